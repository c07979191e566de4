#!/usr/bin/env python3
"""Where a prefill step's GPU time goes (issue 56 item 1: "profile an 8,192-token prefill step,
a c=128 mixed step and a 65k prompt: kernel table; each GEMM's and attention's share of the
step and fraction of peak").

The runner in-process on a config-only checkpoint (dummy weights, served defaults: kernel path,
prefill graphs on), each shape under torch.profiler (CUDA kernels):
  prefill8k  one eager step of 8 fresh 1,024-token prompts;
  mixed      128 decode rows (contexts of 1,024 tokens) beside one fresh 7,168-token prompt;
  long       one 65,536-token prompt in 8,192-token chunks, as the engine runs it.
Each kernel is put in a class by its name (MoE experts, dense GEMMs, attention, GDN, conv,
norms and elementwise, copies, routing, other; `CLASSES`); per shape the classes' ms, share
and launches, the top kernels, and TFLOP/s of the MoE experts, the dense projections and the
attention against the card's dense bf16 peak (--peak-tflops, H100 SXM 989). The classes are
by name: the top-kernel list shows what each holds. `TAILORED_*` switches apply as set, so
one run per variant (e.g. TAILORED_MOE_W8A8_FROM=1024, TAILORED_PREFILL_ATTENTION=fa3).

Usage (GPU): python3 lab/profile_prefill.py /tmp/full-fp8 [--shapes prefill8k,mixed,long]
             [--json F]
CPU dry run: python lab/profile_prefill.py --nano --shapes prefill8k --scale 64
"""

from __future__ import annotations

import argparse
import json
import math
import re

import torch

from tailored.model.batch import ForwardBatch
from tailored.stack import build_stack, embedded_checkpoint

# (class, name pattern) in order: the first match names a kernel's class
CLASSES = [
    ("moe experts", r"fused_moe|moe_w8a8|nvfp4_grouped|moe_gemm|grouped|w8a8_experts|expert"),
    ("moe routing", r"route|align|topk|moe_sum|combine|sort|histogram|bincount"),
    ("attention", r"flash|fmha|attention|FlashAttn|paged_decode|sdpa|softmax"),
    ("gdn", r"chunk|delta|gdn|recompute_w_u|solve_tril|cumsum|l2norm|fused_recurrent"),
    ("conv", r"conv"),
    ("dense gemm", r"nvjet|gemm|cutlass|xmma|sm90_|ampere_|cublas|fp8_linear|splitk|gemv"),
    ("norm/elementwise", r"norm|rope|silu|sigmoid|elementwise|vectorized|reduce|mul|add|"
                         r"exp|where|fill|quant"),
    ("copies", r"copy|Memcpy|Memset|CatArray|index|gather|scatter|cat"),
]


def kernel_class(name: str) -> str:
    for cls, pat in CLASSES:
        if re.search(pat, name, re.IGNORECASE):
            return cls
    return "other"


def flops(cfg, tokens: int, attn_pairs: float) -> dict:
    """Flops (2 a multiply-add) of one step's routed experts and attention (the dense
    projections': 2 x `dense_params` a token)."""
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    n_attn = sum(1 for t in cfg.layer_types if t == "full_attention")
    moe = 2 * tokens * cfg.num_experts_per_tok * 3 * H * I * cfg.num_hidden_layers
    attn = 4 * cfg.num_attention_heads * cfg.head_dim * attn_pairs * n_attn
    return {"moe": moe, "attention": attn}


def dense_params(model) -> int:
    """Weight elements of the dense projections a token multiplies (all nn.Linear outside the
    routed experts and lm_head)."""
    n = 0
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and "experts" not in name and "lm_head" not in name \
                and "mtp" not in name:
            n += mod.weight.numel()
    return n


def profile(fn, device: str):
    from torch.profiler import ProfilerActivity, profile as tprofile

    acts = [ProfilerActivity.CUDA] if device == "cuda" else [ProfilerActivity.CPU]
    fn()  # warm: compiles and tunes outside the profile
    if device == "cuda":
        torch.cuda.synchronize()
    with tprofile(activities=acts) as prof:
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = (e.device_time_total if device == "cuda" else e.self_cpu_time_total)
        if us > 0 and (device != "cuda" or e.device_type.name == "CUDA"):
            rows.append((e.key, us / 1e3, e.count))
    return rows


