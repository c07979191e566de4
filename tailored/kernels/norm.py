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
