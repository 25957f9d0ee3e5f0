"""Stage 2 of the content filter: training and evaluating the prompt-injection classifier.

One file on purpose: fitting a classifier, choosing its threshold and measuring it share the
labelled-data handling and the parameters; a sixth of the file is this docstring's record of
the methods and what they measured.

The classifier the gateway loads and runs (scoring, its features at inference, the saved
folder) is tuneloop/gateway/filter_model.py; this module fits one (train_classifier), reads
and splits labelled sets, scores a held-out part (evaluate_classifier), draws the confusion
matrix and compares methods over seeds. The flow's executor around it (split, baseline,
report, registry) is tuneloop/gateway/filter_training.py.

Methods (``params["method"]``):

``hybrid`` (the default)
    One logistic regression over features that need no encoder training:
    character n-gram TF-IDF (char_wb 2-5; robust to German, spelling and spacing tricks),
    word 1-2-gram TF-IDF, and all-MiniLM-L6-v2 embeddings of the text's segments
    (sentences / lines): their mean, their element-wise max and the last one. Injections
    are often a harmless request with the attack appended ("... Very good. Now forget that
    and ..."); a mean dilutes that, a max over segments and the last segment do not.
    The segment embeddings (``embeddings``) are by default ``static``: the encoder's token
    vectors distilled into a table (tuneloop/embeddings.StaticEmbeddings: each of its
    30,522 tokens run through the encoder alone once, ~10 s at training; a segment is the
    mean of its tokens' rows), so scoring a text is a tokenizer call, a table lookup and the
    regression's arithmetic (filter_model._LinearScorer): ~0.3-0.4 ms on a CPU, no
    transformer pass, no torch. ``encoder`` runs the encoder forward per segment instead (~4-20 ms a text), with
    a cascade in front of it (``screen``): a logistic regression on the TF-IDF blocks alone
    scores every text first, and a text it scores under its cut keeps that score without an
    encoder pass (``screen_cut``). Both train in seconds on two CPU cores.
``baseline``
    Frozen all-MiniLM-L6-v2 embedding of the whole text + logistic regression: the obvious
    method every report compares against.
``finetune``
    The encoder fine-tuned end to end (binary cross-entropy through a linear head, a few
    epochs), then the ``hybrid`` head on the fine-tuned encoder. For larger data or a GPU:
    the out-of-fold threshold needs one fine-tuning per fold (3 + the final one, ~3 min on
    two cores, over CI's budget for a default).

The decision threshold is always chosen on the training data only: k-fold out-of-fold
scores on the training part (as served: the screen's score where it clears a text), and the
threshold that keeps the out-of-fold false-positive rate's one-sided 80 % upper confidence
bound (Clopper-Pearson, ``fpr_confidence``) at or under ``target_fpr``. With the point
estimate instead, an unseen split's FPR lands above the target about half the time. The
final model is then fitted on the whole training part.

Measured (2 CPU cores, 2026-12-03; repeated stratified 80/20 splits of the 546-row set, the
threshold from 5-fold out-of-fold scores on the training part for 5 % FPR, then recall/FPR
on the held-out 109 rows, 68 of them benign, so one false positive is 1.5 points of FPR):

    seeds 0-9, 42             recall          FPR             ROC-AUC         met       train
    baseline                  0.749 +- 0.077  0.032 +- 0.018  0.938 +- 0.021  1 of 11   ~3 s
    hybrid, static (default)  0.905 +- 0.030  0.021 +- 0.020  0.991 +- 0.007  10 of 11  ~2 s
    hybrid, encoder           0.890 +- 0.033  0.026 +- 0.026  0.981           8 of 10   ~4 s (seeds 0-9)
    TF-IDF blocks alone       0.868 +- 0.037  0.029 +- 0.022  0.971           6 of 10   (seeds 0-9)
    seed 42 (the flow's): hybrid static 0.927 at FPR 0.015, baseline 0.805 at 0.015.

"met": >= 85 % recall at <= 5 % FPR; the default's recall was >= 0.85 on all eleven splits,
its FPR 5.9 % (4 of 68) on the one it missed. Train times exclude the distillation (once a
process, ~10 s). ``finetune`` (under an earlier protocol: whole-text embedding, point-estimate
threshold; seeds 0, 1, 2, 4): 0.927 +- 0.045 at 0.029 +- 0.017, 170-330 s to train.

A saved classifier is a folder: see tuneloop/gateway/filter_model.py.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import numpy as np

from tuneloop.embeddings import (
    ENCODER_NAME,
    ENCODER_PACKAGE,
    dimension,
    distilled_encoder,
    encoder_path,
    load_encoder,
)

# _Head keeps its underscore: head.joblib files name the class tuneloop.gateway.filter_model._Head.
from tuneloop.gateway.filter_model import InjectionClassifier, _Head, dense_features
from tuneloop.gateway.normalize import screening_views

if TYPE_CHECKING:
    import pandas

METHODS = ("hybrid", "baseline", "finetune")
DEFAULT_METHOD = "hybrid"

DEFAULT_PARAMS: dict[str, Any] = {
    "method": DEFAULT_METHOD,
    "C": 10.0,  # inverse L2 strength of the logistic regression (all methods)
    "class_weight": "balanced",
    "oof_folds": 5,  # folds for the out-of-fold threshold (finetune: "finetune_oof_folds")
    "threshold_rule": "midpoint",  # midpoint | edge: where between two negatives' scores to cut
    # The threshold keeps the out-of-fold FPR's one-sided Clopper-Pearson upper bound at this
    # confidence within target_fpr (None: the point estimate, which an unseen split then
    # exceeds about half the time).
    "fpr_confidence": 0.8,
    # hybrid / finetune features
    "char_ngram": [2, 5],
    "char_min_df": 2,
    "word_ngram": [1, 2],
    "embedding_weight": 1.0,
    # hybrid: where the segment embeddings come from. static: the encoder's token vectors
    # distilled into a table (tuneloop/embeddings.StaticEmbeddings; no transformer pass when
    # scoring, ~0.02 ms a text); encoder: a forward pass of all-MiniLM-L6-v2 per segment.
    "embeddings": "static",
    "segments": True,  # max over segment embeddings + last segment embedding
    # The whole text's own embedding as the first block (True), or the mean of its segments'
    # (False: one encoder pass over the segments only, about half the tokens of a
    # multi-sentence text, and as accurate on the set). Saved classifiers without the key: True.
    "whole_embedding": False,
    "max_segments": 64,  # per text: the first and last half of them when there are more
    # The cascade (hybrid with encoder embeddings, finetune): a logistic regression on the
    # TF-IDF blocks alone scores every text first; a text it scores below screen_margin x the
    # lowest out-of-fold score of any training injection keeps that score and skips the encoder
    # (half the benign training texts; the encoder pass is most of the filter's cost on a CPU).
    # Static embeddings cost no encoder pass, so there it is not used.
    "screen": True,
    "screen_margin": 0.8,
    # encoder
    "batch_size": 32,  # encoding batch (also used when scoring)
    "device": "cpu",
    # finetune only
    "epochs": 3,
    "learning_rate": 5e-5,
    "head_learning_rate": 1e-2,
    "train_batch_size": 16,
    "train_max_seq_length": 128,
    "finetune_oof_folds": 3,
}

Progress = Callable[[str], None] | None


def _say(progress: Progress, message: str) -> None:
    if progress is not None:
        progress(message)


# ---------------------------------------------------------------------------------------
# data


def load_labelled(path) -> pandas.DataFrame:
    """A labelled set (parquet, CSV, JSONL/JSON) as a DataFrame with columns text (str) and
    label (int, 1 = injection). ValueError when columns are missing, a text is not a string,
    a label is not 0/1, or nothing is left."""
    import pandas as pd

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"labelled set {path} does not exist")
    suffix = path.suffix.lower()
    if suffix in (".parquet", ".pq"):
        df = pd.read_parquet(path)
    elif suffix == ".csv":
        df = pd.read_csv(path)
    elif suffix in (".jsonl", ".ndjson"):
        df = pd.read_json(path, lines=True)
    elif suffix == ".json":
        df = pd.read_json(path)
    else:
        raise ValueError(f"{path}: unknown format {suffix!r} (parquet, csv, jsonl or json)")
    return validate_labelled(df, source=str(path))


def validate_labelled(df, source: str = "labelled set") -> pandas.DataFrame:
    """The checks of load_labelled on a DataFrame: a copy with text (str) and label (int 0/1)."""
    import pandas as pd

    if not isinstance(df, pd.DataFrame):
        raise ValueError(f"{source}: expected a DataFrame, got {type(df).__name__}")
    missing = [c for c in ("text", "label") if c not in df.columns]
    if missing:
        raise ValueError(
            f"{source}: missing column(s) {missing} (has {list(df.columns)}); "
            "need text and label (1 = injection, 0 = benign)"
        )
    if len(df) == 0:
        raise ValueError(f"{source}: no rows")
    texts = df["text"]
    bad_text = ~texts.map(lambda t: isinstance(t, str))
    if bad_text.any():
        rows = list(df.index[bad_text][:5])
        raise ValueError(f"{source}: {int(bad_text.sum())} text(s) are not strings (rows {rows})")
    labels = df["label"]
    if labels.isna().any():
        raise ValueError(f"{source}: {int(labels.isna().sum())} missing label(s)")
    if labels.dtype == bool:
        labels = labels.astype(int)
    try:
        numeric = pd.to_numeric(labels)
    except (TypeError, ValueError):
        raise ValueError(f"{source}: labels must be 0/1, got values {sorted(map(str, set(labels)))[:5]}") from None
    values = set(numeric.unique().tolist())
    if not values <= {0, 1}:
        raise ValueError(f"{source}: labels must be binary 0/1 (1 = injection), got {sorted(values)[:10]}")
    out = pd.DataFrame({"text": texts.astype(str).to_numpy(), "label": numeric.astype(int).to_numpy()})
    return out


def deduplicate(df) -> tuple[pandas.DataFrame, dict[str, int]]:
    """Exact-duplicate texts collapsed to one row (first kept); a text labelled both ways
    keeps label 1 (the filter errs towards flagging). Returns (frame, counts)."""
    df = validate_labelled(df)
    conflicting = df.groupby("text")["label"].nunique()
    conflicting = set(conflicting[conflicting > 1].index)
    out = df.drop_duplicates("text", keep="first").reset_index(drop=True)
    if conflicting:
        out.loc[out["text"].isin(conflicting), "label"] = 1
    return out, {"duplicates_dropped": len(df) - len(out), "conflicting_labels": len(conflicting)}


def split_labelled(df, test_fraction: float, seed: int):
    """(train_df, test_df): exact duplicate texts removed first, then a stratified split."""
    from sklearn.model_selection import train_test_split

    if not 0 < float(test_fraction) < 1:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}")
    df, _ = deduplicate(df)
    counts = df["label"].value_counts()
    if len(counts) < 2 or counts.min() < 2:
        raise ValueError(f"need at least 2 rows of each label to split, got {counts.to_dict()}")
    n_test = max(int(round(len(df) * float(test_fraction))), 2)
    if n_test > len(df) - 2:
        raise ValueError(f"test_fraction {test_fraction} leaves no training data ({len(df)} rows)")
    train_idx, test_idx = train_test_split(
        np.arange(len(df)), test_size=n_test, stratify=df["label"].to_numpy(), random_state=int(seed)
    )
    return (df.iloc[np.sort(train_idx)].reset_index(drop=True), df.iloc[np.sort(test_idx)].reset_index(drop=True))


# ---------------------------------------------------------------------------------------
# heads and thresholds


def fit_head(cfg: dict, texts, dense, labels, seed: int, use_tfidf: bool, screen: bool = False) -> _Head:
    """A head fitted on these rows: TF-IDF blocks (unless use_tfidf is False) and the dense
    features -> logistic regression; with `screen`, the TF-IDF-only regression too."""
    import scipy.sparse as sp
    from sklearn.feature_extraction.text import TfidfVectorizer

    head = _Head(cfg, use_tfidf)
    labels = np.asarray(labels, dtype=int)
    texts = list(texts)
    sparse = None
    if use_tfidf:
        lo, hi = head.cfg["char_ngram"]
        wlo, whi = head.cfg["word_ngram"]
        head.char = TfidfVectorizer(
            analyzer="char_wb",
            ngram_range=(int(lo), int(hi)),
            min_df=int(head.cfg["char_min_df"]),
            sublinear_tf=True,
            dtype=np.float32,
        )
        head.word = TfidfVectorizer(
            analyzer="word", ngram_range=(int(wlo), int(whi)), sublinear_tf=True, dtype=np.float32
        )
        sparse = sp.hstack([head.char.fit_transform(texts), head.word.fit_transform(texts)], format="csr")
    head.lr = _logistic_regression(head.cfg, seed).fit(head._matrix(sparse, dense), labels)
    if screen and sparse is not None:
        head.screen_lr = _logistic_regression(head.cfg, seed).fit(sparse, labels)
    return head


def _logistic_regression(cfg: dict, seed: int):
    from sklearn.linear_model import LogisticRegression

    cw = cfg["class_weight"]
    return LogisticRegression(C=float(cfg["C"]), class_weight=cw if cw else None, max_iter=5000, random_state=int(seed))


def screen_cut(screen_scores: np.ndarray, labels: np.ndarray, margin: float) -> float:
    """The screen's cut: a text scored below it skips the encoder and keeps the screen's score.
    `margin` times the lowest out-of-fold screen score of any injection, so that no training
    injection would have skipped the encoder, with room to spare."""
    positives = np.asarray(screen_scores)[np.asarray(labels) == 1]
    return float(positives.min() * margin) if len(positives) else 0.0


def allowed_false_positives(n: int, target_fpr: float, confidence: float | None = None) -> int:
    """How many of n negatives a threshold may flag: floor(target_fpr * n) (confidence None),
    else the most whose one-sided Clopper-Pearson upper bound of the FPR at `confidence` is
    still <= target_fpr (0 when even none is not: too few negatives to show it)."""
    if confidence is None:
        return int(math.floor(float(target_fpr) * n + 1e-9))
    from scipy.stats import beta

    k = 0
    while k + 1 < n and beta.ppf(float(confidence), k + 2, n - k - 1) <= target_fpr:
        k += 1
    return k


def _threshold_for_fpr(
    negative_scores: np.ndarray, target_fpr: float, rule: str = "midpoint", confidence: float | None = None
) -> float:
    """The threshold (flag when score >= threshold) under which at most
    allowed_false_positives(n, target_fpr, confidence) of these negatives are flagged;
    midpoint: halfway to the next higher negative score."""
    neg = np.sort(np.asarray(negative_scores, dtype=np.float64))[::-1]
    if len(neg) == 0:
        raise ValueError("no negative scores to choose a threshold on")
    allowed = allowed_false_positives(len(neg), target_fpr, confidence)
    if allowed >= len(neg):
        return float(np.nextafter(neg[-1], -np.inf)) if neg[-1] > 0 else 0.0
    cut = neg[allowed]  # the highest negative that must stay unflagged
    higher = neg[:allowed][neg[:allowed] > cut]
    upper = float(higher.min()) if len(higher) else 1.0
    if rule == "edge" or upper <= cut:
        return float(min(np.nextafter(cut, np.inf), 1.0))
    return float(cut + (upper - cut) / 2.0)


# ---------------------------------------------------------------------------------------
# training


def _resolve_params(params: dict | None) -> dict:
    params = dict(params or {})
    unknown = sorted(set(params) - set(DEFAULT_PARAMS) - {"test_fraction", "per_method"})
    if unknown:
        raise ValueError(f"unknown filter params {unknown}; known: {sorted(DEFAULT_PARAMS)}")
    cfg = {**DEFAULT_PARAMS, **{k: v for k, v in params.items() if k in DEFAULT_PARAMS}}
    if cfg["method"] not in METHODS:
        raise ValueError(f"unknown method {cfg['method']!r}; one of {list(METHODS)}")
    if cfg["embeddings"] not in ("static", "encoder"):
        raise ValueError(f"embeddings must be static or encoder, got {cfg['embeddings']!r}")
    if cfg["method"] != "hybrid":  # the baseline is the frozen encoder by definition; finetune trains it
        cfg["embeddings"] = "encoder"
    if cfg["threshold_rule"] not in ("midpoint", "edge"):
        raise ValueError(f"threshold_rule must be midpoint or edge, got {cfg['threshold_rule']!r}")
    if not 0 < float(cfg["screen_margin"]) <= 1:
        raise ValueError(f"screen_margin must be in (0, 1], got {cfg['screen_margin']!r}")
    conf = cfg["fpr_confidence"]
    if conf is not None and not (isinstance(conf, (int, float)) and 0 < float(conf) < 1):
        raise ValueError(f"fpr_confidence must be in (0, 1) or null, got {conf!r}")
    return cfg


def _finetune_encoder(texts: np.ndarray, labels: np.ndarray, cfg: dict, seed: int, progress: Progress, label: str = ""):
    """A fresh copy of the packaged encoder fine-tuned with BCE through a linear head
    (length-bucketed batches; linear warm-up then decay)."""
    import torch

    torch.manual_seed(seed)
    model = load_encoder(encoder_path(), cfg["device"], shared=False)
    inference_length = model.max_seq_length
    model.max_seq_length = int(cfg["train_max_seq_length"])
    model.train()
    dim = dimension(model)
    head = torch.nn.Linear(dim, 1).to(model.device)
    opt = torch.optim.AdamW(
        [
            {"params": model.parameters(), "lr": float(cfg["learning_rate"])},
            {"params": head.parameters(), "lr": float(cfg["head_learning_rate"])},
        ],
        weight_decay=0.01,
    )
    bs, epochs, n = int(cfg["train_batch_size"]), int(cfg["epochs"]), len(texts)
    steps = max(epochs * math.ceil(n / bs), 1)
    warm = max(1, int(0.1 * steps))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) * max(0.0, (steps - s) / steps))
    pos = max(int(labels.sum()), 1)
    pos_weight = torch.tensor((n - pos) / pos, dtype=torch.float32, device=model.device)
    rng = np.random.default_rng(seed)
    lengths = np.array([len(t) for t in texts], dtype=np.float64)
    for epoch in range(epochs):
        order = np.argsort(lengths * (1 + 0.2 * rng.random(n)))  # near-equal lengths batch together
        batches = [order[i : i + bs] for i in range(0, n, bs)]
        rng.shuffle(batches)
        total = 0.0
        for b in batches:
            feats = model.preprocess([str(t) for t in texts[b]])
            feats = {k: (v.to(model.device) if hasattr(v, "to") else v) for k, v in feats.items()}
            emb = model(feats)["sentence_embedding"]
            logits = head(emb * 10.0).squeeze(-1)
            y = torch.tensor(labels[b], dtype=torch.float32, device=model.device)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, y, pos_weight=pos_weight)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            total += float(loss.detach()) * len(b)
        _say(progress, f"finetune{label}: epoch {epoch + 1}/{epochs} loss {total / n:.4f}")
    model.eval()
    model.max_seq_length = inference_length
    return model


def _feature_model(cfg: dict):
    """What a frozen method's dense features come from: the distilled table or the encoder."""
    if cfg["embeddings"] == "static":
        return distilled_encoder(encoder_path())
    return load_encoder(encoder_path(), cfg["device"])


