"""Near-duplicate texts: the same source text under different prompt templates, or edited copies.

An exact comparison of prompts misses the commonest leak in instruction data: a templated
mixture (P3, T0, FLAN) holds each source text several times, each time wrapped in a different
template, so a random split puts the same review in train and in eval. Here two texts count as
near-duplicates when most of the smaller one's content reappears in the larger:

- text -> casefolded alphanumeric words -> 3-word shingles (`word_shingles`);
- shingles found in more than BOILERPLATE_DF texts of the collection are template or stock
  phrases, not content, and are left out (`content_shingles`);
- similarity = containment, |A & B| / min(|A|, |B|) (`containment`), computed exactly on the
  candidate pairs that MinHash LSH (datasketch) proposes, so there is no n^2 loop;
- texts with the same words in the same order are duplicates (similarity 1.0) whatever the
  filter left of them; texts without a word match nothing.

`near_duplicate_groups` gives a group id per text (split whole groups to keep a split clean);
`leaked_pairs` names the eval texts that reappear in train.

Measured on the team's copy of the public T0 amazon-polarity set (200 reviews x 9 T0 templates = 1,800 prompts;
two of the reviews are one review, one sentence apart, so 199 sources): the same source under
two templates has containment 0.78 at least (1st percentile 0.86, median 0.975), two different
sources 0.15 at most (99.99th percentile 0.10). The bundled sample (data/sample), whose short
prompts fill one slot of a shared question ("What is 10 + 7?" / "What is 10 + 4?"), peaks at
0.71. DEFAULT_THRESHOLD = 0.75 sits above the second and below the first: on T0 every same-source
pair passes and nothing else does. Without the boilerplate filter, containment barely separates
T0 (different sources under one long template reach 0.60, while some source is linked to its
other templates only at 0.67 or below) and plain Jaccard does not at all (0.29 vs 0.40).

Limits: a source text held by more than BOILERPLATE_DF rows (under that many templates, or
copied that often) loses its shingles to the filter: exact copies are still found, edited
ones are not; raise `boilerplate_df` for such data. A template used by BOILERPLATE_DF rows or
fewer is not filtered and counts as content, so short texts under a long template can merge.
Short texts are judged on few shingles: a text of 4 words has 2, and one changed word halves
its similarity to the original.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

from datasketch import MinHash, MinHashLSH
from datasketch.hashfunc import sha1_hash32

# 3 words: a template wrapped around a text changes only the 2 shingles that straddle each
# join, while 3-word runs are rarely shared by unrelated texts once stock phrases are
# filtered. On T0 (filtered) the gap between different sources (max) and the weakest link
# within a source's group is 0.21-0.93 for 2 words, 0.15-0.94 for 3, 0.15-0.88 for 4 and
# 0.15-0.81 for 5: longer shingles only lose matches, and short texts have fewer of them.
SHINGLE_WORDS = 3
DEFAULT_THRESHOLD = 0.75
# A template's phrases occur once per row it wraps (hundreds to millions of times); a source
# text's phrases once per template it is shown under (about a dozen per dataset in P3, 10 in
# FLAN, 9 in the T0 amazon files).
BOILERPLATE_DF = 50
# Candidate pairs come from Jaccard LSH (see _candidates): a pair whose content sizes differ
# more than this (a short text inside a much longer one) is found less reliably.
MAX_SIZE_RATIO = 2.0
# 64 permutations: enough for the LSH bands (26 of 2 rows at the default threshold); the
# MinHash estimate itself is never used (every candidate is compared exactly), and 128 only
# adds hashing time (5,000 texts: 4.2 s instead of 3.3 s).
NUM_PERM = 64
DEFAULT_SEED = 1

_WORD = re.compile(r"[^\W_]+")


def normalise(text: str) -> list[str]:
    """The words of `text`: runs of letters and digits, casefolded. Punctuation, spacing,
    underscores and markup characters separate words and are otherwise ignored."""
    return _WORD.findall(text.casefold())


def word_shingles(text: str, k: int = SHINGLE_WORDS) -> frozenset[str]:
    """The distinct runs of `k` consecutive words of `text` (words joined by one space).

    A text of fewer than `k` words is one shingle of all its words, so short texts can still
    match their exact copies; a text without words has no shingles and matches nothing."""
    return _shingles(normalise(text), k)


def content_shingles(
    texts: Sequence[str], k: int = SHINGLE_WORDS, boilerplate_df: int = BOILERPLATE_DF,
) -> list[frozenset[str]]:
    """Each text's shingles less the boilerplate: shingles found in more than
    `boilerplate_df` of `texts` (a template's words, stock phrases)."""
    return _content([normalise(text) for text in texts], k, boilerplate_df)


def containment(a: frozenset[str], b: frozenset[str]) -> float:
    """The fraction of the smaller set found in the larger: 1.0 when one text's content is
    all inside the other, whatever the other adds around it (a template); 0.0 if either is
    empty."""
    smaller = min(len(a), len(b))
    return len(a & b) / smaller if smaller else 0.0


def similar_pairs(
    texts: Sequence[str],
    threshold: float = DEFAULT_THRESHOLD,
    seed: int = DEFAULT_SEED,
    boilerplate_df: int = BOILERPLATE_DF,
) -> list[tuple[int, int, float]]:
    """The pairs (i, j, similarity), i < j, sorted, whose content containment is >= `threshold`,
    and each text paired with the first text of the same words (1.0).

    Pairs are proposed by MinHash LSH, so one can be missed (rarely, see _candidates); every
    pair returned is verified exactly. `seed` picks the MinHash permutations: the result for
    a seed is the same on every run and machine."""
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}")
    words = [normalise(text) for text in texts]
    sets = _content(words, SHINGLE_WORDS, boilerplate_df)
    found: dict[tuple[int, int], float] = {}
    for members in _same_words(words):
        for j in members[1:]:
            # One edge per copy joins the group; the first copy has the lowest index, so
            # in leaked_pairs (train first) it is a train text whenever train has one.
            found[(members[0], j)] = 1.0
    for i, j in _candidates(sets, threshold, seed):
        similarity = containment(sets[i], sets[j])
        if similarity >= threshold and (i, j) not in found:
            found[(i, j)] = similarity
    return sorted((i, j, s) for (i, j), s in found.items())


