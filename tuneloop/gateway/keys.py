"""API keys: created once, shown once, stored only as a peppered hash.

A key reads `<prefix><id>_<secret>` (`tl-3f9a0c1b2d4e_Vh...`): the id finds the row, the
HMAC-SHA256 of the whole key under the pepper is compared in constant time. The store is
any SQLAlchemy URL (SQLite under the state folder by default), shared by `tuneloop keys`
and every server replica; each request reads its row, so a revocation or an expiry takes
effect on the next request everywhere. On SQLite a replica keeps the rows it has read and
reads again only after another connection has committed to the file (`PRAGMA data_version`,
a few microseconds a request instead of a query through SQLAlchemy): the same guarantee. The pepper is not in the database: a stolen
database alone does not let anyone test guesses.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import sqlite3
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import sqlalchemy as sa

PEPPER_ENV = "TUNELOOP_KEY_PEPPER"
ID_HEX = 12  # the id part: 48 random bits, enough to find a row, worthless without the secret

_metadata = sa.MetaData()
api_keys = sa.Table(
    "api_keys",
    _metadata,
    sa.Column("id", sa.String(32), primary_key=True),
    sa.Column("name", sa.String(200), nullable=False),
    sa.Column("tier", sa.String(64), nullable=False),
    sa.Column("team", sa.String(200), nullable=True),
    sa.Column("key_hash", sa.String(64), nullable=False),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
    sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
    # per-key overrides of the tier's limits (None: the tier's)
    sa.Column("requests_per_minute", sa.Integer, nullable=True),
    sa.Column("tokens_per_minute", sa.Integer, nullable=True),
)


class KeyStoreError(Exception):
    """A key operation that cannot be done (unknown tier, unknown id); the message says why."""


class InvalidKey(Exception):
    """The presented key does not grant access; `reason` is for logs and metrics (never the key)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class ApiKey:
    id: str
    name: str
    tier: str
    team: str | None
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None
    requests_per_minute: int | None
    tokens_per_minute: int | None

    @property
    def tenant(self) -> str:
        """Whose cached answers this key may share: its team if it has one, else only its own."""
        return f"team:{self.team}" if self.team else f"key:{self.id}"

    def status(self, now: datetime | None = None) -> str:
        now = now or _now()
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and _aware(self.expires_at) <= now:
            return "expired"
        return "active"


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _aware(t: datetime) -> datetime:
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)  # SQLite hands datetimes back naive


