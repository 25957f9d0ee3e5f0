"""Build a small base causal LM from scratch, for machines that cannot download one.

`tuneloop bootstrap` (and the first run with `model.base_model: bootstrap`) calls
bootstrap_base_model(). It

1. trains a byte-level BPE tokenizer on English text that ships with every Python
   (the pydoc help topics plus the docstrings of a few stdlib modules), with ChatML
   special tokens and a chat template whose assistant turns are marked
   `{% generation %}` so trainers can put the loss on assistant tokens only;
2. builds a tiny GPT-2 or Llama from BootstrapConfig;
3. pre-trains it briefly on the same text (plain torch loop, AdamW, cosine decay);
4. saves a standard Hugging Face folder plus `tuneloop_bootstrap.json`, the marker that
   says which config built it.

The result is cached: a folder whose marker carries the hash of the requested config is
returned as is. The folder is built in a hidden sibling and renamed into place once
complete, so a killed run never leaves something that looks finished.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import inspect
import json
import logging
import math
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from pydoc_data.topics import topics
from typing import Any

from tqdm.auto import tqdm

from tuneloop.config import BootstrapConfig
from tuneloop.presets import PRESETS, convert_preset

log = logging.getLogger(__name__)

MARKER_FILE = "tuneloop_bootstrap.json"
# Bump when the recipe below changes in a way that should invalidate cached models.
RECIPE_VERSION = 1

EOS_TOKEN = "<|endoftext|>"  # also the bos token, as in GPT-2
PAD_TOKEN = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS_TOKEN, PAD_TOKEN, IM_START, IM_END]  # ids 0..3, in this order

# ChatML. The assistant's content and its closing <|im_end|> sit inside
# {% generation %}: that is what apply_chat_template(return_assistant_tokens_mask=True)
# reports, i.e. what a model must learn to produce, including when to stop. The role
# header and the newline after <|im_end|> stay outside. The generation prompt is exactly
# the header of an assistant turn, so a prompt rendered with add_generation_prompt is a
# prefix of the full conversation.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{% generation %}{{- message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{%- else %}"
    "{{- message['content'] + '<|im_end|>' }}"
    "{%- endif %}"
    "{{- '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Stdlib modules whose docstrings add some plain prose to the pydoc topics.
DOCSTRING_MODULES = [
    "argparse",
    "collections",
    "csv",
    "datetime",
    "functools",
    "itertools",
    "json",
    "logging",
    "pathlib",
    "random",
    "re",
    "statistics",
    "string",
    "textwrap",
]


class BootstrapError(Exception):
    """The base model cannot be built; the message says why and where."""


# ---------------------------------------------------------------------------------------
# cache marker


def bootstrap_config_hash(cfg: BootstrapConfig) -> str:
    """Hash of everything that changes the built model (not where it is written)."""
    payload = {"recipe": RECIPE_VERSION, **cfg.model_dump(mode="json", exclude={"output_dir"})}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def read_marker(model_dir: Path) -> dict[str, Any] | None:
    """The marker of a bootstrapped folder, or None if there is none (or it is unreadable)."""
    try:
        marker = json.loads((Path(model_dir) / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def is_bootstrapped(model_dir: Path, cfg: BootstrapConfig) -> bool:
    """True when model_dir holds a finished build of exactly this config."""
    marker = read_marker(model_dir)
    return marker is not None and marker.get("config_hash") == bootstrap_config_hash(cfg)


# ---------------------------------------------------------------------------------------
# text and tokenizer


def training_documents() -> list[str]:
    """Real English text available offline: pydoc help topics and stdlib docstrings."""
    docs = [topics[name] for name in sorted(topics)]
    for module_name in DOCSTRING_MODULES:
        module = importlib.import_module(module_name)
        for name in [None, *sorted(getattr(module, "__all__", None) or dir(module))]:
            if name is not None and name.startswith("_"):
                continue
            obj = module if name is None else getattr(module, name, None)
            doc = inspect.getdoc(obj) if obj is not None else None
            # Short docstrings are mostly signatures; type objects inherit builtins' docs.
            if doc and len(doc) >= 200 and (name is None or inspect.getmodule(obj) is module):
                docs.append(doc)
    return [d.strip() for d in docs if d.strip()]


def build_tokenizer(documents: list[str], vocab_size: int, model_max_length: int):
    """Train a byte-level BPE on documents; return it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Byte level: any input text is encodable, no unknown token needed.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Untrimmed offsets: the assistant mask is computed from character offsets, and a
    # token's offsets must cover the spaces it carries.
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(documents, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        extra_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
    )


