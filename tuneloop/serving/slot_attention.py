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
import string
import subprocess
import tempfile
from pathlib import Path

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

log = logging.getLogger(__name__)

_DECODE_SOURCE = r"""
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

# The fused forward's kernels (fused_forward.py), written once for a storage type and expanded
# for float32 (f32) and bfloat16 (bf16, kept as uint16 and widened to float32 in registers;
# every sum is float32). Where torch rounds an intermediate to bfloat16 (RMSNorm's normalised
# value, SiLU's output, a residual sum), so do these (RND), to stay next to the model's own
# forward in that dtype.
_TYPED_SOURCE = r"""
/* One (query token, kv head) of ragged attention: the G query heads q[G][D] (rotated and
   scaled) over positions a..b of one slot's keys kb (blocked, see below) and values vb;
   out[G][D]. G is a compile-time constant where this is inlined (attend_$S dispatches), so
   each head's TL_BLOCK scores and TL_BLOCK-wide slice of its sum stay in registers. */
static inline __attribute__((always_inline)) void attend_one_$S(
        const long G, const float *q, const $T *kb, const $T *vb, long a, long b, long D,
        float *scores, long stride, $T *out) {
    long first = a / TL_BLOCK, last = b / TL_BLOCK;
    for (long blk = first; blk <= last; blk++) {  /* scores of whole blocks */
        const $T *kt = kb + blk * TL_BLOCK * D;
        float *sb = scores + (blk - first) * TL_BLOCK;
#ifdef __AVX512F__
        /* two accumulators per head (even and odd dimensions): two FMA chains in flight */
        __m512 s[G], t[G];
        for (long j = 0; j < G; j++) s[j] = t[j] = _mm512_setzero_ps();
        for (long d = 0; d < D; d += 2) {
            __m512 k0 = LD16_$S(kt + d * TL_BLOCK), k1 = LD16_$S(kt + (d + 1) * TL_BLOCK);
            for (long j = 0; j < G; j++) {
                s[j] = _mm512_fmadd_ps(_mm512_set1_ps(q[j * D + d]), k0, s[j]);
                t[j] = _mm512_fmadd_ps(_mm512_set1_ps(q[j * D + d + 1]), k1, t[j]);
            }
        }
        for (long j = 0; j < G; j++) _mm512_storeu_ps(sb + j * stride, _mm512_add_ps(s[j], t[j]));
#else
        for (long j = 0; j < G; j++) {
            float s[TL_BLOCK] = {0.f};
            for (long d = 0; d < D; d++) {
                float qd = q[j * D + d];
                for (long l = 0; l < TL_BLOCK; l++) s[l] += qd * LD_$S(kt + d * TL_BLOCK + l);
            }
            for (long l = 0; l < TL_BLOCK; l++) sb[j * stride + l] = s[l];
        }
#endif
    }
    long from = a - first * TL_BLOCK, to = b - first * TL_BLOCK;  /* the attended part */
    float inv[G];
    for (long j = 0; j < G; j++) {
        float *sc = scores + j * stride, top = -INFINITY, sum = 0.f;
        #pragma omp simd reduction(max:top)
        for (long i = from; i <= to; i++) top = sc[i] > top ? sc[i] : top;
        #pragma omp simd reduction(+:sum)
        for (long i = from; i <= to; i++) {
            sc[i] = expf(sc[i] - top);
            sum += sc[i];
        }
        inv[j] = 1.f / sum;
    }
    const $T *v0 = vb + first * TL_BLOCK * D;
    for (long c = 0; c < D; c += TL_BLOCK) {  /* the weighted sum, TL_BLOCK dimensions at a time */
        float result[G][TL_BLOCK];
#ifdef __AVX512F__
        /* two accumulators per head (even and odd positions): two FMA chains in flight */
        __m512 acc[G], acc2[G];
        for (long j = 0; j < G; j++) acc[j] = acc2[j] = _mm512_setzero_ps();
        long i = from;
        for (; i < to; i += 2) {
            __m512 v = LD16_$S(v0 + i * D + c), w = LD16_$S(v0 + (i + 1) * D + c);
            for (long j = 0; j < G; j++) {
                acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(scores[j * stride + i]), v, acc[j]);
                acc2[j] = _mm512_fmadd_ps(_mm512_set1_ps(scores[j * stride + i + 1]), w, acc2[j]);
            }
        }
        if (i == to) {
            __m512 v = LD16_$S(v0 + i * D + c);
            for (long j = 0; j < G; j++) acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(scores[j * stride + i]), v, acc[j]);
        }
        for (long j = 0; j < G; j++)
            _mm512_storeu_ps(result[j], _mm512_mul_ps(_mm512_add_ps(acc[j], acc2[j]), _mm512_set1_ps(inv[j])));
