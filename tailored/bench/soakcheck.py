"""What the soak (soak.py) checks beyond equal text: a differing answer judged by the gate's tie
rule, and the server back at its idle state once the soak is over.

Ties. In bf16 or FP8 an answer under load may legitimately leave its answer alone where the two
best next tokens nearly tie: the batch changes the summation order. `tailored gate` counts a
greedy divergence as a tie when logit_ref[ref token] - logit_ref[engine token] <= the tie gap
(eval/thresholds.json, widened to the noise floor's max logit error on the GPU). Here the
reference answer (the request alone) carries its top logprobs (a logprob difference is the
logit difference); at the first character where the answer under load differs, the token of
the reference covering it is found by `text_offset`, and the answer's own token there is the
alternative of the reference's top list that the rest of the answer starts with. Within the
gap: a tie, reported and allowed; otherwise (or no such alternative): decisive.

Idle. Before the soak and after it, the server's counts of requests, KV pages held by requests
(pages only the prefix cache holds are free to take) and GDN state slots, from /metrics
(tailored's names) or else /v1/loads (SGLang's schema: requests and KV tokens in use). After
the soak, disconnected clients included, they must come back to the values before.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from dataclasses import dataclass

METRIC_NAMES = {
    "running": "tailored:num_requests_running",
    "waiting": "tailored:num_requests_waiting",
    "pages_used": "tailored:kv_cache_pages_used",
    "pages_cached": "tailored:kv_cache_pages_cached",
    "slots_used": "tailored:gdn_state_slots_used",
    "prefix_cache_hits": "tailored:prefix_cache_hits_total",
}


@dataclass
class Reference:
    """An answer alone: its text and, when asked for, its tokens with their top logprobs."""

    text: str
    tokens: list[str] | None = None
    offsets: list[int] | None = None
    logprobs: list[float] | None = None
    tops: list[dict[str, float]] | None = None

    @classmethod
    def of(cls, choice: dict) -> Reference:
        lp = choice.get("logprobs") or None
        if not lp or not lp.get("tokens"):
            return cls(choice["text"])
        return cls(choice["text"], list(lp["tokens"]), list(lp["text_offset"]),
                   [float("nan") if v is None else v for v in lp["token_logprobs"]],
                   [t or {} for t in lp["top_logprobs"]])


def first_diff(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def judge(got: str, ref: Reference, tie_gap: float, partial: bool = False) -> tuple[str, dict]:
    """('same' | 'tie' | 'decisive', detail). partial: the client left mid-stream, so `got`
    need only be a prefix of the reference."""
    want = ref.text
    if got == want or (partial and want.startswith(got)):
        return "same", {}
    k = first_diff(got, want)
    detail = {"first_diff_char": k, "got": got[max(0, k - 20):k + 40],
              "want": want[max(0, k - 20):k + 40]}
    if tie_gap <= 0 or not ref.tokens or k >= len(got):
        return "decisive", detail  # (an answer shorter than its reference is no tie)
    at = max(0, bisect.bisect_right(ref.offsets, k) - 1)
    rest = got[ref.offsets[at]:]
    mine, lp = ref.tokens[at], ref.logprobs[at]
    gaps = [lp - v for t, v in ref.tops[at].items()
            if t != mine and t and not t.startswith("bytes:") and rest.startswith(t)]
    detail.update(token_index=at, ref_token=mine,
                  gap=min(gaps) if gaps else None, tie_gap=tie_gap)
    if gaps and min(gaps) <= tie_gap:
        return "tie", detail
    return "decisive", detail


def parse_metrics(text: str) -> dict[str, float]:
    """{name: value summed over its label sets} of a Prometheus text page."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
    return out


async def snapshot(client, root: str) -> dict | None:
    """What the server holds now: {requests, pages, slots, prefix_cache_hits} from /metrics,
    or {requests, tokens} from /v1/loads; None when it has neither."""
    try:
        r = await client.get(f"{root}/metrics")
        m = parse_metrics(r.text) if r.status_code == 200 else {}
    except Exception:  # noqa: BLE001 - a server without it
        m = {}
    got = {k: m.get(v) for k, v in METRIC_NAMES.items()}
    if got["running"] is not None and got["pages_used"] is not None:
        return {"source": "/metrics",
                "requests": got["running"] + (got["waiting"] or 0.0),
                "pages": got["pages_used"] - (got["pages_cached"] or 0.0),
                "slots": got["slots_used"], "prefix_cache_hits": got["prefix_cache_hits"]}
    try:
        r = await client.get(f"{root}/v1/loads")
        load = r.json()["loads"][0] if r.status_code == 200 else None
    except Exception:  # noqa: BLE001
        load = None
    if not load:
        return None
    return {"source": "/v1/loads", "requests": float(load.get("num_total_reqs", 0)),
            "tokens": float(load.get("num_used_tokens", 0))}


HELD = ("requests", "pages", "slots", "tokens")


def leaks(before: dict, after: dict) -> list[str]:
    """What `after` holds beyond `before` (requests must be 0)."""
    out = []
    for k in HELD:
        if after.get(k) is None:
            continue
        want = 0.0 if k == "requests" else before.get(k) or 0.0
        if after[k] > want:
            out.append(f"{k}: {after[k]:g} held, {want:g} when idle")
    return out


async def wait_idle(client, root: str, before: dict, timeout_s: float = 30.0,
                    poll_s: float = 0.5) -> tuple[dict | None, list[str], float]:
    """(last snapshot, what it still holds, seconds waited): polls until nothing leaks or the
    timeout (aborted requests are reaped at the engine's next step)."""
    t0 = time.monotonic()
    while True:
        now = await snapshot(client, root)
        held = leaks(before, now) if now else ["the server reports no counts any more"]
        if not held or time.monotonic() - t0 >= timeout_s:
            return now, held, time.monotonic() - t0
        await asyncio.sleep(poll_s)
