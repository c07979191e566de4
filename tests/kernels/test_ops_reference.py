"""Reference ops against brute-force definitions (fresh random inputs, odd sizes, carried state)."""

from __future__ import annotations

import pytest
import torch

from tailored.ops import reference as ref


def _gdn_inputs(L, HK=2, HV=4, Dk=16, Dv=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(L, HK, Dk, generator=g)
    k = torch.randn(L, HK, Dk, generator=g)
    v = torch.randn(L, HV, Dv, generator=g)
    gate = -torch.rand(L, HV, generator=g) * 2.0  # log-decay ≤ 0
    beta = torch.rand(L, HV, generator=g)
    s0 = torch.randn(HV, Dk, Dv, generator=g)
    return q, k, v, gate, beta, s0


@pytest.mark.parametrize("L", [1, 2, 63, 64, 65, 127, 128, 129, 200])
def test_chunked_delta_rule_equals_token_by_token(L):
    q, k, v, g, beta, s0 = _gdn_inputs(L, seed=L)
    o_c, s_c = ref.gated_delta_rule_chunked(q, k, v, g, beta, s0)
    o_r, s_r = ref.gated_delta_rule_recurrent(q[None], k[None], v[None], g[None], beta[None], s0[None])
    assert torch.allclose(o_c, o_r[0], rtol=1e-4, atol=1e-4)
    # the final state is what the next chunk / decode step reads: padding must not touch it
    assert torch.allclose(s_c, s_r[0], rtol=1e-4, atol=1e-4)


def test_recurrent_matches_explicit_formula():
    """S_t = α_t (I − β_t k̂k̂ᵀ) S_{t−1} + β_t k̂ v_tᵀ, o_t = S_tᵀ q̂ (spec §5.5), written out."""
    q, k, v, g, beta, s0 = _gdn_inputs(5, HK=1, HV=1, Dk=4, Dv=3, seed=7)
    o, s = ref.gated_delta_rule_recurrent(q[None], k[None], v[None], g[None], beta[None], s0[None])
    S = s0[0].double()
    for t in range(5):
        kh = k[t, 0].double() / (k[t, 0].double().norm() ** 2 + 1e-6).sqrt()
        qh = q[t, 0].double() / (q[t, 0].double().norm() ** 2 + 1e-6).sqrt() / 2.0  # Dk^-½, Dk=4
        a, b = g[t, 0].double().exp(), beta[t, 0].double()
        S = a * (torch.eye(4, dtype=torch.float64) - b * torch.outer(kh, kh)) @ S + b * torch.outer(kh, v[t, 0].double())
        assert torch.allclose(o[0, t, 0].double(), S.t() @ qh, atol=1e-5)
    assert torch.allclose(s[0, 0].double(), S, atol=1e-5)


@pytest.mark.parametrize("split", [1, 3, 64, 70])
def test_chunked_delta_rule_can_be_split_anywhere(split):
    """Chunked prefill in two pieces with the state carried == one pass."""
    q, k, v, g, beta, s0 = _gdn_inputs(150, seed=split)
    o, s = ref.gated_delta_rule_chunked(q, k, v, g, beta, s0)
    o1, s1 = ref.gated_delta_rule_chunked(q[:split], k[:split], v[:split], g[:split], beta[:split], s0)
    o2, s2 = ref.gated_delta_rule_chunked(q[split:], k[split:], v[split:], g[split:], beta[split:], s1)
    assert torch.allclose(torch.cat([o1, o2]), o, rtol=1e-4, atol=1e-4)
    assert torch.allclose(s2, s, rtol=1e-4, atol=1e-4)


def test_causal_conv1d_state_continuation():
    g = torch.Generator().manual_seed(0)
    C, W, L = 6, 4, 11
    x = torch.randn(L, C, generator=g)
    w = torch.randn(C, W, generator=g)
    zero = torch.zeros(C, W - 1)
    full, st = ref.causal_conv1d(x, zero, w)
    # brute force: out_t[c] = silu(Σ_j w[c,j] x_{t-3+j}[c])
    xp = torch.cat([torch.zeros(W - 1, C), x])
    brute = torch.stack([torch.nn.functional.silu((xp[t:t + W].t() * w).sum(-1)) for t in range(L)])
    assert torch.allclose(full, brute, atol=1e-6)
    # split + single-step continuation
    a, st_a = ref.causal_conv1d(x[:5], zero, w)
    b, st_b = ref.causal_conv1d(x[5:10], st_a, w)
    c, st_c = ref.causal_conv1d_step(x[10:11], st_b.unsqueeze(0), w)
    assert torch.allclose(torch.cat([a, b, c]), full, atol=1e-6)
    assert torch.allclose(st_c[0], st, atol=1e-6)


def test_rope_rotates_pairs_i_and_i_plus_half():
    pos = torch.tensor([0, 5])
    cos, sin = ref.rope_cos_sin(pos, 8, 10000.0, torch.float32)
    x = torch.randn(2, 3, 16)
    y = ref.apply_partial_rope(x, cos, sin)
    assert torch.equal(y[..., 8:], x[..., 8:])  # pass-through dims
    assert torch.allclose(y[0], x[0])  # position 0 is identity
    inv = 1.0 / 10000.0 ** (torch.arange(0, 8, 2).float() / 8)
    ang = 5 * inv
    x1, x2 = x[1, :, :4], x[1, :, 4:8]
    assert torch.allclose(y[1, :, :4], x1 * ang.cos() - x2 * ang.sin(), atol=1e-6)
    assert torch.allclose(y[1, :, 4:8], x2 * ang.cos() + x1 * ang.sin(), atol=1e-6)


def test_causal_attention_matches_sdpa():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(5, 4, 8, generator=g)
    k = torch.randn(12, 2, 8, generator=g)
    v = torch.randn(12, 2, 8, generator=g)
    out = ref.causal_attention(q, k, v, start_pos=7)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    mask = torch.arange(12)[None, :] <= torch.arange(7, 12)[:, None]
    exp = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1), attn_mask=mask).transpose(0, 1)
    assert torch.allclose(out, exp, atol=1e-5)


