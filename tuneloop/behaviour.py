"""Behavioural tests of a model: what exact match on the eval split does not show.

Made-With-ML's tests/model (after CheckList, Ribeiro et al. 2020) in three kinds:

- mft, minimum functionality: one prompt, one expected answer ("What is 3 + 4?" -> 7).
- inv, invariance: prompts that differ where the answer must not (another product name,
  a neutral sentence, other casing) must all get the same answer -- `expected` when the
  case names it, else merely each other's.
- dir, directional: a perturbation that must move the answer to `expected` (a strongly
  negative sentence added to a positive review makes it negative); the unperturbed
  `base` must give `base_expected` when the case names it.

A suite is a YAML file (evaluation.behaviour_suite; configs/behaviour/):

    format: chat              # chat: a prompt is the user message; legacy: raw text, no template
    system: "You are a concise assistant."   # chat only: prepended to every prompt
    templates:                # optional: named str.format templates
      review: "Title: {title}\\nReview: {review}\\nIs the review positive or negative?\\n"
    cases:
      - {kind: mft, name: add-small, task: addition, prompt: "What is 3 + 4?", expected: "7"}
      - kind: inv
        template: review      # mapping prompts are this template's fields
        expected: Positive
        prompts: [{title: Great, review: "The lamp is lovely."}, {title: Great, review: "The mug is lovely."}]
      - {kind: dir, base: "Is 14 even or odd?", base_expected: even, perturbed: ["Is 15 even or odd?"], expected: odd}

A prompt is a string, a list of chat messages ({role, content}; chat suites only), or a
mapping of template fields (with `template:` in it or on its case). Answers are compared as
exact match compares them (tuneloop/evaluation.normalize_answer, after the generation is
cut at its end marker), and come from the generation pass evaluation uses (batched greedy,
same chat template, same cleaning): a model passes here exactly when it would answer so there.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any, Callable, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from tuneloop.config import ConfigError, EvaluationConfig, load_config
from tuneloop.data.schema import ROLES, Example
from tuneloop.evaluation import STOP_TOKENS, generate_answers, load_for_eval, metric_key, normalize_answer

KINDS = ("mft", "inv", "dir")


class SuiteError(ConfigError):
    """A behaviour suite that cannot be used; the message names the file and the case."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Message(_Strict):
    role: Literal[ROLES]
    content: str


# A string, chat messages, or template fields.
Prompt = Union[str, list[Message], dict[str, str]]


class _Case(_Strict):
    name: str | None = None
    task: str | None = None  # a label for the report ("addition", "sentiment")
    template: str | None = None  # for mapping prompts that do not name one


class MinimumFunctionality(_Case):
    kind: Literal["mft"]
    prompt: Prompt | None = None
    messages: list[Message] | None = None  # the same as a prompt given as messages
    expected: str

    @model_validator(mode="after")
    def _one_prompt(self) -> "MinimumFunctionality":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("an mft case needs exactly one of prompt or messages")
        return self


class Invariance(_Case):
    kind: Literal["inv"]
    prompts: list[Prompt] = Field(min_length=2)
    expected: str | None = None  # None: the answers need only agree with each other


class Directional(_Case):
    kind: Literal["dir"]
    base: Prompt
    base_expected: str | None = None
    perturbed: list[Prompt] = Field(min_length=1)
    expected: str


Case = Annotated[Union[MinimumFunctionality, Invariance, Directional], Field(discriminator="kind")]


class Recognise(_Strict):
    """How a suite tells that an eval split is of its task: a row is the task's when its prompt
    matches `prompt_pattern` (a regex, searched) and, if `answers` is given, its reference is
    one of them (compared as exact match compares); the suite runs when at least `min_share`
    of the rows are."""

    prompt_pattern: str | None = None
    answers: list[str] | None = None
    min_share: float = Field(0.5, gt=0.0, le=1.0)

    @model_validator(mode="after")
    def _something(self) -> "Recognise":
        if self.prompt_pattern is None and not self.answers:
            raise ValueError("recognise needs prompt_pattern and/or answers")
        if self.prompt_pattern is not None:
            try:
                re.compile(self.prompt_pattern)
            except re.error as exc:
                raise ValueError(f"prompt_pattern is not a valid regex: {exc}") from None
        return self


