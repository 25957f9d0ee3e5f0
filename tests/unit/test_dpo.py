"""Preference data (OpenAI's DPO format) and the preference win rate, without a training job:
the rows load as pairs (prompt, chosen, rejected), bad rows are refused by line with why, a
file or a dataset that mixes pairs with supervised rows is refused, the Files API's contract
takes a DPO file, the prepared dataset keeps the pairs whole (supervised rows hashed as before),
the gate sees the rejected answer, pairs are tokenised as the server renders a conversation,
and the win rate is the summed log-probability comparison it says. The DPO training jobs:
tests/integration/test_dpo_jobs.py."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from tests.support.training import sentiment_preference_rows
from tuneloop.config import TuneloopConfig, ValidationConfig
from tuneloop.data.dataset import load_prepared, prepare_dataset
from tuneloop.data.formats import DataError, load_file, row_problem
from tuneloop.data.schema import Example

WEATHER_TOOL = {
    "type": "function",
    "function": {"name": "weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}


def pair(prompt: str = "How cold is it in Oslo?", chosen: str = "Minus four.", rejected: str = "Warm.", **row) -> dict:
    return {
        "input": {"messages": [{"role": "user", "content": prompt}]},
        "preferred_output": [{"role": "assistant", "content": chosen}],
        "non_preferred_output": [{"role": "assistant", "content": rejected}],
        **row,
    }


def write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def chat_row(user: str = "hi", answer: str = "hello") -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


# ---------------------------------------------------------------------------------------
# loading


def test_dpo_rows_load_as_preference_pairs(tmp_path):
    with_tools = pair("Weather in Oslo?")
    with_tools["input"]["tools"] = [WEATHER_TOOL]
    with_tools["input"]["parallel_tool_calls"] = False
    with_tools["preferred_output"] = [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
            ],
        }
    ]
    result = load_file(write(tmp_path / "prefs.jsonl", [pair(), with_tools]))

    assert result.format == "dpo" and not result.rejects
    plain, tools = result.examples
    assert plain.is_preference and plain.source_format == "dpo" and plain.example_id == "prefs.jsonl:1"
    assert plain.messages == [
        {"role": "user", "content": "How cold is it in Oslo?"},
        {"role": "assistant", "content": "Minus four."},
    ]
    assert plain.completion == "Minus four." and plain.rejected == {"role": "assistant", "content": "Warm."}
    assert plain.prompt_text == "user: How cold is it in Oslo?"  # the prompt only: splits and leakage by it
    assert tools.tools == [WEATHER_TOOL] and tools.extra == {"parallel_tool_calls": False}
    assert tools.completion.startswith("<tool_call>") and tools.rejected_text == "Warm."
    # round trip through the prepared dataset's JSONL, and the pair is part of the hash
    assert Example.from_dict(json.loads(json.dumps(plain.to_dict()))) == plain
    sft = Example(example_id="x", completion=plain.completion, messages=plain.messages)
    assert plain.content_hash != sft.content_hash


def test_supervised_examples_are_written_and_hashed_as_before():
    """No `rejected` key in a supervised row, and its hash is the one it always had (so the
    fingerprints of existing datasets do not move)."""
    ex = Example(
        example_id="a:1",
        completion="4",
        messages=[{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
    )
    assert "rejected" not in ex.to_dict() and not ex.is_preference
    before = json.dumps(
        {"prompt": None, "messages": ex.messages, "completion": "4"}, sort_keys=True, ensure_ascii=False
    )
    assert ex.content_hash == hashlib.sha256(before.encode()).hexdigest()


BAD_ROWS = [
    (
        {
            "input": {"messages": [{"role": "user", "content": "q"}]},
            "preferred_output": [{"role": "assistant", "content": "a"}],
        },
        "missing field 'non_preferred_output'",
    ),
    (
        {
            "preferred_output": [{"role": "assistant", "content": "a"}],
            "non_preferred_output": [{"role": "assistant", "content": "b"}],
        },
        "missing field 'input'",
    ),
    (pair(chosen="same", rejected="same"), "preferred_output and non_preferred_output are the same answer"),
    (
        {**pair(), "preferred_output": [{"role": "user", "content": "a"}]},
        "preferred_output[0]: must be an assistant message, got role 'user'",
    ),
    (pair(rejected="   "), "non_preferred_output[0]: field 'content' is empty"),
    ({**pair(), "non_preferred_output": [{"role": "assistant"}]}, "non_preferred_output[0]: missing field 'content'"),
    (
        {**pair(), "preferred_output": {"role": "assistant", "content": "a"}},
        "field 'preferred_output' must be an array of one assistant message, got object",
    ),
    (
        {**pair(), "preferred_output": [{"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]},
        "field 'preferred_output' must hold exactly one assistant message, got 2",
    ),
    ({**pair(), "input": {"messages": []}}, "input: field 'messages' is empty"),
    (
        {**pair(), "input": {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}},
        "input.messages: the last message must be a user or tool message",
    ),
    ({**pair(), "input": {"messages": [{"role": "robot", "content": "q"}]}}, "input.messages[0]: unknown role 'robot'"),
    (
        {**pair(), "input": {"messages": [{"role": "user", "content": "q"}], "tools": "weather"}},
        "input: field 'tools' must be an array",
    ),
]


def test_bad_dpo_rows_are_refused_with_their_line_and_why(tmp_path):
    path = write(tmp_path / "prefs.jsonl", [pair()] + [row for row, _ in BAD_ROWS] + ["{not json"])
    result = load_file(path)

    assert result.format == "dpo" and len(result.examples) == 1
    by_line = {r.source_line: r.reason for r in result.rejects}
    for line, (_, reason) in enumerate(BAD_ROWS, start=2):
        assert reason in by_line[line], (line, by_line[line])
    assert by_line[len(BAD_ROWS) + 2].startswith("invalid JSON")
    assert len(result.rejects) == len(BAD_ROWS) + 1


def test_a_file_mixing_preference_and_supervised_rows_is_refused(tmp_path):
    # the supervised row far past the rows format detection looks at: refused all the same
    rows = [pair(f"q{i}") for i in range(60)] + [chat_row()]
    with pytest.raises(DataError) as err:
        load_file(write(tmp_path / "mixed.jsonl", rows))
    assert (
        "mixes preference rows (OpenAI's DPO format, first at line 1) with supervised rows (chat, first at line 61)"
        in str(err.value)
    )
    with pytest.raises(DataError, match="mixes preference rows"):
        load_file(write(tmp_path / "mixed2.jsonl", [{"prompt": "p", "completion": "c"}, pair()]))


def test_the_files_api_contract_takes_a_dpo_file_and_refuses_a_broken_one(tmp_path):
    from tuneloop.files.contract import UploadRefused, check_upload, check_upload_in_child

    good = write(tmp_path / "good.jsonl", sentiment_preference_rows(5, seed=0))
    checked = check_upload_in_child(good, "prefs.jsonl")  # as the server runs it: in a child process
    assert (checked.format, checked.rows) == ("dpo", 5)

    broken = write(tmp_path / "broken.jsonl", [pair(), pair(chosen="x", rejected="x"), pair(rejected="")])
    with pytest.raises(UploadRefused) as err:
        check_upload_in_child(broken, "prefs.jsonl")
    message = str(err.value)
    assert "2 of 3 rows do not meet the data contract (dpo format)" in message
    assert "line 2: preferred_output and non_preferred_output are the same answer" in message
    assert "line 3: non_preferred_output[0]: field 'content' is empty" in message
    with pytest.raises(UploadRefused, match="prefs.jsonl: mixes preference rows"):
        check_upload(write(tmp_path / "mixed.jsonl", [pair(), chat_row()]), "prefs.jsonl")


# ---------------------------------------------------------------------------------------
# the prepared dataset and the gate


def config(tmp_path: Path, **validation) -> TuneloopConfig:
    return TuneloopConfig.model_validate(
        {"paths": {"home": str(tmp_path / "home")}, "data": {"eval_fraction": 0.25}, "validation": validation}
    )


def test_a_prepared_dpo_dataset_keeps_the_pairs_whole(tmp_path):
    rows = sentiment_preference_rows(40, seed=0)
    rows[3] = pair(chosen="same", rejected="same")  # a bad row: quarantined with its line
    cfg = config(tmp_path)
    prepared = prepare_dataset(cfg, train_path=write(tmp_path / "prefs.jsonl", rows))

    assert prepared.preference and prepared.manifest["format"] == "dpo"
    assert len(prepared.train) + len(prepared.eval) == 39 and prepared.eval
    assert [r.source_line for r in prepared.rejects] == [4]
    assert all(e.is_preference for e in prepared.train + prepared.eval)
    # the split goes by prompt: no prompt on both sides
    assert not {e.prompt_hash for e in prepared.train} & {e.prompt_hash for e in prepared.eval}
    again = load_prepared(prepared.dir)
    assert again.fingerprint == prepared.fingerprint and again.train == prepared.train
    assert prepare_dataset(cfg, train_path=tmp_path / "prefs.jsonl").fingerprint == prepared.fingerprint


def test_a_dataset_of_pairs_and_supervised_files_is_refused(tmp_path):
    cfg = config(tmp_path)
    prefs = write(tmp_path / "prefs.jsonl", sentiment_preference_rows(8, seed=0))
    chat = write(tmp_path / "chat.jsonl", [chat_row(f"q{i}") for i in range(8)])
    with pytest.raises(DataError, match="cannot mix preference pairs"):
        prepare_dataset(cfg, train_path=prefs, eval_path=chat)
    folder = tmp_path / "both"
    folder.mkdir()
    for f in (prefs, chat):
        (folder / f.name).write_text(f.read_text())
    with pytest.raises(DataError, match=r"cannot mix preference pairs .*\['chat', 'dpo'\]"):
        prepare_dataset(cfg, train_path=folder)


def test_personal_data_in_the_rejected_answer_counts(tmp_path):
    """The policies and the gate look at the rejected answer too: the model reads it in training."""
    from tuneloop.validation import build_frame

    card = "Pay with 4111 1111 1111 1111 then."
    rows = [pair(f"question {i}?", chosen=f"answer {i}", rejected=f"wrong {i}") for i in range(6)]
    rows[2] = pair("question 2?", chosen="answer 2", rejected=card)
    prepared = prepare_dataset(config(tmp_path, pii="drop"), train_path=write(tmp_path / "p.jsonl", rows))
    dropped = [r for r in prepared.rejects if r.policy == "pii"]
    assert [(r.source_line, r.action) for r in dropped] == [(3, "dropped")] and "card" in dropped[0].reason

    examples = load_file(tmp_path / "p.jsonl").examples
    frame = build_frame(examples, [], None)
    flagged = frame[frame["pii_found"].notna()]
    assert list(flagged["example_id"]) == ["p.jsonl:3"] and "(rejected answer)" in flagged["pii_found"].iloc[0]
    assert ValidationConfig().check_pii  # the gate's check runs on that column by default


# ---------------------------------------------------------------------------------------
# tokenising pairs, and the win rate


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), AutoTokenizer.from_pretrained(tiny_model_dir)


def test_a_pair_is_tokenised_as_the_conversation_the_server_renders(tmp_path, tiny):
    from tuneloop.chat_format import render_chat
    from tuneloop.formatting import count_tokens, encode_preference

    _, tokenizer = tiny
    ex = load_file(write(tmp_path / "p.jsonl", [pair(chosen="Minus four degrees today.", rejected="Warm.")])).examples[
        0
    ]
    enc = encode_preference(ex, tokenizer)

    def ids(messages, generation_prompt=False):
        return tokenizer(
            render_chat(tokenizer, messages, None, add_generation_prompt=generation_prompt), add_special_tokens=False
        )["input_ids"]

    prompt = ex.messages[:-1]
    assert enc["prompt_ids"] == ids(prompt, generation_prompt=True)
    assert enc["prompt_ids"] + enc["chosen_ids"] == ids(ex.messages)
    assert enc["prompt_ids"] + enc["rejected_ids"] == ids([*prompt, ex.rejected])
    assert tokenizer.decode(enc["rejected_ids"]).startswith("Warm.<|im_end|>")
    assert count_tokens(ex, tokenizer) == len(enc["prompt_ids"]) + len(enc["chosen_ids"])  # the longer answer


def test_the_win_rate_compares_summed_log_probabilities(tmp_path, tiny):
    import torch

    from tuneloop.formatting import encode_preference
    from tuneloop.preference import score_pairs

    model, tokenizer = tiny
    rows = [
        pair(f"Question number {i}?", chosen=c, rejected=r)
        for i, (c, r) in enumerate(
            [("yes", "no"), ("a longer answer here", "short"), ("blue", "green and red"), ("one", "two")]
        )
    ]
    pairs = load_file(write(tmp_path / "p.jsonl", rows)).examples
    scored = score_pairs(model, tokenizer, pairs, batch_size=3)

    def summed(ex, answer):  # one sequence at a time, with the model's own loss
        enc = encode_preference(ex, tokenizer)
        ids = torch.tensor([enc["prompt_ids"] + enc[answer]])
        labels = ids.clone()
        labels[0, : len(enc["prompt_ids"])] = -100
        with torch.no_grad():
            loss = model(input_ids=ids, labels=labels).loss  # mean over the answer's tokens
        return -float(loss) * len(enc[answer])

    expected = [summed(ex, "chosen_ids") - summed(ex, "rejected_ids") for ex in pairs]
    assert scored["margins"] == pytest.approx(expected, abs=1e-4)
    assert scored["preference_win_rate"] == sum(m > 0 for m in expected) / 4
    assert scored["preference_margin"] == pytest.approx(sum(expected) / 4, abs=1e-4)
    # the same pairs the other way round: every win a loss
    swapped = [
        Example(**{**ex.to_dict(), "messages": [*ex.messages[:-1], ex.rejected], "rejected": ex.messages[-1]})
        for ex in pairs
    ]
    assert score_pairs(model, tokenizer, swapped)["preference_win_rate"] == 1 - scored["preference_win_rate"]
    with pytest.raises(ValueError, match="not preference pairs"):
        score_pairs(model, tokenizer, [Example(example_id="sft:1", completion="x", messages=pairs[0].messages)])


def test_each_objective_refuses_the_other_kind_of_rows(tmp_path, tiny):
    """A dpo run on supervised rows, or an sft run on pairs, stops with what to set, before
    any step; a pair whose prompt fills max_length is dropped and counted."""
    from tuneloop.training import TrainingError
    from tuneloop.training.dpo import encode_pairs
    from tuneloop.training.train import encode_all

    _, tokenizer = tiny
    pairs = load_file(write(tmp_path / "p.jsonl", [pair(), pair("a much longer question " * 20)])).examples
    sft = Example(example_id="sft:1", completion="hello", messages=chat_row()["messages"])
    with pytest.raises(TrainingError, match="sft:1 is not a preference pair: training.objective dpo trains on"):
        encode_pairs([*pairs, sft], tokenizer, 256, "train", print)
    with pytest.raises(TrainingError, match="p.jsonl:1 is a preference pair .*training.objective dpo"):
        encode_all(pairs, tokenizer, 256, "train")
    logged: list[str] = []
    rows = encode_pairs(pairs, tokenizer, 60, "train", logged.append)
    assert len(rows) == 1 and set(rows[0]) == {"prompt_ids", "chosen_ids", "rejected_ids"}
    assert "1 train pairs dropped: prompt fills max_length=60" in logged[0]


# ---------------------------------------------------------------------------------------
# feedback -> pairs (the API's side: tests/integration/test_request_log.py)


def logged_request(rid: str, prompt: str, answer: str, key: str = "k1", route: str = "/v1/chat/completions") -> dict:
    return {
        "kind": "request",
        "request_id": rid,
        "time": "2026-12-01T00:00:00.000Z",
        "route": route,
        "status": 200,
        "key_id": key,
        "prompt": [{"role": "user", "content": prompt}] if route != "/v1/completions" else prompt,
        "completions": [answer],
    }


def rating(fid: str, rid: str, value: int, key: str = "k1", second: int = 1, **more) -> dict:
    return {
        "kind": "feedback",
        "feedback_id": fid,
        "time": f"2026-12-01T00:00:{second:02d}.000Z",
        "request_id": rid,
        "key_id": key,
        "rating": value,
        "correction": None,
        "chosen": None,
        "rejected": None,
        **more,
    }


def test_ratings_of_answers_to_one_prompt_become_pairs():
    from tuneloop.requestlog.feedback import preference_examples

    requests = [
        logged_request("r1", "Name a colour.", "blue"),
        logged_request("r2", "Name a colour.", "seven"),
        logged_request("r3", "Name a colour.", "green"),
        logged_request("r4", "Name a colour.", "blue"),  # the same answer as r1, rated lower: no pair with it
        logged_request("r5", "Name a colour.", "red", key="k2"),  # another key's request: its own group
        logged_request("r6", "Name a fruit.", "pear"),  # alone under its prompt
        logged_request("r7", "2+2", "5", route="/v1/completions"),
    ]
    feedback = [
        rating("f1", "r1", 0, second=1),
        rating("f1b", "r1", 1, second=9),  # the latest rating of r1 wins
        rating("f2", "r2", -1),
        rating("f3", "r3", 1),
        rating("f4", "r4", 0),
        rating("f5", "r5", -1, key="k2"),
        rating("f6", "r6", 1),
        rating("f7", "r7", -1),
        rating("f8", "r2", 1, key="k2"),  # k2 rating k1's request
    ]
    rows, lineage = preference_examples(requests, feedback)

    pairs = [(r["preferred_output"][0]["content"], r["non_preferred_output"][0]["content"]) for r in rows]
    # every higher-rated answer over every lower one; r4's "blue" over "seven" is r1's pair again
    assert sorted(pairs) == [("blue", "seven"), ("green", "blue"), ("green", "seven")]
    assert lineage["sources"] == {"ratings": 3}
    assert lineage["rejected"] == {
        "the same pair as another feedback's": 1,
        "superseded by a later rating": 1,
        "a rating with no differently rated answer to the same prompt": 2,  # r5 (k2 alone), r6
        "a completions request: preference pairs are conversations": 1,
        "from another key than the request": 1,
    }
    assert all(row_problem(r, "dpo") is None for r in rows)  # each meets the data contract


def test_a_dpo_retrain_set_takes_the_feedbacks_preference_pairs(tmp_path):
    """The monitoring's retrain set for a base set of pairs: the base file and the feedback's
    pairs beside it, which prepare as one preference dataset."""
    from tuneloop.monitoring.run import retrain_dataset
    from tuneloop.requestlog.store import SegmentSink

    base = write(tmp_path / "prefs.jsonl", sentiment_preference_rows(12, seed=0))
    cfg = TuneloopConfig.model_validate(
        {"paths": {"home": str(tmp_path / "home")}, "data": {"train_path": str(base), "eval_fraction": 0.25}}
    )
    sink = SegmentSink(cfg.home / "requests", 1 << 20, 3600)
    sink.write("requests", [logged_request("req_1", "Is this review positive or negative?\nIt broke.", "positive")])
    sink.write(
        "feedback",
        [
            rating("fb_1", "req_1", -1, correction="negative"),
            rating("fb_2", "req_1", None, chosen="neg", rejected="pos"),
        ],
    )
    sink.close()

    out = retrain_dataset(cfg, tmp_path / "retrain", since=None)
    assert out["feedback_rows"] == 2 and out["feedback_ids"] == ["fb_2", "fb_1"]
    rows = [json.loads(line) for line in (Path(out["path"]) / "1-feedback.jsonl").read_text().splitlines()]
    assert [(r["preferred_output"][0]["content"], r["non_preferred_output"][0]["content"]) for r in rows] == [
        ("neg", "pos"),
        ("negative", "positive"),
    ]
    prepared = prepare_dataset(cfg, train_path=Path(out["path"]))
    assert prepared.preference and len(prepared.train) + len(prepared.eval) == 14
