"""The child's side of the gateway's checks' process (parent side: guard_process.py).

`python -m tuneloop.gateway.guard_child <spec>` loads what the JSON spec names (Presidio's
analyzer for ``find`` and ``redact``, the content filter's classifier for ``scores``), writes
one "ready" line with what it loaded, then answers one JSON line per request line, in order,
until its parent closes stdin. An error before "ready" is reported as that line instead.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

from tuneloop.config import PiiConfig
from tuneloop.gateway.filter_model import InjectionClassifier
from tuneloop.privacy.redactor import PiiRedactor


def serve(spec: dict, stdin, stdout) -> None:
    """Load what the spec names, say ready (one JSON line), then answer one JSON line per
    request line until stdin closes."""
    ops: dict[str, Callable] = {}
    hello: dict[str, Any] = {"ready": True, "pid": os.getpid()}
    if spec.get("nice"):
        try:
            os.nice(int(spec["nice"]))  # background work (the request log): the server's generation first
        except OSError:
            pass
    if spec.get("pii") is not None:
        pii = PiiRedactor(PiiConfig.model_validate(spec["pii"]), Path(spec["cache_dir"]), spec.get("key_prefix", "tl-"))
        ops["find"] = lambda text: [[e.entity_type, e.start, e.end, e.score] for e in pii.find(text)]
        ops["redact"] = lambda texts: [pii.redact(t)[0] for t in texts]
        hello["pii"] = {"prescreen": pii.prescreen, "early_emit": pii.early_emit}
    if spec.get("classifier") is not None:
        try:
            import torch

            torch.set_num_threads(1)  # an encoder classifier: one core beside the engine's
        except ImportError:  # pragma: no cover
            pass
        clf = InjectionClassifier.load(Path(spec["classifier"]))
        clf.scores(["warm-up: is this an injection?"])

        def scores(texts):
            before = (clf.screened_out, clf.encoded)
            values = clf.scores(texts)
            return {
                "scores": [float(v) for v in values],
                "screened": clf.screened_out - before[0],
                "encoded": clf.encoded - before[1],
            }

        ops["scores"] = scores
        hello["classifier"] = {"method": clf.method, "threshold": clf.threshold}
    stdout.write(json.dumps(hello).encode() + b"\n")
    stdout.flush()
    for line in stdin:
        request = json.loads(line)
        cpu = time.thread_time()
        try:
            reply = {"id": request["id"], "result": ops[request["op"]](request["payload"])}
        except Exception as exc:  # noqa: BLE001 - the caller refuses the request
            reply = {"id": request["id"], "error": f"{type(exc).__name__}: {exc}"}
        reply["cpu"] = time.thread_time() - cpu
        stdout.write(json.dumps(reply, ensure_ascii=False).encode() + b"\n")
        stdout.flush()


def main() -> None:  # pragma: no cover - runs in the child (tested through GuardProcess)
    # The server drains on SIGTERM and still needs its checks for the streams in flight: the
    # child lives in a session of its own and ignores the stop signals; it exits when its
    # parent closes stdin (or dies: the pipe closes then too).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out = sys.stdout.buffer
    try:
        spec = json.loads(sys.argv[1])
        serve(spec, sys.stdin.buffer, out)
    except Exception as exc:  # noqa: BLE001 - before "ready": the parent reports it
        try:
            out.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode() + b"\n")
            out.flush()
        except OSError:
            pass


if __name__ == "__main__":
    main()
