#!/usr/bin/env python3
"""Can an L2 prefetch on a side stream hide a decode GEMV's weight stream? (kb/0038 §8)

At B=1 the step is ~3.2 ms against a 1.4 ms HBM floor (bench summary, 4.3 TB/s). Each
kernel streams its weights only after the kernel before it ends; the short latency-bound
kernels between the GEMMs (norms, routing, conv, attention merge) leave HBM idle meanwhile.
Removing launches did not help (kb/0038 §4). This bench checks the other lever: load the next
GEMM's weights into L2 during those kernels. The prefetch runs on a side stream that is
forked and joined inside the CUDA graph, as the engine would do it.

Measured on the GPU, each case its own CUDA graph. L2 is flushed before every replay (a
separate graph writes a buffer of 4 × the L2). The time is the median of --reps replays,
from CUDA events (µs). For each weight W [N, K] bf16 (decode shapes of the model, spec §3–§7):
  linear cold / warm   F.linear(x, W) after a flush, and right after a first linear (the
                       ceiling of what a prefetch can give one GEMV);
  prefetch alone       the prefetch kernel over W (its bandwidth on --programs SMs);
  chain                --chain tiny elementwise kernels (a latency-bound stretch);
  chain + linear       the chain, then the linear (as today);
  overlapped           the prefetch on a side stream beside the chain, then the linear.
Gain = (chain + linear) − overlapped. The prefetch is `tl.load(..., eviction_policy=
"evict_last")` into a sum nobody uses, and the value is stored so that the loads stay;
--method bulk uses `cp.async.bulk.prefetch.L2` (PTX ISA 8.0, sm_90) from one thread a
program instead.

Usage (GPU): python3 scripts/bench_l2_prefetch.py [--json out.json]   (~1 min)
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# (name, N, K): decode GEMVs of one layer (bf16), spec §3–§7
SHAPES = [("gdn_in_proj", 12352, 2048), ("gdn_out_proj", 2048, 4096),
          ("attn_qkv", 2 * 16 * 256 + 2 * 2 * 256, 2048), ("shared_gate_up", 1024, 2048)]


@triton.jit
def _prefetch_load_kernel(w_ptr, sink_ptr, n, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Program p reads elements [p·CHUNK, (p+1)·CHUNK) of w with evict_last (into L2)."""
    p = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, CHUNK, BLOCK):
        o = p * CHUNK + s + tl.arange(0, BLOCK)
        acc += tl.load(w_ptr + o, mask=o < n, other=0.0,
                       eviction_policy="evict_last").to(tl.float32)
    tl.store(sink_ptr + p, tl.sum(acc, 0))  # keeps the loads (nobody reads it)


@triton.jit
def _prefetch_bulk_kernel(w_ptr, n_bytes, CHUNK_BYTES: tl.constexpr, STEP: tl.constexpr):
    """Program p issues cp.async.bulk.prefetch.L2 over its CHUNK_BYTES of w, STEP bytes an
    instruction (a multiple of 16; the tensor is 16-byte aligned)."""
    p = tl.program_id(0).to(tl.int64)
    base = w_ptr.to(tl.pointer_type(tl.int8))
    for s in range(0, CHUNK_BYTES, STEP):
        off = p * CHUNK_BYTES + s
        size = tl.minimum(n_bytes - off, STEP).to(tl.int32)
        if size > 0:
            tl.inline_asm_elementwise(
                "cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;", "=r,l,r",
                [base + off, size], dtype=tl.int32, is_pure=False, pack=1)


def prefetch(w: torch.Tensor, sink: torch.Tensor, programs: int, method: str) -> None:
    """Pull w (contiguous) into L2 with `programs` programs."""
    n = w.numel()
    if method == "bulk":
        nb = n * w.element_size()
        chunk = triton.cdiv(triton.cdiv(nb, programs), 65536) * 65536
        _prefetch_bulk_kernel[(triton.cdiv(nb, chunk),)](w, nb, CHUNK_BYTES=chunk, STEP=65536,
                                                         num_warps=1)
    else:
        block = 4096
        chunk = triton.cdiv(triton.cdiv(n, programs), block) * block
        _prefetch_load_kernel[(triton.cdiv(n, chunk),)](w, sink, n, CHUNK=chunk, BLOCK=block,
                                                        num_warps=8)


