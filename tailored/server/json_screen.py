"""Screening a request body's raw JSON, before and after json.loads (all C-speed scans, no
recursion): nesting deeper than MAX_JSON_DEPTH (`json_too_deep`, before parsing) and strings
holding a lone UTF-16 surrogate (`check_json_body`, naming the field). Every dialect's body
goes through both (http_io.read_json)."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from tailored.server.errors import OpenAIError, lone_surrogate_at, loc_name

MAX_JSON_DEPTH = 64  # nesting levels of a request body (arrays/objects); deeper -> 400

_STRING = re.compile(rb'"[^"]*"')  # once escapes are gone, a string holds no quote
# bytes.translate tables: keep only brackets and quotes; then [ { -> +1, ] } -> -1 (int8)
_DELETE_ALL_BUT_BRACKETS_AND_QUOTES = bytes(range(256)).translate(None, b'[]{}"')
_BRACKET_STEP = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
# a high-surrogate escape without a low one right after it, or a low one without a high one
# right before it (the lookbehind sees the 12 characters that end the match)
_LONE_SURROGATE_ESCAPE = re.compile(
    r"\\u[dD](?:[89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])"
    r"|[c-fC-F][0-9a-fA-F]{2}(?<!\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}))"
)
_NAMING_WALK_LIMIT = 100_000  # containers visited to name the field of a lone surrogate


def json_too_deep(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """True if UTF-8 JSON text nests arrays/objects more than `limit` deep (brackets inside
    strings ignored), without parsing or recursion: bytes operations and one numpy cumsum
    (~0.1-1 s for 32 MB; json.loads of the same text costs about as much or more). For
    malformed text the answer is a guess (the parse fails anyway)."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    # Drop escaped backslashes, then escaped quotes: every quote left delimits a string.
    raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    compact = raw.translate(None, _DELETE_ALL_BUT_BRACKETS_AND_QUOTES)
    # Two adjacent quotes (an empty string, or a string's end and the next one's start with no
    # bracket between) can go without changing which brackets lie inside strings; one pass
    # leaves no two quotes adjacent.
    compact = compact.replace(b'""', b"")
    if b'"' in compact:  # strings holding brackets (rare): drop them
        compact = _STRING.sub(b"", compact)
    steps = np.frombuffer(compact.translate(_BRACKET_STEP), dtype=np.int8)
    return steps.size > 0 and int(steps.cumsum(dtype=np.int64).max()) > limit


def find_lone_surrogate_escape(text: str) -> str | None:
    """The first \\uXXXX escape of JSON text that parses to a lone surrogate, else None.

    Exact for JSON text decoded strictly (so it holds no raw surrogate): json.loads pairs a
    high-surrogate escape with a low one right after it, and nothing else."""
    if "\\u" not in text:
        return None
    # escaped backslashes go first (same length), so every backslash left starts an escape
    m = _LONE_SURROGATE_ESCAPE.search(text.replace("\\\\", "__"))
    return None if m is None else m.group()


def check_json_body(data: Any, text: str | None = None) -> None:
    """Raise OpenAIError (400) when a string of a parsed body (object key or value) holds a
    lone surrogate, naming the field ("invalid 'messages[0].content': contains a lone
    surrogate ..."); also when it nests deeper than MAX_JSON_DEPTH.

    text: the JSON text `data` was parsed from; when given, the scan runs on it at C speed and
    the walk over `data` (to name the field; at most _NAMING_WALK_LIMIT containers) only runs
    when there is something to report."""
    escape = None
    if text is not None:
        escape = find_lone_surrogate_escape(text)
        if escape is None:
            return
    walked = frozenset({dict, list, str})
    stack: list[tuple[Any, int, Any]] = [(data, 1, ())]  # path: nested (parent, key) pairs
    visited = 0
    while stack:
        obj, depth, path = stack.pop()
        visited += 1
        if depth > MAX_JSON_DEPTH:
            raise OpenAIError(
                f"malformed JSON body: nested too deeply (more than {MAX_JSON_DEPTH} levels)"
            )
        if visited > _NAMING_WALK_LIMIT and escape is not None:
            break
        is_dict = isinstance(obj, dict)
        if is_dict:
            for key in obj:
                if isinstance(key, str) and lone_surrogate_at(key) >= 0:
                    where = _path_name(path)
                    raise OpenAIError(
                        f"invalid key {key!a}{f' in {where!r}' if where else ''}: contains a "
                        "lone surrogate (strings must be valid Unicode)",
                        param=where or None,
                    )
        if walked.isdisjoint(map(type, obj.values() if is_dict else obj)):
            continue
        for key, value in obj.items() if is_dict else enumerate(obj):
            if type(value) is str:
                if (i := lone_surrogate_at(value)) >= 0:
                    field = _path_name((path, key))
                    raise OpenAIError(
                        f"invalid '{field}': contains a lone surrogate "
                        f"(U+{ord(value[i]):04X} at character {i}; strings must be valid "
                        "Unicode)",
                        param=field,
                    )
            elif isinstance(value, (dict, list)):
                stack.append((value, depth + 1, (path, key)))
    if escape is not None:
        raise OpenAIError(
            f"invalid request body: a string holds a lone surrogate (the escape {escape!a}); "
            "strings must be valid Unicode"
        )


def _path_name(path: tuple) -> str:
    keys = []
    while path:
        path, key = path
        keys.append(key)
    return loc_name(tuple(reversed(keys)))

