"""W8A8 block-scaled routed experts for prefill steps (spec §9.1): e4m3 activations × e4m3
weights on the FP8 tensor cores, fp32 sums.

Why: FP8 prefill MoE runs either as `fused_moe` W8A16 (each e4m3 weight tile converted to
bf16/f16 in the kernel, ~100 TFLOP/s at 8192 tokens) or, from `moe_grouped_from` tokens, by
dequantising every expert into a bf16 scratch each layer (661–785 µs a layer, kb/0031) before
torch's grouped GEMM: ~2.06 ms a layer of an 8192-token FP8 step. vLLM serves the checkpoint as
the checkpoint says (`activation_scheme: dynamic`): activations quantised per token in 128-wide
groups, the dots on e4m3 tensor cores (twice bf16's FLOPs), no weight conversion at all.

The path, for the (token, slot) pairs sorted by expert (`moe_route.moe_align`):
  xq, xs = quantize_groups(x)                         [T, H] e4m3, [T, H/128] fp32 (once)
  act[r] = silu(g) · u with [g | u] = Σ_kb (xq[t_r] · W_e,kbᵀ) · xs[t_r, kb] · ws_e[nb, kb]
           quantised in the same program: aq [P, I] e4m3, as_ [P, I/128] (each program owns
           one whole 128-wide group of its rows: BLOCK_N = 128, so no tile is re-rounded)
  y[r]   = Σ_kb (aq[r] · D_e,kbᵀ) · as_[r, kb] · ds_e[nb, kb]   [P, H] in x.dtype
rows r in expert-sorted order: `moe_combine(y, k, ..., rows=, weights=)` weights and sums them
as it does the grouped path's (`moe_grouped.grouped_experts_sorted`, the same contract).
Activation scales are powers of two (`fp8_quant`), so every scale product is exact; gate/up stay
fp32 until the activation (as `fused_moe`, where the grouped path rounds them to bf16).

Work split: each expert's rows are cut into BLOCK_M-row blocks (the last one partial), all
experts' blocks numbered in expert order (`expert_blocks`: one launch, cumulative block counts),
and the grid is (upper bound on the blocks) × N tiles, N tiles fastest, so the programs that
share an activation block and an expert's weights run together. A program finds its expert by
counting the cumulative block counts ≤ its block; past the last block it exits. No host sync.

Launch configs: BLOCK_M by the mean rows an expert gets (`block_ms`, a fixed rule with the
bench's forced variants to revisit it); on CUDA, warps and stages (and down's BLOCK_N) by
Triton's autotuner keyed on (H, I, BLOCK_M), registered with `tuning` like fused_moe's
launchers (tuned.json pre-fills them; the warm-up tunes the rest before serving). The
interpreter and TAILORED_AUTOTUNE=0 take a fixed config.

Reference: `w8a8_experts_ref` (the activations quantised as here, both operands dequantised,
fp32 matmuls); tests/kernels/test_moe_w8a8.py. The idea and layout as in vLLM's fused_moe
fp8_w8a8 block mode and DeepSeek-V3's fine-grained FP8 (1×128 activation, 128×128 weight
blocks); read, not copied.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tailored.kernels import autotune_enabled, tuning
from tailored.kernels.fp8_quant import (FP8, GROUP, dequantize_groups, quantize_groups,
                                        quantize_groups_ref, quantize_tile)
from tailored.kernels.moe import expert_shapes
from tailored.kernels.moe_grouped import unsort_weighted
from tailored.kernels.moe_route import moe_align
from tailored.kernels.pdl import enter as pdl_enter
from tailored.kernels.pdl import launch as pdl_launch

# down's 128-row tiles above this many rows an expert (mean); gate_up keeps 64 rows (its two
# 128-wide fp32 accumulators: 128 rows would hold 256 registers a thread of 8 warps). Not yet
# measured: lab/bench_moe_prefill.py's w8a8:BMxBM variants force each.
DOWN_BM128_ABOVE = 64


def block_ms(num_pairs: int, num_experts: int) -> tuple[int, int]:
    """(gate_up BLOCK_M, down BLOCK_M) by the mean rows an expert gets."""
    return 64, 128 if num_pairs / max(num_experts, 1) > DOWN_BM128_ABOVE else 64


@triton.jit
def _blocks_kernel(offsets_ptr, blocks_ptr, E, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                   PDL: tl.constexpr = False):
    if PDL:  # kernels/pdl.py: wait for the previous kernel first
        pdl_enter()
    e = tl.arange(0, BLOCK_E)
    ok = e < E
    counts = tl.load(offsets_ptr + e + 1, mask=ok, other=0) - tl.load(offsets_ptr + e, mask=ok,
                                                                       other=0)
    tl.store(blocks_ptr + 1 + e, tl.cumsum((counts + BLOCK_M - 1) // BLOCK_M, 0), mask=ok)
    tl.store(blocks_ptr + e, 0, mask=e == 0)


def expert_blocks(offsets: torch.Tensor, block_m: int) -> torch.Tensor:
    """[E+1] int32 from `moe_align`'s offsets: blocks[e] = Σ_{j<e} ceil(rows_j / block_m), the
    number of the first BLOCK_M-row block of expert e (one launch, graph-safe)."""
    E = offsets.numel() - 1
    blocks = torch.empty(E + 1, dtype=torch.int32, device=offsets.device)
    _blocks_kernel[(1,)](offsets, blocks, E, BLOCK_M=block_m,
                         BLOCK_E=max(2, triton.next_power_of_2(E)), **pdl_launch(offsets))
    return blocks


def grid_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on Σ_e ceil(rows_e / block_m): each expert with rows adds at most one
    partial block to the full ones."""
    return triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)


