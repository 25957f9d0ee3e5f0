"""The `tuneloop` console command: instant help on every verb, clear config errors."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

TUNELOOP = [str(Path(sys.executable).parent / "tuneloop")]
VERBS = [[], ["config"], ["bootstrap"], ["prepare"], ["validate"], ["demo"], ["train"], ["package"], ["serve"],
         ["registry"], ["registry", "history"], ["registry", "rollback"]]


def run(*args, **kw):
    return subprocess.run(TUNELOOP + list(args), capture_output=True, text=True, timeout=60, **kw)


@pytest.mark.parametrize("verb", VERBS, ids=lambda v: " ".join(v) or "top")
def test_help_on_every_verb(verb):
    started = time.perf_counter()
    out = run(*verb, "--help")
    elapsed = time.perf_counter() - started
    assert out.returncode == 0, out.stderr
    assert "Usage" in out.stdout
    assert elapsed < 2.0, f"tuneloop {' '.join(verb)} --help took {elapsed:.2f}s"


def test_bad_config_is_a_clear_error_not_a_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  seeed: 3\n")
    out = run("config", "--config", str(bad))
    assert out.returncode == 2
    assert "data.seeed: unknown key" in out.stderr
    assert "Traceback" not in out.stderr
