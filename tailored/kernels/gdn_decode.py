"""Gated DeltaNet decode step (spec §5.2–§5.7) as two Triton kernels over state slots in place.

  1. `conv_step`: depthwise causal conv update + SiLU for one token per sequence, reading and
     writing the conv state of each sequence's slot (no gather/scatter copies).
  2. `recurrent_step`: gates (g = −exp(A_log)·softplus(a+dt_bias), β = σ(b)), q/k L2 norm,
     the gated delta rule update of the [Dk, Dv] fp32 state in its slot, the read-out, and the
     gated RMSNorm (norm-before-gate) — one program per (sequence, value head).

Pad rows point at slot 0 (the pad sink) and are harmless. Both are graph-safe (slot ids are
read on the device). References: `ref.causal_conv1d_step`, `ref.gdn_gates`,
`ref.gated_delta_rule_recurrent`, `ref.gated_rms_norm`; FLA `fused_recurrent_gated_delta_rule`.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from tailored import flags
from tailored.kernels import interpreted
from tailored.kernels.pdl import enter as pdl_enter
from tailored.kernels.pdl import launch as pdl_launch


@triton.jit
def _conv_step_kernel(x_ptr, state_ptr, w_ptr, slot_ptr, out_ptr, snap_ptr, C,
                      stride_xb, stride_ss, stride_sc, stride_ob, stride_pb,
                      W: tl.constexpr, BLOCK_C: tl.constexpr, SNAP: tl.constexpr = False,
                      PDL: tl.constexpr = False):
    if PDL:  # kernels/pdl.py: wait for the previous kernel first
        pdl_enter()
    b = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = c < C
    slot = tl.load(slot_ptr + b).to(tl.int64)
    s_base = state_ptr + slot * stride_ss + c * stride_sc
    x = tl.load(x_ptr + b * stride_xb + c, mask=ok, other=0.0).to(tl.float32)
    acc = x * tl.load(w_ptr + c * W + (W - 1), mask=ok, other=0.0).to(tl.float32)
    for j in tl.static_range(W - 1):
        s = tl.load(s_base + j, mask=ok, other=0.0).to(tl.float32)
        acc += s * tl.load(w_ptr + c * W + j, mask=ok, other=0.0).to(tl.float32)
        if j > 0:  # shift the window left by one
            tl.store(s_base + (j - 1), s.to(state_ptr.dtype.element_ty), mask=ok)
            if SNAP:  # the new window of row b, also into its snapshot (verify steps)
                tl.store(snap_ptr + b * stride_pb + c * (W - 1) + (j - 1),
                         s.to(snap_ptr.dtype.element_ty), mask=ok)
    tl.store(s_base + (W - 2), x.to(state_ptr.dtype.element_ty), mask=ok)
    if SNAP:
        tl.store(snap_ptr + b * stride_pb + c * (W - 1) + (W - 2),
                 x.to(snap_ptr.dtype.element_ty), mask=ok)
    y = acc * tl.sigmoid(acc)
    tl.store(out_ptr + b * stride_ob + c, y.to(out_ptr.dtype.element_ty), mask=ok)


def conv_step(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
              slots: torch.Tensor, snapshot: torch.Tensor | None = None) -> torch.Tensor:
    """One decode token per row through the causal conv, updating `state` in place.

    x: [B, C] projection outputs (row stride free); state: [num_slots, C, W-1] (one layer's conv
    cache, unit stride on the last dim); weight: [C, W]; slots: [B] int32/int64 slot per row.
    snapshot: [B, C, W-1] (contiguous per row, state's dtype) that also receives each row's new
    state, = state[slots] after the call (speculative verify steps, worker/spec_graphs.py).
    Returns out [B, C] in x.dtype = silu(conv). Rows sharing a slot race: only the pad sink may.
    """
    B, C = x.shape
    W = weight.shape[-1]
    assert state.shape[1:] == (C, W - 1) and state.stride(2) == 1 and x.stride(1) == 1
    if snapshot is not None:
        assert (snapshot.shape == (B, C, W - 1) and snapshot.dtype == state.dtype
                and snapshot[0].is_contiguous())
    out = torch.empty(B, C, dtype=x.dtype, device=x.device)
    block = 256
    _conv_step_kernel[(B, triton.cdiv(C, block))](
        x, state, weight.contiguous(), slots, out, out if snapshot is None else snapshot, C,
        x.stride(0), state.stride(0), state.stride(1), out.stride(0),
        0 if snapshot is None else snapshot.stride(0), W=W, BLOCK_C=block,
        SNAP=snapshot is not None, **pdl_launch(out))
    return out


@triton.jit
def delta_rule_token(S, row, a_row, b_row, A_log_ptr, dt_bias_ptr, h, hk, dk, dv, KEY_DIM,
                      scale, DK: tl.constexpr, DV: tl.constexpr):
    """One token of the gated delta rule on one head's state columns S [DK, BLOCK_V] (fp32):
    the gates, q/k L2 norm, decay, delta update. row: the token's [q | k | v] conv output;
    a_row, b_row: its raw in_proj_a/b outputs. Returns (new S, the scaled q) for the read-out.
    Shared by the decode and the verify kernels (kernels/gdn_verify.py): the same bits."""
    q = tl.load(row + hk * DK + dk).to(tl.float32)
    k = tl.load(row + KEY_DIM + hk * DK + dk).to(tl.float32)
    v = tl.load(row + 2 * KEY_DIM + h * DV + dv).to(tl.float32)
    return _delta_rule(S, q, k, v, a_row, b_row, A_log_ptr, dt_bias_ptr, h, scale)


@triton.jit
def _delta_rule(S, q, k, v, a_row, b_row, A_log_ptr, dt_bias_ptr, h, scale):
    """`delta_rule_token` on its loaded q, k [DK] and v [BLOCK_V] (fp32 holding model-dtype
    values)."""
    q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * scale  # l2norm (FLA eps 1e-6), then Dk^-½
    k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
    a = tl.load(a_row + h).to(tl.float32)
    braw = tl.load(b_row + h).to(tl.float32)
    xa = a + tl.load(dt_bias_ptr + h).to(tl.float32)
    softplus = tl.where(xa > 20.0, xa, tl.log(1.0 + tl.exp(xa)))  # torch threshold 20
    g = -tl.exp(tl.load(A_log_ptr + h).to(tl.float32)) * softplus
    beta = tl.sigmoid(braw)
    S = S * tl.exp(g)
    mem = tl.sum(S * k[:, None], 0)
    delta = (v - mem) * beta
    S = S + k[:, None] * delta[None, :]
    return S, q


# Triton's interpreter (the CPU tests) truncates fp32 -> bf16 casts, where the GPU rounds to
# nearest even as torch does; there the state's rounding is spelled out in integer bits
INTERPRETED = interpreted()


@triton.jit
def to_state(x, dt: tl.constexpr, BITS: tl.constexpr):
    """fp32 x rounded to the state's storage dtype dt (fp32: x itself), to nearest even.
    BITS (the interpreter only): bf16 by integer ops, since its cast truncates; on the GPU
    the conversion instruction, which rounds the same way."""
    if BITS and dt == tl.bfloat16:
        u = x.to(tl.uint32, bitcast=True)
        u = u + 0x7FFF + ((u >> 16) & 1)
        return (u >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(dt)


@triton.jit
def _recurrent_kernel(conv_ptr, a_ptr, b_ptr, z_ptr, state_ptr, slot_ptr,
                      A_log_ptr, dt_bias_ptr, norm_w_ptr, out_ptr, snap_ptr,
                      stride_cb, stride_ab, stride_bb, stride_zb, stride_ss, stride_ob,
                      stride_pb, KEY_DIM, eps, scale,
                      HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                      BLOCK_V: tl.constexpr, FUSE_NORM: tl.constexpr, SNAP: tl.constexpr = False,
                      PDL: tl.constexpr = False, BITS: tl.constexpr = False):
    """One (sequence, value head, BLOCK_V columns of the state) per program. The state's value
    columns update independently (S[:, j] depends on v_j only), so a head may be split over
    DV // BLOCK_V programs; the gated norm needs the whole head's output, so it is fused only
    when BLOCK_V == DV (FUSE_NORM) and otherwise `gated_norm_kernel` follows, reading the
    rounded output from out_ptr."""
    bi = tl.program_id(0)
    h = tl.program_id(1)
    # the slot and its state before the PDL wait (kb/0040), so the state's DRAM latency overlaps
    # the kernel before. Safe because with PDL only the kernel launched just before this one
    # can still be running (it waited for all before it), and that kernel never writes the
    # state: it is the conv step in decode and in
    # the verify loops; verify's commits are followed by the MTP head; prefill writes states
    # with stream-ordered torch ops and slots come from host copies. Keep it so: no launch
    # that writes the state may come directly before this kernel (review, kb/0041).
    slot = tl.load(slot_ptr + bi).to(tl.int64)
    dk = tl.arange(0, DK)
    dv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    s_ptrs = state_ptr + slot * stride_ss + h * DK * DV + dk[:, None] * DV + dv[None, :]
    S0 = tl.load(s_ptrs).to(tl.float32)  # fp32 or bf16 storage (--gdn-state-dtype), fp32 math
    if PDL:  # kernels/pdl.py: wait for the previous kernel before reading its outputs
        pdl_enter()
    row = conv_ptr + bi * stride_cb
    S, q = delta_rule_token(S0, row, a_ptr + bi * stride_ab, b_ptr + bi * stride_bb, A_log_ptr,
                             dt_bias_ptr, h, h // GROUP, dk, dv, KEY_DIM, scale, DK, DV)
    # the output reads the fp32 state before it is rounded to the storage dtype, as the
    # chunked prefill's does inside a chunk (vLLM's fused recurrent step stores the same way)
    Sr = to_state(S, state_ptr.dtype.element_ty, BITS)
    tl.store(s_ptrs, Sr)
    if SNAP:  # the new state of row bi, also into its snapshot (verify steps; same dtype)
        tl.store(snap_ptr + bi * stride_pb + h * DK * DV + dk[:, None] * DV + dv[None, :], Sr)
    o = tl.sum(S * q[:, None], 0)
    dt = out_ptr.dtype.element_ty
    if FUSE_NORM:
        gated_norm(o.to(dt).to(tl.float32), z_ptr + bi * stride_zb + h * DV, norm_w_ptr,
                    out_ptr + bi * stride_ob + h * DV, eps, DV)
    else:
        tl.store(out_ptr + bi * stride_ob + h * DV + dv, o.to(dt))


@triton.jit
def gated_norm(o, z_ptr, norm_w_ptr, out_ptr, eps, DV: tl.constexpr):
    """Gated RMSNorm of one head's output o [DV] (fp32 holding model-dtype values) with the
    reference's casts: normalise in fp32, round, scale by w in the model dtype, times silu(z)
    in fp32, round (ref.gated_rms_norm)."""
    dt = out_ptr.dtype.element_ty
    dv = tl.arange(0, DV)
    y = (o * tl.rsqrt(tl.sum(o * o, 0) / DV + eps)).to(dt)
    y = (tl.load(norm_w_ptr + dv).to(dt) * y).to(tl.float32)
    z = tl.load(z_ptr + dv).to(tl.float32)
    tl.store(out_ptr + dv, (y * (z * tl.sigmoid(z))).to(dt))


@triton.jit
def gated_norm_kernel(out_ptr, z_ptr, norm_w_ptr, stride_zb, stride_ob, eps,
                       DV: tl.constexpr, PDL: tl.constexpr = False):
    """The gated norm of one (sequence, head) after a split `_recurrent_kernel`, in place on
    its rounded output."""
    if PDL:  # kernels/pdl.py: wait for the previous kernel first
        pdl_enter()
    bi = tl.program_id(0)
    h = tl.program_id(1)
    base = out_ptr + bi * stride_ob + h * DV
    o = tl.load(base + tl.arange(0, DV)).to(tl.float32)
    gated_norm(o, z_ptr + bi * stride_zb + h * DV, norm_w_ptr, base, eps, DV)


# value-column programs per (sequence, head) (kb/0022): 1 = one program per head with the norm
# fused (32 programs at B=1: 2 MB of state in 6.7 µs on the H200); 2 or 4 spread the state over
# more SMs and add a norm launch. 2 after the A/B on the H200 (kb/0024): B=1 -3.0 %,
# B=16 -2.4 %, B=32 -4.4 % of the graph step; 4 gained less at every batch size
# storage dtypes of the recurrent state (EngineConfig.gdn_state_dtype): the math is fp32 either way
STATE_DTYPES = (torch.float32, torch.bfloat16)


def value_split(dv_split: int | None, DV: int, caller: str) -> int:
    """Programs per (row, head) over the value columns: dv_split, None = the `gdn_dv_split`
    switch. Raises
    ValueError for a split that does not divide DV into a power of 2."""
    split = flags.current().gdn_dv_split if dv_split is None else dv_split
    if split < 1 or DV % split or (DV // split) & (DV // split - 1):
        raise ValueError(f"{caller}: dv_split={split} must divide DV={DV} into a power of 2")
    return split


def recurrent_step(conv_out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, z: torch.Tensor,
                   state: torch.Tensor, slots: torch.Tensor, A_log: torch.Tensor,
                   dt_bias: torch.Tensor, norm_weight: torch.Tensor, num_k_heads: int,
                   eps: float, dv_split: int | None = None,
                   snapshot: torch.Tensor | None = None) -> torch.Tensor:
    """Gates + delta-rule step + gated norm for one token per row; `state` updated in place.

    conv_out: [B, 2·HK·Dk + HV·Dv] = [q | k | v] after conv+SiLU; a, b: [B, HV] raw in_proj_a/b
    outputs; z: [B, HV·Dv]; state: [num_slots, HV, Dk, Dv] fp32 or bf16 (`HybridCache`'s
    state_dtype: loaded to fp32, stored rounded) contiguous per slot;
    slots: [B]; A_log, dt_bias: [HV]; norm_weight: [Dv]. dv_split: programs per (row, head)
    over the value columns (None = `gdn_dv_split`; > 1 adds a gated-norm launch). Returns [B, HV·Dv]
    in conv_out.dtype (input of out_proj). snapshot: [B, HV, Dk, Dv] in state's dtype (contiguous per row)
    that also receives each row's new state, = state[slots] after the call (speculative verify
    steps, worker/spec_graphs.py). Raises ValueError for a split that does not divide Dv into a
    power of 2.
    """
    B = conv_out.shape[0]
    _, HV, DK, DV = state.shape
    assert state.dtype in STATE_DTYPES and state.stride(1) == DK * DV
    assert conv_out.stride(1) == 1 and z.stride(1) == 1
    split = value_split(dv_split, DV, "recurrent_step")
    if snapshot is not None:
        assert (snapshot.shape == (B, HV, DK, DV) and snapshot.dtype == state.dtype
                and snapshot[0].is_contiguous())
    key_dim = num_k_heads * DK
    out = torch.empty(B, HV * DV, dtype=conv_out.dtype, device=conv_out.device)
    _recurrent_kernel[(B, HV, split)](
        conv_out, a, b, z, state, slots, A_log, dt_bias, norm_weight, out,
        state if snapshot is None else snapshot,
        conv_out.stride(0), a.stride(0), b.stride(0), z.stride(0), state.stride(0), out.stride(0),
        0 if snapshot is None else snapshot.stride(0), key_dim, eps, DK ** -0.5,
        HV=HV, GROUP=HV // num_k_heads, DK=DK, DV=DV, BLOCK_V=DV // split,
        FUSE_NORM=split == 1, SNAP=snapshot is not None, num_warps=8 if split == 1 else 4,
        BITS=INTERPRETED, **pdl_launch(out))
    if split > 1:
        gated_norm_kernel[(B, HV)](out, z, norm_weight, z.stride(0), out.stride(0), eps, DV=DV,
                                    num_warps=1, **pdl_launch(out))
    return out
