"""Tool calls: the XML form parsed out of the answer (tailored/server/tool_calls.py), streamed and
whole, and the chat route with `tools` (failure-cases §8: arguments stream as written, the
reasoning split is not swallowed, every request shape streaming and not)."""

from __future__ import annotations

import json
import random
import re
import time

import pytest
from fastapi.testclient import TestClient
from test_server import MODEL, FakeEngine, FakeTokenizer, chat, sse_events

from tailored.server.app import build_app
from tailored.server.async_engine import AsyncEngine
from tailored.server.reasoning import split as split_reasoning
from tailored.server.arg_types import FIXED, OTHER, param_types
from tailored.server.tool_calls import ToolCallSplitter, convert_value, split

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"},
        "opts": {"type": "object"}, "units": {"enum": ["c", "f"]},
        "ratio": {"anyOf": [{"type": "number"}, {"type": "null"}]},
        "flags": {"type": "array"}, "exact": {"type": "boolean"},
    }, "required": ["city"]}}}
TOOLS = [WEATHER, {"type": "function", "function": {"name": "now"}}]
NAMES = {"get_weather", "now"}


def call_xml(name: str, **params) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


TWO_CALLS = ("Let me check.\n\n" + call_xml("get_weather", city='Paris "north"\nbank', days=2,
                                             opts='{"a": [1, {"b": null}]}')
             + "\n" + call_xml("now"))

ANSWERS = [
    TWO_CALLS,
    "plain answer, no call\n\n",
    "ends in a tag's start <tool_c",
    call_xml("get_weather", city="Oslo", ratio="0.5", flags="[1, 2]", exact="True"),
    "text " + call_xml("get_weather", city="A") + "\n\nand words after the call ",
    "<tool_call>not a call</tool_call> then text",
    '<tool_call>\n{"name": "now", "arguments": {"tz": "UTC"}}\n</tool_call>',
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nLima\n</parameter>\n",  # no ends
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n<parameter=days>\n3\n"
    "</function></tool_call>",  # a missing </parameter>s
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nNice\n</parameter>\n</function>\n"
    "<function=now>\n</function>\n</tool_call>",  # two functions in one block
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nBer",  # cut inside a value
    "<tool_call>\n<function=get_weather>\n<parameter=days>\n1",  # cut inside a number
    # no call first, a real one after it (review of session 29: the whole-answer parser lost
    # the real one)
    "I will use <tool_call> tags:\n" + call_xml("now"),
    "<tool_call>oops</tool_call>" + call_xml("now") + "<tool_call>\n" + "\n" * 300,
    "<tool_call>\n<function=now>\n<parameter=x>\n1\n</parameter>\nThat is all.",
]


def run_stream(text: str, pieces: list[int], tools=TOOLS, forced: bool = False):
    """Feed text cut at `pieces` (lengths); (content, {index: (id, name, arguments)}, deltas)."""
    s = ToolCallSplitter(tools, forced=forced)
    content, calls, deltas, at = "", {}, [], 0
    outs = []
    for n in pieces:
        outs.append(s.feed(text[at:at + n]))
        at += n
    outs.append(s.feed(text[at:]))
    outs.append(s.finish())
    for c, ds in outs:
        content += c
        for d in ds:
            deltas.append(d)
            if d.id is not None:
                assert d.index not in calls and d.index == len(calls)
                calls[d.index] = [d.id, d.name, d.arguments]
            else:
                calls[d.index][2] += d.arguments
    return content, calls, deltas


def test_split_whole_answer():
    content, calls, _ = split(TWO_CALLS, TOOLS)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "now"]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c["id"]) and c["type"] == "function"
               for c in calls)
    assert calls[0]["id"] != calls[1]["id"]
    args = json.loads(calls[0]["function"]["arguments"])
    assert args == {"city": 'Paris "north"\nbank', "days": 2, "opts": {"a": [1, {"b": None}]}}
    assert json.loads(calls[1]["function"]["arguments"]) == {}


