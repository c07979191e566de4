"""How much of the device the cache takes: KV pages and GDN state slots, sized at start.

The cache is allocated once (worker/cache.py) from what memory is left after the weights, the
activations of the largest step, the kernel path's own allocations and the speculative graphs'
headroom; the engine's pools then hand out its pages and slots.
"""

from __future__ import annotations

import math

import torch

from tailored import flags
from tailored.config import EngineConfig, ModelConfig
from tailored.worker.cache import HybridCache

CPU_CACHE_BYTES = 512 * 1024**2  # KV + state budget when running on the CPU


# Speculative decoding's share of GPU memory that nothing above counts yet (the verify and MTP
# graphs' pools, the eager MTP over prompt chunks). Without it the cache took the whole budget
# and the H200 ran out (kb/0033): the 1024 -> 8192-token prefill graphs failed to
# capture with 2 drafts (0.24 GiB free), and with 1 draft the first request failed. The plain
# serve never reaches the limit there (its pages are capped by max_num_seqs x max_model_len with
# 4.07 GiB free after every capture); the MTP layer's KV makes each page 10 % larger, so the
# spec serve is memory-bound and needs the slack said out loud. A measured margin, not a model.
SPEC_HEADROOM_BYTES = 6 * 1024**3


def plan_cache(cfg: ModelConfig, ec: EngineConfig, dtype: torch.dtype, device: torch.device,
               reserve_bytes: int = 0):
    """Choose (num_pages, num_slots) for the hybrid cache.

    Slots: max_num_seqs + 1 (slot 0 is the pad sink); the cache holds prefix_cache_entries
    snapshot slots after them (engine/prefix_cache.py). Pages: enough for max_num_seqs requests of
    max_model_len (+1 pad page), limited by memory: on the GPU the free memory after weights
    times gpu_memory_utilization's share, on the CPU CPU_CACHE_BYTES. Raises RuntimeError when
    not even one max_model_len request fits. reserve_bytes: GPU memory the kernel path will
    allocate after the cache (`kernel_path_reserve`), kept out of the budget; with speculative
    decoding also SPEC_HEADROOM_BYTES.
    """
    num_slots = ec.max_num_seqs + 1
    # with speculative decoding the MTP layer's KV too (worker/drafter.py)
    per_page = HybridCache.bytes_per_page(cfg, ec.page_size, dtype, mtp_layers(ec))
    per_slot = HybridCache.bytes_per_slot(cfg, dtype, state_dtype(ec))
    want_pages = ec.max_num_seqs * math.ceil(ec.max_model_len / ec.page_size) + 1
    if ec.num_pages is not None:
        return ec.num_pages, num_slots
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used_elsewhere = total - free
        budget = int(total * ec.gpu_memory_utilization) - used_elsewhere
        # activations of the largest step: 2 GiB (plain PyTorch path, generous) + 256 KiB per
        # token of the step budget (the MoE's fp32 [tokens·8, 2048] output alone is 64 KiB);
        # prefill CUDA graphs keep their largest bucket's activations in their own pool: as much
        # again
        act = ec.max_num_batched_tokens * 256 * 1024
        budget -= 2 * 1024**3 + act * (2 if ec.prefill_graphs else 1) + reserve_bytes
        if ec.num_speculative_tokens > 0:
            budget -= SPEC_HEADROOM_BYTES
    else:
        budget = CPU_CACHE_BYTES
    budget -= (num_slots + ec.prefix_cache_entries) * per_slot  # snapshot slots after them
    # a model cut to its first 1-3 layers has no attention layer: pages cost nothing
    pages = want_pages if per_page == 0 else min(want_pages, budget // per_page)
    need = math.ceil(ec.max_model_len / ec.page_size) + 1
    if pages < need:
        snaps = ec.prefix_cache_entries
        raise RuntimeError(
            f"not enough memory for the cache: {max(pages, 0)} pages of {ec.page_size} tokens "
            f"fit, one {ec.max_model_len}-token request needs {need}; lower --max-model-len or "
            "--max-num-seqs" + (f", or --prefix-cache-entries ({snaps} GDN states of "
                                f"{per_slot / 1024**2:.1f} MiB each come first)" if snaps else ""))
    return int(pages), num_slots


def mtp_layers(ec: EngineConfig) -> int:
    """MTP layers the cache holds KV for: 1 with the MTP head's drafts, else 0 (prompt lookup
    alone needs none)."""
    return 1 if ec.uses_mtp else 0


def state_dtype(ec: EngineConfig) -> torch.dtype:
    """The GDN recurrent states' storage dtype (EngineConfig.gdn_state_dtype, "auto" resolved:
    bf16 for a bf16 model, else fp32)."""
    return getattr(torch, ec.gdn_state_dtype_name)


def kernel_path_asked(ec: EngineConfig, device: torch.device) -> bool:
    """Whether EngineConfig.kernels asks for the kernel path on `device` (auto: CUDA only);
    it runs if `kernels.unavailable_reason` has nothing against it. Raises ValueError for a
    setting other than auto, on or off."""
    if ec.kernels not in ("auto", "on", "off"):
        raise ValueError(f"kernels must be auto, on or off, got {ec.kernels!r}")
    return ec.kernels == "on" or (ec.kernels == "auto" and device.type == "cuda")


def kernel_path_reserve(model, ec: EngineConfig, device: torch.device) -> int:
    """GPU bytes the kernel path will allocate after the cache (FP8 dense projections held
    dequantized, `projections.dense_dequant_bytes`, kb/0026; the grouped prefill experts'
    scratch and activations, `kernel_moe.moe_grouped_reserve_bytes`; the verify graphs' GDN
    snapshots; the mixed-step graphs' outputs, `mixed_graphs.output_bytes`): 0 where it will not run on a GPU (the CPU, --kernels off, no Triton: the
    plain-path fallback must still start)."""
    from tailored import kernels

    if device.type != "cuda" or not kernel_path_asked(ec, device) or \
            kernels.unavailable_reason("cuda", model.model.embed_tokens.weight.dtype) is not None:
        return 0
    from tailored.model.kernel_moe import moe_grouped_reserve_bytes
    from tailored.model.projections import dense_dequant_bytes
    from tailored.worker.spec_graphs import snapshot_bytes

    dtype = model.model.embed_tokens.weight.dtype
    spec = (snapshot_bytes(model.config, ec.num_speculative_tokens, spec_max_batch(ec), dtype,
                           state_dtype(ec))
            if ec.num_speculative_tokens > 0 and not ec.enforce_eager else 0)
    mixed = 0
    limit = flags.current().mixed_graph_tokens
    if limit and ec.prefill_graphs and not ec.enforce_eager:  # worker/mixed_graphs.py
        from tailored.worker.mixed_graphs import output_bytes

        mixed = output_bytes(ec.max_num_seqs, min(limit, ec.max_num_batched_tokens),
                             model.config.hidden_size, dtype.itemsize)
    return (dense_dequant_bytes(model, dtype)
            + moe_grouped_reserve_bytes(model, dtype, ec.max_num_batched_tokens) + spec + mixed)


def spec_max_batch(ec: EngineConfig) -> int:
    """Largest batch of verify steps in CUDA graphs (speculative decoding): the scheduler
    drafts while at most this many requests run (EngineConfig.spec_max_running)."""
    return max(1, min(ec.spec_max_running, ec.max_num_seqs))
