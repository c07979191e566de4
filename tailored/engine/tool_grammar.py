"""The tool-call grammar: an answer held to Qwen3.6's tool-call XML (tool_calls.py reads it).

A "tool_calls" spec (types.StructuredOutput; JSON {"tools", "tool_choice",
"parallel_tool_calls", "answer"?}) compiles to:

- tool_choice "required" or a named function (forced calls): xgrammar's structural tag for
  this model family (`get_model_structural_tag("qwen_3_5", ...)`): `<tool_call>` /
  `</tool_call>` as their tokens, the function names of `tools`, each one's arguments as
  `<parameter=NAME>` blocks per its JSON Schema. "required" allows one or more calls and
  nothing else (one with parallel_tool_calls false; `_calls_only`), a named function exactly
  one call of it.
- tool_choice "auto" with an `answer` (response_format or structured_outputs beside tools):
  either such calls or the answer's grammar (`answer`: {"kind", "schema", "compact"} of its
  own StructuredOutput): the model calls a tool or answers in the schema.

Exact values (`exact_value_newlines`): the chat template writes each value between one
newline after `<parameter=NAME>` and one before `</parameter>`, and the parser drops exactly
those two. xgrammar's tag lets any one whitespace character stand there, or none, outside the
schema's `maxLength`, `pattern` and `format`: a 12-character value written as "\\n" + value +
" " came back with 13 characters. The grammar here has exactly one newline on each side, so the
value the parser reads is the one the schema held.
"""

from __future__ import annotations

import functools
import json
import re

from tailored.engine.schema_formats import exact_formats
from tailored.engine.tool_format import VALUE_ENDS

# whitespace characters allowed in a row around the tool-call format's parts (between
# parameters, around the function tags): the chat template writes single newlines; the
# newlines around a value are fixed (`exact_value_newlines`)
TOOL_CALL_WHITESPACE = 1
# xgrammar's structural-tag template of the Qwen3.5/3.6 tool-call format
_TOOL_CALL_FORMAT = "qwen_3_5"
# structural-tag fields that name tokens (by text or id)
_TOKEN_LISTS = ("trigger_tokens", "exclude_tokens")
# in xgrammar's printed grammar: a value between its tags, with the whitespace rule on each
# side ('"<parameter=NAME" ">" ws VALUE ws "</parameter>"', NAME and VALUE rules or literals)
_VALUE_SLOT = re.compile(r'">" (\w+) ((?:\w+|\(\([^()]*\)\))) (\w+) "</parameter>"')
_RULE = re.compile(r'^(\w+) ::= (.*)$', re.MULTILINE)
_OPTIONAL_SPACE = '("" | ([ \\n\\r\\t]))'
_FREE_SLOT = re.compile(r'">" (\w+) "</parameter>"')
# a closing tag in a sequence (not in a TagDispatch's excludes list)
_CLOSING = re.compile(r'(?<=[\w)]) "</parameter>"')


def tool_call_grammar(xgr, spec: dict, tokenizer, answer_grammar=None):
    """The grammar of a "tool_calls" spec (parsed JSON; see the module docstring), its marker
    tokens given as ids (a structural tag names them as text, which only a compiler could
    resolve; the engine thread parses before the compiler exists). answer_grammar: the
    grammar of the answer beside the calls with tool_choice "auto". Raises ValueError (the
    caller names the field)."""
    choice = spec["tool_choice"]
    tools = [_exact_tool(t) for t in spec["tools"]]
    forced = "required" if choice == "auto" else choice
    tag = xgr.get_model_structural_tag(
        _TOOL_CALL_FORMAT, tools=tools, tool_choice=forced,
        reasoning="disabled",  # the grammar starts after </think> (Guide)
        parallel_tool_calls=spec["parallel_tool_calls"], token_markers=True,
        max_whitespace_cnt=TOOL_CALL_WHITESPACE)
    tag = _calls_only(_exclude_value_ends(tag.model_dump(mode="json")))
    calls = xgr.Grammar.from_structural_tag(json.dumps(_token_ids(tag, tokenizer)))
    calls = xgr.Grammar.from_ebnf(exact_value_newlines(str(calls)), root_rule_name="root")
    calls = xgr.Grammar.concat(_leading_newlines(xgr), calls)
    if choice != "auto":
        return calls
    return xgr.Grammar.union(calls, answer_grammar)


