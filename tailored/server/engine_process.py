"""The engine loop in its own process, so the HTTP server and the engine stop sharing one GIL.

Why (kb/0014): on the H200 a served c=32 decode step waited 18.7 ms for a 14.1 ms GPU step,
and the HTTP side (uvicorn, SSE framing, pydantic) spends ~120 µs of Python per streamed token
(~3.8 ms per B=32 step, kb/0011). In one process that Python holds the GIL the engine thread
needs right after each GPU sync; in two processes each has its own GIL and core. vLLM v1 splits
the same way (AsyncLLM front end, EngineCore process).

`EngineProcess` is a drop-in for `AsyncEngine` (generate / abort / stats / start / shutdown /
healthy / dead_reason, the same `RequestStream`s). The child builds the engine itself (CUDA is
initialized there only; the "spawn" start method), then loops: drain commands, step, send
outputs. Messages are tuples over one duplex `multiprocessing.Pipe`:

    parent -> child   ("add", rid, prompt_ids, sampling) | ("abort", rid)
                      | ("call", key, method) | ("shutdown",)
    child -> parent   ("ready",) | ("failed", exc_type, message)   (once, after the build)
                      ("added", rid, None | (exc_type, message))    (per add, before its outputs)
                      ("out", [RequestOutput, ...])                 (per step with outputs)
                      ("result", key, value, None | (exc_type, message)) | ("died", reason)

Besides the pipe, the child beats into shared memory (loop_watch.py), so the parent sees a loop
that stopped finishing steps while work waits: `healthy` is False while it is stalled.

Errors: a bad request's add error comes back as the engine raised it (ValueError -> 400); a
failed build raises in `start()` (ValueError stays ValueError: `tailored serve` prints one
line); if the child dies every pending request ends with an ERROR output and `healthy` turns
False, as with AsyncEngine. The child ignores SIGINT and SIGTERM (both reach the whole process
group: Ctrl-C, systemd; the parent shuts it down in order) and exits when the parent's end of
the pipe closes. It is spawned with OMP_WAIT_POLICY=PASSIVE unless the user set a policy.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
from typing import Any, Callable

from tailored.engine.step_timing import TimingLog
from tailored.engine.types import FinishReason, RequestOutput, SamplingParams
from tailored.server.async_engine import (
    EngineDeadError,
    RequestStream,
    final_output,
    post_threadsafe,
    put_all,
    resolve_future,
    route_outputs,
    stall_reason,
    OutputSink,
)
from tailored.server.loop_watch import LoopWatch

logger = logging.getLogger(__name__)

_EXC_TYPES = {"ValueError": ValueError, "RuntimeError": RuntimeError, "OSError": OSError,
              "AttributeError": AttributeError}


def _exc(exc_type: str, message: str) -> BaseException:
    """Rebuild an exception sent by the child (only its type name and message travel)."""
    return _EXC_TYPES.get(exc_type, RuntimeError)(message)


class EngineProcess:
    """Runs the engine loop in a child process; fans its outputs out to asyncio callers.

    build: a module-level function (picklable by name) returning an `Engine`-like object
        (add_request, abort_request, step, has_unfinished, stats; optional `timer`), called in
        the child with build_kwargs.
    switch_interval_s: sys.setswitchinterval in the child (None: Python's default).
    timing_log_s: the child logs engine.timer every this many seconds while busy.
    stall_timeout_s: `healthy` turns False while work has waited this long for a step.
    """

    def __init__(self, build: Callable[..., Any], build_kwargs: dict | None = None, *,
                 timing_log_s: float = 10.0, switch_interval_s: float | None = None,
                 log_level: str | int | None = None, ready_timeout_s: float | None = None,
                 stall_timeout_s: float = 60.0) -> None:
        self.stall_timeout_s = stall_timeout_s
        self.watch: LoopWatch | None = None  # shared with the child once it is spawned
        self._build = build
        self._build_kwargs = dict(build_kwargs or {})
        self._timing_log_s = timing_log_s
        self._switch_interval_s = switch_interval_s
        self._log_level = log_level if log_level is not None else logging.getLogger().level
        self._ready_timeout_s = ready_timeout_s
        self._proc: mp.process.BaseProcess | None = None
        self._conn = None
        self._reader: threading.Thread | None = None
        # Sends go through a queue and one sender thread: a full pipe (the child reads only
        # between steps; an 8k-token prompt pickles to ~40 KB) must block neither an event loop
        # nor the reader, or parent and child could wait on each other.
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender: threading.Thread | None = None
        # _lock guards _streams and _pending: request handlers (event loop threads) register,
        # the reader thread dispatches and unregisters
        self._lock = threading.Lock()
        self._streams: dict[str, OutputSink] = {}
        self._pending: dict[tuple, asyncio.Future] = {}  # awaited add/stats replies, by key
        self._keys = itertools.count()
        self._dead: str | None = "engine process not started"
        self._stopping = False

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        """Spawn the child and wait until its engine is built (minutes on the GPU: weights,
        kernel warm-up, CUDA graphs). Idempotent. Raises the build's error (ValueError for bad
        settings) or RuntimeError when the child dies or times out before it is ready."""
        if self._proc is not None:
            return
        ctx = mp.get_context("spawn")
        # The child inherits the environment at spawn. OpenMP workers that spin while waiting
        # made the child's CPU torch ops 10-20x slower whenever another process wanted the
        # cores (2-core machine, an attack run; kb/0014); passive waiting fixes it and costs
        # nothing on the GPU path. Only when the user has not chosen a policy.
        env_set = "OMP_WAIT_POLICY" not in os.environ
        if env_set:
            os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        parent_end, child_end = ctx.Pipe(duplex=True)
        self.watch = LoopWatch.shared(ctx)
        proc = ctx.Process(
            target=_child_main, name="tailored-engine", daemon=True,
            args=(child_end, self._build, self._build_kwargs, self._log_level,
                  self._switch_interval_s, self._timing_log_s, self.watch.cell),
        )
        try:
            proc.start()
        finally:
            if env_set:
                del os.environ["OMP_WAIT_POLICY"]
        child_end.close()  # the child's copy keeps it open; ours would hide the child's death
        self._proc, self._conn = proc, parent_end
        deadline = None if self._ready_timeout_s is None else time.monotonic() + self._ready_timeout_s
        # a child that dies closes its end: poll() turns true and recv() raises EOFError
        while not parent_end.poll(1.0):
            if deadline is not None and time.monotonic() >= deadline:
                proc.kill()
                self._dead = "engine process not ready in time"
                raise RuntimeError(self._dead)
        try:
            msg = parent_end.recv()
        except (EOFError, OSError):
            proc.join(5)
            self._dead = f"engine process exited with code {proc.exitcode} while starting"
            raise RuntimeError(self._dead) from None
        if msg[0] == "failed":
            proc.join(10)
            self._dead = f"engine build failed: {msg[1]}: {msg[2]}"
            raise _exc(msg[1], msg[2])
        self._dead = None
        self._reader = threading.Thread(target=self._read, name="tailored-engine-reader",
                                        daemon=True)
        self._reader.start()
        self._sender = threading.Thread(target=self._send_loop, name="tailored-engine-sender",
                                        daemon=True)
        self._sender.start()
        logger.info("engine running in process %d", proc.pid)

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the child after its current step; pending requests end with an ERROR output."""
        with self._lock:  # the shutdown timer's thread and the app's lifespan may both call
            if self._proc is None or self._stopping:
                return
            self._stopping = True
        self._outbox.put(("shutdown",))
        self._outbox.put(None)  # the sender's last message
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(5)
        self._fail_everything("engine is shutting down")

    @property
    def healthy(self) -> bool:
        return (self._proc is not None and self._proc.is_alive() and self._dead is None
                and not self._stopping and not self.stalled)

    @property
    def stalled(self) -> bool:
        """Work has waited more than stall_timeout_s for the child's loop to finish a step."""
        return self.watch is not None and self.watch.stalled_for() > self.stall_timeout_s

    @property
    def dead_reason(self) -> str | None:
        return self._dead or (stall_reason(self) if self.watch is not None else None)

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    # ---- request API (any thread / event loop) -----------------------------------------
    def generate(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams):
        """Submit a request; returns a RequestStream (await it to surface add errors early)."""
        return RequestStream(self, request_id, prompt_ids, sampling)

    def abort(self, request_id: str) -> None:
        """Cancel a request: its final ABORT output is queued now; the child frees its pages
        and slot before its next step. No-op when unknown, finished or dead. Thread-safe."""
        with self._lock:
            stream = self._streams.pop(request_id, None)
            if stream is None:
                return
            self._send(("abort", request_id))
        post_threadsafe(stream.loop, put_all,
              [(stream.queue, final_output(request_id, stream, FinishReason.ABORT, None))])

    async def stats(self) -> dict:
        """engine.stats(), fetched in the child between steps."""
        return await self.call("stats")

    async def call(self, method: str):
        """engine.<method>() (no arguments), called in the child between steps: stats,
        flush_prefix_cache. Its error comes back as the engine raised it (ValueError,
        AttributeError, else RuntimeError)."""
        fut = asyncio.get_running_loop().create_future()
        key = ("call", next(self._keys))
        with self._lock:
            self._check_alive()
            self._pending[key] = fut
            self._send(("call", key, method))
        self.watch.submitted()
        return await fut

    def _submit(self, cmd: tuple) -> None:
        """RequestStream's entry point: ("add", rid, prompt_ids, sampling, stream, fut)."""
        _, rid, prompt_ids, sampling, stream, fut = cmd
        with self._lock:
            self._check_alive()
            if rid in self._streams or ("add", rid) in self._pending:
                raise ValueError(f"duplicate request id {rid!r}")
            self._streams[rid] = stream
            self._pending[("add", rid)] = fut
            self._send(("add", rid, prompt_ids, sampling))
        self.watch.submitted()

    def _check_alive(self) -> None:
        if self._proc is None:
            raise EngineDeadError("engine process not started")
        if self._dead is not None or self._stopping:
            raise EngineDeadError(self._dead or "engine is shutting down")

    def _send(self, msg: tuple) -> None:
        """Queue a message for the child; order is kept (one sender thread)."""
        self._outbox.put(msg)

    def _send_loop(self) -> None:
        while (msg := self._outbox.get()) is not None:
            try:
                self._conn.send(msg)
            except (OSError, ValueError):
                return  # the child is gone: the reader sees EOF and fails the requests

    # ---- reader thread -----------------------------------------------------------------
    def _read(self) -> None:
        reason = "engine process exited"
        try:
            while True:
                msg = self._conn.recv()  # releases the GIL while waiting
                kind = msg[0]
                if kind == "out":
                    self._dispatch(msg[1])
                elif kind == "added":
                    self._added(msg[1], msg[2])
                elif kind == "result":
                    with self._lock:
                        fut = self._pending.pop(msg[1], None)
                    if fut is not None:
                        exc = None if msg[3] is None else _exc(*msg[3])
                        post_threadsafe(fut.get_loop(), resolve_future, fut, msg[2], exc)
                elif kind == "died":
                    reason = msg[1]
        except (EOFError, OSError):
            if self._proc is not None:
                self._proc.join(2)
                if self._proc.exitcode not in (0, None) and reason == "engine process exited":
                    reason = f"engine process exited with code {self._proc.exitcode}"
        except BaseException as exc:  # noqa: BLE001 - a reader crash must fail the requests
            logger.exception("engine reader thread died")
            reason = f"engine reader died: {type(exc).__name__}: {exc}"
        # we stopped it: a clean exit, one still under way (None), or shutdown()'s kill after
        # its join timeout. Any other exit code during shutdown is a crash worth logging, but
        # the requests it cut were cut by the shutdown asked for: they end with its words (a
        # child that aborted in its own teardown, -6 under load, told clients of a crash)
        stopping = self._stopping and reason.startswith("engine process exited")
        ours = (stopping and self._proc is not None
                and self._proc.exitcode in (0, None, -signal.SIGKILL))
        if not ours:
            logger.error("%s%s", reason, " during shutdown" if stopping else "")
        if stopping:  # the same words as the engine in a thread
            reason = "engine is shutting down"
        self._fail_everything(reason)

    def _added(self, rid: str, err) -> None:
        with self._lock:
            fut = self._pending.pop(("add", rid), None)
            if err is not None:
                self._streams.pop(rid, None)
        if fut is not None:
            post_threadsafe(fut.get_loop(), resolve_future, fut, None,
                            None if err is None else _exc(*err))

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            per_loop = route_outputs(self._streams, outputs)
        for loop, items in per_loop.items():
            post_threadsafe(loop, put_all, items)

    def _fail_everything(self, reason: str) -> None:
        with self._lock:
            if self._dead is None:
                self._dead = reason
            streams, self._streams = self._streams, {}
            pending, self._pending = self._pending, {}
        dead = EngineDeadError(self._dead)
        for fut in pending.values():
            post_threadsafe(fut.get_loop(), resolve_future, fut, None, dead)
        for rid, stream in streams.items():
            out = final_output(rid, stream, FinishReason.ERROR, self._dead)
            post_threadsafe(stream.loop, put_all, [(stream.queue, out)])


