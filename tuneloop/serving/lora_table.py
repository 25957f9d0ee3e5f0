"""The LoRA adapters one slots engine holds, and the batched products that apply them:
each row of a step its own adapter, in the fused forward (punica / S-LoRA style).

- AdapterTable (on the engine's thread): the adapters held, least recently used first. A new
  one is read on a thread of its own (read_adapter) while the running streams go on, and
  installed at a step boundary, evicting the least recently used one that no running row
  uses when serving.lora.max_loaded or max_bytes would be exceeded. Its requests wait
  meanwhile; nobody else does. A swap of the base drops them all (clear).
- stack / Stacks: for each part of a fused product that adapters target (q, k, v of the
  q|k|v product, o, gate and up of the gate|up product, down), the loaded adapters' A
  matrices stacked along the rank ([sum of ranks, in]) and their B matrices, scale folded
  in, likewise ([sum of ranks, out]), per layer.
- LoraStep: a step whose rows use adapters adds, per part and layer,
      out[:, part] += ((x @ A^T) * mask) @ B'
  where mask [tokens, sum of ranks] is 1 on the columns of each token's own adapter and 0
  elsewhere (base rows: 0 everywhere): three calls per part, whatever the number of
  adapters, on the columns between the first and last adapter the step uses. The work is
  that of every adapter in that range for every token, yet it beat doing only each token's
  own: `benchmarks/lora.py --products` at SmolLM2's sizes (30 layers, r=8, 8 adapters, 2
  cores, 2026-12-07), ms per forward for q,v / all seven projections:
      32 decoding tokens:  mask 2.1 / 14.3, a loop over the step's adapters (gather their
                           rows, two products, scatter) 7.8 / 43.4, padded per-adapter bmm
                           4.4 / 22.8; the base's own products 48
      256-token prefill:   mask 12.6 / 72, loop 29 / 117, bmm 21 / 101; the base's 199
  A step without adapter rows runs the base forward unchanged.

torch and safetensors are imported inside the functions that use them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from tuneloop.serving.lora import WEIGHTS_FILE, AdapterError, AdapterRef, Target, inspect_adapter

log = logging.getLogger(__name__)


@dataclass(eq=False)
class LoadedAdapter:
    """An adapter's weights in the served dtype, per (layer, part): A [r, in] and B' = (scale B)^T
    [r, out], every layer of a part it targets at that part's rank (zeros where it does not)."""

    name: str
    path: str
    ranks: dict[tuple, int]  # part -> rank
    weights: dict[tuple, tuple]  # (layer, part) -> (A, B')
    nbytes: int
    read_seconds: float


def read_adapter(ref: AdapterRef, targets: Mapping[str, Target], dtype, max_rank: int, max_bytes: int) -> LoadedAdapter:
    """Read and check an adapter folder for a base whose linear layers are `targets`."""
    import torch
    from safetensors.torch import load_file  # deferred: imports torch

    started = time.perf_counter()
    spec = inspect_adapter(ref, {m: (t.out_features, t.in_features) for m, t in targets.items()}, max_rank)
    try:
        tensors = load_file(str(spec.weights))
    except Exception as exc:  # noqa: BLE001 - a damaged file refuses this adapter, nothing else
        raise AdapterError(f"adapter {ref.name!r} cannot be served: {WEIGHTS_FILE} cannot be read ({exc})") from None
    by_part: dict[tuple, dict[int, tuple]] = {}
    for module, (_, scale) in spec.modules.items():
        a = tensors[f"base_model.model.{module}.lora_A.weight"]
        b = tensors[f"base_model.model.{module}.lora_B.weight"]
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(f"adapter {ref.name!r} cannot be served: {module} has non-finite weights")
        target = targets[module]
        by_part.setdefault(target.part, {})[target.layer] = (
            a.to(dtype).contiguous(),
            (b.float() * scale).t().to(dtype).contiguous(),
        )
    where = {(t.layer, t.part): t for t in targets.values()}
    layers = sorted({t.layer for t in targets.values()})
    ranks = {part: max(a.shape[0] for a, _ in got.values()) for part, got in by_part.items()}
    weights: dict[tuple, tuple] = {}
    nbytes = 0
    for part, got in by_part.items():
        r = ranks[part]
        for layer in layers:
            target = where[(layer, part)]
            a = torch.zeros((r, target.in_features), dtype=dtype)
            bt = torch.zeros((r, target.out_features), dtype=dtype)
            if layer in got:  # a smaller rank here (rank_pattern) sits in the first rows
                a[: got[layer][0].shape[0]] = got[layer][0]
                bt[: got[layer][1].shape[0]] = got[layer][1]
            weights[(layer, part)] = (a, bt)
            nbytes += a.numel() * a.element_size() + bt.numel() * bt.element_size()
    if nbytes > max_bytes:
        raise AdapterError(
            f"adapter {ref.name!r} cannot be served: it needs {nbytes / 2**20:.1f} MiB, over serving.lora.max_bytes "
            f"({max_bytes / 2**20:.0f} MiB)"
        )
    return LoadedAdapter(ref.name, ref.path, ranks, weights, nbytes, time.perf_counter() - started)


