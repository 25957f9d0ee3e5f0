"""PII and secret redaction with Presidio, offline: prompts, outputs (streams included), logs.

The analyzer runs on a blank spaCy English pipeline (a tokenizer, no model download), so it
finds what pattern, checksum and library recognizers find -- email, phone (libphonenumber),
credit card (Luhn), IBAN (checksum), IP, US SSN, URL, dates, ... -- plus the secret patterns
below (API keys, tokens, private keys), all as SECRET_KEY. No NER: names and places are not
found. Every failure is a PiiError so that the caller can fail closed.

The one redactor of the project: the gateway runs it on prompts and answers (in its checks'
process: tuneloop/gateway/remote_pii.py), the request log on what the gateway did not
redact, the data gate on training rows it redacts.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from tuneloop.privacy.secrets import SECRETS, Secret, prescreen_pattern, secrets_for

if TYPE_CHECKING:
    from tuneloop.config import PiiConfig

log = logging.getLogger(__name__)

LANGUAGE = "en"
SECRET = "SECRET_KEY"


# The secrets are tuneloop/privacy/secrets.py's (the one list the data gate uses too),
# each recognised as SECRET_KEY.
# The pre-screen: a text that matches none of these cannot hold an entity, so Presidio
# (~2.5 ms a call) is skipped. Sound for the recognizers in _SCREENED (checked when the
# analyzer is built; anything else turns the pre-screen off), because each needs one of:
#   a digit: credit card, bank no., driver licence, ITIN, passport, SSN, NHS, crypto (bc1 or
#     a leading 1/3), medical licence (\d{7}), dates, IPv4, IBAN (two check digits), phone
#     (libphonenumber starts a number at a digit or a plus and reads any Unicode digit,
#     which \d matches as well);
#   "@": email;  "." then a word character: URL (the dot before its TLD, with or without a
#     scheme: "https://host" alone is no URL to Presidio), MAC written aaaa.bbbb.cccc;
#   "::" or hex:hex: IPv6 and MAC written with colons, when they have no digit;
#   hex-hex: UUID (8 hex, "-", 4 hex) and MAC written with hyphens;
#   a secret's prefix.
# It searches the lower-cased text (3x faster than re.IGNORECASE; ~25 us for 300 characters):
# no character but A-F lower-cases to a-f, and the prefixes keep their meaning lower-cased.
def prescreen_for(secrets: list[Secret]) -> re.Pattern:
    return re.compile(r"[\d@]|\.\w|::|[0-9a-f]:[0-9a-f]|[0-9a-f]{2}-[0-9a-f]{2}|" + prescreen_pattern(secrets))


_PRESCREEN = prescreen_for(SECRETS)

_SCREENED = {
    "CreditCardRecognizer",
    "UsBankRecognizer",
    "UsLicenseRecognizer",
    "UsItinRecognizer",
    "UsPassportRecognizer",
    "UsSsnRecognizer",
    "NhsRecognizer",
    "CryptoRecognizer",
    "DateRecognizer",
    "EmailRecognizer",
    "IbanRecognizer",
    "IpRecognizer",
    "MedicalLicenseRecognizer",
    "MacAddressRecognizer",
    "UuidRecognizer",
    "UrlRecognizer",
    "_PhoneRecognizer",
    "_SecretRecognizer",
}

# Recognizers every match of which starts inside a word that holds a pre-screen trigger (a
# digit, "@", ".x", a secret's prefix, ...): a stream may emit the words before the first
# trigger at once, since no entity can begin in them. Not DateRecognizer ("March 5, 2024"
# begins with a plain word): with DATE_TIME among the entities, streams hold back as always.
_LEADING_TRIGGER = _SCREENED - {"DateRecognizer"}

# Emitted text a stream analyses again, before pending: enough for "Bearer " when its token
# comes after the cut (short so far, or its digit not there yet), and ~5 words of context.
_CONTEXT_CHARS = 32
# Chinese, Japanese and Korean letters (and CJK punctuation) are analysed as spaces, one for
# one so offsets stay: they are \w to the patterns, so "卡号4111111111111111" had no \b before
# the number and "taro@example.jpです" no valid domain. Streams may cut after them too.
_WIDE = "\u3000-\u303f\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uff01\uff0c\uff1a\uff1b\uff1f"
_CJK = re.compile(f"[{_WIDE}]")
# Where a stream may be cut: after what the analyzer sees as a space.
_BREAK = rf"[\s{_WIDE}]"
_UP_TO_BREAK = re.compile(r".*" + _BREAK, re.DOTALL)  # up to the last break before endpos
_FIRST_BREAK = re.compile(_BREAK)


def may_contain_entity(text: str, screen: re.Pattern = _PRESCREEN) -> bool:
    """False only for a text in which no recognizer of the offline analyzer can match."""
    return screen.search(text.lower()) is not None


class PiiError(Exception):
    """The analysis failed or timed out: the caller refuses the request (fails closed)."""


@dataclass(frozen=True)
class Entity:
    entity_type: str
    start: int
    end: int
    score: float


def blank_pipeline(target: Path) -> Path:
    """A blank spaCy English pipeline saved at `target` once; concurrent starts are safe."""
    if (target / "config.cfg").is_file():
        return target
    import spacy

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        spacy.blank(LANGUAGE).to_disk(tmp)
        try:
            os.rename(tmp, target)  # atomic; fails if another process got there first
        except OSError:
            if not (target / "config.cfg").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


class PiiRedactor:
    """Finds and redacts entities; thread-safe (analyses run one at a time)."""

    def __init__(self, config: PiiConfig, cache_dir: Path, key_prefix: str = "tl-"):
        self.config = config
        self.on_cpu: Callable[[float], None] | None = None  # CPU seconds of each analysis (a metric)
        # Presidio's email recognizer imports tldextract, which would fetch the suffix list.
        os.environ.setdefault("TLDEXTRACT_PUBLIC_SUFFIX_LIST_URLS", "")
        secrets = secrets_for(key_prefix)
        self._screen = prescreen_for(secrets)
        try:
            self.analyzer, components = self._build(config, Path(cache_dir), secrets)
        except Exception as exc:
            raise PiiError(f"the PII analyzer could not be built: {type(exc).__name__}: {exc}") from exc
        self.entities = config.entities
        if self.entities is not None:
            supported = set(self.analyzer.get_supported_entities(LANGUAGE))
            unknown = sorted(set(self.entities) - supported)
            if unknown:
                raise ValueError(f"gateway.pii.entities: unknown {unknown}; the analyzer finds {sorted(supported)}")
        names = {type(r).__name__ for r in self.analyzer.registry.get_recognizers(LANGUAGE, all_fields=True)}
        unscreened = sorted(names - _SCREENED)
        # The pre-screen was derived from these recognizers' patterns only (see _PRESCREEN).
        self.prescreen = not components and not unscreened
        # Streams may emit trigger-free words before any analysis (StreamRedactor), when every
        # recognizer that can report a configured entity starts its matches at a trigger.
        reporting = {
            type(r).__name__
            for r in self.analyzer.registry.get_recognizers(LANGUAGE, all_fields=True)
            if self.entities is None or set(r.supported_entities) & set(self.entities)
        }
        self.early_emit = self.prescreen and reporting <= _LEADING_TRIGGER
        if not self.prescreen:
            log.warning(
                "PII pre-screen off (pipeline components %s, recognizers %s): every text is analysed",
                components,
                unscreened,
            )
        self._lock = threading.Lock()
        # Loads the lazy parts (tldextract, phone metadata) now, not in the first request.
        self._analyze("warm-up a@b.com +1 415-555-2671 https://example.com 10.0.0.1")

    @staticmethod
    def _build(config: PiiConfig, cache_dir: Path, secrets: list[Secret]):
        import spacy  # noqa: F401  (import errors surface here, not in presidio's loader)
        from presidio_analyzer import AnalyzerEngine, Pattern, PatternRecognizer, RecognizerResult
        from presidio_analyzer.nlp_engine import NlpEngineProvider
        from presidio_analyzer.predefined_recognizers import PhoneRecognizer

        model = config.spacy_model_dir or cache_dir / "spacy-blank-en"
        if not model.exists():
            blank_pipeline(model)
        # A path, so presidio loads it instead of downloading a model by name.
        nlp_engine = NlpEngineProvider(
            nlp_configuration={
                "nlp_engine_name": "spacy",
                "models": [{"lang_code": LANGUAGE, "model_name": str(model)}],
            }
        ).create_engine()
        analyzer = AnalyzerEngine(nlp_engine=nlp_engine, supported_languages=[LANGUAGE])
        registry = analyzer.registry
        components = list(nlp_engine.nlp[LANGUAGE].pipe_names)
        if not components:  # no NER: the spaCy recognizer could never find anything
            registry.remove_recognizer("SpacyRecognizer")

        class _PhoneRecognizer(PhoneRecognizer):
            # Presidio scores every phone match 0.4 and relies on context words to raise it,
            # which needs lemmas a blank pipeline has not got: no phone would pass 0.5.
            SCORE = 0.5

        registry.remove_recognizer("PhoneRecognizer")
        registry.add_recognizer(_PhoneRecognizer())

        class _SecretRecognizer(PatternRecognizer):
            """One of tuneloop/privacy's secrets; its value check (random-looking only) applies."""

            def __init__(self, secret: Secret):
                self.secret = secret
                super().__init__(
                    supported_entity=SECRET,
                    name=secret.name,
                    supported_language=LANGUAGE,
                    patterns=[Pattern(secret.name, secret.pattern, 1.0)],
                    global_regex_flags=re.DOTALL | re.MULTILINE,
                )

            def analyze(self, text, entities, nlp_artifacts=None, regex_flags=None):
                # The secret's own spans (its value check applied; a labelled value without its label).
                return [
                    RecognizerResult(
                        SECRET,
                        a,
                        b,
                        1.0,
                        recognition_metadata={
                            RecognizerResult.RECOGNIZER_NAME_KEY: self.name,
                            RecognizerResult.RECOGNIZER_IDENTIFIER_KEY: self.id,
                        },
                    )
                    for a, b in self.secret.spans(text)
                ]

        for secret in secrets:
            registry.add_recognizer(_SecretRecognizer(secret))
        return analyzer, components

    # ---- analysis ----------------------------------------------------------------------
    def _analyze(self, text: str) -> list[Entity]:
        # Only ever removes pre-screen triggers, so the pre-screen of `text` still holds.
        text = _CJK.sub(" ", text)
        try:
            with self._lock:
                cpu = time.thread_time()
                try:
                    results = self.analyzer.analyze(
                        text=text,
                        language=LANGUAGE,
                        entities=self.entities,
                        score_threshold=self.config.score_threshold,
                    )
                finally:
                    if self.on_cpu is not None:
                        self.on_cpu(time.thread_time() - cpu)
        except Exception as exc:
            raise PiiError(f"PII analysis failed: {type(exc).__name__}: {exc}") from exc
        return merge_entities(results)

    def needs_analysis(self, text: str) -> bool:
        """False for a text the pre-screen clears (or an empty one): no entity can be in it."""
        return bool(text) and (not self.prescreen or may_contain_entity(text, self._screen))

    def find(self, text: str) -> list[Entity]:
        """Disjoint entities, in order. Overlapping results become one span (their union, so no
        part of any of them survives) named after the longest of them (then the best scored).
        A long text is analysed in windows (CHUNK_CHARS each)."""
        if not self.needs_analysis(text):
            return []
        return _in_windows(text, self._analyze, self.config.holdback_chars)

    async def afind(self, text: str, tenant=None) -> list[Entity]:
        """find() in a worker thread, within config.timeout_s a window (the thread cannot be
        stopped: it finishes in the background, and analyses queued behind it time out too)."""
        if not self.needs_analysis(text):
            return []
        found = []
        for start, end in windows(text, overlap=self.config.holdback_chars):
            try:
                part = await asyncio.wait_for(asyncio.to_thread(self._analyze, text[start:end]), self.config.timeout_s)
            except TimeoutError:
                raise PiiError(f"PII analysis took longer than {self.config.timeout_s:g} s") from None
            found += [Entity(e.entity_type, e.start + start, e.end + start, e.score) for e in part]
        return merge_entities(found)

    def redact(self, text: str) -> tuple[str, list[str]]:
        """(text with every entity replaced by <ENTITY_TYPE>, the type of each entity found)."""
        return _replace(text, self.find(text))

    async def aredact(self, text: str, tenant=None) -> tuple[str, list[str]]:
        return _replace(text, await self.afind(text, tenant))

    def stream(self, step: int = 32, tenant=None) -> StreamRedactor:
        return StreamRedactor(self, self.config.holdback_chars, step, tenant)

    def close(self) -> None:
        """Nothing to release (no threads or files of its own); here for symmetry."""


