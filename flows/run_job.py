"""One fine-tuning job as a training flow run, in a process of its own (what the embedded
runner of tuneloop/finetune/runner.py starts): python -m flows.run_job JOB_ID [--config FILE]"""

from __future__ import annotations

import argparse
import signal
import sys

from flows.training import training_flow


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run one fine-tuning job as a training flow run.")
    parser.add_argument("job_id")
    parser.add_argument("--config", default=None)
    args = parser.parse_args(argv)

    def stop(signum, frame):  # a cancel: unwind, so the training's ranks are stopped too
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)

    try:
        training_flow(config_path=args.config, job_id=args.job_id)
    except SystemExit:
        raise
    except Exception as exc:  # already recorded on the job; the flow run shows it too
        print(f"fine-tuning job {args.job_id} failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
