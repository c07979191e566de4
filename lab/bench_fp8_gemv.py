#!/usr/bin/env python3
"""FP8 dense projections at decode rows: cuBLAS over the dequantized bf16 weight (what FP8
serving runs above the GEMV's rows, `fp8_dense_dequant`, kb/0026) against the tiled W8A16 GEMM
(`fp8_linear`) and, at 1–4 rows, the FP8 GEMV (`fp8_gemv`) over a sweep of its (ROWS,
BLOCK_K, warps), kb/0039 §4. Each shape as the kernel path launches it (model/projections.py):
its bf16 members (GDN b/a, the router and shared-expert gate) in the same launch.

For each decode shape of the model (spec §3–§6; per step: GDN in/out × 30, attention qkv/o ×
10; the shared expert's in/down at 2 rows × 40) enough copies of the weight are cycled that
they span 3 × the L2, so every call reads HBM. Each variant is one CUDA graph over the copies;
µs per call = median of --rounds timings of --reps replays; TB/s over the variant's weight
bytes. Prints each row as it completes and a table last; rel = relative difference to the fp32
reference over the dequantized weight.

With --bf16 also `bf16_gemv` over the bf16 weight (the same sweep; kb/0039 §7.3). Batches
above 4 rows (the GEMV's limit) time cuBLAS and `fp8_linear` (bf16 dots; autotuned at its
first call, outside the graph; shapes without bf16 members only: its bf16 rows in the launch
gained nothing in the model for the MoE group and were removed, kb/0044). Its float16-dot
variant lost for every shape (kb/0043) and was removed.

With --splitk also the split-K GEMM (`fp8_splitk.fp8_linear_splitk`, kb/0045 §4: 64-256 wide N
tiles, K split over programs, bf16 or float16 dots) over a grid of its configs on each shape's
FP8 rows, against cuBLAS over the same rows' bf16 copy (`cublas_fp8rows`); the last table has
the best config by shape and batch. The hypothesis (kb/0045 §4): the tiled GEMM is bound by
re-reading the activations for every 64-wide N tile, not by its K loop.

Usage (GPU): python3 lab/bench_fp8_gemv.py [--batches 1,2] [--bf16] [--json F]   (~1-2 min)
             python3 lab/bench_fp8_gemv.py --batches 8,16,32,64 (the tiled GEMMs only)
             python3 lab/bench_fp8_gemv.py --batches 8,32 --splitk   (~2-3 min)
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from kernel_bench import manifest, row_log, time_graph

from tailored.kernels.fp8_gemv import bf16_gemv, fp8_gemv
from tailored.kernels.fp8_linear import fp8_linear
from tailored.kernels.fp8_splitk import fp8_linear_splitk
from tailored.model import fp8

# (FP8 rows N, bf16 rows NB in the same launch, K) as the kernel path runs them: GDN in = qkv|z FP8
# then b|a bf16; the MoE group = router|shared-expert gate bf16 first, then shared gate|up FP8
SHAPES = {"gdn_in": (12288, 64, 2048), "gdn_out": (2048, 0, 4096), "attn_qkv": (9216, 0, 2048),
          "attn_o": (2048, 0, 4096), "moe_in": (1024, 257, 2048), "shared_down": (2048, 0, 512)}
BF16_FIRST = {"moe_in"}
CONFIGS = [(r, bk, w) for r in (4, 8, 16) for bk in (512, 1024, 2048) for w in (4, 8)]


def splitk_configs(K: int) -> list[tuple[int, int, int, int, bool]]:
    """(k_split, BLOCK_N, num_warps, num_stages, float16 dots) for --splitk: K in 2-16 slices
    or whole, N tiles 64-256 (8 warps for 256)."""
    return [(ks, bn, 8 if bn == 256 else 4, st, f16)
            for ks in sorted({256, 512, 1024, K}) if ks <= K
            for bn in (64, 128, 256) for st in (3, 4) for f16 in (False, True)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,2")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--bf16", action="store_true",
                    help="also bf16_gemv over the bf16 weights (against cuBLAS bf16)")
    ap.add_argument("--splitk", action="store_true",
                    help="also the split-K GEMM's config grid on the FP8 rows (kb/0045 §4)")
    a = ap.parse_args()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    g = torch.Generator(device="cuda").manual_seed(0)
    record, rows = row_log(
        manifest(a, "random normal / sqrt(K), block-FP8 quantized (seed 0)"), a.json,
        lambda r: f"{r['shape']:<13} T={r['T']} {r['variant']:<18} {r['us']:7.2f} us "
                  f"{r['tb_s']:5.2f} TB/s rel {r['rel']:.1e}")

    for name, (N, NB, K) in SHAPES.items():
        first = name in BF16_FIRST
        copies = max(4, math.ceil(3 * l2 / ((N + 2 * NB) * K)))
        qs, ss, ws, bs = [], [], [], []
        for _ in range(copies):
            w = torch.randn(N, K, device="cuda", generator=g) * K ** -0.5
            q, s = fp8.quantize_block(w)
            qs.append(q)
            ss.append(fp8.row_scales(s, N))
            b = (torch.randn(NB, K, device="cuda", generator=g) * K ** -0.5).to(torch.bfloat16)
            bs.append(b if NB else None)
            wd = fp8.dequantize_block(q, s, torch.bfloat16)
            ws.append(torch.cat([b, wd] if first else [wd, b]))  # cuBLAS: the fused bf16 copy
        nbytes8 = N * K + 2 * NB * K
        for T in (int(b) for b in a.batches.split(",")):
            x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16, generator=g)
            ref = F.linear(x.float(), ws[-1].float())

            def run(label, fn, nbytes, want=None):
                try:
                    us, ys = time_graph(lambda: [fn(i) for i in range(copies)], copies,
                                        a.reps, a.rounds)
                    y = ys[-1]
                except Exception as e:  # a config that does not compile: say so, go on
                    print(f"{name} T={T} {label}: {type(e).__name__}: {str(e)[:200]}")
                    return
                r_ = ref if want is None else want
                rel = ((y.float() - r_).norm() / r_.norm()).item()
                record({"shape": name, "N": N, "K": K, "T": T, "variant": label, "us": us,
                        "tb_s": nbytes / (us * 1e-6) / 1e12, "rel": rel})

            run("cublas_bf16", lambda i: F.linear(x, ws[i]), 2 * (N + NB) * K)
            if not NB:  # fp8_linear has no bf16 rows in its launch
                run("fp8_linear", lambda i: fp8_linear(x, qs[i], ss[i]), nbytes8)
            if a.splitk:  # the FP8 rows alone: their bf16 copy through cuBLAS, then split-K
                rows8 = slice(NB, NB + N) if first else slice(0, N)
                ref8 = ref[:, rows8]
                run("cublas_fp8rows", lambda i: F.linear(x, ws[i][rows8]), 2 * N * K, ref8)
                for ks, bn, w, st, f16 in splitk_configs(K):
                    run(f"splitk {ks}x{bn}x{w}x{st}{' f16' if f16 else ''}",
                        lambda i, c=(ks, bn, w, st, f16): fp8_linear_splitk(
                            x, qs[i], ss[i], *c[:4], dot_f16=c[4]), N * K, ref8)
            if T > 4:  # past the GEMVs' rows
                continue
            for cfg in CONFIGS:
                run(f"gemv {cfg[0]}x{cfg[1]}x{cfg[2]}",
                    lambda i, cfg=cfg: fp8_gemv(x, qs[i], ss[i], cfg, bs[i], first), nbytes8)
            if a.bf16:  # the same GEMV over the bf16 weight (kb/0039 §7.3)
                for cfg in CONFIGS:
                    run(f"bf16gemv {cfg[0]}x{cfg[1]}x{cfg[2]}",
                        lambda i, cfg=cfg: bf16_gemv(x, ws[i], cfg), 2 * (N + NB) * K)
        qs = ss = ws = bs = None  # free the copies (the closures above read these names)
        torch.cuda.empty_cache()
    print("\n| shape | T | cuBLAS bf16 µs | fp8_linear µs (TB/s) |")
    print("|---|---|---|---|")
    for name in SHAPES:
        for T in sorted({r["T"] for r in rows}):
            sel = {r["variant"]: r for r in rows if r["shape"] == name and r["T"] == T}
            cb, fl = (sel.get(v) for v in ("cublas_bf16", "fp8_linear"))
            if cb or fl:
                nan = {"us": float("nan"), "tb_s": float("nan")}
                cb, fl = cb or nan, fl or nan
                print(f"| {name} | {T} | {cb['us']:.2f} | {fl['us']:.2f} ({fl['tb_s']:.2f}) |")
    print("\n| shape | T | cuBLAS bf16 µs | fp8_linear µs | best GEMV µs (cfg) | GEMV TB/s "
          "| best bf16 GEMV µs (cfg) |")
    print("|---|---|---|---|---|---|---|")
    for name in SHAPES:
        for T in sorted({r["T"] for r in rows}):
            sel = {r["variant"]: r for r in rows if r["shape"] == name and r["T"] == T}
            gem = [r for v, r in sel.items() if v.startswith("gemv")]
            if not gem:
                continue
            b = min(gem, key=lambda r: r["us"])
            g16 = min((r for v, r in sel.items() if v.startswith("bf16gemv")),
                      key=lambda r: r["us"], default=None)
            b16 = f"{g16['us']:.2f} ({g16['variant'][9:]})" if g16 else "-"
            cb, fl = sel.get("cublas_bf16"), sel.get("fp8_linear")
            print(f"| {name} | {T} | {cb['us'] if cb else float('nan'):.2f} | "
                  f"{fl['us'] if fl else float('nan'):.2f} | {b['us']:.2f} ({b['variant'][5:]}) "
                  f"| {b['tb_s']:.2f} | {b16} |")

    if a.splitk:
        print("\n| shape | T | cuBLAS bf16, FP8 rows µs | best split-K µs (k_split x BLOCK_N x "
              "warps x stages, dots) | TB/s | ratio |")
        print("|---|---|---|---|---|---|")
        for name in SHAPES:
            for T in sorted({r["T"] for r in rows}):
                sel = [r for r in rows if r["shape"] == name and r["T"] == T]
                sk = [r for r in sel if r["variant"].startswith("splitk") and r["rel"] < 2e-2]
                cb = next((r for r in sel if r["variant"] == "cublas_fp8rows"), None)
                if not sk or not cb:
                    continue
                b = min(sk, key=lambda r: r["us"])
                print(f"| {name} | {T} | {cb['us']:.2f} | {b['us']:.2f} ({b['variant'][7:]}) "
                      f"| {b['tb_s']:.2f} | {cb['us'] / b['us']:.2f}x |")


if __name__ == "__main__":
    main()
