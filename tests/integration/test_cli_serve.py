"""`tuneloop serve` with a model it cannot load: it starts the real server process (`bentoml
serve`), which must stop at the first failure. The CLI's other checks, which start no server,
are in tests/unit/test_cli.py."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

TUNELOOP = [str(Path(sys.executable).parent / "tuneloop")]


@pytest.mark.parametrize("broken", ["garbage-config", "no-weights"])
def test_serve_with_a_model_it_cannot_load_exits_with_the_reason(tmp_path, broken):
    """BentoML would restart a worker whose model does not load forever; `tuneloop serve`
    stops at the first failure, exits 1 and says why in one line, and leaves no server behind."""
    import os

    model = tmp_path / "model"
    model.mkdir()
    if broken == "garbage-config":
        (model / "config.json").write_text('{"model_type": "llama", "garbage": true}')
    else:  # a real tokenizer and config, but the weights are missing
        from tests.support.serving_tiny_model import build_tiny_model

        build_tiny_model(model)
        (model / "model.safetensors").unlink()
    env = {
        **os.environ,
        "TUNELOOP_HOME": str(tmp_path / "home"),
        "TUNELOOP_SERVE_MODEL_DIR": str(model),
        "BENTOML_HOME": str(tmp_path / "bentoml"),
    }
    from tests.support.servers import free_port

    port = free_port()
    started = time.perf_counter()
    out = subprocess.run(
        TUNELOOP + ["serve", "--port", str(port)], capture_output=True, text=True, timeout=180, env=env
    )
    elapsed = time.perf_counter() - started
    print(f"\n{broken}: exited {out.returncode} after {elapsed:.1f} s")
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the server could not start: ServingSetupError: cannot load the model at"), last
    assert str(model) in last
    assert out.stdout.count("Application startup failed") == 1  # stopped at the first failure, no restart loop
    alive = subprocess.run(["pgrep", "-f", f"--port {port}"], capture_output=True, text=True)
    assert alive.stdout.strip() == "", "the server's processes were left running"
