"""Running a generation request, the same for completions and chat: admission, the streams of
its choices, text deltas through the hooks' output side, the deadline, the client going away,
and SSE. A route renders the choices and chunks in its own shape (completions.py, chat.py)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from tuneloop.api.logprobs import HeldLogprobs, TokenText
from tuneloop.api.prepare import Prepared
from tuneloop.api.server import OpenAIServer
from tuneloop.hooks import Hooks
from tuneloop.requestlog.record import RequestRecord
from tuneloop.serving.admission import Ticket
from tuneloop.serving.engine import GenerationStream
from tuneloop.serving.errors import InternalError, RequestTimeout, ServingError
from tuneloop.serving.text import TextAssembler

log = logging.getLogger("tuneloop.api")


class Aborted(Exception):
    """The generation was cancelled from outside (timeout, client gone) before it ended."""


class Generations:
    """The generations of one request: their streams, admission ticket and metrics.

    close() is the one exit: it cancels what still runs, records metrics and frees the
    slots; it is idempotent and called from every path (done, error, timeout, disconnect).
    """

    def __init__(self, server: OpenAIServer, prepared: Prepared, request_id: str, hooks: Hooks, call: RequestRecord):
        self.server = server
        self.request_id = request_id
        self.hooks = hooks
        self.call = call  # this request's record, completed in close()
        share = hooks.share(server.admission.max_concurrency)
        tokens = sum(len(ids) + p.max_new_tokens for ids, p in zip(prepared.prompts, prepared.params))
        try:
            self.ticket: Ticket = server.admission.admit(len(prepared.prompts), tokens, share)
        except Exception:
            hooks.release(0)  # nothing generated: the whole reservation goes back
            raise
        loop = asyncio.get_running_loop()
        # loop.time() and time.monotonic() are the same clock.
        self.deadline = self.ticket.deadline
        self.started_at = time.perf_counter()
        self.streams = [
            GenerationStream(f"{request_id}-{i}", ids, params, loop, server.stream_interval_s)
            for i, (ids, params) in enumerate(zip(prepared.prompts, prepared.params))
        ]
        self.prompt_tokens = prepared.prompt_tokens
        self.assemblers = [TextAssembler(server.loaded.tokenizer, prepared.stop) for _ in self.streams]
        self.completion_tokens = [0] * len(self.streams)
        self._got_token = [False] * len(self.streams)
        self.finish_reasons: list[str | None] = [None] * len(self.streams)  # as the client sees them
        # The hooks' output side (the gateway's PII redaction per choice: streams hold back a
        # tail), the text as the client got it (for the output filter and the cache), the verdicts.
        self.redactors = [hooks.output_stream() for _ in self.streams]
        # logprob entries wait until the redaction has let their text out (None: not redacted)
        wants = any(p.logprobs is not None for p in prepared.params)
        self.held = [HeldLogprobs(TokenText(server), r) if r is not None and wants else None for r in self.redactors]
        self.texts = [""] * len(self.streams)
        self.verdicts: list[Any] = [None] * len(self.streams)
        self._closed = False
        self.abort_reason: str | None = None
        if server.metrics:
            for _ in self.streams:
                server.metrics.generation_admitted()
        try:
            for s in self.streams:
                server.backend.submit(s)
        except Exception:
            self.close()
            raise

    async def choice_deltas(self, i: int):
        """(text delta, finish_reason or None, logprob entries of the new tokens) for choice i
        until it ends (entries only when the request asked for logprobs)."""
        stream, text = self.streams[i], self.assemblers[i]
        seen = 0  # stream.token_logprobs handed out so far
        async for ids in stream.events():
            self._first_token(i)
            delta = await self._out(i, text.add(ids))
            self.completion_tokens[i] = len(text.ids)
            logprobs = stream.token_logprobs[seen : seen + len(ids)]  # delivered in the tokens' order
            seen += len(logprobs)
            entries = list(zip(ids, logprobs))
            held = self.held[i]
            if held is not None:
                held.add(entries)
            if text.stopped:
                stream.cancel()  # a stop string ended it: stop generating
                delta += await self._out(i, "", final=True)
                yield delta, await self._finish(i, "stop"), entries if held is None else held.release(final=True)
                return
            if held is not None:
                entries = held.release()
            if delta or entries:
                yield delta, None, entries
        if stream.finish_reason == "cancelled":
            raise Aborted(self.abort_reason or "cancelled")
        # a choice whose first token was a stop token shows no text, yet its first token came
        self._first_token(i)
        last = await self._out(i, text.flush(), final=True)
        held = self.held[i]
        yield (
            last,
            await self._finish(i, "stop" if stream.finish_reason == "stop" else "length"),
            [] if held is None else held.release(final=True),
        )

    def _first_token(self, i: int) -> None:
        if not self._got_token[i]:
            self._got_token[i] = True
            if self.server.metrics:
                self.server.metrics.first_token()
            self.call.first_token()

    async def _out(self, i: int, delta: str, final: bool = False) -> str:
        """What the client may see of a text delta: PII redacted (a tail held back until it is
        known not to start an entity; all of it at the end)."""
        redactor, held = self.redactors[i], self.held[i]
        if held is not None:
            held.raw += len(delta)
        if redactor is not None:
            delta = await redactor.add(delta) if delta else ""
            if final:
                delta += await redactor.flush()
        self.texts[i] += delta
        return delta

    async def _finish(self, i: int, reason: str) -> str:
        """The finish reason the client sees: the output filter may turn it into content_filter."""
        checked = await self.hooks.check_output(self.call, self.texts[i])
        if checked is not None:
            self.verdicts[i], blocked = checked
            if blocked:
                reason = "content_filter"
        self.finish_reasons[i] = reason
        return reason

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        unfinished = [s for s in self.streams if not s.done]
        for s in unfinished:
            s.cancel()
        # Errors that become a response are counted where they do; a client that left is not.
        if self.abort_reason == "client_disconnected" or (unfinished and self.abort_reason is None):
            self.server.count_rejection("client_disconnected")
        if self.server.metrics:
            for i, s in enumerate(self.streams):
                self.server.metrics.generation_ended(s, self.started_at, self._got_token[i], self.finish_reasons[i])
        self.ticket.release()
        # the unused part of a token reservation goes back
        self.hooks.release(self.prompt_tokens + sum(self.completion_tokens))
        r = self.call
        r.completions, r.finish_reasons = list(self.texts), list(self.finish_reasons)
        r.prompt_tokens, r.completion_tokens = self.prompt_tokens, sum(self.completion_tokens)
        r.completion_redacted = self.hooks.redacts_outputs()
        if any(v is not None for v in self.verdicts):
            r.output_filter = [v.summary() if v is not None else None for v in self.verdicts]
        if self.abort_reason is not None and r.error_code is None:
            r.error_code = self.abort_reason

    def filter_results(self, i: int) -> dict | None:
        """The output filter's annotation of choice i (Azure OpenAI's field name), or None."""
        v = self.verdicts[i]
        if v is None:
            return None
        return {"flagged": v.flagged, "categories": v.flagged_categories(), "rules": v.rules}

    def cacheable_result(self) -> bool:
        return all(r in ("stop", "length") for r in self.finish_reasons)

    def timeout_error(self) -> RequestTimeout:
        self.abort_reason = "timeout"
        return RequestTimeout(
            f"the generation did not finish within the request timeout of {self.server.admission.request_timeout_s:g} s"
        )


async def _watch_disconnect(request: Request, gens: Generations) -> None:
    """Cancel the generations when the client goes away (non-streaming requests)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            gens.abort_reason = "client_disconnected"
            for s in gens.streams:
                s.cancel()
            return


