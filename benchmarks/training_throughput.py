"""Training throughput: one process vs plain DDP vs DeepSpeed ZeRO-2, same model and data.

    python benchmarks/training_throughput.py [--steps 30] [--batch-size 8] [--json out.json]

Each setup is a real job started by tuneloop.training.launch (the same path `tuneloop
train` takes): single process; torchrun with 2 processes and DDP over gloo (NCCL on GPUs);
the deepspeed launcher with 2 processes and ZeRO-2. Tokens/s counts non-padding tokens
over all processes inside optimizer steps (first step excluded, see train.py); "wall" is
the whole launch, start-up included. Model: the bootstrap recipe's default size (GPT-2,
4 layers x 128, ~1.4M parameters), untrained. Data: the Amazon-polarity legacy JSONL under
../shared/data (falls back to synthetic reviews when absent).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from tuneloop.config import BootstrapConfig, TrainingConfig  # noqa: E402
from tuneloop.training.launch import TrainSpec, launch_training  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "t0-amazon-polarity" / "amazon_polarity_Is_this_review.jsonl"

SETUPS = [
    # label, processes, launcher, DeepSpeed config, OMP threads per process (None: the default:
    # accelerate gives a lone process all cores, the launchers give each rank cores / ranks)
    ("single process", 1, "torchrun", None, None),
    ("DDP (torchrun)", 2, "torchrun", None, None),
    ("DeepSpeed ZeRO-2", 2, "deepspeed", "zero2", None),
    # Control: one process, one thread. On a busy machine a multi-threaded process loses
    # more to descheduled OpenMP threads than single-threaded ranks do; this row shows it.
    ("single, 1 thread", 1, "torchrun", None, 1),
]


def write_examples(path: Path) -> str:
    """Normalised examples as JSONL; returns where they came from."""
    if DATA.is_file():
        from tuneloop.data.formats import load_file

        examples, source = load_file(DATA).examples, str(DATA)
    else:
        from tuneloop.data.schema import Example

        rng = random.Random(0)
        words = "great awful fine broken lovely poor sturdy cheap quick slow".split()
        examples = [
            Example(
                example_id=f"synthetic:{i}",
                prompt=f"Review: {' '.join(rng.choices(words, k=60))}\nAnswer:",
                completion=" Yes" if i % 2 else " No",
            )
            for i in range(200)
        ]
        source = f"synthetic ({DATA} absent)"
    path.write_text("".join(json.dumps(e.to_dict()) + "\n" for e in examples))
    return f"{source}, {len(examples)} examples"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=8, help="per process")
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tuneloop-throughput-"))
    try:
        run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, work: Path) -> None:
    from tuneloop.bootstrap import bootstrap_base_model

    base = bootstrap_base_model(BootstrapConfig(steps=0), work / "base", progress=False)
    data = work / "train.jsonl"
    source = write_examples(data)
    training = TrainingConfig(
        max_steps=args.steps,
        per_device_batch_size=args.batch_size,
        max_length=args.max_length,
        save_steps=10**9,
        logging_steps=max(1, args.steps // 3),
        warmup_ratio=0.0,
    )
    print(f"model {base} ({BootstrapConfig().n_layer}x{BootstrapConfig().n_embd} GPT-2); data {source}")
    print(
        f"{args.steps} steps, {args.batch_size} sequences per process per step, max_length {args.max_length}, "
        f"{os.cpu_count()} CPU cores\n"
    )

    rows = []
    print(f"load average before: {os.getloadavg()[0]:.1f}")
    for label, n, launcher, zero, threads in SETUPS:
        spec = TrainSpec(
            name=f"setup-{len(rows)}",
            base_model=str(base),
            train_path=str(data),
            eval_path=None,
            output_dir=str(work / f"run-{len(rows)}"),
            training=training.model_dump(mode="json", exclude={"candidates"}),
            deepspeed_config=str(ROOT / "configs" / "deepspeed" / f"{zero}.json") if zero else None,
            num_processes=n,
            launcher=launcher,
        )
        saved = os.environ.get("OMP_NUM_THREADS")
        if threads:
            os.environ["OMP_NUM_THREADS"] = str(threads)  # the job inherits this environment
        started = time.perf_counter()
        try:
            result = launch_training(spec, on_log=lambda line: None).train_result
        finally:
            os.environ.pop("OMP_NUM_THREADS", None)
            if saved is not None:
                os.environ["OMP_NUM_THREADS"] = saved
        wall = time.perf_counter() - started
        rows.append(
            {
                "setup": label,
                "processes": n,
                "omp_threads": threads or "default",
                "tokens_per_second": result["tokens_per_second"],
                "train_tokens": result["train_tokens"],
                "wall_s": round(wall, 1),
            }
        )
        print(f"  {label}: {result['tokens_per_second']:.0f} tokens/s, {wall:.0f} s wall", flush=True)

    print(f"load average after: {os.getloadavg()[0]:.1f}")
    single = rows[0]["tokens_per_second"]
    print(f"\n{'setup':<18} {'procs':>5} {'tokens/s':>10} {'vs single':>9} {'wall s':>7}")
    for r in rows:
        r["ratio_to_single"] = round(r["tokens_per_second"] / single, 2)
        print(
            f"{r['setup']:<18} {r['processes']:>5} {r['tokens_per_second']:>10.0f} "
            f"{r['ratio_to_single']:>8.2f}x {r['wall_s']:>7.1f}"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "steps": args.steps,
                    "batch_size": args.batch_size,
                    "data": source,
                    "cpu_count": os.cpu_count(),
                    "results": rows,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
