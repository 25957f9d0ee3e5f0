"""Near-duplicate groups and train->eval leakage: real T0 templates, then small synthetic cases."""

from __future__ import annotations

import json
import random
from collections import defaultdict

import pytest

from tests.support import ROOT
from tuneloop.data.neardup import (
    DEFAULT_THRESHOLD,
    containment,
    content_shingles,
    leaked_pairs,
    near_duplicate_groups,
    normalise,
    similar_pairs,
    word_shingles,
)

T0_AMAZON = ROOT.parent / "shared" / "data" / "t0-amazon-polarity"


@pytest.fixture(scope="module")
def t0() -> tuple[list[str], list[int]]:
    """The prompts of the nine T0 amazon_polarity template files, and for each its row number:
    row i of every file is the same review under that file's template."""
    files = sorted(T0_AMAZON.glob("*.jsonl")) if T0_AMAZON.is_dir() else []
    if not files:
        pytest.skip(f"real T0 data not present at {T0_AMAZON}")
    texts, rows = [], []
    for path in files:
        with path.open(encoding="utf-8") as f:
            for row, line in enumerate(f):
                texts.append(json.loads(line)["prompt"])
                rows.append(row)
    assert len(files) == 9 and len(texts) == 9 * 200
    return texts, rows


@pytest.fixture(scope="module")
def t0_groups(t0) -> list[int]:
    return near_duplicate_groups(t0[0])


def rows_per_group(groups: list[int], rows: list[int]) -> dict[int, set[int]]:
    out = defaultdict(set)
    for g, row in zip(groups, rows):
        out[g].add(row)
    return dict(out)


def words(n: int, rng: random.Random) -> str:
    """`n` words from a vocabulary of 5,000 made-up ones: two such texts share no 3-word run."""
    return " ".join(f"w{rng.randrange(5000)}" for _ in range(n))


# --- the real T0 files ----------------------------------------------------------------------


def test_t0_rows_117_and_118_are_one_review(t0):
    # The data, not the detector: review 118 is review 117 less one sentence (same title),
    # so 199 sources, not 200, is the right answer below.
    texts, rows = t0
    first = texts[:200]  # one template file
    a, b = word_shingles(first[117]), word_shingles(first[118])
    assert containment(a, b) > 0.95 and a != b


def test_t0_each_review_is_one_group_across_its_nine_templates(t0, t0_groups):
    texts, rows = t0
    groups_of_row = defaultdict(set)
    for g, row in zip(t0_groups, rows):
        groups_of_row[row].add(g)
    assert all(len(gs) == 1 for gs in groups_of_row.values())
    assert len(set(t0_groups)) == 199


def test_t0_distinct_reviews_are_not_merged(t0, t0_groups):
    texts, rows = t0
    merged = [sorted(r) for r in rows_per_group(t0_groups, rows).values() if len(r) > 1]
    assert merged == [[117, 118]]


def test_t0_templates_are_filtered_as_boilerplate(t0):
    # Without the filter, the shortest review under the longest template ("You are
    # considering whether to buy a product...", the last file) shares over half of its
    # shingles with other reviews under that template; with it, almost nothing.
    texts, rows = t0
    last_file = range(8 * 200, 9 * 200)
    short = min(last_file, key=lambda i: len(texts[i]))
    others = [j for j in last_file if rows[j] not in (rows[short], 117, 118)]
    raw = max(containment(word_shingles(texts[short]), word_shingles(texts[j])) for j in others)
    sets = content_shingles(texts)
    filtered = max(containment(sets[short], sets[j]) for j in others)
    assert raw > 0.5
    assert filtered < 0.2


def test_t0_random_split_leaks_every_eval_review(t0):
    texts, rows = t0
    order = list(range(len(texts)))
    random.Random(0).shuffle(order)
    train, evals = order[:1440], order[1440:]
    train_texts, eval_texts = [texts[i] for i in train], [texts[i] for i in evals]
    assert not set(train_texts) & set(eval_texts)  # what an exact check sees: nothing

    source = {row: 117 if row == 118 else row for row in range(200)}
    in_train = {source[rows[i]] for i in train}
    expected = [e for e, i in enumerate(evals) if source[rows[i]] in in_train]
    found = leaked_pairs(train_texts, eval_texts)
    assert [e for e, _, _ in found] == expected
    assert len(expected) > 0.95 * len(evals)  # nine copies: almost every review is in train
    for e, t, similarity in found:
        assert source[rows[evals[e]]] == source[rows[train[t]]]
        assert DEFAULT_THRESHOLD <= similarity <= 1.0


