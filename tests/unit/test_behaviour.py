"""Behavioural suites: parsing with clear errors, scoring, the repo's suites, the real generation path."""

import json
import re

import pytest
import yaml

from tuneloop.behaviour import SuiteError, load_suite, parse_suite, run_suite, score_suite
from tuneloop.blessing import bless
from tuneloop.config import REPO_ROOT, ConfigError, EvaluationConfig, MetricThreshold, load_config
from tuneloop.report import write_report

SUITES = REPO_ROOT / "configs" / "behaviour"


def _write(tmp_path, data, name="suite.yaml"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


# ---- parsing ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "cases,message",
    [
        (
            [{"kind": "mtf", "prompt": "a", "expected": "b"}],
            "cases[0]: unknown kind 'mtf': expected one of mft, inv, dir",
        ),
        ([{"prompt": "a", "expected": "b"}], "cases[0]: no kind"),
        ([{"kind": "mft", "name": "sum", "prompt": "What is 1 + 1?"}], "cases[0] (sum): expected: Field required"),
        ([{"kind": "dir", "base": "a", "perturbed": ["b"]}], "cases[0]: expected: Field required"),
        ([{"kind": "inv", "prompts": ["only one"]}], "cases[0]: prompts: List should have at least 2 items"),
        (
            [{"kind": "mft", "prompt": "a", "messages": [{"role": "user", "content": "a"}], "expected": "b"}],
            "an mft case needs exactly one of prompt or messages",
        ),
        ([{"kind": "mft", "prompt": "a", "expected": "b", "expect": "c"}], "cases[0]: expect: unknown key"),
        ([], "the suite has no cases"),
    ],
)
def test_bad_suites_name_the_file_and_the_case(tmp_path, cases, message):
    path = _write(tmp_path, {"cases": cases})
    with pytest.raises(SuiteError) as exc:
        load_suite(path)
    assert message in str(exc.value) and str(path) in str(exc.value)


@pytest.mark.parametrize(
    "text,message",
    [
        ("", "is empty"),
        ("- a\n- b\n", "top level must be a mapping"),
        ("cases: [", "not valid YAML"),
    ],
)
def test_empty_or_malformed_files(tmp_path, text, message):
    with pytest.raises(SuiteError, match=message):
        load_suite(_write(tmp_path, text))
    with pytest.raises(SuiteError, match="not found"):
        load_suite(tmp_path / "nope.yaml")


def test_prompt_rendering_errors_are_found_at_load_time(tmp_path):
    base = {"templates": {"review": "Review: {review}\nPositive?"}}
    bad = [
        (
            {"kind": "mft", "name": "a", "prompt": {"review": "x"}, "expected": "y"},
            "a prompt of fields ['review'] needs a template",
        ),
        (
            {"kind": "mft", "name": "a", "prompt": {"template": "rev", "review": "x"}, "expected": "y"},
            "unknown template 'rev' (the suite has: review)",
        ),
        (
            {"kind": "mft", "name": "a", "template": "review", "prompt": {"text": "x"}, "expected": "y"},
            "template 'review' needs field 'review'",
        ),
        (
            {"kind": "mft", "name": "a", "messages": [{"role": "assistant", "content": "x"}], "expected": "y"},
            "chat messages must end with a user message",
        ),
    ]
    for case, message in bad:
        with pytest.raises(SuiteError, match=re.escape(f"cases[0] (a): {message}")):
            parse_suite({**base, "cases": [case]}, "s.yaml")
    legacy = {
        "format": "legacy",
        "cases": [{"kind": "mft", "messages": [{"role": "user", "content": "x"}], "expected": "y"}],
    }
    with pytest.raises(SuiteError, match="legacy .* takes text prompts"):
        parse_suite(legacy)
    dupes = {
        "cases": [
            {"kind": "mft", "name": "x", "prompt": "a", "expected": "b"},
            {"kind": "mft", "name": "x", "prompt": "c", "expected": "d"},
        ]
    }
    with pytest.raises(SuiteError, match="unique, repeated: x"):
        parse_suite(dupes)


