"""The slots engine's model runner: the forward passes over the KV-cache slots.

The scheduler (slots.py: SlotEngine) decides which request gets which slot, who is admitted
and how much prompt each step prefills; the runner runs the model for those decisions and
knows nothing of queues, streams' ends or threads. What the scheduler calls:

- choose_forward(): on the engine's thread before any request: the fused forward
  (fused_forward.py) where it serves the model and matches transformers' forward on it,
  else transformers' forward, decoding with the slot attention kernel (slot_attention.py)
  where it builds and matches sdpa; uncompile() if compiling then fails; release() at stop
  (the model is shared: it gets its own attention back, and its layers their plain code);
- prefill(rows, first) and decode(rows) (transformers' forward: a left-padded prefill of
  newcomers, then one token per running row), or fused_step(rows, chunks) (the fused
  forward: ragged steps, prompt chunks beside the decodes) -> each picking row's logits;
- pick(rows, logits) -> each row's next token (sampling.py's per-row sampling, then argmax);
- move(src, dst, length): a request's cache rows into another slot (or a running request's
  prompt prefix into a newcomer's: the prefix cache);
- check_weights(state) / load_weights(state): a weight swap, in place (loaded LoRA adapters
  are dropped: they were trained on the old weights);
- adapters: the LoRA adapters held (lora.py's AdapterTable) where the fused forward serves
  the model and serving.lora is on, else None (adapter_refusal says why).
A SlotRow is a running request in its slot: the scheduler owns the list (transformers' forward:
row i in slot i; the fused forward: row.slot, where the row stays), the runner keeps each row's
cache bookkeeping (length, prefilled) as it writes.

torch and the project's modules that need it at import (fused_forward, slot_attention) are
imported inside the methods that use them: importing this module stays light.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from tuneloop.serving.engine import GenerationStream, LoadedModel, SamplingParams
from tuneloop.serving.sampling import RowFailures, RowSampler, sample_rows
from tuneloop.serving.slot_cache import SlotEngineError, allocate_slot_cache, plan_kv_cache

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------
# how much to compile

FULL_COMPILE_MAX_LAYERS = 8


def resolve_compile_mode(compile: bool, mode: str, num_layers: int) -> str:
    """off, full or regional. auto: the whole forward for small stacks (the demo model: ~1/3
    faster per step, 10-70 s of compiling), nothing for deeper ones: their whole-graph
    compile does not end in reasonable time (SmolLM2-135M's 30 layers: 17+ min in inductor
    before it was stopped), and regional compilation, bounded (60-95 s there), made its
    steps slower, not faster (float32 158 vs 199 output tok/s eager, bfloat16 271 vs 281)."""
    if not compile:
        return "off"
    if mode == "auto":
        return "full" if num_layers <= FULL_COMPILE_MAX_LAYERS else "off"
    return mode


def decoder_layers(model) -> list:
    """The model's repeated decoder blocks: its longest nn.ModuleList (Llama's model.layers,
    GPT-2's transformer.h, ...)."""
    import torch

    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        raise SlotEngineError(
            f"{type(model).__name__}: no repeated decoder layers to compile regionally; "
            "use serving.compile_mode: full, or serving.compile: false"
        )
    return list(max(lists, key=len))


# ---------------------------------------------------------------------------------------
# a request in its slot


class WarmUpSink:
    """A stream stand-in with nobody listening (start-up checks and compilation)."""

    def __init__(self, ids: list[int], steps: int):
        self.prompt_ids, self.params = ids, SamplingParams(max_new_tokens=steps, temperature=0.0)
        self.cancelled = False

    def emit(self, ids, logprobs=None) -> None:
        pass

    def note_cached(self, count: int) -> None:
        pass

    def finish(self, reason, error=None) -> None:
        pass


