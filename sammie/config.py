"""The model's configuration: config.json in transformers' `Sam3Config` layout.

A checkpoint's config.json is either a `sam3` config (what transformers' conversion script
writes: vision_config with its backbone_config, text_config, geometry_encoder_config,
detr_encoder_config, detr_decoder_config, mask_decoder_config) or a `sam3_video` config whose
`detector_config` is one. Missing keys take transformers' defaults, which are the published
model's sizes: `FULL` below. `TINY` keeps every structural ratio of the full model (3 x 3
windows of the patch grid, position embeddings tiled 3 x 3, a global block after each group of
windowed ones, 4 FPN scales) at a width the CPU runs in milliseconds.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

VIT_DEFAULTS = {
    "hidden_size": 1024, "intermediate_size": 4736, "num_hidden_layers": 32,
    "num_attention_heads": 16, "num_channels": 3, "image_size": 1008, "patch_size": 14,
    "hidden_act": "gelu", "layer_norm_eps": 1e-6, "window_size": 24,
    "global_attn_indexes": [7, 15, 23, 31], "pretrain_image_size": 336,
    "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0},
}
VISION_DEFAULTS = {
    "fpn_hidden_size": 256, "backbone_feature_sizes": [[288, 288], [144, 144], [72, 72]],
    "scale_factors": [4.0, 2.0, 1.0, 0.5],
}
TEXT_DEFAULTS = {  # the CLIP text tower transformers' Sam3Config builds when none is given
    "model_type": "clip_text_model", "vocab_size": 49408, "hidden_size": 1024,
    "intermediate_size": 4096, "projection_dim": 512, "num_hidden_layers": 24,
    "num_attention_heads": 16, "max_position_embeddings": 32, "hidden_act": "gelu",
    "layer_norm_eps": 1e-5, "bos_token_id": 49406, "eos_token_id": 49407, "pad_token_id": 1,
}
BLOCK_DEFAULTS = {"hidden_size": 256, "num_attention_heads": 8, "intermediate_size": 2048,
                  "hidden_act": "relu"}
GEOMETRY_DEFAULTS = {**BLOCK_DEFAULTS, "num_layers": 3, "roi_size": 7}
DETR_ENCODER_DEFAULTS = {**BLOCK_DEFAULTS, "num_layers": 6}
DETR_DECODER_DEFAULTS = {**BLOCK_DEFAULTS, "num_layers": 6, "num_queries": 200}
MASK_DECODER_DEFAULTS = {"hidden_size": 256, "num_upsampling_stages": 3, "num_attention_heads": 8}

FULL = {
    "architectures": ["Sam3Model"], "model_type": "sam3",
    "vision_config": {"model_type": "sam3_vision_model",
                      "backbone_config": {"model_type": "sam3_vit_model", **VIT_DEFAULTS},
                      **VISION_DEFAULTS},
    "text_config": dict(TEXT_DEFAULTS),
    "geometry_encoder_config": {"model_type": "sam3_geometry_encoder", **GEOMETRY_DEFAULTS},
    "detr_encoder_config": {"model_type": "sam3_detr_encoder", **DETR_ENCODER_DEFAULTS},
    "detr_decoder_config": {"model_type": "sam3_detr_decoder", **DETR_DECODER_DEFAULTS},
    "mask_decoder_config": {"model_type": "sam3_mask_decoder", **MASK_DECODER_DEFAULTS},
}


def _tiny() -> dict:
    c = copy.deepcopy(FULL)
    # 12 x 12 patches in 3 x 3 windows of 4 (full: 72 x 72 in 3 x 3 of 24); position
    # embeddings of 4 x 4 tiled 3 x 3 (full: 24 x 24); a global block ends each half
    c["vision_config"]["backbone_config"].update(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        image_size=168, window_size=4, global_attn_indexes=[1, 3], pretrain_image_size=56)
    c["vision_config"].update(fpn_hidden_size=32,
                              backbone_feature_sizes=[[48, 48], [24, 24], [12, 12]])
    c["text_config"].update(hidden_size=64, intermediate_size=128, projection_dim=32,
                            num_hidden_layers=2, num_attention_heads=4)
    for key, layers in (("geometry_encoder_config", 1), ("detr_encoder_config", 2),
                        ("detr_decoder_config", 2)):
        c[key].update(hidden_size=32, num_attention_heads=4, intermediate_size=64,
                      num_layers=layers)
    c["detr_decoder_config"]["num_queries"] = 20
    c["mask_decoder_config"].update(hidden_size=32, num_attention_heads=4)
    return c


TINY = _tiny()
PRESETS = {"tiny": TINY, "full": FULL}


@dataclass(frozen=True)
class Block:
    """A DETR-style block stack's sizes (geometry encoder, DETR encoder / decoder, mask
    decoder)."""

    hidden_size: int
    num_heads: int
    intermediate_size: int = 0
    num_layers: int = 0
    extra: int = 0  # roi_size (geometry), num_queries (decoder), upsampling stages (mask)


@dataclass(frozen=True)
class SamConfig:
    raw: dict  # the detector's config.json dict, as read
    # ViT
    vit_hidden: int
    vit_intermediate: int
    vit_layers: int
    vit_heads: int
    image_size: int
    patch_size: int
    window_size: int
    global_layers: tuple[int, ...]
    pretrain_image_size: int
    vit_eps: float
    rope_theta: float
    fpn_hidden: int
    scale_factors: tuple[float, ...]
    # text
    vocab_size: int
    text_hidden: int
    text_intermediate: int
    text_layers: int
    text_heads: int
    text_projection_dim: int
    text_len: int
    text_act: str
    text_eps: float
    bos_token_id: int
    eos_token_id: int
    # detector
    geometry: Block
    detr_encoder: Block
    detr_decoder: Block
    mask_decoder: Block

    @property
    def grid(self) -> int:
        """Patches per side (72 at full size)."""
        return self.image_size // self.patch_size

    @property
    def d_model(self) -> int:
        return self.detr_encoder.hidden_size

    @property
    def num_queries(self) -> int:
        return self.detr_decoder.extra

    @property
    def mask_size(self) -> int:
        """Side of the predicted mask logits (288 at full size: the 4x FPN level)."""
        return int(self.grid * max(self.scale_factors))

    @classmethod
    def from_dict(cls, d: dict) -> "SamConfig":
        if d.get("model_type") == "sam3_video" or "detector_config" in d:
            d = d["detector_config"]
        vis = {**VISION_DEFAULTS, **d.get("vision_config", {})}
        vit = {**VIT_DEFAULTS, **vis.get("backbone_config", {})}
        txt = {**TEXT_DEFAULTS, **d.get("text_config", {})}
        geo = {**GEOMETRY_DEFAULTS, **d.get("geometry_encoder_config", {})}
        enc = {**DETR_ENCODER_DEFAULTS, **d.get("detr_encoder_config", {})}
        dec = {**DETR_DECODER_DEFAULTS, **d.get("detr_decoder_config", {})}
        msk = {**MASK_DECODER_DEFAULTS, **d.get("mask_decoder_config", {})}
        for name, act in (("vision", vit["hidden_act"]), ("text", txt["hidden_act"])):
            if act not in ("gelu", "quick_gelu"):
                raise ValueError(f"config.json: unsupported {name} hidden_act {act!r}")
        if not isinstance(vit["image_size"], int) or not isinstance(vit["patch_size"], int):
            raise ValueError("config.json: image_size and patch_size must be single integers")
        return cls(
            raw=d, vit_hidden=vit["hidden_size"], vit_intermediate=vit["intermediate_size"],
            vit_layers=vit["num_hidden_layers"], vit_heads=vit["num_attention_heads"],
            image_size=vit["image_size"], patch_size=vit["patch_size"],
            window_size=vit["window_size"], global_layers=tuple(vit["global_attn_indexes"]),
            pretrain_image_size=vit["pretrain_image_size"], vit_eps=vit["layer_norm_eps"],
            rope_theta=float((vit.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            fpn_hidden=vis["fpn_hidden_size"], scale_factors=tuple(vis["scale_factors"]),
            vocab_size=txt["vocab_size"], text_hidden=txt["hidden_size"],
            text_intermediate=txt["intermediate_size"], text_layers=txt["num_hidden_layers"],
            text_heads=txt["num_attention_heads"], text_projection_dim=txt["projection_dim"],
            text_len=txt["max_position_embeddings"], text_act=txt["hidden_act"],
            text_eps=txt["layer_norm_eps"], bos_token_id=txt["bos_token_id"],
            eos_token_id=txt["eos_token_id"],
            geometry=Block(geo["hidden_size"], geo["num_attention_heads"],
                           geo["intermediate_size"], geo["num_layers"], geo["roi_size"]),
            detr_encoder=Block(enc["hidden_size"], enc["num_attention_heads"],
                               enc["intermediate_size"], enc["num_layers"]),
            detr_decoder=Block(dec["hidden_size"], dec["num_attention_heads"],
                               dec["intermediate_size"], dec["num_layers"], dec["num_queries"]),
            mask_decoder=Block(msk["hidden_size"], msk["num_attention_heads"],
                               extra=msk["num_upsampling_stages"]),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "SamConfig":
        p = Path(path) / "config.json"
        try:
            return cls.from_dict(json.loads(p.read_text()))
        except FileNotFoundError:
            raise ValueError(f"{path}: no config.json (not a SAM 3 checkpoint directory)") \
                from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}: not valid JSON ({e})") from None

    @classmethod
    def preset(cls, name: str) -> "SamConfig":
        return cls.from_dict(copy.deepcopy(PRESETS[name]))
