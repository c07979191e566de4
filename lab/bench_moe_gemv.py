#!/usr/bin/env python3
"""The B=1–2 MoE layer: tiled expert GEMMs (`moe.route_fused_moe`) against the GEMV kernels
(`moe_gemv.route_gemv_moe`) over a sweep of their (ROWS, num_warps), kb/0039.

Eight layers of distinct experts (256 routed + the shared one stacked as expert 256, spec §7)
are cycled so the ~57 MB (bf16) a layer reads come from HBM, not from the 50 MB L2. Each
variant is one CUDA graph of the eight layers (routing inside the gate_up launch + down), the
median of --rounds timings of --reps replays; µs per layer and TB/s over the 9 experts' bytes a
token. The GEMV sweep: gate_up's config with down fixed, then down's with the best gate_up.
Prints each row as it completes and a table last; rel = relative difference to the tiled
pair terms (different fp32 summation order).

Usage (GPU): python3 lab/bench_moe_gemv.py [--precisions bf16,fp8] [--batches 1,2] [--json F]
"""

from __future__ import annotations

import argparse
import torch
from kernel_bench import manifest, row_log, time_graph

from tailored.kernels import moe, moe_gemv

E, K, H, I, LAYERS = 256, 8, 2048, 512, 8


def _experts(fp8: bool, g):
    """LAYERS stacks of E+1 experts: (gate_up, down, gate_up_scale, down_scale) each."""
    out = []
    for _ in range(LAYERS):
        gu = torch.randn(E + 1, 2 * I, H, device="cuda", dtype=torch.bfloat16, generator=g) * H ** -0.5
        dn = torch.randn(E + 1, H, I, device="cuda", dtype=torch.bfloat16, generator=g) * I ** -0.5
        if not fp8:
            out.append((gu, dn, None, None))
            continue
        from tailored.model import fp8 as fp8m

        qgu, sgu = fp8m.quantize_experts(gu, True)
        qdn, sdn = fp8m.quantize_experts(dn, False)
        out.append((qgu, qdn, fp8m.expert_block_scales(sgu, True),
                    fp8m.expert_block_scales(sdn, False)))
        del gu, dn
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--precisions", default="bf16,fp8")
    ap.add_argument("--batches", default="1,2")
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    record, rows = row_log(
        manifest(a, "random (seed 0), 8 layers of 256+1 experts, H=2048, I=512, k=8"), a.json,
        lambda r: f"{r['precision']} T={r['T']} {r['variant']:<22} {r['us']:7.2f} us "
                  f"{r['tb_s']:5.2f} TB/s rel {r['rel']:.1e}")

    for prec in a.precisions.split(","):
        layers = _experts(prec == "fp8", g)
        wbytes = 1 if prec == "fp8" else 2
        for T in (int(b) for b in a.batches.split(",")):
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
            logits = [torch.randn(T, E, device="cuda", dtype=torch.bfloat16, generator=g)
                      for _ in range(LAYERS)]
            seg = torch.randn(T, 1, device="cuda", dtype=torch.bfloat16, generator=g)
            distinct = sum(len(set(torch.topk(lg.float(), K).indices.flatten().tolist())) + 1
                           for lg in logits) / LAYERS
            nbytes = distinct * 3 * H * I * wbytes

            def run(fn, **kw):
                return lambda: [fn(x, logits[li], K, gu, dn, seg, sgu, sdn, **kw)[0]
                                for li, (gu, dn, sgu, sdn) in enumerate(layers)]

            def row(variant, us, ys, ref):
                rel = max(((p - q).norm() / q.norm()).item() for p, q in zip(ys, ref))
                record({"precision": prec, "T": T, "variant": variant, "us": us,
                        "tb_s": nbytes / (us * 1e-6) / 1e12, "rel": rel})

            us, ref = time_graph(run(moe.route_fused_moe), LAYERS, a.reps, a.rounds)
            row("tiled", us, ref, ref)
            best_gu, best_us = None, float("inf")
            dn_fixed = moe_gemv.CFG[prec, min(T, 2)][1]
            for r in (2, 4, 8, 16):
                for w in (2, 4, 8):
                    try:
                        us, ys = time_graph(run(moe_gemv.route_gemv_moe, gate_up_cfg=(r, w),
                                                down_cfg=dn_fixed), LAYERS, a.reps, a.rounds)
                    except Exception as e:  # a config that does not compile: say so, go on
                        print(f"gate_up {r}x{w}: {type(e).__name__}: {str(e)[:200]}")
                        continue
                    row(f"gemv gu {r}x{w} dn {dn_fixed[0]}x{dn_fixed[1]}", us, ys, ref)
                    if us < best_us:
                        best_gu, best_us = (r, w), us
            for r in (4, 8, 16, 32, 64) if best_gu else ():  # no gate_up config ran: skip
                for w in (2, 4, 8):
                    if (r, w) == dn_fixed:
                        continue
                    try:
                        us, ys = time_graph(run(moe_gemv.route_gemv_moe, gate_up_cfg=best_gu,
                                                down_cfg=(r, w)), LAYERS, a.reps, a.rounds)
                    except Exception as e:
                        print(f"down {r}x{w}: {type(e).__name__}: {str(e)[:200]}")
                        continue
                    row(f"gemv gu {best_gu[0]}x{best_gu[1]} dn {r}x{w}", us, ys, ref)
        layers = None  # free the stacks (the closures above read the name)
        torch.cuda.empty_cache()
    print("\n| precision | T | variant | µs/layer | TB/s | rel |\n|---|---|---|---|---|---|")
    for p in a.precisions.split(","):
        for T in sorted({r["T"] for r in rows}):
            sel = [r for r in rows if r["precision"] == p and r["T"] == T]
            if not sel:
                continue
            tiled = [r for r in sel if r["variant"] == "tiled"]
            best = min((r for r in sel if r["variant"] != "tiled"), key=lambda r: r["us"],
                       default=None)
            for r in tiled + ([best] if best else []):
                print(f"| {p} | {T} | {r['variant']} | {r['us']:.2f} | {r['tb_s']:.2f} | "
                      f"{r['rel']:.1e} |")


if __name__ == "__main__":
    main()
