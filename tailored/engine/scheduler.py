"""Token-budget scheduler: continuous batching, chunked prefill, admission, preemption, stops.

    python -m pytest -q tests/engine/test_scheduler.py

One rule drives every case: a request has `num_tokens` known tokens (prompt + output) of which
`num_computed_tokens` are in the cache; each step computes the next chunk
[num_computed_tokens, num_computed_tokens + n) and samples a token iff the chunk ends at
`num_tokens`. A plain decode is the 1-token case (the last sampled token is not yet cached);
a prompt prefill and a recompute after preemption (prompt + outputs) are the long case. So a
recompute never samples before it has caught up with every known token, and then samples
exactly the token that was next anyway.

Ordering inside a step (`SchedulerOutput.seqs`): decode rows first (1 token, state already in
the slot), then prefill chunks of running requests, then newly admitted requests. While
requests decode, the prompt tokens a step carries follow a time budget from the measured step
cost (engine/step_budget.py, docs/scheduling.md), within max_num_batched_tokens.

Priority is arrival order (`Request.seq_no`): the running list is kept sorted by it; when pages
run short the *newest* running request not yet scheduled in this step is preempted (it may be
the one asking). Preempted requests keep their output ids, lose their pages and slot, and go
back into the waiting queue in arrival order (ahead of every newer request).

    request state         pages / slot        num_computed_tokens
    WAITING (new)         none / 0            0
    RUNNING               ceil(cached/page)   0 < n <= num_tokens - 1 after each step
    WAITING (preempted)   none / 0            0 (output_ids kept -> recomputed)
    FINISHED              none / 0            (no longer in the scheduler)
"""

from __future__ import annotations

import bisect
from collections import deque

from tailored import flags
from tailored.config import EngineConfig
from tailored.engine.drafting import Drafting
from tailored.engine.memory import PagePool, SlotPool
from tailored.engine.prefix_cache import PrefixCache
from tailored.engine.step_budget import StepBudget
from tailored.engine.types import (
    PENDING_TOKEN,
    FinishReason,
    ModelOutput,
    Request,
    RequestStatus,
    ScheduledSeq,
    SchedulerOutput,
)




def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _seq_no(req: Request) -> int:
    return req.seq_no


def _stop_id_set(req: Request) -> frozenset[int]:
    ids = frozenset(req.sampling.stop_token_ids)
    return ids if req.sampling.ignore_eos else ids | frozenset(req.eos_token_ids)


def _remove(queue: list[Request] | deque[Request], req: Request) -> None:
    # by identity: dataclass == would compare every field, token lists included
    del queue[next(i for i, r in enumerate(queue) if r is req)]


