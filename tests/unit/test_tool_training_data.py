"""Issue 37: fine-tuning data with tool calls, in OpenAI's chat fine-tuning format (`tools`,
assistant `tool_calls` with null content, `tool` messages answering a call id), loads,
passes the data contract (bad rows rejected with their line and why), survives the split
and the prepared dataset on disk, is encoded through tuneloop.chat_format exactly as the
server renders requests, with the loss on the `<tool_call>` text, and trains: a tiny model
fine-tuned on a few such rows writes the tool call format."""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path

import pytest

from tuneloop.chat_format import parse_tool_calls, render_chat
from tuneloop.config import BootstrapConfig, TuneloopConfig, ValidationConfig
from tuneloop.data.dataset import load_prepared, prepare_dataset, read_examples
from tuneloop.data.formats import load_file
from tuneloop.data.policies import TokenBudget, apply_pii_policy, truncate_to_fit
from tuneloop.data.schema import Example
from tuneloop.formatting import IGNORE_INDEX, count_tokens, encode_example, prompt_ids, prompt_text

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOLS = [WEATHER, TIME]


def call(call_id: str, name: str, arguments: dict | str) -> dict:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


def calling(*calls: dict, content: str | None = None, **fields) -> dict:
    return {"role": "assistant", "content": content, "tool_calls": list(calls), **fields}