def test_route_topk_renormalises():
    logits = torch.randn(3, 8)
    w, ids = ref.route_topk(logits, 2)
    assert torch.allclose(w.sum(-1), torch.ones(3))
    assert torch.equal(ids[:, 0], logits.argmax(-1))


def test_pad_rows_with_zero_beta_and_g_leave_the_gdn_state_alone():
    """kb/0013 (prefill graphs at padded token counts): rows with β = 0 and g = 0 neither write
    nor decay the recurrent state, whatever their q, k, v — so a fixed-length chunked pass over
    T real + pad rows ends in the state after the T real rows, and real outputs are unchanged."""
    g_ = torch.Generator().manual_seed(13)
    T, P, HK, HV, Dk, Dv = 37, 27, 2, 4, 16, 8
    q = torch.randn(T + P, HK, Dk, generator=g_)
    k = torch.randn(T + P, HK, Dk, generator=g_)
    v = torch.randn(T + P, HV, Dv, generator=g_)
    g = -torch.rand(T + P, HV, generator=g_)
    beta = torch.rand(T + P, HV, generator=g_)
    g[T:], beta[T:] = 0.0, 0.0
    s0 = torch.randn(HV, Dk, Dv, generator=g_)
    o_real, s_real = ref.gated_delta_rule_chunked(q[:T], k[:T], v[:T], g[:T], beta[:T], s0)
    o_pad, s_pad = ref.gated_delta_rule_chunked(q, k, v, g, beta, s0)
    assert torch.allclose(s_pad, s_real, atol=1e-5, rtol=1e-5)
    assert torch.allclose(o_pad[:T], o_real, atol=1e-5, rtol=1e-5)
    # and the token-by-token oracle agrees
    _, s_rec = ref.gated_delta_rule_recurrent(q[None], k[None], v[None], g[None], beta[None],
                                              s0[None])
    assert torch.allclose(s_rec[0], s_real, atol=1e-4, rtol=1e-4)
