"""One-call sweep for the W8A16 linear (kb/0009): which kernel and tile config reads block-FP8
weights fastest at this model's shapes, against cuBLAS bf16 on the same shapes.

Variants, each checked against F.linear over the dequantized weight before it is timed:
  bf16     cuBLAS F.linear on bf16 weights (what the bf16 path runs)
  scale    the package kernel (`kernels.fp8_linear._fp8_linear_kernel`): K tiles ≤ 128, block
           scale applied to each partial dot
  deq      dequantize the tile in registers before the dot (K tiles 128–512), optional split-K
           (partials [S, M, N] fp32, then summed)
  scratch  dequantize the whole weight to bf16 (torch ops), then cuBLAS (a prefill option)
Times: triton.testing.do_bench_cudagraph (launch cost excluded, as inside the decode graph).

    python3 scripts/fp8_sweep.py [--m 1,8,32,1024] [--json out.json]   # H200
    TRITON_INTERPRET=1 python3 scripts/fp8_sweep.py --dry-run            # CPU: correctness only
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tailored.kernels.fp8_linear import _fp8_linear_kernel
from tailored.model import fp8

# (name, N, K) of every FP8 GEMM of a decode step (kernel-path fusion, model/fast.py)
SHAPES = [("gdn in qkv|z", 12288, 2048), ("attn q|k|v", 9216, 2048), ("out_proj/o_proj", 2048, 4096),
          ("shared gate|up", 1024, 2048), ("shared down", 2048, 512)]


@triton.jit
def _deq_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
                stride_ys, K_PER_SPLIT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
    pid_m, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < M, n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_lo = pid_s * K_PER_SPLIT
    k0 = k_lo
    while k0 < k_lo + K_PER_SPLIT:
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        a = tl.load(x_ptr + m[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + n[None, :].to(tl.int64) * stride_wn + kk[:, None],
                    mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        s = tl.load(s_ptr + n[None, :] * stride_sn + kk[:, None] // 128,
                    mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(a, (w.to(tl.float32) * s).to(a.dtype), acc)
        k0 += BLOCK_K
    tl.store(y_ptr + pid_s * stride_ys + m[:, None] * stride_ym + n[None, :], acc,
             mask=m_ok[:, None] & n_ok[None, :])


def run_scale(x, q, rows, bm, bn, bk, warps, stages):
    M, K = x.shape
    N = q.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    # no bf16 rows (NB = 0: x stands in for their never-read pointer), FP8 columns from 0
    _fp8_linear_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
        x, q, rows, x, y, M, N, 0, K, x.stride(0), q.stride(0), rows.stride(0), x.stride(0),
        y.stride(0), 0, N, 0,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_PREC="tf32" if x.dtype != torch.float32 else "ieee",
        KB=min(bk, 128), num_warps=warps, num_stages=stages)
    return y


def run_deq(x, q, rows, bm, bn, bk, split, warps, stages):
    M, K = x.shape
    N = q.shape[0]
    kps = triton.cdiv(triton.cdiv(K, split), bk) * bk
    part = torch.empty(split, M, N, dtype=torch.float32, device=x.device)
    _deq_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn), split)](
        x, q, rows, part, M, N, K, x.stride(0), q.stride(0), rows.stride(0), part.stride(1),
        part.stride(0), kps, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return (part[0] if split == 1 else part.sum(0)).to(x.dtype)


def run_scratch(x, q, block_scale):
    return F.linear(x, fp8.dequantize_block(q, block_scale, x.dtype))


def configs(M):
    bm = 16 if M <= 16 else 32 if M <= 32 else 128
    if M <= 64:
        scale = [(bm, bn, 128, 4, st) for bn in (16, 32, 64) for st in (3, 4, 5)]
        deq = [(bm, bn, bk, sp, 4, st) for bn in (16, 32, 64) for bk in (128, 256, 512)
               for sp in (1, 2, 4) for st in (3, 4)]
    else:
        scale = [(bm, bn, bk, w, 3) for bn in (64, 128) for bk in (64, 128) for w in (4, 8)]
        deq = [(bm, bn, bk, 1, w, 3) for bn in (64, 128) for bk in (64, 128) for w in (4, 8)]
    return scale, deq


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="1,8,32,1024")
    ap.add_argument("--json", default=None)
    ap.add_argument("--dry-run", action="store_true", help="small shapes, correctness only (CPU)")
    a = ap.parse_args()
    dev = "cpu" if a.dry_run else "cuda"
    dt = torch.float32 if a.dry_run else torch.bfloat16
    shapes = [("small", 96, 384)] if a.dry_run else SHAPES
    ms = [1, 5] if a.dry_run else [int(m) for m in a.m.split(",")]
    results = []
    for (name, N, K), M in itertools.product(shapes, ms):
        g = torch.Generator().manual_seed(N + K + M)
        w = torch.randn(N, K, generator=g) * K ** -0.5
        q, s = fp8.quantize_block(w)
        q, s = q.to(dev), s.to(dev)
        rows = fp8.row_scales(s, N)
        x = torch.randn(M, K, generator=g).to(dev, dt)
        wd = fp8.dequantize_block(q, s, dt)
        want = F.linear(x.float(), wd.float())
        tol = 1e-4 if dt == torch.float32 else 2e-2

        def check(y, label):
            err = ((y.float() - want).norm() / want.norm()).item()
            if not err < tol:
                raise SystemExit(f"{name} M={M} {label}: rel err {err:.2e} > {tol}")

        row = {"shape": name, "N": N, "K": K, "M": M}
        bench = (lambda f: None) if a.dry_run else (
            lambda f: triton.testing.do_bench_cudagraph(f, rep=50) * 1e3)  # µs
        check(F.linear(x, wd), "bf16")
        row["bf16_us"] = bench(lambda: F.linear(x, wd))
        check(run_scratch(x, q, s), "scratch")
        row["scratch_us"] = bench(lambda: run_scratch(x, q, s))
        sc, dq = configs(M)
        if a.dry_run:
            sc = [c for c in sc if c[1] <= 32][:2]
            dq = [c for c in dq if c[1] <= 32 and c[2] <= 256 and c[3] <= 2][:4]
        best = {}
        for label, cfgs, fn in (("scale", sc, run_scale), ("deq", dq, run_deq)):
            for c in cfgs:
                try:
                    check(fn(x, q, rows, *c), f"{label}{c}")
                    t = bench(lambda: fn(x, q, rows, *c))
                except Exception as e:  # an unlaunchable config (shared memory) is skipped
                    if isinstance(e, SystemExit):
                        raise
                    continue
                if t is not None and (label not in best or t < best[label][0]):
                    best[label] = (t, c)
                if t is None:
                    best[label] = (None, c)
        if set(best) != {"scale", "deq"}:
            raise SystemExit(f"{name} M={M}: no launchable config for {({'scale', 'deq'} - set(best))}")
        for label, (t, c) in best.items():
            row[f"{label}_us"], row[f"{label}_cfg"] = t, list(c)
        # bytes read: fp8 weight + per-row scales (+ x); bf16 weight for the bf16 row
        row["fp8_bytes"] = N * K + rows.numel() * 4
        results.append(row)
        if not a.dry_run:
            gbs = lambda us: row["fp8_bytes"] / (us * 1e-6) / 1e9
            print(f"{name:16s} M={M:5d} bf16 {row['bf16_us']:8.1f} µs ({2 * N * K / row['bf16_us'] / 1e3:6.0f} GB/s)"
                  f"  scale {row.get('scale_us', float('nan')):8.1f} ({gbs(row.get('scale_us', float('inf'))):5.0f} GB/s) {row.get('scale_cfg')}"
                  f"  deq {row.get('deq_us', float('nan')):8.1f} {row.get('deq_cfg')}"
                  f"  scratch {row['scratch_us']:8.1f}", flush=True)
        else:
            print(f"{name} M={M}: all variants match the dequantized reference "
                  f"({len(sc)} scale + {len(dq)} deq configs)")
    if a.json:
        Path(a.json).write_text(json.dumps({"results": results, "torch": torch.__version__,
                                            "triton": triton.__version__,
                                            "commit": os.environ.get("TAILORED_COMMIT")}, indent=1))


if __name__ == "__main__":
    main()
