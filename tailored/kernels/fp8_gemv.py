"""W8A16 GEMV for block-FP8 dense weights at 1–4 rows (kb/0039 §4): y = x · (W_fp8 ⊙ s)ᵀ.

Why: FP8 checkpoints hold their dense projections dequantized to bf16 (the kernel path,
`fp8_dense_dequant`, kb/0026) because the tiled W8A16 GEMM (`fp8_linear`) had an ~11 µs floor
at decode; cuBLAS over the bf16 copy then reads twice the bytes of FP8 in every decode step.
Here each program loads [ROWS, BLOCK_K] weight tiles (BLOCK_K of 1024 covers half of K = 2048
in one load), multiplies them with the rows of x in fp32 on the CUDA cores and reduces, no
tl.dot — the design of `moe_gemv`. On the H200 (lab/bench_fp8_gemv.py, kb/0039, one
row, best config by shape, `FP8_CFGS`): GDN in 15.9 µs (cuBLAS bf16) → 8.7, GDN out 9.5 → 4.8;
The kernel path uses it up to
`fp8_gemv_up_to` rows, a fused projection's bf16 members (GDN b/a, router) in the same launch.

Per-row scales (`fp8.row_scales`, [N, ceil(K/128)] fp32) as `fp8_linear` takes them: each
128-wide K block of a row is summed, scaled, then added. Reference:
`fp8.dequantize_block` then `F.linear` (tests/kernels/test_fp8_kernels.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tailored import flags
from tailored.kernels.pdl import enter as pdl_enter
from tailored.kernels.pdl import launch as pdl_launch

# (ROWS, BLOCK_K, num_warps) for a shape not in `FP8_CFGS` (the one config the FP8 gate passed
# with first, kb/0039).
CFG = (8, 1024, 4)

# The FP8 GEMV's config by (N + NB, K, rows) at the model's decode shapes: the winners of
# the sweep in kb/0040 (µs, `CFG` → this). One row:
# GDN in 9.25 → 8.70, GDN out and attention o 6.21 → 4.75, qkv 7.81 → 7.08; two rows: GDN in
# 14.0 → 10.8, qkv 12.0 → 9.4, out/o 8.0 → 6.4. Each config groups the fp32 block sums its
# own way, so the table went through the FP8 gate (kb/0040).
FP8_CFGS: dict[tuple[int, int, int], tuple[int, int, int]] = {
    (12352, 2048, 1): (8, 2048, 4), (12352, 2048, 2): (16, 512, 4),   # GDN in_proj (+ b, a)
    (2048, 4096, 1): (4, 2048, 8), (2048, 4096, 2): (8, 2048, 4),     # GDN out, attention o
    (9216, 2048, 1): (16, 1024, 4), (9216, 2048, 2): (16, 512, 4),    # attention q(+gate) k v
    (1281, 2048, 1): (4, 2048, 4), (1281, 2048, 2): (8, 2048, 4),     # shared gate_up + router
    (2048, 512, 1): (8, 512, 4), (2048, 512, 2): (8, 512, 4),         # shared expert down
}
# With the defaults, one row's shared gate_up/router and shared down go through the MoE kernels
# (the `shared_in_moe` switch), so their one-row entries serve only TAILORED_SHARED_IN_MOE=0.
# The measured table as measured: a bench may empty `FP8_CFGS` (its one-config variant) and
# `fp8_cfgs_for_bf16` must still map the sweep's winners.
_MEASURED = dict(FP8_CFGS)


def fp8_cfgs_for_bf16() -> dict[tuple[int, int, int], tuple[int, int, int]]:
    """`FP8_CFGS` keyed for the bf16 weights: the MoE group's 1281 rows are padded to 1344
    there (`proj_row_align` = 64). On the FP8 checkpoint itself this table changes nothing:
    the bf16 GEMV there serves only the router (257 rows, no entry)."""
    return {**_MEASURED, **{(1344, 2048, t): _MEASURED[(1281, 2048, t)] for t in (1, 2)}}


# bf16_gemv's table by (N, K, rows), the fused weight's pad rows included: the FP8 GEMV's
# (bf16 B=1 graph step: -7.7 % median / -7.1 % min against cuBLAS with them,
# -8.3 / -5.6 with `CFG` alone; both gates passed with them, kb/0042);
# switch `bf16_gemv_fp8_cfgs` off: every shape with `CFG`
BF16_CFGS = fp8_cfgs_for_bf16()


@triton.jit
def _tile(w_ptr, s_ptr, n, n_ok, k0, K, stride_wn, stride_sn, W_FP8: tl.constexpr,
          ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows n of W at K columns k0.. ([ROWS, BLOCK_K], W's dtype) and, FP8, their scales
    ([ROWS, BLOCK_K / 128] fp32; zeros otherwise). Past K: masked off, no memory read."""
    NKB: tl.constexpr = BLOCK_K // 128
    k = k0 + tl.arange(0, BLOCK_K)
    w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_wn + k[None, :],
                mask=n_ok[:, None] & (k < K)[None, :], other=0.0)
    if W_FP8:
        kb = k0 // 128 + tl.arange(0, NKB)
        s = tl.load(s_ptr + n[:, None] * stride_sn + kb[None, :],
                    mask=n_ok[:, None] & (kb * 128 < K)[None, :], other=0.0)
    else:
        s = tl.zeros([ROWS, NKB], dtype=tl.float32)
    return w, s