#else
        for (long j = 0; j < G; j++) {
            for (long l = 0; l < TL_BLOCK; l++) result[j][l] = 0.f;
            for (long i = from; i <= to; i++) {
                float w = scores[j * stride + i];
                for (long l = 0; l < TL_BLOCK; l++) result[j][l] += w * LD_$S(v0 + i * D + c + l);
            }
            for (long l = 0; l < TL_BLOCK; l++) result[j][l] *= inv[j];
        }
#endif
        for (long j = 0; j < G; j++)
            for (long l = 0; l < TL_BLOCK; l++) ST_$S(out + j * D + c + l, result[j][l]);
    }
}

static void attend_$S(long G, const float *q, const $T *kb, const $T *vb, long a, long b, long D,
                      float *scores, long stride, $T *out) {
    switch (G) {  /* the groups of common models, unrolled; any other size, generic */
        case 1: attend_one_$S(1, q, kb, vb, a, b, D, scores, stride, out); break;
        case 2: attend_one_$S(2, q, kb, vb, a, b, D, scores, stride, out); break;
        case 3: attend_one_$S(3, q, kb, vb, a, b, D, scores, stride, out); break;
        case 4: attend_one_$S(4, q, kb, vb, a, b, D, scores, stride, out); break;
        case 5: attend_one_$S(5, q, kb, vb, a, b, D, scores, stride, out); break;
        case 6: attend_one_$S(6, q, kb, vb, a, b, D, scores, stride, out); break;
        case 7: attend_one_$S(7, q, kb, vb, a, b, D, scores, stride, out); break;
        case 8: attend_one_$S(8, q, kb, vb, a, b, D, scores, stride, out); break;
        default: for (long j = 0; j < G; j++) attend_one_$S(1, q + j * D, kb, vb, a, b, D, scores, stride, out + j * D);
    }
}

/* Ragged attention for one layer: n query tokens, token t of slot slot[t] at cache position
   pos[t], attending to positions lo[t]..pos[t] of its slot (causal within its own prompt:
   the tokens of one prompt are in the same call, written before any is read).
   qkv [n, (H + 2*KVH) * D]: the layer's q, k, v projections; q and k are rotated
   (rotate-half RoPE, cos/sin [M, D] at position pos[t] - lo[t]; none when cos is NULL), and
   k and v written into the slot's cache. out [n, H * D]. D is a multiple of TL_BLOCK.

   Cache layout, per slot and kv head (M positions, a multiple of TL_BLOCK):
     keys   [M / TL_BLOCK][D][TL_BLOCK]: a block of TL_BLOCK positions stored dimension-major,
            so the scores of a block are TL_BLOCK-wide vector FMAs with no horizontal sums;
     values [M][D]: position-major.
   Query head h reads kv head h / (H / KVH); the `group` query heads of one kv head are done
   together, reading each key and value once. */
void ragged_attention_$S(const $T *qkv, $T *kc, $T *vc, const float *cos_t, const float *sin_t,
                         const long *slot, const long *pos, const long *lo, $T *out,
                         long n, long H, long KVH, long M, long D, float scale) {
    long group = H / KVH, stride = (H + 2 * KVH) * D, half = D / 2, longest = 0;
    for (long t = 0; t < n; t++) longest = pos[t] - lo[t] + 1 > longest ? pos[t] - lo[t] + 1 : longest;
    long width = (longest / TL_BLOCK + 2) * TL_BLOCK;  /* scores of one head: whole blocks */
    float *q = (float *)malloc(sizeof(float) * (n * H * D + 1));
    #pragma omp parallel
    {
        float *x = (float *)malloc(sizeof(float) * D), *y = (float *)malloc(sizeof(float) * D);
        #pragma omp for schedule(static)
        for (long t = 0; t < n; t++) {
            const $T *src = qkv + t * stride;
            long p = pos[t], r = pos[t] - lo[t];
            for (long h = 0; h < H + KVH; h++) {  /* query heads, then key heads */
                #pragma omp simd
                for (long d = 0; d < D; d++) x[d] = LD_$S(src + h * D + d);
                float *dst = h < H ? q + (t * H + h) * D : y;
                float f = h < H ? scale : 1.f;  /* the softmax scale goes into the query once */
                if (cos_t) {
                    const float *c = cos_t + r * D, *s = sin_t + r * D;
                    #pragma omp simd
                    for (long d = 0; d < half; d++) {
                        dst[d] = (x[d] * c[d] - x[d + half] * s[d]) * f;
                        dst[d + half] = (x[d + half] * c[d + half] + x[d] * s[d + half]) * f;
                    }
                } else {
                    #pragma omp simd
                    for (long d = 0; d < D; d++) dst[d] = x[d] * f;
                }
                if (h >= H) {
                    $T *kd = kc + (slot[t] * KVH + (h - H)) * M * D + (p / TL_BLOCK) * TL_BLOCK * D + p % TL_BLOCK;
                    for (long d = 0; d < D; d++) ST_$S(kd + d * TL_BLOCK, y[d]);
                }
            }
            for (long h = 0; h < KVH; h++)
                memcpy(vc + ((slot[t] * KVH + h) * M + p) * D, src + (H + KVH + h) * D, sizeof($T) * D);
        }
        /* (the barrier at the end of the loop: every token's key and value is in the cache) */
        float *scores = (float *)malloc(sizeof(float) * group * width);
        #pragma omp for schedule(dynamic, 1)
        for (long task = 0; task < n * KVH; task++) {
            long t = task / KVH, g = task % KVH;
            long cache = (slot[t] * KVH + g) * M * D;
            attend_$S(group, q + (t * H + g * group) * D, kc + cache, vc + cache, lo[t], pos[t], D, scores, width,
                      out + t * H * D + g * group * D);
        }
        free(x); free(y); free(scores);
    }
    free(q);
}