def result(call_id: str, content: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def answer(text: str, **fields) -> dict:
    return {"role": "assistant", "content": text, **fields}


def weather_round_trip(city: str, temp: int) -> dict:
    """A call, its result and the answer: OpenAI's documented fine-tuning row with tools."""
    return {
        "messages": [
            {"role": "system", "content": "You are a weather assistant."},
            user(f"What is the weather in {city}?"),
            calling(call("call_1", "get_weather", {"city": city}), weight=1),
            result("call_1", json.dumps({"temp_c": temp, "sky": "clear"})),
            answer(f"It is {temp} degrees and clear in {city}."),
        ],
        "tools": TOOLS,
    }


def weather_call(city: str, i: int = 0) -> dict:
    """A row whose learnt turn is the call itself."""
    return {
        "messages": [
            user(f"What is the weather in {city}?"),
            calling(call(f"call_{i}", "get_weather", {"city": city})),
        ],
        "tools": [WEATHER],
    }


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def learnt_text(enc: dict, tokenizer) -> str:
    return tokenizer.decode([t for t, label in zip(enc["input_ids"], enc["labels"]) if label != IGNORE_INDEX])


CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def renders(ex: Example) -> bool:
    """Every message still renders: text content, or calls."""
    return all(isinstance(m.get("content"), str) or m.get("tool_calls") for m in ex.messages)


def load_example(row: dict) -> Example:
    """One row through the loader and the contract."""
    with tempfile.TemporaryDirectory() as d:
        loaded = load_file(write_jsonl(Path(d) / "row.jsonl", [row]))
    assert loaded.rejects == [], loaded.rejects
    return loaded.examples[0]


@pytest.fixture(scope="module")
def marked_model(tmp_path_factory) -> Path:
    """The bootstrap's model shape, untrained, small: its ChatML template marks the assistant
    turns ({% generation %}), so every assistant turn is learnt. A 2048-token vocabulary keeps
    the fallback tools prompt short (a few seconds to build)."""
    from tuneloop.bootstrap import bootstrap_base_model

    cfg = BootstrapConfig(vocab_size=2048, context_length=1024, n_layer=2, n_embd=64, n_head=2, steps=0, block_size=64)
    return bootstrap_base_model(cfg, tmp_path_factory.mktemp("base") / "tiny", progress=False)


def tokenizer_of(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


# ---------------------------------------------------------------------- loading and the contract


def test_openai_rows_with_tool_calls_load_and_pass_the_contract(tmp_path):
    parallel = {
        "messages": [
            user("Weather and time in Oslo?"),
            calling(call("a", "get_weather", {"city": "Oslo"}), call("b", "get_time", {"city": "Oslo"})),
            result("a", "-3 C, snow"),
            result("b", "14:05"),
            answer("It is 14:05 in Oslo, -3 C with snow."),
        ],
        "tools": TOOLS,
        "parallel_tool_calls": True,
    }
    f = write_jsonl(
        tmp_path / "tools.jsonl",
        [weather_round_trip("Paris", 21), weather_call("Oslo"), parallel, {"messages": [user("Hi"), answer("Hello")]}],
    )
    loaded = load_file(f)
    assert loaded.format == "chat" and loaded.rejects == []
    trip, final_call, par, plain = loaded.examples

    assert trip.tools == TOOLS and final_call.tools == [WEATHER] and plain.tools is None
    assert trip.messages[2] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [call("call_1", "get_weather", {"city": "Paris"})],
    }
    assert trip.messages[3] == result("call_1", '{"temp_c": 21, "sky": "clear"}')
    assert trip.completion == "It is 21 degrees and clear in Paris."
    assert trip.extra["message_fields"][2] == {"weight": 1}  # OpenAI's weight: kept, as before
    # A learnt turn that only calls a tool: its completion is the text the model writes for it.
    assert final_call.completion == CALL_TEXT
    assert par.extra == {"parallel_tool_calls": True}
    assert par.prompt_text.splitlines()[1] == "assistant: <tool_call>"  # calls are prompt text too (dedup, leakage)

    # Through to_dict/from_dict (the prepared dataset's train.jsonl) unchanged; rows without
    # tools are written as they always were.
    for ex in loaded.examples:
        assert Example.from_dict(json.loads(json.dumps(ex.to_dict()))) == ex
    assert "tools" in trip.to_dict() and "tools" not in plain.to_dict()
    # The tools are part of what the model sees: the same conversation with other tools is other data.
    assert trip.content_hash != Example(**{**trip.to_dict(), "tools": [WEATHER]}).content_hash
    # ... and a row without tools hashes as it always did (prepared datasets keep their fingerprints).
    seen = {"prompt": None, "messages": plain.messages, "completion": "Hello"}
    assert plain.content_hash == hashlib.sha256(json.dumps(seen, sort_keys=True).encode()).hexdigest()


def test_malformed_tool_rows_are_rejected_with_their_line_and_why(tmp_path):
    good = weather_call("Oslo")
    ask = user("Weather in Oslo?")
    ok = call("c1", "get_weather", {"city": "Oslo"})
    rows = [
        good,  # 1
        {"messages": [ask, calling(call("c1", "get_weather", '{"city": "Oslo"'))], "tools": TOOLS},  # 2
        {"messages": [ask, calling(call("c1", "get_weather", "[1, 2]"))], "tools": TOOLS},  # 3
        {"messages": [ask, calling(call("c1", "get_forecast", {"city": "Oslo"}))], "tools": TOOLS},  # 4
        {"messages": [ask, calling(ok), result("c2", "sunny"), answer("Sunny.")], "tools": TOOLS},  # 5
        {"messages": [ask, calling(ok), {"role": "tool", "content": "sunny"}, answer("Sunny.")]},  # 6
        {"messages": [{**ask, "tool_calls": [ok]}, answer("Sunny.")]},  # 7
        {"messages": [ask, answer("x")], "functions": [WEATHER["function"]]},  # 8
        {"messages": [ask, calling({"type": "function", "function": {"name": "get_weather", "arguments": "{}"}})]},  # 9
        {"messages": [ask, calling(ok), result("c1", "a"), result("c1", "b"), answer("Sunny.")]},  # 10
        {"messages": [ask, calling(ok)], "tools": {"get_weather": {}}},  # 11
        {"messages": [ask, {"role": "assistant", "content": None}]},  # 12
        {"messages": [ask, calling(ok), calling(ok)]},  # 13
        {"messages": [ask, calling(call("c1", "get_weather", {"city": "Oslo"}) | {"type": "code"})]},  # 14
        good,  # 15
    ]
    loaded = load_file(write_jsonl(tmp_path / "bad.jsonl", rows))
    assert [e.source_line for e in loaded.examples] == [1, 15]
    assert [(r.source_line, r.reason) for r in loaded.rejects] == [
        (
            2,
            "messages[1]: tool_calls[0]: function 'get_weather': 'arguments' is not valid JSON: "
            "Expecting ',' delimiter (column 16)",
        ),
        (3, "messages[1]: tool_calls[0]: function 'get_weather': 'arguments' must be a JSON object, got array"),
        (
            4,
            "messages[1]: tool_calls[0]: calls 'get_forecast', which is not among the row's tools (get_time, get_weather)",
        ),
        (5, "messages[2]: the tool message answers call id 'c2', which no earlier assistant message made"),
        (6, "messages[2]: a tool message needs 'tool_call_id': the id of the call it answers"),
        (7, "messages[0]: only an assistant message may carry 'tool_calls', not a 'user' message"),
        (
            8,
            "the legacy 'functions' / 'function_call' fields are not supported: "
            "list the functions under 'tools' and write the calls as 'tool_calls'",
        ),
        (9, "messages[1]: tool_calls[0]: missing field 'id'"),
        (10, "messages[3]: call id 'c1' is answered twice"),
        (11, "field 'tools' must be an array, got object"),
        (12, "messages[1]: field 'content' must be a string, got null"),
        (13, "messages[2]: tool_calls[0]: call id 'c1' is used twice in the conversation"),
        (14, "messages[1]: tool_calls[0]: unknown call type 'code' (expected 'function')"),
    ]
    assert json.loads(loaded.rejects[0].raw) == rows[1]  # the row as it was, nothing lost


def test_tool_rows_survive_the_split_and_the_prepared_dataset_on_disk(tmp_path):
    rows = [weather_round_trip(city, t) for city, t in [("Paris", 21), ("Oslo", -3), ("Lima", 18), ("Rome", 25)]]
    rows += [weather_call(city, i) for i, city in enumerate(["Kyiv", "Cairo", "Quito", "Hanoi"])]
    f = write_jsonl(tmp_path / "tools.jsonl", rows)
    cfg = TuneloopConfig.model_validate({"paths": {"home": str(tmp_path / "home")}, "data": {"eval_fraction": 0.25}})
    ds = prepare_dataset(cfg, train_path=f)
    # (near-duplicate questions are grouped on one side of the split: how many go where is the split's business)
    assert ds.rejects == [] and len(ds.train) + len(ds.eval) == 8 and ds.train and ds.eval
    assert all(e.tools for e in ds.train + ds.eval)
    back = load_prepared(ds.dir)  # checks the fingerprint of what it read
    assert back.fingerprint == ds.fingerprint and back.train == ds.train and back.eval == ds.eval
    assert read_examples(ds.train_path)[0].messages == ds.train[0].messages
    # The tools are in the fingerprint: other tools, another dataset.
    other = write_jsonl(tmp_path / "other.jsonl", [{**r, "tools": [WEATHER]} for r in rows])
    assert prepare_dataset(cfg, train_path=other).fingerprint != ds.fingerprint


def test_length_policy_drops_whole_tool_turns_and_redaction_keeps_valid_arguments():
    ex = load_example(weather_round_trip("Paris", 21))
    earlier = [user("Hello there " * 20), answer("Hi.")]
    longer = Example(**{**ex.to_dict(), "messages": ex.messages[:1] + earlier + ex.messages[1:]})

    def turns(e: Example) -> int:
        return sum(m["role"] != "system" for m in e.messages)

    # The earliest turns go whole: the old exchange, then the question with the call it made
    # (a call is never cut in half); the call's result stays as what the answer answers.
    cut = truncate_to_fit(longer, TokenBudget(count=turns, limit=3))
    assert cut.messages == [ex.messages[0], ex.messages[3], ex.messages[4]]
    assert cut.completion == ex.completion and renders(cut)
    cut = truncate_to_fit(longer, TokenBudget(count=turns, limit=5))
    assert cut.messages == ex.messages  # the old exchange went, the question with its call stayed

    mail = load_example(
        {
            "messages": [
                user("Mail Jane"),
                calling(call("m", "send_mail", {"to": "jane.roe@fastmail.com", "body": "Hi"})),
            ]
        }
    )
    kept, touched = apply_pii_policy(
        [mail], ValidationConfig(pii="redact"), lambda: lambda t: t.replace("jane.roe@fastmail.com", "<EMAIL_ADDRESS>")
    )
    assert [r.action for r in touched] == ["redacted"]
    (redacted,) = kept
    args = json.loads(redacted.messages[-1]["tool_calls"][0]["function"]["arguments"])
    assert args == {"to": "<EMAIL_ADDRESS>", "body": "Hi"}
    assert (
        redacted.completion
        == '<tool_call>\n{"name": "send_mail", "arguments": {"to": "<EMAIL_ADDRESS>", "body": "Hi"}}\n</tool_call>'
    )


# ---------------------------------------------------------------------- encoding


@pytest.mark.parametrize("model", ["marked", "unmarked"])
def test_tool_calls_are_learnt_as_their_call_text_through_the_servers_rendering(model, marked_model, tiny_model_dir):
    """marked: the template marks assistant turns, every one is learnt (the call and the answer);
    unmarked (the serving tests' tiny model): the prefix is masked, the last turn is learnt."""
    tok = tokenizer_of(marked_model if model == "marked" else tiny_model_dir)
    trip = load_example(weather_round_trip("Oslo", -3))
    final_call = load_example(weather_call("Oslo"))

    # Train and serve agree: the training prompt is what the server renders for these messages.
    for ex in (trip, final_call):
        assert prompt_text(ex, tok) == render_chat(tok, ex.messages[:-1], ex.tools, add_generation_prompt=True)
        assert "<tools>" in prompt_text(ex, tok) and '"name": "get_weather"' in prompt_text(ex, tok)
        assert prompt_ids(ex, tok) == tok(prompt_text(ex, tok), add_special_tokens=False)["input_ids"]

    # The marked template learns the turn and its end marker; prefix masking learns the rest of
    # the conversation after the prompt (the tiny template's newline after the marker too).
    end = "<|im_end|>" if model == "marked" else "<|im_end|>\n"
    enc = encode_example(final_call, tok, 4096)
    assert learnt_text(enc, tok) == CALL_TEXT + end
    assert len(enc["input_ids"]) == count_tokens(final_call, tok)
    assert enc["input_ids"][: len(prompt_ids(final_call, tok))] == prompt_ids(final_call, tok)

    enc = encode_example(trip, tok, 4096)
    learnt = learnt_text(enc, tok)
    last = "It is -3 degrees and clear in Oslo." + end
    if model == "marked":
        assert learnt == CALL_TEXT + end + last  # both assistant turns, nothing else
    else:
        assert learnt == last
    assert "temp_c" not in learnt and "<tool_response>" not in learnt  # tool results are input, never learnt
    assert len(enc["input_ids"]) == count_tokens(trip, tok)


# A template that renders tools itself (as Qwen2.5's or Hermes' do), with its assistant turns marked.
NATIVE_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nFunctions:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|im_start|>assistant\n{% generation %}{{ m.content }}"
    "{%- for c in m.tool_calls or [] %}<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}\n</tool_call>{% endfor %}<|im_end|>{% endgeneration %}\n"
    "{%- elif m.role == 'tool' %}<|im_start|>tool\n{{ m.content }}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_renders_tools_itself_gets_them_natively(marked_model):
    tok = tokenizer_of(marked_model)
    tok.chat_template = NATIVE_TEMPLATE
    trip = load_example(weather_round_trip("Oslo", -3))
    prompt = prompt_text(trip, tok)
    assert prompt == render_chat(tok, trip.messages[:-1], trip.tools, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\nFunctions: get_weather get_time<|im_end|>")
    assert "<|im_start|>tool\n" in prompt and "<tools>" not in prompt  # no fallback format
    enc = encode_example(trip, tok, 4096)
    learnt = learnt_text(enc, tok)
    call_text, end = learnt.split("<|im_end|>", 1)
    assert json.loads(call_text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")) == {
        "name": "get_weather",
        "arguments": {"city": "Oslo"},
    }
    assert end == "It is -3 degrees and clear in Oslo.<|im_end|>"
    assert len(enc["input_ids"]) == count_tokens(trip, tok)


@pytest.mark.parametrize("model", ["marked", "unmarked"])
def test_a_conversation_without_tools_encodes_exactly_as_the_plain_chat_template(model, marked_model, tiny_model_dir):
    tok = tokenizer_of(marked_model if model == "marked" else tiny_model_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        user("2+2?"),
        answer("4"),
        user("And 3+3? <tool_call> is only text here"),
        answer("6"),
    ]
    ex = Example(example_id="plain:1", completion="6", messages=messages)

    def ids(out) -> list[int]:
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    prompt = ids(tok.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=True))
    whole = ids(tok.apply_chat_template(messages, tokenize=True))
    assert prompt_ids(ex, tok) == prompt
    assert prompt_text(ex, tok) == tok.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=False)
    enc = encode_example(ex, tok, 4096)
    assert enc["input_ids"] == whole and count_tokens(ex, tok) == len(whole)
    if model == "marked":
        mask = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert enc["labels"] == [t if m else IGNORE_INDEX for t, m in zip(whole, mask["assistant_masks"])]
    else:
        assert enc["labels"] == [IGNORE_INDEX] * len(prompt) + whole[len(prompt) :]
    assert encode_example(ex, tok, 10)["input_ids"] == whole[:10]


