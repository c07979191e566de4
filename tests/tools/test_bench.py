"""`tailored bench`: statistics, roofline vs spec §11, result files and compare table, and live
runs of the load generator against the real app serving the embedded tiny model."""

from __future__ import annotations

import json
import random

import pytest
from live_server import LiveServer

from tailored.bench import loadgen, results, roofline, sidebyside
from tailored.bench.cli import main as bench_main
from tailored.bench.loadgen import RequestResult, Workload

MODEL = "qwen36-35b-a3b"


# ---- statistics --------------------------------------------------------------------------
def test_percentile_matches_numpy_linear():
    np = pytest.importorskip("numpy")
    rng = random.Random(1)
    for n in (1, 2, 3, 10, 101):
        xs = [rng.uniform(0, 100) for _ in range(n)]
        for q in (0, 1, 50, 90, 99, 100):
            assert loadgen.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert loadgen.percentile([], 50) != loadgen.percentile([], 50)  # NaN


def test_describe_reports_ms_under_vllm_keys():
    d = loadgen.describe([0.010, 0.020, 0.030, 0.040], "ttft")
    assert d["mean_ttft_ms"] == pytest.approx(25.0)
    assert d["median_ttft_ms"] == d["p50_ttft_ms"] == pytest.approx(25.0)
    assert d["p90_ttft_ms"] == pytest.approx(37.0)
    assert d["p99_ttft_ms"] == pytest.approx(39.7)
    assert d["std_ttft_ms"] == pytest.approx(11.1803398875)


def test_tpot_and_run_summary_on_synthetic_timings():
    assert loadgen.tpot_s(1.1, 0.1, 11) == pytest.approx(0.1)
    assert loadgen.tpot_s(1.0, 0.2, 1) is None

    def req(ttft, e2e, n, usage=True):
        gaps = [(e2e - ttft) / (n - 1)] * (n - 1)
        return RequestResult(
            ok=True,
            ttft_s=ttft,
            e2e_s=e2e,
            itl_s=gaps,
            text_chunks=n,
            usage_output_tokens=n if usage else None,
            prompt_tokens=100,
            max_tokens=n,
        )

    rs = [
        req(0.1, 1.1, 11),
        req(0.2, 2.2, 21, usage=False),
        req(0.3, 0.3 + 9 * 0.05, 10),
        RequestResult(ok=False, error="HTTP 500: boom", max_tokens=10),
    ]
    s = loadgen.summarize(rs, duration_s=4.0, concurrency=2)
    assert (s["completed"], s["failed"], s["num_prompts"]) == (3, 1, 4)
    assert s["total_output_tokens"] == 11 + 21 + 10
    assert s["total_input_tokens"] == 300
    assert s["output_throughput"] == pytest.approx(42 / 4.0)
    assert s["request_throughput"] == pytest.approx(3 / 4.0)
    assert s["p50_ttft_ms"] == pytest.approx(200.0)
    # TPOT per request: 100 ms, 100 ms, 50 ms
    assert s["mean_tpot_ms"] == pytest.approx(250 / 3)
    assert s["p50_tpot_ms"] == pytest.approx(100.0)
    # ITL is flattened over requests: 10 + 20 gaps of 100 ms and 9 of 50 ms
    assert s["mean_itl_ms"] == pytest.approx((30 * 100 + 9 * 50) / 39)
    assert s["p50_e2el_ms"] == pytest.approx(1100.0)
    assert not s["output_tokens_from_usage"]  # one request fell back to counting chunks
    assert s["errors"] == [{"error": "HTTP 500: boom", "count": 1}]
    assert s["short_outputs"] == 0


def test_random_prompts_exact_length_deterministic_and_regular_ids():
    a = loadgen.random_token_prompts(3, 1024, seed=7)
    assert a == loadgen.random_token_prompts(3, 1024, seed=7)
    assert a != loadgen.random_token_prompts(3, 1024, seed=8)
    assert all(len(p) == 1024 for p in a)
    assert all(0 <= t < 248044 for p in a for t in p)
    w = Workload(base_url="http://x/v1", input_len=32, output_len=8, ignore_eos=True)
    reqs = loadgen.prepare_requests(w, MODEL, 2, 0)
    b = reqs[0].body
    assert reqs[0].endpoint == "completions" and reqs[0].prompt_len == 32
    assert b["max_tokens"] == 8 and b["temperature"] == 0.0 and b["ignore_eos"] is True
    assert b["stream"] is True and b["stream_options"] == {"include_usage": True}
    w2 = Workload(base_url="http://x", input_len=4)
    assert "ignore_eos" not in loadgen.prepare_requests(w2, MODEL, 1, 0)[0].body
    assert loadgen.prepare_requests(w2, MODEL, 1, 0)[0].max_tokens == 512
    assert loadgen.api_root("http://h:1/v1/") == loadgen.api_root("http://h:1") == "http://h:1"


