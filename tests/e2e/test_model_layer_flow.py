"""The whole model layer on real data (../shared/data/t0-amazon-polarity), through the CLI:
validate -> 2-process DeepSpeed fine-tune -> evaluate vs base and champion -> bless ->
promote -> package + infra-validate; a worse second run is not promoted; a poisoned
dataset stops the flow before any training."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support import ROOT
from tuneloop.config import load_config
from tuneloop.registry import ModelRegistry

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
TUNELOOP = str(Path(sys.executable).parent / "tuneloop")


def write_config(path: Path, home: Path, base: Path, data: Path, **training) -> Path:
    config = {
        "paths": {"home": str(home)},
        "bootstrap": {"output_dir": str(base)},
        "data": {"train_path": str(data), "eval_fraction": 0.1, "seed": 0},
        # Reviews run to ~400 tokens (cut from the left to 256, templates that share a question
        # become duplicates: keep them whole); T0's rarest answer word holds 4.9% of rows.
        "validation": {"max_tokens": 512, "min_label_share": 0.02},
        "training": {
            "num_processes": 2,
            "launcher": "torchrun",
            "deepspeed_config": str(ROOT / "configs" / "deepspeed" / "zero2.json"),
            # 120 steps at 3e-3 reach exact match 0.42 (200 at 2e-3: 0.44; the bar is 0.3) in 40 s less
            "max_steps": 120,
            "per_device_batch_size": 8,
            "learning_rate": 3e-3,
            "max_length": 512,
            "save_steps": 1000,
            **training,
        },
        "evaluation": {"max_new_tokens": 4},
        "blessing": {
            "thresholds": [
                {
                    "metric": "exact_match",
                    "value_threshold": {"lower_bound": 0.3},
                    "change_threshold": {"direction": "higher_is_better", "absolute": 0.01},
                },
                {"metric": "eval_loss", "change_threshold": {"direction": "lower_is_better", "absolute": 0.0}},
            ]
        },
    }
    path.write_text(yaml.safe_dump(config))
    return path


def train(config: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TUNELOOP")}
    return subprocess.run(
        [TUNELOOP, "train", "--config", str(config), "--json", *extra],
        capture_output=True,
        text=True,
        timeout=1200,
        env=env,
        cwd=ROOT,
    )


def summary_of(out: subprocess.CompletedProcess) -> dict:
    assert out.returncode == 0, (out.stdout + out.stderr)[-5000:]
    return json.loads(out.stdout[out.stdout.index("{\n") :])


def test_fine_tune_bless_promote_then_refuse_a_worse_model(tmp_path, shared_data, demo_base_model):
    t0 = shared_data / "t0-amazon-polarity"
    home = tmp_path / "home"
    good = write_config(tmp_path / "good.yaml", home, demo_base_model, t0)

    first = summary_of(train(good))
    challenger = first["challenger"]["metrics"]
    assert challenger["exact_match"] > first["base"]["exact_match"] + 0.3, first
    assert challenger["eval_loss"] < first["base"]["eval_loss"]
    assert first["blessed"] and first["promoted"], first["reasons"]
    assert first["champion_before"] is None
    assert first["champion_after"] == first["challenger"]["version"]
    assert first["deployment"]["deployed"], first["deployment"]
    # Split by review (data.split_group_threshold): the nine templates of an eval review are
    # all in eval, so "beats its base" is measured on reviews the model never saw.
    manifest = json.loads((home / "datasets" / first["dataset_fingerprint"][:12] / "manifest.json").read_text())
    assert manifest["split"] == "hash of near-duplicate groups", manifest["split"]

    cfg = load_config(good, environ={})
    registry = ModelRegistry.from_config(cfg)
    champion = registry.champion()
    assert champion.version == first["challenger"]["version"]
    assert champion.tags["tuneloop.dataset_fingerprint"] == first["dataset_fingerprint"]
    assert champion.run_id  # the version points back to its training run

    # A second run that is not better (a few steps from the base) is scored against the
    # champion on the same eval set, registered as challenger, and not promoted.
    # (one process, no DeepSpeed: the worse model needs no distributed launch, the good one had it)
    worse = write_config(
        tmp_path / "worse.yaml", home, demo_base_model, t0, max_steps=3, num_processes=1, deepspeed_config=None
    )
    second = summary_of(train(worse))
    assert second["champion_before"] == first["champion_after"]
    assert not second["blessed"] and not second["promoted"]
    assert any("exact_match" in r for r in second["reasons"])
    assert registry.champion().version == first["challenger"]["version"]
    assert registry.challenger().version == second["challenger"]["version"]
    assert registry.version(second["challenger"]["version"]).tags["blessed"] == "false"
    assert [r.action for r in registry.history()] == ["promote"]

    # What it answered wrongly is in the run's report (MLflow), beside the base and the
    # champion, and the first wrong answers are in the summary the CLI prints.
    wrong = second["wrong_answers"]
    assert wrong and all(set(w) == {"id", "expected", "generated"} for w in wrong)
    import mlflow

    client = mlflow.MlflowClient(cfg.mlflow_tracking_uri)
    run_id = second["run_id"]
    listed = [a.path for a in client.list_artifacts(run_id, "report/predictions")]
    assert "report/predictions/cand-0.jsonl" in listed and "report/predictions/base.jsonl" in listed, listed
    assert any(p.startswith("report/predictions/champion") for p in listed), listed
    local = Path(client.download_artifacts(run_id, "report"))
    rows = [json.loads(line) for line in (local / "predictions" / "cand-0.jsonl").read_text().splitlines()]
    assert len(rows) == int(second["challenger"]["metrics"]["num_examples"])
    assert {r["id"] for r in rows if not r["label_match"]} >= {w["id"] for w in wrong}
    summary_md = (local / "summary.md").read_text()
    section = summary_md[summary_md.index("## Predictions") :]
    assert f"| {wrong[0]['id']}" in section and "champion" in section.split("\n| row |")[1].split("\n")[0]
    # the majority label beside the scores, on the same eval split
    assert 0 < second["challenger"]["metrics"]["majority_label"] <= 1


def test_poisoned_dataset_stops_before_training(tmp_path, demo_base_model):
    rows = [
        {"messages": [{"role": "user", "content": f"Say {w}"}, {"role": "assistant", "content": w}]}
        for w in ["alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "theta", "zeta", "iota"] * 2
    ]
    rows.append(
        {
            "messages": [
                {"role": "user", "content": "key?"},
                {"role": "assistant", "content": "sk-proj-Zx8Qw3Er5Ty7Ui9Op1As2Df4Gh6Jk8Lz"},
            ]
        }
    )
    data = tmp_path / "poisoned.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    home = tmp_path / "home"
    config = write_config(tmp_path / "c.yaml", home, demo_base_model, data)

    out = train(config)
    assert out.returncode == 1
    assert "validation failed" in out.stderr and "poisoned.jsonl:" in out.stderr
    assert not (home / "runs").exists()  # nothing trained
    cfg = load_config(config, environ={})
    assert ModelRegistry.from_config(cfg).champion() is None
