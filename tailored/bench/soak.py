"""Soak test: answers under concurrency must equal the answers of the same requests alone.

failure-cases §9: engines of this model family have collapsed to garbage at high concurrency
while every request still returned 200 (grammar masks racing CUDA graphs and asynchronous copies,
thousands of batches in). Status codes prove nothing; this checks the text.

    python -m tailored.bench.soak --base-url http://127.0.0.1:8000 [--prompts 48]
        [--concurrency 32] [--rounds 3] [--max-tokens 64] [--token-id-range LO,HI] [--json OUT]

1. N random token prompts of mixed lengths (seeded) are sent one at a time, greedy, ignore_eos:
   the reference answers.
2. `rounds` times, all N in a new random order with `concurrency` in flight, half of them
   streamed: each answer must equal its reference text exactly.
With --structured-every K, every K-th prompt also carries a grammar (vLLM's
`structured_outputs`, cycling through STRUCTURED: a regex, a JSON schema and a choice), the
case the failure reports name: grammar masks beside CUDA graphs, asynchronous copies and steps
launched ahead (kb/0052). Such an answer must equal its reference too, and follow its grammar
(`follows`: the whole text when it finished with "stop", a prefix the grammar allows when cut by
max_tokens).
With --prefix-every K, every K-th prompt is the prompt before it plus 1-64 more ids: with the
server's prefix caching on (`--prefix-cache-entries`) those hit the cache whenever their base
prompt ran before them, and must still give the answers alone (failure-cases §3); the report
gives the server's `tailored:prefix_cache_hits_total` from /metrics.
Exit 1 on any HTTP error, mismatch or answer outside its grammar; the report gives the first
differing character of each.
Greedy equality under batching needs a batch-invariant engine: run the server in fp32 (as the
invariance suite does) for a strict check; in bf16 near-tied logits may legitimately flip.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tailored.bench.loadgen import api_root, chunk_text, discover_model, make_client


# (name, vLLM structured_outputs body) — each small enough that a random-weight model ends it
# or keeps inside it within a few dozen tokens
STRUCTURED: tuple[tuple[str, dict], ...] = (
    ("regex", {"regex": "[0-9]{1,200}"}),
    ("json", {"json": {"type": "object", "properties": {"n": {"type": "integer"},
                                                         "ok": {"type": "boolean"}},
                       "required": ["n", "ok"], "additionalProperties": False}}),
    ("choice", {"choice": ["alpha", "beta", "gamma"]}),
)


def follows(kind: str, text: str, finish: str | None) -> bool:
    """Whether text is an answer its grammar allows: whole when the request finished with
    "stop" (the grammar ended it), else (cut by max_tokens) a prefix of one. The checks are
    loose where a prefix is concerned (JSON: only its first character) and exact otherwise."""
    import re

    whole = finish == "stop"
    if kind == "regex":
        return re.fullmatch(r"[0-9]{1,200}" if whole else r"[0-9]{0,200}", text) is not None
    if kind == "json":
        if not whole:
            return text.lstrip().startswith("{") or not text.strip()
        try:
            obj = json.loads(text)
        except ValueError:
            return False
        return (isinstance(obj, dict) and set(obj) == {"n", "ok"}
                and type(obj["n"]) is int and type(obj["ok"]) is bool)
    if kind == "choice":
        names = ("alpha", "beta", "gamma")
        return text in names if whole else any(n.startswith(text) for n in names)
    raise ValueError(kind)


@dataclass
class SoakResult:
    requests: int = 0
    errors: list[str] = field(default_factory=list)
    mismatches: list[dict] = field(default_factory=list)
    outside_grammar: list[dict] = field(default_factory=list)  # structured answers it forbids
    structured: int = 0  # requests with a grammar among `requests`
    seconds: float = 0.0
    prefix_cache_hits: float | None = None  # the server's counter after the soak (tokens)

    @property
    def ok(self) -> bool:
        return not self.errors and not self.mismatches and not self.outside_grammar


async def _complete(client, root: str, model: str, prompt: list[int], max_tokens: int,
                    stream: bool, structured: dict | None = None) -> tuple[str, str | None]:
    """(text, finish_reason) of one greedy completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": stream}
    if structured is not None:
        body["structured_outputs"] = structured
    url = f"{root}/v1/completions"
    if not stream:
        r = await client.post(url, json=body)
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
        c0 = r.json()["choices"][0]
        return c0["text"], c0.get("finish_reason")
    parts, finish = [], None
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(f"in-band error: {ev['error']}")
            text, fin = chunk_text(ev)
            parts.append(text or "")
            finish = fin or finish
    return "".join(parts), finish


