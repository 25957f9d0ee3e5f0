"""The slots engine (tuneloop/serving/slots.py) on transformers' forward, in-process (its fused
forward, the default where it serves the model: test_fused_forward.py): greedy output equal to
single-request `generate` while requests join, wait for a slot, leave and move between
slots, with the slot attention kernel and with sdpa; seeded sampling equal to the other
engines; cancellation; the torch.compile'd variant; and the coalescing of streamed tokens
(serving.stream_interval_ms). The kernel itself: test_slot_attention.py.

Through the real `bentoml serve` it is covered with the other engines in test_serving_api.py.
"""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from tests.support.serving import (
    MAX_LATE_TOKENS,
    PROMPTS,
    assert_greedy_matches,
    collect,
    endings,
    many_specs,
    read_then_cancel,
    reference,
    run_adaptive,
    run_slots,
)
from tests.support.serving_tiny_model import build_tiny_model


@pytest.mark.parametrize("decode_attention", ["kernel", "sdpa"])
def test_greedy_equals_generate_with_joins_leaves_and_a_queue(loaded, decode_attention):
    specs = many_specs(loaded)
    sizes: list[int] = []
    engines: list = []
    results = run_slots(
        loaded,
        specs,
        num_slots=8,
        stagger_s=0.3,
        burst=8,
        sizes=sizes,
        engine_out=engines,
        decode_attention=decode_attention,
    )
    assert_greedy_matches(loaded, specs, results)
    assert engines[0].kernel is (decode_attention == "kernel")  # the kernel was built and used here
    # The stopped engine gave the shared model its own attention back (the continuous engine needs it).
    assert loaded.model.config._attn_implementation == "sdpa"
    assert 4 <= max(sizes) <= 8  # never more rows than slots: 24 requests took turns
    assert len(set(sizes)) > 3  # the batch grew and shrank step by step
    assert engines[0].rows == []  # every slot was freed


def test_all_at_once_in_one_padded_prefill(loaded):
    from tuneloop.serving.engine import SamplingParams

    tok = loaded.tokenizer
    specs = [
        (tok(p)["input_ids"], SamplingParams(max_new_tokens=6 + 7 * i, temperature=0.0)) for i, p in enumerate(PROMPTS)
    ]
    sizes: list[int] = []
    assert_greedy_matches(loaded, specs, run_slots(loaded, specs, sizes=sizes))
    assert sizes[0] == len(specs)  # prefilled together, then decoded together


def test_a_long_prompt_next_to_short_ones_fits_the_context(loaded):
    """Left padding to the longest prompt must not push a short prompt's generation past its slot."""
    from tuneloop.serving.engine import SamplingParams

    ctx = loaded.context_length
    long_prompt = (loaded.tokenizer(PROMPTS[2])["input_ids"] * 40)[: ctx - 4]
    short = loaded.tokenizer(PROMPTS[0])["input_ids"]
    specs = [(long_prompt, SamplingParams(4, temperature=0.0)), (short, SamplingParams(100, temperature=0.0))]
    assert_greedy_matches(loaded, specs, run_slots(loaded, specs))


def test_seeded_sampling_equals_the_adaptive_engine(loaded):
    from tuneloop.serving.engine import SamplingParams

    ids = loaded.tokenizer(PROMPTS[1])["input_ids"]
    seeded = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.9, seed=1234)
    greedy = SamplingParams(max_new_tokens=12, temperature=0.0)
    s = run_slots(loaded, [(ids, seeded), (ids, greedy), (ids, seeded)])
    a = run_adaptive(loaded, [(ids, seeded), (ids, greedy)])
    assert s[0] == s[2] == a[0]
    assert s[1] == a[1]


