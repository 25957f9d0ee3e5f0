"""bless(): TFX Evaluator semantics, table-driven."""

import math

import pytest

from tuneloop.blessing import Blessing, bless, metric_deltas
from tuneloop.config import BlessingConfig, MetricThreshold


def T(metric, lower=None, upper=None, direction=None, absolute=None, relative=None):
    d = {"metric": metric}
    if lower is not None or upper is not None:
        d["value_threshold"] = {"lower_bound": lower, "upper_bound": upper}
    if direction:
        d["change_threshold"] = {"direction": direction, "absolute": absolute, "relative": relative}
    return MetricThreshold.model_validate(d)


HI, LO = "higher_is_better", "lower_is_better"

CASES = [
    # id, candidate, baseline, thresholds, blessed
    ("no thresholds, no blessing", {"exact_match": 1.0}, None, [], False),
    ("value lower bound met", {"exact_match": 0.5}, None, [T("exact_match", lower=0.3)], True),
    ("value lower bound inclusive", {"exact_match": 0.3}, None, [T("exact_match", lower=0.3)], True),
    ("value lower bound missed", {"exact_match": 0.29}, None, [T("exact_match", lower=0.3)], False),
    ("value upper bound inclusive", {"eval_loss": 2.0}, None, [T("eval_loss", upper=2.0)], True),
    ("value upper bound missed", {"eval_loss": 2.01}, None, [T("eval_loss", upper=2.0)], False),
    ("value both bounds", {"f1": 0.5}, None, [T("f1", lower=0.4, upper=0.6)], True),
    ("NaN fails a value check", {"eval_loss": math.nan}, None, [T("eval_loss", upper=9.0)], False),
    ("missing metric fails", {"f1": 0.9}, None, [T("exact_match", lower=0.1)], False),
    ("no champion: change skipped", {"exact_match": 0.1}, None, [T("exact_match", direction=HI, absolute=0.5)], True),
    (
        "no champion: value still applies",
        {"exact_match": 0.1},
        None,
        [T("exact_match", lower=0.2, direction=HI, absolute=0.0)],
        False,
    ),
    # Values exactly representable in binary so "equal to the threshold" is really equal.
    (
        "higher: gain equal to absolute passes",
        {"exact_match": 0.75},
        {"exact_match": 0.5},
        [T("exact_match", direction=HI, absolute=0.25)],
        True,
    ),
    (
        "higher: gain below absolute fails",
        {"exact_match": 0.625},
        {"exact_match": 0.5},
        [T("exact_match", direction=HI, absolute=0.25)],
        False,
    ),
    (
        "higher: equal is inclusive",
        {"exact_match": 0.5},
        {"exact_match": 0.5},
        [T("exact_match", direction=HI, absolute=0.0)],
        True,
    ),
    (
        "higher: small loss fails 'not worse'",
        {"exact_match": 0.49},
        {"exact_match": 0.5},
        [T("exact_match", direction=HI, absolute=-1e-10)],
        False,
    ),
    (
        "higher: tolerance allows a small loss",
        {"exact_match": 0.49},
        {"exact_match": 0.5},
        [T("exact_match", direction=HI, absolute=-0.02)],
        True,
    ),
    ("higher: relative met", {"f1": 0.55}, {"f1": 0.5}, [T("f1", direction=HI, relative=0.1)], True),
    ("higher: relative missed", {"f1": 0.54}, {"f1": 0.5}, [T("f1", direction=HI, relative=0.1)], False),
    (
        "higher: absolute ok but relative fails",
        {"f1": 0.54},
        {"f1": 0.5},
        [T("f1", direction=HI, absolute=0.01, relative=0.1)],
        False,
    ),
    (
        "lower: drop required and met",
        {"eval_loss": 1.9},
        {"eval_loss": 2.0},
        [T("eval_loss", direction=LO, absolute=-0.05)],
        True,
    ),
    (
        "lower: drop required, too small",
        {"eval_loss": 1.98},
        {"eval_loss": 2.0},
        [T("eval_loss", direction=LO, absolute=-0.05)],
        False,
    ),
    (
        "lower: rise tolerated",
        {"eval_loss": 2.01},
        {"eval_loss": 2.0},
        [T("eval_loss", direction=LO, absolute=0.02)],
        True,
    ),
    (
        "lower: rise beyond tolerance",
        {"eval_loss": 2.05},
        {"eval_loss": 2.0},
        [T("eval_loss", direction=LO, absolute=0.02)],
        False,
    ),
    (
        "lower: relative drop",
        {"perplexity": 9.0},
        {"perplexity": 10.0},
        [T("perplexity", direction=LO, relative=-0.1)],
        True,
    ),
    (
        "relative vs zero baseline fails",
        {"exact_match": 0.2},
        {"exact_match": 0.0},
        [T("exact_match", direction=HI, relative=0.1)],
        False,
    ),
    (
        "absolute vs zero baseline still works",
        {"exact_match": 0.2},
        {"exact_match": 0.0},
        [T("exact_match", direction=HI, absolute=0.1)],
        True,
    ),
    (
        "champion lacks the metric",
        {"rouge_l": 0.3},
        {"exact_match": 0.0},
        [T("rouge_l", direction=HI, absolute=0.0)],
        False,
    ),
    ("threshold with nothing set", {"f1": 0.3}, None, [MetricThreshold(metric="f1")], False),
    (
        "all must pass",
        {"exact_match": 0.6, "eval_loss": 2.5},
        {"exact_match": 0.5, "eval_loss": 2.0},
        [T("exact_match", direction=HI, absolute=0.0), T("eval_loss", direction=LO, absolute=0.1)],
        False,
    ),
    (
        "all pass",
        {"exact_match": 0.6, "eval_loss": 1.5},
        {"exact_match": 0.5, "eval_loss": 2.0},
        [T("exact_match", lower=0.2, direction=HI, absolute=0.0), T("eval_loss", direction=LO, absolute=0.1)],
        True,
    ),
]


