"""Loaders for every supported format: good files, bad rows, bad files, auto-detection."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tuneloop.data.formats import DataError, LoadResult, load_file


def write(path: Path, text: str | bytes) -> Path:
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def jsonl(*rows) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


def problems(result: LoadResult) -> list[tuple[int, str]]:
    return [(r.source_line, r.reason) for r in result.rejects]


def chat(*turns, **extra):
    return {"messages": [{"role": r, "content": c} for r, c in turns], **extra}


# ---------------------------------------------------------------------- chat


def test_chat_good_file(tmp_path):
    f = write(
        tmp_path / "chat.jsonl",
        jsonl(
            chat(("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello")),
            "",  # blank lines are not rows and are not rejects
            chat(("user", "2+2?"), ("assistant", "4"), ("user", "and 3+3?"), ("assistant", "6"), weight=1),
        ),
    )
    result = load_file(f)
    assert result.format == "chat"
    assert result.rejects == []
    first, second = result.examples
    assert first.example_id == "chat.jsonl:1"
    assert first.completion == "Hello"
    assert first.messages[-1] == {"role": "assistant", "content": "Hello"}
    assert first.prompt is None
    assert first.prompt_text == "system: Be brief.\nuser: Hi"
    # Line numbers count the blank line: they point at the file as the user sees it.
    assert (second.example_id, second.source_line) == ("chat.jsonl:3", 3)
    assert second.completion == "6" and len(second.messages) == 4
    assert second.extra == {"weight": 1}
    assert second.source_format == "chat" and second.source_file == str(f)


def test_chat_message_weight_kept_in_extra(tmp_path):
    row = {
        "messages": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b", "weight": 0},
            {"role": "user", "content": "c"},
            {"role": "assistant", "content": "d", "weight": 1},
        ]
    }
    (ex,) = load_file(write(tmp_path / "w.jsonl", jsonl(row))).examples
    assert all(set(m) == {"role", "content"} for m in ex.messages)
    assert ex.extra["message_fields"] == [{}, {"weight": 0}, {}, {"weight": 1}]


def test_chat_bad_rows_are_rejected_with_line_and_reason(tmp_path):
    good = chat(("user", "q"), ("assistant", "a"))
    f = write(
        tmp_path / "bad.jsonl",
        jsonl(
            good,  # 1
            '{"messages": [',  # 2 invalid JSON
            "[1, 2]",  # 3 not an object
            {"prompt": "x"},  # 4 missing messages
            {"messages": []},  # 5 empty list
            {"messages": "hello"},  # 6 wrong type
            chat(("user", "q"), ("assistant", "   ")),  # 7 blank content
            {"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "a"}]},  # 8
            chat(("tool", "q"), ("assistant", "a")),  # 9 tool message answering no call
            chat(("system", "s"), ("user", "q")),  # 10 no assistant
            chat(("user", "q"), ("assistant", "a"), ("user", "again?")),  # 11 ends with user
            {"messages": [{"content": "q"}, {"role": "assistant", "content": "a"}]},  # 12 no role
            {"messages": ["q", {"role": "assistant", "content": "a"}]},  # 13 message not object
            "   ",  # 14 blank: skipped
            good,  # 15
        ),
    )
    result = load_file(f)
    assert result.format == "chat"
    assert [e.source_line for e in result.examples] == [1, 15]
    assert problems(result) == [
        (2, "invalid JSON: Expecting value (column 15)"),
        (3, "expected a JSON object, got array"),
        (4, "missing field 'messages'"),
        (5, "field 'messages' is empty"),
        (6, "field 'messages' must be an array, got string"),
        (7, "messages[1]: field 'content' is empty"),
        (8, "messages[0]: field 'content' must be a string, got number"),
        (9, "messages[0]: a tool message needs 'tool_call_id': the id of the call it answers"),
        (10, "no assistant message: nothing to learn"),
        (11, "last message must be from the assistant, got 'user'"),
        (12, "messages[0]: missing field 'role'"),
        (13, "messages[0]: expected an object, got string"),
    ]
    # Nothing is lost: each reject carries the row exactly as it was in the file.
    assert result.rejects[0].raw == '{"messages": ['
    assert json.loads(result.rejects[9].raw) == chat(("user", "q"), ("assistant", "a"), ("user", "again?"))
    assert str(result.rejects[1]) == f"{f}:3: expected a JSON object, got array"


# ---------------------------------------------------------------------- legacy


def test_legacy_end_marker_is_stripped_never_text(tmp_path):
    f = write(
        tmp_path / "legacy.jsonl",
        jsonl(
            {"prompt": "Good?\nAnswer:\n", "completion": "Positive<|endoftext|>"},
            {"prompt": "Good?", "completion": " Negative <|endoftext|>"},
            {"prompt": "Good?", "completion": " Yes\n<|endoftext|>\n"},
            {"prompt": "Good?", "completion": " No"},
            {"prompt": "Say it", "completion": "a <|endoftext|> b"},  # not trailing: it is text
            {"prompt": "Good?", "completion": "Yes", "id": 7},
        ),
    )
    result = load_file(f)
    assert result.format == "legacy" and result.rejects == []
    assert [e.completion for e in result.examples] == [
        "Positive",
        " Negative",
        " Yes",
        " No",
        "a <|endoftext|> b",
        "Yes",
    ]
    first = result.examples[0]
    assert first.prompt == "Good?\nAnswer:\n" and first.messages is None
    assert result.examples[-1].extra == {"id": 7}


def test_legacy_bad_rows(tmp_path):
    f = write(
        tmp_path / "legacy.jsonl",
        jsonl(
            {"prompt": "p", "completion": "c"},  # 1
            {"prompt": "p"},  # 2
            {"prompt": "", "completion": "c"},  # 3
            {"prompt": "p", "completion": "<|endoftext|>"},  # 4
            {"prompt": "p", "completion": 1},  # 5
            {"prompt": None, "completion": "c"},  # 6
            "{'prompt': 'p', 'completion': 'c'}",  # 7 Python, not JSON
        ),
    )
    result = load_file(f)
    assert len(result.examples) == 1
    assert problems(result) == [
        (2, "missing field 'completion'"),
        (3, "field 'prompt' is empty"),
        (4, "field 'completion' is empty once the <|endoftext|> end marker is removed"),
        (5, "field 'completion' must be a string, got number"),
        (6, "field 'prompt' must be a string, got null"),
        (7, "invalid JSON: Expecting property name enclosed in double quotes (column 2)"),
    ]


def test_real_t0_amazon_polarity_files(shared_data):
    folder = shared_data / "t0-amazon-polarity"
    if not folder.is_dir():
        pytest.skip(f"T0 data not present at {folder}")
    files = sorted(folder.glob("*.jsonl"))
    assert len(files) == 9
    labels = set()
    for f in files:
        result = load_file(f)
        assert result.format == "legacy", f
        assert result.rejects == [], f
        assert len(result.examples) == 200, f
        for e in result.examples:
            assert "<|endoftext|>" not in e.completion
            assert e.completion == e.completion.strip() and e.completion
            labels.add(e.completion)
    assert {"Positive", "Negative", "Yes", "No"} <= labels


# ---------------------------------------------------------------------- alpaca

ALPACA = [
    {"instruction": "Give the opposite.", "input": "hot", "output": "cold"},
    {"instruction": "  Name a colour.  ", "input": "   ", "output": " red "},
    {"instruction": "Add.", "output": "5"},  # input is optional
]


def test_alpaca_json_array_pretty_printed(tmp_path):
    f = write(tmp_path / "alpaca.json", json.dumps(ALPACA, indent=2))
    result = load_file(f)
    assert result.format == "alpaca" and result.rejects == []
    a, b, c = result.examples
    assert a.messages == [
        {"role": "user", "content": "Give the opposite.\n\nhot"},
        {"role": "assistant", "content": "cold"},
    ]
    assert b.messages[0]["content"] == "Name a colour." and b.completion == "red"
    assert c.messages[0]["content"] == "Add."
    # Arrays: the id counts records ("record N", not a line), source_line is where the record
    # starts in the file.
    assert [e.example_id for e in result.examples] == [
        "alpaca.json record 1",
        "alpaca.json record 2",
        "alpaca.json record 3",
    ]
    assert [e.source_record for e in result.examples] == [1, 2, 3]
    assert [e.source_line for e in result.examples] == [2, 7, 12]


def test_alpaca_minified_array_and_jsonl(tmp_path):
    one_line = load_file(write(tmp_path / "min.json", json.dumps(ALPACA)))
    as_jsonl = load_file(write(tmp_path / "a.jsonl", jsonl(*ALPACA)))
    assert one_line.format == as_jsonl.format == "alpaca"
    assert [e.example_id for e in one_line.examples] == ["min.json record 1", "min.json record 2", "min.json record 3"]
    assert [e.source_line for e in one_line.examples] == [1, 1, 1]
    assert [e.messages for e in one_line.examples] == [e.messages for e in as_jsonl.examples]
    assert [e.source_line for e in as_jsonl.examples] == [1, 2, 3]
    assert [e.example_id for e in as_jsonl.examples] == ["a.jsonl:1", "a.jsonl:2", "a.jsonl:3"]
    assert [e.source_record for e in as_jsonl.examples] == [None, None, None]


def test_alpaca_bad_records_in_array(tmp_path):
    rows = [
        ALPACA[0],
        {"instruction": "x", "input": 3, "output": "y"},
        "text",
        {"instruction": "x", "input": "", "output": ""},
        {"instruction": "x"},
    ]
    f = write(tmp_path / "bad.json", json.dumps(rows, indent=1))
    result = load_file(f)
    assert len(result.examples) == 1
    assert problems(result) == [
        (7, "field 'input' must be a string, got number"),
        (12, "expected a JSON object, got string"),
        (13, "field 'output' is empty"),
        (18, "missing field 'output'"),
    ]
    assert json.loads(result.rejects[0].raw) == rows[1]
    # Where they are is said as a record number: a minified array has every record on line 1.
    assert [r.source_record for r in result.rejects] == [2, 3, 4, 5]
    assert str(result.rejects[0]) == f"{f} record 2: field 'input' must be a string, got number"
    minified = load_file(write(tmp_path / "min.json", json.dumps(rows)))
    assert [str(r).split(": ", 1)[0] for r in minified.rejects] == [
        f"{tmp_path / 'min.json'} record {n}" for n in (2, 3, 4, 5)
    ]
    # A reject written to rejects.jsonl keeps its record; one from JSONL is written as before.
    assert minified.rejects[0].to_dict()["source_record"] == 2
    jsonl_reject = load_file(write(tmp_path / "bad.jsonl", jsonl(*rows))).rejects[0]
    assert set(jsonl_reject.to_dict()) == {"source_file", "source_line", "reason", "raw"}
    assert str(jsonl_reject).startswith(f"{tmp_path / 'bad.jsonl'}:2: ")


def test_broken_json_array_is_a_file_error(tmp_path):
    f = write(tmp_path / "broken.json", '[\n  {"instruction": "a", "output": "b"},\n  {"instruction": }\n]\n')
    with pytest.raises(DataError, match=r"broken.json:3: invalid JSON array"):
        load_file(f)
    f = write(tmp_path / "trailing.json", '[{"instruction": "a", "output": "b"}] x')
    with pytest.raises(DataError, match="text after the closing"):
        load_file(f)


# ---------------------------------------------------------------------- dolly


def test_dolly(tmp_path):
    f = write(
        tmp_path / "dolly.jsonl",
        jsonl(
            {
                "instruction": "Who wrote it?",
                "context": "The book was written by a cat.",
                "response": "A cat.",
                "category": "closed_qa",
            },
            {"instruction": "Name a fruit.", "context": "", "response": "Apple", "category": "brainstorming"},
            {"instruction": "Name a fruit.", "context": "", "response": ""},
            {"instruction": "Name a fruit.", "context": ["a"], "response": "Pear"},
        ),
    )
    result = load_file(f)
    assert result.format == "dolly"
    a, b = result.examples
    assert a.messages[0]["content"] == "Who wrote it?\n\nContext:\nThe book was written by a cat."
    assert a.completion == "A cat." and a.extra == {"category": "closed_qa"}
    assert b.messages[0]["content"] == "Name a fruit."
    assert problems(result) == [(3, "field 'response' is empty"), (4, "field 'context' must be a string, got array")]


# ---------------------------------------------------------------------- detection


@pytest.mark.parametrize(
    "row, fmt",
    [
        (chat(("user", "q"), ("assistant", "a")), "chat"),
        ({"prompt": "p", "completion": "c"}, "legacy"),
        ({"instruction": "i", "input": "", "output": "o"}, "alpaca"),
        ({"instruction": "i", "context": "", "response": "r"}, "dolly"),
    ],
)
def test_auto_detection(tmp_path, row, fmt):
    assert load_file(write(tmp_path / "d.jsonl", jsonl(row))).format == fmt


def test_detection_skips_broken_leading_rows(tmp_path):
    f = write(tmp_path / "d.jsonl", jsonl("not json", '"a string"', {"prompt": "p", "completion": "c"}))
    result = load_file(f)
    assert result.format == "legacy"
    assert problems(result) == [
        (1, "invalid JSON: Expecting value (column 1)"),
        (2, "expected a JSON object, got string"),
    ]


def test_ambiguous_and_unknown_formats_are_clear_errors(tmp_path):
    mixed = write(
        tmp_path / "mixed.jsonl", jsonl(chat(("user", "q"), ("assistant", "a")), {"prompt": "p", "completion": "c"})
    )
    with pytest.raises(DataError, match=r"ambiguous format.*chat \(line 1\), legacy \(line 2\)"):
        load_file(mixed)
    both = write(tmp_path / "both.jsonl", jsonl({"messages": [], "prompt": "p", "completion": "c"}))
    with pytest.raises(
        DataError,
        match=r"both.jsonl:1: ambiguous format: keys \['completion', 'messages', "
        r"'prompt'\] fit chat and legacy",
    ):
        load_file(both)
    unknown = write(tmp_path / "unknown.jsonl", jsonl({"question": "q", "answer": "a"}))
    with pytest.raises(DataError, match=r"unknown format: keys seen \['answer', 'question'\]"):
        load_file(unknown)
    garbage = write(tmp_path / "garbage.jsonl", "hello\nworld\n")
    with pytest.raises(DataError, match="no JSON object rows"):
        load_file(garbage)
    # In a JSON array the same messages name records, not lines.
    mixed_array = write(
        tmp_path / "mixed.json",
        json.dumps([chat(("user", "q"), ("assistant", "a")), {"prompt": "p", "completion": "c"}]),
    )
    with pytest.raises(DataError, match=r"ambiguous format.*chat \(record 1\), legacy \(record 2\)"):
        load_file(mixed_array)
    both_array = write(tmp_path / "both.json", json.dumps([{"messages": [], "prompt": "p", "completion": "c"}]))
    with pytest.raises(DataError, match=r"both.json record 1: ambiguous format"):
        load_file(both_array)
    strings = write(tmp_path / "strings.json", '["a", "b"]')
    with pytest.raises(DataError, match=r"record 1: expected a JSON object, got string; record 2"):
        load_file(strings)


def test_explicit_format_overrides_detection(tmp_path):
    f = write(tmp_path / "dolly.jsonl", jsonl({"instruction": "i", "context": "", "response": "r"}))
    result = load_file(f, format="alpaca")
    assert result.format == "alpaca" and result.examples == []
    assert problems(result) == [(1, "missing field 'output'")]
    with pytest.raises(DataError, match="unknown data format 'csv'"):
        load_file(f, format="csv")


# ---------------------------------------------------------------------- file-level errors


def test_file_level_errors(tmp_path):
    with pytest.raises(DataError, match="nope.jsonl: file not found"):
        load_file(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="not a file"):
        load_file(tmp_path)
    with pytest.raises(DataError, match="empty file"):
        load_file(write(tmp_path / "empty.jsonl", ""))
    with pytest.raises(DataError, match="empty file"):
        load_file(write(tmp_path / "blank.jsonl", "\n  \n"))
    with pytest.raises(DataError, match=r"latin1.jsonl:2: not UTF-8 text \(byte 0xe9"):
        load_file(
            write(
                tmp_path / "latin1.jsonl",
                '{"prompt": "a", "completion": "b"}\n{"prompt": "caf\xe9", "completion": "b"}\n'.encode("latin-1"),
            )
        )
    with pytest.raises(DataError, match="empty JSON array"):
        load_file(write(tmp_path / "none.json", "[ ]"))


def test_windows_line_endings_and_byte_order_mark(tmp_path):
    text = jsonl({"prompt": "p", "completion": "a"}, {"prompt": "q", "completion": "b"}).replace("\n", "\r\n")
    result = load_file(write(tmp_path / "win.jsonl", "\ufeff".encode() + text.encode()))
    assert result.rejects == []
    assert [(e.source_line, e.completion) for e in result.examples] == [(1, "a"), (2, "b")]


def test_unicode_line_separator_inside_a_string_is_not_a_new_row(tmp_path):
    row = {"prompt": "a\u2028b", "completion": "c"}
    f = write(tmp_path / "u.jsonl", json.dumps(row, ensure_ascii=False) + "\n")
    (ex,) = load_file(f).examples
    assert ex.prompt == "a\u2028b"
