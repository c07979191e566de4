"""NVFP4 routed experts of a decode step as W4A16 GEMVs, one (token, expert) pair a program
(spec §7, §9.2; the layout of `moe_gemv.py`, the NVFP4 decoding of `nvfp4_gemv.py`).

Why: at decode the MoE reads k experts a token, and their weights are most of a step's bytes;
NVFP4 stores them in 4.5 bits an element. Every pair's program reads its expert's rows once,
whole K at a time (no K loop: one DRAM latency a program), decodes the 4-bit codes in
registers and multiplies them with the token's activations in fp32:
  1. gate_up: program (p, nb), pair p = t·S + slot, expert e = ids[p]:
     act[p, n] = silu(x[t]·G_e[n] · g2_e) · (x[t]·U_e[n] · u2_e) for its ROWS rows n;
  2. down:    y[p, n] = w_p · (act[p] · D_e[n]) · d2_e   (fp32 pair terms for `moe_combine`).
g2, u2, d2 are the expert's global scales (gate and up are separate linears in the checkpoint,
each with its own). Routing is the caller's (ids and weights [T, S]); a pair reads its
expert's weights even when another pair of the step has the same expert (no reuse across
tokens: at 32 rows × 8 experts 256 expert reads where ~163 are distinct, 113 MB a layer at
full size, still far below the ~2 GB of traffic that dequantizing all 256 experts costs).
Reference: `ref.moe_experts` over `nvfp4.DequantExperts` (tests/kernels/test_nvfp4_kernels.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tailored.kernels.nvfp4_gemv import packed_tile, tile_dot
from tailored.kernels.pdl import enter as pdl_enter
from tailored.kernels.pdl import launch as pdl_launch

# (ROWS, num_warps) of gate_up and of down: not measured yet (kb/0065)
CFG = ((8, 4), (8, 4))


@triton.jit
def _half(x_ptr, row, nbytes, HALF: tl.constexpr):
    """(even, odd) columns of activation row `row` (a pointer), fp32 [HALF], zero past it."""
    j = tl.arange(0, HALF)
    ok = j < nbytes
    xe = tl.load(row + 2 * j, mask=ok, other=0.0).to(tl.float32)
    xo = tl.load(row + 2 * j + 1, mask=ok, other=0.0).to(tl.float32)
    return xe, xo


@triton.jit
def _gate_up_kernel(x_ptr, ids_ptr, w_ptr, s_ptr, s2_ptr, act_ptr, S, stride_xt, stride_we,
                    stride_wn, stride_se, stride_sn, stride_s2, stride_at,
                    H: tl.constexpr, I: tl.constexpr, HALF: tl.constexpr, ROWS: tl.constexpr,
                    PDL: tl.constexpr = False):
    if PDL:
        pdl_enter()
    p = tl.program_id(0)
    e = tl.load(ids_ptr + p).to(tl.int64)
    n = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    n_ok = n < I
    xe, xo = _half(x_ptr, x_ptr + (p // S) * stride_xt, H // 2, HALF)
    w_base, s_base = w_ptr + e * stride_we, s_ptr + e * stride_se
    lo, hi, s = packed_tile(w_base, s_base, n, n_ok, stride_wn, stride_sn, 0, H // 2, HALF)
    g = tile_dot(lo, hi, s, xe, xo, ROWS, HALF) * tl.load(s2_ptr + e * stride_s2)
    lo, hi, s = packed_tile(w_base + I * stride_wn, s_base + I * stride_sn, n, n_ok, stride_wn,
                            stride_sn, 0, H // 2, HALF)
    u = tile_dot(lo, hi, s, xe, xo, ROWS, HALF) * tl.load(s2_ptr + e * stride_s2 + 1)
    act = g * tl.sigmoid(g) * u
    tl.store(act_ptr + p * stride_at + n, act.to(act_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _down_kernel(act_ptr, ids_ptr, rw_ptr, w_ptr, s_ptr, s2_ptr, y_ptr, stride_at, stride_we,
                 stride_wn, stride_se, stride_sn, stride_s2, stride_yt,
                 H: tl.constexpr, I: tl.constexpr, HALF: tl.constexpr, ROWS: tl.constexpr,
                 PDL: tl.constexpr = False):
    if PDL:
        pdl_enter()
    p = tl.program_id(0)
    e = tl.load(ids_ptr + p).to(tl.int64)
    n = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    n_ok = n < H
    ae, ao = _half(act_ptr, act_ptr + p * stride_at, I // 2, HALF)
    lo, hi, s = packed_tile(w_ptr + e * stride_we, s_ptr + e * stride_se, n, n_ok, stride_wn,
                            stride_sn, 0, I // 2, HALF)
    y = tile_dot(lo, hi, s, ae, ao, ROWS, HALF) * tl.load(s2_ptr + e * stride_s2)
    y = y * tl.load(rw_ptr + p).to(tl.float32)
    tl.store(y_ptr + p * stride_yt + n, y, mask=n_ok)


def nvfp4_moe_pairs(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    gate_up: tuple, down: tuple, gate_up_cfg=None, down_cfg=None) -> torch.Tensor:
    """The weighted pair terms of NVFP4 routed experts: [T·S, H] fp32 in (token, slot) order,
    pair (t, s) = weights[t, s] · Expert_{ids[t, s]}(x[t]), for `moe_combine` (the contract of
    `fused_moe(..., reduce=False)`).

    x [T, H] (bf16/fp32), T ≥ 1 (served up to `nvfp4_gemv_up_to`); weights [T, S], ids [T, S] int64; gate_up = (packed
    uint8 [E, 2I, H/2], scale e4m3 [E, 2I, H/16], scale_2 fp32 [E, 2]) and down = (packed
    [E, H, I/2], scale [E, H, I/16], scale_2 [E, 1]) as `nvfp4.convert_model_` lays experts
    out. gate_up_cfg / down_cfg: (ROWS, num_warps). Raises ValueError on other shapes."""
    (gu, gu_s, gu_s2), (dn, dn_s, dn_s2) = gate_up, down
    T, H = x.shape
    S = ids.shape[1]
    E, two_i, _ = gu.shape
    inter = two_i // 2
    if (T < 1 or ids.shape != (T, S) or weights.shape != (T, S)
            or gu.shape != (E, two_i, H // 2) or gu_s.shape != (E, two_i, H // 16)
            or gu_s2.shape != (E, 2) or dn.shape != (E, H, inter // 2)
            or dn_s.shape != (E, H, inter // 16) or dn_s2.shape != (E, 1)
            or gu.dtype != torch.uint8 or dn.dtype != torch.uint8
            or not all(t.is_contiguous() for t in (gu, gu_s, gu_s2, dn, dn_s, dn_s2))):
        raise ValueError(f"nvfp4_moe_pairs: x{tuple(x.shape)} ids{tuple(ids.shape)} gate_up "
                         f"{[tuple(t.shape) for t in gate_up]} down {[tuple(t.shape) for t in down]}"
                         " (contiguous NVFP4 experts)")
    x = x if x.stride(1) == 1 else x.contiguous()
    ids, weights = ids.contiguous(), weights.contiguous()
    P = T * S
    act = torch.empty(P, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(P, H, dtype=torch.float32, device=x.device)
    (r_gu, w_gu), (r_dn, w_dn) = gate_up_cfg or CFG[0], down_cfg or CFG[1]
    r_gu, r_dn = min(r_gu, triton.next_power_of_2(inter)), min(r_dn, triton.next_power_of_2(H))
    _gate_up_kernel[(P, triton.cdiv(inter, r_gu))](
        x, ids, gu, gu_s, gu_s2, act, S, x.stride(0), gu.stride(0), gu.stride(1), gu_s.stride(0),
        gu_s.stride(1), gu_s2.stride(0), act.stride(0), H=H, I=inter,
        HALF=max(8, triton.next_power_of_2(H // 2)), ROWS=r_gu, num_warps=w_gu, **pdl_launch(x))
    _down_kernel[(P, triton.cdiv(H, r_dn))](
        act, ids, weights, dn, dn_s, dn_s2, y, act.stride(0), dn.stride(0), dn.stride(1),
        dn_s.stride(0), dn_s.stride(1), dn_s2.stride(0), y.stride(0), H=H, I=inter,
        HALF=max(8, triton.next_power_of_2(inter // 2)), ROWS=r_dn, num_warps=w_dn,
        **pdl_launch(x))
    return y
