"""route_align on the GPU: µs per launch by batch rows, warps of its (align) program and with
or without the shared expert as expert E (kb/0019), against the torch path (route_topk +
moe_align + expert_partition) that the model takes above the `route_align_up_to` switch's rows
(kb/0021). 40 launches (one per layer) in a CUDA graph, replayed; prints a table.
Usage: python lab/bench_route.py [--batches 1,2,4,8] [--json F]
"""

from __future__ import annotations

import argparse
import json

import kernel_bench
import torch

from tailored.kernels import moe_route

E, K, LAYERS = 256, 8, 40


def time_graph(fn, reps: int) -> float:
    """µs per call of fn (which runs LAYERS launches), through one captured graph."""
    return kernel_bench.time_graph(lambda: (fn(), [])[1], LAYERS, reps, 1)[0]


def one_program(a) -> None:
    """Each batch through the one-program route_align and through the two-launch one (top-k
    programs + the sorting align program), same inputs, outputs compared."""
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for B in [int(b) for b in a.batches.split(",")]:
        logits = [torch.randn(B, E, device="cuda", dtype=torch.bfloat16, generator=g)
                  for _ in range(LAYERS)]
        ref_out = None
        for up_to in [int(x) for x in a.one_program_up_to.split(",")]:
            moe_route.ROUTE_ONE_PROGRAM_UP_TO = up_to

            def fn():
                return [moe_route.route_align(lg, K) for lg in logits]

            us = time_graph(fn, a.reps)
            out = fn()
            # bf16 ties may order tied experts differently between the two paths: compare sets
            same = ref_out is None or all(
                torch.equal(o[1].sort(-1).values, r[1].sort(-1).values)
                and torch.equal(o[3], r[3]) for o, r in zip(out, ref_out))
            ref_out = ref_out or out
            path = "one program" if B <= up_to else "two launches"
            rows.append(dict(batch=B, one_program_up_to=up_to, path=path, us=us, same_ids=same))
            print(f"| {B} | {path} | {us:.2f} | {same} |", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,2,4,8,16,32")
    ap.add_argument("--warps", default="1,2,4,8")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", default=None)
    ap.add_argument("--one-program-up-to", default="",
                    help="comma list of moe_route.ROUTE_ONE_PROGRAM_UP_TO values to time each "
                         "batch with (0 = always the two-launch path): which path wins at T <= 8")
    a = ap.parse_args()
    if a.one_program_up_to:
        one_program(a)
        return
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for B in [int(b) for b in a.batches.split(",")]:
        logits = [torch.randn(B, E + 1, device="cuda", dtype=torch.bfloat16, generator=g)
                  for _ in range(LAYERS)]
        bt = max(2, 1 << (B - 1).bit_length())
        for shared in (False, True):
            ref_out = None
            for w in [int(x) for x in a.warps.split(",")]:
                moe_route.ROUTE_ALIGN_WARPS[bt] = w

                def fn():
                    return [moe_route.route_align(lg[:, :E], K, lg[:, E:] if shared else None)
                            for lg in logits]

                us = time_graph(fn, a.reps)
                out = fn()
                same = ref_out is None or all(
                    all(torch.equal(p, q) for p, q in zip(o, r)) for o, r in zip(out, ref_out))
                ref_out = ref_out or out
                rows.append(dict(batch=B, shared=shared, warps=w, us=us, same_as_first=same))
                print(f"B={B} shared={shared} warps={w}: {us:.2f} us (outputs equal to the "
                      f"first warps setting: {same})", flush=True)
    torch_us = {}
    for B in [int(b) for b in a.batches.split(",")]:  # the torch path the model takes above 8
        from tailored.ops import reference as ref

        logits = [torch.randn(B, E, device="cuda", dtype=torch.bfloat16, generator=g)
                  for _ in range(LAYERS)]

        def tfn():
            out = []
            for lg in logits:
                w, ids = ref.route_topk(lg, K)
                order, offsets = moe_route.moe_align(ids, E)
                out.append((w, ids, order, offsets, moe_route.expert_partition(offsets)))
            return out

        torch_us[B] = time_graph(tfn, a.reps)
        print(f"B={B} torch route_topk + moe_align + expert_partition: {torch_us[B]:.2f} us",
              flush=True)
    print("\n| batch | shared | " + " | ".join(f"{w} warps µs" for w in a.warps.split(",")) + " |")
    print("|---|---|" + "---|" * len(a.warps.split(",")))
    for B in sorted({r["batch"] for r in rows}):
        for shared in (False, True):
            rs = [r for r in rows if r["batch"] == B and r["shared"] == shared]
            print(f"| {B} | {shared} | " + " | ".join(f"{r['us']:.2f}" for r in rs) + " |")
        print(f"| {B} | torch path | {torch_us[B]:.2f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