def encode_documents(tokenizer, documents: list[str]) -> tuple[list[int], list[int]]:
    """One token stream for training and one for validation, documents split by eos.

    Every 20th document goes to validation, so both streams cover all kinds of text.
    """
    # The Rust tokenizer directly: documents are longer than model_max_length, which is
    # fine here (they are cut into blocks) but would make transformers warn.
    encoded = [e.ids for e in tokenizer.backend_tokenizer.encode_batch(documents, add_special_tokens=False)]
    train, val = [], []
    for i, ids in enumerate(encoded):
        (val if i % 20 == 0 else train).extend(ids + [tokenizer.eos_token_id])
    return train, val


# ---------------------------------------------------------------------------------------
# model


def build_model_config(cfg: BootstrapConfig, tokenizer):
    """A transformers config for cfg.architecture, with the tokenizer's special ids."""
    from transformers import GPT2Config, LlamaConfig

    ids = dict(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if cfg.architecture == "gpt2":
        return GPT2Config(
            vocab_size=len(tokenizer),
            n_positions=cfg.context_length,
            n_embd=cfg.n_embd,
            n_layer=cfg.n_layer,
            n_head=cfg.n_head,
            # No dropout: a few hundred steps on a small corpus underfit, not overfit.
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            tie_word_embeddings=True,
            **ids,
        )
    # SwiGLU has three matrices; 8/3 of the width keeps the MLP as large as GPT-2's 4x.
    intermediate = 16 * max(1, round(8 * cfg.n_embd / 3 / 16))
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.n_embd,
        intermediate_size=intermediate,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_head,
        max_position_embeddings=cfg.context_length,
        tie_word_embeddings=True,
        **ids,
    )


def _generation_config(tokenizer):
    from transformers import GenerationConfig

    # A chat turn ends with <|im_end|>, plain text with <|endoftext|>: stop at either.
    return GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END)],
        pad_token_id=tokenizer.pad_token_id,
    )


# ---------------------------------------------------------------------------------------
# pre-training


