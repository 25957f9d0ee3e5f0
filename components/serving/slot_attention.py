"""Decoding attention that reads each row's own tokens only (the slots engine, on CPU).

A decoding step of the slots engine gives each row one new token that attends to its own
slot of the KV cache. With `sdpa`, every row reads keys and values up to the *longest*
active row (one rectangular batch), through a boolean mask. At this project's workload
(32 rows, lengths spread over 50-350) that is ~40% padding, and the reads are what a CPU
step waits for: the 4 layers' keys and values exceed the L3 cache, so every step streams
them from memory.

This module's kernel walks, for each (row, head), positions lo..hi of that row's slot and
nothing else: scores q·k, a softmax, the weighted sum of v. Measured on 2 cores, 32 rows of
lengths 50-350, 4 layers: 0.59 ms against 2.1 ms for `sdpa` (largest difference to `sdpa`
3e-7).

It is plain C (no torch headers), compiled once with the system C compiler
(`$CC`, default `cc`: -O3 -march=native -fopenmp, no -ffast-math, ~0.2 s) into ~/.cache/tuneloop/kernels
(TUNELOOP_KERNEL_CACHE overrides), keyed by source, flags, compiler and the CPU's flags, and called
through ctypes, which lets go of the GIL while it runs. Its OpenMP is torch's own libgomp
(the same soname, already loaded), so it shares torch's threads. It is registered as the torch custom op `tuneloop::slot_decode_attention`,
so a torch.compile'd step calls it like any other kernel. Where it cannot be built (no
compiler), load_kernel() returns None and the engine keeps `sdpa`.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

log = logging.getLogger(__name__)

SOURCE = r"""
#include <math.h>
#include <stdlib.h>

#ifdef TUNELOOP_VECTOR_EXPF
/* glibc's libmvec has vector expf variants; saying so lets the compiler vectorize the
   softmax's expf loop without -ffast-math (which would link crtfastmath and switch the
   loading thread to flush-to-zero for the life of the process). */
#pragma omp declare simd notinbranch
extern float expf(float);
#endif

/* Row i's query (one token) attends to positions lo[i]..hi[i] (inclusive) of slot i.
   Contiguous float32: q, out [n, H, D]; k, v [>= n slots, KVH, M, D]; query head h reads
   kv head h / (H / KVH) (grouped-query attention; KVH == H without it). */
void slot_decode_attention(const float *q, const float *k, const float *v, float *out,
                           const long *lo, const long *hi, long n, long H, long KVH, long M,
                           long D, float scale) {
    long group = H / KVH;
    #pragma omp parallel
    {
        float *scores = (float *)malloc(sizeof(float) * M);
        #pragma omp for schedule(static)
        for (long task = 0; task < n * H; task++) {  /* task = row * H + head */
            long i = task / H, h = task % H, a = lo[i], b = hi[i];
            const float *qi = q + task * D;
            long cache = (i * KVH + h / group) * M * D;
            const float *kb = k + cache, *vb = v + cache;
            float *oi = out + task * D;
            float top = -INFINITY, total = 0.f;
            for (long t = a; t <= b; t++) {
                const float *kt = kb + t * D;
                float s = 0.f;
                #pragma omp simd reduction(+:s)
                for (long d = 0; d < D; d++) s += qi[d] * kt[d];
                s *= scale;
                scores[t - a] = s;
                if (s > top) top = s;
            }
            #pragma omp simd reduction(+:total)
            for (long t = 0; t <= b - a; t++) {
                scores[t] = expf(scores[t] - top);
                total += scores[t];
            }
            for (long d = 0; d < D; d++) oi[d] = 0.f;
            for (long t = a; t <= b; t++) {
                const float *vt = vb + t * D;
                float p = scores[t - a];
                #pragma omp simd
                for (long d = 0; d < D; d++) oi[d] += p * vt[d];
            }
            for (long d = 0; d < D; d++) oi[d] /= total;
        }
        free(scores);
    }
}
"""
# Tried in order: expf vectorized through glibc's libmvec (declared in SOURCE); where that
# does not link, scalar expf. Never -ffast-math: besides allowing the compiler to assume no
# infinities (the softmax starts from -INFINITY), GCC < 13 links crtfastmath into a shared
# object, whose constructor sets flush-to-zero on the thread that loads it.
BUILDS = [
    (["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-DTUNELOOP_VECTOR_EXPF", "-shared", "-fPIC"],
     ["-lmvec", "-lm"]),
    (["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC"], ["-lm"]),
]

_kernel = None  # the loaded function, once load_kernel() succeeded


def _cpu_signature() -> str:
    """What -march=native depends on: a cached build is only reused on the same kind of CPU.

    The model name alone is not enough (one name covers CPUs, and virtual machines, with
    different instruction sets): the whole flags line goes into the key too.
    """
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    wanted = ("vendor_id", "model name", "flags", "Features", "CPU implementer", "CPU part")
    seen: dict[str, str] = {}
    for line in lines:
        key = line.split(":", 1)[0].strip()
        if key in wanted and key not in seen:  # the first processor's lines
            seen[key] = line
    return "\n".join(seen.values()) or platform.processor() or platform.machine()


def _build(compiler: str, target: Path) -> None:
    """Compile SOURCE into target with the first flag set that works."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "slot_attention.c"
        source.write_text(SOURCE)
        built = Path(tmp) / target.name
        for i, (flags, libs) in enumerate(BUILDS):
            try:
                subprocess.run([compiler, *flags, str(source), "-o", str(built), *libs],
                               check=True, capture_output=True, text=True, timeout=120)
                break
            except subprocess.CalledProcessError:
                if i == len(BUILDS) - 1:
                    raise
        os.replace(built, target)  # atomic: another process may be loading the same file


