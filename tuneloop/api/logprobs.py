"""Log-probabilities as the two routes render them (chat's `logprobs.content`, the legacy
completions object), and held back under output redaction until the text they cover is out."""

from __future__ import annotations

from tuneloop.api.server import OpenAIServer


class TokenText:
    """Token id -> its text, cached (each token's own decode, as OpenAI and vLLM show it)."""

    def __init__(self, server: OpenAIServer):
        self.tokenizer = server.loaded.tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self._cache.get(token)
        if text is None:
            text = self._cache[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return text


class HeldLogprobs:
    """One choice's logprob entries under output redaction (gateway.pii.outputs: redact).

    A token's own text would show what the redaction removes, so entries wait until the
    stream's redactor has let the text they cover out (StreamRedactor.resolved), and an entry
    whose text falls inside a redacted span is shown with the redacted text instead (the
    span's first token carries the replacement, e.g. "<PHONE_NUMBER>", the others "", and a
    token's characters outside the span stay), its own logprob kept and no alternatives. Token texts are decoded one by one and may count
    characters a little differently from the assembled text (a character split over tokens):
    a span reaches that difference further on both sides, so the error is on the redacted side.
    """

    def __init__(self, token_text: TokenText, redactor):
        self.text = token_text
        self.redactor = redactor  # the choice's StreamRedactor
        self.held: list[tuple[int, float, list, int, int]] = []  # token, logprob, top, start, end
        self.end = 0  # token-text characters so far
        self.raw = 0  # characters of the assembled (unredacted) text handed to the redactor
        self.shown: set[int] = set()  # spans whose replacement went out

    def add(self, entries) -> None:
        for token, (own, top) in entries:
            n = len(self.text(token))
            self.held.append((token, own, top, self.end, self.end + n))
            self.end += n

    def release(self, final: bool = False) -> list:
        """The entries whose text the redaction has resolved (all of them when final), as
        (token, (logprob, top), shown text or None for the token's own)."""
        margin = abs(self.end - self.raw)
        resolved = self.redactor.resolved
        out: list[tuple[int, tuple[float, list], str | None]] = []
        while self.held and (final or self.held[0][4] + margin <= resolved):
            token, own, top, start, end = self.held.pop(0)
            hits = [k for k, (s, e, _) in enumerate(self.redactor.spans) if start < e + margin and s - margin < end]
            if not hits:
                out.append((token, (own, top), None))
                continue
            # The token's text outside the spans stays; each span's replacement goes out once.
            text, shown, pos = self.text(token), [], start
            for k in hits:
                s, e, replacement = self.redactor.spans[k]
                shown.append(text[max(pos - start, 0) : max(s - margin - start, 0)])
                if k not in self.shown:
                    shown.append(replacement)
                    self.shown.add(k)
                pos = max(pos, e + margin)
            shown.append(text[min(max(pos - start, 0), len(text)) :])
            out.append((token, (own, []), "".join(shown)))
        return out


def _entries(entries):
    """(token, (logprob, top), shown text or None) from a choice's entries, redacted or not."""
    for entry in entries or []:
        yield entry if len(entry) == 3 else (*entry, None)


class ChatLogprobs:
    """Chat's `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}."""

    def __init__(self, server: OpenAIServer):
        self.text = TokenText(server)

    def _item(self, token: int, logprob: float, text: str | None = None) -> dict:
        text = self.text(token) if text is None else text
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def render(self, entries) -> dict | None:
        if entries is None:
            return None
        return {
            "content": [
                {**self._item(token, own, shown), "top_logprobs": [self._item(t, lp) for t, lp in top]}
                for token, (own, top), shown in _entries(entries)
            ],
            "refusal": None,
        }


class CompletionLogprobs:
    """The legacy completions `logprobs` object: tokens, token_logprobs, top_logprobs and
    text_offset (each token's character offset in the choice's text, echoed prompt included)."""

    def __init__(self, server: OpenAIServer, top: int | None, choices: int, echo: list[str] | None):
        self.top = top
        self.text = TokenText(server)
        self.offsets = [len(echo[i]) if echo else 0 for i in range(choices)]

    def render(self, i: int, delta: str, entries) -> dict | None:
        if self.top is None:
            return None
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, (own, top), shown in _entries(entries):
            text = self.text(token) if shown is None else shown
            out["tokens"].append(text)
            out["token_logprobs"].append(own)
            out["top_logprobs"].append({self.text(t): lp for t, lp in top})
            out["text_offset"].append(self.offsets[i])
            self.offsets[i] += len(text)
        return out
