"""Gated DeltaNet over a speculative verify chunk: n tokens of each sequence in one launch each
of the conv and the recurrence (spec §5.2–§5.7, §8.4), where `kernels.gdn_decode` needs n.

The verify graph (worker/spec_graphs.py) lays its B·n rows out token-major (row j·B + b is token
j of sequence b). Each program keeps its sequence's state in registers across the n tokens
instead of storing and reloading it between launches, and writes the state after every token
j < n-1 into the snapshot (for `HybridCache.commit_many`) and the state after the last token
into the slot. Same arithmetic, in the same order, as n `gdn_decode` steps: in bf16 the
outputs, snapshots and final states are those of the token-by-token launches bit for bit
(H200 and interpreter, tests/kernels/test_kernels.py); fp32 inputs differ in the conv's last bit on
the H200 (the compiler contracts its products differently). At n = 3 this saves 2·(2 or 3)
launches a GDN layer, ~150 of a verify step's ~780 (kb/0033).

References: `gdn_decode.conv_step` / `recurrent_step` run n times; FLA
`fused_recurrent_gated_delta_rule` (its token loop inside one program).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tailored.kernels.gdn_decode import (INTERPRETED, STATE_DTYPES, delta_rule_token,
                                         gated_norm, gated_norm_kernel, to_state, value_split)
from tailored.kernels.pdl import enter as pdl_enter
from tailored.kernels.pdl import launch as pdl_launch


@triton.jit
def _conv_verify_kernel(x_ptr, state_ptr, w_ptr, slot_ptr, out_ptr, snap_ptr, C, B,
                        stride_xb, stride_ss, stride_sc, stride_ob, stride_pj, stride_pb,
                        N: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr = False):
    """Window of 3 (conv kernel 4, the model's): w0 oldest .. w2 newest, held in registers."""
    if PDL:  # kernels/pdl.py: wait for the previous kernel first
        pdl_enter()
    b = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = c < C
    slot = tl.load(slot_ptr + b).to(tl.int64)
    s_base = state_ptr + slot * stride_ss + c * stride_sc
    sdt = state_ptr.dtype.element_ty
    k0 = tl.load(w_ptr + c * 4 + 0, mask=ok, other=0.0).to(tl.float32)
    k1 = tl.load(w_ptr + c * 4 + 1, mask=ok, other=0.0).to(tl.float32)
    k2 = tl.load(w_ptr + c * 4 + 2, mask=ok, other=0.0).to(tl.float32)
    k3 = tl.load(w_ptr + c * 4 + 3, mask=ok, other=0.0).to(tl.float32)
    w0 = tl.load(s_base + 0, mask=ok, other=0.0).to(tl.float32)
    w1 = tl.load(s_base + 1, mask=ok, other=0.0).to(tl.float32)
    w2 = tl.load(s_base + 2, mask=ok, other=0.0).to(tl.float32)
    for j in tl.static_range(N):
        row = j * B + b
        x = tl.load(x_ptr + row * stride_xb + c, mask=ok, other=0.0).to(tl.float32)
        # the order of gdn_decode's accumulation: x·k3, then the window oldest first
        acc = x * k3
        acc += w0 * k0
        acc += w1 * k1
        acc += w2 * k2
        y = acc * tl.sigmoid(acc)
        tl.store(out_ptr + row * stride_ob + c, y.to(out_ptr.dtype.element_ty), mask=ok)
        # the window as the state stores it (rounded to its dtype), shifted by one
        w0 = w1
        w1 = w2
        w2 = x.to(sdt).to(tl.float32)
        if j < N - 1:
            p = snap_ptr + j * stride_pj + b * stride_pb + c * 3
            tl.store(p + 0, w0.to(snap_ptr.dtype.element_ty), mask=ok)
            tl.store(p + 1, w1.to(snap_ptr.dtype.element_ty), mask=ok)
            tl.store(p + 2, w2.to(snap_ptr.dtype.element_ty), mask=ok)
    tl.store(s_base + 0, w0.to(sdt), mask=ok)
    tl.store(s_base + 1, w1.to(sdt), mask=ok)
    tl.store(s_base + 2, w2.to(sdt), mask=ok)


def conv_verify(x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor,
                slots: torch.Tensor, snapshot: torch.Tensor) -> torch.Tensor:
    """n tokens per sequence through the causal conv (kernel width 4), updating `state`.

    x: [n·B, C] token-major projection outputs (row j·B + b; row stride free); state:
    [num_slots, C, 3] (unit stride on the last dim); weight: [C, 4]; slots: [B] distinct slots
    (pads: the sink, slot 0). snapshot: [n-1, B, C, 3] in state's dtype (each [j, b] contiguous;
    a slice of a larger buffer is fine) receiving the state after token j. Returns
    silu(conv) [n·B, C] in x.dtype, equal to n `gdn_decode.conv_step` calls."""
    B = slots.shape[0]
    T, C = x.shape
    n = T // B
    assert T == n * B and n >= 1 and weight.shape == (C, 4)
    assert state.shape[1:] == (C, 3) and state.stride(2) == 1 and x.stride(1) == 1
    assert (snapshot.shape == (n - 1, B, C, 3) and snapshot.dtype == state.dtype
            and (n == 1 or snapshot[0, 0].is_contiguous()))
    out = torch.empty(T, C, dtype=x.dtype, device=x.device)
    block = 256
    _conv_verify_kernel[(B, triton.cdiv(C, block))](
        x, state, weight.contiguous(), slots, out, snapshot if n > 1 else out, C, B,
        x.stride(0), state.stride(0), state.stride(1), out.stride(0),
        snapshot.stride(0) if n > 1 else 0, snapshot.stride(1) if n > 1 else 0,
        N=n, BLOCK_C=block, **pdl_launch(out))
    return out


@triton.jit
def _recurrent_verify_kernel(conv_ptr, a_ptr, b_ptr, z_ptr, state_ptr, slot_ptr,
                             A_log_ptr, dt_bias_ptr, norm_w_ptr, out_ptr, snap_ptr, B,
                             stride_cb, stride_ab, stride_bb, stride_zb, stride_ss, stride_ob,
                             stride_pj, stride_pb, KEY_DIM, eps, scale,
                             N: tl.constexpr, HV: tl.constexpr, GROUP: tl.constexpr,
                             DK: tl.constexpr, DV: tl.constexpr, BLOCK_V: tl.constexpr,
                             FUSE_NORM: tl.constexpr, PDL: tl.constexpr = False,
                             BITS: tl.constexpr = False):
    """One (sequence, value head, BLOCK_V state columns) per program, its n tokens in order
    (gdn_decode.delta_rule_token, as the decode kernel runs it per token)."""
    if PDL:  # kernels/pdl.py: wait for the previous kernel first
        pdl_enter()
    bi = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + bi).to(tl.int64)
    dk = tl.arange(0, DK)
    dv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    s_ptrs = state_ptr + slot * stride_ss + h * DK * DV + dk[:, None] * DV + dv[None, :]
    S = tl.load(s_ptrs).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    sd = state_ptr.dtype.element_ty  # the state's storage dtype (fp32 or bf16)
    for j in tl.static_range(N):
        r = j * B + bi
        S, q = delta_rule_token(S, conv_ptr + r * stride_cb, a_ptr + r * stride_ab,
                                 b_ptr + r * stride_bb, A_log_ptr, dt_bias_ptr, h, h // GROUP,
                                 dk, dv, KEY_DIM, scale, DK, DV)
        if j < N - 1:
            tl.store(snap_ptr + j * stride_pj + bi * stride_pb + h * DK * DV
                     + dk[:, None] * DV + dv[None, :], to_state(S, sd, BITS))
        o = tl.sum(S * q[:, None], 0)
        if FUSE_NORM:
            gated_norm(o.to(dt).to(tl.float32), z_ptr + r * stride_zb + h * DV, norm_w_ptr,
                        out_ptr + r * stride_ob + h * DV, eps, DV)
        else:
            tl.store(out_ptr + r * stride_ob + h * DV + dv, o.to(dt))
        # the next token reads the state as a decode step would reload it: rounded to the
        # storage dtype (a no-op for fp32), so the chunk equals n decode steps bit for bit
        S = to_state(S, sd, BITS).to(tl.float32)
    tl.store(s_ptrs, to_state(S, sd, BITS))


