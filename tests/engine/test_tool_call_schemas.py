"""Grammar-held tool calls give arguments that satisfy their schema exactly (engine/
tool_grammar.py, engine/schema_formats.py, read back by server/tool_calls.py).

Property-style: random parameter schemas (maxLength / minLength, pattern, format, enums with
whitespace of their own, bounded numbers, booleans, nested objects, arrays; required or not),
random walks through each forced-call grammar over the nano tokenizer's tokens (what a
random-weight model does under the mask), each answer parsed as the server parses it and
validated with jsonschema, formats checked. Then the texts a new user's frameworks got before
the fix (a 13th character of whitespace beside a maxLength-12 value, "abc " for a pattern, a
trailing space on a date), and the grammar of tool_choice "auto" beside a response_format:
calls or the answer, nothing else."""

from __future__ import annotations

import json
import random
import re
from datetime import date, datetime, time
from pathlib import Path

import pytest
import torch

import tailored
from tailored.engine.schema_formats import FORMAT_PATTERNS, exact_formats
from tailored.engine.types import StructuredOutput
from tailored.server.tool_calls import split

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

NANO = Path(tailored.__file__).parent / "data" / "nano"
VALIDATOR = jsonschema.Draft202012Validator
SCHEMAS = 150  # random schemas
WALKS = 3  # random answers of each
MAX_STEPS = 400


@pytest.fixture(scope="module")
def grammars():
    from tailored.engine.grammar import Grammars
    from tailored.tokenizer import load_tokenizer

    tok = load_tokenizer(NANO)
    return Grammars(tok, 4160, tok.eos_token_ids), tok


def _tool(params, name="f"):
    return {"type": "function", "function": {"name": name, "parameters": params}}


def _spec(tools, choice="required", parallel=False, answer=None):
    d = {"tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel}
    if answer is not None:
        d["answer"] = answer
    return StructuredOutput("tool_calls", json.dumps(d))


_SHIFTS = torch.arange(32, dtype=torch.int32)


def _allowed(mask: torch.Tensor, vocab: int) -> list[int]:
    bits = (mask.unsqueeze(1) >> _SHIFTS) & 1
    return [i for i in bits.flatten().nonzero().flatten().tolist() if i < vocab]


def _walk(g, tok, spec, rng) -> str | None:
    """A random answer under the grammar (uniform over the allowed tokens at each step), or
    None when it ran past MAX_STEPS."""
    guide = g.guide(spec, tok.encode("hi"))
    ids = []
    for _ in range(MAX_STEPS):
        t = rng.choice(_allowed(guide.mask(), tok.vocab_size))
        if t in tok.eos_token_ids:
            break
        guide.accept(t)
        assert not guide.failed
        ids.append(t)
        if guide.done:
            break
    else:
        return None
    return tok.decode(ids, skip_special_tokens=False)


_WORDS = ["red", "a b", " padded ", "x\ty", "Paris", "São Paulo", "1", "true", "null"]
_PATTERNS = ["^[a-z]{1,5}$", "^[A-Z][a-z]{0,3}$", "^[0-9]{2,4}$", "^(yes|no)$",
             "^[a-c]+-[0-9]$"]
_FORMATS = ["date", "time", "date-time", "ipv4", "ipv6", "uuid"]


def _leaf(rng: random.Random) -> dict:
    kind = rng.choice(["maxlen", "minmax", "pattern", "format", "enum", "int", "num", "bool",
                       "array"])
    if kind == "maxlen":
        return {"type": "string", "maxLength": rng.randint(1, 12)}
    if kind == "minmax":
        lo = rng.randint(0, 6)
        return {"type": "string", "minLength": lo, "maxLength": lo + rng.randint(0, 6)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(_PATTERNS)}
    if kind == "format":
        return {"type": "string", "format": rng.choice(_FORMATS)}
    if kind == "enum":
        return {"type": "string", "enum": rng.sample(_WORDS, rng.randint(1, 4))}
    if kind == "int":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 1000)}
    if kind == "num":
        return {"type": "number", "minimum": -10, "maximum": 10}
    if kind == "bool":
        return {"type": "boolean"}
    return {"type": "array", "items": {"type": "string", "enum": ["x", "y z"]},
            "maxItems": 3}


def _object(rng: random.Random, depth: int = 0) -> dict:
    props = {}
    for i in range(rng.randint(1, 4)):
        nest = depth < 2 and rng.random() < 0.25
        props[f"p{i}"] = _object(rng, depth + 1) if nest else _leaf(rng)
    required = [k for k in props if rng.random() < 0.6]
    return {"type": "object", "properties": props, "required": required}


def _check(params: dict, text: str, tools: list[dict]) -> dict:
    content, calls, unfinished = split(text, tools, max_calls=1, forced=True)
    assert not content and not unfinished and len(calls) == 1, (text, content, calls)
    args = json.loads(calls[0]["function"]["arguments"])
    VALIDATOR(params, format_checker=VALIDATOR.FORMAT_CHECKER).validate(args)
    return args


