"""The first mixed steps of a cold engine against later ones, profiled (kb/0034 §1).

Why: in session 16's FP8 side by side the first 4 mixed steps (prompts arriving beside ~26
decode rows) took 664 ms each, later ones 161-241 ms, and no Triton compile was logged. Whatever
runs for the first time there (an autotune, an allocation, a library's first call) shows up as
GPU or host time that round 0 has and later rounds do not.

The engine is built as `tailored serve` builds it (dummy weights at full size on the GPU; the
embedded model on the CPU), but driven in-process and synchronously (no async scheduling), so
each `Engine.step` is one step. `--running` greedy requests decode; then, each round,
`--arrive` new prompts arrive and the steps until each has its first token are timed, rounds 0
and last under torch.profiler. Prints each round's steps (kind, tokens, ms) and the profiler's
top ops by device time (CUDA) or CPU time.

    python scripts/profile_mixed.py /tmp/full-fp8 --load-format dummy [--rounds 3]
    python scripts/profile_mixed.py --input-len 48 --running 3 --arrive 2 --batch-tokens 128  # CPU
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("ckpt", nargs="?", default=None, help="checkpoint dir (none: embedded model)")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    ap.add_argument("--running", type=int, default=24, help="requests decoding throughout")
    ap.add_argument("--arrive", type=int, default=8, help="prompts arriving each round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--batch-tokens", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--top", type=int, default=25, help="profiler rows")
    args = ap.parse_args()

    import torch

    from tailored.bench.loadgen import REGULAR_TOKEN_IDS, random_token_prompts
    from tailored.engine.types import SamplingParams
    from tailored.stack import build_stack

    cuda = torch.cuda.is_available()
    n_all = args.running + args.arrive * args.rounds
    st = build_stack(args.ckpt, load_format=args.load_format, progress=False,
                     max_model_len=args.input_len + 1024, max_num_seqs=max(n_all, 8),
                     max_num_batched_tokens=args.batch_tokens, prefill_graphs="auto",
                     async_scheduling=False)
    eng = st.engine
    # the embedded CPU model's vocabulary has 4,065 ids (README: --token-id-range 0,4000)
    id_range = REGULAR_TOKEN_IDS if cuda else (0, 4000)
    prompts = iter(random_token_prompts(n_all, args.input_len, 0, id_range))

    def prompt():
        return next(prompts)

    sp = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step():
        """One engine step: (requests with their first token, decode rows, wall ms)."""
        sched_before = {r: len(v) for r, v in seen.items()}
        t = time.perf_counter()
        outs = eng.step()
        sync()
        ms = (time.perf_counter() - t) * 1e3
        ids = set()
        for o in outs:
            seen.setdefault(o.request_id, []).extend(o.delta_token_ids)
            ids.add(o.request_id)
        dec = sum(1 for r in ids if sched_before.get(r, 0) > 0)
        return len(ids) - dec, dec, ms

    seen: dict[str, list[int]] = {}
    for i in range(args.running):
        eng.add_request(f"run{i}", prompt(), sp)
    while len(seen) < args.running:  # every running request past its prompt
        step()
    for _ in range(3):
        step()
    act = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA]
                                                     if cuda else [])
    for rnd in range(args.rounds):
        new = [f"r{rnd}-{i}" for i in range(args.arrive)]
        for rid in new:
            eng.add_request(rid, prompt(), sp)
        prof = (torch.profiler.profile(activities=act)
                if rnd in (0, args.rounds - 1) else None)
        rows = []
        if prof is not None:
            prof.__enter__()
        try:
            while not all(r in seen for r in new):
                first, dec, ms = step()
                rows.append((first, dec, ms))
        finally:
            if prof is not None:
                prof.__exit__(None, None, None)
        total = sum(r[2] for r in rows)
        print(f"round {rnd}: {len(rows)} steps, {total:.1f} ms until all {args.arrive} "
              f"arrivals had a token; steps (first tokens, decode rows, ms): "
              + ", ".join(f"({a}, {b}, {c:.1f})" for a, b, c in rows), flush=True)
        if prof is not None:
            key = "cuda_time_total" if cuda else "cpu_time_total"
            print(prof.key_averages().table(sort_by=key, row_limit=args.top), flush=True)
    for rid in list(seen):
        eng.abort_request(rid)
    return 0


if __name__ == "__main__":
    sys.exit(main())
