"""Open-loop arrivals: a seeded Poisson schedule and a sender that keeps to it.

`--request-rate R` sends requests at the times of a Poisson process of rate R per second
(exponential gaps of mean 1/R, the first request at t = 0), whether or not earlier ones have
finished, optionally capped at `max_in_flight` (a request due while the cap is reached waits
for a slot, as `vllm bench serve --request-rate R --max-concurrency C` does). R = inf sends
every request at t = 0. The schedule depends only on (n, rate, seed).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any


def parse_rates(s: str) -> list[float]:
    """'1,2.5,inf' -> [1.0, 2.5, inf]; every rate > 0."""
    out = []
    for part in s.split(","):
        part = part.strip().lower()
        if not part:
            continue
        r = math.inf if part in ("inf", "infinity") else float(part)
        if not r > 0:
            raise ValueError(f"a request rate must be > 0 (or inf), got {part!r}")
        out.append(r)
    if not out:
        raise ValueError(f"no request rate in {s!r}")
    return out


def rate_label(rate: float) -> float | str:
    """JSON-friendly: a number, or "inf"."""
    return "inf" if math.isinf(rate) else rate


def poisson_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Send times (seconds after the start) of n requests: 0, then exponential gaps of mean
    1 / rate drawn from random.Random(seed); all 0 for rate = inf."""
    if math.isinf(rate):
        return [0.0] * n
    if not rate > 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out


async def run_paced(send: Callable[[int], Awaitable[Any]], offsets: list[float],
                    max_in_flight: int = 0, t0: float | None = None) -> list[Any]:
    """await send(i) for every i, started at t0 + offsets[i] (perf_counter clock), at most
    max_in_flight at once (0: no cap). Returns the results in index order."""
    t0 = time.perf_counter() if t0 is None else t0
    sem = asyncio.Semaphore(max_in_flight) if max_in_flight > 0 else None
    results: list[Any] = [None] * len(offsets)

    async def one(i: int) -> None:
        try:
            results[i] = await send(i)
        finally:
            if sem is not None:
                sem.release()

    tasks = []
    for i, off in enumerate(offsets):
        delay = t0 + off - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if sem is not None:
            await sem.acquire()
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    return results
