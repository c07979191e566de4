"""SAM 3's image detector, module for module as the checkpoint names it (transformers'
`Sam3Model` state dict: vision_encoder, text_encoder, text_projection, geometry_encoder,
detr_encoder, detr_decoder, mask_decoder, dot_product_scoring).

The forward is split where serving splits it, so each part batches on its own:
  encode_images   pixels [B, 3, S, S] -> FPN levels (once per image)
  encode_text     token ids [T, 32] -> prompt features [T, 32, 256] (cached per prompt string)
  detect          one row per (image, prompt) pair, image levels gathered by index: the
                  optional box prompts, the DETR encoder / decoder, scores, presence, boxes,
                  and the mask and pixel embeddings (`mask_logits` makes a row's masks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from sammie.config import SamConfig
from sammie.model.attention import cxcywh_to_xyxy
from sammie.model.detr import DetrDecoder, DetrEncoder, DotProductScoring
from sammie.model.geometry import GeometryEncoder
from sammie.model.mask import MaskDecoder
from sammie.model.neck import Neck, sine_grid
from sammie.model.text import TextEncoder
from sammie.model.vit import VisionBackbone


class VisionEncoder(nn.Module):
    def __init__(self, cfg: SamConfig) -> None:
        super().__init__()
        self.backbone = VisionBackbone(cfg)
        self.neck = Neck(cfg)


@dataclass
class Detections:
    """The detector's raw output for P (image, prompt) rows."""

    logits: torch.Tensor  # [P, Q] query logits (clamped to +-12)
    presence: torch.Tensor  # [P] presence logits (clamped to +-10)
    boxes: torch.Tensor  # [P, Q, 4] xyxy in [0, 1] of the model's square input
    mask_embed: torch.Tensor  # [P, Q, C]
    pixels: torch.Tensor  # [P, C, H4, W4]

    @property
    def scores(self) -> torch.Tensor:
        return self.logits.sigmoid() * self.presence.sigmoid()[:, None]


class Sam3(nn.Module):
    def __init__(self, cfg: SamConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.vision_encoder = VisionEncoder(cfg)
        self.text_encoder = TextEncoder(cfg)
        self.text_projection = nn.Linear(cfg.text_hidden, cfg.d_model)
        self.geometry_encoder = GeometryEncoder(cfg)
        self.detr_encoder = DetrEncoder(cfg)
        self.detr_decoder = DetrDecoder(cfg)
        self.mask_decoder = MaskDecoder(cfg)
        self.dot_product_scoring = DotProductScoring(cfg)

    def encode_images(self, pixels: torch.Tensor) -> list[torch.Tensor]:
        """Normalised pixels [B, 3, S, S] -> FPN levels [x4, x2, x1], each [B, C, h, w]."""
        return self.vision_encoder.neck(self.vision_encoder.backbone(pixels))

    def encode_text(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Token ids [T, L], mask [T, L] (True = a token) -> prompt features [T, L, C]."""
        return self.text_projection(self.text_encoder.text_model(ids, mask))

    def detect(self, levels: list[torch.Tensor], image_index: torch.Tensor, prompt: torch.Tensor,
               prompt_mask: torch.Tensor, boxes: torch.Tensor | None = None,
               box_labels: torch.Tensor | None = None,
               box_mask: torch.Tensor | None = None) -> Detections:
        """levels: encode_images' output for B images; image_index [P]: each row's image;
        prompt / prompt_mask [P, L, C] / [P, L]: each row's text features; boxes [P, N, 4]
        cxcywh in [0, 1] with box_labels / box_mask [P, N] (rows without boxes: an all-False
        mask row), or None."""
        rows = [lv[image_index] for lv in levels]
        x1 = rows[-1]
        p, c, h, w = x1.shape
        pos = sine_grid(p, c, h, w, x1.device, torch.float32).to(x1.dtype)
        if boxes is not None and bool(box_mask.any()):
            prompt, prompt_mask = self._add_boxes(prompt, prompt_mask, boxes, box_labels,
                                                  box_mask, x1, pos)
        vision = x1.flatten(2).transpose(1, 2)
        vision_pos = pos.flatten(2).transpose(1, 2)
        encoded = self.detr_encoder(vision, vision_pos, prompt, prompt_mask)
        queries, ref, presence = self.detr_decoder(encoded, vision_pos, (h, w), prompt,
                                                   prompt_mask)
        logits = self.dot_product_scoring(queries, prompt, prompt_mask)
        mask_embed, pixels = self.mask_decoder.embed(queries, rows[:-1], encoded, prompt,
                                                     prompt_mask)
        return Detections(logits, presence, cxcywh_to_xyxy(ref), mask_embed, pixels)

    def _add_boxes(self, prompt, prompt_mask, boxes, labels, box_mask, x1, pos):
        """The box tokens of the rows that have boxes appended after the text tokens; rows
        without boxes get masked-out slots, so they attend to exactly what they would alone."""
        has = box_mask.any(dim=1)
        sel = has.nonzero().squeeze(1)
        geo, geo_mask = self.geometry_encoder(boxes[sel], labels[sel], box_mask[sel], x1[sel],
                                              pos[sel])
        p, n1 = prompt.shape[0], geo.shape[1]
        full = prompt.new_zeros(p, n1, prompt.shape[-1])
        full_mask = torch.zeros(p, n1, dtype=torch.bool, device=prompt.device)
        full[sel], full_mask[sel] = geo.to(prompt.dtype), geo_mask
        return torch.cat([prompt, full], 1), torch.cat([prompt_mask, full_mask], 1)

    @staticmethod
    def mask_logits(det: Detections, row: int, queries: torch.Tensor) -> torch.Tensor:
        """Mask logits [k, H4, W4] of some queries of one row."""
        return MaskDecoder.mask_logits(det.mask_embed[row:row + 1, queries],
                                       det.pixels[row:row + 1])[0]
