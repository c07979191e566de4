"""Per-head zero-centred RMSNorm + partial rotate-half RoPE of the attention's q or k, one pass.

The gated-attention layers (spec §6.2–6.3) normalise every query and key head (`q_norm`,
`k_norm`: `ref.rms_norm_1p`) and rotate their first `rotary_dim` (64 of 256) dims
(`ref.apply_partial_rope`). In PyTorch that is ~16 elementwise kernels per tensor; in a decode
step's graph each costs ~1.5 µs of GPU time, ×2 tensors ×10 layers. This kernel does it in one
launch per tensor, one program per (token, head).

Casts follow the reference exactly: the norm in fp32, rounded to the model dtype; then the
rotation in that dtype as PyTorch's eager ops round it (`x·cos` rounded, `rot·sin` rounded,
their sum rounded). Compiled with `enable_fp_fusion=False`: ptxas would otherwise fuse
`x·cos + b` into one bf16 FMA and skip a rounding (found by compiling for sm_90, kb/0012).
The rotation partner of dim d (d ± R/2) is recomputed from the input, not gathered from
registers — the same fp32 ops give the same value.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tailored.kernels.pdl import enter as pdl_enter
from tailored.kernels.pdl import launch as pdl_launch


@triton.jit
def _norm_rope_head(row, w_ptr, cos_row, sin_row, eps, dt, D: tl.constexpr, R: tl.constexpr):
    """One head [D] at `row`: zero-centred RMSNorm (fp32, rounded to dt), then rotate-half RoPE
    on its first R dims with the reference's roundings. Returns [D] in dt."""
    d = tl.arange(0, D)
    xf = tl.load(row + d).to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, 0) / D + eps)
    n = (xf * inv * (1.0 + tl.load(w_ptr + d).to(tl.float32))).to(dt)
    # rotate-half partner within the first R dims: d < R/2 takes −n[d + R/2], else n[d − R/2]
    in_rot = d < R
    first = d < R // 2
    p = tl.where(first, d + R // 2, d - R // 2)
    p = tl.where(in_rot, p, d)
    pf = tl.load(row + p).to(tl.float32)
    pn = (pf * inv * (1.0 + tl.load(w_ptr + p).to(tl.float32))).to(dt)
    rot = tl.where(first, -pn, pn)
    c = tl.load(cos_row + d, mask=in_rot, other=0.0)
    s = tl.load(sin_row + d, mask=in_rot, other=0.0)
    a = (n.to(tl.float32) * c.to(tl.float32)).to(dt)
    b = (rot.to(tl.float32) * s.to(tl.float32)).to(dt)
    return tl.where(in_rot, (a.to(tl.float32) + b.to(tl.float32)).to(dt), n)


@triton.jit
def _qk_norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, rows_ptr, v_ptr, v_out_ptr,
                         eps, stride_xt, stride_xh, stride_ct, stride_ot, stride_oh,
                         stride_vt, stride_vh, stride_vot, stride_voh,
                         D: tl.constexpr, R: tl.constexpr, TO_ROWS: tl.constexpr,
                         COPY_V: tl.constexpr,
                         PDL: tl.constexpr = False):
    if PDL:  # kernels/pdl.py: wait for the previous kernel first
        pdl_enter()
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    y = _norm_rope_head(x_ptr + t * stride_xt + h * stride_xh, w_ptr, cos_ptr + t * stride_ct,
                        sin_ptr + t * stride_ct, eps, out_ptr.dtype.element_ty, D, R)
    o = tl.load(rows_ptr + t).to(tl.int64) if TO_ROWS else t  # KV cache row of this token
    tl.store(out_ptr + o * stride_ot + h * stride_oh + d, y)
    if COPY_V:  # the token's v head goes to the same cache row (one launch for the KV store)
        vv = tl.load(v_ptr + t * stride_vt + h * stride_vh + d)
        tl.store(v_out_ptr + o * stride_vot + h * stride_voh + d, vv)


