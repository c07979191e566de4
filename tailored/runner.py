"""ModelRunner: owns the device — weights, the hybrid cache, and sampling.

`execute(SchedulerOutput) -> ModelOutput` is the only engine stage that touches tensors. The
runner makes no policy decisions: the scheduler chose tokens, pages and slots; the runner lays
them out, runs the model, and samples one token per sequence that asked for one. With
speculative decoding it also verifies the drafts, commits the GDN states of the kept tokens
and proposes the next drafts: on the device right after a whole verify step from its CUDA graph
(`_chain`), else on the host after the tokens are read (`_speculate`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import time
from dataclasses import dataclass, field

import torch

from tailored.chain_drafts import ChainDrafts, DraftSources, feed_drafts, pending_drafts
from tailored.config import MAX_SPECULATIVE_TOKENS, EngineConfig, ModelConfig
from tailored.engine.sampler import HostCopy, Sampled, sample_on_device
from tailored.engine.scheduler import PENDING_TOKEN
from tailored.engine.types import ModelOutput, ScheduledSeq, SchedulerOutput
from tailored.kernels import env_flag
from tailored.model.batch import ForwardBatch, HybridCache, SeqInfo, index_on
from tailored.model.mtp import DraftRow, MTPDrafter, accept, emitted

log = logging.getLogger("tailored.runner")

CPU_CACHE_BYTES = 512 * 1024**2  # KV + state budget when running on the CPU
SPEC_LOG_EVERY_S = 10.0  # seconds between speculative-decoding log lines (totals so far)
# a whole verify step's next drafts stay on the device, the next step launched under the chain
# (chain_drafts.py, kb/0035); 0: the host waits for the chain and reads them (the A/B)
DRAFTS_ON_DEVICE = env_flag("TAILORED_SPEC_DRAFTS_ON_DEVICE", True)


# Speculative decoding's share of GPU memory that nothing above counts yet (the verify and MTP
# graphs' pools, the eager MTP over prompt chunks). Without it the cache took the whole budget
# and the H200 ran out (session 15, kb/0033): the 1024 -> 8192-token prefill graphs failed to
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
    allocate after the cache (`kernel_path_reserve`: fast.dense_dequant_bytes and
    fast.moe_grouped_reserve_bytes), kept out of the budget; with speculative decoding also
    SPEC_HEADROOM_BYTES.
    """
    num_slots = ec.max_num_seqs + 1
    # with speculative decoding the MTP layer's KV too (model/mtp.py)
    per_page = HybridCache.bytes_per_page(cfg, ec.page_size, dtype, _mtp_layers(ec))
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


def _mtp_layers(ec: EngineConfig) -> int:
    """MTP layers the cache holds KV for: 1 with speculative decoding (model/mtp.py), else 0."""
    return 1 if ec.num_speculative_tokens > 0 else 0


def state_dtype(ec: EngineConfig) -> torch.dtype:
    """The GDN recurrent states' storage dtype (EngineConfig.gdn_state_dtype, "auto" resolved:
    bf16 for a bf16 model, else fp32)."""
    from tailored.stack import DTYPES  # (stack imports this module)

    return DTYPES[ec.gdn_state_dtype_name]


def kernel_path_asked(ec: EngineConfig, device: torch.device) -> bool:
    """Whether EngineConfig.kernels asks for the kernel path on `device` (auto: CUDA only);
    it runs if `kernels.unavailable_reason` has nothing against it. Raises ValueError for a
    setting other than auto, on or off."""
    if ec.kernels not in ("auto", "on", "off"):
        raise ValueError(f"kernels must be auto, on or off, got {ec.kernels!r}")
    return ec.kernels == "on" or (ec.kernels == "auto" and device.type == "cuda")


