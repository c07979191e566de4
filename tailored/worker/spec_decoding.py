"""Speculative decoding's host side: the drafter, acceptance, state commits, statistics.

With `--num-speculative-tokens N` a greedy request's decode step verifies up to N drafts: the
MTP head's (worker/drafter.py) or prompt lookup's, which the scheduler proposes from the
request's own tokens (engine/prompt_lookup.py) and which reach the runner as any other drafts
do, in the chunk's token ids. After a step the runner hands its result here:
  * a whole verify step replayed from its CUDA graph: acceptance, GDN state commits and the
    next drafts already run on the device (`chain`, kb/0034); the host emits the kept tokens
    without waiting for them and the next drafts stay on the device as placeholders
    (`chained`, worker/chain_drafts.py, kb/0035);
  * any other step with drafting requests: the host accepts, commits and runs the MTP over
    the step's rows for the next drafts (`speculate`). With prompt lookup alone
    (`--speculative-method ngram`) there is no MTP head (`drafter` None, no chain): every
    verify step takes this path, which then only accepts and commits.
"""

from __future__ import annotations

import logging
import random
import time

from tailored import flags
from tailored.config import MAX_SPECULATIVE_TOKENS, EngineConfig
from tailored.engine.types import PENDING_TOKEN, ModelOutput, SchedulerOutput
from tailored.model.batch import ForwardBatch, SeqInfo
from tailored.worker.chain_drafts import ChainDrafts, DraftSources
from tailored.worker.drafter import DraftRow, MTPDrafter, accept, emitted
from tailored.worker.memory_plan import spec_max_batch
from tailored.worker.sampler import HostCopy

log = logging.getLogger("tailored.worker")

SPEC_LOG_EVERY_S = 10.0  # seconds between speculative-decoding log lines (totals so far)


def lone_decode(s) -> bool:
    """A decode row without drafts: one token of a request past its first chunk that
    samples (ScheduledSeq)."""
    return s.sample and len(s.token_ids) == 1 and not s.reset_state and not s.num_draft


