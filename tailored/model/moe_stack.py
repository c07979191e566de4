"""The shared expert as routed expert E: one weight stack [E+1, ...] for decode (kb/0019).

Spec §7.4: the MoE block's output is Σ_k w_k·Expert_{e_k}(x) + sigmoid(x·g)·SharedExpert(x),
and in this model the shared expert has the routed experts' shape (intermediate 512). In a
decode step the shared expert cost three launches of its own below bandwidth (its gate/up rows
in the router GEMM, silu·mul, a 0.5 TB/s cuBLAS GEMV for down: ~6 µs a layer at B=1, H200
profile in kb/0017); as expert E it is one more (token, expert) pair per token in the fused
MoE kernels, read at their bandwidth. This file builds the stacks; `model/kernel_moe.py` uses them.

Memory: the routed experts' storage grows in place by one expert (`UntypedStorage.resize_`:
the parameters keep pointing at it, nothing else holds a second copy), and the shared
expert's weights are copied into the new slot (6.3 MB a layer in bf16, 3.1 MB in FP8: 250 /
125 MB for the model), since the prefill path keeps reading them from the fused router GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn



@dataclass
class ExpertStack:
    """Routed experts 0..E-1 and the shared expert as expert E of one MoE layer.

    gate_up: [E+1, 2I, H] (gate rows first); down: [E+1, H, I]; both the model's weight dtype
    (bf16/fp32, or float8_e4m3fn). gate_up_scale [E+1, 2·ceil(I/128), ceil(H/128)] and down_scale
    [E+1, ceil(H/128), ceil(I/128)] fp32 block scales for FP8 weights
    (`fp8.expert_block_scales`), else None.
    The module's `experts.gate_up_proj`/`down_proj` are views of the first E.
    """

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_scale: torch.Tensor | None
    down_scale: torch.Tensor | None

    def routed_scales(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The routed experts' FP8 block scales (views of the first E), or (None, None)."""
        if self.gate_up_scale is None:
            return None, None
        E = self.gate_up.shape[0] - 1
        return self.gate_up_scale[:E], self.down_scale[:E]


@torch.no_grad()
def append_expert(param: nn.Parameter, extra: torch.Tensor) -> torch.Tensor:
    """[E, R, C] parameter → [E+1, R, C] tensor: the parameter's values, then `extra` [R, C].

    The parameter's own storage grows by one expert when it is exactly that tensor (contiguous,
    offset 0, resizable): no second copy of 1.5 GB a layer. Otherwise (a view, a non-resizable
    storage) it is copied and the parameter becomes a view of the copy.
    """
    t = param.data
    E = t.shape[0]
    if extra.shape != t.shape[1:] or extra.dtype != t.dtype:
        raise ValueError(f"append_expert: {tuple(extra.shape)} {extra.dtype} onto "
                         f"{tuple(t.shape)} {t.dtype}")
    st = t.untyped_storage()
    nbytes = t.numel() * t.element_size()
    out = None
    if t.is_contiguous() and t.storage_offset() == 0 and st.nbytes() == nbytes:
        try:
            st.resize_(nbytes // E * (E + 1))  # keeps the bytes; the parameter sees the new block
            out = torch.empty(0, dtype=t.dtype, device=t.device).set_(st, 0, (E + 1, *t.shape[1:]))
        except RuntimeError:  # not resizable (e.g. memory-mapped)
            out = None
    if out is None:
        out = torch.cat([t, extra[None]])
        param.data = out[:E]
    out[E].copy_(extra)
    return out


def stack_shared_expert(mlp: nn.Module, block_scales: tuple | None) -> ExpertStack | None:
    """The ExpertStack of one SparseMoe module, or None when the shared expert does not have the
    routed experts' shape and dtype (then the decode path keeps it separate).

    block_scales: the routed experts' FP8 block scales (gate_up, down) from
    `fp8.expert_block_scales`, or None for bf16/fp32 experts.
    """
    ex, se = mlp.experts, mlp.shared_expert
    E, two_i, H = ex.gate_up_proj.shape
    g, u, d = se.gate_proj.weight, se.up_proj.weight, se.down_proj.weight
    if (g.shape != (two_i // 2, H) or d.shape != (H, two_i // 2)
            or not g.dtype == u.dtype == d.dtype == ex.gate_up_proj.dtype):
        return None
    gate_up = append_expert(ex.gate_up_proj, torch.cat([g, u]))
    down = append_expert(ex.down_proj, d)
    if block_scales is None:
        return ExpertStack(gate_up, down, None, None)
    # the shared expert's own block scales, laid out as an expert's (gate blocks, up blocks)
    sgu = torch.cat([se.gate_proj.weight_scale_inv, se.up_proj.weight_scale_inv]).float()
    sdn = se.down_proj.weight_scale_inv.float()
    return ExpertStack(gate_up, down, torch.cat([block_scales[0], sgu[None]]),
                       torch.cat([block_scales[1], sdn[None]]))
