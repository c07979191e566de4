"""The kernel path of `Qwen36ForCausalLM.forward`: fused projections, Triton kernels, CUDA graphs.

Same computation as the plain path in `qwen36.py` (spec §3–§7), arranged for the GPU:
  * projections that read the same input are one GEMM: GDN in_proj_qkv|z|b|a, attention
    q|k|v, and router|shared-expert gate|shared gate|shared up. The module weights become views
    into the fused tensors, so the plain path and the checkpoint names still work, with no copy;
  * residual add + RMSNorm fused (`kernels.norm`), routed experts as grouped GEMMs
    (`kernels.moe`), the GDN decode step over state slots in place (`kernels.gdn_decode`), paged
    decode attention (`kernels.attention_decode`);
  * GDN prefill runs FLA's `chunk_gated_delta_rule` (varlen, all prefill sequences at once) when
    fla-core is installed, else the reference chunked recurrence per sequence;
  * decode-only steps (every sequence one token) replay a CUDA graph captured per padded batch
    size: no Python, launch or host sync inside the step.

Anything the graphs cannot hold (prefill chunks, mixed steps, batches over the largest size)
runs the same kernels eagerly. Checked against the plain path in tests/worker/test_fast_path.py (CPU,
Triton interpreter, fp32) and tests/gpu/test_gpu.py (H200, bf16 and fp32, graphs vs eager).
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tailored.kernels import env_flag, env_int
from tailored.kernels.attention_decode import paged_decode_attention
from tailored.kernels.fp8_dequant import dequantize_rows
from tailored.kernels.fp8_gemv import bf16_gemv, fp8_gemv
from tailored.kernels.fp8_linear import fp8_linear
from tailored.kernels.fp8_splitk import fp8_dense_splitk
from tailored.kernels.gdn_conv import conv_prefill, conv_state_update
from tailored.kernels.gdn_decode import conv_step, recurrent_step
from tailored.kernels import moe as moe_kernels
from tailored.kernels import moe_grouped
from tailored.kernels.moe import fused_moe, route_align, route_fused_moe
from tailored.kernels.moe_gemv import route_gemv_moe
from tailored.kernels.moe_combine import moe_combine, moe_combine_folded, silu_mul
from tailored.kernels.norm import add_rms_norm_1p
from tailored.kernels.qk_norm_rope import qk_norm_rope
from tailored.model import fp8
from tailored.model.batch import ForwardBatch, HybridCache, SeqInfo, pinned, to_device
from tailored.model.fp8 import Fp8Linear
from tailored.model.moe_stack import ExpertStack, stack_shared_expert
from tailored.ops import reference as ref

log = logging.getLogger("tailored.fast")

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128)
# prefill graphs (kb/0013): one per padded token count; padding costs ≤ 1/8 of the work to 2048
PREFILL_BUCKETS = tuple(range(128, 2049, 128)) + (3072, 4096, 6144, 8192)
# the shared expert as routed expert E in batches of up to SHARED_IN_MOE_UP_TO rows (kb/0019).
# Above that its one program per N block would walk many times the rows of any routed
# expert's (prefill: 1024 rows against ~32), so prefill keeps it a separate GEMM.
# Session 9 (kb/0024): B=1 -3.8 % (inside the B=1 noise), B=16 +3.7 %. Session 18 (kb/0036,
# 3 rounds in one process): B=1 bf16 -5.9 %, FP8 -4.5 %, but B=2 +3.5 % / +2.1 %: on for one
# row only, where the c=1 benchmark decodes.
SHARED_IN_MOE = env_flag("TAILORED_SHARED_IN_MOE", True)
SHARED_IN_MOE_UP_TO = env_int("TAILORED_SHARED_IN_MOE_UP_TO", 1, 1, 128)
# the MoE combine adds the residual and applies the next norm in its launch (kb/0023): 40
# launches fewer a step; on since the session-9 A/B (-0.4 to -0.9 % at B = 1/16/32, kb/0024)
COMBINE_NEXT_NORM = env_flag("TAILORED_COMBINE_NEXT_NORM", True)
# several prompt chunks in one step (the choices of n, requests arriving together) each replay
# their own prefill or context graph while the step has at most PROMPTS_IN_GRAPHS_CHUNKS chunks
# and PROMPTS_IN_GRAPHS_UP_TO tokens (`FastPath._prompts`): an eager forward costs ~60-80 ms of
# host time whatever its size (kb/0055), a graph its GPU work, but each replay reads the experts
# again while the batched eager step reads each once for all prompts (c=32's 8 × 1024-token
# waves). Session 36 (kb/0056, H100 FP8, TTFT of K prompts of L ids together, eager → graphs):
# K=2 L=128 82.2 → 42.2 ms, L=512 83.3 → 57.9, L=1024 83.7 → 85.5; K=4 L=128 83.2 → 83.4,
# L=512 85.6 → 114.7. 0 = off
PROMPTS_IN_GRAPHS_UP_TO = env_int("TAILORED_PROMPTS_IN_GRAPHS_UP_TO", 1024, 0, 65536)
PROMPTS_IN_GRAPHS_CHUNKS = env_int("TAILORED_PROMPTS_IN_GRAPHS_CHUNKS", 2, 2, 256)
# decode attention: the output gate's sigmoid and product in the merge kernel's launch
# (paged_decode_attention(gate=), kb/0036): two launches fewer per attention layer; rounded as
# the two torch ops are. Session 19 (kb/0037, 3 rounds in one process): B=1 bf16 -3.3 %, FP8
# -3.6 %, B=2 bf16 -3.9 %; the bf16 gate passed with it (its numbers equal to the last digit).
ATTN_GATE_IN_MERGE = env_flag("TAILORED_ATTN_GATE_IN_MERGE", True)
# MoE inputs of up to this many rows route inside the gate_up GEMM's programs
# (`moe.route_fused_moe`, kb/0036): the routing launch leaves the chain of every MoE layer
# (route_align took ~4.9 µs a layer at B=1, kb/0029 §4), each gate_up program repeating the
# top-k of the step's ≤ 4 rows; bitwise the same results. 0 = off. Read at call time (A/B).
# Session 18 (kb/0036, medians of 3 rounds): B=1 with the shared expert as expert E bf16 3.61 ->
# 3.56 ms, FP8 3.75 -> 3.62; B=2 without it bf16 -1.6 %, FP8 -3.9 %. 3-4 rows: not measured.
ROUTE_IN_GATE_UP_UP_TO = env_int("TAILORED_MOE_ROUTE_IN_GATE_UP_UP_TO", 2, 0,
                                 moe_kernels.ROUTE_ONE_PROGRAM_UP_TO)
# MoE inputs of up to this many rows that route inside the gate_up programs run their FP8
# experts as GEMVs, one (token, expert) pair a program (`moe_gemv.route_gemv_moe`, kb/0039),
# instead of the tiled GEMMs, which were compute-bound at one row (e4m3 conversion into
# tl.dot). In-layer bench on the H200 (µs a MoE layer, tiled → GEMV): FP8 T=1 23.0 → 15.4,
# T=2 31.4 → 24.2. Another fp32 summation order: the FP8 gate passed with it (kb/0039). 0 = off.
# Read at call time (A/B). FP8 experts only: for bf16 experts the GEMVs measured no gain (layer
# 24.2 → 23.0 µs at T=1 but the step +0.9 % min / +3.2 % median, kb/0039; with PDL, session 26,
# +5.6 % median / −1.5 % min, kb/0043); their switch was deleted in session 27.
MOE_GEMV_UP_TO = env_int("TAILORED_MOE_GEMV_UP_TO", 2, 0, moe_kernels.ROUTE_ONE_PROGRAM_UP_TO)
# FP8 checkpoints: the dense projections (GDN, attention, shared expert) dequantized once at
# start and run through cuBLAS in every step above FP8_GEMV_UP_TO rows (at 1-2 rows the FP8
# GEMV reads the FP8 weights, kb/0039); the routed experts stay FP8 (kb/0026). The
# W8A16 GEMM has an ~11 µs floor at K = 2048 where cuBLAS bf16 takes 7.5 (decode) and is 2.6x
# slower at 1024 rows (prefill, kb/0009): the FP8 decode step took 4.39 ms against bf16's 3.71
# (kb/0024). Costs 2 bytes per dense weight (2.8 GB at full size; runner.plan_cache reserves
# it, `dense_dequant_bytes`). The rounding is the reference's. On by default since the H200
# A/B and side by side of session 11 (kb/0029: B=1 5.06 -> 4.04 ms, B=32 13.76 -> 12.40 ms,
# 1024-token prefill 63.1 -> 56.5 ms; c=1 280 tok/s, TTFT 60.6 ms) and its FP8 gate passed;
# =0 keeps every FP8 weight FP8 (W8A16 GEMMs, 2.8 GB less).
FP8_DENSE_DEQUANT = env_flag("TAILORED_FP8_DENSE_DEQUANT", True)
# With FP8_DENSE_DEQUANT, projections of up to this many rows read their FP8 weights instead,
# through the FP8 GEMV (`kernels/fp8_gemv.py`, kb/0039 §4; the bf16 members of a fused
# projection in the same launch). The bench of session 21 (run4, µs a call, cuBLAS over the
# dequantized weight → the GEMV's one config `fp8_gemv.CFG`; one row): GDN in 15.9 → 9.3,
# GDN out 9.5 → 6.2, attention qkv 11.9 → 7.8, o 9.3 → 6.2; two rows: 15.8 → 14.0, 9.6 → 8.0,
# 11.8 → 12.0 (slower), 9.4 → 8.0; the configs by shape (`fp8_gemv.FP8_CFGS`, kb/0040) take
# most of these ~1-2 µs lower. In the model (run5, graph step, median of 3): B=1 3.10 → 2.70
# ms (-13 %), B=2 3.70 → 3.56; the FP8 gate passed with it. Default 2 since then; 0 = off.
# Read at call time (A/B).
FP8_GEMV_UP_TO = env_int("TAILORED_FP8_GEMV_UP_TO", 2, 0, 4)
# Projections with a weight in the activations' dtype (bf16 checkpoints, the bf16 router view
# of FP8 ones) of up to this many rows through the same GEMV without scales
# (`fp8_gemv.bf16_gemv`, kb/0039 §7.3) instead of cuBLAS, which streams the 16.8 MB GDN out at
# ~1.8 TB/s and, being cuBLAS, takes no part in PDL (each of its launches waits for the kernel
# before it to end, and the one after for it). Session 22 (PDL off) measured no gain; with
# PDL on (session 25 run1, graph step, 3 rounds, with the FP8 GEMV's configs by shape
# `fp8_gemv.BF16_CFGS`): B=1 bf16 -7.7 % median / -7.1 % min, FP8 (the router alone) -3.0 / -4.6;
# B=2 -0.5 / -1.4 and +0.3 / -0.3, no gain, hence 1. Both gates passed with it at 2 (run2,
# kb/0042). 0 = cuBLAS. Read at call time (A/B).
BF16_GEMV_UP_TO = env_int("TAILORED_BF16_GEMV_UP_TO", 1, 0, 4)
# With FP8_DENSE_DEQUANT, projections of more than FP8_GEMV_UP_TO and up to this many rows
# read their FP8 weights through the split-K W8A16 GEMM (`kernels/fp8_splitk.py`, kb/0045 §4;
# the bf16 members of a fused projection in the same launch) instead of cuBLAS over the
# dequantized bf16 copy, which reads twice the bytes: ~1.4 ms of the FP8 B=32 step. Why
# another try after the tiled GEMM lost (kb/0043 §0): the hypothesis that it re-read the
# activations for every 64-wide N tile; here wider tiles (64-256), K split over programs.
# Numerics: (x·q)·s in fp32 per 128-block, summed by split, where cuBLAS reads bf16(q·s): the
# FP8 gate decides. Default 8 (kb/0049): the bench won 1.09-1.27x over cuBLAS at 8 rows and
# tied or lost at 32 (kb/0047 §2); in the model B=8 -2.2 % median / -3.2 % min, B=4 -1.5 % /
# -1.8 %, and the FP8 gate passed with it. 0 = off. Read at call time (A/B).
FP8_DENSE_SPLITK_UP_TO = env_int("TAILORED_FP8_DENSE_SPLITK_UP_TO", 8, 0, 64)
# Fused bf16 projections (ProjGroup parts of several linears) padded with zero weight rows to a
# multiple of this: the MoE group router|shared-expert gate|shared gate|up has 256+1+512+512 =
# 1281 rows, an output row stride of 2562 bytes that no 16-byte-aligned cuBLAS kernel takes; the
# H200 ran it with an sm75 CUTLASS kernel at ~88 TFLOP/s, 19.4 ms of an 8 x 1024-token prefill
# step (kb/0029). 1 = no padding. 64 is the default since session 12: A/B in one process on the H200
# (kb/0030) 1024-token prefill bf16 54.4 -> 51.3 ms, FP8 56.4 -> 53.5; 8 x 1024 step bf16 288
# -> 272 ms, FP8 321 -> 303; bf16 decode B=1 4.00 -> 3.70 ms; both gates passed with it. Read
# when FastPath lays the projections out.
PROJ_ROW_ALIGN = env_int("TAILORED_PROJ_ROW_ALIGN", 64, 1, 256, power_of_2=True)
# The routed experts of an eager prefill step of at least MOE_GROUPED_FROM tokens through
# torch's grouped GEMM (kernels/moe_grouped.py, kb/0031): at 8192 tokens an expert has ~256 rows
# and our Triton expert GEMMs ran at ~100 TFLOP/s where CUTLASS's grouped GEMM ran the same
# gate_up at ~470 (scripts/bench_moe_prefill.py, session 13). FP8 experts are dequantized into
# one bf16 scratch first (1.6 GB at full size, reserved: `moe_grouped_reserve_bytes`). Never
# inside a CUDA graph capture (prefill graphs keep fused_moe). Read at call time (A/B).
# Bench, µs a layer, Triton as served → grouped: 2048 tokens bf16 1090 → 940 (but 128-row
# Triton tiles 873), FP8 1357 → 1396; 4096: bf16 1694 → 1317 (128-row tiles 1269), FP8 1858
# → 1672; 8192: bf16 2895 → 1638 (128-row 2104), FP8 3107 → 2059. Hence from 6144 tokens: the
# c=32 benchmark's prefill waves (~8192-token steps).
MOE_GROUPED = env_flag("TAILORED_MOE_GROUPED", True)
MOE_GROUPED_FROM = env_int("TAILORED_MOE_GROUPED_FROM", 6144, 1, 1 << 20)


def grouped_applies(tokens: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether an eager MoE input of `tokens` rows in `dtype` on `device` takes the grouped
    experts: the switch, the threshold, bf16 (the CUDA grouped GEMM's only dtype) on CUDA.
    One rule for the forward (`FastPath._use_grouped`), the warm-up and the memory reserve."""
    return (MOE_GROUPED and tokens >= MOE_GROUPED_FROM and dtype == torch.bfloat16
            and device.type == "cuda")


