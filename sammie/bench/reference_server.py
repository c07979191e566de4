"""The reference server: transformers' Sam3Model + Sam3Processor behind a thin FastAPI app with
sammie's API (`POST /v1/segment`, /health, /v1/models, /version), the way users serve SAM 3
today: one request at a time, each through the processor, the model and the processor's
`post_process_instance_segmentation`, masks to COCO RLE. No batching across requests, no
caching: what `sammie bench` measures sammie against, on the same GPU.

    sammie reference CKPT --port 8101 [--device cuda] [--dtype bfloat16]

Sam3Processor's image processor needs torchvision. Without it (this repository's CPU
machines) the server says so at start and in /version ("processor": "fallback"): the image
goes through sammie's decode, the text through transformers' tokenizer, the masks through the
reference's recipe (gate/reference.py) - enough to test the server, not to time it.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import torch
from fastapi import FastAPI, Request

from tailored.server.errors import OpenAIError
from tailored.server.http_io import error_response

log = logging.getLogger("sammie.reference")


class ReferencePredictor:
    def __init__(self, ckpt: str, device: str = "cpu", dtype: str = "float32") -> None:
        from transformers import Sam3Model

        self.device = torch.device(device)
        self.model = Sam3Model.from_pretrained(ckpt, dtype=getattr(torch, dtype)).to(
            self.device).eval()
        self.lock = threading.Lock()
        try:
            from transformers import Sam3Processor

            self.processor = Sam3Processor.from_pretrained(ckpt)
            self.mode = "transformers"
        except Exception as e:  # noqa: BLE001 - no torchvision (ImportError, or a broken one)
            from transformers import AutoTokenizer

            from sammie.checkpoint import ImageSettings
            from sammie.config import SamConfig

            self.processor = None
            self.tokenizer = AutoTokenizer.from_pretrained(ckpt)
            self.images = ImageSettings.from_dir(ckpt, SamConfig.from_dir(ckpt))
            self.mode = "fallback"
            log.warning("Sam3Processor unavailable (%s): fallback preprocessing; numbers from "
                        "this server are not the reference's speed", e)

    @torch.inference_mode()
    def predict(self, image_bytes: bytes, texts: list[str], threshold: float,
                mask_threshold: float) -> tuple[list[list[dict]], int, int]:
        from sammie.engine import rle

        with self.lock:
            if self.processor is not None:
                import io

                from PIL import Image

                img = Image.open(io.BytesIO(image_bytes)).convert("RGB")
                w, h = img.size
                inputs = self.processor(images=[img] * len(texts), text=texts,
                                        return_tensors="pt").to(self.device)
                out = self.model(**inputs)
                res = self.processor.post_process_instance_segmentation(
                    out, threshold=threshold, mask_threshold=mask_threshold,
                    target_sizes=[(h, w)] * len(texts))
            else:
                res, w, h = self._fallback(image_bytes, texts, threshold, mask_threshold)
        answers = []
        for r in res:
            masks = r["masks"].bool().cpu().numpy()
            answers.append([{"score": float(s), "box": [round(v, 2) for v in b],
                             "area": int(m.sum()), "mask": rle.encode(m)}
                            for s, b, m in zip(r["scores"].tolist(), r["boxes"].tolist(), masks)])
        return answers, w, h

    def _fallback(self, image_bytes, texts, threshold, mask_threshold):
        from sammie.engine.images import decode
        from sammie.gate.reference import masks_at

        s = self.images
        img = decode(image_bytes, s.size, s.mean, s.std, rescale=s.rescale)
        t = self.tokenizer(texts, padding="max_length", max_length=32, return_tensors="pt")
        px = img.pixels[None].expand(len(texts), -1, -1, -1).to(self.device,
                                                                 self.model.dtype)
        out = self.model(pixel_values=px, input_ids=t["input_ids"].to(self.device),
                         attention_mask=t["attention_mask"].to(self.device))
        scores = out.pred_logits.sigmoid() * out.presence_logits.sigmoid()
        scale = torch.tensor([img.width, img.height] * 2, device=scores.device)
        res = []
        for i in range(len(texts)):
            keep = scores[i] > threshold
            res.append({"scores": scores[i][keep], "boxes": out.pred_boxes[i][keep] * scale,
                        "masks": masks_at(out.pred_masks[i][keep], img.height, img.width,
                                          mask_threshold)})
        return res, img.width, img.height


def build_reference_app(predictor: ReferencePredictor, model_name: str = "sam3-reference"):
    from sammie.server.intake import read_fields
    from sammie.server.requests import parse

    app = FastAPI(title="sam3 reference", docs_url=None, redoc_url=None)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model"}]}

    @app.get("/version")
    async def version():
        import transformers

        return {"server": "sam3-reference", "transformers": transformers.__version__,
                "processor": predictor.mode, "device": str(predictor.device)}

    @app.post("/v1/segment")
    async def segment(request: Request):
        try:
            fields, image = await read_fields(request, 64 * 2**20, timeout_s=600)
            req = parse(fields, image, max_prompts=64, max_boxes=0, count_tokens=lambda t: 1)
            if any(p.boxes for p in req.prompts):
                raise OpenAIError("the reference server takes text prompts only")
            texts = [p.query for p in req.prompts]
            answers, w, h = await asyncio.to_thread(
                predictor.predict, req.image, texts, req.options.threshold,
                req.options.mask_threshold)
        except OpenAIError as e:
            return error_response(e)
        return {"model": model_name, "image": {"width": w, "height": h},
                "results": [{"prompt": {"text": t}, "instances": a}
                            for t, a in zip(texts, answers)]}

    return app
