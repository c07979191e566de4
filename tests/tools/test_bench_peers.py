"""tailored beside SGLang and vLLM (issue 57): the `peers` section of latest.json from fake
result files (the GPU run itself is not testable here), and the sections living side by side."""

from __future__ import annotations

import json

import pytest

from tailored.bench import peers, results
from tailored.bench.cli import main as bench_main


def _manifest(engine):
    return {"date": f"2026-12-08T10:00:0{len(engine) % 10}+00:00",
            "commit": {"commit": "abc1234def", "source": "TAILORED_COMMIT"},
            "gpu": {"gpus": [{"name": "NVIDIA H200", "driver": "580.1"}]},
            "server": {"models": {"data": [{"id": "qwen36-35b-a3b", "owned_by": engine}]}},
            "engine_config": {"engine": engine}}


def _run(c=1, rate="inf", tok_s=100.0, ttft=50.0, itl=5.0, good=1.0, failed=0):
    return {"max_concurrency": c, "request_rate": rate, "num_prompts": 16, "failed": failed,
            "output_throughput": tok_s, "p50_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft,
            "p50_itl_ms": itl, "p99_itl_ms": 3 * itl, "request_goodput": good,
            "output_goodput": 100 * good}


def _write(d, engine, tag, runs, prec="fp8"):
    res = results.make_result(f"{engine}-{prec}-{tag}", _manifest(engine),
                              {"workload": tag, "seed": 0}, runs)
    return results.write_result(d / f"{engine}-{prec}-{tag}.json", res)


@pytest.fixture
def peers_dir(tmp_path):
    d = tmp_path / "peers"
    d.mkdir()
    # random: tailored 2x SGLang at c=1, SGLang ahead of vLLM; vLLM best at c=128
    scale = {"tailored": (2.0, 1.25, 1.0), "sglang": (1.0, 1.0, 1.0), "vllm": (0.8, 0.8, 1.2)}
    for e, (lo, mid, hi) in scale.items():
        _write(d, e, "random", [_run(1, tok_s=300 * lo, ttft=40 / lo),
                                _run(32, tok_s=2000 * mid, ttft=400),
                                _run(128, tok_s=4000 * hi, ttft=900 * hi)])
    # chat mix: Poisson rates; vLLM lacks rate 8; tailored's goodput peaks at rate 8
    for e, goods in {"tailored": (2.0, 3.9, 7.0), "sglang": (2.0, 3.5, 2.0),
                     "vllm": (1.9, 3.0)}.items():
        _write(d, e, "chat-mix", [_run(0, rate=r, good=g) for r, g in zip((2.0, 4.0, 8.0), goods)])
    # agent mix: one run; SGLang's TTFT is the best peer's
    for e, ttft in {"tailored": 100.0, "sglang": 250.0, "vllm": 400.0}.items():
        _write(d, e, "agent-mix", [_run(16, ttft=ttft)])
    # long prompts: no ITL sample (NaN); no SGLang file for 120k
    for e, t in {"tailored": 3000.0, "sglang": 2000.0, "vllm": 1500.0}.items():
        _write(d, e, "long-65536", [_run(1, ttft=t, itl=float("nan"))])
    _write(d, "tailored", "long-120000", [_run(1, ttft=5000.0, itl=float("nan"))])
    _write(d, "vllm", "long-120000", [_run(1, ttft=4000.0, itl=float("nan"))])
    _write(d, "tailored", "random", [_run(1, tok_s=1.0)], prec="bf16")  # not mixed in
    (d / "vllm-fp8-c1.json").write_text("{}")  # another sweep's name: ignored
    return d


