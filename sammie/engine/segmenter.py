"""The engine: a batch of jobs (a decoded image and its prompts each) through the model.

Per batch: the images through the ViT and the neck together; the prompts' text features from
the cache (one entry per prompt string, LRU, `text_cache_size`) or, for the strings not in it,
through the text encoder together; then one detector row per (image, prompt) pair, all rows in
one call; then each row's instances (postprocess.py). A prompt is a text (default "visual" when
it has only boxes, as Sam3Processor does) and optional boxes: exemplars in image pixels, xyxy,
labelled positive (1) or negative (0).

Seams for the GPU (remaining work, docs/sammie.md): `dtype` bf16 runs every part in bf16 (the
gate decides where FP8 may go); CUDA graphs per batch size would wrap `_vision` (fixed shapes:
[B, 3, 1008, 1008]); decode on the device would hand `pixels` already there.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from sammie.engine.postprocess import MaskBudgetExceeded, Options, check_mask_budget, instances, \
    kept
from sammie.model.sam3 import Sam3
from sammie.tokenizer import PromptTokenizer

DEFAULT_TEXT = "visual"


@dataclass
class Prompt:
    text: str | None = None
    boxes: list[list[float]] = field(default_factory=list)  # xyxy, image pixels
    labels: list[int] = field(default_factory=list)

    @property
    def query(self) -> str:
        return self.text if self.text is not None else DEFAULT_TEXT


@dataclass
class Job:
    pixels: torch.Tensor  # [3, S, S] normalised
    width: int
    height: int
    prompts: list[Prompt]
    options: Options = field(default_factory=Options)


class TextCache:
    """Prompt string -> (features [L, C], mask [L]) on the model's device, least recently used
    dropped first."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.entries: OrderedDict[str, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.hits = self.misses = 0

    def get(self, key: str):
        hit = self.entries.get(key)
        if hit is not None:
            self.entries.move_to_end(key)
            self.hits += 1
        else:
            self.misses += 1
        return hit

    def put(self, key: str, value) -> None:
        if self.size <= 0:
            return
        self.entries[key] = value
        self.entries.move_to_end(key)
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)


class Segmenter:
    def __init__(self, model: Sam3, tokenizer: PromptTokenizer, *, text_cache_size: int = 4096):
        self.model = model
        self.tokenizer = tokenizer
        self.cache = TextCache(text_cache_size)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.batches = 0

    def text_features(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, L, C] features and [T, L] masks of the texts, through the cache."""
        found = {t: v for t in dict.fromkeys(texts) if (v := self.cache.get(t)) is not None}
        todo = [t for t in dict.fromkeys(texts) if t not in found]
        if todo:
            ids, mask = self.tokenizer.encode(todo)
            ids, mask = ids.to(self.device), mask.to(self.device)
            feats = self.model.encode_text(ids, mask)
            for i, t in enumerate(todo):
                found[t] = (feats[i], mask[i])
                self.cache.put(t, found[t])
        return (torch.stack([found[t][0] for t in texts]),
                torch.stack([found[t][1] for t in texts]))

    def _vision(self, pixels: torch.Tensor) -> list[torch.Tensor]:
        return self.model.encode_images(pixels.to(self.device, self.dtype))

    @torch.inference_mode()
    def run(self, jobs: list[Job]) -> list[dict]:
        """Each job's {"results": [{"instances": [...]}, ...] per prompt, "timing_ms"}, or the
        MaskBudgetExceeded of a job whose masks would pass its budget (the batcher fails that
        job alone)."""
        t0 = time.perf_counter()
        levels = self._vision(torch.stack([j.pixels for j in jobs]))
        t1 = time.perf_counter()
        rows = [(i, p) for i, j in enumerate(jobs) for p in j.prompts]
        prompt, prompt_mask = self.text_features([p.query for _, p in rows])
        image_index = torch.tensor([i for i, _ in rows], device=self.device)
        boxes = labels = box_mask = None
        n = max(len(p.boxes) for _, p in rows)
        if n:
            boxes = torch.zeros(len(rows), n, 4, dtype=torch.float32)
            labels = torch.zeros(len(rows), n, dtype=torch.long)
            box_mask = torch.zeros(len(rows), n, dtype=torch.bool)
            for r, (i, p) in enumerate(rows):
                w, h = jobs[i].width, jobs[i].height
                for k, ((x0, y0, x1, y1), lab) in enumerate(zip(p.boxes, p.labels)):
                    boxes[r, k] = torch.tensor([(x0 + x1) / 2 / w, (y0 + y1) / 2 / h,
                                                (x1 - x0) / w, (y1 - y0) / h])
                    labels[r, k], box_mask[r, k] = lab, True
            boxes = boxes.to(self.device, self.dtype)
            labels, box_mask = labels.to(self.device), box_mask.to(self.device)
        det = self.model.detect(levels, image_index, prompt.to(self.dtype), prompt_mask, boxes,
                                labels, box_mask)
        t2 = time.perf_counter()
        out: list = [{"results": []} for _ in jobs]
        for i, j in enumerate(jobs):  # a job over its mask budget fails alone
            try:
                count = sum(kept(det, r, j.options) for r, (k, _) in enumerate(rows) if k == i)
                check_mask_budget(count, j.width, j.height, j.options)
            except MaskBudgetExceeded as e:
                out[i] = e
        for r, (i, p) in enumerate(rows):
            j = jobs[i]
            if isinstance(out[i], dict):
                out[i]["results"].append(
                    {"instances": instances(det, r, j.width, j.height, j.options)})
        t3 = time.perf_counter()
        self.batches += 1
        timing = {"vision_ms": (t1 - t0) * 1e3, "detect_ms": (t2 - t1) * 1e3,
                  "postprocess_ms": (t3 - t2) * 1e3, "batch_images": len(jobs)}
        for o in out:
            if isinstance(o, dict):
                o["timing_ms"] = {k: round(v, 2) if isinstance(v, float) else v
                                  for k, v in timing.items()}
        return out