@pytest.mark.parametrize("text", ANSWERS)
def test_streaming_equals_whole_at_any_cut(text):
    whole_content, whole_calls, _ = split(text, TOOLS)
    rng = random.Random(len(text))
    cuts = [[1] * len(text), [len(text)]]
    cuts += [[rng.randint(1, 6) for _ in range(len(text))] for _ in range(8)]
    for pieces in cuts:
        content, calls, _ = run_stream(text, pieces)
        assert content == whole_content, pieces
        assert [(n, a) for _, n, a in calls.values()] == [
            (c["function"]["name"], c["function"]["arguments"]) for c in whole_calls]


def test_no_call_leaves_the_text_as_it_was():
    for text in ("plain answer, no call\n\n", "ends in a tag's start <tool_c", "a < b > c"):
        assert split(text, TOOLS) == (text, [], False)


def test_string_arguments_stream_before_the_parameter_ends():
    s = ToolCallSplitter(TOOLS)
    _, d = s.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Fra")
    assert d[0].name == "get_weather" and d[0].id
    assert "".join(x.arguments for x in d) == '{"city": "San Fra'
    _, d = s.feed("ncisco\n</param")  # the newline may be the format's: held with the tag
    assert "".join(x.arguments for x in d) == "ncisco"
    _, d = s.feed("eter>\n</function>\n</tool_call>")
    assert "".join(x.arguments for x in d) == '"}'
    assert s.calls == 1


def test_one_delta_per_call_in_a_chunk():
    _, deltas = ToolCallSplitter(TOOLS).feed(TWO_CALLS)
    assert [(d.index, d.id is not None) for d in deltas] == [(0, True), (1, True)]
    assert deltas[0].to_openai() == {"index": 0, "id": deltas[0].id, "type": "function",
                                     "function": {"name": "get_weather",
                                                  "arguments": deltas[0].arguments}}


@pytest.mark.parametrize("text,types,want", [
    ("2", {"integer"}, 2), ("5.0", {"integer"}, 5), ("two", {"integer"}, "two"),
    ("2.5", {"number"}, 2.5), ("true", {"boolean"}, True), ("False", {"boolean"}, False),
    ("null", {"number", "null"}, None), ('{"a": 1}', {"object"}, {"a": 1}),
    ("[1]", {"array"}, [1]), ("[1]", {"object"}, "[1]"), (" 7 ", {"number"}, 7),
])
def test_convert_value(text, types, want):
    got = convert_value(text, types)
    assert got == want and type(got) is type(want)


def test_param_types_from_the_schema():
    types = param_types(TOOLS + [{"type": "function", "function": {"name": "x",
                                                                    "parameters": "bad"}}, 5])
    assert types["get_weather"]["units"] == {"string", FIXED}  # an enum of strings
    assert types["get_weather"]["ratio"] == {"number", "null"}
    assert types["now"] == {} and types["x"] == {}
    # unknown parameters and functions stream as strings
    content, calls, _ = split(call_xml("nope", n="3") + call_xml("get_weather", extra="4"), TOOLS)
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"n": "3"},
                                                                      {"extra": "4"}]


REFS = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object",
    "$defs": {"N": {"type": "integer"}, "Loc": {"type": "object", "properties": {
        "city": {"type": "string"}}}, "Tree": {"anyOf": [{"$ref": "#/$defs/Tree"},
                                                         {"type": "array"}]}},
    "properties": {
        "n": {"$ref": "#/$defs/N"}, "loc": {"$ref": "#/$defs/Loc"},
        "m": {"allOf": [{"$ref": "#/$defs/N"}]}, "pick": {"enum": [1, 2, 3]},
        "five": {"const": 5}, "tz": {"type": "string", "enum": ["UTC", "CET"]},
        "mixed": {"anyOf": [{"type": "integer"}, {"enum": ["auto"]}]},
        "tree": {"$ref": "#/$defs/Tree"}, "lost": {"$ref": "#/$defs/Nope"},
        "text": {"type": "string"}},
    "additionalProperties": {"type": "integer"}}}}


