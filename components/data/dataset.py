"""Turn the configured data files into a prepared, fingerprinted dataset on disk.

prepare_dataset reads the train file (and an eval file, or splits one off), handles bad
rows as the config says, and writes

    <home>/datasets/<fingerprint[:12]>/
        train.jsonl     normalised Examples, one per line (read_examples reads them back)
        eval.jsonl
        rejects.jsonl   every bad row: file, line, reason and the raw text
        manifest.json   fingerprint, counts, sources, format, split settings, rejects by reason

The fingerprint hashes the content of the train and eval examples (not file names, not
row order), so the same data gives the same folder and lineage can name the data a model
was trained on.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from components.config import TuneloopConfig
from components.data.formats import DataError, load_file
from components.data.schema import Example, Reject

DATA_SUFFIXES = (".jsonl", ".json")


@dataclass
class PreparedDataset:
    train: list[Example]
    eval: list[Example]
    rejects: list[Reject]
    fingerprint: str
    dir: Path
    manifest: dict[str, Any] = field(default_factory=dict)

    @property
    def train_path(self) -> Path:
        return self.dir / "train.jsonl"

    @property
    def eval_path(self) -> Path:
        return self.dir / "eval.jsonl"

    @property
    def rejects_path(self) -> Path:
        return self.dir / "rejects.jsonl"

    def summary(self) -> str:
        m = self.manifest
        split = ("eval from " + ", ".join(s["path"] for s in m["sources"]["eval"])
                 if m.get("split") == "file"
                 else f"eval split off: fraction {m.get('eval_fraction')}, seed {m.get('seed')}")
        lines = [
            f"dataset {self.fingerprint[:12]} ({m.get('format')}): "
            f"{len(self.train)} train, {len(self.eval)} eval, {len(self.rejects)} rejected",
            f"  {split}",
        ]
        for reason, n in m.get("rejects_by_reason", {}).items():
            lines.append(f"  rejected {n} x {reason}")
        if self.rejects:
            lines.append(f"  rejected rows kept in {self.rejects_path}")
        lines.append(f"  written to {self.dir}")
        return "\n".join(lines)


# ---------------------------------------------------------------------- helpers

def fingerprint(train: Iterable[Example], eval: Iterable[Example]) -> str:
    """sha256 over the examples' content, per split, independent of order and file names."""
    payload = json.dumps({
        "train": sorted(e.content_hash for e in train),
        "eval": sorted(e.content_hash for e in eval),
    })
    return hashlib.sha256(payload.encode()).hexdigest()


def split_examples(examples: list[Example], eval_fraction: float, seed: int) -> tuple[list[Example], list[Example]]:
    """Deterministic train/eval split keyed by content, not by position.

    Each example is ranked by a seeded hash of its prompt, and the lowest-ranked
    round(n * eval_fraction) go to eval. Ranks do not depend on the other rows, so adding
    rows moves few existing ones across the boundary, and rows sharing a prompt share a
    rank and stay on one side (a duplicate cannot leak from train into eval).
    Both sides keep file order.
    """
    n = len(examples)
    if n < 2:
        raise DataError(f"need at least 2 examples to split off an eval set, have {n}")
    n_eval = min(n - 1, max(1, round(n * eval_fraction)))

    def rank(e: Example) -> tuple[str, str, str]:
        key = hashlib.sha256(f"{seed}\0{e.prompt_hash}".encode()).hexdigest()
        return key, e.content_hash, e.example_id

    ranked = sorted(examples, key=rank)
    eval_prompts = {e.prompt_hash for e in ranked[:n_eval]}
    eval = [e for e in examples if e.prompt_hash in eval_prompts]
    train = [e for e in examples if e.prompt_hash not in eval_prompts]
    if not train:
        raise DataError("every example has the same prompt: nothing left to train on after the eval split")
    return train, eval


