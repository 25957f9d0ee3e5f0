"""Writes grafana/dashboards/tuneloop.json (run it after changing a panel; the JSON is
committed so Grafana's provisioning reads it as is). The seed's three layers, top to bottom:
infrastructure, service, model. Every expression is checked against a real Prometheus in
tests/integration/test_monitoring_prometheus.py."""

from __future__ import annotations

import json
from pathlib import Path

DS = {"type": "prometheus", "uid": "${datasource}"}

ROWS = [
    ("Infrastructure", [
        ("CPU (cores used)", "sum(rate(process_cpu_seconds_total{job=\"tuneloop-bento\"}[5m]))", "short"),
        ("Resident memory", "sum(process_resident_memory_bytes{job=\"tuneloop-bento\"})", "bytes"),
        ("GPU utilisation (DCGM, when present)", "avg(DCGM_FI_DEV_GPU_UTIL)", "percent"),
        ("Replicas up", "sum(up{job=\"tuneloop-bento\"})", "short"),
    ]),
    ("Service", [
        ("Success rate", "1 - tuneloop:error_ratio:5m", "percentunit"),
        ("Latency p50 / p95 (end to end)",
         ["histogram_quantile(0.5, sum by (le) (rate(tuneloop_e2e_request_latency_seconds_bucket[5m])))",
          "tuneloop:e2e_seconds:p95_5m"], "s"),
        ("Queue (waiting / running)", ["sum(tuneloop_num_requests_waiting)", "sum(tuneloop_num_requests_running)"],
         "short"),
        ("Rejections by reason", "sum by (reason) (rate(tuneloop_requests_rejected_total[5m]))", "reqps"),
        ("Rate-limited (by limit)", "sum by (limit) (rate(tuneloop_gateway_rate_limited_total[5m]))", "reqps"),
        ("Content filter flags", "sum by (category, where) (rate(tuneloop_gateway_filter_flagged_total[5m]))",
         "reqps"),
        ("Cache hits / misses", "sum by (result) (rate(tuneloop_gateway_cache_total[5m]))", "reqps"),
        ("Request log records written", "sum by (stream, result) (rate(tuneloop_request_log_records_total[5m]))",
         "reqps"),
    ]),
    ("Model", [
        ("Output tokens/s", "tuneloop:output_tokens:rate_5m", "short"),
        ("TTFT p50 / p95",
         ["histogram_quantile(0.5, sum by (le) (rate(tuneloop_time_to_first_token_seconds_bucket[5m])))",
          "tuneloop:ttft_seconds:p95_5m"], "s"),
        ("TPOT p50", "tuneloop:tpot_seconds:p50_5m", "s"),
        ("Batch size (mean)", "sum(rate(tuneloop_batch_size_sum[5m])) / clamp_min(sum(rate(tuneloop_batch_size_count[5m])), 1e-9)",
         "short"),
        ("Drift scores (latest monitoring run)", "max by (score) (tuneloop_drift_score)", "short"),
        ("Drift detected / SLO breached", ["max(tuneloop_drift_detected)", "max by (objective) (tuneloop_slo_breached)"],
         "short"),
        ("Model version serving", "max by (model) (tuneloop_model_info)", "short"),
    ]),
]


def expressions() -> list[str]:
    out = []
    for _, panels in ROWS:
        for _, expr, _ in panels:
            out += expr if isinstance(expr, list) else [expr]
    return out


def build() -> dict:
    panels, y, pid = [], 0, 1
    for title, row in ROWS:
        panels.append({"type": "row", "title": title, "id": pid, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        pid += 1
        y += 1
        for i, (name, expr, unit) in enumerate(row):
            exprs = expr if isinstance(expr, list) else [expr]
            panels.append({
                "type": "timeseries", "title": name, "id": pid, "datasource": DS,
                "gridPos": {"h": 7, "w": 6, "x": 6 * (i % 4), "y": y + 7 * (i // 4)},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "targets": [{"refId": chr(65 + j), "expr": e, "datasource": DS} for j, e in enumerate(exprs)],
            })
            pid += 1
        y += 7 * ((len(row) + 3) // 4)
    return {
        "uid": "tuneloop", "title": "tuneloop", "tags": ["tuneloop"], "schemaVersion": 39, "version": 1,
        "time": {"from": "now-6h", "to": "now"}, "refresh": "30s", "editable": True,
        "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus",
                                 "label": "Prometheus"}]},
        "panels": panels,
    }


if __name__ == "__main__":
    path = Path(__file__).with_name("dashboards") / "tuneloop.json"
    path.write_text(json.dumps(build(), indent=2) + "\n")
    print(f"wrote {path}")
