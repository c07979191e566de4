"""A token limit on the thinking (the Anthropic API's `thinking.budget_tokens`), enforced in the
server with the engine's own per-request calls: no sampler or runner hook.

`BudgetedStream` stands in for one `RequestStream`. Its engine request runs as usual while it
reads the output; once `budget` tokens of thinking were generated and no `</think>` came, it
aborts that request and starts a second one whose prompt is the first's prompt, the thinking
written so far and `CLOSE_TEXT` ("\\n</think>\\n\\n", as the chat template closes a think
block), with max_tokens less the tokens already spent. The reader sees one answer: the first
request's outputs, one output carrying CLOSE_TEXT (its tokens count as generated), then the
second request's outputs, all under the first's request id.

What it costs: the second request prefills the thinking again. With prefix caching on, its
prompt extends the first's up to the first's save point (before the generation prompt,
engine/prefix_cache.py), so only the generation prompt and the thinking are computed again.
The limit is checked per engine output: a step that emits several tokens (speculative
decoding) can pass it by those few tokens. A grammar (structured output, forced tool calls)
starts right away in the second request: its prompt closes the think block
(engine/grammar.py). The thinking is counted from the start of the output up to `</think>`
(or the budget), by text, so any tokenizer works.
"""

from __future__ import annotations

from dataclasses import replace

from tailored.engine.types import RequestOutput, SamplingParams
from tailored.server.reasoning import THINK_END

CLOSE_TEXT = f"\n{THINK_END}\n\n"


class BudgetedStream:
    """A RequestStream whose thinking ends after `budget` tokens (see the module docstring).

    engine: the AsyncEngine (its `generate`); close_ids: CLOSE_TEXT's token ids."""

    def __init__(self, engine, request_id: str, prompt_ids: list[int],
                 sampling: SamplingParams, budget: int, close_ids: list[int]) -> None:
        self.request_id = request_id
        self._engine = engine
        self._prompt = list(prompt_ids)
        self._sampling = sampling
        self._budget = budget
        self._close_ids = list(close_ids)
        self._inner = engine.generate(request_id, self._prompt, sampling)
        self._watching = True  # still inside the thinking, under the budget
        self._tail = ""  # the last characters read, for a </think> cut between outputs
        self._ids: list[int] = []  # the first request's output ids
        self._pending: list[RequestOutput] = []  # outputs to hand out before reading on
        self._offset = 0  # output tokens before the current request's (the second's)
        self._cached = 0  # the first request's prefix-cache tokens (the prompt's)

    @property
    def finished(self) -> bool:
        return self._inner.finished and not self._pending

    async def start(self) -> BudgetedStream:
        await self._inner.start()
        return self

    def __await__(self):
        return self.start().__await__()

    def __aiter__(self) -> BudgetedStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._pending:
            return self._pending.pop(0)
        out = await self._inner.__anext__()
        if self._watching:
            return await self._watch(out)
        if self._offset:  # the second request: counted and named as one answer
            out.request_id = self.request_id
            out.num_prompt_tokens = len(self._prompt)
            out.num_output_tokens += self._offset
            out.num_cached_tokens = self._cached
        return out

    async def _watch(self, out: RequestOutput) -> RequestOutput:
        self._cached = max(self._cached, out.num_cached_tokens)
        self._ids += out.delta_token_ids
        seen = self._tail + out.delta_text
        self._tail = seen[-len(THINK_END):]
        if THINK_END in seen or out.finished or out.error is not None:
            self._watching = False
            return out
        remaining = self._sampling.max_tokens - len(self._ids) - len(self._close_ids)
        if len(self._ids) < self._budget or remaining < 1:
            return out
        self._watching = False
        self._inner.abort()
        self._offset = len(self._ids) + len(self._close_ids)
        # (the first request gave the prompt's logprobs; min_tokens counts the answer's whole)
        sp = self._sampling
        second = self._engine.generate(
            f"{self.request_id}-answer", self._prompt + self._ids + self._close_ids,
            replace(sp, max_tokens=remaining, prompt_logprobs=None,
                    min_tokens=min(remaining, max(0, sp.min_tokens - self._offset))))
        self._inner = second
        try:
            await second.start()
        except Exception as e:  # noqa: BLE001 - the answer ends with the engine's verdict
            self._pending.append(RequestOutput(
                self.request_id, "", [], True, None, len(self._prompt), len(self._ids),
                error=f"could not continue after the thinking budget: {e}"))
            return out
        self._pending.append(RequestOutput(
            self.request_id, CLOSE_TEXT, list(self._close_ids), False, None, len(self._prompt),
            self._offset, num_cached_tokens=self._cached))
        return out

    def abort(self) -> None:
        self._pending.clear()
        self._inner.abort()

    async def aclose(self) -> None:
        self.abort()
