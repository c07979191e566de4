"""The Qwen3.6-35B-A3B text decoder (plain PyTorch path; runs on CPU and GPU).

Attribute names mirror the checkpoint (`model.language_model.*` → `self.model.*`, `lm_head`,
`mtp.*`) so the loader maps names one to one. Computation: model spec §3–§8, checked against
transformers' `Qwen3_5MoeForCausalLM` in tests/model/test_model_vs_transformers.py.

The forward works on a flattened varlen batch (`ForwardBatch`) and a `HybridCache`: projections
and MoE run over all T tokens at once; the GDN recurrence and attention run per sequence
(decode tokens of the GDN are batched).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tailored.config import ModelConfig
from tailored.model import fp8, nvfp4
from tailored.model.batch import ForwardBatch
from tailored.ops import reference as ref

if TYPE_CHECKING:  # the worker owns the cache; the model only reads and writes it
    from tailored.worker.cache import HybridCache


def _linear(i: int, o: int) -> nn.Linear:
    return nn.Linear(i, o, bias=False)


class RMSNorm1p(nn.Module):
    """Zero-centred RMSNorm, weight initialised to zeros (spec §3)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        return ref.rms_norm_1p(x, self.weight, self.eps)


class GatedNorm(nn.Module):
    """GDN gated RMSNorm, plain weight (spec §3)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, z):
        return ref.gated_rms_norm(x, z, self.weight, self.eps)


class GatedDeltaNet(nn.Module):
    """Linear-attention mixer (spec §5): in_proj → conv1d → gates → delta rule → gated norm → out."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        H = cfg.hidden_size
        self.cfg = cfg
        self.in_proj_qkv = _linear(H, cfg.conv_dim)
        self.in_proj_z = _linear(H, cfg.value_dim)
        self.in_proj_b = _linear(H, cfg.linear_num_value_heads)
        self.in_proj_a = _linear(H, cfg.linear_num_value_heads)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.zeros(cfg.conv_dim, 1, cfg.linear_conv_kernel_dim))
        self.dt_bias = nn.Parameter(torch.ones(cfg.linear_num_value_heads))
        self.A_log = nn.Parameter(torch.zeros(cfg.linear_num_value_heads))
        self.norm = GatedNorm(cfg.linear_value_head_dim, cfg.rms_norm_eps)
        self.out_proj = _linear(cfg.value_dim, H)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cache: HybridCache, layer: int):
        cfg = self.cfg
        li = cache.gdn_index[layer]
        T = x.shape[0]
        HK, HV = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        Dk, Dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        qkv = self.in_proj_qkv(x)  # [T, C]
        z = self.in_proj_z(x).view(T, HV, Dv)
        g, beta = ref.gdn_gates(self.in_proj_a(x), self.in_proj_b(x), self.A_log, self.dt_bias)
        w = self.conv1d.weight[:, 0, :]  # [C, W]
        core = torch.empty(T, HV, Dv, dtype=x.dtype, device=x.device)
        conv_cache, rec_cache = cache.conv[li], cache.rec[li]

        def split(y, n):
            q, k, v = torch.split(y, [cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
            return q.view(n, -1, HK, Dk), k.view(n, -1, HK, Dk), v.view(n, -1, HV, Dv)

        # decode rows (one token each) are batched: gather their slots, step, scatter back
        dec = [s for s in batch.seqs if s.num_tokens == 1]
        if dec:
            rows = torch.tensor([s.q_start for s in dec], device=x.device)
            slots = torch.tensor([s.slot for s in dec], device=x.device)
            reset = torch.tensor([s.reset_state for s in dec], device=x.device)
            cs = torch.where(reset[:, None, None], 0, conv_cache[slots])
            rs = torch.where(reset[:, None, None, None], 0, rec_cache[slots])
            y, cs = ref.causal_conv1d_step(qkv[rows], cs, w)
            q, k, v = split(y, len(dec))
            o, rs = ref.gated_delta_rule_recurrent(q, k, v, g[rows].unsqueeze(1),
                                                   beta[rows].unsqueeze(1), rs)
            conv_cache[slots] = cs
            rec_cache[slots] = rs.to(rec_cache.dtype)
            core[rows] = o[:, 0]
            for i, s in enumerate(dec):
                if s.keep_states:  # a 1-token verify chunk (runner.launch): its only state
                    cache.kept_states[(li, s.slot)] = [(cs[i], rs[i])]
        for s in batch.seqs:
            if s.num_tokens == 1:
                continue
            r = slice(s.q_start, s.q_start + s.num_tokens)
            cs = conv_cache[s.slot] if not s.reset_state else torch.zeros_like(conv_cache[s.slot])
            rs = rec_cache[s.slot] if not s.reset_state else torch.zeros_like(rec_cache[s.slot])
            if s.keep_states:
                # a verify chunk: token by token as decode steps would run it, keeping each
                # state for HybridCache.commit_states (spec §8.4)
                kept = cache.kept_states[(li, s.slot)] = []
                for t in range(s.q_start, s.q_start + s.num_tokens):
                    y, cs = ref.causal_conv1d_step(qkv[t:t + 1], cs[None], w)
                    cs = cs[0]
                    q, k, v = split(y, 1)
                    o, rs = ref.gated_delta_rule_recurrent(q, k, v, g[t:t + 1, None],
                                                           beta[t:t + 1, None], rs[None])
                    # rounded to the storage dtype, as the next decode step reloads it
                    rs = rs[0].to(rec_cache.dtype)
                    kept.append((cs, rs))
                    core[t] = o[0, 0]
                conv_cache[s.slot] = cs
                rec_cache[s.slot] = rs
                continue
            y, cs = ref.causal_conv1d(qkv[r], cs, w)
            q, k, v = split(y, 1)
            o, rs = ref.gated_delta_rule_chunked(q[0], k[0], v[0], g[r], beta[r], rs)
            conv_cache[s.slot] = cs
            rec_cache[s.slot] = rs
            core[r] = o
        out = self.norm(core, z)
        return self.out_proj(out.reshape(T, HV * Dv))


class Attention(nn.Module):
    """Gated GQA attention with q/k norm and partial RoPE over the paged KV cache (spec §6)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        H, D = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.q_proj = _linear(H, cfg.num_attention_heads * D * 2)
        self.k_proj = _linear(H, cfg.num_key_value_heads * D)
        self.v_proj = _linear(H, cfg.num_key_value_heads * D)
        self.o_proj = _linear(cfg.num_attention_heads * D, H)
        self.q_norm = RMSNorm1p(D, cfg.rms_norm_eps)
        self.k_norm = RMSNorm1p(D, cfg.rms_norm_eps)

    def qkv(self, x, cos, sin):
        """Projections, q/k norm and RoPE. Returns q [T,Hq,D], k/v [T,Hkv,D], gate [T,Hq·D]."""
        cfg = self.cfg
        T, D = x.shape[0], cfg.head_dim
        qg = self.q_proj(x).view(T, cfg.num_attention_heads, 2 * D)
        q, gate = qg[..., :D], qg[..., D:].reshape(T, -1)  # per-head [q | gate] (spec §6.1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(T, cfg.num_key_value_heads, D))
        v = self.v_proj(x).view(T, cfg.num_key_value_heads, D)
        return ref.apply_partial_rope(q, cos, sin), ref.apply_partial_rope(k, cos, sin), v, gate

    def forward(self, x, cos, sin, batch: ForwardBatch, cache: HybridCache, layer: int):
        li = cache.attn_index[layer]
        q, k, v, gate = self.qkv(x, cos, sin)
        kf = cache.k[li].view(-1, *cache.k.shape[-2:])  # [pages*page_size, Hkv, D]
        vf = cache.v[li].view(-1, *cache.v.shape[-2:])
        out = torch.empty_like(q)
        for s in batch.seqs:
            r = slice(s.q_start, s.q_start + s.num_tokens)
            new_idx = cache.token_index(s, s.start_pos, s.end_pos)
            kf[new_idx] = k[r]
            vf[new_idx] = v[r]
            idx = cache.token_index(s, 0, s.end_pos)
            out[r] = ref.causal_attention(q[r], kf[idx], vf[idx], s.start_pos)
        a = out.reshape(x.shape[0], -1) * torch.sigmoid(gate)
        return self.o_proj(a)


class Experts(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.zeros(E, H, I))


class SharedExpert(nn.Module):
    def __init__(self, H: int, I: int):
        super().__init__()
        self.gate_proj = _linear(H, I)
        self.up_proj = _linear(H, I)
        self.down_proj = _linear(I, H)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoe(nn.Module):
    """Router softmax → top-k renormalised → routed experts + σ-gated shared expert (spec §7)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.gate = _linear(cfg.hidden_size, cfg.num_experts)
        self.experts = Experts(cfg)
        self.shared_expert = SharedExpert(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = _linear(cfg.hidden_size, 1)

    def forward(self, x):
        w, ids = ref.route_topk(self.gate(x), self.top_k)
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        if gate_up.dtype == fp8.FP8:  # block-FP8 experts: dequantized one hit expert at a time
            gate_up = fp8.DequantExperts(gate_up, self.experts.gate_up_proj_scale_inv, x.dtype, True)
            down = fp8.DequantExperts(down, self.experts.down_proj_scale_inv, x.dtype, False)
        elif nvfp4.is_nvfp4_experts(self.experts):  # NVFP4: likewise, one hit expert at a time
            gate_up, down = nvfp4.experts_view(self.experts, x.dtype)
        routed = ref.moe_experts(x, w, ids, gate_up, down)
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = Attention(cfg)
        self.mlp = SparseMoe(cfg)
        self.input_layernorm = RMSNorm1p(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm1p(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, batch, cache, layer: int):
        h = self.input_layernorm(x)
        if self.layer_type == "linear_attention":
            h = self.linear_attn(h, batch, cache, layer)
        else:
            h = self.self_attn(h, cos, sin, batch, cache, layer)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class TextModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, t) for t in cfg.layer_types)
        self.norm = RMSNorm1p(cfg.hidden_size, cfg.rms_norm_eps)


class MTP(nn.Module):
    """Multi-token-prediction draft head (spec §8). Loaded with the model; not run yet."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        H = cfg.hidden_size
        self.pre_fc_norm_embedding = RMSNorm1p(H, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm1p(H, cfg.rms_norm_eps)
        self.fc = _linear(2 * H, H)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, "full_attention") for _ in range(cfg.mtp_num_hidden_layers)
        )
        self.norm = RMSNorm1p(H, cfg.rms_norm_eps)


class Qwen36ForCausalLM(nn.Module):
    """Embedding → 40 decoder layers (3 GDN + 1 attention per block) → norm → lm_head."""

    def __init__(self, cfg: ModelConfig, with_mtp: bool = True):
        super().__init__()
        self.config = cfg
        self.model = TextModel(cfg)
        self.lm_head = _linear(cfg.hidden_size, cfg.vocab_size)
        self.mtp = MTP(cfg) if with_mtp and cfg.mtp_num_hidden_layers > 0 else None

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, cache: HybridCache) -> torch.Tensor:
        """Run all layers over the batch, updating `cache` in place.

        Returns the final-normed hidden states [T, H] (model dtype). Every slot with
        reset_state=True is zeroed before use; slots and pages not named in the batch are
        never written. The kernel path (`kernel_model.py`, run by the worker) keeps this
        contract.
        """
        cfg = self.config
        x = self.model.embed_tokens(batch.input_ids)
        cos, sin = ref.rope_cos_sin(batch.positions, cfg.rotary_dim, cfg.rope_theta, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, batch, cache, i)
        return self.model.norm(x)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] → logits [N, vocab_size] in fp32."""
        return self.lm_head(hidden).float()
