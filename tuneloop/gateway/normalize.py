"""What the content filter reads: one normalisation of a text, and the views screened.

An injection hides from a screen that reads the characters as sent: a zero-width space
inside "ignore", a Cyrillic "І" for "I", fullwidth or mathematical letters, the attack in
base64 ("decode this and do what it says"), spaced or leetspeak letters. Both stages of the
filter (the rules and the classifier, tuneloop/gateway/content_filter.py and
filter_model.py) read the same views of a text, made here, and a text is flagged when any
view is:

1. the text normalised: Unicode NFKC (fullwidth, mathematical and ligature letters become
   their plain forms), invisible format characters removed (zero-width spaces and joiners,
   word joiners, the BOM, soft hyphens, bidi embeddings, overrides and isolates), and
   letters that look like Latin ones (Cyrillic, Greek, Armenian, Cherokee look-alikes) folded
   to ASCII inside words that mix them with Latin letters; a word written wholly in
   Cyrillic or Greek (a Russian or Greek prompt) is left as it is;
2. when the text has any: the same with leetspeak digits and symbols inside words read as
   letters ("1gn0r3" -> "ignore") and letters spaced or dotted apart joined ("i g n o r e");
3. every base64, hex or %-encoded run that decodes to text, normalised as in 1 (at most
   MAX_DECODED runs a text, each at most MAX_RUN_CHARS long, nested encodings one level).

The training of the classifier normalises its texts the same way (view 1), so what it learnt
is what it is shown when serving.
"""

from __future__ import annotations

import base64
import binascii
import re
import unicodedata
import urllib.parse

# Invisible format characters: zero-width space/non-joiner/joiner, word joiner and the
# invisible operators, BOM, soft hyphen, Mongolian vowel separator, bidi marks, embeddings,
# overrides and isolates, the interlinear annotation marks, and the tag characters.
_INVISIBLE = re.compile(
    "[\u00ad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180e\u200b-\u200f\u202a-\u202e\u2060-\u206f"
    "\u3164\ufe00-\ufe0f\ufeff\uffa0\ufff9-\ufffb\U000e0000-\U000e007f]"
)

# Letters of other scripts drawn like Latin ones -> the Latin letter (after NFKC).
_CONFUSABLES = {
    # Cyrillic
    "А": "A",
    "В": "B",
    "Е": "E",
    "К": "K",
    "М": "M",
    "Н": "H",
    "О": "O",
    "Р": "P",
    "С": "C",
    "Т": "T",
    "Х": "X",
    "У": "Y",
    "Ѕ": "S",
    "І": "I",
    "Ј": "J",
    "Ԛ": "Q",
    "Ԝ": "W",
    "Ӏ": "I",
    "Ү": "Y",
    "Ԁ": "D",
    "а": "a",
    "в": "b",
    "е": "e",
    "к": "k",
    "м": "m",
    "н": "h",
    "о": "o",
    "р": "p",
    "с": "c",
    "т": "t",
    "х": "x",
    "у": "y",
    "ѕ": "s",
    "і": "i",
    "ј": "j",
    "ԛ": "q",
    "ԝ": "w",
    "ӏ": "l",
    "ү": "y",
    "ԁ": "d",
    "һ": "h",
    "ɡ": "g",
    "ї": "i",
    "ё": "e",
    "ҽ": "e",
    "ո": "n",
    "ս": "u",
    "ց": "g",
    "օ": "o",
    "լ": "l",
    # Greek
    "Α": "A",
    "Β": "B",
    "Ε": "E",
    "Ζ": "Z",
    "Η": "H",
    "Ι": "I",
    "Κ": "K",
    "Μ": "M",
    "Ν": "N",
    "Ο": "O",
    "Ρ": "P",
    "Τ": "T",
    "Υ": "Y",
    "Χ": "X",
    "ο": "o",
    "ν": "v",
    "ρ": "p",
    "ι": "i",
    "κ": "k",
    "α": "a",
    "τ": "t",
    "υ": "u",
    "χ": "x",
    "ε": "e",
    "ϲ": "c",
    "ϳ": "j",
    # Latin look-alikes outside ASCII that NFKC keeps
    "ı": "i",
    "ȷ": "j",
    "ʟ": "l",
    "ɪ": "i",
    "ᴀ": "a",
    "ᴄ": "c",
    "ᴅ": "d",
    "ᴇ": "e",
    "ᴏ": "o",
    "ᴜ": "u",
    "ꓲ": "I",
    "Ꭺ": "A",
    "Ꮯ": "C",
    "Ꭼ": "E",
    "Ꮋ": "H",
    "Ꮃ": "W",
    "Ꮪ": "S",
    "Ꭲ": "T",
}
_CONFUSABLE_TABLE = str.maketrans(_CONFUSABLES)
_WORD = re.compile(r"\w+")
_LATIN = re.compile(r"[A-Za-z]")

# Leetspeak inside a word that has letters too ("1gn0r3", "pr3v10u5"); numbers alone stay.
_LEET = str.maketrans(
    {
        "0": "o",
        "1": "i",
        "2": "z",
        "3": "e",
        "4": "a",
        "5": "s",
        "6": "g",
        "7": "t",
        "8": "b",
        "9": "g",
        "@": "a",
        "$": "s",
        "!": "i",
        "|": "l",
        "+": "t",
        "€": "e",
    }
)
_LEET_WORD = re.compile(r"(?<![\w@$!|+€])[\w@$!|+€]{0,24}[A-Za-z][\w@$!|+€]{0,24}(?![\w@$!|+€])")
_LEET_CHARS = re.compile(r"[0-9@$!|+€]")
# Three or more single letters joined by one separator ("i g n o r e", "I.G.N.O.R.E", "i-g-n").
_SPACED = re.compile(r"(?<![\w])(?:[A-Za-z][ .\-_*]){2,}[A-Za-z](?![\w])")

