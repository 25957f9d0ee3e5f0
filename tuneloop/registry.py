"""The model registry: MLflow registered-model versions, aliases, and an audit trail.

One file on purpose: the promotion protocol (append to the log, replay it, copy the decision
to the aliases) and the registry operations it guards are one argument, read together; a
tenth of the file is this docstring's account of why it holds.

This module is the ONE place that knows the alias names and the tag keys tuneloop uses:

  champion   -- the version serving traffic (what `models:/<name>@champion` loads)
  challenger -- the candidate picked by the last training run, waiting for blessing
  previous   -- the champion before the current one: where `rollback` goes

Promotion is compare-and-set: the caller says which champion it evaluated against
(`expected_champion`); if anyone promoted in the meantime, on this machine or another one
sharing the MLflow backend (an HTTP tracking server, or its database), the promotion is
refused (PromotionConflict), never applied twice.

How, given that MLflow's API has no conditional write (aliases and tags are
last-writer-wins): every promotion and rollback is first *appended* to a promotion log,
and the log decides. The log is a second registered model, `<name>.promotion-log`, whose
versions are the requests, in order: version k carries the request as a JSON tag
(action, to_version, from_version = the champion the requester expects, actor, reason,
time) and points at the promoted model's files. MLflow numbers versions itself, and its
SQL store does it atomically: the next number is taken inside a transaction that updates
the registered model's row (a row lock: a concurrent creator waits for the commit, then
sees it), and (name, version) is the primary key, so a duplicate number is rejected and
retried. Hence version numbers are unique, and when version k exists every lower version
that will ever exist already does. Replaying the log from version 1 therefore gives every
reader the same answer: request k is applied iff its from_version is the champion left by
the applied requests before it (a rollback also needs `previous` to be its target); else
it is refused. A promoter appends, reads the log up to its own version, and knows whether
it won -- no clocks, delays or leases involved.

Guarantee: with an SQL backend (PostgreSQL, MySQL, SQLite), directly or behind any number
of `mlflow server` processes, among promotions/rollbacks that expect the same champion
exactly one is applied and every other one raises PromotionConflict; the applied ones form
one chain (each starts from the champion the previous one left), and the history has one
record per applied request. A refused request stays in the log (tag `outcome: refused`)
as evidence of the race.

Limits, all of them about the aliases and history tags, which are a *copy* of the log's
decision written after it (serving reads the alias):
- between the decision and the copy (a few HTTP calls), and after a crash in between,
  readers of `@champion` still see the old champion; the next promotion, rollback or
  `repair()` writes the copy. Nothing is lost: the log holds the decision.
- a process that stalls (GC pause, network) between reading the log and writing the copy
  can write an older decision over a newer one; it re-reads the log after every copy and
  writes again until they agree, so the aliases converge -- but a reader may see the older
  champion for that moment, and if the process dies right then, until the next write.
- champion/previous moved by hand (the MLflow UI, another client) bypass the log; the next
  promotion puts them back to what the log says. Versions of the log model must not be
  deleted (a deleted request changes the replay).
- MLflow's FileStore (file:// backends) numbers versions without that atomicity: there, as
  before, promoters are serialised by an exclusive file lock next to the store (one
  machine). The same lock is taken for every backend (for a remote server it lives in the
  local temp dir), so promoters on one machine never race each other at all.
- a registry that existed before the log is adopted on first use: the first log version
  records the aliases as found (`adopt`).

Every applied promotion and rollback is recorded (who, what, when, why, from/to version) as
a JSON registered-model tag `promotion.<seq>`: it lives in the registry's own database,
travels with the model, and is visible in the MLflow UI.
"""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import hashlib
import json
import logging
import os
import tempfile
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlparse

from tuneloop.blessing import Blessing

logger = logging.getLogger(__name__)

CHAMPION = "champion"
CHALLENGER = "challenger"
PREVIOUS = "previous"

