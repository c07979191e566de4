"""Speculative decoding on the nano checkpoint through the engine (CPU, fp32, plain path).

For N = 0..3 drafts a step: the 17 recorded prompts of tailored/data/nano/nano_eval.json
(`def fibonacci(n):` and 16 held-out code prompts), 48 greedy tokens each, one request at a time
and 8 at a time. Prints per N: whether every completion equals the recorded one, drafts kept,
tokens per verify step, engine steps, and wall time (CPU plain path: not a speed figure).
Usage: python scripts/spec_nano.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import tailored
from tailored.engine.types import SamplingParams
from tailored.stack import build_stack

NANO = Path(tailored.__file__).parent / "data" / "nano"


def run(n: int, items, concurrent: bool) -> dict:
    st = build_stack(NANO, device="cpu", dtype="float32", progress=False, kernels="off",
                     async_scheduling=False, max_model_len=1024, max_num_seqs=32,
                     num_speculative_tokens=n)
    eng = st.engine
    sp = SamplingParams(max_tokens=48, temperature=0)
    outs, steps, t0 = {}, 0, time.perf_counter()
    # 8 at once: EngineConfig.spec_max_running, the most running requests that still draft
    batches = [items[:8], items[8:16], items[16:]] if concurrent else [[it] for it in items]
    for batch in batches:
        for i, it in enumerate(batch):
            eng.add_request(it["prompt"], it["prompt_ids"], sp)
        while eng.has_unfinished():
            for o in eng.step():
                outs.setdefault(o.request_id, []).extend(o.delta_token_ids)
            steps += 1
    wall = time.perf_counter() - t0
    verify, drafted, kept = eng.runner.spec_stats
    return {"drafts": n, "concurrent": concurrent,
            "all_equal_recorded": all(outs[it["prompt"]] == it["completion_ids"] for it in items),
            "tokens": sum(len(v) for v in outs.values()), "engine_steps": steps,
            "verify_steps": verify, "drafts_verified": drafted, "drafts_kept": kept,
            "kept_rate": kept / drafted if drafted else None,
            "tokens_per_verify_step": 1 + kept / verify if verify else None,
            "wall_s": round(wall, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    items = json.loads((NANO / "nano_eval.json").read_text())["items"]
    rows = [run(n, items, c) for c in (False, True) for n in (0, 1, 2, 3)]
    print("| drafts | requests | equal to recorded | kept / drafted | tokens a verify step "
          "| engine steps | CPU wall s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        kr = "—" if r["kept_rate"] is None else f"{r['drafts_kept']}/{r['drafts_verified']} = {r['kept_rate']:.3f}"
        tv = "—" if r["tokens_per_verify_step"] is None else f"{r['tokens_per_verify_step']:.2f}"
        print(f"| {r['drafts']} | {'8 at a time' if r['concurrent'] else 'one at a time'} | "
              f"{r['all_equal_recorded']} | {kr} | {tv} | {r['engine_steps']} | {r['wall_s']} |")
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