def _data_files(path: Path) -> list[Path]:
    """A data path is one file, or a folder whose .jsonl/.json files are read in name order."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in DATA_SUFFIXES)
        if not files:
            raise DataError(f"{path}: folder holds no {' or '.join(DATA_SUFFIXES)} files")
        return files
    return [path]


def _load(path: Path, fmt: str) -> tuple[list[Example], list[Reject], list[dict[str, Any]]]:
    examples: list[Example] = []
    rejects: list[Reject] = []
    sources = []
    for f in _data_files(path):
        result = load_file(f, fmt)
        examples += result.examples
        rejects += result.rejects
        sources.append({
            "path": str(f),
            "sha256": hashlib.sha256(f.read_bytes()).hexdigest(),
            "format": result.format,
            "examples": len(result.examples),
            "rejects": len(result.rejects),
        })
    return examples, rejects, sources


def _reason_kind(reason: str) -> str:
    # Counting by kind, not by exact text: "messages[3]" and "column 17" differ per row.
    return re.sub(r"\d+", "N", reason)


def _write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)  # a reader never sees half a file


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


# ---------------------------------------------------------------------- entry points

def prepare_dataset(cfg: TuneloopConfig, train_path: Path | str | None = None,
                    eval_path: Path | str | None = None) -> PreparedDataset:
    """Load, check, split and write the dataset the config (or the given paths) names.

    Paths given here are taken as they are (relative to the working directory); paths from
    the config resolve against the config's project root. A path may be a folder of files.
    Raises DataError on unusable files, or on any bad row when data.on_bad_rows is "fail".
    """
    d = cfg.data
    train_file = Path(train_path).expanduser() if train_path is not None else cfg.resolve(d.train_path)
    if eval_path is not None:
        eval_file: Path | None = Path(eval_path).expanduser()
    else:
        eval_file = cfg.resolve(d.eval_path) if d.eval_path is not None else None

    examples, rejects, train_sources = _load(train_file, d.format)
    eval_examples: list[Example] = []
    eval_sources: list[dict[str, Any]] = []
    if eval_file is not None:
        eval_examples, eval_rejects, eval_sources = _load(eval_file, d.format)
        rejects += eval_rejects

    if rejects and d.on_bad_rows == "fail":
        listing = "\n".join(f"  {r}" for r in rejects)
        raise DataError(
            f"{len(rejects)} bad row(s) (data.on_bad_rows is 'fail'; 'quarantine' sets them aside):\n{listing}"
        )

    formats = sorted({s["format"] for s in train_sources + eval_sources})
    # Legacy rows are raw text, the others are conversations rendered with a chat template:
    # a model trained on one and evaluated on the other would be measured on the wrong thing.
    if "legacy" in formats and len(formats) > 1:
        raise DataError(f"cannot mix legacy prompt/completion rows with conversations: formats {formats}")

    if not examples:
        raise DataError(f"{train_file}: no usable training rows ({len(rejects)} rejected)")
    if eval_file is not None:
        if not eval_examples:
            raise DataError(f"{eval_file}: no usable eval rows")
        train = examples
        eval = eval_examples
    else:
        train, eval = split_examples(examples, d.eval_fraction, d.seed)

    fp = fingerprint(train, eval)
    out = cfg.datasets_dir / fp[:12]
    manifest = {
        "fingerprint": fp,
        "format": "+".join(formats),
        "counts": {"train": len(train), "eval": len(eval), "rejects": len(rejects)},
        "sources": {"train": train_sources, "eval": eval_sources},
        "split": "file" if eval_file is not None else "hash",
        "seed": d.seed,
        "eval_fraction": None if eval_file is not None else d.eval_fraction,
        "on_bad_rows": d.on_bad_rows,
        "rejects_by_reason": dict(Counter(_reason_kind(r.reason) for r in rejects).most_common()),
    }
    out.mkdir(parents=True, exist_ok=True)
    _write_jsonl(out / "train.jsonl", (e.to_dict() for e in train))
    _write_jsonl(out / "eval.jsonl", (e.to_dict() for e in eval))
    _write_jsonl(out / "rejects.jsonl", (r.to_dict() for r in rejects))
    _write_json(out / "manifest.json", manifest)  # last: its presence means the folder is complete
    return PreparedDataset(train=train, eval=eval, rejects=rejects, fingerprint=fp, dir=out, manifest=manifest)


def read_examples(path: Path | str) -> list[Example]:
    """Read a normalised JSONL (train.jsonl / eval.jsonl of a prepared dataset)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    examples = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                examples.append(Example.from_dict(json.loads(line)))
            except (json.JSONDecodeError, TypeError) as exc:
                raise DataError(f"{path}:{number}: not a normalised example ({exc})") from None
    return examples


def _read_rejects(path: Path) -> list[Reject]:
    rejects = []
    if path.is_file():
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    rejects.append(Reject(**json.loads(line)))
                except (json.JSONDecodeError, TypeError) as exc:
                    raise DataError(f"{path}:{number}: not a reject record ({exc})") from None
    return rejects


def load_prepared(dir: Path | str) -> PreparedDataset:
    """Read back a folder written by prepare_dataset, checking it was not modified since."""
    dir = Path(dir)
    manifest_path = dir / "manifest.json"
    if not manifest_path.is_file():
        raise DataError(f"{dir}: not a prepared dataset (no manifest.json)")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise DataError(f"{manifest_path}: invalid JSON ({exc})") from None
    train = read_examples(dir / "train.jsonl")
    eval = read_examples(dir / "eval.jsonl")
    fp = fingerprint(train, eval)
    if fp != manifest.get("fingerprint"):
        raise DataError(f"{dir}: examples do not match the manifest's fingerprint (modified after preparation?)")
    return PreparedDataset(train=train, eval=eval, rejects=_read_rejects(dir / "rejects.jsonl"),
                           fingerprint=fp, dir=dir, manifest=manifest)
