"""NVFP4 checkpoints answer through the OpenAI API on the CPU (issue 48, "done when"): the tiny
preset in ModelOpt's layout behind `tailored serve` (its own process), and in
compressed-tensors' layout behind the app in this process; both give the greedy tokens of
the engine that serves them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from tailored.engine.types import SamplingParams
from tailored.synth import write_synthetic_checkpoint

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def nvfp4_dirs(tmp_path_factory):
    return {fmt: write_synthetic_checkpoint(tmp_path_factory.mktemp(fmt), "tiny", seed=0,
                                            progress=False, precision="nvfp4", nvfp4_format=fmt)
            for fmt in ("modelopt", "compressed-tensors")}


def _greedy(stack, n: int) -> str:
    ids = stack.tokenizer.encode(PROMPT)
    eng = stack.engine
    eng.add_request("r", ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    out = []
    while eng.has_unfinished():
        out += eng.step()
    return "".join(o.delta_text for o in out)


def test_tailored_serve_answers_on_a_modelopt_nvfp4_checkpoint(nvfp4_dirs, tmp_path):
    from tailored.stack import build_stack

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "serve.log"
    env = {**os.environ, "TAILORED_CACHE": str(tmp_path / "cache")}
    with open(log, "w") as f:
        p = subprocess.Popen([sys.executable, "-m", "tailored", "serve",
                              str(nvfp4_dirs["modelopt"]), "--port", str(port),
                              "--max-model-len", "256", "--max-num-seqs", "2"],
                             stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert p.poll() is None, log.read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        r = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": "qwen36-35b-a3b", "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 8
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(30)
    assert "NVFP4" in log.read_text()  # the startup line says what it serves
    stack = build_stack(nvfp4_dirs["modelopt"], device="cpu", progress=False,
                        max_model_len=256, max_num_seqs=2)
    assert body["choices"][0]["text"] == _greedy(stack, 8)


def test_compressed_tensors_nvfp4_checkpoint_chats_through_the_app(nvfp4_dirs):
    from tailored.server.app import build_app
    from tailored.server.async_engine import AsyncEngine
    from tailored.stack import build_stack

    stack = build_stack(nvfp4_dirs["compressed-tensors"], device="cpu", progress=False,
                        max_model_len=256, max_num_seqs=2)
    assert stack.model_config.precision == "nvfp4"
    want = _greedy(stack, 6)
    app = build_app(AsyncEngine(stack.engine), stack.tokenizer, "m", 256)
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 6,
                                                 "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
        r = client.post("/v1/chat/completions", json={
            "model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
