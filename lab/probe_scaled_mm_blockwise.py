"""Does this torch's `torch._scaled_mm` run DeepSeek-style block-scaled FP8 GEMMs (activations
1×128, weights 128×128) on this GPU, and does it beat today's dense FP8 prefill path (cuBLAS over
the dequantized bf16 copy, kb/0026) at prefill row counts? (kb/0061 §6: a library path would
beat writing our own W8A8 dense kernel.)

torch ≥ 2.9 dispatches that recipe to cuBLASLt on sm90 when built with CUDA ≥ 12.9 (pytorch
PR #158037). The layouts it takes (its test_scaled_mm_block_wise_numerics): a [M, K] e4m3 with
scale_a [M, K/128] fp32 M-major (strides (1, M)); b = w.t() for w [N, K] e4m3, scale_b the
weight's block scales [N/128, K/128], K/128 padded to a multiple of 4, transposed (strides
(1, L4)). Activations from `fp8_quant.quantize_groups` (power-of-two scales).

For the model's FP8 dense shapes at each --rows: prints whether the call ran, its relative
error against the fp32 reference over the dequantized operands (and the W8A16 result's against
the same reference), and µs / TFLOP/s of: bf16 cuBLAS over the dequantized weight (today),
quantize_groups alone, _scaled_mm alone, and quantize + _scaled_mm.
Usage: python lab/probe_scaled_mm_blockwise.py [--rows 1024,8192]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from tailored.kernels.fp8_quant import dequantize_groups, quantize_groups
from tailored.model import fp8 as fp8mod

import bench_moe_prefill  # lab/: run from the repository root, as its other scripts

# (name, N, K) of the FP8 dense projections (full config: GDN qkv|z, GDN out, attention q|k|v
# with the output gate, attention o, shared expert gate|up and down)
SHAPES = [("gdn_in_qkvz", 12288, 2048), ("gdn_out", 2048, 4096), ("attn_qkv", 9216, 2048),
          ("attn_o", 2048, 4096), ("shared_gate_up", 1024, 2048), ("shared_down", 2048, 512)]


def timed(fn, reps=20) -> float:
    """Median µs of `reps` calls (bench_moe_prefill's CUDA-event timer, in µs)."""
    return bench_moe_prefill.timed(fn, reps) * 1e3


def scaled_mm_blockwise(q, s, w, ws_t):
    """q [M, K] e4m3 with scales s [M, K/128] → q·s @ (w·ws)ᵀ in bf16 through torch._scaled_mm
    (ws_t: the weight scales prepared by `weight_scales`)."""
    return torch._scaled_mm(q, w.t(), scale_a=s.t().contiguous().t(), scale_b=ws_t,
                            out_dtype=torch.bfloat16)


def weight_scales(ws: torch.Tensor) -> torch.Tensor:
    """[N/128, K/128] block scales → [L4, N/128] with strides (1, L4), L4 = K/128 rounded up
    to 4."""
    nb, kb = ws.shape
    pad = torch.zeros(nb, -(-kb // 4) * 4, dtype=torch.float32, device=ws.device)
    pad[:, :kb] = ws
    return pad.t()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1024,8192")
    a = ap.parse_args()
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"{torch.cuda.get_device_name()} sm{''.join(map(str, torch.cuda.get_device_capability()))}")
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, N, K in SHAPES:
        w32 = torch.randn(N, K, device="cuda", generator=g) * K ** -0.5
        w, ws = fp8mod.quantize_block(w32)
        wd32 = fp8mod.dequantize_block(w, ws, torch.float32)
        wd = wd32.to(torch.bfloat16)
        ws_t = weight_scales(ws)
        for M in [int(m) for m in a.rows.split(",")]:
            x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
            q, s = quantize_groups(x)
            ref = dequantize_groups(q, s) @ wd32.t()
            flop = 2 * M * N * K
            t_bf16 = timed(lambda: F.linear(x, wd))
            a16 = ((F.linear(x, wd).float() - x.float() @ wd32.t()).norm()
                   / (x.float() @ wd32.t()).norm()).item()
            line = (f"{name:15s} M={M:5d} N={N:5d} K={K:4d}  bf16 cuBLAS {t_bf16:7.1f} µs "
                    f"({flop / t_bf16 / 1e6:5.0f} TFLOP/s, rel vs exact {a16:.1e})")
            try:
                y = scaled_mm_blockwise(q, s, w, ws_t)
                rel = ((y.float() - ref).norm() / ref.norm()).item()
                t_mm = timed(lambda: scaled_mm_blockwise(q, s, w, ws_t))
                t_q = timed(lambda: quantize_groups(x))
                t_all = timed(lambda: scaled_mm_blockwise(*quantize_groups(x), w, ws_t))
                a8 = ((y.float() - x.float() @ wd32.t()).norm()
                      / (x.float() @ wd32.t()).norm()).item()
                line += (f" | _scaled_mm {t_mm:7.1f} µs ({flop / t_mm / 1e6:5.0f} TFLOP/s), "
                         f"quant {t_q:6.1f}, both {t_all:7.1f} µs ({t_bf16 / t_all:.2f}x); "
                         f"rel vs its reference {rel:.1e}, W8A8 vs exact {a8:.1e}")
            except Exception as e:  # not supported by this build / GPU: say so
                line += f" | _scaled_mm: {type(e).__name__}: {str(e)[:160]}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
