"""TextAssembler: incremental decoding with the demo model's real (byte-level BPE) tokenizer."""

from __future__ import annotations

import random

import pytest

from tuneloop.serving.text import TextAssembler

TEXT = "naïve café 🙂 日本語, Ünïcödé ✓ — 🎉🎉 señor, ça va? 中文字符 ok.\n"


@pytest.fixture(scope="module")
def tok(demo_base_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(demo_base_model))


def _groups(ids, rng):
    """ids cut into random-size groups (1-5), as a decoding step may emit several."""
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 5)
        out.append(ids[i : i + n])
        i += n
    return out


def _run(asm, groups):
    deltas = []
    for g in groups:
        deltas.append(asm.add(g))
        if asm.stopped:
            break
    deltas.append(asm.flush())
    return deltas


def _reference(tok, stop, groups):
    """The specification, done the slow way: decode everything on every step."""
    ids, sent, out = [], 0, []
    stop = [s for s in stop if s]
    for g in groups:
        ids += g
        text = tok.decode(ids, skip_special_tokens=True)
        hits = [i for i in (text.find(s) for s in stop) if i >= 0]
        if hits:
            out.append(text[sent : max(min(hits), sent)])
            return out + [""], True
        safe = len(text.rstrip("\ufffd"))
        for s in stop:
            for k in range(min(len(s) - 1, safe), 0, -1):
                if text[:safe].endswith(s[:k]):
                    safe -= k
                    break
        out.append(text[sent : max(safe, sent)])
        sent = max(safe, sent)
    return out + [tok.decode(ids, skip_special_tokens=True)[sent:]], False


def _random_sequences(tok, rng, count):
    text_ids = tok.encode(TEXT * 3, add_special_tokens=False)
    vocab = len(tok)
    for _ in range(count):
        kind = rng.choice(["text", "random", "mixed"])
        if kind == "text":
            a = rng.randrange(len(text_ids))
            ids = text_ids[a : a + rng.randint(1, 80)]
        elif kind == "random":  # any ids, special ones included: split and invalid bytes
            ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 80))]
        else:
            ids = []
            for _ in range(rng.randint(1, 6)):
                a = rng.randrange(len(text_ids))
                ids += text_ids[a : a + rng.randint(1, 15)]
                ids += [rng.randrange(vocab) for _ in range(rng.randint(0, 4))]
        yield ids


def test_text_fed_one_by_one_splits_no_character(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some tokens do split characters
    asm = TextAssembler(tok, [])
    deltas = [asm.add([i]) for i in ids] + [asm.flush()]
    assert "".join(deltas) == TEXT
    assert not any("\ufffd" in d for d in deltas)
    assert asm.ids == ids and not asm.stopped


def test_deltas_add_up_to_the_whole_decode(tok):
    rng = random.Random(1234)
    for ids in _random_sequences(tok, rng, 400):
        groups = [[i] for i in ids] if rng.random() < 0.5 else _groups(ids, rng)
        asm = TextAssembler(tok, [])
        deltas = _run(asm, groups)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True), ids
        assert asm.ids == ids


def test_matches_the_decode_everything_reference_with_stop_strings(tok):
    rng = random.Random(99)
    for ids in _random_sequences(tok, rng, 400):
        full = tok.decode(ids, skip_special_tokens=True)
        stop = []
        for _ in range(rng.randint(1, 4)):  # stops taken from the text (so they hit), or not
            if full and rng.random() < 0.7:
                a = rng.randrange(len(full))
                stop.append(full[a : a + rng.randint(1, 6)].replace("\ufffd", ""))
            else:
                stop.append(rng.choice(["zz#", "\n\n", "日本", "é ", "🙂"]))
        groups = [[i] for i in ids] if rng.random() < 0.5 else _groups(ids, rng)
        asm = TextAssembler(tok, stop)
        deltas = _run(asm, groups)
        want, stopped = _reference(tok, stop, groups)
        assert deltas == want, (ids, stop)
        assert asm.stopped == stopped
        text = "".join(deltas)
        assert not any(s in text for s in stop if s)
        if stopped:
            assert full.startswith(text) and any(full[len(text) :].startswith(s) for s in stop)


def test_stop_string_split_across_tokens(tok):
    ids = tok.encode("I like naïve café 🙂 very much", add_special_tokens=False)
    for stop in (["café 🙂"], ["ïve"], ["🙂"], ["x", "e caf"]):
        asm = TextAssembler(tok, stop)
        deltas = _run(asm, [[i] for i in ids])
        text = "".join(deltas)
        assert asm.stopped
        cut = min(i for i in ("I like naïve café 🙂 very much".find(s) for s in stop) if i >= 0)
        assert text == "I like naïve café 🙂 very much"[:cut]
        assert asm.add(tok.encode(" more", add_special_tokens=False)) == "" and asm.flush() == ""


def test_stop_string_in_the_last_tokens_never_reaches_flush(tok):
    # the stop is completed by the very last token, and the text ends on an incomplete
    # character after it: nothing past the stop comes out, not even from flush()
    ids = tok.encode("hello world 🙂", add_special_tokens=False)
    asm = TextAssembler(tok, [" 🙂"])
    deltas = [asm.add([i]) for i in ids[:-1]]
    assert "".join(deltas) == "hello world"  # " " held back, "🙂" still incomplete
    deltas.append(asm.add(ids[-1:]))
    assert asm.stopped
    deltas.append(asm.flush())
    assert "".join(deltas) == "hello world"

    # the stop lies in text not settled yet (the generation ends on an incomplete
    # character): found all the same, and flush() hands out nothing past it
    tail = tok.encode("🙂", add_special_tokens=False)
    ids = tok.encode("abc STOP xyz", add_special_tokens=False) + tail[:-1]
    asm = TextAssembler(tok, ["STOP"])
    assert asm.add(ids) == "abc " and asm.stopped
    assert asm.flush() == ""
    asm = TextAssembler(tok, ["STOP"])
    assert "".join(_run(asm, [[i] for i in ids])) == "abc " and asm.stopped


def test_partial_stop_prefix_is_held_then_released_by_flush(tok):
    ids = tok.encode("The answer is 42 ##", add_special_tokens=False)
    asm = TextAssembler(tok, ["###", "42!"])
    deltas = [asm.add([i]) for i in ids]
    assert "".join(deltas) == "The answer is 42 "  # "##" could still become "###"
    assert not asm.stopped
    assert asm.flush() == "##"
    assert asm.flush() == ""

    asm = TextAssembler(tok, ["café!"])
    deltas = [asm.add([i]) for i in tok.encode("naïve café", add_special_tokens=False)]
    assert "".join(deltas) == "naïve "
    assert asm.flush() == "café" and not asm.stopped


def test_decoding_work_per_token_is_bounded(tok, monkeypatch):
    sizes = []
    decode = tok.decode

    def counting_decode(ids, *a, **kw):
        sizes.append(len(ids))
        return decode(ids, *a, **kw)

    monkeypatch.setattr(tok, "decode", counting_decode)
    ids = tok.encode(TEXT * 100, add_special_tokens=False)[:2000]
    assert len(ids) == 2000
    asm = TextAssembler(tok, ["<never>", "\n\n\n"])
    deltas = [asm.add([i]) for i in ids] + [asm.flush()]
    monkeypatch.setattr(tok, "decode", decode)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)
    assert len(sizes) <= 2 * len(ids) + 2
    assert max(sizes) <= 64
    assert len(asm._win) <= 64  # the text kept stays small too
