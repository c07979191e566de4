"""The Anthropic Messages API (POST /v1/messages, /v1/messages/count_tokens) on the Chat
Completions engine path (front_doors.py): a request becomes a `ChatCompletionRequest`, the
answer comes back as content blocks, streamed as Anthropic's SSE events.

Request -> chat (see also messages_protocol.py):
- `system` (a string or text blocks; Claude Code's billing-header block is dropped) and the
  `messages` become chat messages (conversation.py): user `text` blocks (a message's text
  blocks joined by blank lines), `tool_result` blocks (tool messages, their text or text
  blocks), assistant `text`, `thinking` (its text, or the reasoning its signature seals) and
  `tool_use` blocks; a `system` role message (Claude Code sends one) as system text; `image`
  and `document` blocks are refused (the model is served text-only); a last assistant message
  (prefill) is refused;
- `tools` (name, description, input_schema) become chat function tools; Anthropic's server
  tools (web_search_..., messages_protocol.SERVER_TOOL_PREFIXES) are left out, other typed
  tools refused; `tool_choice` auto / any (chat "required") / tool (a named function) / none,
  `disable_parallel_tool_use` (parallel_tool_calls false);
- `thinking` enabled / adaptive: thinking on (enabled with `budget_tokens`: the server ends
  the thinking after that many tokens, thinking_budget.py); disabled or absent: off;
- `max_tokens` (more than the prompt leaves of the context is cut to what it leaves, as
  Anthropic's API does: the answer then ends with stop_reason
  "model_context_window_exceeded"; Claude Code asks for 32000), `stop_sequences` (chat's
  stop, at most 4), `temperature`, `top_p`, `top_k`;
  `output_config.format` json_schema: chat's response_format.

Answer -> content blocks, in order: `thinking` (its text, or "" with display "omitted", and a
`signature` that seals the text: conversation.seal), `text`, one `tool_use` per call
(id "toolu_...", `input` the parsed arguments). stop_reason: "tool_use" (calls), "max_tokens",
"model_context_window_exceeded", "stop_sequence" (with `stop_sequence`, the one that
matched), else "end_turn". Usage:
input_tokens (not from the cache), cache_read_input_tokens (the prefix cache's),
cache_creation_input_tokens 0, output_tokens.

Streaming: message_start (with usage; sent with the first output, when the prefix cache's
share is known), ping, then per block content_block_start, content_block_delta (thinking_delta
and, at its end, signature_delta; text_delta; input_json_delta with the arguments as they are
written), content_block_stop; message_delta (stop_reason, stop_sequence, usage), message_stop.
A failure after the headers were sent: `event: error`. Errors before: Anthropic's error JSON.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from tailored.server.answer import Answer, AnswerSplitter, Piece, split_calls
from tailored.server.conversation import ChatBuilder, seal, unseal
from tailored.server.errors import OpenAIError, shown, validation_error_to_openai
from tailored.server.front_doors import Turn
from tailored.server.messages_protocol import (BILLING_HEADER, SERVER_TOOL_PREFIXES,
                                               MessagesRequest, anthropic_error_response,
                                               anthropic_error_type)
from tailored.server.protocol import MAX_STOP_STRINGS
from tailored.server.tool_calls import ToolCallDelta, join_calls
from tailored.server.tools_protocol import tool_name_error


def _text_blocks(content: Any, where: str, allowed: tuple[str, ...] = ("text",)) -> list[str]:
    """The texts of a content value (a string, or blocks of the `allowed` text types)."""
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise OpenAIError(f"invalid '{where}': must be a string or a list of content blocks "
                          f"(got {shown(content)})", param=where)
    out = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in allowed and isinstance(block.get("text"), str):
            out.append(block["text"])
        else:
            raise _bad_block(kind, block, f"{where}[{j}]")
    return out


def _bad_block(kind: Any, block: Any, where: str) -> OpenAIError:
    if kind in ("image", "document", "search_result", "container_upload"):
        return OpenAIError(f"'{where}': {kind} blocks are not supported: this server serves a "
                           "text-only model", param=where, code="unsupported_content")
    return OpenAIError(f"invalid '{where}': {shown(kind)} blocks are not accepted here (got "
                       f"{shown(block)})", param=where)


def _user(builder: ChatBuilder, content: Any, where: str) -> None:
    if isinstance(content, str):
        builder.user(content)
        return
    if not isinstance(content, list):
        raise OpenAIError(f"invalid '{where}': must be a string or a list of content blocks",
                          param=where)
    texts: list[str] = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_result":
            if texts:  # (Anthropic puts tool results first; any text before stays before)
                builder.user("\n\n".join(texts))
                texts = []
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str):
                raise OpenAIError(f"invalid '{where}[{j}].tool_use_id': must be a string",
                                  param=f"{where}[{j}].tool_use_id")
            result = block.get("content", "")
            builder.tool_result(call_id, "\n\n".join(
                _text_blocks(result, f"{where}[{j}].content")))
        else:
            raise _bad_block(kind, block, f"{where}[{j}]")
    if texts:
        builder.user("\n\n".join(texts))


def _assistant(builder: ChatBuilder, content: Any, where: str) -> None:
    if isinstance(content, str):
        builder.assistant_text(content)
        return
    if not isinstance(content, list):
        raise OpenAIError(f"invalid '{where}': must be a string or a list of content blocks",
                          param=where)
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            builder.assistant_text(block["text"])
        elif kind == "thinking":
            text = block.get("thinking") if isinstance(block.get("thinking"), str) else ""
            text = text or unseal(block.get("signature")) or ""
            if text:
                builder.reasoning(text)
        elif kind == "redacted_thinking":
            continue  # another server's sealed reasoning: nothing to render
        elif kind == "tool_use":
            name, args = block.get("name"), block.get("input", {})
            if not isinstance(block.get("id"), str) or not isinstance(name, str):
                raise OpenAIError(f"invalid '{where}[{j}]': a tool_use block needs a string "
                                  "'id' and 'name'", param=f"{where}[{j}]")
            if not isinstance(args, dict):
                raise OpenAIError(f"invalid '{where}[{j}].input': must be an object",
                                  param=f"{where}[{j}].input")
            builder.tool_call(block["id"], name, args)
        else:
            raise _bad_block(kind, block, f"{where}[{j}]")


def _tools(tools: list[Any] | None) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(tools or ()):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise OpenAIError(f"invalid '{where}': must be an object", param=where)
        kind = tool.get("type")
        if isinstance(kind, str) and kind.startswith(SERVER_TOOL_PREFIXES):
            continue  # run by Anthropic, not here: left out of the prompt
        if kind not in (None, "custom"):
            raise OpenAIError(f"invalid '{where}.type': {shown(kind)} tools are not served "
                              "here; declare a custom tool with an input_schema",
                              param=f"{where}.type")
        name = tool.get("name")
        if not isinstance(name, str) or (bad := tool_name_error(name)) is not None:
            raise OpenAIError(f"invalid '{where}.name': {bad or 'must be a string'}",
                              param=f"{where}.name")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise OpenAIError(f"invalid '{where}.input_schema': must be a JSON Schema object",
                              param=f"{where}.input_schema")
        fn: dict[str, Any] = {"name": name, "parameters": schema}
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """(chat tool_choice, parallel_tool_calls) of an Anthropic tool_choice."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") is True else None
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise OpenAIError(f"invalid 'tool_choice': {shown(choice)} (type auto, any, tool with a "
                      "name, or none)", param="tool_choice")


