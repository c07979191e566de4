"""The scheduler's side of speculative decoding: which requests draft, which drafts a decode
step verifies, how many the MTP head proposes, the pages its chains write.

    python -m pytest -q tests/worker/test_spec_decode.py tests/engine/test_ngram_decode.py

Drafts come from the MTP head (proposed by the runner after a step, `Request.draft_ids`), from
prompt lookup (engine/prompt_lookup.py, proposed here at schedule time from the request's own
tokens), or from prompt lookup where it finds a match and else the MTP head
(EngineConfig.speculative_method). Every request's draft length adapts to its recent acceptance
(engine/draft_pace.py). A request drafts only while
  * speculative decoding is on and its sampling allows drafts (greedy, no penalties,
    `SamplingParams.can_draft`),
  * at most spec_max_running requests run,
  * its pace is not paused,
  * its last token is known: a step launched ahead (async scheduling) runs on a pending token,
    and the next drafts come from that token. The scheduler does not launch a step ahead when
    a request of it would draft at the next one (`wants_sync`).
"""

from __future__ import annotations

from dataclasses import replace

from tailored.config import EngineConfig
from tailored.engine.draft_pace import DraftPace
from tailored.engine.memory import PagePool
from tailored.engine.prompt_lookup import PromptLookup
from tailored.engine.types import PENDING_TOKEN, Request, ScheduledSeq


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Drafting:
    """Per-request draft state (pace, prompt lookup) and the draft rules of one scheduler,
    whose page pool it takes chain pages from."""

    def __init__(self, config: EngineConfig, pages: PagePool):
        self.config = config
        self.pages = pages
        self.page_size = config.page_size
        self.on = config.num_speculative_tokens > 0
        self.mtp = config.uses_mtp
        self.ngram = config.uses_ngram
        self.paces: dict[str, DraftPace] = {}
        self.lookups: dict[str, PromptLookup] = {}

    def forget(self, request_id: str) -> None:
        """A request left the scheduler."""
        self.paces.pop(request_id, None)
        self.lookups.pop(request_id, None)

    def pace(self, req: Request) -> DraftPace:
        p = self.paces.get(req.request_id)
        if p is None:
            p = self.paces[req.request_id] = DraftPace(self.config.num_speculative_tokens,
                                                       self.config.spec_min_acceptance)
        return p

    # ---- who drafts --------------------------------------------------------------------------
    def eligible(self, req: Request, num_running: int) -> bool:
        """Speculative decoding on, a request that can draft, at most spec_max_running
        running (the MTP KV of a request's positions computed while more ran stays unwritten:
        its later drafts are worse, and still verified)."""
        return (self.on and req.sampling.can_draft
                and num_running <= self.config.spec_max_running)

    @staticmethod
    def known(req: Request) -> bool:
        """Its last token is not pending (a step launched ahead): drafts can follow it. A
        request can reach a drafting step from one that did not draft when a preemption in
        the same schedule brought the running count down to spec_max_running (kb/0032 §6)."""
        return not (req.output_ids and req.output_ids[-1] == PENDING_TOKEN)

    def runs_mtp(self, req: Request, num_running: int) -> bool:
        """Whether `req`'s chunk this step runs the MTP head (its KV, and the next drafts
        after a chunk that samples)."""
        return (self.mtp and self.eligible(req, num_running) and self.known(req)
                and self.pace(req).active)

    def wants_sync(self, req: Request, num_running: int) -> bool:
        """Whether the step after this one should draft for `req`, so it must not be
        launched ahead of this step's tokens."""
        return self.eligible(req, num_running) and self.pace(req).active

    # ---- the drafts of one decode ------------------------------------------------------------
    def tokens_left(self, req: Request) -> int:
        """Tokens `req` may still emit (max_tokens, max_model_len)."""
        return min(req.sampling.max_tokens - len(req.output_ids),
                   self.config.max_model_len - req.num_tokens)

    def for_decode(self, req: Request, budget: int, num_running: int) -> list[int]:
        """The drafts a decode of `req` verifies this step: up to the pace's length, as far as
        the step budget, its length limits (a step emits at most drafts + 1 tokens) and the
        free pages allow without a preemption; none otherwise. A paused request counts the
        step. Prompt lookup's drafts where it finds some, else the MTP's."""
        if not self.eligible(req, num_running):
            return []
        pace = self.pace(req)
        if not pace.active:
            pace.tick()
            return []
        if not self.known(req):
            return []
        d = min(pace.length(), budget - 1, self.tokens_left(req) - 1)
        if d <= 0:
            return []
        drafts = self.lookup(req, d) if self.ngram else []
        if not drafts:
            if not self.mtp:  # prompt lookup alone found nothing: a rejected draft (draft_pace)
                pace.record(1, 0)
                return []
            drafts = req.draft_ids
        d = min(d, len(drafts))
        if d <= 0 or _cdiv(req.num_computed_tokens + 1 + d, self.page_size) - len(req.pages) \
                > self.pages.num_free:
            return []
        return list(drafts[:d])

    def lookup(self, req: Request, k: int) -> list[int]:
        """Prompt lookup's drafts for `req` (up to k)."""
        pl = self.lookups.get(req.request_id)
        if pl is None:
            pl = self.lookups[req.request_id] = PromptLookup(self.config.prompt_lookup_min,
                                                             self.config.prompt_lookup_max)
        pl.sync(req.prompt_ids, req.output_ids)
        return pl.propose(k)

    def record(self, req: Request, proposed: int, kept: int) -> None:
        """A verify chunk of `req`: `proposed` drafts, `kept` of them kept."""
        self.pace(req).record(proposed, kept)

    # ---- the MTP's proposals and their pages -------------------------------------------------
    def wanted(self, req: Request) -> int:
        """Drafts worth proposing after this step: num_speculative_tokens, no more than the
        next step could use (it emits drafts + 1 of the tokens left after this step's one)."""
        return max(0, min(self.config.num_speculative_tokens, self.tokens_left(req) - 2))

    def num_propose(self, req: Request, end: int) -> int:
        """Drafts the MTP proposes after a sampling chunk of `req` that ends at position `end`:
        `wanted`, no more than its pages hold (the chain writes the MTP KV of positions
        end .. end + drafts - 2)."""
        n = self.wanted(req)
        return n if n <= 1 else min(n, len(req.pages) * self.page_size - end + 1)

    def chain_pages(self, seqs: list[ScheduledSeq], requests: dict) -> list[ScheduledSeq]:
        """After every request of the step has its pages: pages for the MTP chains of the
        drafting chunks that sample, oldest first, from the pages still free (never by
        preempting, never ahead of another request's chunk)."""
        out = []
        for seq in seqs:
            req = requests[seq.request_id]
            want = self.wanted(req) if seq.mtp and seq.sample else 0
            if want > seq.num_propose:
                end = seq.start_pos + len(seq.token_ids)
                need = _cdiv(end + want - 1, self.page_size) - len(req.pages)
                if need > 0 and self.pages.num_free:
                    req.pages += self.pages.allocate(min(need, self.pages.num_free))
                    seq = replace(seq, page_ids=tuple(req.pages),
                                  num_propose=self.num_propose(req, end))
            out.append(seq)
        return out
