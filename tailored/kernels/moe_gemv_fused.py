"""Routed + shared experts of a 1–2 row decode step in ONE launch: per (pair, intermediate
block) program gate_up, SiLU·up and that block's share of the down projection (kb/0051).

Why: at one row the experts run as two launches, each a ~10 µs weight stream with its own
ramp and tail: bf16 `moe.route_fused_moe` gate_up 17.2 + down 7.9 µs a layer for 56.6 MB
(~2.2 TB/s of the ~4.3 an HBM stream reaches, kb/0049 §2), FP8 `moe_gemv.route_gemv_moe`
15.4 µs for 28.3 MB (kb/0039). The down GEMM needs a pair's whole act row, but its sum over
the intermediate dim splits: with n ∈ [nb·BN, (nb+1)·BN)

    act[n]      = silu(x·G_e[n]) · (x·U_e[n])             rows n of gate_up
    part[nb, :] = Σ_{n in block} act[n] · D_e[:, n]       columns n of down   [H]
    y[p, :]     = w_p · Σ_nb part[nb, :]

so program (p, nb) reads rows n of gate_up and columns n of down and depends on no other
program: every weight byte of the step's experts is read once, in one stream of 56.6 MB
(bf16) with one ramp. The partials [P, NB, H] fp32 (~1.2 MB at one row, in L2) are summed in
nb order by the pair's last program to finish — an atomic counter per pair, put back to 0
by that program so every launch and graph replay finds it zero — so the result does not
depend on the order the programs ran in (deterministic, unlike float atomics).

Each program routes the ≤ 2 rows itself (`moe._topk_tile`, as `moe.route_fused_moe`), so
the routing weights/ids are bitwise route_align's at 4 warps (program (0, 0) stores them).
Numerics: act is rounded to x's dtype as the two-launch kernels store it; products and sums
in fp32 in another order than theirs (rel. differences at fp32 rounding level); FP8 weights:
x·scale per 128-wide K block times the e4m3 value for gate_up (as `moe_gemv`), the down
partial times its row block's scale, i.e. s·Σ(q·act) instead of Σ(q·act·s).
Reference: `moe.route_fused_moe` / `ref.moe_experts` (tests/test_kernels.py); spec §7.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tailored.kernels import moe
from tailored.kernels.pdl import enter as pdl_enter
from tailored.kernels.pdl import launch as pdl_launch

# (BN intermediate columns a program, KC gate_up K chunk, HC down rows a chunk, num_warps) by
# weight kind and rows. Not yet measured on the H200 (scripts/bench_moe_gemv.py --fused
# sweeps them): a first guess, BN 32 = 16 blocks × 9 pairs = 144 programs at one row.
CFG = {("bf16", 1): (32, 512, 256, 8), ("bf16", 2): (32, 512, 256, 8),
       ("fp8", 1): (32, 1024, 256, 8), ("fp8", 2): (32, 1024, 256, 8)}


def _cfg_file(path: str | None) -> dict:
    """CFG's entries from a JSON file {"bf16"|"fp8": {"1"|"2": [BN, KC, HC, warps]}} (what
    `scripts/bench_moe_gemv.py --sweep fused --best F` writes), named by
    TAILORED_MOE_FUSED_CFG: a device call measures configs, then runs the model and the gate
    on the fastest without an edit. No file named: {}. ValueError on a malformed file."""
    if not path:
        return {}
    import json

    try:
        doc = json.loads(open(path).read())
        return {(prec, int(t)): tuple(int(v) for v in c) for prec, by_t in doc.items()
                for t, c in by_t.items() if len(c) == 4 and prec in ("bf16", "fp8")}
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"TAILORED_MOE_FUSED_CFG={path}: {type(e).__name__}: {e}") from e


CFG.update(_cfg_file(os.environ.get("TAILORED_MOE_FUSED_CFG")))
MAX_PAIRS = 64  # counters a device holds: T·S ≤ 2·(8+1) in the model; 4·(k+1) allowed here
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def counters(device: torch.device) -> torch.Tensor:
    """The per-pair arrival counters on device ([MAX_PAIRS] int32, zero between launches).

    Allocated once per device, outside any CUDA-graph capture: a buffer made during a capture
    would come from the graph's private pool. The model calls this at start (FastPath), so the
    first launch inside a capture finds it; a capture that would have to allocate it raises
    RuntimeError instead."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    c = _COUNTERS.get(device)
    if c is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("moe_gemv_fused: counters must be made before graph capture "
                               "(call moe_gemv_fused.counters(device) first)")
        c = _COUNTERS[device] = torch.zeros(MAX_PAIRS, dtype=torch.int32, device=device)
    return c


