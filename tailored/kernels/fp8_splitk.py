"""W8A16 GEMM for block-FP8 dense weights at decode rows, wide N tiles and split K (kb/0045 §4):
y = x · (W_fp8 ⊙ s)ᵀ. The kernel path takes it for the FP8 dense projections of
(`fp8_gemv_up_to`, `fp8_dense_splitk_up_to`] rows (default 3-8: measured by shape, kb/0047 §2,
in the model kb/0049; bench: `lab/bench_fp8_gemv.py --splitk`, in the model: bench_decode's
`dense_splitk8` / `dense_splitk`).

Why: at 3–64 rows FP8 serving runs its dense projections through cuBLAS over a dequantized bf16
copy (the kernel path, `fp8_dense_dequant`, kb/0026): ~1.4 ms of the 10.4 ms FP8 B=32 step reads
2.8 GB where the FP8 weights are 1.4 GB. The tiled W8A16 GEMM (`fp8_linear`) lost to it at 8
and 32 rows (0.3–1.5 TB/s, kb/0043 §0). Hypothesis: not its K loop's latency but
the activation tile it re-reads for every N block — at 32 rows a [32, 128] bf16 x tile (8 KB)
per [128, 64] FP8 weight tile (8 KB), so x's L2 traffic equals the weight bytes at BLOCK_N 64
(and 4x them at 16). The FP8 MoE down GEMM showed the same shape of result (kb/0044 §4): only
128-wide tiles, with float16 dots, lifted it from 2.7 to 3.1 TB/s. Here N tiles are wider
(the bench tries 64–256: x re-read up to 4x less), and K is split over programs (K_SPLIT per
program) to keep enough programs in flight with so few N blocks: each program writes an fp32
partial [M, BLOCK_N] of its K range, and a second launch sums the partials in split order (a
deterministic sum; fixed for a given split) and rounds to x's dtype. One split writes y
directly. The partials cost traffic too (at 32 rows, 4 splits of GDN in: 6.3 MB written and
read, against 25 MB of weights, mostly in L2): the bench's split counts weigh that.

Numerics: per 128-wide K block an fp32 dot scaled by its rows' block scale, summed in K order
within a split, then the splits summed in order: the reference's products in another fp32
summation order (cuBLAS over bf16(q·s) rounds the weights first). DOT_F16: float16 dots with
each activation row scaled by a power of 2 first (`fp8_linear.pow2_rows_f16`, as the MoE
down GEMM): the bf16 dots' products for bf16 activations.

Reference: `tailored.model.fp8.dequantize_block` then `F.linear` (tests/kernels/test_fp8_kernels.py).
Split-K as in CUTLASS's "split-K serial/parallel" GEMMs (parallel: partials + a reduction).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tailored.kernels import dot_precision
from tailored.kernels.fp8_linear import SCALE_BLOCK, tile_dot
from tailored.kernels.fp8_linear import block_m as _linear_block_m
from tailored.kernels.pdl import enter as pdl_enter
from tailored.kernels.pdl import launch as pdl_launch


@triton.jit
def _acc_split(x_ptr, w_ptr, s_ptr, m, m_ok, n, n_ok, k_lo, k_hi, stride_xm, stride_wn,
               stride_sn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               DOT_PREC: tl.constexpr, W_FP8: tl.constexpr, DOT_F16: tl.constexpr,
               PDL: tl.constexpr):
    """[BLOCK_M, BLOCK_N] fp32: rows m of x times weight rows n over K range [k_lo, k_hi), in
    128-wide dots (FP8: one block scale each; bf16 rows: plain dots). The first weight tile
    is loaded before the PDL wait, as `fp8_gemv` does (kb/0040): weights are never written
    while serving, so their first DRAM latency overlaps the previous kernel's tail; x, which
    that kernel writes, is read after the wait. That tile is peeled off the loop."""
    w = _w_tile(w_ptr, n, n_ok, k_lo, k_hi, stride_wn)
    if PDL:  # kernels/pdl.py: wait for the previous kernel before reading x
        pdl_enter()
    a = _x_tile(x_ptr, m, m_ok, k_lo, k_hi, stride_xm)
    acc = tile_dot(tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), a, w, s_ptr, n, n_ok,
                   stride_sn, k_lo, DOT_PREC, W_FP8, 1, DOT_F16, DOT_F16)
    for k0 in range(k_lo + 128, k_hi, 128):
        a = _x_tile(x_ptr, m, m_ok, k0, k_hi, stride_xm)
        w = _w_tile(w_ptr, n, n_ok, k0, k_hi, stride_wn)
        acc = tile_dot(acc, a, w, s_ptr, n, n_ok, stride_sn, k0, DOT_PREC, W_FP8, 1, DOT_F16,
                       DOT_F16)  # (bf16 rows: W_FP8 False, a plain dot)
    return acc


@triton.jit
def _x_tile(x_ptr, m, m_ok, k0, k_hi, stride_xm):
    """x's rows m at K columns k0 .. k0 + 127 below k_hi: [BLOCK_M, 128], zeros past them."""
    kk = k0 + tl.arange(0, 128)
    return tl.load(x_ptr + m[:, None].to(tl.int64) * stride_xm + kk[None, :],
                   mask=m_ok[:, None] & (kk < k_hi)[None, :], other=0.0)


