"""One owner of what counts as a secret (tuneloop/privacy): every kind, planted in a text,
is found by the data gate, redacted by the gateway's analyzer (prompts, answers) and never
written by the request log. Before, an AWS secret access key passed the gateway and the log in
clear, and the gate and the gateway kept two lists that disagreed (the gate had no JWT or bearer
tokens)."""

from __future__ import annotations

import pytest

from tuneloop.config import PiiConfig
from tuneloop.privacy.secrets import SECRETS, find_secrets

# kind -> (the secret's value, a text that carries it). Values are made up; the AWS pair is
# AWS's own documentation example.
PLANTED = {
    "openai_api_key": ("sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z", "use sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z here"),
    "stripe_key": ("sk_live_4eC39HqLyjWDarjtT1zdp7dc", "stripe sk_live_4eC39HqLyjWDarjtT1zdp7dc now"),
    "tuneloop_key": ("tl-0123456789ab_" + "Zx9" * 12, "my key tl-0123456789ab_" + "Zx9" * 12 + " works"),
    "aws_access_key_id": ("AKIAIOSFODNN7EXAMPLE", "the id AKIAIOSFODNN7EXAMPLE is set"),
    "aws_secret_access_key": (
        "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
        "and the secret wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY too",
    ),
    "github_token": ("ghp_a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8", "token ghp_a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8"),
    "slack_token": ("xoxb-123456789012-abcdefghij", "slack xoxb-123456789012-abcdefghij bot"),
    "google_api_key": ("AIzaSyA1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q", "maps AIzaSyA1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q key"),
    "jwt": (
        "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
        "auth eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U ok",
    ),
    "bearer_token": ("a8f3kD92mZq7Lp0xRt5vWb1n", "Authorization: Bearer a8f3kD92mZq7Lp0xRt5vWb1n"),
    "private_key": (
        "MIIEowIBAAKCAQEAx4Z9",
        "-----BEGIN RSA PRIVATE KEY-----\nMIIEowIBAAKCAQEAx4Z9\n-----END RSA PRIVATE KEY-----",
    ),
    "labelled_secret": ("hunter2X9!zz", "db password: hunter2X9!zz please"),
}
LABELLED = {  # the same value next to each kind of label a config or a message uses
    "aws_secret_access_key = ": "q8Zr3LmN0pX7vB2kT9wC4yH6jD1sF5gA8eR2uI0o",
    "password=": "Tr0ub4dor&3x",
    '"client_secret": "': "c9f1e8d7b6a5c4d3e2f1a0b9c8d7e6f5",
    "my password is ": "hunter2X9!zz",
}


def test_the_corpus_covers_every_kind():
    assert set(PLANTED) == {s.name for s in SECRETS}


@pytest.mark.parametrize("kind", sorted(PLANTED))
def test_the_gate_finds_each_kind(kind):
    assert kind in find_secrets(PLANTED[kind][1])


@pytest.mark.parametrize("label", sorted(LABELLED))
def test_a_value_next_to_a_label_is_a_secret_and_a_placeholder_is_not(label):
    assert find_secrets(label + LABELLED[label]) == ["labelled_secret"] or find_secrets(label + LABELLED[label]) == [
        "aws_secret_access_key"
    ]
    assert find_secrets(label + "your_secret_here") == []


@pytest.fixture(scope="module")
def redactor(tmp_path_factory):
    from tuneloop.privacy.redactor import PiiRedactor

    return PiiRedactor(PiiConfig(), tmp_path_factory.mktemp("pii"))


def test_the_gateway_redacts_each_kind_and_labels_stay_readable(redactor):
    for kind, (value, text) in PLANTED.items():
        redacted, found = redactor.redact(text)
        assert value not in redacted and "SECRET_KEY" in found, (kind, redacted)
    for label, value in LABELLED.items():
        redacted, _ = redactor.redact(label + value)
        assert value not in redacted and redacted.startswith(label[:6]) and "<SECRET_KEY>" in redacted, redacted
    assert redactor.redact("password: your_password_here")[1] == []


def test_a_stream_never_shows_a_secret_in_parts(redactor):
    """The AWS secret key (no prefix of its own) streamed a few characters at a time."""
    value, text = PLANTED["aws_secret_access_key"]
    stream, seen = redactor.stream(8), ""
    for i in range(0, len(text), 3):
        seen += stream.add(text[i : i + 3])
        assert value[:12] not in seen
    seen += stream.flush()
    assert value not in seen and "<SECRET_KEY>" in seen


def test_the_request_log_never_writes_one(tmp_path, redactor):
    from tuneloop.requestlog.store import SegmentSink, read_records
    from tuneloop.requestlog.writer import InProcessRedactor, RequestLog

    sink = SegmentSink(tmp_path / "requests", 1 << 20, 3600)
    log = RequestLog(sink, flush_interval_s=60, redactor=lambda: InProcessRedactor(redactor))
    texts = [text for _, text in PLANTED.values()] + [k + v for k, v in LABELLED.items()]
    for i, text in enumerate(texts):
        log.submit(
            {
                "kind": "request",
                "request_id": f"req_{i}",
                "time": "2026-12-06T00:00:00.000Z",
                "prompt": [{"role": "user", "content": text}],
                "completions": [text],
            }
        )
    log.close()
    written = read_records(None, tmp_path, "requests")
    assert len(written) == len(texts)
    dump = repr(written)
    for kind, (value, _) in PLANTED.items():
        assert value not in dump, kind
    for value in LABELLED.values():
        assert value not in dump
