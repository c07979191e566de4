"""Per-token-group FP8 activation quantisation (model spec §9.1): x [T, K] → e4m3 codes [T, K]
and one fp32 scale per 128-wide group of each row, [T, ceil(K/128)], for W8A8 block-scaled GEMMs
(`moe_w8a8`): x[t, k] ≈ q[t, k] · s[t, k // 128].

The scale is a power of two: s = 2^ceil(log2(amax / 448)), the smallest power of two with
amax / s ≤ 448 (e4m3's largest finite value), amax the group's largest |x| (a partial last group
counts its real columns only). Why a power of two and not amax / 448 (vLLM's
`per_token_group_quant_fp8`):
  * exact and reproducible: s comes from amax's exponent bits and x / s is an exponent shift
    (x · 2^-k, exact in fp32), so the kernel and the PyTorch reference produce the same codes
    and scales bit for bit on any GPU and in Triton's interpreter. amax / 448 needs an IEEE
    division (Triton's `/` is the approximate one on fp32: kb/0057's quantiser differed from its
    reference in the last bits at every row count) and then x / s rounds a second time;
  * the GEMM's a_scale · w_scale and the dequantised q · s stay exact (no extra rounding);
  * the cost: the group's largest code lands in (224, 448] instead of exactly 448, i.e. up to one
    binade of e4m3's range below the top is unused. e4m3's relative precision (3 mantissa bits)
    is the same in every normal binade, so only values below amax · 2^-14 (e4m3 subnormals)
    lose bits; the same trade DeepGEMM's UE8M0 scales make.
An all-zero group gets s = 1 (codes 0). Scales are clamped to [2^-126, 2^126] (amax below 2^-117,
fp32's tiny end, keeps s = 2^-126: such groups quantise to 0 or a few subnormal codes).

The fp32 → e4m3 rounding is done here in fp32 arithmetic (round to nearest even at e4m3's
quantum for the value's binade, `round_e4m3`) so that the final cast converts an exactly
representable value: Triton's CPU interpreter rounds fp32 → e4m3 wrongly where a value rounds up
into the next binade (31.6 became 16 instead of 32), the GPU's cvt.rn.satfinite does it right;
with the rounding done first both give the same bits as torch's `.to(float8_e4m3fn)`.

Reference: `quantize_groups_ref` (plain PyTorch, the same bit arithmetic for the scale, torch's
own e4m3 cast for the codes); tests/kernels/test_moe_w8a8.py checks them equal bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tailored.kernels.pdl import enter as pdl_enter
from tailored.kernels.pdl import launch as pdl_launch

GROUP = 128  # activation group along K = the checkpoint's weight block width
FP8 = torch.float8_e4m3fn


@triton.jit
def pow2_group_scale(amax):
    """(s, 1/s) fp32 for group maxima amax ≥ 0 (any shape): s = 2^k, k the smallest integer
    with amax ≤ 448 · 2^k, clamped to [-126, 126]; amax = 0 gives s = 1. From the bits: amax =
    1.m · 2^e is ≤ 1.75 · 2^(k+8) iff k ≥ e - 8 (m ≤ .75, mantissa bits ≤ 0x600000) or
    k ≥ e - 7 (m > .75). Both powers are built from their exponent fields: exact."""
    bits = amax.to(tl.int32, bitcast=True)
    ex = (bits >> 23) & 0xFF
    k = ex - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    k = tl.where(amax == 0.0, 0, tl.minimum(tl.maximum(k, -126), 126))
    s = ((k + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - k) << 23).to(tl.float32, bitcast=True)
    return s, inv


@triton.jit
def round_e4m3(v):
    """v (fp32, |v| ≤ 448) rounded to the nearest e4m3 value, ties to even, as fp32 (exactly
    representable in e4m3, so a cast after it is exact everywhere). For |v| in [2^e, 2^(e+1))
    e4m3's quantum is 2^(e-3) (2^-9 below 2^-6: subnormals), and (|v| + C) - C with C = 2^(e+20)
    rounds |v| to it in fp32's round-to-nearest-even: C's ulp is 2^(e-3). The sign is copied
    from v's bits (so -0 and tiny negatives give -0, as torch's cast does)."""
    bits = v.to(tl.int32, bitcast=True)
    mag = (bits & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    c = ((e + 147) << 23).to(tl.float32, bitcast=True)  # 2^(e+20)
    r = (mag + c) - c
    return (r.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def quantize_tile(x):
    """One 128-wide group of each row of the fp32 tile x [R, C] (C ≥ the group's columns, the
    rest 0): (codes [R, C] fp32, exactly e4m3 values, to be cast by the caller; scales [R])."""
    s, inv = pow2_group_scale(tl.max(tl.abs(x), 1))
    return round_e4m3(x * inv[:, None]), s


@triton.jit
def _quant_groups_kernel(x_ptr, q_ptr, s_ptr, T, K, stride_xt, stride_qt, stride_st,
                         BLOCK_R: tl.constexpr, GROUP_: tl.constexpr,
                         PDL: tl.constexpr = False):
    # program (row block, group): BLOCK_R rows of one 128-wide group
    if PDL:  # kernels/pdl.py: wait for the previous kernel first
        pdl_enter()
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    g = tl.program_id(1)
    c = g * GROUP_ + tl.arange(0, GROUP_)
    r_ok = r < T
    mask = r_ok[:, None] & (c < K)[None, :]
    x = tl.load(x_ptr + r[:, None].to(tl.int64) * stride_xt + c[None, :], mask=mask,
                other=0.0).to(tl.float32)
    q, s = quantize_tile(x)
    tl.store(q_ptr + r[:, None].to(tl.int64) * stride_qt + c[None, :],
             q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + r.to(tl.int64) * stride_st + g, s, mask=r_ok)


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] (bf16/fp16/fp32, unit column stride) → (q [T, K] float8_e4m3fn, s [T,
    ceil(K/128)] fp32), one launch: `quantize_groups_ref`'s result bit for bit. Raises
    ValueError for another layout."""
    if x.dim() != 2 or x.stride(1) != 1 or not x.dtype.is_floating_point or x.dtype == FP8:
        raise ValueError(f"quantize_groups: x{tuple(x.shape)} {x.dtype} stride {x.stride()}: "
                         "need a float [T, K] with unit column stride")
    T, K = x.shape
    G = triton.cdiv(K, GROUP)
    q = torch.empty(T, K, dtype=FP8, device=x.device)
    s = torch.empty(T, G, dtype=torch.float32, device=x.device)
    if T and K:
        br = 16
        _quant_groups_kernel[(triton.cdiv(T, br), G)](
            x, q, s, T, K, x.stride(0), q.stride(0), s.stride(0), BLOCK_R=br, GROUP_=GROUP,
            num_warps=4, **pdl_launch(x))
    return q, s