def test_points_best_peer_and_ratio(peers_dir):
    s = peers.assemble(peers_dir)
    assert s["schema"] == peers.SCHEMA and s["precision"] == "fp8"
    assert list(s["workloads"]) == ["random", "chat-mix", "agent-mix", "long"]
    rnd = {p["point"]: p for p in s["workloads"]["random"]["points"]}
    assert list(rnd) == ["c=1", "c=32", "c=128"]
    assert rnd["c=1"]["output_tok_s"] == {"tailored": 600.0, "sglang": 300.0, "vllm": 240.0,
                                          "vllm026": None, "best_peer": "sglang", "ratio": 2.0}
    assert rnd["c=128"]["output_tok_s"]["best_peer"] == "vllm"
    assert rnd["c=128"]["output_tok_s"]["ratio"] == pytest.approx(4000 / 4800)
    # lower is better for the latencies: the best peer is the fastest
    assert rnd["c=1"]["ttft_p50_ms"]["best_peer"] == "sglang"  # 40 ms beside vLLM's 50
    assert rnd["c=1"]["ttft_p50_ms"]["ratio"] == pytest.approx(20 / 40)
    assert rnd["c=128"]["ttft_p99_ms"]["best_peer"] == "sglang"
    assert rnd["c=1"]["files"] == {e: f"{e}-fp8-random.json" if e != "vllm026" else None
                                   for e in peers.ENGINES}
    # every metric the issue names is there, for each engine
    for key in ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
                "goodput_req_s", "goodput_tok_s"):
        assert set(peers.ENGINES) <= set(rnd["c=32"][key])
    # vLLM 0.26.0, when it ran, is one more peer: here it is the best at c=32
    _write(peers_dir, "vllm026", "random", [_run(32, tok_s=5000.0)])
    c32 = {p["point"]: p for p in peers.assemble(peers_dir)["workloads"]["random"]["points"]}
    assert c32["c=32"]["output_tok_s"]["best_peer"] == "vllm026"
    assert c32["c=32"]["output_tok_s"]["ratio"] == pytest.approx(2500 / 5000)


def test_chat_mix_rates_missing_points_and_max_goodput(peers_dir):
    s = peers.assemble(peers_dir)
    chat = {p["point"]: p for p in s["workloads"]["chat-mix"]["points"]}
    assert list(chat) == ["rate=2", "rate=4", "rate=8", "max"]
    r8 = chat["rate=8"]["goodput_req_s"]
    assert r8["vllm"] is None and r8["best_peer"] == "sglang" and r8["ratio"] == 3.5
    mx = chat["max"]
    assert mx["goodput_req_s"] == {"tailored": 7.0, "sglang": 3.5, "vllm": 3.0, "vllm026": None,
                                   "best_peer": "sglang", "ratio": 2.0}
    assert mx["goodput_tok_s"]["tailored"] == 700.0
    assert mx["of"] == ["rate=2", "rate=4", "rate=8"]


def test_long_prompts_and_nan(peers_dir):
    s = peers.assemble(peers_dir)
    longs = {p["point"]: p for p in s["workloads"]["long"]["points"]}
    assert list(longs) == ["65536 tokens", "120000 tokens"]
    assert longs["65536 tokens"]["itl_p50_ms"] == {
        "tailored": None, "sglang": None, "vllm": None, "vllm026": None, "best_peer": None,
        "ratio": None}
    assert longs["120000 tokens"]["ttft_p50_ms"]["sglang"] is None
    assert longs["120000 tokens"]["ttft_p50_ms"]["ratio"] == pytest.approx(5000 / 4000)
    assert longs["120000 tokens"]["files"]["sglang"] is None


def test_targets_of_the_issue(peers_dir):
    t = {(x["workload"], x["point"], x["metric"]): x for x in peers.assemble(peers_dir)["targets"]}
    assert t[("random", "c=1", "output_tok_s")]["met"] is True  # 2.0 >= 1.5
    assert t[("random", "c=32", "output_tok_s")]["met"] is False  # 1.25 < 1.5
    assert t[("random", "c=128", "output_tok_s")]["met"] is False
    assert t[("chat-mix", "max", "goodput_req_s")]["met"] is True
    agent = t[("agent-mix", "all", "ttft_p50_ms")]
    assert agent["ratio"] == pytest.approx(0.4) and agent["met"] is True  # <= 0.5
    assert t[("long", "65536 tokens", "ttft_p50_ms")]["met"] is False  # 2.0 > 0.7
    assert len(t) == 7


