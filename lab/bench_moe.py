"""Routed-expert MoE of a decode step on the GPU, per layer: routing + fused_moe at the
published shapes (E=256, k=8, H=2048, I=512), A/B over `kernels.moe.COMPACT_GRID` (kb/0016),
or with `--ab f16` over the `moe_fp8_dot_f16` switch (FP8 experts' dots in float16, kb/0029).

Eight layers of distinct expert weights are cycled so the experts a step reads (48 MB a layer
in bf16) come from HBM, not from the 50 MB L2. Each variant is autotuned on its own, then one
CUDA graph of the eight layers is replayed; prints µs per layer and the achieved HBM bandwidth
over the routed experts' bytes (8 experts' gate_up + down per token, distinct experts counted
once). Routing (route_align up to the `route_align_up_to` switch's rows, else route_topk) is
in both variants.
Usage: python lab/bench_moe.py [--batches 1,8,32] [--fp8] [--ab compact|f16] [--json F]
`--ncu`: one eager call of layer 0 per variant at the last batch size runs between
cudaProfilerStart/Stop, for `ncu --profile-from-start off` (kernel counters without the tuning
launches).
"""

from __future__ import annotations

import argparse
import json

import torch
from kernel_bench import time_graph

from tailored import flags
from tailored.kernels import moe
from tailored.kernels.moe_route import route_align
from tailored.ops import reference as ref

E, K, H, I, LAYERS = 256, 8, 2048, 512, 8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,4,8,16,32")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", default=None)
    ap.add_argument("--fp8", action="store_true",
                    help="block-FP8 experts (W8A16, block scales): half the bytes per expert")
    ap.add_argument("--ab", choices=("compact", "f16"), default="compact",
                    help="compact: full vs compact expert grid; f16: FP8 dots in bf16 vs float16")
    ap.add_argument("--ncu", action="store_true",
                    help="profiler range around one eager layer per variant at the last batch")
    a = ap.parse_args()
    if a.ab == "f16" and not a.fp8:
        ap.error("--ab f16 needs --fp8")
    # (label, COMPACT_GRID, the moe_fp8_dot_f16 switch) per variant: the first is the control
    f16 = flags.current().moe_fp8_dot_f16
    ab = ([("full", False, f16), ("compact", True, f16)] if a.ab == "compact"
          else [("bf16dot", True, False), ("f16dot", True, True)])
    align_up_to = flags.current().route_align_up_to
    (l0, *_), (l1, *_) = ab
    batches = [int(b) for b in a.batches.split(",")]
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    gu = [torch.randn(E, 2 * I, H, device=dev, dtype=dt, generator=g) * H ** -0.5 for _ in range(LAYERS)]
    dn = [torch.randn(E, H, I, device=dev, dtype=dt, generator=g) * I ** -0.5 for _ in range(LAYERS)]
    scales = [(None, None)] * LAYERS
    if a.fp8:
        from tailored.model import fp8

        for li in range(LAYERS):
            qgu, sgu = fp8.quantize_experts(gu[li], True)
            qdn, sdn = fp8.quantize_experts(dn[li], False)
            gu[li], dn[li] = qgu, qdn
            scales[li] = (fp8.expert_block_scales(sgu, True),
                          fp8.expert_block_scales(sdn, False))
    wbytes = 1 if a.fp8 else 2
    rows = []
    for B in batches:
        x = torch.randn(B, H, device=dev, dtype=dt, generator=g)
        logits = [torch.randn(B, E, device=dev, dtype=dt, generator=g) for _ in range(LAYERS)]
        res = {}
        outs = {}
        for vi, (label, compact, dot_f16) in enumerate(ab):
            moe.COMPACT_GRID = compact
            flags.activate(flags.current().replace(moe_fp8_dot_f16=dot_f16))
            moe._LAUNCHERS.clear()  # each variant tunes its own configs (TAILORED_TUNING=off)

            def step():
                ys = []
                for li in range(LAYERS):
                    if B <= align_up_to:
                        w, ids, *al = route_align(logits[li], K)
                    else:
                        w, ids = ref.route_topk(logits[li], K)
                        al = None
                    ys.append(moe.fused_moe(x, w, ids, gu[li], dn[li], al, *scales[li],
                                            reduce=False))
                return ys

            # autotuned outside the capture (time_graph's eager first call)
            us, outs[vi] = time_graph(step, LAYERS, a.reps, 1)
            if a.ncu and B == batches[-1]:
                w0, ids0, *al0 = route_align(logits[0], K) if B <= align_up_to \
                    else (*ref.route_topk(logits[0], K),)
                torch.cuda.synchronize()
                torch.cuda.profiler.start()
                moe.fused_moe(x, w0, ids0, gu[0], dn[0], al0 or None, *scales[0], reduce=False)
                torch.cuda.synchronize()
                torch.cuda.profiler.stop()
            distinct = sum(len(set(torch.topk(lg.float(), K).indices.flatten().tolist()))
                           for lg in logits) / LAYERS
            bytes_ = distinct * 3 * H * I * wbytes
            res[label] = {"us_per_layer": us, "tb_s": bytes_ / (us * 1e-6) / 1e12}
        # each variant tunes its own configs: a different BLOCK_K changes the fp32 sum order,
        # so "equal" can be False without a bug; the relative difference says how far
        same = all(torch.equal(p, q) for p, q in zip(outs[0], outs[1]))
        rel = max(((p - q).norm() / q.norm().clamp_min(1e-30)).item()
                  for p, q in zip(outs[0], outs[1]))
        row = {"batch": B, "experts_touched": distinct, **res, "bitwise_equal": same,
               "max_rel_diff": rel, "compact_applies": B * K < E, "ab": a.ab}
        rows.append(row)
        note = "; T*k >= E: both run the full grid" if a.ab == "compact" and B * K >= E else ""
        print(f"B={B}: {distinct:.0f} experts; {l0} {res[l0]['us_per_layer']:.1f} us "
              f"({res[l0]['tb_s']:.2f} TB/s), {l1} {res[l1]['us_per_layer']:.1f} us "
              f"({res[l1]['tb_s']:.2f} TB/s); bitwise equal {same} (rel diff {rel:.1e}){note}",
              flush=True)
    print(f"\n| batch | experts | {l0} us/layer | {l1} us/layer | TB/s {l0} | TB/s {l1} | equal |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        b_us = f"{r[l1]['us_per_layer']:.1f}"
        if a.ab == "compact" and not r["compact_applies"]:
            b_us = "n/a (T·k ≥ E)"
        print(f"| {r['batch']} | {r['experts_touched']:.0f} | {r[l0]['us_per_layer']:.1f} | "
              f"{b_us} | {r[l0]['tb_s']:.2f} | {r[l1]['tb_s']:.2f} | {r['bitwise_equal']} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