# Tag keys (model version tags unless noted).
TAG_BLESSED = "blessed"  # "true" / "false"
TAG_BLESSING_BASELINE = "blessing.baseline_version"
TAG_BLESSING_REASONS = "blessing.reasons"  # JSON list of strings
TAG_BLESSING_AT = "blessing.at"
TAG_DELTA = "blessing.delta.{metric}.{kind}"  # kind: absolute / relative
TAG_DEPLOYED_BENTO = "deployed.bento"
TAG_DEPLOYED_AT = "deployed.at"
TAG_PROMOTION = "promotion.{seq:06d}"  # registered-model tag, JSON record
PROMOTION_PREFIX = "promotion."
# The promotion log (see the module docstring): a registered model next to the real one.
LOG_SUFFIX = ".promotion-log"
TAG_LOG_REQUEST = "tuneloop.request"  # on each log version: the request, JSON
TAG_LOG_OUTCOME = "outcome"  # applied / refused: for people reading the log; the replay ignores it
LOG_REASON_CHARS = 4000


class RegistryError(Exception):
    """A registry operation that cannot be done; the message says why."""


class PromotionConflict(RegistryError):
    """The champion changed since the caller looked: the promotion was refused."""

    def __init__(self, version: str, expected: str | None, actual: str | None):
        self.version, self.expected, self.actual = version, expected, actual
        super().__init__(
            f"promotion of version {version} refused: expected the champion to be "
            f"{_v(expected)}, but it is {_v(actual)} (someone promoted in the meantime; "
            "re-evaluate against the new champion)"
        )


class NotBlessed(RegistryError):
    """Promotion of a version without a positive blessing."""


def _v(version: str | None) -> str:
    return "none" if version is None else f"v{version}"


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def default_actor() -> str:
    try:
        return getpass.getuser()
    except Exception:  # no user database entry (some containers)
        return f"uid-{os.getuid()}"


@dataclass
class ModelVersionInfo:
    name: str
    version: str
    run_id: str | None
    source: str
    aliases: list[str]
    tags: dict[str, str]

    @property
    def uri(self) -> str:
        return f"models:/{self.name}/{self.version}"

    @property
    def blessed(self) -> bool:
        return self.tags.get(TAG_BLESSED) == "true"


@dataclass
class PromotionRecord:
    seq: int
    action: str  # "promote" or "rollback"
    to_version: str
    from_version: str | None  # the champion before
    actor: str
    reason: str
    at: str  # ISO 8601, UTC
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class PromotionResult:
    promoted: bool
    version: str
    previous: str | None
    record: PromotionRecord


@dataclass
class LogState:
    """What the promotion log says, replayed up to some version."""

    champion: str | None = None
    previous: str | None = None
    seq: int = 0  # the last history sequence number
    records: dict[int, PromotionRecord] = field(default_factory=dict)  # log version -> applied record
    refused: list[int] = field(default_factory=list)  # log versions of refused requests
    last_version: int = 0  # the highest log version replayed
    requests: int = 0  # requests replayed

    def apply(self, log_version: int, request: dict[str, Any]) -> bool:
        """Replay one request: apply it if its precondition holds. The rule every reader uses."""
        self.last_version = max(self.last_version, log_version)
        self.requests += 1
        action = request.get("action")
        to, expected = request.get("to_version"), request.get("from_version")
        if action == "adopt":  # the aliases as found, before the log existed: only as its first entry
            ok = self.requests == 1
            if ok:
                self.champion, self.previous, self.seq = to, request.get("previous"), int(request.get("seq", 0))
        elif action == "promote":
            ok = to is not None and self.champion == expected and to != self.champion
        elif action == "rollback":
            ok = to is not None and self.champion == expected and self.previous == to
        else:
            ok = False
        if not ok:
            self.refused.append(log_version)
            return False
        if action == "adopt":
            return True
        self.seq += 1
        self.records[log_version] = PromotionRecord(
            self.seq,
            action,
            to,
            expected,
            request.get("actor", ""),
            request.get("reason", ""),
            request.get("at", ""),
            request.get("extra") or {},
        )
        if expected is not None:
            self.previous = expected
        self.champion = to
        return True


