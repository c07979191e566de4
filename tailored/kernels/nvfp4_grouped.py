"""NVFP4 routed experts of a prefill step as a W4A16 grouped GEMM over expert-sorted rows
(spec §7, §9.2): the packed 4-bit weights decoded in registers inside the K loop, bf16
tensor-core dots, fp32 sums. No bf16 copy of the experts.

Why: above `nvfp4_gemv_up_to` rows the kernel path dequantized every layer's 256 experts into
a 1.6 GB bf16 scratch (~0.4 GB read, 1.6 GB written, then read again by the bf16 grouped GEMM)
before multiplying: ~2 GB of traffic a layer whatever the step's size, where the packed
experts are 0.45 GB. Hopper has no FP4 tensor cores, so each weight tile is decoded where it
is used (W4A16, as Marlin-style kernels do on Hopper): the codes are read once a program, in
4.5 bits an element, and the dots run on the bf16 tensor cores.

The path, for the (token, slot) pairs sorted by expert (`moe_route.moe_align`):
  act[r] = silu(g) · u with [g | u] = x[t_r] · [G_e | U_e]ᵀ · [g2_e | u2_e]   [P, I] x.dtype
  y[r]   = act[r] · D_eᵀ · d2_e                                          [P, H] x.dtype
rows r in expert-sorted order, unweighted: `moe_combine(y, k, ..., rows=, weights=)` weights
and sums them, the contract of `moe_grouped.grouped_experts_sorted` and `moe_w8a8`.
Each weight tile [BLOCK_N, BLOCK_K] is decoded as `nvfp4_gemv` does (the codes' fp32 bits
built arithmetically, no table), the even and odd codes interleaved back into columns and each
group of 16 multiplied by its e4m3 scale. code · scale has at most 6 significant bits inside
bf16's range, so the tile is exact in bf16 and the dot's only roundings are the fp32 sums; the
global scale (one per expert and linear) multiplies the fp32 accumulator once at the end.
gate and up tiles of the same columns sit in one program (two accumulators), so silu(g) · u is
formed in fp32 in the epilogue (as `fused_moe`; the bf16 grouped path rounds g and u first).

Work split as `moe_w8a8` (its `expert_blocks`, `grid_blocks`, `block_rows` and `block_ms`):
BLOCK_M-row blocks of each expert's rows numbered in expert order, an upper-bound grid of
(blocks × N tiles), N tiles fastest; programs past the last block exit. No host sync.

Launch configs: on CUDA (bf16/fp16) BLOCK_N, BLOCK_K, warps and stages by Triton's autotuner
keyed on (H, I, BLOCK_M), registered with `tuning`; the interpreter, fp32 activations and
TAILORED_AUTOTUNE=0 take `FIXED`. Triton's interpreter gets bf16 dots wrong (kernels/
__init__.py), so there the operands go to fp32 first: the same values (bf16 is exact in fp32)
and the same fp32 sums. Not yet measured on a GPU (kb/0067: lab/bench_moe_prefill.py --nvfp4).

Reference: `nvfp4_grouped_ref` (over the experts as `nvfp4.DequantExperts` dequantizes them
in fp32, fp32 matmuls); tests/kernels/test_nvfp4_grouped.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tailored.kernels import autotune_enabled, interpreted, tuning
from tailored.kernels.moe_grouped import unsort_weighted
from tailored.kernels.moe_route import moe_align
from tailored.kernels.moe_w8a8 import block_ms, block_rows, expert_blocks, grid_blocks
from tailored.kernels.nvfp4_gemv import GROUP, packed_tile
from tailored.kernels.pdl import enter as pdl_enter
from tailored.kernels.pdl import launch as pdl_launch

PACKED = torch.uint8  # two E2M1 codes a byte (`model/nvfp4.py`, which kernels/ do not import)
# GROUP as the jit functions may read it: Triton's compiler refuses a plain int global (its
# interpreter does not, so only the sm_90 compile test sees it)
GROUP_C = tl.constexpr(GROUP)

# (BLOCK_N, BLOCK_K, num_warps, num_stages) of gate_up and of down where nothing tunes: small
# enough tiles that the tests' H/I (208/96) cross N tiles and K steps with partial ones
FIXED = ((64, 64, 4, 3), (64, 64, 4, 3))


@triton.jit
def weight_tile(w_base, s_base, n, n_ok, k0, K, stride_wn, stride_sn, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """Rows n of a packed NVFP4 weight ([.., K/2] bytes, [.., K/16] e4m3 scales at s_base) at
    columns k0 .. k0 + BLOCK_K, decoded: fp32 [BLOCK_N, BLOCK_K] of code · group scale (zero
    past K or past the rows), without the global scale. k0 a multiple of BLOCK_K ≥ 16."""
    lo, hi, s = packed_tile(w_base, s_base, n, n_ok, stride_wn, stride_sn, k0 // 2, K // 2,
                            BLOCK_K // 2)
    # element 2j is byte j's low nibble, 2j+1 its high one: join restores column order
    v = tl.reshape(tl.join(lo, hi), [BLOCK_N, BLOCK_K // GROUP_C, GROUP_C]) * s[:, :, None]
    return tl.reshape(v, [BLOCK_N, BLOCK_K])


@triton.jit
def _mma(a, w, acc, DOT_F32: tl.constexpr):
    """acc + a · wᵀ: a [M, K] activations, w [N, K] a decoded tile (fp32, exact in bf16)."""
    if DOT_F32:  # fp32 activations, or any in the interpreter (its bf16 dot is wrong)
        acc = tl.dot(a.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc)
    return acc


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, s2_ptr, order_ptr, offsets_ptr, blocks_ptr, act_ptr,
                    E, TOPK, stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_s2,
                    stride_a, H: tl.constexpr, I: tl.constexpr, BLOCK_E: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    DOT_F32: tl.constexpr, PDL: tl.constexpr = False):
    # program (row block, N tile of I): the gate and up tiles of the same columns over H
    if PDL:  # kernels/pdl.py: wait for the previous kernel first
        pdl_enter()
    NT: tl.constexpr = (I + BLOCK_N - 1) // BLOCK_N
    pid_n, e, start, end = block_rows(offsets_ptr, blocks_ptr, E, NT, BLOCK_E, BLOCK_M)
    if start < end:
        r = start + tl.arange(0, BLOCK_M)
        r_ok = r < end
        tok = tl.load(order_ptr + r, mask=r_ok, other=0) // TOPK
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < I
        e64 = e.to(tl.int64)
        w_g, s_g = w_ptr + e64 * stride_we, s_ptr + e64 * stride_se
        w_u, s_u = w_g + I * stride_wn, s_g + I * stride_sn  # the up rows follow the gate's
        x_row = x_ptr + tok[:, None].to(tl.int64) * stride_x
        kk = tl.arange(0, BLOCK_K)
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k = k0 + kk
            a = tl.load(x_row + k[None, :], mask=r_ok[:, None] & (k < H)[None, :], other=0.0)
            wg = weight_tile(w_g, s_g, n, n_ok, k0, H, stride_wn, stride_sn, BLOCK_N, BLOCK_K)
            acc_g = _mma(a, wg, acc_g, DOT_F32)
            wu = weight_tile(w_u, s_u, n, n_ok, k0, H, stride_wn, stride_sn, BLOCK_N, BLOCK_K)
            acc_u = _mma(a, wu, acc_u, DOT_F32)
        g = acc_g * tl.load(s2_ptr + e64 * stride_s2)
        u = acc_u * tl.load(s2_ptr + e64 * stride_s2 + 1)
        act = g * tl.sigmoid(g) * u
        tl.store(act_ptr + r[:, None].to(tl.int64) * stride_a + n[None, :],
                 act.to(act_ptr.dtype.element_ty), mask=r_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(act_ptr, w_ptr, s_ptr, s2_ptr, offsets_ptr, blocks_ptr, y_ptr, E, stride_a,
                 stride_we, stride_wn, stride_se, stride_sn, stride_s2, stride_y,
                 H: tl.constexpr, I: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
                 PDL: tl.constexpr = False):
    # program (row block, N tile of H): y rows = act rows · D_eᵀ · d2_e, unweighted
    if PDL:  # kernels/pdl.py: wait for the previous kernel first
        pdl_enter()
    NT: tl.constexpr = (H + BLOCK_N - 1) // BLOCK_N
    pid_n, e, start, end = block_rows(offsets_ptr, blocks_ptr, E, NT, BLOCK_E, BLOCK_M)
    if start < end:
        r = start + tl.arange(0, BLOCK_M)
        r_ok = r < end
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < H
        e64 = e.to(tl.int64)
        w_d, s_d = w_ptr + e64 * stride_we, s_ptr + e64 * stride_se
        a_row = act_ptr + r[:, None].to(tl.int64) * stride_a
        kk = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            k = k0 + kk
            a = tl.load(a_row + k[None, :], mask=r_ok[:, None] & (k < I)[None, :], other=0.0)
            wd = weight_tile(w_d, s_d, n, n_ok, k0, I, stride_wn, stride_sn, BLOCK_N, BLOCK_K)
            acc = _mma(a, wd, acc, DOT_F32)
        y = acc * tl.load(s2_ptr + e64 * stride_s2)
        tl.store(y_ptr + r[:, None].to(tl.int64) * stride_y + n[None, :],
                 y.to(y_ptr.dtype.element_ty), mask=r_ok[:, None] & n_ok[None, :])


_TUNED: dict = {}


def _launcher(name: str):
    """Autotuned launcher (CUDA) of gate_up or down, keyed on (H, I, BLOCK_M): BLOCK_N 64/128
    × BLOCK_K 64/128 × warps 4/8, 3 stages (4 for down too). Not measured yet (kb/0067)."""
    if name not in _TUNED:
        kernel = _gate_up_kernel if name == "gate_up" else _down_kernel
        stages = (3,) if name == "gate_up" else (3, 4)
        cfgs = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
                for bn in (64, 128) for bk in (64, 128) for w in (4, 8) for st in stages]
        _TUNED[name] = tuning.register(
            f"nvfp4_grouped/{name}", triton.autotune(configs=cfgs, key=["H", "I", "BLOCK_M"],
                                                     warmup=5, rep=20)(kernel))
    return _TUNED[name]


def check_operands(x, weights, ids, gate_up: tuple, down: tuple, who: str):
    """(T, H, E, I) of an NVFP4 expert call; ValueError naming `who` unless x is a float
    [T, H], weights/ids [T, k] (ids integer), and the experts as `nvfp4.convert_model_` lays
    them out: gate_up = (packed uint8 [E, 2I, H/2], scale e4m3 [E, 2I, H/16], scale_2 fp32
    [E, 2]), down = (packed [E, H, I/2], scale [E, H, I/16], scale_2 [E, 1]), contiguous,
    H and I multiples of 16."""
    (gu, gu_s, gu_s2), (dn, dn_s, dn_s2) = gate_up, down
    shapes = (f"x{tuple(x.shape)} {x.dtype} weights{tuple(weights.shape)} ids{tuple(ids.shape)}"
              f" gate_up {[(tuple(t.shape), t.dtype) for t in gate_up]} down "
              f"{[(tuple(t.shape), t.dtype) for t in down]}")
    if x.dim() != 2 or gu.dim() != 3 or x.dtype not in (torch.bfloat16, torch.float16,
                                                         torch.float32):
        raise ValueError(f"{who}: {shapes}: need a float x [T, H] and NVFP4 experts")
    T, H = x.shape
    E, two_i, _ = gu.shape
    inter = two_i // 2
    if (H % GROUP or inter % GROUP or inter == 0 or ids.dim() != 2 or ids.shape[0] != T
            or weights.shape != ids.shape or ids.dtype.is_floating_point
            or gu.shape != (E, two_i, H // 2) or gu_s.shape != (E, two_i, H // GROUP)
            or gu_s2.shape != (E, 2) or dn.shape != (E, H, inter // 2)
            or dn_s.shape != (E, H, inter // GROUP) or dn_s2.shape != (E, 1)
            or gu.dtype != PACKED or dn.dtype != PACKED
            or gu_s.dtype != torch.float8_e4m3fn or dn_s.dtype != torch.float8_e4m3fn
            or gu_s2.dtype != torch.float32 or dn_s2.dtype != torch.float32
            or not all(t.is_contiguous() for t in (*gate_up, *down))):
        raise ValueError(f"{who}: {shapes}: need packed uint8 experts [E, 2I, H/2] / [E, H, "
                         "I/2] with e4m3 scales [.., /16] and fp32 global scales [E, 2] / "
                         "[E, 1], contiguous, H and I multiples of 16, weights/ids [T, k]")
    return T, H, E, inter


def nvfp4_grouped_sorted(x, weights, ids, gate_up: tuple, down: tuple, aligned=None,
                         block_m: tuple[int, int] | None = None):
    """(y [T·k, H] in x.dtype: each pair's unweighted expert output in expert-sorted order;
    order [T·k] int32: the pair of each sorted row). x [T, H] (bf16/fp16/fp32); weights/ids
    [T, k] (ids in 0..E-1); gate_up / down: NVFP4 experts (`check_operands`). aligned: (order,
    offsets, ...) from `route_align` or `moe_align`, else `moe_align` runs here. block_m:
    (gate_up, down) BLOCK_M to force (benchmarks, tests), else `moe_w8a8.block_ms`. Raises
    ValueError on mismatched operands."""
    T, H, E, inter = check_operands(x, weights, ids, gate_up, down, "nvfp4_grouped")
    (gu, gu_s, gu_s2), (dn, dn_s, dn_s2) = gate_up, down
    k = ids.shape[1]
    P = T * k
    x = x if x.stride(1) == 1 else x.contiguous()
    order, offsets = (aligned[0], aligned[1]) if aligned is not None else moe_align(ids, E)
    y = torch.empty(P, H, dtype=x.dtype, device=x.device)
    if P == 0:
        return y, order
    bm_gu, bm_dn = block_m or block_ms(P, E)
    act = torch.empty(P, inter, dtype=x.dtype, device=x.device)
    blocks = {bm: expert_blocks(offsets, bm) for bm in {bm_gu, bm_dn}}
    be = max(2, triton.next_power_of_2(E))
    dot_f32 = interpreted() or x.dtype == torch.float32
    gu_args = (x, gu, gu_s, gu_s2, order, offsets, blocks[bm_gu], act, E, k, x.stride(0),
               gu.stride(0), gu.stride(1), gu_s.stride(0), gu_s.stride(1), gu_s2.stride(0),
               act.stride(0))
    dn_args = (act, dn, dn_s, dn_s2, offsets, blocks[bm_dn], y, E, act.stride(0), dn.stride(0),
               dn.stride(1), dn_s.stride(0), dn_s.stride(1), dn_s2.stride(0), y.stride(0))
    g_gu, g_dn = grid_blocks(P, E, bm_gu), grid_blocks(P, E, bm_dn)
    shape = dict(H=H, I=inter, BLOCK_E=be, DOT_F32=dot_f32)
    if x.is_cuda and autotune_enabled(x.dtype):
        _launcher("gate_up")[lambda m: (g_gu * triton.cdiv(inter, m["BLOCK_N"]),)](
            *gu_args, **shape, BLOCK_M=bm_gu, **pdl_launch(x))
        _launcher("down")[lambda m: (g_dn * triton.cdiv(H, m["BLOCK_N"]),)](
            *dn_args, **shape, BLOCK_M=bm_dn, **pdl_launch(x))
    else:  # Triton's interpreter (CPU tests), fp32 activations or TAILORED_AUTOTUNE=0
        (bn, bk, w, st), (bn_d, bk_d, w_d, st_d) = FIXED
        _gate_up_kernel[(g_gu * triton.cdiv(inter, bn),)](
            *gu_args, **shape, BLOCK_M=bm_gu, BLOCK_N=bn, BLOCK_K=bk, num_warps=w,
            num_stages=st, **pdl_launch(x))
        _down_kernel[(g_dn * triton.cdiv(H, bn_d),)](
            *dn_args, **shape, BLOCK_M=bm_dn, BLOCK_N=bn_d, BLOCK_K=bk_d, num_warps=w_d,
            num_stages=st_d, **pdl_launch(x))
    return y, order


def nvfp4_grouped_experts_sorted(x, weights, ids, gate_up: tuple, down: tuple, aligned=None):
    """`nvfp4_grouped_sorted` for `moe_combine(y, k, ..., rows=rows, weights=weights)`: (y,
    rows [T·k] int32, pair p = token·k + slot being row rows[p]), the contract of
    `moe_grouped.grouped_experts_sorted`. Same arguments and errors."""
    y, order = nvfp4_grouped_sorted(x, weights, ids, gate_up, down, aligned)
    rows = torch.empty_like(order)
    rows[order.long()] = torch.arange(order.numel(), dtype=order.dtype, device=order.device)
    return y, rows


def nvfp4_grouped_experts(x, weights, ids, gate_up: tuple, down: tuple,
                          block_m: tuple[int, int] | None = None) -> torch.Tensor:
    """The weighted routed-expert terms [T·k, H] fp32 in (token, slot) order,
    `fused_moe(..., reduce=False)`'s contract (tests, benchmarks). Same arguments as
    `nvfp4_grouped_sorted`."""
    y, order = nvfp4_grouped_sorted(x, weights, ids, gate_up, down, block_m=block_m)
    return unsort_weighted(y, order, weights)


def nvfp4_grouped_ref(x, weights, ids, gate_up_f32, down_f32) -> torch.Tensor:
    """Plain-PyTorch `nvfp4_grouped_experts`: gate_up_f32 / down_f32 the experts dequantized
    in fp32 by the reference (`nvfp4.DequantExperts(..., torch.float32)`: `[e]` is expert e's
    [2I, H] / [H, I]); per expert, g|u = x · Ĝ|Ûᵀ, act = silu(g)·u, y = act · D̂ᵀ, all fp32;
    returns weights · y, [T·k, H] fp32 in (token, slot) order. The kernels differ from it by
    fp32 summation order and, for bf16/fp16 x, by act and y rounded to x.dtype."""
    T, H = x.shape
    k = ids.shape[1]
    E, two_i = gate_up_f32.shape[0], gate_up_f32.shape[1]
    xf = x.float()
    out = torch.zeros(T * k, H, dtype=torch.float32, device=x.device)
    flat = ids.reshape(-1)
    for e in range(E):
        pairs = (flat == e).nonzero().flatten()
        if pairs.numel() == 0:
            continue
        h = xf[pairs // k] @ gate_up_f32[e].float().t()
        act = F.silu(h[:, :two_i // 2]) * h[:, two_i // 2:]
        out[pairs] = (act @ down_f32[e].float().t()) * weights.reshape(-1)[pairs].float()[:, None]
    return out