# ---------------------------------------------------------------------------------------
# the adapters held, stacked for the batched products


@dataclass
class Stacks:
    """The loaded adapters' weights stacked along the rank, per (layer, part), in `names` order."""

    names: list[str]
    position: dict[str, int]  # adapter name -> its row in the masks (1-based; 0 is the base)
    parts: list[tuple]
    columns: dict[tuple, list[tuple[int, int]]]  # part -> each position's columns (index 0: the base's, empty)
    masks: dict[tuple, Any]  # part -> [adapters + 1, columns] of 0/1
    weights: dict[tuple, tuple]  # (layer, part) -> (A [columns, in], B' [columns, out])


def stack(adapters: list[LoadedAdapter], layers: list[int], dtype) -> Stacks:
    """One A and one B' per (layer, part) for all of `adapters`; each adapter's weights then
    become views of them (no second copy is kept)."""
    import torch

    parts = sorted({p for a in adapters for p in a.ranks})
    columns: dict[tuple, list[tuple[int, int]]] = {}
    masks = {}
    for part in parts:
        spans, at = [(0, 0)], 0
        for a in adapters:
            r = a.ranks.get(part, 0)
            spans.append((at, at + r))
            at += r
        columns[part] = spans
        mask = torch.zeros((len(adapters) + 1, at), dtype=dtype)
        for pos, (c0, c1) in enumerate(spans):
            mask[pos, c0:c1] = 1
        masks[part] = mask
    weights = {}
    for part in parts:
        holders = [a for a in adapters if part in a.ranks]
        for layer in layers:
            pieces = [a.weights[(layer, part)] for a in holders]
            a_all = torch.cat([p[0] for p in pieces])
            b_all = torch.cat([p[1] for p in pieces])
            weights[(layer, part)] = (a_all, b_all)
            at = 0
            for holder, (a, _) in zip(holders, pieces):
                r = a.shape[0]
                holder.weights[(layer, part)] = (a_all[at : at + r], b_all[at : at + r])
                at += r
    names = [a.name for a in adapters]
    return Stacks(names, {n: i + 1 for i, n in enumerate(names)}, parts, columns, masks, weights)


