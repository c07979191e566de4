"""Start-up forwards into the pad sinks, so that no user request compiles or tunes a kernel.

Triton compiles a kernel variant per shape class and per integer argument class (1, a
multiple of 16, or neither), FLA and the MoE autotune per new shape. A cold server did all of
that inside its first requests (~3 s of a c=32 benchmark, kb/0030; new MoE tiles, kb/0031).
These prefills write only slot 0 and page 0, which no request owns.
"""

from __future__ import annotations

import torch

from tailored.kernels import moe as moe_kernels
from tailored.kernels import moe_w8a8
from tailored.model.batch import ForwardBatch, SeqInfo
from tailored.model.kernel_moe import grouped_applies, w8a8_applies
from tailored.model.kernel_moe_w4 import w4_grouped_applies
from tailored.model.kernel_mtp import mtp_eager


def warmup_lengths(km, batch_tokens: int) -> list[int]:
    """Prompt lengths (≤ batch_tokens) whose prefills reach every MoE launch class a prefill
    can pick: fused_moe's pair-count buckets of few-row steps (33..128 tokens: a prompt's last
    chunk), each prefill M tile (`moe._blocks`: tuned per tile when first seen; `warmup_prefill`
    runs every length through fused_moe, as a prefill graph of that size would), the grouped
    path, the W8A8 experts' launch classes (FP8 experts, from `moe_w8a8_from`: each down
    BLOCK_M), the NVFP4 grouped GEMM's (NVFP4 experts, from `nvfp4_grouped_from`: the same
    BLOCK_M rule), 1024 and batch_tokens itself."""
    from tailored import flags

    E, k = km.cfg.num_experts, km.cfg.num_experts_per_tok

    def fewest(per_expert):  # fewest tokens with more than per_expert rows an expert
        return int(per_expert * E / k) + 1

    want = {40, 100, fewest(4), fewest(moe_kernels.BM64_ABOVE),
            fewest(moe_kernels.BM64_ABOVE_FP8), fewest(moe_kernels.BM128_ABOVE), 1024,
            batch_tokens}
    grouped_from = flags.current().moe_grouped_from
    if grouped_applies(grouped_from, km.dtype, km.device):
        want.add(grouped_from)
    w8a8_from = flags.current().moe_w8a8_from
    if w8a8_applies(w8a8_from) and _fp8_experts(km):
        want |= {w8a8_from, max(w8a8_from, fewest(moe_w8a8.DOWN_BM128_ABOVE))}
    w4_from = max(flags.current().nvfp4_grouped_from, flags.current().nvfp4_gemv_up_to + 1)
    if w4_grouped_applies(w4_from) and _nvfp4_experts(km):
        want |= {w4_from, max(w4_from, fewest(moe_w8a8.DOWN_BM128_ABOVE))}
    return sorted(n for n in want if 1 < n <= batch_tokens)


def _fp8_experts(km) -> bool:
    """Whether km's MoE holds FP8 routed experts (their block scales: `MoEBlocks.experts`)."""
    return bool(getattr(getattr(km, "moe", None), "experts", None))


def _nvfp4_experts(km) -> bool:
    """Whether km's MoE holds NVFP4 routed experts (`MoEBlocks.w4`)."""
    return bool(getattr(getattr(km, "moe", None), "w4", None))


def sink_prefill(km, lengths: list[int], decode_rows: int = 0) -> ForwardBatch:
    """Fresh prompts of zero tokens, all in the pad sinks (slot 0, page 0), then
    `decode_rows` decode rows there (position 1)."""
    seqs, q = [], 0
    for n in lengths:
        seqs.append(SeqInfo(q, n, 0, 0, True, [0] * (n // km.cache.page_size + 1)))
        q += n
    for _ in range(decode_rows):
        seqs.append(SeqInfo(q, 1, 1, 0, False, [0]))
        q += 1
    ids = torch.zeros(q, dtype=torch.long, device=km.device)
    pos = torch.cat([torch.arange(n, device=km.device) for n in lengths]
                    + [torch.ones(decode_rows, dtype=torch.long, device=km.device)])
    return ForwardBatch(ids, pos, seqs, [])


@torch.no_grad()  # startup forwards: never keep autograd's saved activations
def warmup_prefill(km, lengths, batch_tokens: int = 0) -> None:
    """Run prefills of these lengths into the pad sinks so that Triton compiles and FLA/MoE
    autotuning happen at start-up (lengths an eager step sends to the grouped, the W8A8 or
    the NVFP4 grouped experts run a second time, eagerly: the first holds the MoE to
    fused_moe, or the NVFP4 scratch). batch_tokens > 4: also one prefill of three sequences
    with an odd token total up to that many, the shape of a mixed step (single prompts of
    even lengths reach only the 1 and multiple-of-16 argument classes, kb/0030). With the MTP
    layer in the cache, each length through it too (`warm_mtp`)."""
    for n in sorted(set(int(x) for x in lengths if x > 1)):
        # every length through fused_moe (a prefill graph of that size would launch it),
        # and through the grouped experts too where an eager step would take them
        km.moe.fused_only = True
        try:
            km.forward_eager(sink_prefill(km, [n]))
        finally:
            km.moe.fused_only = False
        if (grouped_applies(n, km.dtype, km.device) or (w8a8_applies(n) and _fp8_experts(km))
                or (w4_grouped_applies(n) and _nvfp4_experts(km))):
            km.forward_eager(sink_prefill(km, [n]))
        if km.mtp_layer is not None:
            warm_mtp(km, n)
    if batch_tokens > 4:
        m = min(int(batch_tokens), 1024)
        a, b = m // 2, m // 4
        c = (m if m % 2 else m - 1) - a - b  # an odd total, at most m (c ≥ 1 for m ≥ 5)
        km.forward_eager(sink_prefill(km, [a, b, c]))
    # an eager step with a decode row (the eager fold, --enforce-eager, more decode rows
    # than the largest graph) runs the rows' paged attention without the merge's gate: its
    # kernel variants compile here, not inside the first such step (kb/0068)
    km.forward_eager(sink_prefill(km, [3], decode_rows=1))
    if km.device.type == "cuda":
        torch.cuda.synchronize()


def warm_mtp(km, n: int) -> None:
    """The MTP layer over an n-token prompt in the sinks, eagerly, as speculative decoding
    runs it over every prompt chunk. Its experts are bf16 in the FP8 checkpoint, and nothing
    else launches bf16 prefill experts in an FP8 serve (else two MoE compiles happened inside
    the first request of the FP8 speculative serve)."""
    b = sink_prefill(km, [n])
    h = torch.zeros(n, km.cfg.hidden_size, dtype=km.dtype, device=km.device)
    mtp_eager(km, h, b.input_ids, b.positions, b.seqs)