/* x += delta (when delta is not NULL), then out = w * RMSNorm(x): per row of C values. */
void add_rms_norm_$S($T *x, const $T *delta, const $T *w, $T *out, long n, long C, float eps) {
    #pragma omp parallel for schedule(static) if (n * C >= 65536)
    for (long t = 0; t < n; t++) {
        $T *xt = x + t * C, *o = out + t * C;
        float ss = 0.f;
        if (delta) {
            const $T *dt = delta + t * C;
            #pragma omp simd reduction(+:ss)
            for (long c = 0; c < C; c++) {
                float v = RND_$S(LD_$S(xt + c) + LD_$S(dt + c));
                ST_$S(xt + c, v);
                ss += v * v;
            }
        } else {
            #pragma omp simd reduction(+:ss)
            for (long c = 0; c < C; c++) { float v = LD_$S(xt + c); ss += v * v; }
        }
        float r = 1.f / sqrtf(ss / (float)C + eps);
        #pragma omp simd
        for (long c = 0; c < C; c++) ST_$S(o + c, LD_$S(w + c) * RND_$S(LD_$S(xt + c) * r));
    }
}

/* x += delta (when delta is not NULL), then out = LayerNorm(x) * w + b: per row of C values. */
void add_layer_norm_$S($T *x, const $T *delta, const $T *w, const $T *b, $T *out, long n, long C, float eps) {
    #pragma omp parallel for schedule(static) if (n * C >= 65536)
    for (long t = 0; t < n; t++) {
        $T *xt = x + t * C, *o = out + t * C;
        float sum = 0.f;
        if (delta) {
            const $T *dt = delta + t * C;
            #pragma omp simd reduction(+:sum)
            for (long c = 0; c < C; c++) {
                float v = RND_$S(LD_$S(xt + c) + LD_$S(dt + c));
                ST_$S(xt + c, v);
                sum += v;
            }
        } else {
            #pragma omp simd reduction(+:sum)
            for (long c = 0; c < C; c++) sum += LD_$S(xt + c);
        }
        float mean = sum / (float)C, var = 0.f;
        #pragma omp simd reduction(+:var)
        for (long c = 0; c < C; c++) { float d = LD_$S(xt + c) - mean; var += d * d; }
        float r = 1.f / sqrtf(var / (float)C + eps);
        #pragma omp simd
        for (long c = 0; c < C; c++) ST_$S(o + c, (LD_$S(xt + c) - mean) * r * LD_$S(w + c) + LD_$S(b + c));
    }
}

/* x = GELU(x) in place (the tanh approximation, GPT-2's gelu_new), over n rows of I values;
   tanh(u) = 1 - 2 / (exp(2u) + 1), through the vectorised expf. */
void gelu_tanh_$S($T *x, long n, long I) {
    #pragma omp parallel for schedule(static) if (n * I >= 65536)
    for (long t = 0; t < n; t++) {
        $T *xt = x + t * I;
        #pragma omp simd
        for (long i = 0; i < I; i++) {
            float v = LD_$S(xt + i);
            float u = 0.7978845608028654f * (v + 0.044715f * v * v * v);
            ST_$S(xt + i, 0.5f * v * (2.f - 2.f / (expf(2.f * u) + 1.f)));
        }
    }
}