async def _run_to_end(gens: Generations, request: Request) -> list[tuple[str, str, list]]:
    async def one(i: int) -> tuple[str, str, list]:
        parts, finish, entries = [], "length", []
        async for delta, reason, new in gens.choice_deltas(i):
            parts.append(delta)
            entries += new
            finish = reason or finish
        return "".join(parts), finish, entries

    watcher = asyncio.ensure_future(_watch_disconnect(request, gens))
    try:
        async with asyncio.timeout_at(gens.deadline):
            return list(await asyncio.gather(*(one(i) for i in range(len(gens.streams)))))
    except TimeoutError:
        raise gens.timeout_error() from None
    finally:
        watcher.cancel()


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


class _SSEResponse(StreamingResponse):
    """A StreamingResponse that always runs on_close, even if the body was never iterated."""

    def __init__(self, content, on_close):
        super().__init__(
            content, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def stream_response(
    gens: Generations,
    make_chunk,
    include_usage: bool,
    first_chunks: list[dict],
    on_done=None,
    *,
    last_chunks=None,
    error_chunk=None,
    end: str | None = "[DONE]",
    encode=sse,
):
    """SSE over all choices of a request, interleaved as their tokens arrive.

    A route with its own events (the Responses API) gives last_chunks() (the events once every
    choice has ended), error_chunk(error) (an error as its event, else `{"error": ...}`), end
    (the last event, None: none) and encode(event) (its SSE text: `event:` lines too).

    Events that are ready together go out in one write: each write passes BentoML's and
    Starlette's middleware (an OpenTelemetry span each) and a socket send, which at 32
    streams was most of the event loop's work. So the opening chunks (the role) go with
    the first content, a stream's last content with its finish chunk, the usage chunk and
    `[DONE]`; nothing waits for anything that has not arrived yet.
    """

    async def body():
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async for delta, finish, entries in gens.choice_deltas(i):
                    queue.put_nowait((i, delta, finish, entries))
            except Exception as exc:  # handed to the consumer below
                queue.put_nowait((i, exc, None, None))

        tasks = [asyncio.ensure_future(pump(i)) for i in range(len(gens.streams))]
        out = [encode(chunk) for chunk in first_chunks]  # events not yet written
        error: ServingError | None = None
        try:
            pending = len(tasks)
            async with asyncio.timeout_at(gens.deadline):
                while pending:
                    ready = [await queue.get()]
                    while not queue.empty():
                        ready.append(queue.get_nowait())
                    for i, delta, finish, entries in ready:
                        if isinstance(delta, BaseException):
                            raise delta
                        if finish is not None:
                            pending -= 1
                        if delta or finish or entries:
                            made = make_chunk(i, delta, finish, entries=entries)
                            out.extend(encode(c) for c in (made if isinstance(made, list) else [made]))
                    if pending:
                        yield "".join(out)
                        out = []
            if include_usage:
                out.append(encode(make_chunk(None, None, None, usage=usage(gens))))
            if last_chunks is not None:
                out.extend(encode(c) for c in last_chunks())
            if on_done is not None:
                await on_done()
        except TimeoutError:
            error = gens.timeout_error()
        except Aborted:
            return  # cancelled because the client left: nobody to tell
        except ServingError as err:  # e.g. BentoML's batcher shed the request (503)
            error = err
        except Exception:
            log.exception("streamed generation %s failed", gens.request_id)
            error = InternalError("generation failed; see the server log")
        finally:
            for t in tasks:
                t.cancel()
        if error is not None:
            # Headers are sent already: the error travels as an SSE event (the SDK raises it).
            gens.abort_reason = error.reason
            gens.server.count_rejection(error.reason)
            gens.call.error_code, gens.call.error_type = error.code or error.reason, error.type
            out.append(encode(error_chunk(error) if error_chunk is not None else error.body()))
        if end is not None:
            out.append(sse(end))
        yield "".join(out)

    return _SSEResponse(body(), on_close=gens.close)


def cached_tokens(gens: Generations) -> int:
    """Prompt tokens the engine did not prefill (the slots engine's prefix cache), counted as
    prompt_tokens counts them: each prompt once, with the fewest of its n choices (they are
    consecutive streams of one prompt: prepare.py)."""
    total = 0
    group: list[GenerationStream] = []
    for stream in gens.streams:
        if group and stream.prompt_ids != group[0].prompt_ids:
            total += min(s.cached_tokens for s in group)
            group = []
        group.append(stream)
    if group:
        total += min(s.cached_tokens for s in group)
    return min(total, gens.prompt_tokens)


def usage(gens: Generations) -> dict:
    completion = sum(gens.completion_tokens)
    return {
        "prompt_tokens": gens.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": gens.prompt_tokens + completion,
        # What is known of them: the prompt's cached prefix; no reasoning, no predicted outputs.
        "prompt_tokens_details": {"cached_tokens": cached_tokens(gens)},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


async def generate_or_raise(gens: Generations, request: Request) -> list[tuple[str, str, list]] | None:
    """The (text, finish_reason, logprob entries) of every choice; None if the client went away meanwhile."""
    try:
        return await _run_to_end(gens, request)
    except Aborted:
        return None
    except ServingError:
        raise
    except Exception as exc:
        log.exception("generation %s failed", gens.request_id)
        gens.abort_reason = "internal_error"
        raise InternalError("generation failed; see the server log") from exc
    finally:
        gens.close()
