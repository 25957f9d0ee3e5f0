"""The validation gate on real GX: clean data passes, each planted problem is named by id."""

from __future__ import annotations

import json

import pytest

from tests.support.examples import chat, legacy
from tuneloop.config import ValidationConfig
from tuneloop.data.schema import Example
from tuneloop.validation import example_text, find_pii, find_secrets, validate_dataset

FRUITS = ["apple", "pear", "plum", "fig", "kiwi", "lime", "date", "peach", "grape", "melon"]


def clean_sets(n_train: int = 40, n_eval: int = 10) -> tuple[list[Example], list[Example]]:
    """Free-text Q&A, every prompt distinct, no secrets: should pass everything."""
    train = [
        chat(
            f"train.jsonl:{i + 1}",
            f"What colour is a {FRUITS[i % 10]} number {i}?",
            f"A ripe {FRUITS[i % 10]} number {i} is usually colourful.",
        )
        for i in range(n_train)
    ]
    eval_ = [
        chat(
            f"eval.jsonl:{i + 1}",
            f"How heavy is a {FRUITS[i % 10]} sample {i}?",
            f"The {FRUITS[i % 10]} sample {i} weighs about {100 + i} grams.",
        )
        for i in range(n_eval)
    ]
    return train, eval_


def words(ex: Example) -> int:
    """A tokenizer stand-in: words of the example's flat text."""
    return len(example_text(ex).split())


def by_name(report):
    return {e.name: e for e in report.expectations}


def test_clean_set_passes_and_writes_data_docs(tmp_path):
    train, eval_ = clean_sets()
    docs = tmp_path / "docs"
    report = validate_dataset(train, eval_, ValidationConfig(), words, docs)

    assert report.success, report.summary()
    assert report.failures == []
    assert report.data_docs_path == (docs / "index.html").resolve()
    assert report.data_docs_path.is_file()
    assert list(docs.glob("validations/**/*.html")), "the validation result page was not written"
    names = set(by_name(report))
    assert {
        "completion is not empty",
        "no duplicate examples",
        "eval prompts not seen in train",
        "completion has no secrets",
        "completion has no personal data",
        "example length in tokens",
    } <= names
    # Free text: the label-balance check does not run, and the report says why.
    assert "labels are balanced" not in names
    assert "free text" in report.skipped["labels are balanced"]
    assert "PASSED" in report.summary() and "SKIP labels are balanced" in report.summary()
    json.dumps(report.to_dict())  # JSON-safe for MLflow


def test_poisoned_set_names_exactly_the_poisoned_ids(tmp_path):
    train, eval_ = clean_sets()
    poisoned_train = [
        # exact copy of train.jsonl:1 under another id
        chat("dup.jsonl:1", train[0].messages[0]["content"], train[0].completion),
        chat(
            "secret.jsonl:1",
            "How do I call the API?",
            "Use client = OpenAI(api_key='sk-proj-Q2xk9Vb7LmN3pRt5WyZa8cDe') and go.",
        ),
        # Not a reserved example.org address: those are documentation, not personal data.
        chat("email.jsonl:1", "Who do I contact?", "Write to jane.roe@fastmail.com for help."),
        chat("card.jsonl:1", "Which card was charged?", "The card 4111 1111 1111 1111 was charged."),
        chat("long.jsonl:1", "Tell me a long story.", "word " * 900),  # 4500 chars > 4000
    ]
    # An eval prompt that is also a train prompt (different answer: leakage, not a duplicate).
    leaked = chat("eval.jsonl:99", train[5].messages[0]["content"], "Something else entirely.")
    report = validate_dataset(train + poisoned_train, eval_ + [leaked], ValidationConfig(), None, tmp_path)

    assert not report.success
    got = {e.name: sorted(e.failing_example_ids) for e in report.failures}
    assert got == {
        "no duplicate examples": ["dup.jsonl:1"],
        "eval prompts not seen in train": ["eval.jsonl:99"],
        "completion has no secrets": ["secret.jsonl:1"],
        "completion has no personal data": ["card.jsonl:1", "email.jsonl:1"],
        "completion length in characters": ["long.jsonl:1"],
    }, report.summary()
    checks = by_name(report)
    # What was wrong travels with the id (and never the secret itself).
    assert checks["no duplicate examples"].failing_values == ["duplicate of train.jsonl:1"]
    assert checks["completion has no secrets"].failing_values == ["openai_api_key"]
    pii = dict(
        zip(
            checks["completion has no personal data"].failing_example_ids,
            checks["completion has no personal data"].failing_values,
        )
    )
    assert pii == {"email.jsonl:1": "email", "card.jsonl:1": "card_number"}
    assert checks["completion length in characters"].failing_values == [4500]
    assert checks["eval prompts not seen in train"].checked_count == len(eval_) + 1
    # No tokenizer: the token check is skipped, and said so.
    assert "example length in tokens" not in checks
    assert "no tokenizer" in report.skipped["example length in tokens"]
    summary = report.summary()
    assert "FAIL completion has no secrets" in summary and "secret.jsonl:1: openai_api_key" in summary
    assert "sk-proj-Q2xk" not in summary and "sk-proj-Q2xk" not in json.dumps(report.to_dict())
    pages = list(tmp_path.glob("validations/**/*.html"))
    assert pages and not any("sk-proj-Q2xk" in p.read_text() for p in pages)