@triton.jit
def _w_tile(w_ptr, n, n_ok, k0, k_hi, stride_wn):
    """Weight rows n at K columns k0 .. k0 + 127 below k_hi, as [128, BLOCK_N] (K-major for
    the dot), zeros past them."""
    kk = k0 + tl.arange(0, 128)
    return tl.load(w_ptr + n[None, :].to(tl.int64) * stride_wn + kk[:, None],
                   mask=n_ok[None, :] & (kk < k_hi)[:, None], other=0.0)


@triton.jit
def _splitk_kernel(x_ptr, w_ptr, s_ptr, wb_ptr, out_ptr, M, N, NB, K, K_SPLIT, stride_xm,
                   stride_wn, stride_sn, stride_wbn, stride_os, stride_om, COL8, COLB,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
                   DOT_F16: tl.constexpr, PDL: tl.constexpr = False):
    # program (n block, split, m block) over K range [split·K_SPLIT, +K_SPLIT). N blocks 0 ..
    # cdiv(N, BLOCK_N) - 1: the N FP8 rows (w, s) into columns COL8..; the blocks after them:
    # the NB rows in x's dtype (wb: a fused projection's bf16 members, GDN b/a or the router
    # and shared-expert gate) into columns COLB.., as `fp8_gemv` lays them out. out: the fp32
    # partials [splits, M, N + NB] or, with one split, y. The PDL wait is in _acc_split.
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < M
    k_lo = pid_s * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    out = out_ptr + pid_s * stride_os + m[:, None].to(tl.int64) * stride_om
    p8 = tl.cdiv(N, BLOCK_N)
    if pid_n < p8:
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        acc = _acc_split(x_ptr, w_ptr, s_ptr, m, m_ok, n, n_ok, k_lo, k_hi, stride_xm,
                         stride_wn, stride_sn, BLOCK_M, BLOCK_N, DOT_PREC, True, DOT_F16, PDL)
        tl.store(out + COL8 + n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])
    else:
        n = (pid_n - p8) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < NB
        acc = _acc_split(x_ptr, wb_ptr, s_ptr, m, m_ok, n, n_ok, k_lo, k_hi, stride_xm,
                         stride_wbn, stride_sn, BLOCK_M, BLOCK_N, DOT_PREC, False, False, PDL)
        tl.store(out + COLB + n[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])


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


def block_m(M: int) -> int:
    """`fp8_linear`'s M tile, at most 64 (decode rows; the partials stay small)."""
    return min(64, _linear_block_m(M))


# (k_split, BLOCK_N, num_warps, num_stages, float16 dots) for a shape not in CFGS: a guess
# (K in 512-wide slices: 4 at K = 2048, one at the shared down's 512; the MoE down GEMM's
# 128-wide tiles), until the bench's winners fill CFGS.
CFG = (512, 128, 4, 3, False)
# by (N + NB, K, power-of-2 row bucket ≤ 64) at the model's decode shapes: GDN in (12352, 2048), GDN
# out / attention o (2048, 4096), attention qkv (9216, 2048), the MoE group (1281, 2048), the shared
# down (2048, 512). The H200 sweep (kb/0047 §2): at 8 rows the best split-K beat cuBLAS over the FP8
# rows' bf16 copy by 1.09-1.27x (attention qkv: a tie), with two K splits, 64-wide N tiles and
# float16 dots; at 32 rows it tied or lost (0.82-1.04x), so only the 3-8 row buckets have entries.
# The FP8 gate passed with them at 3-8 rows (kb/0049), the switch's default.
_ROWS8 = {
    (12352, 2048): (1024, 64, 4, 3, True),  # GDN in: 15.52 -> 12.75 us
    (2048, 4096): (1024, 64, 4, 3, True),   # GDN out 9.50 -> 7.68, attention o 9.51 -> 8.01
    (9216, 2048): (1024, 64, 4, 3, True),   # attention qkv: 11.94 -> 11.98 (a tie)
    (1281, 2048): (256, 64, 4, 3, True),    # the MoE group: 5.85 -> 4.91
    (2048, 512): (512, 64, 4, 4, True),     # the shared down: 3.74 -> 3.43
}
CFGS: dict[tuple[int, int, int], tuple[int, int, int, int, bool]] = {
    (n, k, rows): cfg for (n, k), cfg in _ROWS8.items() for rows in (4, 8)}


def config(n_total: int, K: int, rows: int) -> tuple[int, int, int, int, bool]:
    """The launch config for an [rows, K] x against n_total weight rows (CFGS, else CFG)."""
    return CFGS.get((n_total, K, min(64, triton.next_power_of_2(rows))), CFG)


