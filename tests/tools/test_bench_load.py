"""The load sweep side by side: the `load` section of latest.json, `tailored bench --plot`, and
lab/side_by_side.sh's load phases in their dry run (the GPU run itself is not testable here)."""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tailored.bench import loadsweep, plot, results, sidebyside
from tailored.bench.cli import main as bench_main

REPO = Path(__file__).resolve().parents[2]
H100 = REPO / "bench" / "results" / "2026-12-07-h100-load"
LATEST = REPO / "bench" / "results" / "latest.json"
README_PNG = "docs/img/load-h100-fp8.png"


def _manifest(engine, commit="abc1234def", max_model_len=16384, cfg=None):
    server = {"models": {"data": [{"id": "qwen36-35b-a3b", "owned_by": engine,
                                   "max_model_len": max_model_len}]}}
    if engine == "vllm":
        server["version"] = {"version": "0.25.1"}
    return {
        "date": "2026-12-07T10:00:00+00:00",
        "commit": {"commit": commit, "source": "TAILORED_COMMIT"},
        "gpu": {"gpus": [{"name": "NVIDIA H200", "driver": "580.1", "memory": "143771 MiB"}],
                "driver_cuda": "13.0"},
        "torch": "2.11.0", "triton": "3.6.0", "cuda": "13.0",
        "checkpoint": {"path": "/tmp/ck", "sha256": "00ff",
                       "quantization_config": {"quant_method": "fp8"}},
        "engine_config": cfg,
        "server": server,
    }


def _point(d, engine, name, c, n, tok_s, ttft, itl, in_len=1024, out_len=512, **kw):
    run = {"max_concurrency": c, "num_prompts": n, "completed": n, "failed": 0,
           "output_throughput": tok_s, "p50_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft,
           "p50_itl_ms": itl, "p99_itl_ms": 3 * itl, "p50_tpot_ms": itl}
    wl = {"input_len": in_len, "output_len": out_len, "ignore_eos": True, "temperature": 0.0,
          "num_warmups": 1, "concurrency": [c], "num_prompts": [n]}
    res = results.make_result(name, _manifest(engine, **kw), wl, [run])
    return results.write_result(d / f"{name}.json", res)


@pytest.fixture
def sweep_dir(tmp_path):
    d = tmp_path / "sweep"
    d.mkdir()
    for c, t, v in ((1, 400.0, 200.0), (8, 1200.0, 1000.0), (128, 4000.0, 5000.0)):
        _point(d, "tailored", f"tailored-fp8-c{c}", c, 8 * c, t, 40.0 * c, 2.0)
        _point(d, "vllm", f"vllm-fp8-c{c}", c, 8 * c, v, 100.0 * c, 4.0)
    # c=64: tailored only (vLLM's point missing)
    _point(d, "tailored", "tailored-fp8-c64", 64, 256, 3000.0, 900.0, 15.0)
    # the long prompts: one output token, so ITL has no sample (NaN in the file); the old
    # names ({engine}-long-N.json) and the new ones ({engine}-PREC-long-N.json) both count
    _point(d, "tailored", "tailored-long-65536", 1, 2, 0.3, 3500.0, float("nan"),
           in_len=65536, out_len=1, max_model_len=131072)
    _point(d, "vllm", "vllm-fp8-long-65536", 1, 2, 0.6, 1600.0, float("nan"),
           in_len=65536, out_len=1, max_model_len=131072)
    # another precision's file is not mixed in
    _point(d, "tailored", "tailored-bf16-c1", 1, 8, 1.0, 1.0, 1.0)
    return d


