"""The FPN neck (`vision_encoder.neck.*`) and the sine position encodings.

The ViT's single-scale features become four levels: x4 (two stride-2 transposed convs with a
GELU between), x2 (one), x1, x0.5 (max-pool); each then a 1x1 and a 3x3 conv to fpn_hidden.
The detector uses the first three (288, 144, 72 px at full size): the x0.5 level's weights are
in the checkpoint, but its output is never read, so it is not computed.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from sammie.config import SamConfig


def sine_grid(batch: int, channels: int, height: int, width: int, device, dtype,
              temperature: float = 10000.0) -> torch.Tensor:
    """Normalised 2D sine encoding [B, channels, H, W]: (y, x) halves, positions 1..n scaled to
    (0, 2 pi]."""
    half = channels // 2
    eps, scale = 1e-6, 2 * math.pi
    y = torch.arange(1, height + 1, dtype=dtype, device=device)
    x = torch.arange(1, width + 1, dtype=dtype, device=device)
    y = y / (y[-1:] + eps) * scale
    x = x / (x[-1:] + eps) * scale
    dim_t = torch.arange(half, dtype=torch.int64, device=device).to(dtype)
    dim_t = temperature ** (2 * torch.div(dim_t, 2, rounding_mode="floor") / half)
    px, py = x[:, None] / dim_t, y[:, None] / dim_t
    px = torch.stack((px[:, 0::2].sin(), px[:, 1::2].cos()), dim=2).flatten(1)  # [W, half]
    py = torch.stack((py[:, 0::2].sin(), py[:, 1::2].cos()), dim=2).flatten(1)  # [H, half]
    pos = torch.cat([py[:, None, :].expand(height, width, half),
                     px[None, :, :].expand(height, width, half)], dim=-1)
    return pos.permute(2, 0, 1)[None].expand(batch, -1, -1, -1)


def sine_1d(v: torch.Tensor, features: int, temperature: float = 10000.0) -> torch.Tensor:
    """Sine encoding of coordinates in [0, 1] (scaled by 2 pi): [...] -> [..., features]."""
    dim_t = torch.arange(features, dtype=torch.int64, device=v.device).to(v.dtype)
    dim_t = temperature ** (2 * torch.div(dim_t, 2, rounding_mode="floor") / features)
    p = (v * (2 * math.pi))[..., None] / dim_t
    return torch.stack((p[..., 0::2].sin(), p[..., 1::2].cos()), dim=-1).flatten(-2)


class FpnLayer(nn.Module):
    def __init__(self, c: int, out: int, scale: float) -> None:
        super().__init__()
        self.scale_layers = nn.ModuleList()
        if scale == 4.0:
            self.scale_layers.extend([nn.ConvTranspose2d(c, c // 2, 2, stride=2), nn.GELU(),
                                      nn.ConvTranspose2d(c // 2, c // 4, 2, stride=2)])
            inner = c // 4
        elif scale == 2.0:
            self.scale_layers.append(nn.ConvTranspose2d(c, c // 2, 2, stride=2))
            inner = c // 2
        elif scale == 1.0:
            inner = c
        elif scale == 0.5:
            self.scale_layers.append(nn.MaxPool2d(2, stride=2))
            inner = c
        else:
            raise ValueError(f"unsupported FPN scale factor {scale}")
        self.proj1 = nn.Conv2d(inner, out, 1)
        self.proj2 = nn.Conv2d(out, out, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.proj1.weight.dtype)
        for layer in self.scale_layers:
            x = layer(x)
        return self.proj2(self.proj1(x))


class Neck(nn.Module):
    def __init__(self, cfg: SamConfig) -> None:
        super().__init__()
        self.fpn_layers = nn.ModuleList(FpnLayer(cfg.vit_hidden, cfg.fpn_hidden, s)
                                        for s in cfg.scale_factors)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        """ViT features -> the levels the detector reads (all but the last), finest first."""
        return [layer(x) for layer in list(self.fpn_layers)[:-1]]
