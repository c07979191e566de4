"""The HTTP edge of every route: request bodies read under a size cap and screened as JSON
before any model validation; JSON error bodies and SSE events written out.

Input limits, checked before any tokenizer work (HF `encode` of a few MB takes seconds):
- the request body: at most `max_body_bytes` (default 256 bytes a token of max_model_len, 2 to
  32 MiB: 4 MiB at 16k) -> else 413; a compressed body (Content-Encoding other than identity)
  -> 415;
- the body must be UTF-8 (or UTF-16/32) JSON nested at most MAX_JSON_DEPTH (64) levels,
  checked before parsing; no string may hold a lone UTF-16 surrogate (JSON "\\ud800") -> else
  400 naming the field.
"""

from __future__ import annotations

import json

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from tailored.server.errors import OpenAIError
from tailored.server.json_screen import MAX_JSON_DEPTH, check_json_body, json_too_deep

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



class ErrorJSONResponse(JSONResponse):
    """JSON rendered with ensure_ascii: any text (even a lone surrogate) encodes."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(err: OpenAIError, headers: dict | None = None) -> JSONResponse:
    return ErrorJSONResponse(err.to_dict(), status_code=err.status, headers=headers)


def sse(payload: BaseModel | dict, exclude: set[str] | None = None) -> str:
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json(exclude=exclude)}\n\n"
    return f"data: {json.dumps(payload)}\n\n"



def internal_error(e: Exception) -> OpenAIError:
    return OpenAIError(
        f"internal server error: {type(e).__name__}: {e}", status=500, type="server_error"
    )


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or OpenAIError(413) as soon as it exceeds `limit` bytes; 415 for a compressed
    body (a gzip body read as JSON said "malformed JSON: 'utf-8' codec", which names the wrong
    fault; new-user attack, session 37)."""
    coding = request.headers.get("content-encoding", "").strip().lower()
    if coding not in ("", "identity"):
        raise OpenAIError(
            f"Content-Encoding {coding[:40]!r} is not supported: send the JSON body "
            "uncompressed", status=415, code="unsupported_media_type")
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


async def read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object, screened: at most `limit` bytes (`read_body`), strictly
    decoded, nested at most MAX_JSON_DEPTH levels, no lone surrogate in any string; else
    OpenAIError naming the fault."""
    body = await read_body(request, limit)
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
    return data
