"""POST /v1/chat/completions: the request (`ChatCompletionRequest`, its messages) and the
chat responses and stream chunks."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any, Callable, ClassVar, Literal

from pydantic import BaseModel, Field, field_validator, model_serializer, model_validator

from tailored.engine.types import MAX_LOGPROBS, StructuredOutput
from tailored.server.errors import OpenAIError, shown
from tailored.server.json_screen import MAX_JSON_DEPTH, check_json_body, json_too_deep
from tailored.server.protocol import (EFFORTS, REQUEST_CONFIG, BaseRequest, PromptLogprobsOut,
                                      UsageInfo, thinking_for_effort, unix_now)
from tailored.server.tools_protocol import (TOOL_CHOICES, ChatTool, check_forced_tool_choice,
                                            tool_name_error)

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# chat_template_kwargs reach the template as its variables (vLLM's rule), but for these: the
# request's own fields (messages, tools, add_generation_prompt) render them
RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "add_generation_prompt")


class ChatMessage(BaseModel):
    """One input message; extra fields (name, tool_calls, tool_call_id, ...) pass to the template.

    content: a string, a list of content parts (dicts; the tokenizer rejects kinds it cannot
    render), or null (only meaningful for assistant messages carrying tool calls)."""

    model_config = REQUEST_CONFIG

    role: str
    content: Any = None
    reasoning_content: str | None = None
    tool_calls: Any = None  # list of {"type": "function", "function": {"name", "arguments"}}

    @field_validator("role")
    @classmethod
    def _known_role(cls, v: str) -> str:
        if v not in CHAT_ROLES:
            raise ValueError(f"unknown role {v!r}; expected one of {', '.join(CHAT_ROLES)}")
        return v

    @field_validator("content")
    @classmethod
    def _content_shape(cls, v: Any) -> Any:
        ok = v is None or isinstance(v, str)
        ok = ok or (isinstance(v, list) and all(isinstance(p, dict) for p in v))
        if not ok:
            raise ValueError("must be a string, a list of content parts (objects), or null")
        # Parts of other types are left to the tokenizer, which names the type it cannot render.
        for i, part in enumerate(v if isinstance(v, list) else ()):
            if part.get("type") == "text" and not isinstance(part.get("text"), str):
                got = "missing" if "text" not in part else f"got {shown(part['text'])}"
                raise ValueError(f"content part {i}: 'text' must be a string ({got})")
        return v

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> "ChatMessage":
        """OpenAI: only an assistant message (one carrying tool calls) may leave content out or
        null; a user, system, developer or tool message without it is a client bug."""
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs 'content' (a string or content parts)")
        return self

    @field_validator("tool_calls")
    @classmethod
    def _tool_calls_shape(cls, v: Any) -> Any:
        """OpenAI's shape: [{"id"?: str, "type": "function", "function": {"name": str,
        "arguments": str holding a JSON object (or "") | object}}]. null or [] = no calls."""
        if v is None:
            return v
        if not isinstance(v, list):
            raise ValueError(  # noqa: TRY004
                "must be a list of tool calls, each {'type': 'function', 'function': "
                f"{{'name': ..., 'arguments': ...}}}} (got {type(v).__name__} {shown(v)})"
            )
        for i, call in enumerate(v):
            if not isinstance(call, dict):
                raise ValueError(  # noqa: TRY004
                    f"item {i} must be an object {{'type': 'function', 'function': {{...}}}} "
                    f"(got {shown(call)})"
                )
            if call.get("type", "function") != "function":
                raise ValueError(
                    f"item {i}: 'type' must be 'function' (got {shown(call.get('type'))})"
                )
            if "id" in call and not isinstance(call["id"], str):
                raise ValueError(f"item {i}: 'id' must be a string (got {shown(call['id'])})")
            fn = call.get("function")
            if not isinstance(fn, dict):
                got = "missing" if "function" not in call else f"got {shown(fn)}"
                raise ValueError(  # noqa: TRY004
                    f"item {i}: 'function' must be an object with 'name' and 'arguments' ({got})"
                )
            name = fn.get("name")
            if not isinstance(name, str) or not name:
                got = "missing" if "name" not in fn else f"got {shown(name)}"
                raise ValueError(f"item {i}: 'function.name' must be a non-empty string ({got})")
            if (bad := tool_name_error(name)) is not None:  # rendered as <function=NAME>
                raise ValueError(f"item {i}: 'function.name' {bad}")
            args = fn.get("arguments")
            if isinstance(args, str):
                if args.strip():
                    if json_too_deep(args.encode("utf-8", "surrogatepass")):
                        raise ValueError(
                            f"item {i}: 'function.arguments' is nested too deeply (more than "
                            f"{MAX_JSON_DEPTH} levels)"
                        )
                    try:
                        parsed = json.loads(args)
                    except (json.JSONDecodeError, RecursionError) as e:
                        raise ValueError(
                            f"item {i}: 'function.arguments' is not valid JSON ({e})"
                        ) from None
                    if not isinstance(parsed, dict):
                        raise ValueError(
                            f"item {i}: 'function.arguments' must encode a JSON object "
                            f"(got {type(parsed).__name__})"
                        )
                    try:  # depth and lone surrogates ("\\ud800" escapes) of the decoded text
                        check_json_body(parsed, args)
                    except OpenAIError as e:
                        raise ValueError(f"item {i}: 'function.arguments': {e.message}") from None
            elif args is not None and not isinstance(args, dict):
                raise ValueError(
                    f"item {i}: 'function.arguments' must be a JSON string or an object "
                    f"(got {shown(args)})"
                )
        return v

    def to_template(self) -> dict[str, Any]:
        """Dict for tokenizer.apply_chat_template. `developer` is OpenAI's new name for
        `system`; the Qwen template only knows `system`. Null content becomes "" because the
        template does string operations on it."""
        d = self.model_dump(exclude_none=True)
        if d["role"] == "developer":
            d["role"] = "system"
        d.setdefault("content", "")
        return d



class ChatCompletionRequest(BaseRequest):
    """POST /v1/chat/completions. max_completion_tokens wins over max_tokens when both given.

    tools: OpenAI function tools, rendered by the chat template; the answer's calls come back
    as `tool_calls` (`tool_calls.py`) unless tool_choice is "none". parallel_tool_calls false
    ends the answer (and its generation) once its first call ended. response_format (or
    structured_outputs) beside tools with tool_choice "auto": the answer is tool calls or the
    format's JSON, one grammar. reasoning_effort "none" / "minimal": thinking off (OpenAI's
    field, as vLLM maps it), unless chat_template_kwargs.enable_thinking says otherwise."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=0)  # 0: as max_tokens
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # false: the answer ends with its first call
    # each generated token's logprob, with its top_logprobs most likely alternatives
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    reasoning_effort: Literal[EFFORTS] | None = None  # type: ignore[valid-type]

    UNSUPPORTED: ClassVar[dict[str, Callable[[Any], bool]]] = {
        k: v for k, v in BaseRequest.UNSUPPORTED.items()
        if k not in ("tools", "tool_choice", "top_logprobs")
    }

    @property
    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_supported(self) -> None:
        if self.top_logprobs and not self.logprobs:  # OpenAI's rule
            raise OpenAIError("parameter 'top_logprobs' needs 'logprobs' set to true",
                              param="top_logprobs")
        if self.tool_choice not in TOOL_CHOICES:
            check_forced_tool_choice(self.tools, self.tool_choice)
        super().check_supported()

    def structured_output(self) -> StructuredOutput | None:
        """The grammar of `response_format` / `structured_outputs`, or of a forced
        tool_choice (StructuredOutput "tool_calls": the tools as rendered; a named function's
        tool_choice in xgrammar's (OpenAI's) shape), or with active tools and tool_choice
        "auto" both: calls or the format's answer ("tool_calls" with tool_choice "auto" and
        the answer's own spec; engine/tool_grammar.py)."""
        answer = super().structured_output()
        if self.forced_tool_calls or (answer is not None and self.active_tools):
            spec = {"tools": self.active_tools,
                    "tool_choice": self.tool_choice if self.forced_tool_calls else "auto",
                    "parallel_tool_calls": self.parallel_tool_calls is not False}
            if not self.forced_tool_calls:
                spec["answer"] = asdict(answer)
            return StructuredOutput("tool_calls", json.dumps(spec))
        return answer

    @property
    def forced_tool_calls(self) -> bool:
        """tool_choice "required" or a named function (with tools): the answer is calls only,
        by a grammar (`structured_output`)."""
        return bool(self.tools) and self.tool_choice not in TOOL_CHOICES

    @property
    def grammar_tool_calls(self) -> bool:
        """The answer's calls are held by a grammar: forced, or beside a response_format."""
        return self.forced_tool_calls or bool(
            self.active_tools and (self.structured_outputs is not None or (
                self.response_format is not None and self.response_format.type != "text")))

    @property
    def max_tool_calls(self) -> int | None:
        """parallel_tool_calls false: 1 (the answer ends once its first call ended)."""
        return 1 if self.parallel_tool_calls is False else None

    @property
    def active_tools(self) -> list[dict[str, Any]] | None:
        """The tools to render and parse calls of: None without tools or with tool_choice
        "none"."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not v:
            raise ValueError("messages must not be empty")
        return v

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: dict | None) -> dict | None:
        # every key reaches the template (template_kwargs), as in vLLM; the request's own fields
        # are set by their fields, not here
        for key in v or {}:
            if key in RESERVED_TEMPLATE_KWARGS:
                raise ValueError(f"key {key!r} is set by the request's own field '{key}', not "
                                 "here")
        if v and not isinstance(v.get("enable_thinking", True), bool):
            raise ValueError("enable_thinking must be a boolean")
        return v

    @property
    def template_kwargs(self) -> dict[str, Any]:
        """chat_template_kwargs but enable_thinking (its own argument): the template's other
        variables."""
        return {k: v for k, v in (self.chat_template_kwargs or {}).items()
                if k != "enable_thinking"}

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def enable_thinking(self) -> bool:
        """Qwen3.6 thinks unless chat_template_kwargs.enable_thinking is false, or (without
        it) reasoning_effort is "none" or "minimal"."""
        kwargs = self.chat_template_kwargs or {}
        if "enable_thinking" in kwargs:
            return kwargs["enable_thinking"]
        thinking = thinking_for_effort(self.reasoning_effort)
        return True if thinking is None else thinking



class ChatResponseMessage(BaseModel):
    """content: the answer (the raw generated text, or with `--reasoning-parser` the text after
    `</think>`); the reasoning under both names clients read (`reasoning`, vLLM's since late
    2025; `reasoning_content`, DeepSeek's, LiteLLM's), both omitted while None."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    # [{"id", "type": "function", "function": {"name", "arguments": JSON text}}], omitted if none
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _drop_empty_reasoning(self, handler):
        d = handler(self)
        for k in ("reasoning", "reasoning_content", "tool_calls"):
            if d.get(k) is None:
                d.pop(k, None)
        return d


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: dict[str, Any] | None = None  # {"content": [token entries]}
    finish_reason: str | None = None


class ChatCompletionResponse(PromptLogprobsOut):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=unix_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    """Stream delta; fields that are None are left out (the final delta is `{}`)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None  # the same text under both names (ChatResponseMessage)
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # ToolCallDelta.to_openai() pieces

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: dict[str, Any] | None = None  # {"content": [the delta's token entries]}
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=unix_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None

