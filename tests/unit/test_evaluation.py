"""Evaluation metrics, evaluate_model on a real tiny model, and the run report."""

import json
import math

import pytest

from tuneloop.blessing import bless
from tuneloop.config import BootstrapConfig, EvaluationConfig, MetricThreshold
from tuneloop.data.schema import Example
from tuneloop.evaluation import (
    answer_tokens,
    evaluate_model,
    exact_match,
    lcs_length,
    normalize_answer,
    rouge_l,
    token_f1,
)
from tuneloop.report import write_report

# ---- metric functions ------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,expected",
    [
        ("  Positive.  ", "positive"),
        ("Yes!!", "yes"),
        ("New   York\n City", "new york city"),
        ("e.g. this...", "e.g. this"),
        ("STRASSE", "strasse"),
        ("Straße", "strasse"),  # casefold, not lower
        ("", ""),
        ("?!", ""),
        ("(a) b", "(a) b"),  # only trailing punctuation goes
    ],
)
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


@pytest.mark.parametrize(
    "pred,ref,em",
    [
        ("Positive", "positive.", 1.0),
        ("positive", "negative", 0.0),
        ("the cat", "cat", 0.0),
        ("", "", 1.0),
    ],
)
def test_exact_match(pred, ref, em):
    assert exact_match(pred, ref) == em


@pytest.mark.parametrize(
    "pred,ref,f1",
    [
        ("the cat sat", "the cat sat", 1.0),
        ("the cat", "the cat sat on the mat", 2 * (2 / 2) * (2 / 6) / (2 / 2 + 2 / 6)),
        ("cat cat cat", "cat", 2 * (1 / 3) * 1 / (1 / 3 + 1)),  # overlap counts multiplicity
        ("dog", "cat", 0.0),
        ("", "cat", 0.0),
        ("", "", 1.0),
        ("Cat, sat.", "cat sat", 1.0),  # punctuation at word edges ignored
    ],
)
def test_token_f1(pred, ref, f1):
    assert token_f1(pred, ref) == pytest.approx(f1)


def test_answer_tokens_trim_word_edges_only():
    assert answer_tokens("Hello, world! It's (fine).") == ["hello", "world", "it's", "fine"]


@pytest.mark.parametrize(
    "a,b,n",
    [
        ("a b c d", "a c d", 3),
        ("a b c", "c b a", 1),
        ("a b c", "", 0),
        ("x y", "x y", 2),
        ("a x b y c", "a b c", 3),
    ],
)
def test_lcs_length(a, b, n):
    assert lcs_length(a.split(), b.split()) == n == lcs_length(b.split(), a.split())


@pytest.mark.parametrize(
    "pred,ref,score",
    [
        ("the cat sat on the mat", "the cat sat on the mat", 1.0),
        # LCS "the cat on the mat" = 5; P = 5/5, R = 5/6
        ("the cat on the mat", "the cat sat on the mat", 2 * 1 * (5 / 6) / (1 + 5 / 6)),
        # order matters for ROUGE-L, not for token F1: LCS "the cat the" = 3 of 6 both ways
        ("mat the on sat cat the", "the cat sat on the mat", 0.5),
        ("dog", "cat", 0.0),
        ("", "", 1.0),
    ],
)
def test_rouge_l(pred, ref, score):
    assert rouge_l(pred, ref) == pytest.approx(score)
    assert token_f1("mat the on sat cat the", "the cat sat on the mat") == 1.0


# ---- evaluate_model on a real tiny model ------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """The real bootstrap builder, untrained (steps=0) and shrunk: ~7 s on 2 cores."""
    from tuneloop.bootstrap import bootstrap_base_model

    cfg = BootstrapConfig(vocab_size=300, n_layer=2, n_embd=64, n_head=2, context_length=128, block_size=32, steps=0)
    return bootstrap_base_model(cfg, tmp_path_factory.mktemp("models") / "tiny", progress=False)


