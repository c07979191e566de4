"""MoE experts of a prefill step on the GPU, one layer at the published shapes (E=256 routed +
the shared expert stacked as expert 256, k=8+1, H=2048, I=512): where the 8192-token step's
largest cost goes (kb/0029 §6: gate_up + down ~134 ms of a 314 ms FP8 step, ~15 % of the
tensor peak) and what a better grouped GEMM would give.

Variants, each timed alone (CUDA events, median of --reps calls after a warm-up):
  tuned        `fused_moe` as served (autotuned, the tuned.json table).
  fixed:...    `fused_moe`'s fixed-config path with (BLOCK_M, BLOCK_N, BLOCK_K, warps) forced,
               to see whether larger M tiles (128) help: 8192 tokens give ~290 rows an expert.
  grouped_mm   torch._grouped_mm (CUTLASS grouped GEMM, bf16 only): pairs sorted by expert
               (`moe_align`), rows gathered, gate_up GEMM, silu·mul, down GEMM, weighted.
               FP8: the experts dequantized to bf16 first, that time shown apart ("+deq").
Prints ms per layer, TFLOP/s over 6·pairs·H·I and the relative difference to `tuned`.
Usage: python scripts/bench_moe_prefill.py [--tokens 1024,8192] [--fp8] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from tailored.kernels import moe
from tailored.model import fp8 as fp8mod

E, K, H, I = 257, 9, 2048, 512  # the shared expert stacked as expert 256, slot 8 of every token
FIXED = [(64, 64, 64, 4), (64, 128, 64, 8), (128, 64, 64, 8), (128, 128, 64, 8),
         (128, 64, 128, 8), (128, 128, 32, 8)]


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


def grouped_mm_moe(x, w, ids, gu_t, dn_t):
    """Σ_i w_i · Expert_{e_i}(x) through torch._grouped_mm; [T·k, H] fp32 pair terms in
    (token, slot) order like fused_moe(reduce=False). gu_t [E, H, 2I], dn_t [E, I, H]
    (column-major views of the checkpoint's [E, 2I, H] / [E, H, I])."""
    T, k = ids.shape
    order, offsets = moe.moe_align(ids, E)
    xs = x.index_select(0, (order // k).long())
    h = torch._grouped_mm(xs, gu_t, offs=offsets[1:])
    act = F.silu(h[:, :I]) * h[:, I:]
    y = torch._grouped_mm(act, dn_t, offs=offsets[1:])
    out = torch.empty(T * k, H, dtype=torch.float32, device=x.device)
    out[order.long()] = y.float() * w.reshape(-1)[order.long()].float()[:, None]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1024,8192")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--fp8", action="store_true")
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

        from tailored.kernels.fp8_dequant import dequantize_rows

        rs = [fp8mod.row_scales(s, q.shape[1]).view(-1, s.shape[-1])
              for q, s in ((qgu, scales[0]), (qdn, scales[1]))]

        def dequant():  # every expert to bf16 with the dense-weight kernel (rows = E·N)
            return tuple(dequantize_rows(q.view(-1, q.shape[-1]), r).view(q.shape)
                         for q, r in zip((qgu, qdn), rs))
    else:
        wgu, wdn = gu, dn
    rows = []
    for T in [int(t) for t in a.tokens.split(",")]:
        x = torch.randn(T, H, device=dev, dtype=dt, generator=g)
        routed = torch.rand(T, 256, device=dev, generator=g).topk(8, dim=1).indices
        ids = torch.cat([routed, torch.full((T, 1), 256, device=dev)], 1)
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
            if a.fp8:
                dgu, ddn = dequant()
                res["dequant"] = timed(dequant, a.reps)
            else:
                dgu, ddn = gu, dn
            gu_t, dn_t = dgu.transpose(1, 2), ddn.transpose(1, 2)
            out = grouped_mm_moe(x, w, ids, gu_t, dn_t)
            res["grouped_mm"] = timed(lambda: grouped_mm_moe(x, w, ids, gu_t, dn_t), a.reps)
            res["grouped_mm:rel"] = ((out - ref_out).norm() / ref_out.norm()).item()
            xs = x.index_select(0, torch.arange(T * K, device=dev) % T)
            order, offsets = moe.moe_align(ids, E)
            res["grouped_mm:gate_up_only"] = timed(
                lambda: torch._grouped_mm(xs, gu_t, offs=offsets[1:]), a.reps)
        except Exception as e:
            print(f"T={T} grouped_mm: {type(e).__name__}: {str(e)[:200]}", flush=True)
        row = {"tokens": T, "pairs": T * K, "gflop": flop / 1e9, "fp8": a.fp8, **res}
        rows.append(row)
        for name, ms in res.items():
            if name.endswith(":rel"):
                continue
            tf = flop / (ms * 1e-3) / 1e12
            rel = res.get(name + ":rel")
            print(f"T={T} {'fp8' if a.fp8 else 'bf16'} {name:24s} {ms:8.3f} ms  {tf:6.1f} TFLOP/s"
                  + (f"  rel {rel:.1e}" if rel is not None else ""), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
