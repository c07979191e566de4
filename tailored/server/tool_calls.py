"""Qwen3.6's tool calls split out of a chat answer into OpenAI `tool_calls`.

With `tools` in the request (and `tool_choice` "auto" or unset) the chat template lists them and
tells the model to call one in this XML form (model spec §10.3; vLLM's and SGLang's
`qwen3_coder` parsers read the same form):

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    </function>
    </tool_call>

`ToolCallSplitter` turns the answer text, fed delta by delta as the detokenizer hands it over,
into content text and tool-call deltas (OpenAI's streamed shape: the first delta of a call has
its index, id, type and name; the later ones carry pieces of `arguments`, a JSON object as
text). Arguments stream as they are written (a fault seen in other servers: nothing until a
parameter ended, failure-cases §8): a string parameter's value goes out JSON-escaped piece by
piece, held back only where a piece could begin its closing tag; a parameter whose schema type
is not string (integer, number, boolean, null, object, array) is sent whole once it ends,
converted by that type, or as a JSON string where the text does not convert; an enum / const
string is sent whole too, without the whitespace beside it. Types: arg_types.py (`type`,
anyOf / oneOf / allOf, local `$ref`s, enum / const values, additionalProperties).

Decisions:
- The one newline after `<parameter=ARG>` and the one before `</parameter>` are the format's,
  not the value's (the template writes them around every value).
- Content is the text outside the calls. Whitespace between content and a call, between calls
  and after the last call is the format's and is dropped; text the model writes after a call
  (the template says not to), with the whitespace before it, stays content: nothing is lost.
- A block that is not a call (`<tool_call>` not followed by `<function=NAME>` or a JSON object
  with a "name", the form of Qwen2.5's hermes template) is passed through as content, and the
  text after its tag is read again (a real call may follow).
- A missing `</parameter>`, `</function>` or `</tool_call>` is forgiven where the next tag shows
  where it should have been; an answer cut inside a call (max_tokens) leaves that call's
  arguments unfinished (invalid JSON) rather than closing them into a call the model never
  finished writing (`unfinished`; the finish_reason stays the engine's). A call whose last
  parameter ended is closed (`}`): the model stopped where `</function>` was due.
- `max_calls` (parallel_tool_calls false: 1): once that many calls ended the splitter is
  `stopped`, drops the rest, and the server ends the generation.
- `forced` (tool_choice "required" or a named function: a grammar makes the answer calls
  only): the text still held at the end outside a complete call — a call cut before its
  `<function=NAME>` was whole, by max_tokens or a stop string — is a call cut short, not
  content: it is dropped (no content; the finish_reason is the engine's, "length" for
  max_tokens).
- An answer cut inside a tag that begins a parameter (`<param`) leaves the call unfinished; a
  cut inside a value's closing tag (`</param`) leaves that tag's beginning out of the value.
- Calls are read in the answer only: the server feeds this splitter the text after the
  thinking (reasoning.py: the reasoning split, or ThinkGate without it).
- Parameter values are not checked against the schema beyond the type conversion: the client
  validates, as with OpenAI. A converted value is strict JSON: NaN, Infinity or a number out of
  float range stays the text, as a JSON string.
- finish_reason "tool_calls" only when every call is complete: a call cut inside a value (by
  max_tokens, a stop string or the end of the answer) keeps the engine's reason.
- The format's limit: a value cannot hold `</parameter>`, `<parameter=`, `</function>` or
  `</tool_call>` (the value ends there), as in every parser of this format.

Source: the Qwen3.6 chat template (spec §10.3) and the OpenAI Chat Completions API (the
`tool_calls` message and delta shapes); vLLM's `qwen3_coder` parser for what clients expect.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from tailored.engine.detokenizer import prefix_hold
from tailored.engine.tool_format import (FUNCTION_END, FUNCTION_START, PARAM_END, PARAM_START,
                                         TOOL_END, TOOL_START, VALUE_ENDS)
from tailored.server.arg_types import FIXED, OTHER, param_types

# a function or parameter name longer than this, or one with a newline or '<' in it, means the
# text is not a call (a name ends at the first '>')
MAX_NAME_CHARS = 256
# whitespace after <tool_call> longer than this means the text is no call (and bounds the
# whitespace the head re-reads while it waits for <function=)
MAX_GAP_CHARS = 256
_WS = " \t\r\n"
_WS_RUN = re.compile(r"[ \t\r\n]*")


@dataclass
class ToolCallDelta:
    """A piece of one tool call: `index` counts the answer's calls from 0; the first piece of a
    call has its `id` ("call_" + 24 hex digits) and `name`, every piece a bit of `arguments`."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        """The streamed `delta.tool_calls[i]` object."""
        d: dict[str, Any] = {"index": self.index}
        fn: dict[str, Any] = {}
        if self.id is not None:
            d["id"], d["type"] = self.id, "function"
            fn["name"] = self.name
        fn["arguments"] = self.arguments
        d["function"] = fn
        return d


def opens_call(after_tag: str, names: set[str]) -> bool | None:
    """Whether the text after a `<tool_call>` opens a call of one of `names` (the request's
    tools): `<function=NAME>` after at most MAX_GAP_CHARS of whitespace; None while it cannot
    tell (too little text). The reasoning split asks it: a tag the model only mentions in its
    thinking (`<tool_call>{x}`, `<function=...>`) must not end the thinking."""
    s = after_tag.lstrip(_WS)
    if len(after_tag) - len(s) > MAX_GAP_CHARS:
        return False
    if not s.startswith(FUNCTION_START):
        return None if FUNCTION_START.startswith(s) else False
    name, _ = _tag_name(s, FUNCTION_START)
    if name is None:
        return None
    return name in names


def _tag_name(s: str, tag: str) -> tuple[str | None, str]:
    """(name, text after the tag's '>') of a tag at the start of s; name None while the '>'
    has not come yet, "" when this is no such tag (a bad or overlong name)."""
    end = s.find(">", len(tag))
    name = s[len(tag):end if end >= 0 else len(s)]
    if any(c in name for c in "<\n") or len(name) > MAX_NAME_CHARS:
        return "", s
    if end < 0:
        return None, s
    return name.strip(_WS), s[end + 1:]


def _is_string(types: set[str]) -> bool:
    """A value streamed as a JSON string: the schema says string (not from a fixed set), or says
    nothing (an unknown function or parameter: the text as written)."""
    return not types or ("string" in types and FIXED not in types)


def convert_value(text: str, types: set[str], exact: bool = False) -> Any:
    """A non-string parameter's value from its text: the first of the schema's types the text
    parses as (JSON; "True"/"False" for booleans too); else the text itself. exact: the text
    is the value as a grammar held it (an enum / const string keeps its own whitespace)."""
    s = text.strip()
    try:
        value = json.loads(s)
        json.dumps(value, allow_nan=False)  # NaN, Infinity, 1e400: no JSON a client can read
    except (ValueError, RecursionError):  # ValueError: also an int of over 4300 digits
        value = {"true": True, "false": False}.get(s.lower(), _NOT_JSON)
    checks = {
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "null": lambda v: v is None,
        "object": lambda v: isinstance(v, dict),
        "array": lambda v: isinstance(v, list),
    }
    if value is not _NOT_JSON:
        for t in ("integer", "number", "boolean", "null", "object", "array"):
            if t in types and checks[t](value):
                return value
        # 5.0 for an integer parameter
        if "integer" in types and isinstance(value, float) and value.is_integer():
            return int(value)
    if FIXED in types:  # an enum / const string: the whitespace beside it is not its text
        return text if exact else s
    return text


_NOT_JSON = object()


def _escaped(text: str) -> str:
    """text as the inside of a JSON string (escapes are per character, so pieces join)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _new_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallSplitter:
    """Splits one answer's text, fed delta by delta, into content text and tool-call deltas.

    tools: the request's `tools` (for the parameter types). `feed(text)` returns
    (content, deltas) of that piece of text; `finish()` what was held back, at the end. The
    content joined over all calls is the answer less the calls; the deltas joined by index are
    the calls (see the module docstring). `calls` counts the calls begun, `unfinished` says
    whether the last one was cut inside a value (its arguments are no complete JSON object).
    Every state does work in the new text only (a held run of whitespace is kept as pieces),
    so a long answer fed a token at a time costs linear time.
    """

    def __init__(self, tools: list[dict] | None, max_calls: int | None = None,
                 forced: bool = False, exact: bool = False) -> None:
        self._types = param_types(tools)
        # the answer is calls only (a forced tool_choice's grammar): text outside a complete
        # call can only be one cut short, and is dropped at the end instead of given out
        self.forced = forced
        # the calls are held by a grammar (forced, or tool_choice "auto" beside a
        # response_format: engine/tool_grammar.py): each value is exactly its text between
        # the format's two newlines, an enum's whitespace included
        self.exact = exact or forced
        # parallel_tool_calls false: 1; once that many calls ended, `stopped` is set and the
        # rest of the answer is dropped (the caller ends the generation)
        self.max_calls = max_calls
        self.stopped = False
        self._buf = ""  # text not yet given out
        self._state = "out"  # out | head | params | value | after
        self._ws: list[str] = []  # out: a held run of whitespace, before _buf
        self._raw = ""  # head: the block's text as written, given out if it is no call
        self._fn_types: dict[str, set[str]] = {}
        self._first_param = True
        self._param_types: set[str] = set()
        self._param_is_string = True
        self._scanned = 0  # of _buf: searched already for an end (a value's, a JSON call's)
        self.calls = 0
        self.unfinished = False
        self._content: list[str] = []
        self._deltas: list[ToolCallDelta] = []

    # -- the interface ---------------------------------------------------------------------------

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        self._run(final=True)
        return self._take()

    def _take(self) -> tuple[str, list[ToolCallDelta]]:
        content, deltas = "".join(self._content), self._deltas
        self._content, self._deltas = [], []
        return content, merge(deltas)

    # -- the states ------------------------------------------------------------------------------

    def _run(self, final: bool) -> None:
        while True:
            step = getattr(self, f"_step_{self._state}")
            if not step(final):
                return

    def _args(self, text: str) -> None:
        self._deltas.append(ToolCallDelta(self.calls - 1, text))

    def _step_out(self, final: bool) -> bool:
        # _buf: at most a held beginning of "<tool_call>" plus the new text; the whitespace
        # run before it waits in _ws: it is the format's if a call follows, else content
        buf = self._buf
        i = buf.find(TOOL_START)
        if i >= 0:
            before = buf[:i]
            text = before.rstrip(_WS)
            if text:
                self._content.extend(self._ws)
                self._content.append(text)
                self._ws = []
            self._ws.append(before[len(text):])
            self._raw = "".join(self._ws) + TOOL_START  # given out again if no call follows
            self._buf, self._ws, self._scanned, self._state = buf[i + len(TOOL_START):], [], 0, \
                "head"
            return True
        if final:
            if self.forced:  # a call's tag cut short (forced calls: no content)
                buf, self._ws = "", []
            if buf or not self.calls:  # trailing whitespace is the format's after a call
                self._content.extend(self._ws)
            self._content.append(buf)
            self._buf, self._ws = "", []
            return False
        keep = prefix_hold(buf, (TOOL_START,), len(TOOL_START) - 1)
        body = buf[:len(buf) - keep]
        text = body.rstrip(_WS)
        if text:
            self._content.extend(self._ws)
            self._content.append(text)
            self._ws = []
        if len(text) < len(body):
            self._ws.append(body[len(text):])
        self._buf = buf[len(body):]
        return False

    def _not_a_call(self, final: bool) -> bool:
        """The block so far is no call: its tag goes out as content as written (with the
        whitespace before it), and the text after it is read again (a real call may follow).
        Forced calls at the end: the block is a call cut short before its name was whole (the
        grammar writes nothing else): its tag is dropped, and so is the rest (`_step_out`)."""
        if not (self.forced and final):
            self._content.append(self._raw)
        self._raw, self._state = "", "out"
        return True

    def _step_head(self, final: bool) -> bool:
        buf = self._buf
        gap = _WS_RUN.match(buf).end()  # (no copy of the text after it: a JSON call is long)
        if gap > MAX_GAP_CHARS:
            return self._not_a_call(final)
        if buf.startswith(FUNCTION_START, gap):
            name, rest = _tag_name(buf[gap:], FUNCTION_START)
            if name is None:
                return self._not_a_call(final) if final else False
            if not name:
                return self._not_a_call(final)
            self._open_call(name)
            self._deltas.append(ToolCallDelta(self.calls - 1, "{", _new_id(), name))
            self._buf, self._state = rest, "params"
            return True
        if buf.startswith("{", gap):  # hermes form: a JSON object with name and arguments
            end = buf.find(TOOL_END, max(gap, self._scanned - len(TOOL_END)))
            self._scanned = len(buf)
            if end < 0:
                return self._not_a_call(final) if final else False
            call = _json_call(buf[gap:end])
            if call is None:
                return self._not_a_call(final)
            self._open_call(call[0])
            self._deltas.append(ToolCallDelta(self.calls - 1, call[1], _new_id(), call[0]))
            if self._call_ended():
                return False
            self._close_call(buf[end + len(TOOL_END):])
            return True
        if not final and FUNCTION_START.startswith(buf[gap:gap + len(FUNCTION_START) + 1]):
            return False  # may still become "<function="
        return self._not_a_call(final)

    def _open_call(self, name: str) -> None:
        self.calls += 1
        self._fn_types = self._types.get(name, {})
        self._first_param = True

    def _close_call(self, rest: str) -> None:
        self._buf, self._raw, self._state = rest, "", "out"

    def _step_params(self, final: bool) -> bool:
        s = self._buf = self._buf.lstrip(_WS)  # whitespace between tags is the format's
        if s.startswith(PARAM_START):
            name, rest = _tag_name(s, PARAM_START)
            if name is None and final:  # cut inside the tag: the arguments stay unfinished
                self.unfinished = True
                return False
            if name is None or (name and not rest and not final):
                return False  # the name, or whether a newline follows it, is still coming
            if name:
                return self._open_param(name, rest)
        else:
            for tag, after in ((FUNCTION_END, "after"), (TOOL_END, None)):
                if s.startswith(tag):
                    self._args("}")
                    if self._call_ended():
                        return False
                    if after is None:
                        self._close_call(s[len(tag):])
                    else:
                        self._buf, self._state = s[len(tag):], after
                    return True
            if not final and any(t.startswith(s) for t in (PARAM_START, FUNCTION_END, TOOL_END)):
                return False
            if final and s and PARAM_START.startswith(s):  # cut inside the next "<parameter="
                self.unfinished = True
                return False
        # every parameter ended and what follows is no tag (or nothing: the answer stopped
        # where </function> was due): the call is closed, the text is content
        self._args("}")
        if self._call_ended():
            return False
        self._close_call(s)
        return True

    def _call_ended(self) -> bool:
        """After a call's arguments closed: whether max_calls are reached, and so the rest of
        the answer is dropped (`stopped`)."""
        if self.max_calls is None or self.calls < self.max_calls:
            return False
        self.stopped = True
        self._state, self._buf, self._ws = "stopped", "", []
        return True

    def _step_stopped(self, final: bool) -> bool:
        self._buf = ""
        return False

    def _open_param(self, name: str, rest: str) -> bool:
        if rest.startswith("\n"):
            rest = rest[1:]
        self._param_types = self._fn_types.get(name, self._fn_types.get(OTHER, set()))
        self._param_is_string = _is_string(self._param_types)
        sep = "" if self._first_param else ", "
        self._first_param = False
        key = json.dumps(name, ensure_ascii=False)
        self._args(f'{sep}{key}: "' if self._param_is_string else f"{sep}{key}: ")
        self._buf, self._scanned, self._state = rest, 0, "value"
        self.unfinished = True
        return True

    def _step_value(self, final: bool) -> bool:
        buf = self._buf
        # a long non-string value (an object) stays in _buf until it ends: search only the new
        # text (and a tag's length before it) or each token would rescan the whole value
        start = max(0, self._scanned - max(map(len, VALUE_ENDS)))
        self._scanned = len(buf)
        ends = [(buf.find(t, start), t) for t in VALUE_ENDS]
        found = [(i, t) for i, t in ends if i >= 0]
        if found:
            i, tag = min(found)
            value = buf[:i]
            if value.endswith("\n"):
                value = value[:-1]
            self._end_value(value)
            self._buf = buf[i + len(tag):] if tag == PARAM_END else buf[i:]
            self._state = "params"
            return True
        if not final and not self._param_is_string:
            return False  # sent whole once it ends
        # the value's text so far: less a held beginning of a closing tag and the format's
        # newline before it (at the end too: a cut inside `</param` is the markup's)
        cut = len(buf) - prefix_hold(buf, VALUE_ENDS, max(map(len, VALUE_ENDS)) - 1)
        if cut > 0 and buf[cut - 1] == "\n":
            cut -= 1
        if final:  # cut inside the value: arguments left unfinished (see the module docstring)
            self._args(_escaped(buf[:cut]) if self._param_is_string else buf[:cut])
            self._buf = ""
            return False
        if cut > 0:
            self._args(_escaped(buf[:cut]))
            self._buf, self._scanned = buf[cut:], len(buf) - cut
        return False

    def _end_value(self, value: str) -> None:
        self.unfinished = False
        if self._param_is_string:
            self._args(_escaped(value) + '"')
        else:
            self._args(json.dumps(convert_value(value, self._param_types, self.exact), ensure_ascii=False))

    def _step_after(self, final: bool) -> bool:
        s = self._buf = self._buf.lstrip(_WS)
        if s.startswith(TOOL_END):
            self._close_call(s[len(TOOL_END):])
            return True
        if s.startswith(FUNCTION_START):  # a second function in one block: a call of its own
            self._buf, self._raw, self._scanned, self._state = s, "", 0, "head"
            return True
        if not final and any(t.startswith(s) for t in (TOOL_END, FUNCTION_START)):
            return False
        self._close_call(s)  # </tool_call> missing: what follows is content
        return True


def _json_call(text: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a hermes-form call {"name", "arguments"}; None if the
    text is no such object."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):  # ValueError: also an int of over 4300 digits
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    try:
        if isinstance(args, str):  # the arguments as JSON text, OpenAI's own shape
            args = json.loads(args) if args.strip() else {}
        if not isinstance(args, dict):
            return None
        return obj["name"], json.dumps(args, ensure_ascii=False, allow_nan=False)
    except (ValueError, RecursionError):  # NaN / Infinity: no JSON a client can read
        return None


def merge(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """deltas with each run of pieces of one call joined: one entry per call in a chunk."""
    merged: list[ToolCallDelta] = []
    for d in deltas:
        if merged and merged[-1].index == d.index and d.id is None:
            merged[-1].arguments += d.arguments
        else:
            merged.append(ToolCallDelta(d.index, d.arguments, d.id, d.name))
    return merged


def split(text: str, tools: list[dict] | None, max_calls: int | None = None,
          forced: bool = False) -> tuple[str, list[dict[str, Any]], bool]:
    """(content, tool_calls, unfinished) of a whole answer fed at once (the reference the tests
    hold a stream's pieces to): the calls in OpenAI's message shape (`join_calls`);
    unfinished: the last call was cut inside a value (its arguments are no complete JSON
    object)."""
    s = ToolCallSplitter(tools, max_calls, forced)
    c1, d1 = s.feed(text)
    c2, d2 = s.finish()
    return c1 + c2, join_calls(d1 + d2), s.unfinished


def join_calls(deltas: list[ToolCallDelta]) -> list[dict[str, Any]]:
    """The calls of an answer's deltas, in OpenAI's message shape [{"id", "type": "function",
    "function": {"name", "arguments"}}]."""
    calls: list[dict[str, Any]] = []
    for d in deltas:
        if d.id is not None:
            calls.append({"id": d.id, "type": "function",
                          "function": {"name": d.name, "arguments": d.arguments}})
        else:
            calls[d.index]["function"]["arguments"] += d.arguments
    return calls
