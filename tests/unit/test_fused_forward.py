"""The slots engine's fused forward for Llama- and GPT-2-architecture models
(tuneloop/serving/fused_forward.py): the same logits as transformers' forward over ragged
batches (float32 and bfloat16, grouped-query heads), the same greedy tokens as `generate` while
requests join, queue, leave, move between slots and prefill in chunks, seeded sampling and
penalties equal to the other engines, weight swaps seen through the fused weights, and
transformers' forward wherever the fused one does not serve the model or disagrees with it."""

from __future__ import annotations

import asyncio
import copy
import logging

import pytest
import torch

from tests.support.serving import (
    PROMPTS,
    assert_greedy_matches,
    collect,
    many_specs,
    reference,
    run_adaptive,
    run_slots,
)
from tests.support.serving_tiny_model import build_tiny_model

ARCHITECTURES = ["llama", "gpt2"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused")
    return {
        arch: {
            "a": build_tiny_model(root / f"{arch}-a", architecture=arch, seed=0),
            "b": build_tiny_model(root / f"{arch}-b", architecture=arch, seed=1),
        }
        for arch in ARCHITECTURES
    }


@pytest.fixture(scope="module", params=ARCHITECTURES)
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def loaded(folders, arch):
    from tuneloop.serving.engine import load_model

    return load_model(folders[arch]["a"], num_threads=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_logits_equal_transformers_over_a_ragged_batch(loaded, arch, dtype):
    from tuneloop.serving.fused_forward import check_against_transformers, fused_forward_for

    model = copy.deepcopy(loaded.model).to(dtype)
    fused = fused_forward_for(model, max_len=64)
    assert type(fused).__name__ == {"llama": "FusedLlama", "gpt2": "FusedGPT2"}[arch]
    if arch == "llama":
        assert fused.kv_heads < fused.heads  # grouped-query attention is exercised
    kv = torch.zeros(2, 2, 3, fused.kv_heads, 64, fused.head_dim, dtype=dtype)
    with torch.inference_mode():
        assert check_against_transformers(fused, model, kv) is None
        # A mistake the check must catch: a layer's attention scaled wrong.
        fused.layers[1].scale *= 3
        assert "relative difference" in check_against_transformers(fused, model, kv)


def test_fused_weights_are_the_models_own_memory(folders):
    """Llama's q|k|v and gate|up are fused into one tensor each; the model's layers are views of
    it, so a swap that copies into the model's state_dict changes what the fused forward computes."""
    from tuneloop.serving.engine import load_model
    from tuneloop.serving.fused_forward import FusedLlama

    model = load_model(folders["llama"]["a"], num_threads=1).model
    fused = FusedLlama(model, max_len=64)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.data_ptr() == fused.layers[0].qkv.weight.data_ptr()
    model.state_dict()["model.layers.0.self_attn.k_proj.weight"].fill_(0.5)
    assert torch.all(fused.layers[0].qkv.weight[attn.q_proj.weight.shape[0] :][: attn.k_proj.weight.shape[0]] == 0.5)


def test_greedy_equals_generate_with_joins_leaves_and_a_queue(loaded):
    specs = many_specs(loaded)
    sizes: list[int] = []
    engines: list = []
    results = run_slots(
        loaded, specs, num_slots=8, stagger_s=0.3, burst=8, sizes=sizes, engine_out=engines, forward="fused"
    )
    assert engines[0].forward_name == "fused" and not engines[0].compiled
    assert_greedy_matches(loaded, specs, results)
    assert 4 <= max(sizes) <= 8 and len(set(sizes)) > 3  # requests took turns for 8 slots
    assert engines[0].rows == []


def test_a_long_prompt_is_prefilled_in_chunks_beside_running_decodes(loaded):
    """max_prefill_tokens 16: the 248-token prompt takes 16 steps of prefill, during which the
    request already running keeps getting a token every step; all of them as `generate`."""
    from tuneloop.serving.engine import SamplingParams

    long_prompt = (loaded.tokenizer(PROMPTS[2])["input_ids"] * 40)[: loaded.context_length - 8]
    short = loaded.tokenizer(PROMPTS[0])["input_ids"]
    specs = [
        (short, SamplingParams(100, temperature=0.0, ignore_eos=True)),
        (long_prompt, SamplingParams(4, temperature=0.0)),
        (short[:3], SamplingParams(30, temperature=0.0)),
    ]
    sizes: list[int] = []
    results = run_slots(loaded, specs, num_slots=3, stagger_s=0.05, sizes=sizes, max_prefill_tokens=16, forward="fused")
    assert_greedy_matches(loaded, specs[1:], results[1:])
    assert len(results[0][0]) == 100
    # 100 + 4 + 30 tokens were picked, one per row and step; the prefill took >= 248 / 16 steps
    # in which the long prompt's row picked none while the others went on
    assert sum(sizes) == 134 and len(sizes) >= 100


def test_seeded_sampling_and_penalties_equal_the_adaptive_engine(loaded):
    from tuneloop.serving.engine import SamplingParams

    ids = loaded.tokenizer(PROMPTS[1])["input_ids"]
    seeded = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.9, seed=1234)
    shaped = SamplingParams(max_new_tokens=12, temperature=0.0, frequency_penalty=1.5, logit_bias=((5, 3.0),))
    s = run_slots(loaded, [(ids, seeded), (ids, shaped), (ids, seeded)], forward="fused")
    a = run_adaptive(loaded, [(ids, seeded), (ids, shaped)])
    assert s[0] == s[2] == a[0]
    assert s[1] == a[1]


def test_a_weight_swap_reaches_the_fused_forward(folders, loaded, arch):
    from tuneloop.serving.engine import GenerationStream, SamplingParams, load_model
    from tuneloop.serving.slots import SlotEngine

    lb = load_model(folders[arch]["b"], num_threads=1)
    prompt = loaded.tokenizer("The quick brown fox", add_special_tokens=False)["input_ids"]
    want_a, want_b = reference(loaded, prompt, 12), reference(lb, prompt, 12)
    assert want_a != want_b
    engine = SlotEngine(copy.deepcopy(loaded), num_slots=2)
    engine.launch()

    async def one():
        stream = GenerationStream("r", prompt, SamplingParams(max_new_tokens=12, temperature=0.0))
        engine.submit(stream)
        return await collect(stream)

    async def main():
        await asyncio.to_thread(engine.ready.wait, 60)
        before = await one()
        await asyncio.to_thread(engine.swap_weights(lb.model.state_dict()).wait, 30)
        return before, await one()

    try:
        before, after = asyncio.run(main())
    finally:
        engine.stop()
    assert engine.forward_name == "fused" and engine.swap_error is None
    assert before[0] == want_a and after[0] == want_b


def test_transformers_forward_where_the_fused_one_does_not_serve(loaded, tmp_path, monkeypatch, caplog):
    from transformers import AutoModelForCausalLM

    from tuneloop.serving import fused_forward
    from tuneloop.serving.engine import load_model

    # GPT-2 with erf GELU: not an activation the fused forward has
    model = AutoModelForCausalLM.from_pretrained(loaded.path)
    if model.config.model_type == "gpt2":
        model.config.activation_function = "gelu"
    else:
        model.config.hidden_act = "gelu"
    model.save_pretrained(tmp_path / "other")
    loaded.tokenizer.save_pretrained(tmp_path / "other")
    other = load_model(tmp_path / "other", num_threads=1)
    assert "activation" in fused_forward.unsupported_reason(
        other.model
    ) or "hidden_act" in fused_forward.unsupported_reason(other.model)
    engines: list = []
    specs = many_specs(other, n=4)
    assert_greedy_matches(other, specs, run_slots(other, specs, engine_out=engines, forward="fused"))
    assert engines[0].forward_name == "transformers"

    # A fused forward that disagrees with transformers' on the served model is not used.
    monkeypatch.setattr(fused_forward, "TOLERANCE", {torch.float32: -1.0, torch.bfloat16: -1.0})
    engines = []
    specs = many_specs(loaded, n=4)
    with caplog.at_level(logging.WARNING, logger="tuneloop.serving.slot_runner"):
        assert_greedy_matches(loaded, specs, run_slots(loaded, specs, engine_out=engines, forward="fused"))
    assert engines[0].forward_name == "transformers"
    assert "fused forward disagrees with transformers'" in caplog.text

    engines = []  # and serving.forward: transformers asks for it outright
    assert_greedy_matches(loaded, specs, run_slots(loaded, specs, engine_out=engines, forward="transformers"))
    assert engines[0].forward_name == "transformers"
