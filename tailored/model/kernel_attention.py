"""The gated attention mixer on the kernel path (spec §6): one call per step shape.

Same computation as `GatedAttention` of the plain path: the q|k|v GEMM (the output gate is a
strided view of the q projection, no copy), per-head q/k norm + partial RoPE in one launch
per tensor (`kernels.qk_norm_rope`; at decode the keys and values go straight into the KV
cache in the k norm's launch), then
  * decode: paged split-K attention over the cache (`kernels.attention_decode`), the output
    gate's sigmoid and product in its merge launch with `attn_gate_in_merge` (kb/0037);
  * eager prefill chunks: causal attention per sequence over its chunk, or over the cached
    context gathered from its pages (`kernels.prefill_attention`: SDPA or FlashAttention-3);
  * one sequence's chunk in a prefill graph body (`chunk`): KV stored by device rows (pads
    into the sink page), causal attention over the chunk itself.
"""

from __future__ import annotations

import torch

from tailored import flags
from tailored.kernels import fa3
from tailored.kernels.attention_decode import paged_decode_attention
from tailored.kernels.prefill_attention import causal_attention
from tailored.kernels.qk_norm_rope import qk_norm_rope
from tailored.model.batch import ForwardBatch
from tailored.model.step_plan import StepPlan


class AttentionBlocks:
    """The attention mixer of every full-attention layer (and the MTP layer): projections
    p_in (q|k|v) and p_out (o_proj) as laid out by `KernelModel`, KV pages in `cache`."""

    def __init__(self, layers: list, cfg, cache, p_in: dict, p_out: dict):
        self.layers, self.cfg, self.cache = layers, cfg, cache
        self.p_in, self.p_out = p_in, p_out

    def qkv(self, i: int, x: torch.Tensor, cos, sin, kv_rows=None):
        """q, k, v [T, heads, D] and the output gate [T, Hq, D] (a strided view of the q
        projection: no copy, `out` reads it as is). kv_rows (decode): k and v go straight
        into layer i's KV cache rows in the k norm's launch; k and v are then that layer's
        cache tensors [pages, page_size, Hkv, D]."""
        cfg, m = self.cfg, self.layers[i].self_attn
        T, D, Hq, Hkv = x.shape[0], cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        qg, k, v = self.p_in[i](x)
        qg = qg.view(T, Hq, 2 * D)
        q, gate = qg[..., :D], qg[..., D:]
        k = k.view(T, Hkv, D)
        v = v.view(T, Hkv, D)
        # per-head norm + partial RoPE: one launch per tensor (kernels/qk_norm_rope.py)
        if kv_rows is None:
            q = qk_norm_rope(q, m.q_norm.weight, cos, sin, m.q_norm.eps)
            k = qk_norm_rope(k, m.k_norm.weight, cos, sin, m.k_norm.eps)
            return q, k, v, gate
        li = self.cache.attn_index[i]
        kc, vc = self.cache.k[li], self.cache.v[li]
        kf, vf = kc.view(-1, *kc.shape[-2:]), vc.view(-1, *vc.shape[-2:])  # flat cache rows
        q = qk_norm_rope(q, m.q_norm.weight, cos, sin, m.q_norm.eps)
        qk_norm_rope(k, m.k_norm.weight, cos, sin, m.k_norm.eps, rows=kv_rows, out=kf, v=v,
                     v_out=vf)
        return q, kc, vc, gate

    def decode(self, i, x, cos, sin, kv_rows, table, lens):
        """One query a row over its sequence's pages: table [T, max_pages], lens [T]."""
        # the KV store rides in the k norm's launch (two index_copy_ launches fewer per layer)
        q, kc, vc, gate = self.qkv(i, x, cos, sin, kv_rows)
        if flags.current().attn_gate_in_merge:  # the gate in the merge's launch (kb/0036)
            o = paged_decode_attention(q.contiguous(), kc, vc, table, lens, gate=gate)
            return self.p_out[i](o.reshape(o.shape[0], -1))
        o = paged_decode_attention(q.contiguous(), kc, vc, table, lens)
        return self.out(i, o, gate)

    def eager(self, i, x, cos, sin, batch: ForwardBatch, plan: StepPlan):
        """Every sequence of an eager step: its new KV stored at the plan's rows, then the
        decode rows together in one paged-decode launch over their pages (as a decode
        step's; one by one each cost ~30 ops a layer of host time and a gather of its whole
        context, kb/0068), and each prompt chunk's causal attention over its chunk (a first
        chunk) or its whole context gathered."""
        li = self.cache.attn_index[i]
        q, k, v, gate = self.qkv(i, x, cos, sin)
        kc, vc = self.cache.k[li], self.cache.v[li]
        kf = kc.view(-1, *kc.shape[-2:])
        vf = vc.view(-1, *vc.shape[-2:])
        out = torch.empty_like(q)
        if plan.dec_rows is not None:
            r = plan.dec_rows
            kf[plan.dec_kv] = k[r]
            vf[plan.dec_kv] = v[r]
            out[r] = paged_decode_attention(q[r].contiguous(), kc, vc, plan.dec_table,
                                            plan.dec_lens)
        for j, s in enumerate(batch.seqs):
            if j in plan.dec_index:
                continue
            r = slice(s.q_start, s.q_start + s.num_tokens)
            kf[plan.kv_new[j]] = k[r]
            vf[plan.kv_new[j]] = v[r]
            if s.start_pos == 0:  # whole context is this chunk: no gather
                kk, vv = k[r], v[r]
            else:
                idx = plan.kv_ctx[j]
                kk, vv = kf[idx], vf[idx]
            out[r] = causal_attention(q[r], kk, vv)
        return self.out(i, out, gate)

    def store_kv(self, i, kv_rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write k, v [T, Hkv, D] at flat KV rows (device int64 [T]) of layer i's cache;
        returns that layer's (k, v) cache tensors [pages, page_size, Hkv, D]."""
        li = self.cache.attn_index[i]
        kc, vc = self.cache.k[li], self.cache.v[li]
        kc.view(-1, *kc.shape[-2:]).index_copy_(0, kv_rows, k)
        vc.view(-1, *vc.shape[-2:]).index_copy_(0, kv_rows, v)
        return kc, vc

    def out(self, i, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """o_proj(attention output · sigmoid(gate)) (spec §6.5). o [T, Hq, D] or [T, Hq·D];
        gate [T, Hq, D], strided: sigmoid reads the view and writes a contiguous tensor, so
        no copy kernel runs for the reshape (the values are those of a copy first)."""
        T = o.shape[0]
        return self.p_out[i](o.reshape(T, -1) * torch.sigmoid(gate).reshape(T, -1))

    def chunk(self, i: int, x: torch.Tensor, cos, sin, kv_rows):
        """A prefill graph bucket of one fresh sequence: KV written by device rows (pads into
        the sink), causal attention over the chunk itself (pads come last: real rows never see
        them)."""
        q, k, v, gate = self.qkv(i, x, cos, sin)
        self.store_kv(i, kv_rows, k, v)
        return self.out(i, causal_attention(q, k, v), gate)

    def context_chunk(self, i: int, x, cos, sin, kv_rows, table, lens, num_splits: int,
                      fa3_lens=None):
        """A chunk continuing a cached context in a graph bucket: K/V stored by device rows (pads
        into the sink), then one paged-decode query a row over keys 0..its position (table: the
        sequence's page table broadcast to every row; lens: per-row key counts). fa3_lens
        (used_q, used_k, row_index: device int32, the chunk's rows, its keys, 0..n-1): the
        chunk's rows in one FlashAttention-3 launch over the pages instead (tensor cores, each
        key tile read once for many rows), pad rows zeroed (it does not write them)."""
        q, k, v, gate = self.qkv(i, x, cos, sin)
        kc, vc = self.store_kv(i, kv_rows, k, v)
        if fa3_lens is not None:
            used_q, used_k, row_index = fa3_lens
            o = fa3.paged_attention(q.contiguous(), kc, vc, table[0], used_q, used_k)
            o = torch.where((row_index < used_q).view(-1, 1, 1), o, 0)
            return self.out(i, o, gate)
        o = paged_decode_attention(q.contiguous(), kc, vc, table, lens, num_splits=num_splits)
        return self.out(i, o, gate)