def kernel_path_reserve(model, ec: EngineConfig, device: torch.device) -> int:
    """GPU bytes the kernel path will allocate after the cache (FP8 dense projections held
    dequantized, `fast.dense_dequant_bytes`, kb/0026; the grouped prefill experts' scratch and
    activations, `fast.moe_grouped_reserve_bytes`): 0 where it will not run on a GPU (the
    CPU, --kernels off, no Triton: the plain-path fallback must still start)."""
    from tailored import kernels

    if device.type != "cuda" or not kernel_path_asked(ec, device) or \
            kernels.unavailable_reason("cuda", model.lm_head.weight.dtype) is not None:
        return 0
    from tailored.model.fast import dense_dequant_bytes, moe_grouped_reserve_bytes
    from tailored.model.fast_spec import snapshot_bytes

    dtype = model.lm_head.weight.dtype
    spec = (snapshot_bytes(model.config, ec.num_speculative_tokens, spec_max_batch(ec), dtype,
                           state_dtype(ec))
            if ec.num_speculative_tokens > 0 and not ec.enforce_eager else 0)
    return (dense_dequant_bytes(model, dtype)
            + moe_grouped_reserve_bytes(model, dtype, ec.max_num_batched_tokens) + spec)


def _lone_decode(s) -> bool:
    """A decode row without drafts: one token of a request past its first chunk that
    samples (ScheduledSeq)."""
    return s.sample and len(s.token_ids) == 1 and not s.reset_state and not s.num_draft


def spec_max_batch(ec: EngineConfig) -> int:
    """Largest batch of verify steps in CUDA graphs (speculative decoding): the scheduler
    drafts while at most this many requests run (EngineConfig.spec_max_running)."""
    return max(1, min(ec.spec_max_running, ec.max_num_seqs))