def test_load_section_ratios_and_missing_points(sweep_dir):
    load = loadsweep.assemble(sweep_dir)
    pts = {p["concurrency"]: p for p in load["points"]}
    assert sorted(pts) == [1, 8, 64, 128]
    assert pts[1]["output_tok_s"] == {"tailored": 400.0, "vllm": 200.0, "ratio": 2.0}
    assert pts[128]["output_tok_s"]["ratio"] == pytest.approx(0.8)
    assert pts[8]["ttft_p50_ms"]["ratio"] == pytest.approx(320 / 800)
    assert pts[8]["ttft_p99_ms"] == {"tailored": 640.0, "vllm": 1600.0, "ratio": 0.4}
    assert pts[8]["itl_p50_ms"]["ratio"] == 0.5 and pts[8]["itl_p99_ms"]["ratio"] == 0.5
    # a point one engine lacks: its side and the ratio are null, the other side stays
    assert pts[64]["output_tok_s"] == {"tailored": 3000.0, "vllm": None, "ratio": None}
    assert pts[64]["files"]["vllm"] is None and pts[64]["num_prompts"]["tailored"] == 256
    (lp,) = load["long_prompts"]
    assert lp["prompt_tokens"] == 65536
    assert lp["ttft_p50_ms"]["ratio"] == pytest.approx(3500 / 1600)
    assert "itl_p99_ms" not in lp
    # from the manifests, nothing invented: card from the GPU name, commit as recorded
    assert load["card"] == "H200" and load["card_source"].startswith("manifest")
    assert load["commit"] == "abc1234" and load["vllm_version"] == "0.25.1"
    t = load["manifest"]["tailored"]
    assert t["driver"] == "580.1" and t["precision"] == "fp8" and t["torch"] == "2.11.0"
    assert t["engine_config"] is None and t["switches"] is None
    assert t["settings"] == dict.fromkeys(
        ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization"))
    assert t["max_model_len"] == {"sweep": [16384], "long": [131072]}
    assert load["workload"]["sweep"]["input_len"] == 1024
    # the section is strict JSON (no NaN)
    json.dumps(load, allow_nan=False)


def test_stated_card_commit_and_engine_settings(tmp_path):
    cfg = {"engine": "tailored serve", "command": "python3 -m tailored serve /ck --max-model-len "
           "16384 --max-num-seqs 128 --max-num-batched-tokens 8192 --gpu-memory-utilization 0.90",
           "env_switches": {"TAILORED_X": "0"}}
    _point(tmp_path, "tailored", "tailored-fp8-c1", 1, 8, 400.0, 40.0, 2.0, cfg=cfg)
    _point(tmp_path, "tailored", "tailored-fp8-c8", 8, 48, 900.0, 90.0, 4.0, cfg=cfg,
           commit="fff0000")
    load = loadsweep.assemble(tmp_path, card="H100", commit="746152a", note="n")
    assert (load["card"], load["commit"], load["note"]) == ("H100", "746152a", "n")
    t = load["manifest"]["tailored"]
    assert t["settings"] == {"max_model_len": "16384", "max_num_seqs": "128",
                             "max_num_batched_tokens": "8192", "gpu_memory_utilization": "0.90"}
    assert t["switches"] == {"TAILORED_X": "0"}
    assert t["differs_between_points"] == ["commit"]  # a mixed folder shows
    assert load["manifest"]["vllm"] is None
    assert all(p["output_tok_s"]["vllm"] is None for p in load["points"])


def test_the_h100_sweep_and_latest_json():
    """latest.json's load section is what the code assembles from the committed files, and its
    older sections are still there."""
    load = loadsweep.assemble(H100, precision="fp8", card="H100", commit="746152a")
    pts = {p["concurrency"]: p for p in load["points"]}
    assert sorted(pts) == [1, 8, 32, 64, 128]
    assert round(pts[128]["output_tok_s"]["ratio"], 2) == 0.90
    assert round(pts[1]["output_tok_s"]["ratio"], 2) == 1.83
    assert [lp["prompt_tokens"] for lp in load["long_prompts"]] == [65536, 120000]
    assert round(load["long_prompts"][1]["ttft_p50_ms"]["ratio"], 2) == 2.49
    latest = json.loads(LATEST.read_text())
    assert {"bf16", "fp8", "manifest", "vllm_manifest", "load"} <= set(latest)
    committed = latest["load"]
    assert committed["card"] == "H100" and committed["commit"] == "746152a"
    for key in ("points", "long_prompts", "manifest", "workload", "precision", "vllm_version"):
        assert committed[key] == json.loads(json.dumps(load[key])), key


def test_latest_keeps_its_other_sections(sweep_dir, tmp_path, capsys):
    latest = tmp_path / "latest.json"
    latest.write_text(json.dumps({"bf16": {"x": 1}, "date": "d"}))
    assert bench_main(["load", "--results-dir", str(sweep_dir), "--latest", str(latest)]) == 0
    d = json.loads(latest.read_text())
    assert d["bf16"] == {"x": 1} and d["date"] == "d" and d["load"]["points"]
    assert "2.00×" in capsys.readouterr().out
    # the side by side's summary rewrites the file but keeps the load section
    sbs = tmp_path / "sbs"
    sbs.mkdir()
    assert sidebyside.main([str(sbs), "--latest", str(latest)]) == 0
    d2 = json.loads(latest.read_text())
    assert d2["load"] == d["load"] and "bf16" in d2 and "x" not in d2["bf16"]


def _is_png(p: Path) -> bool:
    return p.is_file() and p.stat().st_size > 0 and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_writes_a_png(sweep_dir, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "img" / "load.png"
    assert bench_main(["--plot", str(out), "--results-dir", str(sweep_dir), "--card", "H100",
                       "--commit", "746152a"]) == 0
    assert _is_png(out)
    assert "wrote" in capsys.readouterr().err
    # from a latest.json's load section, with the mode spelled out
    latest = tmp_path / "latest.json"
    loadsweep.update_latest(latest, loadsweep.assemble(sweep_dir))
    out2 = tmp_path / "load2.png"
    assert bench_main(["plot", "--plot", str(out2), "--latest", str(latest)]) == 0
    assert _is_png(out2)
    title = plot.title_of(json.loads(latest.read_text())["load"])
    assert "H200" in title and "FP8" in title and "abc1234" in title


def test_the_committed_plot_is_in_the_readme():
    png = REPO / README_PNG
    assert _is_png(png) and png.stat().st_size < 150 * 1024
    assert f"]({README_PNG})" in (REPO / "README.md").read_text()


def test_cli_errors(tmp_path, capsys, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert bench_main(["--plot", str(tmp_path / "x.png"), "--results-dir", str(empty)]) == 2
    err = capsys.readouterr().err
    assert "no load-sweep results in" in err and "-c" in err
    assert not (tmp_path / "x.png").exists()
    assert bench_main(["load", "--results-dir", str(empty)]) == 2
    assert bench_main(["load"]) == 2 and "--results-dir" in capsys.readouterr().err
    assert bench_main(["plot"]) == 2 and "--plot OUT.png" in capsys.readouterr().err
    assert bench_main(["summary", "--plot", "x.png"]) == 2
    no_load = tmp_path / "latest.json"
    no_load.write_text("{}")
    assert bench_main(["--plot", str(tmp_path / "x.png"), "--latest", str(no_load)]) == 2
    assert "no `load` section" in capsys.readouterr().err


def test_plot_without_matplotlib_says_how_to_get_it(sweep_dir, tmp_path, capsys, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert bench_main(["--plot", str(tmp_path / "x.png"), "--results-dir", str(sweep_dir)]) == 2
    assert "pip install 'tailored[plot]'" in capsys.readouterr().err


def _dry(*args, **env):
    out = subprocess.run(
        ["bash", str(REPO / "lab" / "side_by_side.sh"), *args], capture_output=True, text=True,
        cwd=REPO, timeout=60, check=False,
        env={**os.environ, "SBS_DRY_RUN": "1", "SBS_DIR": env.pop("SBS_DIR"), **env})
    return out.returncode, out.stdout, out.stderr


def _bench_calls(stdout):
    calls = []
    for line in stdout.splitlines():
        if line.startswith("+ tailored bench "):
            words = shlex.split(line[len("+ tailored bench "):])
            calls.append({w: words[i + 1] if i + 1 < len(words) and not words[i + 1]
                          .startswith("--") else True
                          for i, w in enumerate(words) if w.startswith("--")})
    return calls


def test_side_by_side_load_phases_dry_run(tmp_path):
    rc, out, err = _dry("load", "tailored", "fp8", SBS_DIR=str(tmp_path))
    assert rc == 0, err
    serve = [ln for ln in out.splitlines() if ln.startswith("+ python3 -m tailored serve")]
    assert len(serve) == 1
    for flag in ("--max-model-len 16384", "--max-num-seqs 128", "--max-num-batched-tokens 8192",
                 "--gpu-memory-utilization 0.90", "--load-format dummy"):
        assert flag in serve[0]
    calls = _bench_calls(out)
    assert [(c["--concurrency"], c["--num-prompts"]) for c in calls] == [
        ("1", "8"), ("8", "48"), ("32", "160"), ("64", "256"), ("128", "512")]
    for c in calls:
        assert c["--input-len"] == "1024" and c["--output-len"] == "512"
        assert c["--ignore-eos"] is True and c["--temperature"] == "0"
        assert c["--out"] == f"{tmp_path}/tailored-fp8-c{c['--concurrency']}.json"
        cfg = json.loads(c["--engine-config"])
        assert "--max-num-seqs 128" in cfg["command"]
    # the long prompts: vLLM restarted at 131072 (the kit's flags, the last --max-model-len wins)
    rc, out, err = _dry("long", "vllm", "fp8", SBS_DIR=str(tmp_path))
    assert rc == 0, err
    assert "serve fp8 --max-model-len 131072" in out
    calls = _bench_calls(out)
    assert [(c["--input-len"], c["--output-len"], c["--num-prompts"]) for c in calls] == [
        ("65536", "1", "2"), ("120000", "1", "2")]
    assert calls[0]["--out"].endswith("vllm-fp8-long-65536.json")
    rc, out, _ = _dry("load", "vllm", SBS_DIR=str(tmp_path), SBS_CONCURRENCY="1,2")
    assert rc != 0


def test_dry_run_names_match_what_the_section_reads(tmp_path):
    rc, out, err = _dry("load-all", "fp8", SBS_DIR=str(tmp_path))
    assert rc == 0, err
    outs = [Path(c["--out"]).name for c in _bench_calls(out)]
    assert len(outs) == 14
    for name in outs:  # write a result under each name: every one lands in the section
        engine = name.split("-")[0]
        long_ = "-long-" in name
        n = int(name.rsplit("-", 1)[1].removeprefix("c").removesuffix(".json"))
        _point(tmp_path, engine, name[:-5], 1 if long_ else n, 2, 1.0, 1.0, math.nan if long_
               else 1.0, in_len=n if long_ else 1024, out_len=1 if long_ else 512)
    load = loadsweep.assemble(tmp_path)
    assert [p["concurrency"] for p in load["points"]] == [1, 8, 32, 64, 128]
    assert all(p["output_tok_s"]["ratio"] == 1.0 for p in load["points"])
    assert [lp["prompt_tokens"] for lp in load["long_prompts"]] == [65536, 120000]
