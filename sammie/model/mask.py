"""The mask decoder (`mask_decoder.*`): the encoder's image tokens attend once more to the
prompt, replace the x1 FPN level, and a small FPN (nearest upsampling, 3x3 conv, GroupNorm,
ReLU) carries them to the x4 level (288 x 288 at full size). A query's mask logits are its
MLP embedding dotted with the projected pixel embedding at every position.

`embed` returns the per-pair pixel embedding and the per-query mask embeddings separately, so
the engine computes mask logits only for the queries that pass the score threshold
(`mask_logits`). The semantic head's weights are loaded but never run: nothing reads it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sammie.config import SamConfig
from sammie.model.attention import Attention


class PixelDecoder(nn.Module):
    def __init__(self, c: int, stages: int) -> None:
        super().__init__()
        self.conv_layers = nn.ModuleList(nn.Conv2d(c, c, 3, padding=1) for _ in range(stages))
        self.norms = nn.ModuleList(nn.GroupNorm(8, c) for _ in range(stages))

    def forward(self, levels: list[torch.Tensor]) -> torch.Tensor:
        x = levels[-1]
        for i, skip in enumerate(reversed(levels[:-1])):
            x = F.interpolate(x, size=skip.shape[-2:], mode="nearest") + skip
            x = F.relu(self.norms[i](self.conv_layers[i](x)))
        return x


class MaskEmbedder(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(c, c) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < 2:
                x = F.relu(x)
        return x


class MaskDecoder(nn.Module):
    def __init__(self, cfg: SamConfig) -> None:
        super().__init__()
        b = cfg.mask_decoder
        c = b.hidden_size
        self.pixel_decoder = PixelDecoder(c, b.extra)
        self.mask_embedder = MaskEmbedder(c)
        self.instance_projection = nn.Conv2d(c, c, 1)
        self.semantic_projection = nn.Conv2d(c, 1, 1)
        self.prompt_cross_attn = Attention(c, b.num_heads)
        self.prompt_cross_attn_norm = nn.LayerNorm(c)

    def embed(self, queries, levels, encoded, prompt, prompt_mask):
        """queries [P, Q, C]; levels: the x4 and x2 FPN levels [P, C, h, w]; encoded: the
        detector encoder's image tokens [P, H*W, C] -> (mask embeddings [P, Q, C], pixel
        embeddings [P, C, 4H, 4W])."""
        encoded = encoded + self.prompt_cross_attn(self.prompt_cross_attn_norm(encoded), prompt,
                                                   prompt, key_mask=prompt_mask)
        p, hw, c = encoded.shape
        h, w = levels[-1].shape[-2] // 2, levels[-1].shape[-1] // 2
        grid = encoded.transpose(1, 2).reshape(p, c, h, w)
        pixels = self.instance_projection(self.pixel_decoder([*levels, grid]))
        return self.mask_embedder(queries), pixels

    @staticmethod
    def mask_logits(mask_embed: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
        """[P, Q, C] x [P, C, H, W] -> [P, Q, H, W]."""
        return torch.einsum("pqc,pchw->pqhw", mask_embed, pixels)
