"""The slots engine's own forward for Llama- and GPT-2-architecture decoders on a CPU.

transformers' forward is written for every device and feature: per layer it runs ~40 small
operators (separate q/k/v and gate/up products, RoPE as a dozen element-wise steps,
RMSNorm as five, the cache's bookkeeping, mask handling), each a Python call and a trip
through the dispatcher. On SmolLM2-135M (30 layers, bf16, 32 rows decoding, 2 cores) its
step took ~125 ms of which the matrix products were ~50 ms; on the 4-layer demo model a
torch.compile'd step still took ~5 ms, nearly all of it overhead.

This forward keeps the matrix products and little else: per layer
  norm -> one q|k|v product -> RoPE + cache write + attention (one C call)
  -> output product -> residual + norm (one C call) -> MLP up product(s)
  -> activation (one C call) -> MLP down product,
for a *ragged* batch: one flat list of tokens, each with its slot and position. A decoding
row contributes one token, a prefilling row a chunk of its prompt, in the same call: prompts
are prefilled next to the running decodes, with no padding and no separate prefill step.
Logits are computed only for the tokens that pick a next one.

Llama (RMSNorm, RoPE, SwiGLU): the q|k|v and gate|up weights are fused into one tensor each
and the model's own Linear layers are re-pointed at slices of them (views). GPT-2 (LayerNorm,
learned positions, GELU): its Conv1D weights already are one q|k|v product. Either way the
model, its state_dict and a weight swap (SlotEngine.swap_weights copies into them) share the
memory this forward reads; packed copies (bfloat16) are refreshed after a swap.

The engine compares it with transformers' forward on the served model at start-up
(check_against_transformers) and keeps transformers' forward if they disagree.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tuneloop.serving import slot_attention
from tuneloop.serving.lora import Target
from tuneloop.serving.lora_table import LoraStep

log = logging.getLogger(__name__)

STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # cos/sin depend on the position only
GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")  # the tanh approximation (one formula)
STORAGE = {torch.float32: "f32", torch.bfloat16: "bf16"}
MAX_GROUP = 64  # query heads per kv head the attention kernel handles (TL_MAX_GROUP)
KEY_BLOCK = 16  # positions per key block in the cache (TL_BLOCK): slots hold a multiple of it


def _text_config(model):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def unsupported_reason(model) -> str | None:
    """Why no fused forward can serve `model`, or None when one can."""
    config = _text_config(model)
    architecture = ARCHITECTURES.get(config.model_type)
    if architecture is None:
        return f"model_type {config.model_type!r} (fused forward: {', '.join(ARCHITECTURES)})"
    if model.device.type != "cpu":
        return f"device {model.device.type} (fused forward: CPU)"
    if model.dtype not in STORAGE:
        return f"dtype {model.dtype} (fused forward: float32, bfloat16)"
    return architecture.unsupported_reason(config)


def fused_forward_for(model, max_len: int) -> "FusedDecoder":
    """The fused forward for `model` (see unsupported_reason), for slots of max_len positions."""
    reason = unsupported_reason(model)
    if reason is not None:
        raise ValueError(f"the fused forward cannot serve this model: {reason}")
    return ARCHITECTURES[_text_config(model).model_type](model, max_len)


def bucket_rows(n: int) -> int:
    """Rows the matrix products run on for n tokens: n up to 64 (decoding steps: one per row),
    else n rounded up to a multiple of 64 (steps that prefill prompts)."""
    return n if n <= 64 else -(-n // 64) * 64


def _ptr(tensor: torch.Tensor | None):
    return None if tensor is None else tensor.data_ptr()


# bfloat16 weights go to oneDNN pre-packed in its blocked layout (AMX / AVX-512 BF16 tiles):
# the plain layout is re-blocked inside every product. Measured on SmolLM2-135M's 30 layers
# here: 32 rows 27.7 -> 17.3 ms, 128 rows 43.5 -> 26.6 ms; the hint is the row count the
# layout is tuned for. float32 products gained nothing from packing and keep the plain layout.
PACK_HINT_ROWS = 128


def _packing_works(dtype) -> bool:
    if dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ones(16, 32, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_HINT_ROWS)
        out = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 32, dtype=dtype), packed, None, "none", [], "")
        return bool(torch.all(out == 32))
    except (RuntimeError, AttributeError):
        return False


def _head_dim_reason(head_dim: int) -> str | None:
    """Why the fused forward cannot serve this head size (keys live in blocks of KEY_BLOCK), or None."""
    return f"head_dim {head_dim} (fused forward: a multiple of {KEY_BLOCK})" if head_dim % KEY_BLOCK else None


class _Linear:
    """y = x W^T (+ b) with W [out, in] from the model (a view it shares), pre-packed when `pack`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: bool):
        self.weight, self.bias, self.pack = weight, bias, pack
        self.packed = None
        self.refresh()

    def refresh(self) -> None:
        """Re-pack after the model's weights changed in place (a weight swap)."""
        if self.pack:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach().contiguous(), PACK_HINT_ROWS)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def _fuse(linears) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several Linear layers on the same input; the layers become views of it."""
    weight = torch.cat([layer.weight.detach() for layer in linears]).contiguous()
    has_bias = [layer.bias is not None for layer in linears]
    if any(has_bias) and not all(has_bias):
        raise ValueError("some of the fused projections have a bias and some do not")
    bias = torch.cat([layer.bias.detach() for layer in linears]).contiguous() if all(has_bias) else None
    start = 0
    for layer in linears:
        rows = layer.weight.shape[0]
        layer.weight.data = weight[start : start + rows]
        if bias is not None:
            layer.bias.data = bias[start : start + rows]
        start += rows
    return weight, bias


@dataclass
class _Layer:
    norm1: tuple  # (weight, bias or None)
    qkv: _Linear
    o: _Linear
    norm2: tuple
    up: _Linear  # Llama: gate|up; GPT-2: c_fc
    down: _Linear
    scale: float  # of the attention scores


class FusedDecoder:
    """forward(ids, slots, positions, starts, logit_rows, kv) -> logits, over a ragged batch.
    Subclasses say how to embed, normalise and activate, and where the model keeps its weights."""

    def __init__(self, model, max_len: int):
        library = slot_attention.load_library()
        if library is None:
            raise RuntimeError("the fused forward's kernels could not be built (see the log)")
        self.model, self.dtype, self.max_len = model, model.dtype, max_len
        self.storage = STORAGE[self.dtype]
        self._attention = self._kernel(
            library, "ragged_attention", [ctypes.c_void_p] * 9 + [ctypes.c_long] * 5 + [ctypes.c_float]
        )
        self.pack = _packing_works(self.dtype)
        self.layers: list[_Layer] = []
        self.lm_head: _Linear
        self.embed: torch.Tensor
        self.final_norm: tuple
        self.heads = self.kv_heads = self.head_dim = self.hidden = 0
        self.cos = self.sin = None  # RoPE tables, when the model rotates
        self._lora_parts: list[tuple] = []  # (module, Target) for each linear layer a LoRA may target

    rows_for = staticmethod(bucket_rows)  # the rows a step of n tokens runs its products on

    def _targetable(self, module, layer: int, linear: str, start: int, stop: int, in_features: int) -> None:
        self._lora_parts.append((module, Target(layer, linear, start, stop, in_features)))

    def lora_targets(self) -> dict[str, Target]:
        """{the model's name for a linear layer (as peft names it): where this forward computes
        it}: the layers a LoRA adapter may target (serving/lora.py). The output layer is not one."""
        names = {id(m): n for n, m in self.model.named_modules()}
        return {names[id(module)]: target for module, target in self._lora_parts}

    def _kernel(self, library, name: str, argtypes: list):
        function = getattr(library, f"{name}_{self.storage}")
        function.argtypes, function.restype = argtypes, None
        return function

    # what subclasses provide
    def _embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _norm(self, x: torch.Tensor, delta: torch.Tensor | None, norm: tuple, out: torch.Tensor, n: int) -> None:
        """x[:n] += delta[:n] (when given, in place), then out[:n] = norm(x[:n])."""
        raise NotImplementedError

    def _activate(self, up: torch.Tensor, n: int) -> torch.Tensor:
        """The MLP's activation of the up product (the first n rows; the rest zeros)."""
        raise NotImplementedError

    def refresh(self) -> None:
        """The model's weights changed in place (SlotEngine.swap_weights): re-pack the packed copies."""
        for linear in self.linears():
            linear.refresh()

    def linears(self) -> list[_Linear]:
        return [self.lm_head, *(lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.up, layer.down))]

    def forward(
        self,
        ids: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
        starts: torch.Tensor,
        logit_rows: torch.Tensor,
        kv: torch.Tensor,
        lora: LoraStep | None = None,
    ) -> torch.Tensor:
        """ids, slots, positions, starts: int64 [n], one entry per token. Token i is written at
        cache position positions[i] of slot slots[i] and attends to starts[i]..positions[i]
        there (its position in its sequence is positions[i] - starts[i]). kv: the engine's
        cache (layers x 2 x slots x kv heads x positions x head dim). lora: each token's LoRA
        adapter, added after each product it targets (None: the base alone, nothing added).
        Returns the logits of the tokens logit_rows names, [len(logit_rows), vocab]."""
        n = ids.shape[0]
        # The matrix products run on `rows` >= n rows (the rest zeros, their results unused):
        # oneDNN builds a kernel per shape, ~1 ms each the first time, and a ragged step's
        # token count changes from step to step; bucketed, few shapes ever occur.
        rows = bucket_rows(n)
        x = self._embed(F.pad(ids, (0, rows - n)), F.pad(positions - starts, (0, rows - n)))
        h = torch.zeros_like(x)
        attended = torch.zeros((rows, self.heads * self.head_dim), dtype=self.dtype)
        slots_p, positions_p, starts_p = slots.data_ptr(), positions.data_ptr(), starts.data_ptr()
        cos_p, sin_p = _ptr(self.cos), _ptr(self.sin)
        delta = None
        for i, layer in enumerate(self.layers):
            self._norm(x, delta, layer.norm1, h, n)
            qkv = layer.qkv(h)
            if lora is not None:
                lora.add(i, "qkv", h, qkv)
            self._attention(
                qkv.data_ptr(),
                kv[i, 0].data_ptr(),
                kv[i, 1].data_ptr(),
                cos_p,
                sin_p,
                slots_p,
                positions_p,
                starts_p,
                attended.data_ptr(),
                n,
                self.heads,
                self.kv_heads,
                kv.shape[4],
                self.head_dim,
                layer.scale,
            )
            o = layer.o(attended)
            if lora is not None:
                lora.add(i, "o", attended, o)
            self._norm(x, o, layer.norm2, h, n)
            up = layer.up(h)
            if lora is not None:
                lora.add(i, "up", h, up)
            act = self._activate(up, n)
            delta = layer.down(act)
            if lora is not None:
                lora.add(i, "down", act, delta)
        if logit_rows.numel() == 0:  # only chunks of prompts still incomplete
            return torch.empty((0, self.embed.shape[0]), dtype=self.dtype)
        x, delta = x[logit_rows].contiguous(), delta[logit_rows].contiguous()
        out = torch.empty_like(x)
        self._norm(x, delta, self.final_norm, out, x.shape[0])
        return self.lm_head(out)