def merge_entities(results) -> list[Entity]:
    merged: list[Entity] = []
    cluster: list = []
    for r in sorted(results, key=lambda r: (r.start, -r.end, r.entity_type)):
        if cluster and r.start >= max(c.end for c in cluster):
            merged.append(_union(cluster))
            cluster = []
        cluster.append(r)
    if cluster:
        merged.append(_union(cluster))
    return merged


def _union(cluster) -> Entity:
    best = max(cluster, key=lambda r: (r.end - r.start, r.score))
    return Entity(best.entity_type, min(r.start for r in cluster), max(r.end for r in cluster), best.score)


CHUNK_CHARS = 4_000  # a longer text is analysed in windows of about this size (one call each)


def windows(text: str, size: int = CHUNK_CHARS, overlap: int = 64) -> list[tuple[int, int]]:
    """(start, end) of windows covering text: each about `size` characters, cut after a
    whitespace where one is near, each overlapping the last by `overlap` characters (at least
    the longest entity: one cut by a window's end is whole in the next)."""
    if len(text) <= size:
        return [(0, len(text))]
    out, start = [], 0
    while True:
        end = min(start + size, len(text))
        if end < len(text):
            space = max(text.rfind(" ", end - 200, end), text.rfind("\n", end - 200, end))
            if space > start + overlap:
                end = space + 1
        out.append((start, end))
        if end >= len(text):
            return out
        start = end - overlap


