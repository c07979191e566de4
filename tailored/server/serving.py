"""Request handling shared by the generation routes (`Server`, one per app): a request is
parsed and screened, its prompt rendered and encoded off the event loop, its completion budget
set, its engine requests started (`n` choices, each its own engine request), and its outputs
streamed or collected (streaming.py) into the API's response objects (formatter.py).

Prompt text (the completion prompt, or the rendered chat prompt) is refused before encoding
when longer than max_model_len x MAX_CHARS_PER_TOKEN (32) characters: 400
context_length_exceeded. Real text averages ~4 characters per token; only pathological input
(long runs of spaces or '=' map to tokens of up to 128 characters) could fit the context with
more than 32.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect

from tailored.server.access_log import record
from tailored.server.async_engine import AsyncEngine, EngineDeadError, RequestStream
from tailored.server.chat_protocol import ChatCompletionRequest
from tailored.server.completions_protocol import CompletionRequest
from tailored.server.errors import OpenAIError, grammar_param, shown, validation_error_to_openai
from tailored.server.formatter import Formatter
from tailored.server.guard import AccessPolicy
from tailored.server.http_io import (SSE_HEADERS, default_max_body_bytes, error_response,
                                     internal_error, read_json)
from tailored.server.metrics import ServerMetrics
from tailored.server.reasoning import REASONING_PARSERS
from tailored.server.streaming import complete, end_streams, stream_events
from tailored.server.thinking_budget import CLOSE_TEXT, BudgetedStream

logger = logging.getLogger(__name__)

MAX_CHARS_PER_TOKEN = 32  # prompt text over max_model_len * this many characters -> 400
# every chat message renders to at least this many tokens (<|im_start|>role\n ... <|im_end|>\n
# is five; a tool response merged into a user turn still has its tags): more messages than
# max_model_len / this cannot fit, and are refused before validation and templating, which
# took ~2 s of the event loop for 300k tiny messages (review of session 10)
MIN_TOKENS_PER_MESSAGE = 2


class Server:
    """Request handling shared by the routes; one per app."""

    def __init__(
        self,
        engine: AsyncEngine,
        tokenizer,
        model_name: str,
        max_model_len: int,
        sampling_defaults: dict | None,
        disconnect_poll_s: float,
        max_body_bytes: int | None = None,
        reasoning_parser: str | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.sampling_defaults = dict(sampling_defaults or {})
        self.disconnect_poll_s = disconnect_poll_s
        self.max_body_bytes = max_body_bytes or default_max_body_bytes(max_model_len)
        if reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser {reasoning_parser!r}: one of {REASONING_PARSERS}")
        self.reasoning_parser = reasoning_parser  # "qwen3": chat answers split (reasoning.py)
        self.max_prompt_chars = max_model_len * MAX_CHARS_PER_TOKEN
        # Tokenizer work runs off the event loop, on one thread so the tokenizer is never used
        # by two server threads at once (the engine thread may still decode concurrently).
        self.tokenizer_pool = ThreadPoolExecutor(1, thread_name_prefix="tailored-tokenize")
        self.metrics = ServerMetrics(model_name)  # GET /metrics; its own registry per app
        self.access = AccessPolicy()  # API keys, hosts (guard.py); build_app sets the app's
        self._close_ids: list[int] | None = None  # close_ids(), once encoded

    # ---- parsing and validation ----------------------------------------------------------
    async def parse(self, request: Request, model_cls):
        data = await read_json(request, self.max_body_bytes)
        if model_cls is ChatCompletionRequest:
            self.check_chat_size(data)
        try:
            req = model_cls.model_validate(data)
        except ValidationError as e:
            raise validation_error_to_openai(e) from None
        self.check_model(req.model)
        req.check_supported()
        return req

    def authorize(self, request: Request) -> None:
        """The API-key check (`self.access`, guard.py): every generation route (completions,
        chat, responses, messages, count_tokens) calls it before reading the body, and the
        app's Guard middleware before every route. Without keys every request passes; else
        one needs `Authorization: Bearer <key>` (OpenAI's SDKs), on the Messages routes also
        `x-api-key` (Anthropic's SDK, Claude Code), or gets OpenAIError(status=401)."""
        err = self.access.key_error(request.url.path, request.headers)
        if err is not None:
            raise err

    def check_model(self, model: str | None) -> None:
        """404 model_not_found unless `model` is None (the served model) or its name."""
        if model is not None and model != self.model_name:
            raise OpenAIError(
                f"The model {shown(model, 100)} does not exist (this server serves "
                f"`{self.model_name}`).",
                status=404,
                param="model",
                code="model_not_found",
            )

    def chat_request(self, data: dict) -> ChatCompletionRequest:
        """A Chat Completions request from its JSON (the front doors' translation): screened
        for size as a chat body is, validated, its parameters checked."""
        self.check_chat_size(data)
        try:
            req = ChatCompletionRequest.model_validate(data)
        except ValidationError as e:
            raise validation_error_to_openai(e) from None
        req.check_supported()
        return req

    def too_many_chars(self, what: str, param: str) -> OpenAIError:
        """The 400 for prompt text longer than any tokenization of it could fit (`what`: how
        many characters it has)."""
        return OpenAIError(
            f"The prompt is too long for this model's maximum context length of "
            f"{self.max_model_len} tokens: {what}, more than the {self.max_prompt_chars} "
            f"({MAX_CHARS_PER_TOKEN} per token of context) accepted before tokenization. "
            "Shorten the prompt.",
            param=param,
            code="context_length_exceeded",
        )

    def check_item_count(self, count: int, param: str) -> None:
        """Refuse a conversation of more items than the context can hold (each renders to at
        least MIN_TOKENS_PER_MESSAGE tokens) before translating or validating them."""
        if count * MIN_TOKENS_PER_MESSAGE > self.max_model_len:
            raise OpenAIError(
                f"{count} items cannot fit this model's maximum context length of "
                f"{self.max_model_len} tokens (each takes at least {MIN_TOKENS_PER_MESSAGE}).",
                param=param, code="context_length_exceeded")

    def check_chat_size(self, data: dict) -> None:
        """Refuse, on the raw JSON, chat messages that cannot fit the context whatever they
        render to: too many messages, or more content characters than `encode` accepts."""
        msgs = data.get("messages")
        if not isinstance(msgs, list):
            return  # validation names the type error
        if len(msgs) * MIN_TOKENS_PER_MESSAGE > self.max_model_len:
            raise OpenAIError(
                f"{len(msgs)} messages cannot fit this model's maximum context length of "
                f"{self.max_model_len} tokens (each takes at least {MIN_TOKENS_PER_MESSAGE}).",
                param="messages", code="context_length_exceeded")
        chars = 0
        for m in msgs:
            c = m.get("content") if isinstance(m, dict) else None
            if isinstance(c, str):
                chars += len(c)
            elif isinstance(c, list):
                chars += sum(len(p["text"]) for p in c
                             if isinstance(p, dict) and isinstance(p.get("text"), str))
        if chars > self.max_prompt_chars:
            raise self.too_many_chars(f"its messages hold {chars} characters", "messages")
        tools = data.get("tools")
        if isinstance(tools, list) and tools:
            # rendered into the prompt as JSON: refused before validation and templating,
            # which took ~0.5 s of the event loop for 10k tools (review of session 29)
            if len(tools) * MIN_TOKENS_PER_MESSAGE > self.max_model_len:
                raise OpenAIError(
                    f"{len(tools)} tools cannot fit this model's maximum context length of "
                    f"{self.max_model_len} tokens.", param="tools",
                    code="context_length_exceeded")
            size = len(json.dumps(tools, ensure_ascii=False))
            if chars + size > self.max_prompt_chars:
                raise self.too_many_chars(
                    f"its messages and tools hold {chars + size} characters", "tools")

    async def _tokenize(self, fn, *args, **kwargs):
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.tokenizer_pool, lambda: fn(*args, **kwargs))

    async def prompt_ids(self, req: CompletionRequest | ChatCompletionRequest,
                         tools: list[dict] | None = None,
                         param: str = "messages") -> list[list[int]]:
        """Each prompt's token ids (one but for a completions batch); tools: a chat request's
        active_tools, rendered; param: the field its messages came from (errors name it)."""
        if isinstance(req, ChatCompletionRequest):
            extra = req.template_kwargs  # chat_template_kwargs: the template's variables
            try:
                text = await self._tokenize(
                    self.tokenizer.apply_chat_template,
                    [m.to_template() for m in req.messages],
                    add_generation_prompt=req.add_generation_prompt,
                    enable_thinking=req.enable_thinking,
                    tools=tools,
                    **extra,
                )
            except ValueError as e:  # the template refused or failed (ChatTemplateError)
                with_kw = (f" (rendered with chat_template_kwargs {sorted(extra)})"
                           if extra else "")
                raise OpenAIError(f"invalid {param}: {e}{with_kw}", param=param) from None
            return [await self.encode(text, param)]
        prompts = req.prompts
        out = []
        for k, prompt in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt[{k}]"
            if isinstance(prompt, str):
                out.append(await self.encode(prompt, param))
            else:
                self.check_token_ids(prompt, param)
                out.append(list(prompt))
        return out

    async def echo_texts(self, req, prompts: list[list[int]]) -> list[str | None]:
        """Each prompt's text for completions' echo (None without echo): a text prompt as
        given, a token-id prompt decoded (special tokens kept: the prompt as the model saw
        it)."""
        if isinstance(req, ChatCompletionRequest) or not req.echo:
            return [None] * len(prompts)
        return [p if isinstance(p, str) else
                await self._tokenize(self.tokenizer.decode, ids, skip_special_tokens=False)
                for p, ids in zip(req.prompts, prompts)]

    async def close_ids(self) -> list[int]:
        """The token ids that close a think block (thinking_budget.CLOSE_TEXT), encoded once."""
        if self._close_ids is None:
            self._close_ids = list(await self._tokenize(self.tokenizer.encode, CLOSE_TEXT))
        return self._close_ids

    async def encode(self, text: str, param: str) -> list[int]:
        """Token ids of prompt text. Text that cannot fit the context whatever its tokens is
        refused before the tokenizer spends seconds on it (see the module docstring)."""
        if len(text) > self.max_prompt_chars:
            raise self.too_many_chars(f"it has {len(text)} characters", param)
        try:
            return list(await self._tokenize(self.tokenizer.encode, text))
        except ValueError as e:  # the tokenizer's verdict on the text (e.g. a lone surrogate)
            raise OpenAIError(f"invalid '{param}': {e}", param=param) from None

    def check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.tokenizer.vocab_size
        eos = set(self.tokenizer.eos_token_ids)
        bad = [i for i in ids if not (0 <= i < vocab or i in eos)]
        if bad:
            raise OpenAIError(
                f"'{param}' holds token id(s) outside the vocabulary [0, {vocab}): {bad[:5]}",
                param=param,
            )

    def max_tokens(self, req, prompt_len: int, prompt_param: str,
                   param: str | None = None, clamp: bool = False) -> int:
        """Completion budget: the requested max_tokens, or all the context the prompt leaves;
        param: the field it came from, for errors (default: the request's own name of it);
        clamp: a request for more than the prompt leaves gets what it leaves (the Messages
        API's rule: its answer then stops at the context window) instead of a 400."""
        limit, requested = self.max_model_len, req.requested_max_tokens
        param = param or req.max_tokens_param
        if clamp and requested is not None and prompt_len < limit:
            requested = min(requested, limit - prompt_len)
        if requested is not None and requested > limit:
            raise OpenAIError(
                f"{param} ({requested}) is larger than the maximum context length ({limit})",
                param=param,
            )
        if prompt_len >= limit:
            raise OpenAIError(
                f"This model's maximum context length is {limit} tokens, but the prompt has "
                f"{prompt_len} tokens, which leaves no room for the completion.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if requested is None:
            return limit - prompt_len
        if prompt_len + requested > limit:
            raise OpenAIError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for "
                f"the completion). Reduce the prompt or {param}.",
                param=param,
                code="context_length_exceeded",
            )
        return requested

    # ---- one request ---------------------------------------------------------------------
    async def handle(self, request: Request, chat: bool) -> Response:
        arrival = time.monotonic()  # TTFT and end-to-end latency count from here
        response = await self._handle(request, chat, arrival)
        self.metrics.http_response("/v1/chat/completions" if chat else "/v1/completions",
                                   response.status_code)
        return response

    async def _handle(self, request: Request, chat: bool, arrival: float) -> Response:
        try:
            self.authorize(request)
            req = await self.parse(request, ChatCompletionRequest if chat else CompletionRequest)
            tools = req.active_tools if chat else None  # (dumped once: a list can be long)
            prompts = await self.prompt_ids(req, tools)
            if req.stop_token_ids:
                self.check_token_ids(req.stop_token_ids, "stop_token_ids")
            if req.logit_bias:
                self.check_token_ids([int(k) for k in req.logit_bias], "logit_bias")
            prompt_param = "messages" if chat else "prompt"
            # a batch's errors name their prompt, as its vocabulary and size checks do
            params = ([prompt_param] if len(prompts) == 1
                      else [f"{prompt_param}[{k}]" for k in range(len(prompts))])
            max_tokens = [self.max_tokens(req, len(p), q) for p, q in zip(prompts, params)]
            if req.min_tokens and req.min_tokens > min(max_tokens):
                # (max_tokens omitted: the budget is what the context leaves)
                raise OpenAIError(f"'min_tokens' ({req.min_tokens}) is more than the "
                                  f"completion can have ({min(max_tokens)} tokens)",
                                  param="min_tokens")
            echoes = await self.echo_texts(req, prompts)
            request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            streams = await self.start(req, request_id, prompts, max_tokens, params)
            n = req.n or 1
            # the thinking split only where the output starts at the template's generation
            # prompt (which opens the think block); with add_generation_prompt false it does not
            opens_think = chat and req.add_generation_prompt and req.enable_thinking
            thinking = (req.enable_thinking
                        if chat and self.reasoning_parser and req.add_generation_prompt else None)
            num_prompt_tokens = sum(len(p) for p in prompts)  # usage counts each prompt once
            fmts = [Formatter(request_id, self.model_name, chat, num_prompt_tokens,
                               req.include_usage, thinking, tools, index=i,
                               logprobs=req.logprobs_k, tokenizer=self.tokenizer,
                               raw_thinking=opens_think and not self.reasoning_parser,
                               max_calls=req.max_tool_calls if chat else None,
                               forced=chat and req.forced_tool_calls, prompt_no=i // n,
                               exact=chat and req.grammar_tool_calls,
                               prompt_ids=prompts[i // n], echo=echoes[i // n],
                               prompt_logprobs=req.prompt_logprobs)
                    for i in range(len(streams))]
            for f in fmts:  # stream_options.continuous_usage_stats: usage on every chunk
                f.continuous_usage = req.continuous_usage
            trackers = [self.metrics.request(arrival, len(prompts[k // n]))
                        for k in range(len(streams))]
            record(request, num_prompt_tokens, trackers)  # (the access log's counts)
            if req.stream:
                return StreamingResponse(
                    stream_events(streams, fmts, trackers),
                    media_type="text/event-stream",
                    headers=SSE_HEADERS,
                    # Runs also when the client left before the body started: frees the engine.
                    background=BackgroundTask(end_streams, streams, trackers),
                )
            return await complete(request, streams, fmts, trackers,
                                  self.disconnect_poll_s)
        except OpenAIError as e:
            return error_response(e)
        except ClientDisconnect:  # left before its body was complete: nothing was started
            logger.info("client left before sending the whole body of %s", request.url.path)
            return error_response(OpenAIError("client disconnected while sending the body"))
        except Exception as e:  # one bad request must not take the server down
            logger.exception("unexpected error while handling %s", request.url.path)
            return error_response(internal_error(e))

    async def start(self, req, request_id: str, prompts: list[list[int]], max_tokens: list[int],
                    params: list[str],
                    thinking_budget: int | None = None) -> list[RequestStream]:
        """The request's engine requests: `n` choices of each prompt, choice k = prompt * n +
        i (ids `<request_id>-<k>` when there are several), each with its own SamplingParams; a
        seeded request's choice i of a prompt draws with seed + i (else the n choices would be
        the same text). If one cannot start, every one is aborted; params: each prompt's name
        in errors (`prompt[k]` in a batch); thinking_budget: end each one's thinking after
        that many tokens (BudgetedStream)."""
        n = req.n or 1
        total = len(prompts) * n
        streams: list[RequestStream] = []
        for k in range(total):
            i = k % n
            sampling = req.sampling_params(max_tokens[k // n], self.sampling_defaults)
            if i and sampling.seed is not None:  # wraps within int64, as a seed may be
                sampling.seed = (sampling.seed + i + 2**63) % 2**64 - 2**63
            child_id = request_id if total == 1 else f"{request_id}-{k}"
            if thinking_budget is None:
                streams.append(self.engine.generate(child_id, prompts[k // n], sampling))
            else:
                streams.append(BudgetedStream(self.engine, child_id, prompts[k // n], sampling,
                                              thinking_budget, await self.close_ids()))
        # every add is submitted before any is awaited: the engine loop reads its commands
        # between steps, so awaiting each in turn let one choice in a step (n = 32 on the nano
        # model: 2.45 s against 0.10 s; review of session 29) instead of one batched prefill
        results = await asyncio.gather(*(s.start() for s in streams), return_exceptions=True)
        errors = [(k, r) for k, r in enumerate(results) if isinstance(r, BaseException)]
        if errors:
            for s in streams:
                s.abort()
            k, e = errors[0]
            if isinstance(e, ValueError):  # the engine's verdict on the input (e.g. too long)
                raise OpenAIError(str(e), param=grammar_param(str(e)) or params[k // n]) \
                    from None
            if isinstance(e, EngineDeadError):
                raise OpenAIError(
                    f"engine unavailable: {e}", status=503, type="service_unavailable"
                ) from None
            raise e
        return streams