class LoraStep:
    """The adapters of one forward: each token's adapter (its position in the stacks, 0 for
    the base) and, per part, the columns the step needs and their mask. add() is what the
    fused forward calls after each product."""

    def __init__(self, stacks: Stacks, positions: list[int], rows: int):
        import torch

        self.stacks = stacks
        index = torch.zeros(rows, dtype=torch.long)
        index[: len(positions)] = torch.tensor(positions, dtype=torch.long)
        used = sorted(set(positions) - {0})
        self.by_linear: dict[str, list[tuple]] = {}
        for part in stacks.parts:
            spans = [stacks.columns[part][p] for p in used if stacks.columns[part][p][1] > stacks.columns[part][p][0]]
            if not spans:
                continue  # no adapter of this step targets this part
            c0, c1 = spans[0][0], spans[-1][1]  # between the first and last used (positions are in column order)
            mask = stacks.masks[part][:, c0:c1].index_select(0, index)
            self.by_linear.setdefault(part[0], []).append((part, c0, c1, mask))

    def add(self, layer: int, linear: str, x, out) -> None:
        """out += each token's own adapter's delta on the parts of `linear` it targets (x: that product's input)."""
        for part, c0, c1, mask in self.by_linear.get(linear, ()):  # no import here: called per product and layer
            a, bt = self.stacks.weights[(layer, part)]
            xa = x.mm(a[c0:c1].t())
            xa.mul_(mask)
            _, start, stop = part
            (out if start == 0 and stop == out.shape[1] else out[:, start:stop]).addmm_(xa, bt[c0:c1])


# ---------------------------------------------------------------------------------------
# the table one engine holds


@dataclass
class _Read:
    name: str
    generation: int
    adapter: LoadedAdapter | None = None
    error: BaseException | None = None


@dataclass
class AdapterStats:
    loads: int = 0
    evictions: int = 0
    read_seconds: list[float] = field(default_factory=list)  # each load's read (its own thread)
    install_seconds: list[float] = field(default_factory=list)  # each install (the engine's step boundary)


