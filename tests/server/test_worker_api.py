"""What a gateway reads from a worker (server/worker_api.py), on the real nano engine: the
pool gauges on /metrics, SGLang's /v1/loads, the prefix-cache flush and the deep probe. The
session's shared nano server (nano_server.py): a few seconds."""

from __future__ import annotations

import re

import httpx
import pytest
from nano_server import MODEL, nano_server, nano_servers  # noqa: F401

from tailored.server.worker_api import load_snapshot

SYSTEM = "You are a careful assistant who answers in one short sentence. " * 8  # 100+ tokens


@pytest.fixture(scope="module")
def url(nano_servers):  # noqa: F811 - the imported fixture
    return nano_server().url


def gauge(text: str, name: str) -> float:
    return float(re.search(rf"^tailored:{name}{{[^}}]*}} (\S+)$", text, re.M).group(1))


def test_pool_gauges_loads_flush_and_deep_probe(url):
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello"}]
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": msgs, "max_tokens": 4, "temperature": 0,
        "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text
    m = httpx.get(url + "/metrics").text
    total, used = gauge(m, "kv_cache_pages_total"), gauge(m, "kv_cache_pages_used")
    assert total > 0 and gauge(m, "prefix_cache_entries") >= 1  # the system prompt's entry
    assert gauge(m, "prefix_cache_entries_max") == 16
    # idle: every used page is the prefix cache's alone, so the usage (vLLM's gauge) is 0
    assert used > 0 and gauge(m, "kv_cache_pages_cached") == used
    assert gauge(m, "kv_cache_usage_perc") == 0.0
    assert gauge(m, "gdn_state_slots_used") == 0 and gauge(m, "gdn_state_slots_total") >= 4
    loads = httpx.get(url + "/v1/loads", params={"include": "core,queues"}).json()
    assert loads["dp_rank_count"] == 1 and loads["timestamp"]
    [rank] = loads["loads"]
    assert rank["max_total_num_tokens"] == total * 16 and rank["num_used_tokens"] == 0
    assert rank["num_running_reqs"] == 0 and rank["max_running_requests"] == 4
    # SMG's POST /flush_cache fans out to this; vLLM's name does the same
    r = httpx.post(url + "/flush_cache")
    assert r.status_code == 200 and r.json()["flushed_entries"] >= 1
    assert httpx.post(url + "/reset_prefix_cache").json()["flushed_entries"] == 0
    m = httpx.get(url + "/metrics").text
    assert gauge(m, "prefix_cache_entries") == 0 and gauge(m, "kv_cache_pages_used") == 0
    probe = httpx.get(url + "/health_generate", timeout=60).json()
    assert probe["status"] == "ok" and probe["tokens"] == 1


def test_load_snapshot_counts_only_the_pages_requests_hold():
    stats = {"running": 3, "waiting": 2, "total_pages": 100, "used_pages": 60,
             "cached_pages": 20, "page_size": 16, "max_running": 8,
             "prefix_cache_queries": 1000, "prefix_cache_hits": 250}
    snap = load_snapshot(stats)
    assert snap["num_used_tokens"] == 40 * 16 and snap["max_total_num_tokens"] == 1600
    assert snap["token_usage"] == 0.4 and snap["cache_hit_rate"] == 0.25
    assert snap["num_total_reqs"] == 5 and snap["utilization"] == 3 / 8
    assert load_snapshot({"running": 1})["token_usage"] == 0.0  # an engine without pools
