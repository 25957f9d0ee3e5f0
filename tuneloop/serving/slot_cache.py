"""The slots engine's KV cache: its layout (one preallocated row per slot, on huge pages
where Linux grants them) and its size (a budget, not slots x the model's whole window).

The layout and why it is so: slots.py's module docstring. torch and transformers are
imported inside the functions that use them: importing this module stays light.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tuneloop.serving.errors import ServingSetupError


class SlotEngineError(ServingSetupError):
    """The model cannot be served by the slots engine (the message says why and what to use)."""


# ---------------------------------------------------------------------------------------
# the cache the model writes into


HUGE_PAGE = 2 << 20
KEY_BLOCK = 16  # fused_forward.KEY_BLOCK (not imported here: that module needs torch at import)
MADV_HUGEPAGE = 14


def _zeros_on_huge_pages(shape: tuple[int, ...], dtype, device):
    """torch.zeros(shape), on CPU placed on transparent huge pages where the kernel allows it.

    Each decoding step reads every active row's keys and values (tens of MB with 32 rows)
    at scattered offsets; with 4 KiB pages that costs a TLB miss per page. 2 MiB pages cut
    the slot attention kernel's time by ~15% here. Linux only grants them to 2 MiB-aligned
    memory marked with madvise(MADV_HUGEPAGE) (when transparent_hugepage is `madvise`, the
    common default) before it is first touched. So the memory is a fresh anonymous mapping
    of our own: torch's allocator may hand out heap memory that was touched before (glibc
    raises its mmap threshold after large frees), and touched pages stay small. Anywhere
    else this is plain torch.zeros.
    """
    import torch

    if torch.device(device).type != "cpu" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    # Private (a shared anonymous mapping is shmem, which huge pages rarely cover), untouched, zero-filled.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer = torch.frombuffer(region, dtype=torch.uint8)  # shares the memory and keeps `region` alive
    offset = -buffer.data_ptr() % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, offset, nbytes // mmap.PAGESIZE * mmap.PAGESIZE)
    except OSError:  # EINVAL: transparent huge pages are off; small pages then
        pass
    # Zeroing is the first touch: the pages fault in huge.
    return buffer[offset : offset + nbytes].view(dtype).view(shape).zero_()


def allocate_slot_cache(num_layers: int, num_slots: int, max_len: int):
    """A transformers Cache whose layers keep one row per slot (see slots.py's module docstring).

    All layers share one tensor (layers x 2 x slots x kv heads x max_len x head dim), so
    moving a request to another slot is one copy. Before each forward the runner sets
    where this step writes:
      prefill: slot indices `slots` of the newcomers (their padded prompts start at index 0);
      decode:  rows 0..n-1, each at write index positions[i], attending to [:kv_len].
    """
    import torch
    from transformers.cache_utils import Cache, CacheLayerMixin

    class SlotLayer(CacheLayerMixin):
        def __init__(self, owner, index: int):
            super().__init__()
            self.owner, self.index = owner, index

        def lazy_initialization(self, key_states, value_states) -> None:
            self.owner.allocate(key_states)

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            o = self.owner
            if o.prefill:  # empty slots: attention needs only the new keys
                width = key_states.shape[2]
                self.keys[:, :, :width].index_copy_(0, o.slots, key_states)
                self.values[:, :, :width].index_copy_(0, o.slots, value_states)
                return key_states, value_states
            n = key_states.shape[0]
            self.keys[o.rows[:n], :, o.positions] = key_states[:, :, 0]
            self.values[o.rows[:n], :, o.positions] = value_states[:, :, 0]
            if o.whole_slots:  # the slot attention kernel reads each row's own range itself
                return self.keys[:n], self.values[:n]
            return self.keys[:n, :, : o.kv_len], self.values[:n, :, : o.kv_len]

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.owner.kv_len, 0  # unused: the engine always passes a 4D mask

        def get_seq_length(self) -> int:
            return 0  # unused: the engine always passes position ids

        def get_max_length(self) -> int:
            return self.owner.max_len

    class SlotCache(Cache):
        def __init__(self):
            self.num_slots, self.max_len = num_slots, max_len
            super().__init__(layers=[SlotLayer(self, i) for i in range(num_layers)])
            self.kv = None
            self.rows = torch.arange(num_slots)
            self.prefill = False
            self.slots = torch.zeros(0, dtype=torch.long)
            self.positions = torch.zeros(num_slots, dtype=torch.long)
            self.kv_len = 1
            self.whole_slots = False  # decode returns whole slots (for the slot attention kernel)

        def allocate(self, key_states) -> None:
            _, heads, _, dim = key_states.shape
            self.allocate_shape(heads, dim, key_states.dtype, key_states.device)

        def allocate_shape(self, heads: int, dim: int, dtype, device) -> None:
            # positions rounded up to whole key blocks of the fused forward's cache layout
            positions = -(-self.max_len // KEY_BLOCK) * KEY_BLOCK
            shape = (len(self.layers), 2, self.num_slots, heads, positions, dim)
            self.kv = _zeros_on_huge_pages(shape, dtype, device)
            for layer in self.layers:
                layer.keys, layer.values = self.kv[layer.index, 0], self.kv[layer.index, 1]
                layer.is_initialized = True

        def move(self, src: int, dst: int, length: int) -> None:
            if self.kv is not None:  # whole key blocks (the fused forward's keys are stored by block)
                length = -(-length // KEY_BLOCK) * KEY_BLOCK
                self.kv[:, :, dst, :, :length] = self.kv[:, :, src, :, :length]

    return SlotCache()


# ---------------------------------------------------------------------------------------
# how much cache, in how many slots


@dataclass(frozen=True)
class KVCachePlan:
    """The slots engine's cache: num_slots slots of slot_len token positions each."""

    num_slots: int
    slot_len: int  # the longest request (prompt + max_tokens) the engine serves
    bytes_per_token: int

    @property
    def tokens(self) -> int:
        return self.num_slots * self.slot_len

    @property
    def gib(self) -> float:
        return self.tokens * self.bytes_per_token / 2**30

    def describe(self) -> str:
        return (
            f"KV cache: {self.tokens} tokens ({self.gib:.2f} GiB) = {self.num_slots} slots x {self.slot_len} "
            f"tokens; a request may use up to {self.slot_len} tokens (prompt + max_tokens)"
        )


MIN_SLOT_LEN = 2048  # without max_model_len, slots shrink to fit max_batch_size in the budget, not below this
DEFAULT_KV_FRACTION = 0.2  # of the memory available at start-up, without kv_cache_tokens / kv_cache_gib


def kv_bytes_per_token(model) -> int:
    """Keys + values of one token over every layer, in the model's dtype."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers * 2 * kv_heads * head_dim * model.dtype.itemsize


def available_memory_bytes() -> int | None:
    """MemAvailable (Linux), or None where it cannot be read."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def plan_kv_cache(
    model,
    context_length: int,
    max_slots: int,
    kv_cache_tokens: int | None = None,
    kv_cache_gib: float | None = None,
    max_model_len: int | None = None,
) -> KVCachePlan:
    """Size the cache by a budget, not by max_slots x the model's whole context window.

    The budget: kv_cache_tokens, else kv_cache_gib, else DEFAULT_KV_FRACTION of the memory
    available now. Each slot holds max_model_len tokens when given (at most the context
    window); otherwise the window, shrunk where the budget cannot give every one of
    max_slots that much (never below MIN_SLOT_LEN); then as many slots as the budget holds.
    """
    per_token = kv_bytes_per_token(model)
    if kv_cache_tokens is not None:
        budget, source = kv_cache_tokens, "serving.kv_cache_tokens"
    elif kv_cache_gib is not None:
        budget, source = int(kv_cache_gib * 2**30 // per_token), "serving.kv_cache_gib"
    else:
        free = available_memory_bytes()
        budget = int(free * DEFAULT_KV_FRACTION // per_token) if free else max_slots * context_length
        source = f"{DEFAULT_KV_FRACTION:.0%} of available memory"
    if max_model_len is not None:
        if max_model_len > context_length:
            raise SlotEngineError(
                f"serving.max_model_len={max_model_len} is above the model's context window of {context_length} tokens"
            )
        slot_len = max_model_len
    else:
        slot_len = min(context_length, max(budget // max_slots, min(context_length, MIN_SLOT_LEN)))
    slots = min(max_slots, budget // slot_len)
    if slots < 1:
        if max_model_len is not None or budget < 64:
            raise SlotEngineError(
                f"the KV cache budget ({source}: {budget} tokens, {per_token} bytes each) holds no slot of "
                f"{slot_len} tokens; raise serving.kv_cache_tokens / kv_cache_gib or lower serving.max_model_len"
            )
        slots, slot_len = 1, budget
    return KVCachePlan(slots, slot_len, per_token)


# ---------------------------------------------------------------------------------------
# which slot a request takes, and the prompt prefixes slots still hold (the prefix cache)


MIN_REUSED_TOKENS = 16  # a shorter common prefix (a chat template's opening) is not worth a slot's held tokens


def common_prefix_length(a: list[int], b: list[int], limit: int) -> int:
    """How many leading tokens a and b share, at most `limit`. List slices compare in C: a
    binary search over them costs a few slice comparisons, not a Python loop per token."""
    n = min(len(a), len(b), limit)
    if n <= 0 or a[:n] == b[:n]:
        return max(n, 0)
    same, differs = 0, n  # a[:same] == b[:same]; a[:differs] != b[:differs]
    while differs - same > 1:
        mid = (same + differs) // 2
        if a[same:mid] == b[same:mid]:
            same = mid
        else:
            differs = mid
    return same


@dataclass(frozen=True)
class SlotChoice:
    """Where a request goes: its slot, and how many of its prompt's first tokens need no
    prefill there (their keys and values are in the slot already, or copied from `source`)."""

    slot: int
    reused: int = 0
    source: int | None = None  # a running request's slot to copy the reused tokens' cache from


@dataclass(frozen=True)
class RunningPrefix:
    """A running request's prompt tokens already in its slot (a source to copy from)."""

    slot: int
    tokens: list[int]
    count: int  # tokens[:count] are in the cache
    adapter: object = None


class SlotPool:
    """The slots engine's free slots (the fused forward's ragged steps), and for each the
    tokens whose keys and values it still holds from the request that used it last: the
    prefix cache, as llama.cpp's server keeps a slot's tokens (`cache_prompt`).

    A newcomer takes the free slot holding the longest prefix of its prompt, made with its
    adapter (a LoRA changes the keys and values; None: the base), and prefills only the rest;
    at least its last prompt token is prefilled, so that its first token's logits come from
    the forward. Among equal prefixes, and when no slot holds MIN_REUSED_TOKENS of it, the
    least recently used slot, an empty one first: a slot holding someone's prefix is given up
    last. With `running` sources, a prefix longer by MIN_REUSED_TOKENS or more in a running
    request's slot is copied into the chosen slot (a few MB, far less than prefilling it). Disabled, nothing is held:
    every prompt is prefilled whole (serving.prefix_cache: false).

    Held tokens stay valid while nothing else writes to the slot: the weights and adapters
    they were computed with must not change (forget() at a weight swap) and a failed step
    leaves what it wrote unknown (reset()).
    """

    def __init__(self, num_slots: int, enabled: bool = True, min_reused: int = MIN_REUSED_TOKENS):
        self.enabled = enabled
        self.min_reused = max(1, min_reused)
        self.free: set[int] = set(range(num_slots))
        self.held: list[list[int]] = [[] for _ in range(num_slots)]
        self.adapter: list[object] = [None] * num_slots
        self.used = [0] * num_slots  # when each slot was last taken or given back (a counter)
        self._clock = 0

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def choose(self, prompt: list[int], adapter: object = None, running: Sequence[RunningPrefix] = ()) -> SlotChoice:
        """The free slot `prompt` should take (the class docstring says which); there must be one."""
        limit = len(prompt) - 1  # the last prompt token is always prefilled
        best, reused = None, 0
        if self.enabled:
            for slot in self.free:
                if self.adapter[slot] != adapter or not self.held[slot]:
                    continue
                n = common_prefix_length(self.held[slot], prompt, limit)
                if n > reused or (n == reused and best is not None and self.used[slot] < self.used[best]):
                    best, reused = slot, n
        if reused < self.min_reused:
            best, reused = None, 0
        slot = best if best is not None else self._victim()
        source, copied = None, reused
        for r in running if self.enabled else ():
            if r.adapter == adapter:
                n = common_prefix_length(r.tokens, prompt, min(limit, r.count))
                if n > copied:
                    source, copied = r.slot, n
        if source is not None and copied - reused >= self.min_reused:  # worth a copy
            return SlotChoice(slot, copied, source)
        return SlotChoice(slot, reused)

    def _victim(self) -> int:
        """The free slot whose held tokens are worth least: an empty one, else the least recently used."""
        return min(self.free, key=lambda s: (bool(self.held[s]), self.used[s], s))

    def take(self, choice: SlotChoice) -> None:
        """The slot is a running request's now: what it held beyond the reused prefix is overwritten."""
        self.free.remove(choice.slot)
        self.held[choice.slot], self.adapter[choice.slot] = [], None
        self.used[choice.slot] = self._tick()

    def give_back(self, slot: int, tokens: list[int], adapter: object = None) -> None:
        """The request in `slot` ended; `tokens` are those whose keys and values it wrote there."""
        self.free.add(slot)
        if self.enabled:
            self.held[slot], self.adapter[slot] = tokens, adapter
        self.used[slot] = self._tick()

    def forget(self) -> None:
        """Drop every held prefix (the weights changed: they were computed with the old ones)."""
        for slot in range(len(self.held)):
            self.held[slot], self.adapter[slot] = [], None

    def reset(self) -> None:
        """Every slot free and holding nothing (after a step failed with its requests)."""
        self.forget()
        self.free = set(range(len(self.held)))