def graph_of(fn) -> torch.cuda.CUDAGraph:
    """fn captured in a CUDA graph, after one eager warm-up run on a side stream."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def time_graph(g, flush, reps: int) -> float:
    """Median µs of g's replays, each after a flush replay (not timed)."""
    ts = []
    for _ in range(reps):
        flush.replay()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1000.0)
    return statistics.median(ts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chain", type=int, default=12, help="tiny kernels in the chain")
    ap.add_argument("--programs", type=int, default=16, help="programs of the prefetch")
    ap.add_argument("--method", choices=["load", "bulk", "both"], default="both")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_l2_prefetch: needs a GPU")
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    l2 = props.L2_cache_size
    print(f"{props.name}: L2 {l2 / 2**20:.0f} MiB, {props.multi_processor_count} SMs")
    junk = torch.empty(4 * l2 // 4 + 1, dtype=torch.float32, device=dev)
    flush = graph_of(lambda: junk.fill_(1.0))
    tiny = torch.zeros(2048, dtype=torch.bfloat16, device=dev)

    def chain():
        for _ in range(a.chain):
            tiny.add_(1.0)

    methods = ["load", "bulk"] if a.method == "both" else [a.method]
    rows = []
    for name, N, K in SHAPES:
        w = torch.randn(N, K, dtype=torch.bfloat16, device=dev) * 0.02
        x = torch.randn(1, K, dtype=torch.bfloat16, device=dev)
        sink = torch.empty(4096, dtype=torch.float32, device=dev)
        r = {"name": name, "MB": w.numel() * 2 / 1e6}
        r["linear_cold"] = time_graph(graph_of(lambda: F.linear(x, w)), flush, a.reps)

        def twice():
            F.linear(x, w)
            F.linear(x, w)
        r["linear_warm"] = time_graph(graph_of(twice), flush, a.reps) - r["linear_cold"]
        r["chain"] = time_graph(graph_of(chain), flush, a.reps)

        def chain_linear():
            chain()
            F.linear(x, w)
        r["chain_linear"] = time_graph(graph_of(chain_linear), flush, a.reps)
        for m in methods:
            try:
                r[f"prefetch_{m}"] = time_graph(
                    graph_of(lambda m=m: prefetch(w, sink, a.programs, m)), flush, a.reps)
                side = torch.cuda.Stream()

                def overlapped(m=m, side=side):
                    main = torch.cuda.current_stream()
                    side.wait_stream(main)  # fork inside the capture
                    with torch.cuda.stream(side):
                        prefetch(w, sink, a.programs, m)
                    chain()
                    main.wait_stream(side)  # join before the GEMV
                    F.linear(x, w)
                r[f"overlapped_{m}"] = time_graph(graph_of(overlapped), flush, a.reps)
            except Exception as e:  # the bulk PTX on an older driver or Triton: report it
                r[f"error_{m}"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(r)
        del w
    cols = ["MB", "linear_cold", "linear_warm", "chain", "chain_linear"] + [
        f"{k}_{m}" for m in methods for k in ("prefetch", "overlapped")]
    print("| shape | " + " | ".join(cols) + " | best gain µs |")
    print("|" + "---|" * (len(cols) + 2))
    for r in rows:
        best = max((r["chain_linear"] - r[f"overlapped_{m}"] for m in methods
                    if f"overlapped_{m}" in r), default=float("nan"))
        print(f"| {r['name']} | " + " | ".join(
            f"{r[c]:.1f}" if c in r else "err" for c in cols) + f" | {best:.1f} |")
        for m in methods:
            if f"error_{m}" in r:
                print(f"  {r['name']} {m}: {r[f'error_{m}']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": props.name, "l2_bytes": l2, "chain": a.chain,
                       "programs": a.programs, "reps": a.reps, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
