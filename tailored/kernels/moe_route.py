"""MoE routing and expert alignment (spec §7.2) as Triton kernels, with no host sync.

`route_align`: softmax over the experts, top-k, renormalisation, then the (token, slot) pairs
sorted by expert (`moe_align`'s order and offsets) and the experts with pairs listed first
(`expert_partition`) — one launch up to ROUTE_ONE_PROGRAM_UP_TO rows, two up to
ROUTE_ALIGN_MAX_TOKENS (kb/0021, kb/0024). The expert GEMMs that consume them are in
kernels/moe.py; `topk_tile` is also the routing inside their gate_up programs (kb/0036).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tailored.kernels.pdl import enter as pdl_enter
from tailored.kernels.pdl import launch as pdl_launch


def moe_align(ids: torch.Tensor, num_experts: int):
    """Sort (token, slot) pairs by expert.

    ids: [T, k] int64 expert ids. Returns (order [T·k] int32: pair indices p = t·k + slot sorted
    by expert, stable; offsets [E+1] int32: expert e owns order[offsets[e]:offsets[e+1]]).
    Graph-safe: sort + searchsorted, no data-dependent shapes.
    """
    # int32 keys: torch's block radix sort makes one pass per 4 key bits, so int64 expert ids
    # cost twice the passes (B=32 H200 profile: radixSortKVInPlace 26.8 µs a layer, kb/0019)
    flat = ids.reshape(-1).to(torch.int32)
    sorted_e, order = torch.sort(flat, stable=True)
    bounds = torch.arange(num_experts + 1, device=ids.device, dtype=sorted_e.dtype)
    offsets = torch.searchsorted(sorted_e, bounds)
    return order.to(torch.int32), offsets.to(torch.int32)


def expert_partition_ref(offsets: torch.Tensor) -> torch.Tensor:
    """Reference of `expert_partition`: expert ids [E] int32, the ones with pairs first, then
    the empty ones, each group ascending (a stable partition)."""
    counts = offsets[1:] - offsets[:-1]
    return torch.argsort((counts == 0).to(torch.int8), stable=True).to(torch.int32)


@triton.jit
def store_active_first(experts_ptr, e, counts, ok, EXTRA: tl.constexpr = 0):
    """Write expert ids e (a [BLOCK_E] range) to experts_ptr, the ones with counts > 0 first:
    an active e goes to its rank among the active, an empty e after all active, by its rank
    among the empty (a stable partition). EXTRA leaves that many places free between the
    active and the empty ones (route_align puts the shared expert there). Shared by
    `expert_partition` and `route_align`."""
    has = (counts > 0).to(tl.int32)
    before = tl.cumsum(has, 0) - has  # active experts before e
    place = tl.where(has > 0, before, tl.sum(has, 0) + EXTRA + e - before)
    tl.store(experts_ptr + place, e, mask=ok)
    return tl.sum(has, 0)


@triton.jit
def _partition_kernel(offsets_ptr, experts_ptr, E, BLOCK_E: tl.constexpr,
                      PDL: tl.constexpr = False):
    if PDL:  # kernels/pdl.py: wait for the previous kernel first
        pdl_enter()
    e = tl.arange(0, BLOCK_E)
    ok = e < E
    counts = tl.load(offsets_ptr + e + 1, mask=ok, other=0) - tl.load(offsets_ptr + e, mask=ok, other=0)
    store_active_first(experts_ptr, e, counts, ok)


def expert_partition(offsets: torch.Tensor) -> torch.Tensor:
    """Experts with pairs first: [E] int32 from `moe_align`'s offsets [E+1] (one launch,
    graph-safe). A decode step of T·k < E pairs launches its expert GEMMs over only T·k
    programs per N-block, program i taking the i-th expert of this list: every expert with
    pairs is among the first T·k, and the rest of those are empty (they exit at once)."""
    E = offsets.numel() - 1
    experts = torch.empty(E, dtype=torch.int32, device=offsets.device)
    _partition_kernel[(1,)](offsets, experts, E, BLOCK_E=max(2, triton.next_power_of_2(E)),
                            **pdl_launch(offsets))
    return experts


@triton.jit
def topk_tile(logits_ptr, seg_ptr, w_ptr, ids_ptr, t, t_ok, store_ok, stride_l, stride_s,
               E: tl.constexpr, K: tl.constexpr, BLOCK_S: tl.constexpr, SHARED: tl.constexpr):
    """Routing of the token rows t (spec §7.2): softmax over the E experts (fp32), top-k by
    repeated max (largest first, ties to the lowest id), renormalised over the k, stored as
    w/ids [T, S] (S = k, or k+1 with the shared expert as expert E in slot k, weight
    sigmoid(shared gate)), in the rows where store_ok. Returns (sel [rows, E]: slot+1 of each
    chosen expert, 0 elsewhere; the expert ids by slot [rows, BLOCK_S] int64)."""
    e = tl.arange(0, E)
    S: tl.constexpr = K + 1 if SHARED else K  # pair slots per token
    x = tl.load(logits_ptr + t[:, None] * stride_l + e[None, :], mask=t_ok[:, None],
                other=0.0).to(tl.float32)
    p = tl.exp(x - tl.max(x, 1)[:, None])
    p = p / tl.sum(p, 1)[:, None]
    # a NaN row (NaN or inf logits) would make every top-k round pick the same expert on the
    # GPU (all comparisons false), and the alignment would then leave pairs unwritten that the
    # shared expert's down program reads (found in review, kb/0036): NaN probabilities count
    # as 0, so k distinct experts are chosen; the row's weights are then NaN (0/0) as before
    p = tl.where(p == p, p, 0.0)
    sel = tl.zeros(p.shape, dtype=tl.int32)
    c = tl.arange(0, BLOCK_S)  # pair slot
    wt = tl.zeros([p.shape[0], BLOCK_S], dtype=tl.float32)  # chosen probabilities by slot
    it = tl.zeros([p.shape[0], BLOCK_S], dtype=tl.int64)  # chosen experts by slot
    q = p
    for j in tl.static_range(K):
        v, idx = tl.max(q, 1, return_indices=True, return_indices_tie_break_left=True)
        hit = e[None, :] == idx[:, None]
        sel = tl.where(hit, j + 1, sel)
        q = tl.where(hit, -1.0, q)
        wt = tl.where(c[None, :] == j, v[:, None], wt)
        it = tl.where(c[None, :] == j, idx[:, None].to(tl.int64), it)
    wt = wt / tl.sum(wt, 1)[:, None]
    if SHARED:
        s = tl.load(seg_ptr + t * stride_s, mask=t_ok, other=0.0).to(tl.float32)
        wt = tl.where(c[None, :] == K, tl.math.div_rn(1.0, 1.0 + tl.exp(-s))[:, None], wt)
        it = tl.where(c[None, :] == K, E, it)
    out_ok = store_ok[:, None] & (c[None, :] < S)
    tl.store(w_ptr + t[:, None] * S + c[None, :], wt.to(w_ptr.dtype.element_ty), mask=out_ok)
    tl.store(ids_ptr + t[:, None] * S + c[None, :], it, mask=out_ok)
    return sel, it


@triton.jit
def align_tile(sel, t, t_ok, T, order_ptr, offsets_ptr, experts_ptr, E: tl.constexpr,
                K: tl.constexpr, SHARED: tl.constexpr):
    """moe_align + expert_partition of all T tokens from sel [BLOCK_T, E] (slot+1 per chosen
    expert): a counting sort — offsets = exclusive cumsum of the per-expert counts, a pair's
    place within its expert = how many earlier tokens chose that expert (stable, like the
    sort) — and the active-first expert list. With SHARED, expert E's pairs t·S+K come last."""
    e = tl.arange(0, E)
    S: tl.constexpr = K + 1 if SHARED else K
    chosen = ((sel > 0) & t_ok[:, None]).to(tl.int32)
    counts = tl.sum(chosen, 0)
    incl = tl.cumsum(counts, 0)
    tl.store(offsets_ptr + 1 + e, incl)
    tl.store(offsets_ptr + e, 0, mask=e == 0)
    rank = tl.cumsum(chosen, 0) - chosen
    pos = (incl - counts)[None, :] + rank
    pair = t[:, None] * S + (sel - 1)
    tl.store(order_ptr + pos, pair, mask=chosen > 0)
    n_active = store_active_first(experts_ptr, e, counts, e < E, 1 if SHARED else 0)
    if SHARED:
        tl.store(order_ptr + T * K + t, t * S + K, mask=t_ok)
        tl.store(offsets_ptr + E + 1 + t, tl.zeros(t.shape, tl.int32) + T * S, mask=t == 0)
        tl.store(experts_ptr + n_active + t, tl.zeros(t.shape, tl.int32) + E, mask=t == 0)


