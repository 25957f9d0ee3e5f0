"""What prepare_dataset does with rows real data always has: too long, or holding personal data.

A real training set of thousands of rows can have hundreds longer than the model takes and
a handful with an email address or a pasted API key. The gate used to fail the whole set
for one of them; these policies let the prepared dataset drop, truncate or redact them
instead, so that the training flow trains on the kept rows and the dataset's fingerprint is
theirs. Every row a policy touched is written to the prepared dataset's rejects.jsonl
(file:line or "record N", what was done, why), and the gate fails only when more than a
configured fraction of the rows was touched (tuneloop/validation.py).

  validation.overlong: drop | truncate | fail   rows over the token limit (TokenBudget)
  validation.pii:      drop | redact | fail     completions with personal data or secrets
                                                (a preference row's rejected answer too)

`fail` does nothing here: the rows stay, and the gate fails on any of them. Personal data is
what the gate's find_pii / find_secrets find in the completion, the text the model learns to
write; redaction goes through the project's Presidio redactor (tuneloop/privacy/redactor.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from typing import Any, Callable

from tuneloop.config import TuneloopConfig, ValidationConfig
from tuneloop.data.schema import Example, Reject, message_text
from tuneloop.privacy.personal import find_pii, is_fictional_phone, is_reserved_email
from tuneloop.privacy.redactor import PiiRedactor
from tuneloop.privacy.secrets import find_secrets

OVERLONG = "overlong"
PII = "pii"

# What `redact` replaces, in the gateway's entity names: the kinds the gate finds. Not the
# gateway's whole list: URLs, IPs or dates in a training answer are content, not someone's data.
REDACTED_ENTITIES = ["EMAIL_ADDRESS", "PHONE_NUMBER", "CREDIT_CARD", "IBAN_CODE", "SECRET_KEY"]

_SPACE = re.compile(r"\s+")


@dataclass(frozen=True)
class TokenBudget:
    """How long an example may be: its tokens as training encodes it, and the limit."""

    count: Callable[[Example], int]
    limit: int
    source: str = ""  # where the limit comes from, in the user's words


def _touched(ex: Example, policy: str, action: str, reason: str, raw: str) -> Reject:
    return Reject(source_file=ex.source_file, source_line=ex.source_line, reason=reason, raw=raw,
                  source_record=ex.source_record, example_id=ex.example_id, action=action, policy=policy)


def _as_raw(ex: Example) -> str:
    return json.dumps(ex.to_dict(), ensure_ascii=False)


# ---------------------------------------------------------------------- length

def _cut_left(text: str, fits: Callable[[str], bool]) -> str | None:
    """The longest end of `text` that fits, starting at a word; None when only blank text fits.

    Assumes fits("") and not fits(text). Token counts of a text's ends shrink as the cut moves
    right (not strictly: a cut can split a token in two), so a binary search finds the cut and
    a short walk over the following word starts makes up for the exceptions.
    """
    lo, hi = 0, len(text)  # text[lo:] does not fit, text[hi:] does
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(text[mid:]):
            hi = mid
        else:
            lo = mid
    start = hi
    if 0 < start < len(text) and not text[start - 1].isspace():  # in the middle of a word
        m = _SPACE.search(text, start)
        if m and text[m.end():].strip():
            start = m.end()
    candidates = [start] + [m.end() for m in _SPACE.finditer(text, start)]
    for s in candidates:
        rest = text[s:].lstrip()
        if not rest:
            return None
        if fits(rest):
            return rest
    return None


def _truncate_legacy(ex: Example, budget: TokenBudget) -> Example | None:
    def fits(prompt: str) -> bool:
        return budget.count(replace(ex, prompt=prompt)) <= budget.limit

    if not fits(""):
        return None
    cut = _cut_left(ex.prompt or "", fits)
    return None if cut is None else replace(ex, prompt=cut)


def _truncate_chat(ex: Example, budget: TokenBudget) -> Example | None:
    """The earliest user/assistant turns go first, whole; then the earliest one left is cut
    from the left. System messages and the answered turn's end stay."""
    final = ex.messages[-1]
    prompt = [dict(m) for m in ex.messages[:-1]]

    def fits(p: list[dict[str, str]]) -> bool:
        return budget.count(replace(ex, messages=p + [final])) <= budget.limit

    def earliest(p: list[dict[str, str]]) -> int | None:
        return next((i for i, m in enumerate(p) if m["role"] != "system"), None)

    def turns(p: list[dict[str, str]]) -> int:
        return sum(m["role"] != "system" for m in p)

    def trimmed(p: list[dict[str, str]], i: int) -> list[dict[str, str]] | None:
        def with_content(content: str) -> list[dict[str, str]]:
            return p[:i] + [{**p[i], "content": content}] + p[i + 1:]

        if not isinstance(p[i].get("content"), str) or p[i].get("tool_calls"):
            return None  # a turn that calls tools goes whole or not at all
        if not fits(with_content("")):
            return None
        cut = _cut_left(p[i]["content"], lambda c: fits(with_content(c)))
        return None if cut is None else with_content(cut)

    while True:
        i = earliest(prompt)
        if i is None:  # only system messages before the answer: nothing may be cut
            return None
        if turns(prompt) == 1:  # the turn the completion answers: keep its end
            cut = trimmed(prompt, i)
            return None if cut is None else replace(ex, messages=cut + [final])
        without = prompt[:i] + prompt[i + 1:]
        j = earliest(without)
        # The conversation still opens with the user: an assistant turn left first goes too,
        # and so do the tool results that answered its calls.
        while without[j]["role"] in ("assistant", "tool") and turns(without) > 1:
            without = without[:j] + without[j + 1:]
            j = earliest(without)
        if fits(without):  # message i need not go whole: keep as much of its end as fits
            cut = trimmed(prompt, i)
            return replace(ex, messages=(cut if cut is not None else without) + [final])
        prompt = without