def _learning_rate(step: int, steps: int, peak: float) -> float:
    """Linear warm-up over 5% of the steps, then cosine decay to 10% of peak."""
    warmup = max(1, steps // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def evaluate_loss(model, tokens, block_size: int, batch_size: int, max_blocks: int = 32) -> float:
    """Mean next-token loss over the first max_blocks non-overlapping blocks of tokens."""
    import torch

    n_blocks = min(max_blocks, (len(tokens) - 1) // block_size)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total = 0.0
    with torch.no_grad():
        for start in range(0, n_blocks, batch_size):
            rows = range(start, min(n_blocks, start + batch_size))
            x = torch.stack([tokens[r * block_size : (r + 1) * block_size + 1] for r in rows]).to(device)
            total += _next_token_loss(model, x, reduction="sum").item()
    model.train(was_training)
    return total / (n_blocks * block_size)


def pretrain(model, train_tokens, val_tokens, cfg: BootstrapConfig, progress: bool = True) -> dict[str, float]:
    """Brief causal-LM pre-training on random blocks of train_tokens; returns the losses."""
    import torch

    device = next(model.parameters()).device
    train = torch.tensor(train_tokens, dtype=torch.long)
    val = torch.tensor(val_tokens, dtype=torch.long)
    generator = torch.Generator().manual_seed(cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, betas=(0.9, 0.95), weight_decay=0.1)

    initial_val = evaluate_loss(model, val, cfg.block_size, cfg.batch_size)
    model.train()
    recent: list[float] = []
    bar = tqdm(range(cfg.steps), desc="pre-training base model", unit="step", disable=not progress)
    for step in bar:
        starts = torch.randint(0, len(train) - cfg.block_size - 1, (cfg.batch_size,), generator=generator)
        x = torch.stack([train[s : s + cfg.block_size + 1] for s in starts.tolist()]).to(device)
        for group in optimizer.param_groups:
            group["lr"] = _learning_rate(step, cfg.steps, cfg.learning_rate)
        loss = _next_token_loss(model, x)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        recent = (recent + [loss.item()])[-20:]
        if step % 10 == 0 or step == cfg.steps - 1:
            bar.set_postfix(loss=f"{sum(recent) / len(recent):.3f}")
    bar.close()
    final_val = evaluate_loss(model, val, cfg.block_size, cfg.batch_size)
    return {
        "initial_val_loss": round(initial_val, 4),
        "final_val_loss": round(final_val, 4),
        # Mean of the last 20 training steps (None without training).
        "final_train_loss": round(sum(recent) / len(recent), 4) if recent else None,
    }


def _next_token_loss(model, x, reduction: str = "mean"):
    """Cross-entropy of predicting x[:, 1:] from x[:, :-1] (blocks carry one extra token)."""
    import torch

    logits = model(input_ids=x[:, :-1]).logits
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction=reduction
    )


# ---------------------------------------------------------------------------------------
# the whole build


def _build(cfg: BootstrapConfig, folder: Path, progress: bool) -> dict[str, Any]:
    """Build everything into folder (which exists and is empty); return the marker."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    documents = training_documents()
    tokenizer = build_tokenizer(documents, cfg.vocab_size, cfg.context_length)
    train_tokens, val_tokens = encode_documents(tokenizer, documents)
    if min(len(train_tokens), len(val_tokens)) <= cfg.block_size + 1:
        raise BootstrapError(
            f"bootstrap.block_size={cfg.block_size} is longer than the built-in corpus allows "
            f"({len(val_tokens)} validation tokens); use a smaller block_size"
        )

    torch.manual_seed(cfg.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_config(
        build_model_config(cfg, tokenizer), dtype=torch.float32, attn_implementation="sdpa"
    ).to(device)
    model.generation_config = _generation_config(tokenizer)
    losses = pretrain(model, train_tokens, val_tokens, cfg, progress=progress)

    model.to("cpu").save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return {
        "tuneloop_bootstrap": RECIPE_VERSION,
        "config_hash": bootstrap_config_hash(cfg),
        "config": cfg.model_dump(mode="json", exclude={"output_dir"}),
        **losses,
        "seconds": round(time.perf_counter() - started, 1),
        "device": device,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tokenizer),
        "train_tokens": len(train_tokens),
        "val_tokens": len(val_tokens),
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
    }


def bootstrap_base_model(cfg: BootstrapConfig, output_dir: Path, force: bool = False, progress: bool = True) -> Path:
    """Make sure output_dir holds a base model built from cfg; build it if not. Returns the folder.

    A folder whose marker matches cfg is returned untouched (no training). A folder built
    from another config, or any folder when force=True, is replaced. A non-empty folder
    without a marker was not made here and is left alone unless force=True.
    """
    output_dir = Path(output_dir).expanduser().resolve()
    if not force and is_bootstrapped(output_dir, cfg):
        log.info("base model %s is up to date (config %s)", output_dir, bootstrap_config_hash(cfg))
        return output_dir
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    # One build at a time per folder: a second process waits, then finds the cache hit.
    with open(output_dir.parent / f".{output_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and is_bootstrapped(output_dir, cfg):
            return output_dir
        return _build_into(cfg, output_dir, force, progress)


def _build_into(cfg: BootstrapConfig, output_dir: Path, force: bool, progress: bool) -> Path:
    if output_dir.exists() and not output_dir.is_dir():
        raise BootstrapError(f"{output_dir}: exists and is not a folder; cannot build the base model there")
    if output_dir.is_dir() and any(output_dir.iterdir()) and read_marker(output_dir) is None and not force:
        raise BootstrapError(
            f"{output_dir}: folder exists, is not empty and has no {MARKER_FILE}, so it was not built "
            "by `tuneloop bootstrap`; refusing to overwrite it (choose another bootstrap.output_dir or use --force)"
        )

    output_dir.parent.mkdir(parents=True, exist_ok=True)
    # Hidden sibling on the same file system, so the final rename is atomic.
    building = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.building-", dir=output_dir.parent))
    try:
        marker = _build(cfg, building, progress)
        # The marker is written last: a folder without it is never taken as finished.
        (building / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
        if not force and is_bootstrapped(output_dir, cfg):
            # Another process finished the same build meanwhile; keep its folder.
            return output_dir
        _replace_folder(building, output_dir)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    log.info(
        "built base model %s in %.0f s, validation loss %.3f -> %.3f",
        output_dir,
        marker["seconds"],
        marker["initial_val_loss"],
        marker["final_val_loss"],
    )
    return output_dir


def _replace_folder(new: Path, target: Path) -> None:
    """Move new to target; an existing target is moved aside first, then deleted."""
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        os.replace(target, old / target.name)
        os.replace(new, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(new, target)


def ensure_base_model(cfg) -> str:
    """The configured base model as from_pretrained takes it; builds the bootstrap model (or
    converts a preset) first when that is what the config names (a cache hit after the first
    time)."""
    if cfg.model.base_model == "bootstrap":
        bootstrap_base_model(cfg.bootstrap, cfg.bootstrap_dir)
    elif cfg.model.base_model in PRESETS:
        convert_preset(cfg.model.base_model, Path(cfg.base_model_ref))
    return cfg.base_model_ref
