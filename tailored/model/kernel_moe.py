"""The MoE block on the kernel path (spec §7): routing, routed experts, shared expert, combine.

Same computation as `SparseMoeBlock` of the plain path, by step size:
  * few rows (decode): routing and the expert GEMMs over the active experts only
    (`kernels.moe`), routing inside the gate_up programs up to `moe_route_in_gate_up_up_to`
    rows (kb/0036), FP8 experts as GEMVs up to `moe_gemv_up_to` (kb/0039), the shared expert
    as routed expert E up to `shared_in_moe_up_to` (kb/0036);
  * large eager prefill steps (≥ `moe_grouped_from` tokens, bf16 activations on CUDA): torch's
    grouped GEMM (CUTLASS) over expert-sorted rows, FP8 experts dequantized into a scratch
    first (kb/0031: at 8192 tokens ~470 TFLOP/s against ~100 for the Triton expert GEMMs);
  * with `moe_w8a8_from` > 0, eager prefill steps of at least that many tokens run FP8 experts
    W8A8 instead (`kernels.moe_w8a8`: e4m3 activations per 128-wide group, FP8 dots, no bf16
    scratch; kb/0061), before either of the above;
  * NVFP4 experts: `kernel_moe_w4.W4Experts` (GEMVs, the W4A16 grouped GEMM from
    `nvfp4_grouped_from` in eager steps, else the bf16 scratch);
  * then one launch for the routed sum, the gated shared expert and, with
    `combine_next_norm`, the residual add and the next RMSNorm (kb/0023).
Checked against the plain path in tests/worker/test_kernel_path.py.
"""

from __future__ import annotations

import torch
from torch import nn

from tailored import flags
from tailored.kernels import moe_route
from tailored.kernels import moe_grouped
from tailored.kernels import moe_w8a8
from tailored.kernels.moe import fused_moe, route_fused_moe
from tailored.kernels.moe_combine import moe_combine, moe_combine_folded, silu_mul
from tailored.kernels.moe_gemv import route_gemv_moe
from tailored.kernels.moe_route import route_align
from tailored.model import fp8, nvfp4
from tailored.model.kernel_moe_w4 import scratch_bytes, w4_grouped_applies
from tailored.model.moe_stack import ExpertStack
from tailored.ops import reference as ref