def _fit(
    method: str,
    texts: np.ndarray,
    labels: np.ndarray,
    cfg: dict,
    seed: int,
    progress: Progress,
    dense: np.ndarray | None = None,
    label: str = "",
):
    """(head, encoder or None for the packaged one) fitted on these rows."""
    encoder = None
    if method == "finetune":
        encoder = _finetune_encoder(texts, labels, cfg, seed, progress, label)
        dense = dense_features(encoder, list(texts), cfg)
    screen = bool(cfg["screen"]) and cfg["embeddings"] == "encoder"
    head = fit_head(cfg, texts, dense, labels, seed, use_tfidf=method != "baseline", screen=screen)
    return head, encoder


def _extra_view_scores(
    head: "_Head", model, extra: list[list[str]], rows: np.ndarray, cfg: dict, dense_extra: np.ndarray | None
) -> np.ndarray:
    """Per row of `rows`, the highest score of its views beyond the first (0 without any).
    dense_extra: the frozen features of every extra view, in order (None: computed with `model`)."""
    out = np.zeros(len(rows), dtype=np.float64)
    starts = np.cumsum([0] + [len(xs) for xs in extra])
    picked = [(i, j) for i, r in enumerate(rows) for j in range(starts[r], starts[r + 1])]
    if not picked:
        return out
    flat = [x for xs in extra for x in xs]
    view_texts = [flat[j] for _, j in picked]
    dense: np.ndarray | None
    if dense_extra is not None:
        dense = dense_extra[[j for _, j in picked]]
    else:
        dense = dense_features(model, view_texts, cfg) if model is not None else None
    for (i, _), score in zip(picked, head.predict(view_texts, dense)):
        out[i] = max(out[i], score)
    return out