def test_thresholds_tolerate_a_fraction(tmp_path):
    train, eval_ = clean_sets(n_train=40, n_eval=10)
    train.append(chat("dup.jsonl:1", train[0].messages[0]["content"], train[0].completion))
    eval_[0] = chat("eval.jsonl:1", train[3].messages[0]["content"], "other")
    cfg = ValidationConfig(max_duplicate_fraction=0.05, max_leakage_fraction=0.1)
    report = validate_dataset(train, eval_, cfg, None, tmp_path)
    assert report.success, report.summary()
    checks = by_name(report)
    # Tolerated, but still counted and named.
    assert checks["no duplicate examples"].failing_example_ids == ["dup.jsonl:1"]
    assert checks["eval prompts not seen in train"].failing_example_ids == ["eval.jsonl:1"]


def test_blank_prompt_and_completion_are_reported_once(tmp_path):
    train, eval_ = clean_sets()
    train += [legacy("blank.jsonl:1", "   ", "an answer"), legacy("blank.jsonl:2", "a question", "  \n")]
    report = validate_dataset(train, eval_, ValidationConfig(), None, tmp_path)
    got = {e.name: e.failing_example_ids for e in report.failures}
    assert got == {"prompt is not empty": ["blank.jsonl:1"], "completion is not empty": ["blank.jsonl:2"]}


def test_token_bounds_with_whitespace_tokenizer(tmp_path):
    train, eval_ = clean_sets()
    train.append(legacy("short.jsonl:1", "Hi", "yo"))  # "Hi\nyo" -> 2 tokens
    train.append(legacy("wordy.jsonl:1", "Count: " + "one two three " * 10, "done"))  # 32 tokens
    cfg = ValidationConfig(min_tokens=3, max_tokens=20)
    report = validate_dataset(train, eval_, cfg, words, tmp_path)
    tokens = by_name(report)["example length in tokens"]
    assert not tokens.success
    assert dict(zip(tokens.failing_example_ids, tokens.failing_values)) == {"short.jsonl:1": 2, "wordy.jsonl:1": 32}
    assert "example length in tokens" not in report.skipped


