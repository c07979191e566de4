"""Gated DeltaNet causal conv for prefill (spec §5.2): every prefill sequence of a step in one
launch, and their carried conv states in a second.

The eager path ran `ref.causal_conv1d` once per sequence and layer: a `torch.cat` of the carried
state and the tokens, cuDNN's depthwise conv and a SiLU, then another `cat` of the outputs.
On the H200 an 8 × 1024-token prefill step spent 28.7 ms in those cats (270 launches) and
21.2 ms in the convs (240) of its 314 ms (FP8, kb/0029); one 1024-token prompt
~5.5 ms of its ~54. The conv reads and writes each value once: ~16 MB a layer at 1024 tokens,
a few µs of HBM time.

  1. `conv_prefill`: out[o_j + t] = silu(Σ_d w[:, d] · in_j[t − (W−1) + d]) for sequence j's
     tokens t < len_j, where in_j[p] is x[q_j + p] for p ≥ 0 and its carried state (or zero on
     a reset) for p < 0. Sums in fp32 and rounds once, as the decode step
     (`gdn_decode.conv_step`) does (its taps are added in another order: equal to fp32
     rounding, not bitwise); the reference rounds the conv to the model dtype before the SiLU.
  2. `conv_state_update`: each sequence's state becomes its last W−1 inputs (old state values
     when it has fewer than W−1 new tokens). A separate launch because (1) reads the old state.

Sequences are described on the device (`seq_meta`, [4, N] int64 rows: first input row q_j,
token count len_j, first output row o_j, reset flag), so both launches are CUDA-graph safe.
Reference: `tailored.ops.reference.causal_conv1d` per sequence; FLA's `causal_conv1d` is the
varlen kernel of the same idea.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tailored.kernels.pdl import enter as pdl_enter
from tailored.kernels.pdl import launch as pdl_launch


@triton.jit
def _sequence(meta_ptr, slot_ptr, N, j):
    """Sequence j of `seq_meta` [4, N]: (first input row, token count, first output row, reset
    flag, state slot as int64)."""
    return (tl.load(meta_ptr + j), tl.load(meta_ptr + N + j), tl.load(meta_ptr + 2 * N + j),
            tl.load(meta_ptr + 3 * N + j), tl.load(slot_ptr + j).to(tl.int64))


# Sequence and row counts change every step: Triton would compile a variant per count that is
# 1, a multiple of 16 or neither (a cold server compiled them inside its first
# mixed steps, 1.6 s for one; kb/0030). One variant for all of them.
@triton.jit(do_not_specialize=["N", "n_out"])
def _conv_prefill_kernel(x_ptr, state_ptr, w_ptr, meta_ptr, slot_ptr, out_ptr, C, N, n_out,
                         stride_x, stride_ss, stride_sc, stride_o,
                         W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                         PDL: tl.constexpr = False):
    if PDL:  # kernels/pdl.py: wait for the previous kernel first
        pdl_enter()
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    # reset 0: the carried state is the prefix
    q0, L, o0, reset, slot = _sequence(meta_ptr, slot_ptr, N, tl.program_id(0))
    t_ok = (t < L) & (o0 + t < n_out)  # a length past the output (a bucket's pads) is cut
    c_ok = c < C
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for d in tl.static_range(W):  # tap d multiplies input position t - (W-1) + d
        p = t - (W - 1) + d
        x_ok = t_ok & (p >= 0)
        s_ok = t_ok & (p < 0) & (p >= -(W - 1) * (1 - reset))  # none on a reset
        xv = tl.load(x_ptr + (q0 + p).to(tl.int64)[:, None] * stride_x + c[None, :],
                     mask=x_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
        # p < 0: state column W-1+p holds input position p
        sv = tl.load(state_ptr + slot * stride_ss + c[None, :] * stride_sc + (W - 1 + p)[:, None],
                     mask=s_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
        wv = tl.load(w_ptr + c * W + d, mask=c_ok, other=0.0).to(tl.float32)
        acc += (xv + sv) * wv[None, :]
    y = acc * tl.sigmoid(acc)
    tl.store(out_ptr + (o0 + t).to(tl.int64)[:, None] * stride_o + c[None, :],
             y.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & c_ok[None, :])


@triton.jit(do_not_specialize=["N"])
def _conv_state_kernel(x_ptr, state_ptr, meta_ptr, slot_ptr, C, N, stride_x, stride_ss, stride_sc,
                       W: tl.constexpr, WP: tl.constexpr, BLOCK_C: tl.constexpr,
                       PDL: tl.constexpr = False):
    if PDL:  # kernels/pdl.py: wait for the previous kernel first
        pdl_enter()
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    q0, L, _, reset, slot = _sequence(meta_ptr, slot_ptr, N, tl.program_id(0))
    c_ok = c < C
    e = tl.arange(0, WP)  # new state column e = input position L - (W-1) + e
    e_ok = e < W - 1
    p = L - (W - 1) + e
    in_x = p >= 0
    s_ok = e_ok & (p < 0) & (p >= -(W - 1) * (1 - reset))  # old state columns; none on a reset
    base = state_ptr + slot * stride_ss + c[:, None] * stride_sc
    xv = tl.load(x_ptr + (q0 + p).to(tl.int64)[None, :] * stride_x + c[:, None],
                 mask=c_ok[:, None] & (e_ok & in_x)[None, :], other=0.0)
    sv = tl.load(base + (e + L)[None, :], mask=c_ok[:, None] & s_ok[None, :], other=0.0)
    new = tl.where(in_x[None, :], xv.to(state_ptr.dtype.element_ty), sv)
    # the store overwrites columns other lanes read above: every lane's old state first
    tl.debug_barrier()
    tl.store(base + e[None, :], new, mask=c_ok[:, None] & e_ok[None, :])


def _check(x, state, weight, seq_meta, slots):
    C, W = weight.shape
    N = slots.shape[0]
    if (x.dim() != 2 or x.shape[1] != C or x.stride(1) != 1 or state.dim() != 3
            or state.shape[1:] != (C, W - 1) or state.stride(2) != 1
            or seq_meta.shape != (4, N) or seq_meta.dtype != torch.int64
            or not seq_meta.is_contiguous()):
        raise ValueError(f"gdn_conv: x{tuple(x.shape)} stride {x.stride()}, state"
                         f"{tuple(state.shape)}, weight{tuple(weight.shape)}, seq_meta"
                         f"{tuple(seq_meta.shape)} {seq_meta.dtype}, slots{tuple(slots.shape)}: "
                         "need x [T, C] (unit column stride), state [slots, C, W-1], "
                         "contiguous int64 seq_meta [4, N]")
    return C, W, N


def conv_prefill(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
                 seq_meta: torch.Tensor, slots: torch.Tensor, n_out: int,
                 max_len: int) -> torch.Tensor:
    """Causal depthwise conv + SiLU of N prefill sequences, continuing their carried states.

    x: [T, C] the step's projection outputs (any rows; sequence j reads rows q_j..q_j+len_j−1);
    state: [num_slots, C, W−1] one layer's conv cache (read only here); weight: [C, W], tap
    W−1 on the current token; seq_meta: [4, N] int64 on x's device (q_j, len_j, o_j, reset_j);
    slots: [N] int32/int64; n_out: output rows (o_j + t ≥ n_out is not computed, so a length
    may overstate: a prefill graph passes its largest bucket); max_len: the grid's tokens per
    sequence, ≥ every len_j that counts. Returns out [n_out, C] in x.dtype; rows no sequence
    covers are left as allocated (torch.empty). Raises ValueError on mismatched shapes.
    """
    C, W, N = _check(x, state, weight, seq_meta, slots)
    out = torch.empty(n_out, C, dtype=x.dtype, device=x.device)
    if N == 0 or max_len <= 0:
        return out
    bt, bc = 16, 128
    _conv_prefill_kernel[(N, triton.cdiv(max_len, bt), triton.cdiv(C, bc))](
        x, state, weight.contiguous(), seq_meta, slots, out, C, N, n_out,
        x.stride(0), state.stride(0), state.stride(1), out.stride(0),
        W=W, BLOCK_T=bt, BLOCK_C=bc, num_warps=4, **pdl_launch(x))
    return out


def conv_state_update(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
                      seq_meta: torch.Tensor, slots: torch.Tensor) -> None:
    """After `conv_prefill`: state[slot_j] ← the last W−1 inputs of sequence j (its new tokens,
    preceded by its old state, or zeros on a reset, when it has fewer than W−1), in place, in
    the state's dtype. Same arguments as `conv_prefill` (weight only gives C and W). Slots must
    be distinct. Raises ValueError on mismatched shapes."""
    C, W, N = _check(x, state, weight, seq_meta, slots)
    if N == 0 or W < 2:
        return
    bc = 128
    _conv_state_kernel[(N, triton.cdiv(C, bc))](
        x, state, seq_meta, slots, C, N, x.stride(0), state.stride(0), state.stride(1),
        W=W, WP=triton.next_power_of_2(W - 1), BLOCK_C=bc, num_warps=4, **pdl_launch(x))
