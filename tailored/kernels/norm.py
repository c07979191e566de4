"""Fused residual add + zero-centred RMSNorm (spec §3), one program per token row.

`add_rms_norm_1p(x, h, w)` = (x + h rounded to the model dtype, rms_norm_1p(that)): the two
tensors every decoder layer needs after its mixer, in one pass over the row instead of five
elementwise kernels. Same casts as the reference (`ref.rms_norm_1p` after `x + h`), so the
result is bit-identical to it in fp32 and at most one rounding apart in bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tailored.kernels.pdl import enter as pdl_enter
from tailored.kernels.pdl import launch as pdl_launch


@triton.jit
def _add_rms_norm_kernel(x_ptr, h_ptr, w_ptr, res_ptr, out_ptr, N, eps,
                         stride_x, stride_h, stride_r, stride_o,
                         HAS_H: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr = False):
    if PDL:  # kernels/pdl.py: wait for the previous kernel first
        pdl_enter()
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    ok = c < N
    x = tl.load(x_ptr + row * stride_x + c, mask=ok, other=0.0)
    if HAS_H:
        x = (x.to(tl.float32) + tl.load(h_ptr + row * stride_h + c, mask=ok, other=0.0)
             .to(tl.float32)).to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_r + c, x, mask=ok)
    xf = x.to(tl.float32)
    y = xf * tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)
    y = y * (1.0 + tl.load(w_ptr + c, mask=ok, other=0.0).to(tl.float32))
    tl.store(out_ptr + row * stride_o + c, y.to(out_ptr.dtype.element_ty), mask=ok)


def add_rms_norm_1p(x: torch.Tensor, h: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """x, h: [T, N] (same dtype; h None = norm only); weight: [N].

    Returns (residual [T, N] = x + h in x.dtype (x itself when h is None),
             normed [T, N] = rms_norm_1p(residual, weight, eps) in x.dtype).
    """
    T, N = x.shape
    assert x.stride(1) == 1 and (h is None or (h.shape == x.shape and h.stride(1) == 1))
    res = torch.empty_like(x) if h is not None else x
    out = torch.empty_like(x)
    block = triton.next_power_of_2(N)
    _add_rms_norm_kernel[(T,)](
        x, h if h is not None else x, weight, res, out, N, eps,
        x.stride(0), (h if h is not None else x).stride(0), res.stride(0), out.stride(0),
        HAS_H=h is not None, BLOCK=block, num_warps=8 if block >= 2048 else 4, **pdl_launch(out))
    return res, out


@triton.jit
def _add_rms_norm_linear_kernel(x_ptr, h_ptr, nw_ptr, w_ptr, res_ptr, out_ptr, y_ptr, N, K, eps,
                                stride_x, stride_h, stride_r, stride_o, stride_w, stride_y,
                                T: tl.constexpr, HAS_H: tl.constexpr, BLOCK_K: tl.constexpr,
                                BLOCK_N: tl.constexpr, PDL: tl.constexpr = False):
    """Program j: rows n in [j·BLOCK_N, (j+1)·BLOCK_N) of y = normed · Wᵀ for all T rows. Every
    program repeats the add + norm of the T rows (K values each: cheaper than a launch);
    program 0 stores the residual and the normed rows."""
    if PDL:  # kernels/pdl.py: wait for the previous kernel first
        pdl_enter()
    j = tl.program_id(0)
    c = tl.arange(0, BLOCK_K)
    ok = c < K
    n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    w = tl.load(w_ptr + n.to(tl.int64)[:, None] * stride_w + c[None, :],
                mask=n_ok[:, None] & ok[None, :], other=0.0).to(tl.float32)
    nw = 1.0 + tl.load(nw_ptr + c, mask=ok, other=0.0).to(tl.float32)
    for t in tl.static_range(T):
        x = tl.load(x_ptr + t * stride_x + c, mask=ok, other=0.0)
        if HAS_H:  # the residual add, rounded to the model dtype as `_add_rms_norm_kernel`
            x = (x.to(tl.float32) + tl.load(h_ptr + t * stride_h + c, mask=ok, other=0.0)
                 .to(tl.float32)).to(res_ptr.dtype.element_ty)
            if j == 0:
                tl.store(res_ptr + t * stride_r + c, x, mask=ok)
        xf = x.to(tl.float32)
        hn = (xf * tl.rsqrt(tl.sum(xf * xf, 0) / K + eps) * nw).to(out_ptr.dtype.element_ty)
        if j == 0:
            tl.store(out_ptr + t * stride_o + c, hn, mask=ok)
        acc = tl.sum(w * hn.to(tl.float32)[None, :], 1)  # fp32 sums, rounded once
        tl.store(y_ptr + t * stride_y + n, acc.to(y_ptr.dtype.element_ty), mask=n_ok)


# rows of W a program of `add_rms_norm_linear` takes: 8 rows of a 2048-wide bf16 weight are
# 32 KB, so the router (257 rows) runs 33 programs and the router + shared gate/up (1344
# padded rows) 168
LINEAR_BLOCK_N = 8
# the fused kernel is for decode steps of a few rows: every program repeats their norm
LINEAR_MAX_ROWS = 4


def add_rms_norm_linear(x: torch.Tensor, h: torch.Tensor | None, norm_weight: torch.Tensor,
                        eps: float, weight: torch.Tensor):
    """`add_rms_norm_1p` and then `F.linear(normed, weight)` in one launch (kb/0037), for the
    few rows of a decode step: the MoE block's first GEMM (the router and shared-expert gate
    rows, 257 × 2048 in bf16: ~1 MB, latency-bound) rides in the post-attention norm's launch.

    x, h: [T, K] (same dtype, unit column stride; h None = norm only), T ≤ LINEAR_MAX_ROWS;
    norm_weight: [K] (zero-centred, spec §3); weight: [N, K] in x.dtype, unit column stride.
    Returns (residual [T, K], normed [T, K], y [T, N]) in x.dtype. residual and normed are
    computed as `add_rms_norm_1p` computes them; y sums in fp32 and rounds once, in another
    order than cuBLAS (rounding-level differences: the accuracy gate covers the switch that
    uses it). Raises ValueError on more rows, another dtype or mismatched shapes.
    """
    T, K = x.shape
    N = weight.shape[0]
    if (T > LINEAR_MAX_ROWS or weight.dim() != 2 or weight.shape[1] != K
            or weight.dtype != x.dtype or weight.stride(1) != 1 or x.stride(1) != 1
            or (h is not None and (h.shape != x.shape or h.stride(1) != 1))):
        raise ValueError(f"add_rms_norm_linear: x{tuple(x.shape)} {x.dtype}, weight"
                         f"{tuple(weight.shape)} {weight.dtype}: need T <= {LINEAR_MAX_ROWS} "
                         "rows and a [N, K] weight of x's dtype, unit column strides")
    res = torch.empty_like(x) if h is not None else x
    out = torch.empty_like(x)
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    if T == 0:
        return res, out, y
    block_k = triton.next_power_of_2(K)
    hh = h if h is not None else x
    _add_rms_norm_linear_kernel[(triton.cdiv(N, LINEAR_BLOCK_N),)](
        x, hh, norm_weight, weight, res, out, y, N, K, eps,
        x.stride(0), hh.stride(0), res.stride(0), out.stride(0), weight.stride(0), y.stride(0),
        T=T, HAS_H=h is not None, BLOCK_K=block_k, BLOCK_N=LINEAR_BLOCK_N,
        num_warps=8 if block_k >= 2048 else 4, **pdl_launch(out))
    return res, out, y
