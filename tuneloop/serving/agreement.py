"""Does a served configuration give the reference's answers? The agreement check.

The reference is transformers' float32 forward of the same model folder. A configuration
(serving.dtype, serving.forward, the slots engine's kernels) is compared with it on:

- greedy answers: the committed prompts of data/agreement/prompts.jsonl (written for tuneloop),
  each through the model's chat template, 32 new tokens, greedy, through the slots engine as
  served (its scheduler, chunked prefill, decoding kernels). exact: how many answers are the
  reference's token for token; word_prefix: the mean share of words the two answers agree on
  before they part (common word prefix over the longer answer's words).
- teacher-forced: data/agreement/text.md (original prose, > 2,000 tokens) in windows, through
  the configuration's forward: top1, how often its most likely next token is the reference's;
  kl, the mean KL(reference || configuration) in nats per token.

The bar (BAR): at least 23 of 24 greedy answers equal and top-1 agreement >= 0.99, as the
serving dtype's default must pass on SmolLM2-135M (benchmarks/serving.py prints these beside
every throughput figure; tests/unit/test_agreement.py runs it on the demo model and SmolLM2).

    tuneloop agreement [--config F] [--model-dir D] [--dtype bfloat16] [--forward transformers]
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tuneloop.config import REPO_ROOT
from tuneloop.serving.engine import GenerationStream, SamplingParams, load_model
from tuneloop.serving.slot_cache import allocate_slot_cache
from tuneloop.serving.slots import SlotEngine

log = logging.getLogger(__name__)

PROMPTS = REPO_ROOT / "data" / "agreement" / "prompts.jsonl"
TEXT = REPO_ROOT / "data" / "agreement" / "text.md"
MAX_NEW_TOKENS = 32
BAR_EXACT, BAR_OF, BAR_TOP1 = 23, 24, 0.99  # >= 23 of 24 greedy answers equal; top-1 >= 0.99
WINDOW = 256  # teacher-forced tokens per forward (the demo model's context is 512)


@dataclass
class AgreementReport:
    label: str  # the configuration, e.g. "slots fused float32"
    model: str
    exact: int
    prompts: int
    word_prefix: float
    top1: float
    kl: float
    tokens: int  # teacher-forced positions compared
    seconds: float
    answers: list[dict[str, Any]] = field(default_factory=list)  # id, reference, candidate, equal

    @property
    def passes(self) -> bool:
        """The bar, scaled to the prompt count: 23 of 24 is at most one differing answer in 24."""
        return self.exact * BAR_OF >= BAR_EXACT * self.prompts and self.top1 >= BAR_TOP1

    def line(self) -> str:
        return (
            f"{self.exact}/{self.prompts} greedy answers equal, word-prefix {self.word_prefix:.3f}, "
            f"top-1 {self.top1:.4f}, KL {self.kl:.2e} over {self.tokens} tokens: "
            f"{'passes' if self.passes else 'FAILS'} the bar ({BAR_EXACT}/{BAR_OF}, top-1 >= {BAR_TOP1})"
        )

    def to_dict(self) -> dict:
        return {**asdict(self), "passes": self.passes}


def load_prompts(path: Path = PROMPTS) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows or any("messages" not in r and "prompt" not in r for r in rows):
        raise ValueError(f"{path}: expected JSON lines with an id and messages (or a prompt)")
    return rows


def text_prompts(n: int = 24, words: int = 24, path: Path = TEXT) -> list[dict]:
    """n plain-text prompts (no chat template): the first `words` words of n evenly spaced
    paragraphs of the committed text, for base models that answer no instructions (the demo's
    bootstrap model answers every chat prompt with newlines)."""
    paragraphs = [p for p in path.read_text().split("\n\n") if len(p.split()) >= words]
    step = max(len(paragraphs) // n, 1)
    return [
        {"id": f"t{i + 1:02d}", "prompt": " ".join(p.split()[:words])} for i, p in enumerate(paragraphs[::step][:n])
    ]


def prompt_ids(loaded, prompts: list[dict]) -> list[list[int]]:
    """Each prompt as the server tokenises it: a chat request through the chat template
    ("messages"; plain text without a template), a completion as it is ("prompt")."""
    tok = loaded.tokenizer
    out = []
    for p in prompts:
        if "prompt" in p:
            text = p["prompt"]
        elif getattr(tok, "chat_template", None):
            text = tok.apply_chat_template(p["messages"], add_generation_prompt=True, tokenize=False)
        else:
            text = "\n".join(m["content"] for m in p["messages"]) + "\n"
        out.append(loaded.encode(text))
    return out


def text_windows(loaded, path: Path = TEXT, window: int = WINDOW) -> list[list[int]]:
    ids = loaded.tokenizer(path.read_text(), add_special_tokens=False)["input_ids"]
    window = min(window, loaded.context_length)
    return [ids[i : i + window] for i in range(0, len(ids) - 1, window) if len(ids[i : i + window]) > 1]


def word_prefix(a: str, b: str) -> float:
    wa, wb = a.split(), b.split()
    if not wa and not wb:
        return 1.0
    n = 0
    for x, y in zip(wa, wb):
        if x != y:
            break
        n += 1
    return n / max(len(wa), len(wb), 1)


class Reference:
    """transformers' float32 forward of a model folder: greedy answers and teacher-forced
    log-probabilities, computed once and compared with any number of configurations."""

    def __init__(self, model_dir: Path | str, prompts: list[dict] | None = None, max_new_tokens: int = MAX_NEW_TOKENS):
        import torch

        started = time.perf_counter()
        self.model_dir = Path(model_dir)
        self.loaded = load_model(model_dir, dtype="float32")
        self.prompts = prompts if prompts is not None else load_prompts()
        self.ids = prompt_ids(self.loaded, self.prompts)
        self.max_new_tokens = max_new_tokens
        self.windows = text_windows(self.loaded)
        with torch.inference_mode():
            self.answers = [self._greedy(ids) for ids in self.ids]
        self.seconds = time.perf_counter() - started
        log.info(
            "agreement reference (%s, float32): %d answers in %.1f s", self.model_dir, len(self.answers), self.seconds
        )

    def _greedy(self, ids: list[int]) -> list[int]:
        import torch
        from transformers import GenerationConfig

        loaded = self.loaded
        out = loaded.model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            generation_config=GenerationConfig(
                do_sample=False,
                max_new_tokens=self.max_new_tokens,
                eos_token_id=sorted(loaded.stop_ids),
                pad_token_id=loaded.tokenizer.pad_token_id,
            ),
        )[0, len(ids) :].tolist()
        while out and out[-1] in loaded.stop_ids:
            out.pop()
        return out

    def log_probs(self, window: list[int]):
        import torch

        with torch.inference_mode():
            logits = self.loaded.model(input_ids=torch.tensor([window]), use_cache=False).logits[0, :-1]
        return torch.log_softmax(logits.float(), dim=-1)

    def compare(self, serving, label: str | None = None) -> AgreementReport:
        """The configuration `serving` (a tuneloop.config.ServingConfig) against this reference."""
        import torch

        started = time.perf_counter()
        candidate = load_model(self.model_dir, serving.num_threads, serving.dtype)
        dtype = str(candidate.model.dtype).replace("torch.", "")
        got = candidate_answers(candidate, serving, self.ids, self.max_new_tokens)
        forward, described = candidate_forward(candidate, serving)
        top1 = kl = 0.0
        n = 0
        with torch.inference_mode():
            for window in self.windows:
                ref = self.log_probs(window)
                lp = forward(window)
                top1 += float((ref.argmax(-1) == lp.argmax(-1)).sum())
                kl += float((ref.exp() * (ref - lp)).sum())
                n += ref.shape[0]
        decode = self.loaded.tokenizer.decode
        answers = []
        for p, want, have in zip(self.prompts, self.answers, got):
            answers.append(
                {
                    "id": p.get("id"),
                    "reference": decode(want, skip_special_tokens=True),
                    "candidate": decode(have, skip_special_tokens=True),
                    "equal": want == have,
                }
            )
        report = AgreementReport(
            label=label or f"slots {described} {dtype}",
            model=str(self.model_dir),
            exact=sum(a["equal"] for a in answers),
            prompts=len(answers),
            word_prefix=sum(word_prefix(a["reference"], a["candidate"]) for a in answers) / max(len(answers), 1),
            top1=top1 / max(n, 1),
            kl=kl / max(n, 1),
            tokens=n,
            seconds=round(time.perf_counter() - started, 1),
            answers=answers,
        )
        del candidate
        return report


def candidate_answers(loaded, serving, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy answers of the slots engine as `serving` configures it (all prompts at once)."""
    serving = serving.model_copy(update={"max_batch_size": max(len(prompts), 2), "compile": False})

    async def main() -> list[list[int]]:
        engine = SlotEngine.from_config(loaded, serving)
        engine.launch()
        await asyncio.to_thread(engine.ready.wait, 600)

        async def one(i: int, ids: list[int]) -> list[int]:
            stream = GenerationStream(
                f"agreement-{i}", ids, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
            )
            engine.submit(stream)
            out: list[int] = []
            async for new in stream.events():
                out += new
            return out

        try:
            return list(await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts))))
        finally:
            engine.stop()

    return asyncio.run(main())


