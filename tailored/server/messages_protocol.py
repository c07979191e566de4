"""POST /v1/messages and /v1/messages/count_tokens: the request of the Anthropic Messages API
(exact Anthropic field names), as Claude Code and the anthropic SDK send it, and its error
shape.

Validation: types and ranges by pydantic (errors name the field), then `check_supported`
refuses what would change the answer but is not served (mcp_servers, container). Accepted and
ignored: metadata (user_id), service_tier, context_management (Claude Code's
clear_thinking edits: the template already drops reasoning before the last user query),
output_config.effort, cache_control on any block (the prefix cache needs no marks),
`defer_loading` on tools (every tool is rendered), the `anthropic-beta` header and `?beta=true`.
The messages, system blocks and tools are checked where they are translated (messages_api.py),
each error naming its block (`messages[2].content[1]`).

Errors are Anthropic's shape: `{"type": "error", "error": {"type", "message"}}` with the type
by status (`anthropic_error_type`).
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from tailored.server.errors import OpenAIError, shown
from tailored.server.http_io import ErrorJSONResponse
from tailored.server.protocol import REQUEST_CONFIG

ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                         403: "permission_error", 404: "not_found_error",
                         413: "request_too_large", 429: "rate_limit_error",
                         529: "overloaded_error"}
# the system block Claude Code adds for Anthropic's billing: not meant for the model, and it
# changes between sessions (it would cost every new session its prefix-cache hit)
BILLING_HEADER = "x-anthropic-billing-header:"
# Anthropic's server tools (run on Anthropic's side): not run here, left out of the prompt
SERVER_TOOL_PREFIXES = ("web_search_", "web_fetch_", "code_execution_", "tool_search_tool_")


def anthropic_error_type(status: int) -> str:
    return ANTHROPIC_ERROR_TYPES.get(status, "api_error" if status >= 500
                                     else "invalid_request_error")


def anthropic_error_response(err: OpenAIError) -> JSONResponse:
    """An OpenAIError in Anthropic's error shape (the message names the field)."""
    body = {"type": "error",
            "error": {"type": anthropic_error_type(err.status), "message": err.message}}
    return ErrorJSONResponse(body, status_code=err.status)


class ThinkingParam(BaseModel):
    """`thinking`: "enabled" (with budget_tokens: a token limit on the thinking,
    thinking_budget.py), "adaptive" (thinking on, no limit), "disabled"; `display`
    "omitted" sends thinking blocks without their text (the signature still carries it)."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1)
    display: str | None = None


class MessagesRequest(BaseModel):
    """The request body of POST /v1/messages (see the module docstring)."""

    model_config = REQUEST_CONFIG

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)  # required (but by count_tokens)
    messages: list[Any]
    system: str | list[Any] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: ThinkingParam | None = None
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    mcp_servers: list[Any] | None = None
    container: Any = None

    def check_supported(self, counting: bool = False) -> None:
        """Raise OpenAIError(400) naming the first field that is missing or not served."""
        if self.max_tokens is None and not counting:
            raise OpenAIError("missing required parameter 'max_tokens'", param="max_tokens")
        for name in ("mcp_servers", "container"):
            value = getattr(self, name)
            if value not in (None, [], {}):
                raise OpenAIError(f"parameter '{name}' is not supported by this server (got "
                                  f"{shown(value)})", param=name, code="unsupported_parameter")
        t = self.thinking
        if t is not None and t.type == "enabled":
            if t.budget_tokens is None:
                raise OpenAIError("thinking.budget_tokens is required with type 'enabled'",
                                  param="thinking.budget_tokens")
            if self.max_tokens is not None and t.budget_tokens >= self.max_tokens:
                raise OpenAIError(f"thinking.budget_tokens ({t.budget_tokens}) must be less "
                                  f"than max_tokens ({self.max_tokens})",
                                  param="thinking.budget_tokens")

    @property
    def enable_thinking(self) -> bool:
        """The template's thinking switch: on for "enabled" and "adaptive"; off for
        "disabled" and when `thinking` is absent (the Messages API's default)."""
        return self.thinking is not None and self.thinking.type != "disabled"

    @property
    def thinking_budget(self) -> int | None:
        t = self.thinking
        return t.budget_tokens if t is not None and t.type == "enabled" else None

    @property
    def thinking_shown(self) -> bool:
        """Whether thinking blocks carry their text (not with display "omitted")."""
        return self.thinking is None or self.thinking.display != "omitted"
