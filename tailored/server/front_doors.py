"""The request flow of the coding agents' front doors: the OpenAI Responses API
(responses_api.py) and the Anthropic Messages API (messages_api.py), on the engine path of
Chat Completions.

A dialect translates its request into a `ChatCompletionRequest` (`Turn.chat`: the same chat
template, tools, tool_choice grammar, structured output and sampling as /v1/chat/completions)
and renders the answer in its own shape. Between the two, everything is the chat route's:
`Server.prompt_ids` (template + encode off the event loop), `Server.max_tokens`,
`Server.start` (with the thinking budget, thinking_budget.py), `AnswerSplitter` and
`answer_pieces` (reasoning split, tool-call parsing, metrics, aborts; answer.py). The reasoning
is always split out here (both dialects have a channel for it), whatever `--reasoning-parser`
says for chat.

A dialect object (one per app) has:
    route                           its path (the metrics label)
    keep_ids                        whether its renderer needs every token id and the raw text
    new_id()                        a response id
    translate(data, server, counting=False) -> Turn
                                    the body (screened JSON) as a chat request, or raises
                                    OpenAIError; counting: for count_tokens (no max_tokens)
    renderer(turn, request_id, prompt_tokens, splitter) -> a renderer of one answer:
        start() / piece(Piece) / finish() / fail(OpenAIError) -> SSE event strings
        body(Answer) -> the whole response (non-streaming)
    error_response(OpenAIError) -> a Response in its error shape
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.requests import ClientDisconnect

from tailored.server.access_log import record
from tailored.server.answer import AnswerSplitter, answer_pieces, collect_watched
from tailored.server.chat_protocol import ChatCompletionRequest
from tailored.server.errors import OpenAIError
from tailored.server.http_io import SSE_HEADERS, internal_error, read_json
from tailored.server.streaming import end_streams

logger = logging.getLogger(__name__)


@dataclass
class Turn:
    """A dialect's request as the chat engine path runs it.

    chat: the translated request; prompt_param / max_tokens_param: the dialect's names of the
    prompt and the completion budget (errors name them); thinking_budget: tokens of thinking
    before the server closes it (None: no limit); context: the dialect's own (its parsed
    request, ...); clamp_max_tokens: cut a budget larger than the context leaves instead of
    a 400 (`clamped` then says it was cut)."""

    chat: ChatCompletionRequest
    prompt_param: str
    max_tokens_param: str
    thinking_budget: int | None = None
    context: Any = None
    # a completion budget over what the prompt leaves is cut to it (Server.max_tokens);
    # `clamped` tells the renderer it was
    clamp_max_tokens: bool = False
    clamped: bool = False


async def serve_turn(server, request: Request, dialect) -> Response:
    """One request of a front door, answered in its dialect (errors too)."""
    arrival = time.monotonic()  # TTFT and end-to-end latency count from here
    response = await _serve_turn(server, request, dialect, arrival)
    server.metrics.http_response(dialect.route, response.status_code)
    return response


async def _serve_turn(server, request: Request, dialect, arrival: float) -> Response:
    try:
        server.authorize(request)
        turn = dialect.translate(await read_json(request, server.max_body_bytes), server)
        req = turn.chat
        tools = req.active_tools  # (dumped once: a list can be long)
        [prompt] = await server.prompt_ids(req, tools, turn.prompt_param)
        max_tokens = server.max_tokens(req, len(prompt), turn.prompt_param,
                                       turn.max_tokens_param, turn.clamp_max_tokens)
        turn.clamped = max_tokens < (req.requested_max_tokens or max_tokens)
        request_id = dialect.new_id()
        [stream] = await server.start(req, request_id, [prompt], [max_tokens],
                                      [turn.prompt_param], turn.thinking_budget)
        splitter = AnswerSplitter(req.enable_thinking, tools, max_calls=req.max_tool_calls,
                                  forced=req.forced_tool_calls,
                                  exact=req.grammar_tool_calls)
        tracker = server.metrics.request(arrival, len(prompt))
        record(request, len(prompt), [tracker])  # (the access log's counts)
        renderer = dialect.renderer(turn, request_id, len(prompt), splitter)
        if req.stream:
            return StreamingResponse(
                turn_events(renderer, stream, splitter, tracker),
                media_type="text/event-stream",
                headers=SSE_HEADERS,
                # Runs also when the client left before the body started: frees the engine.
                background=BackgroundTask(end_streams, [stream], [tracker]),
            )
        answer = await collect_watched(request, stream, splitter, tracker,
                                       server.disconnect_poll_s, dialect.keep_ids)
        return JSONResponse(renderer.body(answer))
    except OpenAIError as e:
        return dialect.error_response(e)
    except ClientDisconnect:  # left before its body was complete: nothing was started
        logger.info("client left before sending the whole body of %s", request.url.path)
        return dialect.error_response(OpenAIError("client disconnected while sending the body"))
    except Exception as e:  # one bad request must not take the server down
        logger.exception("unexpected error while handling %s", request.url.path)
        return dialect.error_response(internal_error(e))


async def turn_events(renderer, stream, splitter: AnswerSplitter,
                      tracker) -> AsyncIterator[str]:
    """The SSE body of a streamed turn: the renderer's events for each piece of the answer; an
    error after the headers were sent is reported in-band (`renderer.fail`). Cancellation
    (client disconnect) closes the pieces, which aborts the engine request."""
    try:
        for event in renderer.start():
            yield event
        async with contextlib.aclosing(answer_pieces(stream, splitter, tracker)) as pieces:
            async for piece in pieces:
                for event in renderer.piece(piece):
                    yield event
        for event in renderer.finish():
            yield event
    except OpenAIError as e:  # the engine failed the request
        for event in renderer.fail(e):
            yield event
    except Exception as e:  # headers are sent; report in-band
        logger.exception("unexpected error while streaming %s", stream.request_id)
        for event in renderer.fail(internal_error(e)):
            yield event


async def count_tokens(server, request: Request, dialect) -> Response:
    """The prompt length a request would have (the Messages API's count_tokens), without
    running it: {"input_tokens": n}."""
    try:
        server.authorize(request)
        turn = dialect.translate(await read_json(request, server.max_body_bytes), server,
                                 counting=True)
        req = turn.chat
        [prompt] = await server.prompt_ids(req, req.active_tools, turn.prompt_param)
        return JSONResponse({"input_tokens": len(prompt)})
    except OpenAIError as e:
        return dialect.error_response(e)
    except ClientDisconnect:
        return dialect.error_response(OpenAIError("client disconnected while sending the body"))
    except Exception as e:
        logger.exception("unexpected error while handling %s", request.url.path)
        return dialect.error_response(internal_error(e))
