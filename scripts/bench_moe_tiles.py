"""Launch-config sweep of the MoE expert GEMMs at decode batches (kb/0044): every config of a
grid timed on its own, not only the autotuner's candidates.

Why: at B=32 the FP8 `_down_kernel` streams its ~171 MB a layer at 2.3 TB/s (73.7 µs) where
gate_up reaches 3.8 TB/s (session 25 run1). down's K is I = 512, so a program of BLOCK_N = 64
rows streams only 32 KB in 4 K iterations: the hypothesis is that the fixed cost of each of its
~5200 programs (the expert id → offsets → pair ids chain, the pipeline's fill) dominates, and
that wider N tiles (128, 256, outside the autotuner's 16-64) stream closer to HBM speed.
Measured (session 27, kb/0044 §4): wrong with bf16 dots (the tuned 64-wide tile is the best);
right only with float16 dots, 128 x 128 x 4 warps x 4 stages, 62.2 -> 54.7 µs a layer.

Published shapes (E=256, k=8, H=2048, I=512); 8 layers of distinct expert weights cycled in one
CUDA graph so the experts come from HBM, not the 50 MB L2; routing from random logits
(`ref.route_topk` + `moe.moe_align`, outside the graph). Each config's output is compared with
the first config's: the relative difference is the fp32 sum order (~1e-7; 0 for FP8, whose
128-wide dots keep one sum sequence), larger means a broken config.

Usage: python scripts/bench_moe_tiles.py [--fp8] [--kernel down|gate_up] [--batches 8,16,32]
       [--json F]
FP8 down: the grid with bf16 dots, then its six fastest with float16 dots (session 28 made
the best of these an autotuner candidate, `moe._tuned`'s down_f16; kb/0045). A config worth
more goes into `moe._tuned`'s candidates and is then measured in the model with bench_decode.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton
from kernel_bench import time_graph

from tailored.kernels import dot_precision, moe
from tailored.ops import reference as ref

E, K, H, I, LAYERS = 256, 8, 2048, 512, 8


def grid(kernel: str):
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) to try; K of down is 512, of gate_up 2048."""
    kdim = I if kernel == "down" else H
    out = []
    for bn, bk, w, st in itertools.product((32, 64, 128, 256), (128, 256, 512), (4, 8),
                                           (1, 2, 3, 4)):
        iters = kdim // bk
        if (iters == 1) != (st == 1) or st > min(iters + 1, 4):
            continue  # stages beyond the K loop's length pipeline nothing
        if kernel == "gate_up" and bn == 256:
            continue  # two [K, 256] weight tiles a stage: past the shared memory
        out.append((bn, bk, w, st))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", choices=("down", "gate_up"), default="down")
    ap.add_argument("--batches", default="8,16,32")
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", default=None)
    ap.add_argument("--check", action="store_true",
                    help="CPU (TRITON_INTERPRET=1): one layer, one config, one batch, no timing")
    a = ap.parse_args()
    global LAYERS
    dev, dt = ("cpu" if a.check else "cuda"), torch.bfloat16
    if a.check:
        LAYERS = 1
    g = torch.Generator(device=dev).manual_seed(0)
    gu = [torch.randn(E, 2 * I, H, device=dev, dtype=dt, generator=g) * H ** -0.5
          for _ in range(LAYERS)]
    dn = [torch.randn(E, H, I, device=dev, dtype=dt, generator=g) * I ** -0.5
          for _ in range(LAYERS)]
    s_gu = s_dn = [None] * LAYERS
    if a.fp8:
        from tailored.model import fp8

        s_gu, s_dn = [], []
        for li in range(LAYERS):
            qgu, sgu = fp8.quantize_experts(gu[li], True)
            qdn, sdn = fp8.quantize_experts(dn[li], False)
            gu[li], dn[li] = qgu, qdn
            s_gu.append(fp8.expert_block_scales(sgu, True).contiguous())
            s_dn.append(fp8.expert_block_scales(sdn, False).contiguous())
    wbytes = 1 if a.fp8 else 2
    per_expert = (I if a.kernel == "down" else 2 * I) * H * wbytes
    prec = dot_precision(dt)
    # gate_up as served; down with bf16 dots first (float16 for the six fastest below)
    f16 = a.fp8 and a.kernel == "gate_up" and moe.FP8_DOT_F16
    rows = []
    for B in [int(b) for b in a.batches.split(",")]:
        x = torch.randn(B, H, device=dev, dtype=dt, generator=g)
        act = torch.randn(B * K, I, device=dev, dtype=dt, generator=g)
        compact = moe.COMPACT_GRID and B * K < E
        grid_e = B * K if compact else E
        bucket = triton.next_power_of_2(B * K)
        layers, distinct = [], 0
        for _ in range(LAYERS):
            w, ids = ref.route_topk(torch.randn(B, E, device=dev, dtype=dt, generator=g), K)
            order, offsets = moe.moe_align(ids, E)
            experts = moe.expert_partition(offsets) if compact else offsets
            layers.append((w.reshape(-1).contiguous(), order, offsets, experts))
            distinct += len(set(ids.flatten().tolist())) / LAYERS

        def step(cfg, f16=f16):
            bn, bk, warps, st = cfg
            outs = []
            for li, (rw, order, offsets, experts) in enumerate(layers):
                if a.kernel == "down":
                    y = torch.empty(B * K, H, dtype=torch.float32, device=dev)
                    s = s_dn[li] if a.fp8 else x
                    moe._down_kernel[(grid_e, triton.cdiv(H, bn))](
                        act, dn[li], order, offsets, experts, rw, y, s,
                        act.stride(0), dn[li].stride(0), dn[li].stride(1), y.stride(0),
                        *((s.stride(0), s.stride(1)) if a.fp8 else (0, 0)),
                        H=H, I=I, BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk,
                        KB=min(bk, 128) if a.fp8 else bk, DOT_PREC=prec, PAIRS_BUCKET=bucket,
                        W_FP8=a.fp8, COMPACT=compact, DOT_F16=f16, num_warps=warps,
                        num_stages=st)
                else:
                    y = torch.empty(B * K, I, dtype=dt, device=dev)
                    s = s_gu[li] if a.fp8 else x
                    moe._gate_up_kernel[(grid_e, triton.cdiv(I, bn))](
                        x, gu[li], order, offsets, experts, y, s, K,
                        x.stride(0), gu[li].stride(0), gu[li].stride(1), y.stride(0),
                        *((s.stride(0), s.stride(1)) if a.fp8 else (0, 0)),
                        triton.cdiv(I, 128), H=H, I=I, BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk,
                        KB=min(bk, 128) if a.fp8 else bk, DOT_PREC=prec, PAIRS_BUCKET=bucket,
                        W_FP8=a.fp8, COMPACT=compact, DOT_F16=f16, num_warps=warps,
                        num_stages=st)
                outs.append(y)
            return outs

        if a.check:
            y = step(grid(a.kernel)[0])[0]
            print(f"check B={B}: {tuple(y.shape)} finite {bool(y.float().isfinite().all())}")
            return
        res, ref_out = [], None
        for cfg in grid(a.kernel):
            try:
                us, outs = time_graph(lambda: step(cfg), LAYERS, a.reps, 3)
            except Exception as e:  # out of shared memory / registers: not a candidate
                print(f"B={B} {cfg}: {type(e).__name__}: {str(e)[:80]}", flush=True)
                torch.cuda.synchronize()
                continue
            if ref_out is None:
                ref_out = outs
            rel = max(((p - q).float().norm() / q.float().norm().clamp_min(1e-30)).item()
                      for p, q in zip(outs, ref_out))
            tbs = distinct * per_expert / (us * 1e-6) / 1e12
            res.append({"batch": B, "cfg": cfg, "us": us, "tb_s": tbs, "rel_vs_first": rel})
            print(f"B={B} {cfg}: {us:.1f} us {tbs:.2f} TB/s rel {rel:.1e}", flush=True)
        res.sort(key=lambda r: r["us"])
        if a.kernel == "down" and a.fp8 and not f16:
            # the six fastest again with float16 dots (FP8_DOWN_F16's pow2 rows, kb/0042):
            # with wider tiles the down GEMM may turn ALU-bound on e4m3 -> bf16, as gate_up was
            for r in list(res[:6]):
                us, outs = time_graph(lambda: step(r["cfg"], True), LAYERS, a.reps, 3)
                rel = max(((p - q).float().norm() / q.float().norm().clamp_min(1e-30)).item()
                          for p, q in zip(outs, ref_out))
                print(f"B={B} {r['cfg']} f16 dots: {us:.1f} us rel {rel:.1e}", flush=True)
                res.append({"batch": B, "cfg": r["cfg"], "us": us, "f16": True,
                            "tb_s": distinct * per_expert / (us * 1e-6) / 1e12,
                            "rel_vs_first": rel})
            res.sort(key=lambda r: r["us"])
        rows += res
        print(f"\nB={B} ({distinct:.0f} experts, compact={compact}), fastest first:")
        print("| BLOCK_N | BLOCK_K | warps | stages | dots | µs/layer | TB/s | rel |\n"
              "|---|---|---|---|---|---|---|---|")
        for r in res[:10]:
            print("| %d | %d | %d | %d | " % r["cfg"] + ("f16" if r.get("f16") else "bf16")
                  + f" | {r['us']:.1f} | {r['tb_s']:.2f} | {r['rel_vs_first']:.0e} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"kernel": a.kernel, "fp8": a.fp8, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
