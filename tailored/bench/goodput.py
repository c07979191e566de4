"""Goodput under a latency SLO, per request as `vllm bench serve --goodput` counts it.

A request is *good* when it completed, its TTFT <= `ttft_ms` and its TPOT (its own mean gap
between output tokens after the first, (E2E - TTFT) / (tokens - 1)) <= `itl_ms`; a request
with one output token has no TPOT and meets that half, as in vLLM. A request whose stream
carried no text (no TTFT known) is not good. Goodput = good requests / run duration, and their
output tokens / run duration. Defaults: TTFT 1 s, 100 ms between tokens (the issue's SLO).

Beside it, the run-level form of the same SLO: TTFT p99 <= ttft_ms and ITL p99 (pooled over
all gaps of all requests) <= itl_ms (`slo_p99_met`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DEFAULT_TTFT_MS = 1000.0
DEFAULT_ITL_MS = 100.0


@dataclass(frozen=True)
class SLO:
    ttft_ms: float = DEFAULT_TTFT_MS
    itl_ms: float = DEFAULT_ITL_MS

    def meets(self, r: Any) -> bool:
        """r: a loadgen.RequestResult (ok, ttft_s, tpot_s)."""
        if not r.ok or r.ttft_s is None or r.ttft_s * 1000.0 > self.ttft_ms:
            return False
        t = r.tpot_s
        return t is None or t * 1000.0 <= self.itl_ms


def goodput(results: list[Any], duration_s: float, slo: SLO,
            run: dict[str, Any] | None = None) -> dict[str, Any]:
    """Result keys for one run; `run` (the summary with p99_ttft_ms, p99_itl_ms) adds the
    run-level p99 check."""
    good = [r for r in results if slo.meets(r)]
    nan = float("nan")
    out: dict[str, Any] = {
        "slo": {"ttft_ms": slo.ttft_ms, "itl_ms": slo.itl_ms,
                "per_request": "ttft <= ttft_ms and tpot <= itl_ms (vLLM's goodput)"},
        "good_requests": len(good),
        "request_goodput": len(good) / duration_s if duration_s > 0 else nan,
        "output_goodput": sum(r.output_tokens for r in good) / duration_s
        if duration_s > 0 else nan,
    }
    if run is not None:
        p99t, p99i = run.get("p99_ttft_ms", nan), run.get("p99_itl_ms", nan)
        out["slo_p99_met"] = bool(p99t <= slo.ttft_ms and (p99i <= slo.itl_ms or p99i != p99i))
    return out