@triton.jit
def _route_align_kernel(logits_ptr, seg_ptr, w_ptr, ids_ptr, order_ptr, offsets_ptr, experts_ptr,
                        T, stride_l, stride_s, E: tl.constexpr, K: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, SHARED: tl.constexpr,
                        PDL: tl.constexpr = False):
    """Routing and alignment of all T tokens in one program (small batches)."""
    if PDL:  # kernels/pdl.py: wait for the previous kernel first
        pdl_enter()
    t = tl.arange(0, BLOCK_T)
    t_ok = t < T
    sel, _ = topk_tile(logits_ptr, seg_ptr, w_ptr, ids_ptr, t, t_ok, t_ok, stride_l, stride_s,
                        E, K, BLOCK_S, SHARED)
    align_tile(sel, t, t_ok, T, order_ptr, offsets_ptr, experts_ptr, E, K, SHARED)


@triton.jit
def _route_rows_kernel(logits_ptr, seg_ptr, w_ptr, ids_ptr, T, stride_l, stride_s,
                       E: tl.constexpr, K: tl.constexpr, ROWS: tl.constexpr,
                       BLOCK_S: tl.constexpr, SHARED: tl.constexpr,
                       PDL: tl.constexpr = False):
    """Routing of ROWS tokens per program (larger batches: the top-k reductions run per token
    in parallel instead of over one [T, E] tile)."""
    if PDL:  # kernels/pdl.py: wait for the previous kernel first
        pdl_enter()
    t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    topk_tile(logits_ptr, seg_ptr, w_ptr, ids_ptr, t, t < T, t < T, stride_l, stride_s, E, K,
               BLOCK_S, SHARED)


