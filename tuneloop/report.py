"""The run report: one markdown page and two plots a person reads to trust a promotion.

- summary.md: the metric table (challenger vs champion vs base vs other candidates), the
  blessing decision and every reason behind it.
- training_loss.png: loss curve(s) of the candidate trainings.
- metrics_comparison.png: one small panel per metric (their scales differ too much for a
  shared axis), one bar per model.
- behaviour.json (when a behaviour suite ran, tuneloop/behaviour.py): every model's
  behavioural results, each case with its prompts and answers; summary.md lists the
  challenger's failing cases.
- predictions/<model>.jsonl: every eval row's expected and generated answer, per model
  (tuneloop.evaluation.predictions), redacted by tuneloop.privacy; summary.md shows the
  challenger's wrong answers first beside what the base and the champion answered.

The flow logs these files to MLflow and publishes them as Prefect artifacts.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable

from tuneloop.blessing import Blessing
from tuneloop.privacy import redact

# Shown first and in this order; any other numeric metric follows alphabetically.
METRIC_ORDER = [
    "exact_match",
    "label_accuracy",
    "majority_label",
    "majority_label_per_template",
    "token_f1",
    "rouge_l",
    "behaviour_pass_rate",
    "behaviour_mft",
    "behaviour_inv",
    "behaviour_dir",
    "eval_loss",
    "perplexity",
    "ms_per_token",
    "tokens_per_second",
]
# Bookkeeping counts: in the table, not worth a plot panel.
NOT_PLOTTED = {"num_examples", "eval_tokens", "generated_tokens", "prompts_truncated", "behaviour_cases"}
LOWER_IS_BETTER = {"eval_loss", "perplexity", "ms_per_token"}


def _points(history: Any) -> list[tuple[float, float]]:
    """(step, loss) pairs from a list of losses, of (step, loss) pairs, or of HF log_history dicts."""
    points = []
    for i, item in enumerate(history or []):
        if isinstance(item, dict):
            if "loss" not in item:  # eval/summary entries in a Trainer log_history
                continue
            step, loss = item.get("step", i), item["loss"]
        elif isinstance(item, (tuple, list)):
            step, loss = item
        else:
            step, loss = i, item
        points.append((float(step), float(loss)))
    return points


def _metric_names(table: dict[str, dict[str, float]], breakdown: bool = False) -> list[str]:
    """The table's metrics in reading order; breakdown: only the per-template / per-label ones
    (names with a "/"), which are otherwise left out."""
    present = {
        m
        for metrics in table.values()
        for m, v in metrics.items()
        if isinstance(v, (int, float)) and ("/" in m) == breakdown
    }
    return [m for m in METRIC_ORDER if m in present] + sorted(present - set(METRIC_ORDER))


def _cell(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
        return str(v)
    if isinstance(v, float) and v.is_integer() and abs(v) >= 1:
        return f"{int(v)}"
    return f"{v:.4g}" if isinstance(v, (int, float)) else str(v)


def metrics_markdown(table: dict[str, dict[str, float]], breakdown: bool = False) -> str:
    labels = list(table)
    lines = ["| metric | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for m in _metric_names(table, breakdown):
        arrow = " ↓" if m in LOWER_IS_BETTER else ""
        lines.append(f"| {m}{arrow} | " + " | ".join(_cell(table[label].get(m)) for label in labels) + " |")
    return "\n".join(lines)


def _one_line(text: str, limit: int = 140) -> str:
    text = " / ".join(line.strip() for line in str(text).splitlines() if line.strip()).replace("`", "'")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def behaviour_markdown(behaviour: dict[str, dict[str, Any]], challenger: str | None) -> list[str]:
    """Cases passed per task and model, then the failing cases (challenger's, else every model's)."""
    labels = list(behaviour)
    tasks = sorted({t for r in behaviour.values() for t in r.get("by_task", {})})
    md = [
        "## Behavioural tests",
        "",
        f"Suite: {next(iter(behaviour.values())).get('suite', '?')} "
        "(passed / cases per task; prompts and answers of every case in behaviour.json)",
        "",
        "| task | " + " | ".join(labels) + " |",
        "|---|" + "---|" * len(labels),
    ]
    for task in tasks:
        cells = [behaviour[label].get("by_task", {}).get(task) for label in labels]
        md.append(f"| {task} | " + " | ".join(f"{c['passed']}/{c['cases']}" if c else "–" for c in cells) + " |")
    md.append("")
    for label in [challenger] if challenger in behaviour else labels:
        failures = behaviour[label].get("failures", [])
        total = len(behaviour[label].get("cases", [])) or "?"
        md += [f"### Failing cases of {label}: {len(failures)} of {total}", ""]
        if not failures:
            md += ["(none)", ""]
            continue
        for case in failures:
            wrong = [a for a in case["answers"] if not a["ok"]]
            head = f"- **{case['name']}** ({case['kind']}{', ' + case['task'] if case.get('task') else ''})"
            md.append(head if wrong else f"{head}: {_one_line(case['reason'], 300)}")  # inv: answers differ
            md += [
                f"  - `{_one_line(a['prompt'])}` → `{_one_line(a['answer'], 60)}`"
                + (f", expected `{_one_line(a['expected'], 60)}`" if a["expected"] is not None else "")
                for a in wrong or case["answers"]
            ]
        md.append("")
    return md


SHOWN_WRONG = 20  # wrong answers in summary.md; every row is in predictions/*.jsonl


def _safe_name(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in label).strip("_") or "model"


def redacted(predictions: dict[str, list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """Every text of every row but its id through tuneloop.privacy.redact: what people see."""

    def row_of(row: dict[str, Any]) -> dict[str, Any]:
        return {k: redact(v) if isinstance(v, str) and k != "id" else v for k, v in row.items()}

    return {label: [row_of(row) for row in rows] for label, rows in predictions.items()}


def write_predictions(out: Path, predictions: dict[str, list[dict[str, Any]]]) -> dict[str, Path]:
    """predictions/<model>.jsonl (rows as given: redacted() first)."""
    folder = out / "predictions"
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for label, rows in predictions.items():
        path = folder / f"{_safe_name(label)}.jsonl"
        with path.open("w") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        paths[label] = path
    return paths


def predictions_markdown(
    predictions: dict[str, list[dict[str, Any]]], challenger: str | None, limit: int = SHOWN_WRONG
) -> list[str]:
    """The challenger's wrong answers first (up to `limit`), each beside the other models'
    answers to the same row; then how many each model got wrong. Rows as given: redacted() first."""
    labels = list(predictions)
    first = challenger if challenger in predictions else labels[-1]
    others = [label for label in labels if label != first]
    by_id = {label: {r["id"]: r for r in rows} for label, rows in predictions.items()}
    wrong = [r for r in predictions[first] if not r["label_match"]]
    md = [
        "## Predictions",
        "",
        "Wrong answers (label match: first line, case, spaces and end punctuation aside): "
        + ", ".join(
            f"{label} {sum(not r['label_match'] for r in rows)} of {len(rows)}" for label, rows in predictions.items()
        )
        + ". Every row of every model is in predictions/*.jsonl.",
        "",
    ]
    if not wrong:
        return md + [f"{first} answered every row right.", ""]
    md += [
        f"### {first}'s wrong answers (first {min(limit, len(wrong))} of {len(wrong)})",
        "",
        "| row | expected | " + " | ".join([first, *others]) + " |",
        "|---|---|" + "---|" * (1 + len(others)),
    ]

    def cell(row: dict[str, Any] | None) -> str:
        if row is None:
            return "–"
        text = _one_line(row["generated"], 60).replace("|", "\\|") or "(empty)"
        return f"`{text}`" + ("" if row["label_match"] else " ✗")

    for r in wrong[:limit]:
        where = r["id"] + (f" ({r['template']})" if r.get("template") else "")
        md.append(
            f"| {_one_line(where, 100)} | `{_one_line(r['expected'], 40)}` | "
            + " | ".join(cell(by_id[label].get(r["id"])) for label in [first, *others])
            + " |"
        )
    md.append("")
    return md


def _plot_losses(histories: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, history in histories.items():
        pts = _points(history)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, marker="." if len(pts) < 30 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("Training loss")
    ax.grid(alpha=0.3)
    if histories:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_metrics(table: dict[str, dict[str, float]], path: Path) -> None:
    import matplotlib.pyplot as plt

    names = [m for m in _metric_names(table) if m not in NOT_PLOTTED] or ["(no metrics)"]
    cols = min(4, len(names))
    rows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.8 * rows), squeeze=False)
    labels = list(table)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, m in zip(axes.flat, names):
        values = [table[label].get(m) for label in labels]
        heights = [v if isinstance(v, (int, float)) and math.isfinite(v) else 0.0 for v in values]
        ax.bar(range(len(labels)), heights, color=[colors[i % len(colors)] for i in range(len(labels))])
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_title(m + (" (lower is better)" if m in LOWER_IS_BETTER else ""), fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(
    out_dir: Path | str,
    train_loss_histories: dict[str, Any] | Iterable[Any] | None,
    metrics_table: dict[str, dict[str, float]],
    blessing: Blessing | None,
    title: str = "tuneloop run report",
    behaviour: dict[str, dict[str, Any]] | None = None,
    challenger: str | None = None,
    predictions: dict[str, list[dict[str, Any]]] | None = None,
    notes: list[str] | None = None,
) -> dict[str, Path]:
    """Write summary.md, training_loss.png and metrics_comparison.png into out_dir.

    train_loss_histories: {label: history} or one history; a history is a list of losses,
    of (step, loss) pairs, or a Trainer log_history. metrics_table: {model label: metrics},
    e.g. {"challenger": ..., "champion": ..., "base": ..., "candidate lr=3e-3": ...}.
    behaviour: {model label: BehaviourResult.to_dict()}, written to behaviour.json; the
    summary lists the failing cases of `challenger` (a label of it), else of every model.
    predictions: {model label: tuneloop.evaluation.predictions(...)}, written to
    predictions/*.jsonl and summarised (wrong answers first). notes: lines for a "Run" section
    (e.g. the recipe's choices and the kept checkpoint).
    Returns {"summary": path, "training_loss": path, "metrics_comparison": path} (and
    "behaviour": path with behaviour, "predictions:<label>": path per model).
    """
    import matplotlib

    matplotlib.use("Agg")  # files only, no display (CI, servers, workers)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if train_loss_histories is None:
        histories: dict[str, Any] = {}
    elif isinstance(train_loss_histories, dict):
        histories = train_loss_histories
    else:
        histories = {"training": list(train_loss_histories)}

    paths = {
        "summary": out / "summary.md",
        "training_loss": out / "training_loss.png",
        "metrics_comparison": out / "metrics_comparison.png",
    }
    _plot_losses(histories, paths["training_loss"])
    _plot_metrics(metrics_table, paths["metrics_comparison"])

    md = [f"# {title}", ""]
    if blessing is None:
        md += ["**Decision:** not evaluated for promotion.", ""]
    else:
        verdict = "BLESSED" if blessing.blessed else "NOT BLESSED"
        against = f"champion v{blessing.baseline_version}" if blessing.baseline_version else "no champion (first model)"
        md += [f"**Decision:** {verdict} (compared against {against})", "", "Reasons:", ""]
        md += [f"- {r}" for r in blessing.reasons] or ["- (none)"]
        md.append("")
    md += ["## Metrics", "", metrics_markdown(metrics_table) if metrics_table else "(no metrics)", ""]
    if metrics_table and _metric_names(metrics_table, breakdown=True):
        md += [
            "### Per template and per label (label accuracy)",
            "",
            metrics_markdown(metrics_table, breakdown=True),
            "",
        ]
    if notes:
        md += ["## Run", "", *[f"- {line}" for line in notes], ""]
    if predictions:
        predictions = redacted(predictions)
        md += predictions_markdown(predictions, challenger)
        paths.update({f"predictions:{label}": p for label, p in write_predictions(out, predictions).items()})
    finals = {label: _points(h)[-1][1] for label, h in histories.items() if _points(h)}
    if finals:
        md += ["## Training", "", "| run | final training loss |", "|---|---|"]
        md += [f"| {label} | {loss:.4g} |" for label, loss in finals.items()]
        md.append("")
    if behaviour:
        md += behaviour_markdown(behaviour, challenger)
        paths["behaviour"] = out / "behaviour.json"
        paths["behaviour"].write_text(json.dumps(behaviour, indent=2, ensure_ascii=False, default=float))
    md += ["![training loss](training_loss.png)", "", "![metrics](metrics_comparison.png)", ""]
    paths["summary"].write_text("\n".join(md))
    return paths
