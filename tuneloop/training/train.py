"""One process of a training job: `python -m tuneloop.training.train --spec SPEC.json`.

Started by tuneloop/training/launch.py, once per rank (torchrun or the deepspeed
launcher) or alone. Reads the TrainSpec, fine-tunes the base model on the normalised
examples with the Hugging Face Trainer and writes, into spec.output_dir:

    checkpoints/checkpoint-N/   every save_steps (the last two kept, deleted on success)
    model/                      the fine-tuned model + tokenizer, a plain HF folder
                                (LoRA weights merged in), written by rank 0
    adapter/                    LoRA runs: the adapter alone (train_result's adapter_dir)
    train_result.json           loss history, eval loss, throughput, how it ran

If checkpoints/ already holds a complete checkpoint the run resumes from the newest one.
training.objective sft: the loss is taken on completion tokens only
(tuneloop.formatting.encode_example masks the prompt). dpo: preference pairs, TRL's
DPOTrainer (tuneloop/training/dpo.py); its loss history is the DPO loss.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from tuneloop.data.dataset import read_examples as read_dataset
from tuneloop.data.formats import DataError
from tuneloop.formatting import IGNORE_INDEX, encode_example
from tuneloop.training.dpo import REWARD_METRICS, dpo_arguments, dpo_result, dpo_trainer, encode_pairs
from tuneloop.training.launch import TrainingError, TrainSpec

CHECKPOINT_PREFIX = "checkpoint-"


def log(msg: str) -> None:
    """Print from rank 0 only: the launcher merges every rank's output into one stream."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[train] {msg}", flush=True)


# ---------------------------------------------------------------------------------------
# data


def read_examples(path: str):
    try:
        return read_dataset(path)
    except DataError as exc:
        raise TrainingError(str(exc)) from None


def encode_all(examples, tokenizer, max_length: int, what: str) -> list[dict[str, list[int]]]:
    """Encode examples; drop (and count, loudly) those with nothing left to learn."""
    rows, empty = [], []
    for ex in examples:
        if ex.is_preference:  # supervised tuning would learn the chosen answers alone, silently
            raise TrainingError(
                f"{what} example {ex.example_id} is a preference pair (OpenAI's DPO format): "
                "train it with training.objective dpo"
            )
        try:
            row = encode_example(ex, tokenizer, max_length)
        except ValueError as exc:  # a chat template that cannot mark the answer
            raise TrainingError(f"{what} example {ex.example_id}: {exc}") from None
        if all(t == IGNORE_INDEX for t in row["labels"]):
            empty.append(ex.example_id)  # the prompt alone fills max_length
        else:
            rows.append(row)
    if empty:
        log(
            f"WARNING: {len(empty)} {what} examples dropped: prompt fills max_length={max_length} "
            f"so no completion token is left (first: {', '.join(empty[:3])})"
        )
    if not rows and examples:
        raise TrainingError(f"no {what} example has a completion token within max_length={max_length}")
    return rows