@triton.jit(do_not_specialize=["P", "NE"])
def _align_sort_kernel(ids_ptr, order_ptr, offsets_ptr, experts_ptr, P, NE,
                       BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr,
                       PDL: tl.constexpr = False):
    """moe_align + expert_partition of P (token, slot) pairs with expert ids < NE, in one
    program: sort the keys expert·BLOCK_P + pair (bitonic, `tl.sort`; the pair index in the
    key keeps it stable), histogram of the experts, exclusive cumsum. Pads carry expert
    BLOCK_E-1 ≥ NE, so they sort last and count nowhere. (The [T, E] tile and column cumsum of
    `align_tile` took 27.7 µs at T=32 on the H200, kb/0021.)"""
    if PDL:  # kernels/pdl.py: wait for the previous kernel first
        pdl_enter()
    p = tl.arange(0, BLOCK_P)
    ok = p < P
    ex = tl.load(ids_ptr + p, mask=ok, other=BLOCK_E - 1).to(tl.int32)
    key = tl.sort(ex * BLOCK_P + p)
    tl.store(order_ptr + p, key % BLOCK_P, mask=ok)
    e = tl.arange(0, BLOCK_E)
    counts = tl.where(e < NE, tl.histogram(ex, BLOCK_E), 0)
    incl = tl.cumsum(counts, 0)
    tl.store(offsets_ptr + 1 + e, incl, mask=e < NE)
    tl.store(offsets_ptr + e, 0, mask=e == 0)
    store_active_first(experts_ptr, e, counts, e < NE)


ROUTE_ALIGN_MAX_TOKENS = 64  # one align program per step (a [T, E] tile or T·k sort keys)
# the model uses route_align up to here; beyond, ~10 torch kernels (≈ 51 µs a layer at 32
# rows, kb/0019). Up to ROUTE_ONE_PROGRAM_UP_TO one program routes and aligns; above it top-k
# runs in T/2 programs and one program sorts the pairs (kb/0021): 6.5 µs a layer at T=32 on the
# H200, B=16 / B=32 graph steps -12.6 % / -12.9 % (kb/0024)
# one program up to 4 rows, two launches above: on the H200 (µs a launch, one program / two
# launches): T=1 3.87/5.67, T=2 3.91/6.16, T=4 4.87/6.21, T=6 11.64/6.32, T=8 11.78/6.34
# (kb/0024)
ROUTE_ONE_PROGRAM_UP_TO = 4
# warps of route_align's single program by BLOCK_T: the route+align program up to 8 rows,
# measured on the H200 (µs per launch for 1/2/4/8 warps): T=1
# 5.2/4.8/4.6/5.0, T=2 6.2/5.3/5.4/5.4, T=4 9.9/7.9/7.3/7.3, T=8 27.7/10.9/13.2/12.6 (the
# shared expert adds ≤ 0.5); above 8 the sorting align program (not yet swept)
# BLOCK_T 2 (T ≤ 2) takes 4 warps: the layout of the [2, E] tile sets the softmax's summation
# order, and `route_fused_moe`'s programs run 4 warps, so its routing is then bitwise
# route_align's (kb/0036; 5.28 vs 5.30 µs at T=2)
ROUTE_ALIGN_WARPS = {1: 4, 2: 4, 4: 4, 8: 2, 16: 4, 32: 4, 64: 4}


