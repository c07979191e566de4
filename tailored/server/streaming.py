"""Running a request's engine streams to its answer: `complete` (non-streaming: every choice
collected, the client watched for leaving) and `stream_events` (SSE as the outputs come),
each ending every engine request however the request ends (finished, failed, client gone).

`n` choices are n engine streams of the one prompt; a stream interleaves their chunks as they
come, each naming its choice index; one choice failing (or the client leaving) ends them all.
A streaming request that fails after the headers were sent gets `data: {"error": {...}}` and
then `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from tailored.engine.types import RequestOutput
from tailored.server.async_engine import RequestStream
from tailored.server.answer import collect_answer
from tailored.server.errors import engine_error
from tailored.server.formatter import Formatter
from tailored.server.http_io import internal_error, sse
from tailored.server.metrics import RequestMetrics

logger = logging.getLogger(__name__)


async def complete(request: Request, streams: list[RequestStream], fmts: list[Formatter],
                   trackers: list[RequestMetrics], disconnect_poll_s: float) -> JSONResponse:
    """Non-streaming: aggregate every choice's deltas; abort all if the client disconnects
    meanwhile or one choice fails."""
    watcher = asyncio.create_task(abort_on_disconnect(request, streams, disconnect_poll_s))
    tasks = [asyncio.ensure_future(collect(s, t, f))
             for s, t, f in zip(streams, trackers, fmts)]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        # every failed task's error read (an unread one is logged at garbage collection)
        errors = [e for t in tasks if t in done and (e := t.exception()) is not None]
        if errors:
            raise errors[0]
        results = [t.result() for t in tasks]
    finally:
        watcher.cancel()
        for s, tracker in zip(streams, trackers):
            tracker.finish("abort")  # no-op when its last output was seen
            s.abort()  # no-op when finished
        for t in tasks:  # the others end once aborted; their errors are not the answer
            t.cancel()
    choices = [choice for choice, _ in results]
    return JSONResponse(fmts[0].response(choices, sum(n for _, n in results),
                                         cached_tokens(fmts)).model_dump())


async def abort_on_disconnect(request: Request, streams: list[RequestStream],
                              poll_s: float) -> None:
    """Abort every stream once the client left (checked every poll_s seconds)."""
    while not all(s.finished for s in streams):
        await asyncio.sleep(poll_s)
        if await request.is_disconnected():
            logger.info("client disconnected; aborting %s", streams[0].request_id)
            for s in streams:
                s.abort()
            return


async def stream_events(streams: list[RequestStream], fmts: list[Formatter],
                        trackers: list[RequestMetrics]) -> AsyncIterator[str]:
    """SSE body: every choice's chunks as they come (each names its index). Cancellation
    (client disconnect) lands in `finally` and aborts every choice."""
    num_tokens = 0
    ended: set[int] = set()
    try:
        for fmt in fmts:
            first = fmt.first_chunk()
            if first is not None:
                yield first
        async for i, out in outputs(streams):
            if i in ended:  # a choice ended by its first call (parallel_tool_calls false)
                continue
            fmt = fmts[i]
            trackers[i].output(out)
            if out.error is not None:
                err = engine_error(out)
                yield sse(err.to_dict())
                yield "data: [DONE]\n\n"
                return
            num_tokens += len(out.delta_token_ids)
            fmt.tokens_sent += len(out.delta_token_ids)
            text, reasoning, calls, finish = fmt.delta(out)
            if fmt.stopped:  # its one call ended: the rest of the answer is not wanted
                ended.add(i)
                trackers[i].finish("stop")
                streams[i].abort()
            # completions' echo: the prompt (and its logprobs) before the first delta's
            echo, lp = fmt.echo_prefix(out.prompt_logprobs)
            text = echo + text
            # a delta's logprobs go with it, also where its text is held back
            lp = join_logprobs(lp, fmt.logprobs_payload(out.delta_token_ids, out.delta_logprobs))
            if text or reasoning or calls or lp or finish is not None:
                yield fmt.chunk(text, finish, reasoning, calls, lp)
            if len(ended) == len(streams):
                break
        if fmts[0].include_usage:
            yield fmts[0].usage_chunk(num_tokens, cached_tokens(fmts))
        yield "data: [DONE]\n\n"
    except Exception as e:  # headers are sent; report in-band
        logger.exception("unexpected error while streaming %s", streams[0].request_id)
        for tracker in trackers:
            tracker.finish("error")
        yield sse(internal_error(e).to_dict())
        yield "data: [DONE]\n\n"
    finally:
        for s, tracker in zip(streams, trackers):
            tracker.finish("abort")  # no-op when its last output was seen
            s.abort()  # no-op when finished


def cached_tokens(fmts: list["Formatter"]) -> int:
    """Prompt tokens the prefix cache supplied, each prompt counted once (as usage counts its
    tokens): the most any of its choices got (they may hit or not, by their admission)."""
    best: dict[int, int] = {}
    for f in fmts:
        best[f.prompt_no] = max(best.get(f.prompt_no, 0), f.cached_tokens)
    return sum(best.values())


async def collect(stream: RequestStream, tracker: RequestMetrics, fmt: Formatter):
    """One choice's whole answer, through the splitters a stream uses (so both give the same
    answer): (its choice object, completion tokens)."""
    answer = await collect_answer(stream, fmt, tracker)
    echo, lp = fmt.echo_prefix(answer.prompt_logprobs)  # (first: the offsets follow it)
    lp = join_logprobs(lp, fmt.logprobs_payload(answer.ids, answer.logprobs))
    fmt.prompt_logprobs = fmt.prompt_logprobs_field(answer.prompt_logprobs)
    choice = fmt.choice(echo + answer.text, answer.reasoning, answer.calls, answer.finish, lp)
    return choice, answer.num_tokens


def join_logprobs(a: dict | None, b: dict | None) -> dict | None:
    """Two completions logprobs objects (the echoed prompt's, the completion's) as one."""
    if a is None or b is None:
        return a if b is None else b
    return {key: a[key] + b[key] for key in a}


async def outputs(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) of every stream until each has finished, in arrival order. One
    stream (n = 1, nearly every request) is read directly: no task or queue per token."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
            if out.finished:
                return
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await queue.put((i, out, None))
                if out.finished:
                    break
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the reader, which raises it
            await queue.put((i, None, e))
            return
        await queue.put((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            i, out, exc = await queue.get()
            if exc is not None:
                raise exc
            if out is None:
                running -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()


async def end_streams(streams: list[RequestStream], trackers: list[RequestMetrics]) -> None:
    """A stream response's background task: also runs when the client left before the body
    started (the generator never ran): the request counts as aborted and leaves the engine."""
    for stream, tracker in zip(streams, trackers):
        tracker.finish("abort")  # no-op when the body's `finally` already counted it
        stream.abort()
