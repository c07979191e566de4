#!/usr/bin/env python3
"""Acceptance of prompt-lookup (n-gram) drafts, MTP drafts and both on the nano model (CPU),
by kind of prompt: code edits, JSON, quoting (kb/0062).

In-process, the real engine, scheduler and runner (plain PyTorch path, fp32), one greedy
request at a time (c = 1). For each setting and category it reports the drafts proposed and
kept, the acceptance rate (kept / proposed), the mean acceptance length (tokens a verify step
emits: 1 + kept / verify steps), the tokens a decode step emits over every decode step (steps
that verify nothing included), and whether every completion equals the one without drafts
(it must: verification keeps the greedy output), and a modelled speed against no drafts:
tokens a step / (1 + ROW_COST · drafts verified a step), ROW_COST being what one more row costs
a c=1 verify step on the H200 (kb/0033 §2.3: 3 rows 5.8 ms against 3.46 ms for one, GPU
span); the MTP head's own run and the host's time are not in it.

The nano model (docs/nano.md) writes Python-shaped text and was trained on Python source and
licence texts, on 512-token windows: the prompts are completions in that style (the chat
template would be out of its distribution), and what it writes after them is often not what
the prompt asks for. The numbers measure the drafters on this model's text, not on
Qwen3.6's.

Usage: python lab/ngram_acceptance.py [--drafts 3] [--max-tokens 96] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tailored.engine.types import SamplingParams  # noqa: E402
from tailored.stack import build_stack  # noqa: E402

CODE = [
    ("def area(width, height):\n    total = width * height\n    return total\n\n\n"
     "# the same function with width renamed to w\n"
     "def area(w, height):\n"),
    ("class Reader:\n    def __init__(self, path, mode='r'):\n        self.path = path\n"
     "        self.mode = mode\n        self.handle = None\n\n    def open(self):\n"
     "        self.handle = open(self.path, self.mode)\n        return self.handle\n\n"
     "    def close(self):\n        if self.handle is not None:\n"
     "            self.handle.close()\n            self.handle = None\n\n\n"
     "# Reader again, with path renamed to filename\n"
     "class Reader:\n    def __init__(self, filename, mode='r'):\n"),
    ("def parse_args(argv):\n    parser = argparse.ArgumentParser()\n"
     "    parser.add_argument('--input', default=None)\n"
     "    parser.add_argument('--output', default=None)\n"
     "    parser.add_argument('--verbose', action='store_true')\n"
     "    return parser.parse_args(argv)\n\n\n"
     "def parse_args(argv):\n    parser = argparse.ArgumentParser()\n"),
    ("for i in range(len(items)):\n    item = items[i]\n    if item is None:\n"
     "        continue\n    result.append(item.value)\n\n"
     "# the loop with i renamed to index\n"
     "for index in range(len(items)):\n"),
]
JSON = [
    ('config = {"name": "tailored", "version": 3, "tags": ["engine", "moe"], '
     '"max_tokens": 512, "stream": True}\n\n# the same dict, one key per line\nconfig = {\n'
     '    "name": "tailored",\n'),
    ('records = [\n    {"id": 1, "user": "alice", "role": "admin", "active": True},\n'
     '    {"id": 2, "user": "bob", "role": "viewer", "active": False},\n'
     '    {"id": 3, "user": "carol", "role": "editor", "active": True},\n]\n\n'
     '# the users only\nusers = [\n    {"id": 1, "user": "alice"},\n'),
    ('payload = {"model": "qwen36-35b-a3b", "messages": [{"role": "user", "content": '
     '"hello"}], "temperature": 0, "max_tokens": 16}\n'
     'expected = {"model": "qwen36-35b-a3b", "messages": [{"role": "user", '),
    ('DEFAULTS = {\n    "host": "127.0.0.1",\n    "port": 8000,\n    "page_size": 16,\n'
     '    "max_num_seqs": 64,\n    "max_model_len": 16384,\n}\n\n'
     'def defaults():\n    return {\n        "host": "127.0.0.1",\n'),
]
QUOTE = [
    ("Permission is hereby granted, free of charge, to any person obtaining a copy of this "
     "software and associated documentation files (the \"Software\"), to deal in the Software "
     "without restriction, including without limitation the rights to use, copy, modify, "
     "merge, publish, distribute, sublicense, and/or sell copies of the Software.\n\n"
     "Quoted again:\n\nPermission is hereby granted, free of charge, to any person"),
    ("This program is free software; you can redistribute it and/or modify it under the terms "
     "of the GNU General Public License as published by the Free Software Foundation; either "
     "version 2 of the License, or (at your option) any later version.\n\n"
     "The notice reads: \"This program is free software; you can"),
    ('"""Return the number of items in the queue.\n\n    The count is approximate: another '
     'thread may add or remove items between the call and the use of its result.\n    """\n\n'
     '# the docstring, quoted\n"""Return the number of items'),
    ("THE SOFTWARE IS PROVIDED \"AS IS\", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR IMPLIED, "
     "INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY, FITNESS FOR A PARTICULAR "
     "PURPOSE AND NONINFRINGEMENT.\n\nAs the licence says: THE SOFTWARE IS PROVIDED"),
]
CATEGORIES = {"code edit": CODE, "json": JSON, "quote": QUOTE}
ROW_COST = 0.34  # a verify step's cost per draft row, in decode steps (H200, c=1, kb/0033)

