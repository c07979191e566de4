#!/usr/bin/env python3
"""NVFP4 W4A16 kernels at decode rows (kb/0065): the lm_head GEMV (`nvfp4_gemv`, [248320,
2048]) and the MoE pair GEMVs (`nvfp4_moe_pairs`, 256 experts [1024, 2048] / [2048, 512], k = 8)
against cuBLAS over the same weights dequantized to bf16 (what serving would run without the
kernel), with TB/s over the bytes each variant must read (packed codes + e4m3 scales for
NVFP4; the experts the step routes to, once each). Issue 48's bar: ≥ 80 % of HBM bandwidth
at one row (H200 ~4.8 TB/s, H100 ~3.35).

Enough weight copies are cycled to span 3 × the L2, so every call reads HBM; each variant is
one CUDA graph (`kernel_bench.time_graph`); rel = relative difference to the fp32 reference.
With --cfgs also a sweep of the GEMV's (ROWS, BLOCK_K, warps) and the MoE's (ROWS, warps).

Usage (GPU): python3 lab/bench_nvfp4_gemv.py [--batches 1,2,4,8,16] [--cfgs] [--json F]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
from kernel_bench import manifest, row_log, time_graph

from tailored.kernels.nvfp4_gemv import nvfp4_gemv
from tailored.kernels.nvfp4_moe import nvfp4_moe_pairs
from tailored.model import nvfp4
from tailored.ops import reference as ref

L2 = 50 * 2 ** 20


def _copies(make, nbytes: int) -> list:
    return [make(i) for i in range(max(1, -(-3 * L2 // nbytes)))]


def bench_lm_head(args, record):
    V, H = 248320, 2048
    torch.manual_seed(0)
    p, s, s2 = nvfp4.quantize(torch.randn(V, H, device="cuda") * H ** -0.5)
    wb = nvfp4.dequantize(p, s, s2, torch.bfloat16)
    nbytes = p.numel() + s.numel()
    ws = _copies(lambda i: (p.clone(), s.clone(), s2.clone()), nbytes)
    cfgs = [None] + (list(itertools.product((4, 8, 16), (256, 512, 1024), (2, 4, 8)))
                     if args.cfgs else [])
    for T in args.batches:
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        want = F.linear(x.float(), wb.float())
        us, ys = time_graph(lambda: [F.linear(x, wb)], 1, args.reps, args.rounds)
        record({"kernel": "lm_head", "variant": "cublas_bf16", "T": T, "us": us,
                "tbs": wb.numel() * 2 / us / 1e6, "rel": _rel(ys[0], want)})
        for cfg in cfgs:
            us, ys = time_graph(lambda: [nvfp4_gemv(x, *w, cfg=cfg) for w in ws], len(ws),
                                args.reps, args.rounds)
            record({"kernel": "lm_head", "variant": f"nvfp4_gemv {cfg or 'CFG'}", "T": T,
                    "us": us, "tbs": nbytes / us / 1e6, "rel": _rel(ys[0], want)})


def bench_moe(args, record):
    E, H, inter, k = 256, 2048, 512, 8
    torch.manual_seed(1)
    gu = nvfp4.quantize_experts(torch.randn(E, 2 * inter, H, device="cuda") * H ** -0.5, 2)
    dn = nvfp4.quantize_experts(torch.randn(E, H, inter, device="cuda") * inter ** -0.5, 1)
    per_expert = (gu[0][0].numel() + gu[1][0].numel() + dn[0][0].numel() + dn[1][0].numel())
    ws = _copies(lambda i: ([t.clone() for t in gu], [t.clone() for t in dn]), per_expert * E)
    cfgs = [None] + (list(itertools.product(((4, 4), (8, 4), (16, 4), (8, 8)), repeat=2))
                     if args.cfgs else [])
    for T in args.batches:
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        w, ids = ref.route_topk(torch.randn(T, E, device="cuda", dtype=torch.bfloat16), k)
        touched = ids.unique().numel() * per_expert
        want = ref.moe_experts(x.float(), w.float(), ids, nvfp4.DequantExperts(*gu, torch.float32),
                               nvfp4.DequantExperts(*dn, torch.float32))
        for cfg in cfgs:
            gcfg, dcfg = cfg or (None, None)
            us, ys = time_graph(lambda: [nvfp4_moe_pairs(x, w, ids, g, d, gcfg, dcfg)
                                         for g, d in ws], len(ws), args.reps, args.rounds)
            got = ys[0].view(T, k, H).sum(1)
            record({"kernel": "moe", "variant": f"nvfp4_moe_pairs {cfg or 'CFG'}", "T": T,
                    "us": us, "tbs": touched / us / 1e6, "rel": _rel(got, want)})


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--cfgs", action="store_true", help="sweep the launch configs")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    record, rows = row_log(manifest(args, "random, NVFP4 by the reference quantizer"), args.json,
                           lambda r: f"{r['kernel']:8s} T={r['T']:2d} {r['variant']:40s} "
                                     f"{r['us']:8.1f} µs {r['tbs']:5.2f} TB/s rel {r['rel']:.1e}")
    with torch.inference_mode():
        bench_lm_head(args, record)
        bench_moe(args, record)


if __name__ == "__main__":
    main()
