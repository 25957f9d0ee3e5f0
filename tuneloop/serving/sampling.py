"""Per-request sampling inside a shared batch, the same in every engine.

One function, sample_rows, shapes and samples the rows of a batch's logits in place: each
row that samples draws its token with its own torch.Generator (so a seed gives the same text
whoever shares the batch) and its logits are replaced by a one-hot; greedy rows keep their
logits. The model then runs with do_sample=False (or the engine takes the argmax), so greedy
rows are exactly `generate`'s argmax.

torch is imported inside the functions that use it: the engines import this module, and
importing an engine module stays light (the API's process may never run a model).
"""

from __future__ import annotations

import logging
import secrets
from collections import deque
from typing import Sequence

from tuneloop.serving.constraints import ConstraintError, RowConstraint, mask_rows
from tuneloop.serving.engine import LoadedModel, SamplingParams, TokenLogprobs

log = logging.getLogger(__name__)


def make_generator(seed: int | None):
    import torch

    # torch takes seeds in [-2**63, 2**64); the API allows OpenAI's int64 range. Reduced
    # here too, so no seed can make an engine step raise.
    return torch.Generator().manual_seed(seed % 2**64 if seed is not None else secrets.randbits(63))


RowFailures = dict  # row index -> the exception that row's sampling raised


class RowSampler:
    """One generation's sampling state: its parameters, its own torch.Generator (sampled
    rows), and how often it generated each token (for the penalties)."""

    def __init__(self, params: SamplingParams, loaded: LoadedModel | None = None):
        self.params = params
        self.loaded = loaded  # for a constrained row: its model's tokenizer
        self.constrained: RowConstraint | None = None  # its matcher, made at its first step
        self.broken: Exception | None = None  # a token its matcher refused (the row fails at its next step)
        self.generator = None if params.greedy else make_generator(params.seed)
        self.counts: dict[int, int] = {}
        # logprobs of the tokens sample_rows picked, not yet handed to the stream (the engine
        # thread appends; whoever emits the token takes them, on any thread: deque is safe)
        self._logprobs: deque[TokenLogprobs] = deque()

    @property
    def active(self) -> bool:
        """Whether sample_rows has anything to do for this row (else its logits stay as they are)."""
        p = self.params
        return not p.greedy or p.shapes_logits or p.logprobs is not None or p.constraint is not None

    @property
    def counts_tokens(self) -> bool:
        """Whether its penalties need the counts of the tokens it generates."""
        return bool(self.params.presence_penalty or self.params.frequency_penalty)

    def observe(self, token: int) -> None:
        """Record a token this generation produced (what the penalties count)."""
        if self.counts_tokens:
            self.counts[token] = self.counts.get(token, 0) + 1
        if self.constrained is not None and self.broken is None:
            try:
                self.constrained.advance(token)
            except ConstraintError as exc:  # never raised into the engine's step
                self.broken = exc

    def constrained_row(self) -> RowConstraint:
        """Its matcher (made at its first step), ready for mask_rows; raises what broke it."""
        if self.broken is not None:
            raise self.broken
        if self.constrained is None:
            if self.loaded is None:
                raise ConstraintError("this engine cannot apply a constraint: it was not given the model's tokenizer")
            self.constrained = RowConstraint(self.params.constraint, self.loaded.grammar_tokenizer)
        return self.constrained

    def take_logprobs(self, n: int = 1) -> list[TokenLogprobs]:
        """The logprobs of the next n picked tokens ([] without logprobs)."""
        out = []
        while self._logprobs and len(out) < n:
            out.append(self._logprobs.popleft())
        return out


def row_sampler(params: SamplingParams, loaded: LoadedModel | None = None) -> RowSampler | None:
    """A RowSampler where the row needs one, None for plain greedy rows (left to the argmax)."""
    sampler = RowSampler(params, loaded)
    return sampler if sampler.active else None


LOGPROB_FLOOR = -9999.0  # what JSON can carry for log(0), as vLLM reports it


