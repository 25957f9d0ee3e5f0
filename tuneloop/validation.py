"""Validation gate: is this dataset fit to train on? (Great Expectations 1.x)

One pandas DataFrame, one row per example (train and eval together, told apart by
`split`), one ExpectationSuite, run through a ValidationDefinition and a Checkpoint on an
ephemeral GX context. Every expectation reports the ids of the examples that fail it
(result_format COMPLETE + unexpected_index_column_names=["example_id"]), and the Data
Docs site is written to a folder we choose, not GX's temp dir.

Where GX has no native check (duplicates of an earlier row, train->eval leakage, secrets,
PII, rare labels) the check is precomputed here into a column that is null when the row
is fine and says what is wrong otherwise ("duplicate of train.jsonl:3", "openai_api_key",
"card_number"), and GX expects that column to be null. Two reasons besides the missing
native checks: the Data Docs and the report then show *what* was found, and they never
copy a planted secret or a card number into HTML pages or MLflow artifacts (a regex
expectation on the completion column would list the completion itself as the
unexpected value).

Rows a dataset policy touched (validation.overlong, validation.pii: dropped, truncated or
redacted by prepare_dataset, see tuneloop/data/policies.py) come in as `handled`: a
truncated or redacted row is marked on its kept row, a dropped one is a row of its own
(split "dropped") that only the policies' checks look at, so that "few over-long rows"
counts them against every row read and fails only above max_overlong_fraction.

Preference pairs (OpenAI's DPO format) are checked as their prompt and preferred answer, with
the rejected answer's secrets and personal data found too and their token length the longer
of the two conversations (formatting.count_tokens).

Thresholds come from ValidationConfig. Checks that cannot run (no tokenizer given, no
eval split, completions that are free text rather than class labels) are skipped and the
report says why.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from tuneloop import formatting
from tuneloop.bootstrap import ensure_base_model
from tuneloop.config import ValidationConfig
from tuneloop.data.policies import TokenBudget
from tuneloop.data.schema import Example, Reject
from tuneloop.gate_report import write_gate_report

# What counts as a secret or personal data is tuneloop/privacy's (one owner for the gate,
# the gateway and the request log).
from tuneloop.privacy.personal import find_pii
from tuneloop.privacy.secrets import find_secrets
from tuneloop.validation_report import MAX_LISTED_IDS, ExpectationOutcome, ValidationReport

SITE_NAME = "tuneloop"
SUITE_NAME = "tuneloop-dataset"


# ---------------------------------------------------------------------------------------
# The DataFrame


def example_text(ex: Example) -> str:
    """The whole example as one flat text (prompt side, then completion), no chat template:
    what a word count stands in for a tokenizer on (the gate itself counts formatted examples)."""
    prompt = ex.prompt_text
    return f"{prompt}\n{ex.completion}" if prompt else ex.completion


def _blank_to_none(text: str | None) -> str | None:
    return text if text and text.strip() else None


def _label_stats(train: list[Example], cfg: ValidationConfig) -> tuple[Counter[str] | None, str]:
    """Counter of labels when train completions look like class labels, else (None, why)."""
    labels = [c.strip() for c in (ex.completion for ex in train) if c and c.strip()]
    counts = Counter(labels)
    if not labels:
        return None, "no non-empty completions"
    if len(counts) > cfg.label_max_classes:
        return (
            None,
            f"completions are free text ({len(counts)} distinct values > label_max_classes={cfg.label_max_classes})",
        )
    longest = max(counts, key=len)
    if len(longest) > cfg.label_max_chars:
        return (
            None,
            f"completions are free text (a completion has {len(longest)} chars > label_max_chars={cfg.label_max_chars})",
        )
    if len(counts) == len(labels):
        # Every completion unique: nothing repeats, so these are answers, not classes.
        return None, "completions are free text (no completion repeats)"
    return counts, ""


# The columns that say what a dataset policy did to a row, by policy (Reject.policy).
POLICY_COLUMNS = {"overlong": "overlong", "pii": "pii_handled"}


def build_frame(
    train: list[Example],
    eval: list[Example],
    count_tokens: Callable[[Example], int] | None,
    labels: Counter[str] | None = None,
    handled: Sequence[Reject] = (),
    leakage_similarity: float | None = None,
):
    """One row per example with the columns the expectations check, then one per row a
    policy dropped (split "dropped"; only the policy columns set)."""
    import pandas as pd

    done: dict[str, dict[str, str]] = {}  # example id -> policy column -> "dropped: why"
    dropped: list[str] = []  # ids of the rows that are in no split, in order
    for r in handled:
        if r.policy not in POLICY_COLUMNS:
            continue
        if r.example_id not in done:
            done[r.example_id] = {}
            if r.action == "dropped":
                dropped.append(r.example_id)
        elif r.action == "dropped" and r.example_id not in dropped:
            dropped.append(r.example_id)  # redacted first, then dropped as over-long
        done[r.example_id][POLICY_COLUMNS[r.policy]] = f"{r.action}: {r.reason}"
    rows = []
    first_seen: dict[str, str] = {}  # content hash -> id of its first occurrence
    train_prompts: dict[str, str] = {}  # prompt hash -> id of a train example with it
    for ex in train:
        train_prompts.setdefault(ex.prompt_hash, ex.example_id)
    near: dict[str, str] = {}  # eval example id -> "near-duplicate of train X (0.93)"
    if leakage_similarity is not None and train and eval:
        from tuneloop.data.neardup import leaked_pairs  # deferred: datasketch (0.6 s), only with leakage_similarity

        for i, j, sim in leaked_pairs(
            [e.prompt_text for e in train], [e.prompt_text for e in eval], leakage_similarity
        ):
            near[eval[i].example_id] = f"prompt near-duplicate of train {train[j].example_id} ({sim:.2f})"
    for split, examples in (("train", train), ("eval", eval)):
        for ex in examples:
            prompt = _blank_to_none(ex.prompt_text)
            completion = _blank_to_none(ex.completion)
            content_hash, prompt_hash = ex.content_hash, ex.prompt_hash
            duplicate_of = first_seen.get(content_hash)
            first_seen.setdefault(content_hash, ex.example_id)
            leaked = train_prompts.get(prompt_hash) if split == "eval" and prompt else None
            secrets = find_secrets(ex.completion) if completion else []
            pii = find_pii(ex.completion) if completion else []
            if ex.rejected is not None:  # a preference pair: its rejected answer is trained on too
                secrets += [f"{k} (rejected answer)" for k in find_secrets(ex.rejected_text)]
                pii += [f"{k} (rejected answer)" for k in find_pii(ex.rejected_text)]
            row = {
                "split": split,
                "example_id": ex.example_id,
                "prompt_text": prompt,
                "completion": completion,
                # None for blank text: the not-blank check reports it once, not twice.
                "prompt_chars": len(ex.prompt_text) if prompt else None,
                "completion_chars": len(ex.completion) if completion else None,
                "content_hash": content_hash,
                "prompt_hash": prompt_hash,
                "duplicate_of": f"duplicate of {duplicate_of}" if duplicate_of else None,
                "eval_prompt_in_train": (
                    f"prompt also in train {leaked}" if leaked else near.get(ex.example_id) if split == "eval" else None
                ),
                "secrets_found": ", ".join(secrets) or None,
                "pii_found": ", ".join(pii) or None,
            }
            for column in POLICY_COLUMNS.values():
                row[column] = done.get(ex.example_id, {}).get(column)
            if count_tokens is not None:
                row["example_tokens"] = int(count_tokens(ex))
            if labels is not None:
                row["label"] = completion.strip() if split == "train" and completion else None
            rows.append(row)
    for ex_id in dropped:
        rows.append(
            {
                "split": "dropped",
                "example_id": ex_id,
                **{column: done[ex_id].get(column) for column in POLICY_COLUMNS.values()},
            }
        )
    # object dtype keeps ints as ints and None as None (float NaN would print "12.0").
    return pd.DataFrame(rows, dtype=object)


# ---------------------------------------------------------------------------------------
# The suite


@dataclass
class _Check:
    name: str
    column: str
    threshold: str
    expectation: Any  # a GX expectation instance


def _fraction(x: float) -> str:
    return "none" if x == 0 else f"up to {x:.1%}"


def _build_checks(
    cfg: ValidationConfig, frame, labels: Counter[str] | None, n_eval: int, max_tokens: int | None = None
) -> list[_Check]:
    import great_expectations.expectations as gxe
    from great_expectations.expectations.row_conditions import Column

    checks: list[_Check] = []
    # Rows a policy dropped are there for the policies' checks only: the others check what
    # will be trained on.
    has_dropped = bool((frame["split"] == "dropped").any())

    def add(name: str, column: str, threshold: str, cls, every_row: bool = False, **kwargs) -> None:
        if has_dropped and not every_row and "row_condition" not in kwargs:
            kwargs["row_condition"] = Column("split") != "dropped"
        exp = cls(column=column, description=f"{name} ({threshold})", meta={"tuneloop_name": name}, **kwargs)
        checks.append(_Check(name, column, threshold, exp))

    if cfg.min_prompt_chars > 0:
        add("prompt is not empty", "prompt_text", "no blank prompts", gxe.ExpectColumnValuesToNotBeNull)
    add("completion is not empty", "completion", "no blank completions", gxe.ExpectColumnValuesToNotBeNull)
    add(
        "prompt length in characters",
        "prompt_chars",
        f"{cfg.min_prompt_chars}..{cfg.max_prompt_chars} chars",
        gxe.ExpectColumnValuesToBeBetween,
        min_value=cfg.min_prompt_chars,
        max_value=cfg.max_prompt_chars,
    )
    add(
        "completion length in characters",
        "completion_chars",
        f"{cfg.min_completion_chars}..{cfg.max_completion_chars} chars",
        gxe.ExpectColumnValuesToBeBetween,
        min_value=cfg.min_completion_chars,
        max_value=cfg.max_completion_chars,
    )
    if "example_tokens" in frame.columns:
        add(
            "example length in tokens",
            "example_tokens",
            f"{cfg.min_tokens}..{max_tokens} tokens" if max_tokens else f">= {cfg.min_tokens} tokens (no limit given)",
            gxe.ExpectColumnValuesToBeBetween,
            min_value=cfg.min_tokens,
            max_value=max_tokens,
        )
    if cfg.overlong != "fail" and ("example_tokens" in frame.columns or frame["overlong"].notna().any()):
        # Over all rows read, dropped ones included: the share the length policy had to act on.
        add(
            "few over-long rows",
            "overlong",
            f"over-long rows ({'dropped' if cfg.overlong == 'drop' else 'truncated or dropped'}): "
            f"{_fraction(cfg.max_overlong_fraction)}",
            gxe.ExpectColumnValuesToBeNull,
            every_row=True,
            mostly=1.0 - cfg.max_overlong_fraction,
        )
    # Duplicates: the first occurrence is fine, each later copy counts (the config's
    # "duplicate of an earlier row"); ExpectColumnValuesToBeUnique would flag both.
    add(
        "no duplicate examples",
        "duplicate_of",
        f"duplicates: {_fraction(cfg.max_duplicate_fraction)}",
        gxe.ExpectColumnValuesToBeNull,
        mostly=1.0 - cfg.max_duplicate_fraction,
    )
    if n_eval:
        # Only eval rows are checked, so `mostly` is a fraction of the eval split.
        add(
            "eval prompts not seen in train",
            "eval_prompt_in_train",
            "leaked eval rows (identical prompt"
            + (f", or a near-duplicate at similarity >= {cfg.leakage_similarity:g}" if cfg.leakage_similarity else "")
            + f"): {_fraction(cfg.max_leakage_fraction)}",
            gxe.ExpectColumnValuesToBeNull,
            mostly=1.0 - cfg.max_leakage_fraction,
            row_condition=Column("split") == "eval",
        )
    if cfg.check_secrets:
        add(
            "completion has no secrets",
            "secrets_found",
            "API keys, tokens, private keys: none",
            gxe.ExpectColumnValuesToBeNull,
        )
    if cfg.check_pii:
        add(
            "completion has no personal data",
            "pii_found",
            "emails, card numbers, phones, IBANs: none",
            gxe.ExpectColumnValuesToBeNull,
        )
    if cfg.pii != "fail" and (cfg.check_pii or cfg.check_secrets):
        add(
            "few rows with personal data or secrets",
            "pii_handled",
            f"rows {'dropped' if cfg.pii == 'drop' else 'redacted or dropped'} for personal data or secrets: "
            f"{_fraction(cfg.max_pii_fraction)}",
            gxe.ExpectColumnValuesToBeNull,
            every_row=True,
            mostly=1.0 - cfg.max_pii_fraction,
        )
    if labels is not None:
        total = sum(labels.values())
        common = sorted(lab for lab, n in labels.items() if n / total >= cfg.min_label_share)
        shares = ", ".join(f"{lab} {n / total:.1%}" for lab, n in labels.most_common())
        add(
            "labels are balanced",
            "label",
            f"each label >= {cfg.min_label_share:.1%} of train; {shares}",
            gxe.ExpectColumnValuesToBeInSet,
            value_set=common,
            row_condition=Column("split") == "train",
        )
    return checks


def _outcome(check: _Check, result) -> ExpectationOutcome:
    r = result.result or {}
    info = result.exception_info or {}
    error = info.get("exception_message") if info.get("raised_exception") else None
    index = r.get("unexpected_index_list") or []
    listed = index[:MAX_LISTED_IDS]
    return ExpectationOutcome(
        name=check.name,
        column=check.column,
        success=bool(result.success),
        unexpected_count=int(r.get("unexpected_count") or 0),
        checked_count=int(r.get("element_count") or 0) - int(r.get("missing_count") or 0),
        failing_example_ids=[str(row["example_id"]) for row in listed],
        failing_values=[row.get(check.column) for row in listed],
        threshold=check.threshold,
        expectation_type=result.expectation_config.type,
        error=error,
    )


# ---------------------------------------------------------------------------------------


def validate_dataset(
    train: list[Example],
    eval: list[Example],
    cfg: ValidationConfig,
    count_tokens: Callable[[Example], int] | None,
    data_docs_dir: Path,
    *,
    max_tokens: int | None = None,
    handled: Sequence[Reject] = (),
) -> ValidationReport:
    """Run the validation suite on train + eval; write Data Docs under data_docs_dir.

    count_tokens: an example's tokens as training encodes it (formatting.count_tokens with
    the base model's tokenizer), or None to skip the token-length check (the report says so).
    max_tokens: the token limit (default cfg.max_tokens; validate_prepared resolves None to
    training's length). handled: the rows the dataset's policies dropped or changed
    (PreparedDataset.rejects and .changed). Nothing is raised for bad data: the report's
    `success` is the gate. ValueError only for an empty training set (nothing to check).
    """
    if not train:
        raise ValueError("validate_dataset: the training split is empty, nothing to validate")
    started = time.perf_counter()

    import great_expectations as gx
    from great_expectations.checkpoint import UpdateDataDocsAction
    from great_expectations.data_context.types.base import ProgressBarsConfig

    skipped: dict[str, str] = {}
    if count_tokens is None:
        skipped["example length in tokens"] = "no tokenizer given (count_tokens=None)"
    if cfg.overlong == "fail":
        skipped["few over-long rows"] = "validation.overlong is fail: any row over the limit fails the token check"
    elif count_tokens is None and not any(r.policy == "overlong" for r in handled):
        skipped["few over-long rows"] = "no tokenizer given (count_tokens=None)"
    if cfg.pii == "fail":
        skipped["few rows with personal data or secrets"] = "validation.pii is fail: any such row fails its check"
    if not eval:
        skipped["eval prompts not seen in train"] = "no eval examples"
    if not cfg.check_secrets:
        skipped["completion has no secrets"] = "check_secrets is off"
    if not cfg.check_pii:
        skipped["completion has no personal data"] = "check_pii is off"
    if cfg.min_prompt_chars == 0:
        skipped["prompt is not empty"] = "min_prompt_chars is 0 (empty prompts allowed)"
    labels, why_not_labels = _label_stats(train, cfg)
    if labels is None:
        skipped["labels are balanced"] = why_not_labels

    frame = build_frame(train, eval, count_tokens, labels, handled, cfg.leakage_similarity)
    checks = _build_checks(cfg, frame, labels, len(eval), max_tokens if max_tokens is not None else cfg.max_tokens)

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)  # no tqdm spam per run
    # The ephemeral context's default site writes to a fresh temp dir; use the known folder.
    data_docs_dir = Path(data_docs_dir).resolve()
    data_docs_dir.mkdir(parents=True, exist_ok=True)
    for site in list(context.list_data_docs_sites()):
        context.delete_data_docs_site(site)
    context.add_data_docs_site(
        SITE_NAME,
        {
            "class_name": "SiteBuilder",
            "store_backend": {"class_name": "TupleFilesystemStoreBackend", "base_directory": str(data_docs_dir)},
            "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
        },
    )

    batch_definition = (
        context.data_sources.add_pandas("tuneloop")
        .add_dataframe_asset("examples")
        .add_batch_definition_whole_dataframe("all examples")
    )
    suite = context.suites.add(gx.ExpectationSuite(name=SUITE_NAME))
    for check in checks:
        suite.add_expectation(check.expectation)
    definition = context.validation_definitions.add(
        gx.ValidationDefinition(name="dataset", data=batch_definition, suite=suite)
    )
    checkpoint = context.checkpoints.add(
        gx.Checkpoint(
            name="validation-gate",
            validation_definitions=[definition],
            actions=[UpdateDataDocsAction(name="data_docs", site_names=[SITE_NAME])],
            result_format={"result_format": "COMPLETE", "unexpected_index_column_names": ["example_id"]},
        )
    )
    result = checkpoint.run(batch_parameters={"dataframe": frame})

    # Match results to our checks by the name we stored in meta (GX keeps suite order,
    # but the name is the contract).
    by_name = {c.name: c for c in checks}
    outcomes = []
    for suite_result in result.run_results.values():
        for r in suite_result.results:
            outcomes.append(_outcome(by_name[r.expectation_config.meta["tuneloop_name"]], r))
    order = {c.name: i for i, c in enumerate(checks)}
    outcomes.sort(key=lambda o: order[o.name])

    index = data_docs_dir / "index.html"
    report = ValidationReport(
        success=all(o.success for o in outcomes),
        expectations=outcomes,
        skipped=skipped,
        data_docs_path=index if index.exists() else None,
        n_train=len(train),
        n_eval=len(eval),
        seconds=time.perf_counter() - started,
    )
    # GX's pages need CDNs to render; this one is self-contained (tuneloop/gate_report.py).
    report.report_path = write_gate_report(report, data_docs_dir)
    return report


def token_limit(cfg, context_window: int | None) -> tuple[int, str]:
    """(the longest example allowed, in tokens; where that number comes from).

    validation.max_tokens when set, else what training keeps: training.max_length, or the base
    model's context window when that is shorter."""
    if cfg.validation.max_tokens is not None:
        return cfg.validation.max_tokens, "validation.max_tokens"
    length = cfg.training.max_length
    if context_window is not None and context_window < length:
        return context_window, f"the base model's context window ({context_window} < training.max_length {length})"
    return length, "training.max_length" + (f" (context window {context_window})" if context_window else "")


def token_budget(cfg) -> TokenBudget:
    """Examples measured as training encodes them, in the base model's tokenizer, and the limit."""
    from transformers import AutoConfig, AutoTokenizer

    path = ensure_base_model(cfg)
    tokenizer = AutoTokenizer.from_pretrained(path)
    limit, source = token_limit(cfg, formatting.context_window(AutoConfig.from_pretrained(path), tokenizer))
    # Measuring rows longer than the model takes is the point: no "sequence too long" warning.
    tokenizer.model_max_length = int(1e30)
    return TokenBudget(count=lambda ex: formatting.count_tokens(ex, tokenizer), limit=limit, source=source)


def validate_prepared(cfg, prepared, budget: TokenBudget | None = None) -> ValidationReport:
    """The gate as runs use it: a prepared dataset, the rows its policies handled, token
    bounds in the base model's tokenizer (token_budget, unless given)."""
    budget = budget or token_budget(cfg)
    return validate_dataset(
        prepared.train,
        prepared.eval,
        cfg.validation,
        budget.count,
        cfg.data_docs_dir,
        max_tokens=budget.limit,
        handled=prepared.rejects + prepared.changed,
    )