def summarize(name: str, rows, fl: dict, dense_flops: float, peak: float) -> dict:
    total = sum(ms for _, ms, _ in rows)
    by: dict[str, list] = {}
    for k, ms, n in rows:
        c = by.setdefault(kernel_class(k), [0.0, 0])
        c[0] += ms
        c[1] += n
    print(f"\n== {name}: {total:.1f} ms of kernels")
    for cls, (ms, n) in sorted(by.items(), key=lambda x: -x[1][0]):
        print(f"  {cls:18s} {ms:9.2f} ms {100 * ms / max(total, 1e-9):5.1f} %  {n:6d} launches")
    eff = {}
    for cls, f in (("moe experts", fl["moe"]), ("dense gemm", dense_flops),
                   ("attention", fl["attention"])):
        ms = by.get(cls, [0.0])[0]
        if ms > 0:
            eff[cls] = f / ms / 1e9
            print(f"  {cls}: {eff[cls]:.0f} TFLOP/s, {100 * eff[cls] / peak:.0f} % of "
                  f"{peak:.0f} (by name; see the top kernels)")
    print("  top kernels:")
    for k, ms, n in sorted(rows, key=lambda r: -r[1])[:15]:
        print(f"    {ms:8.2f} ms {n:5d}x  [{kernel_class(k)}] {k[:110]}")
    return {"total_ms": total, "classes": {c: {"ms": v[0], "launches": v[1]}
                                            for c, v in by.items()},
            "tflops": eff, "top": sorted(rows, key=lambda r: -r[1])[:40]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ckpt", nargs="?", help="config-only checkpoint dir (dummy weights)")
    ap.add_argument("--nano", action="store_true", help="CPU dry run on the embedded model")
    ap.add_argument("--shapes", default="prefill8k,mixed,long")
    ap.add_argument("--scale", type=int, default=1, help="divide every length (dry runs)")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    if not a.nano and not a.ckpt:
        ap.error("give a checkpoint dir, or --nano for the CPU dry run")
    s = a.scale
    prompt, rows, chunk, long_len = 1024 // s, 128 // min(s, 16), 8192 // s, 65536 // s
    if a.nano:
        st = build_stack(embedded_checkpoint(), device="cpu", dtype="float32", progress=False,
                         max_model_len=long_len + 64, max_num_seqs=rows + 2)
        dev = "cpu"
    else:
        st = build_stack(a.ckpt, load_format="dummy", device="cuda", dtype="bfloat16",
                         progress=False, max_num_batched_tokens=8192, prefill_graphs=True,
                         max_model_len=long_len + 64, max_num_seqs=rows + 2)
        dev = "cuda"
    runner, cfg = st.engine.runner, st.model_config
    ps = runner.page_size
    vocab = cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    pages_per = math.ceil((prompt + 64) / ps)
    next_page = [1]

    def take_pages(n: int) -> list[int]:
        p = list(range(next_page[0], next_page[0] + n))
        next_page[0] += n
        return p

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    dense = 2 * dense_params(runner.model)
    out, shapes = {}, a.shapes.split(",")
    if "prefill8k" in shapes:
        lay = [(ids(prompt), 0, b + 1, True, take_pages(pages_per)) for b in range(8)]
        batch = ForwardBatch.build(lay, [(b + 1) * prompt - 1 for b in range(8)], dev)
        fl = flops(cfg, 8 * prompt, 8 * prompt * (prompt + 1) / 2)
        out["prefill8k"] = summarize(f"prefill: 8 x {prompt} fresh tokens",
                                     profile(lambda: runner.forward(batch), dev), fl,
                                     dense * 8 * prompt, a.peak_tflops)
    if "mixed" in shapes:
        # `rows` decode rows of `prompt`-token contexts (prefilled 8 at a time) beside one
        # fresh prompt of 7 x prompt tokens
        ctxs = []
        for b0 in range(0, rows, 8):
            lay = [(ids(prompt), 0, b + 1, True, take_pages(pages_per))
                   for b in range(b0, min(rows, b0 + 8))]
            runner.forward(ForwardBatch.build(lay, [0], dev))
            ctxs += [(b + 1, p) for b, (_, _, _, _, p) in zip(range(b0, b0 + 8), lay)]
        fresh = 7 * prompt
        fresh_pages = take_pages(math.ceil((fresh + 1) / ps))
        slot_fresh = rows + 1

        def mixed():
            lay = [(ids(1), prompt, slot, False, p) for slot, p in ctxs]
            lay.append((ids(fresh), 0, slot_fresh, True, fresh_pages))
            return runner.forward(ForwardBatch.build(lay, list(range(rows)), dev))

        fl = flops(cfg, rows + fresh, rows * prompt + fresh * (fresh + 1) / 2)
        out["mixed"] = summarize(f"mixed: {rows} decode rows + {fresh} fresh tokens",
                                 profile(mixed, dev), fl, dense * (rows + fresh), a.peak_tflops)
    if "long" in shapes:
        long_pages = take_pages(math.ceil((long_len + 1) / ps))
        toks = ids(long_len)

        def long_prompt():
            for s0 in range(0, long_len, chunk):
                e = min(long_len, s0 + chunk)
                runner.forward(ForwardBatch.build(
                    [(toks[s0:e], s0, rows + 2, s0 == 0, long_pages)], [e - s0 - 1], dev))

        fl = flops(cfg, long_len, long_len * (long_len + 1) / 2)
        out["long"] = summarize(f"long: one {long_len}-token prompt in {chunk}-token chunks",
                                profile(long_prompt, dev), fl, dense * long_len, a.peak_tflops)
    if a.json:
        from kernel_bench import manifest

        man = manifest(a, "dummy") if dev == "cuda" else {"workload": vars(a)}
        with open(a.json, "w") as f:
            json.dump({"manifest": man, "shapes": out}, f, indent=1)


if __name__ == "__main__":
    main()
