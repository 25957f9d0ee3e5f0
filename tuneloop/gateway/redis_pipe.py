"""The gateway's Redis connection: one socket, every caller's commands pipelined on it.

Each /v1 request makes one to three Redis calls (its request limit, its token reservation,
a refund, a cache lookup). Through redis-py's asyncio client each cost ~90-160 us of CPU in
the server's process (a pooled connection checked out and in per command, the command and
its reply through generic layers); with a model that streams 60 requests a second that was
the gateway's largest cost on the event loop. Here concurrent callers write their commands
to one connection back to back and the replies, which Redis sends in order, resolve their
futures first in first out: ~15 us a call under load (measured side by side,
benchmarks/gateway.py). redis-py still parses the URL; the wire protocol (RESP2) is the few
lines below.

A command that fails (the connection breaks, Redis answers an error) raises; one that gets
no answer within `timeout_s` raises TimeoutError and drops the connection, failing every
command still waiting on it (a hung server answers none of them), and the next command
connects again. Callers put this behind the circuit breaker (redis_health.py).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import deque


class ReplyError(Exception):
    """Redis answered the command with an error (-ERR ..., -NOSCRIPT ...)."""


class _Protocol(asyncio.Protocol):
    def __init__(self, on_lost):
        self.transport: asyncio.Transport | None = None
        self.waiting: deque[asyncio.Future] = deque()
        self._buf = bytearray()
        self._on_lost = on_lost

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._buf += data
        pos = 0
        while self.waiting:
            try:
                parsed = _parse(self._buf, pos)
            except ValueError as exc:  # not RESP: nothing on this connection can be trusted
                assert self.transport is not None  # data comes only after connection_made
                self.transport.close()
                self._fail(ConnectionError(f"unreadable reply from Redis: {exc}"))
                return
            if parsed is None:
                break
            value, pos = parsed
            fut = self.waiting.popleft()
            if not fut.done():  # a caller that gave up still had its place in the order
                if isinstance(value, ReplyError):
                    fut.set_exception(value)
                else:
                    fut.set_result(value)
        del self._buf[:pos]

    def connection_lost(self, exc) -> None:
        self._fail(ConnectionError(f"the connection to Redis was lost ({exc or 'closed'})"))
        self._on_lost(self)

    def _fail(self, exc: Exception) -> None:
        while self.waiting:
            fut = self.waiting.popleft()
            if not fut.done():
                fut.set_exception(exc)


def _parse(buf: bytearray, pos: int):
    """(value, next position) of the RESP2 reply at pos, or None while it is incomplete."""
    end = buf.find(b"\r\n", pos)
    if end < 0:
        return None
    kind, line, pos = buf[pos], bytes(buf[pos + 1 : end]), end + 2
    if kind == 43:  # + simple string
        return line.decode(), pos
    if kind == 45:  # - error
        return ReplyError(line.decode(errors="replace")), pos
    if kind == 58:  # : integer
        return int(line), pos
    if kind == 36:  # $ bulk string
        n = int(line)
        if n < 0:
            return None, pos
        if len(buf) < pos + n + 2:
            return None
        return bytes(buf[pos : pos + n]).decode(), pos + n + 2
    if kind == 42:  # * array
        n = int(line)
        if n < 0:
            return None, pos
        items = []
        for _ in range(n):
            parsed = _parse(buf, pos)
            if parsed is None:
                return None
            item, pos = parsed
            items.append(item)
        return items, pos
    raise ValueError(f"unknown reply type {chr(kind)!r}")


def _pack(args) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%b\r\n" % (len(b), b))
    return b"".join(out)


class RedisPipe:
    def __init__(self, url: str, timeout_s: float):
        from redis.asyncio.connection import SSLConnection, UnixDomainSocketConnection, parse_url

        options = parse_url(url)
        if options.get("connection_class") is SSLConnection:
            raise ValueError(
                f"{url.split('@')[-1]}: TLS (rediss://) is not supported by the gateway's Redis "
                "connection; use redis:// (inside the cluster) or a local TLS proxy"
            )
        self.path = options.get("path") if options.get("connection_class") is UnixDomainSocketConnection else None
        self.host, self.port = options.get("host", "localhost"), int(options.get("port", 6379))
        self.db = int(options.get("db", 0) or 0)
        self.username, self.password = options.get("username"), options.get("password")
        self.timeout_s = timeout_s
        self._conn: _Protocol | None = None
        self._connecting: asyncio.Future | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def _connection(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # a connection belongs to the event loop that made it
            self._loop, self._conn, self._connecting = loop, None, None
        conn = self._conn
        if conn is not None and conn.transport is not None and not conn.transport.is_closing():
            return conn
        if self._connecting is None or self._connecting.done():
            self._connecting = asyncio.ensure_future(self._connect())
        return await asyncio.shield(self._connecting)

    async def _connect(self) -> _Protocol:
        loop = asyncio.get_running_loop()

        def lost(proto):
            if self._conn is proto:
                self._conn = None

        factory = lambda: _Protocol(lost)  # noqa: E731
        async with asyncio.timeout(self.timeout_s):
            if self.path:
                _, conn = await loop.create_unix_connection(factory, self.path)
            else:
                _, conn = await loop.create_connection(factory, self.host, self.port)
        try:
            if self.password is not None:
                auth = [self.username, self.password] if self.username else [self.password]
                await self._send(conn, ["AUTH", *auth])
            if self.db:
                await self._send(conn, ["SELECT", self.db])
        except BaseException:
            assert conn.transport is not None  # create_connection returns it connected
            conn.transport.close()
            raise
        self._conn = conn
        return conn

    async def _send(self, conn: _Protocol, args):
        transport = conn.transport
        assert transport is not None  # conn comes from _connect: connected
        fut = asyncio.get_running_loop().create_future()
        conn.waiting.append(fut)
        transport.write(_pack(args))
        try:
            async with asyncio.timeout(self.timeout_s):
                return await fut
        except TimeoutError:
            transport.close()  # no answer in time: the connection goes, with all it owes
            raise

    async def execute(self, *args):
        """One command; its reply (str, int, None or a list of them). ReplyError, TimeoutError
        or ConnectionError/OSError when it fails."""
        return await self._send(await self._connection(), args)

    async def get(self, key: str):
        return await self.execute("GET", key)

    async def set(self, key: str, value: str, px: int | None = None):
        return await self.execute("SET", key, value, *(("PX", px) if px is not None else ()))

    def register_script(self, source: str) -> "Script":
        return Script(self, source)

    async def aclose(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and conn.transport is not None:
            conn.transport.close()


class Script:
    """A Lua script run by its SHA1 (EVALSHA), loaded again when Redis has lost it."""

    def __init__(self, pipe: RedisPipe, source: str):
        self.pipe = pipe
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    async def __call__(self, keys=(), args=()):
        try:
            return await self.pipe.execute("EVALSHA", self.sha, len(keys), *keys, *args)
        except ReplyError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
        return await self.pipe.execute("EVAL", self.source, len(keys), *keys, *args)  # caches it again