def candidate_forward(loaded, serving):
    """(window -> log-probabilities of each next token, "fused" or "transformers"): the forward
    the slots engine serves with under `serving` (the fused one where it serves the model and
    matches transformers' at start-up, as the engine decides)."""
    import torch

    from tuneloop.serving import fused_forward  # deferred: it imports torch and transformers (2.9 s)

    if serving.forward == "fused" and fused_forward.unsupported_reason(loaded.model) is None:
        max_len = min(loaded.context_length, WINDOW)
        fused = fused_forward.fused_forward_for(loaded.model, max_len)
        config = (
            loaded.model.config.get_text_config()
            if hasattr(loaded.model.config, "get_text_config")
            else loaded.model.config
        )
        cache = allocate_slot_cache(config.num_hidden_layers, 2, max_len)
        cache.allocate_shape(fused.kv_heads, fused.head_dim, loaded.model.dtype, loaded.model.device)
        with torch.inference_mode():
            mismatch = fused_forward.check_against_transformers(fused, loaded.model, cache.kv)
        if mismatch is None:

            def forward(window: list[int]):
                n = len(window) - 1
                ids = torch.tensor(window[:-1])
                zeros = torch.zeros(n, dtype=torch.long)
                logits = fused.forward(ids, zeros, torch.arange(n), zeros, torch.arange(n), cache.kv)
                return torch.log_softmax(logits.float(), dim=-1)

            return forward, "fused"

    def forward(window: list[int]):
        logits = loaded.model(input_ids=torch.tensor([window[:-1]]), use_cache=False).logits[0]
        return torch.log_softmax(logits.float(), dim=-1)

    return forward, "transformers"


def check(model_dir: Path | str, serving, reference: Reference | None = None) -> AgreementReport:
    """One configuration against a (new) float32 reference of model_dir."""
    reference = reference or Reference(model_dir)
    return reference.compare(serving)