def pow2_scale_ref(amax: torch.Tensor) -> torch.Tensor:
    """`pow2_group_scale`'s s in PyTorch (amax fp32 ≥ 0, any shape), the same bit arithmetic."""
    bits = amax.float().contiguous().view(torch.int32)
    k = ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)
    k = torch.where(amax == 0, torch.zeros_like(k), k.clamp(-126, 126))
    return ((k + 127) << 23).view(torch.float32)


def quantize_groups_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch `quantize_groups`: s = `pow2_scale_ref` of each 128-wide group's amax
    (partial last group: its real columns), q = e4m3(x / s) by torch's round-to-nearest-even
    cast (x / s is exact: s is a power of two)."""
    T, K = x.shape
    G = triton.cdiv(K, GROUP)
    xg = torch.nn.functional.pad(x.float(), (0, G * GROUP - K)).view(T, G, GROUP)
    s = pow2_scale_ref(xg.abs().amax(-1))
    q = (xg / s[..., None]).to(FP8)
    return q.view(T, G * GROUP)[:, :K].contiguous(), s


def dequantize_groups(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """q · s per 128-wide group, fp32 (exact: s is a power of two)."""
    K = q.shape[1]
    return q.float() * s.repeat_interleave(GROUP, 1)[:, :K]
