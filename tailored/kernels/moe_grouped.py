"""Routed experts of a large prefill step through torch's grouped GEMM (spec §7.3).

Why: at 8192 tokens an expert gets ~256 rows, a GEMM's worth, and our Triton expert GEMMs
(`kernels.moe.fused_moe`) reach ~100 TFLOP/s there, while `torch._grouped_mm` (CUTLASS's sm90
grouped GEMM, TMA + warp specialisation) ran the gate_up GEMM of the same rows at ~470 TFLOP/s on
the H200 (lab/bench_moe_prefill.py, kb/0031). The MoE was ~134 ms of a 314 ms
8 × 1024-token FP8 step (kb/0029 §6), the step every wave of a c=32 benchmark waits on.

The path, for the (token, slot) pairs sorted by expert (`moe_route.moe_align`):
  xs   = x[token of each sorted pair]                    [P, H]  bf16 (a gather)
  h    = grouped_mm(xs, gate_upᵀ per expert)             [P, 2I] bf16
  act  = silu_mul(h[:, :I], h[:, I:])                    [P, I]  bf16, PyTorch's roundings
  y    = grouped_mm(act, downᵀ per expert)               [P, H]  bf16
  out[pair] = w[pair] · y  (fp32, back in (token, slot) order: `unsort_weighted`)
which rounds where the reference does (`ref.moe_experts` runs each expert as bf16 F.linear
calls and silu · up in bf16), where `fused_moe` keeps gate/up in fp32 until the activation.
Block-FP8 experts are first dequantized to bf16 (`dequantize_experts`, q · scale rounded once:
`fp8.dequantize_block`), the reference's "FP8 weights dequantized" semantics.

The model takes this path in eager prefill steps only, never inside a CUDA graph capture
(`kernel_moe.grouped_applies`). On sm90/sm100 torch's grouped GEMM reads the group offsets on the
device; elsewhere it falls back to a loop that copies them to the host per GEMM (slow, not
capture-safe), so the path is for the H200. Tests: tests/kernels/test_moe_grouped.py (CPU: torch's
CPU grouped_mm and the interpreter; the same file on the H200), tests/gpu/test_gpu.py (the kernel
path with it against the plain path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tailored.kernels.fp8_linear import SCALE_BLOCK
from tailored.kernels.moe import expert_shapes
from tailored.kernels.moe_route import moe_align
from tailored.kernels.moe_combine import silu_mul
from tailored.kernels.pdl import enter as pdl_enter
from tailored.kernels.pdl import launch as pdl_launch


def available() -> bool:
    """torch has `_grouped_mm` (torch ≥ 2.8; the H200's 2.11 and the CPU's 2.13 do)."""
    return hasattr(torch, "_grouped_mm")


@triton.jit
def _unsort_weighted_kernel(y_ptr, order_ptr, w_ptr, out_ptr, H, stride_y, stride_o,
                            BLOCK: tl.constexpr,
                            PDL: tl.constexpr = False):
    if PDL:  # kernels/pdl.py: wait for the previous kernel first
        pdl_enter()
    j = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < H
    p = tl.load(order_ptr + j).to(tl.int64)
    w = tl.load(w_ptr + p).to(tl.float32)
    y = tl.load(y_ptr + j.to(tl.int64) * stride_y + c, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + p * stride_o + c, y * w, mask=ok)


def unsort_weighted(y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """out[order[j]] = weights.flat[order[j]] · y[j] in fp32.

    y: [P, H] (any float dtype, unit column stride), rows in expert-sorted order; order: [P]
    int32/int64, a permutation of 0..P-1 (pair p = token·k + slot); weights: [T, k] with T·k = P.
    Returns [P, H] fp32 in (token, slot) order, `fused_moe(..., reduce=False)`'s layout for
    `moe_combine`. Raises ValueError on mismatched shapes.
    """
    P, H = y.shape
    if (order.shape != (P,) or weights.numel() != P or y.stride(1) != 1
            or order.dtype not in (torch.int32, torch.int64)
            or order.device != y.device or weights.device != y.device):
        raise ValueError(f"unsort_weighted: y{tuple(y.shape)} {y.stride()} order"
                         f"{tuple(order.shape)} {order.dtype} weights{tuple(weights.shape)}: "
                         "need int order [P] and weights of P values on y's device")
    out = torch.empty(P, H, dtype=torch.float32, device=y.device)
    if P == 0:
        return out
    block = min(1024, triton.next_power_of_2(H))
    _unsort_weighted_kernel[(P, triton.cdiv(H, block))](
        y, order, weights.reshape(-1), out, H, y.stride(0), out.stride(0), BLOCK=block,
        num_warps=4, **pdl_launch(out))
    return out


# Not fp8_dequant's kernel: that one reads per-row scales (its fused dense parts break the
# 128-row block grid), while experts keep the checkpoint's block scales (kb/0027), here with
# the gate/up halves' own block rows.
@triton.jit
def _dequant_experts_kernel(q_ptr, s_ptr, out_ptr, N, K, SPLIT, NB_SPLIT,
                            stride_qe, stride_qn, stride_se, stride_sn, stride_oe, stride_on,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            PDL: tl.constexpr = False):
    if PDL:  # kernels/pdl.py: wait for the previous kernel first
        pdl_enter()
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K  # BLOCK_K divides 128: one scale column per tile
    k = k0 + tl.arange(0, BLOCK_K)
    e = tl.program_id(2).to(tl.int64)
    n_ok = n < N
    mask = n_ok[:, None] & (k < K)[None, :]
    # rows below SPLIT (the gate half) use block row n // 128, the rest (the up half) start
    # their own blocks at NB_SPLIT
    brow = tl.where(n < SPLIT, n // 128, NB_SPLIT + (n - SPLIT) // 128)
    s = tl.load(s_ptr + e * stride_se + brow * stride_sn + k0 // 128, mask=n_ok, other=0.0)
    q = tl.load(q_ptr + e * stride_qe + n[:, None].to(tl.int64) * stride_qn + k[None, :],
                mask=mask, other=0.0)
    y = q.to(tl.float32) * s[:, None]
    tl.store(out_ptr + e * stride_oe + n[:, None].to(tl.int64) * stride_on + k[None, :],
             y.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_experts(q: torch.Tensor, scale: torch.Tensor, gate_up: bool,
                       out: torch.Tensor | None = None, dtype=torch.bfloat16) -> torch.Tensor:
    """Block-FP8 experts → `dtype`, q · scale in fp32 rounded once (`fp8.dequantize_block` of
    each expert, and of each half of a gate_up expert).

    q: [E, N, K] float8_e4m3fn contiguous; scale: the MoE kernels' block scales
    (`fp8.expert_block_scales`): gate_up [E, 2·ceil(I/128), ceil(K/128)] with N = 2I (gate
    blocks, then up blocks), down [E, ceil(N/128), ceil(K/128)]. out: [E, N, K] contiguous
    float scratch on q's device to write into (its dtype wins over `dtype`; else allocated in
    `dtype`). Returns out.
    Raises ValueError on mismatched shapes, dtypes or layouts."""
    E, N, K = q.shape
    nbk = triton.cdiv(K, SCALE_BLOCK)
    split, nb_split = (N // 2, triton.cdiv(N // 2, SCALE_BLOCK)) if gate_up else (N, 0)
    want = (E, (2 * nb_split) if gate_up else triton.cdiv(N, SCALE_BLOCK), nbk)
    if q.dtype != torch.float8_e4m3fn or not q.is_contiguous() or scale.shape != want \
            or scale.dtype != torch.float32 or scale.stride(2) != 1 \
            or (gate_up and N % 2):
        raise ValueError(f"dequantize_experts: q{tuple(q.shape)} {q.dtype} scale"
                         f"{tuple(scale.shape)} {scale.dtype}: need float8_e4m3fn [E, N, K] "
                         f"contiguous and fp32 block scales {want}")
    if out is None:
        out = torch.empty(E, N, K, dtype=dtype, device=q.device)
    if out.shape != q.shape or not out.is_contiguous() or out.device != q.device \
            or not out.dtype.is_floating_point or out.dtype == torch.float8_e4m3fn:
        raise ValueError(f"dequantize_experts: out{tuple(out.shape)} {out.dtype} on "
                         f"{out.device} for q{tuple(q.shape)} on {q.device}")
    if E and N and K:
        bn, bk = 64, min(128, max(16, triton.next_power_of_2(K)))
        _dequant_experts_kernel[(triton.cdiv(N, bn), triton.cdiv(K, bk), E)](
            q, scale, out, N, K, split, nb_split, q.stride(0), q.stride(1), scale.stride(0),
            scale.stride(1), out.stride(0), out.stride(1), BLOCK_N=bn, BLOCK_K=bk,
            num_warps=4, **pdl_launch(out))
    return out


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The weighted routed-expert terms of every (token, slot) pair, through torch._grouped_mm.

    x: [T, H] bf16; weights: [T, k] routing weights; ids: [T, k] int64 expert ids in
    0..E-1; gate_up: [E, 2I, H] bf16 (gate rows first); down: [E, H, I] bf16 (FP8 experts:
    `dequantize_experts` first); H and I multiples of 8 (grouped_mm's 16-byte strides: torch
    raises RuntimeError otherwise). Returns [T·k, H] fp32 in (token, slot) order,
    `fused_moe(..., reduce=False)`'s contract (the sum over slots equals `ref.moe_experts` up
    to bf16 rounding). Raises ValueError on mismatched shapes or a non-bf16 operand (the CUDA
    grouped GEMM is bf16 only).
    """
    y, order = _sorted_outputs(x, weights, ids, gate_up, down)
    return unsort_weighted(y, order, weights)


