"""Turn the configured data files into a prepared, fingerprinted dataset on disk.

prepare_dataset reads the train file (and an eval file, or splits one off), handles bad
rows as the config says (data.on_bad_rows), applies the row policies (validation.pii, then
validation.overlong: tuneloop/data/policies.py) to train and eval alike, and writes

    <home>/datasets/<fingerprint[:12]>/
        train.jsonl     normalised Examples, one per line (read_examples reads them back)
        eval.jsonl
        rejects.jsonl   every bad row: file, line (or record), reason and the raw text; and
                        every row a policy dropped, truncated or redacted (action, policy)
        manifest.json   fingerprint, counts, sources, format, split settings, rejects by
                        reason, what each policy did

The fingerprint hashes the content of the train and eval examples (not file names, not
row order), so the same data gives the same folder and lineage can name the data a model
was trained on: the rows kept, as the policies left them, are what it hashes and what the
training flow trains on.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from tuneloop.config import TuneloopConfig
from tuneloop.data.formats import PREFERENCE_FORMATS, DataError, load_file
from tuneloop.data.policies import TokenBudget, apply_length_policy, apply_pii_policy, presidio_redactor
from tuneloop.data.schema import Example, Reject

DATA_SUFFIXES = (".jsonl", ".json")


@dataclass
class PreparedDataset:
    train: list[Example]
    eval: list[Example]
    rejects: list[Reject]  # rows in neither split: bad rows, rows a policy dropped
    fingerprint: str
    dir: Path
    manifest: dict[str, Any] = field(default_factory=dict)
    changed: list[Reject] = field(default_factory=list)  # kept rows a policy truncated or redacted

    @property
    def preference(self) -> bool:
        """Preference pairs (OpenAI's DPO format: training.objective dpo), not supervised rows."""
        return any(e.is_preference for e in self.train)

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
            f"{len(self.train)} train, {len(self.eval)} eval, {len(self.rejects)} rejected"
            + (f", {len(self.changed)} changed" if self.changed else ""),
            f"  {split}",
        ]
        for reason, n in m.get("rejects_by_reason", {}).items():
            lines.append(f"  rejected {n} x {reason}")
        for reason, n in m.get("changed_by_reason", {}).items():
            lines.append(f"  kept, changed: {n} x {reason}")
        for name, p in m.get("policies", {}).items():
            if not p.get("applied", True):
                lines.append(f"  validation.{name}: {p['policy']}, not applied: {p['why']}")
        if self.rejects or self.changed:
            lines.append(f"  rejected and changed rows kept in {self.rejects_path}")
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


def split_examples(examples: list[Example], eval_fraction: float, seed: int,
                   group_threshold: float | None = None) -> tuple[list[Example], list[Example]]:
    """Deterministic train/eval split keyed by content, not by position.

    Examples are grouped: rows sharing a prompt always, and with group_threshold also rows
    whose prompts are near-duplicates (tuneloop/data/neardup.py: the same review under
    nine templates is one group). Each group is ranked by a seeded hash of its smallest
    prompt hash, and whole groups in rank order go to eval until round(n * eval_fraction)
    rows are there. Ranks do not depend on the other rows, so adding rows moves few existing
    ones across the boundary, and a group never straddles the split (neither a duplicate
    nor a templated copy can leak from train into eval). Both sides keep file order.
    """
    n = len(examples)
    if n < 2:
        raise DataError(f"need at least 2 examples to split off an eval set, have {n}")
    n_eval = min(n - 1, max(1, round(n * eval_fraction)))
    group_of = _prompt_groups(examples, group_threshold)
    members: dict[int, list[Example]] = {}
    for e, g in zip(examples, group_of):
        members.setdefault(g, []).append(e)
    if len(members) < 2:
        raise DataError("every example has the same (or a near-duplicate) prompt: nothing left to train on "
                        "after the eval split" + (" (data.split_group_threshold groups them)" if group_threshold else ""))

    def rank(g: int) -> tuple[str, str]:
        smallest = min(e.prompt_hash for e in members[g])
        return hashlib.sha256(f"{seed}\0{smallest}".encode()).hexdigest(), smallest

    eval_groups: set[int] = set()
    taken = 0
    for g in sorted(members, key=rank):
        if taken >= n_eval or len(eval_groups) == len(members) - 1:
            break
        eval_groups.add(g)
        taken += len(members[g])
    eval = [e for e, g in zip(examples, group_of) if g in eval_groups]
    train = [e for e, g in zip(examples, group_of) if g not in eval_groups]
    return train, eval


def _prompt_groups(examples: list[Example], threshold: float | None) -> list[int]:
    """A group id per example: equal prompt hashes share one; near-duplicates too if threshold."""
    if threshold is None:
        ids: dict[str, int] = {}
        return [ids.setdefault(e.prompt_hash, len(ids)) for e in examples]
    # deferred: datasketch (0.6 s), only with a near-duplicate threshold
    from tuneloop.data.neardup import near_duplicate_groups

    groups = near_duplicate_groups([e.prompt_text for e in examples], threshold)
    # Identical prompts join too, also those neardup cannot judge (no words): union-find.
    parent = list(range(max(groups, default=-1) + 1))

    def root(g: int) -> int:
        while parent[g] != g:
            parent[g] = parent[parent[g]]
            g = parent[g]
        return g

    first: dict[str, int] = {}
    for e, g in zip(examples, groups):
        other = first.setdefault(e.prompt_hash, g)
        a, b = root(g), root(other)
        if a != b:
            parent[max(a, b)] = min(a, b)
    return [root(g) for g in groups]


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