@triton.jit
def _fused_kernel(x_ptr, gu_ptr, dn_ptr, gus_ptr, dns_ptr, logits_ptr, seg_ptr, rw_ptr, ids_ptr,
                  part_ptr, cnt_ptr, y_ptr, T, stride_xt, stride_gue, stride_gun, stride_dne,
                  stride_dnh, stride_guse, stride_gusn, s_up, stride_dnse, stride_dnsh,
                  stride_yt, stride_l, stride_s,
                  H: tl.constexpr, I: tl.constexpr, BN: tl.constexpr, KC: tl.constexpr,
                  HC: tl.constexpr, NB: tl.constexpr, W_FP8: tl.constexpr, E: tl.constexpr,
                  K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
                  SHARED: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # kernels/pdl.py: wait for the previous kernel first
        pdl_enter()
    p = tl.program_id(0)
    nb = tl.program_id(1)
    S: tl.constexpr = K + 1 if SHARED else K
    t = tl.arange(0, BLOCK_T)
    t_ok = t < T
    store = t_ok & ((t * 0 + p + nb) == 0)  # program (0, 0) stores the routing
    _, it, wt = moe._topk_tile(logits_ptr, seg_ptr, rw_ptr, ids_ptr, t, t_ok, store, stride_l,
                               stride_s, E, K, BLOCK_S, SHARED)
    c = tl.arange(0, BLOCK_S)
    mine = (t[:, None] == p // S) & (c[None, :] == p % S)
    e = tl.sum(tl.where(mine, it, 0)).to(tl.int64)
    # the weight as stored (rounded to the logits' dtype), as the down kernels read it back
    rw = tl.sum(tl.where(mine, wt, 0.0)).to(rw_ptr.dtype.element_ty).to(tl.float32)
    n0 = nb * BN  # BN divides 128: the block's rows share one row block of scales
    n = n0 + tl.arange(0, BN)
    n_ok = n < I
    # gate and up rows n over K = H, in chunks of KC
    gu_base = gu_ptr + e * stride_gue
    gs_base = gus_ptr + e * stride_guse + (n0 // 128) * stride_gusn
    g = tl.zeros([BN], dtype=tl.float32)
    u = tl.zeros([BN], dtype=tl.float32)
    for k0 in tl.static_range(0, H, KC):
        k = k0 + tl.arange(0, KC)
        k_ok = k < H
        m = n_ok[:, None] & k_ok[None, :]
        xv = tl.load(x_ptr + (p // S) * stride_xt + k, mask=k_ok, other=0.0).to(tl.float32)
        wg = tl.load(gu_base + n[:, None] * stride_gun + k[None, :], mask=m, other=0.0)
        wu = tl.load(gu_base + (n[:, None] + I) * stride_gun + k[None, :], mask=m, other=0.0)
        xg = xv
        xu = xv
        if W_FP8:
            xg = xv * tl.load(gs_base + k // 128, mask=k_ok, other=0.0)
            xu = xv * tl.load(gs_base + s_up * stride_gusn + k // 128, mask=k_ok, other=0.0)
        g += tl.sum(wg.to(tl.float32) * xg[None, :], 1)
        u += tl.sum(wu.to(tl.float32) * xu[None, :], 1)
    # rounded to x's dtype, as the two-launch kernels store act (masked n: g = u = 0 -> 0)
    a = (g * tl.sigmoid(g) * u).to(x_ptr.dtype.element_ty).to(tl.float32)
    # this block's share of the down projection: columns n of D_e, all H rows in chunks of HC
    dn_base = dn_ptr + e * stride_dne
    ds_base = dns_ptr + e * stride_dnse + n0 // 128
    part_row = part_ptr + (p * NB + nb).to(tl.int64) * H
    for h0 in tl.static_range(0, H, HC):
        h = h0 + tl.arange(0, HC)
        h_ok = h < H
        wd = tl.load(dn_base + h[:, None] * stride_dnh + n[None, :],
                     mask=h_ok[:, None] & n_ok[None, :], other=0.0)
        part = tl.sum(wd.to(tl.float32) * a[None, :], 1)
        if W_FP8:
            part = part * tl.load(ds_base + (h // 128) * stride_dnsh, mask=h_ok, other=0.0)
        tl.store(part_row + h, part, mask=h_ok)
    # every thread's partial stores are done before one thread's release-ordered arrival; the
    # pair's last arrival sums the NB partials in nb order (L1 bypassed: other SMs wrote them)
    tl.debug_barrier()
    old = tl.atomic_add(cnt_ptr + p, 1, sem="acq_rel", scope="gpu")
    if old == NB - 1:
        for h0 in tl.static_range(0, H, HC):
            h = h0 + tl.arange(0, HC)
            h_ok = h < H
            acc = tl.zeros([HC], dtype=tl.float32)
            for j in tl.static_range(NB):
                acc += tl.load(part_ptr + (p * NB + j).to(tl.int64) * H + h, mask=h_ok,
                               other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + p * stride_yt + h, acc * rw, mask=h_ok)
        tl.store(cnt_ptr + p, 0)  # zero again for the next launch (stream-ordered)


def route_gemv_moe_fused(x: torch.Tensor, router_logits: torch.Tensor, top_k: int,
                         gate_up: torch.Tensor, down: torch.Tensor,
                         shared_gate: torch.Tensor | None = None,
                         gate_up_scale: torch.Tensor | None = None,
                         down_scale: torch.Tensor | None = None,
                         cfg: tuple[int, int, int, int] | None = None):
    """`moe.route_fused_moe`'s contract in one launch (the kernel above).

    x: [T, H] normed hidden states (bf16/fp32, unit column stride), 1 ≤ T ≤
    `moe.ROUTE_ONE_PROGRAM_UP_TO`; router_logits [T, E], E a power of 2; shared_gate [T, 1] or
    None; gate_up [En, 2I, H], down [En, H, I] (bf16/fp32, or float8_e4m3fn with their block
    scales, `fp8.expert_block_scales`), En = E (+1 with the shared expert stacked as expert E).
    cfg: (BN, KC, HC, num_warps) instead of `CFG`'s (benchmarks); BN a power of 2 ≤ 128, KC
    and HC powers of 2.
    Returns (pairs [T·S, H] fp32 in (token, slot) order, weights [T, S] in the logits dtype,
    ids [T, S] int64), S = top_k (+1 with the shared expert): the routing bitwise
    route_align's at 4 warps (other warp counts sum the softmax in another order), the pair
    terms route_fused_moe's up to the fp32 summation order.
    Raises ValueError for other T, E, mismatched shapes or cfg; RuntimeError when the pair
    counters would first be made inside a graph capture (`counters`).
    """
    c = moe.routed_operands(x, router_logits, top_k, gate_up, down, shared_gate, gate_up_scale,
                            down_scale, "route_gemv_moe_fused")
    x, gate_up, down, T, S, H, I, fp8 = c.x, c.gate_up, c.down, c.T, c.S, c.H, c.I, c.fp8
    bn, kc, hc, warps = cfg or CFG["fp8" if fp8 else "bf16", min(T, 2)]
    if any(v < 1 or v & (v - 1) for v in (bn, kc, hc, warps)) or bn > 128:
        raise ValueError(f"route_gemv_moe_fused: cfg {cfg} (BN a power of 2 ≤ 128, KC, HC, "
                         "warps powers of 2)")
    if T * S > MAX_PAIRS:
        raise ValueError(f"route_gemv_moe_fused: {T * S} pairs > {MAX_PAIRS}")
    bn = min(bn, triton.next_power_of_2(I))
    nb = triton.cdiv(I, bn)
    part = torch.empty(T * S, nb, H, dtype=torch.float32, device=x.device)
    cnt = counters(x.device)
    _fused_kernel[(T * S, nb)](
        x, gate_up, down, c.gate_up_scale, c.down_scale, router_logits, c.seg, c.w, c.ids, part,
        cnt, c.y, T, x.stride(0), gate_up.stride(0), gate_up.stride(1), down.stride(0),
        down.stride(1), *c.s_gu, triton.cdiv(I, 128), *c.s_dn, c.y.stride(0),
        router_logits.stride(0), c.seg.stride(0), H=H, I=I, BN=bn,
        KC=min(kc, triton.next_power_of_2(H)), HC=min(hc, triton.next_power_of_2(H)), NB=nb,
        W_FP8=fp8, E=c.E, K=top_k, BLOCK_T=max(2, triton.next_power_of_2(T)),
        BLOCK_S=triton.next_power_of_2(S), SHARED=shared_gate is not None, num_warps=warps,
        **pdl_launch(x))
    return c.y, c.w, c.ids