# ---- roofline ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def full_cfg():
    return roofline.preset_model_config("full")


def test_roofline_bf16_batch1_matches_spec_11(full_cfg):
    c = roofline.step_cost(full_cfg, "bf16", batch=1, ctx_len=0)
    assert c.distinct_experts_per_layer == pytest.approx(8.0)
    assert c.dense_weight_bytes + c.routed_expert_bytes == pytest.approx(4.88e9, rel=5e-3)
    assert c.lm_head_bytes == pytest.approx(1.017e9, rel=2e-3)
    assert c.weight_bytes == pytest.approx(5.89e9, rel=3e-3)  # spec §11.3
    # bf16 recurrent states (the served default since kb/0056): 2 x 30 MiB + conv; fp32: 2 x 60
    assert c.gdn_state_bytes == pytest.approx(63e6 + 2.9e6, rel=0.01)
    c32 = roofline.step_cost(full_cfg, "bf16", batch=1, ctx_len=0, state_bytes_per_elem=4)
    assert c32.gdn_state_bytes == pytest.approx(126e6 + 2.9e6, rel=0.01)
    assert c.matmul_flops == pytest.approx(5.89e9, rel=3e-3)  # spec §11.2
    assert c.other_flops == pytest.approx(0.112e9, rel=0.03)
    assert c.weights_time_s(4.1e12) * 1e3 == pytest.approx(1.43, abs=0.01)  # issue 3


def test_roofline_fp8_and_batch_scaling(full_cfg):
    f = roofline.step_cost(full_cfg, "fp8", batch=1)
    assert f.weight_bytes == pytest.approx(3.48e9, rel=3e-3)
    assert f.weights_time_s(4.1e12) * 1e3 == pytest.approx(0.85, abs=0.01)
    # KV: 20 KiB per context token in bf16 (spec §6.6), read ctx + write 1
    k = roofline.step_cost(full_cfg, "bf16", batch=2, ctx_len=1000)
    assert k.kv_bytes == pytest.approx(2 * 20480 * 1001)
    # experts touched grow as E(1-(1-k/E)^B); dense weights stay
    b32 = roofline.step_cost(full_cfg, "bf16", batch=32)
    assert b32.distinct_experts_per_layer == pytest.approx(256 * (1 - (1 - 8 / 256) ** 32))
    assert b32.dense_weight_bytes == pytest.approx(k.dense_weight_bytes)
    assert b32.gdn_state_bytes == pytest.approx(32 * f.gdn_state_bytes)
    assert roofline.expected_distinct_experts(256, 8, 10_000) == pytest.approx(256)
    with pytest.raises(ValueError):
        roofline.step_cost(full_cfg, "int4")


def test_roofline_fraction_of_the_vllm_baseline(full_cfg):
    # vLLM c=1 BF16 decode step 4.25 ms, FP8 4.05 ms: 34% and 21% of the limit (issue 3)
    bf = roofline.roofline_fraction(full_cfg, "bf16", tpot_ms=4.25, hbm_bw=4.1e12)
    fp = roofline.roofline_fraction(full_cfg, "fp8", tpot_ms=4.05, hbm_bw=4.1e12)
    assert bf["weights_only_fraction"] == pytest.approx(0.338, abs=0.003)
    assert fp["weights_only_fraction"] == pytest.approx(0.21, abs=0.003)
    assert bf["fraction"] > bf["weights_only_fraction"]  # state bytes count too
    r = roofline.roofline_fraction(full_cfg, "bf16", tokens_per_s=500.0)
    assert r["measured_step_ms"] == pytest.approx(2.0)
    with pytest.raises(ValueError):
        roofline.roofline_fraction(full_cfg, "bf16")


def test_roofline_cli_json(capsys):
    assert (
        bench_main(
            [
                "roofline",
                "--preset",
                "full",
                "--precision",
                "bf16",
                "--batch",
                "1",
                "--hbm-bw",
                "4.1e12",
                "--json",
            ]
        )
        == 0
    )
    d = json.loads(capsys.readouterr().out)
    assert d["weights_only_ms"] == pytest.approx(1.437, abs=0.005)