def grouped_applies(tokens: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether an eager MoE input of `tokens` rows in `dtype` on `device` takes the grouped
    experts: the switch, the threshold, bf16 (the CUDA grouped GEMM's only dtype) on CUDA.
    One rule for the forward, the warm-up and the memory reserve."""
    f = flags.current()
    return (f.moe_grouped and tokens >= f.moe_grouped_from and dtype == torch.bfloat16
            and device.type == "cuda")


def w8a8_applies(tokens: int) -> bool:
    """Whether an eager MoE input of `tokens` rows over FP8 experts takes the W8A8 experts
    (`moe_w8a8_from` > 0 and reached). Any activation dtype: the kernel path's bf16 on CUDA, its
    fp32 in the CPU tests (Triton's interpreter). One rule for the forward, the warm-up and
    the memory reserve."""
    f = flags.current()
    return 0 < f.moe_w8a8_from <= tokens


def moe_grouped_reserve_bytes(model: nn.Module, dtype: torch.dtype, step_tokens: int) -> int:
    """GPU bytes the grouped path allocates beyond what the cache plan's activation estimate
    covers (worker/memory_plan.py): the FP8 experts' bf16 scratch (one layer's gate_up +
    down, `dtype`) and, per token of the largest step, its k rows of gathered input, gate|up,
    activation and bf16 output (the estimate's fp32 pair terms, fused_moe's, are not
    allocated on this path: conservative). 0 when the grouped path never applies.
    NVFP4 experts: their bf16 scratch always (kernel_moe_w4.py; prefill steps use it).
    FP8 experts with `moe_w8a8_from` reached by the largest step: also the W8A8 path's own
    buffers (x's codes and scales, each pair's act codes and scales and `dtype` output), which
    are below the grouped path's per-pair terms; the scratch stays reserved while the grouped
    path can still apply below `moe_w8a8_from` (conservative). The NVFP4 grouped GEMM
    (`nvfp4_grouped_from`) allocates act [P, I] and y [P, H] in `dtype` a step: below the
    estimate's fp32 pair terms (I <= H), so nothing more."""
    cfg = model.config
    H, I, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    ex = model.model.layers[0].mlp.experts
    # NVFP4 experts: their bf16 scratch (kernel_moe_w4.Scratch), allocated with the kernel path
    w4 = scratch_bytes(ex, dtype) if nvfp4.is_nvfp4_experts(ex) else 0
    w8a8 = 0
    if fp8.is_fp8_experts(ex) and w8a8_applies(step_tokens):
        w8a8 = step_tokens * (H + 4 * ((H + 127) // 128)
                              + k * (I + 4 * ((I + 127) // 128) + H * dtype.itemsize))
    if not grouped_applies(step_tokens, dtype, torch.device("cuda")):  # a CUDA-only reserve
        return w8a8 + w4
    n = w4 + step_tokens * k * (H + 2 * I + I + H) * dtype.itemsize
    if fp8.is_fp8_experts(ex):
        n += (ex.gate_up_proj.numel() + ex.down_proj.numel()) * dtype.itemsize
    return max(n, w8a8)


def _route_experts(T: int, experts: torch.Tensor):
    """The kernels for a T-row MoE input that routes inside the gate_up launch, by the
    experts' weight dtype: FP8 experts as GEMVs up to `moe_gemv_up_to` rows, else the tiled
    GEMMs (same contract)."""
    gemv = experts.dtype == torch.float8_e4m3fn
    return route_gemv_moe if gemv and T <= flags.current().moe_gemv_up_to else route_fused_moe


class MoEBlocks:
    """The MoE block of every layer (decoder layers, then the MTP layer), called as
    `moe(i, x, norm)`. Holds the layer's GEMM groups and expert weights as laid out by
    `KernelModel`: p_moe (router|shared-expert gate|shared gate|shared up), p_route (the
    router|shared-expert gate rows of that GEMM), p_down (shared down), stacks (the shared
    expert as routed expert E, kb/0019), experts (FP8 block scales of the routed experts)."""

    def __init__(self, layers: list, cfg, p_moe: dict, p_route: dict, p_down: dict,
                 stacks: dict[int, ExpertStack], experts: dict[int, tuple],
                 w4: dict[int, tuple] | None = None):
        self.layers, self.cfg = layers, cfg
        self.p_moe, self.p_route, self.p_down = p_moe, p_route, p_down
        self.stacks, self.experts = stacks, experts
        self.w4 = w4 or {}  # NVFP4 experts: `nvfp4_moe.W4Experts` by layer
        self._scratch: tuple | None = None  # the grouped path's bf16 copy of FP8 experts
        # fused_moe even where the grouped path applies: prefill graph bodies and their warm-up
        # runs, which must tune what the capture will launch (a grouped step tuned a new tile
        # inside a capture, which failed: kb/0031)
        self.fused_only = False

    def __call__(self, i: int, x: torch.Tensor, norm: tuple | None = None):
        """The MoE block of layer i on its normed input x [T, H]. norm = (residual, weight,
        eps): returns (residual + block output, the next norm of it) from the combine's launch
        (kb/0023) instead of the block output."""
        if i in self.w4:
            return self.w4[i](x, self.p_moe[i], self.p_down[i], norm, self)
        f = flags.current()
        cfg, mlp = self.cfg, self.layers[i].mlp
        E, k, T = cfg.num_experts, cfg.num_experts_per_tok, x.shape[0]
        # decode batches: routing + align in one or two launches
        one_launch = T <= f.route_align_up_to and not E & (E - 1)
        in_gate_up = one_launch and T <= f.moe_route_in_gate_up_up_to  # no routing launch
        stack = self.stacks.get(i)
        if f.shared_in_moe and stack is not None and T <= f.shared_in_moe_up_to:
            # the shared expert as expert E: slot k of every token, weight sigmoid(gate)
            r, seg = torch.split(self.p_route[i](x), [E, 1], dim=-1)
            if in_gate_up:
                experts = _route_experts(T, stack.gate_up)
                pairs, _, _ = experts(x, r, k, stack.gate_up, stack.down, seg,
                                      stack.gate_up_scale, stack.down_scale)
                return moe_combine_folded(pairs, k, x.dtype, norm)
            if one_launch:
                w, ids, *aligned = route_align(r, k, shared_gate=seg)
            else:
                w, ids = ref.route_topk(r, k)
                w = torch.cat([w, torch.sigmoid(seg).to(w.dtype)], 1)
                ids = torch.cat([ids, ids.new_full((T, 1), E)], 1)
                aligned = None
            pairs = fused_moe(x, w, ids, stack.gate_up, stack.down, aligned,
                              stack.gate_up_scale, stack.down_scale, reduce=False)
            return moe_combine_folded(pairs, k, x.dtype, norm)
        r, seg, sg, su = self.p_moe[i](x)
        if in_gate_up and not self.use_grouped(x) and not self.use_w8a8(i, x):
            gate_up = mlp.experts.gate_up_proj
            pairs, _, _ = _route_experts(T, gate_up)(x, r, k, gate_up, mlp.experts.down_proj,
                                                     None, *self.experts.get(i, (None, None)))
            shared = self.p_down[i](silu_mul(sg, su))
            return moe_combine(pairs, k, seg, shared, norm)
        if one_launch:
            w, ids, *aligned = route_align(r, k)  # order, offsets, experts
        else:
            w, ids = ref.route_topk(r, k)
            aligned = None
        if self.use_w8a8(i, x):
            # FP8 experts W8A8: expert-sorted outputs, weighted and summed by the combine's
            # gather as the grouped path's (kb/0061)
            y, rows = moe_w8a8.w8a8_experts_sorted(
                x, w, ids, mlp.experts.gate_up_proj, mlp.experts.down_proj, *self.experts[i],
                aligned=aligned)
            shared = self.p_down[i](silu_mul(sg, su))
            return moe_combine(y, k, seg, shared, norm, rows=rows, weights=w.contiguous())
        if self.use_grouped(x):
            # expert-sorted outputs, weighted and summed by the combine's gather (kb/0031)
            y, rows = self._grouped_experts(i, x, w, ids)
            shared = self.p_down[i](silu_mul(sg, su))
            return moe_combine(y, k, seg, shared, norm, rows=rows, weights=w.contiguous())
        pairs = fused_moe(x, w, ids, mlp.experts.gate_up_proj, mlp.experts.down_proj, aligned,
                          *self.experts.get(i, (None, None)), reduce=False)
        shared = self.p_down[i](silu_mul(sg, su))
        # Σ_k pairs + sigmoid(seg)·shared in one launch instead of five (kernels/moe_combine.py)
        return moe_combine(pairs, k, seg, shared, norm)

    def use_grouped(self, x: torch.Tensor) -> bool:
        """Whether this MoE input [T, H] takes the grouped experts: eager, past the threshold,
        bf16 on CUDA, not a prefill graph body or its warm-up."""
        return (grouped_applies(x.shape[0], x.dtype, x.device) and not self.fused_only
                and not torch.cuda.is_current_stream_capturing())

    def use_w8a8(self, i: int, x: torch.Tensor) -> bool:
        """Whether layer i's MoE input x [T, H] takes the W8A8 experts: FP8 routed experts,
        eager, `w8a8_applies`, not a prefill graph body or its warm-up (as `use_grouped`)."""
        return (i in self.experts and w8a8_applies(x.shape[0]) and not self.fused_only
                and (x.device.type != "cuda" or not torch.cuda.is_current_stream_capturing()))

    def use_w4_grouped(self, x: torch.Tensor) -> bool:
        """Whether this MoE input x [T, H] over NVFP4 experts takes the W4A16 grouped GEMM:
        `w4_grouped_applies`, eager or in a decode graph (its upper-bound grid and device-side
        blocks need no host sync; there the alternative refills the 1.6 GB bf16 scratch every
        layer of every step), not a prefill graph body or its warm-up (`fused_only`)."""
        return w4_grouped_applies(x.shape[0]) and not self.fused_only

    def _grouped_experts(self, i: int, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor):
        """Layer i's routed experts through `moe_grouped.grouped_experts_sorted`: (outputs in
        expert-sorted order, each pair's row); FP8 experts are first dequantized into a
        scratch that every layer reuses."""
        ex = self.layers[i].mlp.experts
        gu, dn = ex.gate_up_proj, ex.down_proj
        if i in self.experts:
            # reserved at start (moe_grouped_reserve_bytes) when the switch was on then; an A/B
            # that turns it on later allocates it outside the reserve
            if self._scratch is None:
                self._scratch = (torch.empty(gu.shape, dtype=x.dtype, device=x.device),
                                 torch.empty(dn.shape, dtype=x.dtype, device=x.device))
            s_gu, s_dn = self.experts[i]
            gu = moe_grouped.dequantize_experts(gu, s_gu, True, out=self._scratch[0])
            dn = moe_grouped.dequantize_experts(dn, s_dn, False, out=self._scratch[1])
        return moe_grouped.grouped_experts_sorted(x, w, ids, gu, dn)


# the flags' bounds are the kernels' own (flags.py cannot import the kernels: no torch there)
assert flags.ROUTE_ONE_PROGRAM_UP_TO == moe_route.ROUTE_ONE_PROGRAM_UP_TO
assert flags.ROUTE_ALIGN_MAX_TOKENS == moe_route.ROUTE_ALIGN_MAX_TOKENS
