"""Routed + shared experts of a 1–4 row decode step as GEMVs, one pair a program (kb/0039).

Why: at B=1 the tiled expert GEMMs (`moe.route_fused_moe`: tl.dot on 16-row tiles padded from
one row, a K loop of 8–16 dependent iterations) stream their 9 experts' weights at ~2.5 TB/s
(gate_up 14.5 µs for 37.7 MB, down 8 µs for 18.9 MB, kb/0036 profile), where the lm_head's
GEMV reaches ~4.2. A GEMV program here loads its whole [ROWS, K] weight tile in one go (no K
loop, so one DRAM latency a program instead of a chain of them), multiplies it with the row's
activations in fp32 on the CUDA cores and reduces over K. With ~1000 such programs the loads
of every SM are in flight together.

  1. gate_up: program (p, nb) routes the ≤ 4 rows itself (`moe_route.topk_tile`, as
     `route_fused_moe` does), takes pair p = t·S + slot and its expert e, and writes
     act[p, n] = silu(x[t]·G_e[n]) · (x[t]·U_e[n]) for its ROWS rows n.
  2. down:    y[p, n] = w_p · (act[p] · D_e[n])   (fp32 pair terms, for `moe_combine`).

The down kernel reads e = ids[p] directly: no alignment (order/offsets) is needed at one pair a
program. Numerics: products and sums in fp32 like the tiled kernels, summed in another order
(a tree over K instead of tl.dot's), so results differ from `route_fused_moe` at fp32 rounding
level; FP8 weights: x·scale is formed per 128-wide K block and multiplied with the e4m3 value
converted to fp32 (exact), i.e. (x·s)·q instead of (x·q)·s.
Reference: `ref.moe_experts` (tests/kernels/test_kernels.py); the computation is spec §7.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tailored.kernels import moe, moe_route
from tailored.kernels.pdl import enter as pdl_enter
from tailored.kernels.pdl import launch as pdl_launch

# ((ROWS, num_warps) of gate_up, (ROWS, num_warps) of down) by weight kind and rows (1, or
# 2 and more): rows of W a program reads, all of K at once. From lab/bench_moe_gemv.py on
# the H200 (kb/0039; µs a layer with the shared expert, tiled → GEMV): bf16 T=1
# 24.2 → 23.0, T=2 37.6 → 36.8; FP8 T=1 23.0 → 15.4, T=2 31.4 → 24.2. 3–4 rows: not measured.
CFG = {("bf16", 1): ((8, 8), (4, 4)), ("bf16", 2): ((16, 4), (4, 4)),
       ("fp8", 1): ((8, 2), (8, 2)), ("fp8", 2): ((8, 2), (8, 2))}


@triton.jit
def _row_dot(w_base, n, n_ok, stride_wn, k, k_ok, xv, s_ptr, W_FP8: tl.constexpr):
    """[ROWS] fp32: rows n of W (at w_base, K contiguous) times the fp32 vector xv [BLOCK_K].
    FP8: s_ptr points at the rows' 128-row block of scales (one per 128-wide K block)."""
    w = tl.load(w_base + n[:, None] * stride_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                other=0.0)
    if W_FP8:
        xv = xv * tl.load(s_ptr + k // 128, mask=k_ok, other=0.0)
    return tl.sum(w.to(tl.float32) * xv[None, :], 1)


@triton.jit
def _gemv_gate_up_kernel(x_ptr, w_ptr, ws_ptr, act_ptr, logits_ptr, seg_ptr, rw_ptr, ids_ptr,
                         T, stride_xt, stride_we, stride_wn, stride_at, stride_se, stride_sn,
                         s_up, stride_l, stride_s,
                         H: tl.constexpr, I: tl.constexpr, BLOCK_H: tl.constexpr,
                         ROWS: tl.constexpr, W_FP8: tl.constexpr, E: tl.constexpr,
                         K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
                         SHARED: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # kernels/pdl.py: wait for the previous kernel first
        pdl_enter()
    p = tl.program_id(0)
    S: tl.constexpr = K + 1 if SHARED else K
    t = tl.arange(0, BLOCK_T)
    t_ok = t < T
    store = t_ok & ((t * 0 + p + tl.program_id(1)) == 0)  # program (0, 0) stores the routing
    _, it = moe_route.topk_tile(logits_ptr, seg_ptr, rw_ptr, ids_ptr, t, t_ok, store, stride_l,
                           stride_s, E, K, BLOCK_S, SHARED)
    c = tl.arange(0, BLOCK_S)
    e = tl.sum(tl.where((t[:, None] == p // S) & (c[None, :] == p % S), it, 0))
    n0 = tl.program_id(1) * ROWS  # ROWS divides 128: the rows share one block of scales
    n = n0 + tl.arange(0, ROWS)
    n_ok = n < I
    k = tl.arange(0, BLOCK_H)
    k_ok = k < H
    xv = tl.load(x_ptr + (p // S) * stride_xt + k, mask=k_ok, other=0.0).to(tl.float32)
    w_base = w_ptr + e.to(tl.int64) * stride_we
    s_base = ws_ptr + e.to(tl.int64) * stride_se + (n0 // 128) * stride_sn
    g = _row_dot(w_base, n, n_ok, stride_wn, k, k_ok, xv, s_base, W_FP8)
    u = _row_dot(w_base + I * stride_wn, n, n_ok, stride_wn, k, k_ok, xv,
                 s_base + s_up * stride_sn, W_FP8)
    act = g * tl.sigmoid(g) * u
    tl.store(act_ptr + p * stride_at + n, act.to(act_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _gemv_down_kernel(act_ptr, w_ptr, ws_ptr, rw_ptr, ids_ptr, y_ptr, stride_at, stride_we,
                      stride_wn, stride_yt, stride_se, stride_sn,
                      H: tl.constexpr, I: tl.constexpr, BLOCK_I: tl.constexpr,
                      ROWS: tl.constexpr, W_FP8: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:
        pdl_enter()
    p = tl.program_id(0)
    e = tl.load(ids_ptr + p)
    n0 = tl.program_id(1) * ROWS
    n = n0 + tl.arange(0, ROWS)
    n_ok = n < H
    k = tl.arange(0, BLOCK_I)
    k_ok = k < I
    a = tl.load(act_ptr + p * stride_at + k, mask=k_ok, other=0.0).to(tl.float32)
    s_base = ws_ptr + e * stride_se + (n0 // 128) * stride_sn
    y = _row_dot(w_ptr + e * stride_we, n, n_ok, stride_wn, k, k_ok, a, s_base, W_FP8)
    rw = tl.load(rw_ptr + p).to(tl.float32)
    tl.store(y_ptr + p * stride_yt + n, y * rw, mask=n_ok)


def route_gemv_moe(x: torch.Tensor, router_logits: torch.Tensor, top_k: int,
                   gate_up: torch.Tensor, down: torch.Tensor,
                   shared_gate: torch.Tensor | None = None,
                   gate_up_scale: torch.Tensor | None = None,
                   down_scale: torch.Tensor | None = None,
                   gate_up_cfg: tuple[int, int] | None = None,
                   down_cfg: tuple[int, int] | None = None):
    """`moe.route_fused_moe`'s contract through the two GEMV kernels above (two launches).

    x: [T, H] normed hidden states (bf16/fp32, unit column stride), 1 ≤ T ≤
    `moe_route.ROUTE_ONE_PROGRAM_UP_TO`; router_logits [T, E], E a power of 2; shared_gate [T, 1] or
    None; gate_up [En, 2I, H], down [En, H, I] (bf16/fp32, or float8_e4m3fn with their block
    scales, `fp8.expert_block_scales`), En = E (+1 with the shared expert stacked as expert E).
    gate_up_cfg / down_cfg: (ROWS, num_warps) instead of `CFG`'s (benchmarks), ROWS a power
    of 2 ≤ 128.
    Returns (pairs [T·S, H] fp32 in (token, slot) order, weights [T, S] in the logits dtype,
    ids [T, S] int64), S = top_k (+1 with the shared expert): the routing route_align's
    (bitwise at 4 warps, which set the softmax's summation order), the pair terms
    route_fused_moe's up to the fp32 summation order.
    Raises ValueError for other T, E, mismatched shapes or ROWS.
    """
    c = moe.routed_operands(x, router_logits, top_k, gate_up, down, shared_gate, gate_up_scale,
                            down_scale, "route_gemv_moe")
    x, gate_up, down, T, S, H, I, act = c.x, c.gate_up, c.down, c.T, c.S, c.H, c.I, c.act
    fp8 = c.fp8
    cfg_gu, cfg_dn = CFG["fp8" if fp8 else "bf16", min(T, 2)]
    (r_gu, w_gu), (r_dn, w_dn) = gate_up_cfg or cfg_gu, down_cfg or cfg_dn
    if any(r < 1 or r > 128 or r & (r - 1) for r in (r_gu, r_dn)):  # one scale block a program
        raise ValueError(f"route_gemv_moe: ROWS {r_gu}, {r_dn} not powers of 2 ≤ 128")
    r_gu, r_dn = min(r_gu, triton.next_power_of_2(I)), min(r_dn, triton.next_power_of_2(H))
    _gemv_gate_up_kernel[(T * S, triton.cdiv(I, r_gu))](
        x, gate_up, c.gate_up_scale, act, router_logits, c.seg, c.w, c.ids, T, x.stride(0),
        gate_up.stride(0), gate_up.stride(1), act.stride(0), *c.s_gu, triton.cdiv(I, 128),
        router_logits.stride(0), c.seg.stride(0), H=H, I=I, BLOCK_H=triton.next_power_of_2(H),
        ROWS=r_gu, W_FP8=fp8, E=c.E, K=top_k, BLOCK_T=max(2, triton.next_power_of_2(T)),
        BLOCK_S=triton.next_power_of_2(S), SHARED=shared_gate is not None, num_warps=w_gu,
        **pdl_launch(x))
    _gemv_down_kernel[(T * S, triton.cdiv(H, r_dn))](
        act, down, c.down_scale, c.w, c.ids, c.y, act.stride(0), down.stride(0), down.stride(1),
        c.y.stride(0), *c.s_dn, H=H, I=I, BLOCK_I=triton.next_power_of_2(I), ROWS=r_dn,
        W_FP8=fp8, num_warps=w_dn, **pdl_launch(x))
    return c.y, c.w, c.ids
