"""The slots engine's prefix cache (serving.prefix_cache; slot_cache.py's SlotPool, slots.py):
which free slot a prompt takes (the longest common prefix, else the least recently used, an empty
one first), and through the engine on its fused forward: a shared prefix is prefilled once, its
stream says how many tokens were reused, and every answer is `generate`'s token for token, with
the prefix held by a free slot, copied from a running request, or carried over from an earlier
turn's answer; adapters never share a prefix with the base or each other; a weight swap drops
every held prefix; serving.prefix_cache: false prefills every prompt whole. Through the HTTP API
(cached_tokens in usage, the first token sooner): tests/integration/test_prefix_cache.py."""

from __future__ import annotations

import asyncio
import copy

import pytest

from tests.support.lora import make_adapter
from tests.support.serving import collect, reference
from tests.support.serving_tiny_model import build_tiny_model

# ---------------------------------------------------------------------------------------
# which slot


def test_common_prefix_length_counts_shared_leading_tokens_up_to_a_limit():
    from tuneloop.serving.slot_cache import common_prefix_length

    a = list(range(1000))
    assert common_prefix_length(a, a, 2000) == 1000
    assert common_prefix_length(a, a, 999) == 999
    for k in (0, 1, 15, 16, 17, 500, 998, 999):
        b = a[:k] + [-1] + a[k + 1 :]
        assert common_prefix_length(a, b, 2000) == k
        assert common_prefix_length(b, a[:k], 2000) == k
    assert common_prefix_length([], a, 10) == 0
    assert common_prefix_length(a, a, 0) == 0


def test_a_prompt_takes_the_free_slot_with_the_longest_common_prefix_else_the_least_recently_used():
    from tuneloop.serving.slot_cache import RunningPrefix, SlotChoice, SlotPool

    def put(pool, slot, tokens, adapter=None):  # a request ran in `slot` and wrote `tokens`
        pool.take(SlotChoice(slot))
        pool.give_back(slot, tokens, adapter)

    system, other = list(range(100, 200)), list(range(500, 540))
    pool = SlotPool(4, min_reused=16)
    assert pool.choose(system) == SlotChoice(0, 0)  # nothing held: the empty slots in order
    put(pool, 0, system + [1, 2, 3])
    put(pool, 1, system[:60] + [7] * 10)
    put(pool, 2, other)
    # The longest common prefix wins, whatever the slots' ages; never the whole prompt (its last
    # token is prefilled, for the first token's logits).
    assert pool.choose(system + [9]) == SlotChoice(0, 100)
    assert pool.choose(system[:70]) == SlotChoice(0, 69)
    assert pool.choose(system + [1, 2, 3]) == SlotChoice(0, 102)
    assert pool.choose(other + [1]) == SlotChoice(2, 40)
    # No useful prefix (under min_reused: a chat template's opening): the empty slot 3 before
    # any slot holding something, then the least recently used.
    assert pool.choose(system[:10] + [1] * 30) == SlotChoice(3, 0)
    put(pool, 3, [9] * 30)
    assert pool.choose([1] * 30) == SlotChoice(0, 0)
    # Equal prefixes: the least recently used of them (slot 0 was just given back).
    put(pool, 0, system[:60] + [8] * 10)
    assert pool.choose(system[:60] + [5]) == SlotChoice(1, 60)
    assert pool.choose([1] * 30) == SlotChoice(1, 0)
    # A taken slot is nobody's prefix; a slot given back holds what its request wrote.
    pool.take(SlotChoice(1, 60))
    assert pool.choose(system[:60] + [5]) == SlotChoice(0, 60)
    pool.give_back(1, system + [4])
    assert pool.choose(system + [9]) == SlotChoice(1, 100)
    # A longer prefix in a running request's slot (as far as it is prefilled) is copied into
    # the chosen slot, when it is min_reused tokens or more longer than a free slot's.
    pool.take(SlotChoice(3))
    running = [RunningPrefix(slot=3, tokens=system + [4, 4], count=102)]
    assert pool.choose(system + [4, 4, 6], None, running) == SlotChoice(1, 101)  # one more token: no copy
    longer = system + list(range(1000, 1040))
    running = [RunningPrefix(slot=3, tokens=longer, count=130)]
    assert pool.choose(longer + [1], None, running) == SlotChoice(1, 130, source=3)
    assert pool.choose(other + [1], None, running) == SlotChoice(2, 40)
    assert pool.choose(longer + [1], "ft:a", running) == SlotChoice(2, 0)  # the base's: no copy; LRU