def recurrent_verify(conv_out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, z: torch.Tensor,
                     state: torch.Tensor, slots: torch.Tensor, A_log: torch.Tensor,
                     dt_bias: torch.Tensor, norm_weight: torch.Tensor, num_k_heads: int,
                     eps: float, snapshot: torch.Tensor,
                     dv_split: int | None = None) -> torch.Tensor:
    """Gates + delta rule + gated norm for n tokens per sequence; `state` updated in place.

    conv_out: [n·B, 2·HK·Dk + HV·Dv] token-major (`conv_verify`'s output); a, b: [n·B, HV];
    z: [n·B, HV·Dv]; state: [num_slots, HV, Dk, Dv] fp32 or bf16 (math in fp32, the state
    rounded to its dtype after every token as a decode step stores it); slots: [B] distinct
    (pads: 0); snapshot: [n-1, B, HV, Dk, Dv] in state's dtype (each [j, b] contiguous) receiving the state after
    token j; dv_split as `gdn_decode.recurrent_step`. Returns [n·B, HV·Dv] in conv_out.dtype,
    equal to n `recurrent_step` calls. Raises ValueError for a split that does not divide Dv
    into a power of 2."""
    B = slots.shape[0]
    T = conv_out.shape[0]
    n = T // B
    _, HV, DK, DV = state.shape
    assert T == n * B and n >= 1
    assert state.dtype in STATE_DTYPES and state.stride(1) == DK * DV
    assert conv_out.stride(1) == 1 and z.stride(1) == 1
    assert (snapshot.shape == (n - 1, B, HV, DK, DV) and snapshot.dtype == state.dtype
            and (n == 1 or snapshot[0, 0].is_contiguous()))
    split = value_split(dv_split, DV, "recurrent_verify")
    out = torch.empty(T, HV * DV, dtype=conv_out.dtype, device=conv_out.device)
    _recurrent_verify_kernel[(B, HV, split)](
        conv_out, a, b, z, state, slots, A_log, dt_bias, norm_weight, out,
        snapshot if n > 1 else state, B,
        conv_out.stride(0), a.stride(0), b.stride(0), z.stride(0), state.stride(0), out.stride(0),
        snapshot.stride(0) if n > 1 else 0, snapshot.stride(1) if n > 1 else 0,
        num_k_heads * DK, eps, DK ** -0.5,
        N=n, HV=HV, GROUP=HV // num_k_heads, DK=DK, DV=DV, BLOCK_V=DV // split,
        FUSE_NORM=split == 1, num_warps=8 if split == 1 else 4, BITS=INTERPRETED,
        **pdl_launch(out))
    if split > 1:
        gated_norm_kernel[(T, HV)](out, z, norm_weight, z.stride(0), out.stride(0), eps, DV=DV,
                                    num_warps=1, **pdl_launch(out))
    return out
