#!/usr/bin/env python3
"""A decode batch with structured requests beside plain ones, async scheduling on and off
(kb/0052): in-process, the real engine, scheduler and runner, one engine for both settings.

Why: until session 32 one structured request kept its whole batch synchronous (kb/0048), i.e.
every stream lost async scheduling's 11-20 % (kb/0025); now its rows are launched ahead
unmasked and sampled again once the previous token reached the grammar. This bench measures
what the plain streams get back: per setting and round, the same requests (PLAIN greedy
plain requests of --prompt-len random tokens, STRUCTURED greedy ones under a regex of digits
that never ends before --tokens) are added at once, prefilled, and decoded to --tokens; the
decode phase's wall time (from the first step after every request has its first token to the
last) gives tok/s and ms a step. Also "plain only" (no structured request) as the ceiling.
Tokens must agree across settings (greedy): the bench checks it.

Usage (GPU): python3 scripts/bench_structured_async.py /tmp/full [--plain 7] [--structured 1]
             [--tokens 256] [--rounds 3] [--json F]
CPU dry run: python scripts/bench_structured_async.py --nano --tokens 12 --rounds 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tailored.engine.types import SamplingParams, StructuredOutput
from tailored.stack import build_stack

DIGITS = StructuredOutput("regex", "[0-9]{1,4096}")  # never complete before max_tokens


def _run(engine, reqs: dict) -> tuple[dict, float, int, int]:
    """(tokens by id, decode-phase seconds, decode steps, steps launched ahead)."""
    for rid, (ids, sp) in reqs.items():
        engine.add_request(rid, ids, sp)
    # a grammar compiled on a thread admits its request a few steps late, so the prefill
    # batches (whose numerics depend on their rows) and with them the greedy tokens would
    # differ from a run whose grammar was cached (the first GPU run, session 33): warm-up
    # compiles it, and every measured run starts with all requests admitted
    assert not engine._compiling, "a grammar compiles during a measured run"
    out = {rid: [] for rid in reqs}
    t0 = None
    steps = ahead = 0
    while engine.has_unfinished():
        for o in engine.step():
            assert o.error is None, f"{o.request_id}: {o.error}"
            out[o.request_id] += o.delta_token_ids
        if t0 is None and all(out.values()):  # every request has its first token
            t0 = time.perf_counter()
        elif t0 is not None:
            steps += 1
            ahead += engine._inflight is not None
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - (t0 or time.perf_counter()), steps, ahead


def _diff(out: dict, ref: dict, tokenizer, structured: dict) -> list[str]:
    """One line per request whose tokens differ from the reference run's: where the two first
    part, both lengths, and for a structured request both texts (is the answer in its grammar?)."""
    lines = []
    for rid, want in ref.items():
        got = out[rid]
        if got == want:
            continue
        i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        line = f"{rid}: first differs at token {i}, lengths {len(got)} vs {len(want)}"
        if rid in structured:
            line += (f"; text {tokenizer.decode(got)[:80]!r} vs reference "
                     f"{tokenizer.decode(want)[:80]!r}")
        lines.append(line)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt", nargs="?", default=None)
    ap.add_argument("--nano", action="store_true", help="the embedded nano model on the CPU")
    ap.add_argument("--plain", type=int, default=7)
    ap.add_argument("--structured", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.nano:
        from tailored.stack import embedded_checkpoint

        st = build_stack(embedded_checkpoint(), device="cpu", dtype="float32", progress=False,
                         kernels="off", max_model_len=a.prompt_len + a.tokens + 64,
                         max_num_seqs=a.plain + a.structured + 1, async_scheduling=True)
    else:
        st = build_stack(a.ckpt, load_format="dummy", device="cuda", dtype="bfloat16",
                         progress=False, max_model_len=a.prompt_len + a.tokens + 64,
                         max_num_seqs=a.plain + a.structured + 1, async_scheduling=True)
    engine = st.engine
    vocab = min(st.model_config.vocab_size, 240000)
    g = torch.Generator().manual_seed(0)

    def prompt():
        return torch.randint(0, vocab, (a.prompt_len,), generator=g).tolist()

    plain = {f"p{i}": (prompt(), SamplingParams(max_tokens=a.tokens, temperature=0.0,
                                                ignore_eos=True)) for i in range(a.plain)}
    structured = {f"s{i}": (prompt(), SamplingParams(max_tokens=a.tokens, temperature=0.0,
                                                     structured=DIGITS))
                  for i in range(a.structured)}
    cases = {"plain only": plain, "with structured": {**plain, **structured}}
    # "async off" first: the synchronous engine's tokens are the reference
    settings = {"async off": (False, False), "async on": (True, True),
                # structured requests keeping the batch synchronous, as before session 32
                "async, structured sync": (True, False)}
    rows, want = [], {}
    warm = {k: (ids, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
            for k, (ids, _) in list(plain.items())[:2]}
    for rid, (ids, sp) in list(structured.items())[:1]:  # the grammar's compile, cached
        engine.add_request(rid, ids, SamplingParams(max_tokens=4, temperature=0.0,
                                                    structured=DIGITS))
    while engine.has_unfinished():
        engine.step()
    _run(engine, warm)  # warm-up (Triton compiles, graphs)
    for r in range(a.rounds):
        for case, reqs in cases.items():
            for name, (on, structured_ahead) in settings.items():
                engine._async = on
                engine.scheduler.structured_ahead = structured_ahead
                out, secs, steps, ahead = _run(engine, reqs)
                first = want.setdefault(case, out)
                diff = _diff(out, first, st.tokenizer, structured)
                for line in diff:
                    print(f"  differs ({case} / {name}, round {r}): {line}", flush=True)
                n_plain = sum(len(out[k]) for k in plain) - len(plain)  # decode-phase tokens
                rows.append({"round": r, "case": case, "setting": name, "steps": steps,
                             "ahead": ahead, "decode_s": secs,
                             "ms_per_step": 1e3 * secs / max(steps, 1),
                             "plain_tok_s": n_plain / secs if secs else 0.0,
                             "tokens_equal": not diff, "diff": diff})
                print(f"round {r} {case:<16} {name:<23} {rows[-1]['ms_per_step']:7.3f} ms/step "
                      f"{rows[-1]['plain_tok_s']:9.1f} plain tok/s  ahead {ahead}/{steps}"
                      f"  tokens {'equal' if not diff else 'DIFFER'}",
                      flush=True)
    table = []
    for case in cases:
        for name in settings:
            sel = [x for x in rows if x["case"] == case and x["setting"] == name]
            table.append((case, name, statistics.median(x["ms_per_step"] for x in sel),
                          statistics.median(x["plain_tok_s"] for x in sel),
                          sel[-1]["ahead"], sel[-1]["steps"],
                          sum(x["tokens_equal"] for x in sel), len(sel)))
    if a.json:
        from tailored.gate.manifest import script_manifest

        man = script_manifest(vars(a))
        with open(a.json, "w") as f:
            json.dump({"manifest": man, "rows": rows}, f, indent=1)
    print("\n| case | setting | ms/step (median) | plain tok/s | steps ahead | runs with the "
          "sync tokens |\n|---|---|---|---|---|---|")
    for case, name, ms, tps, ahead, steps, eq, n in table:
        print(f"| {case} | {name} | {ms:.3f} | {tps:.1f} | {ahead}/{steps} | {eq}/{n} |")
    if any(not x["tokens_equal"] for x in rows):
        raise SystemExit("tokens differ from the synchronous engine's (see 'differs' lines)")


if __name__ == "__main__":
    main()