class AdapterTable:
    """The adapters one slots engine holds, least recently used first (module docstring).

    Every method but the reader's runs on the engine's thread. Streams whose adapter is not
    loaded wait here (wait_for) while it is read; poll() installs what was read and gives
    those streams back to be admitted, or fails them with the reader's error."""

    def __init__(
        self,
        targets: Mapping[str, Target],
        dtype,
        max_loaded: int,
        max_bytes: int,
        max_rank: int,
        wake: Callable[[], None] = lambda: None,
    ):
        self.targets, self.dtype = dict(targets), dtype
        self.max_loaded, self.max_bytes, self.max_rank = max_loaded, max_bytes, max_rank
        self.layers = sorted({t.layer for t in self.targets.values()})
        self.wake = wake
        self.loaded: OrderedDict[str, LoadedAdapter] = OrderedDict()  # least recently used first
        self.stacks: Stacks | None = None
        self.stats = AdapterStats()
        self.generation = 0  # bumped when the base changes: reads begun before are dropped
        self._waiting: dict[str, list] = {}  # adapter name -> streams waiting for it, in arrival order
        self._paths: dict[str, AdapterRef] = {}
        self._asked: set[str] = set()  # being read
        self._ready: list[LoadedAdapter] = []  # read, waiting for room (every loaded one in use)
        self._done: list[_Read] = []  # from the reader
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._reader: threading.Thread | None = None

    # ---- what the scheduler asks --------------------------------------------------------
    def position(self, name: str) -> int | None:
        """The adapter's position in the stacks (1-based), or None if it is not loaded."""
        return self.stacks.position.get(name) if self.stacks is not None else None

    def touch(self, name: str) -> None:
        """A request uses it: the most recently used now."""
        self.loaded.move_to_end(name)

    def wait_for(self, stream) -> None:
        """Hold stream until its adapter is loaded (reading it if nobody is yet)."""
        ref: AdapterRef = stream.params.adapter
        self._waiting.setdefault(ref.name, []).append(stream)
        self._paths[ref.name] = ref
        if ref.name not in self._asked and not any(a.name == ref.name for a in self._ready):
            self._ask(ref)

    @property
    def has_news(self) -> bool:
        """Something was read and is not installed yet (the idle engine wakes up for it: with no
        row running, there is room for it)."""
        with self._lock:
            return bool(self._done) or bool(self._ready)

    def waiting(self) -> list:
        return [s for streams in self._waiting.values() for s in streams]

    def poll(self, in_use: set[str]) -> list:
        """Install what was read (evicting least recently used adapters not in `in_use`, the
        running rows' ones, as needed); fail the streams of adapters that could not be read.
        Returns the streams whose adapter is now loaded, in arrival order."""
        with self._lock:
            done, self._done = self._done, []
        for read in done:
            if read.generation != self.generation:  # begun before a swap of the base: clear() asked again
                continue
            self._asked.discard(read.name)
            if read.error is not None:
                streams = self._waiting.pop(read.name, [])
                for s in streams:
                    if not s.cancelled:
                        s.finish("error", read.error)
                continue
            self._ready.append(read.adapter)
        admitted = []
        in_use = set(in_use)  # and what this poll installs: its requests are about to run
        for adapter in list(self._ready):
            streams = [s for s in self._waiting.get(adapter.name, []) if not s.cancelled]
            if not streams:  # every request that wanted it is gone: not worth a place
                self._ready.remove(adapter)
                self._waiting.pop(adapter.name, None)
                continue
            if adapter.name in self.loaded or self._install(adapter, in_use):
                self._ready.remove(adapter)
                self._waiting.pop(adapter.name, None)
                admitted.extend(streams)
                in_use.add(adapter.name)
        return admitted

    def clear(self) -> None:
        """The base model changed: every adapter was trained on the old one; drop them all
        (waiting requests read theirs again)."""
        if self.loaded:
            log.info("lora: base model swapped; dropping %d loaded adapters", len(self.loaded))
        self.loaded.clear()
        self.stacks = None
        self._ready.clear()
        self.generation += 1
        self._asked.clear()
        for name, streams in self._waiting.items():
            if streams:
                self._ask(self._paths[name])

    def step(self, positions: list[int], rows: int) -> LoraStep | None:
        """The forward's LoraStep for tokens whose adapters are at `positions` (None when all are 0)."""
        if self.stacks is None or not any(positions):
            return None
        return LoraStep(self.stacks, positions, rows)

    def stop(self) -> None:
        if self._reader is not None:
            self._queue.put(None)

    # ---- inside -------------------------------------------------------------------------
    def _install(self, adapter: LoadedAdapter, in_use: set[str]) -> bool:
        """Make room (least recently used first, never one in use) and restack; False when no room can be made."""
        started = time.perf_counter()
        used = sum(a.nbytes for a in self.loaded.values())
        victims = []
        for name, held in self.loaded.items():
            if len(self.loaded) - len(victims) < self.max_loaded and used + adapter.nbytes <= self.max_bytes:
                break
            if name not in in_use:
                victims.append(name)
                used -= held.nbytes
        if len(self.loaded) - len(victims) >= self.max_loaded or used + adapter.nbytes > self.max_bytes:
            return False
        for name in victims:
            del self.loaded[name]
            self.stats.evictions += 1
        self.loaded[adapter.name] = adapter
        self.stacks = stack(list(self.loaded.values()), self.layers, self.dtype)
        seconds = time.perf_counter() - started
        self.stats.loads += 1
        self.stats.read_seconds.append(adapter.read_seconds)
        self.stats.install_seconds.append(seconds)
        log.info(
            "lora: adapter %s loaded (read in %.1f ms, installed in %.1f ms, %.1f MiB)%s; %d held",
            adapter.name,
            adapter.read_seconds * 1000,
            seconds * 1000,
            adapter.nbytes / 2**20,
            f", evicted {', '.join(victims)}" if victims else "",
            len(self.loaded),
        )
        return True

    def _ask(self, ref: AdapterRef) -> None:
        self._asked.add(ref.name)
        if self._reader is None:
            self._reader = threading.Thread(target=self._read_loop, name="lora-reader", daemon=True)
            self._reader.start()
        self._queue.put((ref, self.generation))

    def _read_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            ref, generation = item
            read = _Read(ref.name, generation)
            try:
                read.adapter = read_adapter(ref, self.targets, self.dtype, self.max_rank, self.max_bytes)
            except AdapterError as exc:
                read.error = exc
            except Exception as exc:  # noqa: BLE001 - this adapter's requests fail, with the reason
                log.exception("lora: reading adapter %s failed", ref.name)
                read.error = AdapterError(f"adapter {ref.name!r} cannot be served: {type(exc).__name__}: {exc}")
            with self._lock:
                self._done.append(read)
            self.wake()