class SuiteTask(_Strict):
    name: str  # "support-ticket routing", "review sentiment"
    recognise: Recognise


class BehaviourSuite(_Strict):
    name: str | None = None
    description: str | None = None
    # The task the suite tests. A run whose eval split is of another task skips the suite, with
    # the reason, instead of failing on cases it was never meant to answer. None: always runs.
    task: SuiteTask | None = None
    format: Literal["chat", "legacy"] = "chat"
    system: str | None = None
    templates: dict[str, str] = {}
    cases: list[Case]

    @model_validator(mode="after")
    def _has_cases(self) -> "BehaviourSuite":
        if not self.cases:
            raise ValueError("the suite has no cases: a suite that tests nothing passes nothing")
        return self


# ---- parsing ---------------------------------------------------------------------------
def case_name(case: _Case, index: int) -> str:
    return case.name or f"{case.kind}-{index + 1}"


def _format_errors(err: ValidationError, where: str, raw: dict[str, Any]) -> str:
    lines = [f"invalid behaviour suite {where}:"]
    cases = raw.get("cases") if isinstance(raw.get("cases"), list) else []
    for e in err.errors():
        loc = list(e["loc"])
        head = ""
        if len(loc) >= 2 and loc[0] == "cases" and isinstance(loc[1], int):
            i = loc[1]
            named = cases[i].get("name") if i < len(cases) and isinstance(cases[i], dict) else None
            head = f"cases[{i}]" + (f" ({named})" if named else "")
            loc = loc[3:] if len(loc) > 2 and loc[2] in KINDS else loc[2:]  # drop the union tag
        key = ".".join(str(p) for p in loc)
        where_in = ": ".join(p for p in (head, key) if p) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif e["type"] == "union_tag_invalid":
            msg = f"unknown kind {e['input'].get('kind')!r}: expected one of {', '.join(KINDS)}"
        elif e["type"] == "union_tag_not_found":
            msg = f"no kind: expected one of {', '.join(KINDS)}"
        lines.append(f"  {where_in}: {msg}")
    return "\n".join(lines)


def parse_suite(data: Any, where: str = "(in memory)") -> BehaviourSuite:
    """Validate a suite given as plain data (what the YAML holds); SuiteError names what is wrong."""
    if data is None:
        raise SuiteError(f"behaviour suite {where} is empty: it needs a list of cases")
    if not isinstance(data, dict):
        raise SuiteError(
            f"behaviour suite {where}: top level must be a mapping with `cases`, got {type(data).__name__}"
        )
    try:
        suite = BehaviourSuite.model_validate(data)
    except ValidationError as err:
        raise SuiteError(_format_errors(err, where, data)) from None
    names = [case_name(c, i) for i, c in enumerate(suite.cases)]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise SuiteError(f"behaviour suite {where}: case names must be unique, repeated: {', '.join(dupes)}")
    for i, case in enumerate(suite.cases):  # every prompt renders now, not halfway through a run
        try:
            _case_inputs(suite, case)
        except ValueError as exc:
            raise SuiteError(f"behaviour suite {where}: cases[{i}] ({names[i]}): {exc}") from None
    return suite


def load_suite(path: Path | str) -> BehaviourSuite:
    path = Path(path)
    if not path.is_file():
        raise SuiteError(f"behaviour suite not found: {path}")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise SuiteError(f"behaviour suite {path}: not valid YAML: {exc}") from None
    suite = parse_suite(data, str(path))
    return suite if suite.name else suite.model_copy(update={"name": path.stem})


# ---- prompts -> model inputs -------------------------------------------------------------
@dataclass(frozen=True)
class _Input:
    key: str  # identical inputs are generated once
    shown: str  # what the report shows
    text: str | None = None
    messages: tuple[tuple[str, str], ...] | None = None


