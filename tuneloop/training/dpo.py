"""Preference tuning (training.objective dpo) inside one training process: TRL's DPOTrainer on
the pairs of a prepared dataset (OpenAI's DPO format: prompt, chosen, rejected).

train.py runs it as it runs supervised tuning (the same launchers, DeepSpeed, checkpoints,
resuming, callbacks and saving); what differs is here:

- **Data.** Each pair is tokenised by tuneloop.formatting.encode_preference, the rendering
  the server and supervised tuning use (the chat template, tools in their format), into the
  columns TRL's collator takes (prompt_ids, chosen_ids, rejected_ids). TRL's own prompt
  extraction and tokenisation are skipped: they would render the answers another way (an
  eos appended after the template's own end-of-turn marker).
- **Reference model.** With LoRA the trainer gets the adapter's config and wraps the model
  itself, so the reference is the same weights with the adapter disabled: no second copy.
  Full fine-tuning loads a frozen copy of the starting model (TRL prepares it for DeepSpeed).
- **Loss.** training.dpo: beta and loss_type (sigmoid: DPO's; ipo; hinge), the policy's
  summed log-probability of each answer against the reference's.
"""

from __future__ import annotations

from typing import Any

from tuneloop.formatting import encode_preference
from tuneloop.training.launch import TrainingError

# What DPOTrainer logs besides the loss that the result keeps, as (log key, result key).
REWARD_METRICS = (("rewards/accuracies", "rewards_accuracy"), ("rewards/margins", "rewards_margin"))


def encode_pairs(examples, tokenizer, max_length: int, what: str, log) -> list[dict[str, list[int]]]:
    """TRL's columns for each preference example; a supervised row is an error (the data is
    of the wrong kind for this objective), a pair whose prompt fills max_length is dropped
    (and counted, loudly): the collator would cut both answers away."""
    rows, full = [], []
    for ex in examples:
        if not ex.is_preference:
            raise TrainingError(
                f"{what} example {ex.example_id} is not a preference pair: training.objective dpo trains on "
                "OpenAI's DPO format (input, preferred_output, non_preferred_output)"
            )
        try:
            row = encode_preference(ex, tokenizer)
        except ValueError as exc:  # a chat template that renders the prompt differently with the answer
            raise TrainingError(f"{what} example {ex.example_id}: {exc}") from None
        if len(row["prompt_ids"]) >= max_length:
            full.append(ex.example_id)
        else:
            rows.append(row)
    if full:
        log(
            f"WARNING: {len(full)} {what} pairs dropped: prompt fills max_length={max_length} "
            f"so no answer token is left (first: {', '.join(full[:3])})"
        )
    if not rows and examples:
        raise TrainingError(f"no {what} pair has an answer token within max_length={max_length}")
    return rows


def dpo_arguments(cfg, common: dict[str, Any]):
    """DPOConfig: the run's TrainingArguments plus training.dpo. TRL's own defaults that would
    change the run (gradient checkpointing and bf16 on) are set from the config instead."""
    from trl import DPOConfig

    return DPOConfig(
        **common,
        gradient_checkpointing=cfg.gradient_checkpointing,
        beta=cfg.dpo.beta,
        loss_type=[cfg.dpo.loss_type],
        max_length=cfg.max_length,
        truncation_mode="keep_start",  # as supervised rows are cut (formatting.encode_example)
        remove_unused_columns=False,  # the rows hold only TRL's columns
    )


def dpo_trainer(model, args, train_rows, eval_rows, tokenizer, lora, callbacks):
    """A DPOTrainer on already tokenised pairs; lora: a peft LoraConfig or None (full)."""
    from datasets import Dataset
    from trl import DPOTrainer

    class PairsTrainer(DPOTrainer):
        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            return dataset  # tokenised by tuneloop.formatting already

    return PairsTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(train_rows),
        eval_dataset=Dataset.from_list(eval_rows) if eval_rows else None,
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=callbacks,
    )


def dpo_result(history: list[dict[str, Any]], cfg) -> dict[str, Any]:
    """What a DPO run adds to train_result.json: its settings and the reward metrics TRL logs
    (histories as [step, value] like loss_history; the eval ones' last value)."""
    out: dict[str, Any] = {"dpo": {"beta": cfg.dpo.beta, "loss_type": cfg.dpo.loss_type}}
    for key, name in REWARD_METRICS:
        out[f"{name}_history"] = [[h["step"], h[key]] for h in history if key in h and "loss" in h]
        evals = [[h["step"], h[f"eval_{key}"]] for h in history if f"eval_{key}" in h]
        out[f"eval_{name}_history"] = evals
        out[f"eval_{name}"] = evals[-1][1] if evals else None
    return out
