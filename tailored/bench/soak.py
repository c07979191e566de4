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
With --disconnect-fraction F, that share of each round's requests (streamed ones) leave after
a few chunks: the text they got must be a prefix of the answer alone, and the server must free
what they held. With prefix caching, an extending prompt's reference runs cold (the server's
cache flushed just before it: POST /reset_prefix_cache), so a hit under load is compared with
its cold run.
With --tie-gap G (> 0; the gate's tie_logit_gap, e.g. from its report: --tie-gap-from), the
references carry their top-5 logprobs and an answer that leaves its reference where the two
best tokens were within G is a tie (soakcheck.py), reported and allowed; a decisive difference
is a mismatch, at most --max-decisive-fraction of the answers (default 0). Without it any
difference is a mismatch: greedy equality under batching needs a batch-invariant engine, so
serve in fp32 (as the invariance suite does) for that strict check.
Before the first request and after the last, the server's requests, KV pages and GDN state
slots (/metrics, else /v1/loads) must be the same: nothing leaked (--idle-timeout to settle).
Exit 1 on any HTTP error, leak, answer outside its grammar or mismatch beyond the allowed share;
the report gives the first differing character of each.
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

from tailored.bench import soakcheck
from tailored.bench.loadgen import api_root, chunk_text, discover_model, make_client
from tailored.bench.soakcheck import Reference, judge


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
    mismatches: list[dict] = field(default_factory=list)  # decisive differences
    ties: list[dict] = field(default_factory=list)  # differences within the tie gap
    outside_grammar: list[dict] = field(default_factory=list)  # structured answers it forbids
    structured: int = 0  # requests with a grammar among `requests`
    disconnected: int = 0  # requests whose client left mid-stream
    compared: int = 0  # answers under load compared with their answer alone
    max_mismatches: int = 0  # decisive differences allowed (--max-decisive-fraction)
    seconds: float = 0.0
    prefix_cache_hits: float | None = None  # prompt tokens the server found cached, this soak
    cold_references: bool | None = None  # references of extending prompts ran uncached
    idle_before: dict | None = None
    idle_after: dict | None = None
    leaks: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (not self.errors and not self.outside_grammar and not self.leaks
                and len(self.mismatches) <= self.max_mismatches)


async def _complete(client, root: str, model: str, prompt: list[int], max_tokens: int,
                    stream: bool, structured: dict | None = None, logprobs: int = 0,
                    leave_after: int = 0) -> tuple[Reference, str | None]:
    """(answer, finish_reason) of one greedy completion; logprobs: the top-k logprobs of each
    token (not streamed); leave_after > 0: close the stream after that many text chunks
    (finish_reason None, the text so far)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": stream}
    if structured is not None:
        body["structured_outputs"] = structured
    if logprobs and not stream:
        body["logprobs"] = logprobs
    url = f"{root}/v1/completions"
    if not stream:
        r = await client.post(url, json=body)
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
        c0 = r.json()["choices"][0]
        return Reference.of(c0), c0.get("finish_reason")
    parts, finish, chunks = [], None, 0
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
            chunks += bool(text)
            if leave_after and chunks >= leave_after and not finish:
                break  # leaving the `async with` closes the connection mid-stream
    return Reference("".join(parts)), finish


async def soak(base_url: str, *, prompts: int = 48, concurrency: int = 32, rounds: int = 3,
               max_tokens: int = 64, token_id_range: tuple[int, int] = (1000, 100000),
               seed: int = 0, max_prompt_len: int = 600, timeout: float = 600.0,
               structured_every: int = 0, prefix_every: int = 0,
               disconnect_fraction: float = 0.0, tie_gap: float = 0.0,
               max_decisive_fraction: float = 0.0, cold_references: bool = True,
               check_idle: bool = True, idle_timeout: float = 30.0) -> SoakResult:
    """Run the soak against an OpenAI-compatible server; see the module docstring.
    structured_every: every K-th prompt (K > 0) carries the next grammar of STRUCTURED.
    prefix_every: every K-th prompt (K > 1) extends the prompt before it.
    disconnect_fraction: share of each round's requests whose client leaves mid-stream
    (at most 0.5: they are among the streamed half)."""
    if not 0.0 <= disconnect_fraction <= 0.5:
        raise ValueError(f"disconnect_fraction must be in [0, 0.5], got {disconnect_fraction}")
    rng = random.Random(seed)
    lo, hi = token_id_range
    ps = [[rng.randrange(lo, hi) for _ in range(rng.randint(1, max_prompt_len))]
          for _ in range(prompts)]
    extends = [False] * prompts
    if prefix_every > 1:
        for i in range(prefix_every, prompts, prefix_every):
            ps[i] = ps[i - 1] + ps[i][:rng.randint(1, 64)]
            extends[i] = True
    kinds: list[tuple[str, dict] | None] = [
        STRUCTURED[(i // structured_every) % len(STRUCTURED)]
        if structured_every > 0 and i % structured_every == 0 else None
        for i in range(prompts)]
    res = SoakResult()
    logprobs = 5 if tie_gap > 0 else 0

    def check(rnd: int, i: int, stream: bool, got: str, finish: str | None) -> None:
        if kinds[i] is not None and not follows(kinds[i][0], got, finish):
            res.outside_grammar.append({"round": rnd, "prompt": i, "kind": kinds[i][0],
                                        "finish": finish, "text": got[:120]})

    t0 = time.monotonic()
    root = api_root(base_url)
    async with make_client(concurrency, timeout) as client:
        model = await discover_model(client, root)
        res.idle_before = await soakcheck.snapshot(client, root) if check_idle else None
        ref: list[Reference | None] = []
        res.cold_references = None if prefix_every <= 1 or not cold_references else True
        for i, p in enumerate(ps):  # one at a time: nothing else in the batch
            if extends[i] and res.cold_references:
                res.cold_references = await _flush_prefix_cache(client, root)
            try:
                got, finish = await _complete(client, root, model, p, max_tokens, stream=False,
                                              structured=kinds[i] and kinds[i][1],
                                              logprobs=logprobs)
                check(-1, i, False, got.text, finish)
                ref.append(got)
            except Exception as e:  # noqa: BLE001 - reported, the soak goes on
                res.errors.append(f"reference {i}: {e}")
                ref.append(None)
            res.requests += 1
            res.structured += kinds[i] is not None
        sem = asyncio.Semaphore(concurrency)

        async def one(rnd: int, i: int, stream: bool, leave_after: int) -> None:
            async with sem:
                try:
                    got, finish = await _complete(client, root, model, ps[i], max_tokens,
                                                  stream, structured=kinds[i] and kinds[i][1],
                                                  leave_after=leave_after)
                except Exception as e:  # noqa: BLE001
                    res.errors.append(f"round {rnd} prompt {i}: {e}")
                    return
            partial = leave_after > 0 and finish is None
            res.disconnected += partial
            if not partial:
                check(rnd, i, stream, got.text, finish)
            if ref[i] is None:
                return
            res.compared += 1
            verdict, detail = judge(got.text, ref[i], tie_gap, partial=partial)
            if verdict != "same":
                entry = {"round": rnd, "prompt": i, "stream": stream, "partial": partial,
                         "prompt_len": len(ps[i]), "prefix_hit_candidate": extends[i], **detail}
                (res.ties if verdict == "tie" else res.mismatches).append(entry)

        n_leave = round(disconnect_fraction * prompts)
        for rnd in range(rounds):
            order = list(range(prompts))
            rng.shuffle(order)
            streamed = [j for j in range(prompts) if j % 2 == 1]
            leaving = set(rng.sample(streamed, min(n_leave, len(streamed))))
            await asyncio.gather(*(
                one(rnd, i, j % 2 == 1,
                    rng.randint(1, max(1, max_tokens // 2)) if j in leaving else 0)
                for j, i in enumerate(order)))
            res.requests += prompts
            res.structured += sum(k is not None for k in kinds)
        res.max_mismatches = int(max_decisive_fraction * res.compared)
        if check_idle and res.idle_before is not None:
            res.idle_after, res.leaks, _ = await soakcheck.wait_idle(
                client, root, res.idle_before, idle_timeout)
            hits = [(x or {}).get("prefix_cache_hits") for x in (res.idle_before, res.idle_after)]
            if None not in hits:
                res.prefix_cache_hits = hits[1] - hits[0]
        elif prefix_every > 1:
            res.prefix_cache_hits = (await soakcheck.snapshot(client, root) or {}).get(
                "prefix_cache_hits")
    res.seconds = time.monotonic() - t0
    return res


async def _flush_prefix_cache(client, root: str) -> bool:
    """Drop the server's prefix cache (vLLM's and tailored's route); False when it has none."""
    try:
        r = await client.post(f"{root}/reset_prefix_cache")
    except Exception:  # noqa: BLE001
        return False
    return r.status_code == 200


def _tie_gap_of(report: str) -> float:
    """The tie gap a `tailored gate` report used (its thresholds, floor-widened on the GPU)."""
    return float(json.loads(Path(report).read_text())["thresholds"]["tie_logit_gap"])


def summary(res: SoakResult) -> dict:
    return {"requests": res.requests, "structured": res.structured,
            "disconnected": res.disconnected, "compared": res.compared,
            "seconds": res.seconds, "errors": res.errors, "mismatches": res.mismatches,
            "max_mismatches": res.max_mismatches, "ties": res.ties,
            "outside_grammar": res.outside_grammar, "prefix_cache_hits": res.prefix_cache_hits,
            "cold_references": res.cold_references, "idle_before": res.idle_before,
            "idle_after": res.idle_after, "leaks": res.leaks, "ok": res.ok}


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
    ap.add_argument("--disconnect-fraction", type=float, default=0.0,
                    help="share of each round's requests whose client leaves mid-stream "
                         "(0..0.5, default 0)")
    ap.add_argument("--tie-gap", type=float, default=0.0,
                    help="a difference where the reference's top-2 logprobs were within this "
                         "is a tie, allowed (default 0: every difference counts)")
    ap.add_argument("--tie-gap-from", default=None, metavar="GATE_REPORT",
                    help="take --tie-gap from a `tailored gate --report` JSON (thresholds)")
    ap.add_argument("--max-decisive-fraction", type=float, default=0.0,
                    help="share of compared answers that may differ decisively (default 0)")
    ap.add_argument("--no-cold-references", action="store_true",
                    help="do not flush the prefix cache before extending prompts' references")
    ap.add_argument("--no-idle-check", action="store_true",
                    help="do not compare the server's requests, pages and slots before/after")
    ap.add_argument("--idle-timeout", type=float, default=30.0,
                    help="seconds the server gets to return to idle (default 30)")
    ap.add_argument("--json", default=None, help="write the report here")
    a = ap.parse_args(argv)
    try:
        lo, hi = (int(x) for x in a.token_id_range.split(","))
    except ValueError:
        ap.error(f"--token-id-range must be LO,HI, got {a.token_id_range!r}")
    for name in ("prompts", "concurrency", "rounds", "max_tokens", "max_prompt_len"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0.0 <= a.disconnect_fraction <= 0.5:
        ap.error("--disconnect-fraction must be in [0, 0.5]")
    tie_gap = _tie_gap_of(a.tie_gap_from) if a.tie_gap_from else a.tie_gap
    res = asyncio.run(soak(a.base_url, prompts=a.prompts,
                           concurrency=a.concurrency, rounds=a.rounds, max_tokens=a.max_tokens,
                           token_id_range=(lo, hi), seed=a.seed, max_prompt_len=a.max_prompt_len,
                           structured_every=a.structured_every, prefix_every=a.prefix_every,
                           disconnect_fraction=a.disconnect_fraction, tie_gap=tie_gap,
                           max_decisive_fraction=a.max_decisive_fraction,
                           cold_references=not a.no_cold_references,
                           check_idle=not a.no_idle_check, idle_timeout=a.idle_timeout))
    print(f"soak: {res.requests} requests in {res.seconds:.1f} s ({res.disconnected} left "
          f"mid-stream), {len(res.errors)} errors, {len(res.mismatches)} of {res.compared} "
          f"answers differing decisively from the same request alone (allowed "
          f"{res.max_mismatches}), {len(res.ties)} ties within {tie_gap:g}, "
          f"{len(res.outside_grammar)} of {res.structured} structured answers outside their "
          f"grammar, {len(res.leaks)} leaks -> {'OK' if res.ok else 'FAIL'}")
    if res.prefix_cache_hits is not None:
        print(f"  server prefix-cache hits: {res.prefix_cache_hits:.0f} tokens "
              f"(references of extending prompts cold: {res.cold_references})")
    print(f"  idle before: {res.idle_before}; after: {res.idle_after}")
    for e in res.errors[:5]:
        print("  error:", e)
    for m in res.mismatches[:5]:
        print(f"  mismatch: round {m['round']} prompt {m['prompt']} (len {m['prompt_len']}, "
              f"stream {m['stream']}) at char {m['first_diff_char']}: got {m['got']!r} "
              f"want {m['want']!r} (gap {m.get('gap')})")
    for m in res.outside_grammar[:5]:
        print(f"  outside its grammar: round {m['round']} prompt {m['prompt']} ({m['kind']}, "
              f"finish {m['finish']}): {m['text']!r}")
    for leak in res.leaks:
        print("  leak:", leak)
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "tie_gap": tie_gap,
                                            **summary(res)}, indent=1))
    return 0 if res.ok else 1


if __name__ == "__main__":
    sys.exit(main())