@triton.jit
def _tile_dot(acc, w, s, x_ptr, k0, t, T, K, stride_xt, W_FP8: tl.constexpr,
              ROWS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr):
    """acc [ROWS, BLOCK_T] + the weight tile w (K columns k0.., scales s) times the T rows of
    x at those columns (fp32)."""
    NKB: tl.constexpr = BLOCK_K // 128
    k = k0 + tl.arange(0, BLOCK_K)
    k_ok = k < K
    wf = w.to(tl.float32)
    for j in tl.static_range(BLOCK_T):  # the weight tile is reused by each row of x
        xv = tl.load(x_ptr + j * stride_xt + k, mask=k_ok & ((k * 0 + j) < T),
                     other=0.0).to(tl.float32)
        if W_FP8:
            part = tl.sum(tl.reshape(wf * xv[None, :], [ROWS, NKB, 128]), 2)  # per K block
            dot = tl.sum(part * s, 1)
        else:
            dot = tl.sum(wf * xv[None, :], 1)
        acc += tl.where(t[None, :] == j, dot[:, None], 0.0)
    return acc


@triton.jit
def _rows_dot(acc, x_ptr, w_ptr, s_ptr, n, n_ok, t, T, K, stride_xt, stride_wn, stride_sn,
              W_FP8: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
              BLOCK_T: tl.constexpr, PDL: tl.constexpr):
    """acc [ROWS, BLOCK_T] + rows n of W times the T rows of x (fp32). FP8: each 128-wide K
    block of a row is summed, then scaled by the row's scale for that block.

    The first weight tile is loaded before the PDL wait (kb/0040): weights are never written,
    so they may be read while the previous kernel still runs, and the DRAM latency of this
    kernel's first loads overlaps that kernel's tail; x, which the previous kernel writes, is
    read after the wait. That first tile is peeled off the loop, which then loads each tile as
    it goes: an earlier version carried the next tile through every iteration (two tiles
    live, a masked-off load past K even where one tile covers K) and took the B=1 FP8 GEMV from
    6.8 to 10.7 µs a call with PDL off (kb/0041). Same tiles in the same order: bitwise."""
    w, s = _tile(w_ptr, s_ptr, n, n_ok, 0, K, stride_wn, stride_sn, W_FP8, ROWS, BLOCK_K)
    if PDL:  # kernels/pdl.py: wait for the previous kernel before reading x
        pdl_enter()
    acc = _tile_dot(acc, w, s, x_ptr, 0, t, T, K, stride_xt, W_FP8, ROWS, BLOCK_K, BLOCK_T)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        w, s = _tile(w_ptr, s_ptr, n, n_ok, k0, K, stride_wn, stride_sn, W_FP8, ROWS, BLOCK_K)
        acc = _tile_dot(acc, w, s, x_ptr, k0, t, T, K, stride_xt, W_FP8, ROWS, BLOCK_K,
                        BLOCK_T)
    return acc


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, wb_ptr, y_ptr, T, N, NB, K, stride_xt, stride_wn,
                     stride_sn, stride_wbn, stride_yt, COL8, COLB, ROWS: tl.constexpr,
                     BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, PDL: tl.constexpr = False):
    pid = tl.program_id(0)
    p8 = tl.cdiv(N, ROWS)
    t = tl.arange(0, BLOCK_T)
    acc = tl.zeros([ROWS, BLOCK_T], dtype=tl.float32)
    t_ok = (t < T)[None, :]
    if pid < p8:  # the FP8 rows, into columns COL8.. (the PDL wait is in _rows_dot)
        n = pid * ROWS + tl.arange(0, ROWS)
        acc = _rows_dot(acc, x_ptr, w_ptr, s_ptr, n, n < N, t, T, K, stride_xt, stride_wn,
                        stride_sn, True, ROWS, BLOCK_K, BLOCK_T, PDL)
        tl.store(y_ptr + t[None, :] * stride_yt + COL8 + n[:, None],
                 acc.to(y_ptr.dtype.element_ty), mask=(n < N)[:, None] & t_ok)
    else:  # the bf16 rows (NB of them), into columns COLB..
        n = (pid - p8) * ROWS + tl.arange(0, ROWS)
        acc = _rows_dot(acc, x_ptr, wb_ptr, s_ptr, n, n < NB, t, T, K, stride_xt, stride_wbn,
                        stride_sn, False, ROWS, BLOCK_K, BLOCK_T, PDL)
        tl.store(y_ptr + t[None, :] * stride_yt + COLB + n[:, None],
                 acc.to(y_ptr.dtype.element_ty), mask=(n < NB)[:, None] & t_ok)


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale_rows: torch.Tensor,
             cfg: tuple[int, int, int] | None = None, other: torch.Tensor | None = None,
             other_first: bool = False) -> torch.Tensor:
    """x [T, K] (bf16/fp32, unit column stride), T ≤ 4 · dequant(weight)ᵀ → [T, N] in x.dtype.

    weight: [N, K] float8_e4m3fn, unit column stride; scale_rows: [N, ceil(K/128)] fp32
    (`fp8.row_scales`). other: [NB, K] rows in x's dtype (the bf16 members of a fused
    projection: GDN b/a, router) computed in the same launch; the output is then [T, N + NB],
    the FP8 rows' columns first, or last with other_first. cfg: (ROWS, BLOCK_K, num_warps),
    ROWS and BLOCK_K powers of 2, BLOCK_K ≥ 128 (else `FP8_CFGS`' entry for the shape, else
    `CFG`). Raises ValueError on other T,
    shapes, dtypes or cfg.
    """
    T, K = x.shape
    N, K2 = weight.shape
    NB = 0 if other is None else other.shape[0]
    if (not 1 <= T <= 4 or K2 != K or weight.dtype != torch.float8_e4m3fn
            or scale_rows.shape != (N, triton.cdiv(K, 128)) or weight.stride(1) != 1
            or scale_rows.stride(1) != 1
            or (other is not None and (other.shape[1] != K or other.stride(1) != 1
                                       or other.dtype != x.dtype))):
        raise ValueError(f"fp8_gemv: x{tuple(x.shape)} {x.dtype} weight{tuple(weight.shape)} "
                         f"{weight.dtype} scale_rows{tuple(scale_rows.shape)} other "
                         f"{None if other is None else (tuple(other.shape), other.dtype)} "
                         "(T ≤ 4, unit column strides, other in x's dtype)")
    cfg = cfg or FP8_CFGS.get((N + NB, K, T))
    return _launch(x, weight, scale_rows, other, N, NB, cfg, other_first)