def near_duplicate_groups(
    texts: Sequence[str],
    threshold: float = DEFAULT_THRESHOLD,
    seed: int = DEFAULT_SEED,
    boilerplate_df: int = BOILERPLATE_DF,
) -> list[int]:
    """A group id per text: texts joined by a chain of near-duplicate pairs share one.
    Ids are 0, 1, 2, ... in order of each group's first text, so equal inputs give equal
    ids. A text with no near-duplicate is a group of its own."""
    parent = list(range(len(texts)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, j, _ in similar_pairs(texts, threshold, seed, boilerplate_df):
        ri, rj = root(i), root(j)
        if ri != rj:
            parent[max(ri, rj)] = min(ri, rj)
    ids: dict[int, int] = {}
    return [ids.setdefault(root(i), len(ids)) for i in range(len(texts))]


def leaked_pairs(
    train_texts: Sequence[str],
    eval_texts: Sequence[str],
    threshold: float = DEFAULT_THRESHOLD,
    seed: int = DEFAULT_SEED,
    boilerplate_df: int = BOILERPLATE_DF,
) -> list[tuple[int, int, float]]:
    """The eval texts that reappear in train: one (eval_index, train_index, similarity) per
    leaked eval text, naming its most similar train text (the first, on a tie), sorted by
    eval index. Boilerplate is counted over both splits together."""
    texts = list(train_texts) + list(eval_texts)
    n_train = len(train_texts)
    best: dict[int, tuple[float, int]] = {}
    for i, j, similarity in similar_pairs(texts, threshold, seed, boilerplate_df):
        if i < n_train <= j:  # i < j, so a cross pair always has train first
            e = j - n_train
            if e not in best or (-similarity, i) < (-best[e][0], best[e][1]):
                best[e] = (similarity, i)
    return [(e, t, s) for e, (s, t) in sorted(best.items())]


def _shingles(words: list[str], k: int) -> frozenset[str]:
    if len(words) < k:
        return frozenset([" ".join(words)]) if words else frozenset()
    return frozenset(" ".join(words[i:i + k]) for i in range(len(words) - k + 1))


def _content(words: list[list[str]], k: int, boilerplate_df: int) -> list[frozenset[str]]:
    sets = [_shingles(w, k) for w in words]
    df = Counter(s for shingles in sets for s in shingles)
    return [frozenset(s for s in shingles if df[s] <= boilerplate_df) for shingles in sets]


def _same_words(words: list[list[str]]) -> list[list[int]]:
    """Indices of texts with the same (non-empty) words, per repeated word sequence."""
    by_words: dict[str, list[int]] = {}
    for i, w in enumerate(words):
        if w:
            by_words.setdefault(" ".join(w), []).append(i)
    return [members for members in by_words.values() if len(members) > 1]


def _candidates(sets: list[frozenset[str]], threshold: float, seed: int) -> set[tuple[int, int]]:
    """Pairs (i, j), i < j, that MinHash LSH proposes as possibly >= `threshold` containment.

    LSH buckets by Jaccard, and a pair's Jaccard depends on its size ratio as well as its
    containment c: with |B| = ratio * |A| >= |A|, Jaccard = c / (1 + ratio - c). The index
    is set for pairs up to MAX_SIZE_RATIO apart (Jaccard 1/3 at c = 0.75) and weighted for
    recall: at c = 0.75, 26 bands of 2 find such a pair with probability 0.95, one of equal
    sizes (Jaccard 0.6) with 0.99999. Unrelated texts share almost no content shingles, so
    the extra candidates are few, and each is checked exactly."""
    keyed = [(i, s) for i, s in enumerate(sets) if s]
    if len(keyed) < 2:
        return set()
    # datasketch hashes every value it is given; hash each distinct shingle once instead
    # and hand it the 32-bit values (hashfunc=int passes them through).
    distinct = frozenset().union(*(shingles for _, shingles in keyed))
    codes = {s: sha1_hash32(s.encode("utf-8")) for s in distinct}
    hashes = MinHash.bulk(
        ([codes[s] for s in shingles] for _, shingles in keyed),
        num_perm=NUM_PERM, seed=seed, hashfunc=int,
    )
    jaccard_floor = threshold / (1 + MAX_SIZE_RATIO - threshold)
    index = MinHashLSH(threshold=jaccard_floor, num_perm=NUM_PERM, weights=(0.1, 0.9))
    for (i, _), h in zip(keyed, hashes):
        index.insert(i, h)
    pairs = set()
    for (i, _), h in zip(keyed, hashes):
        for j in index.query(h):
            if j != i:
                pairs.add((min(i, j), max(i, j)))
    return pairs
