"""Block-FP8 weight → bf16 in one pass: how the kernel path holds an FP8 checkpoint's dense
projections (the `fp8_dense_dequant` switch, kb/0026, kb/0029), dequantized once at start.

The W8A16 Triton GEMM (`fp8_linear`) has an ~11 µs floor per decode GEMV at K = 2048 and lost
2.6× to cuBLAS bf16 at M = 1024 (kb/0009); with the weights held in bf16 cuBLAS runs them all.
(A variant ran it per prefill call into a scratch buffer, `TAILORED_FP8_DEQUANT_FROM`: its A/B
matched holding them dequantized at prefill and lost at decode, so it went, kb/0029.)

The rounding is the reference's (`tailored.model.fp8.dequantize_block`): q · scale in fp32,
rounded once to the output dtype, so the GEMM that follows computes exactly what the plain
PyTorch path of an FP8 checkpoint computes. Tests: tests/kernels/test_fp8_kernels.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tailored.kernels.fp8_linear import SCALE_BLOCK
from tailored.kernels.pdl import enter as pdl_enter
from tailored.kernels.pdl import launch as pdl_launch


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, y_ptr, N, K, stride_wn, stride_sn, stride_yn,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PDL: tl.constexpr = False):
    if PDL:  # kernels/pdl.py: wait for the previous kernel first
        pdl_enter()
    # one [BLOCK_N, BLOCK_K] tile; BLOCK_K divides 128, so the tile's rows share one K block
    # and each row needs one scale
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    k = k0 + tl.arange(0, BLOCK_K)
    n_ok = n < N
    mask = n_ok[:, None] & (k < K)[None, :]
    w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_wn + k[None, :], mask=mask, other=0.0)
    s = tl.load(s_ptr + n.to(tl.int64) * stride_sn + k0 // 128, mask=n_ok, other=0.0)
    y = w.to(tl.float32) * s[:, None]
    tl.store(y_ptr + n[:, None].to(tl.int64) * stride_yn + k[None, :],
             y.to(y_ptr.dtype.element_ty), mask=mask)


def dequantize_rows(weight: torch.Tensor, scale_rows: torch.Tensor,
                    out: torch.Tensor | None = None, dtype=torch.bfloat16) -> torch.Tensor:
    """weight [N, K] float8_e4m3fn (unit column stride), scale_rows [N, ceil(K/128)] fp32
    (`fp8.row_scales`) → [N, K] in `dtype` (or written into `out`, a [N, K] tensor of any
    float dtype with a unit column stride): weight · scale rounded once, bitwise
    `fp8.dequantize_block` of the block scales.

    Raises ValueError on mismatched shapes, dtypes or strides."""
    N, K = weight.shape
    if weight.dtype != torch.float8_e4m3fn or scale_rows.shape != (N, triton.cdiv(K, SCALE_BLOCK)):
        raise ValueError(f"dequantize_rows: weight{tuple(weight.shape)} {weight.dtype} "
                         f"scale_rows{tuple(scale_rows.shape)}: need a float8_e4m3fn weight "
                         f"[N, K] and scale_rows [N, ceil(K/128)]")
    if out is None:
        out = torch.empty(N, K, dtype=dtype, device=weight.device)
    if out.shape != (N, K) or out.stride(1) != 1 or weight.stride(1) != 1 \
            or scale_rows.stride(1) != 1 or scale_rows.dtype != torch.float32:
        raise ValueError(f"dequantize_rows: out{tuple(out.shape)} stride {out.stride()}, weight "
                         f"stride {weight.stride()}, scale_rows {scale_rows.dtype} stride "
                         f"{scale_rows.stride()}: need [N, K] and unit column strides, fp32 scales")
    if N and K:
        # 64 rows x 128 columns: 8 KB of FP8 in, 16 KB of bf16 out per program; memory bound,
        # nothing to tune (one config: no start-up tuning, kb/0020)
        bn, bk = 64, min(128, max(16, triton.next_power_of_2(K)))
        _dequant_kernel[(triton.cdiv(N, bn), triton.cdiv(K, bk))](
            weight, scale_rows, out, N, K, weight.stride(0), scale_rows.stride(0), out.stride(0),
            BLOCK_N=bn, BLOCK_K=bk, num_warps=4, **pdl_launch(out))
    return out