def train_classifier(
    train_df, target_fpr: float, seed: int, params: dict | None = None, progress: Progress = None
) -> InjectionClassifier:
    """Train params["method"] (default hybrid) on train_df; threshold for target_fpr from
    out-of-fold scores on train_df only. Exact duplicate texts are dropped first."""
    from sklearn.metrics import roc_auc_score
    from sklearn.model_selection import StratifiedKFold

    started = time.perf_counter()
    if not 0 < float(target_fpr) < 1:
        raise ValueError(f"target_fpr must be in (0, 1), got {target_fpr}")
    cfg = _resolve_params(params)
    method = cfg["method"]
    if method == "baseline":
        cfg["segments"] = False
    df, dedup = deduplicate(train_df)
    # Trained on what it is shown when serving: the normalised text (view 1 of
    # tuneloop/gateway/normalize.py); the out-of-fold scores take the maximum over every view.
    views = [screening_views(t) for t in df["text"]]
    texts = np.array([v[0] for v in views], dtype=object)
    extra = [v[1:] for v in views]
    labels = df["label"].to_numpy(dtype=int)
    n_pos, n_neg = int(labels.sum()), int(len(labels) - labels.sum())
    folds = int(cfg["finetune_oof_folds"] if method == "finetune" else cfg["oof_folds"])
    if folds < 2:
        raise ValueError("oof_folds must be at least 2")
    if min(n_pos, n_neg) < folds:
        raise ValueError(
            f"need at least {folds} injections and {folds} benign rows to train ({n_pos} injections, {n_neg} benign)"
        )
    _say(
        progress,
        f"filter {method}: {len(df)} training rows ({n_pos} injections), target FPR {target_fpr:.1%}, "
        f"{folds}-fold out-of-fold threshold",
    )
    _seed_everything(seed)

    dense, features, dense_extra = None, None, None
    if method != "finetune":  # frozen features: computed once, reused by every fold
        t0 = time.perf_counter()
        features = _feature_model(cfg)
        dense = dense_features(features, list(texts), cfg)
        dense_extra = dense_features(features, [x for xs in extra for x in xs], cfg) if any(extra) else None
        _say(
            progress,
            f"filter {method}: {cfg['embeddings']} embeddings of {len(texts)} texts in {time.perf_counter() - t0:.1f}s",
        )

    oof = np.zeros(len(texts), dtype=np.float64)
    oof_screen = np.full(len(texts), np.nan)
    skf = StratifiedKFold(n_splits=folds, shuffle=True, random_state=int(seed))
    for k, (tr, va) in enumerate(skf.split(texts, labels)):
        head, enc = _fit(
            method,
            texts[tr],
            labels[tr],
            cfg,
            seed + k + 1,
            progress,
            dense=None if dense is None else dense[tr],
            label=f" fold {k + 1}/{folds}",
        )
        if enc is None:
            assert dense is not None  # no encoder of its own: a frozen-feature method, computed above
            dva = dense[va]
        else:
            dva = dense_features(enc, list(texts[va]), cfg)
        oof[va] = head.predict(list(texts[va]), dva)
        oof[va] = np.maximum(
            oof[va], _extra_view_scores(head, enc if enc is not None else features, extra, va, cfg, dense_extra)
        )
        first = head.screen(head.sparse(list(texts[va])))
        if first is not None:
            oof_screen[va] = first
        _say(progress, f"filter {method}: fold {k + 1}/{folds} done")
        del enc
    cut = None
    if not np.isnan(oof_screen).any():  # the cascade: scores as served, the screen's below its cut
        cut = screen_cut(oof_screen, labels, float(cfg["screen_margin"]))
        oof = np.where(oof_screen < cut, oof_screen, oof)
    threshold = _threshold_for_fpr(oof[labels == 0], target_fpr, cfg["threshold_rule"], cfg["fpr_confidence"])
    oof_flags = oof >= threshold
    head, encoder = _fit(method, texts, labels, cfg, seed, progress, dense=dense, label=" (all)")
    seconds = time.perf_counter() - started
    info = {
        "target_fpr": float(target_fpr),
        "fpr_confidence": cfg["fpr_confidence"],
        "screen_cut": cut,
        "oof_screened_out": None if cut is None else float((oof_screen < cut).mean()),
        "seed": int(seed),
        "n_train": int(len(texts)),
        "n_train_injections": n_pos,
        "oof_folds": folds,
        "oof_roc_auc": float(roc_auc_score(labels, oof)),
        "oof_recall": float(oof_flags[labels == 1].mean()),
        "oof_fpr": float(oof_flags[labels == 0].mean()),
        "train_seconds": round(seconds, 2),
        "encoder": ENCODER_NAME,
        "embeddings": cfg["embeddings"],
        "encoder_finetuned": method == "finetune",
        **dedup,
    }
    _say(
        progress,
        f"filter {method}: threshold {threshold:.4f} (out-of-fold recall {info['oof_recall']:.3f} at "
        f"FPR {info['oof_fpr']:.3f}, ROC-AUC {info['oof_roc_auc']:.3f}); trained in {seconds:.1f}s",
    )
    if method == "finetune":
        ref = {"kind": "directory", "path": "encoder"}
    elif cfg["embeddings"] == "static":
        ref = {"kind": "static", "path": "static", "distilled_from": ENCODER_NAME}
        encoder = features
    else:
        ref = {"kind": "packaged", "package": ENCODER_PACKAGE, "model": ENCODER_NAME}
    config = {k: cfg[k] for k in ("segments", "max_segments", "whole_embedding", "batch_size", "device")}
    config["normalize"] = True  # scores() reads the views of tuneloop/gateway/normalize.py
    config["screen_cut"] = cut
    config["params"] = {k: v for k, v in cfg.items()}
    return InjectionClassifier(method, threshold, info, head, config, ref, encoder)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    try:
        import torch

        torch.manual_seed(seed)
    except ImportError:  # pragma: no cover
        pass