def test_prefixes_are_per_adapter_and_dropped_by_forget_and_when_disabled():
    from tuneloop.serving.slot_cache import SlotChoice, SlotPool

    prompt = list(range(200))
    pool = SlotPool(3)
    for slot, adapter in ((0, None), (1, ("ft:a", "/a"))):
        pool.take(SlotChoice(slot))
        pool.give_back(slot, prompt, adapter)
    assert pool.choose(prompt + [1]) == SlotChoice(0, 200)
    assert pool.choose(prompt + [1], ("ft:a", "/a")) == SlotChoice(1, 200)
    assert pool.choose(prompt + [1], ("ft:b", "/b")).reused == 0
    assert pool.choose(prompt + [1], ("ft:a", "/a-retrained")).reused == 0
    pool.forget()
    assert pool.choose(prompt + [1]).reused == 0 and pool.free == {0, 1, 2}

    off = SlotPool(2, enabled=False)
    off.take(off.choose(prompt))
    off.give_back(0, prompt)
    assert off.choose(prompt + [1]) == SlotChoice(1, 0)
    off.take(SlotChoice(1))
    assert off.choose(prompt + [1]) == SlotChoice(0, 0)


# ---------------------------------------------------------------------------------------
# through the engine


ARCHITECTURES = ["llama", "gpt2"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix")
    return {
        arch: {
            "a": build_tiny_model(root / f"{arch}-a", context_length=512, architecture=arch, seed=0),
            "b": build_tiny_model(root / f"{arch}-b", context_length=512, architecture=arch, seed=1),
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


SYSTEM = "A model server answers completions and chat completions over HTTP. " * 16
QUESTIONS = ["Hello world", "The quick brown fox jumps over", "x", "Tokens are generated one at a time;"]


def chat(loaded, question: str, system: str = SYSTEM) -> list[int]:
    text = loaded.tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": question}],
        add_generation_prompt=True,
        tokenize=False,
    )
    return loaded.encode(text)


def greedy(max_tokens: int, **kw):
    from tuneloop.serving.engine import SamplingParams

    return SamplingParams(max_new_tokens=max_tokens, temperature=0.0, **kw)


class Engine:
    """A SlotEngine on the fused forward, started; counts the tokens its forward runs."""

    def __init__(self, loaded, **kw):
        from tuneloop.serving.slots import SlotEngine

        self.engine = SlotEngine(loaded, num_slots=kw.pop("num_slots", 4), forward="fused", **kw)
        self.engine.launch()
        assert self.engine.ready.wait(120) and self.engine.is_running
        assert self.engine.forward_name == "fused"
        self.forwarded = 0
        fused = self.engine.runner.fused
        forward = fused.forward

        def counted(ids, *args, **kwargs):
            self.forwarded += ids.shape[0]
            return forward(ids, *args, **kwargs)

        fused.forward = counted

    async def run(self, prompt: list[int], params) -> tuple[list[int], int]:
        from tuneloop.serving.engine import GenerationStream

        stream = GenerationStream(f"r{self.forwarded}", prompt, params)
        self.engine.submit(stream)
        ids, _ = await collect(stream)
        return ids, stream.cached_tokens

    def stop(self) -> None:
        self.engine.stop()


def test_a_shared_prefix_is_prefilled_once_and_every_answer_is_generates(loaded):
    prompts = [chat(loaded, q) for q in QUESTIONS]
    shared = min(next(i for i, (a, b) in enumerate(zip(prompts[0], p)) if a != b) for p in prompts[1:])
    assert shared > 200  # the system prompt and the chat template's opening

    async def main(prefix_cache: bool):
        engine = Engine(loaded, prefix_cache=prefix_cache)
        try:
            got = [await engine.run(p, greedy(12)) for p in prompts]
        finally:
            engine.stop()
        return got, engine.forwarded

    on, forwarded_on = asyncio.run(main(True))
    off, forwarded_off = asyncio.run(main(False))
    for p, (ids_on, _), (ids_off, cached_off) in zip(prompts, on, off):
        assert ids_on == ids_off == reference(loaded, p, 12)
        assert cached_off == 0
    cached = [c for _, c in on]
    assert cached[0] == 0 and all(c >= shared for c in cached[1:]), cached
    # The forward ran every reused token once only (the decoding steps are the same: same answers).
    assert forwarded_off - forwarded_on == sum(cached)


def test_an_earlier_turns_answer_is_reused_and_a_running_requests_prefix_copied(loaded):
    """A conversation's next prompt starts with the previous prompt and answer: all of it is
    reused. A newcomer whose prefix only a running request's slot holds copies it."""
    first = chat(loaded, QUESTIONS[0])

    async def main():
        engine = Engine(loaded)
        try:
            answer, cached = await engine.run(first, greedy(10, ignore_eos=True))
            assert cached == 0 and len(answer) == 10
            follow_up = first + answer + loaded.encode("<|im_end|>\n<|im_start|>user\nAnd then?<|im_end|>\n")
            got, cached = await engine.run(follow_up, greedy(8))
            # the last answer token was never fed to the model: its keys and values are not there
            assert cached == len(first) + len(answer) - 1
            assert got == reference(loaded, follow_up, 8)

            # A long generation runs; the free slots hold other prompts or nothing.
            from tuneloop.serving.engine import GenerationStream

            await engine.run(chat(loaded, QUESTIONS[1], system="Another system prompt entirely. " * 10), greedy(4))
            system = "Yet another system prompt, a long one. " * 10
            running = chat(loaded, QUESTIONS[2], system=system)
            runner = GenerationStream("long", running, greedy(200, ignore_eos=True))
            engine.engine.submit(runner)
            events = runner.events()
            head = await events.__anext__()  # its prompt is all in its slot once its first token came
            newcomer = chat(loaded, QUESTIONS[3], system=system)
            got, cached = await engine.run(newcomer, greedy(8))
            shared = next(i for i, (a, b) in enumerate(zip(running, newcomer)) if a != b)
            assert shared > 100 and cached == shared and not runner.done
            assert got == reference(loaded, newcomer, 8)
            rest = [t async for batch in events for t in batch]
            assert len(head) + len(rest) == 200
        finally:
            engine.stop()

    asyncio.run(main())


def test_adapters_share_no_prefix_with_the_base_or_each_other(folders, tmp_path):
    """The same long prompt through the base, adapter a, adapter b and the base again, one slot
    each time free: only a request of the same adapter reuses a prefix, and each answer is its
    adapter's merged into the base and served alone (a reused prefix of the wrong adapter would
    change it: these adapters change every linear layer, keys and values included)."""
    from tuneloop.serving.engine import load_model
    from tuneloop.serving.lora import AdapterRef

    base = folders["llama"]["a"]
    made = {
        name: make_adapter(base, tmp_path / name, seed, r=8, target_modules="all-linear")
        for name, seed in (("a", 1), ("b", 2))
    }
    refs = {name: AdapterRef(f"ft:tiny:{name}", str(adapter)) for name, (adapter, _) in made.items()}
    loaded = load_model(base, num_threads=1)
    prompts = [chat(loaded, q) for q in QUESTIONS]
    order = [None, "a", "b", None, "a", "b"]

    async def main():
        engine = Engine(loaded, num_slots=3)
        try:
            return [
                await engine.run(prompts[i % len(prompts)], greedy(10, adapter=refs.get(name)))
                for i, name in enumerate(order)
            ]
        finally:
            engine.stop()

    got = asyncio.run(main())
    cached = [c for _, c in got]
    # a and b find the base's system prompt held, and take an empty slot; then each its own
    assert cached[:3] == [0, 0, 0] and min(cached[3:]) > 200, cached
    merged = {name: load_model(m, num_threads=1) for name, (_, m) in made.items()}
    for i, name in enumerate(order):
        model = loaded if name is None else merged[name]
        assert got[i][0] == reference(model, prompts[i % len(prompts)], 10), (i, name)


def test_a_weight_swap_drops_every_held_prefix(folders, loaded, arch):
    from tuneloop.serving.engine import load_model

    other = load_model(folders[arch]["b"], num_threads=1)
    prompt = chat(loaded, QUESTIONS[1])

    async def main():
        engine = Engine(copy.deepcopy(loaded), num_slots=2)
        try:
            before = [await engine.run(prompt, greedy(10)) for _ in range(2)]
            assert engine.engine.swap_weights(other.model.state_dict()).wait(60)
            assert engine.engine.swap_error is None
            after = [await engine.run(prompt, greedy(10)) for _ in range(2)]
        finally:
            engine.stop()
        return before, after

    before, after = asyncio.run(main())
    assert [c for _, c in before] == [0, len(prompt) - 1]
    assert [c for _, c in after] == [0, len(prompt) - 1]  # nothing of the old weights' cache was reused
    assert before[0][0] == before[1][0] == reference(loaded, prompt, 10)
    assert after[0][0] == after[1][0] == reference(other, prompt, 10) != before[0][0]