/* out = SiLU(gate) * up, per row of gu = [gate (I values) | up (I values)]. */
void silu_mul_$S(const $T *gu, $T *out, long n, long I) {
    #pragma omp parallel for schedule(static) if (n * I >= 65536)
    for (long t = 0; t < n; t++) {
        const $T *g = gu + t * 2 * I, *u = g + I;
        $T *o = out + t * I;
        #pragma omp simd
        for (long i = 0; i < I; i++) {
            float v = LD_$S(g + i);
            ST_$S(o + i, RND_$S(v / (1.f + expf(-v))) * LD_$S(u + i));
        }
    }
}
"""

_TYPES = r"""
#include <stdint.h>
#include <string.h>

static inline float tl_widen(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t tl_narrow(float f) {  /* round to nearest even, as torch does; NaN stays NaN */
    uint32_t u; memcpy(&u, &f, 4);
    uint32_t rounded = u + 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)((((u & 0x7fffffffu) > 0x7f800000u) ? (u | 0x400000u) : rounded) >> 16);
}
#define TL_BLOCK 16
#define TL_MAX_GROUP 64
#ifdef __AVX512F__
#include <immintrin.h>
/* TL_BLOCK (16) values as one float32 vector */
#define LD16_f32(p) _mm512_loadu_ps(p)
#define LD16_bf16(p) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p))), 16))
#endif
#define LD_f32(p) (*(p))
#define ST_f32(p, v) (*(p) = (v))
#define RND_f32(v) (v)
#define LD_bf16(p) tl_widen(*(p))
#define ST_bf16(p, v) (*(p) = tl_narrow(v))
#define RND_bf16(v) tl_widen(tl_narrow(v))
"""


def _typed(storage: str, ctype: str) -> str:
    return string.Template(_TYPED_SOURCE).substitute(S=storage, T=ctype)


SOURCE = _DECODE_SOURCE + _TYPES + _typed("f32", "float") + _typed("bf16", "uint16_t")
# Tried in order: expf vectorized through glibc's libmvec (declared in SOURCE); where that
# does not link, scalar expf. Never -ffast-math: besides allowing the compiler to assume no
# infinities (the softmax starts from -INFINITY), GCC < 13 links crtfastmath into a shared
# object, whose constructor sets flush-to-zero on the thread that loads it.
BUILDS = [
    (
        ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-DTUNELOOP_VECTOR_EXPF", "-shared", "-fPIC"],
        ["-lmvec", "-lm"],
    ),
    (["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC"], ["-lm"]),
]

_kernel = None  # the loaded function, once load_kernel() succeeded
_library = None  # the loaded shared object, once load_library() succeeded


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
                subprocess.run(
                    [compiler, *flags, str(source), "-o", str(built), *libs],
                    check=True,
                    capture_output=True,
                    text=True,
                    timeout=120,
                )
                break
            except subprocess.CalledProcessError:
                if i == len(BUILDS) - 1:
                    raise
        os.replace(built, target)  # atomic: another process may be loading the same file


def load_library():
    """The compiled kernels (a ctypes.CDLL), or None where they cannot be built here."""
    global _library
    if _library is not None:
        return _library
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
        _library = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("slot attention kernel could not be built (%s); decoding uses sdpa", str(detail).strip()[:500])
        return None
    return _library


def load_kernel():
    """The compiled decoding kernel (a ctypes function), or None where it cannot be built here."""
    global _kernel
    if _kernel is not None:
        return _kernel
    library = load_library()
    if library is None:
        return None
    function = library.slot_decode_attention
    function.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_long] * 5 + [ctypes.c_float]
    function.restype = None
    _kernel = function
    _register_op()
    return _kernel


def _register_op() -> None:
    if hasattr(torch.ops.tuneloop, "slot_decode_attention"):
        return  # registered by an earlier load (the op calls whatever _kernel is now)

    @torch.library.custom_op(
        "tuneloop::slot_decode_attention",
        mutates_args=(),
        schema="(Tensor query, Tensor keys, Tensor values, Tensor lo, Tensor hi, float scale) -> Tensor",
    )
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
        _kernel(
            query.data_ptr(),
            keys.data_ptr(),
            values.data_ptr(),
            out.data_ptr(),
            lo.data_ptr(),
            hi.data_ptr(),
            n,
            heads,
            keys.shape[1],
            keys.shape[2],
            dim,
            scale,
        )
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
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
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
    # transformers' model-level registries: loaded when a model is served, not for the kernel alone
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(IMPLEMENTATION, attention)
    AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)
    previous = model.config._attn_implementation
    model.config._attn_implementation = IMPLEMENTATION
    return previous
