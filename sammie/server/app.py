"""Sammie's HTTP API (FastAPI):

    POST /v1/segment   an image and prompts -> instances (score, box, mask) per prompt
    GET  /health       200 {"status": "ok"} while the batcher runs, else 503
    GET  /v1/models    the served model, as an OpenAI-style list (load tools read it)
    GET  /version      package version, model, batching settings, switches (bench manifests)
    GET  /metrics      requests, images, batches, text-cache hits (Prometheus text)

Errors are tailored's JSON shape `{"error": {"message", "type", "param", "code"}}`: 400 bad
field, empty prompt, URL given as image, corrupt image, box outside the image, masks over
--max-mask-pixels; 401 key; 403 cross-site; 404 route; 408 body not in --body-timeout; 413 body
over --max-body-bytes or image over --max-image-pixels; 415 content type or image format; 500
model failure; 503 batcher down. Bodies: server/intake.py (bytes -> fields), server/requests.py
(fields -> a validated request). Images decode on --decode-workers threads, no more at once
(each may hold ~0.3 GB for a 40 MP image that was a 35 KB PNG).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tailored.server.errors import OpenAIError
from tailored.server.guard import AccessPolicy
from tailored.server.http_io import error_response, internal_error

from sammie import flags
from sammie.engine.batcher import Batcher
from sammie.engine.images import DEFAULT_MAX_PIXELS, ImageError, decode
from sammie.engine.postprocess import DEFAULT_MAX_MASK_PIXELS, MaskBudgetExceeded
from sammie.engine.segmenter import Job, Segmenter
from sammie.server.guard import SammieGuard
from sammie.server.intake import read_fields
from sammie.server.requests import fit_boxes, parse

logger = logging.getLogger("sammie")
DEFAULT_MAX_BODY_BYTES = 32 * 2**20


@dataclass
class ServeSettings:
    model_name: str = "sam3"
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_image_pixels: int = DEFAULT_MAX_PIXELS
    max_prompts: int = 16
    max_boxes: int = 16
    max_batch: int = 4
    max_wait_ms: float = 5.0
    max_mask_pixels: int = DEFAULT_MAX_MASK_PIXELS
    body_timeout_s: float = 60.0
    decode_workers: int = 4
    info: dict = field(default_factory=dict)  # what /version says about the model


@dataclass
class Counters:
    requests: int = 0
    images: int = 0
    errors: int = 0


def build_app(segmenter: Segmenter, image_settings, settings: ServeSettings,
              access: AccessPolicy | None = None) -> FastAPI:
    batcher = Batcher(segmenter.run, max_batch=settings.max_batch,
                      max_wait_ms=settings.max_wait_ms)
    counters = Counters()
    decoder = ThreadPoolExecutor(max_workers=settings.decode_workers,
                                 thread_name_prefix="sammie-decode")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        batcher.start()
        try:
            yield
        finally:
            await batcher.stop()
            decoder.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="sammie", lifespan=lifespan, docs_url=None, redoc_url=None,
                  redirect_slashes=False)
    app.state.batcher, app.state.segmenter = batcher, segmenter
    app.add_middleware(SammieGuard, policy=access or AccessPolicy())

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        msg = (f"route {request.method} {request.url.path} not found" if exc.status_code == 404
               else f"method {request.method} not allowed for {request.url.path}"
               if exc.status_code == 405 else str(exc.detail))
        return error_response(OpenAIError(msg, status=exc.status_code, code=code))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(internal_error(exc))

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if batcher.healthy:
            return {"status": "ok"}
        return JSONResponse({"status": "error", "message": "batcher not running"}, 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model",
                                            "owned_by": "sammie", **settings.info}]}

    @app.get("/version")
    async def version():
        return {"version": _package_version(), "server": "sammie", "model": settings.info,
                "batching": {"max_batch": settings.max_batch,
                             "max_wait_ms": settings.max_wait_ms},
                "switches": flags.current().snapshot()}

    @app.get("/metrics")
    async def metrics():
        c = segmenter.cache
        sizes = batcher.batch_sizes
        lines = [f"sammie_requests_total {counters.requests}",
                 f"sammie_images_total {counters.images}",
                 f"sammie_request_errors_total {counters.errors}",
                 f"sammie_batches_total {segmenter.batches}",
                 f"sammie_batch_images_mean {sum(sizes) / len(sizes) if sizes else 0:.3f}",
                 f"sammie_queue_waiting {batcher.waiting}",
                 f"sammie_text_cache_hits_total {c.hits}",
                 f"sammie_text_cache_misses_total {c.misses}",
                 f"sammie_text_cache_entries {len(c.entries)}"]
        return PlainTextResponse("\n".join(lines) + "\n")

    async def read_request(request: Request):
        fields, image = await read_fields(request, settings.max_body_bytes,
                                          settings.body_timeout_s)
        return parse(fields, image, max_prompts=settings.max_prompts,
                     max_boxes=settings.max_boxes, count_tokens=segmenter.tokenizer.count)

    @app.post("/v1/segment")
    async def segment(request: Request):
        t0 = time.perf_counter()
        counters.requests += 1
        try:
            req = await read_request(request)
            try:
                img = await asyncio.get_running_loop().run_in_executor(decoder, functools.partial(
                    decode, req.image, image_settings.size, image_settings.mean,
                    image_settings.std, max_pixels=settings.max_image_pixels,
                    rescale=image_settings.rescale))
            except ImageError as e:
                raise OpenAIError(str(e), status=e.status, param="image", code=e.code) from None
            req.prompts = fit_boxes(req.prompts, img.width, img.height)
            if not batcher.healthy:
                raise OpenAIError("the model is not running", status=503,
                                  type="service_unavailable")
            t1 = time.perf_counter()
            options = replace(req.options, max_mask_pixels=settings.max_mask_pixels)
            try:
                out = await batcher.submit(Job(img.pixels, img.width, img.height, req.prompts,
                                               options))
            except MaskBudgetExceeded as e:
                raise OpenAIError(str(e), status=e.status, param="max_instances",
                                  code=e.code) from None
        except OpenAIError as e:
            counters.errors += 1
            return error_response(e)
        counters.images += 1
        results = [{"prompt": _echo(p), **r} for p, r in zip(req.prompts, out["results"])]
        timing = {**out["timing_ms"], "decode_ms": round((t1 - t0) * 1e3, 2),
                  "total_ms": round((time.perf_counter() - t0) * 1e3, 2)}
        return {"model": settings.model_name,
                "image": {"width": img.width, "height": img.height, "format": img.format},
                "results": results, "timing_ms": timing}

    return app


def _echo(p) -> dict:
    d: dict = {"text": p.query}
    if p.boxes:
        d["boxes"], d["labels"] = p.boxes, p.labels
    return d


def _package_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("tailored")
    except metadata.PackageNotFoundError:
        return "unknown"
