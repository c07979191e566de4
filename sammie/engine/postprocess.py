"""One (image, prompt) row's detections -> instances, as transformers'
`post_process_instance_segmentation` makes them: score = sigmoid(logit) x sigmoid(presence),
kept above `threshold`; boxes scaled from [0, 1] to the image's pixels (not clipped, as the
reference); masks = sigmoid(logits) resized bilinearly to the image, then > `mask_threshold`.

Only the kept queries' masks are computed (the reference computes all 200 and drops most),
best score first, at most `max_instances`. Masks leave as COCO RLE (rle.py) or a 1-bit PNG.
The resize and threshold run where the detections are (the GPU when serving there); the RLE
runs on the CPU from the thresholded mask: a GPU RLE (run boundaries found on the device, only
they copied back) is remaining work (docs/sammie.md).

Bounded work: the masks are resized MASK_CHUNK_ELEMENTS pixels at a time (all of a row's kept
queries at once, at 40 MP and 200 queries, asked for 32 GB), and a job whose masks would hold
more than `Options.max_mask_pixels` pixels in all is refused before any is computed
(`MaskBudgetExceeded`): a 23 KB PNG of 16 MP with 16 prompts and threshold 0 held the model
thread 75 s for a 14 MB answer (a helper's attack, sammie-hard).
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sammie.engine import rle
from sammie.model.sam3 import Detections, Sam3


MASK_CHUNK_ELEMENTS = 1 << 26  # float32 pixels resized at once: 256 MB
DEFAULT_MAX_MASK_PIXELS = 1 << 30


class MaskBudgetExceeded(ValueError):
    status = 400
    code = "too_many_mask_pixels"


@dataclass(frozen=True)
class Options:
    threshold: float = 0.3
    mask_threshold: float = 0.5
    mask_format: str = "rle"  # rle | png | none
    max_instances: int = 100
    max_mask_pixels: int = DEFAULT_MAX_MASK_PIXELS  # of all a job's masks (the server's)


def kept(det: Detections, row: int, opt: Options) -> int:
    """How many instances row `row` answers with."""
    return min(int((det.scores[row].float() > opt.threshold).sum()), opt.max_instances)


def check_mask_budget(count: int, width: int, height: int, opt: Options) -> None:
    """MaskBudgetExceeded when `count` masks of width x height pass the job's budget."""
    total = count * width * height
    if opt.mask_format != "none" and total > opt.max_mask_pixels:
        raise MaskBudgetExceeded(
            f"the answer would hold {count} masks of {width} x {height} = {total} pixels; the "
            f"limit is {opt.max_mask_pixels} (--max-mask-pixels): raise 'threshold', lower "
            "'max_instances', send fewer prompts or a smaller image, or ask mask_format 'none'")


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
    step = max(1, MASK_CHUNK_ELEMENTS // (height * width))
    for start in range(0, len(out), step):
        full = F.interpolate(probs[None, start:start + step], size=(height, width),
                             mode="bilinear", align_corners=False)[0] > opt.mask_threshold
        for inst, m in zip(out[start:start + step], full.cpu().numpy()):
            inst["area"] = int(m.sum())
            if opt.mask_format == "rle":
                inst["mask"] = rle.encode(m)
            elif opt.mask_format == "png":
                inst["mask_png"] = png_of(m)
    return out