def _render(suite: BehaviourSuite, case: _Case, prompt: Prompt) -> _Input:
    if isinstance(prompt, dict):
        fields = dict(prompt)
        name = fields.pop("template", None) or case.template
        if name is None:
            raise ValueError(f"a prompt of fields {sorted(fields)} needs a template (on the prompt or its case)")
        if name not in suite.templates:
            known = ", ".join(sorted(suite.templates)) or "none"
            raise ValueError(f"unknown template {name!r} (the suite has: {known})")
        try:
            prompt = suite.templates[name].format(**fields)
        except KeyError as exc:
            raise ValueError(f"template {name!r} needs field {exc.args[0]!r}") from None
    if isinstance(prompt, str):
        if suite.format == "legacy":
            return _Input(key=json.dumps(["legacy", prompt]), shown=prompt, text=prompt)
        messages = [("user", prompt)]
    else:
        if suite.format == "legacy":
            raise ValueError("a legacy (raw text) suite takes text prompts, not chat messages")
        messages = [(m.role, m.content) for m in prompt]
        if not messages or messages[-1][0] != "user":
            raise ValueError("chat messages must end with a user message (the model answers it)")
    shown = "\n".join(c if r == "user" else f"{r}: {c}" for r, c in messages)
    if suite.system and messages[0][0] != "system":
        messages = [("system", suite.system), *messages]
    return _Input(key=json.dumps(["chat", messages]), shown=shown, messages=tuple(messages))


def _case_inputs(suite: BehaviourSuite, case: _Case) -> list[_Input]:
    """The case's prompts in order: mft [prompt]; inv its prompts; dir [base, *perturbed]."""
    if isinstance(case, MinimumFunctionality):
        prompts = [case.prompt if case.prompt is not None else case.messages]
    elif isinstance(case, Invariance):
        prompts = case.prompts
    else:
        prompts = [case.base, *case.perturbed]
    return [_render(suite, case, p) for p in prompts]


def _example(inp: _Input) -> Example:
    if inp.text is not None:
        return Example(example_id=inp.key, completion="", prompt=inp.text)
    # prompt_ids generates after messages[:-1]: the last one stands for the answer.
    messages = [{"role": r, "content": c} for r, c in inp.messages] + [{"role": "assistant", "content": ""}]
    return Example(example_id=inp.key, completion="", messages=messages)


# ---- scoring ---------------------------------------------------------------------------
def normalise(text: str) -> str:
    """An answer as exact match compares it, end-of-text markers dropped ("Positive.<|endoftext|>" == "positive")."""
    for marker in STOP_TOKENS:
        text = text.split(marker, 1)[0]
    return normalize_answer(text)


@dataclass
class CaseResult:
    name: str
    kind: str
    task: str | None
    passed: bool
    reason: str  # why it failed ("" when it passed)
    expected: str | None
    answers: list[dict[str, Any]]  # {prompt, answer, expected, ok} in the case's order


@dataclass
class BehaviourResult:
    suite: str
    metrics: dict[str, float]
    cases: list[CaseResult] = field(default_factory=list)

    @property
    def failures(self) -> list[CaseResult]:
        return [c for c in self.cases if not c.passed]

    def summary(self) -> str:
        rates = ", ".join(f"{k}={v:.3g}" for k, v in self.metrics.items() if k != "behaviour_cases")
        passed = len(self.cases) - len(self.failures)
        return f"behaviour suite {self.suite}: {passed}/{len(self.cases)} passed ({rates})"

    def to_dict(self) -> dict[str, Any]:
        by_task: dict[str, list[bool]] = defaultdict(list)
        for c in self.cases:
            by_task[c.task or "(none)"].append(c.passed)
        return {
            "suite": self.suite,
            "metrics": self.metrics,
            "by_task": {t: {"passed": sum(v), "cases": len(v)} for t, v in sorted(by_task.items())},
            "failures": [asdict(c) for c in self.failures],
            "cases": [asdict(c) for c in self.cases],
        }