def test_param_types_follow_refs_allof_enums_and_additional_properties():
    """Found by a review of forced tool calls (kb/0050): values whose type only a $ref, a
    one-schema allOf, enum / const values or additionalProperties gave came back as strings
    ('"0 "'), and an enum value kept the whitespace the grammar lets stand beside it."""
    types = param_types([REFS])["f"]
    assert types["n"] == types["m"] == {"integer"} and types["loc"] == {"object"}
    assert types["pick"] == {"integer"} and types["five"] == {"integer"}
    assert types["tree"] == {"array"} and types["lost"] == set()  # a cycle, a missing target
    assert types[OTHER] == {"integer"}
    xml = call_xml("f", n=" 4 ", loc='{"city": "Rome"}', m="0 ", pick="2", five="5",
                   tz=" UTC", mixed=" auto ", text=" as written ", extra="7")
    _, calls, _ = split(xml, [REFS])
    assert json.loads(calls[0]["function"]["arguments"]) == {
        "n": 4, "loc": {"city": "Rome"}, "m": 0, "pick": 2, "five": 5, "tz": "UTC",
        "mixed": "auto", "text": " as written ", "extra": 7}
    # a number where an enum of strings or a number may stand stays a number
    _, calls, _ = split(call_xml("f", mixed="3"), [REFS])
    assert json.loads(calls[0]["function"]["arguments"]) == {"mixed": 3}


