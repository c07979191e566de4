"""One (image, prompt) row's detections -> instances, as transformers'
`post_process_instance_segmentation` makes them: score = sigmoid(logit) x sigmoid(presence),
kept above `threshold`; boxes scaled from [0, 1] to the image's pixels (not clipped, as the
reference); masks = sigmoid(logits) resized bilinearly to the image, then > `mask_threshold`.

Only the kept queries' masks are computed (the reference computes all 200 and drops most),
best score first, at most `max_instances`. Masks leave as COCO RLE (rle.py) or a 1-bit PNG.
The resize and threshold run where the detections are (the GPU when serving there); the RLE
runs on the CPU from the thresholded mask: a GPU RLE (run boundaries found on the device, only
they copied back) is remaining work (docs/sammie.md).
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sammie.engine import rle
from sammie.model.sam3 import Detections, Sam3


@dataclass(frozen=True)
class Options:
    threshold: float = 0.3
    mask_threshold: float = 0.5
    mask_format: str = "rle"  # rle | png | none
    max_instances: int = 100


def png_of(mask) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(mask).save(buf, format="PNG", optimize=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def instances(det: Detections, row: int, width: int, height: int, opt: Options) -> list[dict]:
    scores = det.scores[row].float()
    keep = (scores > opt.threshold).nonzero().squeeze(1)
    keep = keep[scores[keep].argsort(descending=True)][: opt.max_instances]
    if keep.numel() == 0:
        return []
    scale = torch.tensor([width, height, width, height], dtype=torch.float32,
                         device=scores.device)
    boxes = (det.boxes[row, keep].float() * scale).tolist()
    out = [{"score": float(s), "box": [round(v, 2) for v in b]}
           for s, b in zip(scores[keep].tolist(), boxes)]
    if opt.mask_format == "none":
        return out
    probs = Sam3.mask_logits(det, row, keep).float().sigmoid()
    full = F.interpolate(probs[None], size=(height, width), mode="bilinear",
                         align_corners=False)[0] > opt.mask_threshold
    masks = full.cpu().numpy()
    for inst, m in zip(out, masks):
        inst["area"] = int(m.sum())
        if opt.mask_format == "rle":
            inst["mask"] = rle.encode(m)
        elif opt.mask_format == "png":
            inst["mask_png"] = png_of(m)
    return out
