"""Fine-tuning's real jobs on a tiny bootstrapped model: the real launchers (deepspeed,
torchrun) with 2 processes over gloo on CPU, resuming after a kill, ZeRO-1/2/3, LoRA merged
into a plain model, a failed job's log, early stopping that keeps the best checkpoint. The
task (tests/support/training.py) is small and learnable. The plan they run (candidates, the
auto recipe): tests/unit/test_training.py.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.support import ROOT
from tests.support.training import sentiment_dataset, sentiment_examples, write_jsonl
from tuneloop.config import BootstrapConfig, TrainingConfig
from tuneloop.data.schema import Example
from tuneloop.training import TrainingError, TrainSpec, launch_training
from tuneloop.training.launch import start_training

ZERO = ROOT / "configs" / "deepspeed"


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> str:
    """A 150k-parameter GPT-2 with a ChatML template, untrained (a few seconds to build)."""
    from tuneloop.bootstrap import bootstrap_base_model

    cfg = BootstrapConfig(vocab_size=512, context_length=256, n_layer=2, n_embd=64, n_head=2, steps=0, block_size=64)
    return str(bootstrap_base_model(cfg, tmp_path_factory.mktemp("base") / "tiny", progress=False))


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory) -> Path:
    return sentiment_dataset(tmp_path_factory.mktemp("dataset"))


def make_spec(
    name: str,
    base_model: str,
    dataset_dir: Path,
    out: Path,
    *,
    deepspeed: str | None,
    num_processes: int,
    launcher: str = "torchrun",
    **training,
) -> TrainSpec:
    cfg = TrainingConfig(
        **{"per_device_batch_size": 8, "logging_steps": 5, "learning_rate": 3e-3, "warmup_ratio": 0.0, **training}
    )
    return TrainSpec(
        name=name,
        base_model=base_model,
        train_path=str(dataset_dir / "train.jsonl"),
        eval_path=str(dataset_dir / "eval.jsonl"),
        output_dir=str(out / name),
        training=cfg.model_dump(mode="json"),
        deepspeed_config=str(ZERO / f"{deepspeed}.json") if deepspeed else None,
        num_processes=num_processes,
        launcher=launcher,
    )


def greedy_answers(model_dir: Path, examples: list[Example]) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tuneloop.formatting import clean_completion, prompt_ids

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    answers = []
    for ex in examples:
        ids = torch.tensor([prompt_ids(ex, tokenizer)])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=8,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
        answers.append(clean_completion(tokenizer.decode(out[0, ids.shape[1] :]), tokenizer))
    return answers


def accuracy(model_dir: Path, examples: list[Example]) -> float:
    answers = greedy_answers(model_dir, examples)
    return sum(a == ex.completion for a, ex in zip(answers, examples)) / len(examples)


def read_tensors(model_dir: Path | str) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(model_dir) / "model.safetensors"))


# ---------------------------------------------------------------------------------------
# real jobs


@pytest.mark.slow
@pytest.mark.distributed
def test_zero2_job_killed_midway_resumes_and_learns(tmp_path, base_model, dataset_dir):
    """DeepSpeed launcher, 2 processes, ZeRO-2: SIGKILL after the first checkpoint, relaunch."""
    spec = make_spec(
        "zero2",
        base_model,
        dataset_dir,
        tmp_path,
        deepspeed="zero2",
        num_processes=2,
        launcher="deepspeed",
        max_steps=60,
        save_steps=10,
        logging_steps=10,
    )

    job = start_training(spec)
    first_run: list[str] = []
    reader = threading.Thread(target=lambda: first_run.extend(job.proc.stdout), daemon=True)
    reader.start()  # keep the pipe drained or the job blocks on a full pipe
    deadline = time.time() + 300
    while not list(spec.checkpoints_dir.glob("checkpoint-*/trainer_state.json")):
        assert job.proc.poll() is None, "job ended before its first checkpoint:\n" + "".join(first_run[-30:])
        assert time.time() < deadline, "no checkpoint within 300 s"
        time.sleep(0.05)
    os.killpg(job.proc.pid, signal.SIGKILL)  # the whole launcher group, like a lost machine
    job.proc.wait()
    reader.join(timeout=10)
    job.release_shared_memory()
    assert not spec.result_path.exists() and not spec.model_dir.exists(), "the job finished before the kill"

    lines: list[str] = []
    result = launch_training(spec, on_log=lines.append).train_result

    assert result["resumed_from"] and result["resumed_from"].startswith("checkpoint-")
    assert any(f"resuming from {result['resumed_from']}" in line for line in lines)
    assert result["global_step"] == 60
    assert result["num_processes"] == 2 and result["zero_stage"] == 2 and result["launcher"] == "deepspeed"
    # history spans both launches: the first entries come from the killed run's checkpoint
    assert result["loss_history"][0][0] == 10 and result["loss_history"][-1][0] == 60
    assert result["eval_loss"] < 0.2 * result["eval_loss_before"]
    assert result["tokens_per_second"] > 0 and result["train_tokens"] > 0
    assert not spec.checkpoints_dir.exists()  # deleted once the model is saved
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{job.port}_*"))

    eval_examples = sentiment_examples(32, seed=1)[:12]
    assert accuracy(spec.model_dir, eval_examples) >= 0.9


@pytest.mark.slow
@pytest.mark.distributed
def test_zero3_torchrun_job_saves_a_loadable_model(tmp_path, base_model, dataset_dir):
    """torchrun, 2 processes, ZeRO-3 (weights partitioned) with activation checkpointing."""
    spec = make_spec(
        "zero3",
        base_model,
        dataset_dir,
        tmp_path,
        deepspeed="zero3",
        num_processes=2,
        launcher="torchrun",
        max_steps=20,
        save_steps=20,
        gradient_checkpointing=True,
    )
    result = launch_training(spec, on_log=lambda line: None)

    assert result.train_result["zero_stage"] == 3 and result.train_result["num_processes"] == 2
    assert result.train_result["eval_loss"] < result.train_result["eval_loss_before"]
    base, tuned = read_tensors(base_model), read_tensors(result.model_dir)
    # ZeRO-3 without gathering would save empty tensors: every weight is whole, and trained
    assert {k: v.shape for k, v in tuned.items()} == {k: v.shape for k, v in base.items()}
    assert any(not (tuned[k] == base[k]).all() for k in base)
    assert all(isinstance(a, str) for a in greedy_answers(result.model_dir, sentiment_examples(2, seed=3)))


@pytest.mark.slow
def test_lora_job_saves_merged_plain_model(tmp_path, base_model, dataset_dir):
    """One process, no DeepSpeed, LoRA on the attention projection, merged at the end."""
    spec = make_spec(
        "lora",
        base_model,
        dataset_dir,
        tmp_path,
        deepspeed=None,
        num_processes=1,
        method="lora",
        lora={"r": 8, "alpha": 16, "target_modules": ["c_attn"]},
        learning_rate=1e-2,
        max_steps=20,
        save_steps=20,
    )
    result = launch_training(spec, on_log=lambda line: None)

    assert result.train_result["method"] == "lora" and result.train_result["num_processes"] == 1
    assert result.train_result["eval_loss"] < result.train_result["eval_loss_before"]
    base, merged = read_tensors(base_model), read_tensors(result.model_dir)
    assert set(merged) == set(base)  # a plain GPT-2 checkpoint: no lora_A/lora_B, no peft needed
    changed = {k for k in base if not (merged[k] == base[k]).all()}
    assert changed and all("c_attn" in k for k in changed)  # only the adapted projection moved
    assert (Path(spec.output_dir) / "adapter" / "adapter_config.json").is_file()
    assert result.train_result["adapter_dir"] == str(Path(spec.output_dir) / "adapter")  # an adapter-only version
    assert result.train_result["objective"] == "sft"
    assert all(isinstance(a, str) for a in greedy_answers(result.model_dir, sentiment_examples(2, seed=3)))


@pytest.mark.slow
def test_failed_job_raises_with_the_end_of_its_log(tmp_path, base_model, dataset_dir):
    spec = make_spec("broken", base_model, dataset_dir, tmp_path, deepspeed=None, num_processes=1, max_steps=2)
    spec.train_path = str(tmp_path / "missing.jsonl")
    with pytest.raises(TrainingError) as err:
        launch_training(spec, on_log=lambda line: None)
    assert "exit code 1" in str(err.value) and "missing.jsonl: file not found" in str(err.value)


@pytest.mark.slow
@pytest.mark.distributed
def test_zero1_deepspeed_job_learns(tmp_path, base_model, dataset_dir):
    """The shipped ZeRO-1 config (optimizer states partitioned) on 2 processes, deepspeed launcher."""
    spec = make_spec(
        "zero1",
        base_model,
        dataset_dir,
        tmp_path,
        deepspeed="zero1",
        num_processes=2,
        launcher="deepspeed",
        max_steps=20,
        save_steps=20,
    )
    result = launch_training(spec, on_log=lambda line: None)

    assert result.train_result["zero_stage"] == 1 and result.train_result["num_processes"] == 2
    assert result.train_result["eval_loss"] < result.train_result["eval_loss_before"]
    assert all(isinstance(a, str) for a in greedy_answers(result.model_dir, sentiment_examples(2, seed=3)))


# ---------------------------------------------------------------------------------------
# early stopping and the best checkpoint


def memorisation_examples(n: int, seed: int) -> list[Example]:
    """Codes with answers drawn at random: nothing to learn but the answer words, so a model
    that goes on memorising the train rows gets worse on others (its eval loss rises)."""
    rng = random.Random(seed)
    words = "red blue green amber violet silver".split()
    out = []
    for i in range(n):
        code = "".join(rng.choice("abcdefghjkmnpqrstuvwxyz") for _ in range(6))
        answer = rng.choice(words)
        out.append(
            Example(
                example_id=f"code:{seed}:{i}",
                completion=answer,
                messages=[
                    {"role": "user", "content": f"Colour of code {code}?"},
                    {"role": "assistant", "content": answer},
                ],
            )
        )
    return out


@pytest.mark.slow
def test_early_stopping_keeps_the_checkpoint_with_the_lowest_eval_loss(tmp_path, base_model):
    d = tmp_path / "data"
    d.mkdir()
    write_jsonl(d / "train.jsonl", memorisation_examples(16, seed=0))
    write_jsonl(d / "eval.jsonl", memorisation_examples(48, seed=1))
    spec = make_spec(
        "stop",
        base_model,
        d,
        tmp_path,
        deepspeed=None,
        num_processes=1,
        learning_rate=1e-2,
        max_steps=200,
        save_steps=5,
        per_device_batch_size=8,
        early_stopping={"patience": 3, "keep_best": True},
    )
    result = launch_training(spec, on_log=lambda line: None).train_result

    history = dict((int(step), loss) for step, loss in result["eval_loss_history"])
    assert result["stopped_early"] and result["global_step"] < 200, result
    best = result["best_step"]
    assert best is not None and best < result["global_step"]
    assert result["best_eval_loss"] == pytest.approx(history[best])
    assert result["best_eval_loss"] < result["last_eval_loss"] == pytest.approx(history[result["global_step"]])
    assert any(f"kept checkpoint: step {best}" in note for note in result["notes"]), result["notes"]
    # the saved model is the kept checkpoint: its eval loss is the best one, not the last
    from tuneloop.config import EvaluationConfig
    from tuneloop.evaluation import evaluate_model

    ev = [Example.from_dict(json.loads(line)) for line in (d / "eval.jsonl").read_text().splitlines()]
    saved = evaluate_model(result["model_dir"], ev, EvaluationConfig(max_new_tokens=2), progress=False)
    assert saved.metrics["eval_loss"] == pytest.approx(result["best_eval_loss"], rel=0.02)
    assert saved.metrics["eval_loss"] < result["last_eval_loss"]