def test_a_self_referencing_schema_is_read_in_linear_time():
    defs = {f"D{i}": {"anyOf": [{"$ref": f"#/$defs/D{i + 1}"}, {"$ref": f"#/$defs/D{i + 1}"}]}
            for i in range(40)}
    defs["D40"] = {"type": "integer"}
    tool = {"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "$defs": defs, "properties": {"x": {"$ref": "#/$defs/D0"}}}}}
    assert param_types([tool])["g"]["x"] == {"integer"}  # 2^40 paths without the memo


def _fn(name, params):
    return {"type": "function", "function": {"name": name, "parameters": params}}


def test_param_types_through_a_root_ref_and_root_branches():
    """A second review (kb/0050): pydantic writes a root `$ref` for a self-referencing model;
    its properties were not read (arguments came back as strings)."""
    root_ref = _fn("r", {"$ref": "#/$defs/O", "$defs": {"O": {
        "type": "object", "properties": {"n": {"type": "integer"}, "b": {"type": "boolean"}}}}})
    branches = _fn("a", {"allOf": [{"properties": {"n": {"type": "integer"}}},
                                   {"anyOf": [{"properties": {"s": {"type": "string"}}}]}]})
    types = param_types([root_ref, branches])
    assert types["r"] == {"n": {"integer"}, "b": {"boolean"}}
    assert types["a"] == {"n": {"integer"}, "s": {"string"}}
    _, calls, _ = split(call_xml("r", n="0", b="true "), [root_ref])
    assert json.loads(calls[0]["function"]["arguments"]) == {"n": 0, "b": True}


def test_enums_with_other_values_than_strings():
    """An optional enum (OpenAI strict mode's `"type": ["string", "null"]`) or one of mixed
    values: its non-string values convert, its strings are read whole and stripped."""
    tool = _fn("e", {"type": "object", "properties": {
        "u": {"type": ["string", "null"], "enum": ["C", "F", None]},
        "k": {"enum": ["x", 1, 2, None]}}})
    types = param_types([tool])["e"]
    assert types["u"] == {"string", "null", FIXED}
    assert types["k"] == {"string", "integer", "null", FIXED}
    for u, k, want in (("null ", " 1", {"u": None, "k": 1}), (" C", "x ", {"u": "C", "k": "x"})):
        _, calls, _ = split(call_xml("e", u=u, k=k), [tool])
        assert json.loads(calls[0]["function"]["arguments"]) == want


def test_mutual_ref_cycles_give_the_same_types_in_any_order():
    defs = {"A": {"anyOf": [{"$ref": "#/$defs/B"}, {"type": "integer"}]},
            "B": {"anyOf": [{"$ref": "#/$defs/A"}, {"type": "string"}]}}
    for order in (("p", "q"), ("q", "p")):
        props = {"p": {"$ref": "#/$defs/A"}, "q": {"$ref": "#/$defs/B"}}
        tool = _fn("c", {"type": "object", "$defs": defs,
                         "properties": {k: props[k] for k in order}})
        types = param_types([tool])["c"]
        assert types["p"] == types["q"] == {"integer", "string"}, order


def test_not_a_call_passes_through():
    for text in ("<tool_call>not a call</tool_call> then text",
                 "<tool_call>\n<function=bad\nname>\n</function>\n</tool_call>",
                 "<tool_call>\n" + "<function=" + "x" * 300,
                 '<tool_call>\n{"no": "name"}\n</tool_call>'):
        assert split(text, TOOLS) == (text, [], False), text


def test_hermes_json_form():
    content, calls, _ = split('<tool_call>\n{"name": "now", "arguments": {"tz": "UTC"}}\n'
                           "</tool_call>", TOOLS)
    assert content == "" and calls[0]["function"] == {"name": "now",
                                                      "arguments": '{"tz": "UTC"}'}


def test_forgiven_and_unfinished_calls():
    # every parameter ended, the answer stopped where </function> was due: closed
    _, calls, _ = split(ANSWERS[7], TOOLS)
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Lima"}
    _, calls, _ = split(ANSWERS[8], TOOLS)
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome", "days": 3}
    content, calls, _ = split(ANSWERS[9], TOOLS)
    assert content == "" and [c["function"]["name"] for c in calls] == ["get_weather", "now"]
    # cut inside a value: left unfinished, not closed into a call the model never finished
    for text, partial in ((ANSWERS[10], '{"city": "Ber'), (ANSWERS[11], '{"days": 1')):
        content, calls, _ = split(text, TOOLS)
        assert content == "" and calls[0]["function"]["arguments"] == partial
        with pytest.raises(json.JSONDecodeError):
            json.loads(calls[0]["function"]["arguments"])


def test_a_real_call_after_text_that_is_none():
    for text in ANSWERS[12:14]:
        content, calls, unfinished = split(text, TOOLS)
        assert [c["function"]["name"] for c in calls] == ["now"] and not unfinished
        assert "<tool_call>" in content and "<function=" not in content
    # whitespace before a tag that opens no call stays
    assert split("Use the <tool_call> tag", TOOLS)[0] == "Use the <tool_call> tag"


def test_strict_json_and_model_text_that_breaks_json():
    for text, types in (("NaN", {"number"}), ("1e400", {"number"}), ('{"a": -Infinity}',
                                                                     {"object"}),
                        ("9" * 5000, {"integer"})):  # over Python's int-from-text limit
        assert convert_value(text, types) == text
    content, calls, _ = split('<tool_call>\n{"name": "now", "arguments": {"x": NaN}}\n'
                              "</tool_call>", TOOLS)
    assert calls == [] and "NaN" in content
    _, calls, _ = split('<tool_call>\n{"name": "now", "arguments": "{\\"x\\": 1}"}\n'
                        "</tool_call>", TOOLS)  # arguments as JSON text
    assert calls[0]["function"]["arguments"] == '{"x": 1}'


def test_text_after_a_call_stays_content():
    # no </function> nor </tool_call>: the text after the last parameter is content
    content, calls, _ = split(ANSWERS[14], TOOLS)
    assert content == "That is all." and json.loads(calls[0]["function"]["arguments"]) == {
        "x": "1"}
    content, calls, _ = split(ANSWERS[4], TOOLS)
    # the whitespace after a call is kept once text follows (it separates the two texts)
    assert content == "text\n\nand words after the call" and len(calls) == 1


def test_a_tool_call_ends_the_reasoning_only_with_tools():
    text = "I should look.<tool_call>\n<function=now>\n</function>\n</tool_call>"
    assert split_reasoning(text, True, tools=NAMES) == ("I should look.", text[14:])
    assert split_reasoning(text, True) == (text, None)
    # a </think> first: the answer starts after it, as without tools
    assert split_reasoning("r</think>\n\nok", True, tools=NAMES) == ("r", "ok")
    # the tag written in the thinking, no call after it: still reasoning
    text = "plan: <tool_call> later</think>\n\nanswer"
    assert split_reasoning(text, True, tools=NAMES) == ("plan: <tool_call> later", "answer")
    # streamed a character at a time: the same split
    from tailored.server.reasoning import ReasoningSplitter

    for t in (text, "I should look.<tool_call>\n<function=now>\n</function>\n</tool_call>",
              "cut <tool_call>\n<func"):
        rs = ReasoningSplitter(True, tools=NAMES)
        pieces = [rs.feed(c) for c in t] + [rs.finish()]
        r, c = "".join(p[0] for p in pieces), "".join(p[1] for p in pieces)
        want_r, want_c = split_reasoning(t, True, tools=NAMES)
        assert (r or None, c or None) == (want_r, want_c), t


# ---- the chat route ----------------------------------------------------------------------


@pytest.fixture
def tool_srv():
    engine, tok = FakeEngine(), FakeTokenizer()
    # a context for the fake's byte-per-token prompts that carry the scripted answer
    app = build_app(AsyncEngine(engine), tok, MODEL, 4096, reasoning_parser="qwen3")
    with TestClient(app) as client:
        yield client, engine, tok


def ask(client, script: str, **body):
    body.setdefault("chat_template_kwargs", {"enable_thinking": False})
    return chat(client, "SAY:" + script, tools=TOOLS, **body)


def test_chat_returns_tool_calls(tool_srv):
    client, _, tok = tool_srv
    r = ask(client, TWO_CALLS)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["content"] == "Let me check."
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather", "now"]
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"])["days"] == 2
    assert tok.template_calls[-1]["tools"] == TOOLS  # rendered as given


def test_chat_stream_of_tool_calls_joins_to_the_whole(tool_srv):
    client, _, _ = tool_srv
    whole = ask(client, TWO_CALLS).json()["choices"][0]
    events = sse_events(ask(client, TWO_CALLS, stream=True,
                            stream_options={"include_usage": True}).text)
    assert events[-1] == "DONE" and events[-2]["usage"]["completion_tokens"] > 0
    chunks = [e["choices"][0] for e in events[:-2]]
    assert chunks[-1]["finish_reason"] == "tool_calls"
    content = "".join(c["delta"].get("content") or "" for c in chunks)
    calls: dict[int, dict] = {}
    for c in chunks:
        for d in c["delta"].get("tool_calls", []):
            if "id" in d:
                calls[d["index"]] = {"name": d["function"]["name"], "arguments": ""}
                assert d["type"] == "function"
            calls[d["index"]]["arguments"] += d["function"]["arguments"]
    assert content == whole["message"]["content"]
    assert list(calls.values()) == [c["function"] for c in whole["message"]["tool_calls"]]
    # the string argument came in pieces, as it was written
    pieces = [d for c in chunks for d in c["delta"].get("tool_calls", [])]
    assert len(pieces) > 10


def test_reasoning_then_a_call_without_the_think_end(tool_srv):
    client, _, _ = tool_srv
    script = "I need the weather." + call_xml("get_weather", city="Oslo")
    for stream in (False, True):
        r = ask(client, script, stream=stream, chat_template_kwargs={"enable_thinking": True})
        if not stream:
            msg = r.json()["choices"][0]["message"]
            reasoning, content, names = msg["reasoning"], msg["content"], [
                c["function"]["name"] for c in msg["tool_calls"]]
        else:
            chunks = [e["choices"][0] for e in sse_events(r.text)[:-1]]
            reasoning = "".join(c["delta"].get("reasoning") or "" for c in chunks)
            content = "".join(c["delta"].get("content") or "" for c in chunks) or None
            names = [d["function"]["name"] for c in chunks
                     for d in c["delta"].get("tool_calls", []) if "id" in d]
        assert (reasoning, content, names) == ("I need the weather.", None, ["get_weather"])


def test_tool_choice_none_renders_and_parses_no_tools(tool_srv):
    client, _, tok = tool_srv
    r = ask(client, call_xml("now"), tool_choice="none")
    msg = r.json()["choices"][0]
    assert tok.template_calls[-1]["tools"] is None
    assert msg["finish_reason"] == "stop" and "tool_calls" not in msg["message"]
    assert msg["message"]["content"] == call_xml("now")


def test_without_tools_the_xml_stays_content(tool_srv):
    client, _, _ = tool_srv
    r = chat(client, "SAY:" + call_xml("now"), chat_template_kwargs={"enable_thinking": False})
    assert r.json()["choices"][0]["message"]["content"] == call_xml("now")


def test_a_call_cut_by_the_end_of_the_answer_is_no_tool_calls_finish(tool_srv):
    """EOS or a stop string inside a value: the arguments are no JSON object, so the finish
    stays "stop" (clients read "tool_calls" as "the calls are complete")."""
    client, _, _ = tool_srv
    for stream in (False, True):
        r = ask(client, "<tool_call>\n<function=get_weather>\n<parameter=city>\nBer",
                stream=stream)
        if stream:
            finish = [e["choices"][0] for e in sse_events(r.text)[:-1]][-1]["finish_reason"]
        else:
            finish = r.json()["choices"][0]["finish_reason"]
        assert finish == "stop"


def test_odd_schemas_are_served(tool_srv):
    client, _, _ = tool_srv
    for props in ({"x": {"anyOf": 5}}, {"x": {"oneOf": True, "type": 3}}, {"x": 7}, "nope"):
        tool = {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": props}}}
        r = chat(client, "SAY:" + call_xml("f", x="1"), tools=[tool],
                 chat_template_kwargs={"enable_thinking": False})
        assert r.status_code == 200, r.text
        assert json.loads(r.json()["choices"][0]["message"]["tool_calls"][0]["function"][
            "arguments"]) == {"x": "1"}


def test_history_call_names_must_fit_the_format(tool_srv):
    client, _, _ = tool_srv
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"type": "function", "function": {"name": "a>b\n", "arguments": "{}"}}]}]
    r = chat(client, messages=msgs)
    assert r.status_code == 400 and "without whitespace" in r.json()["error"]["message"]


