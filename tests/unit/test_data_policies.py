"""Row policies on real-looking data: over-long rows and personal data are dropped, truncated
or redacted by prepare_dataset, named by location in rejects.jsonl, and the gate fails only
above the configured fraction."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tuneloop.config import TuneloopConfig, ValidationConfig
from tuneloop.data.dataset import load_prepared, prepare_dataset
from tuneloop.data.policies import TokenBudget, apply_length_policy, apply_pii_policy, truncate_to_fit
from tuneloop.data.schema import Example
from tuneloop.validation import example_text, token_budget, token_limit, validate_prepared


def words(ex: Example) -> int:
    """A tokenizer stand-in: words of the example's flat text."""
    return len(example_text(ex).split())


def budget(limit: int) -> TokenBudget:
    return TokenBudget(count=words, limit=limit, source="test")


def make_cfg(tmp_path: Path, validation: dict | None = None, **sections) -> TuneloopConfig:
    return TuneloopConfig.model_validate(
        {"paths": {"home": str(tmp_path / "home")}, "validation": validation or {}, **sections}
    )


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def news_rows(n: int, long_every: int | None = None, long_at: set[int] | None = None) -> list[dict]:
    """Headline classification: short rows, and some with a whole article pasted in (> 40 words)."""
    rows = []
    for i in range(n):
        body = f"Headline {i}: markets move on day {i}."
        if (long_at and i in long_at) or (long_every and i % long_every == 0):
            body += " " + " ".join(f"word{i}_{k}" for k in range(60))
        rows.append({"prompt": f"{body}\nTopic of story {i}?", "completion": f"business {i}"})
    return rows


def chat_row(answer: str, question: str = "Who do I contact?") -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def by_name(report):
    return {e.name: e for e in report.expectations}


# ---------------------------------------------------------------------- length: drop


def test_overlong_rows_are_dropped_named_and_the_fingerprint_is_the_kept_rows(tmp_path):
    rows = news_rows(50, long_at={3, 17, 40})
    f = write_jsonl(tmp_path / "news.jsonl", rows)
    ds = prepare_dataset(make_cfg(tmp_path), train_path=f, budget=budget(40))

    kept = ds.train + ds.eval
    assert len(kept) == 47 and ds.changed == []
    assert [(r.source_line, r.action, r.policy) for r in ds.rejects] == [
        (4, "dropped", "overlong"),
        (18, "dropped", "overlong"),
        (41, "dropped", "overlong"),
    ]
    assert [r.example_id for r in ds.rejects] == ["news.jsonl:4", "news.jsonl:18", "news.jsonl:41"]
    assert ds.rejects[0].reason == "over-long: 73 tokens > 40"
    assert str(ds.rejects[0]) == f"{f}:4: over-long: 73 tokens > 40"
    assert not {"news.jsonl:4", "news.jsonl:18", "news.jsonl:41"} & {e.example_id for e in kept}
    # Written to rejects.jsonl with the row as normalised, and read back as rejects.
    written = [json.loads(line) for line in ds.rejects_path.read_text().splitlines()]
    assert [(w["source_line"], w["policy"], w["example_id"]) for w in written] == [
        (4, "overlong", "news.jsonl:4"),
        (18, "overlong", "news.jsonl:18"),
        (41, "overlong", "news.jsonl:41"),
    ]
    assert json.loads(written[0]["raw"])["prompt"] == rows[3]["prompt"]
    m = ds.manifest
    assert m["policies"]["overlong"] == {
        "policy": "drop",
        "max_fraction": 0.1,
        "max_tokens": 40,
        "max_tokens_from": "test",
        "dropped": 3,
    }
    assert m["rejects_by_reason"] == {"over-long: N tokens > N (validation.overlong: dropped)": 3}
    assert "rejected 3 x over-long" in ds.summary()
    again = load_prepared(ds.dir)
    assert again.rejects == ds.rejects and again.changed == []
    # The dataset is the kept rows: the same rows without the long ones are the same dataset.
    short = write_jsonl(tmp_path / "short.jsonl", [r for i, r in enumerate(rows) if i not in {3, 17, 40}])
    assert prepare_dataset(make_cfg(tmp_path), train_path=short).fingerprint == ds.fingerprint
    assert prepare_dataset(make_cfg(tmp_path), train_path=f).fingerprint != ds.fingerprint