def load_kernel():
    """The compiled kernel (a ctypes function), or None where it cannot be built here."""
    global _kernel
    if _kernel is not None:
        return _kernel
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        log.warning("slot attention kernel: no C compiler (%s); decoding uses sdpa", compiler)
        return None
    key = hashlib.sha256("\n".join([SOURCE, repr(BUILDS), compiler, _cpu_signature()]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("TUNELOOP_KERNEL_CACHE") or Path.home() / ".cache" / "tuneloop" / "kernels")
    target = cache / f"slot_attention-{key}.so"
    try:
        if not target.exists():
            _build(compiler, target)
        function = ctypes.CDLL(str(target)).slot_decode_attention
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("slot attention kernel could not be built (%s); decoding uses sdpa", str(detail).strip()[:500])
        return None
    function.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_long] * 5 + [ctypes.c_float]
    function.restype = None
    _kernel = function
    _register_op()
    return _kernel


def _register_op() -> None:
    if hasattr(torch.ops.tuneloop, "slot_decode_attention"):
        return  # registered by an earlier load (the op calls whatever _kernel is now)

    @torch.library.custom_op("tuneloop::slot_decode_attention", mutates_args=(),
                             schema="(Tensor query, Tensor keys, Tensor values, Tensor lo, Tensor hi, float scale) -> Tensor")
    def slot_decode_attention(query, keys, values, lo, hi, scale):
        """query [n, H, 1, D]; keys, values [slots >= n, KVH, M, D]; lo, hi [n] (int64): the
        positions of slot i that row i attends to. Returns [n, H, 1, D]."""
        query, lo, hi = query.contiguous(), lo.contiguous(), hi.contiguous()
        n, heads, _, dim = query.shape
        if not (keys.is_contiguous() and values.is_contiguous()):
            raise ValueError("slot_decode_attention needs contiguous key and value caches")
        out = torch.empty_like(query)
        if heads % keys.shape[1]:
            raise ValueError(f"{heads} query heads do not share {keys.shape[1]} kv heads evenly")
        _kernel(query.data_ptr(), keys.data_ptr(), values.data_ptr(), out.data_ptr(), lo.data_ptr(),
                hi.data_ptr(), n, heads, keys.shape[1], keys.shape[2], dim, scale)
        return out

    @slot_decode_attention.register_fake
    def _(query, keys, values, lo, hi, scale):
        return torch.empty_like(query)


def usable_for(model) -> bool:
    """The kernel covers float32 models on the CPU (GPU hosts keep sdpa's fused kernels)."""
    return model.device.type == "cpu" and model.dtype == torch.float32


def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, slot_bounds=None, **kwargs):
    """An attention function for transformers' AttentionInterface ("tuneloop_slots").

    With slot_bounds=(lo, hi) (a slots-engine decoding step) it runs the kernel over the
    caches the SlotCache returns (all slots' full length); otherwise it is plain sdpa.
    """
    if slot_bounds is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    lo, hi = slot_bounds
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = torch.ops.tuneloop.slot_decode_attention(query, key, value, lo, hi, scale)
    return out.transpose(1, 2), None


IMPLEMENTATION = "tuneloop_slots"


def install(model) -> str:
    """Route the model's attention through attention() (sdpa for everything but slot decoding).

    Returns the implementation it replaced: the engine puts it back when it stops, because
    other users of the same model object (the continuous engine, for one) accept only
    transformers' own implementations.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(IMPLEMENTATION, attention)
    AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)
    previous = model.config._attn_implementation
    model.config._attn_implementation = IMPLEMENTATION
    return previous