def test_random_schemas_give_arguments_that_validate(grammars):
    g, tok = grammars
    rng = random.Random(20261207)
    walked = 0
    for _ in range(SCHEMAS):
        params = _object(rng)
        tools = [_tool(params)]
        spec = _spec(tools)
        for _ in range(WALKS):
            text = _walk(g, tok, spec, rng)
            if text is None:
                continue
            walked += 1
            try:
                _check(params, text, tools)
            except Exception as e:  # noqa: BLE001 - the schema and text say what failed
                raise AssertionError(f"{json.dumps(params)}\n{text!r}\n{e}") from None
    assert walked >= SCHEMAS * WALKS * 0.9


def _call(**values) -> str:
    body = "".join(f"<parameter={k}>{v}</parameter>\n" for k, v in values.items())
    return f"<tool_call>\n<function=f>\n{body}</function>\n</tool_call>"


def _takes(g, tok, spec, text) -> bool:
    guide = g.guide(spec, tok.encode("hi"))
    for t in tok.encode(text, allow_special=True):
        if t not in _allowed(guide.mask(), tok.vocab_size):
            return False
        guide.accept(t)
    return tok.eos_token_ids[0] in _allowed(guide.mask(), tok.vocab_size)


BOUNDED = {"type": "object", "properties": {
    "s": {"type": "string", "maxLength": 12},
    "p": {"type": "string", "pattern": "^[a-z]{1,5}$"},
    "d": {"type": "string", "format": "date"},
    "e": {"type": "string", "enum": [" padded ", "red"]},
}, "required": []}


@pytest.mark.parametrize("value,ok", [
    ("\nabcdefghijkl\n", True),
    ("\nabcdefghijkl \n", False),  # a 13th character, before the fix as the format's space
    ("\nabcdefghijkl </parameter", False),
    ("\nabcdefghijkl\t", False),
    (" abcdefghijkl\n", False),
    ("\r\nabcdefghijk\n", False),
    ("abcdefghijkl", False),  # the template's newlines are the format's: always there
    ("\n\nabcdefghijk\n", True),  # a value of its own newline and 11 letters
])
def test_a_bounded_string_has_no_whitespace_beside_it(grammars, value, ok):
    g, tok = grammars
    text = _call(s=value).replace("</parameter</parameter>", "</parameter>")
    assert _takes(g, tok, _spec([_tool(BOUNDED)]), text) is ok
    if ok:
        args = _check(BOUNDED, text, [_tool(BOUNDED)])
        assert args["s"] == value[1:-1]


@pytest.mark.parametrize("key,value,ok", [
    ("p", "\nabc\n", True), ("p", "\nabc \n", False), ("p", "\nabc </parameter", False),
    ("p", "\n abc\n", False),
    ("d", "\n2024-02-29\n", True), ("d", "\n2024-01-01 \n", False),
    ("d", "\n2023-02-29\n", False), ("d", "\n1934-02-30\n", False),
    ("e", "\n padded \n", True), ("e", "\npadded\n", False), ("e", "\nred \n", False),
])
def test_pattern_format_and_enum_values_are_exact(grammars, key, value, ok):
    g, tok = grammars
    text = _call(**{key: value}).replace("</parameter</parameter>", "</parameter>")
    assert _takes(g, tok, _spec([_tool(BOUNDED)]), text) is ok
    if ok:
        assert _check(BOUNDED, text, [_tool(BOUNDED)])[key] == value[1:-1]


def test_format_patterns_accept_what_the_validators_accept():
    """schema_formats' patterns against Python's datetime / jsonschema's format checker."""
    checker = VALIDATOR.FORMAT_CHECKER
    rng = random.Random(7)
    for _ in range(3000):
        y, m, d = rng.randint(0, 9999), rng.randint(1, 12), rng.randint(1, 31)
        text = f"{y:04d}-{m:02d}-{d:02d}"
        try:
            valid = bool(date.fromisoformat(text))
        except ValueError:
            valid = False
        assert bool(re.fullmatch(FORMAT_PATTERNS["date"][1:-1], text)) is valid, text
    for text in ["23:59:59Z", "00:00:00.5+01:00", "12:30:15-23:59", "24:00:00Z", "12:60:00Z",
                 "12:00:60Z", "12:00:00", "12:00:00+24:00", "1:00:00Z"]:
        ok = bool(re.fullmatch(FORMAT_PATTERNS["time"][1:-1], text))
        assert ok is checker.conforms(text, "time"), text
        if ok:
            time.fromisoformat(text)
        stamp = "2024-02-29T" + text
        assert bool(re.fullmatch(FORMAT_PATTERNS["date-time"][1:-1], stamp)) is \
            checker.conforms(stamp, "date-time"), stamp
        if ok:
            datetime.fromisoformat(stamp)
    for text in ["0.0.0.0", "255.255.255.255", "256.1.1.1", "01.2.3.4", "1.2.3", "10.0.0.255"]:
        assert bool(re.fullmatch(FORMAT_PATTERNS["ipv4"][1:-1], text)) is \
            checker.conforms(text, "ipv4"), text


