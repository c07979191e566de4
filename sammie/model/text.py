"""The text encoder (`text_encoder.*`: CLIP's text tower, causal, pre-norm) and the projection of
its last hidden states to the detector's width (`text_projection`).

A prompt is 32 token ids (BOS, the phrase, EOS, padding); the detector reads every valid
position's features with the padding masked out, not CLIP's pooled EOS token, so
`text_encoder.text_projection` (CLIP's own, to its 512-d joint space) is loaded but unused.
"""

from __future__ import annotations

import torch
from torch import nn

from sammie.config import SamConfig
from sammie.model.attention import MLP, Attention


class TextLayer(nn.Module):
    def __init__(self, cfg: SamConfig) -> None:
        super().__init__()
        c = cfg.text_hidden
        self.self_attn = Attention(c, cfg.text_heads, out_name="out_proj")
        self.layer_norm1 = nn.LayerNorm(c, eps=cfg.text_eps)
        self.mlp = MLP(c, cfg.text_intermediate, cfg.text_act)
        self.layer_norm2 = nn.LayerNorm(c, eps=cfg.text_eps)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        y = self.layer_norm1(x)
        x = x + self.self_attn(y, y, y, key_mask=mask, causal=True)
        return x + self.mlp(self.layer_norm2(x))


class TextEmbeddings(nn.Module):
    def __init__(self, cfg: SamConfig) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(cfg.vocab_size, cfg.text_hidden)
        self.position_embedding = nn.Embedding(cfg.text_len, cfg.text_hidden)


class TextEncoderStack(nn.Module):
    def __init__(self, cfg: SamConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(TextLayer(cfg) for _ in range(cfg.text_layers))


class TextModel(nn.Module):
    def __init__(self, cfg: SamConfig) -> None:
        super().__init__()
        self.embeddings = TextEmbeddings(cfg)
        self.encoder = TextEncoderStack(cfg)
        self.final_layer_norm = nn.LayerNorm(cfg.text_hidden, eps=cfg.text_eps)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        e = self.embeddings
        x = e.token_embedding(ids) + e.position_embedding.weight[: ids.shape[1]]
        for layer in self.encoder.layers:
            x = layer(x, mask)
        return self.final_layer_norm(x)


class TextEncoder(nn.Module):
    def __init__(self, cfg: SamConfig) -> None:
        super().__init__()
        self.text_model = TextModel(cfg)
        self.text_projection = nn.Linear(cfg.text_hidden, cfg.text_projection_dim, bias=False)