class ModelRunner:
    """Runs scheduled steps on one device. Attributes num_pages/num_slots size the engine's pools."""

    def __init__(self, model, cfg: ModelConfig, ec: EngineConfig, device, dtype: torch.dtype):
        self.model = model
        self.cfg = cfg
        self.device = torch.device(device)
        self.page_size = ec.page_size
        self._maybe_draft_head(ec)  # before the cache: its memory is then counted as used
        self.num_pages, self.num_slots = plan_cache(cfg, ec, dtype, self.device,
                                                    kernel_path_reserve(model, ec, self.device))
        # the prefix cache's snapshot slots after the requests' (engine/prefix_cache.py)
        all_slots = self.num_slots + ec.prefix_cache_entries
        self.cache = HybridCache(cfg, self.num_pages, ec.page_size, all_slots, dtype,
                                 self.device, _mtp_layers(ec), state_dtype(ec))
        gib = (self.num_pages * HybridCache.bytes_per_page(cfg, ec.page_size, dtype,
                                                           _mtp_layers(ec))
               + all_slots * HybridCache.bytes_per_slot(cfg, dtype, state_dtype(ec))) / 1024**3
        log.info("cache: %d KV pages x %d tokens, %d GDN state slots (%s)%s (%.2f GiB)",
                 self.num_pages, ec.page_size, self.num_slots, ec.gdn_state_dtype_name,
                 f" + {ec.prefix_cache_entries} prefix-cache snapshots"
                 if ec.prefix_cache_entries else "", gib)
        self.fast = self._maybe_fast_path(ec)
        self.drafter = self._maybe_drafter(ec)

    def _maybe_draft_head(self, ec: EngineConfig) -> None:
        """With speculative decoding on the kernel path on a GPU: the MTP drafts through an
        FP8 copy of lm_head (model/draft_head.py, kb/0035; TAILORED_MTP_FP8_HEAD=0: not)."""
        from tailored import kernels
        from tailored.model import draft_head

        self.model.draft_head = None
        if (ec.num_speculative_tokens <= 0 or not draft_head.ENABLED
                or self.device.type != "cuda" or getattr(self.model, "mtp", None) is None
                or not kernel_path_asked(ec, self.device)
                or kernels.unavailable_reason("cuda", self.model.lm_head.weight.dtype)):
            return
        head = self.model.draft_head = draft_head.DraftHead(self.model.lm_head.weight)
        # the quantization's temporaries would stay in the allocator's cache, which plan_cache
        # counts as used: a few hundred MB fewer KV pages (seen in review, kb/0035)
        torch.cuda.empty_cache()
        log.info("MTP drafts through an FP8 copy of lm_head (%.2f GiB)", head.nbytes / 1024**3)

    def _maybe_drafter(self, ec: EngineConfig):
        """The MTP drafter of speculative decoding (EngineConfig.num_speculative_tokens > 0),
        else None. Raises ValueError for a bad setting or a model without its MTP head."""
        n, rate = ec.num_speculative_tokens, ec.spec_synthetic_acceptance
        if n < 0 or n > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in 0..{MAX_SPECULATIVE_TOKENS}, "
                             f"got {n}")
        if rate is not None and not 0 <= rate <= 1:
            raise ValueError(f"spec_synthetic_acceptance must be in [0, 1], got {rate}")
        self.spec_synthetic_acceptance = rate
        self._spec_rng = random.Random(0)
        # verify steps, drafts verified, drafts kept (the acceptance rate; server metrics)
        self.spec_stats = [0, 0, 0]
        # requests whose next drafts are still on the device (chain_drafts.py, kb/0035)
        self._draft_sources = DraftSources()
        # the first line 10 s after the start of serving, not at the first verify step (whose
        # 1-step totals read as a rate of nothing)
        self._spec_logged = time.monotonic()
        if n == 0:
            return None
        drafter = MTPDrafter(self.model, self.cache)
        if ec.spec_max_running > ec.max_num_seqs:  # a new user's finding (s16): say so
            log.warning("spec_max_running %d is above max_num_seqs %d: drafting while at most "
                        "%d run", ec.spec_max_running, ec.max_num_seqs, ec.max_num_seqs)
        log.info("speculative decoding: %d MTP draft%s a step for greedy requests while at "
                 "most %d run%s", n, "s" if n > 1 else "", spec_max_batch(ec), "" if rate is None
                 else f", synthetic acceptance {rate} (benchmarks only: not the greedy output)")
        return drafter

    def _maybe_fast_path(self, ec: EngineConfig):
        """Bind the kernel path (model/fast.py) to this cache when EngineConfig.kernels asks."""
        from tailored import kernels

        want = kernel_path_asked(ec, self.device)
        if want:
            why = kernels.unavailable_reason(self.device.type, self.model.lm_head.weight.dtype)
            if why and ec.kernels == "on":
                raise RuntimeError(f"--kernels on: {why}")
            if why:
                log.warning("kernel path unavailable (%s): running the plain PyTorch path", why)
                want = False
        if not want:
            log.info("plain PyTorch path (kernels=%s on %s)%s%s", ec.kernels, self.device.type,
                     "; --enforce-eager has no effect" if ec.enforce_eager else "",
                     "; --prefill-graphs has no effect (kernel path on CUDA only)"
                     if ec.prefill_graphs else "")
            return None
        from tailored.model.fast import FastPath

        fast = FastPath(self.model, self.cache, max_batch=ec.max_num_seqs,
                        max_pages=math.ceil(ec.max_model_len / ec.page_size) + 1,
                        use_graphs=not ec.enforce_eager)
        self.model.fast = fast
        if ec.num_speculative_tokens > 0 and fast.use_graphs and fast.mtp_layer is not None:
            from tailored.model.fast_spec import SpecGraphs

            fast.spec = SpecGraphs(fast, ec.num_speculative_tokens, spec_max_batch(ec))
        if ec.prefill_graphs and (self.device.type != "cuda" or ec.enforce_eager):
            log.info("--prefill-graphs has no effect %s", "with --enforce-eager"
                     if ec.enforce_eager else "on the CPU (CUDA graphs)")
        if self.device.type == "cuda":
            t0 = time.monotonic()
            log.info("warming up the kernels%s (Triton tunes each new shape unless a saved "
                     "table has it: minutes on a first FP8 start, kb/0020)",
                     " and capturing CUDA graphs" if fast.use_graphs else "")
            fast.warmup_prefill(fast.warmup_lengths(ec.max_num_batched_tokens),
                                batch_tokens=ec.max_num_batched_tokens)
            if fast.use_graphs:
                fast.capture()
                if fast.spec is not None:
                    fast.spec.capture()
                if ec.prefill_graphs:
                    fast.capture_prefill(min(ec.max_num_batched_tokens, ec.max_model_len))
                    from tailored.model import fast_ctx

                    # kb/0055; not after a failed prefill capture (likely out of memory)
                    if fast.prefill_graphs and fast_ctx.ctx_graphs_wanted():
                        fast.ctx = fast_ctx.ContextGraphs(fast)
                        fast.ctx.capture(min(ec.max_num_batched_tokens, ec.max_model_len))
            # TAILORED_TUNING_DUMP=PATH: save the launch configs tuned at this warm-up, for
            # the next start to skip tuning (kernels/tuning.py)
            from tailored.kernels import tuning

            tuning.dump_if_requested({"max_num_seqs": ec.max_num_seqs,
                                      "max_num_batched_tokens": ec.max_num_batched_tokens,
                                      "prefill_graphs": ec.prefill_graphs,
                                      "fp8": self.cfg.fp8 is not None})
            # from here on a Triton compile stalls a step: name each one (kb/0030)
            from tailored.kernels.compile_watch import watch_compiles

            watch_compiles()
            free, _ = torch.cuda.mem_get_info(self.device)
            log.info("kernels warmed up%s in %.1f s; %.2f GiB of GPU memory free, %.2f GiB "
                     "reserved by this process", " and CUDA graphs captured" if fast.use_graphs
                     else "", time.monotonic() - t0, free / 1024**3,
                     torch.cuda.memory_reserved(self.device) / 1024**3)
        log.info("kernel path on (CUDA graphs %s, prefill graphs %s, context-chunk graphs %s, "
                 "GDN prefill %s)", "on" if fast.use_graphs else "off",
                 f"{len(fast.prefill_graphs)} buckets" if fast.prefill_graphs else "off",
                 f"{len(fast.ctx.graphs)} buckets" if fast.ctx and fast.ctx.graphs else "off",
                 "fla-core" if fast.fla else "reference")
        return fast

    timer = None  # engine.step_timing.StepTimer, set by the Engine: build/launch/wait phases

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        """Run one step and return its sampled tokens (`launch` then `collect`)."""
        return self.collect(self.launch(sched))

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, feed: "LaunchedStep | None" = None) -> "LaunchedStep":
        """Enqueue one step (forward, logits, sampling) without waiting for its tokens.

        feed: the previous step, still running: every decode row of `sched` whose token is
        `PENDING_TOKEN` takes that request's id sampled by `feed`, device to device (async
        scheduling, kb/0015; no host sync). Raises RuntimeError for a pending token that
        `feed` did not sample."""
        t = time.perf_counter()
        rows, sampled_seqs, layout, fed = [], [], [], []
        fed_drafts, drafts_in = [], {}  # drafts a chain left on the device (chain_drafts.py)
        q = 0
        prev_rows = {} if feed is None else {s.request_id: i
                                             for i, s in enumerate(feed.sampled_seqs)}
        # in a step that verifies drafts, each remaining decode row (a request without drafts
        # this step) is a verify chunk of one token too: the verify CUDA graph then takes the
        # whole step, not only steps where every request drafts (`_speculate` commits it at 1)
        verify_step = any(s.num_draft for s in sched.seqs)
        for s in sched.seqs:
            toks = list(s.token_ids)
            if pending_drafts(toks, s.num_draft):  # the previous verify step's chain drafted
                rec, b = self._draft_sources.get(s.slot, s.request_id)
                fed_drafts.append((q + len(toks) - s.num_draft, rec, b, s.num_draft))
                drafts_in[s.request_id] = (rec, b)
                toks[-s.num_draft:] = [0] * s.num_draft  # overwritten on the device below
            if PENDING_TOKEN in toks:  # only ever a lone decode token (with no drafts)
                if len(toks) != 1 or s.request_id not in prev_rows:
                    raise RuntimeError(f"pending token of {s.request_id!r} without a step to "
                                       "feed it")
                fed.append((q, prev_rows[s.request_id]))
                toks = [0]  # overwritten on the device below
            layout.append((toks, s.start_pos, s.slot, s.reset_state, s.page_ids,
                           s.num_draft > 0 or (verify_step and _lone_decode(s))))
            q += len(toks)
            if s.sample:
                # a verify chunk samples every row: the target's token after each draft
                for r in range(q - 1 - s.num_draft, q):
                    rows.append(r)
                    sampled_seqs.append(s)
        batch = ForwardBatch.build(layout, rows, self.device)
        if fed:
            dst, src = zip(*fed)
            ids = feed.sampled.ids
            if list(dst) == list(range(q)) and list(src) == list(range(len(src))):
                batch.input_ids = ids[:q]  # the common case: the same rows in the same order
            else:
                dst_t = index_on(dst, self.device)
                batch.input_ids.index_copy_(0, dst_t, ids.index_select(0, index_on(src, self.device)))
        feed_drafts(batch.input_ids, fed_drafts)
        timer = self.timer
        events = None
        if timer is not None:
            timer.runner_ms = {}  # a failed previous step must not leak its phases into this one
            t = timer.runner_phase("build", t)
            if self.device.type == "cuda":  # GPU span forward → logits, read after the sampler's sync
                events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                events[0].record(torch.cuda.current_stream(self.device))
        # states a failed step kept and never committed must not pin snapshots or be read
        # (a verify step is never launched ahead: the previous step's commits are done)
        self.cache.kept_states.clear()
        self.cache.kept_batch = None
        if sched.state_copies or sched.page_copies:  # requests admitted on a cached prefix
            self.cache.copy_states(sched.state_copies)
            self.cache.copy_pages(sched.page_copies)
        hidden = self.model(batch, self.cache)
        if sched.snapshots:  # the states after the prompts this step completes
            self.cache.copy_states([(s.slot, s.snap) for s in sched.snapshots])
        if rows:
            # all rows sampled (decode steps): no index tensor to send
            h = hidden if rows == list(range(hidden.shape[0])) else hidden[index_on(rows, self.device)]
            logits = self.model.compute_logits(h)
            if events is not None:
                events[1].record(torch.cuda.current_stream(self.device))
            sampled = sample_on_device(logits, sampled_seqs)
        else:
            sampled = None
        # a whole verify step from the graph: acceptance, commits and the MTP follow on the
        # device, with no sync between them (kb/0034)
        chain, syn = (self._chain(sched, batch, sampled, len(rows)) if verify_step and rows
                      else (None, None))
        if timer is not None:
            timer.runner_phase("launch", t)
        # the MTP reads this step's hidden states after its tokens are known (collect)
        spec = (batch, hidden) if chain is None and any(s.mtp for s in sched.seqs) else None
        return LaunchedStep(sched, sampled_seqs, sampled, events, spec, chain, syn, drafts_in)

    @torch.inference_mode()
    def resample(self, step: "LaunchedStep", fixes: list[tuple[int, ScheduledSeq]]) -> None:
        """Sample rows of a launched step again from its logits, in place (before `collect`
        and before a step fed from it is launched): fixes = [(row, seq)], seq carrying what
        the row's first sampling could not know yet — a structured request's grammar mask
        (`ScheduledSeq.allowed`) when its step was launched ahead of the previous step's
        tokens (the engine's deferred masks). The same sampler as `launch`, so a row comes out
        as it would have with the mask at launch (its seeded draw depends on the seq's
        num_generated only). Raises ValueError for a step with nothing sampled or a row that
        asked for logprobs (`Sampled.patch`)."""
        if not fixes:
            return
        if step.sampled is None:
            raise ValueError("resample: the step sampled nothing")
        rows = [r for r, _ in fixes]
        index = index_on(rows, self.device)
        again = sample_on_device(step.sampled.raw_rows(index), [seq for _, seq in fixes])
        step.sampled.patch(rows, index, again)

    def _chain(self, sched: SchedulerOutput, batch: ForwardBatch, sampled, n_rows: int):
        """`SpecGraphs.chain` after a whole verify step: (its result as a ChainDrafts, the
        synthetic kept counts drawn for it or None); (None, None) when the step was not one
        verify replay (split beside prompts, eager, no graphs)."""
        fast = getattr(self.model, "fast", None)
        spec = getattr(fast, "spec", None)
        if spec is None or not spec.whole_step(batch, n_rows):
            return None, None
        rate = self.spec_synthetic_acceptance
        syn = None
        if rate is not None:  # the draws that `_speculate` makes after the step, made first
            syn = [accept([0] * s.num_draft, [0] * (s.num_draft + 1), rate, self._spec_rng)
                   for s in sched.seqs]
        out = spec.chain(sampled.ids, syn, sampled.bad)
        # the drafts copied out of the graph's output before the next chain replay rewrites it
        return ChainDrafts(out[:, 1:].clone(), HostCopy(out), kept=[]), syn

    def collect(self, step: "LaunchedStep") -> ModelOutput:
        """Wait for a launched step's tokens; returns them (bad_rows: the sampler's NaN
        fallbacks, which differ from the ids a fed next step used)."""
        if step.sampled is None:
            # prompt chunks only: with speculative decoding the MTP still fills its KV there
            return self._speculate(step, [], frozenset()) if step.spec is not None \
                else ModelOutput(token_ids={})
        t0 = time.perf_counter()
        tokens = step.sampled.tolist()
        timer = self.timer
        if timer is not None:
            # the time blocked on the device for this step's ids (with a step launched ahead,
            # its build and launch are that step's phases, not part of this wait)
            timer.runner_ms["wait"] = (time.perf_counter() - t0) * 1e3
            if step.events is not None:
                step.events[1].synchronize()  # done already (the sampler waited): no stall
                timer.runner_ms["gpu"] = step.events[0].elapsed_time(step.events[1])
        bad = frozenset(step.sampled_seqs[i].request_id for i in step.sampled.bad_rows)
        # requests that asked for logprobs never draft: one sampled row each, their token's
        rows = step.sampled.logprobs()
        logprobs = {} if rows is None else {
            s.request_id: lp for s, lp in zip(step.sampled_seqs, rows) if lp is not None}
        if step.chain is not None or step.spec is not None:
            t0 = time.perf_counter()
            # after a whole verify step the device has accepted and drafted (`_chain`)
            out = (self._chained(step, tokens, bad) if step.chain is not None
                   else self._speculate(step, tokens, bad))
            if timer is not None:
                timer.runner_phase("draft", t0)
            return dataclasses.replace(out, logprobs=logprobs) if logprobs else out
        return ModelOutput(token_ids={s.request_id: t for s, t in zip(step.sampled_seqs, tokens)},
                           bad=bad, logprobs=logprobs)

    def _count_verify(self, num_draft: int, kept: int) -> None:
        """Add one verify chunk to spec_stats; log the totals every SPEC_LOG_EVERY_S."""
        st = self.spec_stats
        st[0] += 1
        st[1] += num_draft
        st[2] += kept
        now = time.monotonic()
        if now - self._spec_logged >= SPEC_LOG_EVERY_S:
            self._spec_logged = now
            log.info("speculative decoding since start: %d verify steps, %.3f of %d "
                     "drafts kept, %.2f tokens a verify step", st[0],
                     st[2] / max(st[1], 1), st[1], 1 + st[2] / st[0])

    def _drafts_of(self, step: "LaunchedStep", s) -> list[int]:
        """The draft ids a verify chunk of `step` ran on: its own, or where they were pending
        the chain's that drafted them (done by now: it ran before this step)."""
        src = step.drafts_in.get(s.request_id)
        if src is None:
            return list(s.token_ids[-s.num_draft:])
        rec, b = src
        return rec.read()[b][:s.num_draft]

    def _chained(self, step: "LaunchedStep", tokens: list[int], bad) -> ModelOutput:
        """The output of a whole verify step whose acceptance, commits and drafts run on the
        device (`_chain`), without waiting for them: the host knows the kept counts (the
        synthetic draws, or the greedy rule over `tokens`, a NaN row ending the prefix as on
        the device); the next drafts stay on the device as PENDING_TOKEN placeholders that
        the next step takes from there (chain_drafts.py, kb/0035). Emitted tokens are the
        kept drafts (the inputs the state took) and the target's next one: with the greedy
        rule the target's tokens themselves, except at a NaN row that the sampler patched
        (`mtp.emitted`)."""
        out_ids, extra, drafts = {}, {}, {}
        row_of, bad_of = {}, {}
        bad_rows = set(step.sampled.bad_rows)
        for i, (s, t) in enumerate(zip(step.sampled_seqs, tokens)):
            row_of.setdefault(s.request_id, []).append(t)
            bad_of.setdefault(s.request_id, []).append(i in bad_rows)
        kept_all, proposing = [], []
        for b, s in enumerate(step.sched.seqs):
            target = row_of[s.request_id]
            kept = 0
            if s.num_draft:
                d = self._drafts_of(step, s)
                kept = (min(step.syn[b], s.num_draft) if step.syn is not None
                        else accept(d, target, bad=bad_of[s.request_id]))
                em = emitted(d, target, kept, True)
                self._count_verify(s.num_draft, kept)
            else:
                em = target
            kept_all.append(kept)
            out_ids[s.request_id], extra[s.request_id] = em[0], tuple(em[1:])
            if s.mtp and s.num_propose > 0 and s.request_id not in bad:
                proposing.append((b, s))
        step.chain.kept = kept_all  # what ChainDrafts.read checks the device's counts against
        rows = None if DRAFTS_ON_DEVICE else step.chain.read()  # the A/B: wait for the chain
        for b, s in proposing:
            if rows is None:
                drafts[s.request_id] = (PENDING_TOKEN,) * s.num_propose
                self._draft_sources.put(s.slot, s.request_id, step.chain, b)
            else:
                drafts[s.request_id] = tuple(rows[b][:s.num_propose])
        return ModelOutput(token_ids=out_ids, bad=bad, extra_ids=extra, draft_ids=drafts)

    def _speculate(self, step: "LaunchedStep", tokens: list[int], bad) -> ModelOutput:
        """Verify the drafts of a step's verify chunks, set their GDN state to the one after
        the last kept token, and run the MTP over every drafting chunk for the next drafts
        (model/mtp.py)."""
        batch, hidden = step.spec
        synthetic = self.spec_synthetic_acceptance
        out_ids, extra, rows, owners = {}, {}, [], []
        commits = {}  # slot -> tokens of its verify chunk kept (HybridCache.commit_many)
        row_of = {}  # request id -> its sampled tokens, in row order
        for s, t in zip(step.sampled_seqs, tokens):
            row_of.setdefault(s.request_id, []).append(t)
        for s, info in zip(step.sched.seqs, batch.seqs):
            if not s.sample:
                if s.mtp:  # a prompt chunk: the MTP fills its cache, the next token is known
                    rows.append(DraftRow(info, list(s.token_ids[1:]) + [s.next_token], 0))
                    owners.append(None)
                continue
            target = row_of[s.request_id]
            if s.num_draft:
                drafts = self._drafts_of(step, s)
                kept = accept(drafts, target, synthetic, self._spec_rng)
                em = emitted(drafts, target, kept, synthetic is not None)
                commits[s.slot] = kept + 1
                self._count_verify(s.num_draft, kept)
            else:
                if info.keep_states:  # a lone decode row of a verify step (launch)
                    commits[s.slot] = 1
                em = target
            out_ids[s.request_id], extra[s.request_id] = em[0], tuple(em[1:])
            # num_propose 0 at a sampling chunk: the request ends within 2 tokens and never
            # drafts again, so its MTP KV is not needed
            if s.mtp and s.num_propose > 0 and s.request_id not in bad:
                # rows up to the last emitted position, each fed the token after it
                n = info.num_tokens - s.num_draft + len(em) - 1
                seq = SeqInfo(info.q_start, n, info.start_pos, info.slot, False, info.page_ids)
                nxt = list(s.token_ids[1:n]) + [em[-1]] if not s.num_draft else em
                rows.append(DraftRow(seq, nxt, s.num_propose))
                owners.append(s.request_id)
        self.cache.commit_many(commits)
        drafts = {}
        for rid, d in zip(owners, self.drafter.propose(hidden, rows)):
            if rid is not None and d:
                drafts[rid] = tuple(d)
        return ModelOutput(token_ids=out_ids, bad=bad, extra_ids=extra, draft_ids=drafts)


@dataclass
class LaunchedStep:
    """A step whose forward and sampling are enqueued (ModelRunner.launch); `collect` reads it."""

    sched: SchedulerOutput
    sampled_seqs: list  # the ScheduledSeqs with sample=True, in row order
    sampled: Sampled | None  # None: nothing sampled (prefill chunks only)
    events: tuple | None  # CUDA events around forward + logits (step timing)
    spec: tuple | None = None  # (ForwardBatch, hidden) of a step with MTP chunks
    # a whole verify step's chain result [B, 1 + N] (`_chain`) and its synthetic kept counts
    chain: ChainDrafts | None = None
    syn: list[int] | None = None
    # request id -> (chain, row) of the verify chunks whose drafts that chain left on the device
    drafts_in: dict = field(default_factory=dict)

