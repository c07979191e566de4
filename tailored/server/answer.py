"""One engine answer read through the splitters, for any API: each output's text split into
the answer, the reasoning (reasoning.py) and tool-call pieces (tool_calls.py), and the finish
reason of the whole.

`AnswerSplitter` holds the split state of one answer (one choice); the OpenAI formatter
(formatter.py) is one, and the Responses and Messages front doors (responses_api.py,
messages_api.py) use one each, so every dialect gets the same reasoning split, tool-call
parsing, forced-call handling and parallel_tool_calls stop. `answer_pieces` reads an engine
stream through a splitter (metrics, engine errors, the early stop once max_calls ended, the
abort when the reader goes away); `collect_answer` joins the pieces into one `Answer`, and
`collect_watched` does so while watching the client, for a non-streaming response.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request

from tailored.engine.types import FinishReason, RequestOutput, TokenLogprob
from tailored.server.errors import engine_error
from tailored.server.metrics import RequestMetrics
from tailored.server.reasoning import ReasoningSplitter, ThinkGate
from tailored.server.tool_calls import ToolCallDelta, ToolCallSplitter, merge

logger = logging.getLogger(__name__)


def finish_reason_of(out: RequestOutput) -> str:
    """The engine's finish reason of a finished output as text ("stop" when it gave none)."""
    reason = out.finish_reason
    if reason is None:
        return FinishReason.STOP.value
    return reason.value if isinstance(reason, FinishReason) else str(reason)


class AnswerSplitter:
    """Splits one answer's outputs, delta by delta, into (answer text, reasoning text, tool-call
    pieces, finish reason).

    thinking: whether the output starts inside the reasoning (None: no reasoning split, the
    reasoning stays answer text); tools: the request's active tools in OpenAI's shape (None:
    no calls parsed); raw_thinking: thinking on with no reasoning split, so calls are read only
    after `</think>` (ThinkGate); max_calls: parallel_tool_calls false (1): `stopped` once that
    many calls ended; forced: tool_choice "required" / named, the answer is calls only (a
    grammar). prompt_no: the prompt of a completions batch it answers; cached_tokens: the
    prompt tokens the prefix cache supplied (the engine's num_cached_tokens);
    reasoning_tokens: tokens of deltas that gave reasoning text only (the Responses API's
    output_tokens_details.reasoning_tokens)."""

    def __init__(self, thinking: bool | None = None, tools: list[dict] | None = None,
                 raw_thinking: bool = False, max_calls: int | None = None,
                 forced: bool = False, prompt_no: int = 0, exact: bool = False) -> None:
        self.prompt_no, self.cached_tokens, self.reasoning_tokens = prompt_no, 0, 0
        # chat answers' thinking split out (--reasoning-parser): whether the output starts
        # inside it (None: no split); streams feed `splitter` delta by delta
        self.thinking = thinking
        names = {t["function"]["name"] for t in tools or ()}
        self.splitter = (ReasoningSplitter(thinking, tools=names)
                         if thinking is not None else None)
        # the request's tools (None: no calls parsed); streams feed `tool_splitter` the answer
        # text the reasoning split leaves. raw_thinking: thinking on with no reasoning split,
        # so content is the raw text, reasoning included: calls are read only after </think>
        # forced: tool_choice "required" / named, the answer is calls only (a grammar)
        # exact: the calls are held by a grammar (ToolCallSplitter)
        self.tool_splitter = ToolCallSplitter(tools, max_calls, forced, exact) if tools else None
        self.gate = ThinkGate() if tools and raw_thinking else None

    def split(self, text: str, finished: bool) -> tuple[str, str, list[ToolCallDelta]]:
        """One streamed delta's (answer text, reasoning text, tool-call pieces); `finished`:
        the last delta, which also gives out what the splitters held back."""
        reasoning, calls = "", []
        if self.splitter is not None:
            reasoning, text = self.splitter.feed(text)
            if finished:  # a held-back tail that never became "</think>"
                r, c = self.splitter.finish()
                reasoning, text = reasoning + r, text + c
        if self.tool_splitter is not None:
            before = ""
            if self.gate is not None:  # the thinking passes as content, unparsed
                before, text = self.gate.feed(text)
                if finished:
                    before += self.gate.finish()
            text, calls = self.tool_splitter.feed(text)
            if finished:
                c, more = self.tool_splitter.finish()
                text, calls = text + c, merge(calls + more)
            text = before + text
        return text, reasoning, calls

    def delta(self, out: RequestOutput) -> tuple[str, str, list[ToolCallDelta], str | None]:
        """One output's (answer text, reasoning text, tool-call pieces, finish reason or None):
        the finish is "tool_calls" once a call ended and the engine stopped, or once the calls
        reached max_calls (`stopped`: the caller then ends the generation)."""
        self.cached_tokens = max(self.cached_tokens, out.num_cached_tokens)
        text, reasoning, calls = self.split(out.delta_text, out.finished)
        if reasoning and not text and not calls:
            self.reasoning_tokens += len(out.delta_token_ids)
        # (after the split: "tool_calls" once a call was seen, this delta's included)
        if self.stopped:
            return text, reasoning, calls, "tool_calls"
        finish = self.finish_reason(finish_reason_of(out)) if out.finished else None
        return text, reasoning, calls, finish

    @property
    def stopped(self) -> bool:
        """The answer's calls reached max_calls (parallel_tool_calls false): the rest of the
        generation is not wanted."""
        return self.tool_splitter is not None and self.tool_splitter.stopped

    def finish_reason(self, finish: str) -> str:
        """OpenAI's "tool_calls" for an answer that called a tool and stopped by itself, every
        call complete (one cut inside a value keeps the engine's reason)."""
        ts = self.tool_splitter
        called = ts is not None and ts.calls > 0 and not ts.unfinished
        return "tool_calls" if finish == FinishReason.STOP.value and called else finish