class Scheduler:
    """Decides what each engine step runs and owns the page/slot pools.

    num_pages / num_slots: pool sizes including the reserved index 0 (the runner's tensor sizes).
    At most min(max_num_seqs, num_slots - 1) requests run at once. With prefix caching
    (EngineConfig.prefix_cache_entries) the cache's slots num_slots .. num_slots + entries - 1
    hold the entries' snapshots (engine/prefix_cache.py).
    """

    def __init__(self, engine_config: EngineConfig, num_pages: int, num_slots: int) -> None:
        self.config = engine_config
        self.page_size = engine_config.page_size
        self.pages = PagePool(num_pages)
        self.slots = SlotPool(num_slots)
        self.max_running = min(engine_config.max_num_seqs, self.slots.capacity)
        self.waiting: deque[Request] = deque()  # arrival order
        self.running: list[Request] = []  # sorted by seq_no (arrival order)
        self.requests: dict[str, Request] = {}  # every unfinished request, waiting or running
        # per unfinished request: the ids that end it with STOP (stop_token_ids, plus the EOS ids
        # unless ignore_eos), as a frozenset so the per-token check is O(1) however many ids
        self.stop_ids: dict[str, frozenset[int]] = {}
        self.num_preemptions = 0  # lifetime counter
        # requests whose step launched ahead once ran on a token that was not theirs (the
        # sampler's NaN fallback): they are never launched ahead again, so a request whose
        # logits keep NaN falls back each step as in the synchronous engine instead of being
        # recomputed every other token
        self.no_ahead: set[str] = set()
        # structured requests may be launched ahead: the engine samples their rows again once
        # the previous step's token set the grammar's mask (runner.resample); the Engine sets
        # it where its runner can. Off: a structured request keeps its batch synchronous
        self.structured_ahead = False
        # speculative decoding: who drafts, and which drafts (engine/drafting.py)
        self.drafts = Drafting(engine_config, self.pages)
        n_snap = engine_config.prefix_cache_entries
        self.prefix = (PrefixCache(self.page_size, range(num_slots, num_slots + n_snap),
                                   self.pages) if n_snap > 0 else None)
        # how many prompt tokens a step may carry while requests decode, from the measured
        # step cost (engine/step_budget.py; the engine reports each step's time)
        # with mixed-step graphs (worker/mixed_graphs.py) a cut chunk ends on their 128-token
        # bucket grid: their pads cost what tokens do (kb/0068)
        sw = flags.current()
        self.budget = StepBudget(engine_config.prefill_stall_factor, sw.min_prefill_chunk,
                                 granule=128 if sw.mixed_graph_tokens else 1)

    # ---- requests in / out -------------------------------------------------------------------
    def max_pages_needed(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """Pages a request holds at its longest (the last sampled token is never cached)."""
        return _cdiv(num_prompt_tokens + max(max_tokens, 1) - 1, self.page_size)

    def add(self, req: Request) -> None:
        """Queue a new request.

        Raises ValueError if it could never fit in the page pool even running alone (it would
        be preempted forever); other validation is the engine's job.
        """
        assert req.request_id not in self.requests, f"duplicate request id {req.request_id!r}"
        assert req.status is RequestStatus.WAITING and not req.pages and req.slot == 0
        self.check_fits(req)
        self.requests[req.request_id] = req
        self.stop_ids[req.request_id] = _stop_id_set(req)
        self.waiting.append(req)

    def check_fits(self, req: Request) -> None:
        """Raise ValueError if `req` could never fit in the page pool, even running alone."""
        need = self.max_pages_needed(len(req.prompt_ids), req.sampling.max_tokens)
        if need > self.pages.capacity:
            raise ValueError(
                f"request {req.request_id!r} needs up to {need} KV pages of {self.page_size} tokens"
                f" but the pool has {self.pages.capacity}; lower max_tokens or the prompt length"
            )

    def abort(self, request_id: str) -> Request | None:
        """Remove a request now and free its pages and slot; None if it is not (or no more) here."""
        return self.finish(request_id, FinishReason.ABORT)

    def finish(self, request_id: str, reason: FinishReason) -> Request | None:
        """Finish a request for `reason` (stop string, abort, error) and free its resources now."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.stop_ids.pop(request_id, None)
        self.no_ahead.discard(request_id)
        self.drafts.forget(request_id)
        if self.prefix is not None:
            self.prefix.forget(request_id)
        if req.status is RequestStatus.RUNNING:
            _remove(self.running, req)
            self._release(req)
        else:
            _remove(self.waiting, req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        return req

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's work within max_num_batched_tokens. Never raises for lack of memory."""
        budget = self.config.max_num_batched_tokens
        scheduled: set[str] = set()
        decodes: list[ScheduledSeq] = []
        prefills: list[ScheduledSeq] = []
        blocked = False  # a running request could not grow this step: admit nobody new
        preemptions_before = self.num_preemptions

        # 1) decodes, oldest first: they hold a slot and are 1 token each (plus the drafts of
        # speculative decoding, as far as budget, limits and free pages allow)
        for req in [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            drafts = self.drafts.for_decode(req, budget, len(self.running))
            # with drafts the pages are free already (Drafting.for_decode): no preemption
            if not self._grow(req, 1 + len(drafts), scheduled):
                blocked = True
                continue
            decodes.append(self._scheduled(req, 1, drafts))
            scheduled.add(req.request_id)
            budget -= 1 + len(drafts)

        # while requests decode, the prompt tokens that fit the step's time budget (a plan
        # without a limit otherwise), spent oldest first: running prompts, then admissions;
        # the load (decoding + waiting requests) says whether chunks can meet it at all
        partial = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        plan = (self.budget.plan(sum(len(s.token_ids) for s in decodes),
                                 min(len(partial) + len(self.waiting),
                                     self.max_running - len(decodes)))
                if partial or self.waiting else None)  # (no prompt work: no plan)

        # 2) prefill chunks of running requests (partial prompt or recompute), oldest first
        for req in partial:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue
            n = plan.take(req.num_computed_tokens,
                          min(req.num_tokens - req.num_computed_tokens, budget))
            if n == 0:
                break
            n = self._to_save_point(req, n)
            if not self._grow(req, n, scheduled):
                blocked = True
                continue
            prefills.append(self._scheduled(req, n))
            scheduled.add(req.request_id)
            budget -= n

        # 3) admit waiting requests in FIFO order; the head blocks the rest (no starvation).
        # NOTE: not after a preemption or a blocked request in this step: pages are short, and a
        # newcomer would take what older requests need next step.
        admit = not blocked and self.num_preemptions == preemptions_before
        state_copies, page_copies = [], []
        ps = self.page_size
        while admit and self.waiting and budget > 0 and len(self.running) < self.max_running:
            req = self.waiting[0]
            # a cached prefix of its ids (a new prompt, or a preempted request's recompute);
            # prompt logprobs need every prompt position computed: no hit for those requests
            hit = (self.prefix.lookup(req.request_id, req.all_ids)
                   if self.prefix and req.sampling.prompt_logprobs is None else None)
            done = hit.length if hit else 0
            req.num_computed_tokens = done  # (0 without a hit: a new or preempted request)
            n = plan.take(done, min(req.num_tokens - done, budget))
            if n == 0:
                req.num_computed_tokens = 0
                break
            n = self._to_save_point(req, n)
            shared = list(hit.pages[:done // ps]) if hit else []  # full pages: read only
            need = _cdiv(done + n, ps) - len(shared)
            if self.slots.num_free == 0:
                req.num_computed_tokens = 0
                break
            # the shared pages held first: evicting the hit's own entry for room is then safe
            # (its snapshot slot and partial page are read by this step's copies before the
            # forward, before anything this step writes reuses them); keeping it could leave
            # a request that fits alone waiting forever (kb/0053)
            self.pages.share(shared)
            if not self._free_pages(need):
                self.pages.free(shared)
                req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            req.slot = self.slots.allocate()
            req.pages = shared + self.pages.allocate(need)
            if hit:
                state_copies.append((hit.snap, req.slot))
                if done % ps:  # the entry's partial last page: the request writes its own
                    page_copies.append((hit.pages[-1], req.pages[len(shared)]))
            if self.prefix is not None:
                self.prefix.queries += req.num_tokens
                self.prefix.hits += done
                if not req.output_ids:  # (a recompute's hit is not the prompt's)
                    req.num_cached_tokens = done
            req.status = RequestStatus.RUNNING
            bisect.insort(self.running, req, key=_seq_no)
            prefills.append(self._scheduled(req, n))
            scheduled.add(req.request_id)
            budget -= n

        seqs = tuple(decodes + prefills)
        if self.drafts.mtp:
            seqs = tuple(self.drafts.chain_pages(list(seqs), self.requests))
        return SchedulerOutput(seqs=seqs, num_tokens=sum(len(s.token_ids) for s in seqs),
                               state_copies=tuple(state_copies), page_copies=tuple(page_copies),
                               snapshots=self._snapshots(prefills))

    def _free_pages(self, need: int) -> bool:
        """Whether `need` pages are free, after evicting prefix-cache entries (least recently
        used first, of those that give a page back) as far as that helps."""
        while need > self.pages.num_free:
            if self.prefix is None or not self.prefix.evict_one(for_pages=True):
                return False
        return True

    def _to_save_point(self, req: Request, n: int) -> int:
        """A prefill chunk of n tokens of `req`, cut to end at its prompt's prefix-cache save
        point when it would cross it (the state there is the one to keep)."""
        if self.prefix is None:
            return n
        start = req.num_computed_tokens
        cut = next((p for p in self.prefix.save_points(req.request_id, req.prompt_ids)
                    if start < p < start + n), None)
        return n if cut is None else cut - start

    def _snapshots(self, prefills: list[ScheduledSeq]) -> tuple:
        """Prefix-cache snapshots of the prompts whose save points a chunk of this step ends at
        (a save point is never past the prompt, so a recompute's state there is the prompt's
        alone)."""
        if self.prefix is None:
            return ()
        out = []
        for seq in prefills:
            req = self.requests[seq.request_id]
            end = seq.start_pos + len(seq.token_ids)
            if end in self.prefix.save_points(req.request_id, req.prompt_ids):
                snap = self.prefix.reserve(req.request_id, req.prompt_ids[:end], req.slot,
                                           req.pages)
                if snap is not None:
                    out.append(snap)
        return tuple(out)

    def discard(self, sched_out: SchedulerOutput) -> None:
        """A step that failed (the engine fails its requests): its snapshots never ran."""
        if self.prefix is not None:
            for snap in sched_out.snapshots:
                self.prefix.discard(snap)

    def update(self, sched_out: SchedulerOutput, model_out: ModelOutput) -> list[Request]:
        """Advance the scheduled requests by the step's results; return the ones that finished.

        Stop checks on each sampled token, first match wins: EOS id (unless ignore_eos) or a
        stop_token_id -> STOP; then max_tokens -> LENGTH; then prompt + output reaching
        max_model_len -> LENGTH. Finished requests leave the scheduler and free pages + slot.
        Raises KeyError if a sampling sequence has no token in `model_out`.
        Same as `advance` then `resolve`.
        """
        self.advance(sched_out)
        applied = self.resolve(sched_out, model_out)
        return [r for r in applied if r.status is RequestStatus.FINISHED]

    # ---- async scheduling (kb/0015): a step's tokens are learned after the next is launched --
    def advance(self, sched_out: SchedulerOutput) -> None:
        """Count the step's tokens as cached and give each sampling request a PENDING_TOKEN
        output, before the step's results are known: the next step can then be scheduled (a
        decode of that pending token) while this one runs on the device."""
        for seq in sched_out.seqs:
            req = self.requests.get(seq.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # finished (abort/stop string) or preempted since it was scheduled
            assert req.num_computed_tokens == seq.start_pos, "step results applied out of order"
            req.num_computed_tokens += len(seq.token_ids)
            if seq.sample:
                req.output_ids.append(PENDING_TOKEN)

    def resolve(self, sched_out: SchedulerOutput, model_out: ModelOutput,
                recompute: frozenset[str] = frozenset()) -> list[Request]:
        """Put the step's sampled tokens in place of its PENDING_TOKENs and run the stop checks
        (see `update`); return the requests that got their token (in step order; the finished
        ones among them have status FINISHED). Rows of requests finished, aborted or preempted
        since the step was scheduled are void. `recompute`: requests whose next, already
        launched step was fed a token other than the one that stands now (the sampler's NaN
        fallback): they are preempted, so their state is computed again from their ids."""
        if self.prefix is not None:  # the step ran: its snapshots were copied
            for snap in sched_out.snapshots:
                self.prefix.commit(snap)
        applied = []
        for seq in sched_out.seqs:
            if not seq.sample:
                continue
            req = self.requests.get(seq.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # finished, aborted or preempted since: this row is void
            # the step's own pending token: the last one unless the next step was advanced too
            # (never: the engine resolves a step before advancing the one after it)
            assert req.output_ids and req.output_ids[-1] == PENDING_TOKEN, \
                "resolve without advance"
            rid = seq.request_id
            token = model_out.token_ids[rid]
            extra = model_out.extra_ids.get(rid, ())
            assert len(extra) <= seq.num_draft, f"{rid!r}: more tokens kept than drafts"
            # a verify chunk keeps len(extra) drafts: its rejected positions are not cached
            req.num_computed_tokens -= seq.num_draft - len(extra)
            if seq.num_draft:  # the draft length adapts to the kept share (draft_pace.py)
                self.drafts.record(req, seq.num_draft, len(extra))
            req.output_ids[-1] = token
            req.num_new_tokens = 1
            lp = model_out.logprobs.get(rid)  # (a request with logprobs has no drafts)
            req.new_logprobs = [lp] if lp is not None else None
            applied.append(req)
            reason = self._stop_reason(req, token)
            for t in extra:  # further tokens of a verify chunk, each stop-checked in turn
                if reason is not None:
                    break
                req.output_ids.append(t)
                req.num_new_tokens += 1
                reason = self._stop_reason(req, t)
            req.draft_ids = list(model_out.draft_ids.get(rid, ()))
            if reason is not None:
                self.finish(rid, reason)
            elif rid in recompute:
                self.no_ahead.add(rid)
                self._preempt(req)
        return applied

    def can_schedule_ahead(self, sched_out: SchedulerOutput) -> bool:
        """Whether the step after `sched_out` can be scheduled before `sched_out`'s tokens are
        known: it must be the same requests' decodes and nothing else (kb/0015). True when the
        step is all decode rows of every running request, none uses penalties (they read the
        host's token history), none can finish by length at this step, nothing waits for
        admission that the next schedule could grant, and the free pages cover every
        request's next token (no preemption). Structured output (its mask needs the previous
        token) only with `structured_ahead` (the engine masks its row after launch) and
        without logprobs."""
        seqs = sched_out.seqs
        if not seqs or len(seqs) != len(self.running):
            return False
        if len(seqs) > self.config.max_num_batched_tokens:
            return False
        need = 0
        for seq in seqs:
            req = self.requests.get(seq.request_id)
            # seq.mtp: the next step's drafts come from this step's results; wants_sync: the
            # next step drafts (after this step's token)
            if (req is None or req.status is not RequestStatus.RUNNING or not seq.sample
                    or len(seq.token_ids) != 1 or seq.start_pos != req.num_computed_tokens
                    or seq.request_id in self.no_ahead or seq.mtp
                    or self.drafts.wants_sync(req, len(self.running))):
                return False
            sp = req.sampling
            # penalties read the host's token history; a grammar masks from the tokens before
            # (applied after launch where structured_ahead: logprobs would be of the first draw)
            if sp.uses_penalties or (sp.structured is not None and (
                    not self.structured_ahead or sp.logprobs is not None)):
                return False
            # after this step: len(output) + 1 tokens; the next one must not be past a limit
            if (len(req.output_ids) + 2 > sp.max_tokens
                    or req.num_tokens + 2 > self.config.max_model_len):
                return False
            need += max(0, _cdiv(seq.start_pos + 2, self.page_size) - len(req.pages))
        if need > self.pages.num_free:
            return False
        if self.waiting:
            # the next schedule admits the queue head when a slot, budget and its first chunk's
            # pages are there (the same test as schedule()'s); then it is not the same batch.
            # A full engine (max_num_seqs running) keeps pipelining with a queue
            head = self.waiting[0]
            budget = self.config.max_num_batched_tokens - len(seqs)
            if len(self.running) < self.max_running and self.slots.num_free > 0 and budget > 0:
                # with prefix caching, evicted entries' pages, a hit's shared pages and a chunk
                # cut at a save point may all let the head in where free pages alone would not
                # (its pages cannot be foreseen cheaply here): no step ahead
                # (the head's first chunk as schedule() would size it: the step budget's plan)
                first = self.budget.plan(len(seqs), min(len(self.waiting),
                                                        self.max_running - len(seqs))).take(
                    0, min(head.num_tokens, budget))
                if self.prefix is not None or (self.pages.num_free - need
                                               >= _cdiv(first, self.page_size)):
                    return False
        return True

    # ---- helpers -----------------------------------------------------------------------------
    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        sp = req.sampling
        stop_ids = self.stop_ids.get(req.request_id)
        if stop_ids is None:  # not added through add()
            stop_ids = self.stop_ids[req.request_id] = _stop_id_set(req)
        # before min_tokens are out a stop id ends nothing (the sampler masks them: only its
        # NaN fallback can still pick one)
        if token in stop_ids and len(req.output_ids) > sp.min_tokens:
            return FinishReason.STOP
        if len(req.output_ids) >= sp.max_tokens:
            return FinishReason.LENGTH
        if req.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _grow(self, req: Request, n: int, scheduled: set[str]) -> bool:
        """Give `req` pages for `n` more tokens, preempting newer requests if needed.

        Returns False when `req` cannot run this step: either it was preempted itself (it was
        the newest candidate), or it is a prefill that only waits because the remaining
        candidates already run this step (it keeps its pages and state).
        """
        need = _cdiv(req.num_computed_tokens + n, self.page_size) - len(req.pages)
        self._free_pages(need)  # prefix-cache entries go before any running request
        while need > self.pages.num_free:
            victim = next(
                (r for r in reversed(self.running) if r.request_id not in scheduled), None
            )
            if victim is req or victim is None:
                # NOTE: a decode that cannot grow must give way (else nobody may progress);
                # a prefill may wait only if another request runs this step and will free pages.
                if n == 1 or not scheduled:
                    self._preempt(req)
                return False
            self._preempt(victim)
        if need > 0:
            req.pages += self.pages.allocate(need)
        return True

    def _preempt(self, req: Request) -> None:
        _remove(self.running, req)
        self._release(req)
        req.draft_ids = []  # the recompute's last chunk proposes new ones
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0  # recompute prompt + outputs later
        # keep the waiting queue in arrival order: a preempted request goes ahead of newer ones
        i = next(
            (i for i, w in enumerate(self.waiting) if w.seq_no > req.seq_no), len(self.waiting)
        )
        self.waiting.insert(i, req)
        self.num_preemptions += 1

    def _release(self, req: Request) -> None:
        if req.pages:
            self.pages.free(req.pages)
        if req.slot:
            self.slots.free(req.slot)
        req.pages = []
        req.slot = 0

    def _scheduled(self, req: Request, n: int, drafts: list[int] = ()) -> ScheduledSeq:
        start = req.num_computed_tokens
        end = start + n
        sp = req.sampling
        if start < len(req.prompt_ids):
            tokens = req.prompt_ids[start:end]
            if end > len(req.prompt_ids):  # recompute crossing into the outputs
                tokens = tokens + req.output_ids[: end - len(req.prompt_ids)]
        else:
            tokens = req.output_ids[start - len(req.prompt_ids) : end - len(req.prompt_ids)]
        sample = end == req.num_tokens
        mtp = self.drafts.runs_mtp(req, len(self.running))
        if not mtp:
            req.draft_ids = []  # drafts of an earlier position: never usable later
        # the pages the MTP chain writes are added after every request has its chunk's pages
        # (`Drafting.chain_pages`): here only what the pages already held cover
        num_propose = self.drafts.num_propose(req, end + len(drafts)) if mtp and sample else 0
        P = len(req.prompt_ids)
        # prompt logprobs: the row at position p predicts prompt token p + 1 (a recompute's
        # repeats are ignored by the engine, which keeps the first)
        targets = (tuple(req.prompt_ids[start + 1:min(end, P - 1) + 1])
                   if sp.prompt_logprobs is not None and start < P - 1 else ())
        # min_tokens: the stop ids cannot be sampled before that many tokens are out
        banned = (tuple(sorted(self.stop_ids.get(req.request_id, ())))
                  if sample and len(req.output_ids) < sp.min_tokens else ())
        return ScheduledSeq(
            request_id=req.request_id,
            token_ids=tuple(tokens) + tuple(drafts),
            start_pos=start,
            slot=req.slot,
            reset_state=start == 0,  # first chunk since this slot was taken (also after preempt)
            page_ids=tuple(req.pages),
            sample=sample,
            sampling=sp,
            prompt_ids=tuple(req.prompt_ids) if sp.repetition_penalty != 1.0 else (),
            output_ids=tuple(req.output_ids) if sp.uses_penalties else (),
            num_generated=len(req.output_ids),
            num_draft=len(drafts),
            mtp=mtp,
            num_propose=num_propose,
            next_token=-1 if sample or not mtp else req.all_ids[end],
            banned_ids=banned,
            logprob_targets=targets,
        )