# ---------------------------------------------------------------------- training


@pytest.mark.slow
def test_a_tiny_fine_tune_learns_to_write_tool_calls(tmp_path, marked_model):
    """Four rows whose answer is a get_weather call, through the real loader and the real
    training job (python -m tuneloop.training.train, one process, CPU): the loss on the
    assistant tokens falls from ~5.5 to under 1 and greedy generation on the training
    prompts writes call blocks the server's parser reads back as get_weather calls."""
    import torch
    from transformers import AutoModelForCausalLM

    from tuneloop.config import TrainingConfig
    from tuneloop.formatting import clean_completion
    from tuneloop.training import TrainSpec, launch_training

    cities = ["Paris", "Oslo", "Lima", "Rome"]
    loaded = load_file(write_jsonl(tmp_path / "tools.jsonl", [weather_call(c, i) for i, c in enumerate(cities)]))
    assert loaded.rejects == []
    train_path = write_jsonl(tmp_path / "train.jsonl", [e.to_dict() for e in loaded.examples])
    training = TrainingConfig(
        per_device_batch_size=4,
        learning_rate=5e-3,
        warmup_ratio=0.0,
        max_steps=60,
        logging_steps=10,
        save_steps=1000,
        max_length=1024,
    )
    spec = TrainSpec(
        name="tools",
        base_model=str(marked_model),
        train_path=str(train_path),
        eval_path=None,
        output_dir=str(tmp_path / "run"),
        training=training.model_dump(mode="json"),
    )
    log: list[str] = []
    done = launch_training(spec, on_log=log.append)
    losses = [loss for _, loss in done.train_result["loss_history"]]
    assert losses[0] > 4 and losses[-1] < 1, losses

    model = AutoModelForCausalLM.from_pretrained(done.model_dir)
    tok = tokenizer_of(done.model_dir)
    wrote = []
    for ex in read_examples(train_path):
        ids = torch.tensor([prompt_ids(ex, tok)])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False, pad_token_id=tok.pad_token_id
        )
        wrote.append(clean_completion(tok.decode(out[0, ids.shape[1] :]), tok))
    for text in wrote:
        content, calls = parse_tool_calls(text, {"get_weather"})
        assert content == "" and [c.name for c in calls] == ["get_weather"], wrote
        assert set(json.loads(calls[0].arguments)) == {"city"}, wrote
    # Most rows come back word for word (a 2-layer model may swap a city it has not yet
    # learnt to copy from the question).
    assert sum(w == ex.completion for w, ex in zip(wrote, loaded.examples)) >= 2, wrote
