"""A `POST /v1/segment` body -> (fields, image bytes or None), before any validation of fields
(requests.py does that).

- The body: at most `max_bytes` (tailored's `read_body`: 413 on Content-Length or while
  streaming), and whole within `timeout_s` seconds, else 408: a client that sent headers and
  then one byte a minute held its connection and coroutine forever (a helper's attack,
  sammie-hard). Slow headers never reach the app: a proxy in front guards against those.
- JSON: screened before parsing, as tailored's `read_json` does (strict UTF-8/16/32, at most
  MAX_JSON_DEPTH levels, no lone surrogate in any string), and first at most MAX_JSON_VALUES
  commas and colons: json.loads holds the event loop (and the GIL) while it builds every
  value, and 32 MiB of `[],` or of keys took 3.7 / 6 s; a real body is one long base64 string
  (no comma in its alphabet) and a few prompts.
- Multipart: starlette's parser (one file, 64 fields), its text read as Latin-1 and decoded
  as the declared charset by requests.multipart_fields, which refuses bytes that are not. The
  charset is UTF-8 (the default), Latin-1 or ASCII: Python's codec registry also holds rot13,
  zlib or unicode_escape, which failed as 500s or made text no client sent.
"""

from __future__ import annotations

import asyncio
import codecs
import json

from python_multipart.multipart import parse_options_header
from starlette.datastructures import Headers
from starlette.formparsers import MultiPartException, MultiPartParser

from tailored.server.errors import OpenAIError, shown
from tailored.server.http_io import read_body
from tailored.server.json_screen import MAX_JSON_DEPTH, check_json_body, json_too_deep

from sammie.server.requests import multipart_fields

MAX_JSON_VALUES = 100_000  # commas + colons of a JSON body
MAX_FORM_FIELDS = 64
CHARSETS = ("utf-8", "iso8859-1", "ascii")  # codecs' names


async def read_fields(request, max_bytes: int, timeout_s: float) -> tuple[dict, bytes | None]:
    try:
        body = await asyncio.wait_for(read_body(request, max_bytes), timeout_s)
    except TimeoutError:
        raise OpenAIError(f"the request body did not arrive within {timeout_s:g} s "
                          "(--body-timeout)", status=408, code="request_timeout") from None
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media == "multipart/form-data":
        return await _multipart(request, body, max_bytes)
    return parse_json(body), None


def parse_json(body: bytes) -> dict:
    """A JSON body -> its object (an empty body is {}), or a 400 naming the fault."""
    if not body.strip():
        return {}
    if body.count(b",") + body.count(b":") > MAX_JSON_VALUES:
        raise OpenAIError(f"the JSON body holds over {MAX_JSON_VALUES} values: send the image "
                          "as one base64 string and a few prompts")
    encoding = json.detect_encoding(body)
    try:
        text = body.decode(encoding)
    except UnicodeDecodeError as e:
        raise OpenAIError(f"malformed JSON body: {e}") from None
    too_deep = OpenAIError(f"malformed JSON body: nested too deeply (more than "
                           f"{MAX_JSON_DEPTH} levels)")
    if json_too_deep(text.encode("utf-8") if encoding != "utf-8" else body):
        raise too_deep
    try:
        data = json.loads(text)
    except ValueError as e:
        raise OpenAIError(f"malformed JSON body: {e}") from None
    except RecursionError:
        raise too_deep from None
    if not isinstance(data, dict):
        raise OpenAIError("request body must be a JSON object")
    check_json_body(data, text)
    return data


async def _multipart(request, body: bytes, max_bytes: int) -> tuple[dict, bytes | None]:
    ctype = request.headers.get("content-type", "")
    charset = parse_options_header(ctype)[1].get(b"charset", b"utf-8").decode("latin-1")
    try:
        name = codecs.lookup(charset).name
    except LookupError:
        name = None
    if name not in CHARSETS:
        raise OpenAIError(f"charset {shown(charset)} of the Content-Type is not supported: send "
                          "UTF-8 text", status=415, code="unsupported_media_type")
    charset = name
    raw = [(k, v) for k, v in request.scope["headers"] if k.lower() != b"content-type"]
    raw.append((b"content-type", ctype.encode("latin-1") + b"; charset=latin-1"))

    async def stream():
        yield body

    try:
        form = await MultiPartParser(Headers(raw=raw), stream(), max_files=1,
                                     max_fields=MAX_FORM_FIELDS, max_part_size=max_bytes).parse()
    except MultiPartException as e:
        raise OpenAIError(f"malformed multipart body: {e.message}") from None
    fields, upload = multipart_fields(form, charset)
    return fields, (await upload.read() if upload is not None else None)
