"""The routes a gateway reads to run this server as one of its workers (docs/scale-out.md):

    GET  /v1/loads              the load report of SGLang's schema, which SMG (and sglang-router
                                before it) polls for its load-aware policies: one rank with
                                running / waiting requests, KV tokens in use and in all, the
                                share in use (`token_usage`), the prefix cache's hit rate.
                                `?include=` is accepted and ignored (one rank, no disaggregation)
    POST /flush_cache           drop the prefix cache (SGLang's name; a gateway's POST
                                /flush_cache fans out to it); POST /reset_prefix_cache: the same
                                under vLLM's name. Pages a running request shares stay its own
    GET  /health_generate       the deep probe (SGLang's name): one greedy token of a short
                                prompt through the whole engine, 200 when it came within the
                                stall bound, else 503. /health only says the loop moves; this
                                says it still produces tokens. Costs one engine step
`/health`, `/v1/models` and `/version` (the other routes a gateway's worker detection reads)
are app.py's.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import datetime, timezone

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tailored.engine.types import SamplingParams
from tailored.server.errors import OpenAIError
from tailored.server.http_io import error_response
from tailored.server.metrics import kv_usage

STATS_TIMEOUT_S = 5.0  # a load report waits this long for the engine's numbers (one step)
PROBE_PROMPT = "Hi"


def load_snapshot(stats: dict) -> dict:
    """One rank of SGLang's `/v1/loads` from engine.stats(): tokens are KV page tokens, those
    only the prefix cache holds left out of the used ones (given back on demand, as SGLang
    leaves its evictable radix cache out)."""
    page = stats.get("page_size", 1)
    total = stats.get("total_pages", 0) * page
    used = max(0, stats.get("used_pages", 0) - stats.get("cached_pages", 0)) * page
    running, waiting = stats.get("running", 0), stats.get("waiting", 0)
    queries = stats.get("prefix_cache_queries", 0)
    max_running = stats.get("max_running", 0)
    return {
        "dp_rank": 0,
        "num_running_reqs": running,
        "num_waiting_reqs": waiting,
        "num_total_reqs": running + waiting,
        "num_used_tokens": used,
        "max_total_num_tokens": total,
        "token_usage": kv_usage(stats),
        "cache_hit_rate": stats.get("prefix_cache_hits", 0) / queries if queries else 0.0,
        "utilization": running / max_running if max_running else 0.0,
        "max_running_requests": max_running,
    }


def add_worker_routes(app: FastAPI, server) -> None:
    """Mount the routes above on `app`; `server`: the app's `Server` (its engine, tokenizer)."""
    engine = server.engine

    def unavailable() -> JSONResponse | None:
        if engine.healthy:
            return None
        return error_response(OpenAIError(
            f"engine unavailable: {engine.dead_reason or 'engine not running'}",
            status=503, type="service_unavailable"))

    @app.get("/v1/loads")
    async def loads():
        if (gone := unavailable()) is not None:
            return gone
        try:
            stats = await asyncio.wait_for(engine.stats(), STATS_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - a long step, or the engine died meanwhile
            return error_response(OpenAIError(
                f"engine load not available: {type(e).__name__}: {e}", status=503,
                type="service_unavailable"))
        return {"timestamp": datetime.now(timezone.utc).isoformat(), "dp_rank_count": 1,
                "loads": [load_snapshot(stats)]}

    async def flush():
        if (gone := unavailable()) is not None:
            return gone
        try:
            dropped = await asyncio.wait_for(engine.call("flush_prefix_cache"),
                                             STATS_TIMEOUT_S)
        except AttributeError:
            dropped = 0  # an engine without a prefix cache
        except Exception as e:  # noqa: BLE001
            return error_response(OpenAIError(
                f"prefix cache not flushed: {type(e).__name__}: {e}", status=503,
                type="service_unavailable"))
        return {"status": "ok", "flushed_entries": dropped}

    app.post("/flush_cache")(flush)
    app.post("/reset_prefix_cache")(flush)

    @app.api_route("/health_generate", methods=["GET", "HEAD"])
    async def health_generate(request: Request):
        if (gone := unavailable()) is not None:
            return gone
        bound = getattr(engine, "stall_timeout_s", 60.0)
        t0 = time.monotonic()
        stream = None
        try:
            ids = await server.encode(PROBE_PROMPT, "prompt")
            sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
            stream = engine.generate(f"health-{uuid.uuid4().hex}", ids, sampling)
            last = await asyncio.wait_for(_last_output(stream), bound)
            if last.error is not None:
                raise RuntimeError(last.error)
        except Exception as e:  # noqa: BLE001 - any failure is the answer
            if stream is not None:
                stream.abort()
            why = (f"no token within {bound:g} s" if isinstance(e, asyncio.TimeoutError)
                   else f"{type(e).__name__}: {e}")
            return JSONResponse({"status": "error", "message": f"generation failed: {why}"},
                                status_code=503)
        return {"status": "ok", "tokens": last.num_output_tokens,
                "seconds": round(time.monotonic() - t0, 4)}


async def _last_output(stream):
    last = None
    async for out in stream:
        last = out
    return last
