#!/usr/bin/env python3
"""A prompt chunk's causal attention on the GPU, the three ways of `TAILORED_PREFILL_ATTENTION`
side by side (kb/0069, issue 56 item 1: "attention at long context at FA3-class speed"):
sdpa (today's default), flash (torch SDPA, grouped heads and the bottom-right mask in its flash
kernel), fa3 (FlashAttention-3's Hopper kernel, lab/build_fa3.sh).

Part 1, the kernels alone, one attention layer's shape (16 query heads, 2 key heads, head dim
256, bf16; q, k, v strided views of one q|k|v projection output, as the model passes them):
  whole   one fresh prompt of L tokens (L queries over L keys);
  chunk   an 8192-token chunk after a cached context (8192 queries over S keys, the context
          gathered as the eager path does);
  prompt  a long prompt as the engine runs it: 8192-token chunks, each over everything before
          it; the sum is one layer's attention time of that prompt (x 10 layers in the model).
  context a context-chunk graph's attention (an agent's next turn, a prefix-cache hit): T new
          rows (in a bucket of as many) over C cached keys in the KV cache's pages, by
          `decode` (today: one paged-decode query a row, kernels/attention_decode.py) and
          `fa3-paged` (FlashAttention-3 over the pages, device lengths).
Each: ms (CUDA events, median), TFLOP/s over the causal pairs (4 * heads * 256 flops a pair),
and the largest error against an fp32 reference on shapes small enough for it.

Part 2 (--model DIR): the engine in-process (dummy weights, served defaults), one prompt of
each --ttft-tokens length, one output token, each way: time to the first token.

Usage (GPU): python3 lab/bench_prefill_attention.py [--ways sdpa,flash,fa3] [--json F]
             [--model /tmp/full-fp8 --ttft-tokens 65536,120000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench_moe_prefill import timed  # median ms of reps CUDA-event-timed calls
from kernel_bench import manifest, row_log

from tailored import flags
from tailored.kernels import fa3, prefill_attention

HQ, HKV, D, CHUNK = 16, 2, 256, 8192
WHOLE = [1024, 4096, 8192, 16384, 32768]
CHUNK_CONTEXT = [16384, 32768, 65536, 131072]
PROMPTS = [65536, 120000]
CONTEXT = [(64, 8192), (512, 8192), (2048, 8192), (64, 25000), (512, 25000), (2048, 25000)]
PAGE = 16
CHECK_UP_TO = 8192  # fp32 reference only up to this many keys (its L x S scores)


def qkv(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Strided q [n, 16, 256], k, v [n, 2, 256] views of one projection output, as the model's."""
    w = torch.randn(n, (HQ + 2 * HKV) * D, generator=gen, device="cuda").to(torch.bfloat16)
    q = w[:, :HQ * D].view(n, HQ, D)
    k = w[:, HQ * D:(HQ + HKV) * D].view(n, HKV, D)
    v = w[:, (HQ + HKV) * D:].view(n, HKV, D)
    return q, k, v


def pairs(L: int, S: int) -> int:
    return L * S - L * (L - 1) // 2


def run_way(way: str, q, k, v):
    with flags.override(prefill_attention=way):
        return prefill_attention.causal_attention(q, k, v)


