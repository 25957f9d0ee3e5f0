"""The agreement check (tuneloop/serving/agreement.py): a served configuration against
transformers' float32 forward of the same model, on the demo model (SmolLM2's check is in
test_real_model.py). The default passes the bar; the full-bfloat16 fused forward does not."""

from __future__ import annotations

import pytest

from tuneloop.config import ServingConfig
from tuneloop.serving import agreement

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(demo_base_model):
    # The demo's bootstrap model answers every chat prompt with newlines (it was never taught
    # to chat): its greedy check uses plain-text prompts from the committed text instead.
    return agreement.Reference(demo_base_model, prompts=agreement.text_prompts())


def test_the_committed_sets_are_big_enough():
    prompts = agreement.load_prompts()
    assert len(prompts) >= 24 and prompts[0]["messages"][0]["content"] == "What is the capital of France?"
    assert len({p["id"] for p in prompts}) == len(prompts)
    assert len(agreement.TEXT.read_text().split()) >= 2000


def test_the_default_configuration_passes_the_bar(reference):
    report = reference.compare(ServingConfig())
    assert report.passes, report.line()
    assert report.exact == report.prompts == 24 and report.top1 >= 0.999 and report.tokens >= 2000
    assert report.word_prefix == 1.0 and "fused" in report.label


def test_the_full_bfloat16_fused_forward_fails_it(reference):
    """bfloat16 everywhere (weights, activations, cache): the reference's next token differs
    on more than 1 % of the committed text, so the bar refuses it."""
    report = reference.compare(ServingConfig(dtype="bfloat16-lossy", forward="fused"))
    assert not report.passes, report.line()
    assert report.top1 < agreement.BAR_TOP1 and report.kl > 1e-6
    assert report.label == "slots fused bfloat16"


def test_word_prefix_and_the_bar_arithmetic():
    assert agreement.word_prefix("The capital is Paris.", "The capital is Paris.") == 1.0
    assert agreement.word_prefix("The capital is Paris.", "The capital of France") == 0.5
    assert agreement.word_prefix("", "") == 1.0 and agreement.word_prefix("", "x") == 0.0
    base = dict(label="x", model="m", word_prefix=1.0, kl=0.0, tokens=2000, seconds=0.0)
    assert agreement.AgreementReport(exact=23, prompts=24, top1=0.99, **base).passes
    assert not agreement.AgreementReport(exact=22, prompts=24, top1=0.999, **base).passes
    assert not agreement.AgreementReport(exact=24, prompts=24, top1=0.989, **base).passes
    assert agreement.AgreementReport(exact=31, prompts=32, top1=0.995, **base).passes  # at most 1 in 24 differ
    assert not agreement.AgreementReport(exact=30, prompts=32, top1=0.995, **base).passes
