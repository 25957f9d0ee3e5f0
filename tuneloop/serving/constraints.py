"""Constrained decoding: structured outputs, inside every engine's batched steps.

A request's Constraint (a JSON schema, any JSON object, a regex, a list of choices or a Lark
grammar) is compiled by llguidance into a grammar; each generation that has one holds its own
matcher (on its RowSampler), and every step sample_rows masks that row's logits to the tokens
the grammar allows next, where it applies logit_bias; the token the row then takes advances
its matcher. The model's stop tokens are allowed exactly where the grammar may end, so a
constrained answer that stops is always complete; one cut by max_tokens ends "length".

Why llguidance (measured here on SmolLM2's 49,152-token vocabulary, docs/benchmarks.md):
against xgrammar 0.2.8 it compiles a nested schema in 2.5 ms (xgrammar 5.5), computes a row's
mask in 12 us median (xgrammar 2 us: both are nothing beside a ~5 ms decode step), names
what it cannot honour (`Unimplemented keys: ["not"]`, `Unknown format: ...`) where xgrammar
compiles `not` and unknown formats silently and then does not enforce them, and is one wheel
with no dependencies (xgrammar brings triton and tvm-ffi).

torch (and llguidance.hf, which imports transformers) are imported inside the functions that
need them: an engine module stays light to import (llguidance itself: 0.05 s).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]

# JSON the grammar writes: one space after , and : (as json.dumps writes it by default), no
# other whitespace outside strings: a small model left free loops on whitespace.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "coerce_one_of": True}


class ConstraintError(ValueError):
    """A constraint that cannot be compiled; the message names what is wrong."""


@dataclass(frozen=True)
class Constraint:
    """What a generation's text must match. spec: the schema's JSON text (json_schema), ""
    (json_object), the regex, the choices as a JSON list (choice) or the grammar (grammar)."""

    kind: Kind
    spec: str = ""

    def grammar(self) -> str:
        """This constraint as an llguidance grammar (not yet checked)."""
        if self.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(self.spec, defaults=JSON_OPTIONS)
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.spec)
        if self.kind == "choice":
            choices = json.loads(self.spec)
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
        if "::=" in self.spec:  # GBNF (llama.cpp's grammar format), as vLLM accepts it too
            return llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(self.spec))
        return llguidance.LLMatcher.grammar_from_lark(self.spec)


def json_schema(schema: dict[str, Any]) -> Constraint:
    return Constraint("json_schema", json.dumps(schema, sort_keys=False))


@lru_cache(maxsize=512)
def _compiled(constraint: Constraint) -> str:
    """The grammar text of a constraint that compiles (ConstraintError otherwise). Cached:
    the same schema sent again is not converted again."""
    try:
        grammar = constraint.grammar()
    except (ValueError, TypeError) as exc:
        raise ConstraintError(str(exc)) from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise ConstraintError(_short(error))
    return grammar


def _short(error: str) -> str:
    """llguidance's message without its trailing dumps of state and grammar."""
    for cut in ("\n<state>", "\n<grammar>"):
        error = error.split(cut)[0]
    return error.strip()


def check(constraint: Constraint, tokenizer: "GrammarTokenizer | None" = None) -> None:
    """ConstraintError (naming the construct) unless the constraint compiles, and, with the
    model's tokenizer, allows at least a first token: a grammar that rejects everything is
    refused here, not found out by a generation."""
    grammar = _compiled(constraint)
    if tokenizer is None:
        return
    mask = tokenizer.empty_mask()
    try:
        tokenizer.fill(tokenizer.matcher(grammar), mask)
    except ConstraintError as exc:
        raise ConstraintError(f"no answer can start under it ({exc})") from None
    if not bool(mask.any()):
        raise ConstraintError("it allows no text at all (not even an empty answer)")


class GrammarTokenizer:
    """The model's tokenizer as llguidance reads it (built once per model: ~0.4 s on SmolLM2),
    its vocabulary the model's output rows, its stop tokens the engine's."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids):
        import llguidance.hf  # deferred: it imports transformers

        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=sorted(stop_ids))
        self.words = (vocab_size + 31) // 32
        self._limits = llguidance.LLParserLimits()

    def matcher(self, grammar: str):
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self._limits)
        if matcher.is_error():
            raise ConstraintError(_short(matcher.get_error()))
        return matcher

    def empty_mask(self):
        import torch

        return torch.zeros(self.words, dtype=torch.int32)

    def fill(self, matcher, mask) -> None:
        matcher.unsafe_compute_mask_ptr(mask.data_ptr(), self.words * 4)
        if matcher.is_error():
            raise ConstraintError(_short(matcher.get_error()))


@lru_cache(maxsize=1)
def _bits():
    """The 32 bit masks of an int32 word, as int64 (bit 31 stays positive)."""
    import torch

    return torch.tensor([1 << j for j in range(32)], dtype=torch.int64)


def allowed_tokens(mask, vocab_size: int):
    """Bitmasks (int32 words, bit j of word w = token 32w + j; one mask or a batch of them)
    as bool tensors over the vocabulary."""
    import torch

    flat = (mask.to(torch.int64).unsqueeze(-1) & _bits()) != 0
    return flat.view(*mask.shape[:-1], -1)[..., :vocab_size]


def mask_rows(scores, rows: list[tuple[int, "RowConstraint"]]) -> dict[int, Exception]:
    """Mask every constrained row of a batch's logits to the tokens its grammar allows next,
    in place: each row's bitmask computed by its matcher, then one unpacking and one fill for
    all of them (a row at a time cost a small model a third of its speed). Returns the rows
    that failed ({row index: exception}); the others are masked."""
    import torch

    if not rows:
        return {}
    tokenizer = rows[0][1].tokenizer
    masks = torch.zeros(len(rows), tokenizer.words, dtype=torch.int32)
    failures: dict[int, Exception] = {}
    good: list[int] = []
    for k, (i, row) in enumerate(rows):
        try:
            row.tokenizer.fill(row.matcher, masks[k])
            good.append(k)
        except Exception as exc:  # noqa: BLE001 - the row's alone
            failures[i] = exc
    if not good:
        return failures
    vocab = tokenizer.vocab_size
    allowed = allowed_tokens(masks[good], vocab)
    for k, ok in zip(good, allowed.any(dim=1).tolist()):
        if not ok:
            failures[rows[k][0]] = ConstraintError("the grammar allows no next token here")
    index = torch.tensor([rows[k][0] for k in good], device=scores.device)
    width = min(scores.shape[-1], vocab)
    block = scores[index]
    block[:, :width].masked_fill_(~allowed[:, :width].to(scores.device), float("-inf"))
    if scores.shape[-1] > vocab:  # output rows past the tokenizer's vocabulary
        block[:, vocab:] = float("-inf")
    scores[index] = block
    return failures


class RowConstraint:
    """One generation's matcher: the tokens it took (advance); mask_rows asks it for the next."""

    def __init__(self, constraint: Constraint, tokenizer: GrammarTokenizer):
        self.tokenizer = tokenizer
        self.matcher = tokenizer.matcher(_compiled(constraint))

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise ConstraintError(_short(self.matcher.get_error()) or f"token {token} breaks the grammar")
