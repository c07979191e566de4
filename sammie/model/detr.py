"""The detector (`detr_encoder.*`, `detr_decoder.*`, `dot_product_scoring.*`).

Encoder: the x1 image level's tokens (72 x 72 at full size) attend to themselves (with sine
positions) and to the prompt tokens, pre-norm. Decoder: a presence token and 200 queries with
learned reference boxes, post-norm; each layer attends to itself, the prompt and the image
(the image attention biased by each query's box: log-scaled distances of every image
row / column to the box edges, embedded per head), then refines the boxes. Scores: the last
layer's queries dotted with the mean-pooled, MLP-refined prompt; the presence token's logit
says whether the concept is in the image at all (score = sigmoid(logit) x sigmoid(presence)).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from sammie.config import SamConfig
from sammie.model.attention import (MLP, Attention, CrossBlock, DecoderMLP, cxcywh_to_xyxy,
                                    inverse_sigmoid)
from sammie.model.neck import sine_1d

PRESENCE_CLAMP = 10.0
SCORE_CLAMP = 12.0


class EncoderLayer(CrossBlock):
    def forward(self, x, pos, prompt, prompt_mask):
        y = self.layer_norm1(x)
        qk = y + pos
        x = x + self.self_attn(qk, qk, y)
        x = x + self.cross_attn(self.layer_norm2(x), prompt, prompt, key_mask=prompt_mask)
        return x + self.mlp(self.layer_norm3(x))


class DetrEncoder(nn.Module):
    def __init__(self, cfg: SamConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(cfg.detr_encoder)
                                    for _ in range(cfg.detr_encoder.num_layers))

    def forward(self, x, pos, prompt, prompt_mask):
        for layer in self.layers:
            x = layer(x, pos, prompt, prompt_mask)
        return x


class DecoderLayer(nn.Module):
    def __init__(self, b) -> None:
        super().__init__()
        c = b.hidden_size
        self.self_attn = Attention(c, b.num_heads)
        self.self_attn_layer_norm = nn.LayerNorm(c)
        self.text_cross_attn = Attention(c, b.num_heads)
        self.text_cross_attn_layer_norm = nn.LayerNorm(c)
        self.vision_cross_attn = Attention(c, b.num_heads)
        self.vision_cross_attn_layer_norm = nn.LayerNorm(c)
        self.mlp = MLP(c, b.intermediate_size, "relu")
        self.mlp_layer_norm = nn.LayerNorm(c)

    def forward(self, x, qpos, prompt, prompt_mask, vision, vision_pos, bias):
        qpos = F.pad(qpos, (0, 0, 1, 0))  # the presence token has no position
        q = x + qpos
        x = self.self_attn_layer_norm(x + self.self_attn(q, q, x))
        x = self.text_cross_attn_layer_norm(
            x + self.text_cross_attn(x + qpos, prompt, prompt, key_mask=prompt_mask))
        x = self.vision_cross_attn_layer_norm(
            x + self.vision_cross_attn(x + qpos, vision + vision_pos, vision, bias=bias))
        return self.mlp_layer_norm(x + self.mlp(x))


class DetrDecoder(nn.Module):
    def __init__(self, cfg: SamConfig) -> None:
        super().__init__()
        b = cfg.detr_decoder
        c, heads = b.hidden_size, b.num_heads
        self.layers = nn.ModuleList(DecoderLayer(b) for _ in range(b.num_layers))
        self.output_layer_norm = nn.LayerNorm(c)
        self.box_head = DecoderMLP([c, c, c, 4])
        self.query_embed = nn.Embedding(b.extra, c)
        self.reference_points = nn.Embedding(b.extra, 4)
        self.presence_token = nn.Embedding(1, c)
        self.presence_head = DecoderMLP([c, c, c, 1])
        self.presence_layer_norm = nn.LayerNorm(c)
        self.ref_point_head = DecoderMLP([2 * c, c, c])
        self.box_rpb_embed_x = DecoderMLP([2, c, heads])
        self.box_rpb_embed_y = DecoderMLP([2, c, heads])

    def rpb(self, boxes: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """Box relative-position bias [P, heads, Q, h*w] of reference boxes [P, Q, 4]."""
        xyxy = cxcywh_to_xyxy(boxes)
        ys = torch.arange(h, device=boxes.device, dtype=boxes.dtype) / h
        xs = torch.arange(w, device=boxes.device, dtype=boxes.dtype) / w
        dy = ys[None, None, :, None] - xyxy[:, :, None, 1::2]  # [P, Q, h, 2]
        dx = xs[None, None, :, None] - xyxy[:, :, None, 0::2]

        def log_scale(d):
            d = d * 8
            return torch.sign(d) * torch.log2(d.abs() + 1.0) / math.log2(8)

        ey = self.box_rpb_embed_y(log_scale(dy))  # [P, Q, h, heads]
        ex = self.box_rpb_embed_x(log_scale(dx))
        bias = ey[:, :, :, None, :] + ex[:, :, None, :, :]
        return bias.flatten(2, 3).permute(0, 3, 1, 2)

    def forward(self, vision, vision_pos, hw, prompt, prompt_mask):
        """-> (last layer's query states [P, Q, C] (output-normed), boxes cxcywh [P, Q, 4],
        presence logits [P])."""
        p = vision.shape[0]
        c = vision.shape[-1]
        x = torch.cat([self.presence_token.weight, self.query_embed.weight])[None].expand(p, -1, -1)
        ref = self.reference_points.weight.sigmoid()[None].expand(p, -1, -1)
        for layer in self.layers:
            half = c // 2
            sine = torch.cat([sine_1d(ref[..., 1], half), sine_1d(ref[..., 0], half),
                              sine_1d(ref[..., 2], half), sine_1d(ref[..., 3], half)], dim=-1)
            qpos = self.ref_point_head(sine)
            bias = F.pad(self.rpb(ref, *hw), (0, 0, 1, 0))
            x = layer(x, qpos, prompt, prompt_mask, vision, vision_pos, bias)
            queries = self.output_layer_norm(x[:, 1:])
            ref = (self.box_head(queries) + inverse_sigmoid(ref)).sigmoid()
        presence = self.presence_head(self.presence_layer_norm(x[:, :1])).view(p)
        return queries, ref, presence.clamp(-PRESENCE_CLAMP, PRESENCE_CLAMP)


class DotProductScoring(nn.Module):
    def __init__(self, cfg: SamConfig) -> None:
        super().__init__()
        b = cfg.detr_decoder
        c = b.hidden_size
        self.text_mlp = DecoderMLP([c, b.intermediate_size, c])
        self.text_mlp_out_norm = nn.LayerNorm(c)
        self.text_proj = nn.Linear(c, c)
        self.query_proj = nn.Linear(c, c)
        self.scale = 1.0 / math.sqrt(c)

    def forward(self, queries, prompt, prompt_mask):
        t = self.text_mlp_out_norm(self.text_mlp(prompt) + prompt)
        valid = prompt_mask.to(t.dtype)[..., None]
        pooled = (t * valid).sum(1) / valid.sum(1).clamp(min=1.0)
        logits = (self.query_proj(queries) @ self.text_proj(pooled)[..., None]).squeeze(-1)
        return (logits * self.scale).clamp(-SCORE_CLAMP, SCORE_CLAMP)
