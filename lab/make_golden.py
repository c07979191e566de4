#!/usr/bin/env python3
"""Regenerate golden outputs (reference greedy tokens + teacher-forced top-5 logprobs).

Policy (kb/0002-golden-outputs.md): goldens change only deliberately. Every run must name the
kb/ entry that explains why (--reason kb/NNNN-....md, which must exist); it is stored in the
manifest, and the commit that changes the goldens adds that entry.

    # CPU, tiny preset (the committed eval/golden/tiny/, fp32, seed 0), ~1 min on 2 cores
    python lab/make_golden.py --preset tiny --reason kb/0002-golden-outputs.md
    # H200, full size: reference in bf16 sharing the loaded weights (one 67 GB copy)
    python lab/make_golden.py /ckpt --device cuda --dtype bfloat16 \
        --out eval/golden/full --reason kb/NNNN-why.md
    # H200, full size without weights on disk: the gate's fixture (dummy, stable init, seed 0)
    python lab/make_golden.py /tmp/full --load-format dummy --dummy-init stable \
        --device cuda --dtype bfloat16 --out eval/golden/full --reason kb/0008-...md

The reference is transformers' Qwen3_5MoeForCausalLM (tailored/gate/reference.py); the engine is
not run, so goldens do not depend on the code they check.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch

from tailored.gate.golden import reference_entry, write_golden
from tailored.gate.manifest import manifest
from tailored.gate.prompts import DEFAULT_PROMPTS, ids_sha256, load_prompts, sha256_file
from tailored.gate.reference import load_reference


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint_dir", nargs="?", default=None)
    ap.add_argument("--preset", choices=["tiny"], default=None)
    ap.add_argument("--reason", required=True, help="kb/ entry explaining this regeneration")
    ap.add_argument("--out", default=None, help="default eval/golden/tiny or eval/golden/full")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-scored-positions", type=int, default=256)
    ap.add_argument("--reference-weights", choices=["checkpoint", "shared"], default=None,
                    help="default: checkpoint on cpu, shared on cuda")
    ap.add_argument("--load-format", choices=["auto", "dummy"], default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dummy-init", choices=["default", "stable"], default="default")
    ap.add_argument("--cpu-threads", type=int, default=0)
    args = ap.parse_args(argv)
    reason = REPO / args.reason if not Path(args.reason).is_absolute() else Path(args.reason)
    if not reason.is_file() or not reason.is_relative_to(REPO / "kb"):
        ap.error(f"--reason must be an existing file under kb/, got {args.reason}")
    if (args.preset is None) == (args.checkpoint_dir is None):
        ap.error("give a checkpoint directory or --preset tiny")
    if args.cpu_threads > 0:
        torch.set_num_threads(args.cpu_threads)
    from tailored.gate.run import preset_checkpoint
    from tailored.stack import build_stack

    t0 = time.monotonic()
    ckpt = preset_checkpoint(args.preset) if args.preset else Path(args.checkpoint_dir)
    out = Path(args.out or REPO / "eval" / "golden" / ("tiny" if args.preset else "full"))
    mode = args.reference_weights or ("shared" if args.device.startswith("cuda") else "checkpoint")
    # the engine stack only holds the weights here (smallest cache); the engine is not run
    stack = build_stack(ckpt, load_format=args.load_format, device=args.device, dtype=args.dtype,
                        seed=args.seed, progress=False, dummy_init=args.dummy_init, max_num_seqs=1, num_pages=2, max_model_len=16)
    hf = load_reference(stack.model_config, stack.engine.runner.model, mode, ckpt)
    prompts = load_prompts(args.prompts)
    entries, all_ids = [], []
    for p in prompts:
        ids = p.encode(stack.tokenizer)
        all_ids.append(ids)
        entries.append(reference_entry(hf, p.name, ids, args.max_new_tokens, args.max_scored_positions))
        print(f"{p.name:14s} T={len(ids):5d} {time.monotonic() - t0:6.1f} s", flush=True)
    man = manifest(device=torch.device(args.device), dtype=args.dtype, checkpoint=ckpt,
                   load_format=args.load_format, seed=args.seed, prompts_path=Path(args.prompts),
                   prompts_sha256=sha256_file(args.prompts), prompt_ids_sha256=ids_sha256(all_ids),
                   extra={"reason": str(reason.relative_to(REPO)), "reference_weights": mode,
                          "max_new_tokens": args.max_new_tokens,
                          "max_scored_positions": args.max_scored_positions,
                          "preset": args.preset, "top_k": 5, "dummy_init": args.dummy_init})
    write_golden(out, man, entries)
    print(f"wrote {out} in {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
