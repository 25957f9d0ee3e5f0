"""What constrained decoding costs: output tokens/s with a JSON schema and with a forced tool
call against free text, the same workload in one run, with the answers' check beside them.

    .venv/bin/python benchmarks/structured.py [--model smollm2|demo|PATH] [--requests 32] [--tokens 128] [--rounds 3]

Same workload: the constrained requests run first (greedy, so each answer's length is fixed);
the free-text run then generates exactly as many tokens for each request (max_tokens = that
answer's length, ignore_eos), from the same prompts at the same concurrency. So the two
differ only in the mask computed and applied at every step of every constrained row. Modes,
in alternating order from the second round on:

    json        response_format json_schema: a city, a free description, a list of landmarks
    tool        tool_choice required: describe_city(city, description), the grammar the API builds
    free-json   free text, the json run's lengths
    free-tool   free text, the tool run's lengths

Checked beside the figures: every constrained answer is one the grammar accepts (its matcher
takes every token; a complete one parses and validates against its schema), and batch
invariance: each greedy constrained answer of the batch equals the same request run alone.
In process: the slots engine with its default fused float32 forward, no HTTP.

A schema with a large minLength/maxLength (thousands) makes llguidance's lexer slow (24 ms a
token at minLength 100,000, measured here): its figures here are for ordinary schemas.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.in_process import chat_prompts, preset_model, run_batch  # noqa: E402

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "description": {"type": "string"},
        "landmarks": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    },
    "required": ["city", "description", "landmarks"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "function": {
        "name": "describe_city",
        "description": "Record a description of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "description": {"type": "string"}},
            "required": ["city", "description"],
            "additionalProperties": False,
        },
    },
}
QUESTIONS = [
    "Describe the capital of France in detail.",
    "Describe the capital of Japan in detail.",
    "Describe the capital of Kenya in detail.",
    "Describe the capital of Brazil in detail.",
    "Describe the capital of Italy in detail.",
    "Describe the capital of Canada in detail.",
    "Describe the capital of Egypt in detail.",
    "Describe the capital of India in detail.",
]


def accepted(loaded, constraint, tokens: list[int]) -> bool:
    """Whether the constraint's matcher takes every token of an answer (it is a valid prefix)."""
    from tuneloop.serving.constraints import RowConstraint

    row = RowConstraint(constraint, loaded.grammar_tokenizer)
    try:
        for t in tokens:
            row.advance(t)
    except ValueError:
        return False
    return True


async def main_async(args) -> None:
    import jsonschema

    from tuneloop.chat_format import parse_tool_calls, tool_call_grammar
    from tuneloop.serving.constraints import Constraint, json_schema
    from tuneloop.serving.engine import SamplingParams, load_model
    from tuneloop.serving.slots import SlotEngine

    path = preset_model(args.model)
    loaded = load_model(path, num_threads=args.threads)
    engine = SlotEngine(loaded, num_slots=args.requests)
    engine.launch()
    await asyncio.to_thread(engine.ready.wait, 900)
    n, k = args.requests, args.tokens
    inputs = {"json": chat_prompts(loaded, QUESTIONS, n), "tool": chat_prompts(loaded, QUESTIONS, n, [TOOL])}
    constraints = {
        "json": json_schema(CITY),
        "tool": Constraint("grammar", tool_call_grammar([TOOL], parallel=False)),
    }
    lengths: dict[str, list[int]] = {}

    def specs(mode: str):
        if mode.startswith("free-"):
            kind = mode[5:]
            return [
                (ids, SamplingParams(max_new_tokens=max(1, m), temperature=0, ignore_eos=True))
                for ids, m in zip(inputs[kind], lengths[kind])
            ]
        return [
            (ids, SamplingParams(max_new_tokens=k, temperature=0, constraint=constraints[mode])) for ids in inputs[mode]
        ]

    await run_batch(engine, specs("json")[:2])  # warm-up: the grammar tokenizer, first steps
    modes = ["json", "tool", "free-json", "free-tool"]
    rates: dict[str, list[float]] = {m: [] for m in modes}
    answers: dict[str, list] = {}
    print(f"model {path.name}: {n} concurrent requests, up to {k} output tokens, {args.rounds} rounds", flush=True)
    for r in range(args.rounds):
        order = modes if r % 2 == 0 else ["free-tool", "free-json", "tool", "json"] if r else modes
        line = []
        for mode in order:
            wall, out = await run_batch(engine, specs(mode))
            tokens = sum(len(t) for t, _ in out)
            if not mode.startswith("free-"):
                if mode in lengths:
                    assert [len(t) for t, _ in out] == lengths[mode], f"{mode}: greedy answers changed length"
                lengths[mode] = [len(t) for t, _ in out]
                answers[mode] = out
            else:
                assert tokens == sum(lengths[mode[5:]]), f"{mode}: not the same workload"
            rates[mode].append(tokens / wall)
            line.append(f"{mode} {tokens / wall:.1f} tok/s ({tokens} tokens)")
        print(f"round {r + 1}: " + ", ".join(line), flush=True)
    # the answers: accepted by their grammar; complete ones valid; batched = alone
    checks = {}
    for mode in ("json", "tool"):
        ok = complete = 0
        for tokens, finish in answers[mode]:
            ok += accepted(loaded, constraints[mode], tokens)
            text = loaded.tokenizer.decode(tokens)
            if finish == "stop":
                if mode == "json":
                    jsonschema.validate(json.loads(text), CITY)
                else:
                    _, calls = parse_tool_calls(text, {"describe_city"})
                    assert len(calls) == 1, text
                    jsonschema.validate(json.loads(calls[0].arguments), TOOL["function"]["parameters"])
                complete += 1
        same = 0
        for spec, (tokens, _) in list(zip(specs(mode), answers[mode]))[:8]:
            _, (alone,) = await run_batch(engine, [spec])
            same += alone[0] == tokens
        checks[mode] = (ok, complete, same, min(8, n))
    engine.stop()
    print()
    print(
        "| mode | output tok/s (rounds) | median | vs free text, same tokens (median of per-round ratios) | answers |"
    )
    print("|---|---|---|---|---|")
    for mode in ("json", "tool"):
        ratios = [c / f for c, f in zip(rates[mode], rates[f"free-{mode}"])]
        ok, complete, same, of = checks[mode]
        print(
            f"| {mode} | {' / '.join(f'{x:.1f}' for x in rates[mode])} | {statistics.median(rates[mode]):.1f} "
            f"| {statistics.median(ratios):.3f} | {ok}/{n} accepted by the grammar, {complete}/{n} complete and "
            f"schema-valid (the rest cut at {k} tokens), greedy batched = alone {same}/{of} |"
        )
        free = rates[f"free-{mode}"]
        print(f"| free-{mode} | {' / '.join(f'{x:.1f}' for x in free)} | {statistics.median(free):.1f} | 1 | - |")
    print(f"\ne.g. json: {loaded.tokenizer.decode(answers['json'][0][0])}")
    print(f"e.g. tool: {loaded.tokenizer.decode(answers['tool'][0][0])}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="smollm2, demo, or a model folder")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
