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

Values that do not end early (`bounded_strings_without_value_ends`): a string value that held
a text ending a value for the parser (`</parameter>`, `<parameter=`, `</function>`,
`</tool_call>`: VALUE_ENDS) would be read as ending there. xgrammar keeps them out of a
string (its `excludes`) only where the string has no length bound, as it drops the bound
then; the nano model copied `</parameter>` from its prompt into a maxLength-12 argument, and
the call lost its next, required argument. A bounded string (up to MAX_BOUND_CHARS) here
holds no "</" and no "<p", which covers them, and a free string's text excludes all four
(xgrammar's own excludes there name `</parameter>` only). A JSON string inside an object
argument of such a schema may still hold them (its bound, or none, is xgrammar's).

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

from tailored.engine.grammar_text import rewrite
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
# a string with a length bound: its character rule repeated (printed `NAME_characters{m, k}`)
_BOUNDED = re.compile(r"\b(\w+_characters)\{(\d+), (-?\d+)\}")
MAX_BOUND_CHARS = 512  # a longer bound keeps xgrammar's rule (a value may then end early)
# the bounded strings' character classes as xgrammar prints them (raw, as an XML value; in
# JSON, a nested object's), and each without '<' and without '<', '/', 'p' (no surrogates,
# no raw control character in JSON: grammar_text.py)
_CLASSES = {
    "[\\0-\\U0010ffff]": ("[^<\\U0000d800-\\U0000dfff]",
                            "[^</p\\U0000d800-\\U0000dfff]"),
    '[^\\"\\\\\\r\\n]': ('[^<\\0-\\x1f\\"\\\\\\U0000d800-\\U0000dfff]',
                             '[^</p\\0-\\x1f\\"\\\\\\U0000d800-\\U0000dfff]'),
}
# a free string's text (xgrammar's TagDispatch) excludes the closing tag only, and all of them
_FREE_EXCLUDES = 'excludes=("</parameter>")'
_ALL_EXCLUDES = "excludes=(" + ", ".join(f'"{t}"' for t in sorted(VALUE_ENDS)) + ")"
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
    text = bounded_strings_without_value_ends(exact_value_newlines(str(calls)))
    # (parsed again from its printed text: the accents of names kept as written, as
    # grammar_text.safe_grammar does)
    calls = xgr.Grammar.from_ebnf(rewrite(text), root_rule_name="root")
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


def bounded_strings_without_value_ends(text: str) -> str:
    """xgrammar's printed tool-call grammar with each length-bounded string (m to k
    characters, k up to MAX_BOUND_CHARS or none) of the same lengths, but holding no "</"
    and no "<p" (see the module docstring): a '<' is followed by another '<', a character
    other than '/' and 'p', or the string's end. Rules by characters left and whether the
    last one was '<'."""
    rules = dict(_RULE.findall(text))
    new: list[str] = []
    done: dict[tuple[str, int, int], str] = {}

    def fix(m: re.Match) -> str:
        name, lo, hi = m.group(1), int(m.group(2)), int(m.group(3))
        body = rules.get(name, "")
        cls = body[2:-2] if body.startswith("((") and body.endswith("))") else ""
        if cls not in _CLASSES or max(lo, hi) > MAX_BOUND_CHARS:
            return m.group(0)
        if (name, lo, hi) not in done:
            done[(name, lo, hi)] = _bounded_rules(new, f"{name}_{lo}_{hi}".replace("-", "n"),
                                                  *_CLASSES[cls], lo, hi)
        return done[(name, lo, hi)]

    out = _BOUNDED.sub(fix, text).replace(_FREE_EXCLUDES, _ALL_EXCLUDES)
    return out + "".join(f"\n{r}" for r in new) + ("\n" if new else "")


def _bounded_rules(out: list[str], base: str, free: str, after_lt: str, lo: int,
                   hi: int) -> str:
    """Append the rules of a string of lo to hi characters (hi -1: no bound) with no "</"
    or "<p" to `out`; the name of its start rule."""
    def name(state, part, n):
        return f"{base}_{state}_{part}{n}"

    chars = {"a": free, "b": after_lt}  # a: after anything but '<'; b: right after '<'
    rest = "inf" if hi < 0 else hi - lo
    for s in "ab":  # the optional part: up to `rest` more characters
        if hi < 0:
            out.append(f'{name(s, "o", "inf")} ::= ("" | ({chars[s]} {name("a", "o", "inf")}) '
                       f'| ("<" {name("b", "o", "inf")}))')
            continue
        out.append(f'{name(s, "o", 0)} ::= ("")')
        for n in range(1, rest + 1):
            out.append(f'{name(s, "o", n)} ::= ("" | ({chars[s]} {name("a", "o", n - 1)}) '
                       f'| ("<" {name("b", "o", n - 1)}))')
    for s in "ab":  # the mandatory part: lo characters
        out.append(f'{name(s, "m", 0)} ::= ({name(s, "o", rest)})')
        for n in range(1, lo + 1):
            out.append(f'{name(s, "m", n)} ::= (({chars[s]} {name("a", "m", n - 1)}) '
                       f'| ("<" {name("b", "m", n - 1)}))')
    return name("a", "m", lo)


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
