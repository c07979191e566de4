"""Plain-PyTorch reference ops: the executable spec of every op the model runs.

Runs on CPU and GPU. Fast kernels (later) are tested against these. Every formula cites the
model spec (/shared/docs/model-spec.md, "spec §N"), which follows transformers'
`modeling_qwen3_5_moe.py` (HF-MOD).

Shapes use T = tokens in the step, H = hidden size, HV = value heads, HK = key heads,
Dk/Dv = key/value head dims, C = conv channels (2·HK·Dk + HV·Dv), W = conv kernel width (4).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GDN_CHUNK = 64  # chunk length of the chunkwise gated delta rule (spec §5.6)


# ---------------------------------------------------------------------------------------------
# norms (spec §3)
# ---------------------------------------------------------------------------------------------
def rms_norm_1p(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm `x / rms(x) · (1 + w)` in fp32, cast back to x.dtype (spec §3).

    x: [..., D]; weight: [D]. Returns x's shape and dtype.
    """
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GDN output norm, norm-before-gate: `(x / rms(x)) · w · silu(z)` per head (spec §3, §5.7).

    x, z: [..., Dv]; weight: [Dv] (plain, not 1+w). Normalise in fp32, cast to x.dtype, scale by w,
    then multiply by silu(z) computed in fp32; result in x.dtype (HF order of casts).
    """
    dtype = x.dtype
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * y.to(dtype)
    return (y * F.silu(z.float())).to(dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x / sqrt(Σx² + eps)` over the last dim (FLA convention, spec §5.5)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


# ---------------------------------------------------------------------------------------------
# causal depthwise conv1d with carried state (spec §5.2, §5.8)
# ---------------------------------------------------------------------------------------------
def causal_conv1d(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor):
    """Depthwise causal conv + SiLU over one sequence's new tokens, continuing from `state`.

    x: [L, C] pre-activation projection outputs of the new tokens.
    state: [C, W-1] the last W-1 inputs before x (zeros at sequence start).
    weight: [C, W]; tap W-1 multiplies the current token.
    Returns (out [L, C] in x.dtype, new_state [C, W-1] in state.dtype).
    """
    L = x.shape[0]
    xx = torch.cat([state.to(weight.dtype), x.t().to(weight.dtype)], dim=-1)  # [C, W-1+L]
    out = F.conv1d(xx.unsqueeze(0), weight.unsqueeze(1), groups=weight.shape[0])[0]  # [C, L]
    new_state = xx[:, -state.shape[-1]:].to(state.dtype)
    return F.silu(out).t()[:L].to(x.dtype), new_state


def causal_conv1d_step(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor):
    """One decode token for a batch: x [B, C], state [B, C, W-1], weight [C, W].

    Returns (out [B, C] in x.dtype, new_state [B, C, W-1]).
    """
    xx = torch.cat([state.to(weight.dtype), x.unsqueeze(-1).to(weight.dtype)], dim=-1)  # [B,C,W]
    out = (xx * weight.unsqueeze(0)).sum(-1)
    return F.silu(out).to(x.dtype), xx[:, :, 1:].to(state.dtype)


# ---------------------------------------------------------------------------------------------
# gated delta rule (spec §5.3–§5.6)
# ---------------------------------------------------------------------------------------------
def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """β = σ(b), g = −exp(A_log)·softplus(a + dt_bias), both fp32 (spec §5.3). a, b: [..., HV]."""
    beta = torch.sigmoid(b.float())
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, beta


def _prep_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int):
    """L2-normalise q,k in fp32, scale q by Dk^-½ and repeat key heads to value heads (h(j)=⌊j/r⌋)."""
    q = l2norm(q.float())
    k = l2norm(k.float())
    q = q * (q.shape[-1] ** -0.5)
    rep = num_v_heads // q.shape[-2]
    if rep > 1:
        q = q.repeat_interleave(rep, dim=-2)
        k = k.repeat_interleave(rep, dim=-2)
    return q, k


def gated_delta_rule_recurrent(q, k, v, g, beta, state):
    """Token-by-token gated delta rule for a batch of sequences (spec §5.5). The brute-force oracle.

    q, k: [B, L, HK, Dk] (raw, after conv); v: [B, L, HV, Dv]; g, beta: [B, L, HV] fp32;
    state: [B, HV, Dk, Dv] fp32 (HF orientation). Returns (o [B, L, HV, Dv] in v.dtype, new state fp32).
    """
    HV = v.shape[-2]
    qf, kf = _prep_qk(q, k, HV)
    vf = v.float()
    S = state.float().clone()
    out = torch.empty(vf.shape, dtype=torch.float32, device=v.device)
    for t in range(v.shape[1]):
        S = S * g[:, t].exp()[..., None, None]
        kt = kf[:, t]  # [B, HV, Dk]
        mem = (S * kt.unsqueeze(-1)).sum(-2)  # [B, HV, Dv]
        delta = (vf[:, t] - mem) * beta[:, t].unsqueeze(-1)
        S = S + kt.unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, t] = (S * qf[:, t].unsqueeze(-1)).sum(-2)
    return out.to(v.dtype), S


def gated_delta_rule_chunked(q, k, v, g, beta, state, chunk: int = GDN_CHUNK):
    """Chunkwise-parallel (WY/UT) gated delta rule for ONE sequence (spec §5.6).

    q, k: [L, HK, Dk]; v: [L, HV, Dv]; g, beta: [L, HV] fp32; state: [HV, Dk, Dv] fp32.
    Returns (o [L, HV, Dv] in v.dtype, final state [HV, Dk, Dv] fp32).

    The tail is padded to a multiple of `chunk` with k = v = 0, β = 0 and g = 0 so padded rows
    neither write to nor decay the state (the fault in failure-cases §2: padding touching state).
    """
    L, HV = v.shape[0], v.shape[1]
    qf, kf = _prep_qk(q, k, HV)
    # [HV, L, D] layout for per-head matmuls
    qf, kf, vf = qf.transpose(0, 1), kf.transpose(0, 1), v.float().transpose(0, 1)
    gf, bf = g.float().t(), beta.float().t()  # [HV, L]
    pad = (-L) % chunk
    if pad:
        qf, kf, vf = (F.pad(x, (0, 0, 0, pad)) for x in (qf, kf, vf))
        gf, bf = F.pad(gf, (0, pad)), F.pad(bf, (0, pad))
    n = (L + pad) // chunk
    qc = qf.reshape(HV, n, chunk, -1)
    kc = kf.reshape(HV, n, chunk, -1)
    vc = vf.reshape(HV, n, chunk, -1)
    gc = gf.reshape(HV, n, chunk).cumsum(-1)  # Γ within each chunk
    bc = bf.reshape(HV, n, chunk)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).tril()
    decay = (gc.unsqueeze(-1) - gc.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp()  # D[r,s]
    kb = kc * bc.unsqueeze(-1)
    A = (kb @ kc.transpose(-1, -2)) * decay  # includes diagonal β_r k_r·k_r; strictly-lower used
    P = A.tril(-1) + torch.eye(chunk, device=v.device)
    U = torch.linalg.solve_triangular(P, vc * bc.unsqueeze(-1), upper=False, unitriangular=True)
    Wk = torch.linalg.solve_triangular(P, kb * gc.exp().unsqueeze(-1), upper=False, unitriangular=True)
    qdec = qc * gc.exp().unsqueeze(-1)
    kdec = kc * (gc[..., -1:] - gc).exp().unsqueeze(-1)
    intra = (qc @ kc.transpose(-1, -2)) * decay
    S = state.float().clone()
    out = torch.empty_like(vc)
    for i in range(n):
        vnew = U[:, i] - Wk[:, i] @ S
        out[:, i] = qdec[:, i] @ S + intra[:, i] @ vnew
        S = S * gc[:, i, -1].exp()[:, None, None] + kdec[:, i].transpose(-1, -2) @ vnew
    o = out.reshape(HV, n * chunk, -1)[:, :L].transpose(0, 1)
    return o.to(v.dtype), S


# ---------------------------------------------------------------------------------------------
# rotary embedding (spec §6.3)
# ---------------------------------------------------------------------------------------------
def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin [T, rotary_dim] for integer positions [T] (fp32 maths, cast to dtype).

    For text-only input all three M-RoPE streams equal the position, so M-RoPE == 1-D RoPE.
    """
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device) / rotary_dim)
    )
    freqs = positions.float().unsqueeze(-1) * inv_freq.unsqueeze(0)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first cos.shape[-1] dims of each head. x: [T, heads, D]; cos: [T, R]."""
    r = cos.shape[-1]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    xr, xp = x[..., :r], x[..., r:]
    x1, x2 = xr[..., : r // 2], xr[..., r // 2:]
    rot = torch.cat([-x2, x1], dim=-1)
    return torch.cat([xr * c + rot * s, xp], dim=-1)


# ---------------------------------------------------------------------------------------------
# attention over a paged KV cache (spec §6.4, §6.6)
# ---------------------------------------------------------------------------------------------
def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int) -> torch.Tensor:
    """GQA causal softmax attention of L new queries over the first start_pos+L cached keys.

    q: [L, Hq, D]; k, v: [start_pos+L, Hkv, D]. Query i (position start_pos+i) sees keys 0..start_pos+i.
    Scale D^-½, softmax in fp32 then cast to q.dtype (HF eager). Returns [L, Hq, D].
    """
    L, Hq, D = q.shape
    rep = Hq // k.shape[1]
    kk = k.repeat_interleave(rep, dim=1).transpose(0, 1)  # [Hq, S, D]
    vv = v.repeat_interleave(rep, dim=1).transpose(0, 1)
    scores = (q.transpose(0, 1) @ kk.transpose(-1, -2)) * (D ** -0.5)  # [Hq, L, S]
    S = k.shape[0]
    qpos = torch.arange(start_pos, start_pos + L, device=q.device).unsqueeze(-1)
    kpos = torch.arange(S, device=q.device).unsqueeze(0)
    scores = scores.masked_fill(kpos > qpos, float("-inf"))
    p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return (p @ vv).transpose(0, 1)


# ---------------------------------------------------------------------------------------------
# MoE (spec §7)
# ---------------------------------------------------------------------------------------------
def route_topk(router_logits: torch.Tensor, top_k: int):
    """Softmax over all experts (fp32), top-k, renormalise; weights cast to the logits dtype.

    router_logits: [T, E]. Returns (weights [T, k], ids [T, k] int64).
    """
    p = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    w, ids = torch.topk(p, top_k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    return w.to(router_logits.dtype), ids


def moe_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Σ_i w_i · Expert_{e_i}(x) with Expert(u) = (silu(u Gᵀ) ⊙ u Uᵀ) Dᵀ (spec §7).

    x: [T, H]; weights, ids: [T, k]; gate_up: [E, 2I, H] (gate rows first); down: [E, H, I].
    Loops over the experts that were hit (the HF reference order of accumulation).
    """
    out = torch.zeros_like(x)
    E = gate_up.shape[0]
    hit = torch.bincount(ids.flatten(), minlength=E).nonzero().flatten().tolist()
    for e in hit:
        tok, slot = torch.where(ids == e)
        gate, up = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e]) * weights[tok, slot, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out