@pytest.mark.parametrize("candidate,baseline,thresholds,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bless_table(candidate, baseline, thresholds, expected):
    result = bless(candidate, baseline, thresholds, baseline_version="3" if baseline else None)
    assert result.blessed is expected, str(result)
    # One reason per check, each says its verdict.
    assert result.reasons and all(r.split()[0] in {"PASS", "FAIL", "SKIP"} for r in result.reasons)
    assert ("FAIL" in " ".join(r.split()[0] for r in result.reasons)) is (not expected)


def test_reasons_name_values_and_baseline():
    result = bless(
        {"exact_match": 0.4, "eval_loss": 2.5},
        {"exact_match": 0.5, "eval_loss": 2.0},
        [
            MetricThreshold.model_validate(
                {
                    "metric": "exact_match",
                    "value_threshold": {"lower_bound": 0.3},
                    "change_threshold": {"direction": HI, "absolute": 0.0},
                }
            )
        ],
        baseline_version="7",
    )
    assert not result.blessed
    assert result.baseline_version == "7"
    text = "\n".join(result.reasons)
    assert "PASS exact_match = 0.4, required >= 0.3" in text
    assert "FAIL exact_match 0.5 (champion v7) -> 0.4" in text and "-0.1" in text
    assert str(result).startswith("NOT BLESSED against champion v7")
    # Deltas cover every shared metric, not only the thresholded ones.
    assert result.deltas["eval_loss"] == {"candidate": 2.5, "baseline": 2.0, "absolute": 0.5, "relative": 0.25}
    assert Blessing.from_dict(result.to_dict()) == result


def test_no_thresholds_reason_and_missing_metric_reason():
    r = bless({"exact_match": 1.0}, None, [])
    assert not r.blessed and "no thresholds" in r.reasons[0]
    r = bless(
        {"f1": 1.0}, None, BlessingConfig(thresholds=[{"metric": "exact_match", "value_threshold": {}}]).thresholds
    )
    assert not r.blessed and "exact_match: missing from the candidate's metrics (candidate has: f1)" in r.reasons[0]


def test_skipped_change_is_reported_and_no_baseline_version():
    r = bless({"exact_match": 0.1}, None, [T("exact_match", direction=HI, absolute=0.0)], baseline_version="2")
    assert r.blessed and r.reasons[0].startswith("SKIP") and r.baseline_version is None and r.deltas == {}


def test_thresholds_accepted_as_plain_dicts():
    r = bless({"exact_match": 0.5}, None, [{"metric": "exact_match", "value_threshold": {"lower_bound": 0.4}}])
    assert r.blessed


def test_metric_deltas_relative_none_on_zero():
    d = metric_deltas({"a": 1.0, "b": 3.0, "c": 1.0}, {"a": 0.0, "b": 2.0})
    assert d["a"]["relative"] is None and d["b"]["relative"] == 0.5 and "c" not in d
