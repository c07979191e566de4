"""The load client of `sammie bench`: images/s and latency at each concurrency, against any
server with sammie's `POST /v1/segment` (sammie itself, or the reference server).

A run at concurrency c: `warmups` requests, then `num_requests` sent by c workers, each sending
its next request when its last one answered (closed loop). Each request is one image (JPEG,
`size` x `size`, drawn by gate/cases.py's `draw`, a few distinct images cycled) with
`prompts_per_image` text prompts, sent as JSON (base64) or multipart. Per run: images/s
(answered requests / duration), latency mean / p50 / p90 / p99 in ms, errors by message.
Statistics and the HTTP client are tailored's (tailored/bench/loadgen.py).
"""

from __future__ import annotations

import asyncio
import base64
import io
import time
from dataclasses import asdict, dataclass

from tailored.bench.loadgen import describe, make_client

from sammie.gate.cases import draw

PROMPTS = ("red circle", "blue square", "every shape", "yellow triangle", "green ring",
           "purple shape", "black square", "white circle")


@dataclass
class Workload:
    base_url: str
    concurrency: int = 1
    num_requests: int = 32
    warmups: int = 4
    size: int = 1008
    prompts_per_image: int = 1
    distinct_images: int = 8
    multipart: bool = False
    mask_format: str = "rle"
    timeout_s: float = 600.0
    api_key: str | None = None


def images(w: Workload) -> list[bytes]:
    from PIL import Image

    out = []
    for i in range(w.distinct_images):
        png, _ = draw(w.size, w.size, 100 + i, 10)
        buf = io.BytesIO()
        Image.open(io.BytesIO(png)).convert("RGB").save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def request_kwargs(w: Workload, image: bytes, i: int) -> dict:
    prompts = [PROMPTS[(i + k) % len(PROMPTS)] for k in range(w.prompts_per_image)]
    headers = {"Authorization": f"Bearer {w.api_key}"} if w.api_key else {}
    if w.multipart:
        return {"files": {"image": ("image.jpg", image, "image/jpeg")},
                "data": {"prompt": prompts, "mask_format": w.mask_format}, "headers": headers}
    return {"json": {"image": base64.b64encode(image).decode("ascii"), "prompts": prompts,
                     "mask_format": w.mask_format}, "headers": headers}


async def _one(client, url: str, kw: dict) -> tuple[float, str | None, int]:
    t = time.perf_counter()
    try:
        r = await client.post(url, **kw)
        if r.status_code != 200:
            return time.perf_counter() - t, f"HTTP {r.status_code}: {r.text[:120]}", 0
        n = sum(len(x["instances"]) for x in r.json()["results"])
        return time.perf_counter() - t, None, n
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not raised
        return time.perf_counter() - t, f"{type(e).__name__}: {e}", 0


async def run_once(w: Workload, imgs: list[bytes]) -> dict:
    url = w.base_url.rstrip("/") + "/v1/segment"
    async with make_client(w.concurrency, w.timeout_s) as client:
        async def pool(n: int, offset: int):
            it = iter(range(n))
            out: list = [None] * n

            async def worker():
                for i in it:
                    k = offset + i
                    out[i] = await _one(client, url, request_kwargs(w, imgs[k % len(imgs)], k))

            await asyncio.gather(*(worker() for _ in range(max(1, min(w.concurrency, n)))))
            return out

        if w.warmups:
            warm = await pool(w.warmups, 10_000)
            bad = [e for _, e, _ in warm if e]
            if bad:
                raise RuntimeError(f"warm-up request failed: {bad[0]}")
        t0 = time.perf_counter()
        res = await pool(w.num_requests, 0)
        duration = time.perf_counter() - t0
    ok = [r for r in res if r[1] is None]
    errors: dict[str, int] = {}
    for _, e, _ in res:
        if e:
            errors[e] = errors.get(e, 0) + 1
    run = {"concurrency": w.concurrency, "requests": len(res), "completed": len(ok),
           "failed": len(res) - len(ok), "duration_s": duration,
           "images_per_s": len(ok) / duration if duration > 0 else float("nan"),
           "instances_per_image": sum(r[2] for r in ok) / len(ok) if ok else 0.0,
           "errors": [{"error": k, "count": v} for k, v in list(errors.items())[:10]]}
    run.update(describe([r[0] for r in ok], "latency"))
    return run


def sweep(base: Workload, concurrencies: list[int], log=None) -> list[dict]:
    imgs = images(base)
    runs = []
    for c in concurrencies:
        w = Workload(**{**asdict(base), "concurrency": c})
        run = asyncio.run(run_once(w, imgs))
        if log:
            log(f"c={c}: {run['completed']}/{run['requests']} ok, {run['images_per_s']:.2f} "
                f"images/s, p50 {run['p50_latency_ms']:.1f} ms, p99 {run['p99_latency_ms']:.1f}"
                f" ms")
        runs.append(run)
    return runs
