"""Asyncio load generator for any OpenAI-compatible server (tailored or vLLM).

One benchmark run = one concurrency level: `num_warmups` warm-up requests (default: as many as the
concurrency, like `vllm bench serve --num-warmups C`), then `num_prompts` requests sent by
`concurrency` workers, each starting its next request as soon as the previous one finished
(request rate infinite, at most `concurrency` in flight). Or, with `request_rate`, open loop:
requests sent at Poisson arrival times (arrivals.py), `concurrency` capping those in flight.
Every request is streamed (SSE) with `stream_options.include_usage`, greedy by default; every
run also reports goodput under an SLO (goodput.py).

Prompts:
* random: `input_len` token ids drawn uniformly from the regular vocabulary (ids 0..248043, spec
  §10.1) and sent as a list of ids to /v1/completions, so both servers see exactly `input_len`
  prompt tokens (a text prompt would be re-tokenised to another length);
* prompt files (JSONL, one request per line, cycled): `{"prompt": str | [ids]}` goes to
  /v1/completions, `{"messages": [...]}` to /v1/chat/completions; optional `max_tokens`,
  `enable_thinking` (-> chat_template_kwargs); `bench/smoke.jsonl` is such a file.

Per request (perf_counter clocks, the client's own view):
* TTFT  = first chunk that carries output text - request start;
* ITL   = gaps between consecutive chunks that carry output text (a chunk may hold > 1 token);
* E2E   = end of the response stream - request start;
* TPOT  = (E2E - TTFT) / (output_tokens - 1), requests with more than one output token;
* output tokens = the server's `usage.completion_tokens`, else the number of text chunks.
Per run: output tok/s = all output tokens / run duration (first request sent -> last response
ended, warm-ups excluded), request/s likewise, and mean/median/std/p50/p90/p99 of the four
latencies in ms. The keys follow `vllm bench serve`'s result JSON (output_throughput,
p50_ttft_ms, ...) so the files of both clients compare directly.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tailored.bench.arrivals import poisson_offsets, rate_label, run_paced
from tailored.bench.goodput import SLO, goodput

# Regular (non-special) token ids of the Qwen3.5/3.6 vocabulary (spec §10.1).
REGULAR_TOKEN_IDS = (0, 248044)
PERCENTILES = (50, 90, 99)
METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_OUTPUT_LEN = 512


# ---------------------------------------------------------------------------------------------
# statistics
# ---------------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    """q-th percentile with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def describe(values_s: list[float], name: str) -> dict[str, float]:
    """mean/median/std/p50/p90/p99 of seconds, reported in ms under vLLM's key names."""
    ms = [v * 1000.0 for v in values_s]
    n = len(ms)
    mean = sum(ms) / n if n else float("nan")
    std = math.sqrt(sum((x - mean) ** 2 for x in ms) / n) if n else float("nan")
    out = {
        f"mean_{name}_ms": mean,
        f"median_{name}_ms": percentile(ms, 50),
        f"std_{name}_ms": std,
    }
    for q in PERCENTILES:
        out[f"p{q}_{name}_ms"] = percentile(ms, q)
    return out


def tpot_s(e2e_s: float, ttft_s: float, output_tokens: int) -> float | None:
    """Time per output token after the first; None for fewer than 2 output tokens."""
    if output_tokens < 2:
        return None
    return (e2e_s - ttft_s) / (output_tokens - 1)


