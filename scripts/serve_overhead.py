"""Serving overhead without a GPU: the real server, engine and scheduler, with the model step
replaced by a sleep of the H200's measured step time (the GIL is free while it sleeps, as it is
while the real engine waits for the GPU). `tailored bench` (another process) loads it; the gap
between its ITL/TPOT and the simulated step time is what the host side (HTTP, SSE, scheduler,
detokenizer, GIL hand-offs) adds per step. kb/0011.

    python scripts/serve_overhead.py [--decode-ms 5.2,14.5] [--prefill-ms-per-token 0.113]
        [--concurrency 1,32] [--num-prompts 4,64] [--output-len 128] [--switch-interval S]

Decode step time is interpolated between B=1 and B=32 (`--decode-ms B1,B32`); a step with
prefill tokens adds `--prefill-ms-per-token` per token. Tokens are drawn from the tiny model's
vocabulary so detokenizing costs what it costs.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _decode_ms(b: int, d1: float, d32: float, h1: float, h32: float) -> tuple[float, float]:
    """(simulated GPU ms, emulated host ms) of a B=b decode step, linear between B=1, 32."""
    f = (max(b, 1) - 1) / 31
    return d1 + (d32 - d1) * f, h1 + (h32 - h1) * f


def build_stub(d1: float, d32: float, h1: float, h32: float, prefill_ms_per_token: float):
    """The embedded engine with its runner's execute replaced by the simulated step; module
    level so that --engine-process can build it in the child (spawn imports this file)."""
    import torch

    from tailored.engine.types import ModelOutput
    from tailored.stack import build_stack

    torch.set_num_threads(1)
    st = build_stack(None, device="cpu", max_model_len=4096, max_num_seqs=64,
                     max_num_batched_tokens=2048, kernels="off",
                     async_scheduling=False)  # the stub replaces execute, which is synchronous
    vocab = st.model_config.vocab_size
    steps: list[tuple[int, int, float]] = []  # (decode rows, prefill tokens, host ms)

    def execute(sched):
        t0 = time.perf_counter()
        dec = sum(1 for s in sched.seqs if len(s.token_ids) == 1)
        pre = sum(len(s.token_ids) for s in sched.seqs if len(s.token_ids) > 1)
        ms, host = _decode_ms(dec, d1, d32, h1, h32) if dec else (0.0, 0.0)
        ms += pre * prefill_ms_per_token
        t_host = time.perf_counter() + host / 1e3
        while time.perf_counter() < t_host:  # build + launch: Python holding the GIL
            pass
        time.sleep(ms / 1e3)  # the GPU: the GIL is free meanwhile
        out = ModelOutput(token_ids={s.request_id: 100 + (s.start_pos * 7919) % (vocab - 200)
                                     for s in sched.seqs if s.sample})
        steps.append((dec, pre, (time.perf_counter() - t0) * 1e3 - ms - host))
        return out

    st.engine.runner.execute = execute
    st.engine.sim_steps = steps
    return st


def build_stub_engine(**kw):
    return build_stub(**kw).engine


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--decode-ms", default="5.2,14.5", help="step time at B=1,B=32 (H200, graphs)")
    ap.add_argument("--prefill-ms-per-token", type=float, default=0.113)
    ap.add_argument("--host-ms", default="0,0",
                    help="host work per decode step at B=1,B=32 (Python holding the GIL before "
                         "the sleep, as the runner's build + launch; H200 run 3: 0.5,2.7)")
    ap.add_argument("--concurrency", default="1,32")
    ap.add_argument("--num-prompts", default="4,64")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="sys.setswitchinterval for the server (default: the server's own)")
    ap.add_argument("--engine-process", action="store_true",
                    help="run the engine in a child process, as `tailored serve` does by default "
                         "(kb/0014); the engine-thread figures are then not printed")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    d1, d32 = (float(x) for x in a.decode_ms.split(","))
    h1, h32 = (float(x) for x in a.host_ms.split(","))
    stub_kw = dict(d1=d1, d32=d32, h1=h1, h32=h32, prefill_ms_per_token=a.prefill_ms_per_token)

    def decode_ms(b: int) -> tuple[float, float]:
        return _decode_ms(b, d1, d32, h1, h32)

    import uvicorn

    from tailored.server.app import build_app
    from tailored.server.async_engine import AsyncEngine

    if a.switch_interval is not None:
        sys.setswitchinterval(a.switch_interval)
    if a.engine_process:
        from tailored.config import ModelConfig
        from tailored.server.engine_process import EngineProcess
        from tailored.stack import embedded_checkpoint
        from tailored.tokenizer import load_tokenizer

        tok = load_tokenizer(embedded_checkpoint())
        vocab = ModelConfig.from_dir(embedded_checkpoint()).vocab_size
        aengine = EngineProcess(build_stub_engine, stub_kw, timing_log_s=1e9,
                                switch_interval_s=a.switch_interval)
        aengine.start()
        steps, step_ms, st = [], [], None
        cpu = {"engine": 0.0}
    else:
        st = build_stub(**stub_kw)
        vocab, steps, tok = st.model_config.vocab_size, st.engine.sim_steps, st.tokenizer
        step_ms: list[tuple[int, float]] = []  # (decode rows, engine.step wall ms minus the sleep)
        real_step = st.engine.step
        cpu = {"engine": 0.0}

        def step():
            n = len(steps)
            t0 = time.perf_counter()
            c0 = time.thread_time()
            outs = real_step()
            cpu["engine"] += time.thread_time() - c0
            if len(steps) > n and steps[-1][1] == 0:
                d = steps[-1][0]
                step_ms.append((d, (time.perf_counter() - t0) * 1e3 - decode_ms(d)[0]))
            return outs

        st.engine.step = step
        st.engine.timer.reset = lambda: None  # keep every window for the summary printed below
        aengine = AsyncEngine(st.engine, timing_log_s=1e9)
    app = build_app(aengine, tok, "m", 4096)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           access_log=False))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    while not server.started:
        time.sleep(0.05)
    p0 = time.process_time()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        cmd = [sys.executable, "-m", "tailored.bench", "run", "--base-url", f"http://127.0.0.1:{port}",
               "--concurrency", a.concurrency, "--num-prompts", a.num_prompts,
               "--input-len", str(a.input_len), "--output-len", str(a.output_len), "--ignore-eos",
               "--num-warmups", "1", "--token-id-range", f"100,{vocab - 100}", "--out", str(out)]
        r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(
            Path(__file__).resolve().parent.parent)})
        if r.returncode:
            print(r.stdout[-3000:], r.stderr[-3000:])
            return 1
        res = json.loads(out.read_text())
    p_total = time.process_time() - p0
    server.should_exit = True
    th.join(10)
    rows = []
    for run in res["runs"]:
        c = run["max_concurrency"]
        sim = sum(decode_ms(c))  # the simulated step: GPU sleep + emulated host work
        itl, tpot = run["p50_itl_ms"], run["p50_tpot_ms"]
        rows.append({"concurrency": c, "sim_decode_ms": round(sim, 2), "itl_p50_ms": itl,
                     "tpot_p50_ms": tpot, "overhead_itl_ms": round(itl - sim, 2),
                     "ttft_p50_ms": run["p50_ttft_ms"], "output_tok_s": run["output_throughput"]})
    if st is None:  # --engine-process: the engine's figures stayed in the child
        print(f"engine in a child process; this (HTTP) process CPU {p_total:.2f} s")
        aengine.shutdown()
    else:
        dec_host = [h for d, p, h in steps if d and not p]
        n_tok = sum(max(d, 1) for d, _, _ in steps)
        print(f"process CPU {p_total:.2f} s, engine thread CPU in step() {cpu['engine']:.2f} s, "
              f"the rest (HTTP thread, uvicorn) {p_total - cpu['engine']:.2f} s = "
              f"{(p_total - cpu['engine']) / max(n_tok, 1) * 1e6:.0f} us per output token")
        print(f"switch interval {sys.getswitchinterval() * 1e3:.2f} ms; engine steps {len(steps)}, "
              f"stub host ms per decode step p50 {sorted(dec_host)[len(dec_host) // 2]:.3f}")
        for b in (1, 32):
            v = sorted(h for d, h in step_ms if d == b)
            if v:
                print(f"decode B={b}: engine.step host ms p50 {v[len(v) // 2]:.3f} (n={len(v)})")
        print("engine step timing (all runs):", st.engine.timer.summary().replace("; ", "\n  "))
    print("| conc | simulated step ms | ITL p50 | overhead | TPOT p50 | TTFT p50 | out tok/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['concurrency']} | {r['sim_decode_ms']} | {r['itl_p50_ms']:.2f} | "
              f"{r['overhead_itl_ms']:+.2f} | {r['tpot_p50_ms']:.2f} | {r['ttft_p50_ms']:.1f} | "
              f"{r['output_tok_s']:.1f} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
