"""Personal data in text, as the data gate looks for it in training answers (email, card
number, phone, IBAN), and the documentation values that are nobody's data. Part of
tuneloop/privacy (one owner of what counts as a secret or personal data)."""

from __future__ import annotations

import re

_EMAIL = re.compile(r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}\b")
# 13-19 digits, optionally grouped by spaces or dashes; Luhn and issuer prefix checked after.
_CARD = re.compile(r"(?<![\d-])\d(?:[ -]?\d){12,18}(?![\d-])")
# International numbers only (leading +): national formats collide with ids, dates, amounts.
_PHONE = re.compile(r"(?<![\w+])\+\d{1,3}(?:[ .-]?\(?\d{1,4}\)?){2,5}(?![\w])")
_IBAN = re.compile(r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]{1,4}){3,9}\b")


def _luhn_ok(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch)
        if i % 2 == 1:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def _is_card_number(candidate: str) -> bool:
    digits = re.sub(r"\D", "", candidate)
    # Issuer prefixes (Visa 4, Mastercard 2/5, Amex 34/37, Discover/UnionPay 6, JCB/Diners 3):
    # together with Luhn this stops most order numbers and timestamps from matching.
    return 13 <= len(digits) <= 19 and digits[0] in "23456" and _luhn_ok(digits)


def _iban_ok(candidate: str) -> bool:
    # ISO 13616: move the first 4 characters to the end, letters -> 10..35, mod 97 == 1.
    s = candidate[4:] + candidate[:4]
    return 15 <= len(candidate) <= 34 and int("".join(str(int(c, 36)) for c in s)) % 97 == 1


# Reserved for documentation, nobody's data: the example domains of RFC 2606 and 6761 (and
# their subdomains), their special-use top-level names, and the North American numbers
# 555-0100..555-0199 (set aside for fiction). Tutorials and synthetic sets are full of them.
_RESERVED_DOMAINS = ("example.com", "example.net", "example.org")
_RESERVED_TLDS = ("example", "test", "invalid", "localhost")


def is_reserved_email(address: str) -> bool:
    domain = address.rsplit("@", 1)[-1].lower().rstrip(".")
    return domain.rsplit(".", 1)[-1] in _RESERVED_TLDS or any(
        domain == d or domain.endswith("." + d) for d in _RESERVED_DOMAINS
    )


def is_fictional_phone(number: str) -> bool:
    """555-0100..555-0199, alone or with an area code, with or without +1, in any punctuation."""
    digits = re.sub(r"\D", "", number)
    if len(digits) in (8, 11) and digits[0] == "1":  # +1, the North American country code
        digits = digits[1:]
    if len(digits) == 10:
        digits = digits[3:]
    return len(digits) == 7 and digits[:3] == "555" and 100 <= int(digits[3:]) <= 199


def find_pii(text: str) -> list[str]:
    """Kinds of personal data found in `text` (email, card_number, phone, iban), sorted.

    Documentation values (user@example.com, *.test, +1 212 555 0142) are not personal data."""
    return sorted({kind for kind, _, _ in pii_spans(text)})


def pii_spans(text: str) -> list[tuple[str, int, int]]:
    """(kind, start, end) of the personal data find_pii reports (documentation values left out)."""
    spans = [("email", m.start(), m.end()) for m in _EMAIL.finditer(text) if not is_reserved_email(m.group(0))]
    spans += [("card_number", m.start(), m.end()) for m in _CARD.finditer(text) if _is_card_number(m.group(0))]
    spans += [
        ("phone", m.start(), m.end())
        for m in _PHONE.finditer(text)
        if 8 <= len(re.sub(r"\D", "", m.group(0))) <= 15 and not is_fictional_phone(m.group(0))
    ]
    for m in _IBAN.finditer(text):
        # The pattern may run into following words ("... 3000 AND"): try shorter prefixes.
        groups = m.group(0).split(" ")
        for k in range(len(groups), 0, -1):
            if _iban_ok("".join(groups[:k])):
                spans.append(("iban", m.start(), m.start() + len(" ".join(groups[:k]))))
                break
    return spans