class FusedLlama(FusedDecoder):
    """LlamaForCausalLM and models of its shape: RMSNorm, RoPE with fixed tables, SwiGLU."""

    @staticmethod
    def unsupported_reason(config) -> str | None:
        if getattr(config, "hidden_act", "silu") != "silu":
            return f"hidden_act {config.hidden_act!r}"
        if getattr(config, "pretraining_tp", 1) != 1:
            return "pretraining_tp > 1"
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
        if rope_type not in STATIC_ROPE_TYPES:
            return f"rope_type {rope_type!r}"
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        if heads % kv_heads or heads // kv_heads > MAX_GROUP:
            return f"{heads} query heads over {kv_heads} kv heads"
        return _head_dim_reason(getattr(config, "head_dim", None) or config.hidden_size // heads)

    def __init__(self, model, max_len: int):
        super().__init__(model, max_len)
        config = _text_config(model)
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.hidden = config.hidden_size
        self.eps = float(config.rms_norm_eps)
        self._rms_norm = self._kernel(
            slot_attention.load_library(),
            "add_rms_norm",
            [ctypes.c_void_p] * 4 + [ctypes.c_long] * 2 + [ctypes.c_float],
        )
        self._silu_mul = self._kernel(
            slot_attention.load_library(), "silu_mul", [ctypes.c_void_p] * 2 + [ctypes.c_long] * 2
        )
        inner = model.model
        self.embed = inner.embed_tokens.weight
        self.final_norm = (inner.norm.weight, None)
        self.lm_head = _Linear(model.lm_head.weight, model.lm_head.bias, self.pack)
        for i, layer in enumerate(inner.layers):
            attn, mlp = layer.self_attn, layer.mlp
            at = 0
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                self._targetable(proj, i, "qkv", at, at + proj.weight.shape[0], proj.weight.shape[1])
                at += proj.weight.shape[0]
            self._targetable(attn.o_proj, i, "o", 0, attn.o_proj.weight.shape[0], attn.o_proj.weight.shape[1])
            inter = mlp.gate_proj.weight.shape[0]
            self._targetable(mlp.gate_proj, i, "up", 0, inter, mlp.gate_proj.weight.shape[1])
            self._targetable(
                mlp.up_proj, i, "up", inter, inter + mlp.up_proj.weight.shape[0], mlp.up_proj.weight.shape[1]
            )
            self._targetable(mlp.down_proj, i, "down", 0, mlp.down_proj.weight.shape[0], mlp.down_proj.weight.shape[1])
            self.layers.append(
                _Layer(
                    norm1=(layer.input_layernorm.weight, None),
                    qkv=_Linear(*_fuse([attn.q_proj, attn.k_proj, attn.v_proj]), self.pack),
                    o=_Linear(attn.o_proj.weight, attn.o_proj.bias, self.pack),
                    norm2=(layer.post_attention_layernorm.weight, None),
                    up=_Linear(*_fuse([mlp.gate_proj, mlp.up_proj]), self.pack),
                    down=_Linear(mlp.down_proj.weight, mlp.down_proj.bias, self.pack),
                    scale=float(getattr(attn, "scaling", self.head_dim**-0.5)),
                )
            )
        # RoPE tables for every position a slot holds, in float32, from the model's own
        # rotary module (its inv_freq and attention scaling): what its forward would compute.
        with torch.no_grad():
            cos, sin = inner.rotary_emb(torch.zeros(1, dtype=torch.float32), torch.arange(max_len)[None])
        self.cos, self.sin = cos[0].float().contiguous(), sin[0].float().contiguous()
        if self.cos.shape != (max_len, self.head_dim):
            raise ValueError(f"unexpected RoPE table shape {tuple(self.cos.shape)}")

    def _embed(self, ids, positions):
        return F.embedding(ids, self.embed)

    def _norm(self, x, delta, norm, out, n):
        self._rms_norm(x.data_ptr(), _ptr(delta), norm[0].data_ptr(), out.data_ptr(), n, self.hidden, self.eps)

    def _activate(self, up, n):
        act = torch.zeros((up.shape[0], up.shape[1] // 2), dtype=self.dtype)
        self._silu_mul(up.data_ptr(), act.data_ptr(), n, act.shape[1])
        return act


class FusedGPT2(FusedDecoder):
    """GPT2LMHeadModel (the demo's bootstrap architecture): LayerNorm, learned positions,
    GELU (tanh approximation), Conv1D weights ([in, out]; read transposed)."""

    @staticmethod
    def unsupported_reason(config) -> str | None:
        if config.activation_function not in GELU_TANH:
            return f"activation_function {config.activation_function!r} (fused forward: {', '.join(GELU_TANH)})"
        if getattr(config, "add_cross_attention", False):
            return "cross-attention"
        return _head_dim_reason(config.n_embd // config.n_head)

    def __init__(self, model, max_len: int):
        super().__init__(model, max_len)
        config = _text_config(model)
        self.heads = self.kv_heads = config.n_head
        self.hidden = config.n_embd
        self.head_dim = self.hidden // self.heads
        self.eps = float(config.layer_norm_epsilon)
        self._layer_norm = self._kernel(
            slot_attention.load_library(),
            "add_layer_norm",
            [ctypes.c_void_p] * 5 + [ctypes.c_long] * 2 + [ctypes.c_float],
        )
        self._gelu = self._kernel(slot_attention.load_library(), "gelu_tanh", [ctypes.c_void_p] + [ctypes.c_long] * 2)
        inner = model.transformer
        self.embed, self.positions = inner.wte.weight, inner.wpe.weight
        self.final_norm = (inner.ln_f.weight, inner.ln_f.bias)
        self.lm_head = _Linear(model.lm_head.weight, model.lm_head.bias, self.pack)

        def conv1d(layer) -> _Linear:  # Conv1D keeps [in, out]: its transpose is a view
            return _Linear(layer.weight.t(), layer.bias, self.pack)

        for i, block in enumerate(inner.h):
            for conv, linear in (
                (block.attn.c_attn, "qkv"),
                (block.attn.c_proj, "o"),
                (block.mlp.c_fc, "up"),
                (block.mlp.c_proj, "down"),
            ):  # Conv1D: weight [in, out]
                self._targetable(conv, i, linear, 0, conv.weight.shape[1], conv.weight.shape[0])
            self.layers.append(
                _Layer(
                    norm1=(block.ln_1.weight, block.ln_1.bias),
                    qkv=conv1d(block.attn.c_attn),
                    o=conv1d(block.attn.c_proj),
                    norm2=(block.ln_2.weight, block.ln_2.bias),
                    up=conv1d(block.mlp.c_fc),
                    down=conv1d(block.mlp.c_proj),
                    scale=float(block.attn.scaling),
                )
            )

    def _embed(self, ids, positions):
        return F.embedding(ids, self.embed) + F.embedding(positions, self.positions)

    def _norm(self, x, delta, norm, out, n):
        self._layer_norm(
            x.data_ptr(), _ptr(delta), norm[0].data_ptr(), norm[1].data_ptr(), out.data_ptr(), n, self.hidden, self.eps
        )

    def _activate(self, up, n):
        self._gelu(up.data_ptr(), n, up.shape[1])  # in place
        return up


ARCHITECTURES: dict[str, type] = {"llama": FusedLlama, "gpt2": FusedGPT2}


# Relative difference (Frobenius norm) of the logits allowed against transformers' forward:
# float32 differs only in summation order (~1e-6 measured on SmolLM2-135M); bfloat16 rounds
# differently in places (RoPE and attention in float32 here, in bfloat16 there: ~0.01-0.02).
# A real mistake (a wrong rotation, a misplaced head) is off by far more than either.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 0.05}


def check_against_transformers(fused: FusedDecoder, model, kv: torch.Tensor) -> str | None:
    """None when `fused` gives the model's own logits, else what differed.

    Two prompts of different lengths are prefilled together (ragged, slots 0 and 1, every
    position's logits) and then decode one token each, compared with transformers' forward
    over the same whole sequences. Writes into slots 0-1 of kv (the engine's cache, unused yet).
    """
    g = torch.Generator().manual_seed(0)
    vocab = fused.embed.shape[0]
    lengths = [7, 3][: kv.shape[2]]
    prompts = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
    following = torch.randint(0, vocab, (len(prompts),), generator=g)

    def reference(ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids[None], use_cache=False).logits[0].float()

    ids = torch.cat(prompts)
    slots = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    positions = torch.cat([torch.arange(n) for n in lengths])
    starts = torch.zeros_like(ids)
    checks = [
        (
            "prefill",
            fused.forward(ids, slots, positions, starts, torch.arange(len(ids)), kv),
            torch.cat([reference(p) for p in prompts]),
        )
    ]
    n = len(prompts)
    decoded = fused.forward(
        following, torch.arange(n), torch.tensor(lengths), torch.zeros(n, dtype=torch.long), torch.arange(n), kv
    )
    checks.append(
        (
            "decode",
            decoded,
            torch.stack([reference(torch.cat([p, following[i : i + 1]]))[-1] for i, p in enumerate(prompts)]),
        )
    )
    for what, ours, theirs in checks:
        difference = float((ours.float() - theirs).norm() / theirs.norm().clamp(min=1e-12))
        if not difference <= TOLERANCE[fused.dtype]:  # (NaN fails too)
            return f"{what}: relative difference {difference:.2e} > {TOLERANCE[fused.dtype]:.0e}"
    return None
