"""The MoE down GEMM of a decode batch as GEMVs, one expert a program (kb/0059).

Why: at B=32 the FP8 down GEMM (`moe._down_kernel`, tl.dot on 16-row tiles padded from the
~1.6 pairs an expert gets) streams its ~171 MB a layer at ~2.3 TB/s, latency-bound (ncu on an
H100, kb/0057 §4: 25 % occupancy by registers and shared memory, 0.71 eligible warps a
scheduler), where gate_up reaches ~3.8 TB/s. The one-pair-a-program GEMVs beat the tiles at
1–2 rows (`moe_gemv`, kb/0039: FP8 down 8 → 4.5 µs at B=1) because a program loads its whole
[ROWS, I] weight tile in one go instead of a chain of K iterations. At 32 rows a pair a
program would read an expert's weights once per pair (~1.6x the bytes); here a program takes
one expert, as the tiled kernel does, loads its rows once and walks the expert's pairs:

    y[p, n] = w_p · Σ_k act[p, k] · D_e[n, k]     for the pairs p of expert e, rows n of its block

FP8 weights: act[p]·scale is formed per 128-wide K block and multiplied with the e4m3 value
converted to fp32 (exact), i.e. (a·s)·q, as `moe_gemv._row_dot`. Products and sums in fp32;
the sum is a tree over K instead of tl.dot's, so the pair terms differ from `_down_kernel`'s
at fp32 rounding level. Reference: `ref.moe_experts` (spec §7); tests/test_kernels.py compares
it with `moe.fused_moe`'s tiled down GEMM.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from tailored.kernels import moe
from tailored.kernels.pdl import enter as pdl_enter

# (ROWS, num_warps, PAIRS): weight rows a program holds (a power of 2 ≤ 128: one block of
# scales), its warps, and the pairs whose activations it loads together before their sums.
# Not yet measured on the GPU (scripts/bench_moe_down.py sweeps them);
# TAILORED_MOE_DOWN_GEMV_CFG=ROWSxWARPSxPAIRS sets it (benchmarks, A/B).
CFG = (16, 4, 2)


def _cfg_from_env(default: tuple[int, int, int]) -> tuple[int, int, int]:
    """TAILORED_MOE_DOWN_GEMV_CFG as (ROWS, num_warps, PAIRS), e.g. "16x8x2"; ValueError when
    it is not three positive integers joined by 'x'."""
    raw = os.environ.get("TAILORED_MOE_DOWN_GEMV_CFG", "").strip()
    if not raw:
        return default
    try:
        rows, warps, pairs = (int(v) for v in raw.lower().split("x"))
    except ValueError:
        raise ValueError(f"TAILORED_MOE_DOWN_GEMV_CFG={raw!r}: want ROWSxWARPSxPAIRS, "
                         "e.g. 16x8x2") from None
    if min(rows, warps, pairs) < 1:
        raise ValueError(f"TAILORED_MOE_DOWN_GEMV_CFG={raw!r}: values must be ≥ 1")
    return rows, warps, pairs


CFG = _cfg_from_env(CFG)


@triton.jit
def _pair_term(act_ptr, rw_ptr, y_ptr, order_ptr, m, end, w, s, n, n_ok, k, k_ok, stride_at,
               stride_yt, W_FP8: tl.constexpr):
    """Pair order[m]'s weighted term into y (nothing when m ≥ end): w [ROWS, BLOCK_I] fp32
    weight rows, s [BLOCK_I] fp32 their K blocks' scales (FP8)."""
    ok = m < end
    pair = tl.load(order_ptr + m, mask=ok, other=0).to(tl.int64)
    okk = k_ok & ((k * 0 + ok.to(tl.int32)) > 0)  # the interpreter cannot broadcast a scalar mask
    a = tl.load(act_ptr + pair * stride_at + k, mask=okk, other=0.0).to(tl.float32)
    if W_FP8:
        a = a * s
    rw = tl.load(rw_ptr + pair, mask=ok, other=0.0).to(tl.float32)
    y = tl.sum(w * a[None, :], 1) * rw
    okn = n_ok & ((n * 0 + ok.to(tl.int32)) > 0)
    tl.store(y_ptr + pair * stride_yt + n, y, mask=okn)


@triton.jit
def _gemv_down_experts_kernel(act_ptr, w_ptr, order_ptr, offsets_ptr, experts_ptr, rw_ptr,
                              y_ptr, ws_ptr, stride_at, stride_we, stride_wn, stride_yt,
                              stride_se, stride_sn,
                              H: tl.constexpr, I: tl.constexpr, BLOCK_I: tl.constexpr,
                              ROWS: tl.constexpr, PAIRS: tl.constexpr, W_FP8: tl.constexpr,
                              COMPACT: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # kernels/pdl.py: wait for the previous kernel first
        pdl_enter()
    e, start, end = moe._program_expert(offsets_ptr, experts_ptr, COMPACT)
    if start < end:  # ~1/3 of the experts get no pair at B=32: no weight read for them
        n0 = tl.program_id(1) * ROWS
        n = n0 + tl.arange(0, ROWS)
        n_ok = n < H
        k = tl.arange(0, BLOCK_I)
        k_ok = k < I
        e64 = e.to(tl.int64)
        w = tl.load(w_ptr + e64 * stride_we + n[:, None] * stride_wn + k[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        s = tl.zeros([BLOCK_I], dtype=tl.float32)
        if W_FP8:  # the rows' one block row of scales (ROWS divides 128)
            s = tl.load(ws_ptr + e64 * stride_se + (n0 // 128) * stride_sn + k // 128,
                        mask=k_ok, other=0.0)
        m0 = start
        while m0 < end:  # a while loop: the interpreter cannot range() over loaded bounds
            for j in tl.static_range(PAIRS):  # independent loads of PAIRS pairs in flight
                _pair_term(act_ptr, rw_ptr, y_ptr, order_ptr, m0 + j, end, w, s, n, n_ok, k,
                           k_ok, stride_at, stride_yt, W_FP8)
            m0 += PAIRS


def launch(dn_args: tuple, grid_e: int, H: int, I: int, fp8: bool, compact: bool,
           pdl: dict, cfg: tuple[int, int, int] | None = None) -> None:
    """`moe._down_kernel`'s launch over the same arguments (act, down, order, offsets, experts,
    rw, y, down_scale and their strides, `moe.fused_moe`'s dn_args) as expert GEMVs.

    grid_e: expert programs (T·k over the active-first experts with `compact`, else one per
    expert); H, I: the down weight's [H, I] per expert; fp8: float8_e4m3fn weights with block
    scales; pdl: `pdl.launch`'s keywords; cfg: (ROWS, num_warps, PAIRS) instead of `CFG`
    (benchmarks). Writes y[p] (fp32 [pairs, H]) for every aligned pair p.
    Raises ValueError for a ROWS that is not a power of 2 ≤ 128 or PAIRS < 1.
    """
    rows, warps, pairs = cfg or CFG
    if rows < 1 or rows > 128 or rows & (rows - 1) or pairs < 1:
        raise ValueError(f"moe_down_gemv: ROWS {rows} not a power of 2 ≤ 128 or PAIRS {pairs}")
    rows = min(rows, triton.next_power_of_2(H))
    _gemv_down_experts_kernel[(grid_e, triton.cdiv(H, rows))](
        *dn_args, H=H, I=I, BLOCK_I=triton.next_power_of_2(I), ROWS=rows, PAIRS=pairs,
        W_FP8=fp8, COMPACT=compact, num_warps=warps, **pdl)
