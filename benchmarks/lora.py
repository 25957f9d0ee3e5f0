"""What serving LoRA adapters costs in the slots engine: output tokens/s of one batch whose rows
use 8 different adapters against the same batch on the base alone, adapter load time, and
beside them the answers' check (each adapter row's greedy answer against that adapter merged
into the base and served alone by the same engine).

    .venv/bin/python benchmarks/lora.py [--model smollm2|demo|PATH] [--requests 32] [--tokens 64] [--rounds 3]
    .venv/bin/python benchmarks/lora.py --products [--model ...]   # the batched products alone, three ways

Adapters: 8 random peft LoRAs (r=8, alpha 16, non-zero B) on q,v (`qv`, training's default
recipe) and 8 on every linear layer (`all`, its auto recipe), made with peft into a temporary
folder. Same workload in every mode: the same prompts, greedy, ignore_eos, --tokens each, at
--requests concurrent streams in one SlotEngine (in process, its default fused float32
forward, no HTTP); row i uses adapter i mod 8. Modes, alternating order from round to round,
each round after the machine is quiet:

    base   every row on the base model
    qv     rows on the 8 q,v adapters
    all    rows on the 8 all-linear adapters

The target: qv and all at >= 0.8 of base (median of per-round ratios). Load time: each of the
16 adapters read cold (its own thread, while the engine goes on) and installed (the engine's
step boundary: the only pause the running streams see), and a request's wait for a cold
adapter against a loaded one. --products times the three ways to apply the adapters of a step
that lora_table.py chose between (a mask over stacked ranks, a loop over the step's adapters,
padded per-adapter bmm) at this model's sizes, for a decoding step and a prefill chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from benchmarks.in_process import chat_prompts, preset_model, run_batch  # noqa: E402
from benchmarks.serving import measured, wait_until_quiet  # noqa: E402
from tests.support.lora import make_adapter  # noqa: E402

QUESTIONS = [
    "Describe the capital of France in a few sentences.",
    "How do I reset my password if I no longer have my phone?",
    "Write a short poem about the sea at night.",
    "What is the difference between a list and a tuple in Python?",
    "My invoice shows a charge twice. What should I do?",
    "Explain photosynthesis to a ten-year-old.",
    "Give me three ideas for a rainy Sunday afternoon.",
    "Why is the sky blue?",
]
MODES = ("base", "qv", "all")
TARGETS = {"qv": ["q_proj", "v_proj"], "all": "all-linear"}  # GPT-2 (the demo model): qv is its c_attn
ADAPTERS = 8


def make_adapters(path: Path, folder: Path, b_scale: float, seed_base: int = 100) -> dict[str, list]:
    from transformers import AutoConfig

    from tuneloop.serving.lora import AdapterRef

    gpt2 = AutoConfig.from_pretrained(path).model_type == "gpt2"
    refs: dict[str, list] = {}
    for v, variant in enumerate(("qv", "all")):
        refs[variant] = []
        for k in range(ADAPTERS):
            # B scaled so that an adapter moves the answers without wrecking them (a trained
            # adapter's B is small too); peft's init_lora_weights=False draws both at random.
            adapter, _ = make_adapter(
                path,
                folder / f"{variant}-{k}",
                seed_base + 10 * v + k,
                merged=False,
                b_scale=b_scale,
                r=8,
                lora_alpha=16,
                target_modules=["c_attn"] if gpt2 and variant == "qv" else TARGETS[variant],
            )
            refs[variant].append(AdapterRef(f"ft:bench:{variant}-{k}", str(adapter)))
    return refs


def merged_alone(loaded, adapter_path: str):
    """The served model with the adapter merged into its weights (peft's merge_and_unload)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(loaded.path, attn_implementation="sdpa", dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, adapter_path).merge_and_unload().eval()
    return dataclasses.replace(loaded, model=merged)


async def main_async(args, work: Path) -> dict:
    from tuneloop.config import ServingLoraConfig
    from tuneloop.serving.engine import SamplingParams, load_model
    from tuneloop.serving.slots import SlotEngine

    path = preset_model(args.model)
    loaded = load_model(path, num_threads=args.threads)
    started = time.perf_counter()
    refs = make_adapters(path, work, args.b_scale)
    print(f"made {2 * ADAPTERS} adapters with peft in {time.perf_counter() - started:.0f} s ({work})", flush=True)
    n, k = args.requests, args.tokens
    inputs = chat_prompts(loaded, QUESTIONS, n)

    def specs(mode: str):
        return [
            (
                ids,
                SamplingParams(
                    k, temperature=0.0, ignore_eos=True, adapter=None if mode == "base" else refs[mode][i % ADAPTERS]
                ),
            )
            for i, ids in enumerate(inputs)
        ]

    engine = SlotEngine(loaded, num_slots=n, lora=ServingLoraConfig(max_loaded=2 * ADAPTERS))
    engine.launch()
    await asyncio.to_thread(engine.ready.wait, 900)
    assert engine.supports_adapters, engine.adapter_refusal

    # load time: each adapter cold (idle engine), then the same request with it loaded
    warm = SamplingParams(1, temperature=0.0, ignore_eos=True)
    await run_batch(engine, [(inputs[0], warm)])  # first-call costs
    cold, loaded_wait = [], []
    for variant in ("qv", "all"):
        for ref in refs[variant]:
            params = dataclasses.replace(warm, adapter=ref)
            cold.append((await run_batch(engine, [(inputs[0], params)]))[0])
            loaded_wait.append((await run_batch(engine, [(inputs[0], params)]))[0])
    stats = engine.adapters.stats
    print(
        f"adapter loads: read {statistics.median(stats.read_seconds) * 1000:.1f} ms median "
        f"(max {max(stats.read_seconds) * 1000:.1f}), installed {statistics.median(stats.install_seconds) * 1000:.1f} ms "
        f"median (max {max(stats.install_seconds) * 1000:.1f}, with up to {2 * ADAPTERS} held); a 1-token request "
        f"{statistics.median(cold) * 1000:.0f} ms cold vs {statistics.median(loaded_wait) * 1000:.0f} ms loaded",
        flush=True,
    )

    for mode in MODES:  # warm-up: every shape of the steps (oneDNN builds a kernel per shape)
        await run_batch(engine, specs(mode))
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    others: list[float] = []
    answers: dict[str, list[list[int]]] = {}
    print(f"model {path.name}: {n} concurrent requests x {k} output tokens, {args.rounds} rounds", flush=True)
    for r in range(args.rounds):
        wait_until_quiet(args.wait_quiet)
        order = MODES if r % 2 == 0 else tuple(reversed(MODES))
        line = []
        for mode in order:
            extra: dict = {}
            with measured(extra):
                wall, out = await run_batch(engine, specs(mode))
            out = [t for t, _ in out]
            tokens = sum(len(t) for t in out)
            assert tokens == n * k, f"{mode}: {tokens} tokens, not {n * k}"
            rates[mode].append(tokens / wall)
            others.append(extra["others_cpu"])
            answers[mode] = out
            line.append(f"{mode} {tokens / wall:.1f} tok/s")
        print(f"round {r + 1}: " + ", ".join(line) + f" (others {max(others[-3:]):.2f} cores)", flush=True)
    engine.stop()

    # the answers: each adapter row against that adapter merged and served alone
    agree: dict[str, tuple[int, int]] = {}
    for variant in ("qv", "all"):
        same = rows = 0
        for a in range(min(args.check, ADAPTERS)):
            mine = [i for i in range(n) if i % ADAPTERS == a]
            alone_engine = SlotEngine(merged_alone(loaded, refs[variant][a].path), num_slots=len(mine))
            alone_engine.launch()
            await asyncio.to_thread(alone_engine.ready.wait, 900)
            plain = [(inputs[i], SamplingParams(k, temperature=0.0, ignore_eos=True)) for i in mine]
            _, alone = await run_batch(alone_engine, plain)
            alone = [t for t, _ in alone]
            alone_engine.stop()
            same += sum(answers[variant][i] == t for i, t in zip(mine, alone))
            rows += len(mine)
        agree[variant] = (same, rows)
        changed = sum(answers[variant][i] != answers["base"][i] for i in range(n))
        print(
            f"{variant}: {same}/{rows} adapter rows equal to their adapter merged alone; {changed}/{n} differ from the base"
        )

    print()
    print(
        "| mode | output tok/s (rounds) | median | vs base (median of per-round ratios) | adapter rows = merged alone |"
    )
    print("|---|---|---|---|---|")
    summary = {"model": path.name, "requests": n, "tokens": k, "rates": rates, "others_cpu_max": max(others)}
    for mode in MODES:
        ratios = [x / b for x, b in zip(rates[mode], rates["base"])]
        check = "-" if mode == "base" else f"{agree[mode][0]}/{agree[mode][1]}"
        print(
            f"| {mode} | {' / '.join(f'{x:.1f}' for x in rates[mode])} | {statistics.median(rates[mode]):.1f} "
            f"| {statistics.median(ratios):.3f} | {check} |"
        )
        summary[f"{mode}_vs_base"] = statistics.median(ratios)
    summary.update(
        read_ms=[s * 1000 for s in stats.read_seconds],
        install_ms=[s * 1000 for s in stats.install_seconds],
        cold_request_ms=statistics.median(cold) * 1000,
        loaded_request_ms=statistics.median(loaded_wait) * 1000,
        agreement={v: list(x) for v, x in agree.items()},
    )
    print(f"(others: at most {max(others):.2f} cores used by other processes during a measured batch)")
    print(f"e.g. qv row 1: {loaded.tokenizer.decode(answers['qv'][1])!r}")
    return summary


# ---------------------------------------------------------------------------------------
# --products: the three ways to apply a step's adapters, at this model's sizes


def products(args) -> None:
    import torch
    from transformers import AutoConfig

    from tuneloop.serving.lora import Target, config_targets
    from tuneloop.serving.lora_table import LoadedAdapter, LoraStep, stack

    if args.threads:
        torch.set_num_threads(args.threads)
    config = AutoConfig.from_pretrained(preset_model(args.model))
    shapes = config_targets(config)
    if shapes is None:
        raise SystemExit(f"{config.model_type}: no fused forward targets")
    # the part each module is of its fused product (as the fused forward lays them out)
    targets, at = {}, {}
    for name, (out_f, in_f) in shapes.items():
        layer = int(name.split(".")[2])
        linear = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "c_attn": "qkv", "o_proj": "o"}.get(
            name.rsplit(".", 1)[1], "up" if name.endswith(("gate_proj", "up_proj", "c_fc")) else "down"
        )
        if name.endswith("attn.c_proj"):
            linear = "o"
        start = at.get((layer, linear), 0)
        at[(layer, linear)] = start + out_f
        targets[name] = Target(layer, linear, start, start + out_f, in_f)
    widths = {(t.layer, t.linear): at[(t.layer, t.linear)] for t in targets.values()}
    inputs = {(t.layer, t.linear): t.in_features for t in targets.values()}
    layers = sorted({t.layer for t in targets.values()})
    r = 8

    suffix = {t.part: name.rsplit(".", 1)[1] for name, t in targets.items()}

    def adapters(count: int, kinds) -> list:
        """count random adapters on the parts whose module name ends with one of kinds (None: all)."""
        ranks = {part: r for part, end in suffix.items() if kinds is None or end in kinds}
        return [
            LoadedAdapter(
                f"a{a}",
                "",
                dict(ranks),
                {
                    (t.layer, t.part): (torch.randn(r, t.in_features) * 0.02, torch.randn(r, t.out_features) * 0.02)
                    for t in targets.values()
                    if t.part in ranks
                },
                0,
                0.0,
            )
            for a in range(count)
        ]

    print(f"{config.model_type}, {len(layers)} layers, r={r}: ms per forward of the adapter products alone")
    print(
        "| tokens | targets | adapters | mask over stacked ranks (served) | loop over adapters | padded bmm | base products |"
    )
    print("|---|---|---|---|---|---|---|")
    for n in (32, 256):
        xs = {key: torch.randn(n, inputs[key]) for key in inputs}
        outs = {key: torch.randn(n, widths[key]) for key in widths}
        base_w = {key: torch.randn(widths[key], inputs[key]) * 0.02 for key in widths}
        base_ms = _timed(functools.partial(_base_products, xs, base_w))
        for kinds, label in ((("q_proj", "v_proj", "c_attn"), "q,v"), (None, "all")):
            for count in (1, ADAPTERS):
                held = adapters(count, kinds)
                stacks = stack(held, layers, torch.float32)
                positions = [(i % count) + 1 for i in range(n)]
                step = LoraStep(stacks, positions, n)
                mask = _timed(functools.partial(_mask, step, layers, xs, outs))
                rows = [torch.tensor([i for i in range(n) if positions[i] == a + 1]) for a in range(count)]
                loop = _timed(functools.partial(_loop, stacks, held, rows, xs, outs))
                per_adapter = {
                    key: (
                        torch.stack([h.weights[key][0].t() for h in held]),
                        torch.stack([h.weights[key][1] for h in held]),
                    )
                    for key in stacks.weights
                }
                bmm = _timed(functools.partial(_bmm, per_adapter, rows, xs, outs))
                print(f"| {n} | {label} | {count} | {mask:.1f} | {loop:.1f} | {bmm:.1f} | {base_ms:.1f} |", flush=True)


