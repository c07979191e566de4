"""The MTP draft layer's plain computation (spec §8.1), the reference of `kernel_mtp.py`.

Row t is fed the target's final hidden state h_t and the token at t+1; the layer is a
full-attention decoder layer whose KV lives in the cache as one more attention layer (index
num_hidden_layers). The drafting loop around it is the worker's (worker/drafter.py).
"""

from __future__ import annotations

import torch

from tailored.model.batch import ForwardBatch, SeqInfo
from tailored.ops import reference as ref


def mtp_hidden(model, cache, h: torch.Tensor, ids: torch.Tensor,
               seqs: list[SeqInfo]) -> torch.Tensor:
    """The MTP layer over rows with target (or own) hidden h [R, H] and next-token ids [R];
    seqs lay the rows out (positions, pages; the MTP KV of those positions is written).
    Returns the post-`mtp.norm` hidden [R, H]."""
    mtp, cfg = model.mtp, model.config
    pos = torch.cat([torch.arange(s.start_pos, s.end_pos) for s in seqs]).to(h.device)
    e = mtp.pre_fc_norm_embedding(model.model.embed_tokens(ids))
    c = mtp.fc(torch.cat([e, mtp.pre_fc_norm_hidden(h)], dim=-1))
    cos, sin = ref.rope_cos_sin(pos, cfg.rotary_dim, cfg.rope_theta, c.dtype)
    batch = ForwardBatch(ids, pos, seqs, [])
    x = mtp.layers[0](c, cos, sin, batch, cache, cfg.num_hidden_layers)
    return mtp.norm(x)
