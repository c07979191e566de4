"""Prometheus metrics of one app, served as text at `GET /metrics`.

Names are vLLM's where the meaning is the same, with the prefix `tailored:` (Grafana boards
built for `vllm:` work after a rename); every series has the label `model_name`. Times are in
seconds, sizes in tokens.

Counted by the HTTP handlers as outputs reach them (each request's `RequestMetrics`):
    tailored:prompt_tokens_total            prompt tokens of requests whose first token arrived
    tailored:generation_tokens_total        generated tokens delivered to the handlers
    tailored:request_success_total          requests that ended, by finished_reason: stop, length,
                                            abort (client left or cancelled), error (engine error)
    tailored:time_to_first_token_seconds    histogram: request received -> its first token
    tailored:inter_token_latency_seconds    histogram: between two outputs of one request (one
                                            engine step: with speculative decoding an output
                                            may bring several tokens)
    tailored:e2e_request_latency_seconds    histogram: request received -> its last output
    tailored:http_requests_total            answers of the two generation routes, by handler and
                                            status code (a stream counts 200 when it starts)
Read from the engine at each scrape (`engine.stats()`, between two engine steps, waited for at
most `stats_timeout_s`, else the previous scrape's numbers; 0 while the engine is not healthy):
    tailored:engine_healthy                 1 while the engine loop runs, else 0 (/health's 503)
    tailored:num_requests_running           requests scheduled (holding KV pages / a state slot)
    tailored:num_requests_waiting           requests queued for admission
    tailored:num_preemptions_total          requests preempted for lack of KV pages
    tailored:prefix_cache_queries_total     prompt tokens of admitted requests looked up in the
                                            prefix cache (recomputes of preempted ones too)
    tailored:prefix_cache_hits_total        of those, tokens found cached
    tailored:spec_decode_num_drafts_total   speculative verify chunks (one request, one step)
    tailored:spec_decode_num_draft_tokens_total     draft tokens verified
    tailored:spec_decode_num_accepted_tokens_total  draft tokens kept
    tailored:kv_cache_usage_perc            share of the KV pages requests hold, 0..1 (vLLM's
                                            name; pages only the prefix cache holds count free)
    tailored:kv_cache_pages_used / _total   KV pages in use (the prefix cache's included) / all
    tailored:kv_cache_pages_cached          of the used ones, pages only the prefix cache holds
    tailored:gdn_state_slots_used / _total  GDN state slots of running requests / all
    tailored:prefix_cache_entries / _max    prefix-cache entries kept / --prefix-cache-entries

Each app has its own CollectorRegistry (not prometheus_client's global one), so several apps
in one process do not collide. The per-token work is O(1) (a counter add, one histogram
observation) and never awaits; an exception in metrics code is logged once and swallowed.
"""

from __future__ import annotations

import asyncio
import logging
import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tailored.engine.types import FinishReason, RequestOutput

logger = logging.getLogger(__name__)

__all__ = ["CONTENT_TYPE_LATEST", "RequestMetrics", "ServerMetrics"]

FINISHED_REASONS = tuple(r.value for r in FinishReason)  # stop, length, abort, error

# vLLM's buckets (seconds), the inter-token ones extended down to 1 ms: a decode step of this
# server takes ~3 ms on the H200 at one stream
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
               50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# engine.stats() key -> (metric name, help, counter?)
_ENGINE_STATS = (
    ("running", "tailored:num_requests_running",
     "Requests the engine's scheduler runs (they hold KV pages and a state slot).", False),
    ("waiting", "tailored:num_requests_waiting",
     "Requests queued in the engine, waiting for admission.", False),
    ("num_preemptions", "tailored:num_preemptions",
     "Requests preempted (their pages freed, recomputed later) since the engine started.", True),
    ("prefix_cache_queries", "tailored:prefix_cache_queries",
     "Prefix caching: prompt tokens of admitted requests looked up in the prefix cache.", True),
    ("prefix_cache_hits", "tailored:prefix_cache_hits",
     "Prefix caching: of those, tokens found cached (not computed again).", True),
    ("spec_verify_steps", "tailored:spec_decode_num_drafts",
     "Speculative decoding: verify chunks (one request's drafts in one step).", True),
    ("spec_drafts", "tailored:spec_decode_num_draft_tokens",
     "Speculative decoding: draft tokens verified.", True),
    ("spec_drafts_kept", "tailored:spec_decode_num_accepted_tokens",
     "Speculative decoding: draft tokens kept.", True),
    ("used_pages", "tailored:kv_cache_pages_used",
     "KV cache pages in use, by requests or the prefix cache.", False),
    ("total_pages", "tailored:kv_cache_pages_total", "KV cache pages in all.", False),
    ("cached_pages", "tailored:kv_cache_pages_cached",
     "KV cache pages only the prefix cache holds (given back when requests need them).", False),
    ("used_slots", "tailored:gdn_state_slots_used",
     "GDN state slots held by running requests.", False),
    ("total_slots", "tailored:gdn_state_slots_total",
     "GDN state slots for requests in all (--max-num-seqs or fewer).", False),
    ("prefix_cache_entries", "tailored:prefix_cache_entries",
     "Prefix caching: entries kept.", False),
    ("prefix_cache_capacity", "tailored:prefix_cache_entries_max",
     "Prefix caching: most entries kept (--prefix-cache-entries).", False),
)