# ---------------------------------------------------------------------------------------
# evaluation


def evaluate_classifier(clf: InjectionClassifier, test_df) -> dict:
    """Held-out metrics at the classifier's own threshold (+ ROC-AUC over its scores)."""
    from sklearn.metrics import roc_auc_score

    df = validate_labelled(test_df, source="test set")
    labels = df["label"].to_numpy(dtype=int)
    scores = clf.scores(df["text"].tolist())
    pred = scores >= clf.threshold
    tp = int(np.sum(pred & (labels == 1)))
    fp = int(np.sum(pred & (labels == 0)))
    tn = int(np.sum(~pred & (labels == 0)))
    fn = int(np.sum(~pred & (labels == 1)))
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    fpr = fp / (fp + tn) if fp + tn else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    auc = float(roc_auc_score(labels, scores)) if 0 < labels.sum() < len(labels) else float("nan")
    return {
        "precision": float(precision),
        "recall": float(recall),
        "fpr": float(fpr),
        "f1": float(f1),
        "accuracy": float((tp + tn) / len(labels)),
        "roc_auc": auc,
        "threshold": float(clf.threshold),
        "target_fpr": float(clf.info.get("target_fpr", float("nan"))),
        "recall_at_target_fpr": float(recall),  # recall at the threshold chosen for target_fpr on training data
        "n_test": int(len(labels)),
        "tp": tp,
        "fp": fp,
        "tn": tn,
        "fn": fn,
    }


