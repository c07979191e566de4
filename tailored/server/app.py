"""OpenAI-compatible HTTP routes over an `AsyncEngine`.

    GET  /health                200 {"status": "ok"} | 503 once the engine loop is dead/stopped
                                (HEAD too; a trailing slash on any route is a 404, no redirect)
    GET  /v1/models             OpenAI model list with the one served model (+ max_model_len);
                                503 once the engine loop is dead, as /health
    GET  /v1/models/{id}        that model, or 404 model_not_found (503 as above)
    POST /v1/completions        text or token-id prompt, or a batch of them
    POST /v1/chat/completions   messages -> tokenizer.apply_chat_template -> encode
    GET  /metrics               Prometheus text (HEAD too): vLLM's metric names with the prefix
                                `tailored:` (tokens, finished requests by reason, TTFT /
                                inter-token / end-to-end latency histograms in seconds, running
                                and waiting requests, engine_healthy 0/1); list in metrics.py

Streaming is SSE: `data: {chunk json}\\n\\n` per non-empty delta; the last chunk carries
finish_reason; with stream_options.include_usage one more chunk with `choices: []` and usage;
then `data: [DONE]\\n\\n`. Chat streams start with a `{"role": "assistant", "content": ""}` delta.

Chat input: the messages are rendered by the chat template and the text encoded as a whole,
so special-token text inside a message (`<|im_start|>`, `<|im_end|>`, `<think>`) becomes those
control tokens, as in vLLM and transformers' apply_chat_template + encode: a client that
forwards untrusted text must escape it.

Chat output: `message.content` is the raw generated text. With thinking on, that includes the
reasoning and the closing `</think>` (the template's generation prompt already holds `<think>`).
With `reasoning_parser="qwen3"` (`tailored serve --reasoning-parser qwen3`) the reasoning goes
to `reasoning` and `reasoning_content` (the same text under both names) and the answer after
`</think>` to `content` (null while the reasoning never ended), in streamed deltas too
(`reasoning.py`).

Tools: a chat request's `tools` are rendered by the chat template (unless tool_choice is
"none"); the calls the model writes (`<tool_call>` XML) leave the answer's `content` and come
back as `message.tool_calls`, or streamed as `delta.tool_calls` pieces with the arguments as
they are written, and finish_reason "tool_calls" (`tool_calls.py`). tool_choice "required" (one
or more calls) or a named function (one call of it) holds the answer after the thinking to the
tool-call format by a grammar (engine/grammar.py; needs xgrammar, as response_format).

Errors are OpenAI JSON `{"error": {"message", "type", "param", "code"}}`: 400 bad input or
unsupported parameter, 404 unknown model/route, 405 wrong method, 413 body over max_body_bytes,
415 compressed body (Content-Encoding other than identity),
500 engine or server fault, 503 engine loop dead. A streaming request that fails after the
headers were sent gets `data: {"error": {...}}` and then `data: [DONE]`. Error bodies are
rendered with ensure_ascii and messages quote user input escaped and shortened.

Input limits, checked before any tokenizer work (HF `encode` of a few MB takes seconds):
- the request body: at most `max_body_bytes` (default 256 bytes a token of max_model_len, 2 to
  32 MiB: 4 MiB at 16k) -> else 413;
- the body must be UTF-8 (or UTF-16/32) JSON nested at most protocol.MAX_JSON_DEPTH (64)
  levels, checked before parsing; no string may hold a lone UTF-16 surrogate (JSON "\\ud800")
  -> else 400 naming the field;
- prompt text (the completion prompt, or the rendered chat prompt): at most
  max_model_len x MAX_CHARS_PER_TOKEN (32) characters -> else 400 context_length_exceeded.
  Real text averages ~4 characters per token; only pathological input (long runs of spaces or
  '=' map to tokens of up to 128 characters) could fit the context with more than 32.

Usage counts what was returned: prompt_tokens = prompt length, completion_tokens = number of
token ids in the deltas that were sent (summed over the choices).

`n` choices are n engine requests of the one prompt (`_Server.start`); a stream interleaves
their chunks as they come, each naming its choice index; one choice failing (or the client
leaving) ends them all. Metrics count each choice as a request.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from tailored.engine.types import FinishReason, RequestOutput, TokenLogprob
from tailored.server.async_engine import AsyncEngine, EngineDeadError, RequestStream
from tailored.server.metrics import CONTENT_TYPE_LATEST, RequestMetrics, ServerMetrics
from tailored.server.reasoning import REASONING_PARSERS, ReasoningSplitter, ThinkGate
from tailored.server.reasoning import fields as reasoning_fields
from tailored.server.tool_calls import ToolCallDelta, ToolCallSplitter, join_calls, merge
from tailored.server.protocol import (
    MAX_JSON_DEPTH,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    OpenAIError,
    UsageInfo,
    check_json_body,
    json_too_deep,
    shown,
    unix_now,
    validation_error_to_openai,
)

logger = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# The default cap of a request body (-> 413) scales with the context: real text is ~2-4
# characters a token (CJK ~1.9), ~12 bytes a token once JSON-escaped as \uXXXX; the longest
# token of the vocabulary is 128 characters. 256 bytes a token leaves 2x over that worst case
# (which the 32-characters-a-token check refuses anyway); 2 MiB is the floor for small
# contexts, 32 MiB (the old fixed cap) the ceiling. Why not one large cap: the body is parsed on
# the event loop, and json.loads + validation of a 27 MB body of 2.2M unknown keys took 2.4 s
# here, during which every other stream stopped (a fresh helper's attack, session 26), with
# the GIL held throughout (a worker thread would not help); at 4 MiB (16k context) ~0.35 s.
# Bytes that never become tokens count too: reasoning that clients send back in the history
# (the template drops it from earlier turns); `tailored serve --max-body-bytes` raises the cap.
BODY_BYTES_PER_TOKEN = 256
MIN_BODY_BYTES = 2 * 2**20
MAX_DEFAULT_BODY_BYTES = 32 * 2**20


def default_max_body_bytes(max_model_len: int) -> int:
    """The request-body cap for a context of max_model_len tokens (bytes)."""
    return min(MAX_DEFAULT_BODY_BYTES, max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len))


MAX_CHARS_PER_TOKEN = 32  # prompt text over max_model_len * this many characters -> 400
# every chat message renders to at least this many tokens (<|im_start|>role\n ... <|im_end|>\n
# is five; a tool response merged into a user turn still has its tags): more messages than
# max_model_len / this cannot fit, and are refused before validation and templating, which
# took ~2 s of the event loop for 300k tiny messages (review of session 10)
MIN_TOKENS_PER_MESSAGE = 2


class _ErrorJSONResponse(JSONResponse):
    """JSON rendered with ensure_ascii: any text (even a lone surrogate) encodes."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(err: OpenAIError, headers: dict | None = None) -> JSONResponse:
    return _ErrorJSONResponse(err.to_dict(), status_code=err.status, headers=headers)


