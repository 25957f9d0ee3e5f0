"""The gateway's pipelined Redis connection (tuneloop/gateway/redis_pipe.py) against a real
redis-server: replies reach the right callers under concurrency, scripts survive a flush,
a restart and a hung server are survived, and the URL's password and database are used."""

from __future__ import annotations

import asyncio
import random
import socket
import subprocess
import time

import pytest

from tests.support.servers import free_port, hung_listener, redis_server
from tuneloop.gateway.redis_pipe import RedisPipe, ReplyError


def test_concurrent_callers_each_get_their_own_reply(tmp_path):
    async def main(url):
        pipe = RedisPipe(url, 2.0)
        values = {f"k{i}": "v" * random.Random(i).randint(0, 3000) + f"|{i}|é" for i in range(400)}
        await asyncio.gather(*(pipe.set(k, v, px=60_000) for k, v in values.items()))
        got = await asyncio.gather(*(pipe.get(k) for k in values))
        assert got == list(values.values())  # big and small replies, split across reads, in order
        assert await pipe.get("missing") is None
        assert await pipe.execute("INCRBY", "n", 5) == 5
        assert await pipe.execute("MGET", "k1", "missing", "k2") == [values["k1"], None, values["k2"]]
        with pytest.raises(ReplyError, match="wrong number of arguments"):
            await pipe.execute("GET")
        assert await pipe.execute("PING") == "PONG"  # an error breaks nothing after it
        ttl = await pipe.execute("PTTL", "k1")
        assert 0 < ttl <= 60_000
        await pipe.aclose()

    with redis_server(tmp_path) as url:
        asyncio.run(main(url))


def test_a_script_survives_a_flush_and_the_connection_a_restart(tmp_path):
    port = free_port()

    async def until_up(pipe):
        for _ in range(100):
            try:
                return await pipe.execute("PING")
            except (OSError, ConnectionError, TimeoutError):
                await asyncio.sleep(0.1)
        raise AssertionError("redis did not come back")

    async def main(url):
        pipe = RedisPipe(url, 1.0)
        add = pipe.register_script("return redis.call('INCRBY', KEYS[1], ARGV[1])")
        assert await add(keys=["c"], args=[2]) == 2
        await pipe.execute("SCRIPT", "FLUSH")
        assert await add(keys=["c"], args=[3]) == 5  # NOSCRIPT: run by its source, cached again
        assert await add(keys=["c"], args=[1]) == 6
        return pipe

    with redis_server(tmp_path, port) as url:
        pipe = asyncio.run(main(url))
    with redis_server(tmp_path, port) as url:  # the same address, a new server

        async def again():
            await until_up(pipe)
            add = pipe.register_script("return redis.call('INCRBY', KEYS[1], ARGV[1])")
            assert await add(keys=["c"], args=[4]) == 4  # a fresh server: its own count, the script loaded
            await pipe.aclose()

        asyncio.run(again())


def test_a_hung_server_times_out_every_waiting_call(tmp_path):
    with hung_listener() as url:

        async def main():
            pipe = RedisPipe(url, 0.3)
            t = time.perf_counter()
            results = await asyncio.gather(*(pipe.get(f"k{i}") for i in range(20)), return_exceptions=True)
            assert all(isinstance(r, (TimeoutError, ConnectionError)) for r in results), results
            assert time.perf_counter() - t < 1.5
            with pytest.raises((TimeoutError, ConnectionError)):
                await pipe.get("again")  # a new connection, hung as well
            await pipe.aclose()

        asyncio.run(main())


def test_the_urls_password_and_database_are_used(tmp_path):
    import shutil

    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed (make install puts Debian's redis-server in place)")
    port = free_port()
    proc = subprocess.Popen(
        [
            binary,
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--requirepass",
            "s3cret",
            "--dir",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)

        async def main():
            with pytest.raises(ReplyError, match="NOAUTH"):
                await RedisPipe(f"redis://127.0.0.1:{port}/0", 1.0).get("x")
            with pytest.raises(ReplyError, match="WRONGPASS|invalid password"):
                await RedisPipe(f"redis://:nope@127.0.0.1:{port}/0", 1.0).get("x")
            three = RedisPipe(f"redis://:s3cret@127.0.0.1:{port}/3", 1.0)
            zero = RedisPipe(f"redis://:s3cret@127.0.0.1:{port}/0", 1.0)
            await three.set("where", "db3")
            assert await three.get("where") == "db3" and await zero.get("where") is None
            await three.aclose()
            await zero.aclose()

        asyncio.run(main())
    finally:
        proc.kill()
        proc.wait()


def test_tls_urls_are_refused_with_a_clear_reason():
    with pytest.raises(ValueError, match="TLS"):
        RedisPipe("rediss://cache.internal:6380/0", 1.0)
