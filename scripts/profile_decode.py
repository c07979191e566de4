#!/usr/bin/env python3
"""Where the time goes in one engine step of the plain-PyTorch path (issue 3 baseline profile).

Builds the model (full preset by default, dummy weights, bf16) on the GPU, prefills B requests
of --input-len tokens, then times decode steps at batch B (CUDA-synchronised wall time, median
of --steps) and the prefill of one --input-len prompt (TTFT proxy), and prints the top ops of
one decode step from torch.profiler plus the host-side time of the engine bookkeeping
(scheduler + detokenizer) measured with a no-op runner. Writes a JSON report with --out.

Usage (GPU machine): python3 scripts/profile_decode.py --batch 1,32 --out $OUT/profile.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tailored.config import EngineConfig, ModelConfig
from tailored.engine.engine import Engine
from tailored.engine.types import ModelOutput, SamplingParams
from tailored.model.batch import ForwardBatch, HybridCache
from tailored.synth import build_empty_model, init_dummy_weights, preset_config

BF16_BYTES_PER_TOKEN = 5.89e9  # spec §11.3, batch 1, weights only
HBM_BPS = 4.3e12  # device-to-device copy measured on our H200 (KINDS.md)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, n):
    out = []
    for _ in range(n):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def engine_overhead(cfg: ModelConfig, n_req: int, steps: int) -> float:
    """Host seconds per Engine.step() with a runner that returns instantly (no model)."""

    class NoopRunner:
        num_pages, num_slots = 100_000, n_req + 1

        def execute(self, sched):
            return ModelOutput({s.request_id: 1000 for s in sched.seqs if s.sample})

    class ByteTokenizer:  # stands in for the real one: no carried wheels needed on the GPU
        eos_token_ids = ()

        def token_bytes(self, i):
            return bytes([i % 128])

        def is_special(self, i):
            return False

        def decode(self, ids, skip_special_tokens=True):
            return bytes(i % 128 for i in ids).decode()

    eng = Engine(cfg, EngineConfig(max_num_seqs=n_req, max_model_len=4096), NoopRunner(),
                 ByteTokenizer())
    for i in range(n_req):
        eng.add_request(str(i), list(range(100, 164)), SamplingParams(max_tokens=steps + 10,
                                                                     temperature=0.0, ignore_eos=True))
    for _ in range(3):
        eng.step()
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    return (time.perf_counter() - t) / steps


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="full")
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--batch", default="1,32")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    cfg = ModelConfig.from_dict(preset_config(args.preset, args.num_layers))
    t0 = time.perf_counter()
    model = build_empty_model(cfg, dev, dt, with_mtp=False)
    init_dummy_weights(model, 0)
    sync()
    report = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
              "torch": torch.__version__, "preset": args.preset, "layers": cfg.num_hidden_layers,
              "init_s": time.perf_counter() - t0, "rows": []}
    batches = [int(b) for b in args.batch.split(",")]
    B_max, L = max(batches), args.input_len
    page = 16
    n_pages = B_max * (L // page + 4) + 1
    cache = HybridCache(cfg, n_pages, page, B_max + 1, dt, dev)
    pages = [list(range(1 + i * (L // page + 4), 1 + (i + 1) * (L // page + 4))) for i in range(B_max)]
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 248044, (L,), generator=g).tolist()

    def prefill(i):
        b = ForwardBatch.build([(prompt, 0, i + 1, True, pages[i])], [L - 1], dev)
        h = model(b, cache)
        return model.compute_logits(h[b.logits_rows])

    ttft = timed(lambda: prefill(0), 3)
    report["prefill_s"] = ttft
    for i in range(1, B_max):
        prefill(i)
    for B in batches:
        def step(B=B):
            b = ForwardBatch.build([([5], L, i + 1, False, pages[i]) for i in range(B)],
                                   list(range(B)), dev)
            h = model(b, cache)
            return model.compute_logits(h).argmax(-1).tolist()

        step()
        s = timed(step, args.steps)
        row = {"batch": B, "step_s": s, "tok_s": B / s,
               "roofline_fraction_b1": (BF16_BYTES_PER_TOKEN / HBM_BPS) / s if B == 1 else None}
        report["rows"].append(row)
        print(f"decode B={B}: {1000 * s:.1f} ms/step, {B / s:.1f} tok/s", flush=True)
    # profile one B=1 decode step
    if dev == "cuda":
        from torch.profiler import ProfilerActivity, profile

        b = ForwardBatch.build([([5], L, 1, False, pages[0])], [0], dev)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            model.compute_logits(model(b, cache)).argmax(-1).tolist()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=20)
        ev = prof.key_averages()
        report["profile_top"] = table
        report["kernel_launches"] = sum(e.count for e in ev if e.device_type.name == "CUDA")
        report["cuda_time_ms"] = sum(e.self_device_time_total for e in ev) / 1000
        print(table)
    report["engine_overhead_s"] = {str(n): engine_overhead(cfg, n, 50) for n in (1, 32)}
    print("\n| what | value |\n|---|---|")
    print(f"| prefill {L} tokens (TTFT proxy) | {1000 * ttft:.0f} ms |")
    for r in report["rows"]:
        print(f"| decode B={r['batch']} | {1000 * r['step_s']:.1f} ms/step = {r['tok_s']:.1f} tok/s |")
    if report["rows"] and report["rows"][0]["roofline_fraction_b1"]:
        print(f"| roofline fraction B=1 (bf16, 4.3 TB/s) | {report['rows'][0]['roofline_fraction_b1']:.3f} |")
    if "kernel_launches" in report:
        print(f"| CUDA kernels in one B=1 step | {report['kernel_launches']} |")
    for n, s in report["engine_overhead_s"].items():
        print(f"| engine bookkeeping per step, {n} requests | {1e3 * s:.2f} ms |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
