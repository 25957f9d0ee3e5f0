"""Multi-adapter LoRA serving in the slots engine (tuneloop/serving/lora.py, lora_table.py, the
fused forward): rows of different adapters and of the base in one batch, each answering as its
adapter merged into the base and served alone by the same engine; a third adapter read while
streams run, none dropped; least recently used adapters evicted beyond max_loaded / max_bytes
and read again; a bad adapter refused (its own request only) with what is wrong; a swap of the
base drops the adapters; the engine in its own process; engines that serve no adapter say so
at once. Adapters are peft's, random and non-zero, on tiny random models (tests/support/lora.py).
The vllm engine's adapters: tests/integration/test_serving_vllm.py."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.lora import make_adapter
from tests.support.serving import PROMPTS, collect, run_slots
from tests.support.serving_tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """Two tiny bases (Llama, GPT-2), each with adapters of its own: a (q,v), b (every linear
    layer), c (k, o, down: rsLoRA, a rank_pattern and an alpha_pattern); and the merged
    references. {(arch, name): (adapter folder, merged folder)} and the bases."""
    root = tmp_path_factory.mktemp("lora")
    bases = {arch: build_tiny_model(root / arch, architecture=arch) for arch in ("llama", "gpt2")}
    adapters = {
        ("llama", "a"): dict(seed=1, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        ("llama", "b"): dict(seed=2, r=8, lora_alpha=16, target_modules="all-linear"),
        ("llama", "c"): dict(
            seed=3,
            r=4,
            lora_alpha=4,
            target_modules=["k_proj", "o_proj", "down_proj"],
            use_rslora=True,
            rank_pattern={"layers.1.self_attn.k_proj": 2},
            alpha_pattern={"down_proj": 12},
        ),
        ("gpt2", "a"): dict(seed=4, r=4, lora_alpha=8, target_modules=["c_attn"]),
        ("gpt2", "b"): dict(seed=5, r=8, lora_alpha=16, target_modules="all-linear"),
    }
    made = {
        key: make_adapter(bases[key[0]], root / f"{key[0]}-{key[1]}", kw.pop("seed"), **kw)
        for key, kw in adapters.items()
    }
    return {"bases": bases, "adapters": made, "root": root}


@pytest.fixture(scope="module")
def models(lab):
    from tuneloop.serving.engine import load_model

    return {arch: load_model(folder, num_threads=1) for arch, folder in lab["bases"].items()}


def ref(lab, arch, name):
    from tuneloop.serving.lora import AdapterRef

    return AdapterRef(f"ft:tiny:{arch}-{name}", str(lab["adapters"][(arch, name)][0]))


def params(max_tokens, adapter=None, **kw):
    from tuneloop.serving.engine import SamplingParams

    return SamplingParams(max_new_tokens=max_tokens, temperature=0.0, ignore_eos=True, adapter=adapter, **kw)


def ids(loaded, i):
    return loaded.tokenizer(PROMPTS[i % len(PROMPTS)])["input_ids"]


def alone(lab, models, arch, name, prompts, max_tokens):
    """What each prompt gets from adapter `name` merged into the base and served alone (the
    base alone for None), by the same engine: the reference."""
    from tuneloop.serving.engine import load_model

    loaded = models[arch] if name is None else load_model(lab["adapters"][(arch, name)][1], num_threads=1)
    return [got for got, _ in run_slots(loaded, [(p, params(max_tokens)) for p in prompts], forward="fused")]


def engine(loaded, **kw):
    from tuneloop.serving.slots import SlotEngine

    e = SlotEngine(loaded, num_slots=kw.pop("num_slots", 12), forward="fused", **kw)
    e.launch()
    assert e.ready.wait(60) and e.is_running
    return e


def stream(rid, prompt, p):
    from tuneloop.serving.engine import GenerationStream

    return GenerationStream(rid, prompt, p)


@pytest.mark.parametrize("arch,compile", [("llama", False), ("gpt2", False), ("llama", True)])
def test_rows_of_two_adapters_and_the_base_in_one_batch_answer_as_each_merged_alone(lab, models, arch, compile):
    loaded = models[arch]
    names = [None, "a", "b"]
    specs = [
        (ids(loaded, i // 3), params(16 + i % 5, ref(lab, arch, names[i % 3]) if i % 3 else None)) for i in range(12)
    ]
    sizes: list[int] = []

    async def main():
        e = engine(loaded, compile=compile, on_batch=sizes.append)
        try:
            for name in "ab":  # read both first, so that the twelve are admitted in one step
                warm = stream(name, ids(loaded, 0), params(1, ref(lab, arch, name)))
                e.submit(warm)
                await collect(warm)
            sizes.clear()
            streams = [stream(f"s{i}", p, sp) for i, (p, sp) in enumerate(specs)]
            with e._wake:  # the engine's queue lock: it takes none of them before it takes all
                for s in streams:
                    e.submit(s)
            return [(await collect(s))[0] for s in streams], e.adapters.stats
        finally:
            e.stop()

    got, stats = asyncio.run(main())
    assert stats.loads == 2 and sizes[0] == 12  # all twelve rows, of three models, in the same steps
    for k, name in enumerate(names):
        rows = list(range(k, 12, 3))
        want = alone(lab, models, arch, name, [specs[i][0] for i in rows], 20)
        assert [got[i] for i in rows] == [w[: specs[i][1].max_new_tokens] for i, w in zip(rows, want)], name
    base = alone(lab, models, arch, None, [specs[i][0] for i in range(12)], 20)
    changed = [got[i] != base[i][: specs[i][1].max_new_tokens] for i in range(12) if i % 3]
    assert all(changed)  # each adapter changes every answer: the rows above are their adapter's


def test_a_third_adapter_read_under_streaming_load_drops_nothing(lab, models):
    loaded = models["llama"]
    LONG = 200  # tokens: the running streams run for a few hundred steps, the read takes a few

    async def main():
        e = engine(loaded)
        try:
            running = [
                stream(f"r{i}", ids(loaded, i), params(LONG, ref(lab, "llama", "ab"[i % 2]) if i % 3 else None))
                for i in range(9)
            ]
            for s in running:
                e.submit(s)
            tasks = [asyncio.create_task(collect(s)) for s in running]
            while not all(s.num_generated >= 3 for s in running):  # every stream is streaming
                await asyncio.sleep(0.001)
            third = [stream(f"c{i}", ids(loaded, i), params(12, ref(lab, "llama", "c"))) for i in range(3)]
            for s in third:
                e.submit(s)
            done = await asyncio.gather(*tasks, *(collect(s) for s in third))
            return running, third, done, e.adapters.stats
        finally:
            e.stop()

    running, third, done, stats = asyncio.run(main())
    assert [reason for _, reason in done] == ["length"] * 12  # none dropped, none cut
    assert [len(tokens) for tokens, _ in done[:9]] == [LONG] * 9
    # the third adapter was read and served while the others streamed, not after them
    assert max(s.first_token_at for s in third) < min(s.finished_at for s in running)
    assert stats.loads == 3 and len(stats.read_seconds) == 3
    assert [tokens for tokens, _ in done[9:]] == alone(lab, models, "llama", "c", [s.prompt_ids for s in third], 12)
    for name in (None, "a", "b"):
        rows = [i for i in range(9) if ("ab"[i % 2] if i % 3 else None) == name]
        want = alone(lab, models, "llama", name, [running[i].prompt_ids for i in rows], LONG)
        assert [done[i][0] for i in rows] == want, name


def test_least_recently_used_adapters_are_evicted_beyond_max_loaded_and_read_again(lab, models):
    from tuneloop.config import ServingLoraConfig

    loaded = models["llama"]
    prompt = ids(loaded, 1)
    want = {n: alone(lab, models, "llama", n, [prompt], 10)[0] for n in "abc"}

    async def one(e, name):
        s = stream(name, prompt, params(10, ref(lab, "llama", name)))
        e.submit(s)
        return (await collect(s))[0]

    def in_turn(lora, order):
        async def main():
            e = engine(loaded, lora=lora)
            held = []
            try:
                for name in order:
                    assert await one(e, name) == want[name], name
                    held.append("".join(sorted(n[-1] for n in e.adapters.loaded)))
                return held, e.adapters
            finally:
                e.stop()

        return asyncio.run(main())

    def at_once(lora, order):
        async def main():
            e = engine(loaded, lora=lora)
            try:
                return await asyncio.gather(*(one(e, n) for n in order)), e.adapters
            finally:
                e.stop()

        return asyncio.run(main())

    # max_loaded 2: a, b; a again (b is now the least recent); c evicts b; b evicts a; a evicts c
    held, table = in_turn(ServingLoraConfig(max_loaded=2), "abacba")
    assert held == ["a", "ab", "ab", "ac", "bc", "ab"]
    assert table.stats.loads == 5 and table.stats.evictions == 3
    # One held at a time, all asked at once: a request whose adapter has no room waits until
    # the rows using the held one end; every request is answered by its own adapter.
    answers, table = at_once(ServingLoraConfig(max_loaded=1), "abcab")
    assert answers == [want[n] for n in "abcab"] and len(table.loaded) == 1 and table.stats.loads == 3
    # max_bytes: room for b beside a or c, not beside both
    answers, table = at_once(ServingLoraConfig(), "abc")
    sizes = {name[-1]: adapter.nbytes for name, adapter in table.loaded.items()}
    budget = sizes["b"] + max(sizes["a"], sizes["c"])
    lora = ServingLoraConfig.model_construct(**{**ServingLoraConfig().model_dump(), "max_bytes": budget})
    held, table = in_turn(lora, "abcab")
    assert held == ["a", "ab", "bc", "ac", "ab"] and table.stats.evictions == 3


def test_a_bad_adapter_fails_only_its_own_request_and_says_why(lab, models, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from tuneloop.config import ServingLoraConfig
    from tuneloop.serving.lora import AdapterError, AdapterRef

    loaded, base = models["llama"], lab["bases"]["llama"]
    a_dir = lab["adapters"][("llama", "a")][0]

    def altered(name, change):
        folder = tmp_path / name
        shutil.copytree(a_dir, folder)
        tensors = load_file(folder / "adapter_model.safetensors")
        change(tensors)
        save_file(tensors, folder / "adapter_model.safetensors")
        return AdapterRef(name, str(folder))

    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    refused = {
        "rank 8 (model.layers.0.": ref(lab, "llama", "b"),  # r=8 over max_rank 4
        "modules the base model does not have": ref(lab, "gpt2", "a"),
        "do not match the base model": altered("narrow", lambda t: t.update({key: t[key][:, :32].contiguous()})),
        "no adapter folder": AdapterRef("gone", str(tmp_path / "gone")),
        "DoRA": AdapterRef("dora", str(make_adapter(base, tmp_path / "dora", 7, False, r=4, use_dora=True)[0])),
        "modules_to_save": AdapterRef(
            "mts",
            str(
                make_adapter(
                    base, tmp_path / "mts", 8, False, r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]
                )[0]
            ),
        ),
        "trained biases": AdapterRef(
            "bias", str(make_adapter(base, tmp_path / "bias", 9, False, r=4, bias="lora_only")[0])
        ),
    }
    nan = altered("nan", lambda t: t[key].fill_(float("nan")))

    async def main():
        e = engine(loaded, lora=ServingLoraConfig(max_rank=4))
        try:
            good = [
                stream(f"g{i}", ids(loaded, i), params(24, ref(lab, "llama", "a") if i % 2 else None)) for i in range(4)
            ]
            for s in good:
                e.submit(s)
            errors = {}
            for why, bad in refused.items():
                with pytest.raises(AdapterError) as caught:
                    e.submit(stream(why, ids(loaded, 0), params(8, bad)))
                errors[why] = caught.value
            late = stream("nan", ids(loaded, 0), params(8, nan))
            e.submit(late)  # its header is fine: the read finds the NaNs
            with pytest.raises(AdapterError) as caught:
                await collect(late)
            errors["non-finite"] = caught.value
            return await asyncio.gather(*(collect(s) for s in good)), good, errors
        finally:
            e.stop()

    done, good, errors = asyncio.run(main())
    for why, error in errors.items():
        assert why in str(error) and "cannot be served" in str(error), (why, str(error))
        assert error.status == 400 and error.param == "model" and error.code == "invalid_adapter"
    assert str(tmp_path / "gone") in str(errors["no adapter folder"])
    for i, s in enumerate(good):
        assert done[i] == (alone(lab, models, "llama", "a" if i % 2 else None, [s.prompt_ids], 24)[0], "length")


def test_a_swap_of_the_base_drops_the_adapters_it_held(lab, models, tmp_path):
    import shutil

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tuneloop.serving.engine import load_model

    new_base = build_tiny_model(tmp_path / "new", architecture="llama", seed=5)
    loaded = load_model(lab["bases"]["llama"], num_threads=1)  # its weights change: not the shared one
    prompt = ids(loaded, 2)
    merged = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(new_base, dtype=torch.float32), lab["adapters"][("llama", "a")][0]
    ).merge_and_unload()
    merged.save_pretrained(tmp_path / "merged")
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(new_base / f, tmp_path / "merged" / f)
    new_state = AutoModelForCausalLM.from_pretrained(new_base, dtype=torch.float32).state_dict()

    async def main():
        e = engine(loaded)
        try:
            first = stream("1", prompt, params(10, ref(lab, "llama", "a")))
            e.submit(first)
            before = (await collect(first))[0]
            held = list(e.adapters.loaded)
            await asyncio.to_thread(e.swap_weights(new_state).wait, 30)
            after_swap = list(e.adapters.loaded)
            second = stream("2", prompt, params(10, ref(lab, "llama", "a")))
            e.submit(second)
            return before, held, after_swap, (await collect(second))[0], e.adapters.stats.loads
        finally:
            e.stop()

    before, held, after_swap, after, loads = asyncio.run(main())
    assert held == ["ft:tiny:llama-a"] and after_swap == [] and loads == 2
    assert before == alone(lab, models, "llama", "a", [prompt], 10)[0]
    reference = load_model(tmp_path / "merged", num_threads=1)
    assert after == run_slots(reference, [(prompt, params(10))], forward="fused")[0][0]
    assert after != before


def test_the_engine_in_its_own_process_serves_each_row_its_adapter(lab, models):
    from tuneloop.config import ServingConfig
    from tuneloop.serving.engine import load_tokenizer
    from tuneloop.serving.engine_process import EngineProcess
    from tuneloop.serving.lora import AdapterError

    loaded = models["llama"]
    names = [None, "a", "b", "c"]
    specs = [(ids(loaded, i), params(14, ref(lab, "llama", names[i % 4]) if i % 4 else None)) for i in range(8)]
    serving = ServingConfig.model_validate({"engine_process": True, "compile": False, "num_threads": 1})

    async def main():
        e = EngineProcess(load_tokenizer(lab["bases"]["llama"]), serving)
        e.launch()
        try:
            await asyncio.to_thread(e.ready.wait, 120)
            assert e.is_running and e.supports_adapters, e.failed
            streams = [stream(f"p{i}", p, sp) for i, (p, sp) in enumerate(specs)]
            for s in streams:
                e.submit(s)
            with pytest.raises(AdapterError, match="modules the base model does not have"):
                e.submit(stream("bad", ids(loaded, 0), params(4, ref(lab, "gpt2", "a"))))
            return await asyncio.gather(*(collect(s) for s in streams))
        finally:
            await asyncio.to_thread(e.stop)

    got = asyncio.run(main())
    for k, name in enumerate(names):
        rows = list(range(k, 8, 4))
        assert [got[i][0] for i in rows] == alone(lab, models, "llama", name, [specs[i][0] for i in rows], 14), name


def test_engines_that_serve_no_adapter_refuse_it_at_once_and_say_why(lab, models):
    from tuneloop.config import ServingLoraConfig
    from tuneloop.serving.adaptive_engine import BatchGenerator
    from tuneloop.serving.continuous_engine import ContinuousEngine
    from tuneloop.serving.lora import AdaptersNotServed
    from tuneloop.serving.slots import SlotEngine

    loaded = models["llama"]
    prompt = ids(loaded, 0)

    async def refused(e):
        with pytest.raises(AdaptersNotServed) as caught:
            e.submit(stream("x", prompt, params(4, ref(lab, "llama", "a"))))
        plain = stream("y", prompt, params(4))
        e.submit(plain)  # the base is still served
        assert (await collect(plain))[1] == "length"
        return str(caught.value)

    async def slots(**kw):
        e = SlotEngine(loaded, num_slots=2, **kw)
        e.launch()
        await asyncio.to_thread(e.ready.wait, 60)
        try:
            assert not e.supports_adapters
            return await refused(e)
        finally:
            e.stop()

    assert "transformers' forward" in asyncio.run(slots(forward="transformers"))
    assert "serving.lora.enabled is false" in asyncio.run(slots(forward="fused", lora=ServingLoraConfig(enabled=False)))

    async def continuous():
        e = ContinuousEngine(loaded, num_blocks=16, page_size=32, max_batch_tokens=64)
        e.launch()
        try:
            assert not e.supports_adapters
            return await refused(e)
        finally:
            e.stop()

    assert "continuous engine serves no LoRA adapters" in asyncio.run(continuous())
    assert not BatchGenerator.supports_adapters

    async def adaptive():
        s = stream("z", prompt, params(4, ref(lab, "llama", "a")))
        BatchGenerator(loaded).run([s])
        with pytest.raises(AdaptersNotServed, match="adaptive engine"):
            await collect(s)

    asyncio.run(adaptive())


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_the_checks_before_loading_know_the_layers_the_fused_forward_computes(models, arch):
    """The API's process checks adapters from the model's config alone (config_targets); the
    engine from its fused forward (lora_targets): both name the same layers, of the same shapes."""
    from tuneloop.serving.fused_forward import fused_forward_for
    from tuneloop.serving.lora import config_targets

    model = models[arch].model
    targets = fused_forward_for(model, max_len=64).lora_targets()
    assert {m: (t.out_features, t.in_features) for m, t in targets.items()} == config_targets(model.config)
    assert len(targets) == {"llama": 7, "gpt2": 4}[arch] * model.config.num_hidden_layers
