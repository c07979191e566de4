#!/usr/bin/env python3
"""The W8A8 block-FP8 GEMM (`kernels/fp8_w8a8.py`, kb/0056 §5) against what FP8 serving runs
for dense projections of 3-64 rows: cuBLAS over the dequantized bf16 copy (`FP8_DENSE_DEQUANT`,
kb/0026). Built blind in session 36: this bench says whether it is worth wiring into FastPath.

For each FP8 dense shape of the model (bench_fp8_gemv.py's SHAPES, FP8 rows only: GDN in
qkv|z, GDN out, attention qkv, attention o, shared expert gate|up and down) and each batch,
enough weight copies are cycled that they span 3 x the L2 (every call reads HBM), each variant
is one CUDA graph over the copies (`kernel_bench.time_graph`):
- cublas_bf16: F.linear over the bf16 copy (2 bytes a weight);
- quant: `quant_act` alone (the activation's e4m3 codes and group scales; once per input in
  the model, shared by the projections that read it);
- w8a8 KSxBNxWxST: `w8a8_linear` over a grid of (k_split, block_n, warps, stages), the
  quantized activation given (its cost is the quant row);
- w8a8q KSxBNxWxST: the same with the bf16 activation quantized inside the GEMM (xs None).
TB/s over the weight bytes of each. rel: relative difference to the fp32 product of the bf16
activation and the dequantized weight (the W8A16 reference), so w8a8's rel includes the
activation rounding; "vs ref" = against `w8a8_linear_ref` (the same quantized operands in fp32:
summation order only). A table last: per shape and batch, cuBLAS, the best w8a8 config and its
speed-up with and without the quant launch.

Usage (GPU): python3 scripts/bench_w8a8.py [--batches 8,32] [--json F]   (~2-3 min)
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from kernel_bench import manifest, row_log, time_graph

from tailored.kernels.fp8_w8a8 import dense_config, quant_act, w8a8_linear, w8a8_linear_ref
from tailored.model import fp8

# (N FP8 rows, K) of FastPath's FP8 dense projections (bench_fp8_gemv.SHAPES without the
# bf16 members of the fused launches)
SHAPES = {"gdn_in": (12288, 2048), "gdn_out": (2048, 4096), "attn_qkv": (9216, 2048),
          "attn_o": (2048, 4096), "shared_gate_up": (1024, 2048), "shared_down": (2048, 512)}


def configs(K: int) -> list[tuple[int, int, int, int]]:
    """(k_split, block_n, num_warps, num_stages): K whole or in 2-8 slices, 64/128-wide N, 4
    or 8 warps, 3 stages (16 configs; each compiles once for all shapes). The first row is
    `fp8_w8a8.dense_config`'s pick for (N, K) when it is not in the grid, see main."""
    return [(ks, bn, w, 3) for ks in sorted({K, K // 2, K // 4, K // 8}) if ks >= 128
            for bn in (64, 128) for w in (4, 8)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    g = torch.Generator(device="cuda").manual_seed(0)
    record, rows = row_log(
        manifest(a, "random normal / sqrt(K), block-FP8 quantized (seed 0)"), a.json,
        lambda r: f"{r['shape']:<15} T={r['T']:<3} {r['variant']:<18} {r['us']:7.2f} us "
                  f"{r['tb_s']:5.2f} TB/s rel {r['rel']:.1e} vs ref {r['rel_ref']:.1e}")
    for name, (N, K) in SHAPES.items():
        copies = max(4, math.ceil(3 * l2 / (N * K)))
        qs, ss, wds = [], [], []
        for _ in range(copies):
            w = torch.randn(N, K, device="cuda", generator=g) * K ** -0.5
            q, s = fp8.quantize_block(w)
            qs.append(q)
            ss.append(fp8.row_scales(s, N))
            wds.append(fp8.dequantize_block(q, s, torch.bfloat16))
        for T in (int(b) for b in a.batches.split(",")):
            x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16, generator=g)
            ref = F.linear(x.float(), wds[-1].float())
            xq, xs = quant_act(x)
            ref8 = w8a8_linear_ref(xq, xs, qs[-1], ss[-1], torch.float32)

            def run(label, fn, nbytes, quantized=True):
                try:
                    us, ys = time_graph(lambda: [fn(i) for i in range(copies)], copies,
                                        a.reps, a.rounds)
                except Exception as e:  # a config that does not compile: say so, go on
                    print(f"{name} T={T} {label}: {type(e).__name__}: {str(e)[:200]}")
                    return
                y = ys[-1]
                rel = rel_ref = float("nan")
                if y.shape == ref.shape:
                    rel = ((y.float() - ref).norm() / ref.norm()).item()
                    if quantized:
                        rel_ref = ((y.float() - ref8).norm() / ref8.norm()).item()
                record({"shape": name, "N": N, "K": K, "T": T, "variant": label, "us": us,
                        "tb_s": nbytes / (us * 1e-6) / 1e12, "rel": rel, "rel_ref": rel_ref})

            run("cublas_bf16", lambda i: F.linear(x, wds[i]), 2 * N * K, quantized=False)
            run("quant", lambda i: quant_act(x)[0], 2 * T * K, quantized=False)
            pick = dense_config(N, K)
            for ks, bn, w, st in [pick] + [c for c in configs(K) if c != pick]:
                run(f"w8a8 {ks}x{bn}x{w}x{st}",
                    lambda i, c=(ks, bn, w, st): w8a8_linear(
                        xq, xs, qs[i], ss[i], k_split=c[0], block_n=c[1], num_warps=c[2],
                        num_stages=c[3]), N * K)
                # the activation quantized inside the GEMM (the way FastPath would call it)
                run(f"w8a8q {ks}x{bn}x{w}x{st}",
                    lambda i, c=(ks, bn, w, st): w8a8_linear(
                        x, None, qs[i], ss[i], k_split=c[0], block_n=c[1], num_warps=c[2],
                        num_stages=c[3]), N * K)
            print(f"{name} T={T}: dense_config picks {pick}")
        del qs, ss, wds
        torch.cuda.empty_cache()
    print("\n| shape | T | cuBLAS bf16 µs (TB/s) | best w8a8 µs (TB/s) | config | quant µs | "
          "speed-up | with quant | quant inside: µs, config, speed-up | rel cuBLAS / w8a8 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in SHAPES:
        for T in sorted({r["T"] for r in rows}):
            sel = [r for r in rows if r["shape"] == name and r["T"] == T]
            cb = next((r for r in sel if r["variant"] == "cublas_bf16"), None)
            qa = next((r for r in sel if r["variant"] == "quant"), None)
            w8 = [r for r in sel if r["variant"].startswith("w8a8 ")]
            wq = [r for r in sel if r["variant"].startswith("w8a8q ")]
            if not (cb and qa and w8 and wq):
                continue
            best = min(w8, key=lambda r: r["us"])
            bq = min(wq, key=lambda r: r["us"])
            print(f"| {name} | {T} | {cb['us']:.2f} ({cb['tb_s']:.2f}) | {best['us']:.2f} "
                  f"({best['tb_s']:.2f}) | {best['variant'][5:]} | {qa['us']:.2f} | "
                  f"{cb['us'] / best['us']:.2f}x | {cb['us'] / (best['us'] + qa['us']):.2f}x | "
                  f"{bq['us']:.2f} {bq['variant'][6:]} {cb['us'] / bq['us']:.2f}x | "
                  f"{cb['rel']:.1e} / {best['rel']:.1e} |")


if __name__ == "__main__":
    main()
