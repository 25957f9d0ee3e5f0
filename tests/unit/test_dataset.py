"""prepare_dataset: bad-row policies, the split, fingerprints, the folder it writes, the sample."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tuneloop.config import REPO_ROOT, TuneloopConfig
from tuneloop.data.dataset import (
    load_prepared,
    prepare_dataset,
    read_examples,
    split_examples,
)
from tuneloop.data.formats import DataError, load_file
from tuneloop.data.sample import write_sample


def make_cfg(tmp_path: Path, **data) -> TuneloopConfig:
    return TuneloopConfig.model_validate({"paths": {"home": str(tmp_path / "home")}, "data": data})


def legacy_rows(n: int, start: int = 0) -> list[dict]:
    return [{"prompt": f"Q{i}?", "completion": f"A{i}"} for i in range(start, start + n)]


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def ids(examples) -> list[str]:
    return [e.example_id for e in examples]


# ---------------------------------------------------------------------- bad rows


def test_quarantine_keeps_every_bad_row(tmp_path):
    f = write_jsonl(
        tmp_path / "t.jsonl",
        legacy_rows(3) + ["{oops", {"prompt": "p"}, {"prompt": "", "completion": "c"}] + legacy_rows(2, start=3),
    )
    ds = prepare_dataset(make_cfg(tmp_path, on_bad_rows="quarantine"), train_path=f)
    assert len(ds.train) + len(ds.eval) == 5
    assert [(r.source_line, r.reason) for r in ds.rejects] == [
        (4, "invalid JSON: Expecting property name enclosed in double quotes (column 2)"),
        (5, "missing field 'completion'"),
        (6, "field 'prompt' is empty"),
    ]
    written = [json.loads(line) for line in ds.rejects_path.read_text().splitlines()]
    assert written == [r.to_dict() for r in ds.rejects]
    assert written[0] == {"source_file": str(f), "source_line": 4, "reason": ds.rejects[0].reason, "raw": "{oops"}
    m = ds.manifest
    assert m["counts"] == {"train": len(ds.train), "eval": len(ds.eval), "rejects": 3}
    assert m["rejects_by_reason"] == {
        "invalid JSON: Expecting property name enclosed in double quotes (column N)": 1,
        "missing field 'completion'": 1,
        "field 'prompt' is empty": 1,
    }
    assert "3 rejected" in ds.summary() and str(ds.rejects_path) in ds.summary()


def test_fail_lists_every_bad_row_and_writes_nothing(tmp_path):
    f = write_jsonl(tmp_path / "t.jsonl", legacy_rows(3) + ["[]", {"prompt": "p", "completion": 5}])
    cfg = make_cfg(tmp_path, on_bad_rows="fail")
    with pytest.raises(DataError) as err:
        prepare_dataset(cfg, train_path=f)
    message = str(err.value)
    assert "2 bad row(s)" in message
    assert f"{f}:4: expected a JSON object, got array" in message
    assert f"{f}:5: field 'completion' must be a string, got number" in message
    assert not cfg.datasets_dir.exists()


def test_fail_also_covers_the_eval_file(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", legacy_rows(5))
    ev = write_jsonl(tmp_path / "eval.jsonl", legacy_rows(1, start=10) + [{"completion": "x"}])
    with pytest.raises(DataError, match=r"eval.jsonl:2: missing field 'prompt'"):
        prepare_dataset(make_cfg(tmp_path, on_bad_rows="fail"), train_path=train, eval_path=ev)


def test_nothing_usable_is_an_error(tmp_path):
    f = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "p", "completion": ""}, {"prompt": "q", "completion": " "}])
    with pytest.raises(DataError, match="no usable training rows"):
        prepare_dataset(make_cfg(tmp_path, format="legacy"), train_path=f)


# ---------------------------------------------------------------------- split


def test_split_is_deterministic_disjoint_and_sized(tmp_path):
    f = write_jsonl(tmp_path / "t.jsonl", legacy_rows(200))
    examples = load_file(f).examples
    train, ev = split_examples(examples, 0.1, seed=42)
    again_train, again_ev = split_examples(examples, 0.1, seed=42)
    assert ids(train) == ids(again_train) and ids(ev) == ids(again_ev)
    assert len(ev) == 20 and len(train) == 180
    assert not set(ids(train)) & set(ids(ev))
    assert sorted(ids(train) + ids(ev)) == sorted(ids(examples))
    # Both sides keep file order.
    assert ids(ev) == [i for i in ids(examples) if i in set(ids(ev))]
    _, other_ev = split_examples(examples, 0.1, seed=7)
    assert ids(other_ev) != ids(ev)


def test_split_is_keyed_by_content_not_position(tmp_path):
    examples = load_file(write_jsonl(tmp_path / "t.jsonl", legacy_rows(200))).examples
    _, ev = split_examples(examples, 0.1, seed=42)
    # Reordering the rows does not change which examples are held out.
    _, ev_reversed = split_examples(examples[::-1], 0.1, seed=42)
    assert {e.content_hash for e in ev_reversed} == {e.content_hash for e in ev}
    # Adding 10% more rows leaves most of the old eval set where it was.
    more = load_file(write_jsonl(tmp_path / "more.jsonl", legacy_rows(220))).examples
    _, ev_more = split_examples(more, 0.1, seed=42)
    kept = {e.content_hash for e in ev} & {e.content_hash for e in ev_more}
    assert len(kept) >= 18


def test_split_keeps_rows_with_the_same_prompt_together(tmp_path):
    rows = legacy_rows(50) + [{"prompt": f"Q{i}?", "completion": "other"} for i in range(50)]
    examples = load_file(write_jsonl(tmp_path / "t.jsonl", rows)).examples
    train, ev = split_examples(examples, 0.2, seed=1)
    assert not {e.prompt_hash for e in train} & {e.prompt_hash for e in ev}
    assert len(ev) == 20


def test_split_needs_two_examples(tmp_path):
    examples = load_file(write_jsonl(tmp_path / "t.jsonl", legacy_rows(1))).examples
    with pytest.raises(DataError, match="at least 2 examples"):
        split_examples(examples, 0.1, seed=0)


def test_explicit_eval_file(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", legacy_rows(30))
    ev = write_jsonl(tmp_path / "eval.jsonl", legacy_rows(5, start=100))
    ds = prepare_dataset(make_cfg(tmp_path, eval_path=str(ev)), train_path=train)
    assert len(ds.train) == 30
    assert ids(ds.eval) == [f"eval.jsonl:{i}" for i in range(1, 6)]
    assert ds.manifest["split"] == "file" and ds.manifest["eval_fraction"] is None
    assert [s["path"] for s in ds.manifest["sources"]["eval"]] == [str(ev)]
    assert "eval from" in ds.summary()


def test_legacy_and_conversations_do_not_mix(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", legacy_rows(5))
    ev = write_jsonl(
        tmp_path / "eval.jsonl",
        [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}],
    )
    with pytest.raises(DataError, match="cannot mix legacy"):
        prepare_dataset(make_cfg(tmp_path), train_path=train, eval_path=ev)


# ---------------------------------------------------------------------- fingerprint and folder


def test_fingerprint_stable_and_sensitive(tmp_path):
    rows = legacy_rows(40)
    a = prepare_dataset(make_cfg(tmp_path), train_path=write_jsonl(tmp_path / "a.jsonl", rows))
    # Same content, other file name and row order: same dataset.
    b = prepare_dataset(make_cfg(tmp_path), train_path=write_jsonl(tmp_path / "b.jsonl", rows[::-1]))
    assert a.fingerprint == b.fingerprint and a.dir == b.dir
    assert a.dir == tmp_path / "home" / "datasets" / a.fingerprint[:12]
    changed = rows[:-1] + [{"prompt": rows[-1]["prompt"], "completion": "A39 "}]
    c = prepare_dataset(make_cfg(tmp_path), train_path=write_jsonl(tmp_path / "c.jsonl", changed))
    assert c.fingerprint != a.fingerprint
    # Another split of the same rows is another dataset too.
    d = prepare_dataset(make_cfg(tmp_path, seed=3), train_path=tmp_path / "a.jsonl")
    assert d.fingerprint != a.fingerprint


def test_prepared_folder_round_trips(tmp_path):
    f = write_jsonl(tmp_path / "t.jsonl", legacy_rows(20) + ["{bad"])
    ds = prepare_dataset(make_cfg(tmp_path), train_path=f)
    assert sorted(p.name for p in ds.dir.iterdir()) == ["eval.jsonl", "manifest.json", "rejects.jsonl", "train.jsonl"]
    manifest = json.loads((ds.dir / "manifest.json").read_text())
    assert manifest == ds.manifest
    assert manifest["fingerprint"] == ds.fingerprint and manifest["format"] == "legacy"
    assert manifest["seed"] == 42 and manifest["eval_fraction"] == 0.1
    assert manifest["sources"]["train"][0]["path"] == str(f) and len(manifest["sources"]["train"][0]["sha256"]) == 64
    again = load_prepared(ds.dir)
    assert again.train == ds.train and again.eval == ds.eval and again.rejects == ds.rejects
    assert read_examples(ds.train_path) == ds.train
    # A hand-edited folder is noticed rather than trained on.
    lines = ds.train_path.read_text().splitlines()
    row = json.loads(lines[0])
    row["completion"] = "tampered"
    ds.train_path.write_text("\n".join([json.dumps(row)] + lines[1:]) + "\n")
    with pytest.raises(DataError, match="do not match the manifest"):
        load_prepared(ds.dir)


def test_read_examples_names_the_bad_line(tmp_path):
    f = write_jsonl(tmp_path / "x.jsonl", [{"example_id": "a:1", "completion": "c", "prompt": "p"}, {"nope": 1}])
    with pytest.raises(DataError, match=r"x.jsonl:2: not a normalised example"):
        read_examples(f)
    with pytest.raises(DataError, match="not a prepared dataset"):
        load_prepared(tmp_path)


def test_folder_of_real_t0_files(tmp_path, shared_data):
    folder = shared_data / "t0-amazon-polarity"
    if not folder.is_dir():
        pytest.skip(f"T0 data not present at {folder}")
    ds = prepare_dataset(make_cfg(tmp_path, on_bad_rows="fail"), train_path=folder)
    assert len(ds.train) + len(ds.eval) == 1800 and ds.rejects == []
    assert len(ds.manifest["sources"]["train"]) == 9 and ds.manifest["format"] == "legacy"
    assert all("<|endoftext|>" not in e.completion for e in ds.train + ds.eval)


# ---------------------------------------------------------------------- bundled sample

SAMPLE = REPO_ROOT / "data" / "sample"


def test_sample_regenerates_byte_identical(tmp_path):
    written = write_sample(tmp_path)
    assert sorted(p.name for p in written) == ["README.md", "train.jsonl"]
    for p in written:
        assert p.read_bytes() == (SAMPLE / p.name).read_bytes(), f"{p.name} differs: rerun tuneloop.data.sample"


def test_sample_is_clean_and_balanced(tmp_path):
    result = load_file(SAMPLE / "train.jsonl")
    assert result.format == "chat" and result.rejects == []
    examples = result.examples
    assert 1100 <= len(examples) <= 1300
    assert len({e.prompt_hash for e in examples}) == len(examples)  # no duplicate prompts
    answers = Counter(e.completion for e in examples)
    assert answers["positive"] == answers["negative"] >= 100
    assert answers["even"] == answers["odd"] >= 50
    assert all(len(e.completion.split()) == 1 for e in examples)
    # The default config prepares it as the demo does.
    ds = prepare_dataset(make_cfg(tmp_path), train_path=SAMPLE / "train.jsonl")
    assert len(ds.eval) == round(len(examples) * 0.1) and ds.rejects == []


def test_generated_task_sets_regenerate_byte_identical(tmp_path):
    """The sets the project generates (data/tickets for configs/smollm2.yaml, data/injections
    for the content filter) are what their generators write, byte for byte."""
    from tuneloop.config import REPO_ROOT
    from tuneloop.data.tickets import write as write_tickets
    from tuneloop.gateway.injection_data import write as write_injections

    for write, folder in ((write_tickets, "tickets"), (write_injections, "injections")):
        out = tmp_path / folder
        write(out)
        for name in ("README.md", "train.jsonl"):
            assert (out / name).read_bytes() == (REPO_ROOT / "data" / folder / name).read_bytes(), (
                f"data/{folder}/{name} differs: rerun its generator"
            )


def test_the_ticket_task_splits_by_ticket_and_its_majority_label_is_far_from_a_pass(tmp_path):
    """configs/smollm2.yaml's task: every template of a ticket lands on the same side of the
    split (a better eval score means unseen tickets routed, not tickets remembered), and always
    answering the commonest class scores far below the blessing's bar."""
    from collections import Counter

    from tuneloop.config import REPO_ROOT, load_config
    from tuneloop.data.dataset import prepare_dataset
    from tuneloop.data.tickets import TEMPLATES

    cfg = load_config(REPO_ROOT / "configs" / "smollm2.yaml", environ={"TUNELOOP_HOME": str(tmp_path)})
    prepared = prepare_dataset(cfg)
    assert len(prepared.train) + len(prepared.eval) == 2208 and 150 <= len(prepared.eval) <= 300

    def ticket(example) -> str:  # the ticket inside the row's template
        prompt, _ = TEMPLATES[example.extra["template"]]
        before, after = prompt.split("{ticket}")
        return example.prompt.removeprefix(before.strip()).removesuffix(after.strip()).strip()

    train_tickets = {ticket(e) for e in prepared.train}
    eval_tickets = {ticket(e) for e in prepared.eval}
    assert len(eval_tickets) * 6 == len(prepared.eval) and not train_tickets & eval_tickets
    labels = Counter(e.extra["label"] for e in prepared.eval)
    assert max(labels.values()) / len(prepared.eval) < 0.4 < cfg.blessing.thresholds[0].value_threshold.lower_bound