def test_latest_keeps_every_section(peers_dir, tmp_path):
    latest = tmp_path / "latest.json"
    latest.write_text(json.dumps({"schema": "tailored-side-by-side/1", "bf16": {"x": 1},
                                  "load": {"points": []}}))
    peers.update_latest(latest, peers.assemble(peers_dir))
    d = json.loads(latest.read_text())
    assert d["bf16"] == {"x": 1} and d["load"] == {"points": []} and "workloads" in d["peers"]
    # the side by side's summary rewrites the file: the load and peers sections stay
    results.write_latest(latest, {"schema": "tailored-side-by-side/1", "bf16": {"x": 2}})
    d = json.loads(latest.read_text())
    assert d["bf16"] == {"x": 2} and "load" in d and d["peers"]["schema"] == peers.SCHEMA
    assert peers.load_section(latest)["precision"] == "fp8"


def test_cli_peers(peers_dir, tmp_path, capsys):
    latest = tmp_path / "latest.json"
    assert bench_main(["peers", "--results-dir", str(peers_dir), "--latest", str(latest),
                       "--card", "H200"]) == 0
    out = capsys.readouterr().out
    assert "H200, fp8: tailored vs SGLang vs vLLM" in out
    assert "target random c=1 output_tok_s: 2.00× ≥ 1.5× vs sglang: met" in out
    assert json.loads(latest.read_text())["peers"]["card"] == "H200"
    assert bench_main(["peers", "--results-dir", str(tmp_path / "none")]) == 2
    assert bench_main(["peers"]) == 2


def test_peers_script_dry_run_writes_what_the_section_reads(tmp_path):
    """lab/peers.sh's dry run: every engine's servers and clients, and result names that
    `tailored bench peers` reads back into all four workloads for all three engines."""
    import os
    import shlex
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SBS_", "PEERS_"))}
    env.update(SBS_DRY_RUN="1", SBS_DIR=str(tmp_path))
    env["PEERS_VLLM026"] = "1"
    r = subprocess.run(["bash", "lab/peers.sh", "all", "fp8"], cwd=repo, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    serves = [ln for ln in r.stdout.splitlines() if " serve " in ln and ln.startswith("+ ")]
    assert any("sglang/remote.sh --port 8002 serve fp8 --context-length 16384" in s
               for s in serves)
    assert any("remote.sh --port 8000 serve fp8 --max-model-len 131072 --enable-prefix-caching"
               in s for s in serves)
    assert any("tailored serve" in s and "--prefix-cache-entries 64" in s for s in serves)
    outs = []
    for ln in r.stdout.splitlines():
        if ln.startswith("+ tailored bench --base-url"):
            words = shlex.split(ln[2:])
            assert "--save-requests" in words  # the CDFs need the per-request records
            outs.append(Path(words[words.index("--out") + 1]).name)
    assert any("remote.sh --port 8003 serve fp8" in s for s in serves)  # vLLM 0.26.0
    assert len(outs) == 24  # 4 engines x (random, chat mix, agent mix, 3 long prompts)
    for name in outs:
        engine, prec, tag = peers.FILE_RE.fullmatch(name).group(1, 2, 3)
        runs = ([_run(c) for c in (1, 32, 128)] if tag == "random" else
                [_run(0, rate=r) for r in (1.0, 2.0)] if tag == "chat-mix" else [_run(1)])
        _write(tmp_path, engine, tag, runs, prec)
    s = peers.assemble(tmp_path)
    assert list(s["workloads"]) == ["random", "chat-mix", "agent-mix", "long"]
    for block in s["workloads"].values():
        for p in block["points"]:
            assert all(p["output_tok_s" if "output_tok_s" in p else "goodput_req_s"][e]
                       is not None for e in peers.ENGINES)
    assert [p["point"] for p in s["workloads"]["long"]["points"]] == [
        "16384 tokens", "65536 tokens", "120000 tokens"]