def test_t0_group_disjoint_split_leaks_nothing(t0, t0_groups):
    texts, rows = t0
    ids = sorted(set(t0_groups))
    random.Random(0).shuffle(ids)
    eval_groups = set(ids[:40])
    train_texts = [t for t, g in zip(texts, t0_groups) if g not in eval_groups]
    eval_texts = [t for t, g in zip(texts, t0_groups) if g in eval_groups]
    assert len(eval_texts) >= 40 * 9
    assert leaked_pairs(train_texts, eval_texts) == []


def test_t0_groups_do_not_depend_on_the_seed_or_the_run(t0, t0_groups):
    assert near_duplicate_groups(t0[0], seed=7) == t0_groups


# --- synthetic cases ------------------------------------------------------------------------


def test_normalise_and_shingles():
    assert normalise("Hello, WORLD!  it's_42\n") == ["hello", "world", "it", "s", "42"]
    assert word_shingles("a b c d") == {"a b c", "b c d"}
    assert word_shingles("Yes!") == {"yes"}
    assert word_shingles(" ?! ") == frozenset()


def test_containment_is_measured_from_the_smaller_set():
    small, big = frozenset("ab"), frozenset("abcdef")
    assert containment(small, big) == containment(big, small) == 1.0
    assert containment(frozenset("abcd"), frozenset("cdef")) == 0.5
    assert containment(frozenset(), big) == 0.0


def test_exact_duplicates_up_to_case_spacing_and_punctuation():
    texts = ["The kettle broke after a week.", "the KETTLE broke -- after a week", "Unrelated."]
    assert near_duplicate_groups(texts) == [0, 0, 1]
    assert similar_pairs(texts) == [(0, 1, 1.0)]


def test_copies_beyond_the_boilerplate_limit_are_still_one_group():
    # 60 copies: every shingle is in more than BOILERPLATE_DF texts, so the filter leaves
    # them no content; being the same words is enough.
    rng = random.Random(7)
    text = words(30, rng)
    texts = [text] * 60 + [text.upper() + "!", words(30, rng)]
    assert near_duplicate_groups(texts) == [0] * 61 + [1]
    assert leaked_pairs(texts[:30], texts[30:]) == [(e, 0, 1.0) for e in range(31)]


def test_empty_and_short_texts():
    texts = ["", "  ", "?!", "yes", "Yes.", "yes please", "no"]
    # Texts without words match nothing, not even each other; short texts match exact copies.
    assert near_duplicate_groups(texts) == [0, 1, 2, 3, 3, 4, 5]
    assert leaked_pairs(["", "yes"], ["", "YES", "no"]) == [(1, 1, 1.0)]
    assert near_duplicate_groups([]) == []
    assert leaked_pairs([], ["a b c"]) == [] and leaked_pairs(["a b c"], []) == []


def test_one_slot_questions_are_not_near_duplicates():
    # The bundled sample's kind of prompt: one changed word is half of a short text.
    texts = ["What is 10 + 7?", "What is 10 + 4?", "What day comes after Sunday?", "What day comes after Monday?"]
    assert near_duplicate_groups(texts) == [0, 1, 2, 3]


def test_unrelated_texts_stay_apart():
    rng = random.Random(1)
    texts = [words(rng.randint(5, 80), rng) for _ in range(300)]
    assert near_duplicate_groups(texts) == list(range(300))
    assert leaked_pairs(texts[:150], texts[150:]) == []


def test_one_text_under_different_templates_is_one_group():
    rng = random.Random(2)
    review = words(60, rng)
    texts = [
        f"Is this product review positive?\nReview: {review}\nAnswer:",
        f"Review: {review}\nIs the review positive or negative?",
        f"Here is a review left by a customer. Was he satisfied?\n{review}",
        words(60, rng),
    ]
    assert near_duplicate_groups(texts) == [0, 0, 0, 1]