def routing_outputs(router_logits: torch.Tensor, top_k: int, shared_gate, who: str):
    """The routing kernels' outputs, allocated: (S pair slots a token, En experts with the
    shared one, weights [T, S], ids [T, S] int64, order [T·S], offsets [En+1], experts [En]
    int32, the shared gate or the logits as its unused pointer). Raises ValueError (naming
    `who`) when shared_gate is not [T, 1]."""
    T, E = router_logits.shape
    shared = shared_gate is not None
    if shared and shared_gate.shape != (T, 1):
        raise ValueError(f"{who}: shared_gate{tuple(shared_gate.shape)}, want ({T}, 1)")
    S, En = (top_k + 1, E + 1) if shared else (top_k, E)
    dev = router_logits.device
    return (S, En, torch.empty(T, S, dtype=router_logits.dtype, device=dev),
            torch.empty(T, S, dtype=torch.int64, device=dev),
            torch.empty(T * S, dtype=torch.int32, device=dev),
            torch.empty(En + 1, dtype=torch.int32, device=dev),
            torch.empty(En, dtype=torch.int32, device=dev),
            shared_gate if shared else router_logits)


def route_align(router_logits: torch.Tensor, top_k: int, shared_gate: torch.Tensor | None = None):
    """Routing and `moe_align` in one kernel launch (T ≤ ROUTE_ONE_PROGRAM_UP_TO) or two
    (T ≤ 64: top-k in parallel programs, then one program sorts the pairs; kb/0021).

    router_logits: [T, E]. Returns (weights [T, k] in the logits dtype, ids [T, k] int64,
    order [T·k] int32, offsets [E+1] int32, experts [E] int32) — equal to `ref.route_topk`
    then `moe_align` and `expert_partition` (softmax in fp32, top-k largest first,
    renormalised, then cast).
    shared_gate [T, 1] (row stride free): the shared expert joins as expert E, slot k of every
    token, with weight sigmoid(shared_gate) (spec §7.4): weights/ids [T, k+1], order [T·(k+1)],
    offsets [E+2], experts [E+1] — what the same routing with a (k+1)-th column gives through
    `moe_align(ids, E+1)` and `expert_partition`. For `fused_moe` over experts stacked with
    the shared one (the kernel path, kb/0019).
    """
    T, E = router_logits.shape
    if T > ROUTE_ALIGN_MAX_TOKENS or E & (E - 1):
        raise ValueError(f"route_align: T={T} > {ROUTE_ALIGN_MAX_TOKENS} or E={E} not a power of 2")
    shared = shared_gate is not None
    S, En, w, ids, order, offsets, experts, seg = routing_outputs(
        router_logits, top_k, shared_gate, "route_align")
    bt = max(2, triton.next_power_of_2(T))
    bs = triton.next_power_of_2(S)
    if T <= ROUTE_ONE_PROGRAM_UP_TO:
        _route_align_kernel[(1,)](router_logits, seg, w, ids, order, offsets, experts, T,
                                  router_logits.stride(0), seg.stride(0), E=E, K=top_k,
                                  BLOCK_T=bt, BLOCK_S=bs, SHARED=shared,
                                  num_warps=ROUTE_ALIGN_WARPS[bt], **pdl_launch(router_logits))
    else:  # top-k per 2 tokens in parallel programs, then one sorting program
        _route_rows_kernel[(triton.cdiv(T, 2),)](router_logits, seg, w, ids, T,
                                                 router_logits.stride(0), seg.stride(0), E=E,
                                                 K=top_k, ROWS=2, BLOCK_S=bs, SHARED=shared,
                                                 num_warps=1, **pdl_launch(router_logits))
        _align_sort_kernel[(1,)](ids, order, offsets, experts, T * S, En,
                                 BLOCK_P=triton.next_power_of_2(T * S),
                                 BLOCK_E=triton.next_power_of_2(En + 1),
                                 num_warps=ROUTE_ALIGN_WARPS[bt], **pdl_launch(ids))
    return w, ids, order, offsets, experts