# ---------------------------------------------------------------------------------------------
# workload
# ---------------------------------------------------------------------------------------------
@dataclass
class Workload:
    """What one run sends. `concurrency`/`num_prompts` are per run; a sweep varies them."""

    base_url: str
    model: str | None = None  # None: the first id of GET /v1/models
    concurrency: int = 1
    num_prompts: int = 16
    input_len: int = 1024
    output_len: int | None = None  # None: 512, or a prompt file line's max_tokens
    ignore_eos: bool = False
    temperature: float = 0.0
    seed: int = 0
    prompt_files: tuple[str, ...] = ()
    num_warmups: int | None = None  # None: = concurrency
    request_timeout_s: float = 1800.0
    token_id_range: tuple[int, int] = REGULAR_TOKEN_IDS
    extra_body: dict[str, Any] = field(default_factory=dict)
    # None: closed loop (`concurrency` workers); a rate (inf too): Poisson arrivals of that
    # rate, `concurrency` the cap on requests in flight (0: none); arrivals.py
    request_rate: float | None = None
    slo_ttft_ms: float = SLO.ttft_ms
    slo_itl_ms: float = SLO.itl_ms
    random_text: bool = False  # random prompts as text of input_len tokens (randtext.py)

    @property
    def warmups(self) -> int:
        return (self.concurrency or 1) if self.num_warmups is None else self.num_warmups

    def describe(self) -> dict[str, Any]:
        d = asdict(self)
        d["num_warmups"] = self.warmups
        d["dataset"] = "prompt-file" if self.prompt_files else (
            "random-text" if self.random_text else "random-token-ids")
        if not self.prompt_files:
            d["output_len"] = self.output_len or DEFAULT_OUTPUT_LEN
        d["token_id_range"] = list(self.token_id_range)
        d["prompt_files"] = list(self.prompt_files)
        d["streaming"] = True
        d["request_rate"] = "inf" if self.request_rate is None else rate_label(self.request_rate)
        d["arrivals"] = "closed-loop" if self.request_rate is None else "poisson"
        return d


@dataclass
class PreparedRequest:
    endpoint: str  # "completions" | "chat"
    body: dict[str, Any]
    prompt_len: int | None  # exact when the prompt is token ids
    max_tokens: int
    keep_text: bool = False  # collect the output text (multi-turn workloads resend it)


def api_root(base_url: str) -> str:
    """'http://h:p', 'http://h:p/' and 'http://h:p/v1' all give 'http://h:p'."""
    return base_url.rstrip("/").removesuffix("/v1")


def random_token_prompts(
    n: int, input_len: int, seed: int, id_range: tuple[int, int] = REGULAR_TOKEN_IDS
) -> list[list[int]]:
    """n prompts of exactly input_len token ids, deterministic for seed."""
    rng = random.Random(seed)
    lo, hi = id_range
    return [[rng.randrange(lo, hi) for _ in range(input_len)] for _ in range(n)]


def load_prompt_files(paths: tuple[str, ...] | list[str]) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    for p in paths:
        for ln, line in enumerate(Path(p).read_text().splitlines(), 1):
            if not line.strip():
                continue
            obj = json.loads(line)
            if "messages" not in obj and "prompt" not in obj:
                raise ValueError(f"{p}:{ln}: a prompt line needs 'prompt' or 'messages'")
            items.append(obj)
    if not items:
        raise ValueError(f"no prompts in {list(paths)}")
    return items


