"""The bootstrapped base model: loadable, chat-ready, cached, and actually pre-trained."""

import shutil
import time
from pathlib import Path

import pytest

from tuneloop import bootstrap
from tuneloop.bootstrap import MARKER_FILE, BootstrapError, bootstrap_base_model, read_marker
from tuneloop.config import BootstrapConfig

# Small enough to build in a few seconds on 2 cores, big enough for the loss to move.
SMALL = dict(vocab_size=512, n_layer=2, n_embd=64, n_head=4, steps=30, batch_size=8, block_size=64)

CONVERSATION = [
    {"role": "system", "content": "Answer in one sentence."},
    {"role": "user", "content": "What is a tuple?"},
    {"role": "assistant", "content": "An immutable sequence."},
    {"role": "user", "content": "And a list?"},
    {"role": "assistant", "content": " A mutable one,\nusually."},
]


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in folder.iterdir()}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("models") / "tiny-base"
    cfg = BootstrapConfig(**SMALL)
    return cfg, bootstrap_base_model(cfg, out, progress=False)


@pytest.mark.slow
def test_folder_is_a_standard_hf_model_that_generates(built):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg, path = built
    for name in ["config.json", "model.safetensors", "generation_config.json", "tokenizer.json", MARKER_FILE]:
        assert (path / name).is_file(), name
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == "gpt2" and model.config.n_layer == cfg.n_layer
    assert model.config.vocab_size == len(tokenizer) == cfg.vocab_size
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert model.config.pad_token_id == tokenizer.pad_token_id
    # Generation stops at the end of a chat turn as well as at the end of a text.
    assert set(model.generation_config.eos_token_id) == {
        tokenizer.eos_token_id,
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
    }

    inputs = tokenizer("The for statement", return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 12
    assert tokenizer.decode(out[0], skip_special_tokens=True).startswith("The for statement")


@pytest.mark.slow
def test_tokenizer_has_special_tokens_and_a_chat_template(built):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built[1])
    assert tokenizer.eos_token == tokenizer.bos_token == "<|endoftext|>"
    assert tokenizer.pad_token == "<|pad|>" and tokenizer.pad_token_id != tokenizer.eos_token_id
    for token in ["<|im_start|>", "<|im_end|>"]:
        assert tokenizer.convert_ids_to_tokens(tokenizer.convert_tokens_to_ids(token)) == token
        assert len(tokenizer(token, add_special_tokens=False)["input_ids"]) == 1

    text = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert text == (
        "<|im_start|>system\nAnswer in one sentence.<|im_end|>\n"
        "<|im_start|>user\nWhat is a tuple?<|im_end|>\n"
        "<|im_start|>assistant\nAn immutable sequence.<|im_end|>\n"
        "<|im_start|>user\nAnd a list?<|im_end|>\n"
        "<|im_start|>assistant\n A mutable one,\nusually.<|im_end|>\n"
    )
    # The generation prompt is the header of the next assistant turn, so a prompt is a
    # prefix of the conversation that answers it.
    prompt = tokenizer.apply_chat_template(CONVERSATION[:-1], tokenize=False, add_generation_prompt=True)
    assert text.startswith(prompt) and prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_assistant_mask_marks_exactly_the_assistant_turns(built):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built[1])
    out = tokenizer.apply_chat_template(CONVERSATION, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert len(mask) == len(ids)
    # Split the masked tokens into runs: one per assistant turn, content plus its <|im_end|>.
    runs, current = [], []
    for token, marked in zip(ids, mask):
        if marked:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    assert [tokenizer.decode(r) for r in runs] == [
        "An immutable sequence.<|im_end|>",
        " A mutable one,\nusually.<|im_end|>",
    ]
    assert sum(mask) == sum(len(r) for r in runs)


@pytest.mark.slow
def test_second_call_is_a_cache_hit(built):
    cfg, path = built
    before = snapshot(path)
    started = time.perf_counter()
    assert bootstrap_base_model(BootstrapConfig(**SMALL), path, progress=False) == path
    assert time.perf_counter() - started < 1.0
    assert snapshot(path) == before  # same files, same inodes, untouched


@pytest.mark.slow
def test_changed_config_rebuilds_in_place(built, tmp_path):
    cfg, path = built
    copy = tmp_path / "tiny-base"
    shutil.copytree(path, copy)
    old_marker = read_marker(copy)

    changed = BootstrapConfig(**{**SMALL, "seed": 1, "steps": 5})
    assert bootstrap_base_model(changed, copy, progress=False) == copy
    new_marker = read_marker(copy)
    assert new_marker["config_hash"] != old_marker["config_hash"]
    assert new_marker["config"]["seed"] == 1 and new_marker["config"]["steps"] == 5
    # Built beside and swapped in: no half-built or old folders are left behind.
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == ["tiny-base"]

    # force=True rebuilds even an up-to-date folder.
    before = snapshot(copy)
    bootstrap_base_model(changed, copy, force=True, progress=False)
    assert snapshot(copy)["model.safetensors"] != before["model.safetensors"]


@pytest.mark.slow
def test_pretraining_lowers_the_loss(built):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg, path = built
    marker = read_marker(path)
    assert marker["final_val_loss"] < marker["initial_val_loss"] - 0.5

    # Independently of the marker: the saved weights predict held-out-style text better
    # than the same architecture freshly initialised.
    from pydoc_data.topics import topics

    tokenizer = AutoTokenizer.from_pretrained(path)
    trained = AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(123)
    untrained = AutoModelForCausalLM.from_config(trained.config)
    ids = tokenizer(topics["for"], return_tensors="pt", add_special_tokens=False)["input_ids"][:, :256]

    def loss(model):
        with torch.no_grad():
            return model.eval()(input_ids=ids, labels=ids).loss.item()

    assert loss(trained) < loss(untrained) - 0.5


@pytest.mark.slow
def test_llama_architecture_builds_and_generates(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = BootstrapConfig(**{**SMALL, "architecture": "llama", "steps": 3})
    path = bootstrap_base_model(cfg, tmp_path / "llama-base", progress=False)
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.config.model_type == "llama"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = model.generate(**prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.shape[1] == prompt["input_ids"].shape[1] + 4


def test_refuses_to_overwrite_a_folder_it_did_not_build(tmp_path):
    foreign = tmp_path / "my-model"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(BootstrapError, match="refusing to overwrite"):
        bootstrap_base_model(BootstrapConfig(**SMALL), foreign, progress=False)
    assert (foreign / "notes.txt").read_text() == "mine"


def test_interrupted_build_leaves_nothing_that_looks_finished(tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):  # simulate Ctrl-C in the middle of pre-training
        raise KeyboardInterrupt

    monkeypatch.setattr(bootstrap, "pretrain", interrupted)
    with pytest.raises(KeyboardInterrupt):
        bootstrap_base_model(BootstrapConfig(**SMALL), tmp_path / "tiny-base", progress=False)
    assert [p for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_config_hash_ignores_where_the_model_goes():
    a = BootstrapConfig(**SMALL)
    assert bootstrap.bootstrap_config_hash(a) == bootstrap.bootstrap_config_hash(
        BootstrapConfig(**SMALL, output_dir=Path("/elsewhere"))
    )
    assert bootstrap.bootstrap_config_hash(a) != bootstrap.bootstrap_config_hash(
        BootstrapConfig(**{**SMALL, "n_layer": 3})
    )
