"""W4A16 kernels for NVFP4 dense weights (spec §9.2, `model/nvfp4.py`): a GEMV for 1–16 rows
(lm_head and the dense projections at decode) and a one-pass dequantization (the MoE's bf16
scratch above the GEMV sizes).

Why: decode is memory-bound, and an NVFP4 weight is 4.5 bits an element (a packed byte per
two, an e4m3 scale per 16) where bf16 is 16 and FP8 8. Hopper has no FP4 tensor cores, so the
4-bit codes are turned into fp32 values in registers (`e2m1`, a few integer ops and a
bitcast: no table) and multiplied with the activations on the CUDA cores, as `fp8_gemv` does
with e4m3 weights. Each program reads [ROWS, BLOCK_K/2] bytes of packed weights and their
[ROWS, BLOCK_K/16] scales per step of its K loop, multiplies the even codes (low nibbles) with
x's even columns and the odd codes with its odd ones, sums each group of 16, applies the
group's scale, sums the groups, and applies the tensor's global scale once at the end.

Numerics: products and sums in fp32; the reference (`nvfp4.dequantize` then `F.linear`)
rounds the weight to the activation dtype first and sums in another order, so the two agree
to fp32 summation order in fp32 and to bf16 weight rounding in bf16. The dequantization
kernel forms (code · scale) · scale_2 in fp32 like the reference: bitwise equal to it.
Tests: tests/kernels/test_nvfp4_kernels.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tailored import flags
from tailored.kernels import interpreted
from tailored.kernels.pdl import enter as pdl_enter
from tailored.kernels.pdl import launch as pdl_launch

GROUP = 16
MAX_ROWS = 16  # rows of x the GEMV takes (its T loop is unrolled)
CFG = (8, 512, 4)  # (ROWS of W a program, BLOCK_K, num_warps): not tuned yet (kb/0065)
# Triton's interpreter runs programs one after another in Python: the tiny model's lm_head (the
# real 248k vocabulary) in 8-row programs took minutes a call
INTERPRETED_CFG = (2048, 512, 4)


@triton.jit
def e2m1(c):
    """4-bit codes (int32, 0..15) → their E2M1 values (fp32) by building the fp32 bits: the
    magnitude index m = c & 7 has exponent field m >> 1 and mantissa bit m & 1; exponent 0 is
    0 or 0.5, else the value is 2^(e-1)·(1 + mantissa/2); bit 3 of c is the sign."""
    m = c & 7
    e = m >> 1
    bits = tl.where(e == 0, (m & 1) * (126 << 23), ((e + 126) << 23) | ((m & 1) << 22))
    bits = bits | ((c >> 3) << 31)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def packed_tile(w_base, s_base, n, n_ok, stride_wn, stride_sn, j0, nbytes,
                HALF: tl.constexpr):
    """Rows n of a packed NVFP4 weight (at w_base, `nbytes` bytes a row; group scales at
    s_base) at bytes j0 .. j0 + HALF, decoded: (even-column values, odd-column values) fp32
    [ROWS, HALF] and the groups' scales fp32 [ROWS, HALF / 8]; zeros past the row. j0 is a
    multiple of 8 (a group's bytes)."""
    G: tl.constexpr = HALF // 8
    j = j0 + tl.arange(0, HALF)
    b = tl.load(w_base + n[:, None].to(tl.int64) * stride_wn + j[None, :],
                mask=n_ok[:, None] & (j < nbytes)[None, :], other=0).to(tl.int32)
    g = j0 // 8 + tl.arange(0, G)
    s = tl.load(s_base + n[:, None].to(tl.int64) * stride_sn + g[None, :],
                mask=n_ok[:, None] & (g < nbytes // 8)[None, :], other=0.0).to(tl.float32)
    return e2m1(b & 15), e2m1(b >> 4), s


@triton.jit
def tile_dot(lo, hi, s, xe, xo, ROWS: tl.constexpr, HALF: tl.constexpr):
    """[ROWS] fp32: a decoded tile (`packed_tile`) times x given as its even (xe) and odd (xo)
    columns at the tile's bytes (fp32 [HALF]): each group of 16 products summed, scaled by
    its group's scale, the groups summed. Without the global scale."""
    prod = lo * xe[None, :] + hi * xo[None, :]
    part = tl.sum(tl.reshape(prod, [ROWS, HALF // 8, 8]), 2)
    return tl.sum(part * s, 1)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, s_ptr, s2_ptr, y_ptr, T, N, K, stride_xt, stride_wn, stride_sn,
                 stride_yt, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
                 PDL: tl.constexpr = False):
    if PDL:  # kernels/pdl.py: wait for the previous kernel first
        pdl_enter()
    HALF: tl.constexpr = BLOCK_K // 2
    n = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    n_ok = n < N
    t = tl.arange(0, BLOCK_T)
    acc = tl.zeros([ROWS, BLOCK_T], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        j = k0 // 2 + tl.arange(0, HALF)  # bytes of each row this step
        j_ok = j < K // 2
        lo, hi, s = packed_tile(w_ptr, s_ptr, n, n_ok, stride_wn, stride_sn, k0 // 2, K // 2,
                                HALF)
        for tt in tl.static_range(BLOCK_T):  # the decoded tile is reused by each row of x
            x_ok = j_ok & ((j * 0 + tt) < T)
            xe = tl.load(x_ptr + tt * stride_xt + 2 * j, mask=x_ok, other=0.0).to(tl.float32)
            xo = tl.load(x_ptr + tt * stride_xt + 2 * j + 1, mask=x_ok, other=0.0).to(tl.float32)
            dot = tile_dot(lo, hi, s, xe, xo, ROWS, HALF)
            acc += tl.where(t[None, :] == tt, dot[:, None], 0.0)
    acc = acc * tl.load(s2_ptr).to(tl.float32)
    tl.store(y_ptr + t[None, :] * stride_yt + n[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=n_ok[:, None] & (t < T)[None, :])


def nvfp4_gemv(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
               scale_2: torch.Tensor, cfg: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [T, K] (bf16/fp32), 1 ≤ T ≤ 16 · dequantize(packed, scale, scale_2)ᵀ → [T, N] in
    x.dtype. packed uint8 [N, K/2], scale float8_e4m3fn [N, K/16] (unit column strides),
    scale_2 fp32 one value (a tensor: read on the device, no host sync). cfg: (ROWS, BLOCK_K,
    num_warps), powers of 2, BLOCK_K ≥ 16 (else `CFG`). Raises ValueError on other shapes."""
    T, K = x.shape
    N = packed.shape[0]
    if (not 1 <= T <= MAX_ROWS or K % GROUP or packed.dtype != torch.uint8
            or packed.shape != (N, K // 2) or scale.shape != (N, K // GROUP)
            or scale.dtype != torch.float8_e4m3fn or scale_2.numel() != 1
            or packed.stride(1) != 1 or scale.stride(1) != 1):
        raise ValueError(f"nvfp4_gemv: x{tuple(x.shape)} packed{tuple(packed.shape)} "
                         f"{packed.dtype} scale{tuple(scale.shape)} {scale.dtype} scale_2 "
                         f"{tuple(scale_2.shape)} (T ≤ {MAX_ROWS}, K % 16 == 0, unit column "
                         "strides)")
    rows, bk, warps = cfg or (INTERPRETED_CFG if interpreted() else CFG)
    if rows < 1 or rows & (rows - 1) or bk < GROUP or bk & (bk - 1):
        raise ValueError(f"nvfp4_gemv: cfg {cfg}: ROWS and BLOCK_K powers of 2, BLOCK_K ≥ 16")
    bk = min(bk, max(GROUP, triton.next_power_of_2(K)))
    x = x if x.stride(1) == 1 else x.contiguous()
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(N, rows),)](
        x, packed, scale, scale_2.reshape(1), y, T, N, K, x.stride(0), packed.stride(0), scale.stride(0),
        y.stride(0), ROWS=rows, BLOCK_K=bk, BLOCK_T=triton.next_power_of_2(T), num_warps=warps,
        **pdl_launch(x))
    return y


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, s2_ptr, out_ptr, R, HALF_K, rows_per_global, stride_w,
                    stride_s, stride_o, ROWS: tl.constexpr, BLOCK_J: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    j = tl.program_id(1) * BLOCK_J + tl.arange(0, BLOCK_J)
    ok = (r < R)[:, None] & (j < HALF_K)[None, :]
    r64 = r.to(tl.int64)[:, None]
    b = tl.load(w_ptr + r64 * stride_w + j[None, :], mask=ok, other=0).to(tl.int32)
    s = tl.load(s_ptr + r64 * stride_s + (j // 8)[None, :], mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(s2_ptr + r // rows_per_global, mask=r < R, other=0.0).to(tl.float32)[:, None]
    lo = e2m1(b & 15) * s * s2
    hi = e2m1(b >> 4) * s * s2
    dst = out_ptr + r64 * stride_o + 2 * j[None, :]
    tl.store(dst, lo.to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(dst + 1, hi.to(out_ptr.dtype.element_ty), mask=ok)


def dequantize_into(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor,
                    out: torch.Tensor) -> torch.Tensor:
    """`nvfp4.dequantize` in one launch, into `out`: packed uint8 [..., R, K/2] and scale e4m3
    [..., R, K/16] contiguous, scale_2 fp32 with one value per `R·lead / scale_2.numel()`
    consecutive rows (a tensor's one value; experts' [E, 2] gate/up halves or [E, 1]);
    out [..., R, K] contiguous (bf16/fp32). Bitwise the reference's. Returns out."""
    K2 = packed.shape[-1]
    rows = packed.numel() // K2
    if (packed.dtype != torch.uint8 or not packed.is_contiguous() or not scale.is_contiguous()
            or not out.is_contiguous() or out.shape[-1] != 2 * K2 or out.numel() != 2 * packed.numel()
            or scale.numel() * 8 != packed.numel() or rows % scale_2.numel()):
        raise ValueError(f"dequantize_into: packed{tuple(packed.shape)} scale{tuple(scale.shape)} "
                         f"scale_2{tuple(scale_2.shape)} out{tuple(out.shape)}")
    s2 = scale_2.reshape(-1).float().contiguous()
    ROWS, BJ = (1024, 512) if interpreted() else (16, 64)  # (INTERPRETED_CFG's why)
    _dequant_kernel[(triton.cdiv(rows, ROWS), triton.cdiv(K2, BJ))](
        packed, scale, s2, out, rows, K2, rows // s2.numel(), K2, K2 // 8, 2 * K2,
        ROWS=ROWS, BLOCK_J=BJ)
    return out


def nvfp4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                 scale_2: torch.Tensor) -> torch.Tensor:
    """x [T, K] · dequantize(W)ᵀ → [T, N] for an NVFP4 linear on the kernel path (lm_head):
    up to `nvfp4_gemv_up_to` rows, W4A16 GEMVs of 16 rows each (each reads the packed weight
    once: 4.5 bits an element); above, W dequantized into a scratch in x's dtype (one
    launch) and one GEMM."""
    T = x.shape[0]
    if 1 <= T <= flags.current().nvfp4_gemv_up_to:
        parts = [nvfp4_gemv(x[i:i + MAX_ROWS], packed, scale, scale_2)
                 for i in range(0, T, MAX_ROWS)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)
    w = torch.empty(packed.shape[0], 2 * packed.shape[1], dtype=x.dtype, device=x.device)
    return F.linear(x, dequantize_into(packed, scale, scale_2, w))