def _judge(case: _Case, answers: list[str]) -> tuple[bool, str, list[dict[str, Any]], str | None]:
    """passed, reason, the per-prompt rows, the case's expected answer."""
    got = [normalise(a) for a in answers]
    if isinstance(case, MinimumFunctionality):
        wants = [case.expected]
    elif isinstance(case, Invariance):
        wants = [case.expected] * len(answers)
    else:
        wants = [case.base_expected] + [case.expected] * (len(answers) - 1)
    oks = [w is None or g == normalise(w) for g, w in zip(got, wants)]
    rows = [{"answer": a, "expected": w, "ok": ok} for a, w, ok in zip(answers, wants, oks)]
    reason = ""
    if isinstance(case, Invariance) and case.expected is None:
        passed = len(set(got)) == 1
        if not passed:
            reason = "answers differ: " + ", ".join(repr(a) for a in answers)
    else:
        passed = all(oks)
        if not passed:
            wrong = [
                f"prompt {i + 1} answered {r['answer']!r}, expected {r['expected']!r}"
                for i, r in enumerate(rows)
                if not r["ok"]
            ]
            if isinstance(case, Directional) and not oks[0]:
                wrong[0] = wrong[0].replace("prompt 1", "base", 1)
            reason = "; ".join(wrong)
    return passed, reason, rows, getattr(case, "expected", None)


def score_suite(suite: BehaviourSuite, answer: Callable[[list[Example]], list[str]]) -> BehaviourResult:
    """Run every case of `suite` through `answer` (examples in, answers out, in order; called
    once with every distinct prompt of the suite) and score it.

    metrics: behaviour_pass_rate (cases passed / cases), behaviour_<kind> for each kind the
    suite has, behaviour_cases (how many).
    """
    inputs = [_case_inputs(suite, c) for c in suite.cases]
    unique: dict[str, _Input] = {}
    for inp in (i for case in inputs for i in case):
        unique.setdefault(inp.key, inp)
    generated = answer([_example(i) for i in unique.values()])
    if len(generated) != len(unique):
        raise ValueError(f"the answer function returned {len(generated)} answers for {len(unique)} prompts")
    by_key = dict(zip(unique, generated))

    results = []
    for i, (case, case_inputs) in enumerate(zip(suite.cases, inputs)):
        answers = [by_key[inp.key] for inp in case_inputs]
        passed, reason, rows, expected = _judge(case, answers)
        for row, inp in zip(rows, case_inputs):
            row["prompt"] = inp.shown
        results.append(
            CaseResult(
                name=case_name(case, i),
                kind=case.kind,
                task=case.task,
                passed=passed,
                reason=reason,
                expected=expected,
                answers=[{k: r[k] for k in ("prompt", "answer", "expected", "ok")} for r in rows],
            )
        )
    return BehaviourResult(suite=suite.name or "(unnamed)", metrics=case_metrics(results), cases=results)


def case_metrics(results: list[CaseResult]) -> dict[str, float]:
    """behaviour_pass_rate, behaviour_<kind> for each kind present, behaviour_cases."""
    metrics = {"behaviour_pass_rate": sum(r.passed for r in results) / len(results)}
    for kind in KINDS:
        of_kind = [r.passed for r in results if r.kind == kind]
        if of_kind:  # absent, not NaN: a threshold on a kind the suite lacks fails as "missing"
            metrics[f"behaviour_{kind}"] = sum(of_kind) / len(of_kind)
    metrics["behaviour_cases"] = float(len(results))
    return metrics


def applies(suite: BehaviourSuite, examples: list[Example]) -> tuple[bool, str]:
    """(does the suite's task match this eval split, why): see Recognise."""
    if suite.task is None:
        return True, "the suite declares no task: it runs on every dataset"
    if not examples:
        return False, "the eval split is empty"
    rec = suite.task.recognise
    pattern = re.compile(rec.prompt_pattern) if rec.prompt_pattern else None
    answers = {normalise(a) for a in rec.answers or []}
    hits = sum(
        1
        for ex in examples
        if (pattern is None or pattern.search(ex.prompt_text or ""))
        and (not answers or normalise(ex.completion) in answers)
    )
    share = hits / len(examples)
    what = " and ".join(
        filter(
            None,
            [
                f"prompts match {rec.prompt_pattern!r}" if pattern else "",
                f"answers are among its {len(answers)}" if answers else "",
            ],
        )
    )
    verdict = (
        f"{hits} of {len(examples)} eval rows ({share:.0%}) look like {suite.task.name} ({what}; "
        f"{rec.min_share:.0%} needed)"
    )
    return share >= rec.min_share, verdict


