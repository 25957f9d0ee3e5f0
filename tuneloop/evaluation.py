"""Evaluate a causal LM on the eval split: loss/perplexity, generation quality, speed.

Two passes over the same examples (the whole split unless evaluation.max_examples says
otherwise -- a sample of 50 rows decides nothing):

1. Teacher-forced loss, masked exactly as in training (tuneloop.formatting.encode_example):
   the mean cross-entropy over every completion token of the split, and its exp (perplexity).
   An example longer than the context keeps its end, so its completion is still scored.
2. Greedy generation from the prompt (batched, left-padded, stopping at eos / <|im_end|>),
   cleaned like serving does (formatting.clean_completion) and scored against the reference:
   exact match, SQuAD-style token F1, ROUGE-L F. Plus speed: ms per generated token and
   generated tokens per second, measured over the generate calls only.

For short-label tasks (classification in words: "Billing", "Science and technology") a score
needs its floor beside it and a cause when it is low:
- label_accuracy: the answer's first line against the reference, both normalised (NFKC,
  casefold, whitespace, end markers, punctuation at either end), so "billing." and an answer
  whose first line is "Billing" count and "Bill" does not;
- majority_label: what always answering the eval split's commonest reference scores, and
  majority_label_per_template (each template's commonest) where the rows name a template (or,
  with no template field, come from several files: a T0 folder has one file per template);
- label_accuracy/template:<t> and label_accuracy/label:<l> where the rows carry those fields
  (the source file's `template` / `label` columns, kept in Example.extra; evaluation.template_field
  and label_field name others);
- every row's prediction (EvalRow), which the flow writes as an artifact.

The metric functions are small and dependency-free, so their behaviour is pinned by tests.
"""

from __future__ import annotations

import math
import re
import time
import unicodedata
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from tuneloop.config import EvaluationConfig
from tuneloop.data.schema import Example
from tuneloop.formatting import IGNORE_INDEX, clean_completion, context_window, encode_example, prompt_ids, prompt_text

STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")  # besides the tokenizer's own eos


# ---- metrics -------------------------------------------------------------------------
def _is_punct(ch: str) -> bool:
    return unicodedata.category(ch).startswith("P")


def normalize_answer(text: str) -> str:
    """Casefold, collapse whitespace, strip, and drop trailing punctuation ("Positive." == "positive")."""
    text = " ".join(text.casefold().split())
    end = len(text)
    while end and (_is_punct(text[end - 1]) or text[end - 1].isspace()):
        end -= 1
    return text[:end]


def answer_tokens(text: str) -> list[str]:
    """Words of the normalised answer, punctuation trimmed from each word's edges."""
    out = []
    for word in normalize_answer(text).split():
        start, end = 0, len(word)
        while start < end and _is_punct(word[start]):
            start += 1
        while end > start and _is_punct(word[end - 1]):
            end -= 1
        if start < end:
            out.append(word[start:end])
    return out


def exact_match(prediction: str, reference: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(reference))


END_MARKERS = ("<|im_end|>", "<|endoftext|>", "</s>", "<eos>", "<|eot_id|>", "<|end|>")


def normalize_label(text: str) -> str:
    """A short label as a person reads it: NFKC, end markers cut, the first non-empty line,
    casefolded, whitespace collapsed, punctuation stripped at both ends."""
    text = unicodedata.normalize("NFKC", text)
    for marker in END_MARKERS:
        text = text.split(marker, 1)[0]
    line = next((ln for ln in text.splitlines() if ln.strip()), "")
    words = " ".join(line.casefold().split())
    start, end = 0, len(words)
    while start < end and (_is_punct(words[start]) or words[start].isspace()):
        start += 1
    while end > start and (_is_punct(words[end - 1]) or words[end - 1].isspace()):
        end -= 1
    return words[start:end]


def label_match(prediction: str, reference: str) -> float:
    return float(normalize_label(prediction) == normalize_label(reference))