def layer_projections(layer: nn.Module) -> tuple[list, nn.Module, list, nn.Module]:
    """The kernel path's GEMM groups of one decoder layer: (input projections sharing the
    normed input: GDN qkv|z|b|a or attention q|k|v, the mixer's output projection, router|
    shared-expert gate|shared gate|shared up, shared down). The router and shared-expert gate
    lead their group (bf16 in both precisions), so the decode path can run just those rows
    when the shared expert is a routed one."""
    if layer.layer_type == "linear_attention":
        m = layer.linear_attn
        ins, out = [m.in_proj_qkv, m.in_proj_z, m.in_proj_b, m.in_proj_a], m.out_proj
    else:
        m = layer.self_attn
        ins, out = [m.q_proj, m.k_proj, m.v_proj], m.o_proj
    mlp = layer.mlp
    moe = [mlp.gate, mlp.shared_expert_gate, mlp.shared_expert.gate_proj,
           mlp.shared_expert.up_proj]
    return ins, out, moe, mlp.shared_expert.down_proj


def dense_dequant_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """GPU bytes FastPath allocates for FP8_DENSE_DEQUANT: every GEMM group with an FP8
    linear, all of its weights (its bf16 members are copied into the group's tensor too), in
    `dtype`, and its FP8 members' fp32 row scales for the FP8 GEMV (kb/0039). 0 when the
    switch is off or the checkpoint has no FP8 linears."""
    if not FP8_DENSE_DEQUANT:
        return 0
    n = scales = 0
    for layer in model.model.layers:
        ins, out, moe, down = layer_projections(layer)
        for group in (ins, [out], moe, [down]):
            if any(isinstance(m, Fp8Linear) for m in group):
                n += sum(m.weight.numel() for m in group)
                if len(group) > 1:  # the zero rows of PROJ_ROW_ALIGN
                    n += _pad_rows(sum(m.weight.shape[0] for m in group)) * group[0].weight.shape[1]
                # the FP8 GEMV's fp32 row scales (`_fp8_gemv_parts`)
                scales += sum(m.weight.shape[0] * -(-m.weight.shape[1] // fp8.BLOCK)
                              for m in group if isinstance(m, Fp8Linear))
    return n * dtype.itemsize + scales * 4


def moe_grouped_reserve_bytes(model: nn.Module, dtype: torch.dtype, step_tokens: int) -> int:
    """GPU bytes the MOE_GROUPED path allocates beyond what runner.plan_cache's activation
    estimate covers: the FP8 experts' bf16 scratch (one layer's gate_up + down, `dtype`) and,
    per token of the largest step, its k rows of gathered input, gate|up, activation and
    bf16 output (the estimate's fp32 pair terms, fused_moe's, are not allocated on this path:
    conservative). 0 when the switch is off."""
    if not grouped_applies(step_tokens, dtype, torch.device("cuda")):  # a CUDA-only reserve
        return 0
    cfg = model.config
    H, I, k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    n = step_tokens * k * (H + 2 * I + I + H) * dtype.itemsize
    ex = model.model.layers[0].mlp.experts
    if fp8.is_fp8_experts(ex):
        n += (ex.gate_up_proj.numel() + ex.down_proj.numel()) * dtype.itemsize
    return n


def _pad_rows(rows: int) -> int:
    """Zero rows that bring a fused projection of `rows` rows to a multiple of PROJ_ROW_ALIGN."""
    return -rows % PROJ_ROW_ALIGN


def _dense_weight(m: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A linear's weight in `dtype`: FP8 dequantized with the reference's rounding."""
    if isinstance(m, Fp8Linear):
        n = m.weight.shape[0]
        return dequantize_rows(m.weight.data, fp8.row_scales(m.weight_scale_inv, n), dtype=dtype)
    return m.weight.data.to(dtype)


def fuse_linears(mods: list[nn.Module], pad: int = 0) -> torch.Tensor:
    """Concatenate the weights of linears sharing an input into one [Σout + pad, in] tensor
    (`pad` zero rows last) and make each module's weight a view into it (no second copy stays
    alive). FP8 modules keep their block scales (`weight_scale_inv`), so their plain forward
    still works."""
    w0 = mods[0].weight.data
    zeros = [w0.new_zeros(pad, w0.shape[1])] if pad else []
    fused = torch.cat([m.weight.data for m in mods] + zeros, dim=0)
    o = 0
    for m in mods:
        n = m.weight.shape[0]
        m.weight = nn.Parameter(fused[o:o + n], requires_grad=False)
        o += n
    return fused


def _fp8_gemv_parts(mods: list[nn.Module], dequantized: torch.Tensor):
    """(FP8 weight [N8, K], its row scales, the bf16 members' rows or None, bf16 members
    first) for `fp8_gemv` over linears sharing an input, or None when none is FP8 or the
    members are not one run of FP8 ones before or after one run of bf16 ones (the GEMV writes
    two blocks of columns). The bf16 rows are a view of `dequantized` (the group's weight in
    module order: the same values); several FP8 members are fused into one tensor their
    modules then view (the old tensors are freed). New bytes: the fp32 row scales only
    (counted by `dense_dequant_bytes`)."""
    is8 = [isinstance(m, Fp8Linear) for m in mods]
    if not any(is8):
        return None
    first, n8 = is8.index(True), sum(is8)
    if is8[first:first + n8] != [True] * n8 or first not in (0, len(mods) - n8):
        return None
    f8 = [m for m in mods if isinstance(m, Fp8Linear)]
    fb = [m for m in mods if not isinstance(m, Fp8Linear)]
    w8 = fuse_linears(f8) if len(f8) > 1 else f8[0].weight.data
    s8 = torch.cat([fp8.row_scales(m.weight_scale_inv, m.weight.shape[0]) for m in f8])
    nb = sum(m.weight.shape[0] for m in fb)  # the bf16 rows: before or after w8's
    wb = (dequantized[:nb] if first > 0 else dequantized[w8.shape[0]:w8.shape[0] + nb]) \
        if fb else None
    return w8, s8, wb, first > 0


class Proj:
    """One GEMM for linears of one kind (bf16, or block-FP8 via `fp8_linear`) sharing an input."""

    def __init__(self, mods: list[nn.Module]):
        self.gemv = None  # FP8 GEMV operands (dequantized projections only)
        self.fp8 = isinstance(mods[0], Fp8Linear)
        self.sizes = [m.weight.shape[0] for m in mods]
        # zero rows after the modules' (PROJ_ROW_ALIGN): cuBLAS GEMMs of several linears only
        self.pad = _pad_rows(sum(self.sizes)) if len(mods) > 1 and not self.fp8 else 0
        self.weight = fuse_linears(mods, self.pad) if len(mods) > 1 else mods[0].weight.data
        self.scale = (torch.cat([fp8.row_scales(m.weight_scale_inv, m.weight.shape[0]) for m in mods])
                      if self.fp8 else None)

    @classmethod
    def dequantized(cls, mods: list[nn.Module], dtype: torch.dtype) -> "Proj":
        """One `dtype` GEMM for linears of any kinds sharing an input (FP8_DENSE_DEQUANT): a new
        weight tensor, concatenated in module order; the modules keep their own weights."""
        p = cls.__new__(cls)
        p.fp8, p.scale = False, None
        p.sizes = [m.weight.shape[0] for m in mods]
        ws = [_dense_weight(m, dtype) for m in mods]
        p.pad = _pad_rows(sum(p.sizes)) if len(ws) > 1 else 0
        if p.pad:
            ws.append(ws[0].new_zeros(p.pad, ws[0].shape[1]))
        p.weight = ws[0] if len(ws) == 1 else torch.cat(ws)
        # the FP8 weights for the few-row GEMV (FP8_GEMV_UP_TO): the modules' own
        p.gemv = _fp8_gemv_parts(mods, p.weight)
        return p

    def leading(self, sizes: list[int]) -> "Proj":
        """A Proj over this one's first sum(sizes) output rows (a view: no copy)."""
        n = sum(sizes)
        p = Proj.__new__(Proj)
        p.fp8, p.sizes, p.pad, p.gemv = self.fp8, list(sizes), 0, None
        p.weight = self.weight[:n]
        p.scale = self.scale[:n] if self.fp8 else None
        return p

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """[T, Σ sizes (+ pad)]: the pad's zero columns only from the dequantized GEMM."""
        if self.gemv is not None and 1 <= x.shape[0] <= FP8_GEMV_UP_TO:
            w8, s8, wb, bf16_first = self.gemv
            return fp8_gemv(x, w8, s8, other=wb, other_first=bf16_first)
        if self.gemv is not None and 1 <= x.shape[0] <= FP8_DENSE_SPLITK_UP_TO:
            w8, s8, wb, bf16_first = self.gemv
            return fp8_dense_splitk(x, w8, s8, other=wb, other_first=bf16_first)
        if self.fp8:
            return fp8_linear(x, self.weight, self.scale)
        if (1 <= x.shape[0] <= BF16_GEMV_UP_TO and self.weight.dtype == x.dtype
                and self.weight.stride(1) == 1):  # bf16_gemv's contract (else it raises)
            return bf16_gemv(x, self.weight)
        return F.linear(x, self.weight)


class ProjGroup:
    """Linears sharing an input, as few GEMMs as their kinds allow (one for a bf16 model; one
    per kind for FP8, where the router, shared-expert gate and GDN a/b stay bf16). Calling it
    returns the modules' outputs in the given order (views of the GEMM outputs)."""

    def __init__(self, mods: list[nn.Module], dequant: torch.dtype | None = None):
        """dequant: a dtype to hold FP8 linears in (FP8_DENSE_DEQUANT): then one GEMM for all."""
        if dequant is not None and any(isinstance(m, Fp8Linear) for m in mods):
            self.parts = [(Proj.dequantized(mods, dequant), list(range(len(mods))))]
            self.n = len(mods)
            return
        kinds: dict[bool, list[int]] = {}
        for j, m in enumerate(mods):
            kinds.setdefault(isinstance(m, Fp8Linear), []).append(j)
        self.parts = [(Proj([mods[j] for j in idx]), idx) for idx in kinds.values()]
        self.n = len(mods)

    def leading(self, n: int) -> Proj:
        """The first n modules' rows as one GEMM: they must be of one kind (one part) and lead
        it. E.g. the router and shared-expert gate without the shared expert's gate/up rows."""
        proj, idx = self.parts[0]
        if idx[:n] != list(range(n)):
            raise ValueError(f"ProjGroup.leading({n}): modules {idx} lead the first GEMM")
        return proj.leading(proj.sizes[:n])

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        out: list = [None] * self.n
        for proj, idx in self.parts:
            # a padded GEMM's zero rows come last and are dropped (zip stops at idx); the
            # FP8 GEMV's output has none
            y = proj(x)
            pad = y.shape[-1] - sum(proj.sizes)
            for j, part in zip(idx, torch.split(y, proj.sizes + [pad] * bool(pad), dim=-1)):
                out[j] = part
        return out


def _fla_chunk():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # not installed, or its triton import fails here
        return None
    return chunk_gated_delta_rule


@dataclass
class StepPlan:
    """Device index tensors of one eager forward, built on the host once and sent in one copy.

    Every layer used to build its own (`torch.tensor(...)` of slots, reset flags, KV rows): a
    pageable host-to-device copy that synchronizes the stream, ~70 times per prefill forward,
    so the host could never run ahead of the GPU (kb/0007: 1024-token prefill 131 ms wall for
    58 ms of GPU time). Views of one int64 buffer:
      pre_rows [n]: batch rows of the prefill sequences' tokens (in `pre` order);
      pre_slots [N], pre_reset [N] (bool): their state slots and reset flags;
      pre_seq [4, N]: per prefill sequence its first batch row, token count, first row in
        `pre` order and reset flag (`kernels.gdn_conv`; pre_reset is its last row);
      kv_new[j], kv_ctx[j]: flat KV rows (page·page_size + offset) of seqs[j]'s new tokens and of
        its whole context 0..end_pos (None when the chunk is the whole context);
      dec_rows, dec_slots: the decode rows (None when there are none);
      ver_rows[j], ver_slots[j]: the rows and slots of token j of the verify chunks longer
        than j (speculative decoding, `SeqInfo.keep_states`), and ver_seqs[j] those chunks.
    """

    pre_rows: torch.Tensor
    pre_slots: torch.Tensor
    pre_reset: torch.Tensor
    pre_seq: torch.Tensor
    kv_new: list
    kv_ctx: list
    dec_rows: torch.Tensor | None
    dec_slots: torch.Tensor | None
    ver_rows: list = None
    ver_slots: list = None
    ver_seqs: list = None


def prefill_static(n_max: int, device, reset: bool) -> dict:
    """Static inputs of a one-sequence prefill graph of up to n_max rows (on `device`): ids,
    positions, valid mask, flat KV row per token, slot, and gdn_conv's sequence meta (q, len,
    o, reset) of the conv and of the state update. reset: a fresh prompt (zero conv state);
    else the rows continue the slot's conv state (model/fast_ctx.py)."""
    r = int(reset)
    return {
        "ids": torch.zeros(n_max, dtype=torch.long, device=device),
        "pos": torch.zeros(n_max, dtype=torch.long, device=device),
        "valid": torch.zeros(n_max, dtype=torch.bool, device=device),
        "kv": torch.zeros(n_max, dtype=torch.long, device=device),  # flat KV row per token
        "slot": torch.zeros(1, dtype=torch.long, device=device),
        # gdn_conv's sequence rows: the conv over the whole bucket
        # (n_max, cut to the bucket by its output rows; pads last, never read by real
        # rows), the carried state from the real tokens (one row until a fill says more:
        # never past a bucket's rows, also in a warm-up)
        "conv_meta": torch.tensor([[0], [n_max], [0], [r]], dtype=torch.long).to(device),
        "state_meta": torch.tensor([[0], [1], [0], [r]], dtype=torch.long).to(device),
    }


def replay_bucket(graphs: dict, size: int, fill, batch: ForwardBatch) -> torch.Tensor:
    """Rows [:size] of the output of the smallest captured bucket n ≥ size of `graphs` ({n:
    (graph, output)}), replayed after `fill(batch, n)` wrote its static inputs: the one
    replay of the decode, prefill and context-chunk graphs."""
    n = min(b for b in graphs if b >= size)
    fill(batch, n)
    g, out = graphs[n]
    g.replay()
    return out[:size]


def h2d(a: np.ndarray, device) -> torch.Tensor:
    """int64 numpy → device tensor without a stream sync (pinned, non-blocking on CUDA)."""
    return to_device(torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)), device)


