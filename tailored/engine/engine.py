"""The engine loop: add_request / abort_request / step() = schedule -> execute -> update -> detok.

    python -m pytest -q tests/engine/test_engine.py

Synchronous and not thread-safe: one thread (server/async_engine.py) makes every call. The
engine never touches tensors; the runner is the only stage that does.

Finish reasons, first match wins (failure-cases §5: stop conditions before max_tokens):
  1. the sampled token is an EOS id (unless ignore_eos) or a stop_token_id  -> STOP
     (the token is in delta_token_ids; its text is left out unless include_stop_str_in_output)
  2. a stop string completes in the text of this token                     -> STOP
     (even when the token also reached max_tokens; text is cut by the detokenizer)
  3. max_tokens reached, or prompt + output reached max_model_len           -> LENGTH
  A structured-output request (SamplingParams.structured, engine/grammar.py) also stops (STOP)
  when its grammar is complete: that takes a stop token (EOS), so rule 1's text rule applies.
  abort_request -> ABORT (final output on the next step); runner exception -> ERROR for the
  requests of that batch only.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field, replace
from typing import Any

from tailored.config import EngineConfig, ModelConfig
from tailored.engine.detokenizer import IncrementalDetokenizer
from tailored.engine.grammar import Grammars, Guide, with_mask
from tailored.engine.memory import pool_stats
from tailored.engine.request_checks import check_request
from tailored.engine.scheduler import Scheduler
from tailored.engine.step_timing import StepTimer, step_kind
from tailored.engine.types import (
    PENDING_TOKEN,
    FinishReason,
    ModelOutput,
    Request,
    RequestOutput,
    SamplingParams,
    SchedulerOutput,
)
from tailored.engine.worker import StepRunner

logger = logging.getLogger(__name__)

# structured output: how long a grammar may compile before its request fails (a pathological
# pattern compiles for minutes; xgrammar's compile cannot be cancelled, so its thread finishes
# it in the background), how long a request may wait for a free compile thread, and how long
# one token's mask may take (a pattern can compile fast and then take seconds a token: every
# stream of the engine thread would wait)
COMPILE_TIMEOUT_S = 30.0
COMPILE_QUEUE_TIMEOUT_S = 60.0
MASK_LIMIT_S = 0.05


class Engine:
    """Continuous-batching engine over one runner.

    runner: a `StepRunner` (engine/worker.py): `num_pages`, `num_slots` (pool sizes incl. the
        reserved index 0) and `execute(SchedulerOutput) -> ModelOutput` (a token for every seq
        with sample=True); an `AsyncStepRunner` also launches steps ahead.
    tokenizer: `decode`, `token_bytes`, `is_special`, `eos_token_ids` (used by the detokenizer).
    """

    def __init__(self, model_config: ModelConfig, engine_config: EngineConfig,
                 runner: StepRunner, tokenizer):
        self.model_config = model_config
        self.engine_config = engine_config
        self.runner = runner
        self.tokenizer = tokenizer
        self.scheduler = Scheduler(engine_config, runner.num_pages, runner.num_slots)
        if self.scheduler.prefix is not None and hasattr(tokenizer, "token_to_id"):
            # prefix-cache entries end where the chat's last message ends (prefix_cache.py)
            im_start = tokenizer.token_to_id("<|im_start|>")
            if im_start is not None:
                self.scheduler.prefix.boundary_ids = frozenset({im_start})
                # a system message's end is a save point too: a new chat with the same system
                # prompt (and tools) hits there
                lead = tuple(tokenizer.encode("<|im_start|>system", allow_special=True))
                if lead[:1] == (im_start,) and len(lead) > 1:
                    self.scheduler.prefix.lead_ids = lead
        # EOS ids of the tokenizer (generation_config) and of the model config, tokenizer first
        eos = tuple(getattr(tokenizer, "eos_token_ids", ()) or ())
        self.eos_token_ids = tuple(dict.fromkeys(eos + tuple(model_config.eos_token_ids)))
        self._requests: dict[str, Request] = {}  # unfinished, by id
        self._detoks: dict[str, IncrementalDetokenizer] = {}
        self._pending: list[RequestOutput] = []  # aborts, emitted on the next step()
        self._grammars: Grammars | None = None  # structured output's compiler
        if engine_config.grammar_warmup and hasattr(tokenizer, "is_added"):
            self._grammars = Grammars(tokenizer, model_config.vocab_size, self.eos_token_ids)
            self._grammars.warm_in_background()
        self._guides: dict[str, Guide] = {}  # structured requests' grammar states, by id
        # structured requests whose grammar still compiles: (request, future, submitted at)
        self._compiling: dict[str, tuple[Request, Future, float]] = {}
        self.timer = StepTimer()  # host phases per step (the server logs them, kb/0011)
        # async scheduling needs a runner that can launch a step and collect it later
        self._async = engine_config.async_scheduling and hasattr(runner, "launch")
        # a structured request's row launched ahead samples unmasked, and is sampled again
        # from the same logits once the previous step's token gave its grammar's mask
        # (`_resample_deferred`): its batch keeps running ahead
        self.scheduler.structured_ahead = self._async and hasattr(runner, "resample")
        logger.info("async scheduling %s", "on (decode steps launched ahead, kb/0025)"
                    if self._async else "off")
        self._inflight = None  # the launched step whose tokens are not read yet
        self._runner_error = ""
        if hasattr(runner, "timer"):
            runner.timer = self.timer
        if self.scheduler.budget.on:  # the step budget's fit goes into the timing log line
            self.timer.notes = self.scheduler.budget.describe

    # ---- API ---------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams) -> None:
        """Queue a request. Raises ValueError (one-line message) if it cannot be served."""
        prompt_ids = list(prompt_ids)
        if request_id in self._requests or any(o.request_id == request_id for o in self._pending):
            raise ValueError(f"duplicate request id {request_id!r}")
        check_request(prompt_ids, sampling, self.model_config.vocab_size,
                      self.engine_config.max_model_len)
        req = Request(request_id, prompt_ids, sampling, eos_token_ids=self.eos_token_ids)
        if sampling.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * len(prompt_ids)
        compiled = future = None
        spec = sampling.structured
        if spec is not None:
            if self._grammars is None:
                self._grammars = Grammars(self.tokenizer, self.model_config.vocab_size,
                                          self.eos_token_ids)
            compiled = self._grammars.cached(spec)
            if compiled is None:
                # parsed here (a bad grammar is a 400 now), compiled on a thread
                grammar = self._grammars.parse(spec)  # ValueError (or no xgrammar)
                self.scheduler.check_fits(req)
                future = self._grammars.submit(spec, grammar)
        if future is not None:  # admitted once its grammar compiled (`_admit_compiled`)
            self._compiling[request_id] = (req, future, time.monotonic())
        else:
            self.scheduler.add(req)  # ValueError if it can never fit in the KV pool
            if compiled is not None:
                self._guides[request_id] = self._grammars.guide(spec, prompt_ids, compiled)
        self._requests[request_id] = req
        self._detoks[request_id] = IncrementalDetokenizer(
            self.tokenizer,
            sampling.skip_special_tokens,
            sampling.stop,
            sampling.include_stop_str_in_output,
        )

    def abort_request(self, request_id: str) -> None:
        """Cancel a request now (pages and slot freed at once); its final output (ABORT) comes
        from the next step(). Unknown or already finished ids are ignored."""
        req = self._requests.get(request_id)
        if req is None:
            return
        self.scheduler.abort(request_id)
        self._forget(request_id)
        compiling = self._compiling.pop(request_id, None)
        if compiling is not None:
            compiling[1].cancel()  # drops it if it still waits for a thread
        self._pending.append(_output(req, "", [], FinishReason.ABORT))

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns outputs for requests that got tokens or finished.

        With async scheduling (EngineConfig.async_scheduling, a runner with `launch` and
        `collect`) a pure decode step is launched before the previous step's tokens are read:
        the device runs step N+1 while the host detokenizes and streams step N (kb/0015). The
        outputs returned are then those of step N; step N+1 stays in flight until the next
        call. Any other step (prefill, admission, penalties, structured output with logprobs,
        a request at its length limit) first waits for the step in flight, so it sees every
        token. A structured request's row in a step launched ahead is sampled again, masked,
        once this call has read the previous step's tokens (`_resample_deferred`)."""
        if self._compiling:
            self._admit_compiled()
        outputs, self._pending = self._pending, []
        t_start = time.perf_counter()
        t_sched = t_start  # a step already in flight was scheduled by the previous call
        if self._inflight is None:
            sched_out = self.scheduler.schedule()
            if sched_out.empty:
                if self._compiling and not outputs:  # nothing to run: wait a little, no spin
                    wait([f for _, f, _ in self._compiling.values()], timeout=0.01,
                         return_when=FIRST_COMPLETED)
                return outputs
            t_sched = time.perf_counter()  # the launch below is the runner's build/launch
            launched = self._launch(sched_out)
            if launched is None:
                return outputs + self._fail_batch(sched_out, self._runner_error)
            self._inflight = launched
        cur = self._inflight
        sched_out = cur.sched
        nxt = None
        if self._async and self.scheduler.can_schedule_ahead(sched_out):
            self.scheduler.advance(sched_out)
            ahead = self.scheduler.schedule()  # the same requests' decodes of pending tokens
            nxt = self._launch(ahead, feed=cur)
            model_out = self._collect(cur)
            if model_out is None:
                # nxt's rows (if it launched) belong to the requests failed here: void
                self._inflight = nxt
                return outputs + self._fail_batch(sched_out, self._runner_error, cur.owners)
            # rows whose next step ran on a token that is not theirs (NaN fallback): recompute
            applied = self.scheduler.resolve(sched_out, model_out, recompute=model_out.bad)
            if nxt is None:  # the launch failed: its requests (those still running) fail
                self._inflight = None
                outputs += self._emit_step(applied)
                # every request `ahead` runs for fails, as now in the engine (no id can be
                # reused within this call), not only cur's: one admitted there would be left
                # on a state it never got (kb/0053)
                return outputs + self._fail_batch(ahead, self._runner_error)
        else:
            model_out = self._collect(cur)
            self._inflight = None
            if model_out is None:
                return outputs + self._fail_batch(sched_out, self._runner_error, cur.owners)
            self.scheduler.advance(sched_out)
            applied = self.scheduler.resolve(sched_out, model_out)
        t_exec = time.perf_counter()
        self._inflight = nxt
        outputs += self._emit_step(applied)
        if nxt is not None and nxt.deferred:  # the grammars took this step's tokens just now
            outputs += self._resample_deferred(nxt)
        t_end = time.perf_counter()
        self.timer.record(step_kind(sched_out.seqs), len(sched_out.seqs), sched_out.num_tokens,
                          t_start, t_sched, t_exec, t_end)
        # the step's wall time, which every stream in it waited for: the step budget's cost
        # model (engine/step_budget.py). A step launched ahead ran on the device while the
        # previous call finished: this call's time is what remained of it, its cost to ITL
        self.scheduler.budget.observe(sched_out.seqs, t_end - t_start)
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self._requests or self._pending or self._inflight is not None)

    def _admit_compiled(self) -> None:
        """Queue the structured requests whose grammar compiled; fail (as bad requests) those
        whose grammar failed, compiled past COMPILE_TIMEOUT_S, or waited for a compile thread
        past COMPILE_QUEUE_TIMEOUT_S."""
        now = time.monotonic()
        for rid, (req, future, submitted) in list(self._compiling.items()):
            spec = req.sampling.structured
            field = spec.field
            error = None
            if not future.done():
                started = future.started_at
                if started is None and now - submitted > COMPILE_QUEUE_TIMEOUT_S:
                    future.cancel()
                    error = (f"{field}: every grammar compile thread stayed busy for "
                             f"{COMPILE_QUEUE_TIMEOUT_S:.0f} s; try again later")
                elif started is not None and now - started > COMPILE_TIMEOUT_S:
                    error = (f"{field}: the grammar did not compile within "
                             f"{COMPILE_TIMEOUT_S:.0f} s (too complex: simplify the schema or "
                             "pattern)")
                else:
                    continue
            elif future.exception() is not None:
                error = str(future.exception())
            del self._compiling[rid]
            if error is None:
                try:
                    self._guides[rid] = self._grammars.guide(spec, req.prompt_ids,
                                                             future.result())
                    self.scheduler.add(req)
                    continue
                except Exception as e:  # noqa: BLE001 - fail this request only
                    error = str(e)
            self._forget(rid)
            out = _output(req, "", [], FinishReason.ERROR, error)
            out.bad_request = True
            self._pending.append(out)

    def _forget(self, request_id: str) -> None:
        """Drop a request that left the engine from the engine's own per-request state (the
        scheduler's is its own: finish / abort)."""
        self._requests.pop(request_id, None)
        self._detoks.pop(request_id, None)
        self._guides.pop(request_id, None)

    # ---- step stages ---------------------------------------------------------------------------
    def _launch(self, sched_out: SchedulerOutput, feed: "_InFlight | None" = None):
        """The step started (`_InFlight`), or None (reason in self._runner_error) when the
        runner raised: the caller fails that batch only; the engine stays usable. feed: the
        step in flight whose sampled ids this one's pending tokens take (async scheduling)."""
        # the Request objects this step runs for (ids can be reused once a request ended)
        owners = {s.request_id: self._requests.get(s.request_id) for s in sched_out.seqs}
        deferred = []
        if self._guides:
            sched_out, deferred = self._with_masks(sched_out, ahead=feed is not None)
        try:
            if self._async:
                return _InFlight(sched_out, owners, launched=self.runner.launch(
                    sched_out, feed=None if feed is None else feed.launched),
                    deferred=deferred)
            return _InFlight(sched_out, owners, model_out=self.runner.execute(sched_out))
        except Exception as e:
            return self._runner_failed(e, sched_out)

    def _collect(self, launched: "_InFlight") -> ModelOutput | None:
        try:
            if launched.launched is None:
                model_out = launched.model_out
            else:
                model_out = self.runner.collect(launched.launched)
            sched_out = launched.sched
            missing = [
                s.request_id
                for s in sched_out.seqs
                if s.sample and s.request_id not in model_out.token_ids
            ]
            if missing:
                raise RuntimeError(f"runner returned no token for {missing}")
            self._take_prompt_logprobs(model_out, launched.owners)
            return model_out
        except Exception as e:
            return self._runner_failed(e, launched.sched)

    def _take_prompt_logprobs(self, model_out: ModelOutput, owners: dict) -> None:
        """Place a step's prompt logprobs at their positions in each request's list; a position
        already filled (a preempted request's recompute) keeps its first value."""
        for rid, (first, lps) in model_out.prompt_logprobs.items():
            req = owners.get(rid)
            if req is None or req.prompt_logprobs is None:
                continue
            got = req.prompt_logprobs
            for pos, lp in enumerate(lps, start=first):
                if pos < len(got) and got[pos] is None:
                    got[pos] = lp

    def _with_masks(self, sched_out: SchedulerOutput,
                    ahead: bool = False) -> tuple[SchedulerOutput, list[int]]:
        """(sched_out with each structured request's sampled row carrying the tokens its
        grammar allows next (ScheduledSeq.allowed), the indices in sched_out.seqs of the rows
        left unmasked). Structured requests never draft. ahead: the step is launched before
        the previous step's tokens are read (async scheduling), so a grammar has not taken
        its request's last token yet: the row is launched unmasked and sampled again once it
        has (`_resample_deferred`)."""
        seqs, deferred = [], []
        for i, seq in enumerate(sched_out.seqs):
            guide = self._guides.get(seq.request_id)
            if guide is not None and seq.sample:
                if ahead:
                    deferred.append(i)
                else:
                    seq = with_mask(seq, self._mask(guide))
            seqs.append(seq)
        return replace(sched_out, seqs=tuple(seqs)), deferred

    @staticmethod
    def _mask(guide: Guide):
        """The guide's next-token mask; a mask slower than MASK_LIMIT_S marks the request,
        which fails after this step (`_emit`)."""
        t = time.perf_counter()
        mask = guide.mask()
        took = time.perf_counter() - t
        if took > MASK_LIMIT_S:
            guide.too_slow = took
        return mask

    def _resample_deferred(self, step: "_InFlight") -> list[RequestOutput]:
        """Sample a launched-ahead step's structured rows again, masked: their grammars have
        taken the previous step's tokens now (`_emit`). Runs before the next step is launched
        from this one and before its tokens are read, so both see the masked ids. Rows of
        requests that ended meanwhile stay as they are (their tokens are dropped). A runner
        error fails the step's batch (ERROR outputs); the engine goes on."""
        fixes = []
        for i in step.deferred:
            seq = step.sched.seqs[i]
            guide = self._guides.get(seq.request_id)
            req = self._requests.get(seq.request_id)
            if guide is None or req is None or step.owners.get(seq.request_id) is not req:
                continue
            mask = self._mask(guide)
            if mask is None:  # not constrained yet (the thinking): the first draw is the one
                continue
            row = next(r for r, s in enumerate(step.launched.sampled_seqs)
                       if s.request_id == seq.request_id)  # decode rows: one sampled row each
            fixes.append((row, with_mask(seq, mask)))
        step.deferred = []
        if not fixes:
            return []
        try:
            self.runner.resample(step.launched, fixes)
        except Exception as e:
            self._runner_failed(e, step.sched)
            self._inflight = None
            return self._fail_batch(step.sched, self._runner_error, step.owners)
        return []

    def _runner_failed(self, e: Exception, sched_out: SchedulerOutput) -> None:
        """Log a runner error and keep its message for the batch's ERROR outputs."""
        logger.exception("runner failed on a batch of %d sequences", len(sched_out.seqs))
        self._runner_error = f"{type(e).__name__}: {e}"

    def _emit_step(self, applied) -> list[RequestOutput]:
        """Outputs of the requests that got a token this step and are still the engine's (a
        request aborted while its step ran has already had its final output)."""
        return [self._emit(req) for req in applied if req.request_id in self._requests]

    def stats(self) -> dict:
        s = self.scheduler
        verify, drafts, kept = getattr(self.runner, "spec_stats", None) or (0, 0, 0)
        return {
            "running": len(s.running),
            # a structured request whose grammar still compiles waits too (not yet queued)
            "waiting": len(s.waiting) + len(self._compiling),
            "free_pages": s.pages.num_free,
            "free_slots": s.slots.num_free,
            **pool_stats(s.pages, s.slots, s.prefix),
            "page_size": s.page_size,
            "max_running": s.max_running,
            "num_preemptions": s.num_preemptions,
            # prefix caching (engine/prefix_cache.py): tokens of admitted requests looked up,
            # and of those found cached (vLLM's prefix_cache_queries / prefix_cache_hits)
            "prefix_cache_queries": s.prefix.queries if s.prefix else 0,
            "prefix_cache_hits": s.prefix.hits if s.prefix else 0,
            # speculative decoding (worker/drafter.py): verify steps, drafts verified, drafts kept
            "spec_verify_steps": verify,
            "spec_drafts": drafts,
            "spec_drafts_kept": kept,
        }

    def flush_prefix_cache(self) -> int:
        """Drop every prefix-cache entry (a gateway's cache flush): how many. Pages a running
        request shares stay its own."""
        n = len(self.scheduler.prefix or ())
        if n:
            self.scheduler.prefix.clear()
        return n

    # ---- helpers -----------------------------------------------------------------------------
    def _emit(self, req: Request) -> RequestOutput:
        """Detokenize the tokens this step gave the request (one, or a verify chunk's kept
        drafts and the target's next token) and build the request's output. A stop string
        ends the request at the token that completes it; later tokens of the step are dropped."""
        new = req.output_ids[len(req.output_ids) - req.num_new_tokens:]
        lps, req.new_logprobs = req.new_logprobs, None  # one per id of `new` when asked for
        sp = req.sampling
        prompt_lps = None
        if req.prompt_logprobs is not None and not req.prompt_logprobs_sent:
            prompt_lps, req.prompt_logprobs_sent = req.prompt_logprobs, True  # once, complete
        if sp.max_tokens == 0:
            # the prompt alone (prompt logprobs with max_tokens 0, OpenAI's echo): the token the
            # prompt's last row sampled is dropped; the scheduler ended it by length
            del req.output_ids[:]
            self._forget(req.request_id)
            out = _output(req, "", [], FinishReason.LENGTH)
            out.prompt_logprobs = prompt_lps
            return out
        guide = self._guides.get(req.request_id)
        if guide is not None:
            for t in new:
                guide.accept(t)
            error = None
            if guide.failed and guide.dead:
                # the mask allowed no token: no text satisfies the grammar (the request's
                # fault, a 400; it was a 500 blaming the model's logits until kb/0057 §5)
                error = (f"{sp.structured.field}: the grammar allows no next token after "
                         f"{len(req.output_ids) - len(new)} generated tokens: no text can "
                         "satisfy it")
            elif guide.failed:
                # a token the grammar refused: the sampler fell back past the mask on NaN
                # logits; the answer could not follow the grammar
                error = ("structured output: the model's logits held NaN; the answer could "
                         "not follow the grammar")
            elif guide.too_slow:
                error = (f"{sp.structured.field}: the grammar took {guide.too_slow * 1e3:.0f} ms to mask one "
                         f"token (limit {MASK_LIMIT_S * 1e3:.0f} ms: it would stall every "
                         "stream); simplify the schema or pattern")
            if error is not None and req.finish_reason is None:
                self.scheduler.finish(req.request_id, FinishReason.ERROR)
                self._forget(req.request_id)
                out = _output(req, "", [], FinishReason.ERROR, error)
                out.bad_request = guide.dead or (guide.too_slow is not None and not guide.failed)
                return out
            if guide.done and req.finish_reason is None:
                # complete: the grammar took a stop token (ignore_eos let it through), which
                # is not text
                self.scheduler.finish(req.request_id, FinishReason.STOP)
                req.finish_reason = FinishReason.STOP
        # finish_reason is STOP here only for an EOS / stop token id (scheduler.update): the
        # last of `new`
        stop_token = req.finish_reason is FinishReason.STOP
        detok = self._detoks[req.request_id]
        text, matched = "", None
        before = len(req.output_ids) - len(new)  # tokens out before this step's
        for i, t in enumerate(new):
            if stop_token and i == len(new) - 1 and not sp.include_stop_str_in_output:
                break
            # one at a time: a match must cut right here; with min_tokens, stop strings are
            # looked for from the token after the min_tokens-th on (vLLM's order)
            piece, matched = detok.add([t], check_stops=before + i + 1 > sp.min_tokens)
            text += piece
            if matched is not None:
                if i + 1 < len(new):
                    del req.output_ids[i + 1 - len(new):]
                    new = new[:i + 1]
                break
        if matched is not None:
            if req.finish_reason is None:
                self.scheduler.finish(req.request_id, FinishReason.STOP)
            req.finish_reason = FinishReason.STOP  # a stop string beats max_tokens on this token
        elif req.finish_reason is not None:
            text += detok.flush()  # held-back text (partial stop string / UTF-8) is final now
        if req.finish_reason is not None:
            self._forget(req.request_id)
        if lps is not None:
            lps = lps[:len(new)]  # a stop string may have cut the step's tokens
        out = _output(req, text, new, req.finish_reason, logprobs=lps)
        out.prompt_logprobs = prompt_lps
        return out

    def _fail_batch(self, sched_out: SchedulerOutput, message: str,
                    owners: dict | None = None) -> list[RequestOutput]:
        """ERROR outputs for the batch's requests, which leave the engine. owners: the Request
        objects the step was launched for; a request id that finished since and was reused by
        a new request (whose own steps are not this one) is left alone."""
        outputs = []
        self.scheduler.discard(sched_out)  # its prefix-cache snapshots are not to be trusted
        for seq in sched_out.seqs:
            req = self._requests.get(seq.request_id)
            if req is None or (owners is not None and owners.get(seq.request_id) is not req):
                continue
            if req.output_ids and req.output_ids[-1] == PENDING_TOKEN:
                req.output_ids.pop()  # advanced, never sampled: not a delivered token
            self.scheduler.finish(seq.request_id, FinishReason.ERROR)
            self._forget(seq.request_id)
            outputs.append(_output(req, "", [], FinishReason.ERROR, message))
        return outputs


@dataclass
class _InFlight:
    """A step the engine started: the runner's LaunchedStep (async scheduling: its tokens are
    read by `runner.collect`) or the ModelOutput of a step run synchronously, and the Request
    objects it runs for (a request id can come back as a new request once one ended)."""

    sched: SchedulerOutput
    owners: dict
    launched: Any = None  # the runner's launched step (worker/runner.py LaunchedStep)
    model_out: ModelOutput | None = None
    # indices in sched.seqs of structured rows launched unmasked (`_resample_deferred`)
    deferred: list = field(default_factory=list)


def _output(
    req: Request, text: str, ids: list[int], reason: FinishReason | None, error: str | None = None,
    logprobs: list | None = None,
) -> RequestOutput:
    return RequestOutput(
        request_id=req.request_id,
        delta_text=text,
        delta_token_ids=ids,
        finished=reason is not None,
        finish_reason=reason,
        num_prompt_tokens=len(req.prompt_ids),
        num_output_tokens=len(req.output_ids),
        error=error,
        delta_logprobs=logprobs,
        num_cached_tokens=req.num_cached_tokens,
    )
