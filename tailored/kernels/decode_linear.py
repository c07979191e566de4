"""bf16 linear for decode batches: y = x · Wᵀ for M ≤ 16 rows, one Triton GEMM (kb/0017).

At B=1 cuBLAS picks a split-K GEMM plus a reduce kernel for the 4096→2048 output projections
(7.2 + 1.8 µs for 16.8 MB, 1.9 TB/s) and a GEMV for the shared expert's 512→2048 down
projection (4.4 µs for 2 MB, 0.5 TB/s) — H200 profile, logs/gpu/2026-11-30-s7/run2. Decode is
memory bound: this kernel gives every SM a narrow N slice and streams its weight rows along K
in wide tiles (no split-K, no second kernel), autotuned per (N, K, row bucket) at warm-up. It
is the block-FP8 linear's kernel (`fp8_linear._fp8_linear_kernel`) with the bf16 weight used
as is (`W_FP8=False`); the 16-row tile is padded by masks (tensor cores, fp32 accumulation,
one rounding to the output dtype).

Numerics: fp32 accumulation in another order than cuBLAS, so outputs differ from F.linear at
bf16 rounding level; off unless TAILORED_DECODE_LINEAR=1 until the accuracy gate has run with
it on the H200. Reference: `torch.nn.functional.linear` (tests/test_kernels.py).
"""

from __future__ import annotations

import os

import torch
import triton

from tailored.kernels import autotune_enabled, dot_precision, tuning
from tailored.kernels.fp8_linear import _fp8_linear_kernel

# the projections it takes (FastPath labels each): "in" (mixer input), "out" (mixer output),
# "router" (router | shared-expert gate | shared gate/up), "down" (shared expert down).
# TAILORED_DECODE_LINEAR=1: all; a comma list (e.g. "out,down") picks some. Off by default: all
# together were +7.7 % on the H200 B=1 step (kb/0019); per kind not yet measured
ALL = frozenset({"in", "out", "router", "down"})


def _parse(env: str) -> frozenset:
    if env in ("", "0"):
        return frozenset()
    if env == "1":
        return ALL
    kinds = frozenset(k.strip() for k in env.split(",") if k.strip())
    if not kinds <= ALL:
        raise ValueError(f"TAILORED_DECODE_LINEAR={env!r}: kinds are 0, 1 or a comma list of "
                         f"{', '.join(sorted(ALL))}")
    return kinds


ENABLED: frozenset = _parse(os.environ.get("TAILORED_DECODE_LINEAR", ""))
MAX_M = 16  # rows; above it cuBLAS's tensor-core GEMMs are the better choice

_TUNED: dict = {}


def _tuned():
    """Autotuned launcher: narrow N tiles (more CTAs), wide K tiles (more bytes in flight per
    CTA); 8 configs per distinct K (K is a compile-time constant), tuned at warm-up."""
    if "k" not in _TUNED:
        cfgs = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "KB": bk}, num_warps=4,
                              num_stages=st)
                for bn in (16, 32) for bk in (256, 512) for st in (3, 4)]
        _TUNED["k"] = tuning.register(
            "decode_linear", triton.autotune(configs=cfgs, key=["N", "K", "BLOCK_M", "M_BUCKET"],
                                             warmup=5, rep=20)(_fp8_linear_kernel))
    return _TUNED["k"]


def use_decode_linear(x: torch.Tensor, weight: torch.Tensor, kind: str = "in") -> bool:
    """Whether `decode_linear` takes this call: its kind enabled, ≤ MAX_M rows, a bf16/fp32
    weight."""
    return (kind in ENABLED and 0 < x.shape[0] <= MAX_M
            and weight.dtype in (torch.bfloat16, torch.float32) and weight.stride(1) == 1)


def decode_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] (M ≤ 16; unit column stride, row stride free) · weightᵀ ([N, K], unit column
    stride, row stride free) → [M, N] in x.dtype. Raises ValueError on mismatched shapes or
    dtypes, or M > MAX_M."""
    M, K = x.shape
    N, K2 = weight.shape
    if K2 != K or M > MAX_M or weight.dtype != x.dtype or weight.stride(1) != 1:
        raise ValueError(f"decode_linear: x{tuple(x.shape)} {x.dtype} weight{tuple(weight.shape)} "
                         f"{weight.dtype} (M ≤ {MAX_M}, same dtype, unit column stride)")
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    bucket = triton.next_power_of_2(M)
    # s_ptr and stride_sn are unused with W_FP8=False
    args = (x, weight, weight, y, M, N, K, x.stride(0), weight.stride(0), 0, y.stride(0), bucket)
    prec = dot_precision(x.dtype)
    if x.is_cuda and autotune_enabled(x.dtype):
        _tuned()[lambda c: (1, triton.cdiv(N, c["BLOCK_N"]))](
            *args, BLOCK_M=16, DOT_PREC=prec, W_FP8=False)
    else:  # Triton's interpreter (CPU tests), fp32, or TAILORED_AUTOTUNE=0: a fixed choice
        bn, bk = 32, min(256, max(16, triton.next_power_of_2(K)))
        _fp8_linear_kernel[(1, triton.cdiv(N, bn))](
            *args, BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, KB=bk, DOT_PREC=prec, W_FP8=False)
    return y