@triton.jit
def block_rows(offsets_ptr, blocks_ptr, E, NT: tl.constexpr, BLOCK_E: tl.constexpr,
               BLOCK_M: tl.constexpr):
    """(N tile, expert, first row, one past the expert's last row) of this program of a grid of
    (row blocks x NT N tiles), N tiles fastest; expert E (and an empty row range) past the
    last block."""
    pid = tl.program_id(0)
    pid_m = pid // NT
    j = tl.arange(0, BLOCK_E)
    cum = tl.load(blocks_ptr + 1 + j, mask=j < E, other=2147483647)
    e = tl.sum((cum <= pid_m).to(tl.int32), 0)
    ec = tl.minimum(e, E - 1)
    start = tl.load(offsets_ptr + ec) + (pid_m - tl.load(blocks_ptr + ec)) * BLOCK_M
    end = tl.where(e < E, tl.load(offsets_ptr + ec + 1), 0)
    return pid % NT, e, start, end


@triton.jit
def _gate_up_kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, order_ptr, offsets_ptr, blocks_ptr,
                    aq_ptr, as_ptr, E, TOPK, stride_xq, stride_xs, stride_we, stride_wn,
                    stride_se, stride_sn, stride_aq, stride_as,
                    H: tl.constexpr, I: tl.constexpr, BLOCK_E: tl.constexpr,
                    BLOCK_M: tl.constexpr, PDL: tl.constexpr = False):
    # program (row block, 128-wide act group): gate and up tiles of the group's columns over
    # H in 128-wide K blocks (one activation scale per row and block, one weight scale per
    # tile: a 128-column tile sits in one 128-row weight block), then silu(g)·u quantised
    if PDL:  # kernels/pdl.py: wait for the previous kernel first
        pdl_enter()
    NT: tl.constexpr = (I + 127) // 128
    NB_I: tl.constexpr = (I + 127) // 128  # the up half's block rows start here
    pid_n, e, start, end = block_rows(offsets_ptr, blocks_ptr, E, NT, BLOCK_E, BLOCK_M)
    if start < end:
        r = start + tl.arange(0, BLOCK_M)
        r_ok = r < end
        tok = tl.load(order_ptr + r, mask=r_ok, other=0) // TOPK
        n = pid_n * 128 + tl.arange(0, 128)
        n_ok = n < I
        kk = tl.arange(0, 128)
        w_g = w_ptr + e.to(tl.int64) * stride_we + n[None, :] * stride_wn
        w_u = w_g + I * stride_wn
        s_g = ws_ptr + e.to(tl.int64) * stride_se + pid_n * stride_sn
        s_u = s_g + NB_I * stride_sn
        x_row = xq_ptr + tok[:, None].to(tl.int64) * stride_xq
        acc_g = tl.zeros([BLOCK_M, 128], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, 128], dtype=tl.float32)
        for kb in range((H + 127) // 128):
            k = kb * 128 + kk
            k_ok = k < H
            a = tl.load(x_row + k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            sa = tl.load(xs_ptr + tok.to(tl.int64) * stride_xs + kb, mask=r_ok, other=0.0)
            wg = tl.load(w_g + k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            wu = tl.load(w_u + k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            acc_g += tl.dot(a, wg) * (sa * tl.load(s_g + kb))[:, None]
            acc_u += tl.dot(a, wu) * (sa * tl.load(s_u + kb))[:, None]
        q, s = quantize_tile(acc_g * tl.sigmoid(acc_g) * acc_u)
        tl.store(aq_ptr + r[:, None].to(tl.int64) * stride_aq + n[None, :],
                 q.to(aq_ptr.dtype.element_ty), mask=r_ok[:, None] & n_ok[None, :])
        tl.store(as_ptr + r.to(tl.int64) * stride_as + pid_n, s, mask=r_ok)


@triton.jit
def _down_kernel(aq_ptr, as_ptr, w_ptr, ws_ptr, offsets_ptr, blocks_ptr, y_ptr, E,
                 stride_aq, stride_as, stride_we, stride_wn, stride_se, stride_sn, stride_y,
                 H: tl.constexpr, I: tl.constexpr, BLOCK_E: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr = False):
    # program (row block, N tile): y rows = Σ_kb (aq · D_kbᵀ) · as_[:, kb] · ds[n // 128, kb]
    # (BLOCK_N divides 128: one weight scale per tile and K block)
    if PDL:  # kernels/pdl.py: wait for the previous kernel first
        pdl_enter()
    NT: tl.constexpr = (H + BLOCK_N - 1) // BLOCK_N
    pid_n, e, start, end = block_rows(offsets_ptr, blocks_ptr, E, NT, BLOCK_E, BLOCK_M)
    if start < end:
        r = start + tl.arange(0, BLOCK_M)
        r_ok = r < end
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < H
        kk = tl.arange(0, 128)
        w_n = w_ptr + e.to(tl.int64) * stride_we + n[None, :] * stride_wn
        s_n = ws_ptr + e.to(tl.int64) * stride_se + (pid_n * BLOCK_N // 128) * stride_sn
        a_row = aq_ptr + r[:, None].to(tl.int64) * stride_aq
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kb in range((I + 127) // 128):
            k = kb * 128 + kk
            k_ok = k < I
            a = tl.load(a_row + k[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            sa = tl.load(as_ptr + r.to(tl.int64) * stride_as + kb, mask=r_ok, other=0.0)
            w = tl.load(w_n + k[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            acc += tl.dot(a, w) * (sa * tl.load(s_n + kb))[:, None]
        tl.store(y_ptr + r[:, None].to(tl.int64) * stride_y + n[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=r_ok[:, None] & n_ok[None, :])


_TUNED: dict = {}


def _launcher(name: str):
    """Autotuned launcher (CUDA) of gate_up or down, keyed on (H, I, BLOCK_M): warps 4/8 ×
    stages 3/4 (down also BLOCK_N 64/128). Shared memory a stage: gate_up 8 KB of activation
    + 32 KB of gate and up weights at 64 rows, down 8/16 KB + 8/16 KB: 4 stages fit the
    H100's 228 KB."""
    if name not in _TUNED:
        if name == "gate_up":
            kernel, cfgs = _gate_up_kernel, [triton.Config({}, num_warps=w, num_stages=st)
                                             for w in (4, 8) for st in (3, 4)]
        else:
            kernel, cfgs = _down_kernel, [triton.Config({"BLOCK_N": bn}, num_warps=w,
                                                        num_stages=st)
                                          for bn in (64, 128) for w in (4, 8) for st in (3, 4)]
        _TUNED[name] = tuning.register(
            f"moe_w8a8/{name}", triton.autotune(configs=cfgs, key=["H", "I", "BLOCK_M"],
                                                warmup=5, rep=20)(kernel))
    return _TUNED[name]


def check_operands(x, weights, ids, gate_up, down, gate_up_scale, down_scale, who: str):
    """(T, H, E, I) of a W8A8 expert call; ValueError naming `who` unless the experts are
    float8_e4m3fn with the MoE kernels' block scales (`fp8.expert_block_scales`) and x a
    bf16/fp16/fp32 [T, H]."""
    T, H, E, I = expert_shapes(x, weights, ids, gate_up, down, who)
    nb_i, nb_h = triton.cdiv(I, 128), triton.cdiv(H, 128)
    if (gate_up.dtype != FP8 or down.dtype != FP8 or gate_up_scale is None
            or down_scale is None or gate_up_scale.shape != (E, 2 * nb_i, nb_h)
            or down_scale.shape != (E, nb_h, nb_i) or gate_up_scale.dtype != torch.float32
            or down_scale.dtype != torch.float32
            or x.dtype not in (torch.bfloat16, torch.float16, torch.float32)):
        raise ValueError(f"{who}: x {x.dtype}, experts {gate_up.dtype}/{down.dtype} with "
                         f"scales {None if gate_up_scale is None else tuple(gate_up_scale.shape)}"
                         f"/{None if down_scale is None else tuple(down_scale.shape)}: need "
                         f"float8_e4m3fn experts, fp32 block scales [{E}, {2 * nb_i}, {nb_h}] "
                         f"and [{E}, {nb_h}, {nb_i}], a float x")
    return T, H, E, I


def w8a8_sorted(x, weights, ids, gate_up, down, gate_up_scale, down_scale, aligned=None,
                block_m: tuple[int, int] | None = None):
    """(y [T·k, H] in x.dtype: each pair's unweighted expert output in expert-sorted order;
    order [T·k] int32: the pair of each sorted row). x: [T, H]; weights/ids: [T, k] (ids int64
    in 0..E-1); gate_up: [E, 2I, H] float8_e4m3fn (gate rows first), down: [E, H, I]; their
    block scales as `fused_moe` takes them. aligned: (order, offsets, ...) from `route_align`
    or `moe_align`, else `moe_align` runs here. block_m: (gate_up, down) BLOCK_M to force
    (benchmarks), else `block_ms`. Raises ValueError on mismatched operands."""
    T, H, E, I = check_operands(x, weights, ids, gate_up, down, gate_up_scale, down_scale,
                                "moe_w8a8")
    k = ids.shape[1]
    P = T * k
    if x.stride(1) != 1:
        x = x.contiguous()
    gate_up, down = gate_up.contiguous(), down.contiguous()
    gate_up_scale, down_scale = gate_up_scale.contiguous(), down_scale.contiguous()
    order, offsets = (aligned[0], aligned[1]) if aligned is not None else moe_align(ids, E)
    y = torch.empty(P, H, dtype=x.dtype, device=x.device)
    if P == 0:
        return y, order
    bm_gu, bm_dn = block_m or block_ms(P, E)
    xq, xs = quantize_groups(x)  # once, before the gather
    aq = torch.empty(P, I, dtype=FP8, device=x.device)
    as_ = torch.empty(P, triton.cdiv(I, GROUP), dtype=torch.float32, device=x.device)
    blocks = {bm: expert_blocks(offsets, bm) for bm in {bm_gu, bm_dn}}
    be = max(2, triton.next_power_of_2(E))
    gu_args = (xq, xs, gate_up, gate_up_scale, order, offsets, blocks[bm_gu], aq, as_, E, k,
               xq.stride(0), xs.stride(0), gate_up.stride(0), gate_up.stride(1),
               gate_up_scale.stride(0), gate_up_scale.stride(1), aq.stride(0), as_.stride(0))
    dn_args = (aq, as_, down, down_scale, offsets, blocks[bm_dn], y, E, aq.stride(0),
               as_.stride(0), down.stride(0), down.stride(1), down_scale.stride(0),
               down_scale.stride(1), y.stride(0))
    nt_gu = triton.cdiv(I, 128)
    g_gu, g_dn = grid_blocks(P, E, bm_gu), grid_blocks(P, E, bm_dn)
    if x.is_cuda and autotune_enabled(x.dtype):
        _launcher("gate_up")[(g_gu * nt_gu,)](*gu_args, H=H, I=I, BLOCK_E=be, BLOCK_M=bm_gu,
                                              **pdl_launch(x))
        _launcher("down")[lambda m: (g_dn * triton.cdiv(H, m["BLOCK_N"]),)](
            *dn_args, H=H, I=I, BLOCK_E=be, BLOCK_M=bm_dn, **pdl_launch(x))
    else:  # Triton's interpreter (CPU tests), fp32 activations or TAILORED_AUTOTUNE=0
        _gate_up_kernel[(g_gu * nt_gu,)](*gu_args, H=H, I=I, BLOCK_E=be, BLOCK_M=bm_gu,
                                         num_warps=8, num_stages=3, **pdl_launch(x))
        bn = 128
        _down_kernel[(g_dn * triton.cdiv(H, bn),)](*dn_args, H=H, I=I, BLOCK_E=be,
                                                   BLOCK_M=bm_dn, BLOCK_N=bn, num_warps=8,
                                                   num_stages=3, **pdl_launch(x))
    return y, order


def w8a8_experts_sorted(x, weights, ids, gate_up, down, gate_up_scale, down_scale,
                        aligned=None):
    """`w8a8_sorted` for `moe_combine(y, k, ..., rows=rows, weights=weights)`: (y, rows [T·k]
    int32, pair p = token·k + slot being row rows[p]) — `moe_grouped.grouped_experts_sorted`'s
    contract for FP8 experts. Same arguments and errors."""
    y, order = w8a8_sorted(x, weights, ids, gate_up, down, gate_up_scale, down_scale, aligned)
    rows = torch.empty_like(order)
    rows[order.long()] = torch.arange(order.numel(), dtype=order.dtype, device=order.device)
    return y, rows


def w8a8_experts(x, weights, ids, gate_up, down, gate_up_scale, down_scale,
                 block_m: tuple[int, int] | None = None) -> torch.Tensor:
    """The weighted routed-expert terms [T·k, H] fp32 in (token, slot) order,
    `fused_moe(..., reduce=False)`'s contract (tests, benchmarks). Same arguments as
    `w8a8_sorted`."""
    y, order = w8a8_sorted(x, weights, ids, gate_up, down, gate_up_scale, down_scale,
                           block_m=block_m)
    return unsort_weighted(y, order, weights)


def _dequant_blocks(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """One expert's block-FP8 weight [N, K] with block scales [ceil(N/128), ceil(K/128)] →
    fp32 q · s (not rounded to a model dtype)."""
    N, K = q.shape
    return q.float() * s.repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]


def w8a8_experts_ref(x, weights, ids, gate_up, down, gate_up_scale, down_scale):
    """Plain-PyTorch `w8a8_experts`: x quantised per 128-wide group of each row
    (`quantize_groups_ref`), per expert its rows' gate|up = x̂ · Ŵᵀ in fp32 over the
    dequantised operands, act = silu(g)·u in fp32 quantised the same way, y = âct · D̂ᵀ in
    fp32; returns weights · y, [T·k, H] fp32 in (token, slot) order. The kernels differ from it by fp32
    summation order (and the rare e4m3 code of act that order tips over a rounding boundary)."""
    T, H, E, I = check_operands(x, weights, ids, gate_up, down, gate_up_scale, down_scale,
                                "w8a8_experts_ref")
    k = ids.shape[1]
    nb_i = triton.cdiv(I, 128)
    xd = dequantize_groups(*quantize_groups_ref(x))
    out = torch.zeros(T * k, H, dtype=torch.float32, device=x.device)
    flat = ids.reshape(-1)
    for e in range(E):
        pairs = (flat == e).nonzero().flatten()
        if pairs.numel() == 0:
            continue
        g = xd[pairs // k] @ _dequant_blocks(gate_up[e, :I], gate_up_scale[e, :nb_i]).t()
        u = xd[pairs // k] @ _dequant_blocks(gate_up[e, I:], gate_up_scale[e, nb_i:]).t()
        act = dequantize_groups(*quantize_groups_ref(F.silu(g) * u))
        y = act @ _dequant_blocks(down[e], down_scale[e]).t()
        out[pairs] = y * weights.reshape(-1)[pairs].float()[:, None]
    return out