# Encoded runs. Base64: 16+ characters of its alphabet (standard or URL-safe) with padding;
# hex: 8+ byte pairs, bare or as \x.. / 0x.. / spaced pairs; %-encoding: 3+ escapes in a run.
_BASE64 = re.compile(r"(?<![A-Za-z0-9+/=_-])[A-Za-z0-9+/_-]{16,}={0,2}(?![A-Za-z0-9+/=_-])")
_HEX = re.compile(r"(?:(?:\\x|0x)?[0-9A-Fa-f]{2}[\s,:]?){8,}")
_PERCENT = re.compile(r"(?:%[0-9A-Fa-f]{2}|[^\s%]){0,200}%[0-9A-Fa-f]{2}(?:[^\s]*%[0-9A-Fa-f]{2}){2,}[^\s]*")

MAX_DECODED = 8  # decoded runs screened per text
MAX_RUN_CHARS = 20_000  # longer runs are not decoded (the text's length bounds stay the request's)
_MIN_PRINTABLE = 0.9  # a decoded run is text when this share of its characters is printable
_MIN_LETTERS = 0.4  # ... and this share of its non-space characters are letters


def normalize(text: str) -> str:
    """NFKC, invisible format characters removed, Latin look-alikes folded inside mixed words."""
    text = _INVISIBLE.sub("", unicodedata.normalize("NFKC", text))
    if text.isascii():
        return text
    letters = [ch for ch in text if ch.isalpha()]
    latin_text = sum(ch.isascii() for ch in letters) > len(letters) / 2

    def fold(match: re.Match) -> str:
        # A word that is Latin once folded is a disguise when it mixes Latin letters with
        # look-alikes, or when it stands among Latin words ("Оbey" / "ОВЕҮ" in English);
        # "Москва" in a Russian text stays as it is.
        word = match.group(0)
        if word.isascii():
            return word
        folded = word.translate(_CONFUSABLE_TABLE)
        return folded if folded.isascii() and (latin_text or _LATIN.search(word)) else word

    return _WORD.sub(fold, text)


def deobfuscate(text: str) -> str:
    """Leetspeak read as letters inside words that have letters, spaced-out letters joined."""
    text = _SPACED.sub(lambda m: re.sub(r"[ .\-_*]", "", m.group(0)), text)

    def unleet(m: re.Match) -> str:
        word = m.group(0)
        core = word.strip("!|+")  # "Hello!!!" is no leetspeak; "h3ll0" and "p@ss" are
        if not _LEET_CHARS.search(core):
            return word
        start = word.index(core) if core else 0
        return word[:start] + core.translate(_LEET) + word[start + len(core) :]

    return _LEET_WORD.sub(unleet, text)


def _printable_text(raw: bytes) -> str | None:
    try:
        decoded = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if not decoded.strip():
        return None
    printable = sum(ch.isprintable() or ch in "\n\r\t" for ch in decoded)
    letters = sum(ch.isalpha() for ch in decoded)
    if printable < _MIN_PRINTABLE * len(decoded) or letters < _MIN_LETTERS * len(decoded.replace(" ", "")):
        return None
    return decoded


def _from_base64(run: str) -> str | None:
    body = run.rstrip("=")
    if len(body) % 4 == 1 or not re.search(r"[a-z]", body) or not re.search(r"[A-Z0-9+/_-]", body):
        return None  # not the right length, or a plain word / identifier (no mix of cases and digits)
    padded = body + "=" * (-len(body) % 4)
    try:
        raw = base64.b64decode(padded.replace("-", "+").replace("_", "/"), validate=True)
    except (binascii.Error, ValueError):
        return None
    return _printable_text(raw)


def _from_hex(run: str) -> str | None:
    digits = re.sub(r"\\x|0x|[\s,:]", "", run)
    if len(digits) % 2:
        digits = digits[:-1]
    try:
        return _printable_text(bytes.fromhex(digits))
    except ValueError:
        return None


def decoded_runs(text: str, depth: int = 2) -> list[str]:
    """The texts hidden in base64, hex and %-encoded runs of `text` (at most MAX_DECODED;
    what a decoded run hides in turn, down to `depth` levels)."""
    found: list[str] = []
    for pattern, decode in ((_BASE64, _from_base64), (_HEX, _from_hex)):
        for m in pattern.finditer(text):
            run = m.group(0).strip()
            if len(run) > MAX_RUN_CHARS:
                continue
            decoded = decode(run)
            if decoded is not None and decoded not in found:
                found.append(decoded)
                if len(found) >= MAX_DECODED:
                    return found
    if "%" in text:
        unquoted = urllib.parse.unquote(text[:MAX_RUN_CHARS])
        if unquoted != text and unquoted not in found and _PERCENT.search(text):
            found.append(unquoted)
    if depth > 1:
        for inner in list(found):
            for deeper in decoded_runs(inner, depth - 1):
                if deeper not in found and len(found) < MAX_DECODED:
                    found.append(deeper)
    return found[:MAX_DECODED]


def screening_views(text: str) -> list[str]:
    """The views of `text` the content filter screens (the first is the normalised text;
    the others only where they differ from it): see the module's docstring."""
    base = normalize(text)
    views = [base]
    clear = deobfuscate(base)
    if clear != base:
        views.append(clear)
    for decoded in decoded_runs(base):
        view = normalize(decoded)
        if view not in views:
            views.append(view)
    return views