def make_examples(n=10):
    out = []
    for i in range(n):
        if i % 2:
            out.append(
                Example(
                    example_id=f"chat.jsonl:{i + 1}",
                    completion=f"answer number {i}",
                    messages=[
                        {"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "question " + "word " * i},
                        {"role": "assistant", "content": f"answer number {i}"},
                    ],
                )
            )
        else:
            out.append(
                Example(
                    example_id=f"legacy.jsonl:{i + 1}",
                    prompt=f"Review {i}: fine " * (1 + i % 3),
                    completion=" Positive",
                )
            )
    return out


def test_evaluate_model_whole_split(tiny_model):
    examples = make_examples(10)
    cfg = EvaluationConfig(max_new_tokens=6, batch_size=4)
    result = evaluate_model(tiny_model, examples, cfg, progress=False)
    m = result.metrics
    assert m["num_examples"] == 10 and len(result.rows) == 10, "the whole split, no sampling"
    assert [r.id for r in result.rows] == [e.example_id for e in examples], "rows keep the input order"
    assert math.isfinite(m["eval_loss"]) and m["eval_loss"] > 0
    assert m["perplexity"] == pytest.approx(math.exp(m["eval_loss"]))
    assert m["eval_tokens"] > 10 and m["generated_tokens"] > 0
    assert m["ms_per_token"] > 0 and m["tokens_per_second"] == pytest.approx(1000 / m["ms_per_token"])
    for row in result.rows:
        assert row.em == exact_match(row.generation, row.reference)
        assert row.f1 == token_f1(row.generation, row.reference)
        assert 1 <= row.generated_tokens <= 6
    assert m["exact_match"] == pytest.approx(sum(r.em for r in result.rows) / 10)
    assert result.rows[1].prompt.startswith("<|im_start|>system") and result.rows[0].reference == "Positive"
    json.dumps(result.to_dict())  # serialisable as is, for MLflow / Prefect artifacts

    limited = evaluate_model(tiny_model, examples, EvaluationConfig(max_new_tokens=2, max_examples=3), progress=False)
    assert limited.metrics["num_examples"] == 3


def test_loss_matches_training_masking_and_hf_loss(tiny_model):
    """Split-level loss == token-weighted mean of HF's own per-example loss on encode_example."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tuneloop.formatting import IGNORE_INDEX, encode_example

    examples = make_examples(6)
    result = evaluate_model(tiny_model, examples, EvaluationConfig(max_new_tokens=1, batch_size=4), progress=False)
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model)
    total, count = 0.0, 0
    for ex in examples:
        enc = encode_example(ex, tok, 128)
        labels = torch.tensor([enc["labels"]])
        n = int((labels[:, 1:] != IGNORE_INDEX).sum())
        with torch.no_grad():
            loss = model(input_ids=torch.tensor([enc["input_ids"]]), labels=labels).loss.item()
        total, count = total + loss * n, count + n
    assert result.metrics["eval_tokens"] == count
    assert result.metrics["eval_loss"] == pytest.approx(total / count, rel=1e-4)


def test_batched_generation_equals_one_at_a_time(tiny_model):
    examples = make_examples(8)
    batched = evaluate_model(tiny_model, examples, EvaluationConfig(max_new_tokens=8, batch_size=8), progress=False)
    single = evaluate_model(tiny_model, examples, EvaluationConfig(max_new_tokens=8, batch_size=1), progress=False)
    assert [r.generation for r in batched.rows] == [r.generation for r in single.rows]
    assert batched.metrics["eval_loss"] == pytest.approx(single.metrics["eval_loss"], rel=1e-4)


def test_references_equal_to_generations_score_perfectly(tiny_model):
    examples = make_examples(6)
    first = evaluate_model(tiny_model, examples, EvaluationConfig(max_new_tokens=8), progress=False)
    echoed = [
        Example(example_id=e.example_id, prompt=e.prompt, messages=e.messages, completion=r.generation)
        for e, r in zip(examples, first.rows)
        if r.generation
    ]
    assert echoed, "the tiny model generated only empty answers"
    again = evaluate_model(tiny_model, echoed, EvaluationConfig(max_new_tokens=8), progress=False)
    assert again.metrics["exact_match"] == 1.0 and again.metrics["token_f1"] == 1.0 and again.metrics["rouge_l"] == 1.0


def test_evaluate_real_t0_rows(tiny_model, shared_data):
    path = shared_data / "t0-amazon-polarity" / "amazon_polarity_Is_this_review.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()[:6]]
    examples = [
        Example(example_id=f"{path.name}:{i + 1}", prompt=r["prompt"], completion=r["completion"])
        for i, r in enumerate(rows)
    ]
    result = evaluate_model(tiny_model, examples, EvaluationConfig(max_new_tokens=4), progress=False)
    # The literal <|endoftext|> of the legacy format is an end marker, not part of the answer.
    assert {r.reference for r in result.rows} <= {"Positive", "Negative"}
    assert result.metrics["num_examples"] == 6 and math.isfinite(result.metrics["eval_loss"])
    # Long reviews exceed the 128-token context: prompts are cut from the left, and counted.
    assert result.metrics["prompts_truncated"] >= 1


def test_empty_split_is_a_clear_error(tiny_model):
    with pytest.raises(ValueError, match="eval split is empty"):
        evaluate_model(tiny_model, [], EvaluationConfig(), progress=False)


# ---- report ------------------------------------------------------------------------------


def test_write_report(tmp_path):
    table = {
        "challenger": {"exact_match": 0.5, "token_f1": 0.6, "eval_loss": 1.9, "perplexity": 6.7, "num_examples": 40.0},
        "champion": {"exact_match": 0.4, "token_f1": 0.55, "eval_loss": 2.1, "perplexity": 8.2, "num_examples": 40.0},
        "base": {"exact_match": 0.0, "token_f1": 0.05, "eval_loss": 4.0, "perplexity": 54.6, "num_examples": 40.0},
    }
    threshold = MetricThreshold.model_validate(
        {"metric": "exact_match", "change_threshold": {"direction": "higher_is_better", "absolute": 0.0}}
    )
    blessing = bless(table["challenger"], table["champion"], [threshold], baseline_version="3")
    histories = {
        "lr=1e-3": [{"loss": 3.0, "step": 10}, {"loss": 2.5, "step": 20}, {"eval_loss": 2.4, "step": 20}],
        "lr=3e-3": [(10, 2.8), (20, 2.2)],
    }
    paths = write_report(tmp_path / "report", histories, table, blessing)
    for key in ("summary", "training_loss", "metrics_comparison"):
        assert paths[key].exists() and paths[key].stat().st_size > 0
    assert paths["training_loss"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = paths["summary"].read_text()
    assert "**Decision:** BLESSED (compared against champion v3)" in md
    assert "| metric | challenger | champion | base |" in md and "| exact_match | 0.5 | 0.4 | 0 |" in md
    assert "| eval_loss ↓ |" in md and "| lr=3e-3 | 2.2 |" in md
    assert blessing.reasons[0] in md

    # One plain history and no blessing also work (e.g. a training-only run).
    paths = write_report(tmp_path / "r2", [3.0, 2.0, 1.5], {"candidate": {"exact_match": 0.1}}, None)
    assert "not evaluated for promotion" in paths["summary"].read_text()


# ---- short labels: normalised accuracy, the majority floor, per template / label, predictions
@pytest.mark.parametrize(
    "pred,ref,match",
    [
        ("Billing.", "Billing", 1.0),
        ("  billing\nThe customer was charged twice", "Billing", 1.0),
        ("Science and Technology", "Science and technology<|endoftext|>", 1.0),
        ("\n\n**Sales**", "Sales", 1.0),
        ("Bill", "Billing", 0.0),
        ("Billing department", "Billing", 0.0),
    ],
)
def test_label_match(pred, ref, match):
    from tuneloop.evaluation import label_match

    assert label_match(pred, ref) == match


def _row(i, ref, gen, template=None, label=None):
    from tuneloop.evaluation import EvalRow, exact_match, label_match

    return EvalRow(
        id=f"r{i}",
        prompt="p",
        reference=ref,
        generation=gen,
        em=exact_match(gen, ref),
        f1=0.0,
        rouge_l=0.0,
        generated_tokens=1,
        label_match=label_match(gen, ref),
        template=template,
        label=label,
    )


def test_majority_and_per_template_label_metrics():
    from tuneloop.evaluation import label_metrics

    rows = [
        _row(0, "Yes", "Yes", "a", "pos"),
        _row(1, "Yes", "No", "a", "pos"),
        _row(2, "No", "No", "a", "neg"),
        _row(3, "Positive", "Positive.", "b", "pos"),
        _row(4, "Negative", "Positive", "b", "neg"),
        _row(5, "Negative", "negative", "b", "neg"),
    ]
    m = label_metrics(rows)
    assert m["majority_label"] == pytest.approx(2 / 6)  # "Yes" or "Negative": 2 rows each
    assert m["majority_label_per_template"] == pytest.approx((2 + 2) / 6)
    assert m["label_accuracy/template:a"] == pytest.approx(2 / 3) and m["label_accuracy/template:b"] == pytest.approx(
        2 / 3
    )
    assert m["label_accuracy/label:pos"] == pytest.approx(2 / 3) and m["label_accuracy/label:neg"] == pytest.approx(
        2 / 3
    )
    assert label_metrics([_row(0, "x", "x")]) == {"majority_label": 1.0}  # no fields: no breakdown


def test_evaluation_reads_template_and_label_fields(tiny_model):
    examples = make_examples(6)
    for i, ex in enumerate(examples):
        ex.extra = {"template": f"t{i % 2}", "label": "L"}
    result = evaluate_model(tiny_model, examples, EvaluationConfig(max_new_tokens=2), progress=False)
    m = result.metrics
    assert {
        "label_accuracy",
        "majority_label",
        "majority_label_per_template",
        "label_accuracy/template:t0",
        "label_accuracy/template:t1",
        "label_accuracy/label:L",
    } <= set(m)
    from tuneloop.evaluation import predictions

    preds = predictions(result)
    assert [p["id"] for p in preds] == [e.example_id for e in examples]
    assert set(preds[0]) == {"id", "template", "label", "expected", "generated", "exact_match", "label_match"}


def test_report_shows_wrong_answers_first_beside_the_other_models_redacted(tmp_path):
    def pred(i, expected, generated):
        return {
            "id": f"eval.jsonl:{i}",
            "template": "t",
            "label": None,
            "expected": expected,
            "generated": generated,
            "exact_match": generated == expected,
            "label_match": generated == expected,
        }

    predictions = {
        "base": [pred(1, "Billing", "I cannot say"), pred(2, "Sales", "mail jane.doe@gmail.com")],
        "cand-0": [pred(1, "Billing", "Billing"), pred(2, "Sales", "Contact jane.doe@gmail.com")],
    }
    paths = write_report(
        tmp_path,
        None,
        {"base": {"exact_match": 0.0}, "cand-0": {"exact_match": 0.5}},
        None,
        challenger="cand-0",
        predictions=predictions,
        notes=["kept checkpoint: step 40"],
    )
    md = paths["summary"].read_text()
    assert "cand-0 1 of 2" in md and "base 2 of 2" in md and "- kept checkpoint: step 40" in md
    table = md[md.index("### cand-0's wrong answers") :]
    assert "| row | expected | cand-0 | base |" in table
    first = next(line for line in table.splitlines() if line.startswith("| eval.jsonl"))
    assert first.startswith("| eval.jsonl:2 (t) | `Sales` | `Contact <EMAIL>` ✗ | `mail <EMAIL>` ✗")
    assert "eval.jsonl:1" not in table  # answered right by the challenger
    stored = paths["predictions:cand-0"].read_text()
    assert "jane.doe@gmail.com" not in stored and "<EMAIL>" in stored and len(stored.splitlines()) == 2


def test_rows_from_several_files_take_the_file_as_their_template(tiny_model):
    examples = make_examples(4)
    for i, ex in enumerate(examples):
        ex.source_file = f"/data/t0/template_{i % 2}.jsonl"
    result = evaluate_model(tiny_model, examples, EvaluationConfig(max_new_tokens=2), progress=False)
    assert {r.template for r in result.rows} == {"template_0", "template_1"}
    assert "label_accuracy/template:template_0" in result.metrics and "majority_label_per_template" in result.metrics
