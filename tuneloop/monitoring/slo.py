"""Service health of a window of the request log against the SLOs in config."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
FILTER_CODES = ("content_filter", "pii_detected")
# Errors of the service (not of the client): 5xx, a stream that failed midway, a timeout.
SERVER_ERROR_CODES = ("internal_error", "timeout", "server_error", "overloaded", "unavailable")


@dataclass
class SloResult:
    judged: bool
    breached: list[str]
    values: dict[str, float | None]
    objectives: dict[str, float]
    counts: dict[str, int] = field(default_factory=dict)
    reason: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 4) if values else None


def service_health(records: list[dict], cfg) -> SloResult:
    """cfg: tuneloop.config.SloConfig."""
    objectives = {
        "ttft_p95_s": cfg.ttft_p95_s,
        "e2e_p95_s": cfg.e2e_p95_s,
        "error_rate": cfg.error_rate,
        "filter_rejection_rate": cfg.filter_rejection_rate,
        "rate_limited_rate": cfg.rate_limited_rate,
    }
    gens = [r for r in records if r.get("route") in GENERATION_ROUTES]
    ok = [r for r in gens if r.get("status") == 200 and r.get("error_code") is None]
    ttft = [r["ttft_s"] for r in ok if r.get("ttft_s") is not None and r.get("cache") != "hit"]
    e2e = [r["latency_s"] for r in ok if r.get("latency_s") is not None]
    errors = [r for r in gens if (r.get("status") or 0) >= 500 or r.get("error_code") in SERVER_ERROR_CODES]
    filtered = [r for r in gens if r.get("error_code") in FILTER_CODES]
    limited = [r for r in records if r.get("status") == 429]
    values = {
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p95_s": _pct(ttft, 95),
        "e2e_p50_s": _pct(e2e, 50),
        "e2e_p95_s": _pct(e2e, 95),
        "error_rate": round(len(errors) / len(gens), 4) if gens else None,
        "filter_rejection_rate": round(len(filtered) / len(gens), 4) if gens else None,
        "rate_limited_rate": round(len(limited) / len(records), 4) if records else None,
    }
    counts = {
        "requests": len(records),
        "generations": len(gens),
        "ok": len(ok),
        "errors": len(errors),
        "filtered": len(filtered),
        "rate_limited": len(limited),
        "cache_hits": sum(1 for r in gens if r.get("cache") == "hit"),
    }
    if len(records) < cfg.min_requests:
        return SloResult(
            False,
            [],
            values,
            objectives,
            counts,
            f"{len(records)} requests in the window, fewer than monitoring.slo.min_requests ({cfg.min_requests})",
        )
    breached = [k for k, limit in objectives.items() if values.get(k) is not None and values[k] > limit]
    return SloResult(True, breached, values, objectives, counts)