def _body_common(w: Workload, model: str, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": w.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if w.ignore_eos:
        body["ignore_eos"] = True  # vLLM extension, tailored supports it
    body.update(w.extra_body)
    return body


def prepare_requests(w: Workload, model: str, n: int, seed: int) -> list[PreparedRequest]:
    if not w.prompt_files:
        out_len = w.output_len or DEFAULT_OUTPUT_LEN
        reqs = []
        if w.random_text:
            from tailored.bench.randtext import random_text_prompts

            for text in random_text_prompts(n, w.input_len, seed):
                body = _body_common(w, model, out_len)
                body["prompt"] = text
                reqs.append(PreparedRequest("completions", body, w.input_len, out_len))
            return reqs
        for ids in random_token_prompts(n, w.input_len, seed, w.token_id_range):
            body = _body_common(w, model, out_len)
            body["prompt"] = ids
            reqs.append(PreparedRequest("completions", body, len(ids), out_len))
        return reqs
    items = load_prompt_files(w.prompt_files)
    reqs = []
    offset = seed % len(items)
    for i in range(n):
        it = items[(offset + i) % len(items)]
        out_len = w.output_len or int(it.get("max_tokens") or DEFAULT_OUTPUT_LEN)
        body = _body_common(w, model, out_len)
        if "messages" in it:
            body["messages"] = it["messages"]
            if "enable_thinking" in it:
                body["chat_template_kwargs"] = {"enable_thinking": bool(it["enable_thinking"])}
            reqs.append(PreparedRequest("chat", body, None, out_len))
        else:
            body["prompt"] = it["prompt"]
            plen = len(it["prompt"]) if isinstance(it["prompt"], list) else None
            reqs.append(PreparedRequest("completions", body, plen, out_len))
    return reqs


# ---------------------------------------------------------------------------------------------
# one request
# ---------------------------------------------------------------------------------------------
@dataclass
class RequestResult:
    ok: bool
    error: str | None = None
    start_s: float = 0.0  # relative to the run's start
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    text_chunks: int = 0
    usage_output_tokens: int | None = None
    prompt_tokens: int | None = None
    max_tokens: int = 0
    finish_reason: str | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if sent
    text: str = ""  # the output text, when the request asked to keep it

    @property
    def output_tokens(self) -> int:
        return (
            self.usage_output_tokens if self.usage_output_tokens is not None else self.text_chunks
        )

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.ttft_s is None or self.e2e_s is None:
            return None
        return tpot_s(self.e2e_s, self.ttft_s, self.output_tokens)


def chunk_text(obj: dict[str, Any]) -> tuple[str | None, str | None]:
    """(output text carried by a chunk, finish_reason) for completions and chat chunks."""
    choices = obj.get("choices")
    if not choices:
        return None, None
    c0 = choices[0]
    if "delta" in c0:
        d = c0.get("delta") or {}
        text = d.get("content") or d.get("reasoning_content") or d.get("reasoning")
    else:
        text = c0.get("text")
    return text, c0.get("finish_reason")


try:  # faster JSON when present (vLLM installs it); same results
    import orjson as _orjson

    _loads = _orjson.loads
except ImportError:  # pragma: no cover - depends on the environment
    _loads = json.loads


async def send_request(client, root: str, req: PreparedRequest, t_run0: float) -> RequestResult:
    """Stream one request; never raises (errors are recorded in the result)."""
    import httpx

    url = f"{root}/v1/{'chat/completions' if req.endpoint == 'chat' else 'completions'}"
    res = RequestResult(ok=False, prompt_tokens=req.prompt_len, max_tokens=req.max_tokens)
    st = time.perf_counter()
    res.start_s = st - t_run0
    last = None
    try:
        async with client.stream("POST", url, json=req.body) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {body[:300]}"
                return res
            pending = b""
            done = False
            async for data in resp.aiter_bytes():
                now = time.perf_counter()
                lines = (pending + data).split(b"\n")
                pending = lines.pop()
                for line in lines:
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        done = True
                        break
                    obj = _loads(payload)
                    if "error" in obj and not obj.get("choices"):
                        err = obj["error"]
                        res.error = f"in-band error: {err.get('message', err) if isinstance(err, dict) else err}"
                        continue
                    text, finish = chunk_text(obj)
                    if text:
                        if req.keep_text:
                            res.text += text
                        res.text_chunks += 1
                        if res.ttft_s is None:
                            res.ttft_s = now - st
                        else:
                            res.itl_s.append(now - last)
                        last = now
                    if finish:
                        res.finish_reason = finish
                    usage = obj.get("usage")
                    if usage:
                        if usage.get("completion_tokens") is not None:
                            res.usage_output_tokens = int(usage["completion_tokens"])
                        if usage.get("prompt_tokens") is not None:
                            res.prompt_tokens = int(usage["prompt_tokens"])
                        details = usage.get("prompt_tokens_details") or {}
                        if details.get("cached_tokens") is not None:
                            res.cached_tokens = int(details["cached_tokens"])
                if done:
                    break
        res.e2e_s = time.perf_counter() - st
        if res.error is None and res.finish_reason in ("abort", "error"):
            res.error = f"stream finished with finish_reason {res.finish_reason!r}"
        # A stream with no text at all fails, unless the server reports generated tokens in
        # `usage`: tokens that all detokenize to "" (a random-weight model repeating a special
        # token: 2 of 256 vLLM requests). That request counts for throughput and
        # E2E; its TTFT/TPOT/ITL stay unknown (no chunk marks a first token: chat sends a role
        # chunk before prefill, completions may send only the final chunk), so the latency
        # percentiles leave it out.
        empty_but_generated = done and (res.usage_output_tokens or 0) > 0
        if res.error is None and res.ttft_s is None and not empty_but_generated:
            res.error = "no output text in the stream"
        if res.error is None and not done:
            res.error = "stream ended without [DONE]"
        res.ok = res.error is None
    except (httpx.HTTPError, OSError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


# ---------------------------------------------------------------------------------------------
# one run
# ---------------------------------------------------------------------------------------------
async def _pool(
    client, root: str, reqs: list[PreparedRequest], concurrency: int, t0: float
) -> list[RequestResult]:
    results: list[RequestResult | None] = [None] * len(reqs)
    it = iter(range(len(reqs)))

    async def worker() -> None:
        for i in it:  # shared iterator: each index is taken by exactly one worker
            results[i] = await send_request(client, root, reqs[i], t0)

    await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(reqs))))))
    return results  # type: ignore[return-value]


