"""Monitoring benchmark: one monitoring run (tuneloop/monitoring/run.py, what the hourly
flow and `tuneloop monitor` call) over a request log of N logged requests.

    python benchmarks/monitoring.py               # 10,000 requests (target: the run under 30 s)
    python benchmarks/monitoring.py --requests 2000

The log is written first (JSONL segments, the sample data's prompts as chat requests, times
spread over the last hour); the run then reads it, computes drift against the configured
training set's prompts (no champion: the reference comes from data.train_path) and the SLOs,
and writes the Evidently reports. Printed: the run's total and its parts.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from tuneloop.config import TuneloopConfig
    from tuneloop.monitoring.run import monitor
    from tuneloop.requestlog.record import utc_iso
    from tuneloop.requestlog.store import SegmentSink

    sample = ROOT / "data" / "sample" / "train.jsonl"
    rows = [json.loads(line)["messages"] for line in sample.read_text().splitlines() if line.strip()]
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="tuneloop-monitoring-bench-") as tmp:
        cfg = TuneloopConfig.model_validate({"paths": {"home": tmp}, "data": {"train_path": str(sample)}})
        now = datetime.now(timezone.utc)
        sink = SegmentSink(cfg.home / "requests", 64 << 20, 3600)
        batch = []
        for i in range(args.requests):
            messages = rng.choice(rows)[:-1]
            batch.append(
                {
                    "kind": "request",
                    "request_id": f"req_{rng.getrandbits(128):032x}",
                    "time": utc_iso((now - timedelta(seconds=3500 * (1 - i / args.requests))).timestamp()),
                    "route": "/v1/chat/completions",
                    "status": 200,
                    "key_id": "bench",
                    "prompt": messages,
                    "completions": ["positive"],
                    "prompt_tokens": 40,
                    "completion_tokens": 2,
                    "ttft_s": rng.uniform(0.02, 0.2),
                    "latency_s": rng.uniform(0.1, 1.5),
                    "error_code": None,
                    "prompt_redacted": True,
                    "completion_redacted": True,
                }
            )
        sink.write("requests", batch)
        sink.close()
        print(f"{args.requests} logged requests written; running one monitoring pass ...", flush=True)
        steps: list[tuple[float, str]] = []
        started = time.perf_counter()

        def progress(message: str) -> None:
            steps.append((time.perf_counter() - started, message))
            print(f"  {steps[-1][0]:6.1f} s  {message}", flush=True)

        result = monitor(cfg, emit=None, progress=progress)
        total = time.perf_counter() - started
    d = result["drift"]
    print(
        f"\ndrift detected: {d['detected']} (scores {d['scores']}); drift computation {d['seconds']:.1f} s "
        f"(embedded {d['embedded_rows']})"
    )
    print(
        f"monitoring run over {result['window']['requests']} requests: {total:.1f} s "
        f"(target < 30 s) {'MET' if total < 30 else 'MISSED'}"
    )


if __name__ == "__main__":
    main()