@dataclass(eq=False)
class SlotRow:
    """A running request in its slot."""

    stream: GenerationStream
    offset: int  # left padding of its prefill: its tokens start at this slot index
    length: int  # tokens in the slot after the padding (prompt + generated so far)
    last: int  # the token to feed next
    generated: int = 0
    sampler: RowSampler | None = None  # sampling / shaped rows; None for plain greedy
    prefilled: int = 0  # the fused forward: prompt tokens in the cache so far (it prefills in chunks)
    admitted: int = 0  # admission order: the earliest prefilling row gets the step's budget first
    adapter: str | None = None  # its LoRA adapter's name (loaded in the runner's adapters); None: the base
    slot: int = -1  # the fused forward: its slot (rows stay in theirs); transformers' forward: row i in slot i
    output: list[int] = field(default_factory=list)  # the tokens it generated, in order

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.stream.prompt_ids)

    @property
    def write_at(self) -> int:
        return self.offset + self.length

    def cached_ids(self) -> list[int]:
        """The tokens whose keys and values it wrote into its slot (the fused forward: from position 0)."""
        prompt = self.stream.prompt_ids
        if self.prefilling:
            return prompt[: self.prefilled]
        return prompt + self.output[: self.length - len(prompt)]  # `last` is fed at the next step


# ---------------------------------------------------------------------------------------
# the runner


