"""Honest health (server/loop_watch.py): /health answers 503 while work has waited longer
than the stall bound for the engine loop to finish a step, and 200 again once it moves, for
the loop in a thread (an engine whose step blocks) and in a child process (SIGSTOP); an idle
loop is healthy however long it sleeps. /health_generate generates a token, or says it could
not. Fake engines: a few seconds."""

from __future__ import annotations

import os
import signal
import threading
import time

from fastapi.testclient import TestClient
from test_server import MAX_LEN, MODEL, FakeEngine, FakeTokenizer, completion

from tailored.server.app import build_app
from tailored.server.async_engine import AsyncEngine
from tailored.server.engine_process import EngineProcess
from tailored.server.loop_watch import LoopWatch

BOUND_S = 0.4


class FreezableEngine(FakeEngine):
    """A fake engine whose step() waits while `running` is clear: a hung step."""

    def __init__(self, delay_s: float = 0.0) -> None:
        super().__init__(delay_s)
        self.running = threading.Event()
        self.running.set()

    def step(self):
        self.running.wait()
        return super().step()


def slow_engine() -> FakeEngine:
    """The child's build (spawn imports this module by name): 20 ms a step."""
    return FakeEngine(0.02)


def health(c) -> tuple[int, dict]:
    r = c.get("/health")
    return r.status_code, r.json()


def wait_for(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def in_background(c, **body) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        out["r"] = completion(c, **body)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def assert_stalled(c) -> None:
    assert wait_for(lambda: health(c)[0] == 503), "a stalled loop answered 200"
    code, body = health(c)
    assert code == 503 and "stalled" in body["message"] and "without a finished step" in \
        body["message"], body
    assert c.get("/v1/models").status_code == 503
    assert 'tailored:engine_healthy{model_name="%s"} 0.0' % MODEL in c.get("/metrics").text
    assert c.get("/health_generate").status_code == 503


def test_loop_watch_rules(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("tailored.server.loop_watch.time.monotonic", lambda: now[0])
    w = LoopWatch()  # idle at 100
    now[0] = 500.0
    assert w.stalled_for() == 0.0  # idle for ages, nothing waits
    w.submitted()  # a request at 500 for a loop that does not wake
    now[0] = 503.0
    assert w.stalled_for() == 3.0
    w.beat(idle=False)  # it woke at 503 and steps
    now[0] = 504.0
    w.submitted()  # more work while busy: the wait counts from the last step
    now[0] = 510.0
    assert w.stalled_for() == 7.0
    w.beat(idle=True)  # finished everything at 510
    now[0] = 600.0
    assert w.stalled_for() == 0.0  # the old submission was picked up before the beat


def test_thread_loop_frozen_mid_step_then_released():
    engine = FreezableEngine(delay_s=0.01)
    app = build_app(AsyncEngine(engine, stall_timeout_s=BOUND_S), FakeTokenizer(), MODEL, MAX_LEN)
    with TestClient(app) as c:
        time.sleep(BOUND_S * 2)
        assert health(c) == (200, {"status": "ok"})  # idle longer than the bound: fine
        assert c.get("/health_generate").json()["status"] == "ok"
        t, out = in_background(c, prompt="SAY:" + "x" * 60, max_tokens=60)
        assert wait_for(lambda: engine.reqs)
        engine.running.clear()  # the next step hangs
        assert_stalled(c)
        engine.running.set()
        t.join(10)
        assert out["r"].status_code == 200 and out["r"].json()["choices"][0]["text"] == "x" * 60
        assert health(c) == (200, {"status": "ok"})
        # frozen while idle: a request that arrives waits, and that is a stall too
        engine.running.clear()
        t, out = in_background(c, prompt="SAY:late", max_tokens=8)
        assert_stalled(c)
        engine.running.set()
        t.join(10)
        assert out["r"].json()["choices"][0]["text"] == "late"
        assert health(c)[0] == 200


def test_engine_process_stopped_with_sigstop():
    ep = EngineProcess(slow_engine, ready_timeout_s=120, stall_timeout_s=BOUND_S)
    app = build_app(ep, FakeTokenizer(), MODEL, MAX_LEN)
    with TestClient(app) as c:
        assert health(c)[0] == 200
        t, out = in_background(c, prompt="SAY:" + "y" * 100, max_tokens=100)  # ~2 s of steps
        running = 'tailored:num_requests_running{model_name="%s"} 1.0' % MODEL
        assert wait_for(lambda: running in c.get("/metrics").text)
        os.kill(ep.pid, signal.SIGSTOP)
        try:
            assert_stalled(c)
        finally:
            os.kill(ep.pid, signal.SIGCONT)
        t.join(15)
        assert out["r"].status_code == 200 and out["r"].json()["choices"][0]["text"] == "y" * 100
        assert wait_for(lambda: health(c)[0] == 200)
        # stopped while idle: healthy until work arrives and waits
        os.kill(ep.pid, signal.SIGSTOP)
        try:
            time.sleep(BOUND_S * 2)
            assert health(c)[0] == 200
            t, out = in_background(c, prompt="SAY:ok", max_tokens=4)
            assert_stalled(c)
        finally:
            os.kill(ep.pid, signal.SIGCONT)
        t.join(15)
        assert out["r"].json()["choices"][0]["text"] == "ok"
        assert wait_for(lambda: health(c)[0] == 200)


def test_dead_engine_process_is_503_with_its_reason():
    ep = EngineProcess(slow_engine, ready_timeout_s=120, stall_timeout_s=60)
    app = build_app(ep, FakeTokenizer(), MODEL, MAX_LEN)
    with TestClient(app) as c:
        os.kill(ep.pid, signal.SIGKILL)
        assert wait_for(lambda: health(c)[0] == 503)
        assert "exited" in health(c)[1]["message"]
        assert c.get("/health_generate").status_code == 503


def test_health_generate_reports_a_failed_generation():
    engine = FakeEngine()
    engine.add_request = lambda *a: (_ for _ in ()).throw(RuntimeError("device lost"))
    app = build_app(AsyncEngine(engine), FakeTokenizer(), MODEL, MAX_LEN)
    with TestClient(app) as c:
        r = c.get("/health_generate")
        assert r.status_code == 503 and "device lost" in r.json()["message"]
