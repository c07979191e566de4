"""Fused routed-experts MoE (spec §7) as two grouped Triton GEMMs, with no host sync.

Layout: the T·k (token, expert) pairs are sorted by expert (`moe_align`), and one program per
(expert, N-block) walks that expert's pairs in BLOCK_M rows, so each expert's weight tile is
read once per block of its tokens — the vLLM `fused_moe` idea, written for this model's shapes
(H=2048, I=512, E=256, k=8). Experts nobody picked exit at once. No `.item()`, `nonzero` or
`bincount` anywhere, so the whole thing can be captured in a CUDA graph.

  1. gate_up:  act[p, :] = silu(x[t_p] G_eᵀ) ⊙ (x[t_p] U_eᵀ)          (p = pair, e = its expert)
  2. down:     y[p, :]   = w_p · act[p] D_eᵀ                              (fp32)
  3. out[t]    = Σ_{p of t} y[p]   (a fixed-order sum over the k slots: batch-invariant)

Every product accumulates in fp32 and is rounded once; the reference (`ref.moe_experts`) rounds
each expert's output to the model dtype, so bf16 results differ from it at rounding level.
Source: reference `tailored.ops.reference.moe_experts`; HF-MOD `Qwen3_5MoeExperts`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tailored import flags
from tailored.kernels import autotune_enabled, dot_precision, tuning
from tailored.kernels.fp8_linear import tile_dot
from tailored.kernels.moe_route import (ROUTE_ONE_PROGRAM_UP_TO, align_tile,
                                        expert_partition, moe_align, routing_outputs,
                                        topk_tile)
from tailored.kernels.pdl import enter as pdl_enter
from tailored.kernels.pdl import launch as pdl_launch


@triton.jit
def _program_expert(offsets_ptr, experts_ptr, COMPACT: tl.constexpr):
    """(expert, its first pair, one past its last) for this program: program i takes expert i,
    or with the compact grid the i-th of the active-first list (kb/0016)."""
    if COMPACT:
        e = tl.load(experts_ptr + tl.program_id(0))
    else:
        e = tl.program_id(0)
    return e, tl.load(offsets_ptr + e), tl.load(offsets_ptr + e + 1)


@triton.jit
def _gate_up_rows(x_ptr, w_ptr, order_ptr, act_ptr, ws_ptr, e, start, end, TOPK, stride_xt,
                  stride_wn, stride_at, stride_sn, s_up, stride_we, stride_se,
                  H: tl.constexpr, I: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, KB: tl.constexpr,
                  DOT_PREC: tl.constexpr, W_FP8: tl.constexpr, DOT_F16: tl.constexpr,
                  PAIR_IS_ROW: tl.constexpr):
    """act[p] = silu(x[t_p] G_eᵀ) ⊙ (x[t_p] U_eᵀ) for this program's N block and expert e's
    pairs start..end-1 (pair = order[row], or the row itself with PAIR_IS_ROW: one pair per
    program, `route_fused_moe`)."""
    pid_n = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < I
    w_base = w_ptr + e.to(tl.int64) * stride_we
    ws_base = ws_ptr + e.to(tl.int64) * stride_se
    m0 = start
    while m0 < end:  # a while loop: the interpreter cannot range() over loaded bounds
        m = m0 + tl.arange(0, BLOCK_M)
        m_ok = m < end
        if PAIR_IS_ROW:
            pair = m
        else:
            pair = tl.load(order_ptr + m, mask=m_ok, other=0)
        tok = pair // TOPK
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            for j in tl.static_range(BLOCK_K // KB):  # KB-wide dots (FP8: one scale each)
                kk = k0 + j * KB + tl.arange(0, KB)
                k_ok = kk < H
                x = tl.load(x_ptr + tok[:, None].to(tl.int64) * stride_xt + kk[None, :],
                            mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                wg = tl.load(w_base + n[None, :] * stride_wn + kk[:, None],
                             mask=n_ok[None, :] & k_ok[:, None], other=0.0)
                wu = tl.load(w_base + (I + n)[None, :] * stride_wn + kk[:, None],
                             mask=n_ok[None, :] & k_ok[:, None], other=0.0)
                # block scales (128 rows each): the up half's blocks start at s_up
                acc_g = tile_dot(acc_g, x, wg, ws_base, n, n_ok, stride_sn, k0 + j * KB,
                                 DOT_PREC, W_FP8, 128, DOT_F16)
                acc_u = tile_dot(acc_u, x, wu, ws_base + s_up * stride_sn, n, n_ok, stride_sn,
                                 k0 + j * KB, DOT_PREC, W_FP8, 128, DOT_F16)
        act = acc_g * tl.sigmoid(acc_g) * acc_u
        tl.store(act_ptr + pair[:, None].to(tl.int64) * stride_at + n[None, :],
                 act.to(act_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
        m0 += BLOCK_M


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, order_ptr, offsets_ptr, experts_ptr, act_ptr, ws_ptr,
                    TOPK, stride_xt, stride_we, stride_wn, stride_at, stride_se, stride_sn,
                    s_up,
                    H: tl.constexpr, I: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    KB: tl.constexpr, DOT_PREC: tl.constexpr, PAIRS_BUCKET, W_FP8: tl.constexpr,
                    COMPACT: tl.constexpr, DOT_F16: tl.constexpr = False,
                    PDL: tl.constexpr = False):
    if PDL:  # kernels/pdl.py: wait for the previous kernel first
        pdl_enter()
    e, start, end = _program_expert(offsets_ptr, experts_ptr, COMPACT)
    _gate_up_rows(x_ptr, w_ptr, order_ptr, act_ptr, ws_ptr, e, start, end, TOPK, stride_xt,
                  stride_wn, stride_at, stride_sn, s_up, stride_we, stride_se, H, I, BLOCK_M,
                  BLOCK_N, BLOCK_K, KB, DOT_PREC, W_FP8, DOT_F16, False)


@triton.jit
def _down_kernel(act_ptr, w_ptr, order_ptr, offsets_ptr, experts_ptr, rw_ptr, y_ptr, ws_ptr,
                 stride_at, stride_we, stride_wn, stride_yt, stride_se, stride_sn,
                 H: tl.constexpr, I: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 KB: tl.constexpr, DOT_PREC: tl.constexpr, PAIRS_BUCKET, W_FP8: tl.constexpr,
                 COMPACT: tl.constexpr, DOT_F16: tl.constexpr = False,
                 PDL: tl.constexpr = False):
    if PDL:  # kernels/pdl.py: wait for the previous kernel first
        pdl_enter()
    e, start, end = _program_expert(offsets_ptr, experts_ptr, COMPACT)
    pid_n = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < H
    w_base = w_ptr + e.to(tl.int64) * stride_we
    ws_base = ws_ptr + e.to(tl.int64) * stride_se
    m0 = start
    while m0 < end:
        m = m0 + tl.arange(0, BLOCK_M)
        m_ok = m < end
        pair = tl.load(order_ptr + m, mask=m_ok, other=0)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            for j in tl.static_range(BLOCK_K // KB):
                kk = k0 + j * KB + tl.arange(0, KB)
                k_ok = kk < I
                a = tl.load(act_ptr + pair[:, None].to(tl.int64) * stride_at + kk[None, :],
                            mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_base + n[None, :] * stride_wn + kk[:, None],
                            mask=n_ok[None, :] & k_ok[:, None], other=0.0)
                # float16 dots only with each row scaled into float16's range by a power of
                # 2 (`moe_fp8_down_f16`): silu(g)·u has no bound below 65504
                acc = tile_dot(acc, a, w, ws_base, n, n_ok, stride_sn, k0 + j * KB, DOT_PREC,
                               W_FP8, 128, DOT_F16, True)
        rw = tl.load(rw_ptr + pair, mask=m_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + pair[:, None].to(tl.int64) * stride_yt + n[None, :],
                 acc * rw[:, None], mask=m_ok[:, None] & n_ok[None, :])
        m0 += BLOCK_M


# Prefill M tiles by the mean rows an expert gets (lab/bench_moe_prefill.py on the H200,
# kb/0031; routed experts, µs a layer as served → with the larger tile):
#   1024 tokens (32 rows an expert): 32-row tiles 1030 → 64-row 692 (bf16), 1060 → 853 (FP8);
#   2048 / 4096 / 8192 tokens, bf16: 64-row 1090 / 1694 / 2895 → 128-row 873 / 1269 / 2104.
# FP8 lost with 128 rows at every size (1455 / 1915 / 3338 against 1357 / 1858 / 3107): its
# e4m3 conversion of the weight tiles. Why 64 rows from 16 an expert: each M tile of an
# expert re-reads that expert's weights, and with 16-32 rows an expert many experts need two
# 32-row tiles but only one 64-row tile. In the model (one process, prefill graph of 1024
# tokens) bf16 went 45.5 -> 39.8 ms, but FP8 43.8 -> 46.2: its tuned 64-row config was not the
# bench's fixed one, so FP8 keeps 32-row tiles up to 32 rows (tuned.json's FP8 64-row entry
# now holds the fixed config; bench_decode's fp8_tiles16 variant tries 16 again, kb/0031).
BM64_ABOVE = 16  # bf16 experts
BM64_ABOVE_FP8 = 32
BM128_ABOVE = 48  # bf16 experts only


def _blocks(num_pairs: int, num_experts: int, fp8: bool = False):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) by the mean number of pairs per expert (the
    fixed choice; on CUDA the autotuned launchers below pick BLOCK_N/BLOCK_K/warps/stages)."""
    per_expert = num_pairs / num_experts
    if per_expert <= 4:  # decode: a handful of rows per expert, memory bound
        return 16, 64, 128, 4
    if per_expert <= (BM64_ABOVE_FP8 if fp8 else BM64_ABOVE):
        return 32, 64, 64, 4
    if per_expert > BM128_ABOVE and not fp8:
        return 128, 64, 64, 8
    return 64, 128, 64, 8


