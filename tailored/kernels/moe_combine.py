"""The sparse-MoE block's elementwise glue in two launches (spec §7.3–7.4).

Around the routed experts' GEMMs and the shared expert's down projection, the block computes
`silu(gate) · up` for the shared expert and `Σ_k pairs + sigmoid(shared_gate) · shared` at the
end: seven eager PyTorch kernels per layer (sum, cast, silu, mul, sigmoid, mul, add), ×40
layers in every decode step's graph. These two kernels do the same with the reference's casts:
  silu_mul:    dt(dt(silu(g)) · u)                      (F.silu then *, each rounded to dt)
  moe_combine: dt(dt(Σ_k pairs) + dt(dt(sigmoid(s)) · shared))
where dt is the model dtype and the maths between roundings is fp32. Compiled with
`enable_fp_fusion=False` (an FMA would skip the rounding of `dt(sigmoid)·shared` before the add)
and exact division; `tl.exp` is the fast approximation where PyTorch uses `expf`, which can
flip a bf16 rounding rarely. Reference:
`model/kernel_moe.py` before fusion = `ref` ops; tests/kernels/test_kernels.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tailored.kernels.pdl import enter as pdl_enter
from tailored.kernels.pdl import launch as pdl_launch


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, N, stride_g, stride_u, stride_o,
                     BLOCK: tl.constexpr,
                     PDL: tl.constexpr = False):
    if PDL:  # kernels/pdl.py: wait for the previous kernel first
        pdl_enter()
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < N
    dt = out_ptr.dtype.element_ty
    g = tl.load(g_ptr + t * stride_g + c, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + t * stride_u + c, mask=ok, other=0.0).to(tl.float32)
    a = tl.math.div_rn(g, 1.0 + tl.exp(-g)).to(dt)  # exact division, as PyTorch's silu
    tl.store(out_ptr + t * stride_o + c, (a.to(tl.float32) * u).to(dt), mask=ok)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up with PyTorch's eager roundings. gate, up: [T, N] (same dtype, unit column
    stride, row strides free: views of a fused GEMM output). Returns contiguous [T, N]."""
    T, N = gate.shape
    if up.shape != gate.shape or gate.stride(1) != 1 or up.stride(1) != 1 or up.dtype != gate.dtype:
        raise ValueError(f"silu_mul: gate{tuple(gate.shape)} {gate.stride()} up{tuple(up.shape)} {up.stride()}")
    out = torch.empty(T, N, dtype=gate.dtype, device=gate.device)
    if T == 0:
        return out
    block = min(1024, triton.next_power_of_2(N))
    _silu_mul_kernel[(T, triton.cdiv(N, block))](gate, up, out, N, gate.stride(0), up.stride(0),
                                                 out.stride(0), BLOCK=block, num_warps=4,
                                                 enable_fp_fusion=False, **pdl_launch(out))
    return out


@triton.jit
def _moe_combine_kernel(p_ptr, s_ptr, sh_ptr, out_ptr, res_ptr, res_out_ptr, nw_ptr, rows_ptr,
                        rw_ptr, H, eps, stride_s, stride_sh, stride_o, stride_r, stride_ro,
                        K: tl.constexpr, BLOCK: tl.constexpr, FOLDED: tl.constexpr,
                        NORM: tl.constexpr, GATHER: tl.constexpr = False,
                        PDL: tl.constexpr = False):
    if PDL:  # kernels/pdl.py: wait for the previous kernel first
        pdl_enter()
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < H
    dt = out_ptr.dtype.element_ty
    S: tl.constexpr = K + 1 if FOLDED else K  # pair rows per token
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(K):
        if GATHER:  # pair t·K + j is row rows[t·K + j] of expert-sorted, unweighted outputs
            r = tl.load(rows_ptr + t * K + j).to(tl.int64)
            w = tl.load(rw_ptr + t * K + j).to(tl.float32)
            acc += tl.load(p_ptr + r * H + c, mask=ok, other=0.0).to(tl.float32) * w
        else:
            acc += tl.load(p_ptr + (t * S + j) * H + c, mask=ok, other=0.0)
    routed = acc.to(dt).to(tl.float32)
    if FOLDED:  # the shared expert's weighted term is the token's last pair row
        shared = tl.load(p_ptr + (t * S + K) * H + c, mask=ok, other=0.0).to(dt).to(tl.float32)
    else:
        s = tl.load(s_ptr + t * stride_s).to(tl.float32)
        gate = tl.math.div_rn(1.0, 1.0 + tl.exp(-s)).to(dt).to(tl.float32)
        sh = tl.load(sh_ptr + t * stride_sh + c, mask=ok, other=0.0).to(tl.float32)
        shared = (gate * sh).to(dt).to(tl.float32)
    y = (routed + shared).to(dt)
    if NORM:  # then kernels/norm.py's add + zero-centred RMSNorm of the next layer's input
        x = (tl.load(res_ptr + t * stride_r + c, mask=ok, other=0.0).to(tl.float32)
             + y.to(tl.float32)).to(dt)
        tl.store(res_out_ptr + t * stride_ro + c, x, mask=ok)
        xf = x.to(tl.float32)
        n = xf * tl.rsqrt(tl.sum(xf * xf, 0) / H + eps)
        n = n * (1.0 + tl.load(nw_ptr + c, mask=ok, other=0.0).to(tl.float32))
        tl.store(out_ptr + t * stride_o + c, n.to(dt), mask=ok)
    else:
        tl.store(out_ptr + t * stride_o + c, y, mask=ok)


