"""`sammie gate` on the CPU (tiny synthetic checkpoint against transformers' Sam3Model: passes,
and a perturbed model breaches with exit 1) and `sammie bench` against sammie and the reference
server (both on the tiny model, each in a uvicorn thread), results with manifests."""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time

import pytest

pytest.importorskip("transformers", reason="the gate's and the bench's reference is transformers'")

from sammie import checkpoint  # noqa: E402
from sammie.cli import main  # noqa: E402
from sammie.gate.cases import CASES_DIR  # noqa: E402
from sammie.synth import write_synthetic_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("gate") / "tiny", "tiny")


def test_gate_passes_on_the_cpu_and_writes_a_report(ckpt, tmp_path, capsys):
    out = tmp_path / "gate.json"
    assert main(["gate", str(ckpt), "--out", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["pass"] and not rep["breaches"]
    s = rep["summary"]
    assert s["prompts"] >= 16 and s["kept_reference"] > 0 and s["min_mask_iou"] >= 0.999
    m = rep["manifest"]
    assert m["checkpoint"]["sha256"] and m["cases"]["sha256"] and m["dtype"] == "float32"
    assert m["transformers"] and "commit" in m
    assert "PASS" in capsys.readouterr().out


def test_gate_breach_exits_1(ckpt, tmp_path, monkeypatch):
    cases = tmp_path / "cases"
    cases.mkdir()
    data = json.loads((CASES_DIR / "cases.json").read_text())
    data["cases"] = data["cases"][1:2]
    (cases / "cases.json").write_text(json.dumps(data))
    shutil.copy(CASES_DIR / data["cases"][0]["file"], cases)
    real = checkpoint.load_model

    def perturbed(*a, **kw):
        m = real(*a, **kw)
        m.dot_product_scoring.query_proj.bias.data += 0.5
        return m

    monkeypatch.setattr(checkpoint, "load_model", perturbed)
    out = tmp_path / "gate.json"
    assert main(["gate", str(ckpt), "--cases", str(cases), "--out", str(out)]) == 1
    rep = json.loads(out.read_text())
    assert not rep["pass"] and any("score diff" in b for b in rep["breaches"])


def _serve(app) -> tuple[str, object]:
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", server


def test_bench_against_sammie_and_the_reference_server(ckpt, tmp_path):
    from tailored.server.guard import AccessPolicy

    from sammie.bench.reference_server import ReferencePredictor, build_reference_app
    from sammie.cli import build_server
    from sammie.server.app import ServeSettings

    ours, s1 = _serve(build_server(ckpt, "cpu", "float32", ServeSettings(), AccessPolicy()))
    ref, s2 = _serve(build_reference_app(ReferencePredictor(str(ckpt))))
    try:
        for url, label, extra in ((ours, "sammie", []), (ref, "reference", ["--multipart"])):
            out = tmp_path / f"{label}.json"
            rc = main(["bench", "--url", url, "--concurrency", "1,2", "--num-requests", "4",
                       "--warmups", "1", "--size", "224", "--prompts-per-image", "2",
                       "--label", label, "--out", str(out), *extra])
            assert rc == 0
            res = json.loads(out.read_text())
            assert res["schema"] == "sammie-bench/1" and res["label"] == label
            assert [r["concurrency"] for r in res["runs"]] == [1, 2]
            for r in res["runs"]:
                assert r["completed"] == 4 and r["images_per_s"] > 0
                assert r["p99_latency_ms"] >= r["p50_latency_ms"] > 0
            assert res["manifest"]["server"]["models"]["data"]
    finally:
        s1.should_exit = s2.should_exit = True