def fp8_linear_splitk(x: torch.Tensor, weight: torch.Tensor, scale_rows: torch.Tensor,
                      k_split: int, block_n: int = 128, num_warps: int = 4,
                      num_stages: int = 3, dot_f16: bool = False,
                      other: torch.Tensor | None = None,
                      other_first: bool = False) -> torch.Tensor:
    """x [M, K] (bf16/fp32, unit column stride) · dequant(weight)ᵀ → [M, N] in x.dtype.

    weight: [N, K] float8_e4m3fn (unit column stride); scale_rows: [N, ceil(K/128)] fp32
    (`fp8.row_scales`). k_split: K per program, a positive multiple of 128 (ceil(K / k_split)
    splits; one split writes y directly, more write fp32 partials [splits, M, N + NB] summed
    by a second launch). block_n: N tile (16–256, power of 2); dot_f16: float16 dots with
    power-of-2 row scaling for the FP8 rows (bf16 activations; fp32 ones keep fp32 dots).
    other: [NB, K] rows in x's dtype (a fused projection's bf16 members) in the same launch;
    the output is then [M, N + NB], the FP8 rows' columns first, or last with other_first
    (`fp8_gemv`'s layout). Raises ValueError on mismatched shapes or dtypes, a k_split that
    is not a positive multiple of 128, another block_n, or partials past int32 offsets.
    """
    M, K = x.shape
    N, K2 = weight.shape
    NB = 0 if other is None or other.dim() != 2 else other.shape[0]
    if (K2 != K or weight.dtype != torch.float8_e4m3fn
            or scale_rows.shape != (N, triton.cdiv(K, SCALE_BLOCK))
            or scale_rows.dtype != torch.float32
            or (other is not None and (other.dim() != 2 or other.shape[1] != K
                                       or other.dtype != x.dtype))):
        raise ValueError(f"fp8_linear_splitk: x{tuple(x.shape)} {x.dtype} "
                         f"weight{tuple(weight.shape)} {weight.dtype} "
                         f"scale_rows{tuple(scale_rows.shape)} {scale_rows.dtype} other "
                         f"{None if other is None else (tuple(other.shape), other.dtype)} "
                         "(other in x's dtype)")
    if k_split <= 0 or k_split % SCALE_BLOCK:
        raise ValueError(f"fp8_linear_splitk: k_split {k_split} is not a positive multiple "
                         f"of {SCALE_BLOCK}")
    if block_n not in (16, 32, 64, 128, 256):
        raise ValueError(f"fp8_linear_splitk: block_n {block_n} is not a power of 2 in 16-256")
    if triton.cdiv(K, k_split) * M * (N + NB) >= 2**31:  # the kernels' int32 offsets
        raise ValueError(f"fp8_linear_splitk: {triton.cdiv(K, k_split)} splits of "
                         f"[{M}, {N + NB}] partials exceed int32 offsets (decode rows only)")
    if (weight.stride(1) != 1 or scale_rows.stride(1) != 1
            or (other is not None and other.stride(1) != 1)):
        raise ValueError("fp8_linear_splitk: weight, scale_rows and other need a unit column "
                         "stride")
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(M, N + NB, dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    splits = triton.cdiv(K, k_split)
    out = y if splits == 1 else torch.empty(splits, M, N + NB, dtype=torch.float32,
                                            device=x.device)
    bm = block_m(M)
    f16 = dot_f16 and x.dtype == torch.bfloat16
    wb = x if other is None else other  # never read when NB = 0 (no program takes that branch)
    col8, colb = (NB, 0) if other_first else (0, N)
    grid_n = triton.cdiv(N, block_n) + triton.cdiv(NB, block_n)
    _splitk_kernel[(grid_n, splits, triton.cdiv(M, bm))](
        x, weight, scale_rows, wb, out, M, N, NB, K, k_split, x.stride(0), weight.stride(0),
        scale_rows.stride(0), wb.stride(0), out.stride(0) if splits > 1 else 0, N + NB, col8,
        colb, BLOCK_M=bm, BLOCK_N=block_n, DOT_PREC=dot_precision(x.dtype), DOT_F16=f16,
        num_warps=num_warps, num_stages=num_stages, **pdl_launch(x))
    if splits > 1:
        block = 1024
        _reduce_kernel[(triton.cdiv(M * (N + NB), block),)](
            out, y, M * (N + NB), SPLITS=splits, stride_ps=out.stride(0), BLOCK=block,
            num_warps=4, **pdl_launch(x))
    return y


def fp8_dense_splitk(x: torch.Tensor, weight: torch.Tensor, scale_rows: torch.Tensor,
                     other: torch.Tensor | None = None, other_first: bool = False) -> torch.Tensor:
    """`fp8_linear_splitk` at the shape's config (`config`): the kernel path's FP8 dense projections
    (a fused projection's bf16 rows in other, as `fp8_gemv` takes them). Same contract."""
    n_total = weight.shape[0] + (0 if other is None else other.shape[0])
    ks, bn, warps, stages, f16 = config(n_total, x.shape[1], x.shape[0])
    return fp8_linear_splitk(x, weight, scale_rows, ks, bn, warps, stages, f16, other,
                             other_first)
