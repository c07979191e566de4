"""asyncio <-> engine bridge: one background thread owns the synchronous `Engine`.

The engine is not thread-safe, so *every* engine call (add_request, abort_request, step,
has_unfinished, stats) happens on the single engine thread. Request handlers talk to it through a
thread-safe command queue that the loop drains before each step; results come back through
per-request `asyncio.Queue`s fed with `loop.call_soon_threadsafe` (one call per event loop per
step, not per output). When nothing is running the thread sleeps on an Event (no busy-spin).

Usage (both forms work):

    stream = await async_engine.generate(rid, prompt_ids, sampling)   # ValueError raised here
    async for out in stream: ...                                       # RequestOutputs, last one finished

    async for out in async_engine.generate(rid, prompt_ids, sampling): ...

If the engine loop raises, every pending request receives a final RequestOutput with
finish_reason=ERROR and `error` set, `healthy` turns False, and later `generate` calls raise
`EngineDeadError`. A loop that has work and has not finished a step for `stall_timeout_s`
(a hung step) is not `healthy` either, until it moves again (loop_watch.py).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any, Self

from tailored.engine.step_timing import TimingLog
from tailored.engine.types import FinishReason, RequestOutput, SamplingParams
from tailored.server.loop_watch import LoopWatch

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop is not running (never started, crashed or shut down)."""


@dataclass
class OutputSink:
    """Where one request's outputs go. Owned by the engine thread once registered."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    num_prompt_tokens: int
    num_output_tokens: int = 0


def post_threadsafe(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    """call_soon_threadsafe that tolerates a loop that has already closed (client went away)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


def resolve_future(fut: asyncio.Future, result: Any = None,
                   exc: BaseException | None = None) -> None:
    # The awaiting coroutine may have been cancelled meanwhile; setting a done future raises.
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)


def route_outputs(streams: dict[str, OutputSink], outputs: list[RequestOutput]) -> dict:
    """Group a step's outputs by their consumer's event loop: {loop: [(queue, output)]}.
    Outputs of unknown ids (aborted: the consumer is gone) are dropped; a finished request's
    stream is removed from `streams`."""
    per_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for out in outputs:
        stream = streams.get(out.request_id)
        if stream is None:
            continue
        stream.num_output_tokens = out.num_output_tokens
        if out.finished:
            del streams[out.request_id]
        per_loop.setdefault(stream.loop, []).append((stream.queue, out))
    return per_loop


def stall_reason(engine) -> str | None:
    """/health's words for a stalled loop (None when it is not): `engine` has `watch` and
    `stall_timeout_s`."""
    waited = engine.watch.stalled_for()
    if waited <= engine.stall_timeout_s:
        return None
    return (f"engine loop stalled: work has waited {waited:.0f} s without a finished step "
            f"(the bound is {engine.stall_timeout_s:g} s)")


def final_output(request_id: str, stream: OutputSink, reason: FinishReason, error: str | None):
    return RequestOutput(
        request_id=request_id,
        delta_text="",
        delta_token_ids=[],
        finished=True,
        finish_reason=reason,
        num_prompt_tokens=stream.num_prompt_tokens,
        num_output_tokens=stream.num_output_tokens,
        error=error,
    )


class RequestStream:
    """Async iterator over one request's `RequestOutput`s; stops after the finished one.

    `await stream` (or `await stream.start()`) submits the request and raises the engine's
    ValueError (bad input) or EngineDeadError before any output is consumed. Iterating an
    unstarted stream starts it first. `abort()` / `aclose()` cancel the request in the engine if
    it has not finished; call one of them when the consumer stops early (client disconnect).
    """

    def __init__(self, owner: AsyncEngine, request_id: str, prompt_ids, sampling) -> None:
        self.request_id = request_id
        self._owner = owner
        self._prompt_ids = list(prompt_ids)
        self._sampling = sampling
        self._queue: asyncio.Queue | None = None
        self._started = False
        self._finished = False  # the finished output was consumed, or abort() was called

    @property
    def finished(self) -> bool:
        return self._finished

    async def start(self) -> RequestStream:
        if self._started:
            return self
        self._started = True
        loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue()
        added = loop.create_future()
        stream = OutputSink(loop, self._queue, num_prompt_tokens=len(self._prompt_ids))
        try:
            self._owner._submit(
                ("add", self.request_id, self._prompt_ids, self._sampling, stream, added)
            )
            await added
        except asyncio.CancelledError:
            # The add may still go through on the engine thread; the abort is queued behind it.
            self.abort()
            raise
        except BaseException:
            self._finished = True
            raise
        return self

    def __await__(self):
        return self.start().__await__()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._started:
            await self.start()
        if self._finished and self._queue.empty():
            raise StopAsyncIteration
        out = await self._queue.get()
        if out.finished:
            self._finished = True
        return out

    def abort(self) -> None:
        """Cancel the request if it is still running; a final ABORT output is queued."""
        if self._started and not self._finished:
            self._finished = True
            self._owner.abort(self.request_id)

    async def aclose(self) -> None:
        self.abort()

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        self.abort()


