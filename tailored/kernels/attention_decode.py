"""Paged GQA decode attention (spec §6.4, §6.6): one query token per sequence over its KV pages.

One program per (sequence, KV head, split) runs an online softmax over BLOCK_N keys at a time,
looking each key's page up in the sequence's page table, and handles all Hq/Hkv query heads of
the group with one `tl.dot` (GQA 16:2 → 8 query heads share each K/V tile). Long contexts are
cut into `num_splits` ranges whose partial (max, sum, acc) are merged by a second small kernel
(flash-decoding), so a single sequence still fills many SMs.

Graph-safe: sequence lengths and page tables are read on the device. Pad rows have length 1 and
page table zeros (the pad-sink page). Reference: `ref.causal_attention` with start_pos = len−1.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from tailored.kernels import dot_precision
from tailored.kernels.pdl import enter as pdl_enter
from tailored.kernels.pdl import launch as pdl_launch


# the page table's row stride is the step's widest page list in an eager step (decode
# graphs: max_pages): unspecialised, so a width of 1 or a multiple of 16 compiles no variant
# of its own inside a served step (kb/0068)
@triton.jit(do_not_specialize=["stride_tb"])
def _attn_split_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, m_ptr, l_ptr, acc_ptr,
                       stride_qb, stride_qh, stride_kp, stride_ko, stride_kh,
                       stride_tb, scale,
                       GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                       PAGE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                       DOT_PREC: tl.constexpr,
                       PDL: tl.constexpr = False):
    if PDL:  # kernels/pdl.py: wait for the previous kernel first
        pdl_enter()
    b = tl.program_id(0)
    hk = tl.program_id(1)
    sp = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = sp * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    g = tl.arange(0, BLOCK_G)
    g_ok = g < GROUP
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * stride_qb + (hk * GROUP + g)[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, D], dtype=tl.float32)
    start = lo
    while start < hi:
        t = start + tl.arange(0, BLOCK_N)
        t_ok = t < hi
        page = tl.load(table_ptr + b * stride_tb + t // PAGE, mask=t_ok, other=0).to(tl.int64)
        kv_off = page * stride_kp + (t % PAGE) * stride_ko + hk * stride_kh
        k = tl.load(k_ptr + kv_off[:, None] + d[None, :], mask=t_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale  # [BLOCK_G, BLOCK_N]
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_off[:, None] + d[None, :], mask=t_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new
        start += BLOCK_N
    base = (b * tl.num_programs(1) + hk) * NUM_SPLITS + sp
    tl.store(m_ptr + base * BLOCK_G + g, m_i, mask=g_ok)
    tl.store(l_ptr + base * BLOCK_G + g, l_i, mask=g_ok)
    tl.store(acc_ptr + (base * BLOCK_G + g)[:, None] * D + d[None, :], acc, mask=g_ok[:, None])


@triton.jit
def _attn_merge_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, stride_ob, stride_oh, gate_ptr,
                       stride_gb, stride_gh,
                       GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
                       BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                       GATE: tl.constexpr = False, PDL: tl.constexpr = False):
    if PDL:  # kernels/pdl.py: wait for the previous kernel first
        pdl_enter()
    b = tl.program_id(0)
    hk = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    g_ok = g < GROUP
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)  # many splits: D over programs
    base = (b * tl.num_programs(1) + hk) * NUM_SPLITS
    m_all = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    for sp in tl.static_range(NUM_SPLITS):
        m_all = tl.maximum(m_all, tl.load(m_ptr + (base + sp) * BLOCK_G + g, mask=g_ok,
                                          other=float("-inf")))
    l_all = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for sp in tl.static_range(NUM_SPLITS):
        m = tl.load(m_ptr + (base + sp) * BLOCK_G + g, mask=g_ok, other=float("-inf"))
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_all))  # empty split: weight 0
        l_all += tl.load(l_ptr + (base + sp) * BLOCK_G + g, mask=g_ok, other=0.0) * w
        acc += tl.load(acc_ptr + ((base + sp) * BLOCK_G + g)[:, None] * D + d[None, :],
                       mask=g_ok[:, None], other=0.0) * w[:, None]
    o = acc / tl.where(g_ok, l_all, 1.0)[:, None]
    if GATE:  # o · sigmoid(gate) with the roundings of the two torch ops it replaces (spec §6.5)
        gt = tl.load(gate_ptr + b * stride_gb + (hk * GROUP + g)[:, None] * stride_gh
                     + d[None, :], mask=g_ok[:, None], other=0.0).to(tl.float32)
        dt = out_ptr.dtype.element_ty
        o = o.to(dt).to(tl.float32) * tl.sigmoid(gt).to(dt).to(tl.float32)
    tl.store(out_ptr + b * stride_ob + (hk * GROUP + g)[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])


# key ranges per (sequence, KV head) of a decode query. Splits by batch size (more at small
# batches to fill the SMs, fewer at large ones) measured no gain on the H200 (kb/0019, kb/0043)
DECODE_SPLITS = 8


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           page_table: torch.Tensor, seq_lens: torch.Tensor,
                           num_splits: int | None = None,
                           gate: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q Kᵀ/√D) V for one query per sequence over its cached keys 0..len−1.

    q: [B, Hq, D]; k_cache, v_cache: [num_pages, page_size, Hkv, D] (one layer; the new token's
    K/V already written); page_table: [B, max_pages] int32; seq_lens: [B] int32 (≥ 1);
    num_splits: key ranges per (sequence, KV head), each ⌈len/num_splits⌉ rounded up to BLOCK_N
    (computed on the device, so one captured graph serves every length); None = DECODE_SPLITS.
    BLOCK_N (keys per iteration) is 64, or 32 with ≥ 16 splits so that a 1024-token context
    still reaches 32 splits. Returns [B, Hq, D] in q.dtype.
    gate: [B, Hq, D] (unit stride in D, other strides free; the attention gate rows of the
    q projection, spec §6.5): the merge returns attention · sigmoid(gate) instead, rounded
    like `(o.to(dtype) * torch.sigmoid(gate))` (two launches fewer a layer, kb/0036).
    """
    B, Hq, D = q.shape
    _, page, Hkv, D2 = k_cache.shape
    assert D2 == D and q.stride(2) == 1 and k_cache.stride(3) == 1
    if gate is not None and (gate.shape != q.shape or gate.stride(2) != 1):
        raise ValueError(f"paged_decode_attention: gate{tuple(gate.shape)} with strides "
                         f"{gate.stride()}, want {tuple(q.shape)} with unit stride in D")
    group = Hq // Hkv
    block_g = max(16, triton.next_power_of_2(group))
    if num_splits is None:
        num_splits = DECODE_SPLITS
    block_n = 32 if num_splits >= 16 else 64  # keys per iteration; may span several pages
    m = torch.empty(B * Hkv * num_splits * block_g, dtype=torch.float32, device=q.device)
    l_ = torch.empty_like(m)
    acc = torch.empty(B * Hkv * num_splits * block_g, D, dtype=torch.float32, device=q.device)
    prec = dot_precision(q.dtype)
    _attn_split_kernel[(B, Hkv, num_splits)](
        q, k_cache, v_cache, page_table, seq_lens, m, l_, acc,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        page_table.stride(0), D ** -0.5,
        GROUP=group, BLOCK_G=block_g, D=D, PAGE=page, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        DOT_PREC=prec, num_warps=4, **pdl_launch(q))
    out = torch.empty_like(q)
    block_d = D if num_splits <= 8 else min(D, 64)  # many splits: more merge programs
    g = gate if gate is not None else out  # unused pointer without a gate
    _attn_merge_kernel[(B, Hkv, D // block_d)](m, l_, acc, out, out.stride(0), out.stride(1),
                                               g, g.stride(0), g.stride(1),
                                               GROUP=group, BLOCK_G=block_g, D=D,
                                               BLOCK_D=block_d, NUM_SPLITS=num_splits,
                                               GATE=gate is not None, **pdl_launch(out))
    return out