class PadCollator:
    """Right-pad a batch: input_ids with the pad token, attention_mask with 0, labels with -100."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, rows: list[dict[str, list[int]]]):
        import torch

        width = max(len(r["input_ids"]) for r in rows)
        pads = {"input_ids": self.pad_token_id, "attention_mask": 0, "labels": IGNORE_INDEX}
        return {
            key: torch.tensor([r[key] + [pad] * (width - len(r[key])) for r in rows], dtype=torch.long)
            for key, pad in pads.items()
        }


# ---------------------------------------------------------------------------------------
# how to run: precision, DeepSpeed, distributed state


def resolve_precision(precision: str) -> str:
    """auto: bf16 on a GPU that has it, else fp32 (bf16 on CPUs without AMX is slower, fp16 unsupported)."""
    import torch

    if precision != "auto":
        return precision
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16"
    return "fp32"


def load_deepspeed_config(path: str | None, on_gpu: bool) -> dict[str, Any] | None:
    if not path:
        return None
    try:
        ds = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise TrainingError(f"{path}: cannot read DeepSpeed config ({exc})") from None
    zero = ds.setdefault("zero_optimization", {})
    if zero.get("offload_optimizer") and not on_gpu:
        # Else accelerate swaps in DeepSpeedCPUAdam, a JIT-compiled op (minutes to build).
        ds.setdefault("zero_force_ds_cpu_optimizer", False)
    if zero.get("stage") == 3:
        # Without it ZeRO-3 saves empty (partitioned) weights: no loadable model.
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    return ds


def setup_distributed(deepspeed: dict | None, on_gpu: bool) -> dict[str, Any]:
    """Extra TrainingArguments so every rank agrees on the process group."""
    if deepspeed is not None and not on_gpu:
        # On CPU accelerate would build its state without a backend and count one process
        # (train_batch_size mismatch). Build it here, for DeepSpeed over gloo.
        from accelerate import PartialState

        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(backend="gloo")
        del os.environ["ACCELERATE_USE_DEEPSPEED"]
        return {"accelerator_config": {"use_configured_state": True}}
    if not on_gpu and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return {"ddp_backend": "gloo"}
    return {}  # GPUs: NCCL, the default


def last_checkpoint(checkpoints_dir: Path) -> Path | None:
    """Newest checkpoint that was written completely (trainer_state.json is written last)."""
    if not checkpoints_dir.is_dir():
        return None
    done = [
        p
        for p in checkpoints_dir.iterdir()
        if p.name.startswith(CHECKPOINT_PREFIX)
        and p.name[len(CHECKPOINT_PREFIX) :].isdigit()
        and (p / "trainer_state.json").is_file()
    ]
    return max(done, key=lambda p: int(p.name[len(CHECKPOINT_PREFIX) :]), default=None)


# ---------------------------------------------------------------------------------------
# progress and throughput


def make_callbacks(max_steps: int):
    from transformers import TrainerCallback

    class Progress(TrainerCallback):
        """One compact line per logging step, instead of progress bars in a piped log."""

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not state.is_world_process_zero or not logs:
                return
            keys = ("loss", "eval_loss", "learning_rate", "grad_norm") + tuple(k for k, _ in REWARD_METRICS)
            shown = {k: v for k, v in logs.items() if k in keys}
            if shown:
                parts = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items()]
                print(f"[train] step {state.global_step}/{max_steps} " + " ".join(parts), flush=True)

    class Throughput(TrainerCallback):
        """Tokens/s inside optimizer steps (forward, backward, update), first step excluded.

        Start-up, evaluation and checkpoint writing are left out: they do not scale with
        the number of processes the way the steps do, and would swamp a short run.
        """

        def __init__(self):
            self.steps_seen = 0
            self.seconds = 0.0
            self.tokens = 0
            self._begin: tuple[float, int] = (0.0, 0)

        def on_step_begin(self, args, state, control, **kwargs):
            self._begin = (time.perf_counter(), int(state.num_input_tokens_seen))

        def on_step_end(self, args, state, control, **kwargs):
            self.steps_seen += 1
            if self.steps_seen > 1:  # the first step pays for lazy init and warm-up
                self.seconds += time.perf_counter() - self._begin[0]
                self.tokens += int(state.num_input_tokens_seen) - self._begin[1]

        def tokens_per_second(self) -> float | None:
            return self.tokens / self.seconds if self.seconds > 0 else None

    return Progress(), Throughput()


# ---------------------------------------------------------------------------------------
# the job


def train(spec: TrainSpec) -> dict[str, Any] | None:
    """Run this rank's part of the job; rank 0 returns the train_result it wrote."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments
    from transformers.trainer_callback import PrinterCallback
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # loading/saving bars: noise in a piped, merged log
    started = time.time()
    cfg = spec.config
    on_gpu = torch.cuda.is_available()
    precision = resolve_precision(cfg.precision)
    deepspeed = load_deepspeed_config(spec.deepspeed_config, on_gpu)
    zero_stage = deepspeed["zero_optimization"].get("stage", 0) if deepspeed else None
    distributed = setup_distributed(deepspeed, on_gpu)
    resume = last_checkpoint(spec.checkpoints_dir)

    tokenizer = AutoTokenizer.from_pretrained(spec.base_model)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # padding is masked out, any id works
    dpo = cfg.objective == "dpo"
    if dpo:
        train_rows = encode_pairs(read_examples(spec.train_path), tokenizer, cfg.max_length, "train", log)
        eval_rows = (
            encode_pairs(read_examples(spec.eval_path), tokenizer, cfg.max_length, "eval", log)
            if spec.eval_path
            else []
        )
    else:
        train_rows = encode_all(read_examples(spec.train_path), tokenizer, cfg.max_length, "train")
        eval_rows = (
            encode_all(read_examples(spec.eval_path), tokenizer, cfg.max_length, "eval") if spec.eval_path else []
        )
    log(
        f"{spec.name}: {len(train_rows)} train / {len(eval_rows)} eval {'pairs' if dpo else 'examples'}, "
        f"{cfg.method} {'preference (DPO) ' if dpo else ''}fine-tuning, "
        f"{spec.num_processes} process(es), ZeRO stage {zero_stage if deepspeed else '- (no DeepSpeed)'}, {precision}"
        + (f", resuming from {resume.name}" if resume else "")
    )

    has_eval = bool(eval_rows)
    stopping = cfg.early_stopping
    keep_best = has_eval and stopping.keep_best
    if not has_eval and (stopping.keep_best or stopping.patience):
        log(f"{spec.name}: no eval split: early stopping and keep_best are off")
    # TrainingArguments before the model: with ZeRO-3 it makes from_pretrained partition weights.
    common = dict(
        output_dir=str(spec.checkpoints_dir),
        max_steps=cfg.max_steps,
        per_device_train_batch_size=cfg.per_device_batch_size,
        per_device_eval_batch_size=cfg.per_device_batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        learning_rate=cfg.learning_rate,
        warmup_steps=cfg.warmup_ratio,  # a float < 1 is a fraction of max_steps
        weight_decay=cfg.weight_decay,
        lr_scheduler_type="linear",
        logging_steps=cfg.logging_steps,
        save_strategy="steps",
        save_steps=cfg.save_steps,
        save_total_limit=2,
        eval_strategy="steps" if has_eval else "no",
        eval_steps=cfg.save_steps,
        eval_on_start=has_eval,  # the eval loss before any update: the baseline of this run
        activation_checkpointing=cfg.gradient_checkpointing,
        activation_checkpointing_kwargs={"use_reentrant": False} if cfg.gradient_checkpointing else None,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        use_cpu=not on_gpu,
        deepspeed=deepspeed,
        include_num_input_tokens_seen="non_padding",
        ddp_find_unused_parameters=False,
        dataloader_num_workers=0,
        seed=cfg.seed,
        report_to="none",  # the flow logs train_result.json to MLflow
        disable_tqdm=True,  # bars make noise in a piped log; Progress prints a line per log step
        save_only_model=False,  # optimizer + scheduler + RNG too: a resumed run continues exactly
        # training.early_stopping: the checkpoint with the lowest eval loss becomes the model
        # (kept besides the last two); early stopping needs it.
        load_best_model_at_end=keep_best or bool(has_eval and stopping.patience),
        metric_for_best_model="eval_loss" if has_eval else None,
        greater_is_better=False if has_eval else None,
        **distributed,
    )
    args = dpo_arguments(cfg, common) if dpo else TrainingArguments(**common)

    model = AutoModelForCausalLM.from_pretrained(spec.base_model, dtype=torch.float32)
    lora = None
    if cfg.method == "lora":
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=cfg.lora.r,
            lora_alpha=cfg.lora.alpha,
            lora_dropout=cfg.lora.dropout,
            target_modules=cfg.lora.target_modules,
            task_type="CAUSAL_LM",
        )
        if not dpo:  # DPOTrainer wraps the model itself: its reference is the adapter disabled
            model = get_peft_model(model, lora)
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            total = sum(p.numel() for p in model.parameters())
            log(f"LoRA r={cfg.lora.r}: {trainable:,} of {total:,} parameters trainable")

    progress, throughput = make_callbacks(cfg.max_steps)
    callbacks = [progress, throughput]
    if has_eval and stopping.patience:
        from transformers import EarlyStoppingCallback

        callbacks.append(
            EarlyStoppingCallback(
                early_stopping_patience=stopping.patience, early_stopping_threshold=stopping.min_delta
            )
        )
    if dpo:
        trainer = dpo_trainer(model, args, train_rows, eval_rows, tokenizer, lora, callbacks)
        if lora is not None:
            trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
            total = sum(p.numel() for p in trainer.model.parameters())
            log(f"LoRA r={cfg.lora.r}: {trainable:,} of {total:,} parameters trainable")
    else:
        trainer = Trainer(
            model=model,
            args=args,
            train_dataset=train_rows,
            eval_dataset=eval_rows or None,
            data_collator=PadCollator(tokenizer.pad_token_id),
            processing_class=tokenizer,
            callbacks=callbacks,
        )
    trainer.remove_callback(PrinterCallback)

    output = trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    history = trainer.state.log_history
    last_eval_step = max((h["step"] for h in history if "eval_loss" in h), default=None)
    final_eval = None
    best_step = best_loss = last_loss = None
    if has_eval:
        last_loss = (
            next(h["eval_loss"] for h in reversed(history) if "eval_loss" in h)
            if last_eval_step == trainer.state.global_step
            else trainer.evaluate()["eval_loss"]
        )
        final_eval = last_loss
        if args.load_best_model_at_end and trainer.state.best_model_checkpoint:
            best_step = int(Path(trainer.state.best_model_checkpoint).name.rsplit("-", 1)[-1])
            best_loss = float(trainer.state.best_metric)
            final_eval = best_loss  # the weights now in the trainer: the best checkpoint's

    save_model(trainer, spec, tokenizer)
    trainer.accelerator.wait_for_everyone()
    if not trainer.is_world_process_zero():
        return None

    history = trainer.state.log_history
    eval_history = [[h["step"], h["eval_loss"]] for h in history if "eval_loss" in h]
    notes = list(spec.notes)
    stopped_early = bool(stopping.patience and has_eval and trainer.state.global_step < cfg.max_steps)
    if stopped_early:
        notes.append(
            f"early stopping at step {trainer.state.global_step} of {cfg.max_steps}: "
            f"{stopping.patience} evaluations without a lower eval loss"
        )
    if best_step is not None:
        notes.append(
            f"kept checkpoint: step {best_step} (eval loss {best_loss:.4g}; the last evaluation, "
            f"step {eval_history[-1][0] if eval_history else '?'}, had {last_loss:.4g})"
        )
    result = {
        "name": spec.name,
        "base_model": spec.base_model,
        "method": cfg.method,
        "objective": cfg.objective,
        "overrides": spec.overrides,
        "loss_history": [[h["step"], h["loss"]] for h in history if "loss" in h],
        "eval_loss_history": eval_history,
        "eval_loss_before": next((loss for step, loss in eval_history if step == 0), None),
        "eval_loss": final_eval,  # of the model saved: the best checkpoint's when keep_best
        "best_step": best_step,  # keep_best: the step of the checkpoint that became the model
        "best_eval_loss": best_loss,
        "last_eval_loss": last_loss,  # at the run's last step, whatever was kept
        "stopped_early": stopped_early,
        "notes": notes,
        "train_loss": output.training_loss,  # mean over this launch's steps
        "global_step": trainer.state.global_step,
        "train_tokens": int(trainer.state.num_input_tokens_seen),
        "tokens_per_second": throughput.tokens_per_second(),
        "train_runtime_s": output.metrics.get("train_runtime"),
        "runtime_s": round(time.time() - started, 2),
        "num_processes": trainer.args.world_size,
        "launcher": spec.launcher if spec.num_processes > 1 else "none",
        "deepspeed": deepspeed is not None,
        "zero_stage": zero_stage,
        "precision": precision,
        "device": "cuda" if on_gpu else "cpu",
        "resumed_from": resume.name if resume else None,
        "model_dir": str(spec.model_dir),
        # LoRA: the adapter alone, beside the merged model (an adapter-only model version)
        "adapter_dir": str(adapter_dir(spec)) if cfg.method == "lora" else None,
        **(dpo_result(history, cfg) if dpo else {}),
    }
    tmp = spec.result_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(spec.result_path)
    # The model is saved: checkpoints only cost disk now (optimizer state is ~2x the model).
    shutil.rmtree(spec.checkpoints_dir, ignore_errors=True)
    log(
        f"{spec.name}: done in {result['runtime_s']:.0f}s, eval loss {result['eval_loss_before']} -> "
        f"{result['eval_loss']}, {result['tokens_per_second'] or 0:.0f} tokens/s, model in {spec.model_dir}"
    )
    return result


