"""The lm_head the MTP drafts with: an FP8 copy of the target's (kb/0035).

A draft is the argmax of the MTP's logits (spec §8.2), and each one reads the whole lm_head:
248320 × 2048 bf16 = 1.02 GB, ~0.26 ms of HBM time, twice a verify step with 2 drafts. That
is a quarter of what the device chain costs at c=1 (kb/0034 §3). The verify step keeps the
target's bf16 lm_head, so a draft only decides what is proposed, never what is emitted: a
draft head that reads half the bytes changes the acceptance at most (where two logits are
within the rounding of the weights), never the output.

The copy is e4m3 with one fp32 scale per row and 128 columns (amax / 448), the layout of
`kernels/fp8_linear.py` (`scale_rows`): finer than the checkpoint's 128 × 128 blocks, so the
argmax moves less. On the GPU it runs through that kernel (W8A16: half the bytes read); on the
CPU (tests) as its reference, the dequantized weight through F.linear.

With the `mtp_fp8_head` switch off the MTP drafts with the bf16 lm_head itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tailored.model.fp8 import BLOCK as COLS  # columns a scale covers: fp8_linear's SCALE_BLOCK
from tailored.model.fp8 import FP8, FP8_MAX


@torch.no_grad()
def quantize_rows(w: torch.Tensor, chunk: int = 16384) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (any float dtype) → (q float8_e4m3fn [N, K], scale_rows fp32 [N, ceil(K/128)])
    with scale = amax(|w[n, 128-column block]|) / 448 (1 for an all-zero block) and
    q = round_to_nearest(w / scale). Rows go `chunk` at a time: the fp32 temporaries of the
    whole lm_head would be 2 GB."""
    N, K = w.shape
    kb = -(-K // COLS)
    q = torch.empty(N, K, dtype=FP8, device=w.device)
    scale = torch.empty(N, kb, dtype=torch.float32, device=w.device)
    for r in range(0, N, chunk):
        wf = F.pad(w[r:r + chunk].float(), (0, kb * COLS - K)).view(-1, kb, COLS)
        amax = wf.abs().amax(-1)
        s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        q[r:r + chunk] = (wf / s[..., None]).clamp_(-FP8_MAX, FP8_MAX).view(-1, kb * COLS)[:, :K] \
            .to(FP8)
        scale[r:r + chunk] = s
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """The inverse of quantize_rows: q · scale [N, K] in `dtype` (the reference)."""
    K = q.shape[1]
    return (q.float() * scale.repeat_interleave(COLS, 1)[:, :K]).to(dtype)


class DraftHead:
    """FP8 copy of an lm_head weight [V, H] (bf16 or fp32) for drafting; `logits(h)` of
    h [B, H] → [B, V] in h's dtype. ~V·H bytes of device memory (0.51 GB at full size)."""

    def __init__(self, weight: torch.Tensor):
        self.q, self.scale = quantize_rows(weight)

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scale.numel() * 4

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        if h.is_cuda:
            from tailored.kernels.fp8_linear import fp8_linear

            return fp8_linear(h, self.q, self.scale)
        return F.linear(h, dequantize_rows(self.q, self.scale, h.dtype))


def draft_argmax(model, head: DraftHead | None, h: torch.Tensor) -> torch.Tensor:
    """The MTP's drafts from its final-normed hidden rows h [B, H]: int64 [B], the argmax of
    the FP8 `head`'s logits when there is one (the runner makes it on CUDA with speculative
    decoding on), else of the model's lm_head (`compute_logits`). Used by every drafting path
    (MTPDrafter, the MTP and chain graphs), so the host and device paths draft the same
    tokens."""
    if head is None:
        return model.compute_logits(h).argmax(-1)
    return head.logits(h).argmax(-1)