def _first_diff(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


async def soak(base_url: str, *, prompts: int = 48, concurrency: int = 32, rounds: int = 3,
               max_tokens: int = 64, token_id_range: tuple[int, int] = (1000, 100000),
               seed: int = 0, max_prompt_len: int = 600, timeout: float = 600.0,
               structured_every: int = 0, prefix_every: int = 0) -> SoakResult:
    """Run the soak against an OpenAI-compatible server; see the module docstring.
    structured_every: every K-th prompt (K > 0) carries the next grammar of STRUCTURED.
    prefix_every: every K-th prompt (K > 1) extends the prompt before it."""
    rng = random.Random(seed)
    lo, hi = token_id_range
    ps = [[rng.randrange(lo, hi) for _ in range(rng.randint(1, max_prompt_len))]
          for _ in range(prompts)]
    if prefix_every > 1:
        for i in range(prefix_every, prompts, prefix_every):
            ps[i] = ps[i - 1] + ps[i][:rng.randint(1, 64)]
    kinds: list[tuple[str, dict] | None] = [
        STRUCTURED[(i // structured_every) % len(STRUCTURED)]
        if structured_every > 0 and i % structured_every == 0 else None
        for i in range(prompts)]
    res = SoakResult()

    def check(rnd: int, i: int, stream: bool, got: str, finish: str | None) -> None:
        if kinds[i] is not None and not follows(kinds[i][0], got, finish):
            res.outside_grammar.append({"round": rnd, "prompt": i, "kind": kinds[i][0],
                                        "finish": finish, "text": got[:120]})

    t0 = time.monotonic()
    root = api_root(base_url)
    async with make_client(concurrency, timeout) as client:
        model = await discover_model(client, root)
        ref: list[str | None] = []
        for i, p in enumerate(ps):  # one at a time: nothing else in the batch
            try:
                got, finish = await _complete(client, root, model, p, max_tokens, stream=False,
                                              structured=kinds[i] and kinds[i][1])
                check(-1, i, False, got, finish)
                ref.append(got)
            except Exception as e:  # noqa: BLE001 - reported, the soak goes on
                res.errors.append(f"reference {i}: {e}")
                ref.append(None)
            res.requests += 1
            res.structured += kinds[i] is not None
        sem = asyncio.Semaphore(concurrency)

        async def one(rnd: int, i: int, stream: bool) -> None:
            async with sem:
                try:
                    got, finish = await _complete(client, root, model, ps[i], max_tokens,
                                                  stream, structured=kinds[i] and kinds[i][1])
                except Exception as e:  # noqa: BLE001
                    res.errors.append(f"round {rnd} prompt {i}: {e}")
                    return
            check(rnd, i, stream, got, finish)
            if ref[i] is not None and got != ref[i]:
                k = _first_diff(got, ref[i])
                res.mismatches.append({"round": rnd, "prompt": i, "stream": stream,
                                       "prompt_len": len(ps[i]), "first_diff_char": k,
                                       "got": got[max(0, k - 20):k + 40],
                                       "want": ref[i][max(0, k - 20):k + 40]})

        for rnd in range(rounds):
            order = list(range(prompts))
            rng.shuffle(order)
            await asyncio.gather(*(one(rnd, i, j % 2 == 1) for j, i in enumerate(order)))
            res.requests += prompts
            res.structured += sum(k is not None for k in kinds)
        if prefix_every > 1:
            res.prefix_cache_hits = await _metric(client, root,
                                                  "tailored:prefix_cache_hits_total")
    res.seconds = time.monotonic() - t0
    return res


async def _metric(client, root: str, name: str) -> float | None:
    """The summed value of one metric from the server's /metrics (None if absent); root:
    `api_root` of the server's URL."""
    try:
        r = await client.get(f"{root}/metrics")
    except Exception:  # noqa: BLE001 - a report line only
        return None
    vals = [float(line.rsplit(" ", 1)[1]) for line in r.text.splitlines()
            if line.startswith(name + "{") or line.startswith(name + " ")]
    return sum(vals) if vals else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tailored.bench.soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-len", type=int, default=600)
    ap.add_argument("--token-id-range", default="1000,100000",
                    help="LO,HI of the random prompt ids (the embedded CPU model: 0,4000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefix-every", type=int, default=0,
                    help="every K-th prompt (K > 1) extends the one before it (prefix caching)")
    ap.add_argument("--structured-every", type=int, default=0,
                    help="every K-th prompt carries a grammar (regex, JSON schema, choice)")
    ap.add_argument("--json", default=None, help="write the report here")
    a = ap.parse_args(argv)
    try:
        lo, hi = (int(x) for x in a.token_id_range.split(","))
    except ValueError:
        ap.error(f"--token-id-range must be LO,HI, got {a.token_id_range!r}")
    for name in ("prompts", "concurrency", "rounds", "max_tokens", "max_prompt_len"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    res = asyncio.run(soak(a.base_url, prompts=a.prompts,
                           concurrency=a.concurrency, rounds=a.rounds, max_tokens=a.max_tokens,
                           token_id_range=(lo, hi), seed=a.seed, max_prompt_len=a.max_prompt_len,
                           structured_every=a.structured_every, prefix_every=a.prefix_every))
    print(f"soak: {res.requests} requests in {res.seconds:.1f} s, {len(res.errors)} errors, "
          f"{len(res.mismatches)} answers differing from the same request alone, "
          f"{len(res.outside_grammar)} of {res.structured} structured answers outside their "
          f"grammar -> "
          f"{'OK' if res.ok else 'FAIL'}")
    if res.prefix_cache_hits is not None:
        print(f"  server prefix-cache hits: {res.prefix_cache_hits:.0f} tokens")
    for e in res.errors[:5]:
        print("  error:", e)
    for m in res.mismatches[:5]:
        print(f"  mismatch: round {m['round']} prompt {m['prompt']} (len {m['prompt_len']}, "
              f"stream {m['stream']}) at char {m['first_diff_char']}: got {m['got']!r} "
              f"want {m['want']!r}")
    for m in res.outside_grammar[:5]:
        print(f"  outside its grammar: round {m['round']} prompt {m['prompt']} ({m['kind']}, "
              f"finish {m['finish']}): {m['text']!r}")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "requests": res.requests,
                                            "structured": res.structured,
                                            "seconds": res.seconds, "errors": res.errors,
                                            "mismatches": res.mismatches,
                                            "outside_grammar": res.outside_grammar,
                                            "prefix_cache_hits": res.prefix_cache_hits,
                                            "ok": res.ok},
                                           indent=1))
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
