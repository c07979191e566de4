"""The detector's attention and MLP blocks (checkpoint names q_proj / k_proj / v_proj / o_proj,
fc1 / fc2), on torch's fused scaled_dot_product_attention.

Masks: `key_mask` [B, K] bool (True = a real key) becomes a [B, 1, 1, K] boolean mask; `bias`
is an additive float [B, heads, Q, K] (the decoder's box relative-position bias).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def activation(name: str):
    if name == "gelu":
        return F.gelu
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    if name == "relu":
        return F.relu
    raise ValueError(f"unsupported activation {name!r}")


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, intermediate)
        self.fc2 = nn.Linear(intermediate, hidden)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, out_name: str = "o_proj") -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = hidden // heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        setattr(self, out_name, nn.Linear(hidden, hidden))  # CLIP calls it out_proj
        self._out = out_name

    def split(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        return x.view(b, n, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                key_mask: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                causal: bool = False) -> torch.Tensor:
        b, n, c = q.shape
        mask = None
        if key_mask is not None:
            mask = key_mask[:, None, None, :]
            if causal:
                keep = torch.ones(n, k.shape[1], dtype=torch.bool, device=q.device).tril()
                mask = mask & keep
        elif causal:
            mask = torch.ones(n, k.shape[1], dtype=torch.bool, device=q.device).tril()
        if bias is not None:
            bias = bias.to(q.dtype)
            mask = bias if mask is None else bias.masked_fill(~mask, float("-inf"))
        out = F.scaled_dot_product_attention(self.split(self.q_proj(q)), self.split(self.k_proj(k)),
                                             self.split(self.v_proj(v)), attn_mask=mask)
        return getattr(self, self._out)(out.transpose(1, 2).reshape(b, n, c))


class CrossBlock(nn.Module):
    """The checkpoint's pre-norm layer of self-attention, cross-attention and a ReLU MLP, each
    after its own LayerNorm (the DETR encoder's and the geometry encoder's layers: the same
    tensors, their own forward)."""

    def __init__(self, b) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(b.hidden_size)
        self.self_attn = Attention(b.hidden_size, b.num_heads)
        self.cross_attn = Attention(b.hidden_size, b.num_heads)
        self.layer_norm2 = nn.LayerNorm(b.hidden_size)
        self.mlp = MLP(b.hidden_size, b.intermediate_size, "relu")
        self.layer_norm3 = nn.LayerNorm(b.hidden_size)


class DecoderMLP(nn.Module):
    """layer1 / layer2 [/ layer3] with ReLU between (box head, presence head, RPB embeds)."""

    def __init__(self, dims: list[int]) -> None:
        super().__init__()
        self.n = len(dims) - 1
        for i in range(self.n):
            setattr(self, f"layer{i + 1}", nn.Linear(dims[i], dims[i + 1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(self.n):
            x = getattr(self, f"layer{i + 1}")(x)
            if i < self.n - 1:
                x = F.relu(x)
        return x


def inverse_sigmoid(x: torch.Tensor, eps: float = 1e-3) -> torch.Tensor:
    x = x.clamp(0, 1)
    return torch.log(x.clamp(min=eps) / (1 - x).clamp(min=eps))


def cxcywh_to_xyxy(b: torch.Tensor) -> torch.Tensor:
    cx, cy, w, h = b.unbind(-1)
    return torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], -1)