@pytest.mark.parametrize("name", ["sample.yaml", "amazon-polarity.yaml"])
def test_repo_suites_load_with_all_three_kinds(name):
    suite = load_suite(SUITES / name)
    assert {c.kind for c in suite.cases} == {"mft", "inv", "dir"}
    assert 20 <= len(suite.cases) <= 40
    assert all(c.name and c.task for c in suite.cases)
    # Every inv case names its answer: a model that always answers the same would pass it otherwise.
    assert all(c.expected for c in suite.cases if c.kind == "inv")


def test_repo_configs_name_the_suites():
    for config, suites in (
        ("default.yaml", ["sample.yaml"]),
        ("smollm2.yaml", ["tickets.yaml", "amazon-polarity.yaml"]),
    ):
        cfg = load_config(REPO_ROOT / "configs" / config, environ={})
        assert [cfg.resolve(p) for p in cfg.evaluation.suites] == [SUITES / s for s in suites]
        for path in cfg.evaluation.suites:
            assert load_suite(cfg.resolve(path)).task is not None  # every shipped suite says its task


def test_a_one_word_model_stays_under_the_configured_floors():
    """The suites are balanced enough that answering one word to everything cannot bless."""
    for config in ("default.yaml", "smollm2.yaml"):
        cfg = load_config(REPO_ROOT / "configs" / config, environ={})
        floor = next(
            t.value_threshold.lower_bound for t in cfg.blessing.thresholds if t.metric == "behaviour_pass_rate"
        )
        for path in cfg.evaluation.suites:
            suite = load_suite(cfg.resolve(path))
            words = {
                w for c in suite.cases for w in (getattr(c, "expected", None), getattr(c, "base_expected", None)) if w
            }
            for word in words:
                rate = score_suite(suite, lambda exs, w=word: [w] * len(exs)).metrics["behaviour_pass_rate"]
                assert rate < floor, (config, path, word, rate)


# ---- scoring ----------------------------------------------------------------------------
SUITE = {
    "name": "toy",
    "system": "Be brief.",
    "cases": [
        {"kind": "mft", "name": "sum", "prompt": "2+2", "expected": "4"},
        {"kind": "mft", "name": "sum-wrong", "prompt": "2+3", "expected": "5"},
        {"kind": "inv", "name": "same", "prompts": ["good A", "good B"], "expected": "Positive"},
        {"kind": "inv", "name": "agree", "prompts": ["x", "y"]},  # no expected: only agreement
        {
            "kind": "dir",
            "name": "flip",
            "base": "good A",
            "base_expected": "positive",
            "perturbed": ["good A. broke", "bad A"],
            "expected": "negative",
        },
    ],
}
ANSWERS = {
    "2+2": "4.<|endoftext|>",
    "2+3": "6",
    "good A": " Positive. ",
    "good B": "positive!",
    "x": "maybe",
    "y": "Maybe",
    "good A. broke": "negative",
    "bad A": "positive",
}


def _fake(calls):
    def answer(examples):
        calls.append(examples)
        return [ANSWERS[ex.messages[-2]["content"]] for ex in examples]

    return answer


def test_scoring_per_kind_and_failures():
    calls = []
    result = score_suite(parse_suite(SUITE), _fake(calls))
    assert result.metrics == {
        "behaviour_pass_rate": 3 / 5,
        "behaviour_mft": 1 / 2,
        "behaviour_inv": 1.0,
        "behaviour_dir": 0.0,
        "behaviour_cases": 5.0,
    }
    # One batched call, each distinct prompt once ("good A" is in two cases).
    assert len(calls) == 1 and len(calls[0]) == len(ANSWERS)
    ex = calls[0][0]
    assert [m["role"] for m in ex.messages] == ["system", "user", "assistant"]
    assert ex.messages[0]["content"] == "Be brief."
    failures = {c.name: c for c in result.failures}
    assert set(failures) == {"sum-wrong", "flip"}
    assert failures["sum-wrong"].reason == "prompt 1 answered '6', expected '5'"
    assert failures["flip"].reason == "prompt 3 answered 'positive', expected 'negative'"
    assert [a["ok"] for a in failures["flip"].answers] == [True, True, False]
    assert failures["flip"].answers[2]["prompt"] == "bad A"
    d = result.to_dict()
    assert json.loads(json.dumps(d))["failures"][0]["name"] == "sum-wrong"
    assert "3/5 passed" in result.summary()


