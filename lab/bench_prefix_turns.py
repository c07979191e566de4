#!/usr/bin/env python3
"""Prefix caching on chats (kb/0053, kb/0054): TTFT of a chat's next turn and of a new chat
under the same system prompt, with the cache against without, and what the cache costs the
first turn (its prefill ends chunks at the save points: more steps).

In-process, the real engine, scheduler and runner, one request at a time (c=1 TTFT, no HTTP):
for each of --convs conversations, a system message = `<|im_start|>system` (the tokenizer's
ids) and --context random ids; turn 1 = that, `<|im_start|>`, a 32-id question, then
`<|im_start|>` and a few generation-prompt ids (as the chat template ends a prompt); turn 2 =
turn 1 up to its last `<|im_start|>`, an answer and a new message (--new ids), `<|im_start|>`
and the generation prompt again (hits turn 1's last save point); new chat = the system
message, another question and the generation prompt (hits the system message's end). Each
request decodes --tokens greedy tokens. Both settings run the same ids; the greedy tokens of
turn 2 and of the new chat are compared (reported: in bf16 the hit's prefill splits where
the cold one does not, and random weights' near-ties may follow; the exact check is the fp32
tests/gpu/test_gpu_invariance.py -k prefix). Each setting runs in a process of its own (`--one`).

Usage (GPU): python3 lab/bench_prefix_turns.py /tmp/full [--context 8192] [--new 256]
             [--convs 4] [--tokens 8] [--json F]
CPU dry run: python lab/bench_prefix_turns.py --nano --context 300 --new 40 --convs 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from kernel_bench import engine_stack

from tailored.engine.types import SamplingParams

IM_START = "<|im_start|>"


def _ttft(engine, rid: str, ids: list[int], sp: SamplingParams) -> tuple[float, list[int]]:
    """(seconds from add_request to the first token, all tokens) of one request alone."""
    t0 = time.perf_counter()
    engine.add_request(rid, ids, sp)
    first, out = None, []
    while engine.has_unfinished():
        for o in engine.step():
            assert o.error is None, f"{rid}: {o.error}"
            if o.delta_token_ids and first is None:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                first = time.perf_counter() - t0
            out += o.delta_token_ids
    return first, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt", nargs="?", default=None)
    ap.add_argument("--nano", action="store_true", help="the embedded nano model on the CPU")
    ap.add_argument("--context", type=int, default=8192, help="turn 1's ids before its gen prompt")
    ap.add_argument("--new", type=int, default=256, help="turn 2's answer + new message ids")
    ap.add_argument("--convs", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--entries", type=int, default=16)
    ap.add_argument("--json", default=None)
    ap.add_argument("--one", type=int, default=None,
                    help="(internal) run this entries setting alone; print its JSON last")
    a = ap.parse_args()
    if a.one is not None:
        print(json.dumps(_setting(a, a.one)))
        return
    # each setting in its own process: a second full-size model beside the first's leftovers
    # (CUDA graph pools, the allocator's cache) ran out of memory on an H100 (kb/0054 §2)
    results, tokens = {}, {}
    for entries in (0, a.entries):
        cmd = [sys.executable, __file__, *sys.argv[1:], "--one", str(entries)]
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
        lines = proc.stdout.strip().splitlines()
        print("\n".join(lines[:-1]), flush=True)
        if proc.returncode or not lines:
            raise SystemExit(f"entries={entries}: exit {proc.returncode}")
        r = json.loads(lines[-1])
        results[r["name"]] = {"rows": r["rows"], "hits": r["hits"]}
        for c, out2 in enumerate(r["turn2_tokens"]):
            tokens.setdefault(c, []).append(out2)
    same = all(len(set(map(tuple, v))) == 1 for v in tokens.values())
    print(f"turn 2 and new-chat tokens {'equal' if same else 'differ'} with and without the "
          "cache")
    if a.json:
        from tailored.gate.manifest import script_manifest

        man = script_manifest(vars(a))
        with open(a.json, "w") as f:
            json.dump({"manifest": man, "results": results, "tokens_equal": same}, f, indent=1)


def _setting(a, entries: int) -> dict:
    """One engine with `entries` prefix-cache entries (0: off): the conversations' TTFTs."""
    kw = dict(progress=False, max_model_len=a.context + a.new + a.tokens + 64,
              max_num_seqs=4, prefix_cache_entries=entries)
    st = engine_stack(a.ckpt, a.nano, **kw)
    engine = st.engine
    im_start = st.tokenizer.token_to_id(IM_START)
    vocab = min(st.model_config.vocab_size, 240000)
    g = torch.Generator().manual_seed(0)

    def rand(n):
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    sp = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True)
    _ttft(engine, "warm", rand(a.context) + [im_start] + rand(4), sp)  # compiles, graphs
    _ttft(engine, "warm2", rand(a.context // 2) + [im_start] + rand(4), sp)
    lead = st.tokenizer.encode("<|im_start|>system", allow_special=True)
    rows, outs = [], []
    for c in range(a.convs):
        system = lead + rand(a.context)
        turn1 = system + [im_start] + rand(32) + [im_start] + rand(4)
        turn2 = turn1[:-5] + rand(a.new) + [im_start] + rand(4)
        chat2 = system + [im_start] + rand(32) + [im_start] + rand(4)
        t1, _ = _ttft(engine, f"c{c}t1", turn1, sp)
        t2, out2 = _ttft(engine, f"c{c}t2", turn2, sp)
        t3, out3 = _ttft(engine, f"c{c}new", chat2, sp)
        rows.append({"conv": c, "turn1_ttft_ms": 1e3 * t1, "turn2_ttft_ms": 1e3 * t2,
                     "new_chat_ttft_ms": 1e3 * t3})
        outs.append(out2 + out3)
    name = f"prefix cache {entries}" if entries else "prefix cache off"
    hits = engine.scheduler.prefix.hits if engine.scheduler.prefix else 0
    med = {k: statistics.median(r[k] for r in rows)
           for k in ("turn1_ttft_ms", "turn2_ttft_ms", "new_chat_ttft_ms")}
    print(f"{name:<18} TTFT ms: turn 1 {med['turn1_ttft_ms']:8.2f}   turn 2 "
          f"{med['turn2_ttft_ms']:8.2f}   new chat, same system {med['new_chat_ttft_ms']:8.2f}"
          f"   hits {hits} tokens", flush=True)
    return {"name": name, "rows": rows, "hits": hits, "turn2_tokens": outs}


if __name__ == "__main__":
    main()