def _tuned(kernel, decode: bool, fp8: bool = False, compact_key: bool = True,
           down_f16: bool = False):
    """Autotuned launcher (CUDA only) keyed on the model dims, BLOCK_M and the pair-count
    bucket; tuned when first seen (the runner warms every decode batch size up before CUDA
    graph capture, so no tuning ever happens inside a capture). FP8 weights: dots of KB ≤ 128 (one
    scale per row and dot), BLOCK_K // KB of them per K iteration. The FP8 decode down
    GEMM's configs name their DOT_F16 (the caller omits it), with float16 ones offered when
    down_f16 (`moe_fp8_down_f16`); the tuner only ever sees bf16 activations (fp32 never tunes,
    `autotune_enabled`)."""
    if decode:
        # FP8: K per iteration 128 or 256 as 128-wide dots (one scale each; two independent
        # dots per iteration halve the dependent K chain, kb/0009); bf16: one dot per iteration
        cfgs = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "KB": min(bk, 128) if fp8 else bk},
                              num_warps=w, num_stages=st)
                for bn in (16, 32, 64) for bk in (128, 256)
                for w in (4,) for st in (3, 4)]
        if fp8 and kernel is _down_kernel:
            # FP8 down: the dot kind is part of the config (kb/0045); the float16 dots pay
            # only with 128-wide 4-stage tiles (kb/0044 §4: B=32 62.2 -> 54.7 µs a layer;
            # 64-wide 63.9, 128-wide bf16 64.3), so the tuner weighs both kinds per bucket
            cfgs = [triton.Config({**c.kwargs, "DOT_F16": False}, num_warps=c.num_warps,
                                  num_stages=c.num_stages) for c in cfgs]
            if down_f16:
                cfgs += [triton.Config({"BLOCK_N": bn, "BLOCK_K": 128, "KB": 128,
                                        "DOT_F16": True}, num_warps=4, num_stages=st)
                         for bn in (64, 128) for st in (3, 4)]
    else:
        # prefill runs at ~57 % of HBM bandwidth with these (1024 tokens: gate_up 441 µs for
        # 1 GB, H200): deeper K tiles / pipelines added for the tuner to try (kb/0016)
        cfgs = [triton.Config({"BLOCK_N": bn, "BLOCK_K": 64, "KB": 64}, num_warps=w,
                              num_stages=3)
                for bn in (64, 128) for w in (4, 8)]
        # shared memory per stage of gate_up (BLOCK_M = 64, two weight tiles): 48 KB at
        # BLOCK_N 64, 80 KB at 128 → at most 4 resp. 2 stages in the H200's 228 KB. With
        # 128-row tiles (bf16, kb/0031) the 4-stage one needs ~256 KB: it fails to compile
        # and the tuner skips it (Triton's autotuner times out-of-resources configs as inf)
        cfgs += [triton.Config({"BLOCK_N": bn, "BLOCK_K": 128, "KB": 128}, num_warps=w,
                               num_stages=st)
                 for bn, w, st in ((64, 4, 4), (64, 8, 3), (128, 8, 2))]
    # COMPACT in the key: bucket 256 holds both T=17..31 (compact grid) and T=32 (full grid)
    name = (f"moe/{kernel.__name__.strip('_').removesuffix('_kernel')}/"
            f"{'decode' if decode else 'prefill'}/{'fp8' if fp8 else 'bf16'}")
    key = ["H", "I", "BLOCK_M", "PAIRS_BUCKET"] + (["COMPACT"] if compact_key else [])
    return tuning.register(name, triton.autotune(configs=cfgs, key=key, warmup=5,
                                                 rep=20)(kernel))


