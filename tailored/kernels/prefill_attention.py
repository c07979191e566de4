"""A prompt chunk's causal attention: one sequence's L new queries over its S >= L keys.

The queries are the context's last L positions (bottom-right causal mask). q [L, Hq, D]; k, v
[S, Hkv, D] with Hq a multiple of Hkv (grouped-query heads); returns [L, Hq, D] in q's dtype.
Three ways, by the `prefill_attention` switch (TAILORED_PREFILL_ATTENTION;
docs/prefill-attention.md has the A/B):

  sdpa   torch SDPA over key/value heads repeated to the query heads; a chunk after a cached
         context passes a materialised [L, S] mask, which rules out the flash kernels (the
         memory-efficient kernel then computes all L x S scores).
  flash  torch SDPA's flash kernel with the bottom-right causal bias (`causal_lower_right`),
         which it takes without a mask, and grouped heads in the kernel where this torch's
         flash kernel takes them (else the key/value heads are repeated first).
  fa3    FlashAttention-3's Hopper kernel (kernels/fa3.py, built by lab/build_fa3.sh).

`kernels.fa3.causal_attention_reference` is the fp32 reference all three are tested against.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.backends.cuda import SDPAParams, can_use_flash_attention
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from tailored import flags
from tailored.kernels import fa3

# the flash way never falls back to the memory-efficient kernel, which has no grouped heads
_FLASH_OR_MATH = [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The `sdpa` way. SDPA takes [1, heads, len, D], the layout of its GPU kernels."""
    L, S, rep = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    qt = q.transpose(0, 1).unsqueeze(0)
    kt = k.repeat_interleave(rep, dim=1).transpose(0, 1).unsqueeze(0)
    vt = v.repeat_interleave(rep, dim=1).transpose(0, 1).unsqueeze(0)
    if L == S:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    else:
        mask = torch.ones(L, S, dtype=torch.bool, device=q.device).tril(S - L)
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)
    return o[0].transpose(0, 1)


@functools.cache
def _flash_takes_grouped_heads(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch's flash kernel takes grouped heads (`enable_gqa`) here: where it does
    not, SDPA would fall to its math kernel, whose [heads, L, S] scores at a long context are
    tens of GB. (Not on CUDA: SDPA's CPU kernels take them.)"""
    if device.type != "cuda":
        return True
    q = torch.zeros(1, 16, 128, 256, dtype=dtype, device=device)
    k = torch.zeros(1, 2, 128, 256, dtype=dtype, device=device)
    return can_use_flash_attention(SDPAParams(q, k, k, None, 0.0, True, True), False)


def causal_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The `flash` way: grouped heads and the bottom-right mask inside SDPA's kernel (heads
    repeated first where this torch's flash kernel does not group them)."""
    L, S = q.shape[0], k.shape[0]
    gqa = _flash_takes_grouped_heads(q.device, q.dtype)
    if not gqa:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    qt = q.transpose(0, 1).unsqueeze(0)
    kt = k.transpose(0, 1).unsqueeze(0)
    vt = v.transpose(0, 1).unsqueeze(0)
    with sdpa_kernel(_FLASH_OR_MATH):
        if L == S:
            o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=causal_lower_right(L, S),
                                               enable_gqa=gqa)
    return o[0].transpose(0, 1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The chunk's attention by the switch's way (fa3 on CUDA only: elsewhere it is refused at
    start by `check_choice`)."""
    way = flags.current().prefill_attention
    if way == "fa3" and q.is_cuda:
        return fa3.attention(q, k, v)
    if way == "flash":
        return causal_flash(q, k, v)
    return causal_sdpa(q, k, v)


def check_choice(device: torch.device) -> None:
    """Raise at start, not at the first long prompt, where the chosen way cannot run here (fa3:
    one tiny call on the device)."""
    if flags.current().prefill_attention == "fa3":
        if device.type != "cuda":
            raise fa3.FA3Unavailable("TAILORED_PREFILL_ATTENTION=fa3 needs a CUDA device; "
                                     f"this model is on {device.type}")
        fa3.check(device)
