"""Blessing: may this candidate replace the champion? (TFX Evaluator semantics)

A blessing is a decision with its evidence: BLESSED or NOT BLESSED, the baseline it was
compared against, one reason per check, and the metric deltas. It is a pure function of
two metric dicts and the configured thresholds, so it is trivially testable and the same
decision can be recomputed from what MLflow recorded.

Semantics, as tensorflow_model_analysis/evaluators/metrics_validator.py implements them
(verified against its source):

- Value threshold: lower_bound <= value <= upper_bound. Both bounds inclusive; an unset
  bound is -inf / +inf.
- Change threshold against the baseline (the champion), with diff = candidate - baseline
  and relative = diff / baseline:
    higher_is_better: diff >= absolute and relative >= relative_threshold
    lower_is_better:  diff <= absolute and relative <= relative_threshold
  Inclusive, and the thresholds are SIGNED: for a loss (lower_is_better), `absolute: -0.05`
  demands a drop of at least 0.05, `absolute: 0.01` tolerates a rise of up to 0.01. For
  exact_match (higher_is_better), `absolute: 0.02` demands a gain of 2 points and
  `absolute: -1e-10` means "not worse" (the idiom from the TFX examples).
- No baseline (first model): change thresholds are skipped, only value thresholds decide;
  with change thresholds alone the first model is blessed (how TFX crowns a first champion).
- A thresholded metric missing from the candidate fails ("Metric not found" in TFMA).
- No thresholds at all: NOT blessed. "No thresholds, no blessing" -- a model is never
  promoted by accident.

Where we deliberately differ from TFMA (which would silently misbehave):
- A relative threshold against a baseline of 0 fails with a reason (relative change is
  undefined); TFMA computes NaN and then also fails an *absolute-only* check, which we
  do not: an unset relative threshold is simply not checked.
- relative uses |baseline| so the sign of the change is preserved for negative metrics
  (identical to TFMA for the non-negative metrics tuneloop computes).
- A metric the candidate has but the baseline lacks fails a change threshold (TFMA would
  raise), and a NaN value fails every check.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from tuneloop.config import ChangeThreshold, MetricThreshold, ValueThreshold


@dataclass
class Blessing:
    blessed: bool
    reasons: list[str]  # one line per check: PASS/FAIL/SKIP, values and threshold
    deltas: dict[str, dict[str, float | None]] = field(default_factory=dict)
    baseline_version: str | None = None
    checks: list[dict[str, Any]] = field(default_factory=list)  # the same, structured

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Blessing":
        return cls(**d)

    def __str__(self) -> str:
        head = "BLESSED" if self.blessed else "NOT BLESSED"
        against = f" against champion v{self.baseline_version}" if self.baseline_version else ""
        return "\n".join([head + against, *("  " + r for r in self.reasons)])


def metric_deltas(candidate: dict[str, float], baseline: dict[str, float]) -> dict[str, dict[str, float | None]]:
    """candidate, baseline, absolute and relative change for every metric both have."""
    out = {}
    for name in sorted(set(candidate) & set(baseline)):
        c, b = float(candidate[name]), float(baseline[name])
        diff = c - b
        rel = None if math.isclose(b, 0.0, abs_tol=1e-12) else diff / abs(b)
        out[name] = {"candidate": c, "baseline": b, "absolute": diff, "relative": rel}
    return out


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4g}"


def _check_value(metric: str, value: float, t: ValueThreshold) -> tuple[bool, str]:
    lo = -math.inf if t.lower_bound is None else t.lower_bound
    hi = math.inf if t.upper_bound is None else t.upper_bound
    ok = lo <= value <= hi  # False for NaN
    bounds = []
    if t.lower_bound is not None:
        bounds.append(f">= {_fmt(t.lower_bound)}")
    if t.upper_bound is not None:
        bounds.append(f"<= {_fmt(t.upper_bound)}")
    want = " and ".join(bounds) or "any value (no bounds set)"
    return ok, f"{metric} = {_fmt(value)}, required {want}"


def _check_change(
    metric: str, delta: dict[str, float | None], t: ChangeThreshold, baseline_version: str | None
) -> tuple[bool, str]:
    higher = t.direction == "higher_is_better"
    op = ">=" if higher else "<="
    diff, rel = delta["absolute"], delta["relative"]
    parts, ok = [], True
    if t.absolute is not None:
        passed = diff >= t.absolute if higher else diff <= t.absolute  # False for NaN
        ok &= passed
        parts.append(f"change {diff:+.4g} {op} {t.absolute:+.4g} required")
    if t.relative is not None:
        if rel is None:
            ok = False
            parts.append("relative change undefined (baseline is 0)")
        else:
            ok &= rel >= t.relative if higher else rel <= t.relative
            parts.append(f"relative change {rel:+.2%} {op} {t.relative:+.2%} required")
    if not parts:
        parts.append("no absolute or relative change set (nothing to check)")
    champion = f"champion v{baseline_version}" if baseline_version else "champion"
    head = f"{metric} {_fmt(delta['baseline'])} ({champion}) -> {_fmt(delta['candidate'])} ({t.direction})"
    return ok, head + ": " + "; ".join(parts)


def bless(
    candidate: dict[str, float],
    baseline: dict[str, float] | None,
    thresholds: list[MetricThreshold],
    baseline_version: str | None = None,
    not_applicable: dict[str, str] | None = None,
) -> Blessing:
    """Decide whether `candidate` may replace the champion whose metrics are `baseline`.

    baseline None means there is no champion yet. Every threshold is checked (no early
    exit) so the reasons list says everything that is wrong at once. not_applicable: metric
    name prefix -> why no metric of that kind exists for this run (every behaviour suite is of
    another task): a threshold on such a missing metric is SKIP with that reason, not FAIL.
    """
    thresholds = [t if isinstance(t, MetricThreshold) else MetricThreshold.model_validate(t) for t in thresholds]
    deltas = metric_deltas(candidate, baseline) if baseline is not None else {}
    checks: list[dict[str, Any]] = []

    def record(metric: str, kind: str, status: str, detail: str) -> None:
        checks.append({"metric": metric, "kind": kind, "status": status, "detail": detail})

    if not thresholds:
        record("*", "config", "FAIL", "no thresholds configured: no thresholds, no blessing (set blessing.thresholds)")

    for t in thresholds:
        m = t.metric
        if t.value_threshold is None and t.change_threshold is None:
            record(m, "config", "FAIL", f"{m}: threshold sets neither value_threshold nor change_threshold")
            continue
        if m not in candidate:
            why = next((r for prefix, r in (not_applicable or {}).items() if m.startswith(prefix)), None)
            if why is not None:
                record(m, "missing", "SKIP", f"{m}: not measured for this run: {why}")
                continue
            have = ", ".join(sorted(candidate)) or "none"
            hint = (
                " -- behaviour_* metrics come from evaluation.behaviour_suite, behaviour_<kind> only when "
                "the suite has cases of that kind"
                if m.startswith("behaviour_")
                else ""
            )
            record(m, "missing", "FAIL", f"{m}: missing from the candidate's metrics (candidate has: {have}){hint}")
            continue
        value = float(candidate[m])
        if t.value_threshold is not None:
            ok, detail = _check_value(m, value, t.value_threshold)
            record(m, "value", "PASS" if ok else "FAIL", detail)
        if t.change_threshold is not None:
            if baseline is None:
                record(m, "change", "SKIP", f"{m}: change threshold skipped, no champion to compare against")
            elif m not in baseline:
                record(m, "change", "FAIL", f"{m}: the champion's metrics lack {m}; cannot check the change")
            else:
                ok, detail = _check_change(m, deltas[m], t.change_threshold, baseline_version)
                record(m, "change", "PASS" if ok else "FAIL", detail)

    blessed = bool(checks) and all(c["status"] != "FAIL" for c in checks)
    reasons = [f"{c['status']} {c['detail']}" for c in checks]
    return Blessing(
        blessed=blessed,
        reasons=reasons,
        deltas=deltas,
        baseline_version=baseline_version if baseline is not None else None,
        checks=checks,
    )
