"""W8A16 linear for block-FP8 weights (model spec §9.1): y = x · (W_fp8 ⊙ scale)ᵀ.

The weight stays FP8 in memory and is read once per tile (half the bytes of bf16: decode is
memory bound); each [KB, BLOCK_N] tile is converted to the activation dtype (exact: every
e4m3 value is a bf16 value), multiplied on the tensor cores with fp32 accumulation, and scaled
by its rows' block scale for that K block before it is added — so KB (the K of one dot;
BLOCK_K = one or two of them per loop iteration) divides 128 and the scale is one value per
(row, K block). Scales come per row (`fp8.row_scales`, [N, ceil(K/128)]
fp32), which keeps them right when linears are concatenated along N.

Used by FP8 linears held as FP8 (`TAILORED_FP8_DENSE_DEQUANT=0`, the MTP draft head). (Float16
dots with power-of-2 row scales for the dense projections lost to cuBLAS over the dequantized
bf16 copy, kb/0043, and were removed; the FP8 MoE group through this GEMM with its bf16 rows
in the same launch gained nothing in the model, kb/0044, and went too.)

Reference: `tailored.model.fp8.dequantize_block` then `F.linear` (tests/kernels/test_fp8_kernels.py);
the idea as in vLLM's block-FP8 Triton GEMM, with bf16 activations instead of FP8 ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tailored.kernels import autotune_enabled, dot_precision, tuning
from tailored.kernels.pdl import enter as pdl_enter
from tailored.kernels.pdl import launch as pdl_launch

SCALE_BLOCK = 128


@triton.jit
def pow2_rows_f16(a):
    """(a·2^k as float16, 2^-k) with one power of 2 per row of the [M, K] tile a (bf16/fp32),
    chosen from the row's largest magnitude m so that m·2^k < 2^15 (float16 ends at 65504):
    k = 141 - (m's biased fp32 exponent), at most 126 (m zero or subnormal; 2^±126 are the
    widest powers of 2 the exponent field builds as normal floats; no finite m needs k below
    -113). A power-of-2 scale changes no significant bit, so every bf16 value ≥ m·2^-28 converts
    to float16 exactly (smaller ones fall into float16's subnormals: terms below 2^-28 of the
    row's largest, under fp32's own rounding of the sum), and an fp32 sum of products scaled
    back by 2^-k is the unscaled one (kb/0042). inf stays inf and NaN NaN (a NaN's row max is
    the other elements'); zero rows stay zero. A review found (kb/0042): a clamp at ±100 sent rows
    ≥ 2^116 to inf and flushed rows below 2^-117."""
    af = a.to(tl.float32)
    ex = (tl.max(tl.abs(af), 1).to(tl.int32, bitcast=True) >> 23) & 0xFF
    k = tl.minimum(tl.maximum(141 - ex, -126), 126)
    up = ((k + 127) << 23).to(tl.float32, bitcast=True)  # 2^k built from its exponent: exact
    back = ((127 - k) << 23).to(tl.float32, bitcast=True)
    return (af * up[:, None]).to(tl.float16), back


@triton.jit
def tile_dot(acc, a, w, s_ptr, n, n_ok, stride_sn, k0, DOT_PREC: tl.constexpr,
             W_FP8: tl.constexpr, S_ROWS: tl.constexpr = 1, DOT_F16: tl.constexpr = False,
             A_POW2: tl.constexpr = False):
    """acc + a·w for one [BLOCK_K, BLOCK_N] weight tile at K offset k0. A bf16/fp32 tile is
    used as is; an FP8 tile is converted to a's dtype (exact) and its partial product scaled by
    its rows' block scale for K block k0 // 128 (so BLOCK_K ≤ 128): weight row n's scales
    start at s_ptr + (n // S_ROWS)·stride_sn, i.e. per-row scales (`fp8.row_scales`, S_ROWS =
    1: this linear, whose fused projections put a part's first row mid-block) or the block
    scales themselves (S_ROWS = 128: the MoE experts, where gate, up and down each start their
    own 128-row block grid at row 0, whatever their sizes). Unused when not W_FP8. Shared by
    this linear and the MoE expert GEMMs. DOT_F16 (FP8 only, the MoE gate_up, kb/0029): both operands
    go to float16 instead, where e4m3 converts in one instruction per pair; exact for the
    weights, and for activations inside float16's normal range (bf16 → f16 keeps their 8
    significant bits), so the products, and the fp32 sums, are those of the bf16 dot.
    A_POW2 (with DOT_F16; the MoE down GEMM, whose input silu(g)·u has no bound below 65504):
    each row of a is first scaled by a power of 2 into float16's range (`pow2_rows_f16`) and
    its partial product scaled back, so the dot is the bf16 one for every finite activation
    row (elements below 2^-28 of their row's largest may round: float16 subnormals)."""
    if W_FP8:
        s = tl.load(s_ptr + (n // S_ROWS) * stride_sn + k0 // 128, mask=n_ok, other=0.0)
        if DOT_F16 and A_POW2:
            a16, back = pow2_rows_f16(a)
            acc += (tl.dot(a16, w.to(tl.float16)) * back[:, None]) * s[None, :]
        elif DOT_F16:
            acc += tl.dot(a.to(tl.float16), w.to(tl.float16)) * s[None, :]
        else:
            acc += tl.dot(a, w.to(a.dtype), input_precision=DOT_PREC) * s[None, :]
    else:
        acc = tl.dot(a, w, acc, input_precision=DOT_PREC)
    return acc


@triton.jit
def _fp8_linear_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K: tl.constexpr,
                       stride_xm, stride_wn, stride_sn, stride_ym,
                       M_BUCKET, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, KB: tl.constexpr, DOT_PREC: tl.constexpr,
                       PDL: tl.constexpr = False):
    if PDL:  # kernels/pdl.py: wait for the previous kernel first
        pdl_enter()
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < M
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    # BLOCK_K of K per loop iteration, as BLOCK_K // KB dots of KB each (FP8: KB ≤ 128, one
    # scale per row and dot). The dots of one iteration are independent and their loads issue
    # together: at M ≤ 32 the K loop is a chain of dependent iterations (16 of 128 at K = 2048
    # set an ~11 µs floor, kb/0009), and 256-wide iterations halve it with the same sequence
    # of accumulations, so the result is bitwise that of BLOCK_K = KB.
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        for j in tl.static_range(BLOCK_K // KB):
            kk = k0 + j * KB + tl.arange(0, KB)
            k_ok = kk < K
            a = tl.load(x_ptr + m[:, None].to(tl.int64) * stride_xm + kk[None, :],
                        mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr + n[None, :].to(tl.int64) * stride_wn + kk[:, None],
                        mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            acc = tile_dot(acc, a, w, s_ptr, n, n_ok, stride_sn, k0 + j * KB, DOT_PREC, True)
    tl.store(y_ptr + m[:, None].to(tl.int64) * stride_ym + n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def block_m(M: int) -> int:
    return 16 if M <= 16 else 32 if M <= 32 else 64 if M <= 64 else 128


_TUNED: dict = {}


def _tuned(small: bool):
    """Autotuned launcher (CUDA): keyed on N, K, BLOCK_M and the power-of-2 row bucket
    (decode batch sizes tune once each, at warm-up; all prefills > 64 rows share one tuning). Two small config sets (memory-bound rows ≤ 64: narrow N tiles for more CTAs;
    prefill: wide tiles), since every config is one more compile at server start."""
    if small not in _TUNED:
        if small:  # 128 or 256 of K per iteration (two 128-wide dots: kb/0009's floor)
            cfgs = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "KB": 128}, num_warps=4,
                                  num_stages=st)
                    for bn in (16, 32, 64) for bk in (128, 256) for st in (3, 4)]
        else:
            cfgs = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "KB": bk}, num_warps=w,
                                  num_stages=3)
                    for bn in (64, 128) for bk in (64, 128) for w in (4, 8)]
        _TUNED[small] = tuning.register(
            f"fp8_linear/{'small' if small else 'large'}",
            triton.autotune(configs=cfgs, key=["N", "K", "BLOCK_M", "M_BUCKET"],
                            warmup=5, rep=20)(_fp8_linear_kernel))
    return _TUNED[small]


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_rows: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bf16/fp16/fp32, unit column stride) · dequant(weight)ᵀ → [M, N] in x.dtype.

    weight: [N, K] float8_e4m3fn, row stride free, unit column stride; scale_rows: [N,
    ceil(K/128)] fp32 (`fp8.row_scales`). Raises ValueError on mismatched shapes or dtypes.
    """
    M, K = x.shape
    N, K2 = weight.shape
    if (K2 != K or weight.dtype != torch.float8_e4m3fn
            or scale_rows.shape != (N, triton.cdiv(K, SCALE_BLOCK))):
        raise ValueError(f"fp8_linear: x{tuple(x.shape)} {x.dtype} weight{tuple(weight.shape)} "
                         f"{weight.dtype} scale_rows{tuple(scale_rows.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1 or scale_rows.stride(1) != 1:
        raise ValueError("fp8_linear: weight and scale_rows need a unit column stride")
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return y
    bm = block_m(M)
    bucket = triton.next_power_of_2(M) if M <= 64 else 0
    args = (x, weight, scale_rows, y, M, N, K, x.stride(0), weight.stride(0),
            scale_rows.stride(0), y.stride(0), bucket)
    prec = dot_precision(x.dtype)
    if x.is_cuda and autotune_enabled(x.dtype):
        _tuned(M <= 64)[lambda c: (triton.cdiv(M, bm), triton.cdiv(N, c["BLOCK_N"]))](
            *args, BLOCK_M=bm, DOT_PREC=prec, **pdl_launch(x))
    else:  # Triton's interpreter (CPU tests), or TAILORED_AUTOTUNE=0: a fixed choice
        bn, bk = 32, min(128, max(16, triton.next_power_of_2(K)))
        _fp8_linear_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
            *args, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, KB=bk, DOT_PREC=prec, **pdl_launch(x))
    return y