def summarize(results: list[RequestResult], duration_s: float, concurrency: int) -> dict[str, Any]:
    """Run metrics under vLLM's result-JSON key names (times in ms, throughputs per second)."""
    ok = [r for r in results if r.ok]
    out_tokens = [r.output_tokens for r in ok]
    in_tokens = [r.prompt_tokens or 0 for r in ok]
    total_out = sum(out_tokens)
    d: dict[str, Any] = {
        "max_concurrency": concurrency,
        "num_prompts": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration": duration_s,
        "total_input_tokens": sum(in_tokens),
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else float("nan"),
        "output_throughput": total_out / duration_s if duration_s > 0 else float("nan"),
        "total_token_throughput": (total_out + sum(in_tokens)) / duration_s
        if duration_s > 0
        else float("nan"),
        "output_tokens_from_usage": all(r.usage_output_tokens is not None for r in ok),
        "short_outputs": sum(1 for r in ok if r.output_tokens < r.max_tokens),
    }
    d.update(describe([r.ttft_s for r in ok if r.ttft_s is not None], "ttft"))
    d.update(describe([t for r in ok if (t := r.tpot_s) is not None], "tpot"))
    d.update(describe([g for r in ok for g in r.itl_s], "itl"))
    d.update(describe([r.e2e_s for r in ok], "e2el"))
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error or "?"] = errors.get(r.error or "?", 0) + 1
    d["errors"] = [{"error": k, "count": v} for k, v in list(errors.items())[:10]]
    return d


def request_records(results: list[RequestResult]) -> list[dict[str, Any]]:
    return [
        {
            "ok": r.ok,
            "error": r.error,
            "start_s": r.start_s,
            "ttft_s": r.ttft_s,
            "e2e_s": r.e2e_s,
            "tpot_s": r.tpot_s,
            "output_tokens": r.output_tokens,
            "prompt_tokens": r.prompt_tokens,
            "text_chunks": r.text_chunks,
            "finish_reason": r.finish_reason,
            "cached_tokens": r.cached_tokens,
            "itl_s": r.itl_s,
        }
        for r in results
    ]


async def discover_model(client, root: str) -> str:
    import httpx

    try:
        resp = await client.get(f"{root}/v1/models")
        resp.raise_for_status()
    except httpx.HTTPError as e:  # a server that is down or not an OpenAI endpoint
        raise RuntimeError(f"GET {root}/v1/models failed: {type(e).__name__}: {e}") from None
    data = resp.json().get("data") or []
    if not data:
        raise RuntimeError(f"{root}/v1/models lists no model")
    return data[0]["id"]


def make_client(concurrency: int, timeout_s: float):
    import httpx

    limits = httpx.Limits(
        max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8
    )
    # trust_env=False: never route localhost benchmark traffic through a proxy from the env
    return httpx.AsyncClient(
        limits=limits, timeout=httpx.Timeout(timeout_s, connect=30.0), trust_env=False
    )


