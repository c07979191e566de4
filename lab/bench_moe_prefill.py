"""Routed experts of a prefill step on the GPU, one layer at the published shapes (E=256, k=8,
H=2048, I=512; the prefill path runs the shared expert as its own GEMMs): where the 8192-token step's
largest cost goes (kb/0029 §6: gate_up + down ~134 ms of a 314 ms FP8 step, ~15 % of the
tensor peak) and what a better grouped GEMM would give.

Variants, each timed alone (CUDA events, median of --reps calls after a warm-up):
  tuned        `fused_moe` as served (autotuned, the tuned.json table).
  fixed:...    `fused_moe`'s fixed-config path with (BLOCK_M, BLOCK_N, BLOCK_K, warps) forced,
               to see whether larger M tiles (128) help: 8192 tokens give ~290 rows an expert.
  grouped      `moe_grouped.grouped_experts` (torch._grouped_mm, CUTLASS's grouped GEMM, bf16
               only): pairs sorted by expert, rows gathered, gate_up GEMM, silu·mul, down
               GEMM, weighted unsort. FP8: the experts dequantized to bf16 first
               (`moe_grouped.dequantize_experts`, timed inside "grouped" and alone as
               "dequant").
  w8a8         FP8 only: `moe_w8a8.w8a8_experts_sorted` as the model calls it (x quantised per
               128-wide group, gate_up + silu·mul + act quantisation, down to bf16 sorted rows;
               kb/0061), its launch configs by `moe_w8a8.block_ms` and the autotuner.
  w8a8:G×D     the same with gate_up / down BLOCK_M forced (64×64, 64×128), to revisit
               `moe_w8a8.DOWN_BM128_ABOVE`; "quant" is the x quantisation alone.
  NVFP4 (--nvfp4; kb/0067): the experts quantized by the reference quantizer; "tuned",
  "fixed" and "grouped" run over their bf16 dequantization, and "grouped" and "scratch+fused"
  include refilling the bf16 scratch from the packed weights as the served path does each
  layer (`nvfp4_gemv.dequantize_into`, alone as "dequant"):
  scratch+fused `dequantize_into` + `fused_moe` (served below `moe_grouped_from`).
  w4a16        `nvfp4_grouped.nvfp4_grouped_experts_sorted` as the model calls it (the packed
               weights decoded in registers, no scratch), autotuned launch configs.
  w4a16:G×D    the same with gate_up / down BLOCK_M forced.
(A first run stacked the shared expert as expert 256, whose 8192 rows one program per N block
walked alone: a tail that no prefill step has; kb/0031.)
Prints µs per layer, TFLOP/s over 6·pairs·H·I and the relative difference to `tuned` (for
w8a8: the error the e4m3 activations add to the W8A16 result).
Usage: python lab/bench_moe_prefill.py [--tokens 1024,8192] [--fp8 | --nvfp4] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from tailored.kernels import fp8_quant, moe, moe_grouped, moe_w8a8, nvfp4_grouped
from tailored.kernels.nvfp4_gemv import dequantize_into
from tailored.model import fp8 as fp8mod
from tailored.model import nvfp4 as nvfp4mod

E, K, H, I = 256, 8, 2048, 512  # routed experts only: prefill runs the shared one apart
FIXED = [(64, 64, 64, 4), (128, 64, 64, 8), (128, 64, 128, 8)]
W8A8_BM = [(64, 64), (64, 128)]  # (gate_up, down) BLOCK_M forced


def timed(fn, reps: int) -> float:
    """Median ms of `reps` calls of fn (each between two CUDA events)."""
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1024,2048,4096,8192")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--nvfp4", action="store_true")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    gu = torch.randn(E, 2 * I, H, device=dev, dtype=dt, generator=g) * H ** -0.5
    dn = torch.randn(E, H, I, device=dev, dtype=dt, generator=g) * I ** -0.5
    scales = (None, None)
    if a.fp8:
        qgu, sgu = fp8mod.quantize_experts(gu, True)
        qdn, sdn = fp8mod.quantize_experts(dn, False)
        scales = (fp8mod.expert_block_scales(sgu, True), fp8mod.expert_block_scales(sdn, False))
        wgu, wdn = qgu, qdn
        scratch = (torch.empty_like(gu), torch.empty_like(dn))
        del gu, dn

        def dequant():
            return (moe_grouped.dequantize_experts(qgu, scales[0], True, out=scratch[0]),
                    moe_grouped.dequantize_experts(qdn, scales[1], False, out=scratch[1]))
    elif a.nvfp4:
        w4 = (nvfp4mod.quantize_experts(gu, 2), nvfp4mod.quantize_experts(dn, 1))
        scratch = (torch.empty_like(gu), torch.empty_like(dn))
        del gu, dn

        def dequant():
            return (dequantize_into(*w4[0], out=scratch[0]),
                    dequantize_into(*w4[1], out=scratch[1]))

        wgu, wdn = (t.clone() for t in dequant())  # fused_moe's operands: the served weights
    else:
        wgu, wdn = gu, dn

        def dequant():
            return gu, dn

    def grouped(x, w, ids):
        dgu, ddn = dequant()
        return moe_grouped.grouped_experts(x, w, ids, dgu, ddn)

    rows = []
    for T in [int(t) for t in a.tokens.split(",")]:
        x = torch.randn(T, H, device=dev, dtype=dt, generator=g)
        ids = torch.rand(T, E, device=dev, generator=g).topk(K, dim=1).indices
        w = torch.rand(T, K, device=dev, generator=g).to(dt)
        flop = 6 * T * K * H * I
        res = {}
        moe._LAUNCHERS.clear()
        ref_out = moe.fused_moe(x, w, ids, wgu, wdn, None, *scales, reduce=False)
        res["tuned"] = timed(lambda: moe.fused_moe(x, w, ids, wgu, wdn, None, *scales,
                                                   reduce=False), a.reps)
        auto, blocks = moe.autotune_enabled, moe._blocks
        try:
            moe.autotune_enabled = lambda *_: False
            for cfg in FIXED:
                moe._blocks = lambda *_, c=cfg: c
                name = "fixed:" + "x".join(map(str, cfg))
                try:
                    out = moe.fused_moe(x, w, ids, wgu, wdn, None, *scales, reduce=False)
                    res[name] = timed(lambda: moe.fused_moe(x, w, ids, wgu, wdn, None, *scales,
                                                            reduce=False), a.reps)
                    res[name + ":rel"] = ((out - ref_out).norm() / ref_out.norm()).item()
                except Exception as e:  # out of shared memory / registers: say so, go on
                    print(f"T={T} {name}: {type(e).__name__}: {str(e)[:120]}", flush=True)
        finally:
            moe.autotune_enabled, moe._blocks = auto, blocks
        try:
            out = grouped(x, w, ids)
            res["grouped"] = timed(lambda: grouped(x, w, ids), a.reps)
            res["grouped:rel"] = ((out - ref_out).norm() / ref_out.norm()).item()
            if a.fp8:
                res["dequant"] = timed(dequant, a.reps)
        except Exception as e:
            print(f"T={T} grouped: {type(e).__name__}: {str(e)[:200]}", flush=True)
        if a.nvfp4:
            res["dequant"] = timed(dequant, a.reps)
            res["scratch+fused"] = timed(lambda: (dequant(), moe.fused_moe(
                x, w, ids, *scratch, None, reduce=False)), a.reps)
            try:
                out = nvfp4_grouped.nvfp4_grouped_experts(x, w, ids, *w4)
                res["w4a16"] = timed(lambda: nvfp4_grouped.nvfp4_grouped_experts_sorted(
                    x, w, ids, *w4), a.reps)
                res["w4a16:rel"] = ((out - ref_out).norm() / ref_out.norm()).item()
                for bm in W8A8_BM:
                    name = "w4a16:" + "x".join(map(str, bm))
                    res[name] = timed(lambda bm=bm: nvfp4_grouped.nvfp4_grouped_sorted(
                        x, w, ids, *w4, block_m=bm), a.reps)
            except Exception as e:
                print(f"T={T} w4a16: {type(e).__name__}: {str(e)[:200]}", flush=True)
        if a.fp8:
            try:
                out = moe_w8a8.w8a8_experts(x, w, ids, wgu, wdn, *scales)
                res["w8a8"] = timed(lambda: moe_w8a8.w8a8_experts_sorted(
                    x, w, ids, wgu, wdn, *scales), a.reps)
                res["w8a8:rel"] = ((out - ref_out).norm() / ref_out.norm()).item()
                for bm in W8A8_BM:
                    name = "w8a8:" + "x".join(map(str, bm))
                    res[name] = timed(lambda bm=bm: moe_w8a8.w8a8_sorted(
                        x, w, ids, wgu, wdn, *scales, block_m=bm), a.reps)
                res["quant"] = timed(lambda: fp8_quant.quantize_groups(x), a.reps)
            except Exception as e:
                print(f"T={T} w8a8: {type(e).__name__}: {str(e)[:200]}", flush=True)
        row = {"tokens": T, "pairs": T * K, "gflop": flop / 1e9, "fp8": a.fp8,
               "nvfp4": a.nvfp4, **res}
        rows.append(row)
        for name, ms in res.items():
            if name.endswith(":rel"):
                continue
            tf = flop / (ms * 1e-3) / 1e12
            rel = res.get(name + ":rel")
            prec = "fp8" if a.fp8 else "nvfp4" if a.nvfp4 else "bf16"
            print(f"T={T} {prec} {name:24s} {ms * 1e3:8.0f} µs  "
                  f"{tf:6.1f} TFLOP/s"
                  + (f"  rel {rel:.1e}" if rel is not None else ""), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