class AsyncEngine:
    """Runs `engine.step()` in one background thread and fans outputs out to asyncio callers.

    engine: object with add_request(id, prompt_ids, sampling) (ValueError on bad input),
    abort_request(id), step() -> list[RequestOutput], has_unfinished() -> bool, stats() -> dict.
    stall_timeout_s: `healthy` turns False while work has waited this long for a step.
    """

    def __init__(self, engine, *, thread_name: str = "tailored-engine",
                 timing_log_s: float = 10.0, stall_timeout_s: float = 60.0) -> None:
        self.engine = engine
        self.stall_timeout_s = stall_timeout_s
        self.watch = LoopWatch()  # the loop's beats, for `stalled` (loop_watch.py)
        # engine.timer (engine/step_timing.py), logged at INFO every timing_log_s while busy
        self._timing = TimingLog(getattr(engine, "timer", None), timing_log_s, logger)
        self._thread_name = thread_name
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        # _lock orders "is the loop alive?" against "put a command": once _dead is set no new
        # command can enter the queue, so the dying thread can fail every queued one.
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._dead: str | None = None  # reason the loop is not running any more
        self._streams: dict[str, OutputSink] = {}  # engine thread only

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        with self._lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name=self._thread_name, daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the loop after the current step; pending requests end with an ERROR output."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def healthy(self) -> bool:
        """True while the engine thread is running, has not crashed and is not stalled."""
        return (self._thread is not None and self._thread.is_alive() and self._dead is None
                and not self.stalled)

    @property
    def stalled(self) -> bool:
        """Work has waited more than stall_timeout_s for the loop to finish a step."""
        return self.watch.stalled_for() > self.stall_timeout_s

    @property
    def dead_reason(self) -> str | None:
        if self._thread is None:
            return "engine loop not started"
        return self._dead or stall_reason(self)

    # ---- request API (any thread / event loop) -----------------------------------------
    def generate(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams):
        """Submit a request; returns a RequestStream (await it to surface add errors early)."""
        return RequestStream(self, request_id, prompt_ids, sampling)

    def abort(self, request_id: str) -> None:
        """Cancel a request (no-op if unknown, finished, or the loop is dead). Thread-safe."""
        try:
            self._submit(("abort", request_id))
        except EngineDeadError:
            pass

    async def stats(self) -> dict:
        """engine.stats(), fetched on the engine thread between steps."""
        return await self.call("stats")

    async def call(self, method: str):
        """engine.<method>() (no arguments), called on the engine thread between steps: stats,
        flush_prefix_cache. AttributeError when the engine has no such method."""
        fut = asyncio.get_running_loop().create_future()
        self._submit(("call", method, fut))
        return await fut

    def _submit(self, cmd: tuple) -> None:
        with self._lock:
            if self._thread is None:
                raise EngineDeadError("engine loop not started")
            if self._dead is not None or self._stopping:
                raise EngineDeadError(self._dead or "engine is shutting down")
            self._commands.put(cmd)
        if cmd[0] != "abort":
            self.watch.submitted()
        self._wake.set()

    # ---- engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        reason = "engine is shutting down"
        try:
            while not self._stopping:
                self._drain_commands()
                if self._stopping:
                    break
                if not self.engine.has_unfinished():
                    self._timing.going_idle()  # the busy spell's last window, not stale later
                    self.watch.beat(idle=True)
                    # Ordering: wait -> clear -> drain. A command put after the drain sets the
                    # event, so the next wait returns at once; nothing can be missed.
                    self._wake.wait()
                    self._wake.clear()
                    self.watch.beat(idle=False)
                    self._timing.waking()
                    continue
                self._dispatch(self.engine.step())
                self.watch.beat(idle=False)
                self._timing.after_step()
        except BaseException as exc:  # any crash must fail the pending requests
            logger.exception("engine loop died")
            reason = f"engine loop died: {type(exc).__name__}: {exc}"
        finally:
            self._fail_everything(reason)

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            kind = cmd[0]
            if kind == "add":
                self._do_add(*cmd[1:])
            elif kind == "abort":
                self._do_abort(cmd[1])
            elif kind == "call":
                fut = cmd[2]
                try:
                    result, exc = getattr(self.engine, cmd[1])(), None
                except Exception as e:  # noqa: BLE001 - reported to the caller
                    result, exc = None, e
                post_threadsafe(fut.get_loop(), resolve_future, fut, result, exc)

    def _do_add(self, request_id, prompt_ids, sampling, stream: OutputSink, fut) -> None:
        exc: BaseException | None = None
        if request_id in self._streams:
            exc = ValueError(f"duplicate request id {request_id!r}")
        else:
            try:
                self.engine.add_request(request_id, prompt_ids, sampling)
            except Exception as e:  # noqa: BLE001 - ValueError = bad input; others -> caller
                exc = e
            else:
                self._streams[request_id] = stream
        post_threadsafe(stream.loop, resolve_future, fut, None, exc)

    def _do_abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:  # never added, already finished or already aborted
            return
        try:
            self.engine.abort_request(request_id)
        except Exception:  # a failed abort must not kill the loop
            logger.exception("engine.abort_request(%r) failed", request_id)
        out = final_output(request_id, stream, FinishReason.ABORT, None)
        post_threadsafe(stream.loop, put_all, [(stream.queue, out)])

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for loop, items in route_outputs(self._streams, outputs).items():
            post_threadsafe(loop, put_all, items)

    def _fail_everything(self, reason: str) -> None:
        with self._lock:
            self._dead = reason
        dead = EngineDeadError(reason)
        while True:  # commands queued before _dead was set
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                post_threadsafe(cmd[4].loop, resolve_future, cmd[5], None, dead)
            elif cmd[0] == "call":
                post_threadsafe(cmd[2].get_loop(), resolve_future, cmd[2], None, dead)
        streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            out = final_output(request_id, stream, FinishReason.ERROR, reason)
            post_threadsafe(stream.loop, put_all, [(stream.queue, out)])