def lock_path_for(tracking_uri: str, name: str) -> Path:
    """The lock file for promotions of `name`: next to the database for local backends."""
    parsed = urlparse(tracking_uri)
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    if parsed.scheme == "sqlite":
        # sqlite:///relative.db or sqlite:////abs/path.db -> the folder holding the db
        db = tracking_uri[len("sqlite:///") :]
        if db and db != ":memory:":
            return Path(db).expanduser().resolve().parent / f".registry-{safe}.lock"
    elif parsed.scheme in ("", "file"):
        root = Path(parsed.path if parsed.scheme == "file" else tracking_uri).expanduser().resolve()
        return root / f".registry-{safe}.lock"
    digest = hashlib.sha256(f"{tracking_uri}|{name}".encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / "tuneloop-registry-locks" / f"{safe}-{digest}.lock"


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)  # blocks until the other process is done
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


# What an SQL backend says when two writers insert the same row at once (PostgreSQL, MySQL,
# SQLite), passed on by `mlflow server` inside a BAD_REQUEST.
_UNIQUE_CLASH = (
    "UniqueViolation",
    "duplicate key value",
    "Duplicate entry",
    "UNIQUE constraint failed",
    "IntegrityError",
)


def _copy_write(write, *args) -> None:
    """One write of the log's copy (an alias or a history tag). MLflow's SQL store sets them
    by read-then-insert, so two processes copying the same decision at once can both insert
    the row and one gets a unique-key error. That write was made by the other one: the
    caller re-reads and writes again until the copy agrees with the log."""
    from mlflow.exceptions import MlflowException

    try:
        write(*args)
    except MlflowException as exc:
        if not any(marker in str(exc) for marker in _UNIQUE_CLASH):
            raise
        logger.info("registry: a concurrent writer set the same row first (%s); re-reading", type(exc).__name__)


