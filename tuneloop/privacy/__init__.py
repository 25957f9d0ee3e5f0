"""What counts as a secret or as personal data: one owner, used by everyone who asks.

- secrets.py: credentials (API keys and tokens by their formats, AWS secret access keys,
  private keys, bearer tokens, values labelled password / secret / api_key / ...), as
  patterns. The data gate (tuneloop/validation.py, tuneloop/data/policies.py) finds them
  with find_secrets(); the Presidio redactor (redactor.py: the gateway, the request log and the data gate run it) recognises
  them from the same list, so prompts, answers and the request log (which the gateway's
  analyzer redacts) agree with the gate.
- personal.py: personal data the gate looks for in training answers (email, card number,
  phone, IBAN) and the documentation values that are nobody's (example.com, 555-01xx).

tests/unit/test_privacy.py plants every kind in texts for all three users.
"""

from tuneloop.privacy.personal import find_pii, pii_spans  # noqa: E402
from tuneloop.privacy.secrets import find_secrets, secret_spans  # noqa: E402


def redact(text: str) -> str:
    """`text` with every secret and every piece of personal data replaced by <KIND>, for texts
    shown to people outside the gateway (run reports, predictions). Overlapping finds merge."""
    spans = sorted(secret_spans(text) + pii_spans(text), key=lambda s: (s[1], -s[2]))
    out, at = [], 0
    for kind, a, b in spans:
        if a < at:  # inside one already replaced
            continue
        out += [text[at:a], f"<{kind.upper()}>"]
        at = b
    return "".join(out) + text[at:]


__all__ = ["find_pii", "find_secrets", "pii_spans", "redact", "secret_spans"]