def _launch(pairs, k, seg, shared, T, H, dtype, folded, norm, rows=None, weights=None):
    """Shared launcher: out [T, H] (and the new residual with norm = (res, weight, eps));
    rows/weights: pairs are expert-sorted unweighted outputs gathered by rows."""
    out = torch.empty(T, H, dtype=dtype, device=pairs.device)
    res_out = torch.empty(T, H, dtype=dtype, device=pairs.device) if norm else out
    if T == 0:
        return (res_out, out) if norm else out
    # with the norm one program holds the whole row (the RMS needs it); else 1024 columns
    block = triton.next_power_of_2(H) if norm else min(1024, triton.next_power_of_2(H))
    res, w, eps = norm if norm else (out, out, 0.0)
    if norm and (res.shape != (T, H) or res.stride(1) != 1 or res.dtype != dtype
                 or w.shape != (H,)):
        raise ValueError(f"moe_combine: residual{tuple(res.shape)} {res.dtype} weight"
                         f"{tuple(w.shape)} for [{T}, {H}] {dtype}")
    gather = rows is not None
    _moe_combine_kernel[(T, triton.cdiv(H, block))](
        pairs, seg, shared, out, res, res_out, w, rows if gather else out,
        weights if gather else out, H, eps, seg.stride(0), shared.stride(0),
        out.stride(0), res.stride(0), res_out.stride(0), K=k, BLOCK=block, FOLDED=folded,
        NORM=bool(norm), GATHER=gather, num_warps=8 if block >= 2048 else 4,
        enable_fp_fusion=False, **pdl_launch(out))  # no FMA: keep each rounding
    return (res_out, out) if norm else out


def moe_combine(pairs: torch.Tensor, k: int, shared_gate: torch.Tensor,
                shared: torch.Tensor, norm: tuple | None = None, *,
                rows: torch.Tensor | None = None, weights: torch.Tensor | None = None):
    """Σ_k pairs + sigmoid(shared_gate) · shared, with the reference's roundings.

    pairs: [T·k, H] fp32 contiguous (`fused_moe(..., reduce=False)`); shared_gate: [T, 1] logits
    (row stride free); shared: [T, H] (unit column stride). Returns [T, H] in shared.dtype.
    norm = (residual [T, H], weight [H], eps): also the next layer's input in the same launch,
    as `add_rms_norm_1p(residual, moe_out, weight, eps)` computes it; returns (residual +
    moe_out, its zero-centred RMSNorm) instead (kb/0023).
    rows [T·k] int32/int64 and weights [T, k]: pairs are instead the experts' unweighted
    outputs in expert-sorted order ([T·k, H], any float dtype, contiguous:
    `moe_grouped.grouped_experts_sorted`), pair t·k + j being row rows[t·k + j], weighted here:
    bitwise what `moe_grouped.unsort_weighted` then this combine give, without the fp32
    [T·k, H] copy between them (kb/0031). Raises ValueError on bad shapes.
    """
    T, H = shared.shape
    gather = rows is not None or weights is not None
    if (pairs.shape != (T * k, H) or not pairs.is_contiguous()
            or (pairs.dtype != torch.float32 and not gather)
            or shared_gate.shape != (T, 1) or shared.stride(1) != 1
            or (gather and (rows is None or weights is None or rows.shape != (T * k,)
                            or weights.shape != (T, k) or not weights.is_contiguous()))):
        raise ValueError(f"moe_combine: pairs{tuple(pairs.shape)} {pairs.dtype} k={k} "
                         f"shared_gate{tuple(shared_gate.shape)} shared{tuple(shared.shape)}"
                         + (f" rows{tuple(rows.shape) if rows is not None else None} weights"
                            f"{tuple(weights.shape) if weights is not None else None}"
                            if gather else ""))
    return _launch(pairs, k, shared_gate, shared, T, H, shared.dtype, False, norm, rows, weights)


def moe_combine_folded(pairs: torch.Tensor, k: int, dtype: torch.dtype,
                       norm: tuple | None = None):
    """dt(dt(Σ_{j<k} pairs[t, j]) + dt(pairs[t, k])): the MoE block's output when the shared
    expert ran inside `fused_moe` as slot k with weight sigmoid(shared gate) (`route_align`'s
    shared_gate, kb/0019), so its weighted term is already a pair row.

    pairs: [T·(k+1), H] fp32 contiguous, (token, slot) order. Returns [T, H] in dtype; norm as
    in `moe_combine`. Raises ValueError on other shapes/dtypes. The roundings are those of
    `moe_combine` after the shared expert's own (it is rounded once, from fp32, like a routed
    expert's output).
    """
    if pairs.dim() != 2 or pairs.shape[0] % (k + 1) or pairs.dtype != torch.float32 \
            or not pairs.is_contiguous():
        raise ValueError(f"moe_combine_folded: pairs{tuple(pairs.shape)} {pairs.dtype} k={k}")
    T, H = pairs.shape[0] // (k + 1), pairs.shape[1]
    return _launch(pairs, k, pairs, pairs, T, H, dtype, True, norm)
