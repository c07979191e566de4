"""Compare two `tailored gate` reports number by number: did a change move any result?

    python3 lab/compare_gates.py BEFORE.json AFTER.json [--tol 0]

Walks both reports' results (overall, noise floor, per prompt, vs the bf16 reference; not the
manifest, thresholds or timings) and prints every value that differs by more than --tol
(default 0: a refactor that moves no arithmetic must reproduce every bit), with the engine
texts compared too. Exit 0 when nothing differs, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

SKIP = {"manifest", "thresholds", "timings", "notes"}


def walk(a, b, path, out, tol):
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if not path and k in SKIP:
                continue
            if k not in a or k not in b:
                out.append(f"{path}/{k}: only in {'after' if k in b else 'before'}")
                continue
            walk(a[k], b[k], f"{path}/{k}", out, tol)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            out.append(f"{path}: {len(a)} items before, {len(b)} after")
        for i, (x, y) in enumerate(zip(a, b)):
            name = x.get("name", i) if isinstance(x, dict) else i
            walk(x, y, f"{path}[{name}]", out, tol)
    elif isinstance(a, float) and isinstance(b, float):
        if not (a == b or (math.isnan(a) and math.isnan(b)) or abs(a - b) <= tol):
            out.append(f"{path}: {a!r} -> {b!r}")
    elif a != b:
        out.append(f"{path}: {a!r} -> {b!r}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--tol", type=float, default=0.0)
    args = ap.parse_args(argv)
    a = json.load(open(args.before))
    b = json.load(open(args.after))
    out: list[str] = []
    walk(a, b, "", out, args.tol)
    verdict = (f"passed: before {a.get('passed')}, after {b.get('passed')}; overall top1 "
               f"{a.get('overall', {}).get('top1')} -> {b.get('overall', {}).get('top1')}")
    print(verdict)
    if out:
        print(f"{len(out)} values differ:")
        print("\n".join(out[:200]))
        return 1
    print("every result identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
