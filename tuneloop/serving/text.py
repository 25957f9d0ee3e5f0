"""Token ids -> text deltas, with stop strings: what every engine's generations go through
before a client sees them."""

from __future__ import annotations


class TextAssembler:
    """Turns one generation's token ids into text deltas; detects stop strings.

    Decodes incrementally with prefix/read offsets into `ids` (byte-level BPE splits
    characters across tokens): each call decodes only the tokens not yet settled into
    text plus one step of context, and searches for stop strings only where a new hit
    could start, so the work per call is bounded by the new tokens. Text that could
    still become a stop string, or is an incomplete character (a trailing U+FFFD), is
    held back, so nothing at or after a stop string is ever sent.
    """

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self._longest = max((len(s) for s in self.stop), default=0)
        self.ids: list[int] = []
        self.sent = 0  # characters already handed out
        self.stopped = False  # a stop string was found
        self._prefix = 0  # ids[_prefix:_read]: context decoded with the unsettled tokens
        self._read = 0  # ids[:_read] are settled into text
        self._prefix_text = ""  # decode(ids[_prefix:_read])
        self._done = 0  # length of the settled text, decode(ids[:_read])
        self._win_start = 0  # the settled text kept, from this character on ...
        self._win = ""  # ... (older text is sent and can no longer be part of a stop string)
        self._checked = 0  # settled text already searched for stop strings

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _settle(self) -> str:
        """Settles the new tokens' text if it ends on a whole character; returns what stays unsettled."""
        if self._read == len(self.ids):
            return ""
        new_text = self._decode(self.ids[self._prefix :])
        if len(new_text) <= len(self._prefix_text):
            return ""
        pending = new_text[len(self._prefix_text) :]
        if pending.endswith("\ufffd"):
            return pending
        self._win += pending
        self._done += len(pending)
        self._prefix, self._read = self._read, len(self.ids)
        self._prefix_text = self._decode(self.ids[self._prefix : self._read])
        return ""

    def add(self, token_ids: list[int]) -> str:
        if self.stopped:
            return ""
        self.ids.extend(token_ids)
        return self._step(final=False)

    def flush(self) -> str:
        """The rest of the text once the generation has ended."""
        return "" if self.stopped else self._step(final=True)

    def _step(self, final: bool) -> str:
        pending = self._settle()
        base, text = self._win_start, self._win + pending  # text: the whole text from `base` on
        # a hit starting earlier would lie wholly in text already searched
        start = max(self._checked - self._longest + 1 - base, 0)
        self._checked = self._done
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            return self._take(text, min(hits))
        if final:
            return self._take(text, len(text))
        safe, sent = len(text.rstrip("\ufffd")), self.sent - base
        for s in self.stop:
            if safe <= sent:
                break
            for k in range(min(len(s) - 1, safe), 0, -1):
                if text.endswith(s[:k], 0, safe):
                    safe -= k
                    break
        return self._take(text, safe)

    def _take(self, text: str, upto: int) -> str:
        """Hands out text[sent:upto] (positions relative to the kept window), then trims the window."""
        base = self._win_start
        delta = ""
        if upto + base > self.sent:
            delta, self.sent = text[self.sent - base : upto], upto + base
        keep_from = max(min(self.sent, self._done) - self._longest, 0)
        if keep_from > base:
            self._win, self._win_start = self._win[keep_from - base :], keep_from
        return delta
