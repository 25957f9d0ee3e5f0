"""What a fine-tune reaches on a task, against the base model and the majority label.

    python benchmarks/recipe.py [--config configs/smollm2.yaml] [--data FILE_OR_FOLDER] [--shared]
                                [--set training.recipe_max_steps=120] [--json out.json]

Each run is a real `tuneloop train --json` (validation, the training job, evaluation beside the
base, blessing) in a state folder of its own (a temporary one unless --home says otherwise), so
nothing the user has registered is touched; the base model is converted or bootstrapped there
again (SmolLM2: ~35 s). --shared adds a run on ../shared/data/t0-amazon-polarity when it is there
(this team's copy of a public set: nine T0 templates over the same reviews, split so that every
template of an eval review is in eval). Printed per run: exact match, label accuracy and the
majority-label floors on the same eval split, for the base and the fine-tune, with the recipe's
choices and the checkpoint it kept. The exit status is 1 when a fine-tune's label accuracy is not
at least --margin above the per-template majority label (the floor a model that learnt only each
template's commonest answer reaches).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TUNELOOP = str(Path(sys.executable).parent / "tuneloop")
SHARED_T0 = ROOT.parent / "shared" / "data" / "t0-amazon-polarity"
SHOWN = (
    "exact_match",
    "label_accuracy",
    "majority_label",
    "majority_label_per_template",
    "eval_loss",
    "behaviour_pass_rate",
)


def run(config: str, data: str | None, home: Path, sets: list[str]) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TUNELOOP")}
    env["TUNELOOP__PATHS__HOME"] = str(home)
    for item in sets:
        key, _, value = item.partition("=")
        env["TUNELOOP__" + "__".join(key.upper().split("."))] = value
    cmd = [TUNELOOP, "train", "--config", config, "--json"] + (["--data", data] if data else [])
    print(f"\n$ {' '.join(cmd)}  (home {home})", flush=True)
    started = time.time()
    tail: list[str] = []
    with tempfile.TemporaryFile("w+") as stdout:
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        for line in proc.stderr:  # progress as it comes: the flow's tasks and the job's steps
            tail = (tail + [line])[-200:]
            if any(
                k in line
                for k in ("[train] step", "early stopping", "kept checkpoint", "Finished in state", ': {"eval_loss"')
            ):
                print("  " + line.rstrip().split(" - ", 1)[-1][-160:], flush=True)
        proc.wait()
        stdout.seek(0)
        out = stdout.read()
    if proc.returncode != 0:
        print("".join(tail)[-4000:], file=sys.stderr)
        raise SystemExit(f"tuneloop train failed ({proc.returncode})")
    summary = json.loads(out[out.index("{\n") :])
    summary["wall_s"] = round(time.time() - started, 1)
    return summary


def show(name: str, summary: dict) -> dict:
    ch, base = summary["challenger"]["metrics"], summary["base"]
    print(f"\n== {name}: {summary['wall_s'] / 60:.1f} min, blessed={summary['blessed']}")
    print(f"{'metric':30} {'base':>8} {'fine-tune':>10}")
    for key in SHOWN:
        if key in ch:
            print(f"{key:30} {base.get(key, float('nan')):8.3f} {ch[key]:10.3f}")
    for note in summary.get("recipe_notes") or []:
        print(f"  recipe: {note}")
    for skip in summary.get("behaviour_skipped") or []:
        print(f"  behaviour suite {skip['suite']} skipped: {skip['reason']}")
    for row in (summary.get("wrong_answers") or [])[:3]:
        print(f"  wrong: {row['id']}: expected {row['expected']!r}, got {row['generated']!r}")
    floor = ch.get("majority_label_per_template", ch.get("majority_label", 0.0))
    return {
        "name": name,
        "label_accuracy": ch.get("label_accuracy"),
        "exact_match": ch.get("exact_match"),
        "base_label_accuracy": base.get("label_accuracy"),
        "floor": floor,
        "majority_label": ch.get("majority_label"),
        "best_step": summary.get("best_step"),
        "minutes": round(summary["wall_s"] / 60, 1),
        "blessed": summary["blessed"],
        "notes": summary.get("recipe_notes"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/smollm2.yaml")
    parser.add_argument(
        "--data",
        action="append",
        default=[],
        help="a training file or folder instead of the config's (repeatable: one run each)",
    )
    parser.add_argument("--shared", action="store_true", help="also run on ../shared/data/t0-amazon-polarity")
    parser.add_argument("--no-default", action="store_true", help="skip the run on the config's own data")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override for every run, e.g. training.recipe_max_steps=120",
    )
    parser.add_argument("--home", help="state folder (default: a new temporary one per run)")
    parser.add_argument("--margin", type=float, default=0.1)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    runs: list[tuple[str, str | None]] = [] if args.no_default else [("the config's data", None)]
    runs += [(d, d) for d in args.data]
    if args.shared:
        if SHARED_T0.is_dir():
            runs.append(("t0-amazon-polarity (../shared)", str(SHARED_T0)))
        else:
            print(f"--shared: {SHARED_T0} is absent; skipped")
    results = []
    for name, data in runs:
        home = Path(args.home) if args.home else Path(tempfile.mkdtemp(prefix="tuneloop-recipe-"))
        results.append(show(name, run(args.config, data, home, args.set)))
    print("\n| data | base label acc. | majority (per template) | fine-tune label acc. | exact match | kept step |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['name']} | {r['base_label_accuracy']:.3f} | {r['majority_label']:.3f} ({r['floor']:.3f}) | "
            f"**{r['label_accuracy']:.3f}** | {r['exact_match']:.3f} | {r['best_step']} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    short = [r["name"] for r in results if r["label_accuracy"] < r["floor"] + args.margin]
    if short:
        print(f"below the per-template majority + {args.margin}: {', '.join(short)}")
    return 1 if short else 0


if __name__ == "__main__":
    raise SystemExit(main())