def adapter_dir(spec: TrainSpec) -> Path:
    """Where a LoRA run keeps its adapter (peft's adapter_config.json + weights)."""
    return Path(spec.output_dir) / "adapter"


def save_model(trainer, spec: TrainSpec, tokenizer) -> None:
    """Write spec.model_dir as a plain HF folder. Every rank calls this (ZeRO-3 gathers)."""
    model_dir = spec.model_dir
    if model_dir.exists() and trainer.is_world_process_zero():
        shutil.rmtree(model_dir)  # a previous, failed attempt's leftovers
    if spec.config.method != "lora":
        trainer.model.config.use_cache = True  # gradient checkpointing turned it off; generation wants it
        trainer.save_model(str(model_dir))
        return
    # LoRA: save the adapter (gathered across ranks), then merge it into a fresh copy of the
    # base on rank 0, so serving and evaluation never need peft.
    adapter = adapter_dir(spec)
    trainer.save_model(str(adapter))
    trainer.accelerator.wait_for_everyone()
    if not trainer.is_world_process_zero():
        return
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()  # else from_pretrained would partition the base for ZeRO-3
    base = AutoModelForCausalLM.from_pretrained(spec.base_model, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
    merged.config.use_cache = True
    merged.save_pretrained(str(model_dir))
    tokenizer.save_pretrained(str(model_dir))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, help="TrainSpec JSON written by launch.py")
    # The deepspeed launcher passes --local_rank=N; torchrun sets LOCAL_RANK instead.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None)
    args = parser.parse_args(argv)
    # torch's own collectives, called by DeepSpeed, warn about their renaming on every step.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    try:
        train(TrainSpec.load(args.spec))
    except TrainingError as exc:
        print(f"[train] error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