def _check_heads(who: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """x [T, H, D] with unit stride on D, D a power of 2; cos, sin [T, R] alike with R even,
    ≤ D; else ValueError naming `who`."""
    T, _, D = x.shape
    R = cos.shape[-1]
    if (x.stride(2) != 1 or D & (D - 1) or R % 2 or R > D or cos.shape != (T, R)
            or sin.shape != cos.shape or cos.stride(1) != 1 or sin.stride() != cos.stride()):
        raise ValueError(f"{who}: x{tuple(x.shape)} stride {x.stride()}, "
                         f"cos{tuple(cos.shape)}, sin{tuple(sin.shape)}")


def _check_store(who: str, x: torch.Tensor, rows: torch.Tensor, out: torch.Tensor,
                 v: torch.Tensor | None, v_out: torch.Tensor | None) -> None:
    """The KV store's tensors for keys x [T, H, D]: rows [T], out [N, H, D] in x.dtype with
    unit stride on D; v like x and v_out like out, of one dtype; else ValueError."""
    T, H, D = x.shape
    if (rows.shape != (T,) or out.shape[1:] != (H, D) or out.stride(2) != 1
            or out.dtype != x.dtype):
        raise ValueError(f"{who}: rows{tuple(rows.shape)} out{tuple(out.shape)} "
                         f"stride {out.stride()} {out.dtype} for x{tuple(x.shape)} {x.dtype}")
    if v is not None and (v.shape != x.shape or v.stride(2) != 1 or v_out.shape != out.shape
                          or v_out.stride(2) != 1 or v.dtype != v_out.dtype):
        raise ValueError(f"{who}: v{tuple(v.shape)} v_out{tuple(v_out.shape)}")


def qk_norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 eps: float, rows: torch.Tensor | None = None, out: torch.Tensor | None = None,
                 v: torch.Tensor | None = None, v_out: torch.Tensor | None = None) -> torch.Tensor:
    """apply_partial_rope(rms_norm_1p(x, weight, eps), cos, sin) in one launch.

    x: [T, H, D] (unit stride on D; token and head strides free, e.g. a view of the fused qkv
    GEMM output); weight: [D]; cos, sin: [T, R] in x.dtype (`ref.rope_cos_sin`), R even, ≤ D;
    D a power of 2. Returns a contiguous [T, H, D] tensor in x.dtype.
    KV store in the same launch (decode keys, kb/0022): rows [T] int64 (device) and out
    [N, H, D] (a layer's flat K cache, unit stride on D): token t's result goes to out[rows[t]]
    and out is returned; with v [T, H, D] and v_out (the flat V cache), v[t] is copied to
    v_out[rows[t]]. Rows may repeat only for pad rows (the sink: last writer wins).
    Raises ValueError on mismatched shapes. Source: spec §6.2–6.3, reference
    `ref.rms_norm_1p` + `ref.apply_partial_rope`.
    """
    T, H, D = x.shape
    R = cos.shape[-1]
    _check_heads("qk_norm_rope", x, cos, sin)
    to_rows = rows is not None
    if to_rows != (out is not None) or (v is None) != (v_out is None) or (v is not None and not to_rows):
        raise ValueError("qk_norm_rope: rows and out go together, v and v_out too (with rows)")
    if to_rows:
        _check_store("qk_norm_rope", x, rows, out, v, v_out)
    if out is None:
        out = torch.empty(T, H, D, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    vv, vo = (v, v_out) if v is not None else (x, out)  # unused pointers without COPY_V
    _qk_norm_rope_kernel[(T, H)](x, weight, cos, sin, out, rows if to_rows else x, vv, vo, eps,
                                 x.stride(0), x.stride(1), cos.stride(0), out.stride(0),
                                 out.stride(1), vv.stride(0), vv.stride(1), vo.stride(0),
                                 vo.stride(1), D=D, R=R, TO_ROWS=to_rows, COPY_V=v is not None,
                                 num_warps=2 if D <= 256 else 4,
                                 enable_fp_fusion=False,  # no FMA: keep each rounding
                                 **pdl_launch(x))
    return out