def test_edited_copy_joins_its_original():
    rng = random.Random(3)
    original = words(100, rng).split()
    edited = list(original)
    edited[50] = "changed"  # one word changes the 3 of the 98 shingles that hold it
    texts = [" ".join(original), words(100, rng), " ".join(edited)]
    assert near_duplicate_groups(texts) == [0, 1, 0]
    assert similar_pairs(texts) == [(0, 2, pytest.approx(95 / 98))]


def test_a_chain_of_near_duplicates_is_one_group():
    rng = random.Random(6)
    a = words(100, rng).split()
    b = a[:80] + words(20, rng).split()  # shares 78 of 98 shingles with a
    c = b[20:] + words(20, rng).split()  # shares 78 with b, 58 with a
    texts = [" ".join(a), " ".join(b), " ".join(c)]
    assert [(i, j) for i, j, _ in similar_pairs(texts)] == [(0, 1), (1, 2)]
    assert near_duplicate_groups(texts) == [0, 0, 0]


def test_shared_template_is_boilerplate_not_content():
    # 60 different questions behind one long instruction: the instruction is in every row,
    # so it is filtered out and the questions are compared on their own words.
    rng = random.Random(4)
    instruction = (
        "You are a careful assistant. Read the question below and answer it with a "
        "single word, without any explanation, in lower case, and nothing else."
    )
    texts = [f"{instruction}\n{words(4, rng)}" for _ in range(60)]
    assert len(set(near_duplicate_groups(texts))) == 60
    # The filter is what keeps them apart: counted as content, the instruction merges them all.
    assert len(set(near_duplicate_groups(texts, boilerplate_df=1000))) == 1


def test_leaked_pairs_names_the_most_similar_train_text():
    rng = random.Random(5)
    source = words(80, rng).split()
    near = source[:70] + words(10, rng).split()  # containment 68/78 with the source
    train = [words(80, rng), " ".join(near), " ".join(source), " ".join(source)]
    evals = [words(80, rng), "Q: " + " ".join(source) + " A:"]
    [(e, t, similarity)] = leaked_pairs(train, evals)
    assert (e, t) == (1, 2)  # the exact copy, and the first of the two
    assert similarity == 1.0
    assert leaked_pairs(train, evals, threshold=1.0) == [(1, 2, 1.0)]


def test_threshold_must_be_a_fraction():
    with pytest.raises(ValueError, match="threshold"):
        near_duplicate_groups(["a b c"], threshold=0.0)
    with pytest.raises(ValueError, match="threshold"):
        leaked_pairs(["a b c"], ["a b c"], threshold=1.5)


# --- wired into the split and the gate ------------------------------------------------------


@pytest.mark.skipif(not T0_AMAZON.exists(), reason=f"{T0_AMAZON} is absent")
def test_the_split_keeps_every_template_of_a_review_on_one_side_and_the_gate_sees_a_random_split_leak():
    import random as _random

    from tuneloop.config import ValidationConfig
    from tuneloop.data.dataset import split_examples
    from tuneloop.data.formats import load_file
    from tuneloop.validation import build_frame

    rows = [e for f in sorted(T0_AMAZON.glob("*.jsonl")) for e in load_file(f).examples]
    train, eval_ = split_examples(rows, 0.1, 42, group_threshold=0.75)
    assert 150 <= len(eval_) <= 210 and len(train) + len(eval_) == len(rows)
    assert leaked_pairs([e.prompt_text for e in train], [e.prompt_text for e in eval_]) == []
    # the prompt-only split (the old behaviour) leaks every eval review through its other templates
    old_train, old_eval = split_examples(rows, 0.1, 42, group_threshold=None)
    assert len(leaked_pairs([e.prompt_text for e in old_train], [e.prompt_text for e in old_eval])) > 0.9 * len(
        old_eval
    )

    # the gate's leakage column names the pair for a random split, and nothing for the grouped one
    shuffled = rows[:]
    _random.Random(0).shuffle(shuffled)
    cut = len(shuffled) // 10
    frame = build_frame(shuffled[cut:], shuffled[:cut], None, leakage_similarity=ValidationConfig().leakage_similarity)
    leaked = frame[(frame.split == "eval") & frame.eval_prompt_in_train.notna()]
    assert len(leaked) > 0.9 * cut
    assert leaked.eval_prompt_in_train.str.contains("near-duplicate of train amazon_polarity_").all()
    frame = build_frame(train, eval_, None, leakage_similarity=0.75)
    assert frame[frame.split == "eval"].eval_prompt_in_train.isna().all()