def test_cut_by_max_tokens_inside_a_call(tool_srv):
    client, _, _ = tool_srv
    script = call_xml("get_weather", city="Reykjavik")
    cut = script.index("Reyk") + 4
    for stream in (False, True):
        r = ask(client, script, max_tokens=cut, stream=stream)
        if stream:
            chunks = [e["choices"][0] for e in sse_events(r.text)[:-1]]
            finish = chunks[-1]["finish_reason"]
            args = "".join(d["function"]["arguments"] for c in chunks
                           for d in c["delta"].get("tool_calls", []))
        else:
            choice = r.json()["choices"][0]
            finish, args = choice["finish_reason"], choice["message"]["tool_calls"][0][
                "function"]["arguments"]
        assert (finish, args) == ("length", '{"city": "Reyk')


def test_history_with_tool_calls_and_results(tool_srv):
    client, _, tok = tool_srv
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "SAY:sunny"}]
    r = chat(client, messages=msgs, tools=TOOLS, chat_template_kwargs={"enable_thinking": False})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "sunny"
    assert tok.template_calls[-1]["messages"][1]["tool_calls"][0]["function"]["name"] == \
        "get_weather"
    assert MODEL in r.json()["model"]


def test_parsed_calls_render_back_as_the_model_wrote_them():
    """A tool loop sends the answer back as history: the template must render the parsed calls
    as the XML the model wrote (else the next turn sees calls it never made), and keep that
    turn's reasoning (a tool result is no new user query; failure-cases §8: multi-turn tool
    use degrading to empty arguments)."""
    from tailored.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    written = "\n\n" + TWO_CALLS.split("\n\n", 1)[1]
    reasoning, answer = split_reasoning("I should check." + "</think>\n\nLet me check." + written,
                                        True, tools=NAMES)
    content, calls, _ = split(answer, TOOLS)
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": content, "reasoning_content": reasoning,
             "tool_calls": calls},
            {"role": "tool", "tool_call_id": calls[0]["id"], "content": "sunny"}]
    prompt = tok.apply_chat_template(msgs, tools=TOOLS)
    assert ("<|im_start|>assistant\n<think>\nI should check.\n</think>\n\nLet me check."
            + written + "<|im_end|>\n") in prompt


