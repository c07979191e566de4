"""The reference: transformers' `Sam3Model` loaded from the same checkpoint directory (so with the
same weights), float32, and transformers' CLIP tokenizer on the same files.

The image processor of transformers' Sam3Processor needs torchvision (its resize and box ops);
without torchvision both sides take the pixels sammie prepared (engine/images.py, the same
recipe: bilinear + antialias to S x S, 8-bit rounding, (x / 255 - 0.5) / 0.5), the masks are
post-processed by the reference's recipe (sigmoid, bilinear to the image, > mask threshold)
written out in `masks_at`, and box prompts are skipped: transformers' geometry encoder calls
torchvision's roi_align. With torchvision present (GPU machines) box prompts run too.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F


def torchvision_ops():
    try:
        from torchvision.ops import roi_align  # noqa: F401

        return True
    except Exception:  # noqa: BLE001 - missing, or a CUDA build beside a CPU torch
        return False


class Reference:
    def __init__(self, ckpt: str | Path, device: str = "cpu") -> None:
        from transformers import AutoTokenizer, Sam3Model

        self.device = torch.device(device)
        self.model = Sam3Model.from_pretrained(str(ckpt), dtype=torch.float32).to(
            self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(str(ckpt))
        self.boxes_ok = torchvision_ops()

    def tokens(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.tokenizer(texts, padding="max_length", max_length=32, return_tensors="pt")
        return t["input_ids"], t["attention_mask"].bool()

    @torch.inference_mode()
    def vision(self, pixels: torch.Tensor):
        return self.model.get_vision_features(pixel_values=pixels[None].to(self.device))

    @torch.inference_mode()
    def run(self, vision, ids: torch.Tensor, mask: torch.Tensor, boxes: torch.Tensor | None,
            labels: torch.Tensor | None) -> dict:
        """One prompt: ids / mask [1, 32]; boxes [1, N, 4] cxcywh in [0, 1] or None."""
        kw = {}
        if boxes is not None:
            kw = {"input_boxes": boxes.to(self.device),
                  "input_boxes_labels": labels.to(self.device)}
        out = self.model(vision_embeds=vision, input_ids=ids.to(self.device),
                         attention_mask=mask.long().to(self.device), **kw)
        scores = out.pred_logits.sigmoid() * out.presence_logits.sigmoid()
        return {"scores": scores[0].float().cpu(), "boxes": out.pred_boxes[0].float().cpu(),
                "mask_logits": out.pred_masks[0].float()}


def masks_at(logits: torch.Tensor, height: int, width: int, threshold: float) -> torch.Tensor:
    """The reference's mask recipe: sigmoid, bilinear to the image, > threshold -> bool
    [k, H, W]."""
    if logits.shape[0] == 0:
        return torch.zeros(0, height, width, dtype=torch.bool)
    p = F.interpolate(logits.float().sigmoid()[None], size=(height, width), mode="bilinear",
                      align_corners=False)[0]
    return (p > threshold).cpu()
