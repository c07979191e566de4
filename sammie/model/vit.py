"""The image encoder's ViT (`vision_encoder.backbone.*`): 14 px patches, learned position
embeddings at the pretraining grid tiled over the image grid, pre-norm blocks with 2D axial
RoPE, windowed attention (24 x 24 at full size) but for the global blocks.

RoPE: each head's dims are rotated in pairs (2i, 2i+1); the first half of the pairs by the
token's column, the second by its row, at frequencies theta^(-4j/d). A windowed block counts
positions within its window; a global block scales the grid's positions by window/grid, so
both span the same range. The cos/sin tables are built once (buffers, not weights).

Seam for the GPU (remaining work, docs/sammie.md): the blocks run through torch's fused
attention in the model's dtype; bf16 / FP8 GEMMs and CUDA graphs per batch size wrap
`VisionBackbone.forward` from outside (engine/vision_runner.py), not here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sammie.config import SamConfig
from sammie.model.attention import MLP


def rope_tables(head_dim: int, side: int, scale: float, theta: float):
    """(cos, sin) of shape [side*side, head_dim] for a side x side grid (row-major tokens)."""
    quarter = torch.arange(0, head_dim // 2, 2, dtype=torch.float32)
    inv_freq = 1.0 / (theta ** (quarter / (head_dim // 2)))
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    x = cols.flatten().float() * scale
    y = rows.flatten().float() * scale
    freqs = torch.cat([x[:, None] * inv_freq, y[:, None] * inv_freq], dim=-1)
    freqs = freqs.repeat_interleave(2, dim=-1)
    return freqs.cos(), freqs.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    pairs = xf.unflatten(-1, (-1, 2))
    rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return (xf * cos + rotated * sin).to(x.dtype)


class RopeAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.o_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, h, w, c = x.shape
        shape = (b, h * w, self.heads, self.head_dim)
        q = rotate(self.q_proj(x).view(shape).transpose(1, 2), cos, sin)
        k = rotate(self.k_proj(x).view(shape).transpose(1, 2), cos, sin)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(b, h, w, c))


class VitLayer(nn.Module):
    def __init__(self, cfg: SamConfig, window: int) -> None:
        super().__init__()
        c = cfg.vit_hidden
        self.window = window
        self.layer_norm1 = nn.LayerNorm(c, eps=cfg.vit_eps)
        self.attention = RopeAttention(c, cfg.vit_heads)
        self.layer_norm2 = nn.LayerNorm(c, eps=cfg.vit_eps)
        self.mlp = MLP(c, cfg.vit_intermediate, "gelu")
        side = window or cfg.grid
        cos, sin = rope_tables(c // cfg.vit_heads, side, cfg.window_size / side, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, c = x.shape
        y = self.layer_norm1(x)
        if self.window:
            s = self.window
            ph, pw = (s - h % s) % s, (s - w % s) % s
            y = F.pad(y, (0, 0, 0, pw, 0, ph))
            hp, wp = h + ph, w + pw
            y = y.view(b, hp // s, s, wp // s, s, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, s, s, c)
            y = self.attention(y, self.rope_cos, self.rope_sin)
            y = y.view(b, hp // s, wp // s, s, s, c).permute(0, 1, 3, 2, 4, 5)
            y = y.reshape(b, hp, wp, c)[:, :h, :w]
        else:
            y = self.attention(y, self.rope_cos, self.rope_sin)
        x = x + y
        return x + self.mlp(self.layer_norm2(x))


class PatchEmbeddings(nn.Module):
    def __init__(self, cfg: SamConfig) -> None:
        super().__init__()
        p = cfg.patch_size
        self.projection = nn.Conv2d(3, cfg.vit_hidden, kernel_size=p, stride=p, bias=False)


class Embeddings(nn.Module):
    def __init__(self, cfg: SamConfig) -> None:
        super().__init__()
        self.patch_embeddings = PatchEmbeddings(cfg)
        n = (cfg.pretrain_image_size // cfg.patch_size) ** 2
        self.position_embeddings = nn.Parameter(torch.zeros(1, n, cfg.vit_hidden))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] -> [B, H/14, W/14, C]."""
        proj = self.patch_embeddings.projection
        x = proj(pixels.to(proj.weight.dtype)).permute(0, 2, 3, 1)
        h, w = x.shape[1:3]
        pos = self.position_embeddings
        side = int(pos.shape[1] ** 0.5)
        pos = pos.view(1, side, side, -1)
        if (side, side) != (h, w):  # tiled, not interpolated
            pos = pos.tile(1, h // side + 1, w // side + 1, 1)[:, :h, :w]
        return x + pos


class VisionBackbone(nn.Module):
    def __init__(self, cfg: SamConfig) -> None:
        super().__init__()
        self.embeddings = Embeddings(cfg)
        self.layer_norm = nn.LayerNorm(cfg.vit_hidden, eps=cfg.vit_eps)
        self.layers = nn.ModuleList(
            VitLayer(cfg, 0 if i in cfg.global_layers else cfg.window_size)
            for i in range(cfg.vit_layers))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """Normalised pixels [B, 3, S, S] -> features [B, C, S/14, S/14]."""
        x = self.layer_norm(self.embeddings(pixels))
        for layer in self.layers:
            x = layer(x)
        return x.permute(0, 3, 1, 2)