def _in_windows(text: str, find, overlap: int) -> list[Entity]:
    """find(window) over the windows of text, offsets back in text's, overlaps merged."""
    found = []
    for start, end in windows(text, overlap=overlap):
        found += [Entity(e.entity_type, e.start + start, e.end + start, e.score) for e in find(text[start:end])]
    return merge_entities(found)


def _replace(text: str, entities: list[Entity]) -> tuple[str, list[str]]:
    out, pos = [], 0
    for e in entities:
        out += (text[pos : e.start], f"<{e.entity_type}>")
        pos = e.end
    out.append(text[pos:])
    return "".join(out), [e.entity_type for e in entities]


class StreamRedactor:
    """Redacts a streamed text as it comes: add(delta) -> text safe to emit now, flush() -> the
    redacted rest at the end. One consumer at a time (a stream is sequential).

    Words before the first word that holds a pre-screen trigger go out at once, unanalysed
    (PiiRedactor.early_emit: every recognizer that can report a configured entity starts its
    matches inside such a word), so prose reaches the client token by token instead of a
    hold-back behind; the last word waits, as it may go on.

    Unemitted text waits in `pending`. Once it has grown by `step` characters since the last
    look, pending (after the last few emitted words, its left context) is analysed and cut: at
    least holdback_chars before its end (room for the longest multi-word entity: a spaced IBAN
    is 42 characters), after a whitespace (a word -- a key, a JWT -- is never split, so a long
    one is held until it ends; a CJK letter counts as a whitespace) and never inside an entity.
    No word straddles a cut, and a multi-word entity that does is whole in the window (it is
    shorter than the hold-back), so no part of an entity is emitted before it is recognised.
    The cut being after a whitespace, every boundary check of a pattern (\b, lookbehinds)
    sees what it sees in the whole text.

    add() analyses in the calling thread (~2.5 ms every `step` characters, nothing when the
    pre-screen rules the window out); async code should use aadd()/aflush(), which analyse in
    a worker thread within config.timeout_s. After a PiiError every call raises it again, so
    held text can never come out unredacted.
    """

    def __init__(self, redactor: PiiRedactor, holdback: int, step: int = 32, tenant=None):
        self._redactor = redactor
        self._tenant = tenant
        self._holdback = holdback
        self._step = max(1, step)
        self.found: list[str] = []  # the type of every entity redacted so far
        # Where the redactions are, in the unredacted text's characters: how much of it has
        # gone out (redacted or not), and (start, end, replacement) of every redacted span,
        # so that what is shown beside the text (logprobs' token texts) can follow them.
        self.resolved = 0
        self.spans: list[tuple[int, int, str]] = []
        self._reset()
        self._error: PiiError | None = None

    def _reset(self) -> None:
        self._pending = ""
        self._tail = ""  # emitted text (unredacted), the left context of the next analysis
        self._next = self._holdback + self._step  # analyse once pending is this long
        self._cut = 0

    def add(self, delta: str) -> str:
        early = self._early(delta)
        window = self._due()
        return early if window is None else early + self._emit(self._run(self._redactor.find, window), final=False)

    def flush(self) -> str:
        window = self._final_window()
        return "" if window is None else self._emit(self._run(self._redactor.find, window), final=True)

    async def aadd(self, delta: str) -> str:
        early, window = self.begin(delta)
        return early if window is None else early + await self.finish(window)

    def begin(self, delta: str) -> tuple[str, str | None]:
        """aadd() in two steps, the first without awaiting: take delta in and return (the text
        that may go out now, the window due for analysis or None); with a window, finish(window)
        is the rest of the text to emit (await it before the next begin)."""
        return self._early(delta), self._due()

    async def finish(self, window: str) -> str:
        return self._emit(await self._arun(window), final=False)

    async def aflush(self) -> str:
        window = self._final_window()
        return "" if window is None else self._emit(await self._arun(window), final=True)

    # ---- internals ---------------------------------------------------------------------
    def _check(self) -> None:
        if self._error is not None:
            raise PiiError(f"the stream's PII analysis failed earlier: {self._error}")

    def _run(self, find, window: str) -> list[Entity]:
        try:
            return find(window)
        except PiiError as exc:
            self._error = exc
            raise

    async def _arun(self, window: str) -> list[Entity]:
        try:
            return await self._redactor.afind(window, self._tenant)
        except PiiError as exc:
            self._error = exc
            raise

    def _early(self, delta: str) -> str:
        """Take delta in; return the words of pending that may go out unanalysed: those before
        the first word holding a pre-screen trigger, never the last word (it may go on). Only
        where no entity can begin in a trigger-free word (PiiRedactor.early_emit)."""
        self._check()
        self._pending += delta
        if not self._redactor.early_emit or not self._pending:
            return ""
        p = self._pending
        trigger = self._redactor._screen.search(p.lower())
        m = _UP_TO_BREAK.match(p, 0, trigger.start() if trigger else len(p))
        if m is None:
            return ""
        out, self._pending = p[: m.end()], p[m.end() :]
        self.resolved += m.end()
        self._tail = _left_context(self._tail + out, _CONTEXT_CHARS)
        self._next = max(self._next - m.end(), self._holdback + self._step)  # as often as a fresh stream at most
        return out

    def _due(self) -> str | None:
        """The window to analyse now, or None while nothing may be emitted yet."""
        p = self._pending
        if len(p) < self._next:
            return None
        m = _UP_TO_BREAK.match(p, 0, max(0, len(p) - self._holdback))
        if m is None:  # one word runs past the hold-back: nothing to emit until it ends
            self._next = len(p) + max(self._step, len(p) // 4)
            return None
        self._cut = m.end()
        return self._tail + p

    def _final_window(self) -> str | None:
        self._check()
        if not self._pending:
            self._reset()
            return None
        return self._tail + self._pending

    def _emit(self, entities: list[Entity], final: bool) -> str:
        p, offset = self._pending, len(self._tail)
        # An entity that reaches from the left context into pending (a "Bearer " that went
        # out before its token could be recognised) has its pending part redacted.
        spans = [(max(e.start - offset, 0), e.end - offset, e.entity_type) for e in entities if e.end > offset]
        cut = len(p) if final else self._cut
        while not final:
            inside = [s for s, e, _ in spans if s < cut < e]
            if not inside:
                break
            m = _UP_TO_BREAK.match(p, 0, min(inside))
            cut = m.end() if m else 0
        out, pos = [], 0
        for s, e, kind in spans:
            if e > cut:
                break
            out += (p[pos:s], f"<{kind}>")
            self.spans.append((self.resolved + s, self.resolved + e, f"<{kind}>"))
            pos = e
            self.found.append(kind)
        out.append(p[pos:cut])
        self.resolved += cut
        if final:
            self._reset()
        else:
            self._tail = _left_context(self._tail + p[:cut], _CONTEXT_CHARS)
            self._pending = p[cut:]
            # Grows with pending, so a long held text costs O(n) analysis in all, not O(n^2).
            self._next = len(self._pending) + max(self._step, len(self._pending) // 4)
        return "".join(out)


def _left_context(text: str, n: int) -> str:
    if len(text) <= n:
        return text
    tail = text[-n:]
    m = _FIRST_BREAK.search(tail)  # start at a word, not inside one
    return tail[m.end() :] if m else ""