def outcome(r, stream: bool):
    """(finish_reason, call names, content, reasoning) of a response, streamed or not."""
    if not stream:
        choice = r.json()["choices"][0]
        msg = choice["message"]
        return (choice["finish_reason"], [c["function"]["name"] for c in msg.get("tool_calls")
                                          or []], msg["content"], msg.get("reasoning"))
    chunks = [e["choices"][0] for e in sse_events(r.text)[:-1]]
    names = [d["function"]["name"] for c in chunks for d in c["delta"].get("tool_calls", [])
             if "id" in d]
    content = "".join(c["delta"].get("content") or "" for c in chunks) or None
    reasoning = "".join(c["delta"].get("reasoning") or "" for c in chunks) or None
    return chunks[-1]["finish_reason"], names, content, reasoning


HERMES = '<tool_call>\n{"name": "now", "arguments": {"tz": "UTC"}}\n</tool_call>'


@pytest.fixture
def slow_srv():
    """tool_srv with an engine step of 2 ms: a request is still generating when it ends."""
    engine, tok = FakeEngine(delay_s=0.002), FakeTokenizer()
    app = build_app(AsyncEngine(engine), tok, MODEL, 4096, reasoning_parser="qwen3")
    with TestClient(app) as client:
        yield client, engine, tok


