"""Credentials, by their formats: the one list (see tuneloop/privacy/__init__.py).

Each Secret is a regular expression (matched case-sensitively unless it says otherwise),
the prefix a pre-screen can look for (lower-cased text; None: the pattern needs a screen
of its own, AWS_SECRET_SCREEN), and an optional check of the matched value (random-looking
values only, so prose and placeholders pass). Patterns aim at few false alarms: a gate that
cries wolf gets switched off.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import Callable

_TOKEN_START = r"(?<![A-Za-z0-9_\-])"  # not inside a longer word or token


def entropy(s: str) -> float:
    """Shannon entropy in bits per character."""
    n = len(s)
    return -sum(c / n * math.log2(c / n) for c in Counter(s).values()) if n else 0.0


def looks_random(value: str) -> bool:
    """Random keys mix letters and digits and use many distinct characters; words,
    placeholders ("your_api_key_here") and repeated characters do not."""
    return any(c.isdigit() for c in value) and any(c.isalpha() for c in value) and entropy(value) >= 3.5


def _aws_secret(value: str) -> bool:
    # 40 characters of base64's alphabet, upper and lower case, a digit or "/" or "+", and
    # near-random (AWS's documented example key has 4.8 bits per character; a 40-letter word
    # run has far fewer distinct characters).
    return (
        any(c.isupper() for c in value)
        and any(c.islower() for c in value)
        and any(c.isdigit() or c in "/+" for c in value)
        and entropy(value) >= 4.0
    )


# What a config or tutorial writes where the secret goes: words joined by _ or -, <...>, x's.
_PLACEHOLDER = re.compile(
    r"(?i)^(?:[a-z]+[_\-.])+[a-z]+$|^<.*>$|^\{.*\}$|^\$\{?\w+\}?$|^[x*.#]+$|"
    r"^(?:changeme|redacted|password|secret|none|null|true|false)$"
)


def _labelled(value: str) -> bool:
    """A labelled value is a secret unless it is a placeholder: random-looking, or a password's
    mix (8+ characters with a digit or a symbol: "hunter2X9!")."""
    if _PLACEHOLDER.match(value):
        return False
    return looks_random(value) or (len(value) >= 8 and any(not c.isalpha() for c in value))


@dataclass(frozen=True)
class Secret:
    name: str
    pattern: str  # the match, or its group "value" where it has one, is the secret
    prefix: str | None  # what a pre-screen of the lower-cased text looks for (a regex); None: AWS_SECRET_SCREEN
    check: Callable[[str], bool] | None = None  # on the value (group "value" when the pattern has one)

    @property
    def regex(self) -> re.Pattern:
        return _compiled(self.pattern)

    def spans(self, text: str) -> list[tuple[int, int]]:
        """(start, end) of each secret in text: the value only where the pattern names one
        (a label stays readable: "password: <SECRET_KEY>")."""
        out = []
        named = "value" in self.regex.groupindex
        for m in self.regex.finditer(text):
            value = m.group("value") if named else m.group(0)
            if self.check is None or self.check(value):
                out.append(m.span("value") if named else m.span())
        return out


_CACHE: dict[str, re.Pattern] = {}


def _compiled(pattern: str) -> re.Pattern:
    if pattern not in _CACHE:
        _CACHE[pattern] = re.compile(pattern, re.DOTALL | re.MULTILINE)
    return _CACHE[pattern]


LABELS = (
    r"aws_secret_access_key|secret_access_key|secret[_-]?key|client[_-]?secret|api[_-]?key|access[_-]?key|"
    r"access[_-]?token|auth[_-]?token|refresh[_-]?token|private[_-]?key|password|passwd|passwort|pwd|"
    r"secret|token"
)

SECRETS: list[Secret] = [
    Secret("openai_api_key", _TOKEN_START + r"sk-(?:proj-|svcacct-|admin-|ant-)?[A-Za-z0-9_\-]{20,}", "sk-"),
    Secret("stripe_key", _TOKEN_START + r"[sr]k_(?:live|test)_[A-Za-z0-9]{16,}", r"[sr]k_"),
    Secret("tuneloop_key", _TOKEN_START + r"tl-[A-Za-z0-9_\-]{32,}", "tl-"),  # tl-<id>_<token_urlsafe(32)>
    Secret("aws_access_key_id", _TOKEN_START + r"(?:AKIA|ASIA)[0-9A-Z]{16}(?![A-Za-z0-9])", "a[ks]ia"),
    # An AWS secret access key alone (40 characters of base64's alphabet, near-random).
    Secret(
        "aws_secret_access_key", r"(?<![A-Za-z0-9/+=])(?P<value>[A-Za-z0-9/+]{40})(?![A-Za-z0-9/+=])", None, _aws_secret
    ),
    Secret(
        "github_token",
        _TOKEN_START + r"(?:gh[pousr]_[A-Za-z0-9]{36,}|github_pat_[A-Za-z0-9_]{22,})",
        r"gh[pousr]_|github_pat_",
    ),
    Secret("slack_token", _TOKEN_START + r"xox[abprse]-[A-Za-z0-9\-]{10,}", "xox[abprse]-"),
    Secret("google_api_key", _TOKEN_START + r"AIza[0-9A-Za-z_\-]{35}", "aiza"),
    Secret("jwt", _TOKEN_START + r"eyJ[A-Za-z0-9_\-]+\.eyJ[A-Za-z0-9_\-]+\.[A-Za-z0-9_\-]*", "eyj"),
    # A digit in the token keeps "bearer responsibilities" out.
    Secret(
        "bearer_token", r"\b(?i:bearer)\s{1,8}(?P<value>(?=[A-Za-z._~+/\-]*[0-9])[A-Za-z0-9._~+/\-]{16,}=*)", "bearer"
    ),
    # The whole block, or to the end of the text while its END line has not come: a stream
    # holds the key back until it is complete, and a cut-off key is still redacted.
    Secret(
        "private_key",
        r"-----BEGIN[A-Z0-9 ]* PRIVATE KEY[A-Z0-9 ]*-----.*?"
        r"(?:-----END[A-Z0-9 ]* PRIVATE KEY[A-Z0-9 ]*-----|\Z)",
        "-----begin",
    ),
    # A value next to a label that says what it is: password = hunter2X9!, "api_key": "...".
    Secret(
        "labelled_secret",
        r"(?i:\b(?:" + LABELS + r")[\w-]*)[\"']?(?:\s*[:=]\s*|\s+(?i:is|was)\s+)"
        r"(?i:bearer\s+)?[\"']?(?P<value>[^\s\"',;]{8,})",
        r"(?:" + LABELS + r")[\w-]*[\"']?(?:\s*[:=]|\s+(?:is|was)\s)",
        _labelled,
    ),
]

# The pre-screen for the patterns without a fixed prefix (lower-cased text): 40 characters of
# base64's alphabet in a row.
AWS_SECRET_SCREEN = r"[a-z0-9/+]{40}"


def custom_key(prefix: str) -> Secret:
    """This deployment's own API keys when their prefix is not tl- (gateway.key_prefix)."""
    return Secret(
        "tuneloop_key_custom", _TOKEN_START + re.escape(prefix) + r"[A-Za-z0-9_\-]{32,}", re.escape(prefix.lower())
    )


def secrets_for(key_prefix: str = "tl-") -> list[Secret]:
    return list(SECRETS) if key_prefix == "tl-" else [*SECRETS, custom_key(key_prefix)]


def prescreen_pattern(secrets: list[Secret]) -> str:
    """One regex over the lower-cased text that matches wherever any of `secrets` may."""
    return "|".join((s.prefix if s.prefix is not None else AWS_SECRET_SCREEN) for s in secrets)


def secret_spans(text: str, secrets: list[Secret] | None = None) -> list[tuple[str, int, int]]:
    """(kind, start, end) of every credential in text."""
    return [(s.name, a, b) for s in (secrets or SECRETS) for a, b in s.spans(text)]


def find_secrets(text: str) -> list[str]:
    """Kinds of credentials found in `text` (e.g. ["openai_api_key"]), sorted; [] if none. A value
    a specific pattern names is not reported again as a labelled one."""
    spans = secret_spans(text)
    specific = [(a, b) for kind, a, b in spans if kind != "labelled_secret"]
    found = {
        kind
        for kind, a, b in spans
        if kind != "labelled_secret" or not any(a <= x and y <= b or x <= a < y for x, y in specific)
    }
    return sorted(found)
