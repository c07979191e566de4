"""W8A8 block-FP8 GEMM for decode rows: activations quantized to e4m3 per 128-wide group of
each row (one fp32 scale a group), weights e4m3 with 128x128 block scales, products on the FP8
tensor cores, fp32 sums. y = Σ_kb (x̂_kb · ŵ_kbᵀ) · sx[:, kb] · sw[n // 128, kb]. Built blind
in session 36 (kb/0056 §5), not wired into the model: `scripts/bench_w8a8.py` measures it
against cuBLAS over the dequantized bf16 copy first.

Why: FP8 serving runs its dense projections of 3–64 rows through cuBLAS over a dequantized
bf16 copy (`FastPath`, `FP8_DENSE_DEQUANT`, kb/0026), ~1.4–1.6 ms of the 10.3 ms FP8 B=32 step:
it reads 2 bytes a weight where the checkpoint holds 1. The W8A16 kernels that read the FP8
weights (`fp8_linear`, `fp8_splitk`) convert every e4m3 weight to bf16 before the dot, and at
32 rows that conversion, not the bytes, bounds them (kb/0029 §5, kb/0043, kb/0045). Here the
dot takes e4m3 on both sides, so no weight is converted: the weight tile goes from memory to
the tensor cores as loaded. The activations are quantized inside the GEMM (xs None: each
program quantizes the [rows, 128] tile it reads, a row reduction in registers, 4x fewer
conversions than the weight tile's at 32 rows and 128-wide N tiles), or beforehand by
`quant_act` (one launch, shared by the projections that read the same input).

Numerics: the activations are rounded to e4m3 (3 mantissa bits) per group. That error is added
to the W8A16 path's, so a model using this must pass the FP8 gate. vLLM serves the official
FP8 checkpoint this way (`activation_scheme: dynamic` in the config: per-token-group
activation scales); the reference here is `quant_act_ref` and `w8a8_linear_ref` (fp32 over the
dequantized operands), which the kernels match to fp32 summation order.

References: DeepSeek-V3 technical report §3.3 (fine-grained FP8: 1x128 activation tiles,
128x128 weight blocks); vLLM's `w8a8_block_fp8_matmul` / `per_token_group_quant_fp8` (the same
layout; read for the layout, not copied).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tailored.kernels.pdl import enter as pdl_enter
from tailored.kernels.pdl import launch as pdl_launch

GROUP = 128  # activation group = weight block width along K
E4M3_MAX = 448.0  # (also literal in `e4m3_rows`)
SCALE_FLOOR = 1e-10  # an all-zero group's scale (its codes are 0 either way; literal there too)


def quant_act_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] → (e4m3 codes [M, K], fp32 scales [M, ⌈K/128⌉]) with scale = max(|x| of the
    128-wide group (the last one may be partial), 1e-10) / 448 and code = e4m3(x / scale),
    rounded to nearest."""
    M, K = x.shape
    G = triton.cdiv(K, GROUP)
    xg = torch.nn.functional.pad(x.float(), (0, G * GROUP - K)).view(M, G, GROUP)
    s = xg.abs().amax(-1).clamp(min=SCALE_FLOOR) / E4M3_MAX
    q = (xg / s[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(M, G * GROUP)[:, :K], s


def w8a8_linear_ref(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor,
                    ws: torch.Tensor, out_dtype=torch.bfloat16) -> torch.Tensor:
    """fp32 reference of `w8a8_linear`: the dequantized operands' product, rounded once.
    xq/xs: `quant_act_ref`; w [N, K] e4m3; ws [N, K/128] per-row block scales."""
    K = xq.shape[1]
    xd = xq.float() * xs.float().repeat_interleave(GROUP, 1)[:, :K]
    return (xd @ (w.float() * ws.float().repeat_interleave(GROUP, 1)[:, :K]).t()).to(out_dtype)


@triton.jit
def e4m3_rows(x):
    """`quant_act_ref`'s arithmetic on an fp32 tile x [R, C] (a group of each row): (codes
    [R, C] as fp32 within ±448, to be cast to e4m3 by the caller; scales [R]). The one copy
    for `quant_act`, the GEMM's in-tile quantization and `fp8_linear.tile_dot`'s A_FP8, so
    their codes are the same bits. IEEE divisions (div_rn): Triton's `/` on fp32 is the
    approximate one, and a code next to a rounding boundary would then differ from torch's.
    The literals are E4M3_MAX and SCALE_FLOOR."""
    s = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 1), 1e-10), 448.0)
    q = tl.minimum(tl.maximum(tl.math.div_rn(x, s[:, None]), -448.0), 448.0)
    return q, s


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, stride_sm,
                  GROUP_: tl.constexpr, PDL: tl.constexpr = False):
    # program (row, group): one 128-wide group's absmax scale and its e4m3 codes, as a
    # [1, GROUP] tile
    if PDL:  # kernels/pdl.py: wait for the previous kernel first
        pdl_enter()
    m = tl.program_id(0).to(tl.int64)
    gi = tl.program_id(1)
    k = gi * GROUP_ + tl.arange(0, GROUP_)[None, :]
    x = tl.load(x_ptr + m * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
    q, s = e4m3_rows(x)
    tl.store(q_ptr + m * stride_qm + k, q.to(q_ptr.dtype.element_ty), mask=k < K)
    tl.store(s_ptr + m * stride_sm + gi + tl.arange(0, 1), s)


def quant_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quant_act_ref` in one launch (GPU). x: [M, K] bf16/fp32, unit stride on K. Returns
    (codes [M, K] float8_e4m3fn, scales [M, ⌈K/128⌉] fp32). Raises ValueError for a stride
    other than 1 along K."""
    M, K = x.shape
    if x.stride(1) != 1:
        raise ValueError("quant_act: x needs unit stride along K")
    G = triton.cdiv(K, GROUP)
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(M, G, dtype=torch.float32, device=x.device)
    if M:
        _quant_kernel[(M, G)](x, q, s, K, x.stride(0), q.stride(0), s.stride(0),
                              GROUP_=GROUP, num_warps=1, **pdl_launch(x))
    return q, s


@triton.jit
def _w8a8_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, M, N, K, K_SPLIT,
                 stride_xm, stride_xsm, stride_wn, stride_wsn, stride_os, stride_om,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_: tl.constexpr,
                 QUANT_IN: tl.constexpr, PDL: tl.constexpr = False):
    # program (n block, split, m block) over K range [split·K_SPLIT, +K_SPLIT) in 128-wide
    # groups: one fp8 dot a group, scaled by its rows' activation scales and its weight rows'
    # block scales (row layout [N, K/128], `fp8.row_scales`: right for fused linears too),
    # summed in K order. QUANT_IN: x is the bf16 activation and each program quantizes the
    # group it reads (the group is the K step, so its absmax is a row reduction of the tile in
    # registers: no quantization launch, no codes in memory; the N programs of a row block
    # repeat it, cheap beside the weight tile); else x holds codes and xs their scales
    # (`quant_act`). out: fp32 partials [splits, M, N], or y with one split.
    if PDL:  # kernels/pdl.py: wait for the previous kernel first
        pdl_enter()
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = m < M, n < N
    kk = tl.arange(0, GROUP_)
    k_lo = pid_s * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, GROUP_):
        k_ok = (k0 + kk) < k_hi  # a partial last group (K not a multiple of 128)
        xt = tl.load(x_ptr + m[:, None].to(tl.int64) * stride_xm + (k0 + kk)[None, :],
                     mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if QUANT_IN:  # `quant_act`'s arithmetic on this tile
            q, sa = e4m3_rows(xt.to(tl.float32))
            a = q.to(w_ptr.dtype.element_ty)
        else:
            a = xt
            sa = tl.load(xs_ptr + m * stride_xsm + k0 // GROUP_, mask=m_ok, other=0.0)
        b = tl.load(w_ptr + n[None, :].to(tl.int64) * stride_wn + (k0 + kk)[:, None],
                    mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        sb = tl.load(ws_ptr + n * stride_wsn + k0 // GROUP_, mask=n_ok, other=0.0)
        acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
    tl.store(out_ptr + pid_s * stride_os + m[:, None].to(tl.int64) * stride_om + n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def w8a8_linear(x: torch.Tensor, xs: torch.Tensor | None, w: torch.Tensor, ws: torch.Tensor,
                k_split: int | None = None, block_n: int = 128, block_m: int | None = None,
                num_warps: int = 4, num_stages: int = 3,
                out_dtype=torch.bfloat16) -> torch.Tensor:
    """y [M, N] = quantized(x) · (w·ws)ᵀ on the FP8 tensor cores (GPU, Hopper).

    x: [M, K] float8_e4m3fn codes with xs [M, ⌈K/128⌉] fp32 scales (`quant_act`), or, with xs
    None, the bf16/fp32 activation itself, quantized inside the GEMM with `quant_act`'s
    arithmetic (no extra launch). Unit stride on K. w [N, K] float8_e4m3fn, unit stride on K;
    ws [N, ⌈K/128⌉] fp32 per-row block scales (`fp8.row_scales` of the checkpoint's
    `weight_scale_inv`). k_split: K columns a program sums (a multiple of 128; None = all of
    K, one launch); with several splits each writes fp32 partials, summed in a fixed order
    (deterministic) and rounded to out_dtype. block_n: 16..256, a power of 2. Raises
    ValueError for bad shapes, dtypes, strides or tile sizes."""
    M, K = x.shape
    N = w.shape[0]
    quant_in = xs is None
    if w.dtype != torch.float8_e4m3fn or (not quant_in and x.dtype != torch.float8_e4m3fn):
        raise ValueError(f"w8a8_linear: e4m3 operands expected, got {x.dtype} and {w.dtype}")
    if quant_in and x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"w8a8_linear: a bf16/fp32 activation to quantize, got {x.dtype}")
    G = triton.cdiv(K, GROUP)
    if w.shape[1] != K or (not quant_in and xs.shape != (M, G)):
        raise ValueError(f"w8a8_linear: shapes x {tuple(x.shape)}, scales "
                         f"{None if quant_in else tuple(xs.shape)}, w {tuple(w.shape)} do not "
                         f"fit 128-wide groups")
    if ws.shape != (N, G):
        raise ValueError(f"w8a8_linear: row scales {tuple(ws.shape)} for w {tuple(w.shape)} "
                         f"(want [N, ceil(K/128)])")
    if block_n < 16 or block_n > 256 or block_n & (block_n - 1):
        raise ValueError(f"w8a8_linear: block_n={block_n} must be a power of 2 in 16..256")
    k_split = G * GROUP if k_split is None else k_split
    if k_split <= 0 or k_split % GROUP:
        raise ValueError(f"w8a8_linear: k_split={k_split} must be a positive multiple of {GROUP}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("w8a8_linear: operands need unit stride along K")
    splits = triton.cdiv(K, k_split)
    bm = block_m or max(16, min(64, triton.next_power_of_2(M)))
    y = torch.empty(M, N, dtype=out_dtype, device=x.device)
    if M == 0:
        return y
    out = y if splits == 1 else torch.empty(splits, M, N, dtype=torch.float32,
                                            device=x.device)
    grid = (triton.cdiv(N, block_n), splits, triton.cdiv(M, bm))
    _w8a8_kernel[grid](x, x if quant_in else xs, w, ws, out, M, N, K, k_split, x.stride(0),
                       0 if quant_in else xs.stride(0), w.stride(0), ws.stride(0),
                       out.stride(0) if splits > 1 else 0, out.stride(-2), BLOCK_M=bm,
                       BLOCK_N=block_n, GROUP_=GROUP, QUANT_IN=quant_in, num_warps=num_warps,
                       num_stages=num_stages, **pdl_launch(x))
    if splits > 1:
        y.copy_(out.sum(0))  # a fixed order for a given shape: deterministic
    return y


def dense_config(N: int, K: int) -> tuple[int, int, int, int]:
    """(k_split, block_n, num_warps, num_stages) for a dense projection of N rows and K inputs
    at decode rows: 128-wide N tiles, and K split (powers of 2, ≥ 128 columns a program) until
    the grid has ≥ 132 programs (one per H200 SM) — the narrow outputs (N = 2048) would run
    on 16 SMs otherwise. A guess until `scripts/bench_w8a8.py` has measured the grid."""
    blocks, G = triton.cdiv(N, 128), triton.cdiv(K, GROUP)
    splits = 1
    while blocks * splits < 132 and G % (2 * splits) == 0:
        splits *= 2
    return G // splits * GROUP, 128, 4, 3


def w8a8_dense(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """`w8a8_linear` with the activation quantized inside, at `dense_config`'s tiles: FastPath's
    FP8 dense projections (TAILORED_FP8_W8A8_UP_TO rows). Same contract and errors."""
    ks, bn, warps, stages = dense_config(w.shape[0], x.shape[1])
    return w8a8_linear(x, None, w, ws, k_split=ks, block_n=bn, num_warps=warps,
                       num_stages=stages)
