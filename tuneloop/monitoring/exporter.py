"""The latest monitoring run's scores as Prometheus gauges on the bento's /metrics (the
monitoring flow writes <home>/monitoring/latest.json; each replica re-reads it every
refresh_s, so Prometheus, the alert rules and Grafana see drift next to latency).

| tuneloop_drift_score      | score (text_length, word_count, sentence_count, non_letter_pct, embeddings) |
| tuneloop_drift_detected   | 1 when the latest window drifted                                          |
| tuneloop_slo_value        | measure (ttft_p95_s, e2e_p95_s, error_rate, ...)                          |
| tuneloop_slo_breached     | objective: 1 when breached in the latest window                           |
| tuneloop_monitoring_age_seconds | seconds since that run (a stale monitor is an alert too)            |
"""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path

LATEST = "latest.json"  # in <home>/monitoring: the latest run's scores (monitoring/run.py writes it)
OBJECTIVES = ("ttft_p95_s", "e2e_p95_s", "error_rate", "filter_rejection_rate", "rate_limited_rate")


class MonitoringGauges:
    def __init__(self, path: Path, registry=None):
        import prometheus_client as prom

        kw = {} if registry is None else {"registry": registry}
        self.path = Path(path)
        self.score = prom.Gauge(
            "tuneloop_drift_score", "Latest drift score per view", ["score"], multiprocess_mode="livemax", **kw
        )
        self.detected = prom.Gauge(
            "tuneloop_drift_detected", "1 when the latest monitored window drifted", multiprocess_mode="livemax", **kw
        )
        self.slo = prom.Gauge(
            "tuneloop_slo_value", "Latest monitored service measure", ["measure"], multiprocess_mode="livemax", **kw
        )
        self.breached = prom.Gauge(
            "tuneloop_slo_breached",
            "1 when the objective was breached in the latest window",
            ["objective"],
            multiprocess_mode="livemax",
            **kw,
        )
        self.age = prom.Gauge(
            "tuneloop_monitoring_age_seconds",
            "Seconds since the latest monitoring run",
            multiprocess_mode="livemin",
            **kw,
        )

    def refresh(self) -> bool:
        try:
            latest = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return False
        for k, v in (latest.get("scores") or {}).items():
            self.score.labels(score=k).set(float(v))
        self.detected.set(1.0 if latest.get("drift_detected") else 0.0)
        for k, v in (latest.get("slo") or {}).items():
            if v is not None:
                self.slo.labels(measure=k).set(float(v))
        breached = set(latest.get("slo_breached") or [])
        for k in OBJECTIVES:
            self.breached.labels(objective=k).set(1.0 if k in breached else 0.0)
        try:
            self.age.set(max(0.0, time.time() - datetime.fromisoformat(latest["time"]).timestamp()))
        except (KeyError, ValueError):
            pass
        return True
