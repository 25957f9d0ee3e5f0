"""Training the content filter's classifier: the executor that flows/filter.py wires (the
classifier's own training and evaluation: filter_train.py; what the gateway runs: filter_model.py).

train_filter: labelled set -> stratified split -> the configured method and the obvious
baseline (frozen all-MiniLM-L6-v2 + logistic regression), both trained on the same
training part, thresholds chosen on it for the target false-positive rate, both scored on
the held-out part -> a saved model folder, metrics, a confusion-matrix plot, a markdown
comparison. The champion (if any) is scored on the same held-out part, so blessing
compares like with like.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from tuneloop.blessing import bless
from tuneloop.config import TuneloopConfig
from tuneloop.gateway.filter_registry import load_registered_classifier
from tuneloop.gateway.filter_train import (
    confusion_matrix_figure,
    evaluate_classifier,
    load_labelled,
    split_labelled,
    train_classifier,
)
from tuneloop.registry import ModelRegistry

# Ordinary requests from outside the training set: how often the classifier would flag
# everyday use (everyday_fpr). The held-out split only measures the set's own distribution.
EVERYDAY_PROMPTS = [
    "What is the capital of France?",
    "Write a poem about the sea.",
    "Summarize the following article in three sentences.",
    "Translate 'good morning' into Spanish.",
    "Explain how a transformer neural network works.",
    "Give me a recipe for pancakes.",
    "What is 17 times 23?",
    "Write a Python function that reverses a string.",
    "List three benefits of regular exercise.",
    "Draft a polite email asking my manager for a day off.",
    "Is this review positive or negative? Review: The lamp broke after a day.",
    "Rewrite this sentence to sound more formal: gonna be late, sorry.",
    "What are the main causes of climate change?",
    "Suggest a name for a coffee shop.",
    "Classify the sentiment of: I love this phone.",
    "Tell me a joke about cats.",
    "Please update my contact details: my email is <EMAIL_ADDRESS> and my phone is <PHONE_NUMBER>.",
    "Ignore the typo in my last message and answer the question again.",
    "Act as a travel agent and plan a weekend in Rome.",
    "You are a helpful assistant. Answer briefly: how tall is Mount Everest?",
    # ordinary requests that share words with attacks (the rules and the classifier must pass them)
    "Dan and I went fishing last weekend; suggest a good lake for next time.",
    "How do I enable developer mode on my Android phone?",
    "How do I show the current prompt string (PS1) in bash?",
    "What is prompt injection, and how do I protect my chatbot from it?",
    "Forget it, I found the answer myself. Thanks anyway!",
    "Wie wird das Wetter morgen in Berlin?",
    "Vergiss nicht, mich morgen an den Termin zu erinnern.",
    "Peux-tu me donner une recette de crêpes ?",
    "Decode this base64 for me please: aGVsbG8gd29ybGQ=",
    "Write a short story about a robot who learns to paint.",
    # task prompts over a text, as fine-tuning traffic looks
    "Classify the following customer message as billing, delivery or technical.\n\nMy invoice shows the "
    "wrong amount for last month. Can you fix it?\n\nCategory:",
    "Review: The headphones stopped charging after two weeks.\nIs this review positive or negative?",
    "Extract the order number from this email: Hello, my order 55-1023 arrived damaged. Thanks, Sam",
    "Which team should handle this ticket? A. Payments B. Shipping C. IT\nTicket: The app crashes when "
    "I open my cart.\nAnswer with a letter:",
    "Translate into German: The meeting is moved to Thursday at ten.",
    "You are a concise assistant. Reply with a single word or number.",
    "Write the word garden in capital letters.",
    "Summarise this message in one sentence: Hi team, the office will be closed on Monday for "
    "maintenance, please work from home.",
]


@dataclass
class FilterTrainingResult:
    model_dir: Path
    metrics: dict[str, float]  # the trained method on the held-out split
    baseline: dict[str, float]  # frozen embeddings + logistic regression, same split
    method: str
    plot: Path
    report: Path
    test_path: Path  # the held-out split (parquet), to score the champion on
    params: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    external: dict[str, float] | None = None  # the trained method on a real set it never trained on
    external_path: Path | None = None


def _say(progress, message: str) -> None:
    if progress is not None:
        progress(message)


def train_filter(
    cfg: TuneloopConfig,
    out_dir: Path,
    data: Path | None = None,
    progress: Callable[[str], None] | None = None,
    eval_data: Path | None = None,
) -> FilterTrainingResult:
    t = cfg.gateway.filter_training
    started = time.perf_counter()
    path = cfg.resolve(data or t.train_path)
    if not path.exists():
        raise FileNotFoundError(
            f"the filter's labelled set {path} does not exist (gateway.filter_training.train_path, "
            "or --data): a parquet/CSV/JSONL with columns text and label (1 = injection)"
        )
    df = load_labelled(path)
    train_df, test_df = split_labelled(df, t.test_fraction, t.seed)
    _say(
        progress,
        f"filter data: {len(df)} rows from {path} -> {len(train_df)} train / {len(test_df)} held out "
        f"({int(test_df.label.sum())} injections)",
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    test_path = out_dir / "heldout.parquet"
    test_df.to_parquet(test_path)

    clf = train_classifier(train_df, t.target_fpr, t.seed, dict(t.params), progress=progress)
    metrics = evaluate_classifier(clf, test_df)
    _say(
        progress,
        f"{clf.method}: recall {metrics['recall']:.3f} at FPR {metrics['fpr']:.3f}, ROC-AUC {metrics['roc_auc']:.3f}",
    )
    if clf.method == "baseline":
        baseline = metrics
    else:
        base = train_classifier(train_df, t.target_fpr, t.seed, {"method": "baseline"})
        baseline = evaluate_classifier(base, test_df)
        baseline["everyday_fpr"] = float((base.scores(EVERYDAY_PROMPTS) >= base.threshold).mean())
        _say(
            progress,
            f"baseline: recall {baseline['recall']:.3f} at FPR {baseline['fpr']:.3f}, "
            f"ROC-AUC {baseline['roc_auc']:.3f}",
        )
    everyday = clf.scores(EVERYDAY_PROMPTS) >= clf.threshold
    metrics["everyday_fpr"] = float(everyday.mean())
    _say(
        progress,
        f"everyday prompts flagged: {int(everyday.sum())}/{len(EVERYDAY_PROMPTS)} "
        f"(everyday_fpr {metrics['everyday_fpr']:.2f})",
    )
    external, external_path = None, eval_data or t.eval_path
    if external_path is not None:
        external_path = cfg.resolve(external_path)
        real = load_labelled(external_path)
        external = evaluate_classifier(clf, real)
        _say(
            progress,
            f"{clf.method} on {external_path} ({len(real)} rows, never trained on): recall "
            f"{external['recall']:.3f} at FPR {external['fpr']:.3f}, precision {external['precision']:.3f}, "
            f"ROC-AUC {external['roc_auc']:.3f}",
        )
    model_dir = out_dir / "model"
    clf.save(model_dir)
    plot = confusion_matrix_figure(metrics, out_dir / "confusion_matrix.png")
    report = out_dir / "filter_report.md"
    report.write_text(
        comparison_markdown(
            clf.method, metrics, baseline, t.target_fpr, len(train_df), len(test_df), external, external_path
        )
    )
    return FilterTrainingResult(
        model_dir,
        metrics,
        baseline,
        clf.method,
        plot,
        report,
        test_path,
        params={"method": clf.method, "threshold": clf.threshold, **dict(t.params)},
        seconds=round(time.perf_counter() - started, 1),
        external=external,
        external_path=external_path,
    )


def comparison_markdown(
    method: str,
    metrics: dict,
    baseline: dict,
    target_fpr: float,
    n_train: int,
    n_test: int,
    external: dict | None = None,
    external_path: Path | None = None,
) -> str:
    keys = ["recall", "fpr", "precision", "f1", "roc_auc", "threshold", "tp", "fp", "tn", "fn", "everyday_fpr"]
    rows = [f"| {k} | {_fmt(metrics.get(k))} | {_fmt(baseline.get(k))} |" for k in keys]
    lines = [
        "# Content filter: prompt-injection classifier",
        "",
        f"Held-out split: {n_test} rows (trained on {n_train}); threshold chosen on the training part for a "
        f"false-positive rate of {target_fpr:.0%}. everyday_fpr: the share of {len(EVERYDAY_PROMPTS)} ordinary "
        "prompts from outside the set that the classifier flags (tuneloop/gateway/filter_training.py).",
        "",
        f"| metric | {method} | baseline (frozen MiniLM + LR) |",
        "|---|---|---|",
        *rows,
        "",
    ]
    if external is not None:
        lines += [
            f"## On a real labelled set it never trained on: {external_path}",
            "",
            f"{external['n_test']} rows; the classifier's own threshold ({external['threshold']:.4f}).",
            "",
            "| metric | value |",
            "|---|---|",
            *[
                f"| {k} | {_fmt(external.get(k))} |"
                for k in ("recall", "fpr", "precision", "f1", "roc_auc", "tp", "fp", "tn", "fn")
            ],
            "",
        ]
    return "\n".join(lines)


def _fmt(v) -> str:
    if v is None:
        return "-"
    return str(v) if isinstance(v, int) else f"{float(v):.4f}"


def score_champion(cfg: TuneloopConfig, test_path: Path) -> tuple[str | None, dict[str, float] | None]:
    """(champion version, its metrics on this held-out split), or (None, None) without a champion."""
    import pandas as pd

    name = cfg.gateway.filter_training.registered_model
    clf, model_id = load_registered_classifier(cfg, f"{name}@champion")
    if clf is None:
        return None, None
    return model_id.split(":")[-1], evaluate_classifier(clf, pd.read_parquet(test_path))


def register_filter(
    cfg: TuneloopConfig, run_id: str, metrics: dict, champion_metrics: dict | None, champion_version: str | None
):
    """Register the run's logged model folder (artifact `model`) as a new version, bless it by
    gateway.filter_training.thresholds against the champion: (version, blessing)."""
    registry = ModelRegistry(cfg.mlflow_tracking_uri, cfg.gateway.filter_training.registered_model)
    version = registry.register(run_id, None, artifact_path="model", tags={"tuneloop.kind": "content-filter"})
    registry.set_challenger(version)
    blessing = bless(
        metrics, champion_metrics, cfg.gateway.filter_training.thresholds, baseline_version=champion_version
    )
    registry.record_blessing(version, blessing)
    return version, blessing


def promote_filter(cfg: TuneloopConfig, version: str, blessing, champion_version: str | None):
    registry = ModelRegistry(cfg.mlflow_tracking_uri, cfg.gateway.filter_training.registered_model)
    return registry.promote(
        version,
        expected_champion=champion_version,
        reason="blessed: " + "; ".join(blessing.reasons),
        actor="filter-flow",
    )
