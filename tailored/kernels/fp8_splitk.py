"""W8A16 GEMM for block-FP8 dense weights at decode rows, wide N tiles and split K (kb/0045 §4):
y = x · (W_fp8 ⊙ s)ᵀ. Bench only so far (`scripts/bench_fp8_gemv.py --splitk`); FastPath does
not call it.

Why: at 3–64 rows FP8 serving runs its dense projections through cuBLAS over a dequantized bf16
copy (`FastPath`, `FP8_DENSE_DEQUANT`, kb/0026): ~1.4 ms of the 10.4 ms FP8 B=32 step reads
2.8 GB where the FP8 weights are 1.4 GB. The tiled W8A16 GEMM (`fp8_linear`) lost to it at 8
and 32 rows (0.3–1.5 TB/s, kb/0043 §0). Hypothesis (session 28): not its K loop's latency but
the activation tile it re-reads for every N block — at 32 rows a [32, 128] bf16 x tile (8 KB)
per [128, 64] FP8 weight tile (8 KB), so x's L2 traffic equals the weight bytes at BLOCK_N 64
(and 4x them at 16). The FP8 MoE down GEMM showed the same shape of result (kb/0044 §4): only
128-wide tiles, with float16 dots, lifted it from 2.7 to 3.1 TB/s. Here N tiles are 128–256
wide (x re-read 2–4x less), and K is split over programs (K_SPLIT per program) to keep
enough programs in flight with so few N blocks: each program writes an fp32 partial
[M, BLOCK_N] of its K range, and a second launch sums the partials in split order (a
deterministic sum; fixed for a given split) and rounds to x's dtype. One split writes y directly.

Numerics: per 128-wide K block an fp32 dot scaled by its rows' block scale, summed in K order
within a split, then the splits summed in order: the reference's products in another fp32
summation order (cuBLAS over bf16(q·s) rounds the weights first). DOT_F16: float16 dots with
each activation row scaled by a power of 2 first (`fp8_linear.pow2_rows_f16`, as the MoE
down GEMM): the bf16 dots' products for bf16 activations.

Reference: `tailored.model.fp8.dequantize_block` then `F.linear` (tests/test_fp8_kernels.py).
Split-K as in CUTLASS's "split-K serial/parallel" GEMMs (parallel: partials + a reduction).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tailored.kernels import dot_precision
from tailored.kernels.fp8_linear import SCALE_BLOCK, tile_dot
from tailored.kernels.pdl import enter as pdl_enter
from tailored.kernels.pdl import launch as pdl_launch


@triton.jit
def _splitk_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, K_SPLIT, stride_xm, stride_wn,
                   stride_sn, stride_os, stride_om, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F16: tl.constexpr,
                   PDL: tl.constexpr = False):
    # program (n block, split, m block): K range [split·K_SPLIT, +K_SPLIT) in 128-wide dots
    # (one block scale each); out is the fp32 partials [splits, M, N] or, with one split, y
    if PDL:  # kernels/pdl.py: wait for the previous kernel first
        pdl_enter()
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < M
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    k_lo = pid_s * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, 128):
        kk = k0 + tl.arange(0, 128)
        k_ok = kk < k_hi
        a = tl.load(x_ptr + m[:, None].to(tl.int64) * stride_xm + kk[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + n[None, :].to(tl.int64) * stride_wn + kk[:, None],
                    mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tile_dot(acc, a, w, s_ptr, n, n_ok, stride_sn, k0, DOT_PREC, True, 1, DOT_F16,
                       DOT_F16)
    tl.store(out_ptr + pid_s * stride_os + m[:, None].to(tl.int64) * stride_om + n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _reduce_kernel(p_ptr, y_ptr, MN, SPLITS: tl.constexpr, stride_ps, BLOCK: tl.constexpr,
                   PDL: tl.constexpr = False):
    # y (flat [M·N], contiguous) = Σ_s partial[s] in split order, rounded once to y's dtype
    if PDL:
        pdl_enter()
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(p_ptr + s * stride_ps + i, mask=ok, other=0.0)
    tl.store(y_ptr + i, acc.to(y_ptr.dtype.element_ty), mask=ok)


def _block_m(M: int) -> int:
    return 16 if M <= 16 else 32 if M <= 32 else 64


def fp8_linear_splitk(x: torch.Tensor, weight: torch.Tensor, scale_rows: torch.Tensor,
                      k_split: int, block_n: int = 128, num_warps: int = 4,
                      num_stages: int = 3, dot_f16: bool = False) -> torch.Tensor:
    """x [M, K] (bf16/fp32, unit column stride) · dequant(weight)ᵀ → [M, N] in x.dtype.

    weight: [N, K] float8_e4m3fn (unit column stride); scale_rows: [N, ceil(K/128)] fp32
    (`fp8.row_scales`). k_split: K per program, a positive multiple of 128 (ceil(K / k_split)
    splits; one split writes y directly, more write fp32 partials [splits, M, N] summed by a
    second launch). block_n: N tile (16–256, power of 2); dot_f16: float16 dots with
    power-of-2 row scaling (bf16 activations; fp32 ones keep fp32 dots). Raises ValueError on
    mismatched shapes or dtypes, or a k_split that is not a positive multiple of 128.
    """
    M, K = x.shape
    N, K2 = weight.shape
    if (K2 != K or weight.dtype != torch.float8_e4m3fn
            or scale_rows.shape != (N, triton.cdiv(K, SCALE_BLOCK))
            or scale_rows.dtype != torch.float32):
        raise ValueError(f"fp8_linear_splitk: x{tuple(x.shape)} weight{tuple(weight.shape)} "
                         f"{weight.dtype} scale_rows{tuple(scale_rows.shape)} "
                         f"{scale_rows.dtype}")
    if k_split <= 0 or k_split % SCALE_BLOCK:
        raise ValueError(f"fp8_linear_splitk: k_split {k_split} is not a positive multiple "
                         f"of {SCALE_BLOCK}")
    if weight.stride(1) != 1 or scale_rows.stride(1) != 1:
        raise ValueError("fp8_linear_splitk: weight and scale_rows need a unit column stride")
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    splits = triton.cdiv(K, k_split)
    out = y if splits == 1 else torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    bm = _block_m(M)
    f16 = dot_f16 and x.dtype == torch.bfloat16
    _splitk_kernel[(triton.cdiv(N, block_n), splits, triton.cdiv(M, bm))](
        x, weight, scale_rows, out, M, N, K, k_split, x.stride(0), weight.stride(0),
        scale_rows.stride(0), out.stride(0) if splits > 1 else 0, N,
        BLOCK_M=bm, BLOCK_N=block_n, DOT_PREC=dot_precision(x.dtype), DOT_F16=f16,
        num_warps=num_warps, num_stages=num_stages, **pdl_launch(x))
    if splits > 1:
        block = 1024
        _reduce_kernel[(triton.cdiv(M * N, block),)](
            out, y, M * N, SPLITS=splits, stride_ps=out.stride(0), BLOCK=block, num_warps=4,
            **pdl_launch(x))
    return y