def test_exact_formats_rewrites_schemas_only():
    schema = {"type": "object", "properties": {
        "d": {"type": "string", "format": "date"},
        "keep": {"type": "string", "format": "date", "maxLength": 10},
        "other": {"type": "string", "format": "email"},
        "enum": {"enum": [{"format": "date"}]},
    }, "$defs": {"D": {"format": "ipv4"}}, "items": {"anyOf": [{"format": "time"}]}}
    out = exact_formats(schema)
    assert out["properties"]["d"] == {"type": "string", "pattern": FORMAT_PATTERNS["date"]}
    assert out["properties"]["keep"] == schema["properties"]["keep"]
    assert out["properties"]["other"] == schema["properties"]["other"]
    assert out["properties"]["enum"] == schema["properties"]["enum"]  # a value, not a schema
    assert out["$defs"]["D"] == {"pattern": FORMAT_PATTERNS["ipv4"]}
    assert out["items"]["anyOf"][0] == {"pattern": FORMAT_PATTERNS["time"]}
    assert schema["properties"]["d"]["format"] == "date"  # the caller's schema is unchanged


def test_json_schema_answers_hold_formats_exactly(grammars):
    g, tok = grammars
    spec = StructuredOutput("json_schema", json.dumps(
        {"type": "object", "properties": {"d": {"type": "string", "format": "date"}},
         "required": ["d"]}), compact=True)
    assert _takes(g, tok, spec, '{"d":"2024-02-29"}')
    assert not _takes(g, tok, spec, '{"d":"2023-02-29"}')


# ---- tool_choice "auto" beside a response_format: calls or the answer -----------------------

WEATHER = _tool({"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                 "required": ["city"]}, "get_weather")
PICK = {"type": "object", "properties": {"pick": {"enum": ["red", "green"]}},
        "required": ["pick"]}
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "</function>\n</tool_call>")
ANSWER = {"kind": "json_schema", "schema": json.dumps(PICK), "compact": False}


@pytest.mark.parametrize("parallel,text,ok", [
    (True, CALL, True),
    (True, "\n\n" + CALL, True),
    (True, CALL + "\n" + CALL, True),
    (False, CALL + "\n" + CALL, False),
    (True, '{"pick": "red"}', True),
    (True, '\n\n{"pick": "green"}', True),
    (True, '{"pick": "blue"}', False),  # the answer follows its schema
    (True, "Sure. " + CALL, False),  # calls or the answer: no free text
    (True, CALL + '\n{"pick": "red"}', False),
    (True, '{"pick": "red"}' + CALL, False),
    (True, CALL.replace("\nParis\n", "\nParis \n"), True),  # (a 6-character value)
    (True, CALL.replace("\nParis\n", "\n" + "P" * 13 + "\n"), False),
])
def test_calls_or_the_answer(grammars, parallel, text, ok):
    g, tok = grammars
    assert _takes(g, tok, _spec([WEATHER], "auto", parallel, ANSWER), text) is ok


def test_calls_or_the_answer_name_the_field_at_fault(grammars):
    g, _ = grammars
    bad_answer = {**ANSWER, "schema": json.dumps({"type": "object", "not": {}})}
    with pytest.raises(ValueError, match=r"^response_format: .*'not'"):
        g.parse(_spec([WEATHER], "auto", True, bad_answer))
    bad_tool = _tool({"type": "object", "properties": {"x": {"not": {}}}})
    with pytest.raises(ValueError, match=r"^tool_choice cannot be used: tools\[0\]"):
        g.parse(_spec([bad_tool], "auto", True, ANSWER))
    regex = {"kind": "regex", "schema": "[ab]{2}", "compact": False}
    g.parse(_spec([WEATHER], "auto", True, regex))  # any answer kind (structured_outputs)


@pytest.mark.parametrize("value,ok", [
    ("\n</parameter>\n", False),  # 12 characters: within maxLength, but it ends the value
    ("\nab<parameter=x\n", False), ("\n</function>\n", False), ("\na</tool_call>\n", False),
    ("\na<b\n", True), ("\n<<a\n", True), ("\nx<\n", True), ("\n<q/p>\n", True),
])
def test_a_bounded_string_holds_no_text_that_ends_a_value(grammars, value, ok):
    """The parser ends a value at `</parameter>`, `<parameter=`, `</function>` or
    `</tool_call>`: a bounded string cannot hold them (no "</", no "<p"), a free one neither
    (the nano model copied `</parameter>` from its prompt into a maxLength-12 argument, and the
    call lost its next, required one)."""
    g, tok = grammars
    params = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 12},
                                               "f": {"type": "string"}},
              "required": ["s", "f"]}
    text = _call(s=value, f="\nfree\n")
    assert _takes(g, tok, _spec([_tool(params)]), text) is ok
    if ok:
        assert _check(params, text, [_tool(params)])["s"] == value[1:-1]
    free = _call(s="\nx\n", f=value)
    assert _takes(g, tok, _spec([_tool(params)]), free) is ("</" not in value and "<p" not in value)