def test_cancelled_generation_frees_its_slot(loaded):
    from tuneloop.serving.engine import GenerationStream, SamplingParams
    from tuneloop.serving.slots import SlotEngine

    ids = loaded.tokenizer(PROMPTS[0])["input_ids"]

    async def main():
        engine = SlotEngine(loaded, num_slots=2)
        engine.launch()
        try:
            doomed = GenerationStream("k", ids, SamplingParams(max_new_tokens=200, temperature=0.0))
            other = GenerationStream("o", ids, SamplingParams(max_new_tokens=30, temperature=0.0))
            waiting = GenerationStream("w", ids, SamplingParams(max_new_tokens=5, temperature=0.0))
            for s in (doomed, other, waiting):  # two slots: `waiting` needs the cancelled one's
                engine.submit(s)
            got, late = await read_then_cancel(doomed)
            other_ids, _ = await collect(other)
            waiting_ids, _ = await collect(waiting)
            return got, late, doomed.finish_reason, other_ids, waiting_ids, engine.rows
        finally:
            engine.stop()

    got, late, reason, other_ids, waiting_ids, rows = asyncio.run(main())
    assert reason == "cancelled" and got < 200
    assert len(late) <= MAX_LATE_TOKENS
    assert other_ids == reference(loaded, ids, 30)
    assert waiting_ids == reference(loaded, ids, 5)
    assert rows == []


def test_compiled_engine_matches_generate(loaded):
    """serving.compile: torch.compile'd forward, the same tokens (takes ~0.5-1 min to compile)."""
    specs = many_specs(loaded, n=12, seed=2)
    sizes: list[int] = []
    results = run_slots(loaded, specs, num_slots=4, compile=True, stagger_s=0.2, sizes=sizes)
    assert_greedy_matches(loaded, specs, results)
    assert 2 <= max(sizes) <= 4


def test_regional_compile_matches_generate_and_gives_the_model_back(loaded):
    """serving.compile_mode: regional -- one decoder layer's code compiled, shared by all layers."""
    from tuneloop.serving.slot_runner import decoder_layers

    specs = many_specs(loaded, n=8, seed=4)
    engines: list = []
    results = run_slots(loaded, specs, num_slots=4, compile=True, compile_mode="regional", engine_out=engines)
    assert_greedy_matches(loaded, specs, results)
    assert engines[0].compile_mode == "regional" and engines[0].compiled
    layers = decoder_layers(loaded.model)
    assert len(layers) == loaded.model.config.n_layer
    assert all(layer._compiled_call_impl is None for layer in layers)  # the shared model is plain again
    assert layers == list(loaded.model.transformer.h)  # they were GPT-2's own decoder blocks


def test_compile_mode_auto_compiles_only_small_stacks_whole():
    from tuneloop.serving.slot_runner import resolve_compile_mode

    assert resolve_compile_mode(True, "auto", 4) == "full"  # the demo model
    assert resolve_compile_mode(True, "auto", 30) == "off"  # SmolLM2-135M: bounded start-up, eager is faster
    assert resolve_compile_mode(True, "regional", 30) == "regional"
    assert resolve_compile_mode(False, "auto", 30) == "off"
    assert resolve_compile_mode(True, "full", 30) == "full"