def metric_key(value: Any) -> str:
    """A row field's value as part of an MLflow metric name (alphanumerics, _ - . : / and space)."""
    return re.sub(r"[^A-Za-z0-9_.\- ]+", "_", str(value)).strip()[:60] or "_"


def label_metrics(rows: list["EvalRow"]) -> dict[str, float]:
    """majority_label(_per_template) and per-template / per-label accuracy (see the module doc)."""
    if not rows:
        return {}
    refs = [normalize_label(r.reference) for r in rows]
    out = {"majority_label": Counter(refs).most_common(1)[0][1] / len(rows)}
    by_template: dict[str, list[EvalRow]] = {}
    by_label: dict[str, list[EvalRow]] = {}
    for r in rows:
        if r.template is not None:
            by_template.setdefault(str(r.template), []).append(r)
        if r.label is not None:
            by_label.setdefault(str(r.label), []).append(r)
    if by_template:
        out["majority_label_per_template"] = sum(
            Counter(normalize_label(r.reference) for r in group).most_common(1)[0][1] for group in by_template.values()
        ) / len(rows)
    for kind, groups in (("template", by_template), ("label", by_label)):
        for name, group in sorted(groups.items()):
            out[f"label_accuracy/{kind}:{metric_key(name)}"] = sum(r.label_match for r in group) / len(group)
    return out


def token_f1(prediction: str, reference: str) -> float:
    """SQuAD-style F1 over the bag of words: overlap counted with multiplicity."""
    pred, ref = answer_tokens(prediction), answer_tokens(reference)
    if not pred or not ref:
        return float(pred == ref)  # both empty: a perfect (empty) answer
    overlap = sum((Counter(pred) & Counter(ref)).values())
    if overlap == 0:
        return 0.0
    precision, recall = overlap / len(pred), overlap / len(ref)
    return 2 * precision * recall / (precision + recall)


def lcs_length(a: list[str], b: list[str]) -> int:
    """Longest common subsequence length, O(len(a)*len(b)) time and O(len(b)) memory."""
    if len(a) < len(b):
        a, b = b, a
    row = [0] * (len(b) + 1)
    for x in a:
        prev_diag = 0
        for j, y in enumerate(b, 1):
            cur = row[j]
            row[j] = prev_diag + 1 if x == y else max(row[j], row[j - 1])
            prev_diag = cur
    return row[-1]


def rouge_l(prediction: str, reference: str) -> float:
    """ROUGE-L F1 (beta = 1) over answer tokens."""
    pred, ref = answer_tokens(prediction), answer_tokens(reference)
    if not pred or not ref:
        return float(pred == ref)
    lcs = lcs_length(pred, ref)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(pred), lcs / len(ref)
    return 2 * precision * recall / (precision + recall)


# ---- result --------------------------------------------------------------------------
@dataclass
class EvalRow:
    id: str
    prompt: str
    reference: str
    generation: str
    em: float
    f1: float
    rouge_l: float
    generated_tokens: int
    label_match: float = 0.0
    template: str | None = None  # the row's `template` field, if it has one
    label: str | None = None  # the row's `label` field (the class behind the answer's wording)


@dataclass
class EvalResult:
    model_ref: str
    metrics: dict[str, float]
    rows: list[EvalRow] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"model_ref": self.model_ref, "metrics": self.metrics, "rows": [asdict(r) for r in self.rows]}


def _field(ex: Example, name: str) -> str | None:
    value = (ex.extra or {}).get(name)
    return None if value is None or isinstance(value, (dict, list)) else str(value)


def predictions(result: "EvalResult") -> list[dict[str, Any]]:
    """One record per eval row: what the predictions artifact holds."""
    return [
        {
            "id": r.id,
            "template": r.template,
            "label": r.label,
            "expected": r.reference,
            "generated": r.generation,
            "exact_match": bool(r.em),
            "label_match": bool(r.label_match),
        }
        for r in result.rows
    ]