def grouped_experts_sorted(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                           gate_up: torch.Tensor, down: torch.Tensor):
    """`grouped_experts` without its unsort: (y [T·k, H] bf16, the experts' unweighted outputs
    in expert-sorted order; rows [T·k] int32, pair p = token·k + slot being row rows[p]), for
    `moe_combine(y, k, ..., rows=rows, weights=weights)` to weight and sum in one pass. Same
    arguments and errors as `grouped_experts`."""
    y, order = _sorted_outputs(x, weights, ids, gate_up, down)
    rows = torch.empty_like(order)
    rows[order.long()] = torch.arange(order.numel(), dtype=order.dtype, device=order.device)
    return y, rows


def _sorted_outputs(x, weights, ids, gate_up, down):
    """(y [P, H] bf16 in expert-sorted order, order [P] int32) of the grouped GEMMs."""
    T, H, E, I = expert_shapes(x, weights, ids, gate_up, down, "grouped_experts")
    if not (x.dtype == gate_up.dtype == down.dtype == torch.bfloat16):
        raise ValueError(f"grouped_experts: bf16 operands only, got x {x.dtype}, gate_up "
                         f"{gate_up.dtype}, down {down.dtype}")
    k = ids.shape[1]
    order, offsets = moe_align(ids, E)
    ends = offsets[1:]  # grouped_mm's groups: cumulative row ends, one per expert (empty ok)
    xs = x.index_select(0, torch.div(order, k, rounding_mode="floor"))
    h = torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=ends)
    act = silu_mul(h[:, :I], h[:, I:])
    return torch._grouped_mm(act, down.transpose(1, 2), offs=ends), order