async def run_once(w: Workload, *, keep_requests: bool = False, log=None) -> dict[str, Any]:
    """Warm up, then run `w.num_prompts` requests at `w.concurrency`; returns the run dict."""
    root = api_root(w.base_url)
    async with make_client(w.concurrency or w.num_prompts, w.request_timeout_s) as client:
        model = w.model or await discover_model(client, root)
        reqs = prepare_requests(w, model, w.num_prompts, w.seed)
        if w.warmups:
            # other prompts than the measured ones (no prefix-cache hit can flatter TTFT)
            warm = prepare_requests(w, model, w.warmups, w.seed + 1_000_003)
            t = time.perf_counter()
            wres = await _pool(client, root, warm, w.concurrency, t)
            bad = [r.error for r in wres if not r.ok]
            if log:
                log(
                    f"  warm-up: {len(wres) - len(bad)}/{len(wres)} ok in {time.perf_counter() - t:.1f} s"
                )
            if bad:
                hint = ""
                if "vocab" in str(bad[0]).lower() and w.token_id_range == REGULAR_TOKEN_IDS:
                    # random prompts draw from the full model's vocabulary (found by a new
                    # user's trial against the small CPU model)
                    hint = (" (random prompts draw ids from the full 248k vocabulary: a "
                            "smaller model needs --token-id-range, e.g. 0,4000)")
                raise RuntimeError(f"warm-up request failed: {bad[0]}{hint}")
        t0 = time.perf_counter()
        if w.request_rate is None:
            results = await _pool(client, root, reqs, w.concurrency, t0)
        else:
            offsets = poisson_offsets(len(reqs), w.request_rate, w.seed)
            results = await run_paced(lambda i: send_request(client, root, reqs[i], t0),
                                      offsets, w.concurrency, t0)
        duration = time.perf_counter() - t0
    run = summarize(results, duration, w.concurrency or len(reqs))
    run["model"] = model
    run["request_rate"] = "inf" if w.request_rate is None else rate_label(w.request_rate)
    run.update(goodput(results, duration, SLO(w.slo_ttft_ms, w.slo_itl_ms), run))
    if keep_requests:
        run["requests"] = request_records(results)
    return run


def install_uvloop() -> str:
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        return f"uvloop {getattr(uvloop, '__version__', '?')}"
    except ImportError:
        return "asyncio"


def run_sweep(
    base: Workload,
    concurrencies: list[int],
    num_prompts: list[int],
    *,
    keep_requests: bool = False,
    use_uvloop: bool = True,
    log=None,
    rates: list[float] | None = None,
) -> list[dict]:
    """One run per (concurrency, num_prompts) pair, in order; with `rates`, one run per
    (rate, num_prompts) pair at Poisson arrivals, `concurrencies[0]` the cap in flight."""
    steps = rates or concurrencies
    if len(num_prompts) == 1:
        num_prompts = num_prompts * len(steps)
    if len(num_prompts) != len(steps):
        raise ValueError("--num-prompts needs one value or one per --concurrency "
                         "(--request-rate) value")
    loop_kind = install_uvloop() if use_uvloop else "asyncio"
    runs = []
    pairs = [(concurrencies[0], n, r) for r, n in zip(rates, num_prompts)] if rates else \
        [(c, n, None) for c, n in zip(concurrencies, num_prompts)]
    for c, n, rate in pairs:
        w = Workload(**{**asdict(base), "concurrency": c, "num_prompts": n, "request_rate": rate})
        if log:
            what = f"concurrency {c}" if rate is None else \
                f"Poisson rate {rate_label(rate)}/s, cap {c or 'none'}"
            log(f"run: {what}, {n} prompts -> {w.base_url}")
        run = asyncio.run(run_once(w, keep_requests=keep_requests, log=log))
        run["event_loop"] = loop_kind
        if log:
            log("  " + one_line(run))
        runs.append(run)
    return runs


def default_num_prompts(concurrency: int) -> int:
    """16 at c=1, 8 per stream above (256 at c=32), like the baseline kit's c1/c32 runs."""
    return 16 if concurrency <= 1 else 8 * concurrency


def one_line(run: dict[str, Any]) -> str:
    return (
        f"c={run['max_concurrency']} {run['completed']}/{run['num_prompts']} ok, "
        f"{run['output_throughput']:.1f} out tok/s, {run['request_throughput']:.3f} req/s, "
        f"TTFT p50 {run['p50_ttft_ms']:.1f} ms, TPOT p50 {run['p50_tpot_ms']:.2f} ms, "
        f"ITL p99 {run['p99_itl_ms']:.2f} ms, E2E p50 {run['p50_e2el_ms']:.0f} ms, "
        f"goodput {run.get('request_goodput', float('nan')):.3f} req/s"
    )


def stderr_log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
