"""The MoE block of a layer with NVFP4 routed experts on the kernel path (spec §7, §9.2).

Same computation as `SparseMoe` of the plain path over `nvfp4.DequantExperts`, by step size:
  * up to `nvfp4_gemv_up_to` rows (decode, 64): the experts as W4A16 GEMVs on the packed weights,
    one (token, expert) pair a program (`kernels.nvfp4_moe`);
  * with `nvfp4_grouped_from` > 0, steps of at least that many rows (above the GEMVs), eager
    or in a decode graph (65-128 rows): the W4A16 grouped GEMM on the packed weights over
    expert-sorted rows (`kernels.nvfp4_grouped`, kb/0067), no scratch; never in a prefill
    graph body (`MoEBlocks.use_w4_grouped`), which keeps the scratch;
  * otherwise above (prefill, large decode batches): the layer's experts dequantized into a
    bf16 scratch that every layer reuses (one launch each for gate_up and down,
    `nvfp4_gemv.dequantize_into`), then the bf16 expert GEMMs the engine runs for bf16
    checkpoints (the grouped GEMM where it applies, else `fused_moe`).
Routing is `ref.route_topk` (torch ops, no host sync); the shared expert stays a dense
projection (NVFP4 linears held dequantized, `projections.held_dequantized`) and is added by
`moe_combine` with the routed pairs, as for the other precisions.
Checked against the plain path in tests/worker/test_kernel_path_nvfp4.py.
"""

from __future__ import annotations

import torch

from tailored import flags
from tailored.kernels import moe_grouped, nvfp4_grouped
from tailored.kernels.moe import fused_moe
from tailored.kernels.moe_combine import moe_combine, silu_mul
from tailored.kernels.nvfp4_gemv import dequantize_into
from tailored.kernels.nvfp4_moe import nvfp4_moe_pairs
from tailored.ops import reference as ref


class Scratch:
    """The bf16 copy of one layer's experts ([E, 2I, H] and [E, H, I] in `dtype`), allocated
    once for all layers (`scratch_bytes`, counted by the memory plan)."""

    def __init__(self, shape_gate_up, shape_down, dtype, device):
        self.gate_up = torch.empty(shape_gate_up, dtype=dtype, device=device)
        self.down = torch.empty(shape_down, dtype=dtype, device=device)

    def fill(self, gate_up: tuple, down: tuple):
        return (dequantize_into(*gate_up, out=self.gate_up),
                dequantize_into(*down, out=self.down))


def w4_grouped_applies(tokens: int) -> bool:
    """Whether an eager MoE input of `tokens` rows above the GEMV sizes over NVFP4 experts
    may take the W4A16 grouped GEMM (`nvfp4_grouped_from` > 0 and reached). One rule for the
    forward and the warm-up."""
    f = flags.current()
    return 0 < f.nvfp4_grouped_from <= tokens and tokens > f.nvfp4_gemv_up_to


def scratch_bytes(experts, dtype) -> int:
    """Bytes of the `Scratch` for NVFP4 `experts` (a module of packed uint8 weights)."""
    return 2 * (experts.gate_up_proj.numel() + experts.down_proj.numel()) * dtype.itemsize


class W4Experts:
    """One layer's NVFP4 routed experts: gate_up = (packed [E, 2I, H/2], scale [E, 2I, H/16],
    scale_2 [E, 2]), down likewise ([E, H, I/2], [E, H, I/16], [E, 1]); `scratch` the shared
    bf16 copy. Called as the MoE block: `(x, p_moe, p_down, norm, blocks)` → the block's
    output (or, with norm = (residual, weight, eps), the residual sum and its next norm)."""

    def __init__(self, gate_up: tuple, down: tuple, top_k: int, scratch: Scratch):
        self.gate_up, self.down, self.k, self.scratch = gate_up, down, top_k, scratch

    def __call__(self, x: torch.Tensor, p_moe, p_down, norm, blocks):
        r, seg, sg, su = p_moe(x)
        w, ids = ref.route_topk(r, self.k)
        shared = p_down(silu_mul(sg, su))
        if 1 <= x.shape[0] <= flags.current().nvfp4_gemv_up_to:
            pairs = nvfp4_moe_pairs(x, w, ids, self.gate_up, self.down)
            return moe_combine(pairs, self.k, seg, shared, norm)
        if blocks.use_w4_grouped(x):  # the packed weights, sorted outputs (kb/0067)
            y, rows = nvfp4_grouped.nvfp4_grouped_experts_sorted(x, w, ids, self.gate_up,
                                                                 self.down)
            return moe_combine(y, self.k, seg, shared, norm, rows=rows, weights=w.contiguous())
        gu, dn = self.scratch.fill(self.gate_up, self.down)
        if blocks.use_grouped(x):  # expert-sorted outputs, summed by the combine (kb/0031)
            y, rows = moe_grouped.grouped_experts_sorted(x, w, ids, gu, dn)
            return moe_combine(y, self.k, seg, shared, norm, rows=rows, weights=w.contiguous())
        pairs = fused_moe(x, w, ids, gu, dn, None, reduce=False)
        return moe_combine(pairs, self.k, seg, shared, norm)