def _timed(fn) -> float:
    """Best of 5, in ms."""
    fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1000


def _base_products(xs, weights) -> None:
    import torch

    for key, w in weights.items():
        torch.nn.functional.linear(xs[key], w)


def _mask(step, layers, xs, outs) -> None:
    """What the engine runs: LoraStep.add after each fused product."""
    for layer in layers:
        for linear in ("qkv", "o", "up", "down"):
            step.add(layer, linear, xs[(layer, linear)], outs[(layer, linear)])


def _loop(stacks, held, rows, xs, outs) -> None:
    """Per part, per adapter of the step: gather its rows, two products, scatter them back."""
    for layer, part in stacks.weights:
        for a, adapter in enumerate(held):
            wa, wb = adapter.weights[(layer, part)]
            x = xs[(layer, part[0])].index_select(0, rows[a])
            outs[(layer, part[0])][:, part[1] : part[2]].index_add_(0, rows[a], (x @ wa.t()) @ wb)


def _bmm(per_adapter, rows, xs, outs) -> None:
    """Per part: the step's rows gathered into one padded segment per adapter, two bmm with the
    adapters' A^T [adapters, in, r] and B' [adapters, r, out], scattered back."""
    import torch

    count, n = len(rows), sum(len(r) for r in rows)
    seg = max(len(r) for r in rows)
    pad = torch.full((count * seg,), n)  # padding points at an extra zero row
    for a in range(count):
        pad[a * seg : a * seg + len(rows[a])] = rows[a]
    for (layer, part), (wa, wb) in per_adapter.items():
        key = (layer, part[0])
        x = torch.cat([xs[key], torch.zeros(1, xs[key].shape[1])]).index_select(0, pad).view(count, seg, -1)
        delta = torch.bmm(torch.bmm(x, wa), wb).view(count * seg, -1)
        keep = pad < n
        outs[key][:, part[1] : part[2]].index_add_(0, pad[keep], delta[keep])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2, demo, or a model folder")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--check", type=int, default=ADAPTERS, help="adapters whose rows are checked against merged alone")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--b-scale", type=float, default=0.05, help="B of the random adapters times this")
    ap.add_argument("--wait-quiet", type=float, default=120.0, help="seconds to wait for other processes to go quiet")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--products", action="store_true", help="time the batched adapter products alone")
    args = ap.parse_args()
    if args.products:
        products(args)
        return
    work = Path(tempfile.mkdtemp(prefix="tuneloop-lora-bench-"))
    try:
        summary = asyncio.run(main_async(args, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)  # 16 adapters' folders
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