def _reason_kind(r: Reject) -> str:
    # Counting by kind, not by exact text: "messages[3]" and "column 17" differ per row.
    kind = re.sub(r"\d+", "N", r.reason)
    return f"{kind} (validation.{r.policy}: {r.action})" if r.policy else kind


def _apply_policies(cfg: TuneloopConfig, examples: list[Example], budget: TokenBudget | None,
                    make_redactor) -> tuple[list[Example], list[Reject]]:
    """Personal data first (redacting changes lengths), then length."""
    examples, touched = apply_pii_policy(examples, cfg.validation, make_redactor)
    if budget is not None:
        examples, too_long = apply_length_policy(examples, cfg.validation.overlong, budget)
        touched += too_long
    return examples, touched


def _policies_manifest(cfg: TuneloopConfig, budget: TokenBudget | None, touched: list[Reject]) -> dict[str, Any]:
    v = cfg.validation

    def counts(policy: str) -> dict[str, int]:
        return dict(Counter(r.action for r in touched if r.policy == policy))

    overlong: dict[str, Any] = {"policy": v.overlong, "max_fraction": v.max_overlong_fraction}
    if budget is None:
        overlong.update(applied=False, why="no tokenizer given (prepare_dataset(..., budget=None))")
    else:
        overlong.update(max_tokens=budget.limit, max_tokens_from=budget.source, **counts("overlong"))
    pii: dict[str, Any] = {"policy": v.pii, "max_fraction": v.max_pii_fraction, **counts("pii")}
    if not (v.check_pii or v.check_secrets):
        pii.update(applied=False, why="check_pii and check_secrets are off")
    return {"pii": pii, "overlong": overlong}


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
                    eval_path: Path | str | None = None, budget: TokenBudget | None = None) -> PreparedDataset:
    """Load, check, apply the row policies, split and write the dataset the config (or the
    given paths) names.

    Paths given here are taken as they are (relative to the working directory); paths from
    the config resolve against the config's project root. A path may be a folder of files.
    budget: examples' tokens and the limit (validation.token_budget(cfg): the base model's
    tokenizer); without it the length policy is not applied, and the manifest says so.
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
    # Preference pairs and supervised rows train different objectives (dpo, sft).
    if any(f in PREFERENCE_FORMATS for f in formats) and len(formats) > 1:
        raise DataError(f"cannot mix preference pairs (OpenAI's DPO format) with supervised rows: formats {formats}")

    make_redactor = functools.cache(lambda: presidio_redactor(cfg))  # built on the first row to redact
    examples, touched = _apply_policies(cfg, examples, budget, make_redactor)
    eval_examples, eval_touched = _apply_policies(cfg, eval_examples, budget, make_redactor)
    touched += eval_touched
    rejects += [r for r in touched if r.action == "dropped"]
    changed = [r for r in touched if r.action != "dropped"]

    if not examples:
        raise DataError(f"{train_file}: no usable training rows ({len(rejects)} rejected)")
    if eval_file is not None:
        if not eval_examples:
            raise DataError(f"{eval_file}: no usable eval rows ({len(eval_touched)} dropped by the policies)")
        train = examples
        eval = eval_examples
    else:
        train, eval = split_examples(examples, d.eval_fraction, d.seed, d.split_group_threshold)

    fp = fingerprint(train, eval)
    out = cfg.datasets_dir / fp[:12]
    manifest = {
        "fingerprint": fp,
        "format": "+".join(formats),
        "counts": {"train": len(train), "eval": len(eval), "rejects": len(rejects)},
        "sources": {"train": train_sources, "eval": eval_sources},
        "split": "file" if eval_file is not None else ("hash of near-duplicate groups" if d.split_group_threshold
                                                        else "hash of the prompt"),
        "split_group_threshold": None if eval_file is not None else d.split_group_threshold,
        "seed": d.seed,
        "eval_fraction": None if eval_file is not None else d.eval_fraction,
        "on_bad_rows": d.on_bad_rows,
        "rejects_by_reason": dict(Counter(_reason_kind(r) for r in rejects).most_common()),
        "changed_by_reason": dict(Counter(_reason_kind(r) for r in changed).most_common()),
        "policies": _policies_manifest(cfg, budget, touched),
    }
    out.mkdir(parents=True, exist_ok=True)
    _write_jsonl(out / "train.jsonl", (e.to_dict() for e in train))
    _write_jsonl(out / "eval.jsonl", (e.to_dict() for e in eval))
    _write_jsonl(out / "rejects.jsonl", (r.to_dict() for r in rejects + changed))
    _write_json(out / "manifest.json", manifest)  # last: its presence means the folder is complete
    return PreparedDataset(train=train, eval=eval, rejects=rejects, fingerprint=fp, dir=out, manifest=manifest,
                           changed=changed)


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
    rows = _read_rejects(dir / "rejects.jsonl")
    return PreparedDataset(train=train, eval=eval, rejects=[r for r in rows if r.action == "dropped"],
                           fingerprint=fp, dir=dir, manifest=manifest,
                           changed=[r for r in rows if r.action != "dropped"])