_LAUNCHERS: dict = {}
# FP8 experts with bf16 activations: gate_up dots in float16 instead of bf16 (`moe_fp8_dot_f16`,
# kb/0029, kb/0030; bench_moe --ab f16). On the H200 (ncu, B=32) bf16 dots make gate_up
# ALU-bound converting e4m3 → bf16 (79 % SM, 61 % DRAM, 122.6 µs), f16 dots 57 % SM / 81 % DRAM,
# 93.3 µs. Products and sums equal the bf16 dots' (rel 3e-9 measured). On by default (kb/0030):
# in one process decode B=32 11.80 -> 10.82 ms, B=1 3.81 -> 3.68, 1024-token prefill 56.4 ->
# 52.2 ms; the FP8 gate passed with it. The launch configs are the bf16-dot ones (same key).
# The down GEMM (`moe_fp8_down_f16`, kb/0042, kb/0044 §4, kb/0045): its input silu(g)·u has no bound
# below float16's 65504 (an inf would become NaN rows), so each row of an activation tile is scaled
# by a power of 2 into float16's range first and the tile's product scaled back
# (`fp8_linear.pow2_rows_f16`), which changes no bit of a product or of the fp32 sum, bar elements
# below 2^-28 of their row's largest (float16 subnormals). Why: with bf16 dots `_down_kernel`
# streamed ~171 MB of FP8 weights at 2.3 TB/s (B=32) where gate_up with float16 dots streams 3.8
# (kb/0042); with 128-wide tiles and 4 stages 62.2 -> 54.7 µs a layer, in the model B=32 -3.9 %
# median (B=8 -2.7 %), and the FP8 gate passed (kb/0044 §4; no gain at 64-wide tiles, kb/0043 §0).
# The dot kind is part of the decode down config (kb/0045): the tuner weighs 128/64-wide float16
# configs against the bf16 ones per bucket (tuned.json holds the measured picks), for decode-size
# launches only (BLOCK_M 16: ≤ 4 pairs an expert, i.e. decode and verify steps and prefill chunks of
# up to 128 tokens); larger prefills keep bf16 dots (not measured). False = bf16 configs only (A/B:
# bench_decode's down_bf16dot; tuned.json's bf16 picks still apply there, its float16 ones re-tune
# at the re-capture). Read at each launch (each setting has its own launcher); the fixed configs
# (interpreter, TAILORED_AUTOTUNE=0) take float16 dots at decode size when on.
COMPACT_GRID = True  # decode: T·k programs per N-block over the active-first experts (kb/0016)