class SpecDecoding:
    """The speculative side of one runner. Validates the settings; `drafter` is None when
    speculative decoding is off (num_speculative_tokens 0). kernel: the runner's
    `KernelForward` or None; draft_head: the FP8 lm_head copy or None."""

    def __init__(self, model, cache, ec: EngineConfig, kernel=None, draft_head=None):
        n, rate = ec.num_speculative_tokens, ec.spec_synthetic_acceptance
        if n < 0 or n > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in 0..{MAX_SPECULATIVE_TOKENS}, "
                             f"got {n}")
        if rate is not None and not 0 <= rate <= 1:
            raise ValueError(f"spec_synthetic_acceptance must be in [0, 1], got {rate}")
        self.cache = cache
        self.kernel = kernel
        self.synthetic_acceptance = rate
        self._rng = random.Random(0)
        # verify steps, drafts verified, drafts kept (the acceptance rate; server metrics)
        self.stats = [0, 0, 0]
        # requests whose next drafts are still on the device (chain_drafts.py, kb/0035)
        self.sources = DraftSources()
        # the first line 10 s after the start of serving, not at the first verify step (whose
        # 1-step totals read as a rate of nothing)
        self._logged = time.monotonic()
        self.drafter = None  # the MTP head's (none with prompt lookup alone)
        if n == 0:
            return
        if ec.uses_mtp:
            self.drafter = MTPDrafter(model, cache, km=kernel.km if kernel else None,
                                      spec=kernel.spec if kernel else None, draft_head=draft_head)
        if ec.spec_max_running > ec.max_num_seqs:
            log.warning("spec_max_running %d is above max_num_seqs %d: drafting while at most "
                        "%d run", ec.spec_max_running, ec.max_num_seqs, ec.max_num_seqs)
        source = {"mtp": "MTP", "ngram": f"prompt-lookup ({ec.prompt_lookup_min}.."
                  f"{ec.prompt_lookup_max}-gram)", "ngram+mtp": "prompt-lookup or else MTP"}
        log.info("speculative decoding: up to %d %s draft%s a step for greedy requests while at "
                 "most %d run, %s%s", n, source[ec.speculative_method], "s" if n > 1 else "",
                 spec_max_batch(ec), "adaptive length (a draft when its chance of being kept "
                 f"is >= {ec.spec_min_acceptance})" if ec.spec_min_acceptance > 0 else
                 "fixed length", "" if rate is None
                 else f", synthetic acceptance {rate} (benchmarks only: not the greedy output)")

    def chain(self, sched: SchedulerOutput, batch: ForwardBatch, sampled, n_rows: int):
        """`SpecGraphs.chain` after a whole verify step: (its result as a ChainDrafts, the
        synthetic kept counts drawn for it or None); (None, None) when the step was not one
        verify replay (split beside prompts, eager, no graphs)."""
        spec = self.kernel.spec if self.kernel is not None else None
        if spec is None or self.drafter is None or not spec.whole_step(batch, n_rows):
            return None, None
        rate = self.synthetic_acceptance
        syn = None
        if rate is not None:  # the draws that `speculate` makes after the step, made first
            syn = [accept([0] * s.num_draft, [0] * (s.num_draft + 1), rate, self._rng)
                   for s in sched.seqs]
        out = spec.chain(sampled.ids, syn, sampled.bad)
        # the drafts copied out of the graph's output before the next chain replay rewrites it
        return ChainDrafts(out[:, 1:].clone(), HostCopy(out), kept=[]), syn

    def _count_verify(self, num_draft: int, kept: int) -> None:
        """Add one verify chunk to the stats; log the totals every SPEC_LOG_EVERY_S."""
        st = self.stats
        st[0] += 1
        st[1] += num_draft
        st[2] += kept
        now = time.monotonic()
        if now - self._logged >= SPEC_LOG_EVERY_S:
            self._logged = now
            log.info("speculative decoding since start: %d verify steps, %.3f of %d "
                     "drafts kept, %.2f tokens a verify step", st[0],
                     st[2] / max(st[1], 1), st[1], 1 + st[2] / st[0])

    @staticmethod
    def drafts_of(step, s) -> list[int]:
        """The draft ids a verify chunk of `step` ran on: its own, or where they were pending
        the chain's that drafted them (done by now: it ran before this step)."""
        src = step.drafts_in.get(s.request_id)
        if src is None:
            return list(s.token_ids[-s.num_draft:])
        rec, b = src
        return rec.read()[b][:s.num_draft]

    def chained(self, step, tokens: list[int], bad) -> ModelOutput:
        """The output of a whole verify step whose acceptance, commits and drafts run on the
        device (`chain`), without waiting for them: the host knows the kept counts (the
        synthetic draws, or the greedy rule over `tokens`, a NaN row ending the prefix as on
        the device); the next drafts stay on the device as PENDING_TOKEN placeholders that
        the next step takes from there (chain_drafts.py, kb/0035). Emitted tokens are the
        kept drafts (the inputs the state took) and the target's next one: with the greedy
        rule the target's tokens themselves, except at a NaN row that the sampler patched
        (`drafter.emitted`)."""
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
                d = self.drafts_of(step, s)
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
        # the A/B: wait for the chain
        rows = None if flags.current().spec_drafts_on_device else step.chain.read()
        for b, s in proposing:
            if rows is None:
                drafts[s.request_id] = (PENDING_TOKEN,) * s.num_propose
                self.sources.put(s.slot, s.request_id, step.chain, b)
            else:
                drafts[s.request_id] = tuple(rows[b][:s.num_propose])
        return ModelOutput(token_ids=out_ids, bad=bad, extra_ids=extra, draft_ids=drafts)

    def speculate(self, step, tokens: list[int], bad) -> ModelOutput:
        """Verify the drafts of a step's verify chunks, set their GDN state to the one after
        the last kept token, and run the MTP over every drafting chunk for the next drafts
        (worker/drafter.py)."""
        batch, hidden = step.spec
        synthetic = self.synthetic_acceptance
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
                drafts = self.drafts_of(step, s)
                kept = accept(drafts, target, synthetic, self._rng)
                em = emitted(drafts, target, kept, synthetic is not None)
                commits[s.slot] = kept + 1
                self._count_verify(s.num_draft, kept)
            else:
                if info.keep_states:  # a lone decode row of a verify step (runner.launch)
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
        for rid, d in zip(owners, self.drafter.propose(hidden, rows) if rows else ()):
            if rid is not None and d:
                drafts[rid] = tuple(d)
        return ModelOutput(token_ids=out_ids, bad=bad, extra_ids=extra, draft_ids=drafts)