def kernel_rows(ways, reps, record) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [("whole", L, L) for L in WHOLE] + [("chunk", CHUNK, S) for S in CHUNK_CONTEXT]
    for kind, L, S in shapes:
        q, k, v = qkv(S, gen)
        q = q[S - L:]
        ref = (fa3.causal_attention_reference(q, k, v) if S <= CHECK_UP_TO else None)
        for way in ways:
            try:
                ms = timed(lambda: run_way(way, q, k, v), reps)
                err = None
                if ref is not None:
                    err = (run_way(way, q, k, v).float() - ref).abs().max().item()
            except Exception as e:  # one way failing must not lose the others' rows
                record({"kind": kind, "way": way, "L": L, "S": S, "error": repr(e)[:300]})
                continue
            record({"kind": kind, "way": way, "L": L, "S": S, "ms": round(ms, 3),
                    "tflops": round(4 * HQ * D * pairs(L, S) / ms / 1e9, 1),
                    "max_abs_err_vs_fp32": err})
        del q, k, v
        torch.cuda.empty_cache()
    for n in PROMPTS:  # a long prompt in 8192-token chunks, each over all keys before it
        q, k, v = qkv(n, gen)
        for way in ways:
            try:
                total = 0.0
                for s in range(0, n, CHUNK):
                    e = min(n, s + CHUNK)
                    kk, vv = k[:e].contiguous(), v[:e].contiguous()  # the eager path's gather
                    total += timed(lambda: run_way(way, q[s:e], kk, vv), max(2, reps // 2))
            except Exception as e:
                record({"kind": "prompt", "way": way, "L": n, "S": n, "error": repr(e)[:300]})
                continue
            record({"kind": "prompt", "way": way, "L": n, "S": n, "ms": round(total, 3),
                    "tflops": round(4 * HQ * D * pairs(n, n) / total / 1e9, 1),
                    "model_ms_10_layers": round(10 * total, 1)})
        del q, k, v
        torch.cuda.empty_cache()


def context_rows(ways, reps, record) -> None:
    """`context` rows: T rows over C + T keys on scattered pages of a KV cache."""
    from tailored.kernels.attention_decode import paged_decode_attention
    from tailored.worker.ctx_graphs import ctx_splits

    gen = torch.Generator(device="cuda").manual_seed(2)
    for T, C in CONTEXT:
        keys = C + T
        npages = -(-keys // PAGE)
        kc = torch.randn(npages + 1, PAGE, HKV, D, generator=gen, device="cuda").to(torch.bfloat16)
        vc = torch.randn_like(kc)
        table = (torch.randperm(npages, device="cuda", generator=gen) + 1).to(torch.int32)
        q = torch.randn(T, HQ, D, generator=gen, device="cuda").to(torch.bfloat16)
        lens = torch.arange(C + 1, keys + 1, dtype=torch.int32, device="cuda")
        used_q = torch.tensor([T], dtype=torch.int32, device="cuda")
        used_k = torch.tensor([keys], dtype=torch.int32, device="cuda")
        calls = {"decode": lambda: paged_decode_attention(
                     q, kc, vc, table.expand(T, -1), lens, num_splits=ctx_splits(T, HKV))}
        if "fa3" in ways:
            calls["fa3-paged"] = lambda: fa3.paged_attention(q, kc, vc, table, used_q, used_k)
        rows = torch.arange(keys, device="cuda")
        idx = table.long()[rows // PAGE] * PAGE + rows % PAGE
        ref = fa3.causal_attention_reference(q, kc.view(-1, HKV, D)[idx],
                                             vc.view(-1, HKV, D)[idx])
        for name, fn in calls.items():
            try:
                ms = timed(fn, reps)
                err = (fn()[:T].float() - ref).abs().max().item()
            except Exception as e:
                record({"kind": "context", "way": name, "L": T, "S": keys, "error": repr(e)[:300]})
                continue
            record({"kind": "context", "way": name, "L": T, "S": keys, "ms": round(ms, 3),
                    "tflops": round(4 * HQ * D * pairs(T, keys) / ms / 1e9, 1),
                    "model_ms_10_layers": round(10 * ms, 2), "max_abs_err_vs_fp32": err})
        del kc, vc
        torch.cuda.empty_cache()


def ttft_rows(args, ways, record) -> None:
    from kernel_bench import engine_stack

    from tailored.engine.types import SamplingParams

    longest = max(args.ttft_tokens)
    stack = engine_stack(args.model, False, max_model_len=longest + 16)
    engine = stack.engine
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(1)
    for n in args.ttft_tokens:
        ids = torch.randint(1000, 100000, (n,), generator=gen).tolist()
        for way in ways:
            with flags.override(prefill_attention=way):
                try:
                    times = []
                    for r in range(args.ttft_reps + 1):  # the first one warms the shapes up
                        t0 = time.perf_counter()
                        engine.add_request(f"{way}-{n}-{r}", ids, sp)
                        while engine.has_unfinished():
                            engine.step()
                        times.append(time.perf_counter() - t0)
                except Exception as e:
                    record({"kind": "ttft", "way": way, "L": n, "error": repr(e)[:300]})
                    continue
            record({"kind": "ttft", "way": way, "L": n,
                    "ttft_s": round(statistics.median(times[1:]), 3), "runs_s": times})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ways", default="sdpa,flash,fa3")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--model", default="", help="checkpoint dir (config only): part 2, TTFT")
    ap.add_argument("--ttft-tokens", default="65536,120000")
    ap.add_argument("--ttft-reps", type=int, default=2)
    ap.add_argument("--skip-kernels", action="store_true")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    ways = args.ways.split(",")
    args.ttft_tokens = [int(x) for x in args.ttft_tokens.split(",")]
    man = manifest(args, "random (kernels), dummy (TTFT)")
    man["fa3_library"] = str(fa3.library_path())

    def line(r: dict) -> str:
        if "error" in r:
            return f"{r['kind']:7} {r['way']:9} L={r['L']:>6} FAILED {r['error']}"
        if r["kind"] == "ttft":
            return f"ttft   {r['way']:5} L={r['L']:>6} {r['ttft_s']:.3f} s"
        return (f"{r['kind']:7} {r['way']:9} L={r['L']:>6} S={r['S']:>6} {r['ms']:9.3f} ms "
                f"{r['tflops']:6.1f} TFLOP/s err={r.get('max_abs_err_vs_fp32')}")

    record, _ = row_log(man, args.json or None, line)
    if not args.skip_kernels:
        kernel_rows(ways, args.reps, record)
        context_rows(ways, args.reps, record)
    if args.model:
        ttft_rows(args, ways, record)


if __name__ == "__main__":
    main()
