"""GET /metrics (server/metrics.py) over test_server's fake engine and tokenizer: the text
parses, and completions, streams, bad requests, engine errors, aborts and a dead engine move
the right series by the right amounts."""

from __future__ import annotations

import json

import httpx
import pytest
from fastapi.testclient import TestClient
from live_server import LiveServer
from test_server import (
    MAX_LEN,
    MODEL,
    FakeTokenizer,
    chat,
    completion,
    make_app,
    sse_events,
    wait_for,
)

from tailored.server.app import build_app
from tailored.server.engine_process import EngineProcess

parser = pytest.importorskip("prometheus_client.parser")

REASONS = ("stop", "length", "abort", "error")


# the Prometheus text format: version 0.0.4, which prometheus-client >= 0.26 labels 1.0.0
# (its CONTENT_TYPE_LATEST; the same text for our ASCII metric names)
TEXT_FORMAT = ("text/plain; version=0.0.4", "text/plain; version=1.0.0")


@pytest.fixture
def client():
    """A TestClient of test_server's app over a FakeEngine (the lifespan runs the engine)."""
    app, _, _, _ = make_app()
    with TestClient(app) as c:
        yield c


def scrape(client) -> dict:
    """{(sample name, frozenset of labels other than model_name): value} of GET /metrics."""
    r = client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith(TEXT_FORMAT)
    samples = {}
    for family in parser.text_string_to_metric_families(r.text):
        for s in family.samples:
            assert s.labels.pop("model_name") == MODEL
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def success(samples: dict) -> dict:
    return {r: value(samples, "tailored:request_success_total", finished_reason=r)
            for r in REASONS}


def http(samples: dict, handler: str, status: int) -> float:
    return value(samples, "tailored:http_requests_total", handler=handler, status=str(status))


def test_counts_after_a_completion_a_streamed_chat_and_a_bad_request(client):
    m0 = scrape(client)
    assert value(m0, "tailored:engine_healthy") == 1.0
    assert success(m0) == dict.fromkeys(REASONS, 0.0)
    for name in ("tailored:prompt_tokens_total", "tailored:generation_tokens_total",
                 "tailored:num_requests_running", "tailored:num_requests_waiting",
                 "tailored:num_preemptions_total", "tailored:time_to_first_token_seconds_count"):
        assert (name, frozenset()) in m0, name

    # a completion that ends on EOS: "hello" + EOS = 6 tokens, one a step
    r = completion(client, prompt="SAY:hello")
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "stop"
    u1 = r.json()["usage"]
    assert u1["completion_tokens"] == 6
    # a streamed chat cut by max_tokens
    r = chat(client, "SAY:hello", stream=True, max_tokens=3,
             stream_options={"include_usage": True})
    events = sse_events(r.text)
    assert events[-1] == "DONE" and events[-3]["choices"][0]["finish_reason"] == "length"
    u2 = events[-2]["usage"]
    assert u2["completion_tokens"] == 3
    # a bad request: never reaches the engine
    r = completion(client, prompt="SAY:x", temperature=-1)
    assert r.status_code == 400

    m = scrape(client)
    assert value(m, "tailored:prompt_tokens_total") == u1["prompt_tokens"] + u2["prompt_tokens"]
    assert value(m, "tailored:generation_tokens_total") == 6 + 3
    assert success(m) == {"stop": 1.0, "length": 1.0, "abort": 0.0, "error": 0.0}
    assert value(m, "tailored:time_to_first_token_seconds_count") == 2
    assert value(m, "tailored:e2e_request_latency_seconds_count") == 2
    # one gap between two consecutive outputs (here: tokens) of each request
    assert value(m, "tailored:inter_token_latency_seconds_count") == (6 - 1) + (3 - 1)
    assert value(m, "tailored:inter_token_latency_seconds_bucket", le="+Inf") == 7
    assert value(m, "tailored:e2e_request_latency_seconds_sum") > 0
    assert http(m, "/v1/completions", 200) == 1
    assert http(m, "/v1/chat/completions", 200) == 1
    assert http(m, "/v1/completions", 400) == 1
    assert value(m, "tailored:num_requests_running") == 0
    assert value(m, "tailored:engine_healthy") == 1.0

    r = client.head("/metrics")
    assert r.status_code == 200 and not r.content
    assert r.headers["content-type"].startswith(TEXT_FORMAT)


