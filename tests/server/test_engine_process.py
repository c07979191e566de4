"""The engine loop in a child process (server/engine_process.py): the same contract as the
in-thread AsyncEngine — outputs, add errors, aborts, stats, a dying engine — across a process
boundary, through the app, and with the real engine (same greedy tokens as in-thread)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from test_server import (
    MAX_LEN,
    MODEL,
    FakeEngine,
    FakeTokenizer,
    assert_openai_error,
    completion,
    sse_events,
)

from tailored.engine.types import FinishReason, SamplingParams
from tailored.server.app import build_app
from tailored.server.async_engine import AsyncEngine, EngineDeadError
from tailored.server.engine_process import EngineProcess


def fake_engine(delay_s: float = 0.0) -> FakeEngine:
    """The child's build (spawn imports this module by name)."""
    return FakeEngine(delay_s)


def env_engine() -> FakeEngine:
    e = FakeEngine()
    e.stats = lambda: {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY")}
    return e


def test_child_waits_passively_in_openmp_unless_told_otherwise(monkeypatch):
    """Spinning OpenMP workers made the child's CPU ops 10-20x slower under CPU contention
    (kb/0014); the child gets OMP_WAIT_POLICY=PASSIVE, the parent's environment is unchanged,
    and a policy the user set wins."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    for want in ("PASSIVE", "ACTIVE"):
        if want == "ACTIVE":
            monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
        ep = EngineProcess(env_engine, ready_timeout_s=120)
        ep.start()
        try:
            got = asyncio.run(ep.stats())
        finally:
            ep.shutdown()
        assert got == {"OMP_WAIT_POLICY": want}
        assert os.environ.get("OMP_WAIT_POLICY") == (None if want == "PASSIVE" else "ACTIVE")


def failing_build() -> FakeEngine:
    raise ValueError("--max-model-len 5 is too small for this test")


def _proc(delay_s: float = 0.0) -> EngineProcess:
    return EngineProcess(fake_engine, {"delay_s": delay_s}, ready_timeout_s=120)


async def _wait_stats(ep: EngineProcess, want: dict, timeout: float = 5.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        got = await ep.stats()
        if got == want or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.01)


def test_generate_abort_errors_and_stats_across_the_process():
    asyncio.run(_generate_abort_errors_and_stats())


async def _generate_abort_errors_and_stats():
    ep = _proc(delay_s=0.002)
    with pytest.raises(EngineDeadError):
        await ep.generate("early", [1], SamplingParams())
    ep.start()
    try:
        assert ep.healthy and ep.pid != os.getpid()
        with pytest.raises(ValueError, match="rejected"):  # the engine's own error, rebuilt
            await ep.generate("bad", list(b"REJECT"), SamplingParams())
        sp = SamplingParams(max_tokens=10_000, ignore_eos=True)
        stream = await ep.generate("long", list(b"SAY:abc"), sp)
        with pytest.raises(ValueError, match="duplicate"):
            await ep.generate("long", list(b"SAY:x"), SamplingParams())
        got = [await anext(stream) for _ in range(3)]
        assert "".join(o.delta_text for o in got) == "abc"
        await stream.aclose()  # early close aborts in the child
        assert await _wait_stats(ep, {"running": 0}) == {"running": 0}
        outs = [o async for o in ep.generate("short", list(b"SAY:hi"), SamplingParams())]
        assert outs[-1].finished and outs[-1].finish_reason == FinishReason.STOP
        assert "".join(o.delta_text for o in outs) == "hi"
        # many at once, each gets its own text
        texts = await asyncio.gather(*(_text(ep, f"r{i}", f"SAY:answer-{i}") for i in range(40)))
        assert texts == [f"answer-{i}" for i in range(40)]
    finally:
        ep.shutdown()
    assert not ep.healthy
    with pytest.raises(EngineDeadError):
        await ep.generate("late", [1], SamplingParams())


async def _text(ep, rid, prompt):
    return "".join([o.delta_text async for o in ep.generate(rid, list(prompt.encode()),
                                                             SamplingParams())])


def test_app_over_the_engine_process():
    ep = _proc(delay_s=0.001)
    app = build_app(ep, FakeTokenizer(), MODEL, MAX_LEN)
    with TestClient(app) as client:  # the lifespan starts and stops the child
        assert client.get("/health").json() == {"status": "ok"}
        r = completion(client, prompt="SAY:hello")
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hello"
        r = client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "SAY:hey"}], "stream": True})
        chunks = sse_events(r.text)
        assert chunks[-1] == "DONE"
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == "hey"
        assert_openai_error(completion(client, prompt="REJECT"), 400, "rejected")
        assert completion(client, prompt="SAY:still fine").json()["choices"][0]["text"] == "still fine"
    assert not ep.healthy


def test_engine_crash_in_the_child_fails_pending_and_health_503():
    ep = _proc(delay_s=0.01)
    app = build_app(ep, FakeTokenizer(), MODEL, MAX_LEN)
    with TestClient(app) as client:
        err = assert_openai_error(completion(client, prompt="SAY:CRASH"), 500, "engine loop died")
        assert err["type"] == "server_error" and "fake engine crashed" in err["message"]
        health = client.get("/health")
        assert health.status_code == 503 and "fake engine crashed" in health.json()["message"]
        assert_openai_error(completion(client, prompt="SAY:a"), 503, "engine unavailable")


def test_killed_child_ends_every_pending_request_with_an_error():
    asyncio.run(_killed_child())


async def _killed_child():
    ep = _proc(delay_s=0.005)
    ep.start()
    try:
        sp = SamplingParams(max_tokens=100_000, ignore_eos=True)
        streams = [await ep.generate(f"s{i}", list(b"SAY:xyz"), sp) for i in range(3)]
        await anext(streams[0])
        os.kill(ep.pid, signal.SIGKILL)
        for s in streams:
            last = [o async for o in s][-1]
            assert last.finish_reason == FinishReason.ERROR and "code -9" in last.error
        assert not ep.healthy and "code -9" in ep.dead_reason
        with pytest.raises(EngineDeadError):
            await ep.generate("after", [1], SamplingParams())
    finally:
        ep.shutdown()


def aborting_at_exit_engine() -> FakeEngine:
    """A child that aborts in its own teardown (SIGABRT, exit code -6), as one did under load
    after a shutdown was asked for."""
    import atexit

    atexit.register(os.abort)
    return FakeEngine(0.005)


def test_a_child_aborting_in_its_teardown_ends_streams_as_the_shutdown():
    asyncio.run(_aborting_child())


async def _aborting_child():
    """Requests cut by a shutdown end with its words ("shutting down"), whatever code the
    child then exits with; the health says the engine is gone."""
    ep = EngineProcess(aborting_at_exit_engine, ready_timeout_s=120)
    ep.start()
    try:
        stream = await ep.generate("s", list(b"SAY:xyz"), SamplingParams(max_tokens=100_000,
                                                                         ignore_eos=True))
        await anext(stream)
        await asyncio.get_running_loop().run_in_executor(None, ep.shutdown, 10.0)
        last = [o async for o in stream][-1]
        assert last.finish_reason == FinishReason.ERROR and "shutting down" in last.error
        assert not ep.healthy
    finally:
        ep.shutdown()


def dying_build() -> FakeEngine:
    os._exit(3)  # a crash (segfault, OOM kill) before the child can report anything


def test_child_dying_while_starting_raises_in_start():
    ep = EngineProcess(dying_build, ready_timeout_s=120)
    with pytest.raises(RuntimeError, match="exited with code 3 while starting"):
        ep.start()
    assert not ep.healthy


def test_build_error_raises_in_start_with_its_type():
    ep = EngineProcess(failing_build, ready_timeout_s=120)
    with pytest.raises(ValueError, match="too small for this test"):
        ep.start()
    assert not ep.healthy and "too small" in ep.dead_reason


def test_real_engine_in_a_process_equals_in_thread():
    """The embedded model, greedy, 6 concurrent prompts: the same tokens as the in-thread
    AsyncEngine (both build the same weights; batching is the engine's, not the transport's)."""
    from tailored.stack import build_engine, build_stack

    kw = dict(device="cpu", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=128)
    prompts = [[100 + 13 * i + j for j in range(5 + 7 * i)] for i in range(6)]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    async def run(engine) -> list[list[int]]:
        async def one(i):
            ids = []
            async for o in engine.generate(f"p{i}", prompts[i], sp):
                ids += o.delta_token_ids
            return ids
        return await asyncio.gather(*(one(i) for i in range(len(prompts))))

    thread = AsyncEngine(build_stack(None, **kw).engine)
    thread.start()
    try:
        want = asyncio.run(run(thread))
    finally:
        thread.shutdown()
    ep = EngineProcess(build_engine, dict(checkpoint_dir=None, **kw), ready_timeout_s=240)
    ep.start()
    try:
        got = asyncio.run(run(ep))
        # a second wave reuses slots and pages freed by the first, in the child
        again = asyncio.run(run(ep))
    finally:
        ep.shutdown()
    assert all(len(t) == 12 for t in want)
    assert got == want and again == want


def _serve(tmp_path, *flags):
    """`tailored serve` (the embedded nano model) in its own session on a free port, until
    /health answers. Returns (process, base url, log path)."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "serve.log"
    env = {**os.environ, "TAILORED_CACHE": str(tmp_path / "cache")}
    with open(log, "w") as f:
        p = subprocess.Popen([sys.executable, "-m", "tailored", "serve", "--port", str(port),
                              *flags], stdout=f, stderr=subprocess.STDOUT, env=env,
                             start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            assert p.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return p, url, log
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
    except BaseException:
        p.kill()
        raise


def _stream_in_flight(url: str, body: dict, done: dict):
    """A thread streaming one completion into done["r"]; started, and returned for join()."""
    import threading

    def run():
        try:
            done["r"] = httpx.post(f"{url}/v1/completions", timeout=300,
                                   json={**body, "stream": True})
        except httpx.HTTPError as e:  # a forced exit cuts the stream
            done["err"] = e

    th = threading.Thread(target=run)
    th.start()
    return th


def _long_stream_then(p, url: str, *signals):
    """Start a 4000-token stream, then send `signals` to the server's process group 0.5 s
    apart. Returns (done dict of the stream, its thread, the time of the first signal)."""
    done: dict = {}
    th = _stream_in_flight(url, {"prompt": "x", "max_tokens": 4000, "ignore_eos": True}, done)
    time.sleep(1.0)
    t0 = time.monotonic()
    for i, sig in enumerate(signals):
        if i:
            time.sleep(0.5)
        os.killpg(p.pid, sig)
    return done, th, t0


def _wait_exit(p) -> None:
    import subprocess

    try:
        p.wait(30)
    except subprocess.TimeoutExpired:
        p.kill()


def test_serve_cli_runs_the_engine_in_a_child(tmp_path):
    """`tailored serve` (default --engine-process on) answers over HTTP; a SIGTERM to its whole
    process group (systemd, `timeout`) lets the in-flight request finish: the child ignores
    the signal and is stopped by the parent in order."""
    p, url, log = _serve(tmp_path, "--max-model-len", "512")
    try:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "def f(x):", "max_tokens": 5},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
        assert "engine loop in process" in log.read_text()
        done = {}
        th = _stream_in_flight(url, {"prompt": "x", "max_tokens": 150, "ignore_eos": True}, done)
        time.sleep(1.0)
        os.killpg(p.pid, signal.SIGTERM)
        th.join(120)
        body = done["r"].text
        assert done["r"].status_code == 200 and body.rstrip().endswith("data: [DONE]"), body[-500:]
        assert '"error"' not in body, body[-500:]
    finally:
        _wait_exit(p)
    text = log.read_text()
    assert p.returncode in (0, -signal.SIGTERM), text[-3000:]  # uvicorn re-raises SIGTERM
    assert "engine process exited" not in text, text[-3000:]


@pytest.mark.parametrize("mode", ["on", "off"])
def test_serve_sigterm_ends_a_long_stream_after_the_shutdown_timeout(tmp_path, mode):
    """uvicorn alone waits for open connections with no limit (a stream can run for
    max_model_len tokens): after --shutdown-timeout the engine stops and the stream ends
    with an error event and [DONE], and the server exits."""
    p, url, log = _serve(tmp_path, "--max-model-len", "4096", "--shutdown-timeout", "1",
                         "--engine-process", mode)
    try:
        done, th, t0 = _long_stream_then(p, url, signal.SIGTERM)
        th.join(120)
        took = time.monotonic() - t0
        body = done["r"].text
        assert body.rstrip().endswith("data: [DONE]"), body[-500:]
        assert '"error"' in body and "shutting down" in body, body[-500:]
        assert took < 30, took
    finally:
        _wait_exit(p)
    text = log.read_text()
    assert p.returncode in (0, -signal.SIGTERM), text[-3000:]
    assert "shutdown timeout: ending the requests still in flight" in text, text[-3000:]


def test_serve_ctrl_c_when_idle_stops_without_a_traceback(tmp_path):
    """Ctrl-C is how a user stops `tailored serve`: a log line and a shell's 130, no
    traceback (uvicorn re-raises the signal after its graceful shutdown)."""
    p, url, log = _serve(tmp_path, "--max-model-len", "512", "--engine-process", "off")
    try:
        os.killpg(p.pid, signal.SIGINT)
        p.wait(30)
    finally:
        _wait_exit(p)
    text = log.read_text()
    assert p.returncode == 130 and "stopped (Ctrl-C)" in text, (p.returncode, text[-2000:])
    assert "Traceback" not in text, text[-3000:]


def test_serve_second_ctrl_c_exits_at_once_with_the_engine_process(tmp_path):
    """A second Ctrl-C makes uvicorn skip the app's shutdown; the engine process must still be
    stopped (else the interpreter's exit waits on it): exit within seconds, not after
    --shutdown-timeout, with no engine process left behind."""
    p, url, log = _serve(tmp_path, "--max-model-len", "4096", "--shutdown-timeout", "60")
    try:
        _, th, t0 = _long_stream_then(p, url, signal.SIGINT, signal.SIGINT)
        p.wait(30)
        took = time.monotonic() - t0
        th.join(30)
    finally:
        _wait_exit(p)
    text = log.read_text()
    assert took < 20, (took, text[-2000:])
    assert p.returncode == 130 and "stopped (Ctrl-C)" in text, (p.returncode, text[-2000:])
    pid = next((int(w) for line in text.splitlines() if "engine running in process" in line
                for w in line.split() if w.isdigit()), None)
    assert pid is not None, text[-2000:]
    time.sleep(1.0)
    assert not os.path.exists(f"/proc/{pid}") or "zombie" in open(f"/proc/{pid}/status").read().lower(), pid