class ServerMetrics:
    """The metrics of one app (one served model) in their own registry.

    model_name: the value of every series' `model_name` label.
    stats_timeout_s: how long a scrape waits for the engine's counts (seconds); the engine
        answers between two steps.
    """

    def __init__(self, model_name: str, stats_timeout_s: float = 1.0) -> None:
        self.model_name = model_name
        self.stats_timeout_s = stats_timeout_s
        self.registry = CollectorRegistry()
        self._reported = False  # a metrics error was logged (once)
        labels, reg, name = ["model_name"], self.registry, [model_name]
        self.prompt_tokens = Counter(
            "tailored:prompt_tokens", "Prompt tokens of requests that got their first token.",
            labels, registry=reg).labels(*name)
        self.generation_tokens = Counter(
            "tailored:generation_tokens", "Generated tokens delivered to clients.",
            labels, registry=reg).labels(*name)
        success = Counter(
            "tailored:request_success", "Requests that ended, by finished_reason (stop, length, "
            "abort: the client left or cancelled, error: the engine failed it).",
            labels + ["finished_reason"], registry=reg)
        self.request_success = {r: success.labels(model_name, r) for r in FINISHED_REASONS}
        self.time_to_first_token = Histogram(
            "tailored:time_to_first_token_seconds",
            "Seconds from receiving a request to its first generated token.",
            labels, registry=reg, buckets=TTFT_BUCKETS).labels(*name)
        self.inter_token_latency = Histogram(
            "tailored:inter_token_latency_seconds",
            "Seconds between two consecutive outputs of one request (an engine step; a "
            "speculative step may bring several tokens).",
            labels, registry=reg, buckets=ITL_BUCKETS).labels(*name)
        self.e2e_request_latency = Histogram(
            "tailored:e2e_request_latency_seconds",
            "Seconds from receiving a request to its last output (any finished_reason).",
            labels, registry=reg, buckets=E2E_BUCKETS).labels(*name)
        self.http_requests = Counter(
            "tailored:http_requests", "Answers of the generation routes by handler and status "
            "code (a stream counts 200 when it starts).",
            labels + ["handler", "status"], registry=reg)
        self._engine = _EngineCollector(model_name)
        reg.register(self._engine)

    def set_profile(self, name: str, sha256: str) -> None:
        """`tailored serve --profile`: a gauge of 1 labelled with the profile's name and hash."""
        Gauge("tailored:profile_info", "The profile the server applies (tailored serve "
              "--profile): its name and sha256, value 1.", ["model_name", "profile", "sha256"],
              registry=self.registry).labels(self.model_name, name, sha256).set(1)

    def request(self, arrival: float, num_prompt_tokens: int) -> RequestMetrics:
        """The tracker of one request the engine accepted. arrival: time.monotonic() when the
        request was received (seconds); num_prompt_tokens: its prompt length (tokens)."""
        return RequestMetrics(self, arrival, num_prompt_tokens)

    def http_response(self, handler: str, status: int) -> None:
        """Count one answer of a generation route (handler: its path)."""
        try:
            self.http_requests.labels(self.model_name, handler, str(status)).inc()
        except Exception:  # noqa: BLE001 - metrics never fail a request
            self.report()

    async def render(self, engine) -> bytes:
        """The exposition text (Prometheus' format, CONTENT_TYPE_LATEST), after reading the
        engine's health and, while healthy, its counts (waiting at most stats_timeout_s)."""
        healthy = bool(engine.healthy)
        stats = None
        if healthy:
            try:
                stats = await asyncio.wait_for(engine.stats(), self.stats_timeout_s)
            except Exception:  # noqa: BLE001 - timeout (a long step) or engine died: keep the last
                logger.debug("engine stats unavailable for /metrics", exc_info=True)
        self._engine.update(healthy, stats)
        return generate_latest(self.registry)

    def report(self) -> None:
        """Log a metrics error (the first one with its traceback, later ones at debug)."""
        if not self._reported:
            self._reported = True
            logger.exception("metrics update failed (the request goes on; not logged again)")
        else:
            logger.debug("metrics update failed", exc_info=True)