def _launcher(name: str, decode: bool, fp8: bool = False):
    down_f16 = name == "down" and decode and fp8 and flags.current().moe_fp8_down_f16
    key = (name, decode, fp8, down_f16)
    if key not in _LAUNCHERS:
        kernel = {"gate_up": _gate_up_kernel, "down": _down_kernel,
                  "route_gate_up": _route_gate_up_kernel}[name]
        _LAUNCHERS[key] = _tuned(kernel, decode, fp8, compact_key=name != "route_gate_up",
                                 down_f16=down_f16)
    return _LAUNCHERS[key]


@triton.jit
def _route_gate_up_kernel(x_ptr, w_ptr, act_ptr, ws_ptr, logits_ptr, seg_ptr, rw_ptr, ids_ptr,
                          order_ptr, offsets_ptr, experts_ptr, T, TOPK, stride_xt, stride_we,
                          stride_wn, stride_at, stride_se, stride_sn, s_up, stride_l, stride_s,
                          H: tl.constexpr, I: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, KB: tl.constexpr,
                          DOT_PREC: tl.constexpr, PAIRS_BUCKET, W_FP8: tl.constexpr,
                          E: tl.constexpr, K: tl.constexpr, BLOCK_T: tl.constexpr,
                          BLOCK_S: tl.constexpr, SHARED: tl.constexpr,
                          DOT_F16: tl.constexpr = False, PDL: tl.constexpr = False):
    """route_align and the gate_up GEMM in one launch (`route_fused_moe`, kb/0036): program
    (p, n) routes all T ≤ 4 tokens itself (the same `topk_tile` as `_route_align_kernel`),
    takes pair p = t·TOPK + slot, and computes that one pair's act for N block n. Program
    (0, 0) also stores the routing (weights, ids) and the alignment (order, offsets, experts)
    for the down kernel, which is launched as after `route_align`."""
    if PDL:  # kernels/pdl.py: wait for the previous kernel first
        pdl_enter()
    p = tl.program_id(0)
    first = (p == 0) & (tl.program_id(1) == 0)
    t = tl.arange(0, BLOCK_T)
    t_ok = t < T
    store = t_ok & ((t * 0 + p + tl.program_id(1)) == 0)  # program (0, 0)'s rows
    sel, it = topk_tile(logits_ptr, seg_ptr, rw_ptr, ids_ptr, t, t_ok, store,
                         stride_l, stride_s, E, K, BLOCK_S, SHARED)
    if first:
        align_tile(sel, t, t_ok, T, order_ptr, offsets_ptr, experts_ptr, E, K, SHARED)
    c = tl.arange(0, BLOCK_S)
    mine = (t[:, None] == p // TOPK) & (c[None, :] == p % TOPK)
    e = tl.sum(tl.where(mine, it, 0))
    _gate_up_rows(x_ptr, w_ptr, order_ptr, act_ptr, ws_ptr, e, p, p + 1, TOPK, stride_xt,
                  stride_wn, stride_at, stride_sn, s_up, stride_we, stride_se, H, I, BLOCK_M,
                  BLOCK_N, BLOCK_K, KB, DOT_PREC, W_FP8, DOT_F16, True)


# P (pairs) and NE change with the step's tokens: one variant for every count (a variant per
# count class compiled inside benchmark windows, after warm-up: kb/0034 §1)
def expert_shapes(x, weights, ids, gate_up, down, who: str) -> tuple[int, int, int, int]:
    """(T, H, E, I) of an expert call: x [T, H], weights/ids [T, k], gate_up [E, 2I, H], down
    [E, H, I]; raises ValueError (naming `who`) when they do not fit together."""
    T, H = x.shape
    E, two_i, H2 = gate_up.shape
    I = two_i // 2
    if H2 != H or down.shape != (E, H, I) or ids.shape != weights.shape or ids.shape[0] != T:
        raise ValueError(f"{who}: shapes x{tuple(x.shape)} ids{tuple(ids.shape)} "
                         f"gate_up{tuple(gate_up.shape)} down{tuple(down.shape)}")
    return T, H, E, I


def _expert_scales(x, gate_up, down, gate_up_scale, down_scale, E, H, I, who: str):
    """(fp8, gate_up_scale, down_scale, (gate_up scale strides), (down scale strides)) of an
    expert call: FP8 weights need their block scales (else ValueError naming `who`); bf16/fp32
    weights get x as the unused pointer arguments."""
    fp8 = gate_up.dtype == torch.float8_e4m3fn
    nb_i, nb_h = triton.cdiv(I, 128), triton.cdiv(H, 128)
    if fp8 and (gate_up_scale is None or down_scale is None
                or gate_up_scale.shape != (E, 2 * nb_i, nb_h)
                or down_scale.shape != (E, nb_h, nb_i)):
        raise ValueError(f"{who}: FP8 experts need block scales gate_up_scale "
                         f"[{E}, {2 * nb_i}, {nb_h}] and down_scale [{E}, {nb_h}, {nb_i}] "
                         "(fp8.expert_block_scales)")
    if not fp8:  # unused pointer arguments
        return False, x, x, (0, 0), (0, 0)
    gate_up_scale, down_scale = gate_up_scale.contiguous(), down_scale.contiguous()
    return (True, gate_up_scale, down_scale, (gate_up_scale.stride(0), gate_up_scale.stride(1)),
            (down_scale.stride(0), down_scale.stride(1)))


def _launch_down(dn_args, grid_e: int, H: int, I: int, bm: int, bn: int, bk: int, warps: int,
                 prec, bucket: int, fp8: bool, compact: bool, tuned: bool, x: torch.Tensor):
    """The down GEMM over grid_e expert programs (autotuned on CUDA, else the fixed blocks).
    FP8 experts at decode size (BLOCK_M 16) with bf16 activations: float16 dots where
    `moe_fp8_down_f16` (the tuned launcher's config carries DOT_F16); fp32 activations keep fp32
    dots, larger prefill tiles bf16 dots."""
    decode = bm == 16
    f16 = fp8 and flags.current().moe_fp8_down_f16 and decode and x.dtype == torch.bfloat16
    if tuned:
        launch = _launcher("down", decode, fp8)
        # the FP8 decode configs carry their DOT_F16 (`_tuned`); the others take it here
        dot = {} if "DOT_F16" in launch.configs[0].kwargs else {"DOT_F16": False}
        launch[lambda m: (grid_e, triton.cdiv(H, m["BLOCK_N"]))](
            *dn_args, H=H, I=I, BLOCK_M=bm, DOT_PREC=prec, PAIRS_BUCKET=bucket, W_FP8=fp8,
            COMPACT=compact, **dot, **pdl_launch(x))
        return
    kb = min(bk, 128) if fp8 else bk  # FP8: one scale per row and dot
    bk_dn = min(bk, triton.next_power_of_2(I))
    _down_kernel[(grid_e, triton.cdiv(H, bn))](
        *dn_args, H=H, I=I, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk_dn, KB=min(kb, bk_dn),
        DOT_PREC=prec, PAIRS_BUCKET=bucket, W_FP8=fp8, COMPACT=compact, DOT_F16=f16,
        num_warps=warps, **pdl_launch(x))


def fused_moe(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
              gate_up: torch.Tensor, down: torch.Tensor, aligned=None,
              gate_up_scale: torch.Tensor | None = None,
              down_scale: torch.Tensor | None = None, reduce: bool = True) -> torch.Tensor:
    """Σ_i w_i · Expert_{e_i}(x), same contract as `ref.moe_experts`.

    x: [T, H] (bf16/fp32, row stride free, unit column stride); weights: [T, k] routing weights;
    ids: [T, k] int64; gate_up: [E, 2I, H] gate rows first; down: [E, H, I].
    aligned: (order, offsets) or (order, offsets, experts) from `route_align` (else
    `moe_align` runs here). With T·k < E pairs (decode) the expert GEMMs run over T·k
    programs per N-block instead of E, taking experts from `expert_partition` (kb/0016): at
    B=1 that is 8 programs where 248 of 256 had nothing to do. COMPACT_GRID = False restores
    the one-program-per-expert grid (A/B benchmarks); the results are bitwise the same.
    Block-FP8 experts (spec §9.1): gate_up/down float8_e4m3fn with their block scales
    gate_up_scale [E, 2·ceil(I/128), ceil(H/128)] (gate blocks, then up blocks) and down_scale
    [E, ceil(H/128), ceil(I/128)] fp32 (`fp8.expert_block_scales`); the reference is
    `ref.moe_experts` over `fp8.DequantExperts`.
    Returns [T, H] in x.dtype; reduce=False returns the weighted pair terms instead, [T·k, H]
    fp32 in (token, choice) order, for `moe_combine` to sum with the shared expert in one pass.
    Raises ValueError on mismatched shapes.
    """
    T, H, E, I = expert_shapes(x, weights, ids, gate_up, down, "fused_moe")
    fp8, gate_up_scale, down_scale, s_gu, s_dn = _expert_scales(
        x, gate_up, down, gate_up_scale, down_scale, E, H, I, "fused_moe")
    nb_i = triton.cdiv(I, 128)
    k = ids.shape[1]
    if x.stride(1) != 1:
        x = x.contiguous()
    gate_up, down = gate_up.contiguous(), down.contiguous()
    order, offsets, *rest = aligned if aligned is not None else moe_align(ids, E)
    compact = COMPACT_GRID and T * k < E
    experts = (rest[0] if rest else expert_partition(offsets)) if compact else offsets
    grid_e = T * k if compact else E
    bm, bn, bk, warps = _blocks(T * k, E, fp8)
    prec = dot_precision(x.dtype)
    # decode: one tuning per power-of-2 pair count; prefill: one for all sizes (tuning mid-serve
    # would stall a request)
    bucket = triton.next_power_of_2(T * k) if bm == 16 else 0
    act = torch.empty(T * k, I, dtype=x.dtype, device=x.device)
    y = torch.empty(T * k, H, dtype=torch.float32, device=x.device)
    rw = weights.reshape(-1).contiguous()
    gu_args = (x, gate_up, order, offsets, experts, act, gate_up_scale, k,
               x.stride(0), gate_up.stride(0), gate_up.stride(1), act.stride(0), *s_gu, nb_i)
    dn_args = (act, down, order, offsets, experts, rw, y, down_scale,
               act.stride(0), down.stride(0), down.stride(1), y.stride(0), *s_dn)
    # exact for bf16 activations only
    f16 = fp8 and flags.current().moe_fp8_dot_f16 and x.dtype == torch.bfloat16
    tuned = x.is_cuda and autotune_enabled(x.dtype)
    if tuned:  # autotuned block sizes
        _launcher("gate_up", bm == 16, fp8)[lambda m: (grid_e, triton.cdiv(I, m["BLOCK_N"]))](
            *gu_args, H=H, I=I, BLOCK_M=bm, DOT_PREC=prec, PAIRS_BUCKET=bucket, W_FP8=fp8,
            COMPACT=compact, DOT_F16=f16, **pdl_launch(x))
    else:  # Triton's interpreter (tests on the CPU), or TAILORED_AUTOTUNE=0: the fixed choice
        kb = min(bk, 128) if fp8 else bk  # FP8: one scale per row and dot
        _gate_up_kernel[(grid_e, triton.cdiv(I, bn))](
            *gu_args, H=H, I=I, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, KB=kb, DOT_PREC=prec,
            PAIRS_BUCKET=bucket, W_FP8=fp8, COMPACT=compact, DOT_F16=f16, num_warps=warps,
            **pdl_launch(x))
    _launch_down(dn_args, grid_e, H, I, bm, bn, bk, warps, prec, bucket, fp8, compact, tuned, x)
    return y.view(T, k, H).sum(1).to(x.dtype) if reduce else y


class RoutedOperands(NamedTuple):
    """The checked operands and outputs of one routing-in-gate_up MoE call (`route_fused_moe`,
    `moe_gemv.route_gemv_moe`): x and the experts with unit column strides, T rows, E routed
    experts, S pair slots a token, En experts in the weights (with the shared one), dims H and
    I, the routing outputs (`routing_outputs`), the scales (`_expert_scales`), and the
    empty act [T·S, I] (x.dtype) and pair terms y [T·S, H] (fp32)."""
    x: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    T: int
    E: int
    S: int
    En: int
    H: int
    I: int
    w: torch.Tensor
    ids: torch.Tensor
    order: torch.Tensor
    offsets: torch.Tensor
    experts: torch.Tensor
    seg: torch.Tensor
    fp8: bool
    gate_up_scale: torch.Tensor
    down_scale: torch.Tensor
    s_gu: tuple
    s_dn: tuple
    act: torch.Tensor
    y: torch.Tensor


def routed_operands(x, router_logits, top_k, gate_up, down, shared_gate, gate_up_scale,
                    down_scale, who: str) -> RoutedOperands:
    """Check a routing-in-gate_up call (1 ≤ T ≤ ROUTE_ONE_PROGRAM_UP_TO, E a power of 2, the
    weights' expert count the routing's) and allocate its outputs; ValueError naming `who`."""
    T, E = router_logits.shape
    if T > ROUTE_ONE_PROGRAM_UP_TO or T < 1 or E & (E - 1):
        raise ValueError(f"{who}: T={T} not in 1..{ROUTE_ONE_PROGRAM_UP_TO} or "
                         f"E={E} not a power of 2")
    S, En, w, ids, order, offsets, experts, seg = routing_outputs(
        router_logits, top_k, shared_gate, who)
    _, H, Ew, I = expert_shapes(x, w, ids, gate_up, down, who)
    if Ew != En:
        raise ValueError(f"{who}: {Ew} experts in the weights, routing gives {En}")
    fp8, gate_up_scale, down_scale, s_gu, s_dn = _expert_scales(
        x, gate_up, down, gate_up_scale, down_scale, Ew, H, I, who)
    if x.stride(1) != 1:
        x = x.contiguous()
    act = torch.empty(T * S, I, dtype=x.dtype, device=x.device)
    y = torch.empty(T * S, H, dtype=torch.float32, device=x.device)
    return RoutedOperands(x, gate_up.contiguous(), down.contiguous(), T, E, S, En, H, I, w, ids,
                          order, offsets, experts, seg, fp8, gate_up_scale, down_scale, s_gu,
                          s_dn, act, y)


def route_fused_moe(x: torch.Tensor, router_logits: torch.Tensor, top_k: int,
                    gate_up: torch.Tensor, down: torch.Tensor,
                    shared_gate: torch.Tensor | None = None,
                    gate_up_scale: torch.Tensor | None = None,
                    down_scale: torch.Tensor | None = None):
    """`route_align` then `fused_moe(..., reduce=False)` in two launches instead of three: the
    gate_up programs route the tokens themselves (one program per (token, slot) pair and N
    block), so the step's chain loses the routing launch (kb/0036). Decode batches only.

    x: [T, H] normed hidden states, T ≤ ROUTE_ONE_PROGRAM_UP_TO (4); router_logits: [T, E],
    E a power of 2; shared_gate [T, 1] or None and the experts (with the shared one stacked as
    expert E when shared_gate is given, `model/moe_stack.py`) as in `route_align` and
    `fused_moe`. Returns (pairs [T·S, H] fp32 in (token, slot) order, weights [T, S] in the
    logits dtype, ids [T, S] int64), S = top_k (+1 with the shared expert): bitwise what
    `route_align` + `fused_moe(reduce=False)` give (the same top-k code, the same per-pair
    arithmetic). Raises ValueError for other T, E or shapes.
    """
    c = routed_operands(x, router_logits, top_k, gate_up, down, shared_gate, gate_up_scale,
                        down_scale, "route_fused_moe")
    x, gate_up, down, T, E, S, En, H, I = c.x, c.gate_up, c.down, c.T, c.E, c.S, c.En, c.H, c.I
    w, ids, order, offsets, experts, seg = c.w, c.ids, c.order, c.offsets, c.experts, c.seg
    fp8, gate_up_scale, down_scale, s_gu, s_dn = (c.fp8, c.gate_up_scale, c.down_scale, c.s_gu,
                                                  c.s_dn)
    act, y, shared = c.act, c.y, shared_gate is not None
    bm, bn, bk, warps = _blocks(T * S, En, fp8)
    prec = dot_precision(x.dtype)
    bucket = triton.next_power_of_2(T * S)
    gu_args = (x, gate_up, act, gate_up_scale, router_logits, seg, w, ids, order, offsets,
               experts, T, S, x.stride(0), gate_up.stride(0), gate_up.stride(1),
               act.stride(0), *s_gu, triton.cdiv(I, 128), router_logits.stride(0),
               seg.stride(0))
    # the down GEMM as after route_align: over the active-first experts while T·S < experts
    compact = COMPACT_GRID and T * S < En
    dn_args = (act, down, order, offsets, experts if compact else offsets, w.view(-1), y,
               down_scale, act.stride(0), down.stride(0), down.stride(1), y.stride(0), *s_dn)
    route = dict(E=E, K=top_k, BLOCK_T=max(2, triton.next_power_of_2(T)),
                 BLOCK_S=triton.next_power_of_2(S), SHARED=shared)
    f16 = fp8 and flags.current().moe_fp8_dot_f16 and x.dtype == torch.bfloat16
    tuned = x.is_cuda and autotune_enabled(x.dtype)
    if tuned:
        _launcher("route_gate_up", True, fp8)[lambda m: (T * S, triton.cdiv(I, m["BLOCK_N"]))](
            *gu_args, H=H, I=I, BLOCK_M=bm, DOT_PREC=prec, PAIRS_BUCKET=bucket, W_FP8=fp8,
            DOT_F16=f16, **route, **pdl_launch(x))
    else:
        _route_gate_up_kernel[(T * S, triton.cdiv(I, bn))](
            *gu_args, H=H, I=I, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            KB=min(bk, 128) if fp8 else bk, DOT_PREC=prec, PAIRS_BUCKET=bucket, W_FP8=fp8,
            DOT_F16=f16, **route, num_warps=warps, **pdl_launch(x))
    _launch_down(dn_args, T * S if compact else En, H, I, bm, bn, bk, warps, prec, bucket, fp8,
                 compact, tuned, x)
    return y, w, ids
