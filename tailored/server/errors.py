"""Errors in the OpenAI shape, and the messages that name the field at fault.

`OpenAIError` is raised anywhere in the server for a request that cannot be served; the route
renders it as `{"error": {"message", "type", "param", "code"}}`. Messages quote user input through
`shown` (repr, shortened) and are always encodable (`safe_text`).
`validation_error_to_openai` turns a pydantic ValidationError into one readable message naming
the field(s) (`loc_name`: ('messages', 0, 'content') -> 'messages[0].content').
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ValidationError

from tailored.engine.types import RequestOutput

MAX_ERROR_MESSAGE_CHARS = 2000


class OpenAIError(Exception):
    """An error returned to the client as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",  # OpenAI's field name
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        # Messages may quote user input: keep them short and always encodable as UTF-8.
        message = safe_text(message)
        if len(message) > MAX_ERROR_MESSAGE_CHARS:
            message = message[: MAX_ERROR_MESSAGE_CHARS - 3] + "..."
        param = safe_text(param) if param is not None else None
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = (
            message,
            status,
            type,
            param,
            code,
        )

    def to_dict(self) -> dict:
        return ErrorResponse(
            error=ErrorDetail(
                message=self.message, type=self.type, param=self.param, code=self.code
            )
        ).model_dump()


_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate_at(text: str) -> int:
    """Index of the first lone UTF-16 surrogate in `text` (JSON `"\\ud800"`), else -1.

    Paired surrogates in JSON become one code point when parsed, so any surrogate code point
    left in a str is a lone one: not valid Unicode, and neither the tokenizer nor UTF-8 output
    can handle it."""
    if text.isascii():
        return -1
    m = _SURROGATE.search(text)
    return -1 if m is None else m.start()


def safe_text(text: str) -> str:
    """`text` with lone surrogates written as `\\udXXX` escapes (so it encodes as UTF-8)."""
    if lone_surrogate_at(text) < 0:
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def shown(value: Any, limit: int = 60) -> str:
    """Short, printable rendering of user input for error messages (repr, truncated)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."



def loc_name(loc: tuple) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    name = ""
    for part in loc:
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else str(part))
    return name


def validation_error_to_openai(exc: ValidationError) -> OpenAIError:
    """One message for all errors (at most 3 shown), each naming its field; param = first field."""
    parts = []
    errors = exc.errors(include_url=False)
    for err in errors[:3]:
        field = loc_name(err["loc"]) or "body"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "missing":
            parts.append(f"missing required parameter '{field}'")
        elif err["type"] == "value_error":  # our own validators: message is complete
            parts.append(f"invalid '{field}': {msg}")
        else:
            got = shown(err.get("input"))
            parts.append(f"invalid '{field}': {msg} (got {got})")
    if len(errors) > 3:
        parts.append(f"and {len(errors) - 3} more error(s)")
    param = loc_name(errors[0]["loc"]) if errors else None
    return OpenAIError("; ".join(parts), param=param or None)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def grammar_param(message: str) -> str | None:
    """The request field a structured-output error is about (the engine's messages start with
    it: engine/grammar.py), else None."""
    for field in ("response_format", "structured_outputs", "tool_choice"):
        if message.startswith(field):
            return field
    return None


def engine_error(out: RequestOutput) -> OpenAIError:
    """The error of a request the engine failed: a 400 when it was the request's fault (a
    grammar that failed to compile after admission), else a 500."""
    if out.bad_request:
        return OpenAIError(out.error, param=grammar_param(out.error))
    return OpenAIError(f"engine error: {out.error}", status=500, type="server_error")