def _sse(payload: BaseModel | dict, exclude: set[str] | None = None) -> str:
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json(exclude=exclude)}\n\n"
    return f"data: {json.dumps(payload)}\n\n"


def _finish_reason(out: RequestOutput) -> str:
    reason = out.finish_reason
    if reason is None:
        return FinishReason.STOP.value
    return reason.value if isinstance(reason, FinishReason) else str(reason)


class _Server:
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

    # ---- parsing and validation ----------------------------------------------------------
    async def read_body(self, request: Request) -> bytes:
        """The body, or OpenAIError(413) as soon as it exceeds max_body_bytes; 415 for a
        compressed body (a gzip body read as JSON said "malformed JSON: 'utf-8' codec", which
        names the wrong fault; new-user attack, session 37)."""
        coding = request.headers.get("content-encoding", "").strip().lower()
        if coding not in ("", "identity"):
            raise OpenAIError(
                f"Content-Encoding {coding[:40]!r} is not supported: send the JSON body "
                "uncompressed", status=415, code="unsupported_media_type")
        limit = self.max_body_bytes
        too_large = OpenAIError(
            f"request body too large: the limit is {limit} bytes",
            status=413,
            code="request_too_large",
        )
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    async def parse(self, request: Request, model_cls):
        body = await self.read_body(request)
        encoding = json.detect_encoding(body)  # UTF-8 (optional BOM), or UTF-16/32
        try:
            text = body.decode(encoding)  # strict: invalid UTF-8, raw surrogates -> 400
        except UnicodeDecodeError as e:
            raise OpenAIError(f"malformed JSON body: {e}") from None
        too_deep = OpenAIError(
            f"malformed JSON body: nested too deeply (more than {MAX_JSON_DEPTH} levels)"
        )
        if json_too_deep(body if encoding.startswith("utf-8") else text.encode("utf-8")):
            raise too_deep
        try:
            data = json.loads(text)
        except ValueError as e:  # JSONDecodeError, and ints over Python's 4300-digit limit
            raise OpenAIError(f"malformed JSON body: {e}") from None
        except RecursionError:
            raise too_deep from None
        if not isinstance(data, dict):
            raise OpenAIError("request body must be a JSON object")
        check_json_body(data, text)  # lone surrogates anywhere, named by field
        if model_cls is ChatCompletionRequest:
            self.check_chat_size(data)
        try:
            req = model_cls.model_validate(data)
        except ValidationError as e:
            raise validation_error_to_openai(e) from None
        if req.model is not None and req.model != self.model_name:
            raise OpenAIError(
                f"The model {shown(req.model, 100)} does not exist (this server serves "
                f"`{self.model_name}`).",
                status=404,
                param="model",
                code="model_not_found",
            )
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
                         tools: list[dict] | None = None) -> list[list[int]]:
        """Each prompt's token ids (one but for a completions batch); tools: a chat request's
        active_tools, rendered."""
        if isinstance(req, ChatCompletionRequest):
            try:
                text = await self._tokenize(
                    self.tokenizer.apply_chat_template,
                    [m.to_template() for m in req.messages],
                    add_generation_prompt=req.add_generation_prompt,
                    enable_thinking=req.enable_thinking,
                    tools=tools,
                )
            except ValueError as e:
                raise OpenAIError(f"invalid messages: {e}", param="messages") from None
            return [await self.encode(text, "messages")]
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

    def max_tokens(self, req, prompt_len: int, prompt_param: str) -> int:
        """Completion budget: the requested max_tokens, or all the context the prompt leaves."""
        limit, requested, param = self.max_model_len, req.requested_max_tokens, req.max_tokens_param
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
            request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            streams = await self.start(req, request_id, prompts, max_tokens, params)
            n = req.n or 1
            # the thinking split only where the output starts at the template's generation
            # prompt (which opens the think block); with add_generation_prompt false it does not
            opens_think = chat and req.add_generation_prompt and req.enable_thinking
            thinking = (req.enable_thinking
                        if chat and self.reasoning_parser and req.add_generation_prompt else None)
            num_prompt_tokens = sum(len(p) for p in prompts)  # usage counts each prompt once
            fmts = [_Formatter(request_id, self.model_name, chat, num_prompt_tokens,
                               req.include_usage, thinking, tools, index=i,
                               logprobs=req.logprobs_k, tokenizer=self.tokenizer,
                               raw_thinking=opens_think and not self.reasoning_parser,
                               max_calls=req.max_tool_calls if chat else None,
                               forced=chat and req.forced_tool_calls, prompt_no=i // n)
                    for i in range(len(streams))]
            trackers = [self.metrics.request(arrival, len(prompts[k // n]))
                        for k in range(len(streams))]
            if req.stream:
                return StreamingResponse(
                    self.stream_events(streams, fmts, trackers),
                    media_type="text/event-stream",
                    headers=SSE_HEADERS,
                    # Runs also when the client left before the body started: frees the engine.
                    background=BackgroundTask(_end_streams, streams, trackers),
                )
            return await self.complete(request, streams, fmts, trackers)
        except OpenAIError as e:
            return error_response(e)
        except ClientDisconnect:  # left before its body was complete: nothing was started
            logger.info("client left before sending the whole body of %s", request.url.path)
            return error_response(OpenAIError("client disconnected while sending the body"))
        except Exception as e:  # one bad request must not take the server down
            logger.exception("unexpected error while handling %s", request.url.path)
            return error_response(_internal_error(e))

    async def start(self, req, request_id: str, prompts: list[list[int]], max_tokens: list[int],
                    params: list[str]) -> list[RequestStream]:
        """The request's engine requests: `n` choices of each prompt, choice k = prompt * n +
        i (ids `<request_id>-<k>` when there are several), each with its own SamplingParams; a
        seeded request's choice i of a prompt draws with seed + i (else the n choices would be
        the same text). If one cannot start, every one is aborted; params: each prompt's name
        in errors (`prompt[k]` in a batch)."""
        n = req.n or 1
        total = len(prompts) * n
        streams: list[RequestStream] = []
        for k in range(total):
            i = k % n
            sampling = req.sampling_params(max_tokens[k // n], self.sampling_defaults)
            if i and sampling.seed is not None:  # wraps within int64, as a seed may be
                sampling.seed = (sampling.seed + i + 2**63) % 2**64 - 2**63
            child_id = request_id if total == 1 else f"{request_id}-{k}"
            streams.append(self.engine.generate(child_id, prompts[k // n], sampling))
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
                raise OpenAIError(str(e), param=_grammar_param(str(e)) or params[k // n]) \
                    from None
            if isinstance(e, EngineDeadError):
                raise OpenAIError(
                    f"engine unavailable: {e}", status=503, type="service_unavailable"
                ) from None
            raise e
        return streams

    async def complete(self, request: Request, streams: list[RequestStream],
                       fmts: list[_Formatter], trackers: list[RequestMetrics]):
        """Non-streaming: aggregate every choice's deltas; abort all if the client disconnects
        meanwhile or one choice fails."""
        watcher = asyncio.create_task(self._abort_on_disconnect(request, streams))
        tasks = [asyncio.ensure_future(_collect(s, t, f))
                 for s, t, f in zip(streams, trackers, fmts)]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            # every failed task's error read (an unread one is logged at garbage collection)
            errors = [e for t in tasks if t in done and (e := t.exception()) is not None]
            if errors:
                raise errors[0]
            results = [t.result() for t in tasks]
        finally:
            watcher.cancel()
            for s, tracker in zip(streams, trackers):
                tracker.finish("abort")  # no-op when its last output was seen
                s.abort()  # no-op when finished
            for t in tasks:  # the others end once aborted; their errors are not the answer
                t.cancel()
        choices = [choice for choice, _ in results]
        return JSONResponse(fmts[0].response(choices, sum(n for _, n in results),
                                             _cached_tokens(fmts)).model_dump())

    async def _abort_on_disconnect(self, request: Request, streams: list[RequestStream]) -> None:
        while not all(s.finished for s in streams):
            await asyncio.sleep(self.disconnect_poll_s)
            if await request.is_disconnected():
                logger.info("client disconnected; aborting %s", streams[0].request_id)
                for s in streams:
                    s.abort()
                return

    async def stream_events(self, streams: list[RequestStream], fmts: list[_Formatter],
                            trackers: list[RequestMetrics]) -> AsyncIterator[str]:
        """SSE body: every choice's chunks as they come (each names its index). Cancellation
        (client disconnect) lands in `finally` and aborts every choice."""
        num_tokens = 0
        ended: set[int] = set()
        try:
            for fmt in fmts:
                first = fmt.first_chunk()
                if first is not None:
                    yield first
            async for i, out in _outputs(streams):
                if i in ended:  # a choice ended by its first call (parallel_tool_calls false)
                    continue
                fmt = fmts[i]
                trackers[i].output(out)
                if out.error is not None:
                    err = _engine_error(out)
                    yield _sse(err.to_dict())
                    yield "data: [DONE]\n\n"
                    return
                num_tokens += len(out.delta_token_ids)
                text, reasoning, calls, finish = fmt.delta(out)
                if fmt.stopped:  # its one call ended: the rest of the answer is not wanted
                    ended.add(i)
                    trackers[i].finish("stop")
                    streams[i].abort()
                # a delta's logprobs go with it, also where its text is held back
                lp = fmt.logprobs_payload(out.delta_token_ids, out.delta_logprobs)
                if text or reasoning or calls or lp or finish is not None:
                    yield fmt.chunk(text, finish, reasoning, calls, lp)
                if len(ended) == len(streams):
                    break
            if fmts[0].include_usage:
                yield fmts[0].usage_chunk(num_tokens, _cached_tokens(fmts))
            yield "data: [DONE]\n\n"
        except Exception as e:  # headers are sent; report in-band
            logger.exception("unexpected error while streaming %s", streams[0].request_id)
            for tracker in trackers:
                tracker.finish("error")
            yield _sse(_internal_error(e).to_dict())
            yield "data: [DONE]\n\n"
        finally:
            for s, tracker in zip(streams, trackers):
                tracker.finish("abort")  # no-op when its last output was seen
                s.abort()  # no-op when finished


def _cached_tokens(fmts: list["_Formatter"]) -> int:
    """Prompt tokens the prefix cache supplied, each prompt counted once (as usage counts its
    tokens): the most any of its choices got (they may hit or not, by their admission)."""
    best: dict[int, int] = {}
    for f in fmts:
        best[f.prompt_no] = max(best.get(f.prompt_no, 0), f.cached_tokens)
    return sum(best.values())


async def _collect(stream: RequestStream, tracker: RequestMetrics, fmt: _Formatter):
    """One choice's whole answer, through the splitters a stream uses (so both give the same
    answer): (its choice object, completion tokens)."""
    text: list[str] = []
    reasoning: list[str] = []
    calls: list[ToolCallDelta] = []
    ids: list[int] = []
    lps: list[TokenLogprob] = []
    num_tokens, finish = 0, None
    try:
        async for out in stream:
            tracker.output(out)
            if out.error is not None:
                raise _engine_error(out)
            num_tokens += len(out.delta_token_ids)
            if out.delta_logprobs is not None:
                ids += out.delta_token_ids
                lps += out.delta_logprobs
            t, r, c, finish = fmt.delta(out)
            text.append(t)
            reasoning.append(r)
            calls += c
            if fmt.stopped:  # its one call ended (parallel_tool_calls false)
                tracker.finish("stop")
                stream.abort()  # now, not once the other choices are done
                break
    except Exception:
        tracker.finish("error")  # as stream_events counts it
        raise
    choice = fmt.choice("".join(text), "".join(reasoning), calls, finish,
                        fmt.logprobs_payload(ids, lps))
    return choice, num_tokens


async def _outputs(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) of every stream until each has finished, in arrival order. One
    stream (n = 1, nearly every request) is read directly: no task or queue per token."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
            if out.finished:
                return
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await queue.put((i, out, None))
                if out.finished:
                    break
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the reader, which raises it
            await queue.put((i, None, e))
            return
        await queue.put((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            i, out, exc = await queue.get()
            if exc is not None:
                raise exc
            if out is None:
                running -= 1
                continue
            yield i, out
    finally:
        for t in tasks:
            t.cancel()


async def _end_streams(streams: list[RequestStream], trackers: list[RequestMetrics]) -> None:
    """A stream response's background task: also runs when the client left before the body
    started (the generator never ran): the request counts as aborted and leaves the engine."""
    for stream, tracker in zip(streams, trackers):
        tracker.finish("abort")  # no-op when the body's `finally` already counted it
        stream.abort()


def _grammar_param(message: str) -> str | None:
    """The request field a structured-output error is about (the engine's messages start with
    it: engine/grammar.py), else None."""
    for field in ("response_format", "structured_outputs", "tool_choice"):
        if message.startswith(field):
            return field
    return None


def _engine_error(out: RequestOutput) -> OpenAIError:
    """The error of a request the engine failed: a 400 when it was the request's fault (a
    grammar that failed to compile after admission), else a 500."""
    if out.bad_request:
        return OpenAIError(out.error, param=_grammar_param(out.error))
    return OpenAIError(f"engine error: {out.error}", status=500, type="server_error")


def _internal_error(e: Exception) -> OpenAIError:
    return OpenAIError(
        f"internal server error: {type(e).__name__}: {e}", status=500, type="server_error"
    )


class _Formatter:
    """Builds the response objects of one request for either API."""

    def __init__(self, request_id, model, chat, prompt_tokens, include_usage,
                 thinking: bool | None = None, tools: list[dict] | None = None,
                 index: int = 0, logprobs: int | None = None, tokenizer=None,
                 raw_thinking: bool = False, max_calls: int | None = None,
                 forced: bool = False, prompt_no: int = 0) -> None:
        self.request_id, self.model, self.chat = request_id, model, chat
        self.index = index  # the choice this formatter renders (n > 1: one formatter each)
        # the prompt of the batch it answers, and the prompt tokens the prefix cache supplied
        # (the engine's num_cached_tokens; usage's prompt_tokens_details.cached_tokens)
        self.prompt_no, self.cached_tokens = prompt_no, 0
        # SamplingParams.logprobs of the request (None: none); the tokenizer names the tokens
        self.logprobs_k, self._tokenizer = logprobs, tokenizer
        self._text_offset = 0  # completions' text_offset of the next token
        # the tokens' bytes decoded as the detokenizer does: a character split over tokens
        # counts once it is whole
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self.prompt_tokens, self.include_usage = prompt_tokens, include_usage
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
        self.tool_splitter = ToolCallSplitter(tools, max_calls, forced) if tools else None
        self.gate = ThinkGate() if tools and raw_thinking else None
        self.created = unix_now()  # one timestamp for every chunk of a stream (OpenAI's rule)
        # OpenAI sends "usage": null on every chunk only when include_usage is set.
        self._exclude = None if include_usage else {"usage"}
        # chunk() before / after the text, for content and for reasoning deltas
        self._templates: dict[str, list[str]] = {}

    def _envelope(self, choices):
        cls = ChatCompletionChunk if self.chat else CompletionStreamResponse
        return cls(id=self.request_id, created=self.created, model=self.model, choices=choices)

    def first_chunk(self) -> str | None:
        if not self.chat:
            return None
        choice = ChatChunkChoice(index=self.index,
                                 delta=DeltaMessage(role="assistant", content=""))
        return _sse(self._envelope([choice]), self._exclude)

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
        # (after the split: "tool_calls" once a call was seen, this delta's included)
        if self.stopped:
            return text, reasoning, calls, "tool_calls"
        finish = self.finish_reason(_finish_reason(out)) if out.finished else None
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
        tokens = [self._token(t)["token"] for t in ids]
        offsets = []
        is_special = getattr(self._tokenizer, "is_special", None)
        for t in ids:  # where each token's text starts in the returned text (characters)
            offsets.append(self._text_offset)
            if is_special is None or not is_special(t):  # (special tokens give no text)
                self._text_offset += len(self._utf8.decode(self._tokenizer.token_bytes(t)))
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{**{self._token(i)["token"]: v for i, v in lp.top},
                              tok: lp.logprob} for tok, lp in zip(tokens, lps)],
            "text_offset": offsets,
        }

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
        if finish is None and bool(text) != bool(reasoning) and not calls and not logprobs:
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
        return _sse(self._envelope([choice]), self._exclude)

    def usage_chunk(self, completion_tokens: int, cached_tokens: int = 0) -> str:
        env = self._envelope([])
        env.usage = UsageInfo.of(self.prompt_tokens, completion_tokens, cached_tokens)
        return _sse(env)

    def choice(self, text: str, reasoning: str, calls: list[ToolCallDelta], finish: str | None,
               logprobs: dict | None = None) -> ChatChoice | CompletionChoice:
        """This choice of a non-streaming response, from the joined `split` pieces of all its
        deltas (and the `logprobs_payload` of all its tokens). With the thinking split, an
        empty reasoning is null, and so is the answer when the reasoning never ended or the
        answer is empty; content is null beside calls when the model wrote none (OpenAI)."""
        if not self.chat:
            return CompletionChoice(index=self.index, text=text, finish_reason=finish,
                                    logprobs=logprobs)
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
        cls = ChatCompletionResponse if self.chat else CompletionResponse
        return cls(id=self.request_id, model=self.model, choices=choices, usage=usage)


def build_app(
    async_engine: AsyncEngine,
    tokenizer,
    served_model_name: str,
    max_model_len: int,
    *,
    sampling_defaults: dict | None = None,
    disconnect_poll_s: float = 0.5,
    max_body_bytes: int | None = None,
    reasoning_parser: str | None = None,
) -> FastAPI:
    """The FastAPI app. Its lifespan starts `async_engine` (idempotent) and shuts it down.

    sampling_defaults: values for omitted sampling fields (temperature, top_p, top_k, min_p,
    presence/frequency/repetition_penalty, seed), e.g. from the model's generation_config.json.
    disconnect_poll_s: how often a non-streaming request checks whether its client left.
    max_body_bytes: larger request bodies get 413 (None: `default_max_body_bytes`, 256 bytes a
    token of max_model_len, 2 to 32 MiB).
    reasoning_parser: "qwen3" splits chat answers into the reasoning (`reasoning` and
    `reasoning_content`) and content (`reasoning.py`); None leaves content the raw text.
    """
    server = _Server(
        async_engine,
        tokenizer,
        served_model_name,
        max_model_len,
        sampling_defaults,
        disconnect_poll_s,
        max_body_bytes,
        reasoning_parser,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(async_engine.shutdown)
            server.tokenizer_pool.shutdown(wait=False)

    # redirect_slashes off: `/v1/completions/` got a 307 to wherever the Host header pointed
    # (an OpenAI client does not follow it and fails obscurely); now a 404 in the OpenAI format
    app = FastAPI(title="tailored", lifespan=lifespan, docs_url=None, redoc_url=None,
                  redirect_slashes=False)
    app.state.server = server

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            err = OpenAIError(
                f"route {request.method} {request.url.path} not found",
                status=404,
                type="not_found_error",
                code="not_found",
            )
        elif exc.status_code == 405:
            err = OpenAIError(
                f"method {request.method} not allowed for {request.url.path}",
                status=405,
                type="invalid_request_error",
                code="method_not_allowed",
            )
        else:
            err = OpenAIError(str(exc.detail), status=exc.status_code)
        return error_response(err, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return error_response(OpenAIError(f"invalid request: {exc.errors()}"))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(_internal_error(exc))

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics():
        return Response(await server.metrics.render(async_engine), media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' health checks
    async def health():
        if async_engine.healthy:
            return {"status": "ok"}
        return JSONResponse(
            {"status": "error", "message": async_engine.dead_reason or "engine not running"},
            status_code=503,
        )

    def model_card() -> ModelCard:
        return ModelCard(id=served_model_name, max_model_len=max_model_len)

    def engine_gone() -> JSONResponse | None:
        """503 once the engine is dead: load generators and routers read /v1/models to find a
        server to send work to, and a dead one answered 200 there while every request got 503."""
        if async_engine.healthy:
            return None
        return error_response(OpenAIError(
            f"engine unavailable: {async_engine.dead_reason or 'engine not running'}",
            status=503, type="service_unavailable"))

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def list_models():
        return engine_gone() or ModelList(data=[model_card()]).model_dump()

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
    async def get_model(model_id: str):
        if (gone := engine_gone()) is not None:
            return gone
        if model_id != served_model_name:
            return error_response(
                OpenAIError(
                    f"The model {shown(model_id, 100)} does not exist.",
                    status=404,
                    param="model",
                    code="model_not_found",
                )
            )
        return model_card().model_dump()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await server.handle(request, chat=True)

    return app