@dataclass
class MessagesContext:
    req: MessagesRequest


class MessagesDialect:
    """POST /v1/messages for front_doors.serve_turn (one per app)."""

    route = "/v1/messages"
    keep_ids = True  # the stop sequence that matched is read from the last token ids

    def __init__(self, server) -> None:
        self.server = server

    @staticmethod
    def new_id() -> str:
        return f"msg_{uuid.uuid4().hex}"

    @staticmethod
    def error_response(err: OpenAIError):
        return anthropic_error_response(err)

    def translate(self, data: dict, server, counting: bool = False) -> Turn:
        msgs = data.get("messages")
        if isinstance(msgs, list):
            server.check_item_count(len(msgs), "messages")
        try:
            req = MessagesRequest.model_validate(data)
        except ValidationError as e:
            raise validation_error_to_openai(e) from None
        server.check_model(req.model)
        req.check_supported(counting)
        builder = ChatBuilder()
        if req.system is not None:
            for text in _text_blocks(req.system, "system"):
                if not text.startswith(BILLING_HEADER):
                    builder.system(text)
        if not req.messages:
            raise OpenAIError("messages must not be empty", param="messages")
        for i, m in enumerate(req.messages):
            where = f"messages[{i}]"
            role = m.get("role") if isinstance(m, dict) else None
            content = m.get("content") if isinstance(m, dict) else None
            if role == "user":
                _user(builder, content, f"{where}.content")
            elif role == "assistant":
                if i == len(req.messages) - 1 and not counting:
                    raise OpenAIError(f"'{where}': a last assistant message (prefill) is not "
                                      "supported by this server", param=where,
                                      code="unsupported_parameter")
                _assistant(builder, content, f"{where}.content")
            elif role == "system":
                builder.system("\n\n".join(_text_blocks(content, f"{where}.content")))
            else:
                raise OpenAIError(f"invalid '{where}.role': {shown(role)} (user or assistant)",
                                  param=f"{where}.role")
        stops = req.stop_sequences or []
        if len(stops) > MAX_STOP_STRINGS:
            raise OpenAIError(f"at most {MAX_STOP_STRINGS} stop_sequences are served, got "
                              f"{len(stops)}", param="stop_sequences")
        chat: dict[str, Any] = {"model": req.model, "messages": builder.build(),
                                "stream": req.stream,
                                "chat_template_kwargs": {"enable_thinking": req.enable_thinking}}
        tools = _tools(req.tools)
        choice, parallel = _tool_choice(req.tool_choice)
        if tools:
            chat["tools"] = tools
            if choice is not None:
                chat["tool_choice"] = choice
        elif choice not in (None, "auto", "none"):
            raise OpenAIError(f"tool_choice {shown(req.tool_choice)} needs tools",
                              param="tool_choice")
        fmt = (req.output_config or {}).get("format")
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": fmt.get("schema")}}
        for key, value in (("max_tokens", req.max_tokens), ("stop", stops or None),
                           ("temperature", req.temperature), ("top_p", req.top_p),
                           ("top_k", req.top_k), ("parallel_tool_calls", parallel)):
            if value is not None:
                chat[key] = value
        return Turn(server.chat_request(chat), "messages", "max_tokens",
                    thinking_budget=req.thinking_budget, context=MessagesContext(req),
                    clamp_max_tokens=True)

    def renderer(self, turn: Turn, request_id: str, prompt_tokens: int,
                 splitter: AnswerSplitter) -> MessagesRenderer:
        return MessagesRenderer(self, turn, request_id, prompt_tokens, splitter)


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _parsed(arguments: str) -> Any:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except (ValueError, RecursionError):  # cut short (max_tokens): the text as it is
        return {"_unparsed_arguments": arguments}
    return value if isinstance(value, dict) else {"_unparsed_arguments": arguments}


