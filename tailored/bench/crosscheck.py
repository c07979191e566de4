"""Cross-check `tailored bench` against AIPerf (NVIDIA's client, PyPI `aiperf`) on one server.

Both clients send byte-identical request bodies: the random-token-id prompts of
`tailored bench` are written as an AIPerf `inputs_json` file (verbatim payloads), so the
workload is the same to the token. The clients run alternately (tailored, aiperf, tailored,
aiperf, ...) for each concurrency, and the medians over repetitions are compared:
output tok/s, TTFT p50 and TPOT p50 (AIPerf calls (latency − TTFT)/(OSL − 1) "inter token
latency"; its per-chunk gap is "inter chunk latency").

    python -m tailored.bench.crosscheck --base-url http://127.0.0.1:8160 \\
        --aiperf /tmp/aiperf-venv/bin/aiperf --tokenizer ~/.cache/tailored/tiny-seed0 \\
        --concurrency 1,4 --num-prompts 16,32 --input-len 128 --output-len 32 --repeats 2

`--serve PORT --pace-ms MS` instead runs the real server (embedded tiny model, real engine, app
and tokenizer) with every engine step padded to MS milliseconds: on a shared 2-core machine the
unpaced step time depends on what else runs, AIPerf included (it is a multi-process client
that takes a good share of a core), so a paced server is how the two clients can be compared
on the same thing; unpaced numbers measure the contention as much as the client.

AIPerf is installed in its own venv (`python -m venv V && V/bin/pip install aiperf`); it needs a
local tokenizer dir (it loads one even with --use-server-token-count) and no network otherwise.
Run the server and the clients on different cores (taskset) so client CPU use cannot slow
the server differently for the two clients.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tailored.bench import loadgen

KEYS = ("output_tok_s", "ttft_p50_ms", "tpot_p50_ms", "request_s", "e2e_p50_ms")


def tailored_metrics(run: dict) -> dict[str, float]:
    return {
        "output_tok_s": run["output_throughput"],
        "ttft_p50_ms": run["p50_ttft_ms"],
        "tpot_p50_ms": run["p50_tpot_ms"],
        "request_s": run["request_throughput"],
        "e2e_p50_ms": run["p50_e2el_ms"],
        "completed": run["completed"],
        "failed": run["failed"],
    }


def aiperf_metrics(export_json: Path) -> dict[str, float]:
    d = json.loads(export_json.read_text())
    completed = d.get("completed_request_count", d.get("request_count", {})).get("avg")
    errors = d.get("error_summary") or []
    return {
        "output_tok_s": d["output_token_throughput"]["avg"],
        "ttft_p50_ms": d["time_to_first_token"]["p50"],
        "tpot_p50_ms": d["inter_token_latency"]["p50"],
        "request_s": d["request_throughput"]["avg"],
        "e2e_p50_ms": d["request_latency"]["p50"],
        "completed": completed,
        "failed": len(errors),
    }


def write_inputs_json(path: Path, w: loadgen.Workload, model: str, n: int) -> None:
    reqs = loadgen.prepare_requests(w, model, n, w.seed)
    data = {"data": [{"session_id": f"s{i}", "payloads": [r.body]} for i, r in enumerate(reqs)]}
    path.write_text(json.dumps(data))


def run_aiperf(
    aiperf: str,
    base_url: str,
    inputs: Path,
    model: str,
    tokenizer: str,
    concurrency: int,
    n: int,
    warmups: int,
    out_dir: Path,
    cpu: str | None,
) -> dict:
    cmd = [
        aiperf,
        "profile",
        "--model",
        model,
        "--url",
        loadgen.api_root(base_url),
        "--endpoint-type",
        "completions",
        "--streaming",
        "--input-file",
        str(inputs),
        "--custom-dataset-type",
        "inputs_json",
        "--dataset-sampling-strategy",
        "sequential",
        "--concurrency",
        str(concurrency),
        "--request-count",
        str(n),
        "--warmup-request-count",
        str(warmups),
        "--tokenizer",
        tokenizer,
        "--use-server-token-count",
        "--artifact-dir",
        str(out_dir),
        "--ui-type",
        "none",
        "--no-server-metrics",
        "--no-gpu-telemetry",
    ]
    if cpu:
        cmd = ["taskset", "-c", cpu] + cmd
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    export = out_dir / "profile_export_aiperf.json"
    if p.returncode != 0 or not export.is_file():
        raise RuntimeError(f"aiperf failed ({p.returncode}): {p.stdout[-2000:]}{p.stderr[-2000:]}")
    return aiperf_metrics(export)


def run_tailored(
    base_url: str, w: loadgen.Workload, concurrency: int, n: int, warmups: int, cpu: str | None
) -> dict:
    """In a subprocess (pinned like AIPerf) so both clients get the same core."""
    with tempfile.TemporaryDirectory() as td:
        out = Path(td) / "r.json"
        cmd = [
            sys.executable,
            "-m",
            "tailored.bench",
            "--base-url",
            base_url,
            "--concurrency",
            str(concurrency),
            "--num-prompts",
            str(n),
            "--input-len",
            str(w.input_len),
            "--output-len",
            str(w.output_len),
            "--num-warmups",
            str(warmups),
            "--seed",
            str(w.seed),
            "--out",
            str(out),
        ]
        if w.ignore_eos:
            cmd.append("--ignore-eos")
        cmd += ["--token-id-range", ",".join(map(str, w.token_id_range))]
        if cpu:
            cmd = ["taskset", "-c", cpu] + cmd
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
        if not out.is_file():
            raise RuntimeError(f"tailored bench failed ({p.returncode}): {p.stderr[-2000:]}")
        return tailored_metrics(json.loads(out.read_text())["runs"][0])


class PacedEngine:
    """The real engine with each step() padded to `pace_s` seconds (sleeps, no CPU)."""

    def __init__(self, engine, pace_s: float) -> None:
        self.engine, self.pace_s = engine, pace_s
        self.overruns = 0

    def step(self):
        t = time.perf_counter()
        out = self.engine.step()
        rest = self.pace_s - (time.perf_counter() - t)
        if rest > 0:
            time.sleep(rest)
        else:
            self.overruns += 1
        return out

    def __getattr__(self, name):
        return getattr(self.engine, name)


def serve_paced(port: int, pace_ms: float) -> int:
    import uvicorn

    from tailored.server.app import build_app
    from tailored.server.async_engine import AsyncEngine
    from tailored.stack import build_stack

    stack = build_stack(None, max_model_len=4096, max_num_seqs=16, progress=False)
    paced = PacedEngine(stack.engine, pace_ms / 1e3)
    app = build_app(AsyncEngine(paced), stack.tokenizer, "qwen36-35b-a3b", 4096)

    @app.get("/pace")
    async def pace():
        return {"pace_ms": pace_ms, "overruns": paced.overruns}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--serve",
        type=int,
        default=None,
        metavar="PORT",
        help="run the paced real server on 127.0.0.1:PORT instead (blocks)",
    )
    ap.add_argument("--pace-ms", type=float, default=150.0, help="engine step time of --serve")
    ap.add_argument("--base-url", default="http://127.0.0.1:8160")
    ap.add_argument("--aiperf", default=shutil.which("aiperf") or "aiperf")
    ap.add_argument("--tokenizer", default=None, help="local HF tokenizer dir for AIPerf")
    ap.add_argument("--model", default="qwen36-35b-a3b")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--num-prompts", default="16,32")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--token-id-range", default="0,248044", help="LO,HI of the random prompt ids")
    ap.add_argument("--client-cpu", default=None, help="taskset CPU list for both clients")
    ap.add_argument("--out", default=None, help="write all measurements as JSON")
    a = ap.parse_args(argv)
    if a.serve:
        return serve_paced(a.serve, a.pace_ms)
    if not a.tokenizer:
        ap.error(
            "--tokenizer is required (a local HF tokenizer dir, e.g. ~/.cache/tailored/tiny-seed0)"
        )
    concs = [int(x) for x in a.concurrency.split(",")]
    nps = [int(x) for x in a.num_prompts.split(",")]
    lo, hi = (int(x) for x in a.token_id_range.split(","))
    w = loadgen.Workload(
        base_url=a.base_url,
        input_len=a.input_len,
        output_len=a.output_len,
        ignore_eos=True,
        token_id_range=(lo, hi),
    )
    report: dict = {
        "workload": {
            **w.describe(),
            "concurrency": concs,
            "num_prompts": nps,
            "repeats": a.repeats,
            "client_cpu": a.client_cpu,
        },
        "runs": [],
    }
    ok = True
    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        for c, n in zip(concs, nps):
            inputs = td / f"inputs-c{c}.json"
            write_inputs_json(inputs, w, a.model, n)
            samples: dict[str, list[dict]] = {"tailored": [], "aiperf": []}
            for rep in range(a.repeats):
                t = run_tailored(a.base_url, w, c, n, c, a.client_cpu)
                samples["tailored"].append(t)
                print(f"c={c} rep {rep} tailored: {t}", file=sys.stderr, flush=True)
                ai = run_aiperf(
                    a.aiperf,
                    a.base_url,
                    inputs,
                    a.model,
                    a.tokenizer,
                    c,
                    n,
                    c,
                    td / f"aiperf-c{c}-{rep}",
                    a.client_cpu,
                )
                samples["aiperf"].append(ai)
                print(f"c={c} rep {rep} aiperf:   {ai}", file=sys.stderr, flush=True)
            med = {
                cl: {k: statistics.median(s[k] for s in samples[cl]) for k in KEYS}
                for cl in samples
            }
            diff = {k: med["tailored"][k] / med["aiperf"][k] - 1 for k in KEYS}
            report["runs"].append(
                {
                    "concurrency": c,
                    "num_prompts": n,
                    "samples": samples,
                    "median": med,
                    "rel_diff": diff,
                }
            )
            print(f"\nconcurrency {c}, {n} prompts, median of {a.repeats}")
            print(f"{'metric':<14} {'tailored':>10} {'aiperf':>10} {'diff':>8}")
            for k in KEYS:
                flag = "" if abs(diff[k]) <= 0.05 or k not in KEYS[:3] else "  > 5%"
                ok &= not flag
                print(
                    f"{k:<14} {med['tailored'][k]:>10.2f} {med['aiperf'][k]:>10.2f} "
                    f"{100 * diff[k]:>+7.2f}%{flag}"
                )
    if a.out:
        try:  # the paced server reports how often a step overran its pace
            import httpx

            report["pace"] = httpx.get(
                loadgen.api_root(a.base_url) + "/pace", timeout=5, trust_env=False
            ).json()
        except (httpx.HTTPError, ValueError):
            report["pace"] = None
        Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