def truncate_to_fit(ex: Example, budget: TokenBudget) -> Example | None:
    """`ex` with its prompt cut from the left to fit budget.limit, or None when no prompt fits
    beside the completion (which is never cut)."""
    if budget.count(ex) <= budget.limit:
        return ex
    return _truncate_legacy(ex, budget) if ex.messages is None else _truncate_chat(ex, budget)


def _completion_alone(ex: Example, budget: TokenBudget) -> int:
    """Tokens of the example with no prompt left but its system messages: what truncate cannot cut."""
    if ex.messages is None:
        return budget.count(replace(ex, prompt=""))
    kept = [m for m in ex.messages[:-1] if m["role"] == "system"]
    return budget.count(replace(ex, messages=kept + [ex.messages[-1]]))


def apply_length_policy(examples: list[Example], policy: str,
                        budget: TokenBudget) -> tuple[list[Example], list[Reject]]:
    """(the rows kept, possibly truncated; a Reject for every over-long row, dropped or truncated)."""
    if policy == "fail":
        return examples, []
    kept: list[Example] = []
    touched: list[Reject] = []
    for ex in examples:
        n = budget.count(ex)
        if n <= budget.limit:
            kept.append(ex)
            continue
        reason = f"over-long: {n} tokens > {budget.limit}"
        if policy == "truncate":
            cut = truncate_to_fit(ex, budget)
            if cut is not None:
                kept.append(cut)
                touched.append(_touched(ex, OVERLONG, "truncated",
                                        f"{reason}; prompt cut from the left to {budget.count(cut)}", _as_raw(ex)))
                continue
            alone = _completion_alone(ex, budget)
            reason += (f"; the completion alone is {alone} (never cut)" if alone > budget.limit
                       else f"; the completion ({alone}) leaves no room for the prompt")
        touched.append(_touched(ex, OVERLONG, "dropped", reason, _as_raw(ex)))
    return kept, touched


# ---------------------------------------------------------------------- personal data, secrets

def completion_findings(text: str, cfg: ValidationConfig) -> list[str]:
    """What the gate would flag in a completion: secret kinds, then personal data kinds."""
    return (find_secrets(text) if cfg.check_secrets else []) + (find_pii(text) if cfg.check_pii else [])


def _redact_values(value: Any, redact: Callable[[str], str]) -> Any:
    """A JSON value with each string in it redacted (object keys are names, not data)."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, list):
        return [_redact_values(v, redact) for v in value]
    if isinstance(value, dict):
        return {k: _redact_values(v, redact) for k, v in value.items()}
    return value


def _redacted_calls(calls: list[dict[str, Any]], redact: Callable[[str], str]) -> list[dict[str, Any]]:
    """Tool calls with each argument value redacted (the arguments stay a JSON object)."""
    out = []
    for call in calls:
        args = json.loads(call["function"]["arguments"])
        redacted = _redact_values(args, redact)
        text = call["function"]["arguments"] if redacted == args else json.dumps(redacted, ensure_ascii=False)
        out.append({**call, "function": {**call["function"], "arguments": text}})
    return out


def _redacted_message(message: dict[str, Any], redact: Callable[[str], str]) -> dict[str, Any]:
    """An assistant message with its text and each tool call's argument values redacted."""
    out = dict(message)
    if isinstance(out.get("content"), str):
        out["content"] = redact(out["content"])
    if out.get("tool_calls"):
        out["tool_calls"] = _redacted_calls(out["tool_calls"], redact)
    return out