# ---- result files and compare ------------------------------------------------------------
def _fake_result(tmp_path, name, runs):
    r = results.make_result(
        name, {"date": "2026-11-29T00:00:00+00:00"}, {"input_len": 1024, "output_len": 512}, runs
    )
    return results.write_result(tmp_path / f"{name}.json", r)


def _run(c, tok_s, ttft, tpot):
    return {
        "max_concurrency": c,
        "output_throughput": tok_s,
        "request_throughput": tok_s / 512,
        "p50_ttft_ms": ttft,
        "mean_ttft_ms": ttft,
        "p50_tpot_ms": tpot,
        "mean_tpot_ms": tpot,
    }


def test_compare_ratios_tailored_and_vllm_files(tmp_path):
    a = _fake_result(tmp_path, "a", [_run(1, 440.0, 70.0, 2.0), _run(32, 3400.0, 300.0, 9.0)])
    # raw `vllm bench serve` JSON (the baseline kit's format)
    v = tmp_path / "vllm.json"
    v.write_text(json.dumps({**_run(1, 220.0, 168.0, 4.0), "backend": "vllm", "label": "c1"}))
    rows = {(r["concurrency"], r["key"]): r for r in results.compare(a, v)}
    assert {c for c, _ in rows} == {1}  # c=32 is not in the vLLM file
    assert rows[(1, "output_throughput")]["ratio"] == pytest.approx(2.0)
    assert rows[(1, "output_throughput")]["a_better"] is True
    assert rows[(1, "p50_ttft_ms")]["ratio"] == pytest.approx(70 / 168)
    assert rows[(1, "p50_ttft_ms")]["a_better"] is True
    text = results.format_compare(a, v)
    assert "2.000" in text and "TTFT p50" in text
    b = _fake_result(tmp_path, "b", [_run(1, 400.0, 70.0, 2.5), _run(32, 1700.0, 600.0, 9.0)])
    rows = {(r["concurrency"], r["key"]): r for r in results.compare(a, b)}
    assert rows[(32, "output_throughput")]["ratio"] == pytest.approx(2.0)
    assert rows[(32, "p50_tpot_ms")]["ratio"] == pytest.approx(1.0)
    assert rows[(32, "p50_tpot_ms")]["a_better"] is None  # a tie
    assert rows[(1, "p50_tpot_ms")]["a_better"] is True and rows[(1, "p50_tpot_ms")]["ratio"] == 0.8
    with pytest.raises(ValueError):
        bad = tmp_path / "bad.json"
        bad.write_text("{}")
        results.load_runs(bad)


def test_side_by_side_summary_latest_json(tmp_path, capsys):
    d = tmp_path / "sbs"
    d.mkdir()
    for prec, (t1, v1, t32, v32) in {
        "bf16": (440.0, 219.0, 3400.0, 1956.0),
        "fp8": (400.0, 227.0, 4500.0, 2585.0),
    }.items():
        _fake_result(d, f"tailored-{prec}", [_run(1, t1, 60.0, 2.0), _run(32, t32, 400.0, 9.0)])
        _fake_result(d, f"vllm-{prec}", [_run(1, v1, 168.0, 4.25), _run(32, v32, 543.0, 15.3)])
    latest = tmp_path / "latest.json"
    assert sidebyside.main([str(d), "--latest", str(latest), "--hbm-bw", "4.1e12"]) == 0
    s = json.loads(latest.read_text())
    b = s["bf16"]
    assert b["c1_output_tok_s"] == {
        **b["c1_output_tok_s"],
        "tailored": 440.0,
        "vllm": 219.0,
        "target_met": True,
    }
    assert b["c1_output_tok_s"]["ratio"] == pytest.approx(440 / 219)
    assert b["ttft_p50_ms"]["ratio"] == pytest.approx(60 / 168)
    assert b["ttft_p50_ms"]["target_met"] is True
    assert s["fp8"]["c1_output_tok_s"]["target_met"] is False  # 400 < 430
    assert b["roofline_fraction_c1"]["vllm"] == pytest.approx(1.475 / 4.25, abs=0.01)
    assert "manifest" in s and (d / "compare-bf16.txt").is_file()
    assert "NOT met" in capsys.readouterr().out


# ---- live runs against the real app (embedded tiny model) --------------------------------

