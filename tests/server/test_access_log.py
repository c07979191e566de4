"""The access log (server/access_log.py): one line per request with method, path, status,
"stream" for SSE, the prompt and completion tokens of a generation route, and the latency;
/health and /metrics at DEBUG; nothing with it off (`tailored serve --access-log off`)."""

from __future__ import annotations

import logging
import re

from fastapi.testclient import TestClient
from test_server import MODEL, make_app

LOGGER = "tailored.server.access_log"


def _client(access_log: bool):
    app, *_ = make_app(access_log=access_log)
    return TestClient(app)


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_one_line_per_request_with_its_tokens(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    with _client(access_log=True) as client:
        r = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "SAY:hello"}]})
        usage = r.json()["usage"]
        client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "SAY:hi"}], "stream": True, "n": 2})
        client.post("/v1/completions", json={"prompt": "SAY:x", "max_tokens": 2})
        client.post("/v1/responses", json={"input": "SAY:ok", "max_output_tokens": 8})
        client.post("/v1/chat/completions", json={"messages": [], "model": MODEL})
        client.get("/health")
        client.get("/v1/models")
    lines = _lines(caplog)
    assert len(lines) == 6, lines  # /health only at DEBUG
    first, stream, comp, resp, bad, models = lines
    assert re.fullmatch(
        r'\S+ "POST /v1/chat/completions" 200 prompt_tokens=(\d+) completion_tokens=(\d+) '
        r'\d+\.\d{3}s', first), first
    assert f"prompt_tokens={usage['prompt_tokens']} " in first
    assert f"completion_tokens={usage['completion_tokens']} " in first
    # n = 2: the prompt counted once, both choices' tokens ("hi" + EOS each)
    assert '"POST /v1/chat/completions" 200 stream prompt_tokens=' in stream
    assert "completion_tokens=6 " in stream
    assert '"POST /v1/completions" 200 ' in comp and "completion_tokens=2 " in comp
    assert '"POST /v1/responses" 200 ' in resp and "completion_tokens=3 " in resp
    assert '"POST /v1/chat/completions" 400 ' in bad and "tokens" not in bad
    assert '"GET /v1/models" 200 ' in models


def test_quiet_paths_at_debug_and_nothing_when_off(caplog):
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with _client(access_log=True) as client:
        client.get("/health")
    assert any('"GET /health" 200' in line for line in _lines(caplog))
    caplog.clear()
    with _client(access_log=False) as client:
        client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "SAY:hello"}]})
        client.get("/health")
    assert not _lines(caplog)
