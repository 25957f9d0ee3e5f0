"""Preference tuning's real jobs (training.objective dpo, TRL's DPOTrainer): the sentiment task
as OpenAI DPO pairs (the right label preferred), loaded through the data contract, and scored on
held-out pairs whose prompts no training or eval pair has (as the prepared dataset's split by
prompt guarantees). A LoRA run in one process on the demo base model raises the preference win
rate well above the base model's and keeps its adapter beside the merged model; a full run of
an untrained tiny GPT-2 on 2 processes (torchrun, gloo, ZeRO-3) trains against a frozen
reference copy. (LoRA on an untrained model's frozen random weights learns the train prompts,
not the task: 0.58 -> 0.70 on held-out pairs at best, so the LoRA run starts from the demo's
pre-trained base.) The data and the win rate alone: tests/unit/test_dpo.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support import ROOT
from tests.support.training import sentiment_preference_rows, write_jsonl
from tuneloop.config import BootstrapConfig, TrainingConfig
from tuneloop.data.formats import load_file
from tuneloop.data.schema import Example
from tuneloop.preference import preference_win_rate
from tuneloop.training import TrainSpec, launch_training

ZERO = ROOT / "configs" / "deepspeed"


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> str:
    """A 150k-parameter GPT-2 with a ChatML template, untrained (as test_training_jobs.py's)."""
    from tuneloop.bootstrap import bootstrap_base_model

    cfg = BootstrapConfig(vocab_size=512, context_length=256, n_layer=2, n_embd=64, n_head=2, steps=0, block_size=64)
    return str(bootstrap_base_model(cfg, tmp_path_factory.mktemp("base") / "tiny", progress=False))


def pairs(folder: Path, name: str, n: int, seed: int) -> list[Example]:
    """n sentiment pairs written in OpenAI's DPO format, read back through the loader."""
    path = folder / f"{name}.dpo.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in sentiment_preference_rows(n, seed)))
    result = load_file(path)
    assert result.format == "dpo" and not result.rejects
    return result.examples


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> tuple[Path, list[Example]]:
    """(a prepared-dataset folder: 256 train pairs, 32 eval pairs; held-out pairs whose prompts
    are in neither)."""
    folder = tmp_path_factory.mktemp("pairs")
    train, eval = pairs(folder, "train", 256, seed=0), pairs(folder, "eval", 32, seed=1)
    write_jsonl(folder / "train.jsonl", train)
    write_jsonl(folder / "eval.jsonl", eval)
    seen = {e.prompt_hash for e in train + eval}
    held_out = [e for e in pairs(folder, "held-out", 120, seed=2) if e.prompt_hash not in seen]
    assert len(held_out) >= 40
    return folder, held_out


def make_spec(
    name: str, base_model: str, folder: Path, out: Path, *, deepspeed: str | None, num_processes: int, **training
) -> TrainSpec:
    cfg = TrainingConfig(
        **{
            "objective": "dpo",
            "per_device_batch_size": 8,
            "logging_steps": 5,
            "warmup_ratio": 0.0,
            "max_steps": 30,
            "save_steps": 30,
            **training,
        }
    )
    return TrainSpec(
        name=name,
        base_model=base_model,
        train_path=str(folder / "train.jsonl"),
        eval_path=str(folder / "eval.jsonl"),
        output_dir=str(out / name),
        training=cfg.model_dump(mode="json"),
        deepspeed_config=str(ZERO / f"{deepspeed}.json") if deepspeed else None,
        num_processes=num_processes,
        launcher="torchrun",
    )


@pytest.mark.slow
def test_a_dpo_lora_job_raises_the_preference_win_rate_on_held_out_pairs(tmp_path, demo_base_model, dataset):
    folder, held_out = dataset
    base_model = str(demo_base_model)
    spec = make_spec(
        "dpo-lora",
        base_model,
        folder,
        tmp_path,
        deepspeed=None,
        num_processes=1,
        method="lora",
        lora={"r": 16, "alpha": 32, "target_modules": ["c_attn", "c_fc", "c_proj"]},
        learning_rate=3e-3,
        max_steps=60,
        save_steps=60,
        logging_steps=10,
    )
    result = launch_training(spec, on_log=lambda line: None)
    r = result.train_result

    before = preference_win_rate(base_model, held_out)
    after = preference_win_rate(result.model_dir, held_out)
    print(
        f"\npreference win rate on {len(held_out)} held-out pairs: base {before['preference_win_rate']:.3f} "
        f"(margin {before['preference_margin']:.3f}) -> DPO LoRA {after['preference_win_rate']:.3f} "
        f"(margin {after['preference_margin']:.3f}); {r['global_step']} steps in {r['train_runtime_s']:.1f} s"
    )
    assert after["preference_win_rate"] >= before["preference_win_rate"] + 0.25
    assert after["preference_win_rate"] >= 0.85 and after["preference_margin"] > before["preference_margin"]

    assert r["objective"] == "dpo" and r["method"] == "lora" and r["dpo"] == {"beta": 0.1, "loss_type": "sigmoid"}
    assert [step for step, _ in r["loss_history"]] == [10, 20, 30, 40, 50, 60]  # supervised tuning's shape
    assert r["eval_loss"] < r["eval_loss_before"] == pytest.approx(0.6931, abs=1e-3)  # log 2: policy == reference
    assert len(r["rewards_accuracy_history"]) == 6 and r["eval_rewards_accuracy"] > 0.5
    # the adapter alone is kept and reported; scored by itself it is the merged model
    adapter = Path(r["adapter_dir"])
    assert adapter == Path(spec.output_dir) / "adapter" and (adapter / "adapter_config.json").is_file()
    assert preference_win_rate(adapter, held_out) == pytest.approx(after)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_full_dpo_job_on_two_processes_with_zero3(tmp_path, base_model, dataset):
    """torchrun, 2 processes over gloo, ZeRO-3: every weight trained against a frozen copy."""
    folder, held_out = dataset
    spec = make_spec(
        "dpo-full", base_model, folder, tmp_path, deepspeed="zero3", num_processes=2, learning_rate=3e-3, max_steps=60
    )
    r = launch_training(spec, on_log=lambda line: None).train_result

    assert r["num_processes"] == 2 and r["zero_stage"] == 3 and r["objective"] == "dpo"
    assert r["adapter_dir"] is None and r["eval_loss"] < r["eval_loss_before"]
    before = preference_win_rate(base_model, held_out)["preference_win_rate"]
    after = preference_win_rate(r["model_dir"], held_out)["preference_win_rate"]
    print(f"\nfull DPO, 2 processes: held-out win rate {before:.3f} -> {after:.3f}")
    assert after >= before + 0.25
