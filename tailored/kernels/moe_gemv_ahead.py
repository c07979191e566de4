"""Routed + shared experts of a 1–4 row decode step as GEMVs whose weight streams start ahead.

Why (kb/0058): at one row the experts stream 56.6 MB (bf16) a layer in ~22 µs, ~2.5 TB/s,
and FP8's 28.3 MB in ~15 µs: both fit "~8 µs fixed + bytes at ~3.8 TB/s". The fixed part is
latency in front of the streams, which `moe_gemv` pays per program and per launch:
  - every gate_up program (~600 of them, ~2 waves a SM) repeats the top-k before its one load;
  - the down launch starts its weight loads only after gate_up has ended (PDL wait), so the
    down stream begins with an empty pipe at every layer.
Here:
  1. gate_up is persistent: `programs` programs (a few a SM), each routes once and walks the
     (pair, row block) units u = pid, pid + programs, … . AHEAD: the next unit's weight tile
     is loaded before the current one is reduced, so two tiles a program are in flight. L2:
     the program's later units are sent to L2 first (`cp.async.bulk.prefetch.L2`, one
     instruction per contiguous block of rows).
  2. down routes by itself *before* its PDL wait — the router logits were written two
     kernels back, so they are complete once gate_up's programs have all passed their own
     wait, which is when down may launch (kernels/pdl.py's rule) — and loads its first unit's
     weight tile (AHEAD) or sends all its units to L2 (L2) before waiting for gate_up's act.
     After the wait each unit takes its expert from the ids gate_up stored; a first unit whose
     ahead-routed expert differs (only possible if two probabilities tie differently under
     another reduction order) is loaded again, so what is computed never depends on the
     ahead routing.

Numerics: `moe_gemv`'s exactly (the same per-row fp32 products and tree sums over K, the
weights route_gemv_moe stores); on the interpreter the results are bitwise route_gemv_moe's.
Reference: `ref.moe_experts` through `moe.route_fused_moe` (tests/test_kernels.py); spec §7.
"""

from __future__ import annotations

import json
import os

import torch
import triton
import triton.language as tl

from tailored.kernels import moe
from tailored.kernels.pdl import enter as pdl_enter
from tailored.kernels.pdl import launch as pdl_launch

# (gate_up (ROWS, warps, programs a SM, AHEAD, L2), down (ROWS, warps, programs a SM, AHEAD,
# L2)) by weight kind and rows (1, or 2 and more). Not yet measured on the H200: a guess from
# moe_gemv's configs (kb/0039) until scripts/bench_moe_gemv.py --sweep ahead has run.
# TAILORED_MOE_AHEAD_CFG names a JSON file {"bf16,1": [[...], [...]], ...} that replaces
# entries (the bench writes one with its best configs, so an A/B can run them).
CFG = {("bf16", 1): ((8, 8, 2, True, False), (16, 4, 4, True, False)),
       ("bf16", 2): ((8, 8, 2, True, False), (16, 4, 4, True, False)),
       ("fp8", 1): ((8, 4, 4, True, False), (16, 4, 4, True, False)),
       ("fp8", 2): ((8, 4, 4, True, False), (16, 4, 4, True, False))}


def load_cfg_file(path: str | None) -> None:
    """Replace CFG entries from a JSON file {"bf16,1": [gate_up cfg, down cfg], ...}."""
    if not path or not os.path.exists(path):
        return
    for key, (gu, dn) in json.loads(open(path).read()).items():
        kind, rows = key.split(",")
        CFG[kind, int(rows)] = (tuple(gu), tuple(dn))


load_cfg_file(os.environ.get("TAILORED_MOE_AHEAD_CFG"))


@triton.jit
def _tile(w_base, n, n_ok, stride_wn, k, k_ok, mask_ok):
    """W rows n (K contiguous at w_base) over k, [ROWS, BLOCK_K] in the weights' dtype; all
    zero unless the scalar mask_ok."""
    # the scalar as a [ROWS] mask: the interpreter cannot broadcast a scalar bool in a mask
    n_ok = n_ok & ((n * 0 + mask_ok.to(tl.int32)) > 0)
    return tl.load(w_base + n[:, None] * stride_wn + k[None, :],
                   mask=n_ok[:, None] & k_ok[None, :], other=0.0)