def _redacted_completion(ex: Example, redact: Callable[[str], str]) -> Example:
    if ex.messages is None:
        return replace(ex, completion=redact(ex.completion))
    last = dict(ex.messages[-1])
    if not last.get("tool_calls"):
        completion = redact(ex.completion)
        last["content"] = completion
        return replace(ex, completion=completion, messages=ex.messages[:-1] + [last])
    last = _redacted_message(last, redact)
    return replace(ex, completion=message_text(last), messages=ex.messages[:-1] + [last])


def _redacted(ex: Example, redact: Callable[[str], str]) -> Example:
    """ex with its completion redacted; a final turn that calls tools has its text and each
    call's argument values redacted (the arguments stay a JSON object), and its completion
    is the calls' text again. A preference row's rejected answer is redacted the same way."""
    out = _redacted_completion(ex, redact)
    if ex.rejected is not None:
        out = replace(out, rejected=_redacted_message(ex.rejected, redact))
    return out


def _findings(ex: Example, cfg: ValidationConfig) -> list[str]:
    """What the gate flags in the text the model learns from: the completion, and a
    preference row's rejected answer too (the model reads it in training)."""
    kinds = completion_findings(ex.completion, cfg)
    if ex.rejected is not None:
        kinds += [k for k in completion_findings(ex.rejected_text, cfg) if k not in kinds]
    return kinds


def apply_pii_policy(examples: list[Example], cfg: ValidationConfig,
                     make_redactor: Callable[[], Callable[[str], str]]) -> tuple[list[Example], list[Reject]]:
    """(the rows kept, possibly redacted; a Reject for every row whose completion held any).

    make_redactor is called once, on the first row to redact (building Presidio takes seconds).
    A redacted completion is checked again: what the redactor missed (a labelled secret, a
    number format it does not know) drops the row, so a secret is never kept as it was.
    The Reject names the kinds found, never the value, and keeps no copy of the row.
    """
    if cfg.pii == "fail" or not (cfg.check_pii or cfg.check_secrets):
        return examples, []
    redact: Callable[[str], str] | None = None
    kept: list[Example] = []
    touched: list[Reject] = []
    for ex in examples:
        kinds = _findings(ex, cfg)
        if not kinds:
            kept.append(ex)
            continue
        reason = f"completion holds {', '.join(kinds)}"
        if cfg.pii == "redact":
            redact = redact or make_redactor()
            redacted = _redacted(ex, redact)
            left = _findings(redacted, cfg)
            if not left:
                kept.append(redacted)
                touched.append(_touched(ex, PII, "redacted", reason, ""))
                continue
            reason += f"; still there after redaction: {', '.join(left)}"
        touched.append(_touched(ex, PII, "dropped", reason, ""))
    return kept, touched


def presidio_redactor(cfg: TuneloopConfig) -> Callable[[str], str]:
    """text -> text with REDACTED_ENTITIES replaced by <ENTITY_TYPE>: the gateway's redactor, its
    settings (threshold, blank spaCy pipeline) and cache folder, the gate's reserved values kept."""
    settings = cfg.gateway.pii.model_copy(update={"entities": REDACTED_ENTITIES})
    if settings.spacy_model_dir is not None:
        settings = settings.model_copy(update={"spacy_model_dir": cfg.resolve(settings.spacy_model_dir)})
    redactor = PiiRedactor(settings, cfg.home / "gateway", key_prefix=cfg.gateway.key_prefix)
    reserved = {"EMAIL_ADDRESS": is_reserved_email, "PHONE_NUMBER": is_fictional_phone}

    def redact(text: str) -> str:
        out, pos = [], 0
        for e in redactor.find(text):
            if e.entity_type in reserved and reserved[e.entity_type](text[e.start:e.end]):
                continue  # user@example.com is documentation, as the gate sees it
            out += (text[pos:e.start], f"<{e.entity_type}>")
            pos = e.end
        out.append(text[pos:])
        return "".join(out)

    return redact
