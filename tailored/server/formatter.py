"""The OpenAI response objects of one choice (Completions or Chat Completions), from its
engine outputs: each output's text split into the answer, the reasoning (`--reasoning-parser`,
reasoning.py) and tool-call pieces (tool_calls.py), then rendered as a stream chunk or, joined,
as the choice of a whole response; logprobs in either API's shape.

Chat output: `message.content` is the raw generated text. With thinking on, that includes the
reasoning and the closing `</think>` (the template's generation prompt already holds `<think>`).
With `reasoning_parser="qwen3"` the reasoning goes to `reasoning` and `reasoning_content` and
the answer after `</think>` to `content` (null while the reasoning never ended), in streamed
deltas too. Tools: the calls leave the answer's `content` and come back as
`message.tool_calls`, or streamed as `delta.tool_calls` pieces, finish_reason "tool_calls".
"""

from __future__ import annotations

import codecs
import json

from pydantic import BaseModel

from tailored.engine.types import TokenLogprob
from tailored.server.answer import AnswerSplitter
from tailored.server.chat_protocol import (ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                           ChatCompletionResponse, ChatResponseMessage,
                                           DeltaMessage)
from tailored.server.completions_protocol import (CompletionChoice, CompletionResponse,
                                                  CompletionStreamResponse)
from tailored.server.http_io import sse
from tailored.server.protocol import UsageInfo, unix_now
from tailored.server.reasoning import fields as reasoning_fields
from tailored.server.tool_calls import ToolCallDelta, join_calls


