"""LoRA adapters for serving tests and the LoRA benchmark: a random adapter saved by peft as
training saves one, and the same adapter merged into its base (the reference: that adapter
served alone, as a plain model)."""

from __future__ import annotations

import shutil
from pathlib import Path


def make_adapter(
    base: Path, folder: Path, seed: int, merged: bool = True, b_scale: float = 1.0, **lora: object
) -> tuple[Path, Path | None]:
    """Save a peft LoRA of the model at `base` (LoraConfig(**lora): r, lora_alpha, target_modules,
    use_rslora, rank_pattern, ...) with random non-zero A and B (B times b_scale) to
    folder/adapter; with `merged`, also the base with it merged in (merge_and_unload) to
    folder/merged, tokenizer and generation config beside it. Returns (adapter, merged or None)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(folder)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **lora))  # type: ignore[arg-type]
    if b_scale != 1.0:
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if ".lora_B." in name:
                    param.mul_(b_scale)
    peft_model.save_pretrained(folder / "adapter")
    if not merged:
        return folder / "adapter", None
    peft_model.merge_and_unload().save_pretrained(folder / "merged")
    AutoTokenizer.from_pretrained(base).save_pretrained(folder / "merged")
    for extra in ("generation_config.json", "chat_template.jinja"):
        if (Path(base) / extra).exists():
            shutil.copy(Path(base) / extra, folder / "merged" / extra)
    return folder / "adapter", folder / "merged"