class SlotRunner:
    """The model, its KV cache of slots, and the forward that runs over them (module docstring)."""

    def __init__(
        self,
        loaded: LoadedModel,
        num_slots: int,
        compile: bool = False,
        decode_attention: str = "kernel",
        kv_cache_tokens: int | None = None,
        kv_cache_gib: float | None = None,
        max_model_len: int | None = None,
        compile_mode: str = "auto",
        forward: str = "fused",
        lora=None,
    ):
        import torch

        config = loaded.model.config
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        if getattr(text_config, "sliding_window", None) or getattr(text_config, "is_encoder_decoder", False):
            raise SlotEngineError(
                f"{loaded.path}: the slots engine needs a decoder with full attention on every layer "
                f"(this one is {text_config.model_type} with a sliding window or an encoder); "
                "use serving.engine: continuous"
            )
        self.loaded = loaded
        self.model = loaded.model
        self.device = self.model.device
        # num_slots is the most slots; the budget may give fewer, each of plan.slot_len tokens
        self.plan = plan_kv_cache(
            self.model, loaded.context_length, num_slots, kv_cache_tokens, kv_cache_gib, max_model_len
        )
        log.info("slots engine: %s", self.plan.describe())
        self.num_slots = self.plan.num_slots
        self.max_len = self.plan.slot_len
        self.pad_id = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else 0
        self.cache = allocate_slot_cache(text_config.num_hidden_layers, self.num_slots, self.max_len)
        self.cache.rows = self.cache.rows.to(self.device)
        self._arange = torch.arange(self.max_len, device=self.device)
        # Decoding attention: our kernel over each row's own tokens where it builds and
        # agrees with sdpa on this model (slot_attention.py), else sdpa up to the longest row.
        # Chosen on the engine's thread at start (choose_forward), not here: all model work stays
        # on one thread. Running the model once on the constructing thread too left OpenMP with a
        # second thread team whose spinning cost the engine ~20% (in-process 5.0k vs 8.0k tok/s).
        self.decode_attention = decode_attention
        self.kernel = False
        # The forward: tuneloop's fused one (fused_forward.py: Llama and GPT-2 architectures on a CPU,
        # ragged steps that prefill newcomers beside the running decodes) where it serves the
        # model and matches transformers' forward on it at start-up; else transformers' own.
        # Also chosen on the engine's thread (choose_forward).
        if forward not in ("fused", "transformers"):
            raise ValueError(f"serving.forward must be fused or transformers, not {forward!r}")
        self.forward_wanted = forward
        self.fused = None  # a fused_forward.FusedDecoder once chosen
        # LoRA adapters (serving.lora, a ServingLoraConfig or None): served on the fused forward
        # only, set up once it is chosen (choose_forward); adapter_refusal says why not otherwise.
        self.lora = lora
        self.adapters = None  # lora.AdapterTable
        self.adapter_refusal = (
            "the engine has not started" if lora is not None and lora.enabled else "serving.lora.enabled is false"
        )
        self.on_adapter_read = lambda: None  # set by the scheduler: an adapter was read (wake the idle engine)
        self._replaced_attention: str | None = None  # the model's attention before the kernel's
        self._forward, self._decode_forward = self._run_model, self._decode_model
        self._compiled_layers: list = []
        self.compile_mode = resolve_compile_mode(compile, compile_mode, text_config.num_hidden_layers)
        if self.compile_mode == "full":
            # Compiled apart: the prefill (every prompt width) and the decoding step (mask included).
            self._forward = torch.compile(self._run_model, dynamic=True)
            self._decode_forward = torch.compile(self._decode_model, dynamic=True)
        elif self.compile_mode == "regional":
            # One decoder layer's code, compiled once and shared by every layer (parameters
            # are graph inputs): compile time of one layer, not of the whole stack.
            self._compiled_layers = decoder_layers(self.model)
            for layer in self._compiled_layers:
                layer.compile(dynamic=True)
        self.compiled = self.compile_mode != "off"

    @property
    def forward_name(self) -> str:
        return "fused" if self.fused is not None else "transformers"

    @property
    def ragged(self) -> bool:
        """Whether steps are ragged (fused_step: prompt chunks beside the decodes) rather than
        a padded prefill of the newcomers and a decoding step of the running rows."""
        return self.fused is not None

    # ---- start and stop -----------------------------------------------------------------
    def choose_forward(self) -> None:
        """Pick the forward and the decoding attention (on the engine's thread, before any request)."""
        if self.forward_wanted == "fused":
            try:
                self.fused = self._use_fused()
            except Exception:  # the engine still serves, with transformers' forward
                log.exception("slots engine: checking the fused forward failed; serving with transformers' forward")
                self.fused = None
        if self.fused is not None:  # eager: nothing of transformers' forward to compile or re-route
            self.compiled, self.compile_mode = False, "off"
            if self.lora is not None and self.lora.enabled:
                self._serve_adapters()
            return
        if self.lora is not None and self.lora.enabled:
            self.adapter_refusal = (
                "LoRA adapters are served on the slots engine's fused forward, and this model is served "
                "with transformers' forward"
            )
        if self.decode_attention == "kernel":
            try:
                self.kernel = self._use_kernel()
            except Exception:  # the engine still serves, with sdpa
                log.exception("slots engine: checking the slot attention kernel failed; decoding uses sdpa")
                self.kernel = False

    def _serve_adapters(self) -> None:
        from tuneloop.serving.lora_table import AdapterTable  # deferred: with fused_forward (torch)

        self.adapters = AdapterTable(
            self.fused.lora_targets(),
            self.model.dtype,
            self.lora.max_loaded,
            self.lora.max_bytes,
            self.lora.max_rank,
            wake=lambda: self.on_adapter_read(),
        )
        self.adapter_refusal = None

    def uncompile(self) -> None:
        """Serve the eager model (torch.compile failed on it)."""
        self._forward, self._decode_forward = self._run_model, self._decode_model
        self._uncompile_layers()
        self.compiled, self.compile_mode = False, "off"

    def release(self) -> None:
        """Give the shared model back as it was: its own attention, its layers' plain code."""
        if self._replaced_attention is not None:
            self.model.config._attn_implementation = self._replaced_attention
            self._replaced_attention = None
        self._uncompile_layers()
        if self.adapters is not None:
            self.adapters.stop()

    def _uncompile_layers(self) -> None:
        for layer in self._compiled_layers:  # nn.Module.compile keeps its compiled call here
            layer._compiled_call_impl = None
        self._compiled_layers = []

    def _use_fused(self):
        """The fused forward for the served model if there is one and it matches transformers' forward on it."""
        import torch

        from tuneloop.serving import fused_forward  # deferred: it imports torch and transformers (2.9 s)

        reason = fused_forward.unsupported_reason(self.model)
        if reason is not None:
            log.info("slots engine: transformers' forward (the fused forward does not serve %s)", reason)
            return None
        fused = fused_forward.fused_forward_for(self.model, self.max_len)
        if self.cache.kv is None:
            self.cache.allocate_shape(fused.kv_heads, fused.head_dim, self.model.dtype, self.device)
        with torch.inference_mode():
            mismatch = fused_forward.check_against_transformers(fused, self.model, self.cache.kv)
        if mismatch is not None:
            log.warning(
                "slots engine: the fused forward disagrees with transformers' on %s (%s); "
                "serving with transformers' forward",
                self.loaded.path,
                mismatch,
            )
            return None
        return fused

    def _use_kernel(self) -> bool:
        """Install the slot attention kernel if it builds, fits the model, and matches sdpa on it."""
        import torch

        from tuneloop.serving import slot_attention  # deferred: it imports torch and transformers (2.9 s)

        if not slot_attention.usable_for(self.model) or slot_attention.load_kernel() is None:
            return False
        self._replaced_attention = slot_attention.install(self.model)
        self._no_mask = torch.ones((self.num_slots, 1, 1, 1), dtype=torch.bool, device=self.device)
        # The model must hand our keyword to its attention layers and read the cache as a
        # transformers model should: check on two rows (one left-padded) against sdpa.
        with torch.inference_mode():
            rows = [
                SlotRow(WarmUpSink([1, 2, 3, 4], 2), offset=0, length=4, last=-1),  # type: ignore[arg-type]
                SlotRow(WarmUpSink([5, 6], 2), offset=2, length=2, last=-1),
            ][: self.num_slots]  # type: ignore[arg-type]
            logits = self.prefill(rows, 0, self._run_model)  # uncompiled: compiling comes after this choice
            for row, token in zip(rows, logits.argmax(dim=-1).tolist()):
                row.last = token
            state = self._decode_state(rows)
            self.kernel = True
            try:
                ours = self._decode_model(state)
            except Exception:
                log.exception("slot attention kernel failed on %s; decoding uses sdpa", self.loaded.path)
                ours = None
            self.kernel = False
            reference = self._decode_model(state)  # rewrites the same cache entries
        if ours is None or not torch.allclose(ours, reference, rtol=1e-4, atol=1e-4):
            if ours is not None:
                log.warning(
                    "slot attention kernel disagrees with sdpa on %s (max |diff| %.2e); decoding uses sdpa",
                    self.loaded.path,
                    float((ours - reference).abs().max()),
                )
            return False
        return True

    # ---- the forward passes -------------------------------------------------------------
    def prefill(self, newcomers: list[SlotRow], first: int, forward=None):
        """The newcomers' prompts, left-padded to the longest, into slots first.. (consecutive):
        their last prompt token's logits, one row each (raises if the forward fails)."""
        import torch

        width = max(r.offset + r.length for r in newcomers)
        ids = torch.tensor([[self.pad_id] * r.offset + r.stream.prompt_ids for r in newcomers], device=self.device)
        offsets = torch.tensor([r.offset for r in newcomers], device=self.device)
        cols = self._arange[:width]
        # query i attends to key j when j <= i (causal) and j is not padding; a padding
        # query attends to itself only (a row with nothing to attend to would be NaN)
        mask = (cols[None, :, None] >= cols[None, None, :]) & (cols[None, None, :] >= offsets[:, None, None])
        mask |= torch.eye(width, dtype=torch.bool, device=self.device)[None]
        positions = (cols[None, :] - offsets[:, None]).clamp(min=0)
        self.cache.prefill = True
        self.cache.slots = torch.arange(first, first + len(newcomers), device=self.device)
        try:
            return (forward or self._forward)(ids, mask[:, None], positions)
        finally:
            self.cache.prefill = False

    def decode(self, rows: list[SlotRow]):
        """One token for each of rows (slots 0..len(rows)-1): their logits."""
        state = self._decode_state(rows)
        logits = self._decode_forward(state)
        for r in rows:
            r.length += 1  # its `last` token is in the cache now
        return logits

    def _decode_state(self, rows: list[SlotRow]):
        """One (n, 3) tensor: the token fed, its position id, and where its slot starts; and
        the step's key length."""
        import torch

        state = torch.tensor([(r.last, r.length, r.offset) for r in rows], device=self.device)
        self.cache.kv_len = max(r.write_at for r in rows) + 1
        return state

    def _decode_model(self, state):
        """A decoding step from (token, position id, slot offset) per row; builds the mask itself."""
        ids, positions, offsets = state[:, 0:1], state[:, 1:2], state[:, 2:3]
        writes = offsets + positions  # each row's new token goes here in its slot
        self.cache.positions = writes[:, 0]
        if self.kernel:  # row i attends to offsets[i]..writes[i] of its slot; the mask is a placeholder
            self.cache.whole_slots = True
            try:
                return self._run_model(
                    ids, self._no_mask[: ids.shape[0]], positions, slot_bounds=(offsets[:, 0], writes[:, 0])
                )
            finally:
                self.cache.whole_slots = False
        cols = self._arange[: self.cache.kv_len][None, :]
        mask = (cols <= writes) & (cols >= offsets)
        return self._run_model(ids, mask[:, None, None, :], positions)

    def _run_model(self, input_ids, mask, position_ids, **attention_kwargs):
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
            **attention_kwargs,
        )
        return out.logits[:, -1, :]

    def fused_step(self, rows: list[SlotRow], chunks: dict[int, int]):
        """One ragged forward over rows (each in its row.slot): a token for each decoding row,
        and chunks[i] more prompt tokens of each prefilling row i given one (a prefilling row
        not in chunks waits). (logits, their rows' indices in rows) for the rows that decoded
        and those whose prompt is now whole; None if there was nothing to run."""
        import torch

        ids: list[int] = []
        slots: list[int] = []
        positions: list[int] = []
        starts: list[int] = []
        picks: list[int] = []  # the tokens whose logits pick a next token
        picked: list[int] = []  # ... and their rows' indices
        decoding: list[SlotRow] = []
        adapters: list[int] = []  # each token's adapter's position in the stacks (0: the base)
        table = self.adapters
        for i, row in enumerate(rows):
            if i in chunks:
                first, count = row.prefilled, chunks[i]
                ids.extend(row.stream.prompt_ids[first : first + count])
                positions.extend(range(first, first + count))
                if first + count == len(row.stream.prompt_ids):
                    picks.append(len(ids) - 1)
                    picked.append(i)
            elif not row.prefilling:
                ids.append(row.last)
                positions.append(row.write_at)
                count = 1
                picks.append(len(ids) - 1)
                picked.append(i)
                decoding.append(row)
            else:
                continue  # waits for budget in a later step
            slots.extend([row.slot] * count)
            starts.extend([row.offset] * count)
            if table is not None:
                adapters.extend([table.position(row.adapter) if row.adapter is not None else 0] * count)
        if not ids:
            return None

        def longs(values: list[int]):
            return torch.tensor(values, dtype=torch.long, device=self.device)

        lora = table.step(adapters, self.fused.rows_for(len(ids))) if table is not None else None
        logits = self.fused.forward(
            longs(ids), longs(slots), longs(positions), longs(starts), longs(picks), self.cache.kv, lora
        )
        for row in decoding:
            row.length += 1  # its `last` token is in the cache now
        for i, count in chunks.items():
            rows[i].prefilled += count
        return logits, picked

    def pick(self, rows: list[SlotRow], logits) -> tuple[list[int], RowFailures]:
        """Each row's next token from its logits (shaped and sampled in place for the rows with a
        sampler), and the rows whose sampling failed ({index: exception})."""
        failed: RowFailures = {}
        if any(r.sampler is not None for r in rows):
            failed = sample_rows(logits, [r.sampler for r in rows])
        return logits.argmax(dim=-1).tolist(), failed

    def move(self, src: int, dst: int, length: int) -> None:
        """A request's first `length` cache positions from slot src into slot dst (also how a
        running request's prompt prefix is copied for a newcomer that shares it)."""
        self.cache.move(src, dst, length)

    # ---- a new model's weights ----------------------------------------------------------
    def check_weights(self, state: dict) -> None:
        """Raise ValueError unless `state` is a state dict of the served model's architecture."""
        own = self.model.state_dict()
        missing = sorted(set(own) - set(state))
        wrong = [k for k in own if k in state and tuple(state[k].shape) != tuple(own[k].shape)]
        if missing or wrong:
            raise ValueError(f"not the served model's architecture: missing {missing[:3]}, other shapes {wrong[:3]}")

    def load_weights(self, state: dict) -> None:
        """Copy `state` into the served model in place (compiled code and the KV cache stay valid)."""
        import torch

        with torch.no_grad():
            for name, tensor in self.model.state_dict().items():  # views of the parameters: copied in place
                tensor.copy_(state[name].to(device=tensor.device, dtype=tensor.dtype))
        if self.fused is not None:  # its fused weights are views of these; packed copies are not
            self.fused.refresh()
        if self.adapters is not None:  # trained on the weights just replaced
            self.adapters.clear()
