"""The kernel path's projections: linears that read one input as one GEMM (spec §9.1 layout).

Projections that read the same input are fused into one weight tensor: GDN in_proj_qkv|z|b|a,
attention q|k|v, and router|shared-expert gate|shared gate|shared up. The modules' weights
become views into the fused tensor, so the plain path and the checkpoint names still work with
no second copy. A `Proj` picks its kernel per call by row count: the FP8 GEMV or split-K GEMM
over FP8 weights at few rows, cuBLAS over bf16 (or FP8 held dequantized) above, the bf16 GEMV
at one row (switches `fp8_gemv_up_to`, `fp8_dense_splitk_up_to`, `bf16_gemv_up_to`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tailored import flags
from tailored.kernels.fp8_dequant import dequantize_rows
from tailored.kernels.fp8_gemv import bf16_gemv, fp8_gemv
from tailored.kernels.fp8_linear import fp8_linear
from tailored.kernels.fp8_splitk import fp8_dense_splitk
from tailored.model import fp8
from tailored.model.fp8 import Fp8Linear
from tailored.model.nvfp4 import Nvfp4Linear

QUANTIZED = (Fp8Linear, Nvfp4Linear)


def held_dequantized(mods: list[nn.Module]) -> bool:
    """Whether a GEMM group is held dequantized on the kernel path: one with an NVFP4 member
    always (its dense linears have no GEMM of their own: issue 48's W4A16 GEMM is not built),
    one with an FP8 member with the `fp8_dense_dequant` switch."""
    if any(isinstance(m, Nvfp4Linear) for m in mods):
        return True
    return flags.current().fp8_dense_dequant and any(isinstance(m, Fp8Linear) for m in mods)


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
    """GPU bytes the kernel path allocates for the GEMM groups it holds dequantized
    (`held_dequantized`: `fp8_dense_dequant`, NVFP4): all of a group's weights (its bf16
    members are copied into the group's tensor too), in `dtype`, and its FP8 members' fp32
    row scales for the FP8 GEMV (kb/0039). 0 when no group is held so."""
    n = scales = 0
    for layer in model.model.layers:
        ins, out, moe, down = layer_projections(layer)
        for group in (ins, [out], moe, [down]):
            if held_dequantized(group):
                n += sum(m.in_features * m.out_features if isinstance(m, Nvfp4Linear)
                         else m.weight.numel() for m in group)
                if len(group) > 1:  # the zero rows of proj_row_align
                    n += pad_rows(sum(m.weight.shape[0] for m in group)) * group[0].in_features
                # the FP8 GEMV's fp32 row scales (`fp8_gemv_parts`)
                scales += sum(m.weight.shape[0] * -(-m.weight.shape[1] // fp8.BLOCK)
                              for m in group if isinstance(m, Fp8Linear))
    return n * dtype.itemsize + scales * 4


def pad_rows(rows: int) -> int:
    """Zero rows that bring a fused projection of `rows` rows to a multiple of the
    `proj_row_align` switch (kb/0030: a 1281-row group's 2562-byte row stride took no aligned
    cuBLAS kernel)."""
    return -rows % flags.current().proj_row_align


def dense_weight(m: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A linear's weight in `dtype`: FP8 and NVFP4 dequantized with the reference's rounding."""
    if isinstance(m, Nvfp4Linear):
        return m.dequantized(dtype)
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


def fp8_gemv_parts(mods: list[nn.Module], dequantized: torch.Tensor):
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
        # zero rows after the modules' (proj_row_align): cuBLAS GEMMs of several linears only
        self.pad = pad_rows(sum(self.sizes)) if len(mods) > 1 and not self.fp8 else 0
        self.weight = fuse_linears(mods, self.pad) if len(mods) > 1 else mods[0].weight.data
        self.scale = (torch.cat([fp8.row_scales(m.weight_scale_inv, m.weight.shape[0]) for m in mods])
                      if self.fp8 else None)

    @classmethod
    def dequantized(cls, mods: list[nn.Module], dtype: torch.dtype) -> "Proj":
        """One `dtype` GEMM for linears of any kinds sharing an input (fp8_dense_dequant): a new
        weight tensor, concatenated in module order; the modules keep their own weights."""
        p = cls.__new__(cls)
        p.fp8, p.scale = False, None
        p.sizes = [m.weight.shape[0] for m in mods]
        ws = [dense_weight(m, dtype) for m in mods]
        p.pad = pad_rows(sum(p.sizes)) if len(ws) > 1 else 0
        if p.pad:
            ws.append(ws[0].new_zeros(p.pad, ws[0].shape[1]))
        p.weight = ws[0] if len(ws) == 1 else torch.cat(ws)
        # the FP8 weights for the few-row GEMV (fp8_gemv_up_to): the modules' own
        p.gemv = fp8_gemv_parts(mods, p.weight)
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
        f = flags.current()
        if self.gemv is not None and 1 <= x.shape[0] <= f.fp8_gemv_up_to:
            w8, s8, wb, bf16_first = self.gemv
            return fp8_gemv(x, w8, s8, other=wb, other_first=bf16_first)
        if self.gemv is not None and 1 <= x.shape[0] <= f.fp8_dense_splitk_up_to:
            w8, s8, wb, bf16_first = self.gemv
            return fp8_dense_splitk(x, w8, s8, other=wb, other_first=bf16_first)
        if self.fp8:
            return fp8_linear(x, self.weight, self.scale)
        if (1 <= x.shape[0] <= f.bf16_gemv_up_to and self.weight.dtype == x.dtype
                and self.weight.stride(1) == 1):  # bf16_gemv's contract (else it raises)
            return bf16_gemv(x, self.weight)
        return F.linear(x, self.weight)


class ProjGroup:
    """Linears sharing an input, as few GEMMs as their kinds allow (one for a bf16 model; one
    per kind for FP8, where the router, shared-expert gate and GDN a/b stay bf16). Calling it
    returns the modules' outputs in the given order (views of the GEMM outputs)."""

    def __init__(self, mods: list[nn.Module], dequant: torch.dtype | None = None):
        """dequant: a dtype to hold quantized linears in (`held_dequantized`): then one GEMM
        for all."""
        if dequant is not None and any(isinstance(m, QUANTIZED) for m in mods):
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