class ModelRegistry:
    """One registered model in one MLflow backend."""

    def __init__(self, tracking_uri: str, name: str, lock_path: Path | None = None):
        from mlflow.tracking import MlflowClient

        self.tracking_uri = tracking_uri
        self.name = name
        self.client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
        self.lock_path = Path(lock_path) if lock_path else lock_path_for(tracking_uri, name)

    @classmethod
    def from_config(cls, cfg) -> "ModelRegistry":
        return cls(cfg.mlflow_tracking_uri, cfg.mlflow.registered_model)

    # ---- reading --------------------------------------------------------------
    def _ensure_model(self) -> None:
        from mlflow.exceptions import MlflowException

        try:
            self.client.create_registered_model(self.name, description="tuneloop fine-tuned chat model")
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":  # another process made it first: fine
                raise

    def _aliases(self) -> dict[str, str]:
        """alias -> version, read fresh from the backend ({} when the model does not exist yet)."""
        from mlflow.exceptions import MlflowException

        try:
            model = self.client.get_registered_model(self.name)
        except MlflowException as exc:
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                return {}
            raise
        return {alias: str(v) for alias, v in (model.aliases or {}).items()}

    def version(self, version: str | int) -> ModelVersionInfo:
        from mlflow.exceptions import MlflowException

        try:
            mv = self.client.get_model_version(self.name, str(version))
        except MlflowException as exc:
            raise RegistryError(f"model {self.name!r} has no version {version}: {exc.message}") from None
        return ModelVersionInfo(
            name=self.name,
            version=str(mv.version),
            run_id=mv.run_id,
            source=mv.source,
            aliases=list(mv.aliases or []),
            tags=dict(mv.tags or {}),
        )

    def by_alias(self, alias: str) -> ModelVersionInfo | None:
        version = self._aliases().get(alias)
        return self.version(version) if version is not None else None

    def champion(self) -> ModelVersionInfo | None:
        return self.by_alias(CHAMPION)

    def challenger(self) -> ModelVersionInfo | None:
        return self.by_alias(CHALLENGER)

    def previous(self) -> ModelVersionInfo | None:
        return self.by_alias(PREVIOUS)

    def history(self) -> list[PromotionRecord]:
        """Every promotion and rollback, oldest first."""
        from mlflow.exceptions import MlflowException

        try:
            tags = self.client.get_registered_model(self.name).tags or {}
        except MlflowException as exc:
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                return []
            raise
        # Only our own `promotion.<digits>` keys: a hand-made tag must not break the history.
        records = [
            PromotionRecord(**json.loads(v))
            for k, v in tags.items()
            if k.startswith(PROMOTION_PREFIX) and k[len(PROMOTION_PREFIX) :].isdigit()
        ]
        return sorted(records, key=lambda r: r.seq)

    # ---- writing --------------------------------------------------------------
    def register(
        self,
        run_id: str,
        model_dir: Path | str | None = None,
        artifact_path: str = "model",
        tags: dict[str, str] | None = None,
    ) -> str:
        """Log `model_dir` under the run (at `artifact_path`) and register it as a new version.

        With model_dir None the artifacts are assumed already logged at artifact_path.
        Plain artifacts + create_model_version: 0.3 s, against 4-5 s for the transformers
        flavour, and the version's run_id points back to the training run.
        """
        run = self.client.get_run(run_id)
        if model_dir is not None:
            model_dir = Path(model_dir)
            if not (model_dir / "config.json").exists():
                raise RegistryError(f"{model_dir}: not a saved model folder (no config.json)")
            self.client.log_artifacts(run_id, str(model_dir), artifact_path)
        source = f"{run.info.artifact_uri.rstrip('/')}/{artifact_path}"
        self._ensure_model()
        mv = self.client.create_model_version(
            self.name, source=source, run_id=run_id, tags={k: str(v) for k, v in (tags or {}).items()}
        )
        return str(mv.version)

    def download(self, version: str | int, dst: Path | str | None = None) -> Path:
        """A local folder holding the version's model files (for evaluation and packaging)."""
        import mlflow.artifacts

        info = self.version(version)
        local = mlflow.artifacts.download_artifacts(
            artifact_uri=info.source, dst_path=str(dst) if dst else None, tracking_uri=self.tracking_uri
        )
        return Path(local)

    def set_challenger(self, version: str | int) -> None:
        self.version(version)  # clear error for an unknown version
        self.client.set_registered_model_alias(self.name, CHALLENGER, str(version))

    def record_blessing(self, version: str | int, blessing: Blessing) -> None:
        """Write the decision and its evidence onto the version, for the UI and for promote()."""
        version = str(version)
        tags = {
            TAG_BLESSED: "true" if blessing.blessed else "false",
            TAG_BLESSING_BASELINE: blessing.baseline_version or "none",
            TAG_BLESSING_REASONS: json.dumps(blessing.reasons)[:7000],
            TAG_BLESSING_AT: _now(),
        }
        for metric, d in blessing.deltas.items():
            for kind in ("absolute", "relative"):
                if d.get(kind) is not None:
                    tags[TAG_DELTA.format(metric=metric, kind=kind)] = f"{d[kind]:+.6g}"
        for key, value in tags.items():
            self.client.set_model_version_tag(self.name, version, key, value)

    def mark_deployed(self, version: str | int, bento_tag: str) -> None:
        self.client.set_model_version_tag(self.name, str(version), TAG_DEPLOYED_BENTO, bento_tag)
        self.client.set_model_version_tag(self.name, str(version), TAG_DEPLOYED_AT, _now())

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with _exclusive(self.lock_path):
            yield

    # ---- the promotion log (module docstring) ---------------------------------------
    @property
    def log_name(self) -> str:
        return f"{self.name}{LOG_SUFFIX}"

    def _read_log(self) -> list[tuple[int, dict[str, Any]]]:
        """(log version, request) of every request, in order ([] when there is no log yet)."""
        from mlflow.exceptions import MlflowException

        found: list[tuple[int, dict[str, Any]]] = []
        token = None
        quoted = self.log_name.replace("'", "\\'")
        while True:
            try:
                page = self.client.search_model_versions(f"name = '{quoted}'", max_results=1000, page_token=token)
            except MlflowException as exc:
                if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                    return []
                raise
            for mv in page:
                raw = (mv.tags or {}).get(TAG_LOG_REQUEST)
                if raw is None:
                    continue  # not a request of ours (a hand-made version): not part of the replay
                try:
                    found.append((int(mv.version), json.loads(raw)))
                except ValueError:
                    continue
            token = getattr(page, "token", None)
            if not token:
                break
        return sorted(found, key=lambda item: item[0])

    @staticmethod
    def _replay(requests: list[tuple[int, dict[str, Any]]], upto: int | None = None) -> LogState:
        state = LogState()
        for log_version, request in requests:
            if upto is not None and log_version > upto:
                break
            state.apply(log_version, request)
        return state

    def _append(self, request: dict[str, Any], files: ModelVersionInfo) -> int:
        """Append a request to the log; returns its log version (MLflow numbers it: the order).

        The log version points at `files` (the model being promoted): a version needs a
        source, and this one is valid on every backend and tells a reader of the log what
        the request was about."""
        from mlflow.exceptions import MlflowException

        request = {**request, "reason": request.get("reason", "")[:LOG_REASON_CHARS]}

        def create():
            return self.client.create_model_version(
                self.log_name,
                source=files.source,
                run_id=files.run_id,
                tags={TAG_LOG_REQUEST: json.dumps(request)},
                await_creation_for=0,
            )  # a request is never loaded

        try:
            return int(create().version)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
        try:  # the first request ever: make the log
            self.client.create_registered_model(
                self.log_name,
                description=f"tuneloop's promotion log of {self.name!r}: one version per "
                "promotion or rollback request, in order (tuneloop/registry.py). Do not edit or delete.",
            )
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":  # another process made it first: fine
                raise
        return int(create().version)

    def _decide(self, request: dict[str, Any], files: ModelVersionInfo) -> tuple[int, LogState]:
        """Append the request and replay the log up to it: (its log version, the whole log's
        state) when it was applied; PromotionConflict when the log refused it."""
        mine = self._append(request, files)
        log = self._read_log()
        if mine not in {v for v, _ in log}:
            raise RegistryError(f"promotion log {self.log_name!r}: version {mine} vanished after it was written")
        before = self._replay(log, upto=mine - 1)
        applied = before.apply(mine, dict(log)[mine])
        self._mark(mine, applied)
        if not applied:
            raise PromotionConflict(
                request["to_version"], request["from_version"], self._replay(log, upto=mine - 1).champion
            )
        return mine, self._replay(log)

    def _mark(self, log_version: int, applied: bool) -> None:
        try:
            self.client.set_model_version_tag(
                self.log_name, str(log_version), TAG_LOG_OUTCOME, "applied" if applied else "refused"
            )
        except Exception:  # informational only: the replay decides, not this tag
            pass

    def _copy_to_aliases(self, state: LogState, rounds: int = 5) -> LogState:
        """Make the aliases and history tags say what the log says; re-read the log after
        writing and write again until they agree (an older copy written late by a stalled
        process is corrected here). Returns the state finally written."""
        for _ in range(rounds):
            model = self.client.get_registered_model(self.name)
            aliases = {a: str(v) for a, v in (model.aliases or {}).items()}
            tags = model.tags or {}
            # `previous` before `champion`: a reader between the two calls never loses a version
            if state.previous is not None and aliases.get(PREVIOUS) != state.previous:
                _copy_write(self.client.set_registered_model_alias, self.name, PREVIOUS, state.previous)
            if state.champion is not None and aliases.get(CHAMPION) != state.champion:
                _copy_write(self.client.set_registered_model_alias, self.name, CHAMPION, state.champion)
            for record in state.records.values():
                key, value = TAG_PROMOTION.format(seq=record.seq), json.dumps(record.to_dict())
                if tags.get(key) != value:
                    _copy_write(self.client.set_registered_model_tag, self.name, key, value)
            latest = self._replay(self._read_log())
            if (latest.champion, latest.previous, latest.seq) == (state.champion, state.previous, state.seq):
                return latest
            state = latest
        return state

    def _settled(self) -> LogState:
        """The log's state, copied onto the aliases; a registry without a log is adopted first."""
        log = self._read_log()
        if not log:
            aliases, history = self._aliases(), self.history()
            champion = aliases.get(CHAMPION)
            if champion is not None or history:
                adopt = {
                    "action": "adopt",
                    "to_version": champion,
                    "from_version": None,
                    "previous": aliases.get(PREVIOUS),
                    "seq": history[-1].seq if history else 0,
                    "actor": "tuneloop",
                    "reason": "the aliases as found when the promotion log started",
                    "at": _now(),
                }
                mine = self._append(adopt, self.version(champion or history[-1].to_version))
                log = self._read_log()
                self._mark(mine, mine not in self._replay(log).refused)
        state = self._replay(log)
        return self._copy_to_aliases(state) if log else state

    def repair(self) -> LogState:
        """Finish what a crashed or stalled promoter left undone: the aliases and history
        tags as the promotion log says (a no-op when they already agree)."""
        with self._locked():
            return self._settled()

    def promote(
        self,
        version: str | int,
        expected_champion: str | int | None,
        reason: str,
        actor: str | None = None,
        require_blessed: bool = True,
    ) -> PromotionResult:
        """Make `version` the champion if the champion is still `expected_champion`.

        expected_champion None means "I expect there is no champion yet". The old champion
        becomes `previous`. Raises PromotionConflict when the champion changed meanwhile
        (on any machine sharing the backend: the promotion log decides, see the module
        docstring), NotBlessed when the version carries no positive blessing (unless
        require_blessed is False: a deliberate manual override, recorded as such).
        """
        version = str(version)
        expected = None if expected_champion is None else str(expected_champion)
        actor = actor or default_actor()
        info = self.version(version)
        if require_blessed and not info.blessed:
            raise NotBlessed(
                f"version {version} is not blessed (tag {TAG_BLESSED}={info.tags.get(TAG_BLESSED, 'unset')}); "
                "evaluate and bless it first, or promote with require_blessed=False"
            )
        with self._locked():
            current = self._settled().champion
            if current != expected:  # refused before asking the log: it would refuse too
                raise PromotionConflict(version, expected, current)
            if current == version:
                raise RegistryError(f"version {version} is already the champion")
            mine, state = self._decide(
                {
                    "action": "promote",
                    "to_version": version,
                    "from_version": current,
                    "actor": actor,
                    "reason": reason,
                    "at": _now(),
                    "extra": {} if require_blessed else {"override": "promoted without blessing"},
                },
                info,
            )
            self._copy_to_aliases(state)
            if self._aliases().get(CHALLENGER) == version:
                self.client.delete_registered_model_alias(self.name, CHALLENGER)
        return PromotionResult(promoted=True, version=version, previous=current, record=state.records[mine])

    def rollback(self, reason: str, actor: str | None = None) -> PromotionResult:
        """Make `previous` the champion again; the champion being rolled back becomes `previous`.
        Raises PromotionConflict when someone promoted or rolled back meanwhile."""
        actor = actor or default_actor()
        with self._locked():
            settled = self._settled()
            target, current = settled.previous, settled.champion
            if target is None:
                raise RegistryError(
                    f"cannot roll back {self.name!r}: there is no previous champion (current champion: {_v(current)})"
                )
            mine, state = self._decide(
                {
                    "action": "rollback",
                    "to_version": target,
                    "from_version": current,
                    "actor": actor,
                    "reason": reason,
                    "at": _now(),
                },
                self.version(target),
            )
            self._copy_to_aliases(state)
        return PromotionResult(promoted=True, version=target, previous=current, record=state.records[mine])
