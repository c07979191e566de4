"""Copy GDN states from a verify step's snapshots into their slots, every layer and sequence in
one launch (`HybridCache.commit_many`, spec §8.4).

dst[g, slot[m]] = src[g, j[m], b[m]] for every layer g and move m, without the temporary that
torch's advanced indexing builds (`src[:, j, b]` is a full copy: 1.9 GiB at 32 sequences for
the recurrent states) and without one copy launch per sequence (64 at 32 sequences).
Reference: that indexing expression (tests/kernels/test_kernels.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tailored.kernels.pdl import enter as pdl_enter
from tailored.kernels.pdl import launch as pdl_launch


# The moves come as one pointer and a row stride (the move count), not three row pointers: rows 1
# and 2 of a [3, M] tensor are 16-byte aligned only for even M, and Triton compiles a variant per
# pointer alignment and per count class (1, a multiple of 16, neither). A spec serve compiled
# two inside its benchmark window (kb/0034 §1); one variant serves every M.
@triton.jit(do_not_specialize=["stride_m"])
def _commit_kernel(src_ptr, dst_ptr, moves_ptr, stride_m, E,
                   stride_sg, stride_sj, stride_sb, stride_dg, stride_ds,
                   BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # kernels/pdl.py: wait for the previous kernel first
        pdl_enter()
    m = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    e = tl.program_id(2).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    j = tl.load(moves_ptr + m).to(tl.int64)
    # j < 0: no move (decided on the device: SpecGraphs.chain_body); an empty range, not a
    # scalar-and-block mask (which Triton's interpreter rejects)
    ok = e < tl.where(j >= 0, E, 0)
    b = tl.load(moves_ptr + stride_m + m).to(tl.int64)
    slot = tl.load(moves_ptr + 2 * stride_m + m).to(tl.int64)
    x = tl.load(src_ptr + g * stride_sg + j * stride_sj + b * stride_sb + e, mask=ok)
    tl.store(dst_ptr + g * stride_dg + slot * stride_ds + e, x, mask=ok)


def commit_snapshots(src: torch.Tensor, dst: torch.Tensor, moves: torch.Tensor) -> None:
    """src: [G, N, MB, ...] snapshots; dst: [G, S, ...] states, same trailing shape and dtype,
    each [g, j, b] / [g, s] block contiguous; moves: [3, M] int64 on the device (j, b, slot),
    slots distinct. Writes dst[g, slot] = src[g, j, b] for every g and move; a move with
    j < 0 writes nothing."""
    G = src.shape[0]
    assert dst.shape[0] == G and src.shape[3:] == dst.shape[2:] and src.dtype == dst.dtype
    assert src[0, 0, 0].is_contiguous() and dst[0, 0].is_contiguous()
    M = moves.shape[1]
    if M == 0:
        return
    if moves.stride(1) != 1:
        moves = moves.contiguous()
    E = dst[0, 0].numel()
    block = 4096
    _commit_kernel[(M, G, triton.cdiv(E, block))](
        src, dst, moves, moves.stride(0), E,
        src.stride(0), src.stride(1), src.stride(2), dst.stride(0), dst.stride(1),
        BLOCK=block, **pdl_launch(dst))
