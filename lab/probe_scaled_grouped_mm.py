"""Does this torch run FP8 grouped GEMMs (CUTLASS's sm90 grouped kernel behind
`torch._scaled_grouped_mm`, torch >= 2.8) at the MoE's prefill shapes, and how fast beside
today's paths? (issue 56 item 1: "a maintained kernel library beats our own kernel wherever it
is faster"; kb/0061: our Triton W8A8 experts; kb/0031: bf16 `torch._grouped_mm` over experts
dequantized each layer.)

One layer's routed experts (E=256, top-8, H=2048, I=512), T tokens routed uniformly at random,
pairs sorted by expert with each expert's rows padded to a multiple of 16 (the grouped kernel's
row alignment; the pads are counted in its time, not in its TFLOP/s). Per T, each GEMM (gate_up
[P, 2048] x [2048, 1024], down [P, 512] x [512, 2048]):
  bf16        torch._grouped_mm over bf16 experts (the grouped path's GEMMs; its per-layer
              dequantisation of all 256 experts is timed alone as "dequant")
  rowwise     torch._scaled_grouped_mm: activations e4m3 with one scale a row, experts e4m3
              requantised with one scale an output channel (from the checkpoint's 128x128
              blocks: a load-time conversion that changes the weights' rounding)
  blockwise   torch.nn.functional.scaled_grouped_mm with the checkpoint's own recipe
              (activations 1x128, weights 128x128), where this torch and GPU accept it
Prints whether each ran, µs, TFLOP/s over the real pairs and the relative error against fp32
over the checkpoint's dequantised weights.
Usage (GPU): python lab/probe_scaled_grouped_mm.py [--tokens 1024,8192]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from tailored.kernels.fp8_quant import quantize_groups
from tailored.model import fp8 as fp8mod

import bench_moe_prefill  # lab/: run from the repository root, as its other scripts

E, K_TOP, H, I, ALIGN = 256, 8, 2048, 512, 16
E4M3_MAX = 448.0


def timed(fn, reps=20) -> float:
    return bench_moe_prefill.timed(fn, reps) * 1e3  # µs


def rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., R, C] → e4m3 codes and one fp32 scale a row [..., R] (amax / 448)."""
    s = x.float().abs().amax(dim=-1).clamp(min=1e-12) / E4M3_MAX
    return (x.float() / s.unsqueeze(-1)).to(torch.float8_e4m3fn), s


def experts(N: int, K: int, g) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """E experts [N, K]: block-FP8 codes and scales as a checkpoint holds them, and their fp32
    dequantisation."""
    w32 = torch.randn(E, N, K, device="cuda", generator=g) * K ** -0.5
    qs, ss = zip(*(fp8mod.quantize_block(w32[e]) for e in range(E)))
    q, s = torch.stack(qs), torch.stack(ss)
    wd = torch.stack([fp8mod.dequantize_block(q[e], s[e], torch.float32) for e in range(E)])
    return q, s, wd


def routed_rows(T: int, g) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(expert of each padded row or -1 for a pad, group ends int32 [E], real pairs)."""
    ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:K_TOP] for _ in range(T)])
    counts = torch.bincount(ids.flatten(), minlength=E)
    padded = (counts + ALIGN - 1) // ALIGN * ALIGN
    ends = torch.cumsum(padded, 0).to(torch.int32)
    owner = torch.full((int(ends[-1]),), -1, dtype=torch.long, device="cuda")
    start = 0
    for e in range(E):
        owner[start:start + int(counts[e])] = e
        start += int(padded[e])
    return owner, ends, T * K_TOP


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1024,8192")
    a = ap.parse_args()
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()}, "
          f"_scaled_grouped_mm: {hasattr(torch, '_scaled_grouped_mm')}, "
          f"F.scaled_grouped_mm: {hasattr(F, 'scaled_grouped_mm')}")
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, N, K in (("gate_up", 2 * I, H), ("down", H, I)):
        q, s, wd32 = experts(N, K, g)
        wd = wd32.to(torch.bfloat16)
        wq_row, ws_row = rowwise(wd32)  # [E, N, K] e4m3, [E, N]
        t_deq = timed(lambda: torch.stack([fp8mod.dequantize_block(q[e], s[e], torch.bfloat16)
                                           for e in range(E)]), reps=3)
        print(f"{name}: dequantising all {E} experts (the grouped path's per-layer scratch, "
              f"as a loop here): {t_deq:.0f} µs", flush=True)
        for T in [int(t) for t in a.tokens.split(",")]:
            owner, ends, pairs = routed_rows(T, g)
            P = owner.numel()
            x = torch.randn(P, K, device="cuda", generator=g).to(torch.bfloat16)
            x[owner < 0] = 0
            ref = torch.zeros(P, N, device="cuda")
            real = owner >= 0
            for e in owner[real].unique().tolist():
                rows = owner == e
                ref[rows] = x[rows].float() @ wd32[e].t()
            flop = 2 * pairs * N * K

            def rel(y):
                return ((y.float() - ref)[real].norm() / ref[real].norm()).item()

            line = f"{name:7s} T={T:5d} rows={P:6d} (pads {P - pairs:5d}) |"
            t = timed(lambda: torch._grouped_mm(x, wd.transpose(1, 2), offs=ends))
            y = torch._grouped_mm(x, wd.transpose(1, 2), offs=ends)
            line += f" bf16 {t:8.1f} µs {flop / t / 1e6:5.0f} TFLOP/s rel {rel(y):.1e} |"
            try:
                xq, xs = rowwise(x)

                def run_row():
                    return torch._scaled_grouped_mm(xq, wq_row.transpose(1, 2), xs, ws_row,
                                                    offs=ends, out_dtype=torch.bfloat16)
                y = run_row()
                t = timed(run_row)
                t_q = timed(lambda: rowwise(x))
                line += (f" rowwise {t:8.1f} µs {flop / t / 1e6:5.0f} TFLOP/s (+quant {t_q:.0f}) "
                         f"rel {rel(y):.1e} |")
            except Exception as e:
                line += f" rowwise: {type(e).__name__}: {str(e)[:140]} |"
            try:
                xq, xs = quantize_groups(x)  # [P, K] e4m3, [P, K/128]

                def run_block():
                    return F.scaled_grouped_mm(
                        xq, q.transpose(1, 2), xs, F.ScalingType.BlockWise1x128,
                        s.transpose(1, 2), F.ScalingType.BlockWise128x128, offs=ends)
                y = run_block()
                t = timed(run_block)
                line += f" blockwise {t:8.1f} µs {flop / t / 1e6:5.0f} TFLOP/s rel {rel(y):.1e}"
            except Exception as e:
                line += f" blockwise: {type(e).__name__}: {str(e)[:140]}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
