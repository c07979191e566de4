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
  prefetch then linear the same stream: what the linear gains once W's start is in L2.
Gain = (chain + linear) − overlapped. The prefetch reads at most --l2-fraction of L2 from W's
start (the in_proj is as large as L2). --method load: plain loads into a sum that is stored
so that they stay, 2 programs a SM; --method bulk: `cp.async.bulk.prefetch.L2` (PTX ISA 8.0,
sm_90), one thread in each of 16 programs, whose kernel ends when the prefetches are issued
(its "prefetch" column is issue time). Checked by a review in session 20: the flush reads (a
writing flush would leave dirty lines to write back), and W is cold again at the end.

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
    """Program p reads elements [p·CHUNK, (p+1)·CHUNK) of w (plain loads: they pass L2).
    Two independent loads an iteration, so more bytes are in flight."""
    p = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, CHUNK, 2 * BLOCK):
        o = p * CHUNK + s + tl.arange(0, BLOCK)
        acc += tl.load(w_ptr + o, mask=o < n, other=0.0).to(tl.float32)
        acc2 += tl.load(w_ptr + o + BLOCK, mask=o + BLOCK < n, other=0.0).to(tl.float32)
    tl.store(sink_ptr + p, tl.sum(acc + acc2, 0))  # keeps the loads (nobody reads it)


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
            # a scalar asm runs in every thread of the program: thread 0 alone issues it
            # (before session 38 each of the warp's 32 threads issued every prefetch, kb/0058)
            tl.inline_asm_elementwise(
                "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
                "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }", "=r,l,r",
                [base + off, size], dtype=tl.int32, is_pure=False, pack=1)


def prefetch(w: torch.Tensor, sink: torch.Tensor, programs: int, method: str) -> None:
    """Pull the first w.numel() elements of w (contiguous) into L2 with `programs` programs
    (sink: ≥ programs fp32). bulk: the kernel ends when the prefetches are issued, not done
    (the PTX has no completion for them)."""
    n = w.numel()
    if method == "bulk":
        nb = n * w.element_size()
        chunk = triton.cdiv(triton.cdiv(nb, programs), 65536) * 65536
        _prefetch_bulk_kernel[(triton.cdiv(nb, chunk),)](w, nb, CHUNK_BYTES=chunk, STEP=65536,
                                                         num_warps=1)
    else:
        block = 4096
        chunk = triton.cdiv(triton.cdiv(n, programs), 2 * block) * 2 * block
        grid = triton.cdiv(n, chunk)
        assert grid <= sink.numel()
        _prefetch_load_kernel[(grid,)](w, sink, n, CHUNK=chunk, BLOCK=block, num_warps=8)


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
    ap.add_argument("--programs", type=int, default=0,
                    help="programs of the prefetch (0: 2 a SM for load, 16 for bulk)")
    ap.add_argument("--l2-fraction", type=float, default=0.6,
                    help="prefetch at most this fraction of L2 from the start of W (a W as "
                         "large as L2 would evict its own start)")
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
    # the flush reads 4 × L2 (filled once, eagerly): L2 then holds clean lines, as in the
    # engine, where evicted lines are mostly weights (a writing flush leaves dirty lines whose
    # write-back the cold reads would pay)
    junk = torch.ones(l2 + 1, dtype=torch.float32, device=dev)
    junk_sum = torch.empty((), dtype=torch.float32, device=dev)
    flush = graph_of(lambda: torch.sum(junk, dim=0, out=junk_sum))
    sms = props.multi_processor_count
    tiny = torch.zeros(2048, dtype=torch.bfloat16, device=dev)

    def chain():
        for _ in range(a.chain):
            tiny.add_(1.0)

    methods = ["load", "bulk"] if a.method == "both" else [a.method]
    rows = []
    for name, N, K in SHAPES:
        w = torch.randn(N, K, dtype=torch.bfloat16, device=dev) * 0.02
        x = torch.randn(1, K, dtype=torch.bfloat16, device=dev)
        sink = torch.empty(4 * sms + max(a.programs, 16), dtype=torch.float32, device=dev)
        part = w.view(-1)[:min(w.numel(), int(a.l2_fraction * l2) // w.element_size())]
        r = {"name": name, "MB": w.numel() * 2 / 1e6, "prefetched_MB": part.numel() * 2 / 1e6}
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
            progs = a.programs or (2 * sms if m == "load" else 16)
            try:
                # bulk: issue time only (its prefetches complete after the kernel)
                r[f"prefetch_{m}"] = time_graph(
                    graph_of(lambda m=m, p=progs: prefetch(part, sink, p, m)), flush, a.reps)

                def then_linear(m=m, p=progs):  # the same stream: what the linear gains
                    prefetch(part, sink, p, m)
                    F.linear(x, w)
                r[f"then_linear_{m}"] = time_graph(graph_of(then_linear), flush, a.reps)
                side = torch.cuda.Stream()

                def overlapped(m=m, p=progs, side=side):
                    main = torch.cuda.current_stream()
                    side.wait_stream(main)  # fork inside the capture
                    with torch.cuda.stream(side):
                        prefetch(part, sink, p, m)
                    chain()
                    main.wait_stream(side)  # join before the GEMV
                    F.linear(x, w)
                r[f"overlapped_{m}"] = time_graph(graph_of(overlapped), flush, a.reps)
            except Exception as e:  # the bulk PTX on an older driver or Triton: report it
                r[f"error_{m}"] = f"{type(e).__name__}: {e}"[:300]
        # the flush still evicts W after all this (a stale-warm W would fake the gains)
        r["linear_cold_again"] = time_graph(graph_of(lambda: F.linear(x, w)), flush, a.reps)
        rows.append(r)
        print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in r.items()}),
              flush=True)  # each row as it comes: a GPU fault later loses no earlier row
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"device": props.name, "l2_bytes": l2, "chain": a.chain,
                           "programs": a.programs, "reps": a.reps, "rows": rows}, f, indent=1)
        del w, part
    cols = ["MB", "prefetched_MB", "linear_cold", "linear_warm", "chain", "chain_linear"] + [
        f"{k}_{m}" for m in methods for k in ("prefetch", "then_linear", "overlapped")]
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
