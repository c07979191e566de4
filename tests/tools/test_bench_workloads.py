"""`tailored bench` workloads: Poisson arrivals, goodput under an SLO, the agent mix (against a
fake endpoint that checks turn order, and the real app), the committed chat mix, long random
prompts."""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import httpx
import pytest
from live_server import LiveServer

from tailored.bench import agentmix, arrivals, loadgen, workloads
from tailored.bench.cli import main as bench_main
from tailored.bench.goodput import SLO, goodput
from tailored.bench.loadgen import RequestResult, Workload

MODEL = "qwen36-35b-a3b"


# ---- arrivals ----------------------------------------------------------------------------
def test_poisson_arrivals_have_the_rate_and_follow_the_seed():
    rate = 4.0
    t = arrivals.poisson_offsets(20_000, rate, seed=3)
    gaps = [b - a for a, b in zip(t, t[1:])]
    assert t[0] == 0.0 and all(g >= 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(1 / rate, rel=0.03)
    # exponential gaps: standard deviation = mean (a fixed pace would have 0)
    assert statistics.pstdev(gaps) == pytest.approx(1 / rate, rel=0.05)
    assert arrivals.poisson_offsets(50, rate, seed=3) == t[:50]
    assert arrivals.poisson_offsets(50, rate, seed=4) != t[:50]
    assert arrivals.poisson_offsets(5, float("inf"), seed=3) == [0.0] * 5
    assert arrivals.parse_rates("1, 2.5,inf") == [1.0, 2.5, float("inf")]
    for bad in ("0", "-1", ""):
        with pytest.raises(ValueError):
            arrivals.parse_rates(bad)


def test_paced_sender_keeps_the_schedule_and_the_cap():
    starts, in_flight, peak = {}, [0], [0]

    async def send(i):
        starts[i] = time.perf_counter() - t0
        in_flight[0] += 1
        peak[0] = max(peak[0], in_flight[0])
        await asyncio.sleep(0.05)
        in_flight[0] -= 1
        return i * 10

    offsets = [0.0, 0.0, 0.0, 0.12, 0.13]
    t0 = time.perf_counter()
    out = asyncio.run(arrivals.run_paced(send, offsets, max_in_flight=2, t0=t0))
    assert out == [0, 10, 20, 30, 40] and peak[0] == 2
    assert all(starts[i] >= offsets[i] - 1e-3 for i in range(5))
    assert starts[2] >= 0.045  # the third waited for a slot


# ---- goodput ------------------------------------------------------------------------------
def _req(ttft, tpot, n=11, ok=True):
    e2e = None if ttft is None else ttft + tpot * (n - 1)
    return RequestResult(ok=ok, error=None if ok else "HTTP 500", ttft_s=ttft, e2e_s=e2e,
                         usage_output_tokens=n, max_tokens=n)


def test_goodput_counts_only_the_requests_within_their_slo():
    rs = [
        _req(0.5, 0.05),            # good
        _req(0.9, 0.099, n=21),     # good
        _req(1.2, 0.01),            # TTFT over 1 s
        _req(0.1, 0.2),             # TPOT over 100 ms
        _req(0.2, 0.01, ok=False),  # failed
        _req(0.3, 0.5, n=1),        # one token: no TPOT, TTFT within: good
        RequestResult(ok=True, usage_output_tokens=3, max_tokens=3),  # no TTFT known
    ]
    slo = SLO(ttft_ms=1000, itl_ms=100)
    assert [slo.meets(r) for r in rs] == [True, True, False, False, False, True, False]
    g = goodput(rs, 2.0, slo, {"p99_ttft_ms": 900.0, "p99_itl_ms": 120.0})
    assert g["good_requests"] == 3
    assert g["request_goodput"] == pytest.approx(1.5)
    assert g["output_goodput"] == pytest.approx((11 + 21 + 1) / 2.0)
    assert g["slo_p99_met"] is False  # the pooled ITL p99 is over 100 ms
    assert goodput(rs, 2.0, SLO(2000, 300), {"p99_ttft_ms": 900.0, "p99_itl_ms": 120.0})[
        "slo_p99_met"] is True
    assert goodput(rs, 2.0, SLO(2000, 300))["good_requests"] == 5


# ---- the chat mix -------------------------------------------------------------------------
def test_chat_mix_file_loads_with_the_length_spread_it_claims():
    items = loadgen.load_prompt_files([str(workloads.CHAT_MIX)])
    assert len(items) == 100 and workloads.CHAT_MIX.stat().st_size < 400_000
    ins = [x["input_tokens"] for x in items]
    outs = [x["max_tokens"] for x in items]
    # inputs ~100..4,000 tokens, outputs 50..1,000, long-tailed (mean above median)
    assert 90 <= min(ins) <= 130 and 3500 <= max(ins) <= 4020
    assert 350 <= statistics.median(ins) <= 550 < statistics.mean(ins)
    assert min(outs) == 50 and max(outs) == 1000
    assert 185 <= statistics.median(outs) <= 215 < statistics.mean(outs)
    assert sum(len(x["messages"]) > 1 for x in items) >= 10  # some carry an earlier exchange
    # the counts are the Qwen3.6 tokens of the rendered chat
    from tailored.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    for x in items[:5]:
        assert len(tok.encode(tok.apply_chat_template(x["messages"]))) == x["input_tokens"]
    w = Workload(base_url="http://x", prompt_files=(str(workloads.CHAT_MIX),))
    reqs = loadgen.prepare_requests(w, MODEL, 3, 0)
    assert [r.endpoint for r in reqs] == ["chat"] * 3
    assert [r.max_tokens for r in reqs] == outs[:3]


# ---- long random prompts --------------------------------------------------------------
def test_long_random_prompts_build_in_linear_time():
    w = Workload(base_url="http://x", output_len=1)
    times = {}
    for n in (16_384, 65_536, 120_000):
        w.input_len = n
        t = time.perf_counter()
        reqs = loadgen.prepare_requests(w, MODEL, 2, 0)
        times[n] = time.perf_counter() - t
        assert [len(r.body["prompt"]) for r in reqs] == [n, n] and reqs[0].prompt_len == n
    assert times[120_000] < 2.0


def test_random_text_prompts_have_the_exact_qwen_token_count():
    from tailored.bench.randtext import random_text_prompts
    from tailored.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    texts = random_text_prompts(2, 1000, seed=1)
    assert texts == random_text_prompts(2, 1000, seed=1) and texts[0] != texts[1]
    assert [len(tok.encode(t)) for t in texts] == [1000, 1000]
    w = Workload(base_url="http://x", input_len=300, output_len=2, random_text=True)
    r = loadgen.prepare_requests(w, MODEL, 1, 0)[0]
    assert isinstance(r.body["prompt"], str) and r.prompt_len == 300
    assert len(tok.encode(r.body["prompt"])) == 300
    assert w.describe()["dataset"] == "random-text"


# ---- the agent mix against a fake endpoint -------------------------------------------
def test_agent_mix_sends_turns_in_order_each_extending_the_last(monkeypatch):
    mix = agentmix.AgentMix(system_prompts=2, conversations=4, turns=4, system_tokens=60,
                            tool_tokens=20, max_tokens=4)
    seen: list[tuple[int, list]] = []
    open_turns: dict[int, int] = {}

    def conv_of(body):
        return int(body["messages"][1]["content"].split(":")[0].removeprefix("Task "))

    async def handler(request: httpx.Request):
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": MODEL}]})
        body = json.loads(request.content)
        j = conv_of(body)
        assert open_turns.get(j, 0) == 0, "a turn was sent before the previous one ended"
        open_turns[j] = 1
        seen.append((j, body["messages"]))
        n = len(body["messages"])

        async def stream():
            for piece in (f"answer {j}", f" after {n} messages"):
                await asyncio.sleep(0.005)
                yield b"data: " + json.dumps(
                    {"choices": [{"index": 0, "delta": {"content": piece}}]}).encode() + b"\n\n"
            yield b"data: " + json.dumps({"choices": [{"index": 0, "delta": {},
                                                       "finish_reason": "length"}]}).encode()
            yield b"\n\ndata: " + json.dumps({"choices": [], "usage": {
                "prompt_tokens": 100 * n, "completion_tokens": 2,
                "prompt_tokens_details": {"cached_tokens": 10 * n}}}).encode()
            open_turns[j] = 0  # the answer ends with the next chunk
            yield b"\n\ndata: [DONE]\n\n"

        return httpx.Response(200, content=stream())

    monkeypatch.setattr(loadgen, "make_client", lambda c, t: httpx.AsyncClient(
        transport=httpx.MockTransport(handler)))
    w = Workload(base_url="http://fake", concurrency=0, num_warmups=0)
    run = asyncio.run(agentmix.run_agent_mix(w, mix, keep_requests=True))
    assert (run["completed"], run["failed"]) == (16, 0)
    systems = {}
    for j in range(4):
        turns = [m for c, m in seen if c == j]
        assert len(turns) == 4
        for a, b in zip(turns, turns[1:]):
            assert b[:len(a)] == a and len(b) == len(a) + 2  # resent whole, then 2 new
            assert b[len(a)]["role"] == "assistant"
            assert b[len(a)]["content"] == f"answer {j} after {len(a)} messages"
        assert [m["role"] for m in turns[-1][-2:]] == ["assistant", "user"]  # every 3rd turn
        assert turns[1][-1]["role"] == "tool"
        systems[j] = turns[0][0]["content"]
    assert systems[0] == systems[2] != systems[1] == systems[3]
    # all conversations ran at once: their first turns came before any 4th turn
    order = [c for c, _ in seen]
    assert set(order[:4]) == {0, 1, 2, 3}
    a = run["agent"]
    assert [t["turn"] for t in a["per_turn"]] == [1, 2, 3, 4]
    assert a["prompt_tokens"] == sum(100 * len(m) for _, m in seen)
    assert a["cached_tokens"] == sum(10 * len(m) for _, m in seen)
    assert a["cached_fraction"] == pytest.approx(0.1) and a["cached_tokens_reported"]
    assert sorted((r["conversation"], r["turn"]) for r in run["requests"]) == [
        (j, t) for j in range(4) for t in range(1, 5)]
    assert agentmix.build(mix)[0].messages == agentmix.build(mix)[0].messages  # deterministic


# ---- live: the real app serving the embedded nano model ---------------------------------
@pytest.fixture(scope="module")
def live():
    from tailored.server.app import build_app
    from tailored.server.async_engine import AsyncEngine
    from tailored.stack import build_stack

    stack = build_stack(None, max_model_len=8192, max_num_seqs=8, progress=False,
                        prefix_cache_entries=16)
    app = build_app(AsyncEngine(stack.engine), stack.tokenizer, MODEL, 8192)
    with LiveServer(app, start_timeout=30) as srv:
        yield srv.url


def test_live_chat_mix_at_poisson_rates_and_the_agent_mix(live, tmp_path):
    out = tmp_path / "chat.json"
    rc = bench_main(["--base-url", live, "--workload", "chat-mix", "--request-rate", "8,inf",
                     "--num-prompts", "3", "--output-len", "3", "--seed", "5", "--no-uvloop",
                     "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["workload"]["workload"] == "chat-mix" and res["workload"]["arrivals"] == "poisson"
    assert res["workload"]["request_rate"] == [8.0, "inf"] and res["workload"]["seed"] == 5
    assert [r["request_rate"] for r in res["runs"]] == [8.0, "inf"]
    for r in res["runs"]:
        assert r["completed"] == 3 and 0 <= r["good_requests"] <= 3
        assert r["slo"]["ttft_ms"] == 1000.0 and "request_goodput" in r
    out = tmp_path / "agent.json"
    rc = bench_main(["--base-url", live, "--workload", "agent-mix", "--agent-system-prompts",
                     "1", "--agent-conversations", "2", "--agent-turns", "3",
                     "--agent-system-tokens", "300", "--agent-tool-tokens", "30",
                     "--output-len", "3", "--no-uvloop", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["workload"]["workload"] == "agent-mix"
    assert res["workload"]["system_prompts"] == 1 and res["workload"]["turns"] == 3
    run = res["runs"][0]
    assert run["completed"] == 6
    a = run["agent"]
    assert a["per_turn"][1]["cached_tokens"] > 0  # turn 2 resends turn 1: the prefix cache hits
    assert 0 < a["cached_tokens"] < a["prompt_tokens"]


def test_bench_against_a_server_that_is_down_says_so_in_one_line(capsys):
    """The random workload asks GET /v1/models first: a refused connection is an error
    line naming the URL, not a traceback."""
    from tailored.cli import main

    rc = main(["bench", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1",
               "--input-len", "4", "--output-len", "1", "--num-warmups", "0"])
    err = capsys.readouterr().err
    assert rc == 2 and "http://127.0.0.1:9/v1/models failed" in err and "Traceback" not in err


@pytest.mark.parametrize("flag,value", [("--slo-ttft-ms", "-5"), ("--slo-itl-ms", "nan"),
                                        ("--slo-itl-ms", "0"), ("--slo-ttft-ms", "inf")])
def test_an_slo_bound_must_be_a_positive_finite_number(flag, value, capsys):
    from tailored.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", flag, value])
    assert e.value.code == 2 and flag in capsys.readouterr().err
