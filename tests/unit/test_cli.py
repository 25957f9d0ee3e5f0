"""The `tuneloop` console command: instant help on every verb, clear config errors (`tuneloop
serve` with a model it cannot load, which starts a server: tests/integration/test_cli_serve.py)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

TUNELOOP = [str(Path(sys.executable).parent / "tuneloop")]
VERBS = [
    [],
    ["config"],
    ["bootstrap"],
    ["prepare"],
    ["validate"],
    ["demo"],
    ["loop"],
    ["train"],
    ["package"],
    ["serve"],
    ["registry"],
    ["registry", "history"],
    ["registry", "rollback"],
    ["keys"],
    ["keys", "create"],
    ["keys", "list"],
    ["keys", "revoke"],
    ["filter"],
    ["filter", "train"],
]


def run(*args, **kw):
    return subprocess.run(TUNELOOP + list(args), capture_output=True, text=True, timeout=300, **kw)


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


def isolated_env(tmp_path, base_model) -> dict:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("TUNELOOP")}
    env["TUNELOOP_HOME"] = str(tmp_path / "home")
    env["TUNELOOP__BOOTSTRAP__OUTPUT_DIR"] = str(base_model)
    return env


@pytest.mark.slow
def test_validate_exits_0_on_the_sample_and_1_naming_poisoned_rows(tmp_path, demo_base_model):
    import json

    env = isolated_env(tmp_path, demo_base_model)
    ok = run("validate", env=env)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "PASSED" in ok.stdout

    rows = [
        {"prompt": f"Q{i}: say {w}", "completion": f" {w}<|endoftext|>"}
        for i, w in enumerate(["red", "green", "blue", "cyan", "pink", "gold", "gray", "teal"] * 3)
    ]
    rows[5] = dict(rows[4])  # a duplicate of the row on line 5, at line 6
    rows[9]["completion"] = " mail me at jane.doe@fastmail.com"  # not a reserved example.com address
    bad = tmp_path / "poisoned.jsonl"
    bad.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = run("validate", str(bad), "--json", env=env)
    assert out.returncode == 1
    report = json.loads(out.stdout)
    failing = {e["name"]: e["failing_example_ids"] for e in report["expectations"] if not e["success"]}
    assert any("poisoned.jsonl:6" in ids for ids in failing.values()), failing
    assert any("poisoned.jsonl:10" in ids for ids in failing.values()), failing


def test_registry_history_and_rollback_verbs(tmp_path):
    import json
    import os

    import mlflow

    from tuneloop.config import load_config
    from tuneloop.registry import ModelRegistry
    from tuneloop.tracking import setup_mlflow

    env = {k: v for k, v in os.environ.items() if not k.startswith("TUNELOOP")}
    env["TUNELOOP_HOME"] = str(tmp_path / "home")
    cfg = load_config(environ=env)
    setup_mlflow(cfg)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    registry = ModelRegistry.from_config(cfg)
    versions = []
    for _ in range(2):
        with mlflow.start_run() as run_:
            versions.append(registry.register(run_.info.run_id, model))
    registry.promote(versions[0], expected_champion=None, reason="first", actor="test", require_blessed=False)
    registry.promote(versions[1], expected_champion=versions[0], reason="second", actor="test", require_blessed=False)

    out = run("registry", "rollback", "--reason", "bad answers", env=env)
    assert out.returncode == 0, out.stderr
    assert f"champion is now version {versions[0]}" in out.stdout
    history = json.loads(run("registry", "history", "--json", env=env).stdout)
    assert [(h["action"], h["to_version"], h["reason"]) for h in history] == [
        ("promote", versions[0], "first"),
        ("promote", versions[1], "second"),
        ("rollback", versions[0], "bad answers"),
    ]
    table = run("registry", "history", env=env)
    assert "rollback" in table.stdout and "bad answers" in table.stdout

    # With no previous champion at all, rollback is a clear error, not a traceback.
    empty = dict(env, TUNELOOP_HOME=str(tmp_path / "empty"))
    none = run("registry", "rollback", env=empty)
    assert none.returncode == 1 and "no previous champion" in none.stderr and "Traceback" not in none.stderr


@pytest.mark.slow
def test_train_with_bad_rows_and_on_bad_rows_fail_is_a_clear_error(tmp_path, demo_base_model):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
        '{"messages": [{"role": "robot", "content": "hi"}]}\nnot json\n'
    )
    env = isolated_env(tmp_path, demo_base_model)
    env["TUNELOOP__DATA__ON_BAD_ROWS"] = "fail"
    out = run("train", "--data", str(bad), env=env)
    assert out.returncode == 1
    last = out.stderr[out.stderr.rindex("error:") :]
    assert "bad.jsonl:2: messages[0]: unknown role 'robot'" in last
    assert "bad.jsonl:3: invalid JSON" in last
    assert "nothing was trained or promoted" in last
    assert not (tmp_path / "home" / "runs").exists()


def test_prefect_runs_offline_without_telemetry_unless_asked(monkeypatch):
    """The ephemeral Prefect server's telemetry row raced the flows' writes on its SQLite
    database (`database is locked` in `make demo`): the CLI turns analytics off by default
    (measured: no TELEMETRY_SESSION row in the ephemeral database afterwards) and leaves a
    user's own setting alone."""
    from tuneloop.cli import _use_prefect
    from tuneloop.config import load_config

    cfg = load_config(None, environ={})
    monkeypatch.setattr(os, "environ", {})  # what _use_prefect sets stays inside this test
    _use_prefect(cfg)
    assert os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] == "false"
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "true"
    _use_prefect(cfg)
    assert os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] == "true"