def test_the_kv_cache_is_sized_by_its_budget(loaded):
    """Not slots x the whole window: kv_cache_tokens and max_model_len decide, and requests
    beyond a slot wait (more requests than slots) or are refused (longer than a slot)."""
    from tuneloop.serving.slot_cache import SlotEngineError, kv_bytes_per_token, plan_kv_cache

    model, ctx = loaded.model, loaded.context_length  # 2 layers, 4 heads of 16, 256 positions, float32
    assert kv_bytes_per_token(model) == 2 * 2 * 4 * 16 * 4
    plan = plan_kv_cache(model, ctx, max_slots=32, kv_cache_tokens=4096)
    assert (plan.num_slots, plan.slot_len) == (16, 256)  # the budget holds 16 whole-window slots
    plan = plan_kv_cache(model, ctx, max_slots=32, kv_cache_tokens=4096, max_model_len=64)
    assert (plan.num_slots, plan.slot_len) == (32, 64)
    assert plan.tokens == 2048 and "32 slots x 64 tokens" in plan.describe()
    plan = plan_kv_cache(model, 8192, max_slots=32, kv_cache_tokens=32 * 1024)
    assert (plan.num_slots, plan.slot_len) == (16, 2048)  # a long window shrinks, not below 2048
    plan = plan_kv_cache(model, ctx, max_slots=8, kv_cache_gib=2 * 256 * 1024 / 2**30)
    assert (plan.num_slots, plan.slot_len) == (2, 256)
    plan = plan_kv_cache(model, ctx, max_slots=32)  # the default: a share of the memory available now
    assert plan.gib * 2**30 <= 0.2 * 24 * 2**30 and plan.num_slots == 32
    with pytest.raises(SlotEngineError, match="max_model_len"):
        plan_kv_cache(model, ctx, max_slots=4, max_model_len=ctx + 1)
    with pytest.raises(SlotEngineError, match="holds no slot"):
        plan_kv_cache(model, ctx, max_slots=4, kv_cache_tokens=32, max_model_len=64)

    engines: list = []
    specs = [
        (ids[:20], p.__class__(max_new_tokens=min(p.max_new_tokens, 40), temperature=0.0))
        for ids, p in many_specs(loaded, n=10, seed=5)
    ]
    sizes: list[int] = []
    results = run_slots(
        loaded, specs, num_slots=8, kv_cache_tokens=256, max_model_len=64, engine_out=engines, sizes=sizes
    )
    assert_greedy_matches(loaded, specs, results)
    engine = engines[0]
    assert (engine.num_slots, engine.context_length) == (4, 64)
    assert max(sizes) <= 4 and tuple(engine.cache.kv.shape[2:5:2]) == (4, 64)  # 4 slots of 64 positions


def test_a_model_torch_compile_cannot_handle_is_served_uncompiled(loaded, monkeypatch):
    """Fault simulation: compilation fails; the engine logs it and serves the eager model."""
    from tuneloop.serving.slots import SlotEngine

    def broken(self):
        raise RuntimeError("simulated compiler failure")

    monkeypatch.setattr(SlotEngine, "_compile_warm_up", broken)
    specs = many_specs(loaded, n=4, seed=3)
    engines: list = []
    assert_greedy_matches(loaded, specs, run_slots(loaded, specs, compile=True, engine_out=engines))
    assert engines[0].compiled is False


def test_a_model_with_a_sliding_window_is_refused_with_a_clear_error(loaded):
    from tuneloop.serving.slot_cache import SlotEngineError
    from tuneloop.serving.slots import SlotEngine

    loaded.model.config.sliding_window = 64
    try:
        with pytest.raises(SlotEngineError, match="serving.engine: continuous"):
            SlotEngine(loaded, num_slots=2)
    finally:
        del loaded.model.config.sliding_window


def test_stream_interval_coalesces_tokens_but_sends_the_first_at_once():
    from tuneloop.serving.engine import GenerationStream, SamplingParams

    async def main():
        stream = GenerationStream("c", [1], SamplingParams(max_new_tokens=100), interval_s=0.05)

        def engine():  # emits a token every 2 ms, like a fast decoding loop
            for t in range(100):
                stream.emit([t])
                time.sleep(0.002)
            stream.finish("length")

        job = asyncio.get_running_loop().run_in_executor(None, engine)
        pieces = [ids async for ids in stream.events()]
        await job
        return pieces

    pieces = asyncio.run(main())
    assert [t for p in pieces for t in p] == list(range(100))  # nothing lost, in order
    assert pieces[0] == [0]  # time to first token is not delayed
    assert 2 <= len(pieces) <= 10  # ~0.2 s of tokens in 50 ms chunks, not 100 chunks


