"""Gateway benchmark: what auth + limits + PII + content filter cost, what the cache buys,
and /v1/moderations batched vs one at a time.

    python benchmarks/gateway.py --ignore-eos              # 128 requests, 32 clients, 3 rounds
    python benchmarks/gateway.py --quick --ignore-eos      # 64 requests, 2 rounds
    python benchmarks/gateway.py --ignore-eos --max-tokens 64 --rounds 6 --systems off,on \
        --model-dir .tuneloop-smollm2/models/smollm2-135m-instruct

One run, side by side, the same seeded workload as benchmarks/serving.py (chat rows,
greedy, streamed; --ignore-eos: every request generates its max_tokens, so every system
does the same work) against `bentoml serve` with the slots engine:
  off    the gateway off (no key, no limits, no PII, no filter, no cache);
  on     everything on, cache off: a key checked per request, limits in a real Redis
         (started here on 127.0.0.1), PII redaction of prompts and of streamed outputs,
         rules + the classifier on every prompt, rules on every output (the classifier
         trained first by `tuneloop filter train`, the shipped method unless --method, and
         loaded by alias);
  cache  as `on` with the result cache: 40 % of the requests were answered once before
         the round (the seed's hit rate), the rest are new. Each round uses a fresh seed,
         so no round reuses another's answers. The 40 % are drawn 2 of every 5 requests in
         order of max_tokens, so they are also ~40 % of the round's output tokens (a plain
         random 40 % of 128 requests held 35-43 % of them: an Amdahl bound anywhere from
         1.53x to 1.75x).
  on-no-classifier, on-no-pii, on-no-auth (only when named in --systems): `on` less one
         part, to attribute the cost; on-no-checks: neither PII nor the classifier (keys,
         limits and rules only: no checks' process); on-no-redis: limits in the server's
         memory instead of Redis; on-checks-in-thread: `on` with Presidio and the
         classifier in the server's process (gateway.checks_in: thread).
Rounds go round-robin over the systems, every other round in reverse order; a system's
cost is the median of its per-round throughput ratios to `off` (round i of both ran back to
back). Beside it, the shares the server itself measures, which the host's round-to-round
noise (+-15 % here) does not blur: the wall time the filter's encoder held the CPU in turns
with the engine (tuneloop_cpu_turn_seconds_total, tuneloop/cpu_turns.py: the engine's
throughput lost to it; only a classifier on encoder embeddings takes turns) and the CPU of
Presidio and the classifier (tuneloop_gateway_cpu_seconds_total: in the checks' own process
by default, on another core than the engine's, so a share of work done, not of throughput
lost).

Targets: on/off output tok/s >= 0.95 (gateway cost <= 5 %); the cache's speed-up >= 0.95 of
the Amdahl bound 1/(1 - 0.4): the cache server's round with 40 % hits over its round with
none, back to back (cache/on, across two servers, is printed beside it); per round the bound
is 1/(1 - s), s the larger of the hits' share of the requests and of the output tokens (the
stricter). The speed-up is read in the steady state (benchmarks/serving.py's steady_throughput: the
tokens that arrive from the moment the round's request at 15 % is let go to the moment the
last one is): a round's start and drain, with fewer requests in flight, take about the same
time with or without hits, so over whole rounds they come out of the cache's speed-up; the
whole-round reading is printed beside it. The cold round still pays the
cache's work for every miss (a lookup, a store), which the `on` server does not: cache/on is
the stricter reading, the same-server one the steadier. Cache-hit latency p50 server-side (the app's `server-timing`,
from the request reaching it to its response starting) and client-measured, back to back on a
quiet server and right after each hit's miss;
/v1/moderations texts/s at batch 1 (sequential) vs batched (64 concurrent).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from benchmarks.serving import (  # noqa: E402
    DATA,
    MODEL_NAME,
    Client,
    build_workload,
    measured,
    median_of,
    parse_serving,
    percentiles,
    print_system,
    resolve_model,
    run_workload,
    send_chat_stream,
    steady_throughput,
    summarize,
    wait_until_quiet,
)
from tests.support.servers import GATEWAY_OFF, free_port, redis_server, service  # noqa: E402
from tuneloop.formatting import context_window  # noqa: E402

HIT_RATE = 0.4
# The moderation benchmark's texts: the team's real labelled set when it is there (test data).
INJECTIONS = ROOT.parent / "shared" / "data" / "prompt-injections" / "train.parquet"


def scrape(url: str) -> dict[str, float]:
    """The server's counters this benchmark reads: cache hits, the CPU turns the filter's
    encoder and the engine held (seconds), Presidio's and the classifier's own CPU seconds."""
    import urllib.request

    wanted = {
        'tuneloop_gateway_cache_total{result="hit"}': "cache_hits",
        'tuneloop_cpu_turn_seconds_total{holder="filter"}': "filter_turn_s",
        'tuneloop_cpu_turn_seconds_total{holder="engine"}': "engine_turn_s",
        'tuneloop_gateway_cpu_seconds_total{part="pii"}': "pii_cpu_s",
        'tuneloop_gateway_cpu_seconds_total{part="filter"}': "filter_cpu_s",
    }
    out = dict.fromkeys(wanted.values(), 0.0)
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            series, _, value = line.rpartition(" ")
            if series in wanted:
                out[wanted[series]] = float(value)
    return out


def cache_hits(url: str) -> float:
    return scrape(url)["cache_hits"]


def warm_sample(rng: random.Random, requests: list, share: float) -> list:
    """`share` of the requests, drawn so that they also carry ~`share` of the output tokens:
    p of every q requests in order of max_tokens (share = p/q), at random within each group.
    A hit saves its request's whole generation, so the Amdahl bound is about the share of
    the work, and a plain random sample of a hundred-odd requests misses it by +-5 points."""
    from fractions import Fraction

    frac = Fraction(share).limit_denominator(20)
    ordered = sorted(requests, key=lambda r: (r.max_tokens, r.index))
    out = []
    for start in range(0, len(ordered), frac.denominator):
        group = ordered[start : start + frac.denominator]
        out += rng.sample(group, round(len(group) * frac))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="64 requests, 2 rounds")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--min-tokens", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model-dir", type=Path, help="model folder (default: the bootstrap base model)")
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--wait-quiet", type=float, default=60.0)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="every request generates its max_tokens (a fixed workload: the same tokens for every system)",
    )
    parser.add_argument(
        "--method",
        default=None,
        help="the filter classifier's method (default: the shipped gateway.filter_training one)",
    )
    parser.add_argument(
        "--systems",
        default="off,on,cache",
        help="which to run: off,on,cache (the default), and for attribution on-no-classifier, "
        "on-no-pii, on-no-auth, on-no-checks, on-no-redis, on-checks-in-thread",
    )
    parser.add_argument(
        "--instances",
        type=int,
        default=1,
        help="servers per system, taking the rounds in turn: two servers of the same system "
        "differ by up to ~7 %% on the demo model (the off-again system measures it), so "
        "several average that out",
    )
    parser.add_argument(
        "--serving",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a serving setting for every server (repeatable), e.g. dtype=bfloat16",
    )
    args = parser.parse_args()
    args.serving = parse_serving(args.serving)
    if args.quick:
        args.num_requests, args.rounds = 64, 2
    args.request_rate = float("inf")
    model_dir = resolve_model(args)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    requests = build_workload(args.data, tokenizer, args.num_requests, args.min_tokens, args.max_tokens, args.seed)
    for r in requests:
        r.ignore_eos = args.ignore_eos
    if not {"max_model_len", "kv_cache_tokens", "kv_cache_gib"} & set(args.serving):
        # Without a budget each server's KV cache takes 20 % of the memory available when it
        # starts: six SmolLM2 servers took ~20 of 24 GiB, and the last one started ran at half
        # speed (the page cache gone, its code paged in again and again). The workload needs
        # its longest request (+ room for a redacted prompt's longer placeholders) per slot.
        need = max(len(r.prompt_ids) + r.max_tokens for r in requests) + 64
        from transformers import AutoConfig

        window = context_window(AutoConfig.from_pretrained(model_dir), tokenizer) or need
        args.serving["max_model_len"] = str(min(window, -(-need // 256) * 256))
        print(
            f"each server's KV slots hold {args.serving['max_model_len']} tokens (--serving max_model_len=N to change)",
            flush=True,
        )
    work = Path(tempfile.mkdtemp(prefix="tuneloop-gateway-bench-"))
    results: dict = {"args": {k: str(v) for k, v in vars(args).items()}}
    try:
        with ExitStack() as stack:
            redis_url = stack.enter_context(redis_server(work))
            base_env = {k: v for k, v in os.environ.items() if not k.startswith("TUNELOOP")}
            base_env.update(
                {
                    "TUNELOOP_HOME": str(work / "home"),
                    "BENTOML_HOME": str(work / "bentoml"),
                    "PREFECT_HOME": str(work / "prefect"),
                    "TUNELOOP_SERVE_MODEL_DIR": str(model_dir),
                    "TUNELOOP_SERVE_MODEL_NAME": MODEL_NAME,
                    "TUNELOOP_SERVE_ENGINE": "slots",
                }
            )
            base_env.update({f"TUNELOOP__SERVING__{k.upper()}": str(v) for k, v in args.serving.items()})
            if args.num_threads:
                base_env["TUNELOOP__SERVING__NUM_THREADS"] = str(args.num_threads)
            train_filter(base_env, args.method)
            key = json.loads(
                subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "tuneloop.cli",
                        "keys",
                        "create",
                        "--name",
                        "bench",
                        "--tier",
                        "enterprise",
                        "--json",
                    ],
                    env=base_env,
                    capture_output=True,
                    text=True,
                    cwd=ROOT,
                    check=True,
                ).stdout
            )["key"]
            on_env = {"TUNELOOP_REDIS_URL": redis_url, "TUNELOOP__GATEWAY__CACHE": "{enabled: false}"}
            systems = {
                "off": {**GATEWAY_OFF},
                "on": on_env,
                "cache": {"TUNELOOP_REDIS_URL": redis_url, "TUNELOOP__GATEWAY__CACHE": "{enabled: true}"},
            }
            # Attribution (not in the default run): `on` less one part.
            systems["on-no-classifier"] = {**on_env, "TUNELOOP__GATEWAY__FILTER": "{classifier: null}"}
            systems["on-no-pii"] = {**on_env, "TUNELOOP__GATEWAY__PII": "{mode: off, outputs: off}"}
            systems["on-no-auth"] = {**on_env, "TUNELOOP__GATEWAY__AUTH": "off"}
            systems["on-no-redis"] = {"TUNELOOP__GATEWAY__CACHE": "{enabled: false}"}  # limits in process
            systems["on-no-checks"] = {
                **on_env,
                "TUNELOOP__GATEWAY__PII": "{mode: off, outputs: off}",
                "TUNELOOP__GATEWAY__FILTER": "{classifier: null}",
            }
            systems["on-checks-in-thread"] = {**on_env, "TUNELOOP__GATEWAY__CHECKS_IN": "thread"}
            # A second server of `off`: how far two servers of the same system differ (an A/A check).
            systems["off-again"] = {**GATEWAY_OFF}
            wanted = args.systems.split(",")
            unknown = sorted(set(wanted) - set(systems))
            if unknown:
                raise SystemExit(f"--systems: unknown {unknown} ({', '.join(systems)})")
            systems = {n: e for n, e in systems.items() if n in wanted}
            urls: dict[str, list[str]] = {}
            pids: dict[str, list[int]] = {}
            for name, extra in systems.items():
                for i in range(args.instances):
                    port = free_port()
                    url = f"http://127.0.0.1:{port}"
                    cmd = [
                        sys.executable,
                        "-m",
                        "bentoml",
                        "serve",
                        "bentos.service:TuneloopLLM",
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(port),
                    ]
                    print(f"{name}: starting bentoml serve on {url} ...", flush=True)
                    # Each server its own BENTOML_HOME: a starting server clears the Prometheus
                    # multiprocess folder under it, which would wipe the metrics of those before it.
                    own = {"BENTOML_HOME": str(work / f"bentoml-{name}-{i}")}
                    proc = stack.enter_context(
                        service(
                            cmd,
                            f"{url}/readyz",
                            work / f"serve-{name}-{i}.log",
                            env={**base_env, **extra, **own},
                            timeout=300,
                            cwd=ROOT,
                        )
                    )
                    urls.setdefault(name, []).append(url)
                    pids.setdefault(name, []).append(proc.pid)
            headers = {"Authorization": f"Bearer {key}"}
            memory_check(results)

            def run_round(name: str, reqs, seed: int, url: str):
                async def send(client, req):
                    return await send_chat_stream_seeded(client, req, seed)

                async def go():
                    keyless = systems[name].get("TUNELOOP__GATEWAY__AUTH") == "off"
                    client = Client(url, None if keyless else headers)
                    try:
                        return await run_workload(
                            reqs, lambda r: send(client, r), args.concurrency, args.request_rate, args.seed, name
                        )
                    finally:
                        await client.close()

                return asyncio.run(go())

            cold: list[float] = []  # the cache server's output tok/s with nothing warmed, one a round
            cold_steady: list[float] = []  # the same in the steady state (steady_throughput)

            def cold_round(r: int, url: str, seed: int) -> None:
                """The cache server over the round's requests with fresh keys (0 % hits), back to
                back with its hit round (before it in odd rounds, after in even ones): the same
                server and the same cache work per miss, so hit round / cold round is the
                cache's speed-up with no server-to-server noise (two servers of one system
                differ by up to ~7 % here, as much as the target's margin)."""
                wait_until_quiet(args.wait_quiet, busy_cores=0.1)
                res, duration = run_round("cache", requests, seed, url)
                cold.append(sum(x.output_tokens for x in res if x.ok) / duration)
                cold_steady.append(steady_throughput(res))
                print(
                    f"round {r}/{args.rounds}  cache, nothing warmed: {cold[-1]:.1f} out tok/s "
                    f"(steady {cold_steady[-1]:.1f})",
                    flush=True,
                )

            rng = random.Random(args.seed)
            rounds: dict[str, list[dict]] = {n: [] for n in systems}
            hit_rates = []
            bounds = []  # per cache round: 1/(1 - the hits' share), the stricter of requests and tokens
            for r in range(1, args.rounds + 1):
                inst = (r - 1) % args.instances  # each system's servers take the rounds in turn
                for name in list(systems) if r % 2 else list(systems)[::-1]:  # A B C, C B A, ...
                    # Quiet, the other servers included: one whose request log is still redacting
                    # the last round's texts (in its niced child) would slow this round's server.
                    wait_until_quiet(args.wait_quiet, busy_cores=0.1)
                    url, pid = urls[name][inst], pids[name][inst]
                    seed = 1000 * r + list(systems).index(name)  # fresh cache keys every round (greedy: same tokens)
                    if name == "cache" and r % 2:
                        cold_round(r, url, seed + 500)
                    if name == "cache":
                        warm = warm_sample(rng, requests, HIT_RATE)
                        run_round(name, warm, seed, url)  # answered once before the round: these hit
                        before = cache_hits(url)
                    extra: dict = {}
                    counters = scrape(url)
                    with measured(extra, pid):
                        res, duration = run_round(name, requests, seed, url)
                    counters = {k: v - counters[k] for k, v in scrape(url).items()}
                    # What the gateway's heavy parts took, as shares of the round: an encoder
                    # classifier runs in turns with the engine (its wall time is the engine's
                    # loss), Presidio and the classifier's own work beside it (their CPU over
                    # the server's).
                    extra["filter_turn_share"] = counters["filter_turn_s"] / duration
                    server_cpu_s = max(extra["server_cpu"] * duration, 1e-9)
                    extra["pii_cpu_share"] = counters["pii_cpu_s"] / server_cpu_s
                    extra["filter_cpu_share"] = counters["filter_cpu_s"] / server_cpu_s
                    if name != "off":
                        extra["notes"] = [
                            f"filter encoder's turns {extra['filter_turn_share']:.1%} of the round; "
                            f"classifier {extra['filter_cpu_share']:.1%} and Presidio "
                            f"{extra['pii_cpu_share']:.1%} of the server's CPU"
                        ]
                    if name == "cache":
                        hits = cache_hits(url) - before
                        hit_rates.append(hits / len(requests))
                        # Every warmed request hits (checked): their tokens' share is the work saved.
                        out_tokens = [x.output_tokens for x in res]  # in the order of `requests` (q.index)
                        token_share = (
                            sum(out_tokens[q.index] for q in warm) / max(sum(out_tokens), 1)
                            if hits == len(warm)
                            else hit_rates[-1]
                        )
                        bounds.append(1 / (1 - max(hit_rates[-1], token_share)))
                        extra["notes"].append(
                            f"cache hits this round: {hit_rates[-1]:.1%} of the requests, "
                            f"{token_share:.1%} of the output tokens (Amdahl bound "
                            f"{bounds[-1]:.3f}x)"
                        )
                    rounds[name].append(summarize(f"gateway {name}", requests, res, duration, extra))
                    print(
                        f"round {r}/{args.rounds}  {name}: {rounds[name][-1]['output_throughput']:.1f} out tok/s "
                        f"(steady {rounds[name][-1]['steady_output_throughput']:.1f})",
                        flush=True,
                    )
                    if name == "cache" and not r % 2:
                        cold_round(r, url, seed + 500)
            summaries = {n: median_of(rs) for n, rs in rounds.items()}
            for s in summaries.values():
                print_system(s)
            costs = {n: cost_of(rounds[n], rounds["off"]) for n in systems if n != "off" and "off" in systems}
            results.update(summaries=summaries, costs=costs)
            print("\n" + "=" * 80)
            for n, c in costs.items():
                print(
                    f" {n}/off paired by round: median {c['ratio']:.3f} (cost {1 - c['ratio']:+.1%}; rounds "
                    f"{' '.join(f'{x:.2f}' for x in c['ratios'])}); filter encoder's turns {c['filter_turn_share']:.1%} "
                    f"of the round, classifier {c['filter_cpu_share']:.1%} and Presidio {c['pii_cpu_share']:.1%} of "
                    "the server's CPU (medians)"
                )
            if set(systems) != {"off", "on", "cache"}:
                print("=" * 80)
                if args.json:
                    args.json.write_text(json.dumps(results, indent=2, default=str))
                return
            # cache-hit latency, one request at a time
            hit_ms = asyncio.run(hit_latency(urls["cache"][0], headers, requests[:20]))
            moderation = asyncio.run(moderation_throughput(urls["on"][0], headers))

        # cache/on paired by round too (round i of both back to back), each against its round's bound
        pairs = list(zip(rounds["cache"], rounds["on"], bounds))
        cache_on = statistics.median(a["output_throughput"] / b["output_throughput"] for a, b, _ in pairs)
        of_bound_on = [a["output_throughput"] / b["output_throughput"] / bd for a, b, bd in pairs]
        # The same server, hits against none (see cold_round): over the whole round, and the
        # target's measure, in the steady state (steady_throughput: the start's and the drain's
        # fixed time weigh more in the shorter hit round).
        of_bound = [a["output_throughput"] / c / bd for a, c, bd in zip(rounds["cache"], cold, bounds)]
        of_bound_steady = [
            a["steady_output_throughput"] / c / bd for a, c, bd in zip(rounds["cache"], cold_steady, bounds)
        ]
        bound = statistics.mean(bounds)
        steady = statistics.median(of_bound_steady)
        c = costs["on"]
        print(
            f" gateway cost: on/off = {c['ratio']:.3f} (cost {1 - c['ratio']:+.1%}; target <= 5 %) "
            f"{'MET' if c['ratio'] >= 0.95 else 'MISSED'}; the checks' own CPU (classifier + Presidio) "
            f"{c['filter_cpu_share'] + c['pii_cpu_share']:.1%} of the server's, encoder turns "
            f"{c['filter_turn_share']:.1%} of the round"
        )
        print(
            f" cache: at a {statistics.mean(hit_rates):.1%} hit rate, Amdahl bound {bound:.3f}x (mean of rounds); "
            f"the cache server against itself with nothing warmed, in the steady state {steady:.3f} of the "
            f"bound, median of rounds ({' '.join(f'{x:.2f}' for x in of_bound_steady)}; target >= 0.95) "
            f"{'MET' if steady >= 0.95 else 'MISSED'}; whole rounds, start and drain included "
            f"{statistics.median(of_bound):.3f} ({' '.join(f'{x:.2f}' for x in of_bound)}); against the `on` server "
            f"cache/on {cache_on:.2f}x = {statistics.median(of_bound_on):.3f} of the bound "
            f"({' '.join(f'{x:.2f}' for x in of_bound_on)})"
        )
        print(
            f" cache hit latency, back to back on a quiet server: p50 {hit_ms['server_p50']:.2f} ms server-side "
            f"(p95 {hit_ms['server_p95']:.2f} ms; client p50 {hit_ms['p50']:.1f} ms, p95 {hit_ms['p95']:.1f} ms); "
            f"right after its miss: p50 {hit_ms['after_miss_server_p50']:.2f} ms server-side (client "
            f"{hit_ms['after_miss_p50']:.1f} ms)"
        )
        print(
            f" /v1/moderations: batch 1 {moderation['sequential_per_s']:.1f} texts/s (p50 "
            f"{moderation['sequential_p50_ms']:.1f} ms); batched {moderation['batched_per_s']:.1f} texts/s (p50 "
            f"{moderation['batched_p50_ms']:.1f} ms, {moderation['concurrency']} in flight) = "
            f"{moderation['batched_per_s'] / moderation['sequential_per_s']:.2f}x"
        )
        print("=" * 80)
        results.update(
            hit_rates=hit_rates,
            hit_latency_ms=hit_ms,
            moderation=moderation,
            ratios={
                "on_over_off": c["ratio"],
                "cache_over_on": cache_on,
                "amdahl_bound": bound,
                "cache_of_bound": steady,
                "cache_of_bound_rounds": of_bound_steady,
                "cache_of_bound_whole_rounds": of_bound,
                "cache_on_of_bound_rounds": of_bound_on,
                "cache_cold_tok_s": cold,
                "cache_cold_steady_tok_s": cold_steady,
            },
        )
        if args.json:
            args.json.write_text(json.dumps(results, indent=2, default=str))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def train_filter(env: dict, method: str | None = None) -> bool:
    """`tuneloop filter train` on its default set (the one the project generates, what a user's
    clone trains) into env's TUNELOOP_HOME, registered and promoted as a user does it."""
    print(f"training the filter classifier ({method or 'the shipped method'})...", flush=True)
    t = time.perf_counter()
    extra = {"TUNELOOP__GATEWAY__FILTER_TRAINING__PARAMS": json.dumps({"method": method})} if method else {}
    out = subprocess.run(
        [sys.executable, "-m", "tuneloop.cli", "filter", "train", "--json"],
        env={**env, **extra},
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if out.returncode != 0:
        raise SystemExit(f"filter train failed:\n{(out.stdout + out.stderr)[-3000:]}")
    print(f"  trained and promoted in {time.perf_counter() - t:.0f} s", flush=True)
    return True


def cost_of(rounds: list[dict], off_rounds: list[dict]) -> dict:
    """A system against `off`: the median of the per-round throughput ratios (round i of both
    ran back to back, so a drift of the shared host hits both alike) and its measured shares."""
    ratios = [a["output_throughput"] / b["output_throughput"] for a, b in zip(rounds, off_rounds)]
    return {
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "filter_turn_share": statistics.median(r.get("filter_turn_share", 0.0) for r in rounds),
        "pii_cpu_share": statistics.median(r.get("pii_cpu_share", 0.0) for r in rounds),
        "filter_cpu_share": statistics.median(r.get("filter_cpu_share", 0.0) for r in rounds),
    }


def memory_check(results: dict) -> None:
    """Say how much memory every server left: a host short of it pages the servers' code in
    and out, and the last servers started run at a fraction of their speed."""
    from tuneloop.serving.slot_cache import available_memory_bytes

    available = available_memory_bytes()
    if available is None:
        return
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    results["memory_available_gib"] = available / 2**30
    print(f"memory available with every server up: {available / 2**30:.1f} of {total / 2**30:.1f} GiB", flush=True)
    if available < 0.15 * total:
        print(
            "  WARNING: under 15 % of memory left; the servers may slow each other down (fewer --instances or "
            "--systems, or --serving max_model_len=N)",
            flush=True,
        )


async def send_chat_stream_seeded(client: Client, req, seed: int):
    """send_chat_stream with a seed in the body: greedy tokens are the same, cache keys are fresh."""
    original = client.post

    async def post(path, payload):
        return await original(path, {**payload, "seed": seed})

    client.post = post
    try:
        return await send_chat_stream(client, req)
    finally:
        client.post = original


async def hit_latency(url: str, headers: dict, reqs) -> dict:
    """Cache-hit latency, server-side (the app's `server-timing`) and at the client, two ways:
    each request's hit right after its miss (the server still finishing the miss's work: its
    log record, the engine's threads), then, after a pause, the same hits back to back on a
    quiet server (a hit's own time). Not after idle gaps: on this VM an idle process's
    wake-up alone costs milliseconds (docs/benchmarks.md)."""
    client = Client(url, headers)
    after_miss: dict[str, list[float]] = {"client": [], "server": []}  # seconds, as percentiles() takes them
    back_to_back: dict[str, list[float]] = {"client": [], "server": []}

    async def send(body, into=None):
        t = time.perf_counter()
        status, pieces = await client.post("/v1/chat/completions", body)
        [p async for p in pieces]
        if into is not None and status == 200:
            if client.last_headers.get("x-cache") != "hit":
                raise RuntimeError(f"a repeated deterministic request was not a cache hit: {client.last_headers}")
            into["client"].append(time.perf_counter() - t)
            # the app's own time in ms (tuneloop/api/middleware.py: ProcessingTimeMiddleware)
            into["server"].append(float(client.last_headers["server-timing"].partition("dur=")[2]) / 1000)

    bodies = [
        {"model": MODEL_NAME, "messages": req.messages, "max_tokens": req.max_tokens, "temperature": 0, "seed": 7}
        for req in reqs
    ]
    try:
        for body in bodies:
            await send(body)  # a miss: answers and fills the cache
            await send(body, after_miss)
        await asyncio.sleep(2.0)
        for body in bodies:
            await send(body, back_to_back)
    finally:
        await client.close()

    quiet = {side: percentiles(xs) for side, xs in back_to_back.items()}
    after = {side: percentiles(xs) for side, xs in after_miss.items()}
    return {
        "server_p50": quiet["server"]["p50"],
        "server_p95": quiet["server"]["p95"],
        "p50": quiet["client"]["p50"],
        "p95": quiet["client"]["p95"],
        "after_miss_server_p50": after["server"]["p50"],
        "after_miss_p50": after["client"]["p50"],
        "n": len(back_to_back["server"]),
    }


async def moderation_throughput(url: str, headers: dict, n: int = 192, concurrency: int = 64) -> dict:
    import numpy as np
    import pandas as pd

    texts = (
        pd.read_parquet(INJECTIONS).text.tolist()
        if INJECTIONS.exists()
        else [f"sample text number {i} to classify" for i in range(n)]
    )[:n]

    async def one(client, text):
        t = time.perf_counter()
        status, pieces = await client.post("/v1/moderations", {"input": text})
        [p async for p in pieces]
        assert status == 200, status
        return (time.perf_counter() - t) * 1000

    client = Client(url, headers)
    try:
        t = time.perf_counter()
        seq = [await one(client, x) for x in texts]
        seq_s = time.perf_counter() - t
        gate = asyncio.Semaphore(concurrency)

        async def limited(x):
            async with gate:
                return await one(client, x)

        t = time.perf_counter()
        par = await asyncio.gather(*(limited(x) for x in texts))
        par_s = time.perf_counter() - t
    finally:
        await client.close()
    return {
        "sequential_per_s": len(texts) / seq_s,
        "sequential_p50_ms": float(np.percentile(seq, 50)),
        "batched_per_s": len(texts) / par_s,
        "batched_p50_ms": float(np.percentile(par, 50)),
        "concurrency": concurrency,
        "texts": len(texts),
    }


if __name__ == "__main__":
    main()
