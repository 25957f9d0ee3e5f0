"""The preference win rate: on held-out preference pairs (prompt, chosen, rejected), how often
a model finds the chosen answer more likely than the rejected one.

What preference tuning (training.objective dpo) is meant to move, reported beside exact match:
evaluate_model scores the chosen answer as the reference; this scores the pair. Each answer is
scored as the log-probability the model gives its tokens after the prompt, both rendered
exactly as training renders them (tuneloop.formatting.encode_preference: the chat template,
the answer's end-of-turn marker included), teacher-forced, no generation.

The log-probabilities are **summed** over the answer's tokens: that is the probability of the
whole answer, which is what the model's sampling follows and what DPO's implicit reward is
built on (beta * the summed log-ratio against the reference), so a win here is the model
preferring the answer as DPO trained it to. A per-token mean would judge answers of different
lengths by another rule than the one trained (it forgives a long answer its length); it is
reported beside, as preference_win_rate_per_token, for pairs whose answers differ much in
length. A win is strict (chosen > rejected): a tie, as a model that cannot tell the answers
apart gives, is no win.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tuneloop.data.schema import Example
from tuneloop.evaluation import load_for_eval
from tuneloop.formatting import context_window, encode_preference


def _answer_logprobs(model, sequences: list[tuple[list[int], int]], pad_id: int) -> list[tuple[float, int]]:
    """(summed log-probability, tokens) of each sequence's answer: the tokens from `start` on.
    Right-padded, so positions are those of an unpadded sequence."""
    import torch

    device = next(model.parameters()).device
    width = max(len(ids) for ids, _ in sequences)
    ids = torch.tensor([s + [pad_id] * (width - len(s)) for s, _ in sequences], device=device)
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s, _ in sequences], device=device)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
    logprobs = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    out = []
    for row, (seq, start) in enumerate(sequences):
        # token t is predicted at position t-1: the answer's tokens start..len-1
        picked = logprobs[row, start - 1 : len(seq) - 1]
        out.append((float(picked.sum()), len(seq) - start))
    return out


def score_pairs(
    model, tokenizer, pairs: list[Example], batch_size: int = 16, max_length: int | None = None
) -> dict[str, Any]:
    """preference_win_rate's metrics for a loaded model (see preference_win_rate), plus
    `margins`: each pair's summed log-probability of chosen minus rejected, in order."""
    if not pairs:
        raise ValueError("the preference win rate needs at least one pair; none given")
    not_pairs = [ex.example_id for ex in pairs if not ex.is_preference]
    if not_pairs:
        raise ValueError(f"not preference pairs (no rejected answer): {', '.join(not_pairs[:5])}")
    max_length = max_length or context_window(model.config) or 2048
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    sequences: list[tuple[list[int], int]] = []
    truncated = 0
    for ex in pairs:
        enc = encode_preference(ex, tokenizer)
        cut = False
        for answer in (enc["chosen_ids"], enc["rejected_ids"]):
            seq = enc["prompt_ids"] + answer
            start = len(enc["prompt_ids"])
            if len(seq) > max_length:  # keep the END: the answer is what is scored
                start = max(1, start - (len(seq) - max_length))
                seq = seq[-max_length:]
                cut = True
            sequences.append((seq, max(start, 1)))
        truncated += cut
    scores: list[tuple[float, int]] = []
    for i in range(0, len(sequences), 2 * batch_size):
        scores += _answer_logprobs(model, sequences[i : i + 2 * batch_size], pad)
    margins, per_token = [], []
    for (chosen, n_c), (rejected, n_r) in zip(scores[0::2], scores[1::2]):
        margins.append(chosen - rejected)
        per_token.append(chosen / max(n_c, 1) - rejected / max(n_r, 1))
    n = len(margins)
    return {
        "preference_win_rate": sum(m > 0 for m in margins) / n,
        "preference_margin": sum(margins) / n,
        "preference_win_rate_per_token": sum(m > 0 for m in per_token) / n,
        "preference_pairs": float(n),
        "preference_pairs_truncated": float(truncated),
        "margins": margins,
    }


def preference_win_rate(
    model_ref: str | Path, pairs: list[Example], batch_size: int = 16, max_length: int | None = None
) -> dict[str, float]:
    """The model at model_ref (a model folder, merged or a LoRA adapter's, or a hub id) on
    preference pairs (Examples with `rejected`: a prepared dpo dataset's eval split):

      preference_win_rate            share of pairs whose chosen answer has the higher summed
                                     log-probability given the prompt (strictly)
      preference_margin              mean of log p(chosen) - log p(rejected), summed, in nats
      preference_win_rate_per_token  the same win rate with per-token mean log-probabilities
      preference_pairs               pairs scored
      preference_pairs_truncated     pairs longer than max_length (default: the model's
                                     context), cut from the left so the answers stay whole

    ValueError for no pairs, or an example that is not a pair."""
    model, tokenizer = load_for_eval(model_ref)
    metrics = score_pairs(model, tokenizer, pairs, batch_size, max_length)
    metrics.pop("margins")
    return metrics