# ---- model loading -------------------------------------------------------------------
def load_for_eval(model_ref: str | Path):
    """(model, tokenizer) ready for batched generation; a LoRA adapter folder is merged."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ref = str(model_ref)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    adapter = Path(ref) / "adapter_config.json"
    if adapter.exists():
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(ref, dtype=torch.float32).merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32)
    # transformers 5 does not persist padding_side: say it at load time.
    tokenizer = AutoTokenizer.from_pretrained(ref, padding_side="left")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # pads are masked out; any id will do
    return model.to(device).eval(), tokenizer


def _context_length(model) -> int:
    return context_window(model.config) or 2048


def _stop_ids(tokenizer) -> list[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for tok in STOP_TOKENS:
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid >= 0:
            ids.add(tid)
    return sorted(ids)


# ---- the two passes ------------------------------------------------------------------
def _eval_loss(model, tokenizer, examples, batch_size: int, max_length: int, bar) -> tuple[float, int, set[str]]:
    """Summed cross-entropy and number of completion tokens (training's masking), and the
    ids of examples cut to fit max_length."""
    import torch
    import torch.nn.functional as F

    device = next(model.parameters()).device
    encoded, cut = [], set()
    for ex in examples:
        enc = encode_example(ex, tokenizer, 10**9)
        if len(enc["input_ids"]) > max_length:
            # Keep the END: cutting the right side (as a plain truncation would) drops the
            # very completion tokens the loss is about. Masking is unchanged.
            enc = {k: v[-max_length:] for k, v in enc.items()}
            cut.add(ex.example_id)
        encoded.append(enc)
    total, count = 0.0, 0
    for i in range(0, len(encoded), batch_size):
        batch = encoded[i : i + batch_size]
        width = max(len(e["input_ids"]) for e in batch)
        pad = tokenizer.pad_token_id
        ids = torch.tensor([e["input_ids"] + [pad] * (width - len(e["input_ids"])) for e in batch], device=device)
        mask = torch.tensor([e["attention_mask"] + [0] * (width - len(e["input_ids"])) for e in batch], device=device)
        labels = torch.tensor([e["labels"] + [IGNORE_INDEX] * (width - len(e["labels"])) for e in batch], device=device)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits.float()
        # Token t predicts token t+1: the same shift the HF loss does, summed not averaged
        # per batch, so the split-level mean weighs every completion token equally.
        total += F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)),
            labels[:, 1:].reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        ).item()
        count += int((labels[:, 1:] != IGNORE_INDEX).sum())
        bar.update(len(batch))
    return total, count, cut


def _generate(model, tokenizer, examples, batch_size: int, max_new_tokens: int, bar):
    """Greedy completions in original order, their token counts, and seconds spent generating."""
    import torch

    device = next(model.parameters()).device
    stop = _stop_ids(tokenizer)
    pad = tokenizer.pad_token_id
    # Room for the answer within the position embeddings: keep the END of long prompts.
    max_prompt = max(1, _context_length(model) - max_new_tokens)
    full = [prompt_ids(ex, tokenizer) for ex in examples]
    truncated = {ex.example_id for ex, p in zip(examples, full) if len(p) > max_prompt}
    prompts = [p[-max_prompt:] for p in full]
    # Similar lengths share a batch: less padding, same greedy result per example.
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    texts, counts = [""] * len(prompts), [0] * len(prompts)
    seconds = 0.0
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in idx], device=device)
        mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in idx], device=device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=stop,
                pad_token_id=pad,
            )
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds += time.perf_counter() - t0
        for row, i in zip(out[:, width:].tolist(), idx):
            # Tokens the model produced for this row: up to and including its stop token.
            cut = next((k for k, t in enumerate(row) if t in stop), None)
            produced = row if cut is None else row[: cut + 1]
            counts[i] = len(produced)
            text = tokenizer.decode(row if cut is None else row[:cut], skip_special_tokens=True)
            texts[i] = clean_completion(text, tokenizer)
        bar.update(len(idx))
    return texts, counts, seconds, truncated


def generate_answers(model, tokenizer, examples: list[Example], cfg: EvaluationConfig) -> list[str]:
    """Greedy, cleaned answers to `examples` in their order: evaluate_model's generation pass,
    for checks that must answer exactly as the evaluation does (tuneloop/behaviour.py)."""
    with tqdm(total=len(examples), disable=True) as bar:
        texts, _, _, _ = _generate(model, tokenizer, examples, cfg.batch_size, cfg.max_new_tokens, bar)
    return texts


def evaluate_model(
    model_ref: str | Path,
    examples: list[Example],
    cfg: EvaluationConfig,
    progress: bool = True,
    max_length: int | None = None,
) -> EvalResult:
    """Evaluate the model at `model_ref` (a saved folder or hub id) on `examples`.

    max_length: longest sequence in the loss pass (longer examples keep their end, so the
    completion is always scored). None: the model's context length.
    """
    if cfg.max_examples is not None:
        examples = examples[: cfg.max_examples]
    if not examples:
        raise ValueError("evaluation needs at least one example; the eval split is empty")
    model, tokenizer = load_for_eval(model_ref)
    max_length = max_length or _context_length(model)
    name = Path(str(model_ref)).name or str(model_ref)

    with tqdm(total=len(examples), desc=f"eval loss {name}", unit="ex", disable=not progress) as bar:
        loss_sum, loss_tokens, loss_cut = _eval_loss(model, tokenizer, examples, cfg.batch_size, max_length, bar)
    with tqdm(total=len(examples), desc=f"generate {name}", unit="ex", disable=not progress) as bar:
        generations, counts, seconds, truncated = _generate(
            model, tokenizer, examples, cfg.batch_size, cfg.max_new_tokens, bar
        )

    # Without a template field, a split read from several files (a T0 folder: one file per
    # template) takes the file as the template, so the per-template floor is still there.
    by_file = len({ex.source_file for ex in examples}) > 1 and not any(
        _field(ex, cfg.template_field) for ex in examples
    )
    rows = []
    for ex, gen, n in zip(examples, generations, counts):
        ref = clean_completion(ex.completion, tokenizer)  # legacy data may carry a literal <|endoftext|>
        rows.append(
            EvalRow(
                id=ex.example_id,
                prompt=prompt_text(ex, tokenizer),
                reference=ref,
                generation=gen,
                em=exact_match(gen, ref),
                f1=token_f1(gen, ref),
                rouge_l=rouge_l(gen, ref),
                generated_tokens=n,
                label_match=label_match(gen, ref),
                label=_field(ex, cfg.label_field),
                template=Path(ex.source_file).stem if by_file else _field(ex, cfg.template_field),
            )
        )
    mean_loss = loss_sum / loss_tokens if loss_tokens else math.nan
    generated = sum(counts)
    metrics = {
        "eval_loss": mean_loss,
        "perplexity": math.exp(mean_loss) if mean_loss < 700 else math.inf,
        "exact_match": sum(r.em for r in rows) / len(rows),
        "token_f1": sum(r.f1 for r in rows) / len(rows),
        "rouge_l": sum(r.rouge_l for r in rows) / len(rows),
        "label_accuracy": sum(r.label_match for r in rows) / len(rows),
        "ms_per_token": 1000 * seconds / generated if generated else math.nan,
        "tokens_per_second": generated / seconds if seconds > 0 else math.nan,
        "num_examples": float(len(rows)),
        "eval_tokens": float(loss_tokens),
        "generated_tokens": float(generated),
        # Examples longer than the context: their prompt lost its beginning (both passes).
        "prompts_truncated": float(len(truncated | loss_cut)),
        **label_metrics(rows),
    }
    return EvalResult(model_ref=str(model_ref), metrics=metrics, rows=rows)
