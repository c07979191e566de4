"""POST /v1/responses: the request of the OpenAI Responses API (exact OpenAI field names), as
Codex CLI, the OpenAI Agents SDK and `client.responses.create` send it.

Validation, as for chat (protocol.py): types and ranges by pydantic (errors name the field:
errors.validation_error_to_openai), then `check_supported` refuses, naming the field, what
would change the answer but is not served: background mode, conversations, prompt
templates, `truncation: "auto"`, max_tool_calls, logprobs, context_management. Fields that
change nothing here are accepted and ignored: prompt_cache_key (the prefix cache needs no
key), service_tier, safety_identifier, user, stream_options, client_metadata (Codex),
text.verbosity, reasoning.summary. The input items, tools and tool_choice are checked where
they are translated (responses_api.py), each error naming its item (`input[3].content[0]`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tailored.server.errors import OpenAIError, shown
# reasoning.effort: mapped onto the thinking switch where chat's reasoning_effort is
from tailored.server.protocol import EFFORTS, REQUEST_CONFIG
# tools OpenAI runs on its side: they are not run here and are left out of the prompt (Codex
# sends web_search unless told not to); any other unknown tool type is refused
HOSTED_TOOL_TYPES = frozenset({
    "web_search", "web_search_preview", "web_search_preview_2025_03_11",
    "web_search_2025_08_26", "file_search", "code_interpreter", "image_generation",
    "computer_use_preview", "computer_use", "mcp", "local_shell", "shell", "apply_patch",
    "tool_search",
})
# `include` values honoured; others that only add fields we do not produce are accepted
INCLUDE_ENCRYPTED_REASONING = "reasoning.encrypted_content"
REFUSED_INCLUDES = ("message.output_text.logprobs",)
MAX_METADATA_KEYS = 16  # OpenAI's limits of `metadata`
MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 64, 512


class ReasoningParam(BaseModel):
    """`reasoning`: effort (passed on as chat's reasoning_effort: "none" and "minimal" turn
    the thinking off, protocol.thinking_for_effort), summary (accepted; no summaries are
    written: the reasoning itself is returned)."""

    model_config = ConfigDict(extra="allow", strict=True)
    effort: Literal[EFFORTS] | None = None  # type: ignore[valid-type]
    summary: str | None = None
    generate_summary: str | None = None


class TextParam(BaseModel):
    """`text`: format {"type": "text" | "json_object" | "json_schema", ...} (checked where it
    becomes the chat response_format); verbosity (accepted, changes nothing)."""

    model_config = ConfigDict(extra="allow", strict=True)
    format: dict[str, Any] | None = None
    verbosity: str | None = None


class ResponsesRequest(BaseModel):
    """The request body of POST /v1/responses (see the module docstring)."""

    model_config = REQUEST_CONFIG

    model: str | None = None
    input: str | list[Any] = Field(default_factory=list)
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: TextParam | None = None
    reasoning: ReasoningParam | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(None, ge=0)
    store: bool | None = None  # OpenAI's default: true
    previous_response_id: str | None = None
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    stream: bool = False
    truncation: Literal["disabled", "auto"] | None = None
    user: str | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: int | None = Field(None, ge=1)
    context_management: Any = None

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is None:
            return v
        if len(v) > MAX_METADATA_KEYS:
            raise ValueError(f"at most {MAX_METADATA_KEYS} keys (got {len(v)})")
        for key, value in v.items():
            if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
                raise ValueError(f"keys have at most {MAX_METADATA_KEY_CHARS} characters and "
                                 f"values at most {MAX_METADATA_VALUE_CHARS} (key {shown(key)})")
        return v

    @property
    def stored(self) -> bool:
        """Whether the response is kept for a later previous_response_id (OpenAI: unless
        store is false)."""
        return self.store is not False

    def check_supported(self) -> None:
        """Raise OpenAIError(400) naming the first field that is set but not served."""
        refused = {
            "background": self.background is True,
            "conversation": self.conversation is not None,
            "prompt": self.prompt is not None,
            "max_tool_calls": self.max_tool_calls is not None,
            "top_logprobs": bool(self.top_logprobs),
            "context_management": self.context_management not in (None, [], {}),
        }
        for name, bad in refused.items():
            if bad:
                raise OpenAIError(
                    f"parameter '{name}' is not supported by this server (got "
                    f"{shown(getattr(self, name))})", param=name, code="unsupported_parameter")
        if self.truncation == "auto":
            raise OpenAIError(
                "truncation 'auto' is not supported: this server never drops input items; an "
                "input longer than the context is refused (use 'disabled')",
                param="truncation", code="unsupported_parameter")
        for value in self.include or ():
            if value in REFUSED_INCLUDES:
                raise OpenAIError(f"include {shown(value)} is not supported by this server",
                                  param="include", code="unsupported_parameter")

    @property
    def encrypted_reasoning(self) -> bool:
        """`include` asks for reasoning.encrypted_content (here: the reasoning, sealed)."""
        return INCLUDE_ENCRYPTED_REASONING in (self.include or ())
