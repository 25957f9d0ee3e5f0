"""Drift of served prompts against the prompts the champion was trained on, with Evidently.

Two views, both offline:
- text descriptors (Evidently's TextLength, WordCount, SentenceCount,
  NonLetterCharacterPercentage; not Sentiment or OOV, which need nltk downloads), each
  compared with Evidently's normed Wasserstein distance;
- embeddings of all-MiniLM-L6-v2 (tuneloop/embeddings.py), compared with Evidently's
  domain-classifier method (ROC AUC of a classifier told to tell reference from current:
  0.5 = indistinguishable, 1.0 = a different population), on a sample of each side.
The window drifts when the embeddings do, or when at least `min_drifted_descriptors`
descriptors do. Thresholds come from config; their defaults were calibrated on the sample
data (tests/integration/test_monitoring.py measures false alarms over seeds and window sizes on
in-distribution traffic, and detection of a real topic shift). The HTML report renders
Evidently's embedding plot (a TSNE) on a small sample only: the score never waits for it.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

from tuneloop.embeddings import embed, encoder_path, load_encoder

DESCRIPTORS = ("text_length", "word_count", "sentence_count", "non_letter_pct")
EMBEDDINGS = "embeddings"


@dataclass
class DriftResult:
    detected: bool
    judged: bool  # False: too few requests in the window to judge (detected is then False)
    scores: dict[str, float]
    drifted: list[str]
    thresholds: dict[str, float]
    reference_rows: int
    current_rows: int
    embedded_rows: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    reason: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def _descriptor_list(column: str):
    from evidently.descriptors import NonLetterCharacterPercentage, SentenceCount, TextLength, WordCount

    return [
        TextLength(column, alias="text_length"),
        WordCount(column, alias="word_count"),
        SentenceCount(column, alias="sentence_count"),
        NonLetterCharacterPercentage(column, alias="non_letter_pct"),
    ]


def evidently_dataset(texts: Sequence[str], embeddings=None):
    """An Evidently Dataset of texts with the four descriptors (and embedding columns)."""
    import pandas as pd
    from evidently import DataDefinition, Dataset

    frame = pd.DataFrame({"text": list(texts)})
    emb_cols = None
    if embeddings is not None:
        emb_cols = [f"e{i}" for i in range(embeddings.shape[1])]
        frame = pd.concat([frame, pd.DataFrame(embeddings, columns=emb_cols)], axis=1)
    definition = DataDefinition(
        text_columns=["text"], numerical_columns=emb_cols or [], embeddings={EMBEDDINGS: emb_cols} if emb_cols else None
    )
    return Dataset.from_pandas(frame, data_definition=definition, descriptors=_descriptor_list("text"))


def descriptor_frame(texts: Sequence[str]):
    return evidently_dataset(texts).as_dataframe()[list(DESCRIPTORS)]


_EMBEDDED: dict[int, object] = {}  # the last few embedded text lists (a reference is embedded once per process)


def _embed(texts: Sequence[str]):
    key = hash(tuple(texts))
    hit = _EMBEDDED.get(key)
    if hit is None:
        hit = embed(load_encoder(encoder_path()), list(texts), 64)
        if len(_EMBEDDED) >= 4:
            _EMBEDDED.pop(next(iter(_EMBEDDED)))
        _EMBEDDED[key] = hit
    return hit


def _sample(texts: list[str], n: int, rng: random.Random) -> list[str]:
    return texts if len(texts) <= n else rng.sample(texts, n)


def compute_drift(reference: Sequence[str], current: Sequence[str], cfg, seed: int = 0) -> DriftResult:
    """cfg: tuneloop.config.DriftConfig."""
    import pandas as pd
    from evidently.legacy.calculations.stattests import get_stattest
    from evidently.legacy.core import ColumnType
    from evidently.legacy.metrics.data_drift.embedding_drift_methods import ModelDriftMethod

    started = time.perf_counter()
    reference, current = [t for t in reference if t], [t for t in current if t]
    thresholds = {d: cfg.descriptor_threshold for d in DESCRIPTORS} | {EMBEDDINGS: cfg.embedding_threshold}
    if len(current) < cfg.min_requests or not reference:
        why = (
            f"{len(current)} prompts in the window, fewer than monitoring.drift.min_requests ({cfg.min_requests})"
            if reference
            else "no reference prompts"
        )
        return DriftResult(
            False,
            False,
            {},
            [],
            thresholds,
            len(reference),
            len(current),
            reason=why,
            seconds=round(time.perf_counter() - started, 3),
        )
    ref_d, cur_d = descriptor_frame(reference), descriptor_frame(current)
    scores: dict[str, float] = {}
    test = get_stattest(ref_d[DESCRIPTORS[0]], cur_d[DESCRIPTORS[0]], ColumnType.Numerical, "wasserstein")
    for d in DESCRIPTORS:
        r = test(ref_d[d].astype(float), cur_d[d].astype(float), ColumnType.Numerical, cfg.descriptor_threshold)
        scores[d] = round(float(r.drift_score), 4)
    rng = random.Random(seed)
    ref_s = _sample(list(reference), cfg.max_embedded_rows, rng)
    cur_s = _sample(list(current), cfg.max_embedded_rows, rng)
    ref_e, cur_e = _embed(ref_s), _embed(cur_s)
    cols = [f"e{i}" for i in range(ref_e.shape[1])]
    auc, _, _ = ModelDriftMethod(threshold=cfg.embedding_threshold)(
        pd.DataFrame(cur_e, columns=cols), pd.DataFrame(ref_e, columns=cols)
    )
    scores[EMBEDDINGS] = round(float(auc), 4)
    drifted = [k for k, v in scores.items() if v > thresholds[k]]
    descriptor_drift = [d for d in drifted if d in DESCRIPTORS]
    detected = EMBEDDINGS in drifted or len(descriptor_drift) >= cfg.min_drifted_descriptors
    return DriftResult(
        detected,
        True,
        scores,
        drifted,
        thresholds,
        len(reference),
        len(current),
        {"reference": len(ref_s), "current": len(cur_s)},
        round(time.perf_counter() - started, 3),
    )


def drift_report_html(reference: Sequence[str], current: Sequence[str], path: Path, cfg, seed: int = 0) -> Path:
    """Evidently's HTML report: descriptor drift on every row, embeddings drift (and its
    TSNE plot) on a sample of cfg.plot_rows per side."""
    from evidently import Report
    from evidently.legacy.metrics.data_drift.embedding_drift_methods import ModelDriftMethod
    from evidently.metrics import EmbeddingsDrift, ValueDrift

    rng = random.Random(seed)
    reference, current = [t for t in reference if t], [t for t in current if t]
    ref_s, cur_s = _sample(reference, cfg.plot_rows, rng), _sample(current, cfg.plot_rows, rng)
    ref_ds = evidently_dataset(reference)
    cur_ds = evidently_dataset(current)
    metrics = [ValueDrift(column=d, method="wasserstein", threshold=cfg.descriptor_threshold) for d in DESCRIPTORS]
    snapshot = Report(metrics).run(cur_ds, ref_ds)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    snapshot.save_html(str(path))
    emb = Report(
        [EmbeddingsDrift(embeddings_name=EMBEDDINGS, drift_method=ModelDriftMethod(threshold=cfg.embedding_threshold))]
    ).run(evidently_dataset(cur_s, _embed(cur_s)), evidently_dataset(ref_s, _embed(ref_s)))
    emb_path = path.with_name(path.stem + "-embeddings.html")
    emb.save_html(str(emb_path))
    return path