@triton.jit
def _dot(w, xv, s_ptr, k, k_ok, W_FP8: tl.constexpr):
    """[ROWS] fp32: the tile w times the fp32 vector xv [BLOCK_K] (`moe_gemv._row_dot`'s
    arithmetic: FP8 scales x per 128-wide K block, from the rows' block of scales at s_ptr)."""
    if W_FP8:
        xv = xv * tl.load(s_ptr + k // 128, mask=k_ok, other=0.0)
    return tl.sum(w.to(tl.float32) * xv[None, :], 1)


@triton.jit
def _expert_of(it, t, c, p, S: tl.constexpr):
    """The expert of pair p = t·S + slot from the ids by slot `it` [BLOCK_T, BLOCK_S]."""
    return tl.sum(tl.where((t[:, None] == p // S) & (c[None, :] == p % S), it, 0))


@triton.jit
def _prefetch_rows_l2(w_base, n0, stride_wn, nbytes):
    """Send nbytes from row n0 of W (rows contiguous) to L2: one bulk prefetch (PTX ISA 8.0,
    sm_90; the address 16-byte aligned, nbytes a multiple of 16)."""
    base = (w_base + n0 * stride_wn).to(tl.pointer_type(tl.int8))
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;",
                              "=r,l,r", [base, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _ahead_gate_up_kernel(x_ptr, w_ptr, ws_ptr, act_ptr, logits_ptr, seg_ptr, rw_ptr, ids_ptr,
                          T, stride_xt, stride_we, stride_wn, stride_at, stride_se, stride_sn,
                          s_up, stride_l, stride_s,
                          H: tl.constexpr, I: tl.constexpr, BLOCK_H: tl.constexpr,
                          ROWS: tl.constexpr, W_FP8: tl.constexpr, E: tl.constexpr,
                          K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
                          SHARED: tl.constexpr, AHEAD: tl.constexpr, L2: tl.constexpr,
                          PDL: tl.constexpr = False):
    if PDL:  # kernels/pdl.py: the router logits come from the kernel before
        pdl_enter()
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    S: tl.constexpr = K + 1 if SHARED else K
    NB: tl.constexpr = (I + ROWS - 1) // ROWS
    t = tl.arange(0, BLOCK_T)
    t_ok = t < T
    store = t_ok & ((t * 0 + pid) == 0)  # program 0 stores the routing
    _, it = moe._topk_tile(logits_ptr, seg_ptr, rw_ptr, ids_ptr, t, t_ok, store, stride_l,
                           stride_s, E, K, BLOCK_S, SHARED)
    c = tl.arange(0, BLOCK_S)
    units = T * S * NB
    k = tl.arange(0, BLOCK_H)
    k_ok = k < H
    r = tl.arange(0, ROWS)
    u = pid
    if AHEAD:  # the first unit's tiles now, every later unit's one iteration early
        e = _expert_of(it, t, c, u // NB, S).to(tl.int64)
        n = (u % NB) * ROWS + r
        wg = _tile(w_ptr + e * stride_we, n, n < I, stride_wn, k, k_ok, u < units)
        wu = _tile(w_ptr + e * stride_we, I + n, n < I, stride_wn, k, k_ok, u < units)
    if L2:  # this program's later units into L2 (gate rows and up rows: two blocks each)
        for v in range(pid + nprog, units, nprog):
            ev = _expert_of(it, t, c, v // NB, S).to(tl.int64)
            nv = (v % NB) * ROWS
            nbytes = (tl.minimum(I - nv, ROWS) * H * w_ptr.dtype.element_ty.primitive_bitwidth
                      // 8)
            _prefetch_rows_l2(w_ptr + ev * stride_we, nv, stride_wn, nbytes)
            _prefetch_rows_l2(w_ptr + ev * stride_we, I + nv, stride_wn, nbytes)
    while u < units:  # a while loop: the interpreter cannot range() over loaded bounds
        p = u // NB
        n0 = (u % NB) * ROWS
        n = n0 + r
        n_ok = n < I
        e = _expert_of(it, t, c, p, S).to(tl.int64)
        un = u + nprog
        if AHEAD:
            en = _expert_of(it, t, c, un // NB, S).to(tl.int64)
            nn = (un % NB) * ROWS + r
            wg_next = _tile(w_ptr + en * stride_we, nn, nn < I, stride_wn, k, k_ok, un < units)
            wu_next = _tile(w_ptr + en * stride_we, I + nn, nn < I, stride_wn, k, k_ok,
                            un < units)
        else:
            wg = _tile(w_ptr + e * stride_we, n, n_ok, stride_wn, k, k_ok, u < units)
            wu = _tile(w_ptr + e * stride_we, I + n, n_ok, stride_wn, k, k_ok, u < units)
        xv = tl.load(x_ptr + (p // S) * stride_xt + k, mask=k_ok, other=0.0).to(tl.float32)
        # ROWS divides 128: the rows share one block of scales (FP8)
        s_base = ws_ptr + e * stride_se + (n0 // 128) * stride_sn
        g = _dot(wg, xv, s_base, k, k_ok, W_FP8)
        up = _dot(wu, xv, s_base + s_up * stride_sn, k, k_ok, W_FP8)
        act = g * tl.sigmoid(g) * up
        tl.store(act_ptr + p * stride_at + n, act.to(act_ptr.dtype.element_ty), mask=n_ok)
        if AHEAD:
            wg = wg_next
            wu = wu_next
        u = un


@triton.jit
def _ahead_down_kernel(act_ptr, w_ptr, ws_ptr, logits_ptr, seg_ptr, rw_ptr, ids_ptr, y_ptr, T,
                       stride_at, stride_we, stride_wn, stride_yt, stride_se, stride_sn,
                       stride_l, stride_s,
                       H: tl.constexpr, I: tl.constexpr, BLOCK_I: tl.constexpr,
                       ROWS: tl.constexpr, W_FP8: tl.constexpr, E: tl.constexpr,
                       K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
                       SHARED: tl.constexpr, AHEAD: tl.constexpr, L2: tl.constexpr,
                       PDL: tl.constexpr = False):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    S: tl.constexpr = K + 1 if SHARED else K
    NB: tl.constexpr = (H + ROWS - 1) // ROWS
    units = T * S * NB
    k = tl.arange(0, BLOCK_I)
    k_ok = k < I
    r = tl.arange(0, ROWS)
    if AHEAD or L2:
        # before the wait: the routing again (logits of the kernel two back; nothing stored)
        t = tl.arange(0, BLOCK_T)
        t_ok = t < T
        _, it = moe._topk_tile(logits_ptr, seg_ptr, rw_ptr, ids_ptr, t, t_ok, t_ok, stride_l,
                               stride_s, E, K, BLOCK_S, SHARED, False)
        c = tl.arange(0, BLOCK_S)
        if AHEAD:
            e_ahead = _expert_of(it, t, c, pid // NB, S).to(tl.int64)
            n = (pid % NB) * ROWS + r
            w_ahead = _tile(w_ptr + e_ahead * stride_we, n, n < H, stride_wn, k, k_ok,
                            pid < units)
        if L2:  # every unit not loaded above
            for v in range(pid + nprog if AHEAD else pid, units, nprog):
                ev = _expert_of(it, t, c, v // NB, S).to(tl.int64)
                nv = (v % NB) * ROWS
                nbytes = (tl.minimum(H - nv, ROWS) * I
                          * w_ptr.dtype.element_ty.primitive_bitwidth // 8)
                _prefetch_rows_l2(w_ptr + ev * stride_we, nv, stride_wn, nbytes)
    if PDL:  # gate_up's act, weights and ids from here on
        pdl_enter()
    u = pid
    while u < units:
        p = u // NB
        n0 = (u % NB) * ROWS
        n = n0 + r
        n_ok = n < H
        e = tl.load(ids_ptr + p)
        if AHEAD:
            # the first unit's tile came ahead; load it (again) only if gate_up routed
            # otherwise, and every later unit's now
            kept = (u == pid) & (e == e_ahead)
            w = _tile(w_ptr + e * stride_we, n, n_ok, stride_wn, k, k_ok, kept == 0)
            w = tl.where(kept, w_ahead, w)
        else:
            w = _tile(w_ptr + e * stride_we, n, n_ok, stride_wn, k, k_ok, u < units)
        a = tl.load(act_ptr + p * stride_at + k, mask=k_ok, other=0.0).to(tl.float32)
        y = _dot(w, a, ws_ptr + e * stride_se + (n0 // 128) * stride_sn, k, k_ok, W_FP8)
        rw = tl.load(rw_ptr + p).to(tl.float32)
        tl.store(y_ptr + p * stride_yt + n, y * rw, mask=n_ok)
        u += nprog


def _programs(per_sm: int, units: int, device: torch.device) -> int:
    """Grid of a persistent launch: per_sm programs on every SM (4 SMs on the CPU, so the
    interpreter walks several units a program), at most one a unit."""
    sms = (torch.cuda.get_device_properties(device).multi_processor_count
           if device.type == "cuda" else 4)
    return max(1, min(units, per_sm * sms))


def _bulk_ok(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether the L2 bulk prefetch can run: sm_90 PTX, rows 16-byte aligned."""
    return (x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 9
            and (gate_up.shape[2] * gate_up.element_size()) % 16 == 0
            and (down.shape[2] * down.element_size()) % 16 == 0)


def route_gemv_ahead_moe(x: torch.Tensor, router_logits: torch.Tensor, top_k: int,
                         gate_up: torch.Tensor, down: torch.Tensor,
                         shared_gate: torch.Tensor | None = None,
                         gate_up_scale: torch.Tensor | None = None,
                         down_scale: torch.Tensor | None = None,
                         gate_up_cfg: tuple | None = None, down_cfg: tuple | None = None):
    """`moe_gemv.route_gemv_moe`'s contract (and numerics) with the weight streams started
    ahead (module doc): two launches, both persistent.

    x: [T, H] normed hidden states (bf16/fp32), 1 ≤ T ≤ `moe.ROUTE_ONE_PROGRAM_UP_TO`;
    router_logits [T, E], E a power of 2; shared_gate [T, 1] or None; gate_up [En, 2I, H],
    down [En, H, I] (bf16/fp32, or float8_e4m3fn with their block scales), En = E (+1 with the
    shared expert stacked as expert E). gate_up_cfg / down_cfg: (ROWS, num_warps, programs a
    SM, AHEAD, L2) instead of `CFG`'s (benchmarks); ROWS a power of 2 ≤ 128. L2 (bulk
    prefetch) only on sm_90+ CUDA devices, and only with 16-byte aligned rows; elsewhere off.
    Returns (pairs [T·S, H] fp32 in (token, slot) order, weights [T, S] in the logits dtype,
    ids [T, S] int64) as route_gemv_moe. Raises ValueError for other T, E, shapes or ROWS.
    """
    c = moe.routed_operands(x, router_logits, top_k, gate_up, down, shared_gate, gate_up_scale,
                            down_scale, "route_gemv_ahead_moe")
    x, gate_up, down, T, S, H, I, act = c.x, c.gate_up, c.down, c.T, c.S, c.H, c.I, c.act
    fp8 = c.fp8
    cfg_gu, cfg_dn = CFG["fp8" if fp8 else "bf16", min(T, 2)]
    gu, dn = tuple(gate_up_cfg or cfg_gu), tuple(down_cfg or cfg_dn)
    if any(len(v) != 5 or v[0] < 1 or v[0] > 128 or v[0] & (v[0] - 1) for v in (gu, dn)):
        raise ValueError(f"route_gemv_ahead_moe: configs {gu}, {dn} are not (ROWS a power of "
                         f"2 ≤ 128, warps, programs a SM, AHEAD, L2)")
    r_gu, r_dn = min(gu[0], triton.next_power_of_2(I)), min(dn[0], triton.next_power_of_2(H))
    bulk = _bulk_ok(x, gate_up, down)
    units_gu, units_dn = T * S * triton.cdiv(I, r_gu), T * S * triton.cdiv(H, r_dn)
    route = dict(E=c.E, K=top_k, BLOCK_T=max(2, triton.next_power_of_2(T)),
                 BLOCK_S=triton.next_power_of_2(S), SHARED=shared_gate is not None)
    _ahead_gate_up_kernel[(_programs(gu[2], units_gu, x.device),)](
        x, gate_up, c.gate_up_scale, act, router_logits, c.seg, c.w, c.ids, T, x.stride(0),
        gate_up.stride(0), gate_up.stride(1), act.stride(0), *c.s_gu, triton.cdiv(I, 128),
        router_logits.stride(0), c.seg.stride(0), H=H, I=I,
        BLOCK_H=triton.next_power_of_2(H), ROWS=r_gu, W_FP8=fp8, AHEAD=bool(gu[3]),
        L2=bool(gu[4]) and bulk, **route, num_warps=gu[1], **pdl_launch(x))
    _ahead_down_kernel[(_programs(dn[2], units_dn, x.device),)](
        act, down, c.down_scale, router_logits, c.seg, c.w, c.ids, c.y, T, act.stride(0),
        down.stride(0), down.stride(1), c.y.stride(0), *c.s_dn, router_logits.stride(0),
        c.seg.stride(0), H=H, I=I, BLOCK_I=triton.next_power_of_2(I), ROWS=r_dn, W_FP8=fp8,
        AHEAD=bool(dn[3]), L2=bool(dn[4]) and bulk, **route, num_warps=dn[1],
        **pdl_launch(x))
    return c.y, c.w, c.ids