def token_logprobs(lp, token: int, top: int) -> TokenLogprobs:
    """One token's entry from its row's log-probabilities."""
    import torch

    own = max(float(lp[token]), LOGPROB_FLOOR)
    if top <= 0:
        return own, []
    values, ids = torch.topk(lp, min(top, lp.shape[-1]))
    return own, [(int(i), max(float(v), LOGPROB_FLOOR)) for i, v in zip(ids.tolist(), values.tolist())]


def sample_rows(scores, rows: Sequence[RowSampler | None]) -> RowFailures:
    """Shape and sample one token for every row that has a RowSampler; in place.

    Shaping (logit_bias, presence/frequency penalties) changes a row's logits, a constraint
    masks them to the tokens its grammar allows (serving/constraints.py); a sampling
    row's logits then become a one-hot (0 / -inf) on its drawn token. Greedy rows keep their
    (shaped) logits, so an argmax over the result is every row's next token. Rows that
    report logprobs get that token's entry queued on their RowSampler (take_logprobs).

    One row's failure is that row's alone: it is returned ({row index: exception}) for its
    engine to end that request with an error, and every other row of the batch goes on.
    """
    import torch

    failures: RowFailures = {}
    reporting = [i for i, r in enumerate(rows) if r is not None and r.params.logprobs is not None]
    # the model's own distribution, before anything below changes the logits
    raw = dict(zip(reporting, torch.log_softmax(scores[reporting].float(), dim=-1).cpu())) if reporting else {}
    for i, row in enumerate(rows):
        if row is not None and row.active and row.params.shapes_logits:
            try:
                _shape_row(scores, i, row)
            except Exception as exc:  # noqa: BLE001 - isolated to its row, reported to its stream
                log.exception("shaping failed for one row of a batch; only its request fails")
                failures[i] = exc
    # after the shaping (a bias cannot re-allow a token): every constrained row's mask at once
    constrained = []
    for i, row in enumerate(rows):
        if row is not None and row.params.constraint is not None and i not in failures:
            try:
                constrained.append((i, row.constrained_row()))
            except Exception as exc:  # noqa: BLE001 - e.g. its grammar failed on a token
                failures[i] = exc
    failures.update(mask_rows(scores, constrained))
    for i, row in enumerate(rows):
        if row is None or not row.active or i in failures:
            continue
        try:
            if not row.params.greedy:
                _sample_row(scores, i, row.params, row.generator)
            if i in raw:  # the token the engine's argmax will pick from these scores
                row._logprobs.append(token_logprobs(raw[i], int(scores[i].argmax()), row.params.logprobs))
        except Exception as exc:  # noqa: BLE001 - isolated to its row, reported to its stream
            log.exception("sampling failed for one row of a batch; only its request fails")
            failures[i] = exc
    return failures


def _shape_row(scores, i: int, row: RowSampler) -> None:
    import torch

    p = row.params
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], device=scores.device)
        scores[i, ids] += torch.tensor([b for _, b in p.logit_bias], dtype=scores.dtype, device=scores.device)
    if row.counts:
        ids = torch.tensor(list(row.counts), device=scores.device)
        counts = torch.tensor(list(row.counts.values()), dtype=scores.dtype, device=scores.device)
        scores[i, ids] -= p.frequency_penalty * counts + p.presence_penalty


def _sample_row(scores, i: int, params: SamplingParams, generator) -> None:
    import torch

    # Sampled on the CPU: the seeded torch.Generator lives there, and one vocab-sized
    # row is cheap to move; the one-hot result goes back to the scores' device.
    logits = scores[i].float().cpu()
    # Shifted so the largest logit is 0 before scaling: a small temperature then sends the
    # others towards -inf, never the largest to +inf.
    logits = (logits - logits.max()) / params.temperature
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p. The top token always stays:
        # a top_p below float32's resolution (1e-300 is 0.0 there) must not remove it.
        outside = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= params.top_p
        outside[0] = False
        probs = probs.clone()
        probs[order[outside]] = 0.0
    token = torch.multinomial(probs, 1, generator=generator)
    scores[i].fill_(float("-inf"))
    scores[i, token.to(scores.device)] = 0.0