@dataclass
class Piece:
    """One output of an answer, split: `finish` is set on the last piece (the engine's reason,
    or "tool_calls"); `out` the engine output it came from."""

    text: str
    reasoning: str
    calls: list[ToolCallDelta]
    finish: str | None
    out: RequestOutput


def split_calls(calls: list[ToolCallDelta]) -> tuple[list[ToolCallDelta], list[ToolCallDelta]]:
    """A piece's call deltas as (the arguments of the call already open, the calls it begins):
    a piece's text comes between them (the splitters return a delta's text and its call
    pieces apart; a call ends before text that follows it, text comes before a new call)."""
    for i, c in enumerate(calls):
        if c.id is not None:
            return calls[:i], calls[i:]
    return calls, []


@dataclass
class Answer:
    """A whole answer: its joined pieces, the completion tokens (every id the engine sent, as
    usage counts them), and, when kept, the ids with their logprobs and the raw text."""

    text: str = ""
    reasoning: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)
    finish: str | None = None
    num_tokens: int = 0
    ids: list[int] = field(default_factory=list)  # all ids (keep_ids), or those with logprobs
    logprobs: list[TokenLogprob] = field(default_factory=list)
    raw_text: str = ""  # the engine's text before any split (keep_ids)
    # SamplingParams.prompt_logprobs: one per prompt token, None for the first
    prompt_logprobs: list[TokenLogprob | None] | None = None


async def answer_pieces(stream, splitter: AnswerSplitter,
                        tracker: RequestMetrics) -> AsyncIterator[Piece]:
    """The pieces of one engine stream, the last one with its finish. An engine error is
    raised as OpenAIError (engine_error); once the answer's calls reached max_calls the engine
    request ends at once (its piece finishes with "tool_calls"). However the reader stops
    (finished, failed, closed early), the request leaves the engine and its metrics end."""
    try:
        async for out in stream:
            tracker.output(out)
            if out.error is not None:
                raise engine_error(out)
            text, reasoning, calls, finish = splitter.delta(out)
            if splitter.stopped:  # its one call ended (parallel_tool_calls false)
                tracker.finish("stop")
                stream.abort()
                yield Piece(text, reasoning, calls, finish, out)
                return
            yield Piece(text, reasoning, calls, finish, out)
            if out.finished:
                return
    except Exception:
        tracker.finish("error")
        raise
    finally:
        tracker.finish("abort")  # no-op when its last output was seen
        stream.abort()  # no-op when finished


async def collect_answer(stream, splitter: AnswerSplitter, tracker: RequestMetrics,
                         keep_ids: bool = False) -> Answer:
    """One whole answer, through the splitters a stream uses (so both give the same answer).
    keep_ids: keep every token id and the raw text (else only ids that carry logprobs)."""
    answer = Answer()
    text: list[str] = []
    reasoning: list[str] = []
    raw: list[str] = []
    async with contextlib.aclosing(answer_pieces(stream, splitter, tracker)) as pieces:
        async for p in pieces:
            out = p.out
            answer.num_tokens += len(out.delta_token_ids)
            if out.prompt_logprobs is not None:  # (once, with the first output)
                answer.prompt_logprobs = out.prompt_logprobs
            if out.delta_logprobs is not None:
                answer.ids += out.delta_token_ids
                answer.logprobs += out.delta_logprobs
            elif keep_ids:
                answer.ids += out.delta_token_ids
            if keep_ids:
                raw.append(out.delta_text)
            text.append(p.text)
            reasoning.append(p.reasoning)
            answer.calls += p.calls
            answer.finish = p.finish
    answer.text, answer.reasoning, answer.raw_text = "".join(text), "".join(reasoning), \
        "".join(raw)
    return answer


async def collect_watched(request: Request, stream, splitter: AnswerSplitter,
                          tracker: RequestMetrics, poll_s: float,
                          keep_ids: bool = False) -> Answer:
    """`collect_answer` for a non-streaming response: the engine request is aborted as soon as
    the client leaves (checked every poll_s seconds)."""

    async def watch() -> None:
        while not stream.finished:
            await asyncio.sleep(poll_s)
            if await request.is_disconnected():
                logger.info("client disconnected; aborting %s", stream.request_id)
                stream.abort()
                return

    watcher = asyncio.create_task(watch())
    try:
        return await collect_answer(stream, splitter, tracker, keep_ids)
    finally:
        watcher.cancel()
