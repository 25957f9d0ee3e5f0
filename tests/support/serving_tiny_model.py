"""A tiny GPT-2 chat model for the serving tests, built in about a second, fully offline.

Same shape as what `tuneloop bootstrap` builds (byte-level BPE with <|endoftext|>,
<|pad|> and ChatML tokens, a ChatML chat template, GPT-2), but with random weights and
a tokenizer trained on a few sentences: the tests compare engines with each other and
with `generate`, so the text needs no meaning.
"""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "A model server answers completions and chat completions over HTTP.",
    "Tokens are generated one at a time; batching shares the work between requests.",
    "Hello world! How are you today? I am fine, thank you.",
    "Continuous batching lets requests join and leave the running batch at every step.",
] * 20


def build_tiny_model(
    folder: Path, context_length: int = 256, seed: int = 0, heads: int = 4, architecture: str = "gpt2"
) -> Path:
    """Save a random-weight 2-layer GPT-2 (or Llama) and its tokenizer to folder; return folder.

    heads: attention heads over 64 dimensions (vLLM's CPU attention needs a head size of
    32 or more: heads=1 or 2). architecture llama: grouped-query attention (half as many
    kv heads), RoPE, SwiGLU, tied embeddings, as the bootstrap's llama and SmolLM2."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        GenerationConfig,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedTokenizerFast,
    )

    specials = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_TEXT, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=context_length,
    )
    tokenizer.chat_template = CHAT_TEMPLATE

    torch.manual_seed(seed)
    ids = dict(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    # initializer_range wider than the usual 0.02 so greedy text varies from token to token (a sharper test)
    if architecture == "llama":
        model = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=len(tokenizer),
                hidden_size=64,
                intermediate_size=176,
                num_hidden_layers=2,
                num_attention_heads=heads,
                num_key_value_heads=max(1, heads // 2),
                max_position_embeddings=context_length,
                tie_word_embeddings=True,
                initializer_range=0.2,
                **ids,
            )
        )
    elif architecture == "gpt2":
        model = GPT2LMHeadModel(
            GPT2Config(
                vocab_size=len(tokenizer),
                n_positions=context_length,
                n_embd=64,
                n_layer=2,
                n_head=heads,
                initializer_range=0.2,
                **ids,
            )
        )
    else:
        raise ValueError(f"architecture: gpt2 or llama, not {architecture!r}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")],
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    ).save_pretrained(folder)
    return folder
