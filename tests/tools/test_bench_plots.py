"""`tailored bench --plot --plot-kind cdf|goodput` (issue 57): the data series drawn from
synthetic result files, and the PNGs written."""

from __future__ import annotations

import pytest

from tailored.bench import plotlatency, results
from tailored.bench.cli import main as bench_main

PNG = b"\x89PNG\r\n\x1a\n"


def _req(ttft, itls, ok=True):
    return {"ok": ok, "ttft_s": ttft, "itl_s": itls, "output_tokens": len(itls) + 1}


def _run(c=8, rate="inf", reqs=None, good=1.0):
    r = {"max_concurrency": c, "request_rate": rate, "request_goodput": good,
         "output_goodput": 50.0 * good, "slo": {"ttft_ms": 1000.0, "itl_ms": 100.0}}
    if reqs is not None:
        r["requests"] = reqs
    return r


def _write(d, name, runs):
    return results.write_result(d / f"{name}.json", results.make_result(name, {}, {}, runs))


@pytest.fixture
def files(tmp_path):
    reqs_t = [_req(0.030, [0.004, 0.005]), _req(0.010, [0.003]), _req(0.020, []),
              _req(None, [], ok=False)]  # a failed request is left out
    reqs_v = [_req(0.100, [0.006, 0.020]), _req(0.050, [0.010])]
    return {
        "tailored": _write(tmp_path, "tailored-fp8-chat-mix", [
            _run(rate=4.0, reqs=[_req(9.0, [9.0])], good=3.5),
            _run(rate=2.0, reqs=reqs_t, good=2.0),
            _run(rate="inf", good=0.5)]),  # all at once: no x position on a rate axis
        "vllm": _write(tmp_path, "vllm-fp8-chat-mix", [
            _run(rate=2.0, reqs=reqs_v, good=1.9), _run(rate=4.0, reqs=reqs_v, good=2.5)]),
        "other": _write(tmp_path, "mine", [_run(c=32, reqs=reqs_v)]),
    }


def test_latency_series_and_cdf(files):
    s = plotlatency.latency_series(files["tailored"], "rate=2")
    assert s["engine"] == "tailored" and s["run"] == "rate=2"
    assert s["ttft_ms"] == pytest.approx([30.0, 10.0, 20.0])
    assert s["itl_ms"] == pytest.approx([4.0, 5.0, 3.0])
    xs, ys = plotlatency.cdf(s["ttft_ms"])
    assert xs == pytest.approx([10.0, 20.0, 30.0]) and ys == pytest.approx([1 / 3, 2 / 3, 1.0])
    # default: the file's last run; a file with another name is labelled by its label
    assert plotlatency.latency_series(files["vllm"])["run"] == "rate=4"
    other = plotlatency.latency_series(files["other"])
    assert other["engine"] == "mine" and other["run"] == "c=32"
    with pytest.raises(ValueError, match="no run rate=8"):
        plotlatency.latency_series(files["vllm"], "rate=8")
    with pytest.raises(ValueError, match="--save-requests"):
        plotlatency.latency_series(files["tailored"], "c=8")


def test_goodput_series_by_rate(files):
    s = plotlatency.goodput_series(files["tailored"])
    assert s["engine"] == "tailored"
    assert s["rate"] == [2.0, 4.0]  # sorted; the rate=inf run is not on the axis
    assert s["request_goodput"] == [2.0, 3.5] and s["output_goodput"] == [100.0, 175.0]
    with pytest.raises(ValueError, match="finite --request-rate"):
        plotlatency.goodput_series(files["other"])


def test_plot_files_written(files, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    cdf_png, gp_png = tmp_path / "img" / "cdf.png", tmp_path / "img" / "goodput.png"
    assert bench_main(["--plot", str(cdf_png), "--plot-kind", "cdf", "--plot-point", "rate=2",
                       "--plot-inputs", str(files["tailored"]), str(files["vllm"])]) == 0
    assert bench_main(["--plot", str(gp_png), "--plot-kind", "goodput", "--plot-inputs",
                       str(files["tailored"]), str(files["vllm"])]) == 0
    for p in (cdf_png, gp_png):
        assert p.read_bytes()[:8] == PNG and p.stat().st_size > 10_000
    # from a peers folder: the chat mix's files of the precision
    d = files["tailored"].parent
    out = tmp_path / "from-dir.png"
    assert bench_main(["--plot", str(out), "--plot-kind", "goodput", "--results-dir",
                       str(d)]) == 0 and out.is_file()
    capsys.readouterr()
    assert bench_main(["--plot", str(out), "--plot-kind", "cdf", "--plot-inputs",
                       str(files["other"]), "--plot-point", "c=1"]) == 2
    assert "no run c=1" in capsys.readouterr().err
    assert bench_main(["--plot", str(out), "--plot-kind", "cdf"]) == 2
