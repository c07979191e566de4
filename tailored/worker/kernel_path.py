"""Start the kernel path on the runner's cache: lay out the weights, warm up, capture graphs.

Called once by the runner. On CUDA: every kernel a request can reach is compiled and tuned in
sink-only forwards (worker/warmup.py), then the decode graphs, the speculative graphs, the
prefill graphs and the context-chunk graphs are captured into one pool; from then on a Triton
compile inside a step is logged by name (kernels/compile_watch.py, kb/0030).
"""

from __future__ import annotations

import logging
import math
import time

import torch

from tailored import flags, kernels
from tailored.config import EngineConfig
from tailored.kernels import prefill_attention
from tailored.model.kernel_model import KernelModel
from tailored.worker.draft_head import DraftHead
from tailored.worker.memory_plan import kernel_path_asked, spec_max_batch
from tailored.worker.warmup import warmup_lengths, warmup_prefill

log = logging.getLogger("tailored.worker")


def make_draft_head(model, ec: EngineConfig, device: torch.device) -> DraftHead | None:
    """With speculative decoding on the kernel path on a GPU: an FP8 copy of lm_head for the
    MTP's drafts (kb/0035; the `mtp_fp8_head` switch off: none). Made before the cache is
    planned, so that its memory counts as used."""
    if (not ec.uses_mtp or not flags.current().mtp_fp8_head
            or device.type != "cuda" or getattr(model, "mtp", None) is None
            or not kernel_path_asked(ec, device)
            or kernels.unavailable_reason("cuda", model.model.embed_tokens.weight.dtype)
            or not model.lm_head.weight.is_floating_point()):  # NVFP4 lm_head: drafts read it
        return None
    head = DraftHead(model.lm_head.weight)
    # the quantization's temporaries would stay in the allocator's cache, which the cache plan
    # counts as used: a few hundred MB fewer KV pages
    torch.cuda.empty_cache()
    log.info("MTP drafts through an FP8 copy of lm_head (%.2f GiB)", head.nbytes / 1024**3)
    return head


def start_kernel_path(model, cache, cfg, ec: EngineConfig, device: torch.device,
                      draft_head: DraftHead | None = None):
    """The kernel path bound to `cache` (a `KernelForward`), warmed up and with its graphs
    captured, when EngineConfig.kernels asks for it here; else None (the plain path). Raises
    RuntimeError for `--kernels on` where the kernels cannot run."""
    from tailored.worker.kernel_forward import KernelForward

    want = kernel_path_asked(ec, device)
    if want:
        why = kernels.unavailable_reason(device.type, model.model.embed_tokens.weight.dtype)
        if why and ec.kernels == "on":
            raise RuntimeError(f"--kernels on: {why}")
        if why:
            log.warning("kernel path unavailable (%s): running the plain PyTorch path", why)
            want = False
    way = flags.current().prefill_attention
    if not want:
        log.info("plain PyTorch path (kernels=%s on %s)%s%s%s", ec.kernels, device.type,
                 "; --enforce-eager has no effect" if ec.enforce_eager else "",
                 "; --prefill-graphs has no effect (kernel path on CUDA only)"
                 if ec.prefill_graphs else "",
                 f"; TAILORED_PREFILL_ATTENTION={way} has no effect (kernel path only)"
                 if way != "sdpa" else "")
        return None
    prefill_attention.check_choice(device)  # fa3 that cannot run here: refused at start
    km = KernelModel(model, cache)
    kf = KernelForward(km, max_batch=ec.max_num_seqs,
                       max_pages=math.ceil(ec.max_model_len / ec.page_size) + 1,
                       use_graphs=not ec.enforce_eager)
    # verify graphs; with the MTP head also its MTP and chain graphs (prompt lookup alone:
    # verify graphs only, the host accepts)
    if ec.num_speculative_tokens > 0 and kf.use_graphs and (km.mtp_layer is not None
                                                            or not ec.uses_mtp):
        from tailored.worker.spec_graphs import SpecGraphs

        kf.spec = SpecGraphs(km, kf.pool, ec.num_speculative_tokens, spec_max_batch(ec),
                             kf.max_pages, draft_head)
    if ec.prefill_graphs and (device.type != "cuda" or ec.enforce_eager):
        log.info("--prefill-graphs has no effect %s", "with --enforce-eager"
                 if ec.enforce_eager else "on the CPU (CUDA graphs)")
    if device.type == "cuda":
        _warm_and_capture(kf, cfg, ec, device)
    log.info("kernel path on (CUDA graphs %s, prefill graphs %s, context-chunk graphs %s, "
             "mixed-step graphs %s, GDN prefill %s, prefill attention %s)",
             "on" if kf.use_graphs else "off",
             f"{len(kf.prefill.graphs)} buckets" if kf.prefill.graphs else "off",
             f"{len(kf.ctx.graphs)} buckets" if kf.ctx and kf.ctx.graphs else "off",
             f"{sum(len(m.graphs) for m in kf.mixed)}" if kf.mixed else "off",
             "fla-core" if km.gdn.fla else "reference", way)
    return kf


def _warm_and_capture(kf, cfg, ec: EngineConfig, device: torch.device) -> None:
    t0 = time.monotonic()
    log.info("warming up the kernels%s (Triton tunes each new shape unless a saved table has "
             "it: minutes on a first FP8 start, kb/0020)",
             " and capturing CUDA graphs" if kf.use_graphs else "")
    warmup_prefill(kf.km, warmup_lengths(kf.km, ec.max_num_batched_tokens),
                   batch_tokens=ec.max_num_batched_tokens)
    if kf.use_graphs:
        kf.decode.capture()
        if kf.spec is not None:
            kf.spec.capture()
        if ec.prefill_graphs:
            max_tokens = min(ec.max_num_batched_tokens, ec.max_model_len)
            kf.prefill.capture(max_tokens)
            # kb/0055; not after a failed prefill capture (likely out of memory)
            if kf.prefill.graphs and flags.current().ctx_graphs:
                from tailored.worker.ctx_graphs import ContextGraphs

                kf.ctx = ContextGraphs(kf.km, kf.pool, kf.max_pages)
                kf.ctx.capture(max_tokens)
            # kb/0068: decode rows beside one chunk in one graph (the `mixed_graph_tokens`
            # switch; after the graphs whose buffers and mixers they share)
            from tailored.worker.mixed_graphs import mixed_families

            kf.mixed = mixed_families(kf)
    # the `tuning_dump` switch: save the launch configs tuned at this warm-up, for the next
    # start to skip tuning (kernels/tuning.py)
    from tailored.kernels import tuning

    tuning.dump_if_requested({"max_num_seqs": ec.max_num_seqs,
                              "max_num_batched_tokens": ec.max_num_batched_tokens,
                              "prefill_graphs": ec.prefill_graphs,
                              "fp8": cfg.fp8 is not None})
    # from here on a Triton compile stalls a step: name each one (kb/0030)
    from tailored.kernels.compile_watch import watch_compiles

    watch_compiles()
    free, _ = torch.cuda.mem_get_info(device)
    log.info("kernels warmed up%s in %.1f s; %.2f GiB of GPU memory free, %.2f GiB reserved by "
             "this process", " and CUDA graphs captured" if kf.use_graphs else "",
             time.monotonic() - t0, free / 1024**3, torch.cuda.memory_reserved(device) / 1024**3)