# (label, EngineConfig fields); drafts: --drafts
SETTINGS = [
    ("ngram 2..4", dict(speculative_method="ngram")),
    ("ngram 1..4", dict(speculative_method="ngram", prompt_lookup_min=1)),
    ("mtp", dict(speculative_method="mtp")),
    ("ngram+mtp", dict(speculative_method="ngram+mtp")),
]


def run(engine, prompts, max_tokens: int) -> tuple[list, int]:
    """Greedy completions of `prompts`, one at a time: (token ids each, decode steps)."""
    outs, decode_steps = [], 0
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                        ignore_eos=True))
        got, steps = [], 0
        while engine.has_unfinished():
            for o in engine.step():
                got.extend(o.delta_token_ids)
            steps += 1
        outs.append(got)
        decode_steps += steps - 1  # the first step is the prompt's
    return outs, decode_steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafts", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--json", default=None, help="write the rows here too")
    args = ap.parse_args()
    torch.set_num_threads(1)  # the nano model's small ops: faster on one thread

    def stack(**kw):
        return build_stack(None, device="cpu", dtype="float32", progress=False, kernels="off",
                           max_model_len=1024, max_num_seqs=4, async_scheduling=False, **kw)

    tok = stack().tokenizer
    prompts = {c: [tok.encode(p) for p in ps] for c, ps in CATEGORIES.items()}
    base = {}
    plain = stack().engine
    for cat, ps in prompts.items():
        base[cat] = run(plain, ps, args.max_tokens)
    rows = []
    print(f"nano, CPU, greedy, c=1, {args.max_tokens} tokens a prompt, up to {args.drafts} "
          "drafts a step; `adaptive`: spec_min_acceptance 0.5 (the default), `fixed`: 0")
    print(f"{'setting':<22} {'category':<10} {'drafts':>6} {'kept':>5} {'accept':>7} "
          f"{'tok/verify':>10} {'tok/step':>8} {'model':>6}  same")
    for label, kw in SETTINGS:
        for pace, ma in (("fixed", 0.0), ("adaptive", 0.5)):
            eng = stack(num_speculative_tokens=args.drafts, spec_max_running=4,
                        spec_min_acceptance=ma, **kw).engine
            for cat, ps in prompts.items():
                before = list(eng.runner.spec_stats)
                outs, steps = run(eng, ps, args.max_tokens)
                verify, drafts, kept = (a - b for a, b in zip(eng.runner.spec_stats, before))
                n_out = sum(len(o) for o in outs) - len(outs)  # tokens of decode steps
                row = dict(setting=f"{label} {pace}", category=cat, drafts=drafts, kept=kept,
                           verify_steps=verify, acceptance=kept / drafts if drafts else 0.0,
                           mean_acceptance_length=1 + kept / verify if verify else 1.0,
                           tokens_per_step=n_out / steps,
                           modelled_speedup=n_out / (steps + ROW_COST * drafts),
                           same=outs == base[cat][0])
                rows.append(row)
                print(f"{row['setting']:<22} {cat:<10} {drafts:>6} {kept:>5} "
                      f"{row['acceptance']:>7.3f} {row['mean_acceptance_length']:>10.2f} "
                      f"{row['tokens_per_step']:>8.2f} {row['modelled_speedup']:>5.2f}x  "
                      f"{'yes' if row['same'] else 'NO'}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