def test_engine_errors_count_as_error(client):
    assert completion(client, prompt="SAY:FAIL").status_code == 500
    events = sse_events(chat(client, "SAY:FAIL", stream=True).text)
    assert "error" in events[-2]
    assert completion(client, prompt="REJECT").status_code == 400  # the engine's add refused it
    m = scrape(client)
    assert success(m) == {"stop": 0.0, "length": 0.0, "abort": 0.0, "error": 2.0}
    assert value(m, "tailored:generation_tokens_total") == 0
    assert value(m, "tailored:prompt_tokens_total") == 0  # no first token: prefill not counted
    assert http(m, "/v1/completions", 500) == 1 and http(m, "/v1/completions", 400) == 1
    assert http(m, "/v1/chat/completions", 200) == 1  # the stream had started


def test_engine_healthy_goes_0_when_the_engine_dies():
    app, aengine, _, _ = make_app(delay_s=0.01)
    with TestClient(app) as client:
        assert value(scrape(client), "tailored:engine_healthy") == 1.0
        assert completion(client, prompt="SAY:CRASH").status_code == 500
        assert completion(client, prompt="SAY:a").status_code == 503
        m = scrape(client)
        assert not aengine.healthy
        assert value(m, "tailored:engine_healthy") == 0.0
        assert value(m, "tailored:num_requests_running") == 0
        assert success(m)["error"] == 1
        assert http(m, "/v1/completions", 503) == 1
    # before the lifespan started the engine, and after it stopped it
    app, _, _, _ = make_app()
    assert value(scrape(TestClient(app)), "tailored:engine_healthy") == 0.0


def test_apps_in_one_process_count_apart():
    app1, _, _, _ = make_app()
    app2, _, _, _ = make_app()
    with TestClient(app1) as c1, TestClient(app2) as c2:
        assert completion(c1, prompt="SAY:one").status_code == 200
        assert success(scrape(c1))["stop"] == 1
        assert success(scrape(c2))["stop"] == 0


def test_a_failing_metric_does_not_fail_the_request(client, caplog):
    metrics = client.app.state.server.metrics

    class Broken:
        def inc(self, *a):
            raise RuntimeError("metric broke")

        observe = labels = inc

    metrics.generation_tokens = Broken()
    metrics.request_success = {"error": Broken()}
    metrics.http_requests = Broken()
    r = completion(client, prompt="SAY:fine")
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "fine"
    events = sse_events(chat(client, "SAY:ok", stream=True).text)
    assert events[-1] == "DONE" and "error" not in events[-2]
    assert "metric broke" in caplog.text
    assert client.get("/metrics").status_code == 200


def test_running_gauge_and_abort_on_a_live_server():
    app, _, engine, _ = make_app(delay_s=0.005, disconnect_poll_s=0.02)
    body = {"model": MODEL, "prompt": "SAY:abc", "ignore_eos": True, "max_tokens": 400,
            "stream": True}
    with LiveServer(app) as live, httpx.Client(base_url=live.url) as client:
        with client.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            rid = json.loads(next(line for line in lines if line.startswith("data: "))[6:])["id"]
            m = scrape(client)
            assert value(m, "tailored:num_requests_running") == 1  # FakeEngine.stats
            assert value(m, "tailored:prompt_tokens_total") == len("SAY:abc")
        assert wait_for(lambda: rid in engine.aborted)
        assert wait_for(lambda: success(scrape(client))["abort"] == 1)
        m = scrape(client)
        assert value(m, "tailored:e2e_request_latency_seconds_count") == 1
        assert value(m, "tailored:generation_tokens_total") >= 1
        assert value(m, "tailored:num_requests_running") == 0


def fake_engine():
    """The child's build (spawn imports this module by name)."""
    from test_server import FakeEngine

    return FakeEngine(0.001)


def test_metrics_over_the_engine_process():
    ep = EngineProcess(fake_engine, ready_timeout_s=120)
    app = build_app(ep, FakeTokenizer(), MODEL, MAX_LEN)
    with TestClient(app) as client:
        assert completion(client, prompt="SAY:hi").status_code == 200
        m = scrape(client)
        assert value(m, "tailored:engine_healthy") == 1.0
        assert success(m)["stop"] == 1 and value(m, "tailored:generation_tokens_total") == 3
    assert value(scrape(TestClient(app)), "tailored:engine_healthy") == 0.0