@pytest.fixture(scope="module")
def live():
    from tailored.server.app import build_app
    from tailored.server.async_engine import AsyncEngine
    from tailored.stack import build_stack

    # prefix caching on: the soak's prompts that extend others hit it (failure-cases §3)
    stack = build_stack(None, max_model_len=512, max_num_seqs=8, progress=False,
                        prefix_cache_entries=4)
    app = build_app(AsyncEngine(stack.engine), stack.tokenizer, MODEL, 512)
    # random prompts must use ids the served tokenizer has (the embedded model may be small)
    hi = min(stack.tokenizer.vocab_size, loadgen.REGULAR_TOKEN_IDS[1])
    with LiveServer(app, start_timeout=30) as srv:
        yield srv.url, (0, hi)


def _sse(*objs, done=True) -> bytes:
    lines = [b"data: " + json.dumps(o).encode() for o in objs]
    return b"\n\n".join(lines + ([b"data: [DONE]"] if done else [])) + b"\n\n"


@pytest.mark.parametrize("usage_tokens,finish,want_ok", [
    (3, "length", True), (0, "length", False), (None, "length", False), (3, "abort", False)])
def test_stream_of_empty_texts_counts_when_the_server_reports_tokens(usage_tokens, finish,
                                                                     want_ok):
    """A random-weight model can stream tokens that all detokenize to "" (vLLM, session 7:
    2 of 256 requests). With [DONE] and usage.completion_tokens > 0 the request counts for
    throughput, with no TTFT (nothing marks its first token); with no token reported, or an
    aborted stream, it is a failure."""
    import asyncio

    import httpx

    chunk = {"choices": [{"index": 0, "text": "", "finish_reason": None}]}
    last = {"choices": [{"index": 0, "text": "", "finish_reason": finish}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": usage_tokens}}
    body = _sse(chunk, chunk, last, usage) if usage_tokens is not None else _sse(chunk, last)

    async def go():
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=body))
        async with httpx.AsyncClient(transport=transport) as client:
            req = loadgen.PreparedRequest("completions", {"prompt": [1, 2, 3, 4]}, 4, 3)
            return await loadgen.send_request(client, "http://x", req, 0.0)

    res = asyncio.run(go())
    assert res.ok is want_ok, res.error
    if want_ok:
        assert res.ttft_s is None and res.tpot_s is None and res.output_tokens == 3
        summary = loadgen.summarize([res], 1.0, 1)
        assert summary["completed"] == 1 and summary["total_output_tokens"] == 3
    elif finish == "abort":
        assert "finish_reason 'abort'" in res.error
    else:
        assert res.error == "no output text in the stream"


def test_live_random_token_run_counts_everything(live):
    live_url, ids = live
    w = Workload(
        base_url=live_url + "/v1",
        concurrency=2,
        num_prompts=4,
        input_len=24,
        output_len=6,
        ignore_eos=True,
        token_id_range=ids,
    )
    import asyncio

    run = asyncio.run(loadgen.run_once(w, keep_requests=True))
    assert run["model"] == MODEL
    assert (run["completed"], run["failed"]) == (4, 0), run["errors"]
    assert run["total_output_tokens"] == 4 * 6 and run["total_input_tokens"] == 4 * 24
    assert run["output_tokens_from_usage"] and run["short_outputs"] == 0
    for r in run["requests"]:
        assert r["ok"] and r["prompt_tokens"] == 24 and r["output_tokens"] == 6
        assert r["finish_reason"] == "length"
        assert 0 < r["ttft_s"] <= r["e2e_s"]
        assert r["tpot_s"] == pytest.approx((r["e2e_s"] - r["ttft_s"]) / 5)
        assert len(r["itl_s"]) == r["text_chunks"] - 1
    assert run["p50_ttft_ms"] > 0 and run["p50_tpot_ms"] > 0
    assert run["output_throughput"] == pytest.approx(24 / run["duration"])