def bf16_gemv(x: torch.Tensor, weight: torch.Tensor,
              cfg: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [T, K], T ≤ 4 · weightᵀ → [T, N] in x.dtype, for a weight [N, K] in x's dtype (bf16
    served, fp32 in the CPU tests; unit column stride): the kernel's second branch alone, the
    same GEMV without scales (kb/0039 §7.3; the kernel path up to `bf16_gemv_up_to` rows, 1 by
    default since kb/0042). cfg as `fp8_gemv`'s (its table: `BF16_CFGS`). Raises ValueError
    on other T, shapes or dtypes."""
    T, K = x.shape
    if (not 1 <= T <= 4 or weight.shape[1] != K or weight.dtype != x.dtype
            or weight.stride(1) != 1):
        raise ValueError(f"bf16_gemv: x{tuple(x.shape)} {x.dtype} weight{tuple(weight.shape)} "
                         f"{weight.dtype} (T ≤ 4, the weight in x's dtype, unit column stride)")
    if cfg is None and flags.current().bf16_gemv_fp8_cfgs:
        cfg = BF16_CFGS.get((weight.shape[0], K, T))
    return _launch(x, weight, weight, weight, 0, weight.shape[0], cfg, False)


def _launch(x, w8, s8, wb, N: int, NB: int, cfg, other_first: bool) -> torch.Tensor:
    """The kernel over N FP8 rows (w8, s8) and NB rows of x's dtype (wb): [T, N + NB]."""
    T, K = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, bk, warps = cfg or CFG
    if rows < 1 or rows & (rows - 1) or bk < 128 or bk & (bk - 1):
        raise ValueError(f"fp8_gemv: cfg {cfg}: ROWS and BLOCK_K powers of 2, BLOCK_K ≥ 128")
    bk = min(bk, max(128, triton.next_power_of_2(K)))
    y = torch.empty(T, N + NB, dtype=x.dtype, device=x.device)
    wb = w8 if wb is None else wb
    col8, colb = (NB, 0) if other_first else (0, N)
    _fp8_gemv_kernel[(triton.cdiv(N, rows) + triton.cdiv(NB, rows),)](
        x, w8, s8, wb, y, T, N, NB, K, x.stride(0), w8.stride(0), s8.stride(0), wb.stride(0),
        y.stride(0), col8, colb, ROWS=rows, BLOCK_K=bk, BLOCK_T=triton.next_power_of_2(T),
        num_warps=warps, **pdl_launch(x))
    return y
