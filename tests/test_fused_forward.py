"""The slots engine's fused forward for Llama-architecture models (components/serving/fused_llama.py):
the same logits as transformers' forward over ragged batches (float32 and bfloat16, grouped-query
heads), the same greedy tokens as `generate` while requests join, queue, leave and move between
slots, seeded sampling equal to the other engines, weight swaps seen through the fused weights,
and transformers' forward wherever the fused one does not serve the model or disagrees with it."""

from __future__ import annotations

import asyncio
import copy
import logging

import pytest
import torch

from tests.serving_tiny_model import build_tiny_model
from tests.test_serving_engine import PROMPTS, collect, reference, run_adaptive
from tests.test_serving_slots import assert_greedy_matches, many_specs, run_slots


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama")
    return {"a": build_tiny_model(root / "a", architecture="llama", seed=0),
            "b": build_tiny_model(root / "b", architecture="llama", seed=1),
            "gpt2": build_tiny_model(root / "gpt2")}


@pytest.fixture(scope="module")
def loaded(folders):
    from components.serving.engine import load_model

    return load_model(folders["a"], num_threads=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_logits_equal_transformers_over_a_ragged_batch(loaded, dtype):
    from components.serving.fused_llama import FusedLlama, check_against_transformers

    model = copy.deepcopy(loaded.model).to(dtype)
    fused = FusedLlama(model, max_len=64)
    assert fused.kv_heads < fused.heads  # grouped-query attention is exercised
    kv = torch.zeros(2, 2, 3, fused.kv_heads, 64, fused.head_dim, dtype=dtype)
    with torch.inference_mode():
        assert check_against_transformers(fused, model, kv) is None
        # A mistake the check must catch: keys rotated for the wrong positions.
        fused.cos, fused.sin = fused.cos.roll(3, 0), fused.sin.roll(3, 0)
        assert "relative difference" in check_against_transformers(fused, model, kv)


def test_fused_weights_are_the_models_own_memory(loaded):
    """q|k|v and gate|up are fused into one tensor each; the model's layers are views of it, so a
    swap that copies into the model's state_dict changes what the fused forward computes."""
    from components.serving.fused_llama import FusedLlama

    model = copy.deepcopy(loaded.model)
    fused = FusedLlama(model, max_len=64)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.data_ptr() == fused.layers[0].qkv.weight.data_ptr()
    model.state_dict()["model.layers.0.self_attn.k_proj.weight"].fill_(0.5)
    assert torch.all(fused.layers[0].qkv.weight[attn.q_proj.weight.shape[0]:][:attn.k_proj.weight.shape[0]] == 0.5)


def test_greedy_equals_generate_with_joins_leaves_and_a_queue(loaded):
    specs = many_specs(loaded)
    sizes: list[int] = []
    engines: list = []
    results = run_slots(loaded, specs, num_slots=8, stagger_s=0.3, sizes=sizes, engine_out=engines)
    assert engines[0].forward_name == "fused" and not engines[0].compiled
    assert_greedy_matches(loaded, specs, results)
    assert 4 <= max(sizes) <= 8 and len(set(sizes)) > 3  # requests took turns for 8 slots
    assert engines[0].rows == []


def test_a_long_prompt_is_prefilled_in_chunks_beside_running_decodes(loaded):
    """max_prefill_tokens 16: the 248-token prompt takes 16 steps of prefill, during which the
    request already running keeps getting a token every step; all of them as `generate`."""
    from components.serving.engine import SamplingParams

    long_prompt = (loaded.tokenizer(PROMPTS[2])["input_ids"] * 40)[: loaded.context_length - 8]
    short = loaded.tokenizer(PROMPTS[0])["input_ids"]
    specs = [(short, SamplingParams(100, temperature=0.0, ignore_eos=True)),
             (long_prompt, SamplingParams(4, temperature=0.0)), (short[:3], SamplingParams(30, temperature=0.0))]
    sizes: list[int] = []
    results = run_slots(loaded, specs, num_slots=3, stagger_s=0.05, sizes=sizes, max_prefill_tokens=16)
    assert_greedy_matches(loaded, specs[1:], results[1:])
    assert len(results[0][0]) == 100
    # 100 + 4 + 30 tokens were picked, one per row and step; the prefill took >= 248 / 16 steps
    # in which the long prompt's row picked none while the others went on
    assert sum(sizes) == 134 and len(sizes) >= 100


def test_seeded_sampling_and_penalties_equal_the_adaptive_engine(loaded):
    from components.serving.engine import SamplingParams

    ids = loaded.tokenizer(PROMPTS[1])["input_ids"]
    seeded = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.9, seed=1234)
    shaped = SamplingParams(max_new_tokens=12, temperature=0.0, frequency_penalty=1.5, logit_bias=((5, 3.0),))
    s = run_slots(loaded, [(ids, seeded), (ids, shaped), (ids, seeded)])
    a = run_adaptive(loaded, [(ids, seeded), (ids, shaped)])
    assert s[0] == s[2] == a[0]
    assert s[1] == a[1]


def test_a_weight_swap_reaches_the_fused_forward(folders, loaded):
    from components.serving.engine import GenerationStream, SamplingParams, load_model
    from components.serving.slots import SlotEngine

    lb = load_model(folders["b"], num_threads=1)
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


def test_transformers_forward_where_the_fused_one_does_not_serve(folders, loaded, monkeypatch, caplog):
    from components.serving import fused_llama
    from components.serving.engine import load_model

    gpt2 = load_model(folders["gpt2"], num_threads=1)
    engines: list = []
    specs = many_specs(gpt2, n=4)
    assert_greedy_matches(gpt2, specs, run_slots(gpt2, specs, engine_out=engines))
    assert engines[0].forward_name == "transformers"  # GPT-2 is not a Llama-architecture model

    # A fused forward that disagrees with transformers' on the served model is not used.
    monkeypatch.setattr(fused_llama, "TOLERANCE", {torch.float32: -1.0, torch.bfloat16: -1.0})
    engines = []
    specs = many_specs(loaded, n=4)
    with caplog.at_level(logging.WARNING, logger="components.serving.slots"):
        assert_greedy_matches(loaded, specs, run_slots(loaded, specs, engine_out=engines))
    assert engines[0].forward_name == "transformers"
    assert "fused forward disagrees with transformers'" in caplog.text

    engines = []  # and serving.forward: transformers asks for it outright
    assert_greedy_matches(loaded, specs, run_slots(loaded, specs, engine_out=engines, forward="transformers"))
    assert engines[0].forward_name == "transformers"