def test_live_prompt_file_and_cli_result_file(live, tmp_path, capsys):
    live_url, ids = live
    pf = tmp_path / "p.jsonl"
    pf.write_text(
        "\n".join(
            json.dumps(x)
            for x in [
                {"prompt": "def f(x):", "max_tokens": 3},
                {
                    "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 4,
                    "enable_thinking": False,
                },
            ]
        )
        + "\n"
    )
    out = tmp_path / "r.json"
    rc = bench_main(
        [
            "--base-url",
            live_url,
            "--concurrency",
            "1,2",
            "--num-prompts",
            "2,4",
            "--prompt-file",
            str(pf),
            "--ignore-eos",
            "--out",
            str(out),
            "--label",
            "tiny",
            "--engine-config",
            '{"max_num_seqs": 8}',
            "--no-uvloop",
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["schema"] == "tailored-bench/1" and res["label"] == "tiny"
    assert [r["max_concurrency"] for r in res["runs"]] == [1, 2]
    assert [r["completed"] for r in res["runs"]] == [2, 4]
    assert res["runs"][1]["total_output_tokens"] == 2 * 3 + 2 * 4
    m = res["manifest"]
    assert m["engine_config"] == {"max_num_seqs": 8}
    assert m["server"]["models"]["data"][0]["id"] == MODEL
    assert "commit" in m["commit"] and m["client"]["name"] == "tailored bench"
    assert res["workload"]["prompt_files"] == [str(pf)]
    # random prompts through the CLI, with the id range of the served vocabulary
    rc = bench_main(
        [
            "--base-url",
            live_url,
            "--num-prompts",
            "2",
            "--input-len",
            "8",
            "--output-len",
            "2",
            "--ignore-eos",
            "--token-id-range",
            f"0,{ids[1]}",
            "--out",
            str(out),
            "--no-uvloop",
        ]
    )
    assert rc == 0 and json.loads(out.read_text())["runs"][0]["total_input_tokens"] == 16
    assert "out tok/s" in capsys.readouterr().out


def test_live_failures_are_counted_not_raised(live):
    import asyncio

    live_url, ids = live
    # a prompt longer than max_model_len (512) is a 400 for every request
    w = Workload(
        base_url=live_url,
        concurrency=2,
        num_prompts=3,
        input_len=600,
        output_len=4,
        num_warmups=0,
        token_id_range=ids,
    )
    run = asyncio.run(loadgen.run_once(w))
    assert (run["completed"], run["failed"]) == (0, 3)
    assert run["errors"][0]["count"] == 3 and "HTTP 400" in run["errors"][0]["error"]


@pytest.mark.contract("concurrency-soak")
def test_soak_answers_under_concurrency_equal_the_answers_alone(live):
    """failure-cases §9: the soak tool against the real app (CPU plain path, fp32): every
    answer at concurrency 8 equals the same request's answer alone, streamed or not."""
    from tailored.bench.soak import soak

    import asyncio

    url, (_, hi) = live
    res = asyncio.run(soak(url, prompts=10, concurrency=8, rounds=2, max_tokens=12,
                           token_id_range=(1, hi), max_prompt_len=150))
    assert res.ok, (res.errors[:3], res.mismatches[:3])
    assert res.requests == 30


def test_soak_with_grammars_checks_each_structured_answer(live):
    """failure-cases §9 with grammar masks in the batch (kb/0052): every 2nd prompt carries a
    regex, JSON schema or choice; each answer equals its answer alone and follows its grammar.
    Every 4th prompt extends the one before it: prefix-cache hits (§3) give the same answers."""
    from tailored.bench.soak import soak

    import asyncio

    pytest.importorskip("xgrammar")
    url, (_, hi) = live
    res = asyncio.run(soak(url, prompts=9, concurrency=8, rounds=2, max_tokens=12,
                           token_id_range=(1, hi), max_prompt_len=150, structured_every=2,
                           prefix_every=4))
    assert res.ok, (res.errors[:3], res.mismatches[:3], res.outside_grammar[:3])
    assert (res.requests, res.structured) == (27, 15)
    assert res.prefix_cache_hits and res.prefix_cache_hits > 0  # the extended prompts hit


@pytest.mark.parametrize("kind,text,finish,want", [
    ("regex", "0123", "stop", True), ("regex", "", "stop", False), ("regex", "12a", "length", False),
    ("regex", "", "length", True),
    ("json", '{"n": 3, "ok": true}', "stop", True), ("json", '{"n": 3}', "stop", False),
    ("json", '{"n": 3.5, "ok": true}', "stop", False), ("json", '{"n": 1, "ok": 1}', "stop", False),
    ("json", ' {"n', "length", True), ("json", "[", "length", False),
    ("choice", "beta", "stop", True), ("choice", "bet", "stop", False),
    ("choice", "gam", "length", True), ("choice", "delta", "length", False)])
def test_soak_grammar_check(kind, text, finish, want):
    from tailored.bench.soak import follows

    assert follows(kind, text, finish) is want
