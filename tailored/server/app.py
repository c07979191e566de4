"""OpenAI-compatible HTTP routes over an `AsyncEngine`.

    GET  /health                200 {"status": "ok"} | 503 once the engine loop is dead/stopped,
                                or while it is stalled (loop_watch.py) (HEAD too; a trailing
                                slash on any route is a 404, no redirect)
    GET  /health_generate       the deep probe: one generated token (worker_api.py)
    GET  /v1/loads              SGLang's load report, for gateways; POST /flush_cache,
                                /reset_prefix_cache: drop the prefix cache (worker_api.py)
    GET  /v1/models             OpenAI model list with the one served model (+ max_model_len);
                                503 once the engine loop is dead, as /health
    GET  /v1/models/{id}        that model, or 404 model_not_found (503 as above)
    POST /v1/completions        text or token-id prompt, or a batch of them
    POST /v1/chat/completions   messages -> tokenizer.apply_chat_template -> encode
    POST /v1/responses          the OpenAI Responses API (Codex CLI, the Agents SDK), on the
                                chat path (responses_api.py); GET /v1/responses/{id}: a
                                stored response
    POST /v1/messages           the Anthropic Messages API (Claude Code), on the chat path
                                (messages_api.py); POST /v1/messages/count_tokens
    POST /tokenize, /detokenize vLLM's tokenizer routes; GET /tokenizer_info (lm-eval's
                                remote tokenizer finds them: tokenize_api.py)
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

Chat output and tools: formatter.py (the reasoning split: reasoning.py; tool calls:
tool_calls.py). tool_choice "required" (one or more calls) or a named function (one call of it)
holds the answer after the thinking to the tool-call format by a grammar (engine/grammar.py;
needs xgrammar, as response_format).

Errors are OpenAI JSON `{"error": {"message", "type", "param", "code"}}`: 400 bad input or
unsupported parameter (or a Host header outside the allow-list), 401 a missing or wrong API
key, 404 unknown model/route, 405 wrong method, 413 body over max_body_bytes, 415 compressed
body (Content-Encoding other than identity) or a non-JSON Content-Type, 500 engine or server
fault, 503 engine loop dead or stalled. Hosts, keys and content types are checked before any
route (guard.py's middleware). A streaming request that fails after the headers were sent gets
`data: {"error": {...}}` and then `data: [DONE]`. Error bodies are rendered with ensure_ascii
and messages quote user input escaped and shortened. Input limits (body size, JSON depth, lone
surrogates, prompt characters): http_io.py and serving.py.

Usage counts what was returned: prompt_tokens = prompt length, completion_tokens = number of
token ids in the deltas that were sent (summed over the choices); `n` choices are n engine
requests of the one prompt (serving.py, streaming.py). Metrics count each choice as a request.

The modules: app.py (this: the app and its routes), serving.py (`Server`: parse, prompt,
budget, start), streaming.py (streamed and whole answers), answer.py (an answer's split:
reasoning, tool calls, finish), formatter.py (OpenAI chat / completions objects), http_io.py
(bodies in, errors and SSE out), protocol.py and the *_protocol.py modules (the request and
response schemas); the coding agents' front doors: front_doors.py (their request flow),
responses_api.py + responses_input.py + response_store.py (OpenAI Responses),
messages_api.py (Anthropic Messages), conversation.py (their conversations as chat
messages), thinking_budget.py (a token limit on the thinking); the front door: guard.py (hosts,
API keys, content types), serve_options.py (their `tailored serve` options); for gateways:
worker_api.py (docs/scale-out.md). docs/agents.md: how to point
Codex CLI and Claude Code at the server.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tailored import flags
from tailored.server.access_log import AccessLog
from tailored.server.async_engine import AsyncEngine
from tailored.server.errors import OpenAIError, shown
from tailored.server.http_io import error_response, internal_error
from tailored.server.metrics import CONTENT_TYPE_LATEST
from tailored.server.protocol import ModelCard, ModelList
from tailored.server.front_doors import count_tokens, serve_turn
from tailored.server.guard import AccessPolicy, Guard
from tailored.server.messages_api import MessagesDialect
from tailored.server.response_store import ResponseStore
from tailored.server.responses_api import ResponsesDialect
from tailored.server.serving import Server
from tailored.server.tokenize_api import add_tokenizer_routes
from tailored.server.worker_api import add_worker_routes

logger = logging.getLogger(__name__)


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
    access_log: bool = False,
    access: AccessPolicy | None = None,
    profile: dict | None = None,
) -> FastAPI:
    """The FastAPI app. Its lifespan starts `async_engine` (idempotent) and shuts it down.

    sampling_defaults: values for omitted sampling fields (temperature, top_p, top_k, min_p,
    presence/frequency/repetition_penalty, seed), e.g. from the model's generation_config.json.
    disconnect_poll_s: how often a non-streaming request checks whether its client left.
    max_body_bytes: larger request bodies get 413 (None: `default_max_body_bytes`, 256 bytes a
    token of max_model_len, 2 to 32 MiB).
    reasoning_parser: "qwen3" splits chat answers into the reasoning (`reasoning` and
    `reasoning_content`) and content (`reasoning.py`); None leaves content the raw text.
    access_log: one log line per request (access_log.py; `tailored serve` turns it on).
    access: API keys, their exempt routes and the Host allow-list (guard.py; None: no key,
    any host). Non-JSON POST bodies get 415 either way.
    profile: the `tailored serve --profile` summary (name, sha256, engine, switches), which
    /version and /metrics (tailored:profile_info) carry; None: no profile.
    """
    server = Server(
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
    if profile is not None:
        server.metrics.set_profile(profile["name"], profile["sha256"])
    if access is not None:
        server.access = access
    app.add_middleware(Guard, policy=server.access)  # hosts, keys, content types (guard.py)
    if access_log:  # outermost (added last): its line names the guard's refusals too
        app.add_middleware(AccessLog)

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
        return error_response(internal_error(exc))

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

    @app.get("/version")
    async def version():
        """What this server is: the package version and every switch it runs with
        (tailored/flags.py), which `tailored bench` records in its manifest."""
        return {"version": _package_version(), "switches": flags.current().snapshot(),
                "profile": profile}

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

    add_tokenizer_routes(app, server)  # /tokenize, /detokenize, /tokenizer_info
    add_worker_routes(app, server)  # a gateway's: /v1/loads, /flush_cache, /health_generate

    # the coding agents' front doors, on the chat engine path (front_doors.py)
    responses = ResponsesDialect(server, ResponseStore())
    messages = MessagesDialect(server)

    @app.post("/v1/responses")
    async def create_response(request: Request):
        return await serve_turn(server, request, responses)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        found = responses.store.get(response_id)
        if found is None:
            return error_response(OpenAIError(
                f"response {shown(response_id, 100)} not found (kept only with store: true, "
                "and only the most recent)", status=404, param="response_id",
                code="not_found"))
        return found

    @app.post("/v1/messages")
    async def create_message(request: Request):
        return await serve_turn(server, request, messages)

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(request: Request):
        return await count_tokens(server, request, messages)

    return app


def _package_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("tailored")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"
