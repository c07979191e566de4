"""ModelRunner: the worker's face to the engine — one step in, its sampled tokens out.

The runner owns the device side: the weights, the hybrid cache (worker/cache.py, sized by
worker/memory_plan.py), the forward (the kernel path with its CUDA graphs on CUDA,
worker/kernel_forward.py; the plain PyTorch path elsewhere), the sampler and speculative
decoding. It makes no policy decisions: the scheduler chose tokens, pages and slots; the
runner lays them out, runs the forward, and samples one token per sequence that asked for one.

The engine sees it through `engine/worker.py`'s protocol: `launch` enqueues a step (feeding
pending tokens from the previous step's device ids), `collect` waits for its ids on an event,
`resample` samples rows of a launched step again (deferred grammar masks), `execute` = both.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field

import torch

from tailored.config import EngineConfig, ModelConfig
from tailored.engine.types import PENDING_TOKEN, ModelOutput, ScheduledSeq, SchedulerOutput
from tailored.model.batch import ForwardBatch, index_on
from tailored.worker.cache import HybridCache
from tailored.worker.chain_drafts import ChainDrafts, feed_drafts, pending_drafts
from tailored.worker.kernel_path import make_draft_head, start_kernel_path
from tailored.worker.memory_plan import kernel_path_reserve, mtp_layers, plan_cache, state_dtype
from tailored.worker.prompt_logprobs import PromptLogprobs
from tailored.worker.sampler import Sampled, sample_on_device
from tailored.worker.spec_decoding import SpecDecoding, lone_decode

log = logging.getLogger("tailored.worker")


class ModelRunner:
    """Runs scheduled steps on one device. Attributes num_pages/num_slots size the engine's
    pools; `kernel` is the kernel path (`KernelForward`) or None."""

    def __init__(self, model, cfg: ModelConfig, ec: EngineConfig, device, dtype: torch.dtype):
        self.model = model
        self.cfg = cfg
        self.device = torch.device(device)
        self.page_size = ec.page_size
        # before the cache: its memory is then counted as used
        draft_head = make_draft_head(model, ec, self.device)
        self.num_pages, self.num_slots = plan_cache(cfg, ec, dtype, self.device,
                                                    kernel_path_reserve(model, ec, self.device))
        # the prefix cache's snapshot slots after the requests' (engine/prefix_cache.py)
        all_slots = self.num_slots + ec.prefix_cache_entries
        self.cache = HybridCache(cfg, self.num_pages, ec.page_size, all_slots, dtype,
                                 self.device, mtp_layers(ec), state_dtype(ec))
        gib = (self.num_pages * HybridCache.bytes_per_page(cfg, ec.page_size, dtype,
                                                           mtp_layers(ec))
               + all_slots * HybridCache.bytes_per_slot(cfg, dtype, state_dtype(ec))) / 1024**3
        log.info("cache: %d KV pages x %d tokens, %d GDN state slots (%s)%s (%.2f GiB)",
                 self.num_pages, ec.page_size, self.num_slots, ec.gdn_state_dtype_name,
                 f" + {ec.prefix_cache_entries} prefix-cache snapshots"
                 if ec.prefix_cache_entries else "", gib)
        self.kernel = start_kernel_path(model, self.cache, cfg, ec, self.device, draft_head)
        self.spec = SpecDecoding(model, self.cache, ec, self.kernel, draft_head)

    def release(self) -> None:
        """Drop the cache, the kernel path (its graphs, stacked experts and scratch) and the
        speculative decoding: their device memory is freed once collected, and this runner
        cannot run another step. The FP8 gate's reference needs that memory on an 80 GB card."""
        self.cache = self.kernel = self.spec = None

    @property
    def spec_stats(self) -> list[int]:
        """[verify steps, drafts verified, drafts kept] since start (server metrics)."""
        return self.spec.stats

    @torch.no_grad()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Final-normed hidden states [T, H] of a batch over the runner's cache: the kernel
        path where it runs, else the plain path (the model's own forward)."""
        if self.kernel is not None:
            return self.kernel.forward(batch)
        return self.model(batch, self.cache)

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
        rows, sampled_seqs, layout, fed, lp_rows = [], [], [], [], []
        fed_drafts, drafts_in = [], {}  # drafts a chain left on the device (chain_drafts.py)
        q = 0
        prev_rows = {} if feed is None else {s.request_id: i
                                             for i, s in enumerate(feed.sampled_seqs)}
        # in a step that verifies drafts, each remaining decode row (a request without drafts
        # this step) is a verify chunk of one token too: the verify CUDA graph then takes the
        # whole step, not only steps where every request drafts (`speculate` commits it at 1)
        verify_step = any(s.num_draft for s in sched.seqs)
        for s in sched.seqs:
            toks = list(s.token_ids)
            if pending_drafts(toks, s.num_draft):  # the previous verify step's chain drafted
                rec, b = self.spec.sources.get(s.slot, s.request_id)
                fed_drafts.append((q + len(toks) - s.num_draft, rec, b, s.num_draft))
                drafts_in[s.request_id] = (rec, b)
                toks[-s.num_draft:] = [0] * s.num_draft  # overwritten on the device below
            if PENDING_TOKEN in toks:  # only ever a lone decode token (with no drafts)
                if len(toks) != 1 or s.request_id not in prev_rows:
                    raise RuntimeError(f"pending token of {s.request_id!r} without a step to "
                                       "feed it")
                fed.append((q, prev_rows[s.request_id]))
                toks = [0]  # overwritten on the device below
            if s.logprob_targets:
                lp_rows.append((s, q))
            layout.append((toks, s.start_pos, s.slot, s.reset_state, s.page_ids,
                           s.num_draft > 0 or (verify_step and lone_decode(s))))
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
        hidden = self.forward(batch)
        # prompt logprobs (lm-eval, echo): the LM head over the rows that ask, enqueued now
        prompt_lps = PromptLogprobs(self.model, hidden, lp_rows) if lp_rows else None
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
        chain, syn = (self.spec.chain(sched, batch, sampled, len(rows)) if verify_step and rows
                      else (None, None))
        if timer is not None:
            timer.runner_phase("launch", t)
        # the MTP reads this step's hidden states after its tokens are known (collect); a
        # verify step's drafts are accepted there (prompt lookup's too, with no MTP)
        spec = ((batch, hidden) if chain is None and (verify_step and rows
                                                      or any(s.mtp for s in sched.seqs))
                else None)
        return LaunchedStep(sched, sampled_seqs, sampled, events, spec, chain, syn, drafts_in,
                            prompt_lps)

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

    def collect(self, step: "LaunchedStep") -> ModelOutput:
        """Wait for a launched step's tokens; returns them (bad_rows: the sampler's NaN
        fallbacks, which differ from the ids a fed next step used) and the step's prompt
        logprobs."""
        out = self._collect_tokens(step)
        if step.prompt_lps is not None:
            out = dataclasses.replace(out, prompt_logprobs=step.prompt_lps.read())
        return out

    def _collect_tokens(self, step: "LaunchedStep") -> ModelOutput:
        if step.sampled is None:
            # prompt chunks only: with speculative decoding the MTP still fills its KV there
            return self.spec.speculate(step, [], frozenset()) if step.spec is not None \
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
            # after a whole verify step the device has accepted and drafted (`spec.chain`)
            out = (self.spec.chained(step, tokens, bad) if step.chain is not None
                   else self.spec.speculate(step, tokens, bad))
            if timer is not None:
                timer.runner_phase("draft", t0)
            return dataclasses.replace(out, logprobs=logprobs) if logprobs else out
        return ModelOutput(token_ids={s.request_id: t for s, t in zip(step.sampled_seqs, tokens)},
                           bad=bad, logprobs=logprobs)


@dataclass
class LaunchedStep:
    """A step whose forward and sampling are enqueued (ModelRunner.launch); `collect` reads it."""

    sched: SchedulerOutput
    sampled_seqs: list  # the ScheduledSeqs with sample=True, in row order
    sampled: Sampled | None  # None: nothing sampled (prefill chunks only)
    events: tuple | None  # CUDA events around forward + logits (step timing)
    spec: tuple | None = None  # (ForwardBatch, hidden) of a step with MTP chunks
    # a whole verify step's chain result [B, 1 + N] (`spec.chain`) and its synthetic kept counts
    chain: ChainDrafts | None = None
    syn: list[int] | None = None
    # request id -> (chain, row) of the verify chunks whose drafts that chain left on the device
    drafts_in: dict = field(default_factory=dict)
    prompt_lps: PromptLogprobs | None = None  # the step's prompt logprobs, on the device