def test_invariance_without_expected_fails_when_answers_differ():
    suite = parse_suite({"cases": [{"kind": "inv", "name": "agree", "prompts": ["x", "y"]}]})
    result = score_suite(suite, lambda exs: ["yes", "no"])
    assert result.metrics["behaviour_inv"] == 0.0 and "mft" not in json.dumps(result.metrics)
    assert result.failures[0].reason == "answers differ: 'yes', 'no'"


def test_directional_base_is_checked_when_named():
    suite = parse_suite(
        {
            "cases": [
                {
                    "kind": "dir",
                    "name": "d",
                    "base": "14",
                    "base_expected": "even",
                    "perturbed": ["15"],
                    "expected": "odd",
                }
            ]
        }
    )
    result = score_suite(suite, lambda exs: ["odd", "odd"])
    assert result.failures[0].reason == "base answered 'odd', expected 'even'"


def test_legacy_suites_send_raw_text_and_templates():
    suite = parse_suite(
        {
            "format": "legacy",
            "templates": {"t": "Review: {review}\nPositive?\n"},
            "cases": [{"kind": "mft", "name": "a", "template": "t", "prompt": {"review": "Nice."}, "expected": "Yes"}],
        }
    )
    seen = []
    result = score_suite(suite, lambda exs: seen.extend(exs) or ["Yes<|endoftext|>"])
    assert seen[0].messages is None and seen[0].prompt == "Review: Nice.\nPositive?\n"
    assert result.metrics["behaviour_pass_rate"] == 1.0


def test_an_answer_function_that_drops_answers_is_an_error():
    with pytest.raises(ValueError, match="returned 1 answers for 8 prompts"):
        score_suite(parse_suite(SUITE), lambda exs: ["x"])


# ---- blessing, config, report -----------------------------------------------------------
def test_blessing_on_behaviour_metrics_and_a_missing_one_fails_clearly():
    t = MetricThreshold.model_validate({"metric": "behaviour_pass_rate", "value_threshold": {"lower_bound": 0.7}})
    assert bless({"behaviour_pass_rate": 0.8}, None, [t]).blessed
    assert not bless({"behaviour_pass_rate": 0.5}, None, [t]).blessed
    missing = bless({"exact_match": 0.9}, None, [t])
    assert not missing.blessed
    assert "behaviour_pass_rate: missing from the candidate's metrics" in missing.reasons[0]
    assert "evaluation.behaviour_suite" in missing.reasons[0]


def test_config_refuses_behaviour_thresholds_without_a_suite(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        yaml.safe_dump(
            {"blessing": {"thresholds": [{"metric": "behaviour_pass_rate", "value_threshold": {"lower_bound": 0.5}}]}}
        )
    )
    with pytest.raises(ConfigError, match="behaviour_pass_rate but evaluation.behaviour_suite is not set"):
        load_config(path, environ={})
    cfg = load_config(path, environ={"TUNELOOP__EVALUATION__BEHAVIOUR_SUITE": "configs/behaviour/sample.yaml"})
    assert cfg.evaluation.behaviour_suite is not None


def test_report_lists_the_challengers_failing_cases(tmp_path):
    result = score_suite(parse_suite(SUITE), _fake([])).to_dict()
    table = {"cand-0": {"exact_match": 0.5, **result["metrics"]}, "base": {"exact_match": 0.0}}
    paths = write_report(
        tmp_path / "report", None, table, None, behaviour={"cand-0": result, "base": result}, challenger="cand-0"
    )
    assert json.loads(paths["behaviour"].read_text())["cand-0"]["metrics"]["behaviour_pass_rate"] == 0.6
    md = paths["summary"].read_text()
    assert "## Behavioural tests" in md and "### Failing cases of cand-0: 2 of 5" in md
    assert "- **flip** (dir)\n  - `bad A` → `positive`, expected `negative`\n" in md
    assert "| behaviour_pass_rate | 0.6 | – |" in md