def _exact_tool(tool: dict) -> dict:
    """A tool with its parameters' formats held exactly (schema_formats.py)."""
    fn = tool.get("function") or {}
    if not isinstance(fn.get("parameters"), dict):
        return tool
    return {**tool, "function": {**fn, "parameters": exact_formats(fn["parameters"])}}


def exact_value_newlines(text: str) -> str:
    """xgrammar's printed tool-call grammar with exactly one newline on each side of every
    parameter value (see the module docstring). Raises ValueError when a value's slot is not
    in the shape this rewrite knows (a new xgrammar printing it otherwise)."""
    rules = dict(_RULE.findall(text))

    def fix(m: re.Match) -> str:
        before, value, after = m.groups()
        if rules.get(before) != _OPTIONAL_SPACE or rules.get(after) != _OPTIONAL_SPACE:
            raise ValueError(f"unexpected tool-call grammar around a value: {m.group(0)[:120]}")
        return f'">" "\\n" {value} "\\n" "</parameter>"'

    out, n = _VALUE_SLOT.subn(fix, text)
    # a free string (no length, pattern or format) is the text between the tags, whitespace
    # and all: any text is such a string, and the parser's newlines are the template's
    free = [m for m in _FREE_SLOT.findall(text) if rules.get(m, "").startswith("TagDispatch(")]
    if n + len(free) != len(_CLOSING.findall(text)):
        raise ValueError("unexpected tool-call grammar: a parameter value in an unknown shape")
    return out


def _calls_only(tag: dict) -> dict:
    """xgrammar's "required" tag (free text with calls triggered by `<tool_call>`, at least
    one) as calls only: one or more, separated by a newline (as the chat template joins them),
    no text before, between or after them. Free text let a random-weight model write on after
    its call to max_tokens, and spell `<tool_call>` out of ordinary tokens, which the parser
    reads as a call of any name (a function that is not among the tools)."""
    fmt = tag["format"]
    if fmt.get("type") != "token_triggered_tags":
        return tag  # a named function: exactly one call already
    return {**tag, "format": {"type": "tags_with_separator", "tags": fmt["tags"],
                              "separator": "\n", "at_least_one": True,
                              "stop_after_first": fmt.get("stop_after_first", False)}}


def _has_length_bound(schema) -> bool:
    """Whether a JSON Schema (as Python values) bounds a string's length anywhere."""
    if isinstance(schema, list):
        return any(_has_length_bound(x) for x in schema)
    if not isinstance(schema, dict):
        return False
    return "minLength" in schema or "maxLength" in schema or \
        any(_has_length_bound(v) for v in schema.values())


def _exclude_value_ends(node):
    """A structural tag (as JSON values) whose Qwen-XML argument schemas keep VALUE_ENDS (the
    texts that end a value for tool_calls.py's parser, and vLLM's: a string value holding one
    would be read as ending there) out of their string values (xgrammar's `excludes`). Not
    for a schema that bounds a string's length: xgrammar drops minLength / maxLength from
    strings it filters, and the bound is the user's; there a value may hold a VALUE_ENDS text
    (the parser then ends it early)."""
    if isinstance(node, list):
        return [_exclude_value_ends(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _exclude_value_ends(v) for k, v in node.items()}
    if (out.get("type") == "json_schema" and out.get("style") == "qwen_xml"
            and not _has_length_bound(out.get("json_schema"))):
        out["excludes"] = sorted(set(out.get("excludes") or ()) | set(VALUE_ENDS))
    return out


def _token_ids(node, tokenizer):
    """A structural tag (as JSON values) with every token it names by text given by id.
    Raises ValueError for a text that is no single token of the vocabulary."""
    def tid(t):
        if isinstance(t, int):
            return t
        i = tokenizer.token_to_id(t)
        if i is None:
            raise ValueError(f"the tokenizer has no token {t!r}")
        return i

    if isinstance(node, list):
        return [_token_ids(x, tokenizer) for x in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for k, v in node.items():
        if k == "token" and node.get("type") == "token":
            out[k] = tid(v)
        elif k in _TOKEN_LISTS and isinstance(v, list):
            out[k] = [tid(t) for t in v]
        else:
            out[k] = _token_ids(v, tokenizer)
    return out


@functools.lru_cache(maxsize=1)
def _leading_newlines(xgr):
    """Before tool calls: the newlines Qwen writes after `</think>` (at most 2; more
    whitespace ends up in the answer's content when a call is cut)."""
    return xgr.Grammar.from_ebnf('root ::= "" | "\\n" | "\\n\\n"')
