"""Golden outputs: committed reference results for the gate prompts, and the check against them.

Layout of a golden directory (eval/golden/tiny/, written by lab/make_golden.py):
  manifest.json   how they were made (manifest.py fields, options, `reason`: the kb/ entry that
                  justified this regeneration — policy in kb/0002-golden-outputs.md)
  prompts.jsonl   one line per prompt:
                    name, prompt_tokens, prompt_ids_sha256
                    tokens        the reference's own greedy continuation (HF cache decode), N ids
                    gap_top2      its top-1 − top-2 logit gap at each generated step
                    positions     teacher-forced positions (metrics.scored_positions over prompt +
                                  `tokens`), each with
                    top_ids, top_logprobs   the reference's top-5 ids and log-probabilities

Tolerances of `check_engine` (fp32 engine vs fp32 goldens; measured engine vs reference on the
tiny preset: max |logit err| ≈ 1e-4, so logprobs agree to ~2e-4):
  LOGPROB_TOL = 1e-3 nats for each golden top-5 id — 5× margin for another CPU / BLAS build
    summing in another order, still well below what a real change moves (tests/tools/test_gate.py's
    nudged weight moves logits by > 1e-2);
  TIE_GAP = 2e-3: a greedy or top-1 disagreement is excused only where the golden's own top-2
    logit gap is ≤ 2 · 1e-3 (two values each off by ≤ 1e-3 can swap only then); positions after
    an excused divergence are not compared (the contexts differ).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tailored.gate import metrics as M
from tailored.gate.prompts import ids_sha256

LOGPROB_TOL = 1e-3
TIE_GAP = 2e-3
TOP_K = 5


def reference_entry(hf, name: str, ids: list[int], max_new_tokens: int, max_scored: int) -> dict:
    """The golden line of one prompt from the reference (greedy decode + teacher-forced top-5)."""
    from tailored.gate.reference import reference_greedy, reference_logits

    ref = reference_greedy(hf, ids, max_new_tokens)
    vals = ref.step_top[0]
    pos = M.scored_positions(len(ids), max_new_tokens, max_scored)
    top_ids, top_lp = [], []
    for s in range(0, len(pos), 32):
        logits = reference_logits(hf, ref.hidden[torch.tensor(pos[s:s + 32], device=ref.hidden.device)])
        lp, i = torch.log_softmax(logits, -1).topk(TOP_K, -1)
        top_ids += i.tolist()
        top_lp += [[round(float(x), 6) for x in row] for row in lp]
    return {"name": name, "prompt_tokens": len(ids), "prompt_ids_sha256": ids_sha256(ids),
            "tokens": ref.tokens, "gap_top2": [round(float(v[0] - v[1]), 6) for v in vals],
            "positions": pos, "top_ids": top_ids, "top_logprobs": top_lp}


def write_golden(out_dir: str | Path, manifest: dict, entries: list[dict]) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
    (out / "prompts.jsonl").write_text("".join(json.dumps(e) + "\n" for e in entries))


def read_golden(d: str | Path) -> tuple[dict, list[dict]]:
    d = Path(d)
    entries = [json.loads(line) for line in (d / "prompts.jsonl").read_text().splitlines() if line]
    return json.loads((d / "manifest.json").read_text()), entries


@torch.inference_mode()
def check_engine(engine, tokenizer, prompts, entries: list[dict], max_new_tokens: int) -> list[str]:
    """Run the prompts through `engine` (greedy, hidden states captured) and compare with the
    golden entries. Returns human-readable failures (empty = reproduced)."""
    from tailored.gate.engine_side import engine_greedy

    by_name = {e["name"]: e for e in entries}
    ids = {p.name: p.encode(tokenizer) for p in prompts}
    fails = []
    for name, i in ids.items():
        if name not in by_name:
            fails.append(f"{name}: no golden entry")
        elif ids_sha256(i) != by_name[name]["prompt_ids_sha256"]:
            fails.append(f"{name}: prompt ids changed (tokenizer or prompt file): regenerate "
                         "goldens with a kb/ reason")
    if fails:
        return fails
    toks, hidden = engine_greedy(engine, ids, max_new_tokens, capture=True)
    model = engine.runner.model
    for name, g in ((n, by_name[n]) for n in ids):
        T, got = g["prompt_tokens"], toks[name]
        n = next((k for k, (a, b) in enumerate(zip(got, g["tokens"])) if a != b), len(got))
        if n < len(got) and g["gap_top2"][n] > TIE_GAP:
            fails.append(f"{name}: greedy token {n} is {got[n]}, golden {g['tokens'][n]} "
                         f"(golden top-2 gap {g['gap_top2'][n]:.2e})")
            continue
        keep = [j for j, p in enumerate(g["positions"]) if p <= T - 1 + n]  # same context
        rows = torch.tensor([g["positions"][j] for j in keep], device=hidden[name].device)
        lp = torch.log_softmax(model.compute_logits(hidden[name][rows]), -1).cpu()
        gid = torch.tensor([g["top_ids"][j] for j in keep])
        glp = torch.tensor([g["top_logprobs"][j] for j in keep])
        err = (lp.gather(1, gid) - glp).abs()
        if float(err.max()) > LOGPROB_TOL:
            j = int(err.amax(1).argmax())
            fails.append(f"{name}: logprob error {float(err.max()):.2e} > {LOGPROB_TOL} at "
                         f"position {g['positions'][keep[j]]}")
        top1_bad = (lp.argmax(-1) != gid[:, 0]) & (glp[:, 0] - glp[:, 1] > TIE_GAP)
        if bool(top1_bad.any()):
            fails.append(f"{name}: top-1 differs at {int(top1_bad.sum())} positions")
    return fails