# ---- the child -----------------------------------------------------------------------------
def _child_main(conn, build, build_kwargs, log_level, switch_interval_s, timing_log_s,
                watch_cell) -> None:
    # Ctrl-C and a service manager's SIGTERM reach the whole process group: the parent stops
    # us in order (in-flight requests finish), and a dead parent closes the pipe
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if switch_interval_s is not None:
        sys.setswitchinterval(switch_interval_s)
    try:
        engine = build(**build_kwargs)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        logger.debug("engine build failed", exc_info=True)
        try:
            conn.send(("failed", type(e).__name__, str(e)))
        finally:
            conn.close()
        return
    conn.send(("ready",))
    try:
        _child_loop(conn, engine, timing_log_s, LoopWatch(watch_cell))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the parent is gone
    except BaseException as e:  # noqa: BLE001
        logger.exception("engine loop died")
        try:
            conn.send(("died", f"engine loop died: {type(e).__name__}: {e}"))
        except OSError:
            pass
        raise SystemExit(1) from None


def _child_loop(conn, engine, timing_log_s: float, watch: LoopWatch) -> None:
    # the same log lines and windows as the in-thread loop (AsyncEngine)
    timing = TimingLog(getattr(engine, "timer", None), timing_log_s,
                       logging.getLogger("tailored.server.async_engine"))
    while True:
        if not engine.has_unfinished():
            timing.going_idle()
            watch.beat(idle=True)
            conn.poll(None)  # sleep until a command arrives
            watch.beat(idle=False)
            timing.waking()
        while conn.poll(0):
            msg = conn.recv()
            kind = msg[0]
            if kind == "add":
                _, rid, prompt_ids, sampling = msg
                try:
                    engine.add_request(rid, prompt_ids, sampling)
                    conn.send(("added", rid, None))
                except Exception as e:  # noqa: BLE001 - ValueError = bad input
                    conn.send(("added", rid, (type(e).__name__, str(e))))
            elif kind == "abort":
                try:
                    engine.abort_request(msg[1])
                except Exception:  # a failed abort must not kill the loop
                    logger.exception("engine.abort_request(%r) failed", msg[1])
            elif kind == "call":
                try:
                    conn.send(("result", msg[1], getattr(engine, msg[2])(), None))
                except Exception as e:  # noqa: BLE001 - the caller's error
                    conn.send(("result", msg[1], None, (type(e).__name__, str(e))))
            elif kind == "shutdown":
                return
        if engine.has_unfinished():
            outputs = engine.step()
            watch.beat(idle=False)
            if outputs:
                conn.send(("out", outputs))
            timing.after_step()