class RequestMetrics:
    """One request's counts and timings, fed by its handler: `output` per RequestOutput,
    `finish` where the handler stops early (the first reason recorded wins)."""

    __slots__ = ("_m", "_arrival", "_prompt_tokens", "_last", "_done", "completion_tokens")

    def __init__(self, metrics: ServerMetrics, arrival: float, num_prompt_tokens: int) -> None:
        self._m = metrics
        self._arrival = arrival  # time.monotonic() when received (seconds)
        self._prompt_tokens = num_prompt_tokens
        self._last: float | None = None  # when the last output with tokens arrived (seconds)
        self._done = False
        self.completion_tokens = 0  # generated so far (the access log's count)

    def output(self, out: RequestOutput) -> None:
        """Account one output: its tokens, TTFT or the inter-token gap; the finish if last."""
        try:
            n = len(out.delta_token_ids)
            self.completion_tokens += n
            if n:
                m, now = self._m, time.monotonic()
                if self._last is None:
                    m.prompt_tokens.inc(self._prompt_tokens)
                    m.time_to_first_token.observe(now - self._arrival)
                else:
                    m.inter_token_latency.observe(now - self._last)
                self._last = now
                m.generation_tokens.inc(n)
            if out.finished:
                reason = out.finish_reason
                reason = reason.value if isinstance(reason, FinishReason) else reason
                self.finish("error" if out.error is not None else reason or "stop")
        except Exception:  # noqa: BLE001 - metrics never fail a request
            self._m.report()

    def finish(self, reason: str) -> None:
        """Count the request as ended with `reason` (one of FINISHED_REASONS; others count as
        error) and observe its end-to-end latency. No-op after the first call."""
        if self._done:
            return
        self._done = True
        try:
            m = self._m
            m.request_success.get(reason, m.request_success["error"]).inc()
            m.e2e_request_latency.observe(time.monotonic() - self._arrival)
        except Exception:  # noqa: BLE001
            self._m.report()


def kv_usage(stats: dict) -> float:
    """The share of KV pages requests hold (vLLM's kv_cache_usage_perc), from engine.stats()."""
    try:
        total = stats.get("total_pages", 0)
        used = stats.get("used_pages", 0) - stats.get("cached_pages", 0)
        return max(0.0, used / total) if total else 0.0
    except Exception:  # noqa: BLE001 - an engine reporting other things
        return 0.0


class _EngineCollector:
    """The engine's own numbers as of the last scrape (`update`), as Prometheus families."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.healthy = False
        self.stats: dict = {}

    def update(self, healthy: bool, stats: dict | None) -> None:
        """healthy: engine.healthy; stats: engine.stats() (None: keep the last ones)."""
        self.healthy = healthy
        if not healthy:
            self.stats = {}
        elif isinstance(stats, dict):
            self.stats = stats

    def collect(self):
        labels, value = [self.model_name], self.healthy
        g = GaugeMetricFamily("tailored:engine_healthy",
                              "1 while the engine loop runs (/health answers 200), else 0.",
                              labels=["model_name"])
        g.add_metric(labels, 1.0 if value else 0.0)
        yield g
        for key, name, doc, counter in _ENGINE_STATS:
            family = CounterMetricFamily if counter else GaugeMetricFamily
            f = family(name, doc, labels=["model_name"])
            v = self.stats.get(key, 0)
            f.add_metric(labels, float(v) if isinstance(v, (int, float)) else 0.0)
            yield f
        f = GaugeMetricFamily("tailored:kv_cache_usage_perc",
                              "KV cache usage, 0..1: the share of KV pages requests hold (1 "
                              "means full; pages only the prefix cache holds count as free).",
                              labels=["model_name"])
        f.add_metric(labels, kv_usage(self.stats))
        yield f