class MessagesRenderer:
    """The output of one message: its events while streaming, its object at the end."""

    def __init__(self, dialect: MessagesDialect, turn: Turn, request_id: str,
                 prompt_tokens: int, splitter: AnswerSplitter) -> None:
        self.dialect, self.req, self.clamped = dialect, turn.context.req, turn.clamped
        self.id, self.prompt_tokens, self.splitter = request_id, prompt_tokens, splitter
        self.blocks: list[dict[str, Any]] = []  # the content blocks
        self.open: dict[str, Any] | None = None  # the block being streamed
        self.open_text: list[str] = []
        self.started = False
        self.num_tokens = 0
        self.ids: list[int] = []
        self.reason: str | None = None

    # ---- the message object --------------------------------------------------------------
    def _usage(self, output_tokens: int) -> dict[str, Any]:
        cached = self.splitter.cached_tokens
        return {"input_tokens": self.prompt_tokens - cached, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached, "output_tokens": output_tokens}

    def _message(self, stop_reason: str | None, stop_sequence: str | None,
                 output_tokens: int) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant",
                "model": self.dialect.server.model_name, "content": list(self.blocks),
                "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": self._usage(output_tokens)}

    def _stop(self, reason: str | None, ids: list[int]) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) of the finished answer."""
        if reason == "tool_calls":
            return "tool_use", None
        if reason == "length":  # the context window, when it left less than max_tokens
            return ("model_context_window_exceeded" if self.clamped else "max_tokens"), None
        stops = self.req.stop_sequences or []
        tok = self.dialect.server.tokenizer
        if reason == "stop" and stops and ids and ids[-1] not in set(tok.eos_token_ids):
            # the engine cut the stop string from the text; it is in the last tokens' text
            tail = tok.decode(ids[-(max(map(len, stops)) + 8):])
            found = [(tail.rfind(s), s) for s in stops if s in tail]
            if found:
                return "stop_sequence", max(found)[1]
        return "end_turn", None

    def _thinking_block(self, text: str) -> dict[str, Any]:
        return {"type": "thinking", "thinking": text if self.req.thinking_shown else "",
                "signature": seal(text)}

    def body(self, answer: Answer) -> dict[str, Any]:
        """The whole message (non-streaming)."""
        if answer.reasoning:
            self.blocks.append(self._thinking_block(answer.reasoning))
        if answer.text:
            self.blocks.append({"type": "text", "text": answer.text})
        for call in join_calls(answer.calls):
            self.blocks.append({"type": "tool_use", "id": _tool_use_id(call["id"]),
                                "name": call["function"]["name"],
                                "input": _parsed(call["function"]["arguments"])})
        stop_reason, stop_sequence = self._stop(answer.finish, answer.ids)
        return self._message(stop_reason, stop_sequence, answer.num_tokens)

    # ---- streaming -----------------------------------------------------------------------
    @staticmethod
    def _event(kind: str, **fields: Any) -> str:
        data = json.dumps({"type": kind, **fields}, ensure_ascii=False)
        return f"event: {kind}\ndata: {data}\n\n"

    def start(self) -> list[str]:
        return []  # message_start goes with the first output (its usage is known then)

    def _begin(self) -> list[str]:
        if self.started:
            return []
        self.started = True
        return [self._event("message_start", message=self._message(None, None, 0)),
                self._event("ping")]

    def piece(self, p: Piece) -> list[str]:
        events = self._begin()
        self.num_tokens += len(p.out.delta_token_ids)
        self.ids += p.out.delta_token_ids
        if p.finish is not None:
            self.reason = p.finish
        if p.reasoning:
            events += self._append("thinking", p.reasoning)
        ongoing, new = split_calls(p.calls)  # (as responses_api.ResponsesRenderer.piece)
        for call in ongoing:
            events += self._call(call)
        if p.text:
            events += self._append("text", p.text)
        for call in new:
            events += self._call(call)
        return events

    def _open(self, block: dict[str, Any]) -> list[str]:
        events = self._close()
        self.blocks.append(block)
        self.open, self.open_text = block, []
        return events + [self._event("content_block_start", index=len(self.blocks) - 1,
                                     content_block=block)]

    def _append(self, kind: str, text: str) -> list[str]:
        events: list[str] = []
        if self.open is None or self.open["type"] != kind:
            events += self._open({"type": "thinking", "thinking": "", "signature": ""}
                                 if kind == "thinking" else {"type": "text", "text": ""})
        self.open_text.append(text)
        if kind == "text":
            delta = {"type": "text_delta", "text": text}
        elif self.req.thinking_shown:
            delta = {"type": "thinking_delta", "thinking": text}
        else:
            return events  # display "omitted": the text goes only into the signature
        return events + [self._event("content_block_delta", index=len(self.blocks) - 1,
                                     delta=delta)]

    def _call(self, call: ToolCallDelta) -> list[str]:
        events: list[str] = []
        if call.id is not None:
            events += self._open({"type": "tool_use", "id": _tool_use_id(call.id),
                                  "name": call.name, "input": {}})
        if call.arguments and self.open is not None and self.open["type"] == "tool_use":
            self.open_text.append(call.arguments)
            events.append(self._event("content_block_delta", index=len(self.blocks) - 1,
                                      delta={"type": "input_json_delta",
                                             "partial_json": call.arguments}))
        return events

    def _close(self) -> list[str]:
        block, self.open = self.open, None
        if block is None:
            return []
        index, text, events = len(self.blocks) - 1, "".join(self.open_text), []
        if block["type"] == "thinking":
            self.blocks[index] = self._thinking_block(text)
            events.append(self._event("content_block_delta", index=index, delta={
                "type": "signature_delta", "signature": self.blocks[index]["signature"]}))
        elif block["type"] == "text":
            self.blocks[index] = {"type": "text", "text": text}
        else:
            self.blocks[index] = {**block, "input": _parsed(text)}
        return events + [self._event("content_block_stop", index=index)]

    def finish(self) -> list[str]:
        events = self._begin() + self._close()
        stop_reason, stop_sequence = self._stop(self.reason, self.ids)
        usage = self._usage(self.num_tokens)
        events.append(self._event("message_delta", delta={"stop_reason": stop_reason,
                                                          "stop_sequence": stop_sequence},
                                  usage=usage))
        events.append(self._event("message_stop"))
        return events

    def fail(self, err: OpenAIError) -> list[str]:
        """An error after the headers were sent: Anthropic's `error` event."""
        return [self._event("error", error={"type": anthropic_error_type(err.status),
                                            "message": err.message})]
