"""The OpenAI Responses API (POST /v1/responses) on the Chat Completions engine path
(front_doors.py): a request becomes a `ChatCompletionRequest`, the answer comes back as
Responses output items, streamed as the event sequence the SDKs and Codex CLI parse.

Request -> chat (see also responses_protocol.py):
- `instructions`, then `input` (a string: one user message; or items: messages with text
  parts, `function_call`, `function_call_output`, `reasoning`), after the items of the
  `previous_response_id` chain (response_store.py), become chat messages (conversation.py);
  image, file and audio parts are refused (the model is served text-only), as are item types
  not listed;
- function `tools` (and the functions of a `namespace` tool, flattened: a name two namespaces
  share is qualified as `namespace.name` for the model) become chat tools; hosted tools
  (web_search, file_search, ...: responses_protocol.HOSTED_TOOL_TYPES) are not run here and
  are left out; custom (freeform) tools are refused;
- `tool_choice` auto / none / required / {"type": "function", "name"}, `parallel_tool_calls`,
  `text.format` (json_object, json_schema: chat's response_format, enforced by a grammar),
  `reasoning.effort` (none and minimal: thinking off; others on; absent: the template's
  default, on), `max_output_tokens`, `temperature`, `top_p`; vLLM's sampling extensions
  (top_k, min_p, seed, penalties, stop) and chat's logit_bias pass through as in chat.

Answer -> output items, in order: `reasoning` (the thinking, as a reasoning_text part; with
include ["reasoning.encrypted_content"] also sealed in encrypted_content, so clients that keep
only that still send the reasoning back: conversation.seal), `message` (output_text), one
`function_call` per call (call_id "call_...", arguments as JSON text, `namespace` for a
namespaced tool). Status: "completed", or "incomplete" (incomplete_details.reason
"max_output_tokens") when max_output_tokens cut the answer; usage with
input_tokens_details.cached_tokens (the prefix cache) and output_tokens_details.reasoning_tokens.

Streaming (SSE, `event: <type>` + `data: {...}`, each with sequence_number): response.created,
response.in_progress; per item response.output_item.added, for reasoning and message items
response.content_part.added, response.reasoning_text.delta / response.output_text.delta,
their .done events and response.content_part.done, for calls
response.function_call_arguments.delta / .done; response.output_item.done; then
response.completed (or response.incomplete). A failure after the headers were sent: an `error`
event, then response.failed. Errors before: OpenAI JSON errors naming the field.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from tailored.server.answer import Answer, AnswerSplitter, Piece, split_calls
from tailored.server.conversation import ChatBuilder, seal
from tailored.server.errors import OpenAIError, shown, validation_error_to_openai
from tailored.server.front_doors import Turn
from tailored.server.http_io import error_response
from tailored.server.protocol import unix_now
from tailored.server.response_store import ResponseStore
from tailored.server.responses_input import (PASSED_THROUGH, ToolNames, add_items,
                                             in_request_terms, response_format, tool_choice)
from tailored.server.responses_protocol import ResponsesRequest
from tailored.server.tool_calls import ToolCallDelta, join_calls

@dataclass
class ResponsesContext:
    req: ResponsesRequest
    own_items: list[Any]  # the request's input as items (stored with its response)
    tools: ToolNames


class ResponsesDialect:
    """POST /v1/responses for front_doors.serve_turn (one per app)."""

    route = "/v1/responses"
    keep_ids = False

    def __init__(self, server, store: ResponseStore) -> None:
        self.server, self.store = server, store

    @staticmethod
    def new_id() -> str:
        return f"resp_{uuid.uuid4().hex}"

    @staticmethod
    def error_response(err: OpenAIError):
        return error_response(err)

    def translate(self, data: dict, server, counting: bool = False) -> Turn:
        items = data.get("input")
        if isinstance(items, list):
            server.check_item_count(len(items), "input")
        try:
            req = ResponsesRequest.model_validate(data)
        except ValidationError as e:
            raise validation_error_to_openai(e) from None
        server.check_model(req.model)
        req.check_supported()
        tools = ToolNames(req.tools)
        own = ([{"type": "message", "role": "user", "content": req.input}]
               if isinstance(req.input, str) else list(req.input))
        builder = ChatBuilder()
        if req.instructions:
            builder.system(req.instructions)
        if req.previous_response_id is not None:
            add_items(builder, self.store.history(req.previous_response_id),
                      "previous_response_id", tools)
        add_items(builder, own, "input", tools)
        if not builder.messages:
            raise OpenAIError("input must hold at least one message or item", param="input")
        chat: dict[str, Any] = {"model": req.model, "messages": builder.build(),
                                "stream": req.stream}
        if tools.chat:
            chat["tools"] = tools.chat
            if req.tool_choice is not None:
                chat["tool_choice"] = tool_choice(req.tool_choice, tools)
        elif req.tool_choice not in (None, "auto", "none"):
            raise OpenAIError(f"tool_choice {shown(req.tool_choice)} needs function tools",
                              param="tool_choice")
        for key, value in (("parallel_tool_calls", req.parallel_tool_calls),
                           ("max_completion_tokens", req.max_output_tokens),
                           ("temperature", req.temperature), ("top_p", req.top_p),
                           ("response_format",
                            response_format(req.text.format if req.text else None))):
            if value is not None:
                chat[key] = value
        if req.reasoning is not None and req.reasoning.effort is not None:
            chat["reasoning_effort"] = req.reasoning.effort  # (chat maps it: protocol.py)
        extra = req.model_extra or {}
        for key in PASSED_THROUGH:
            if key in extra:
                chat[key] = extra[key]
        try:
            chat_req = server.chat_request(chat)
        except OpenAIError as e:
            raise in_request_terms(e, tools) from None
        return Turn(chat_req, "input", "max_output_tokens",
                    context=ResponsesContext(req, own, tools))

    def renderer(self, turn: Turn, request_id: str, prompt_tokens: int,
                 splitter: AnswerSplitter) -> ResponsesRenderer:
        return ResponsesRenderer(self, turn, request_id, prompt_tokens, splitter)


class ResponsesRenderer:
    """The output of one response: its events while streaming, its object at the end."""

    def __init__(self, dialect: ResponsesDialect, turn: Turn, request_id: str,
                 prompt_tokens: int, splitter: AnswerSplitter) -> None:
        self.dialect, self.ctx, self.chat = dialect, turn.context, turn.chat
        self.req: ResponsesRequest = self.ctx.req
        self.id, self.prompt_tokens, self.splitter = request_id, prompt_tokens, splitter
        self.created = unix_now()
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being streamed
        self.open_text: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}  # call index -> its item
        self.seq = 0
        self.num_tokens = 0
        self.reason: str | None = None  # the answer's finish reason, once known

    # ---- the response object -------------------------------------------------------------
    def _usage(self, num_tokens: int) -> dict[str, Any]:
        p, s = self.prompt_tokens, self.splitter
        return {"input_tokens": p,
                "input_tokens_details": {"cached_tokens": s.cached_tokens,
                                         "cache_write_tokens": 0},
                "output_tokens": num_tokens,
                "output_tokens_details": {"reasoning_tokens": s.reasoning_tokens},
                "total_tokens": p + num_tokens}

    def _response(self, status: str, usage: dict | None, error: dict | None = None,
                  incomplete: dict | None = None) -> dict[str, Any]:
        req, defaults = self.req, self.dialect.server.sampling_defaults
        fmt = (req.text.format if req.text else None) or {"type": "text"}
        return {
            "id": self.id, "object": "response", "created_at": self.created,
            "status": status, "background": False, "error": error,
            "incomplete_details": incomplete, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "max_tool_calls": None,
            "model": self.dialect.server.model_name, "output": list(self.items),
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None,
                          "summary": None},
            "store": req.stored,
            "temperature": req.temperature if req.temperature is not None
            else defaults.get("temperature", 1.0),
            "text": {"format": fmt}, "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [],
            "top_p": req.top_p if req.top_p is not None else defaults.get("top_p", 1.0),
            "truncation": "disabled", "usage": usage, "user": req.user,
            "metadata": req.metadata or {},
        }

    def _status(self) -> tuple[str, dict | None, dict | None]:
        """(status, incomplete_details, error) of the finished answer."""
        if self.reason == "length":
            return "incomplete", {"reason": "max_output_tokens"}, None
        if self.reason in (None, "stop", "tool_calls"):
            return "completed", None, None
        return "failed", None, {"code": "server_error",
                                "message": f"the generation ended: {self.reason}"}

    def _done(self, status: str, incomplete, error, num_tokens: int) -> dict[str, Any]:
        response = self._response(status, self._usage(num_tokens), error, incomplete)
        if self.req.stored and status != "failed":
            self.dialect.store.put(self.id, self.req.previous_response_id, self.ctx.own_items,
                                   self.items, response)
        return response

    # ---- items ---------------------------------------------------------------------------
    def _reasoning_item(self, text: str, status: str) -> dict[str, Any]:
        return {"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "summary": [],
                "content": [{"type": "reasoning_text", "text": text}],
                "encrypted_content": seal(text) if self.req.encrypted_reasoning else None,
                "status": status}

    @staticmethod
    def _message_item(text: str, status: str) -> dict[str, Any]:
        return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "status": status,
                "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [],
                             "logprobs": []}]}

    def _call_item(self, call_id: str, name: str | None, arguments: str,
                   status: str) -> dict[str, Any]:
        return {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": status,
                "call_id": call_id, **self.ctx.tools.item_fields(name),
                "arguments": arguments}

    def body(self, answer: Answer) -> dict[str, Any]:
        """The whole response (non-streaming)."""
        self.reason = answer.finish
        status, incomplete, error = self._status()
        item_status = "incomplete" if status == "incomplete" else "completed"
        if answer.reasoning:
            self.items.append(self._reasoning_item(answer.reasoning, item_status))
        if answer.text:
            self.items.append(self._message_item(answer.text, item_status))
        for call in join_calls(answer.calls):
            fn = call["function"]
            self.items.append(self._call_item(call["id"], fn["name"], fn["arguments"],
                                              item_status))
        return self._done(status, incomplete, error, answer.num_tokens)

    # ---- streaming -----------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def start(self) -> list[str]:
        response = self._response("in_progress", None)
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def piece(self, p: Piece) -> list[str]:
        self.num_tokens += len(p.out.delta_token_ids)
        if p.finish is not None:
            self.reason = p.finish
        events: list[str] = []
        if p.reasoning:
            events += self._append("reasoning", p.reasoning)
        # a delta's text and calls come apart: the arguments of the call already open were
        # written before its text (a call ends, text follows), new calls after it
        ongoing, new = split_calls(p.calls)
        for call in ongoing:
            events += self._call(call)
        if p.text:
            events += self._append("message", p.text)
        for call in new:
            events += self._call(call)
        return events

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def _open(self, item: dict[str, Any]) -> list[str]:
        events = self._close("completed")
        self.items.append(item)
        self.open, self.open_text = item, []
        events.append(self._event("response.output_item.added", output_index=len(self.items) - 1,
                                  item=item))
        part = {"reasoning": {"type": "reasoning_text", "text": ""},
                "message": {"type": "output_text", "text": "", "annotations": [],
                            "logprobs": []}}.get(item["type"])
        if part is not None:
            events.append(self._event("response.content_part.added", **self._where(),
                                      content_index=0, part=part))
        return events

    def _append(self, kind: str, text: str) -> list[str]:
        events: list[str] = []
        if self.open is None or self.open["type"] != kind:
            item = (self._reasoning_item("", "in_progress") if kind == "reasoning"
                    else self._message_item("", "in_progress"))
            item["content"] = []
            if kind == "reasoning":
                item["encrypted_content"] = None
            events += self._open(item)
        self.open_text.append(text)
        name = "response.reasoning_text.delta" if kind == "reasoning" \
            else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self._event(name, **self._where(), content_index=0, delta=text, **extra))
        return events

    def _call(self, call: ToolCallDelta) -> list[str]:
        events: list[str] = []
        if call.id is not None:
            item = self._call_item(call.id, call.name, "", "in_progress")
            self.calls[call.index] = item
            events += self._open(item)
        item = self.calls.get(call.index)
        if item is not None and item is self.open and call.arguments:
            self.open_text.append(call.arguments)
            events.append(self._event("response.function_call_arguments.delta",
                                      item_id=item["id"], output_index=len(self.items) - 1,
                                      delta=call.arguments))
        return events

    def _close(self, status: str) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        text = "".join(self.open_text)
        where = {"item_id": item["id"], "output_index": self.items.index(item)}
        item["status"] = status
        events = []
        if item["type"] == "function_call":
            item["arguments"] = text
            events.append(self._event("response.function_call_arguments.done", **where,
                                      name=item["name"], arguments=text))
        else:
            done = self._reasoning_item(text, status) if item["type"] == "reasoning" \
                else self._message_item(text, status)
            item.update({k: v for k, v in done.items() if k != "id"})
            part = item["content"][0]
            if item["type"] == "reasoning":
                events.append(self._event("response.reasoning_text.done", **where,
                                          content_index=0, text=text))
            else:
                events.append(self._event("response.output_text.done", **where,
                                          content_index=0, text=text, logprobs=[]))
            events.append(self._event("response.content_part.done", **where, content_index=0,
                                      part=part))
        events.append(self._event("response.output_item.done", output_index=where["output_index"],
                                  item=item))
        return events

    def finish(self) -> list[str]:
        status, incomplete, error = self._status()
        events = self._close("incomplete" if status == "incomplete" else "completed")
        response = self._done(status, incomplete, error, self.num_tokens)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            status, "response.failed")
        events.append(self._event(kind, response=response))
        return events

    def fail(self, err: OpenAIError) -> list[str]:
        """An error after the headers were sent: an `error` event, then response.failed."""
        events = self._close("incomplete")
        code = err.code or ("server_error" if err.status >= 500 else err.type)
        events.append(self._event("error", code=code, message=err.message, param=err.param))
        response = self._response("failed", self._usage(self.num_tokens),
                                  {"code": code, "message": err.message})
        events.append(self._event("response.failed", response=response))
        return events
