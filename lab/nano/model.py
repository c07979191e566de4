"""The nano model: config, initialisation and a batched, differentiable training forward.

The parameters live in tailored's own `Qwen36ForCausalLM` (so parameter names, shapes and the
checkpoint layout are exactly the engine's; export = `to_checkpoint_name`). The forward here is
a separate, batched ([B, L, ·]) re-implementation of the same maths (model spec §3–§8) built
from tailored.ops.reference where those are already batched/differentiable:

* GDN: projections → causal depthwise conv (left pad 3) + SiLU → gates (fp32) → chunkwise
  gated delta rule (WY form, chunk 64, fp32, autocast off) → gated RMSNorm → out_proj.
* attention: q/gate split per head, q/k zero-centred norms, partial rotate-half RoPE,
  causal softmax attention (SDPA in training, explicit in evaluation), sigmoid output gate.
* MoE: softmax router → top-k renormalised; the routed experts are computed densely (every
  expert on every token, weighted by a combine matrix that is zero outside the top-k), which is
  numerically the sparse MoE and two large matmuls on the GPU; σ-gated shared expert.
* MTP (spec §8.1): [RMSNorm1p(embed(x_{t+1})), RMSNorm1p(h_t)] → fc → one full-attention
  decoder layer (position t) → norm → shared lm_head, trained to predict x_{t+2}.

tests/model/test_nano.py and the script's export check compare the exported checkpoint in
tailored's engine and in transformers against this forward (fp32).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tailored.config import ModelConfig
from tailored.model.qwen36 import Qwen36ForCausalLM
from tailored.ops import reference as ref
from tailored.synth import preset_config, to_checkpoint_name

# Dimensions (spec §1 ratios where the budget allows: value dim = 2·hidden in the GDN,
# q heads·head_dim = 2·hidden in attention, GQA, partial rotary 0.25, top-k + shared expert).
NANO_DIMS = {
    "hidden_size": 128,
    "num_hidden_layers": 8,  # [GDN, GDN, GDN, attention] × 2
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,  # rotary dim 16
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 48,
    "shared_expert_intermediate_size": 32,
    "max_position_embeddings": 32768,
}


def nano_config(vocab_size: int, ids: dict[str, int], dims: dict | None = None) -> dict:
    """config.json dict: top-level qwen3_5_moe + text_config (official field names)."""
    d = dict(NANO_DIMS, **(dims or {}))
    rotary = int(d["head_dim"] * 0.25)
    half = rotary // 2
    base, rem = divmod(half, 3)  # 32 → [11, 11, 10] as published; 8 → [3, 3, 2]
    section = [base + (rem > 0), base + (rem > 1), base]
    eot = ids["<|endoftext|>"]
    cfg = preset_config(
        "tiny",
        num_layers=d["num_hidden_layers"],
        **{k: v for k, v in d.items() if k != "num_hidden_layers"},
        vocab_size=vocab_size,
        bos_token_id=eot,
        eos_token_id=eot,
        router_aux_loss_coef=0.001,
        rope_parameters={"mrope_interleaved": True, "mrope_section": section,
                         "partial_rotary_factor": 0.25, "rope_theta": 10000000,
                         "rope_type": "default"},
    )
    cfg["image_token_id"] = ids["<|image_pad|>"]
    cfg["video_token_id"] = ids["<|video_pad|>"]
    cfg["vision_start_token_id"] = ids["<|vision_start|>"]
    cfg["vision_end_token_id"] = ids["<|vision_end|>"]
    return cfg


def generation_config(ids: dict[str, int]) -> dict:
    eot, im_end = ids["<|endoftext|>"], ids["<|im_end|>"]
    return {"bos_token_id": eot, "do_sample": True, "eos_token_id": [im_end, eot],
            "pad_token_id": eot, "temperature": 0.6, "top_k": 20, "top_p": 0.95}


def count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------------
# initialisation
# ---------------------------------------------------------------------------------------------
RESIDUAL_OUT = ("o_proj.weight", "out_proj.weight", "down_proj.weight", "experts.down_proj")


@torch.no_grad()
def build_model(cfg_dict: dict, seed: int, device="cpu") -> Qwen36ForCausalLM:
    """Qwen36ForCausalLM (fp32) with the nano initialisation, deterministic for `seed`.

    Matrices N(0, 0.02²), residual-output projections N(0, (0.02/√(2·layers))²), zero-centred
    norms 0, GDN gated-norm weight 1, conv taps U(−½, ½) (PyTorch's Conv1d default for fan-in 4),
    dt_bias 1 and A_log = log U(1, 16)·… as transformers initialises them (A ~ U(0.01, 16)).
    """
    cfg = ModelConfig.from_dict(cfg_dict)
    model = Qwen36ForCausalLM(cfg, with_mtp=True)
    g = torch.Generator().manual_seed(seed)
    n_layers = cfg.num_hidden_layers + cfg.mtp_num_hidden_layers
    for name, p in model.named_parameters():
        if name.endswith("linear_attn.norm.weight"):
            p.fill_(1.0)
        elif p.dim() == 1 and name.endswith("weight"):
            p.zero_()
        elif name.endswith("conv1d.weight"):
            p.copy_(torch.rand(p.shape, generator=g) - 0.5)
        elif name.endswith("dt_bias"):
            p.fill_(1.0)
        elif name.endswith("A_log"):
            p.copy_((torch.rand(p.shape, generator=g) * (16 - 0.01) + 0.01).log())
        else:
            std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(RESIDUAL_OUT) else 0.02
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return model.to(device)


def export_state_dict(model, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """Checkpoint tensors (official names) in `dtype`, contiguous, on the CPU."""
    return {to_checkpoint_name(n): p.detach().to("cpu", dtype).contiguous()
            for n, p in model.named_parameters()}


# ---------------------------------------------------------------------------------------------
# batched forward
# ---------------------------------------------------------------------------------------------
def rms1p(x, w, eps):
    return ref.rms_norm_1p(x, w, eps)


def chunk_gated_delta_rule(q, k, v, g, beta, chunk: int = ref.GDN_CHUNK):
    """Batched chunkwise gated delta rule from a zero state (spec §5.6), fp32, differentiable.

    q, k: [B, L, HK, Dk]; v: [B, L, HV, Dv]; g, beta: [B, L, HV]. Returns o [B, L, HV, Dv] fp32.
    Same algorithm and padding rule as reference.gated_delta_rule_chunked (one sequence).
    """
    B, L, HV, Dv = v.shape
    qf, kf = ref._prep_qk(q, k, HV)  # l2norm, q·Dk^-½, key heads → value heads
    qf, kf, vf = qf.transpose(1, 2), kf.transpose(1, 2), v.float().transpose(1, 2)  # [B,HV,L,D]
    gf, bf = g.float().transpose(1, 2), beta.float().transpose(1, 2)  # [B,HV,L]
    pad = (-L) % chunk
    if pad:
        qf, kf, vf = (F.pad(x, (0, 0, 0, pad)) for x in (qf, kf, vf))
        gf, bf = F.pad(gf, (0, pad)), F.pad(bf, (0, pad))
    n = (L + pad) // chunk
    qc = qf.reshape(B, HV, n, chunk, -1)
    kc = kf.reshape(B, HV, n, chunk, -1)
    vc = vf.reshape(B, HV, n, chunk, -1)
    gc = gf.reshape(B, HV, n, chunk).cumsum(-1)
    bc = bf.reshape(B, HV, n, chunk)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).tril()
    decay = (gc.unsqueeze(-1) - gc.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()
    kb = kc * bc.unsqueeze(-1)
    A = (kb @ kc.transpose(-1, -2)) * decay
    P = A.tril(-1) + torch.eye(chunk, device=v.device)
    U = torch.linalg.solve_triangular(P, vc * bc.unsqueeze(-1), upper=False, unitriangular=True)
    Wk = torch.linalg.solve_triangular(P, kb * gc.exp().unsqueeze(-1), upper=False,
                                       unitriangular=True)
    qdec = qc * gc.exp().unsqueeze(-1)
    kdec = kc * (gc[..., -1:] - gc).exp().unsqueeze(-1)
    intra = (qc @ kc.transpose(-1, -2)) * decay
    S = torch.zeros(B, HV, kc.shape[-1], Dv, device=v.device, dtype=torch.float32)
    outs = []
    for i in range(n):
        vnew = U[:, :, i] - Wk[:, :, i] @ S
        outs.append(qdec[:, :, i] @ S + intra[:, :, i] @ vnew)
        S = S * gc[:, :, i, -1].exp()[..., None, None] + kdec[:, :, i].transpose(-1, -2) @ vnew
    o = torch.stack(outs, 2).reshape(B, HV, n * chunk, Dv)[:, :, :L]
    return o.transpose(1, 2)


def gdn(mod, u, cfg: ModelConfig):
    B, L, _ = u.shape
    HK, HV = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    Dk, Dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    W = cfg.linear_conv_kernel_dim
    qkv = mod.in_proj_qkv(u).transpose(1, 2)  # [B, C, L]
    qkv = F.silu(F.conv1d(F.pad(qkv, (W - 1, 0)), mod.conv1d.weight.to(qkv.dtype),
                          groups=cfg.conv_dim)).transpose(1, 2)
    q, k, v = torch.split(qkv, [cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
    z = mod.in_proj_z(u).view(B, L, HV, Dv)
    g, beta = ref.gdn_gates(mod.in_proj_a(u), mod.in_proj_b(u), mod.A_log, mod.dt_bias)
    with torch.autocast(u.device.type, enabled=False):
        o = chunk_gated_delta_rule(q.float().view(B, L, HK, Dk), k.float().view(B, L, HK, Dk),
                                   v.float().view(B, L, HV, Dv), g, beta)
    o = ref.gated_rms_norm(o.to(z.dtype), z, mod.norm.weight, cfg.rms_norm_eps)
    return mod.out_proj(o.reshape(B, L, HV * Dv))


def attn_qkv(mod, u, cos, sin, cfg: ModelConfig):
    """q [B,L,Hq,D], k/v [B,L,Hkv,D] (normed, RoPE'd), gate [B,L,Hq·D]."""
    B, L, _ = u.shape
    D, Hq, Hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    qg = mod.q_proj(u).view(B, L, Hq, 2 * D)
    q, gate = qg[..., :D], qg[..., D:].reshape(B, L, Hq * D)
    q = rms1p(q, mod.q_norm.weight, cfg.rms_norm_eps)
    k = rms1p(mod.k_proj(u).view(B, L, Hkv, D), mod.k_norm.weight, cfg.rms_norm_eps)
    v = mod.v_proj(u).view(B, L, Hkv, D)
    cos, sin = cos.to(q.dtype), sin.to(q.dtype)
    return ref.apply_partial_rope(q, cos, sin), ref.apply_partial_rope(k, cos, sin), v, gate


def attention(mod, u, cos, sin, cfg: ModelConfig, sdpa: bool = True):
    q, k, v, gate = attn_qkv(mod, u, cos, sin, cfg)
    B, L = u.shape[:2]
    rep = cfg.num_attention_heads // cfg.num_key_value_heads
    qh = q.transpose(1, 2)
    kh = k.repeat_interleave(rep, dim=2).transpose(1, 2).to(qh.dtype)
    vh = v.repeat_interleave(rep, dim=2).transpose(1, 2).to(qh.dtype)
    if sdpa:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True)
    else:  # explicit fp32 softmax (HF eager order), for evaluation
        s = (qh @ kh.transpose(-1, -2)) * cfg.head_dim ** -0.5
        mask = torch.ones(L, L, dtype=torch.bool, device=u.device).triu(1)
        p = torch.softmax(s.masked_fill(mask, float("-inf")), dim=-1, dtype=torch.float32)
        o = p.to(vh.dtype) @ vh
    o = o.transpose(1, 2).reshape(B, L, -1) * torch.sigmoid(gate)
    return mod.o_proj(o)


def moe(mod, u, cfg: ModelConfig):
    """Returns (output [B,L,H], Switch load-balancing loss E·Σ f_e·P_e)."""
    shape = u.shape
    x = u.reshape(-1, shape[-1])
    N, E, I = x.shape[0], cfg.num_experts, cfg.moe_intermediate_size
    logits = mod.gate(x)
    w, ids = ref.route_topk(logits, cfg.num_experts_per_tok)
    combine = torch.zeros(N, E, dtype=w.dtype, device=x.device).scatter(1, ids, w)
    gu = (x @ mod.experts.gate_up_proj.reshape(E * 2 * I, -1).t().to(x.dtype)).view(N, E, 2 * I)
    a = F.silu(gu[..., :I]) * gu[..., I:] * combine.unsqueeze(-1).to(gu.dtype)
    down = mod.experts.down_proj.permute(1, 0, 2).reshape(shape[-1], E * I)  # [H, E·I]
    routed = a.reshape(N, E * I) @ down.t().to(a.dtype)
    shared = torch.sigmoid(mod.shared_expert_gate(x)) * mod.shared_expert(x)
    out = (routed + shared).view(shape)
    probs = torch.softmax(logits.float(), dim=-1)
    frac = torch.zeros(E, device=x.device).scatter_add(
        0, ids.flatten(), torch.ones(ids.numel(), device=x.device)) / ids.numel()
    aux = E * (frac * probs.mean(0)).sum()
    return out, aux


def decoder_layer(layer, x, cos, sin, cfg: ModelConfig, sdpa: bool = True):
    h = rms1p(x, layer.input_layernorm.weight, cfg.rms_norm_eps)
    if layer.layer_type == "linear_attention":
        h = gdn(layer.linear_attn, h, cfg)
    else:
        h = attention(layer.self_attn, h, cos, sin, cfg, sdpa)
    x = x + h
    y, aux = moe(layer.mlp, rms1p(x, layer.post_attention_layernorm.weight, cfg.rms_norm_eps), cfg)
    return x + y, aux


def rope(L: int, cfg: ModelConfig, device, offset: int = 0):
    pos = torch.arange(offset, offset + L, device=device)
    return ref.rope_cos_sin(pos, cfg.rotary_dim, cfg.rope_theta, torch.float32)


def forward_hidden(model, ids, sdpa: bool = True):
    """ids [B, L] → (final-normed hidden [B, L, H], summed load-balancing loss)."""
    cfg = model.config
    x = model.model.embed_tokens(ids)
    cos, sin = rope(ids.shape[1], cfg, ids.device)
    aux = x.new_zeros(())
    for layer in model.model.layers:
        x, a = decoder_layer(layer, x, cos, sin, cfg, sdpa)
        aux = aux + a
    return rms1p(x, model.model.norm.weight, cfg.rms_norm_eps), aux


def mtp_input(model, h, next_ids):
    """fc([RMSNorm1p(embed(x_{t+1})), RMSNorm1p(h_t)]) (spec §8.1: embedding first)."""
    cfg, m = model.config, model.mtp
    e = rms1p(model.model.embed_tokens(next_ids), m.pre_fc_norm_embedding.weight, cfg.rms_norm_eps)
    hh = rms1p(h, m.pre_fc_norm_hidden.weight, cfg.rms_norm_eps)
    return m.fc(torch.cat([e, hh.to(e.dtype)], dim=-1))


def forward_mtp(model, h, next_ids, sdpa: bool = True):
    """Teacher-forced MTP rows t = 0..L−1 (position t): h [B,L,H], next_ids [B,L] = x_{t+1}.

    Returns (post-`mtp.norm` hidden [B, L, H] whose logits predict x_{t+2}, aux loss).
    """
    cfg = model.config
    c = mtp_input(model, h, next_ids)
    cos, sin = rope(c.shape[1], cfg, c.device)
    c, aux = decoder_layer(model.mtp.layers[0], c, cos, sin, cfg, sdpa)
    return rms1p(c, model.mtp.norm.weight, cfg.rms_norm_eps), aux


def logits(model, h):
    return model.lm_head(h)


def losses(model, window, mtp_weight: float, aux_weight: float):
    """window [B, L+1] tokens → dict of scalar losses (main CE, MTP CE, aux, total)."""
    x, y = window[:, :-1], window[:, 1:]
    h, aux = forward_hidden(model, x)
    ce = F.cross_entropy(logits(model, h).flatten(0, 1).float(), y.flatten())
    # MTP rows t = 0..L-2: (h_t, x_{t+1}) → x_{t+2}
    g, aux_m = forward_mtp(model, h[:, :-1], x[:, 1:])
    ce_m = F.cross_entropy(logits(model, g).flatten(0, 1).float(), y[:, 1:].flatten())
    n_moe = len(model.model.layers) + 1
    aux_t = (aux + aux_m) / n_moe
    total = ce + mtp_weight * ce_m + aux_weight * aux_t
    return {"loss": total, "ce": ce, "mtp_ce": ce_m, "aux": aux_t}