def test_label_imbalance_names_the_rare_label_rows(tmp_path):
    # 30 Positive, 28 Negative, 2 Mixed: Mixed holds 3.3% < 5%.
    completions = ["Positive"] * 30 + ["Negative"] * 28 + ["Mixed"] * 2
    train = [legacy(f"reviews.jsonl:{i + 1}", f"Review {i}: is it good?", c) for i, c in enumerate(completions)]
    eval_ = [
        legacy(f"eval.jsonl:{i + 1}", f"Held-out review {i}: is it good?", c)
        for i, c in enumerate(["Positive", "Negative", "Mixed"])
    ]
    report = validate_dataset(train, eval_, ValidationConfig(), None, tmp_path)
    labels = by_name(report)["labels are balanced"]
    assert not labels.success and not report.success
    assert labels.failing_example_ids == ["reviews.jsonl:59", "reviews.jsonl:60"]  # train rows only
    assert labels.failing_values == ["Mixed", "Mixed"]
    assert labels.checked_count == 60
    assert "Mixed 3.3%" in labels.threshold

    balanced = validate_dataset(train[:58], eval_[:2], ValidationConfig(), None, tmp_path)
    assert by_name(balanced)["labels are balanced"].success, balanced.summary()


def test_real_sentiment_data_passes_with_label_check(tmp_path, shared_data):
    """T0 Amazon polarity prompts: real reviews, Positive/Negative labels, no PII expected."""
    rows = []
    for path in sorted((shared_data / "t0-amazon-polarity").glob("*.jsonl"))[:2]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            d = json.loads(line)
            rows.append(legacy(f"{path.name}:{n}", d["prompt"], d["completion"].replace("<|endoftext|>", "")))
    train, eval_ = rows[:-40], rows[-40:]
    cfg = ValidationConfig(max_tokens=2048, max_duplicate_fraction=0.05)
    report = validate_dataset(train, eval_, cfg, words, tmp_path)
    checks = by_name(report)
    assert checks["labels are balanced"].success
    assert checks["completion has no secrets"].success and checks["completion has no personal data"].success
    assert report.seconds < 30


def test_empty_train_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="training split is empty"):
        validate_dataset([], [], ValidationConfig(), None, tmp_path)


@pytest.mark.parametrize(
    "text, kinds",
    [
        ("key sk-proj-abcDEF1234567890ghijKLMN", ["openai_api_key"]),
        ("AKIAIOSFODNN7EXAMPLE", ["aws_access_key_id"]),
        ("ghp_a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8", ["github_token"]),
        ("xoxb-123456789012-abcdefghij", ["slack_token"]),
        ("-----BEGIN RSA PRIVATE KEY-----", ["private_key"]),
        ("api_key = 'f3a9c1d27b8e4a6f9c0d1e2f3a4b5c6d'", ["labelled_secret"]),
        ("token: your_api_key_here_please", []),  # placeholder, not random
        ("I am so sk-eptical about this task-specific skill", []),
    ],
)
def test_find_secrets(text, kinds):
    assert find_secrets(text) == kinds


@pytest.mark.parametrize(
    "text, kinds",
    [
        ("mail john.doe@gmail.com", ["email"]),
        # Reserved for documentation (RFC 2606 / 6761) and the fictional 555-01xx numbers: not PII.
        ("mail john.doe@example.com, ops@mail.example.org, x@example.net", []),
        ("mail a@shop.test, b@host.example, c@nowhere.invalid, d@box.localhost", []),
        ("mail john.doe@example.com or john@examples.com", ["email"]),  # one real address is enough
        ("mail root@notexample.com", ["email"]),  # a suffix, not the reserved domain
        ("call +1 (212) 555-0142, +1-800-555-0199, +1.415.555.0100 or +15555550123", []),
        ("call +1 212 555 0200", ["phone"]),  # just past the fictional range
        ("call +1 212 555 0099", ["phone"]),
        ("call +44 20 5550 0150", ["phone"]),  # the range is North American only
        ("card 4111-1111-1111-1111", ["card_number"]),
        ("card 4111 1111 1111 1112", []),  # fails Luhn
        ("order 1234567890123456", []),  # no card issuer prefix
        ("call +44 20 7946 0958", ["phone"]),
        ("IBAN DE89 3704 0044 0532 0130 00 AND more", ["iban"]),
        ("IBAN DE89 3704 0044 0532 0130 01", []),  # bad checksum
        ("on 2023-01-15 at 10:30 the price was 1299.99", []),
    ],
)
def test_find_pii(text, kinds):
    assert find_pii(text) == kinds