def aborted_soon(engine, n: int) -> bool:
    deadline = time.monotonic() + 5  # aborts reach the engine thread by its queue
    while len(engine.aborted) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return len(engine.aborted) == n


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_ends_at_the_first_call(slow_srv, stream):
    client, engine, _ = slow_srv
    two_in_one = ("<tool_call>\n<function=now>\n</function>\n<function=get_weather>\n"
                  "</function>\n</tool_call>")
    for script, name in ((TWO_CALLS, "get_weather"), (two_in_one, "now"),
                         (HERMES + HERMES, "now")):
        before = len(engine.aborted)
        r = ask(client, script + "x" * 300, parallel_tool_calls=False, stream=stream)
        finish, names, content, _ = outcome(r, stream)
        assert (finish, names) == ("tool_calls", [name]), script
        assert content in (None, "Let me check.")
        assert aborted_soon(engine, before + 1)  # the generation ended with the first call
    assert all(sp.stop == [] for sp in engine.added.values())  # no stop string added
    # a mention of the closing tag, in the thinking or the answer, ends nothing
    script = "The format closes with </tool_call> tags.</think>\n\nUse </tool_call>."
    r = ask(client, script, parallel_tool_calls=False, stream=stream,
            chat_template_kwargs={"enable_thinking": True})
    assert outcome(r, stream) == ("stop", [], "Use </tool_call>.",
                                  "The format closes with </tool_call> tags.")


def test_forced_calls_cut_short_leave_no_content():
    """tool_choice "required" / named (`forced`: a grammar makes the answer calls only): an
    answer cut before a call's name was whole (max_tokens, a stop string) gives no content —
    the partial markup is a call cut short, not text — where the same cut without forcing
    gives the text out as written; complete calls before the cut are kept, a cut inside a
    value stays an unfinished call; streamed pieces join to the whole at any cut."""
    one = call_xml("get_weather", city="Paris")
    cases = [
        ("<tool_call>\n<function=get_wea", 0, False),
        ("\n\n<tool_call>\n<func", 0, False),
        ("\n<tool_c", 0, False),
        (one + "\n<tool_call>\n<function=no", 1, False),
        (one + "\n<tool", 1, False),
        (one[:one.index("Par") + 3], 1, True),
    ]
    for text, n_calls, unfinished in cases:
        content, calls, cut = split(text, TOOLS, forced=True)
        assert (content, len(calls), cut) == ("", n_calls, unfinished), text
        if n_calls and not unfinished:
            assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
        free, _, _ = split(text, TOOLS)
        assert free.strip() or n_calls, text  # unforced: the cut markup is content
        rng = random.Random(len(text))
        for pieces in ([1] * len(text), [rng.randint(1, 5) for _ in range(len(text))]):
            c, streamed, _ = run_stream(text, pieces, forced=True)
            assert c == "" and len(streamed) == n_calls, (text, pieces)
    forced, free = split(one, TOOLS, forced=True), split(one, TOOLS)  # a whole call: the same
    assert forced[0] == free[0] == "" and [c["function"] for c in forced[1]] == [
        c["function"] for c in free[1]]


