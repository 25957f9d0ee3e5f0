"""LoRA adapters served beside their base model (serving.lora): what a request names, and
the checks, with no torch (the API's process imports this module).

An adapter is a folder as PEFT saves one (adapter_config.json + adapter_model.safetensors),
fine-tuned on the served base. A request names it through SamplingParams.adapter; the
engine loads it on first use and applies it to that request's rows only (the slots engine:
lora_table.py; the vllm engine: vLLM's own LoRA support, vllm_engine.py).

- AdapterRef: which adapter a request runs with (its model id and folder).
- inspect_adapter: the adapter's config and its tensors' names and shapes (the safetensors
  header only), checked against what can be served; AdapterError (a 400) says what cannot:
  DoRA, modules_to_save, trained biases, a rank over serving.lora.max_rank, a module the base
  does not have or of another shape. AdapterChecker runs it where requests are submitted, so
  a bad adapter is refused before its request is queued.
- AdaptersNotServed (a 400): a request names an adapter and the engine serves none.
- Target / config_targets: the linear layers an adapter may target, as the fused forward
  computes them (q, k, v, o, gate, up, down; not the output layer).
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from tuneloop.serving.errors import InvalidRequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# What peft (0.21) saves for a LoRA on a Linear: base_model.model.<module>.lora_A.weight [r, in]
# and .lora_B.weight [out, r] (the adapter's name is not in the saved keys).
LORA_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")
DTYPES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8}
MAX_HEADER_BYTES = 64 * 2**20
# adapter_config.json fields that change what the adapter computes beyond x A^T B^T: served
# only when off. (field, what it is)
UNSERVED = (
    ("use_dora", "DoRA (use_dora)"),
    ("modules_to_save", "modules_to_save (whole layers trained beside the adapter)"),
    ("lora_bias", "a trained bias on lora_B (lora_bias)"),
    ("layer_replication", "layer_replication"),
    ("target_parameters", "target_parameters (LoRA on parameters, not modules)"),
    ("trainable_token_indices", "trainable_token_indices (trained embedding rows)"),
    ("alora_invocation_tokens", "aLoRA (alora_invocation_tokens)"),
    ("use_qalora", "QALoRA (use_qalora)"),
    ("use_bdlora", "block-diagonal LoRA (use_bdlora)"),
)


@dataclass(frozen=True)
class AdapterRef:
    """Which adapter a generation runs with: its model id (the cache key) and its folder."""

    name: str
    path: str


class AdapterError(InvalidRequest, ValueError):
    """An adapter this server cannot serve (a 400 naming the adapter and the problem)."""

    code, reason = "invalid_adapter", "invalid_adapter"

    def __init__(self, message: str, **kwargs):
        kwargs.setdefault("param", "model")
        super().__init__(message, **kwargs)


class AdaptersNotServed(InvalidRequest):
    """A request names an adapter and this engine serves none (a 400 saying why)."""

    code, reason = "adapters_not_served", "invalid_request"

    def __init__(self, message: str, **kwargs):
        kwargs.setdefault("param", "model")
        super().__init__(message, **kwargs)


# ---------------------------------------------------------------------------------------
# the linear layers an adapter may target


@dataclass(frozen=True)
class Target:
    """A linear layer of the base as the fused forward computes it: the `linear` product
    (qkv, o, up or down) of decoder layer `layer`, whose output columns start..stop it is."""

    layer: int
    linear: str
    start: int
    stop: int
    in_features: int

    @property
    def out_features(self) -> int:
        return self.stop - self.start

    @property
    def part(self) -> tuple[str, int, int]:
        """The same part in every layer (e.g. q: qkv's first columns)."""
        return (self.linear, self.start, self.stop)


def config_targets(config) -> dict[str, tuple[int, int]] | None:
    """{module name: (out, in)} of the linear layers a LoRA may target in a model of this
    Hugging Face config (what the fused forward's targets are), or None for an architecture
    it does not serve. Needs only the config: the API's process checks adapters with it."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    kind = getattr(config, "model_type", None)
    out: dict[str, tuple[int, int]] = {}
    if kind == "llama":
        hidden, heads = config.hidden_size, config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        inter = config.intermediate_size
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            out[p + "self_attn.q_proj"] = (heads * head_dim, hidden)
            out[p + "self_attn.k_proj"] = (kv * head_dim, hidden)
            out[p + "self_attn.v_proj"] = (kv * head_dim, hidden)
            out[p + "self_attn.o_proj"] = (hidden, heads * head_dim)
            out[p + "mlp.gate_proj"] = (inter, hidden)
            out[p + "mlp.up_proj"] = (inter, hidden)
            out[p + "mlp.down_proj"] = (hidden, inter)
        return out
    if kind == "gpt2":
        hidden = config.n_embd
        inner = getattr(config, "n_inner", None) or 4 * hidden
        for i in range(config.n_layer):
            p = f"transformer.h.{i}."
            out[p + "attn.c_attn"] = (3 * hidden, hidden)
            out[p + "attn.c_proj"] = (hidden, hidden)
            out[p + "mlp.c_fc"] = (inner, hidden)
            out[p + "mlp.c_proj"] = (hidden, inner)
        return out
    return None


# ---------------------------------------------------------------------------------------
# reading an adapter's folder


@dataclass(frozen=True)
class AdapterSpec:
    """What inspect_adapter found: each targeted module's rank and scale (alpha / r, or
    alpha / sqrt(r) with rsLoRA), and the weights file."""

    modules: dict[str, tuple[int, float]]
    weights: Path


def _pattern_value(patterns: Mapping[str, Any], module: str, default):
    """peft's rank_pattern / alpha_pattern lookup: the first key that matches the end of the module's name."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _header(path: Path) -> dict:
    """A safetensors file's header: {tensor name: {dtype, shape, data_offsets}}."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError("shorter than a safetensors header")
        (size,) = struct.unpack("<Q", raw)
        if size > MAX_HEADER_BYTES:
            raise ValueError(f"a header of {size} bytes")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def _listing(names, most: int = 4) -> str:
    names = sorted(names)
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def inspect_adapter(ref: AdapterRef, shapes: Mapping[str, tuple[int, int]] | None, max_rank: int) -> AdapterSpec:
    """Check the adapter folder `ref.path` against what can be served: its config and its
    tensors' names, dtypes and shapes (read from the safetensors header, not the tensors).
    shapes: {module: (out, in)} of the base's linear layers (None: not checked here).
    Raises AdapterError naming the adapter and the problem."""
    name = ref.name

    def refuse(problem: str) -> AdapterError:
        return AdapterError(f"adapter {name!r} cannot be served: {problem}")

    folder = Path(ref.path)
    if not folder.is_dir():
        raise refuse(f"there is no adapter folder at {folder}")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise refuse(f"no {CONFIG_FILE} in {folder}") from None
    except (OSError, ValueError) as exc:
        raise refuse(f"{CONFIG_FILE} cannot be read ({exc})") from None
    if not isinstance(config, dict):
        raise refuse(f"{CONFIG_FILE} is not a JSON object")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise refuse(f"it is a {config.get('peft_type')} adapter (LoRA only)")
    for key, what in UNSERVED:
        if config.get(key):
            raise refuse(f"{what} is not served")
    if config.get("bias", "none") not in ("none", None):
        raise refuse(f"trained biases (bias: {config['bias']!r}) are not served")
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        if (folder / "adapter_model.bin").exists():
            raise refuse("only safetensors adapters are served (found adapter_model.bin)")
        raise refuse(f"no {WEIGHTS_FILE} in {folder}")
    try:
        header = _header(weights)
    except (OSError, ValueError) as exc:
        raise refuse(f"{WEIGHTS_FILE} is not a safetensors file ({exc})") from None

    pairs: dict[str, dict[str, list[int]]] = {}
    other = []
    for key, info in header.items():
        match = LORA_KEY.match(key)
        if match is None:
            other.append(key)
            continue
        if info.get("dtype") not in DTYPES:
            raise refuse(f"{key} is {info.get('dtype')} (served: {', '.join(DTYPES)})")
        pairs.setdefault(match["module"], {})[match["which"]] = list(info.get("shape", []))
    if other:
        if any("lora_magnitude_vector" in k for k in other):
            raise refuse("DoRA (lora_magnitude_vector) is not served")
        if any("lora_embedding" in k for k in other):
            raise refuse("LoRA on embeddings is not served (linear layers only)")
        raise refuse(f"tensors that are not the A and B of a LoRA on a linear layer: {_listing(other)}")
    if not pairs:
        raise refuse(f"{WEIGHTS_FILE} holds no LoRA weights")

    modules: dict[str, tuple[int, float]] = {}
    unknown, wrong = [], []
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise refuse(f"{module} has lora_{'A' if 'A' in ab else 'B'} without its other half")
        a, b = ab["A"], ab["B"]
        if len(a) != 2 or len(b) != 2 or a[0] != b[1]:
            raise refuse(f"{module}: lora_A {a} and lora_B {b} are not a LoRA pair ([r, in] and [out, r])")
        rank = a[0]
        if rank < 1:
            raise refuse(f"{module}: rank {rank}")
        if rank > max_rank:
            raise refuse(f"rank {rank} ({module}) is over the largest served, serving.lora.max_rank {max_rank}")
        if shapes is not None:
            if module not in shapes:
                unknown.append(module)
                continue
            out_f, in_f = shapes[module]
            if (b[0], a[1]) != (out_f, in_f):
                wrong.append(f"{module} is [{b[0]}, {a[1]}], the base's [{out_f}, {in_f}]")
                continue
        alpha = float(_pattern_value(config.get("alpha_pattern"), module, config.get("lora_alpha", rank)))
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        modules[module] = (rank, scale)
    if unknown:
        raise refuse(f"it targets modules the base model does not have (or that are not served): {_listing(unknown)}")
    if wrong:
        raise refuse(f"its shapes do not match the base model (trained on another base?): {_listing(wrong, 2)}")
    return AdapterSpec(modules, weights)


class AdapterChecker:
    """inspect_adapter where requests are submitted, remembered per folder until its files change."""

    def __init__(self, shapes: Mapping[str, tuple[int, int]] | None, max_rank: int, remember: int = 256):
        self.shapes, self.max_rank, self.remember = shapes, max_rank, remember
        self._seen: OrderedDict[tuple[str, str], tuple] = OrderedDict()

    def check(self, ref: AdapterRef) -> AdapterSpec:
        folder = Path(ref.path)
        try:
            stats = [(folder / CONFIG_FILE).stat(), (folder / WEIGHTS_FILE).stat()]
            stamp = tuple((s.st_mtime_ns, s.st_size) for s in stats)
        except OSError:
            stamp = None  # inspect_adapter says what is missing
        key = (ref.name, str(folder))
        seen = self._seen.get(key)
        if stamp is not None and seen is not None and seen[0] == stamp:
            self._seen.move_to_end(key)
            return seen[1]
        spec = inspect_adapter(ref, self.shapes, self.max_rank)
        if stamp is not None:
            self._seen[key] = (stamp, spec)
            while len(self._seen) > self.remember:
                self._seen.popitem(last=False)
        return spec
