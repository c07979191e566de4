"""Synthetic SAM 3 checkpoints: the official layout (what transformers' SAM 3 conversion writes),
random values.

`sammie synth OUT --preset {tiny,full}` writes config.json (a `sam3` config, Sam3Model),
model.safetensors (float32, every tensor of transformers' Sam3Model state dict under its name),
preprocessor_config.json and processor_config.json (Sam3Processor's), and the CLIP tokenizer
files (tokenizer.py). transformers' Sam3Model.from_pretrained and Sam3Processor load it.

Statistics (`init_weights`), chosen so that every part of the network moves the output (at
std 0.02 everywhere the ViT and the text encoder barely reach the scores) and the outputs look
like a detector's: linear and conv weights N(0, g^2 / fan_in) with g = 1, residual output
projections g = 1 / sqrt(2 x layers), so 32 ViT blocks stay well-conditioned; norm weights
1 + N(0, 0.05^2); biases N(0, 0.02^2); embeddings N(0, 1); reference boxes centred anywhere
with sizes around sigmoid(-1.5) ~ 0.18; presence bias +1; the scoring projections biased
along one direction so that query logits on any input are about N(-3, 2^2): a handful of the
200 queries pass the 0.3 score threshold, as with a real model on an image holding the concept.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn

from sammie.config import PRESETS, SamConfig
from sammie.model.sam3 import Sam3
from sammie.tokenizer import MAX_TOKENS, write_synthetic_tokenizer

IMAGE_MEAN = [0.5, 0.5, 0.5]
IMAGE_STD = [0.5, 0.5, 0.5]

RESIDUAL_OUT = ("attention.o_proj", "mlp.fc2", "self_attn.out_proj", "self_attn.o_proj",
                "cross_attn.o_proj")


def _normal(t: torch.Tensor, std: float, g: torch.Generator, mean: float = 0.0) -> None:
    t.copy_(torch.randn(t.shape, generator=g) * std + mean)


def _depth(cfg: SamConfig, name: str) -> int:
    for prefix, n in (("vision_encoder", cfg.vit_layers), ("text_encoder", cfg.text_layers),
                      ("geometry_encoder", cfg.geometry.num_layers),
                      ("detr_encoder", cfg.detr_encoder.num_layers),
                      ("detr_decoder", cfg.detr_decoder.num_layers)):
        if name.startswith(prefix):
            return max(n, 1)
    return 1


@torch.no_grad()
def init_weights(model: Sam3, seed: int = 0) -> None:
    """Fill every parameter of `model` (on the CPU) with the module docstring's statistics."""
    cfg = model.cfg
    g = torch.Generator().manual_seed(seed)
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.LayerNorm, nn.GroupNorm)):
            _normal(mod.weight, 0.05, g, 1.0)
            _normal(mod.bias, 0.02, g)
        elif isinstance(mod, (nn.Linear, nn.Conv2d, nn.ConvTranspose2d)):
            w = mod.weight
            fan_in = w.shape[0] if isinstance(mod, nn.ConvTranspose2d) else w[0].numel()
            gain = 1.0 / math.sqrt(2 * _depth(cfg, name)) if name.endswith(RESIDUAL_OUT) else 1.0
            _normal(w, gain / math.sqrt(fan_in), g)
            if mod.bias is not None:
                _normal(mod.bias, 0.02, g)
        elif isinstance(mod, nn.Embedding):
            _normal(mod.weight, 1.0, g)
    _normal(model.vision_encoder.backbone.embeddings.position_embeddings, 0.5, g)
    ref = model.detr_decoder.reference_points.weight
    _normal(ref[:, :2], 1.0, g)
    _normal(ref[:, 2:], 0.5, g, -1.5)
    model.detr_decoder.presence_head.layer3.bias.fill_(1.0)
    # query logits ~ N(-3, 2^2): the text side is mostly a fixed direction u of norm sqrt(c),
    # the query side has per-component std 2 and a bias of -3 along u
    s = model.dot_product_scoring
    c = s.query_proj.weight.shape[0]
    u = torch.randn(c, generator=g)
    u /= u.norm()
    s.text_proj.weight.mul_(0.5)
    s.text_proj.bias.copy_(u * math.sqrt(c))
    s.query_proj.weight.mul_(2.0)
    s.query_proj.bias.copy_(-3.0 * u)


def preprocessor_config(cfg: SamConfig) -> dict:
    return {"image_processor_type": "Sam3ImageProcessor", "processor_class": "Sam3Processor",
            "do_resize": True, "size": {"height": cfg.image_size, "width": cfg.image_size},
            "resample": 2, "do_rescale": True, "rescale_factor": 1 / 255,
            "do_normalize": True, "image_mean": IMAGE_MEAN, "image_std": IMAGE_STD,
            "do_convert_rgb": True,
            "mask_size": {"height": cfg.mask_size, "width": cfg.mask_size}}


def write_synthetic_checkpoint(out: str | Path, preset: str = "tiny", seed: int = 0) -> Path:
    """Write a synthetic checkpoint of `preset` (tiny | full) to `out`; returns its path."""
    from safetensors.torch import save_file

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    raw = json.loads(json.dumps(PRESETS[preset]))
    cfg = SamConfig.from_dict(raw)
    model = Sam3(cfg)
    init_weights(model, seed)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**raw, "dtype": "float32"}, indent=1))
    (out / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(cfg), indent=1))
    (out / "processor_config.json").write_text(json.dumps(
        {"processor_class": "Sam3Processor", "target_size": cfg.image_size,
         "point_pad_value": -10}, indent=1))
    write_synthetic_tokenizer(out)
    (out / "sammie_synthetic.json").write_text(json.dumps(
        {"preset": preset, "seed": seed, "text_len": MAX_TOKENS,
         "note": "random weights in the official layout (sammie synth); not a trained model"},
        indent=1))
    return out
