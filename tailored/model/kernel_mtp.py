"""The MTP draft layer on the kernel path (spec §8.1).

The MTP layer is a full-attention decoder layer with the backbone's MoE; `KernelModel` lays
out its projections like a decoder layer's under index num_hidden_layers (`mtp_layer`), and
the cache holds its KV as one more attention layer. So the layer runs through the same
blocks: fused residual-add + RMSNorm, the q|k|v GEMM with q/k norm and RoPE, paged attention,
the routed + shared experts and their combine, which applies `mtp.norm` in its launch.
Checked against the plain path (`model/mtp.py`) in tests/worker/test_kernel_path.py.
"""

from __future__ import annotations

import torch

from tailored import flags
from tailored.kernels.norm import add_rms_norm_1p
from tailored.model.batch import ForwardBatch, SeqInfo
from tailored.model.step_plan import build_plan
from tailored.ops import reference as ref


def mtp_input(km, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """fc([RMSNorm1p(embed(ids)), RMSNorm1p(h)]) (spec §8.1: embedding first): h [R, H] the
    target's (or the MTP's own) final-normed hidden states, ids [R] the next tokens. [R, H]."""
    mtp = km.model.mtp
    e = km.model.model.embed_tokens(ids)
    _, en = add_rms_norm_1p(e, None, mtp.pre_fc_norm_embedding.weight,
                            mtp.pre_fc_norm_embedding.eps)
    _, hn = add_rms_norm_1p(h, None, mtp.pre_fc_norm_hidden.weight, mtp.pre_fc_norm_hidden.eps)
    return km.p_fc(torch.cat([en, hn], dim=-1))


def mtp_layer(km, c: torch.Tensor, mixer) -> torch.Tensor:
    """The MTP decoder layer on its input c [R, H], then `mtp.norm`; mixer(i, normed) is the
    attention (eager or paged decode). Returns the post-`mtp.norm` hidden [R, H]."""
    L, mtp = km.mtp_layer, km.model.mtp
    layer = km.layers[L]
    norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
    res, hn = add_rms_norm_1p(c, None, norm1.weight, norm1.eps)
    res, hn = add_rms_norm_1p(res, mixer(L, hn), norm2.weight, norm2.eps)
    if flags.current().combine_next_norm:
        return km.moe(L, hn, (res, mtp.norm.weight, mtp.norm.eps))[1]
    return add_rms_norm_1p(res, km.moe(L, hn), mtp.norm.weight, mtp.norm.eps)[1]


def mtp_eager(km, h: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor,
              seqs: list[SeqInfo]) -> torch.Tensor:
    """The MTP layer over rows laid out by `seqs` (their pages; the MTP KV of those positions
    is written), eagerly: attention as for prefill chunks. Same contract as the plain
    `model.mtp.mtp_hidden`. h [R, H], ids [R], pos [R] (the rows' positions); returns
    [R, H]."""
    cfg = km.cfg
    cos, sin = ref.rope_cos_sin(pos, cfg.rotary_dim, cfg.rope_theta, h.dtype)
    plan = build_plan(seqs, [], [], km.cache.page_size, h.device)
    batch = ForwardBatch(ids, pos, seqs, [])
    return mtp_layer(km, mtp_input(km, h, ids),
                     lambda i, hn: km.attn.eager(i, hn, cos, sin, batch, plan))
