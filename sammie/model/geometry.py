"""Box prompts (`geometry_encoder.*`): each box becomes one prompt token from its coordinates, the
image features pooled inside it (ROI align, 7 x 7) and a sine encoding of its centre, plus a
positive / negative label embedding; a CLS token follows the boxes; three pre-norm layers attend
to each other and to the image.

`roi_align` is torchvision's `roi_align(..., aligned=False, sampling_ratio=-1)` written in
torch (the CPU has no torchvision here); on CUDA with torchvision present the engine may pass
torchvision's (`GeometryEncoder.roi_align`), the same arithmetic.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from sammie.config import SamConfig
from sammie.model.attention import CrossBlock, cxcywh_to_xyxy
from sammie.model.neck import sine_1d


def _axis_samples(start: float, size: float, bins: int, n: int, limit: int):
    """Sample positions along one axis of an ROI (bins x n), their low / high indices and the
    weights of the two, with torchvision's boundary rules (outside (-1, limit] -> weight 0)."""
    b = torch.arange(bins, dtype=torch.float64)
    i = torch.arange(n, dtype=torch.float64)
    pos = start + b[:, None] * (size / bins) + (i[None, :] + 0.5) * (size / bins) / n
    pos = pos.flatten()
    valid = (pos >= -1.0) & (pos <= limit)
    pos = pos.clamp(min=0)
    low = pos.floor().long()
    at_edge = low >= limit - 1
    low = torch.where(at_edge, torch.full_like(low, limit - 1), low)
    high = torch.where(at_edge, low, low + 1)
    pos = torch.where(at_edge, low.double(), pos)
    frac = pos - low
    w_low, w_high = (1 - frac) * valid, frac * valid
    return low, high, w_low.float(), w_high.float()


def roi_align(features: torch.Tensor, boxes: torch.Tensor, out: int) -> torch.Tensor:
    """features [C, H, W], boxes [N, 4] xyxy in feature pixels -> [N, C, out, out]."""
    c, h, w = features.shape
    f = features.float()
    rows = []
    for x0, y0, x1, y1 in boxes.double().tolist():
        rw, rh = max(x1 - x0, 1.0), max(y1 - y0, 1.0)
        gh, gw = math.ceil(rh / out), math.ceil(rw / out)
        yl, yh, wyl, wyh = _axis_samples(y0, rh, out, gh, h)
        xl, xh, wxl, wxh = _axis_samples(x0, rw, out, gw, w)
        dev = features.device
        yl, yh, xl, xh = yl.to(dev), yh.to(dev), xl.to(dev), xh.to(dev)
        wyl, wyh, wxl, wxh = wyl.to(dev), wyh.to(dev), wxl.to(dev), wxh.to(dev)
        v = (f[:, yl][:, :, xl] * (wyl[:, None] * wxl[None, :])
             + f[:, yl][:, :, xh] * (wyl[:, None] * wxh[None, :])
             + f[:, yh][:, :, xl] * (wyh[:, None] * wxl[None, :])
             + f[:, yh][:, :, xh] * (wyh[:, None] * wxh[None, :]))
        rows.append(v.view(c, out, gh, out, gw).mean(dim=(2, 4)))
    return torch.stack(rows).to(features.dtype)


class GeometryLayer(CrossBlock):
    def forward(self, x, mask, vision, vision_pos):
        y = self.layer_norm1(x)
        x = x + self.self_attn(y, y, y, key_mask=mask)
        x = x + self.cross_attn(self.layer_norm2(x), vision + vision_pos, vision)
        return x + self.mlp(self.layer_norm3(x))


class GeometryEncoder(nn.Module):
    def __init__(self, cfg: SamConfig) -> None:
        super().__init__()
        b = cfg.geometry
        c = b.hidden_size
        self.roi_size = b.extra
        self.label_embed = nn.Embedding(2, c)
        self.cls_embed = nn.Embedding(1, c)
        self.boxes_direct_project = nn.Linear(4, c)
        self.boxes_pool_project = nn.Conv2d(c, c, self.roi_size)
        self.boxes_pos_enc_project = nn.Linear(c + 2, c)
        self.vision_layer_norm = nn.LayerNorm(c)
        self.final_proj = nn.Linear(c, c)
        self.prompt_layer_norm = nn.LayerNorm(c)
        self.layers = nn.ModuleList(GeometryLayer(b) for _ in range(b.num_layers))
        self.output_layer_norm = nn.LayerNorm(c)
        self.roi_align = roi_align

    def forward(self, boxes: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor,
                vision: torch.Tensor, vision_pos: torch.Tensor):
        """boxes [P, N, 4] cxcywh in [0, 1], labels [P, N] (1 positive, 0 negative), mask
        [P, N] (True = a box), vision / vision_pos [P, C, H, W] (the x1 FPN level) ->
        (prompt tokens [P, N+1, C], their mask [P, N+1])."""
        p, n, _ = boxes.shape
        c = vision.shape[1]
        h, w = vision.shape[-2:]
        normed = self.vision_layer_norm(vision.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        x = self.boxes_direct_project(boxes)
        xyxy = cxcywh_to_xyxy(boxes) * torch.tensor([w, h, w, h], dtype=boxes.dtype,
                                                     device=boxes.device)
        pooled = torch.cat([self.roi_align(normed[i], xyxy[i], self.roi_size) for i in range(p)])
        x = x + self.boxes_pool_project(pooled).view(p, n, c)
        cx, cy, bw, bh = boxes.reshape(-1, 4).unbind(-1)
        half = c // 2
        enc = torch.cat([sine_1d(cy, half), sine_1d(cx, half), bh[:, None], bw[:, None]], dim=1)
        x = x + self.boxes_pos_enc_project(enc.view(p, n, -1))
        x = x + self.label_embed(labels.long())
        # the CLS token right after each row's valid boxes (rows are right-padded)
        count = mask.sum(dim=1)
        x = torch.cat([x, torch.zeros_like(x[:, :1])], dim=1)
        x[torch.arange(p, device=x.device), count] = self.cls_embed.weight[0].to(x.dtype)
        keep = torch.arange(n + 1, device=x.device)[None] <= count[:, None]
        x = self.prompt_layer_norm(self.final_proj(x))
        vis = vision.flatten(2).transpose(1, 2)
        pos = vision_pos.flatten(2).transpose(1, 2)
        for layer in self.layers:
            x = layer(x, keep, vis, pos)
        return self.output_layer_norm(x), keep