def test_the_policies_cover_the_eval_file_too(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", news_rows(20))
    ev = write_jsonl(tmp_path / "eval.jsonl", news_rows(5, long_at={2}))
    ds = prepare_dataset(make_cfg(tmp_path), train_path=train, eval_path=ev, budget=budget(40))
    assert len(ds.eval) == 4 and [r.example_id for r in ds.rejects] == ["eval.jsonl:3"]


def test_without_a_budget_the_length_policy_is_not_applied_and_says_so(tmp_path):
    f = write_jsonl(tmp_path / "news.jsonl", news_rows(20, long_at={1}))
    ds = prepare_dataset(make_cfg(tmp_path), train_path=f)
    assert len(ds.train) + len(ds.eval) == 20 and ds.rejects == []
    assert ds.manifest["policies"]["overlong"]["applied"] is False
    assert "validation.overlong: drop, not applied: no tokenizer given" in ds.summary()


# ---------------------------------------------------------------------- length: the gate


def test_news_set_with_8_percent_overlong_passes_with_them_dropped_and_reported(tmp_path):
    """The real case: 8% of a news set over the limit used to fail the gate outright."""
    f = write_jsonl(tmp_path / "news.jsonl", news_rows(100, long_at=set(range(0, 100, 13))))  # 8 rows
    cfg = make_cfg(tmp_path)
    ds = prepare_dataset(cfg, train_path=f, budget=budget(40))
    assert len(ds.rejects) == 8
    report = validate_prepared(cfg, ds, budget=budget(40))
    assert report.success, report.summary()
    checks = by_name(report)
    overlong = checks["few over-long rows"]
    assert overlong.unexpected_count == 8 and overlong.checked_count == 100  # of every row read
    assert sorted(overlong.failing_example_ids) == sorted(r.example_id for r in ds.rejects)
    assert overlong.failing_values[0] == "dropped: over-long: 73 tokens > 40"
    assert "PASS few over-long rows" in report.summary() and "(8 tolerated)" in report.summary()
    # The dropped rows are not in the other checks: those look at what is trained on.
    assert checks["example length in tokens"].success and checks["example length in tokens"].threshold == "2..40 tokens"
    assert checks["completion is not empty"].checked_count == 92


def test_too_many_overlong_rows_fail_the_gate_and_fail_policy_fails_on_any(tmp_path):
    f = write_jsonl(tmp_path / "news.jsonl", news_rows(100, long_every=8))  # 13 rows: 13% > 10%
    cfg = make_cfg(tmp_path)
    report = validate_prepared(cfg, prepare_dataset(cfg, train_path=f, budget=budget(40)), budget=budget(40))
    assert not report.success
    assert [e.name for e in report.failures] == ["few over-long rows"]
    assert by_name(report)["few over-long rows"].unexpected_count == 13
    # Exactly the fraction is still fine: the gate fails on more than max_overlong_fraction.
    f = write_jsonl(tmp_path / "ten.jsonl", news_rows(100, long_every=10))
    assert validate_prepared(cfg, prepare_dataset(cfg, train_path=f, budget=budget(40)), budget=budget(40)).success

    # overlong: fail keeps the rows, and one over the limit is enough to fail.
    strict = make_cfg(tmp_path, {"overlong": "fail"})
    one = write_jsonl(tmp_path / "one.jsonl", news_rows(100, long_at={5}))
    ds = prepare_dataset(strict, train_path=one, budget=budget(40))
    assert ds.rejects == [] and len(ds.train) + len(ds.eval) == 100
    report = validate_prepared(strict, ds, budget=budget(40))
    assert [e.name for e in report.failures] == ["example length in tokens"]
    assert by_name(report)["example length in tokens"].failing_example_ids == ["one.jsonl:6"]
    assert "few over-long rows" in report.skipped


# ---------------------------------------------------------------------- length: truncate


def legacy(prompt: str, completion: str, example_id: str = "t.jsonl:1") -> Example:
    return Example(
        example_id=example_id,
        prompt=prompt,
        completion=completion,
        source_file="t.jsonl",
        source_line=1,
        source_format="legacy",
    )


def chat(*turns: tuple[str, str], example_id: str = "c.jsonl:1") -> Example:
    messages = [{"role": r, "content": c} for r, c in turns]
    return Example(
        example_id=example_id,
        completion=messages[-1]["content"],
        messages=messages,
        source_file="c.jsonl",
        source_line=1,
        source_format="chat",
    )


def test_truncate_keeps_the_end_of_the_prompt_and_never_cuts_the_completion():
    context = " ".join(f"old{k}" for k in range(30))
    ex = legacy(f"{context} So, which topic is this story?", "business news")
    answer = " ".join(f"a{k}" for k in range(13))
    too_long = legacy("Tell me: w w w", answer, example_id="t.jsonl:2")  # the completion alone is 13
    no_room = legacy("Tell me: w w w", " ".join(answer.split()[:12]), example_id="t.jsonl:3")  # exactly 12
    kept, touched = apply_length_policy([ex, too_long, no_room], "truncate", budget(12))
    assert len(kept) == 1
    cut = kept[0]
    assert cut.completion == "business news" and words(cut) <= 12
    assert cut.prompt.endswith("So, which topic is this story?") and ex.prompt.endswith(cut.prompt)
    assert cut.prompt.split()[0].startswith("old")  # starts at a word, not inside one
    assert words(legacy("old0 " + cut.prompt, cut.completion)) > 12  # as much as fits was kept
    assert [(r.action, r.example_id) for r in touched] == [
        ("truncated", "t.jsonl:1"),
        ("dropped", "t.jsonl:2"),
        ("dropped", "t.jsonl:3"),
    ]
    assert touched[0].reason == "over-long: 38 tokens > 12; prompt cut from the left to 12"
    assert json.loads(touched[0].raw)["prompt"] == ex.prompt  # the original is kept in the rejects file
    assert touched[1].reason == "over-long: 18 tokens > 12; the completion alone is 13 (never cut)"
    assert touched[2].reason == "over-long: 17 tokens > 12; the completion (12) leaves no room for the prompt"
    # drop instead: all go, nothing is cut.
    kept, touched = apply_length_policy([ex, too_long, no_room], "drop", budget(12))
    assert kept == [] and [r.action for r in touched] == ["dropped"] * 3
    assert touched[0].reason == "over-long: 38 tokens > 12"
    # fail: the policy leaves every row as it is (the gate fails on them).
    assert apply_length_policy([ex, too_long], "fail", budget(12)) == ([ex, too_long], [])


def test_truncate_a_chat_drops_the_earliest_turns_keeps_system_and_the_last_question():
    ex = chat(
        ("system", "You are terse."),
        ("user", "First question with " + "filler " * 20),
        ("assistant", "First answer " + "more " * 10),
        ("user", "Second question, the one to answer now?"),
        ("assistant", "Yes."),
    )
    cut = truncate_to_fit(ex, budget(20))
    assert cut is not None and words(cut) <= 20
    assert cut.messages[0] == {"role": "system", "content": "You are terse."}
    assert cut.messages[-1] == {"role": "assistant", "content": "Yes."} and cut.completion == "Yes."
    # The earliest user turn went with the answer to it (the conversation still opens with the
    # user), the question answered stayed whole.
    assert cut.messages == [ex.messages[0], ex.messages[3], ex.messages[4]]

    # Room for part of the earliest turn: its end is kept, the rest whole.
    roomy = truncate_to_fit(ex, budget(40))
    assert words(roomy) <= 40 and len(roomy.messages) == len(ex.messages)
    assert ex.messages[1]["content"].endswith(roomy.messages[1]["content"])
    assert roomy.messages[2:] == ex.messages[2:]

    # Only the question itself is left to cut: its end stays.
    one = chat(
        ("system", "Be brief."),
        ("user", "Background " * 30 + "so what is the capital of France?"),
        ("assistant", "Paris."),
    )
    short = truncate_to_fit(one, budget(12))
    assert [m["role"] for m in short.messages] == ["system", "user", "assistant"]
    assert short.messages[1]["content"].endswith("so what is the capital of France?") and words(short) <= 12

    # A system prompt and completion that alone are over: nothing may be cut, the row goes.
    assert truncate_to_fit(chat(("system", "rule " * 20), ("user", "q"), ("assistant", "a")), budget(12)) is None


def test_truncated_rows_train_with_their_whole_answer_in_a_real_tokenizer(tmp_path):
    """Measured as training encodes them (chat template included): after truncation the
    encoded row fits max_length and every completion token is still learnt."""
    from tuneloop.bootstrap import build_tokenizer
    from tuneloop.formatting import IGNORE_INDEX, count_tokens, encode_example

    docs = ["The quick brown fox jumps over the lazy dog. " * 20, "What is the capital of France? Paris."]
    tok = build_tokenizer(docs, vocab_size=400, model_max_length=512)
    rows = [
        chat(
            ("system", "Answer briefly."),
            ("user", "Context: " + "the lazy dog sleeps " * 40 + "Who jumps?"),
            ("assistant", "The quick brown fox."),
        ),
        legacy("Story: " + "the fox jumps over the dog " * 40 + "\nWho jumps?", " The fox."),
    ]
    measure = TokenBudget(count=lambda ex: count_tokens(ex, tok), limit=96)
    for ex in rows:
        assert count_tokens(ex, tok) == len(encode_example(ex, tok, 10**9)["input_ids"]) > 96
        cut = truncate_to_fit(ex, measure)
        assert cut is not None and cut.completion == ex.completion
        full = encode_example(cut, tok, 10**9)
        trained = encode_example(cut, tok, 96)
        assert len(full["input_ids"]) <= 96
        learnt = [t for t in trained["labels"] if t != IGNORE_INDEX]
        assert learnt == [t for t in full["labels"] if t != IGNORE_INDEX] and learnt
        assert cut.prompt_text.endswith("Who jumps?")


def test_truncate_through_prepare_dataset_writes_the_change(tmp_path):
    f = write_jsonl(tmp_path / "news.jsonl", news_rows(30, long_at={4}))
    ds = prepare_dataset(make_cfg(tmp_path, {"overlong": "truncate"}), train_path=f, budget=budget(40))
    assert ds.rejects == [] and [(r.example_id, r.action) for r in ds.changed] == [("news.jsonl:5", "truncated")]
    cut = next(e for e in ds.train + ds.eval if e.example_id == "news.jsonl:5")
    assert words(cut) <= 40 and cut.prompt.endswith("Topic of story 4?")
    assert ds.manifest["policies"]["overlong"]["truncated"] == 1
    again = load_prepared(ds.dir)
    assert again.changed == ds.changed and again.rejects == []
    assert "1 changed" in ds.summary()


# ---------------------------------------------------------------------- token limit


def test_the_limit_follows_training_max_length_and_the_context_window(tmp_path):
    cfg = make_cfg(tmp_path)
    assert token_limit(cfg, 512) == (256, "training.max_length (context window 512)")
    long = make_cfg(tmp_path, training={"max_length": 1024})
    assert token_limit(long, 512)[0] == 512 and "context window" in token_limit(long, 512)[1]
    assert token_limit(long, None) == (1024, "training.max_length")
    assert token_limit(make_cfg(tmp_path, {"max_tokens": 100}), 512) == (100, "validation.max_tokens")


def test_token_budget_reads_the_base_models_tokenizer_and_context_window(tmp_path):
    from transformers import GPT2Config

    from tuneloop.bootstrap import build_tokenizer

    model = tmp_path / "model"
    build_tokenizer(["a few words to learn from " * 10], vocab_size=300, model_max_length=4096).save_pretrained(model)
    GPT2Config(n_positions=128, vocab_size=300).save_pretrained(model)
    cfg = make_cfg(tmp_path, model={"base_model": str(model)}, training={"max_length": 512})
    b = token_budget(cfg)
    assert b.limit == 128 and "context window" in b.source
    assert b.count(legacy("a few words", "to learn")) > 3


# ---------------------------------------------------------------------- personal data


def test_pii_rows_are_dropped_by_kind_and_reserved_addresses_kept(tmp_path):
    rows = [chat_row(f"Ask the desk about item {i}.", f"Question {i}?") for i in range(40)]
    rows[5] = chat_row("Write to jane.roe@fastmail.com for help.")
    rows[9] = chat_row("Use the key sk-proj-Q2xk9Vb7LmN3pRt5WyZa8cDe to call it.")
    rows[12] = chat_row("Write to support@example.com or call +1 (212) 555-0142.")  # documentation values
    f = write_jsonl(tmp_path / "chat.jsonl", rows)
    ds = prepare_dataset(make_cfg(tmp_path), train_path=f)
    assert [(r.example_id, r.action, r.policy, r.reason) for r in ds.rejects] == [
        ("chat.jsonl:6", "dropped", "pii", "completion holds email"),
        ("chat.jsonl:10", "dropped", "pii", "completion holds openai_api_key"),
    ]
    assert "chat.jsonl:13" in {e.example_id for e in ds.train + ds.eval}
    # Neither the rejects file nor the manifest keeps a copy of the value.
    folder = ds.rejects_path.read_text() + (ds.dir / "manifest.json").read_text()
    assert "fastmail" not in folder and "sk-proj" not in folder
    assert all(r.raw == "" for r in ds.rejects)
    assert ds.manifest["policies"]["pii"] == {"policy": "drop", "max_fraction": 0.01, "dropped": 2}


def test_alpaca_array_with_synthetic_example_com_addresses_passes_and_names_records(tmp_path):
    """The real case: six synthetic example.com addresses in an Alpaca set failed the whole set."""
    records = [
        {"instruction": f"Summarise note {i}.", "input": "", "output": f"Note {i} is about topic {i}."}
        for i in range(200)
    ]
    for i in (10, 40, 70, 100, 130, 160):
        records[i]["output"] = f"Contact user{i}@example.com for note {i}."
    records[150]["output"] = "Contact jane.roe@fastmail.com about it."
    f = tmp_path / "alpaca.json"
    f.write_text(json.dumps(records), encoding="utf-8")  # minified: every record on line 1
    cfg = make_cfg(tmp_path)
    ds = prepare_dataset(cfg, train_path=f, budget=budget(100))
    assert [(r.example_id, r.source_record, r.source_line) for r in ds.rejects] == [("alpaca.json record 151", 151, 1)]
    assert str(ds.rejects[0]) == f"{f} record 151: completion holds email"
    report = validate_prepared(cfg, ds, budget=budget(100))
    assert report.success, report.summary()
    pii = by_name(report)["few rows with personal data or secrets"]
    assert pii.failing_example_ids == ["alpaca.json record 151"] and pii.unexpected_count == 1
    assert by_name(report)["completion has no personal data"].unexpected_count == 0

    # pii: fail is the old gate: the row stays and fails it.
    strict = make_cfg(tmp_path, {"pii": "fail"})
    kept = prepare_dataset(strict, train_path=f, budget=budget(100))
    assert kept.rejects == []
    report = validate_prepared(strict, kept, budget=budget(100))
    assert [e.name for e in report.failures] == ["completion has no personal data"]
    assert by_name(report)["completion has no personal data"].failing_example_ids == ["alpaca.json record 151"]


def test_more_pii_rows_than_the_fraction_fail_the_gate(tmp_path):
    rows = [chat_row(f"Answer {i}.", f"Question {i}?") for i in range(50)]
    rows[3] = chat_row("Mail me at a.b@fastmail.com")
    rows[30] = chat_row("Card 4111 1111 1111 1111 was charged.")
    cfg = make_cfg(tmp_path)  # 2 of 50 = 4% > 1%
    report = validate_prepared(
        cfg, prepare_dataset(cfg, train_path=write_jsonl(tmp_path / "c.jsonl", rows)), budget=budget(100)
    )
    assert [e.name for e in report.failures] == ["few rows with personal data or secrets"]
    failing = by_name(report)["few rows with personal data or secrets"]
    assert dict(zip(failing.failing_example_ids, failing.failing_values)) == {
        "c.jsonl:4": "dropped: completion holds email",
        "c.jsonl:31": "dropped: completion holds card_number",
    }
    lenient = make_cfg(tmp_path, {"max_pii_fraction": 0.05})
    assert validate_prepared(
        lenient, prepare_dataset(lenient, train_path=tmp_path / "c.jsonl"), budget=budget(100)
    ).success


def test_redact_keeps_the_row_redacted_and_drops_what_it_cannot_redact():
    cfg = ValidationConfig(pii="redact")
    calls = []

    def make_redactor():
        calls.append(1)
        return lambda text: text.replace("jane.roe@fastmail.com", "<EMAIL_ADDRESS>")

    rows = [
        chat(("user", "Who?"), ("assistant", "Write to jane.roe@fastmail.com today."), example_id="c.jsonl:1"),
        chat(("user", "Key?"), ("assistant", "api_key = 'f3a9c1d27b8e4a6f9c0d1e2f3a4b5c6d'"), example_id="c.jsonl:2"),
        chat(("user", "Hi"), ("assistant", "Hello."), example_id="c.jsonl:3"),
    ]
    kept, touched = apply_pii_policy(rows, cfg, make_redactor)
    assert [e.example_id for e in kept] == ["c.jsonl:1", "c.jsonl:3"]
    assert kept[0].completion == "Write to <EMAIL_ADDRESS> today." == kept[0].messages[-1]["content"]
    assert rows[0].completion == "Write to jane.roe@fastmail.com today."  # the input is not modified
    assert [(r.example_id, r.action, r.reason) for r in touched] == [
        ("c.jsonl:1", "redacted", "completion holds email"),
        ("c.jsonl:2", "dropped", "completion holds labelled_secret; still there after redaction: labelled_secret"),
    ]
    assert calls == [1]  # built once, on the first row that needed it
    assert apply_pii_policy(rows[2:], cfg, make_redactor) == (rows[2:], []) and calls == [1]  # none needed


def test_redact_through_the_gateways_presidio(tmp_path):
    rows = [chat_row(f"Answer {i}.", f"Question {i}?") for i in range(30)]
    rows[7] = chat_row("Write to jane.roe@fastmail.com (or docs@example.com), key sk-proj-Q2xk9Vb7LmN3pRt5WyZa8cDe.")
    cfg = make_cfg(tmp_path, {"pii": "redact", "max_pii_fraction": 0.05})
    ds = prepare_dataset(cfg, train_path=write_jsonl(tmp_path / "c.jsonl", rows))
    assert ds.rejects == [] and [(r.example_id, r.action) for r in ds.changed] == [("c.jsonl:8", "redacted")]
    row = next(e for e in ds.train + ds.eval if e.example_id == "c.jsonl:8")
    assert row.completion == "Write to <EMAIL_ADDRESS> (or docs@example.com), key <SECRET_KEY>."
    assert row.messages[-1]["content"] == row.completion
    on_disk = ds.train_path.read_text() + ds.eval_path.read_text() + ds.rejects_path.read_text()
    assert "fastmail" not in on_disk and "sk-proj" not in on_disk
    report = validate_prepared(cfg, ds, budget=budget(100))
    assert report.success, report.summary()
    assert by_name(report)["few rows with personal data or secrets"].failing_values == [
        "redacted: completion holds openai_api_key, email"
    ]


@pytest.mark.parametrize("policy", ["drop", "redact"])
def test_secrets_are_never_kept_as_they_were(tmp_path, policy):
    rows = [chat_row(f"Answer {i}.", f"Question {i}?") for i in range(20)]
    rows[2] = chat_row("Token: ghp_a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8 works.")
    cfg = make_cfg(tmp_path, {"pii": policy, "max_pii_fraction": 0.1})
    ds = prepare_dataset(cfg, train_path=write_jsonl(tmp_path / "s.jsonl", rows))
    on_disk = ds.train_path.read_text() + ds.eval_path.read_text() + ds.rejects_path.read_text()
    assert "ghp_a1B2" not in on_disk
    row = next((e for e in ds.train + ds.eval if e.example_id == "s.jsonl:3"), None)
    if policy == "drop":
        assert row is None and [(r.example_id, r.reason) for r in ds.rejects] == [
            ("s.jsonl:3", "completion holds github_token")
        ]
    else:
        assert row.completion == "Token: <SECRET_KEY> works." and ds.rejects == []