def _token_rows(seqs) -> np.ndarray:
    """Batch rows of these sequences' tokens, in order (int64, host)."""
    if not seqs:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(q.q_start, q.q_start + q.num_tokens) for q in seqs])


def _sub_batch(batch: ForwardBatch, picked: list[int]) -> ForwardBatch:
    """The sequences `picked` of `batch` as a batch of their own (rows renumbered from 0)."""
    dev = batch.input_ids.device
    rows = h2d(_token_rows([batch.seqs[j] for j in picked]), dev)
    seqs, q = [], 0
    for j in picked:
        s = batch.seqs[j]
        seqs.append(SeqInfo(q, s.num_tokens, s.start_pos, s.slot, s.reset_state, s.page_ids,
                            s.keep_states))
        q += s.num_tokens
    return ForwardBatch(batch.input_ids[rows], batch.positions[rows], seqs, [])


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of one sequence's L new queries over its S ≥ L context (the queries
    are the context's last L positions: bottom-right mask). q [L, Hq, D]; k, v [S, Hkv, D]
    with Hq a multiple of Hkv (GQA). Returns [L, Hq, D]. SDPA takes [1, heads, len, D], the
    layout of its flash/efficient kernels on the GPU."""
    L, S, rep = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    qt = q.transpose(0, 1).unsqueeze(0)
    kt = k.repeat_interleave(rep, dim=1).transpose(0, 1).unsqueeze(0)
    vt = v.repeat_interleave(rep, dim=1).transpose(0, 1).unsqueeze(0)
    if L == S:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    else:
        mask = torch.ones(L, S, dtype=torch.bool, device=q.device).tril(S - L)
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)
    return o[0].transpose(0, 1)


def build_plan(seqs, pre, dec, page_size: int, device, ver=()) -> StepPlan:
    """StepPlan for an eager forward over `seqs` (all), `pre` (prefill-path seqs), `dec`
    (decode rows) and `ver` (verify chunks); one host-to-device copy."""
    parts: list[np.ndarray] = []
    size = [0]  # elements in parts so far

    def add(a) -> tuple[int, int]:
        a = np.asarray(a, dtype=np.int64).reshape(-1)
        parts.append(a)
        start = size[0]
        size[0] += len(a)
        if len(a) % 2:
            # every view starts 16-byte aligned: Triton compiles a kernel variant per pointer
            # alignment, and an odd offset made the conv kernels compile again inside a c=32
            # benchmark (session 15's log, after warm-up)
            parts.append(np.zeros(1, dtype=np.int64))
            size[0] += 1
        return start, start + len(a)

    r_rows = add(_token_rows(pre))
    r_slots = add([q.slot for q in pre])
    lens = [q.num_tokens for q in pre]
    r_seq = add([[q.q_start for q in pre], lens, np.cumsum([0] + lens)[:-1],
                 [int(q.reset_state) for q in pre]])
    rows = HybridCache.kv_rows
    r_new = [add(rows(q.page_ids, q.start_pos, q.end_pos, page_size)) for q in seqs]
    r_ctx = [add(rows(q.page_ids, 0, q.end_pos, page_size)) if q.start_pos else None for q in seqs]
    r_dec = add([q.q_start for q in dec])
    r_dslot = add([q.slot for q in dec])
    ver_seqs = [[q for q in ver if q.num_tokens > j]
                for j in range(max((q.num_tokens for q in ver), default=0))]
    r_ver = [(add([q.q_start + j for q in sel]), add([q.slot for q in sel]))
             for j, sel in enumerate(ver_seqs)]
    buf = h2d(np.concatenate(parts), device)

    def view(r):
        return buf[r[0]:r[1]]

    pre_seq = view(r_seq).view(4, len(pre))
    return StepPlan(view(r_rows), view(r_slots), pre_seq[3].bool(), pre_seq,
                    [view(r) for r in r_new], [view(r) if r else None for r in r_ctx],
                    view(r_dec) if dec else None,
                    view(r_dslot).to(torch.int32) if dec else None,
                    [view(r) for r, _ in r_ver], [view(r).to(torch.int32) for _, r in r_ver],
                    ver_seqs)


class FastPath:
    """Kernel forward of one model over one HybridCache. `forward(batch)` = model.forward(batch).

    max_batch: largest decode batch captured in a graph; max_pages: page-table width (pages of
    the longest sequence). use_graphs: capture decode graphs (CUDA only).
    """

    def __init__(self, model: nn.Module, cache: HybridCache, max_batch: int, max_pages: int,
                 use_graphs: bool = True, use_fla: bool = True):
        self.model = model
        self.cfg = model.config
        self.cache = cache
        self.device = cache.k.device
        self.dtype = model.lm_head.weight.dtype
        # FLA only in bf16/fp16: its chunk kernel uses TF32 dots, so fp32 (the exactness mode)
        # keeps the reference recurrence
        self.fla = (_fla_chunk() if (use_fla and self.device.type == "cuda"
                                     and self.dtype != torch.float32) else None)
        # per layer: the input projections (one GEMM per weight kind), the mixer's output
        # projection, the MoE's router|shared-expert gate|shared gate|shared up, shared down
        self.p_in: dict[int, ProjGroup] = {}
        self.p_out: dict[int, Proj] = {}
        self.p_moe: dict[int, ProjGroup] = {}
        self.p_route: dict[int, Proj] = {}  # router|shared-expert gate rows of p_moe's GEMM
        self.p_down: dict[int, Proj] = {}
        # routed experts + the shared one as expert E (kb/0019; FP8: with block scales)
        self.stacks: dict[int, ExpertStack] = {}
        self.experts: dict[int, tuple] = {}  # FP8 experts: block scales (gate_up, down)
        self._grouped_scratch: tuple | None = None  # MOE_GROUPED's bf16 FP8 experts
        # fused_moe even where MOE_GROUPED applies: prefill graph bodies (their eager warm-up
        # runs must tune what the capture will launch: session 13's gate with grouped experts
        # from 1024 tokens tuned a new tile inside the capture, which failed) and warm-up runs
        self._moe_fused_only = False
        dq = self.dtype if FP8_DENSE_DEQUANT and model.config.fp8 is not None else None

        def single(m):  # one linear's projection
            return Proj.dequantized([m], dq) if dq is not None and \
                isinstance(m, Fp8Linear) else Proj([m])

        # the decoder layers, then the MTP layer when the cache holds its KV (speculative
        # decoding, model/mtp.py): layer num_hidden_layers, run by `mtp_eager`
        self.layers = list(model.model.layers)
        self.mtp_layer = None
        if model.mtp is not None and len(self.layers) in cache.attn_index:
            self.mtp_layer = len(self.layers)
            self.layers += list(model.mtp.layers)[:1]
            self.p_fc = Proj([model.mtp.fc])
        for i, layer in enumerate(self.layers):
            ins, out, moe, down = layer_projections(layer)
            self.p_in[i] = ProjGroup(ins, dequant=dq)
            self.p_out[i] = single(out)
            self.p_moe[i] = ProjGroup(moe, dequant=dq)
            self.p_route[i] = self.p_moe[i].leading(2)
            self.p_down[i] = single(down)
            mlp = layer.mlp
            ex = mlp.experts
            scales = None
            if fp8.is_fp8_experts(ex):
                scales = (
                    fp8.expert_block_scales(ex.gate_up_proj_scale_inv, True),
                    fp8.expert_block_scales(ex.down_proj_scale_inv, False))
            stack = stack_shared_expert(mlp, scales)
            if stack is not None:
                self.stacks[i] = stack
                scales = stack.routed_scales() if scales is not None else None
            if scales is not None:
                self.experts[i] = scales
        if dq is not None:
            log.info("FP8 dense projections held dequantized in %s (%.2f GiB; "
                     "TAILORED_FP8_DENSE_DEQUANT, kb/0026)", str(dq).removeprefix("torch."),
                     dense_dequant_bytes(model, dq) / 1024**3)
        # decode graph state
        self.max_batch = max_batch
        self.max_pages = max_pages
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None
        self._static = None
        # prefill graph state (kb/0013): single fresh prompts padded to a bucket
        self.prefill_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pstatic = None
        self._fla_ctx = None  # (lens, cu_seqlens, cu_seqlens_cpu, chunk_indices) of this forward
        self._plan: StepPlan | None = None  # index tensors of the current eager forward
        self.spec = None  # fast_spec.SpecGraphs: verify + MTP graphs (speculative decoding)
        self.ctx = None  # fast_ctx.ContextGraphs: a prompt chunk after a cached context

    # -------------------------------------------------------------------------------------------
    # blocks
    # -------------------------------------------------------------------------------------------
    @staticmethod
    def _route_experts(T: int, experts: torch.Tensor):
        """The kernels for a T-row MoE input that routes inside the gate_up launch, by the
        experts' weight dtype: FP8 experts as GEMVs up to MOE_GEMV_UP_TO rows, else the tiled
        GEMMs (same contract)."""
        gemv = experts.dtype == torch.float8_e4m3fn
        return route_gemv_moe if gemv and T <= MOE_GEMV_UP_TO else route_fused_moe

    def _moe(self, i: int, x: torch.Tensor, norm: tuple | None = None):
        """The MoE block of layer i on its normed input x [T, H]. norm = (residual, weight,
        eps): returns (residual + block output, the next norm of it) from the combine's launch
        (kb/0023) instead of the block output."""
        cfg, mlp = self.cfg, self.layers[i].mlp
        E, k, T = cfg.num_experts, cfg.num_experts_per_tok, x.shape[0]
        # decode batches: routing + align in one or two launches (read at call time: A/B)
        one_launch = T <= moe_kernels.ROUTE_ALIGN_USE_UP_TO and not E & (E - 1)
        in_gate_up = one_launch and T <= ROUTE_IN_GATE_UP_UP_TO  # no routing launch
        stack = self.stacks.get(i)
        if SHARED_IN_MOE and stack is not None and T <= SHARED_IN_MOE_UP_TO:
            # the shared expert as expert E: slot k of every token, weight sigmoid(gate)
            r, seg = torch.split(self.p_route[i](x), [E, 1], dim=-1)
            if in_gate_up:
                experts = self._route_experts(T, stack.gate_up)
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
        if in_gate_up and not self._use_grouped(x):
            gate_up = mlp.experts.gate_up_proj
            pairs, _, _ = self._route_experts(T, gate_up)(x, r, k, gate_up,
                                                          mlp.experts.down_proj, None,
                                                          *self.experts.get(i, (None, None)))
            shared = self.p_down[i](silu_mul(sg, su))
            return moe_combine(pairs, k, seg, shared, norm)
        if one_launch:
            w, ids, *aligned = route_align(r, k)  # order, offsets, experts
        else:
            w, ids = ref.route_topk(r, k)
            aligned = None
        if self._use_grouped(x):
            # expert-sorted outputs, weighted and summed by the combine's gather (kb/0031)
            y, rows = self._grouped_experts(i, x, w, ids)
            shared = self.p_down[i](silu_mul(sg, su))
            return moe_combine(y, k, seg, shared, norm, rows=rows, weights=w.contiguous())
        pairs = fused_moe(x, w, ids, mlp.experts.gate_up_proj, mlp.experts.down_proj, aligned,
                          *self.experts.get(i, (None, None)), reduce=False)
        shared = self.p_down[i](silu_mul(sg, su))
        # Σ_k pairs + sigmoid(seg)·shared in one launch instead of five (kernels/moe_combine.py)
        return moe_combine(pairs, k, seg, shared, norm)

    def _use_grouped(self, x: torch.Tensor) -> bool:
        """Whether this MoE input [T, H] takes the grouped experts (MOE_GROUPED): eager,
        T ≥ MOE_GROUPED_FROM, bf16 on CUDA, not a prefill graph body or warm-up run."""
        return (grouped_applies(x.shape[0], x.dtype, x.device) and not self._moe_fused_only
                and not torch.cuda.is_current_stream_capturing())

    def _grouped_experts(self, i: int, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor):
        """Layer i's routed experts through `moe_grouped.grouped_experts_sorted`: (outputs in
        expert-sorted order, each pair's row); FP8 experts are first dequantized into a
        scratch that every layer reuses."""
        ex = self.layers[i].mlp.experts
        gu, dn = ex.gate_up_proj, ex.down_proj
        if i in self.experts:
            # reserved at start (moe_grouped_reserve_bytes) when the switch was on then; an A/B
            # that turns it on later (bench_decode variants) allocates it outside the reserve
            if self._grouped_scratch is None:
                self._grouped_scratch = (
                    torch.empty(gu.shape, dtype=x.dtype, device=x.device),
                    torch.empty(dn.shape, dtype=x.dtype, device=x.device))
            s_gu, s_dn = self.experts[i]
            gu = moe_grouped.dequantize_experts(gu, s_gu, True, out=self._grouped_scratch[0])
            dn = moe_grouped.dequantize_experts(dn, s_dn, False, out=self._grouped_scratch[1])
        return moe_grouped.grouped_experts_sorted(x, w, ids, gu, dn)

    def _gdn(self, i: int, x: torch.Tensor, batch: ForwardBatch | None, dec_rows, dec_slots):
        """x [T, H] normed. dec_rows/dec_slots: device tensors of the decode rows (all rows in
        graph mode, batch None) and their slots."""
        cfg, m = self.cfg, self.layers[i].linear_attn
        li = self.cache.gdn_index[i]
        T = x.shape[0]
        V, HK = cfg.value_dim, cfg.linear_num_key_heads
        qkv, z, b, a = self.p_in[i](x)
        w = m.conv1d.weight[:, 0, :]
        conv_cache, rec_cache = self.cache.conv[li], self.cache.rec[li]
        def decode(qkv, a, b, z):  # the decode rows' conv and recurrence
            return recurrent_step(conv_step(qkv, conv_cache, w, dec_slots), a, b, z, rec_cache,
                                  dec_slots, m.A_log, m.dt_bias, m.norm.weight, HK, m.norm.eps)

        if batch is None:  # graph mode: every row is a decode row
            return self.p_out[i](decode(qkv, a, b, z))
        core = torch.empty(T, V, dtype=x.dtype, device=x.device)
        if dec_rows is not None:
            core[dec_rows] = decode(qkv[dec_rows], a[dec_rows], b[dec_rows], z[dec_rows])
        pre = batch.seqs  # the caller left out the decode rows and verify chunks
        if pre:
            self._gdn_prefill(m, pre, qkv, a, b, z, core, conv_cache, rec_cache, self._plan)
        if self._plan.ver_seqs:
            self._gdn_verify(m, li, qkv, a, b, z, core, conv_cache, rec_cache, self._plan)
        return self.p_out[i](core)

    def _gdn_verify(self, m, li, qkv, a, b, z, core, conv_cache, rec_cache, plan: StepPlan):
        """The verify chunks of speculative decoding (model/mtp.py): token j of every chunk
        through the decode kernels, as decode steps would run it, then each chunk's state
        after token j kept (`HybridCache.kept_states`) for `commit_states`."""
        HK = self.cfg.linear_num_key_heads
        w = m.conv1d.weight[:, 0, :]
        for sel in plan.ver_seqs[0]:
            self.cache.kept_states[(li, sel.slot)] = []
        for j, (rows, slots, sel) in enumerate(zip(plan.ver_rows, plan.ver_slots,
                                                   plan.ver_seqs)):
            last = [q.num_tokens == j + 1 for q in sel]
            # the state after a chunk's last token stays in its slot; before that, the kernels
            # also write each new state into a snapshot (as the verify graph does)
            cs = rs = None
            if not all(last):
                cs = conv_cache.new_empty((len(sel),) + tuple(conv_cache.shape[1:]))
                rs = rec_cache.new_empty((len(sel),) + tuple(rec_cache.shape[1:]))
            y = conv_step(qkv[rows], conv_cache, w, slots, snapshot=cs)
            core[rows] = recurrent_step(y, a[rows], b[rows], z[rows], rec_cache, slots,
                                        m.A_log, m.dt_bias, m.norm.weight, HK, m.norm.eps,
                                        snapshot=rs)
            for n, q in enumerate(sel):
                self.cache.kept_states[(li, q.slot)].append(
                    None if last[n] else (cs[n], rs[n]))

    def _gdn_prefill(self, m, seqs, qkv, a, b, z, core, conv_cache, rec_cache, plan: StepPlan):
        cfg = self.cfg
        HK, HV = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        Dk, Dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        w = m.conv1d.weight[:, 0, :]
        g, beta = ref.gdn_gates(a, b, m.A_log, m.dt_bias)
        # the causal conv of every sequence in one launch, then their carried states: per
        # sequence cat + cuDNN conv + cat took 50 ms of an 8 x 1024-token step (kb/0029, 0030)
        y = conv_prefill(qkv, conv_cache, w, plan.pre_seq, plan.pre_slots,
                         plan.pre_rows.shape[0], max(s.num_tokens for s in seqs))
        conv_state_update(qkv, conv_cache, w, plan.pre_seq, plan.pre_slots)
        rows, slots, reset = plan.pre_rows, plan.pre_slots, plan.pre_reset
        h0 = torch.where(reset[:, None, None, None], 0.0, rec_cache[slots].float())
        q, k, v = torch.split(y, [cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
        n = y.shape[0]
        o = None
        if self.fla is not None:
            try:
                o, hT = self._fla_prefill(seqs, q, k, v, g[rows], beta[rows], h0)
            except Exception as e:  # keep serving: fall back to the reference recurrence
                log.error("fla chunk_gated_delta_rule failed (%s); using the reference path", e)
                self.fla = None
        if o is None:
            outs, states, off = [], [], 0
            for j, s in enumerate(seqs):
                r = slice(off, off + s.num_tokens)
                oj, sj = ref.gated_delta_rule_chunked(
                    q[r].view(-1, HK, Dk), k[r].view(-1, HK, Dk), v[r].view(-1, HV, Dv),
                    g[rows[r]], beta[rows[r]], h0[j])
                outs.append(oj)
                states.append(sj)
                off += s.num_tokens
            o, hT = torch.cat(outs), torch.stack(states)
        rec_cache[slots] = hT.to(rec_cache.dtype)
        out = ref.gated_rms_norm(o.reshape(n, HV, Dv).to(core.dtype), z[rows].view(n, HV, Dv),
                                 m.norm.weight, m.norm.eps)
        core[rows] = out.reshape(n, -1)

    def _fla_prefill(self, seqs, q, k, v, g, beta, h0):
        """All prefill sequences in one varlen FLA call. q,k [n, HK·Dk]; v [n, HV·Dv];
        g, beta [n, HV] fp32; h0 [N, HV, Dk, Dv] fp32. Returns (o [n, HV, Dv], final states)."""
        cfg = self.cfg
        HK, HV = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        Dk, Dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        n = q.shape[0]
        ctx = self._fla_ctx
        if ctx is None or ctx[0] != [s.num_tokens for s in seqs]:
            # once per forward, shared by the 30 GDN layers: FLA caches per cu_seqlens tensor,
            # and with the host copy and chunk indices given it never syncs to read them
            from fla.ops.utils.index import prepare_chunk_indices

            lens = [s.num_tokens for s in seqs]
            cu_cpu = torch.tensor([0] + lens).cumsum(0)
            cu = (cu_cpu.pin_memory().to(q.device, non_blocking=True) if q.is_cuda
                  else cu_cpu.to(q.device))  # pinned + async: no stream sync
            ctx = self._fla_ctx = (lens, cu, cu_cpu, prepare_chunk_indices(cu, 64, cu_seqlens_cpu=cu_cpu))
        _, cu, cu_cpu, chunk_indices = ctx
        o, hT = self.fla(q.reshape(1, n, HK, Dk), k.reshape(1, n, HK, Dk),
                         v.reshape(1, n, HV, Dv), g.unsqueeze(0),
                         beta.unsqueeze(0), initial_state=h0.contiguous(),
                         output_final_state=True, use_qk_l2norm_in_kernel=True,
                         cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, chunk_indices=chunk_indices)
        return o[0], hT

    def _attn_qkv(self, i, x, cos, sin, kv_rows=None):
        """q, k, v [T, heads, D] and the output gate [T, Hq, D] (a strided view of the q
        projection: no copy, `_attn_out` reads it as is). kv_rows (decode): k and v go
        straight into layer i's KV cache rows in the k norm's launch; k and v are then that
        layer's cache tensors [pages, page_size, Hkv, D]."""
        cfg, m = self.cfg, self.layers[i].self_attn
        T, D, Hq, Hkv = x.shape[0], cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        qg, k, v = self.p_in[i](x)
        qg = qg.view(T, Hq, 2 * D)
        q, gate = qg[..., :D], qg[..., D:]
        k = k.view(T, Hkv, D)
        v = v.view(T, Hkv, D)
        # per-head norm + partial RoPE: one launch per tensor (kernels/qk_norm_rope.py)
        if kv_rows is None:
            q = qk_norm_rope(q, m.q_norm.weight, cos, sin, m.q_norm.eps)
            k = qk_norm_rope(k, m.k_norm.weight, cos, sin, m.k_norm.eps)
            return q, k, v, gate
        li = self.cache.attn_index[i]
        kc, vc = self.cache.k[li], self.cache.v[li]
        kf, vf = kc.view(-1, *kc.shape[-2:]), vc.view(-1, *vc.shape[-2:])  # flat cache rows
        q = qk_norm_rope(q, m.q_norm.weight, cos, sin, m.q_norm.eps)
        qk_norm_rope(k, m.k_norm.weight, cos, sin, m.k_norm.eps, rows=kv_rows, out=kf, v=v,
                     v_out=vf)
        return q, kc, vc, gate

    def _attn_decode(self, i, x, cos, sin, kv_rows, table, lens):
        # the KV store rides in the k norm's launch (two index_copy_ launches fewer per layer)
        q, kc, vc, gate = self._attn_qkv(i, x, cos, sin, kv_rows)
        if ATTN_GATE_IN_MERGE:  # the gate in the merge's launch (kb/0036)
            o = paged_decode_attention(q.contiguous(), kc, vc, table, lens, gate=gate)
            return self.p_out[i](o.reshape(o.shape[0], -1))
        o = paged_decode_attention(q.contiguous(), kc, vc, table, lens)
        return self._attn_out(i, o, gate)

    def _attn_eager(self, i, x, cos, sin, batch: ForwardBatch):
        li = self.cache.attn_index[i]
        q, k, v, gate = self._attn_qkv(i, x, cos, sin)
        kf = self.cache.k[li].view(-1, *self.cache.k.shape[-2:])
        vf = self.cache.v[li].view(-1, *self.cache.v.shape[-2:])
        out = torch.empty_like(q)
        plan = self._plan
        for j, s in enumerate(batch.seqs):
            r = slice(s.q_start, s.q_start + s.num_tokens)
            kf[plan.kv_new[j]] = k[r]
            vf[plan.kv_new[j]] = v[r]
            if s.start_pos == 0:  # whole context is this chunk: no gather
                kk, vv = k[r], v[r]
            else:
                idx = plan.kv_ctx[j]
                kk, vv = kf[idx], vf[idx]
            out[r] = _causal_sdpa(q[r], kk, vv)
        return self._attn_out(i, out, gate)

    def _store_kv(self, i, kv_rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write k, v [T, Hkv, D] at flat KV rows (device int64 [T]) of layer i's cache;
        returns that layer's (k, v) cache tensors [pages, page_size, Hkv, D]."""
        li = self.cache.attn_index[i]
        kc, vc = self.cache.k[li], self.cache.v[li]
        kc.view(-1, *kc.shape[-2:]).index_copy_(0, kv_rows, k)
        vc.view(-1, *vc.shape[-2:]).index_copy_(0, kv_rows, v)
        return kc, vc

    def _attn_out(self, i, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """o_proj(attention output · sigmoid(gate)) (spec §6.5). o [T, Hq, D] or [T, Hq·D];
        gate [T, Hq, D], strided: sigmoid reads the view and writes a contiguous tensor, so
        no copy kernel runs for the reshape (the values are those of a copy first)."""
        T = o.shape[0]
        return self.p_out[i](o.reshape(T, -1) * torch.sigmoid(gate).reshape(T, -1))

    # -------------------------------------------------------------------------------------------
    # forward
    # -------------------------------------------------------------------------------------------
    def _layers(self, x, cos, sin, mixer):
        """Residual stream through all layers; mixer(i, normed) → mixer output."""
        layers = self.model.model.layers
        first = layers[0].input_layernorm
        res, hn = add_rms_norm_1p(x, None, first.weight, first.eps)
        for i, layer in enumerate(layers):
            h = mixer(i, hn)
            res, hn = add_rms_norm_1p(res, h, layer.post_attention_layernorm.weight,
                                      layer.post_attention_layernorm.eps)
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.model.norm
            if COMBINE_NEXT_NORM:
                # the MoE's combine also adds the residual and applies the next norm (the next
                # layer's input norm, or the final norm): one launch fewer per layer (kb/0023)
                res, hn = self._moe(i, hn, (res, nxt.weight, nxt.eps))
            else:
                res, hn = add_rms_norm_1p(res, self._moe(i, hn), nxt.weight, nxt.eps)
        return hn

    def forward_eager(self, batch: ForwardBatch) -> torch.Tensor:
        cfg = self.cfg
        self._fla_ctx = None
        x = self.model.model.embed_tokens(batch.input_ids)
        cos, sin = ref.rope_cos_sin(batch.positions, cfg.rotary_dim, cfg.rope_theta, x.dtype)
        # a 1-token verify chunk (a lone decode row of a verify step, runner.launch) is a
        # verify chunk: its state must be kept for commit_states
        dec = [s for s in batch.seqs
               if s.num_tokens == 1 and not s.reset_state and not s.keep_states]
        ver = [s for s in batch.seqs if s.keep_states]
        # sequences that start with a 1-token prompt take the prefill path (it resets the slot)
        pre_batch = ForwardBatch(batch.input_ids, batch.positions,
                                 [s for s in batch.seqs if not (s.num_tokens == 1 and not s.reset_state)
                                  and not s.keep_states],
                                 batch.logits_rows)
        plan = self._plan = build_plan(batch.seqs, pre_batch.seqs, dec, self.cache.page_size,
                                       x.device, ver)
        dec_rows, dec_slots = plan.dec_rows, plan.dec_slots

        def mixer(i, hn):
            if self.layers[i].layer_type == "linear_attention":
                return self._gdn(i, hn, pre_batch, dec_rows, dec_slots)
            return self._attn_eager(i, hn, cos, sin, batch)

        return self._layers(x, cos, sin, mixer)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Final-normed hidden states [T, H] of the batch; same contract as the plain path.

        Decode rows replay a CUDA graph; in a mixed step they replay it on their own and the
        prompt chunks run after (`_prompts`): from a prefill graph for a fresh prompt or a
        context graph for a chunk continuing its cached context (model/fast_ctx.py), or
        eagerly (sequences are independent, so the split changes no result: the decode rows'
        pages and slots are disjoint from the prefills'). The verify chunks of speculative
        decoding beside prompt chunks split the same way, with the verify graph."""
        if not self.use_graphs:
            return self.forward_eager(batch)
        if self.spec is not None:
            self.spec.forget()  # its MTP graph reads the verify graph of this step only
            if self.spec.fits(batch):  # a speculative verify step
                return self.spec.forward(batch)
            ver = [j for j, s in enumerate(batch.seqs) if s.keep_states]
            if 0 < len(ver) < len(batch.seqs) and self.spec.fits_seqs([batch.seqs[j]
                                                                       for j in ver]):
                # new requests' prompts beside the verify chunks (every arrival at c=32):
                # eager, the whole step cost 300-1000 ms of host time (s15, kb/0033)
                return self._split(batch, ver, _sub_batch(batch, ver), self.spec.forward)
        dec = [j for j, s in enumerate(batch.seqs)
               if s.num_tokens == 1 and not s.reset_state and not s.keep_states]
        if not dec:
            return self._prompts(batch)
        if len(dec) > self.max_batch:
            return self.forward_eager(batch)
        if len(dec) == len(batch.seqs):
            return self.forward_decode_graph(batch)
        return self._split(batch, dec, _sub_batch(batch, dec), self.forward_decode_graph)

    def _split(self, batch: ForwardBatch, picked: list[int], sub: ForwardBatch,
               graph_forward) -> torch.Tensor:
        """Hidden states of a step whose sequences `picked` (sub-batch `sub`) replay a graph
        (`graph_forward`: decode or verify) and whose other sequences (prompt chunks, or
        verify chunks beside decode rows) run after it through `_prompts`."""
        dev = batch.input_ids.device
        rest = [j for j in range(len(batch.seqs)) if j not in set(picked)]
        sub_p = _sub_batch(batch, rest)
        out = torch.empty(batch.input_ids.shape[0], self.cfg.hidden_size, dtype=self.dtype,
                          device=dev)
        out[h2d(_token_rows([batch.seqs[j] for j in picked]), dev)] = graph_forward(sub)
        # a fresh prompt alone besides the decode rows (a request arriving while others decode:
        # every arrival of a serve whose requests do not come in waves) replays its prefill
        # graph too; eager, its ~1024 tokens cost ~150 ms of host time for ~56 ms of GPU work
        # (kb/0010, kb/0028). The first graph's output is copied out above, and the two
        # graphs' static buffers are disjoint, so replaying both in one step is safe.
        out[h2d(_token_rows([batch.seqs[j] for j in rest]), dev)] = self._prompts(sub_p)
        return out

    def _one_graph(self, batch: ForwardBatch):
        """The graph entry point of a one-sequence batch (a fresh prompt: its prefill graph;
        a chunk after its cached context: its context graph), or None."""
        if self.prefill_graphs and self.prefill_graph_fits(batch):
            return self.forward_prefill_graph
        if self.ctx is not None and self.ctx.fits(batch):
            return self.ctx.forward
        return None

    def _prompts(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states of a step's prompt chunks (no decode rows): one chunk from its graph
        when it has one; several, each from its own graph one after another, while the step
        has at most PROMPTS_IN_GRAPHS_CHUNKS chunks and PROMPTS_IN_GRAPHS_UP_TO tokens and every
        chunk has a graph (each output is copied out before the next replay, which may reuse
        the bucket); else eagerly, all together."""
        if len(batch.seqs) == 1:
            graph = self._one_graph(batch)
            return graph(batch) if graph is not None else self.forward_eager(batch)
        total = batch.input_ids.shape[0]
        if total <= PROMPTS_IN_GRAPHS_UP_TO and len(batch.seqs) <= PROMPTS_IN_GRAPHS_CHUNKS:
            subs = [_sub_batch(batch, [j]) for j in range(len(batch.seqs))]
            graphs = [self._one_graph(sub) for sub in subs]
            if all(g is not None for g in graphs):
                out = torch.empty(total, self.cfg.hidden_size, dtype=self.dtype,
                                  device=batch.input_ids.device)
                for s, sub, graph in zip(batch.seqs, subs, graphs):
                    out[s.q_start:s.q_start + s.num_tokens] = graph(sub)
                return out
        return self.forward_eager(batch)

    def warmup_lengths(self, batch_tokens: int) -> list[int]:
        """Prompt lengths (≤ batch_tokens) whose prefills reach every MoE launch class a
        prefill can pick: fused_moe's pair-count buckets of few-row steps (33..128 tokens: a
        prompt's last chunk), each prefill M tile (`moe._blocks`: tuned per tile when first
        seen; `warmup_prefill` runs every length through fused_moe, as a prefill graph of that
        size would), the grouped path, 1024 and batch_tokens itself. Session 13's new tiles
        would otherwise tune inside the first steps that reach them (kb/0031)."""
        E, k = self.cfg.num_experts, self.cfg.num_experts_per_tok

        def fewest(per_expert):  # fewest tokens with more than per_expert rows an expert
            return int(per_expert * E / k) + 1

        want = {40, 100, fewest(4), fewest(moe_kernels.BM64_ABOVE),
                fewest(moe_kernels.BM64_ABOVE_FP8), fewest(moe_kernels.BM128_ABOVE), 1024,
                batch_tokens}
        if grouped_applies(MOE_GROUPED_FROM, self.dtype, self.device):
            want.add(MOE_GROUPED_FROM)
        return sorted(n for n in want if 1 < n <= batch_tokens)

    @torch.no_grad()  # startup forwards: never keep autograd's saved activations
    def warmup_prefill(self, lengths, batch_tokens: int = 0) -> None:
        """Run prefills of these lengths into the pad sinks (slot 0, page 0) so that Triton
        compiles and FLA/MoE autotuning happen at startup, not in a user's first request.
        batch_tokens > 4: also one prefill of three sequences with an odd token total up to
        that many, the shape of a mixed step: Triton compiles a variant of a kernel for
        integer arguments that are 1, multiples of 16 or neither, and single prompts of even
        lengths only reach the first two (session 12, kb/0030: a cold bf16 server compiled
        inside its first mixed steps, ~3 s of a c=32 benchmark)."""
        for n in sorted(set(int(x) for x in lengths if x > 1)):
            # every length through fused_moe (a prefill graph of that size would launch it),
            # and through the grouped experts too where an eager step would take them
            self._moe_fused_only = True
            try:
                self.forward_eager(self._sink_prefill([n]))
            finally:
                self._moe_fused_only = False
            if grouped_applies(n, self.dtype, self.device):
                self.forward_eager(self._sink_prefill([n]))
            if self.mtp_layer is not None:
                self._warm_mtp(n)
        if batch_tokens > 4:
            m = min(int(batch_tokens), 1024)
            a, b = m // 2, m // 4
            c = (m if m % 2 else m - 1) - a - b  # an odd total, at most m (c ≥ 1 for m ≥ 5)
            self.forward_eager(self._sink_prefill([a, b, c]))
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _warm_mtp(self, n: int) -> None:
        """The MTP layer over an n-token prompt in the sinks, eagerly, as speculative decoding
        runs it over every prompt chunk (model/fast_mtp.py). Its experts are bf16 in the FP8
        checkpoint, and nothing else launches bf16 prefill experts in an FP8 serve (session
        16: two MoE compiles inside the first request of the FP8 spec serve)."""
        from tailored.model.fast_mtp import mtp_eager

        b = self._sink_prefill([n])
        h = torch.zeros(n, self.cfg.hidden_size, dtype=self.dtype, device=self.device)
        mtp_eager(self, h, b.input_ids, b.positions, b.seqs)

    def _sink_prefill(self, lengths: list[int]) -> ForwardBatch:
        """Fresh prompts of zero tokens, all in the pad sinks (slot 0, page 0)."""
        seqs, q = [], 0
        for n in lengths:
            seqs.append(SeqInfo(q, n, 0, 0, True, [0] * (n // self.cache.page_size + 1)))
            q += n
        ids = torch.zeros(q, dtype=torch.long, device=self.device)
        pos = torch.cat([torch.arange(n, device=self.device) for n in lengths])
        return ForwardBatch(ids, pos, seqs, [])

    # -------------------------------------------------------------------------------------------
    # CUDA graphs for decode
    # -------------------------------------------------------------------------------------------
    def _decode_body(self, n: int) -> torch.Tensor:
        st = self._static
        cfg = self.cfg
        ids, pos = st["ids"][:n], st["pos"][:n]
        slots, table, lens, kv_rows = st["slots"][:n], st["table"][:n], st["lens"][:n], st["kv_rows"][:n]
        x = self.model.model.embed_tokens(ids)
        cos, sin = ref.rope_cos_sin(pos, cfg.rotary_dim, cfg.rope_theta, x.dtype)

        def mixer(i, hn):
            if self.layers[i].layer_type == "linear_attention":
                return self._gdn(i, hn, None, None, slots)
            return self._attn_decode(i, hn, cos, sin, kv_rows, table, lens)

        return self._layers(x, cos, sin, mixer)

    def _alloc_static(self):
        dev, B, P = self.device, self.max_batch, self.max_pages
        self._static = {
            "ids": torch.zeros(B, dtype=torch.long, device=dev),
            "pos": torch.zeros(B, dtype=torch.long, device=dev),
            "slots": torch.zeros(B, dtype=torch.int32, device=dev),
            "table": torch.zeros(B, P, dtype=torch.int32, device=dev),
            "lens": torch.ones(B, dtype=torch.int32, device=dev),
            "kv_rows": torch.zeros(B, dtype=torch.long, device=dev),
        }

    def _fill_static(self, batch: ForwardBatch, n: int):
        """Copy the step's layout into the static buffers; rows len(batch.seqs)..n are pad rows
        (slot 0, page 0, length 1): they compute garbage into the sinks and are never read.
        Token ids and positions are already on the device (device-to-device copies, no sync);
        the page table is built in numpy and sent in one host-to-device copy per tensor."""
        ps = self.cache.page_size
        B = len(batch.seqs)
        table = np.zeros((n, self.max_pages), dtype=np.int32)
        meta = np.zeros((3, n), dtype=np.int64)  # lens, slots, kv_rows
        meta[0, :] = 1
        for j, s in enumerate(batch.seqs):
            table[j, :len(s.page_ids)] = s.page_ids
            meta[0, j] = s.end_pos
            meta[1, j] = s.slot
            meta[2, j] = s.page_ids[s.start_pos // ps] * ps + s.start_pos % ps
        st = self._static
        st["ids"][:B].copy_(batch.input_ids)
        st["pos"][:B].copy_(batch.positions)
        if n > B:
            st["ids"][B:n].zero_()
            st["pos"][B:n].zero_()
        st["table"][:n].copy_(pinned(torch.from_numpy(table), self.device), non_blocking=True)
        m = to_device(torch.from_numpy(meta), self.device)
        st["lens"][:n].copy_(m[0])
        st["slots"][:n].copy_(m[1])
        st["kv_rows"][:n].copy_(m[2])

    @torch.no_grad()  # startup forwards: never keep autograd's saved activations
    def capture(self, sizes=None):
        """Capture one decode graph per padded batch size (largest first, one memory pool)."""
        if not self.use_graphs:
            return
        if self._static is None:
            self._alloc_static()
        # warm-up and capture run real forwards over the static buffers: after served steps
        # they hold live sequences' slots, pages and KV rows, so point every row at the sinks
        # (slot 0, page 0, length 1) first, or a re-capture would advance those sequences
        st = self._static
        for name in ("ids", "pos", "slots", "table", "kv_rows"):
            st[name].zero_()
        st["lens"].fill_(1)
        sizes = sorted({b for b in (sizes or GRAPH_BATCH_SIZES) if b <= self.max_batch}
                       | {self.max_batch}, reverse=True)
        self._capture_into(self.graphs, sizes, self._decode_body)
        log.info("captured decode CUDA graphs for batch sizes %s", sorted(self.graphs))

    def drop_decode_graphs(self) -> None:
        """Forget the decode graphs, e.g. to capture again with other kernel switches (A/B
        benchmarks). Their memory pool goes too unless prefill or context-chunk graphs still
        use it: capturing into a pool whose graphs are all gone trips an allocator assert in
        torch 2.11 ("use_count > 0", H200 session 8)."""
        self.graphs.clear()
        if not self.prefill_graphs and not (self.ctx is not None and self.ctx.graphs):
            self.pool = None
            gc.collect()
            torch.cuda.empty_cache()

    def _capture_into(self, graphs: dict, sizes, body) -> None:
        """graphs[n] = (graph, output) of body(n) for each size, largest first, all in one
        memory pool (self.pool, shared by decode and prefill graphs: they never replay at
        once, and each keeps its output alive). Every size runs once on a side stream first,
        so Triton compiles and autotuners run outside the capture."""
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for n in sizes:
                body(n)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        # the warm-up's blocks stay cached for its side stream, where no graph pool can take
        # them: hand them back first (suspected in s15's prefill-capture OOM, which this did
        # not fix: the cache's size was the cause, kb/0033 §2.1)
        torch.cuda.empty_cache()
        for n in sizes:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                out = body(n)
            if self.pool is None:
                self.pool = g.pool()
            graphs[n] = (g, out)
        torch.cuda.synchronize()

    def forward_decode_graph(self, batch: ForwardBatch) -> torch.Tensor:
        if not self.graphs:
            self.capture()
        return replay_bucket(self.graphs, len(batch.seqs), self._fill_static, batch)

    # -------------------------------------------------------------------------------------------
    # CUDA graphs for single-prompt prefill (kb/0013)
    # -------------------------------------------------------------------------------------------
    # A fresh prompt alone in its step (the c=1 TTFT case) is padded to a bucket of tokens and
    # replayed from a graph: its eager forward is host-bound (~150 ms of Python and launches for
    # ~58 ms of GPU work at 1024 tokens, kb/0010). Pad rows come after the real ones, so every
    # causal operation leaves the real rows exact; pads write KV into the sink page 0, and have
    # g = 0, β = 0 in the delta rule (decay 1, no write), so the state after the bucket is the
    # state after the prompt (tests/kernels/test_ops_reference.py pins that property).
    def prefill_graph_fits(self, batch: ForwardBatch) -> bool:
        """One sequence, a fresh prompt (position 0, state reset) of 2..largest-bucket tokens."""
        if len(batch.seqs) != 1:
            return False
        s = batch.seqs[0]
        return (s.start_pos == 0 and s.reset_state and s.num_tokens > 1
                and s.num_tokens <= max(self.prefill_graphs))

    def _alloc_prefill_static(self, n_max: int) -> None:
        self._pstatic = prefill_static(n_max, self.device, reset=True)

    def _fill_prefill_static(self, batch: ForwardBatch, n: int) -> None:
        """The prompt's ids/positions (device-to-device) and one host-to-device copy of the
        rest: KV rows (pads → row 0 of the sink page 0), the slot, the valid mask and the conv
        state update's sequence meta (its T real rows)."""
        s = batch.seqs[0]
        T, ps = s.num_tokens, self.cache.page_size
        st = self._pstatic
        st["ids"][:T].copy_(batch.input_ids)
        st["pos"][:T].copy_(batch.positions)
        st["ids"][T:n].zero_()
        st["pos"][T:n].zero_()
        meta = np.zeros(2 * n + 5, dtype=np.int64)
        meta[:T] = HybridCache.kv_rows(s.page_ids, 0, T, ps)
        meta[n] = s.slot
        meta[n + 1:n + 1 + T] = 1
        meta[2 * n + 1:] = [0, T, 0, 1]  # state_meta [4, 1]
        m = h2d(meta, self.device)
        st["kv"][:n].copy_(m[:n])
        st["slot"].copy_(m[n:n + 1])
        st["valid"][:n].copy_(m[n + 1:2 * n + 1] != 0)
        st["state_meta"].copy_(m[2 * n + 1:].view(4, 1))

    def _gdn_prefill_static(self, i: int, x: torch.Tensor, valid, slot, st=None,
                            carried: bool = False):
        """GDN over the bucket for one sequence: the eager prefill's computation with zero
        initial states (a fresh prompt), or with the slot's conv and recurrent states when
        `carried` (a chunk continuing a cached context, model/fast_ctx.py: `st` holds its
        static buffers, whose conv meta says "no reset"), pads neutralized (g = 0, β = 0),
        states written with device indices (nothing in here depends on the prompt length on
        the host)."""
        cfg, m = self.cfg, self.layers[i].linear_attn
        li = self.cache.gdn_index[i]
        n = x.shape[0]
        HK, HV = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        Dk, Dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        qkv, z, b, a = self.p_in[i](x)
        w = m.conv1d.weight[:, 0, :]
        conv_cache, rec_cache = self.cache.conv[li], self.cache.rec[li]
        st = self._pstatic if st is None else st
        y = conv_prefill(qkv, conv_cache, w, st["conv_meta"], slot, n, n)
        conv_state_update(qkv, conv_cache, w, st["state_meta"], slot)
        g, beta = ref.gdn_gates(a, b, m.A_log, m.dt_bias)
        keep = valid[:, None]
        g, beta = torch.where(keep, g, 0.0), torch.where(keep, beta, 0.0)
        q, k, v = torch.split(y, [cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
        if carried:  # the state after the cached context (the eager path's h0 on no reset)
            h0 = rec_cache.index_select(0, slot).float()
        else:
            h0 = torch.zeros(1, HV, Dk, Dv, dtype=torch.float32, device=x.device)
        if self.fla is not None:
            o, hT = self.fla(q.reshape(1, n, HK, Dk), k.reshape(1, n, HK, Dk),
                             v.reshape(1, n, HV, Dv), g.unsqueeze(0), beta.unsqueeze(0),
                             initial_state=h0, output_final_state=True,
                             use_qk_l2norm_in_kernel=True)
            o = o[0]
        else:
            o, hT = ref.gated_delta_rule_chunked(q.view(n, HK, Dk), k.view(n, HK, Dk),
                                                 v.view(n, HV, Dv), g, beta, h0[0])
        rec_cache.index_copy_(0, slot, hT.to(rec_cache.dtype).reshape(1, HV, Dk, Dv))
        out = ref.gated_rms_norm(o.reshape(n, HV, Dv).to(x.dtype), z.reshape(n, HV, Dv),
                                 m.norm.weight, m.norm.eps)
        return self.p_out[i](out.reshape(n, -1))

    def _attn_prefill_static(self, i: int, x: torch.Tensor, cos, sin, kv_rows):
        """Attention over the bucket for one fresh sequence: KV written by device rows (pads
        into the sink), causal SDPA over the chunk itself (pads come last: real rows never
        see them)."""
        q, k, v, gate = self._attn_qkv(i, x, cos, sin)
        self._store_kv(i, kv_rows, k, v)
        return self._attn_out(i, _causal_sdpa(q, k, v), gate)

    def _prefill_body(self, n: int) -> torch.Tensor:
        """Final-normed hidden states [n, H] of the static prefill buffers' first n rows."""
        st, cfg = self._pstatic, self.cfg
        ids, pos, valid, kv = st["ids"][:n], st["pos"][:n], st["valid"][:n], st["kv"][:n]
        x = self.model.model.embed_tokens(ids)
        cos, sin = ref.rope_cos_sin(pos, cfg.rotary_dim, cfg.rope_theta, x.dtype)

        def mixer(i, hn):
            if self.layers[i].layer_type == "linear_attention":
                return self._gdn_prefill_static(i, hn, valid, st["slot"])
            return self._attn_prefill_static(i, hn, cos, sin, kv)

        return self._layers(x, cos, sin, mixer)

    @torch.no_grad()  # startup forwards: never keep autograd's saved activations
    def capture_prefill(self, max_tokens: int, buckets=None) -> None:
        """Capture one prefill graph per bucket up to max_tokens (largest first, in the decode
        graphs' memory pool). A failed capture (an op that syncs or allocates on the host
        inside FLA or torch) logs a warning and leaves prefill eager: never an error."""
        if not self.use_graphs:
            return
        sizes = sorted({b for b in (buckets or PREFILL_BUCKETS) if b <= max_tokens}, reverse=True)
        if not sizes:
            return
        if self._pstatic is None:
            self._alloc_prefill_static(sizes[0])
        st = self._pstatic
        st["valid"].fill_(True)  # warm-up/capture content: all rows real, KV and state → sinks
        st["kv"].zero_()
        st["slot"].zero_()
        st["state_meta"][1].fill_(1)  # a fill's T may exceed a smaller bucket's rows
        self._capture_guarded(self.prefill_graphs, sizes, self._prefill_body, "prefill",
                              "prefill stays eager")

    def _capture_guarded(self, graphs: dict, sizes, body, what: str, fallback: str) -> None:
        """`_capture_into` with the MoE held to fused_moe (`_moe_fused_only`: the bodies'
        warm-up and capture launch the same MoE; the session-13 bf16 gate tuned a new tile
        inside a capture that took the grouped path, kb/0031), logging the buckets captured
        (token counts, `sizes` descending). A failure (an op that syncs or allocates on the
        host inside FLA or torch, out of memory) logs a warning naming `what` and `fallback`,
        and empties `graphs`: never an error."""
        failed = None
        self._moe_fused_only = True
        try:
            self._capture_into(graphs, sizes, body)
        except Exception as e:  # noqa: BLE001 - serving continues eagerly
            failed = f"{type(e).__name__}: {e}"
        finally:
            self._moe_fused_only = False
        if failed is None:
            log.info("captured %s CUDA graphs for %d..%d tokens (%d buckets)", what, sizes[-1],
                     sizes[0], len(sizes))
            return
        # after the except block: inside it the exception being handled still holds the
        # failed warm-up's frames (and tensors) through its traceback; those frames form a
        # cycle that only the cyclic GC frees (GPU memory is no pressure for it), so collect
        # now, or an out-of-memory capture leaves that memory taken for the whole serve.
        # (Memory a failed *capture* took stays in the pool shared with the decode graphs.)
        log.warning("%s CUDA graphs not captured (%s); %s", what, failed, fallback)
        graphs.clear()
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def forward_prefill_graph(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [T, H] of one fresh prompt, replayed from the smallest bucket ≥ T."""
        return replay_bucket(self.prefill_graphs, batch.seqs[0].num_tokens,
                             self._fill_prefill_static, batch)