def load_pepper(pepper_file: Path) -> bytes:
    """The pepper: $TUNELOOP_KEY_PEPPER, else pepper_file (made once, mode 0600)."""
    if os.environ.get(PEPPER_ENV):
        return os.environ[PEPPER_ENV].encode()
    if not pepper_file.exists():
        pepper_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = pepper_file.with_name(f".{pepper_file.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_hex(32))
        try:
            os.link(tmp, pepper_file)  # first writer wins; a concurrent second one reads its pepper
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    return pepper_file.read_text().strip().encode()


_DURATION = re.compile(r"^(\d+)([mhdw])$")


def parse_expiry(text: str | None, now: datetime | None = None) -> datetime | None:
    """`--expires`: a duration (30m, 12h, 90d, 4w) or an ISO date/time (UTC unless it says)."""
    if text is None:
        return None
    now = now or _now()
    m = _DURATION.match(text.strip())
    if m:
        n, unit = int(m.group(1)), m.group(2)
        return now + timedelta(**{{"m": "minutes", "h": "hours", "d": "days", "w": "weeks"}[unit]: n})
    try:
        t = datetime.fromisoformat(text.strip())
    except ValueError:
        raise KeyStoreError(
            f"--expires {text!r}: give a duration (30m, 12h, 90d, 4w) or an ISO date "
            "(2027-01-31 or 2027-01-31T12:00:00+00:00)"
        ) from None
    return _aware(t)


class KeyStore:
    def __init__(self, url: str, pepper: bytes, prefix: str = "tl-", tiers: list[str] | None = None):
        if url.startswith("sqlite:///"):
            Path(url[len("sqlite:///") :]).parent.mkdir(parents=True, exist_ok=True)
        # SQLite: each request reads one row; a writer (keys create/revoke) must not make readers fail.
        args = {"timeout": 15} if url.startswith("sqlite") else {}
        self.engine = sa.create_engine(url, connect_args=args, pool_pre_ping=not url.startswith("sqlite"))
        _metadata.create_all(self.engine)
        self.pepper = pepper
        self.prefix = prefix
        self.tiers = tiers
        # Compared against when the id is unknown, so unknown and wrong keys cost the same time.
        self._decoy = self._hash(prefix + "0" * ID_HEX + "_decoy")
        # SQLite: rows read so far, valid while the file's data_version (as seen by a connection
        # of our own that never writes) has not moved, i.e. no one has committed since.
        self._rows: dict[str, Any] = {}
        self._rows_version: int | None = None
        self._version_conn = None
        self._lock = threading.Lock()
        database = self.engine.url.database if self.engine.url.get_backend_name() == "sqlite" else None
        if database and database != ":memory:" and not database.startswith("file:"):
            self._version_conn = sqlite3.connect(database, timeout=15, check_same_thread=False)

    def _hash(self, key: str) -> str:
        return hmac.new(self.pepper, key.encode(), hashlib.sha256).hexdigest()

    def create(
        self,
        name: str,
        tier: str,
        expires_at: datetime | None = None,
        team: str | None = None,
        requests_per_minute: int | None = None,
        tokens_per_minute: int | None = None,
    ) -> tuple[ApiKey, str]:
        """A new key: (its record, the key itself -- shown once, never stored)."""
        if not name.strip():
            raise KeyStoreError("a key needs a --name")
        if self.tiers is not None and tier not in self.tiers:
            raise KeyStoreError(f"unknown tier {tier!r}; the configured tiers are {', '.join(self.tiers)}")
        for label, value in (("requests_per_minute", requests_per_minute), ("tokens_per_minute", tokens_per_minute)):
            if value is not None and value < 1:
                raise KeyStoreError(f"{label} must be at least 1, got {value}")
        key_id = secrets.token_hex(ID_HEX // 2)
        secret = f"{self.prefix}{key_id}_{secrets.token_urlsafe(32)}"
        record = ApiKey(key_id, name, tier, team, _now(), expires_at, None, requests_per_minute, tokens_per_minute)
        with self.engine.begin() as conn:
            conn.execute(
                api_keys.insert().values(
                    id=key_id,
                    name=name,
                    tier=tier,
                    team=team,
                    key_hash=self._hash(secret),
                    created_at=record.created_at,
                    expires_at=expires_at,
                    requests_per_minute=requests_per_minute,
                    tokens_per_minute=tokens_per_minute,
                )
            )
        return record, secret

    @staticmethod
    def _record(row) -> ApiKey:
        def t(v):
            return _aware(v) if v is not None else None

        return ApiKey(
            row.id,
            row.name,
            row.tier,
            row.team,
            t(row.created_at),
            t(row.expires_at),
            t(row.revoked_at),
            row.requests_per_minute,
            row.tokens_per_minute,
        )

    def list(self) -> list[ApiKey]:
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(api_keys).order_by(api_keys.c.created_at)).all()
        return [self._record(r) for r in rows]

    def get(self, key_id: str) -> ApiKey:
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(api_keys).where(api_keys.c.id == key_id)).first()
        if row is None:
            raise KeyStoreError(f"no key with id {key_id!r} (tuneloop keys list shows them)")
        return self._record(row)

    def revoke(self, key_id: str) -> ApiKey:
        self.get(key_id)
        with self.engine.begin() as conn:
            conn.execute(
                api_keys.update()
                .where(api_keys.c.id == key_id, api_keys.c.revoked_at.is_(None))
                .values(revoked_at=_now())
            )
        return self.get(key_id)

    def verify(self, presented: str) -> ApiKey:
        """The key's record if it grants access now; else InvalidKey(reason)."""
        body = presented[len(self.prefix) :] if presented.startswith(self.prefix) else None
        if body is None or len(body) < ID_HEX + 2 or body[ID_HEX] != "_":
            raise InvalidKey("malformed")
        key_id = body[:ID_HEX]
        row = self._row(key_id)
        expected = row.key_hash if row is not None else self._decoy
        if not hmac.compare_digest(self._hash(presented), expected) or row is None:
            raise InvalidKey("unknown")
        record = self._record(row)
        status = record.status()
        if status != "active":
            raise InvalidKey(status)
        return record

    def _row(self, key_id: str):
        """The key's row (None if there is none): from this store's cache while no one has
        committed to the SQLite file since it was read, else from the database."""
        if self._version_conn is None:
            return self._select(key_id)
        with self._lock:
            version = self._version_conn.execute("PRAGMA data_version").fetchone()[0]
            if version != self._rows_version:
                self._rows.clear()
                self._rows_version = version
            elif key_id in self._rows:
                return self._rows[key_id]
        row = self._select(key_id)
        with self._lock:
            if self._rows_version == version:  # nobody committed in between (else read again next time)
                self._rows[key_id] = row
        return row

    def _select(self, key_id: str):
        with self.engine.connect() as conn:
            return conn.execute(sa.select(api_keys).where(api_keys.c.id == key_id)).first()

    def close(self) -> None:
        if self._version_conn is not None:
            self._version_conn.close()
        self.engine.dispose()


def key_store_url(cfg) -> str:
    return cfg.gateway.key_store_url or f"sqlite:///{cfg.home / 'gateway' / 'keys.db'}"


def open_key_store(cfg) -> KeyStore:
    """The deployment's key store, as `tuneloop keys` and every server replica open it."""
    g = cfg.gateway
    pepper = load_pepper(cfg.resolve(g.pepper_file) if g.pepper_file else cfg.home / "gateway" / "pepper")
    return KeyStore(key_store_url(cfg), pepper, g.key_prefix, tiers=list(g.tiers))