def confusion_matrix_figure(metrics: dict, path) -> Path:
    """A PNG of the 2x2 confusion matrix (rows: truth, columns: prediction)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    cells = np.array([[int(metrics["tn"]), int(metrics["fp"])], [int(metrics["fn"]), int(metrics["tp"])]])
    fig = Figure(figsize=(4.8, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.imshow(cells, cmap="Blues", vmin=0, vmax=max(int(cells.max()), 1))
    names = ["benign", "injection"]
    ax.set_xticks([0, 1], labels=[f"pred {n}" for n in names])
    ax.set_yticks([0, 1], labels=[f"true {n}" for n in names])
    for (i, j), v in np.ndenumerate(cells):
        ax.text(j, i, str(v), ha="center", va="center", fontsize=16, color="white" if v > cells.max() / 2 else "black")
    title = "Prompt-injection classifier"
    sub = []
    for key, label in (("recall", "recall"), ("fpr", "FPR"), ("threshold", "thr")):
        if key in metrics and metrics[key] is not None:
            sub.append(f"{label} {float(metrics[key]):.3f}")
    ax.set_title(title + ("\n" + ", ".join(sub) if sub else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


def compare_methods(
    df,
    seeds: Iterable[int],
    target_fpr: float,
    methods: Sequence[str] = ("baseline", "hybrid"),
    params: dict | None = None,
    progress: Progress = None,
) -> dict:
    """Repeated stratified splits (one per seed): every method trained on the same training
    part (threshold from its out-of-fold scores) and scored on the same held-out part.
    params: shared settings (test_fraction: default 0.2), params["per_method"][m] overrides."""
    params = dict(params or {})
    per_method = params.pop("per_method", {}) or {}
    test_fraction = float(params.pop("test_fraction", 0.2))
    seeds = [int(s) for s in seeds]
    methods = list(methods)
    if not seeds or not methods:
        raise ValueError("compare_methods needs at least one seed and one method")
    df = validate_labelled(df)
    out: dict[str, Any] = {
        "target_fpr": float(target_fpr),
        "test_fraction": test_fraction,
        "seeds": seeds,
        "methods": {m: {"per_seed": []} for m in methods},
    }
    keys = ("recall", "fpr", "roc_auc", "precision", "f1", "train_seconds", "threshold")
    for seed in seeds:
        train_df, test_df = split_labelled(df, test_fraction, seed)
        for m in methods:
            mp = {**params, **per_method.get(m, {}), "method": m}
            t0 = time.perf_counter()
            clf = train_classifier(train_df, target_fpr, seed, mp, progress=progress)
            seconds = time.perf_counter() - t0
            metrics = evaluate_classifier(clf, test_df)
            row = {
                "seed": seed,
                "train_seconds": round(seconds, 2),
                **metrics,
                "oof_recall": clf.info["oof_recall"],
                "oof_fpr": clf.info["oof_fpr"],
            }
            out["methods"][m]["per_seed"].append(row)
            _say(
                progress,
                f"compare seed {seed} {m}: recall {metrics['recall']:.3f} fpr {metrics['fpr']:.3f} "
                f"auc {metrics['roc_auc']:.3f} ({seconds:.1f}s)",
            )
    for m in methods:
        rows = out["methods"][m]["per_seed"]
        out["methods"][m]["mean"] = {k: float(np.mean([r[k] for r in rows])) for k in keys}
        out["methods"][m]["std"] = {
            k: float(np.std([r[k] for r in rows], ddof=1 if len(rows) > 1 else 0)) for k in keys
        }
        out["methods"][m]["min"] = {k: float(np.min([r[k] for r in rows])) for k in keys}
        out["methods"][m]["max"] = {k: float(np.max([r[k] for r in rows])) for k in keys}
    return out