def test_cuts_inside_the_tags_around_a_value():
    """A cut inside the tag that begins the next parameter leaves the call unfinished (it was
    closed as complete before session 32); a cut inside a value's closing tag leaves that
    tag's beginning, and the format's newline before it, out of the unfinished value."""
    one = call_xml("get_weather", city="Paris", days=2)
    for cut in ("<parameter", "<param"):
        text = one[:one.index("<parameter=days") + len(cut)]
        _, calls, unfinished = split(text, TOOLS)
        assert unfinished and calls[0]["function"]["arguments"] == '{"city": "Paris"', text
    for cut in ("\n</param", "\n<", "\n"):
        text = one[:one.index("Paris") + 5] + cut
        _, calls, unfinished = split(text, TOOLS)
        assert unfinished and calls[0]["function"]["arguments"] == '{"city": "Paris', text
    # forced calls: a block that is no call in the middle of an answer (the grammar writes
    # none) goes out as without forcing; only what is held at the end is dropped
    text = "<tool_call>\n<fx>hello " + one
    (content, calls, _), free = split(text, TOOLS, forced=True), split(text, TOOLS)
    assert content == free[0] == "<tool_call>\n<fx>hello"
    assert [c["function"] for c in calls] == [c["function"] for c in free[1]]


def test_cut_inside_a_parameter_tag_is_unfinished():
    for text in ("<tool_call>\n<function=now>\n<parameter=",
                 "<tool_call>\n<function=get_weather>\n<parameter=city>\nhi\n</parameter>\n"
                 "<parameter=da"):
        _, calls, unfinished = split(text, TOOLS)
        assert unfinished, text
        with pytest.raises(json.JSONDecodeError):
            json.loads(calls[0]["function"]["arguments"])


def test_a_call_only_mentioned_in_the_thinking_ends_nothing():
    for text in ("Maybe <tool_call>{x} is wrong.</think>\n\nHello",
                 "Use <tool_call><function=...> syntax.</think>\n\nHello",
                 "Or <tool_call>\n<function=unknown_tool>\n</function></think>\n\nHello"):
        reasoning, content = split_reasoning(text, True, tools=NAMES)
        assert content == "Hello" and reasoning == text.split("</think>")[0], text


@pytest.mark.parametrize("stream", [False, True])
def test_without_the_reasoning_split_calls_are_read_after_the_thinking(stream):
    """No --reasoning-parser, thinking on: content is the raw text, reasoning included, but a
    call drafted while thinking is no call."""
    engine, tok = FakeEngine(), FakeTokenizer()
    app = build_app(AsyncEngine(engine), tok, MODEL, 4096)
    drafted = call_xml("get_weather", city="Draft")
    script = "I could " + drafted + " maybe.</think>\n\nOK.\n\n" + call_xml("now")
    with TestClient(app) as client:
        r = chat(client, "SAY:" + script, tools=TOOLS, stream=stream)
        finish, names, content, _ = outcome(r, stream)
    assert (finish, names) == ("tool_calls", ["now"])
    assert content == "I could " + drafted + " maybe.</think>\n\nOK."


def test_tool_and_parameter_names_must_fit_the_format(tool_srv):
    client, _, _ = tool_srv
    for name in ("f\u00a0", "\u3000f", "f\u2028g", "a\x1fb"):
        r = chat(client, "SAY:x", tools=[{"type": "function", "function": {"name": name}}])
        assert r.status_code == 400 and "without whitespace" in r.json()["error"]["message"]
    for prop in ("x>y", "a\nb", ""):
        tool = {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {prop: {"type": "string"}}}}}
        r = chat(client, "SAY:x", tools=[tool])
        assert r.status_code == 400, prop
        assert "<parameter=NAME>" in r.json()["error"]["message"]


def test_a_huge_tools_list_is_refused_before_validation(tool_srv):
    client, _, _ = tool_srv
    many = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(3000)]
    r = chat(client, "SAY:x", tools=many)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert r.json()["error"]["code"] == "context_length_exceeded"
    big = [{"type": "function", "function": {"name": "f", "description": "d" * 200_000}}]
    r = chat(client, "SAY:x", tools=big)
    assert r.status_code == 400 and "tools hold" in r.json()["error"]["message"]


def test_head_on_the_model_routes(tool_srv):
    client, _, _ = tool_srv
    assert client.head("/v1/models").status_code == 200
    assert client.head(f"/v1/models/{MODEL}").status_code == 200