# ---- the real generation path -----------------------------------------------------------
def test_untrained_base_model_fails_the_sample_suite(demo_base_model):
    """Through evaluation's own generation (chat template, greedy, cleaning): the untrained
    tiny base cannot do the tasks, so every minimum-functionality case fails."""
    result = run_suite(demo_base_model, SUITES / "sample.yaml", EvaluationConfig(max_new_tokens=6, batch_size=16))
    m = result.metrics
    assert set(m) == {"behaviour_pass_rate", "behaviour_mft", "behaviour_inv", "behaviour_dir", "behaviour_cases"}
    assert m["behaviour_cases"] == len(result.cases) == len(load_suite(SUITES / "sample.yaml").cases)
    assert m["behaviour_mft"] == 0.0 and m["behaviour_pass_rate"] < 0.2
    mft = [c for c in result.cases if c.kind == "mft"]
    assert all(not c.passed and len(c.answers) == 1 and isinstance(c.answers[0]["answer"], str) for c in mft)
    assert {c.name for c in result.failures} >= {c.name for c in mft}


def test_a_suite_of_another_task_is_skipped_and_one_of_the_same_task_runs(demo_base_model, tmp_path):
    """Suites follow the data: each says its task (task.recognise); a run on a dataset of
    another task skips it with the reason, and blessing skips thresholds on its metrics."""
    from tuneloop.behaviour import run_suites
    from tuneloop.data.formats import load_file

    suites = [SUITES / "tickets.yaml", SUITES / "sample.yaml"]
    cfg = EvaluationConfig(max_new_tokens=4, batch_size=16)
    sample_rows = load_file(REPO_ROOT / "data" / "sample" / "train.jsonl").examples[:200]
    tickets_rows = load_file(REPO_ROOT / "data" / "tickets" / "train.jsonl").examples[:200]

    on_sample = run_suites(demo_base_model, suites, cfg, sample_rows)
    assert [r["suite"] for r in on_sample["ran"]] == ["sample-tasks"]
    assert [s["suite"] for s in on_sample["skipped"]] == ["tickets"]
    assert "0 of 200 eval rows (0%) look like support-ticket routing" in on_sample["skipped"][0]["reason"]
    assert on_sample["metrics"]["behaviour_cases"] == len(load_suite(SUITES / "sample.yaml").cases)

    on_tickets = run_suites(demo_base_model, suites, cfg, tickets_rows)
    assert [r["suite"] for r in on_tickets["ran"]] == ["tickets"]
    assert on_tickets["metrics"]["behaviour_cases"] == len(load_suite(SUITES / "tickets.yaml").cases)

    news = [e for e in sample_rows if "positive or negative" not in (e.prompt_text or "")][:20]
    for e in news:  # rows of neither task
        e.messages = [m for m in e.messages if m["role"] != "system"]
    neither = run_suites(demo_base_model, suites, cfg, news)
    assert not neither["ran"] and len(neither["skipped"]) == 2 and neither["metrics"] == {}
    thresholds = [
        MetricThreshold.model_validate({"metric": "exact_match", "value_threshold": {"lower_bound": 0.0}}),
        MetricThreshold.model_validate({"metric": "behaviour_pass_rate", "value_threshold": {"lower_bound": 0.7}}),
    ]
    why = "; ".join(s["reason"] for s in neither["skipped"])
    blessed = bless({"exact_match": 0.5}, None, thresholds, not_applicable={"behaviour_": why})
    assert blessed.blessed and any(r.startswith("SKIP behaviour_pass_rate: not measured") for r in blessed.reasons)
    assert not bless({"exact_match": 0.5}, None, thresholds).blessed  # without the reason: still a FAIL


def test_a_suite_names_a_valid_way_to_recognise_its_task(tmp_path):
    case = [{"kind": "mft", "prompt": "a", "expected": "b"}]
    with pytest.raises(SuiteError, match="recognise needs prompt_pattern and/or answers"):
        load_suite(_write(tmp_path, {"task": {"name": "x", "recognise": {}}, "cases": case}))
    with pytest.raises(SuiteError, match="prompt_pattern is not a valid regex"):
        load_suite(_write(tmp_path, {"task": {"name": "x", "recognise": {"prompt_pattern": "("}}, "cases": case}))
