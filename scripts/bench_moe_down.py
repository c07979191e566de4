#!/usr/bin/env python3
"""The decode down GEMM alone: the tiled `_down_kernel` as served (tuned.json's picks) against
the one-expert-a-program GEMVs (`moe_down_gemv`, kb/0059) over a sweep of (ROWS, warps, PAIRS).

Eight layers of distinct experts (256, spec §7) are cycled so the down weights a layer reads
(~171 MB FP8 / 342 MB bf16 at B=32) come from HBM, not from L2. Routing is random
(route_align up to its limit, else route_topk + moe_align), as the side by side's dummy
weights give. Each variant is one CUDA graph of the eight down launches, the median of
--rounds timings of --reps replays; µs per layer and TB/s over the distinct experts' down
bytes. rel = relative difference of the pair terms to the tiled kernel's (fp32 summation
order). Prints each row as it completes and a table per (precision, batch) last.

Usage (GPU): python3 scripts/bench_moe_down.py [--precisions fp8,bf16] [--batches 8,16,32]
             [--cfgs 16x8x2,32x8x1] [--json F]
"""

from __future__ import annotations

import argparse

import torch
from kernel_bench import manifest, row_log, time_graph

from tailored.kernels import dot_precision, moe, moe_down_gemv
from tailored.kernels.pdl import launch as pdl_launch
from tailored.ops import reference as ref

E, K, H, I, LAYERS = 256, 8, 2048, 512, 8
DEV = "cuda"  # a CPU dry run (tests) sets "cpu" and smaller dims
SWEEP = [(r, w, p) for r in (8, 16, 32, 64) for w in (4, 8, 16) for p in (1, 2)
         if r * 512 // (w * 32) <= 128]  # ≤ 128 fp32 weight registers a thread


def _downs(fp8: bool, g):
    """LAYERS down stacks: (down [E, H, I], its block scales or None)."""
    out = []
    for _ in range(LAYERS):
        dn = torch.randn(E, H, I, device=DEV, dtype=torch.bfloat16, generator=g) * I ** -0.5
        if not fp8:
            out.append((dn, None))
            continue
        from tailored.model import fp8 as fp8m

        q, s = fp8m.quantize_experts(dn, False)
        out.append((q, fp8m.expert_block_scales(s, False)))
        del dn
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--precisions", default="fp8,bf16")
    ap.add_argument("--batches", default="8,16,32")
    ap.add_argument("--cfgs", default=None, help="ROWSxWARPSxPAIRS,... instead of the sweep")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    sweep = ([tuple(int(v) for v in c.split("x")) for c in a.cfgs.split(",")] if a.cfgs
             else SWEEP)
    g = torch.Generator(device=DEV).manual_seed(0)
    record, rows = row_log(
        manifest(a, "random (seed 0), 8 layers of 256 experts' down [2048, 512]"), a.json,
        lambda r: f"{r['precision']} B={r['B']} {r['variant']:<14} {r['us']:7.2f} us "
                  f"{r['tb_s']:5.2f} TB/s rel {r['rel']:.1e}")
    for prec in a.precisions.split(","):
        fp8 = prec == "fp8"
        layers = _downs(fp8, g)
        for B in (int(b) for b in a.batches.split(",")):
            args, distinct = [], 0
            for dn, sdn in layers:
                logits = torch.randn(B, E, device=DEV, dtype=torch.bfloat16, generator=g)
                if B <= moe.ROUTE_ALIGN_USE_UP_TO:
                    w, ids, *aligned = moe.route_align(logits, K)
                else:
                    w, ids = ref.route_topk(logits, K)
                    aligned = moe.moe_align(ids, E)
                order, offsets, *rest = aligned
                compact = moe.COMPACT_GRID and B * K < E
                experts = (rest[0] if rest else moe.expert_partition(offsets)) if compact \
                    else offsets
                act = torch.randn(B * K, I, device=DEV, dtype=torch.bfloat16, generator=g)
                y = torch.empty(B * K, H, device=DEV, dtype=torch.float32)
                s = sdn if fp8 else act
                ss = (sdn.stride(0), sdn.stride(1)) if fp8 else (0, 0)
                args.append(((act, dn, order, offsets, experts, w.reshape(-1).contiguous(), y,
                              s, act.stride(0), dn.stride(0), dn.stride(1), y.stride(0), *ss),
                             B * K if compact else E, compact, y))
                distinct += len(set(ids.flatten().tolist()))
            nbytes = distinct / LAYERS * H * I * (1 if fp8 else 2)
            x = args[0][0][0]
            bucket = triton_bucket(B * K)

            def tiled():
                for dn_args, grid_e, compact, y in args:
                    moe._launch_down(dn_args, grid_e, H, I, 16, 64, 128, 4,
                                     dot_precision(torch.bfloat16), bucket, fp8, compact, True,
                                     x)
                return [y for *_, y in args]

            def gemv(cfg):
                def run():
                    for dn_args, grid_e, compact, y in args:
                        moe_down_gemv.launch(dn_args, grid_e, H, I, fp8, compact, pdl_launch(x),
                                             cfg)
                    return [y for *_, y in args]
                return run

            us, ref_ys = time_graph(tiled, LAYERS, a.reps, a.rounds)
            record({"precision": prec, "B": B, "variant": "tiled", "us": us,
                    "tb_s": nbytes / (us * 1e-6) / 1e12, "rel": 0.0})
            for cfg in sweep:
                us, ys = time_graph(gemv(cfg), LAYERS, a.reps, a.rounds)
                rel = max(((p - q).norm() / q.norm()).item() for p, q in zip(ys, ref_ys))
                record({"precision": prec, "B": B, "variant": "gemv %dx%dx%d" % cfg, "us": us,
                        "tb_s": nbytes / (us * 1e-6) / 1e12, "rel": rel})
    print("\n| precision | B | tiled µs | best GEMV (ROWSxWARPSxPAIRS) µs | TB/s tiled → GEMV |")
    print("|---|---|---|---|---|")
    for prec in a.precisions.split(","):
        for B in (int(b) for b in a.batches.split(",")):
            rs = [r for r in rows if r["precision"] == prec and r["B"] == B]
            if not rs:
                continue
            t = rs[0]
            best = min(rs[1:], key=lambda r: r["us"], default=t)
            print(f"| {prec} | {B} | {t['us']:.2f} | {best['us']:.2f} ({best['variant']}) | "
                  f"{t['tb_s']:.2f} → {best['tb_s']:.2f} |")


def triton_bucket(pairs: int) -> int:
    """fused_moe's pair-count bucket of a decode launch (its tuning key)."""
    import triton

    return triton.next_power_of_2(pairs)


if __name__ == "__main__":
    main()