class Formatter(AnswerSplitter):
    """Builds the response objects of one choice for either OpenAI API (its answer split by
    `AnswerSplitter`)."""

    def __init__(self, request_id, model, chat, prompt_tokens, include_usage,
                 thinking: bool | None = None, tools: list[dict] | None = None,
                 index: int = 0, logprobs: int | None = None, tokenizer=None,
                 raw_thinking: bool = False, max_calls: int | None = None,
                 forced: bool = False, prompt_no: int = 0,
                 prompt_ids: list[int] | None = None, echo: str | None = None,
                 prompt_logprobs: int | None = None, exact: bool = False) -> None:
        super().__init__(thinking, tools, raw_thinking, max_calls, forced, prompt_no, exact)
        self.request_id, self.model, self.chat = request_id, model, chat
        self.index = index  # the choice this formatter renders (n > 1: one formatter each)
        # SamplingParams.logprobs of the request (None: none); the tokenizer names the tokens
        self.logprobs_k, self._tokenizer = logprobs, tokenizer
        # the prompt's ids (this choice's prompt); echo: the prompt's text, which the answer
        # starts with (completions' echo, once: `echo_prefix`); prompt_logprobs: the request's
        # (vLLM's field, `prompt_logprobs_field`)
        self._prompt_ids, self._echo = list(prompt_ids or ()), echo
        self.prompt_logprobs_k = prompt_logprobs
        self.prompt_logprobs: list | None = None  # the field, once the answer is collected
        self._text_offset = 0  # completions' text_offset of the next token
        # the tokens' bytes decoded as the detokenizer does: a character split over tokens
        # counts once it is whole
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self.prompt_tokens, self.include_usage = prompt_tokens, include_usage
        self.created = unix_now()  # one timestamp for every chunk of a stream (OpenAI's rule)
        # OpenAI sends "usage": null on every chunk only when include_usage is set.
        self._exclude = None if include_usage else {"usage"}
        # chunk() before / after the text, for content and for reasoning deltas
        self._templates: dict[str, list[str]] = {}
        # stream_options.continuous_usage_stats: every chunk carries `usage` with this
        # choice's prompt and the completion tokens streamed so far (`tokens_sent`, counted
        # by the stream), as vLLM's
        self.continuous_usage = False
        self.tokens_sent = 0

    def _envelope(self, choices):
        cls = ChatCompletionChunk if self.chat else CompletionStreamResponse
        env = cls(id=self.request_id, created=self.created, model=self.model, choices=choices)
        if self.continuous_usage:
            env.usage = UsageInfo.of(len(self._prompt_ids) or self.prompt_tokens,
                                     self.tokens_sent)
        return env

    def first_chunk(self) -> str | None:
        if not self.chat:
            return None
        choice = ChatChunkChoice(index=self.index,
                                 delta=DeltaMessage(role="assistant", content=""))
        return sse(self._envelope([choice]), self._exclude)

    def logprobs_payload(self, ids: list[int], lps: list[TokenLogprob] | None) -> dict | None:
        """The `logprobs` object of a choice (or a chunk) for these tokens: chat's
        {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}, or completions'
        {"tokens", "token_logprobs", "top_logprobs" (each {token: logprob}, the sampled one
        included, as vLLM), "text_offset"}; None when not asked for or no token."""
        if self.logprobs_k is None or not lps:
            return None
        if self.chat:
            return {"content": [
                {**self._token(t, lp.logprob),
                 "top_logprobs": [self._token(i, v) for i, v in lp.top]}
                for t, lp in zip(ids, lps)]}
        return self._completion_logprobs(ids, lps)

    def _completion_logprobs(self, ids: list[int], lps: list[TokenLogprob | None],
                             prompt: bool = False) -> dict:
        """Completions' logprobs object; an entry None (the first prompt token's) gives null
        token_logprobs and top_logprobs; prompt: the echoed prompt's tokens (special tokens
        are part of its text; an entry lists at most `logprobs` alternatives, the engine may
        have computed more for prompt_logprobs)."""
        tokens = [self._token(t)["token"] for t in ids]
        offsets = []
        is_special = getattr(self._tokenizer, "is_special", None)
        for t in ids:  # where each token's text starts in the returned text (characters)
            offsets.append(self._text_offset)
            # (special tokens give no text in the completion; the echoed prompt has them)
            if prompt or is_special is None or not is_special(t):
                self._text_offset += len(self._utf8.decode(self._tokenizer.token_bytes(t)))
        k = self.logprobs_k
        return {
            "tokens": tokens,
            "token_logprobs": [None if lp is None else lp.logprob for lp in lps],
            "top_logprobs": [None if lp is None else
                             {**{self._token(i)["token"]: v for i, v in lp.top[:k]},
                              tok: lp.logprob} for tok, lp in zip(tokens, lps)],
            "text_offset": offsets,
        }

    def echo_prefix(self, prompt_lps: list[TokenLogprob | None] | None
                    ) -> tuple[str, dict | None]:
        """Completions' echo, with the choice's first output (then, and without echo: "" and
        None): the prompt's text and, with logprobs, its tokens' entries (OpenAI's legacy
        shape: the first token's logprob and top_logprobs null; text_offset from 0). The
        completion's offsets then count from the end of the prompt's text."""
        if self._echo is None:
            return "", None
        text, self._echo = self._echo, None
        payload = None
        if self.logprobs_k is not None:
            ids = self._prompt_ids
            payload = self._completion_logprobs(ids, prompt_lps or [None] * len(ids),
                                                prompt=True)
        self._text_offset = len(text)
        self._utf8.reset()
        return text, payload

    def prompt_logprobs_field(self, prompt_lps: list[TokenLogprob | None] | None
                              ) -> list | None:
        """vLLM's `prompt_logprobs` (None unless the request set it): one entry per prompt
        token, null for the first, else {token id as text: {"logprob", "rank",
        "decoded_token"}} holding the prompt's token first (its rank in the whole
        vocabulary), then the k most likely with ranks 1..k (the prompt's token keeps its
        place when it is one of them), as vLLM's `append_logprobs_for_next_position`."""
        k = self.prompt_logprobs_k
        if k is None:
            return None
        ids = self._prompt_ids
        out: list = []
        for t, lp in zip(ids, prompt_lps or [None] * len(ids)):
            if lp is None:
                out.append(None)
                continue
            entry = {str(t): self._ranked(t, lp.logprob, lp.rank)}
            for rank, (i, v) in enumerate(lp.top[:k], start=1):
                entry[str(i)] = self._ranked(i, v, rank)
            out.append(entry)
        return out

    def _ranked(self, token_id: int, logprob: float, rank: int | None) -> dict:
        text = self._tokenizer.token_bytes(token_id).decode("utf-8", "replace")
        return {"logprob": logprob, "rank": rank, "decoded_token": text}

    def _token(self, token_id: int, logprob: float | None = None) -> dict:
        """{"token": its text, "logprob", "bytes": its bytes}. A token holding part of a UTF-8
        character is named by its bytes, `bytes:\\xe4\\xb8` (OpenAI's form), so distinct
        tokens keep distinct names (completions key top_logprobs by name)."""
        b = self._tokenizer.token_bytes(token_id)
        try:
            text = b.decode("utf-8")
        except UnicodeDecodeError:
            text = "bytes:" + "".join(f"\\x{c:02x}" for c in b)
        d = {"token": text}
        if logprob is not None:
            d["logprob"] = logprob
        d["bytes"] = list(b)  # (OpenAI's key order)
        return d

    _TEXT = "@@tailored-text@@"  # placeholder: plain ASCII, survives JSON encoding unchanged

    def chunk(self, text: str, finish: str | None, reasoning: str = "",
              calls: list[ToolCallDelta] | None = None, logprobs: dict | None = None) -> str:
        """One SSE event with a token's text (answer text, and chat reasoning text with
        --reasoning-parser). The common cases (answer text alone, or reasoning text alone, no
        finish) fill a template rendered once per request by the same pydantic models: the
        HTTP thread pays ~140 µs of CPU per streamed token and shares the GIL with the engine
        (kb/0011)."""
        if (finish is None and bool(text) != bool(reasoning) and not calls and not logprobs
                and not self.continuous_usage):
            kind = "content" if text else "reasoning"
            if kind not in self._templates:
                args = (self._TEXT, "") if text else ("", self._TEXT)
                parts = self._render(*args, None).split(f'"{self._TEXT}"')
                # the placeholder once a field (the reasoning goes under two names): else it
                # also sits elsewhere (a model named so), and the models render every chunk
                fields = 1 if text else 2
                self._templates[kind] = parts if len(parts) == fields + 1 else []
            if self._templates[kind]:
                return json.dumps(text or reasoning, ensure_ascii=False).join(
                    self._templates[kind])
        return self._render(text, reasoning, finish, calls, logprobs)

    def _render(self, text: str, reasoning: str, finish: str | None,
                calls: list[ToolCallDelta] | None = None, logprobs: dict | None = None) -> str:
        if self.chat:
            delta = DeltaMessage(content=text or None, reasoning=reasoning or None,
                                 reasoning_content=reasoning or None,
                                 tool_calls=[c.to_openai() for c in calls] if calls else None)
            choice = ChatChunkChoice(index=self.index, delta=delta, finish_reason=finish,
                                     logprobs=logprobs)
        else:
            choice = CompletionChoice(index=self.index, text=text, finish_reason=finish,
                                      logprobs=logprobs)
        return sse(self._envelope([choice]), self._exclude)

    def usage_chunk(self, completion_tokens: int, cached_tokens: int = 0) -> str:
        env = self._envelope([])
        env.usage = UsageInfo.of(self.prompt_tokens, completion_tokens, cached_tokens)
        return sse(env)

    def choice(self, text: str, reasoning: str, calls: list[ToolCallDelta], finish: str | None,
               logprobs: dict | None = None) -> ChatChoice | CompletionChoice:
        """This choice of a non-streaming response, from the joined `split` pieces of all its
        deltas (and the `logprobs_payload` of all its tokens). With the thinking split, an
        empty reasoning is null, and so is the answer when the reasoning never ended or the
        answer is empty; content is null beside calls when the model wrote none (OpenAI)."""
        if not self.chat:
            return CompletionChoice(index=self.index, text=text, finish_reason=finish,
                                    logprobs=logprobs, prompt_logprobs=self.prompt_logprobs)
        r, content = reasoning_fields(reasoning, text, self.thinking)
        tool_calls = join_calls(calls) or None
        if tool_calls:
            content = content or None
        message = ChatResponseMessage(content=content, reasoning=r, reasoning_content=r,
                                      tool_calls=tool_calls)
        return ChatChoice(index=self.index, message=message, finish_reason=finish,
                          logprobs=logprobs)

    def response(self, choices: list, completion_tokens: int,
                 cached_tokens: int = 0) -> BaseModel:
        """The non-streaming response of `choices` (`choice()` of each formatter);
        completion_tokens: summed over them (the prompt counts once); cached_tokens:
        `_cached_tokens` of the formatters."""
        usage = UsageInfo.of(self.prompt_tokens, completion_tokens, cached_tokens)
        if self.chat:  # (vLLM's place for a chat request's prompt_logprobs: the top level)
            return ChatCompletionResponse(id=self.request_id, model=self.model,
                                          choices=choices, usage=usage,
                                          prompt_logprobs=self.prompt_logprobs)
        return CompletionResponse(id=self.request_id, model=self.model, choices=choices,
                                  usage=usage)