def test_stopping_the_engine_ends_running_and_queued_streams(loaded):
    """Nobody waits forever on a server that shuts down: running and queued streams end with an error."""
    from tuneloop.serving.engine import GenerationStream, SamplingParams
    from tuneloop.serving.slots import SlotEngine

    ids = loaded.tokenizer(PROMPTS[0])["input_ids"]

    async def main():
        engine = SlotEngine(loaded, num_slots=1)
        engine.launch()
        running = GenerationStream("r", ids, SamplingParams(max_new_tokens=200, temperature=0.0))
        queued = GenerationStream("q", ids, SamplingParams(max_new_tokens=5, temperature=0.0))
        engine.submit(running)
        engine.submit(queued)
        async for _ in running.events():
            break  # it is generating (and `queued` waits for its slot)
        await asyncio.to_thread(engine.stop)
        return await endings((running, queued))

    assert asyncio.run(main()) == ["the server is shutting down"] * 2


def test_slot_cache_is_zeroed_and_on_huge_pages_where_linux_grants_them():
    import torch

    from tuneloop.serving.slot_cache import HUGE_PAGE, _zeros_on_huge_pages

    # Large frees raise glibc's mmap threshold, so torch's allocator may then hand out heap
    # memory touched before (on small pages for good): the cache must not depend on that.
    for _ in range(3):
        churn = torch.ones(40_000_000, dtype=torch.uint8)
        del churn
    kv = _zeros_on_huge_pages((2, 2, 8, 4, 512, 32), torch.float32, "cpu")  # 8 MiB
    assert kv.shape == (2, 2, 8, 4, 512, 32) and kv.dtype == torch.float32 and not kv.any()
    assert kv.data_ptr() % HUGE_PAGE == 0
    kv[1, 1, 7, 3, 511, 31] = 1.0  # the whole range is usable
    thp = "/sys/kernel/mm/transparent_hugepage/enabled"
    if not os.path.exists(thp) or "[never]" in open(thp).read():
        pytest.skip("transparent huge pages are off on this machine")
    # The kernel's own account of the mapping that holds the cache: all of it on huge pages.
    start, huge_kb, inside = kv.data_ptr(), 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= start < hi
            elif inside and line.startswith("AnonHugePages:"):
                huge_kb = int(line.split()[1])
                break
    assert huge_kb >= 8192, f"only {huge_kb} kB of the 8 MiB cache is on huge pages"


def test_serving_dtype_float32_bfloat16_and_auto(tmp_path):
    """serving.dtype: auto serves float32 (the reference's answers); bfloat16-lossy serves
    bfloat16 weights and KV cache (the float32-only C kernel steps aside for sdpa), and says
    what it costs; plain "bfloat16" is refused with the name that says it."""
    import torch

    from tuneloop.config import ConfigError, load_config
    from tuneloop.serving.engine import SamplingParams, choose_cpu_dtype, load_model

    folder = build_tiny_model(tmp_path / "tiny")
    fp32 = load_model(folder, num_threads=1)
    assert choose_cpu_dtype(fp32.model, "float32") == (torch.float32, "float32")
    assert choose_cpu_dtype(fp32.model, "auto")[0] == torch.float32
    dtype, why = choose_cpu_dtype(fp32.model, "bfloat16-lossy")
    assert dtype == torch.bfloat16 and "NOT the reference's answers" in why and "13 of 24" in why
    with pytest.raises(ConfigError, match="bfloat16-lossy"):
        load_config(environ={"TUNELOOP__SERVING__DTYPE": "bfloat16"})

    bf16 = load_model(folder, num_threads=1, dtype="bfloat16-lossy")
    assert bf16.model.dtype == torch.bfloat16
    ids = bf16.tokenizer(PROMPTS[1])["input_ids"]
    engines: list = []
    [(got, _)] = run_slots(bf16, [(ids, SamplingParams(max_new_tokens=12, temperature=0.0))], engine_out=engines)
    assert got == reference(bf16, ids, 12)
    assert engines[0].kernel is False and engines[0].cache.kv.dtype == torch.bfloat16