def run_suites(
    model_ref: str | Path, suites: list[BehaviourSuite | Path | str], cfg: EvaluationConfig, examples: list[Example]
) -> dict[str, Any]:
    """Every suite whose task the eval split `examples` is of, on one model, as one result dict
    (BehaviourResult.to_dict() shape: the cases of all suites that ran, their metrics pooled,
    behaviour_pass_rate/suite:<name> per suite) plus "skipped": [{suite, reason}] and "ran":
    [{suite, reason}]. No suite ran: no behaviour_* metrics (blessing skips their thresholds)."""
    loaded = [s if isinstance(s, BehaviourSuite) else load_suite(s) for s in suites]
    chosen, skipped, ran = [], [], []
    for suite in loaded:
        ok, why = applies(suite, examples)
        (ran if ok else skipped).append({"suite": suite.name or "(unnamed)", "reason": why})
        if ok:
            chosen.append(suite)
    out: dict[str, Any] = {
        "suite": ", ".join(r["suite"] for r in ran) or "(none ran)",
        "metrics": {},
        "by_task": {},
        "failures": [],
        "cases": [],
        "skipped": skipped,
        "ran": ran,
    }
    if not chosen:
        return out
    model, tokenizer = load_for_eval(model_ref)
    results = [score_suite(s, lambda exs: generate_answers(model, tokenizer, exs, cfg)) for s in chosen]
    cases = [c for r in results for c in r.cases]
    pooled = BehaviourResult(suite=out["suite"], metrics=case_metrics(cases), cases=cases)
    if len(results) > 1:
        for r in results:
            pooled.metrics[f"behaviour_pass_rate/suite:{metric_key(r.suite)}"] = r.metrics["behaviour_pass_rate"]
    return {**pooled.to_dict(), "skipped": skipped, "ran": ran}


def run_suite(model_ref: str | Path, suite: BehaviourSuite | Path | str, cfg: EvaluationConfig) -> BehaviourResult:
    """Score the model at `model_ref` on `suite` (a BehaviourSuite or its YAML file), answering
    through evaluation's generation pass with cfg's batch_size and max_new_tokens."""
    if not isinstance(suite, BehaviourSuite):
        suite = load_suite(suite)
    model, tokenizer = load_for_eval(model_ref)
    return score_suite(suite, lambda examples: generate_answers(model, tokenizer, examples, cfg))


def main(argv: list[str] | None = None) -> int:
    """python -m tuneloop.behaviour MODEL [--suite F] [--config F] [--json]: score one saved model."""
    parser = argparse.ArgumentParser(description="Run a behaviour suite on one model (a saved folder or hub id).")
    parser.add_argument("model")
    parser.add_argument("--config", help="config file (default configs/default.yaml): its evaluation section")
    parser.add_argument("--suite", help="suite file (default: the config's evaluation.behaviour_suite)")
    parser.add_argument("--json", action="store_true", help="print every case as JSON")
    args = parser.parse_args(argv)
    cfg = load_config(args.config)
    suite = args.suite or (cfg.resolve(cfg.evaluation.behaviour_suite) if cfg.evaluation.behaviour_suite else None)
    if suite is None:
        parser.error("no suite: pass --suite or set evaluation.behaviour_suite")
    result = run_suite(args.model, suite, cfg.evaluation)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2, ensure_ascii=False))
    else:
        print(result.summary())
        for case in result.failures:
            print(f"  FAIL {case.name} ({case.kind}): {case.reason}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
