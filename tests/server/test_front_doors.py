"""The Responses API (/v1/responses) and the Messages API (/v1/messages) against the fake
engine of test_server.py (no model; the nano model and the real clients:
test_front_doors_sdk.py, test_agent_clis.py): how each dialect's request becomes the chat
template's input and sampling, the shape of whole and streamed answers, and each bad input a
4xx in its dialect's shape naming the field, the server healthy after.

The fake engine writes what follows the last "SAY:" in the prompt; FakeTokenizer renders the
template as `<|im_start|>role\\ncontent<|im_end|>` and records each call's messages."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from test_server import MAX_LEN, MODEL, make_app

from tailored.server.conversation import seal, unseal
from tailored.server.response_store import ResponseStore
from tailored.server.thinking_budget import CLOSE_TEXT

CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "</function>\n</tool_call>")
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
OFF = {"reasoning": {"effort": "none"}}  # Responses: thinking off, so the answer is text


@pytest.fixture(scope="module")
def fake():
    app, aengine, engine, tok = make_app()
    with TestClient(app) as client:
        yield client, engine, tok
    assert not aengine.healthy


def respond(client, input="SAY:hello", **body):
    return client.post("/v1/responses", json={"model": MODEL, "input": input, **body})


def message(client, content="SAY:hello", **body):
    msgs = body.pop("messages", [{"role": "user", "content": content}])
    body.setdefault("max_tokens", 200)
    return client.post("/v1/messages", json={"model": MODEL, "messages": msgs, **body})


def events(text: str) -> list[tuple[str, dict]]:
    """(event name, data) of each SSE event."""
    out = []
    for block in text.split("\n\n"):
        if block.strip():
            head, data = block.split("\n", 1)
            assert head.startswith("event: ") and data.startswith("data: "), block
            out.append((head[7:], json.loads(data[6:])))
    return out


def last_template(tok) -> dict:
    return tok.template_calls[-1]


def openai_error(r, status: int, param: str | None, *needles: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    for needle in needles:
        assert needle in err["message"], err
    return err


def anthropic_error(r, status: int, kind: str, *needles: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    for needle in needles:
        assert needle in body["error"]["message"], body
    return body["error"]


# ---- Responses: request -> template ------------------------------------------------------------

def test_responses_input_becomes_the_chat_template_input(fake):
    """instructions and the leading developer message join into one system message; text
    parts join; a function_call follows its reasoning and text into one assistant turn;
    function_call_output is a tool message; namespaced tools are flattened, hosted tools
    left out; reasoning.effort none turns the thinking off, and no effort leaves the
    template's default."""
    client, _, tok = fake
    items = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text",
                                                              "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                     {"type": "input_text", "text": "in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "encrypted_content": seal("I should call the tool.")},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"role": "user", "content": "SAY:thanks"},
    ]
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER},
             {"type": "namespace", "name": "ns", "description": "more",
              "tools": [{"type": "function", "name": "ping", "parameters": {"type": "object"}}]},
             {"type": "web_search"}]
    r = respond(client, items, instructions="You help.", tools=tools, **OFF)
    assert r.status_code == 200, r.text
    call = last_template(tok)
    assert call["enable_thinking"] is False
    assert [t["function"]["name"] for t in call["tools"]] == ["get_weather", "ping"]
    msgs = call["messages"]
    assert msgs[0] == {"role": "system", "content": "You help.\n\nBe brief."}
    assert msgs[1] == {"role": "user", "content": "Weather in Paris?"}
    assert msgs[2]["role"] == "assistant" and msgs[2]["content"] == "Let me look."
    assert msgs[2]["reasoning_content"] == "I should call the tool."
    fn = msgs[2]["tool_calls"][0]["function"]  # (the arguments as sent: the template parses)
    assert (fn["name"], json.loads(fn["arguments"])) == ("get_weather", {"city": "Paris"})
    assert msgs[3] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    assert msgs[4] == {"role": "user", "content": "SAY:thanks"}
    respond(client, "SAY:x", max_output_tokens=4)
    assert last_template(tok)["enable_thinking"] is True  # no effort: the template's default
    assert last_template(tok)["messages"] == [{"role": "user", "content": "SAY:x"}]


def test_namespaced_calls_round_trip_and_shared_names_are_qualified(fake):
    """A function two namespaces share is `ns.name` for the model; the call comes back as
    name + namespace, and a history call with its namespace renders as the model's name."""
    client, _, tok = fake
    fn = {"type": "function", "name": "go", "parameters": {"type": "object"}}
    tools = [{"type": "namespace", "name": "a", "tools": [fn]},
             {"type": "namespace", "name": "b", "tools": [fn]}]
    said = "SAY:<tool_call>\n<function=b.go>\n</function>\n</tool_call>"
    r = respond(client, said, tools=tools, **OFF).json()
    assert [t["function"]["name"] for t in last_template(tok)["tools"]] == ["a.go", "b.go"]
    [item] = r["output"]
    assert (item["type"], item["name"], item["namespace"]) == ("function_call", "go", "b")
    history = [{"role": "user", "content": "x"}, {**item, "arguments": "{}"},
               {"type": "function_call_output", "call_id": item["call_id"], "output": "ok"},
               {"role": "user", "content": "SAY:done"}]
    assert respond(client, history, tools=tools, **OFF).status_code == 200
    assert last_template(tok)["messages"][1]["tool_calls"][0]["function"]["name"] == "b.go"


# ---- Responses: answers ------------------------------------------------------------------------

def test_responses_whole_answer_items_usage_and_status(fake):
    client, _, _ = fake
    r = respond(client, "SAY:think</think>\n\nHi!", include=["reasoning.encrypted_content"])
    body = r.json()
    assert body["object"] == "response" and body["status"] == "completed"
    rs, msg = body["output"]
    assert rs["type"] == "reasoning" and rs["content"] == [{"type": "reasoning_text",
                                                             "text": "think"}]
    assert unseal(rs["encrypted_content"]) == "think"
    assert msg["type"] == "message" and msg["content"][0]["text"] == "Hi!"
    u = body["usage"]
    assert u["output_tokens"] == len("think</think>\n\nHi!") + 1  # + EOS
    assert u["input_tokens"] + u["output_tokens"] == u["total_tokens"]
    assert u["output_tokens_details"]["reasoning_tokens"] > 0
    assert u["input_tokens_details"]["cached_tokens"] == 0
    cut = respond(client, "SAY:abcdefgh", max_output_tokens=3, **OFF).json()
    assert cut["status"] == "incomplete"
    assert cut["incomplete_details"] == {"reason": "max_output_tokens"}
    assert cut["output"][0]["content"][0]["text"] == "abc"
    calls = respond(client, f"SAY:{CALL}", tools=[{"type": "function", "name": "get_weather",
                                                   "parameters": WEATHER}], **OFF).json()
    [fc] = calls["output"]
    assert fc["type"] == "function_call" and fc["call_id"].startswith("call_")
    assert json.loads(fc["arguments"]) == {"city": "Paris"} and fc["name"] == "get_weather"


def test_responses_stream_event_sequence(fake):
    """The events the SDKs and Codex parse, in order, numbered from 0; the final response
    holds what the deltas said."""
    client, _, _ = fake
    said = f"SAY:hmm</think>\n\nLet me check.{CALL}"
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    r = respond(client, said, tools=tools, stream=True)
    evs = events(r.text)
    assert [d["sequence_number"] for _, d in evs] == list(range(len(evs)))
    assert all(name == d["type"] for name, d in evs)
    kinds = [name for name, _ in evs]
    deltas = {"response.reasoning_text.delta", "response.output_text.delta",
              "response.function_call_arguments.delta"}
    squeezed = [k for i, k in enumerate(kinds) if k not in deltas or kinds[i - 1] != k]
    assert squeezed == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    final = evs[-1][1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "message", "function_call"]
    text = "".join(d["delta"] for k, d in evs if k == "response.output_text.delta")
    args = "".join(d["delta"] for k, d in evs if k == "response.function_call_arguments.delta")
    assert final["output"][1]["content"][0]["text"] == text == "Let me check."
    assert json.loads(final["output"][2]["arguments"]) == json.loads(args) == {"city": "Paris"}
    for k, d in evs:  # each delta names the item it belongs to
        if k in deltas:
            item = final["output"][d["output_index"]]
            assert d["item_id"] == item["id"]


def test_responses_engine_failure_mid_stream_is_error_then_failed(fake):
    client, _, _ = fake
    r = respond(client, "SAY:FAIL", stream=True, **OFF)
    kinds = [k for k, _ in events(r.text)]
    assert kinds[-2:] == ["error", "response.failed"]
    failed = events(r.text)[-1][1]["response"]
    assert failed["status"] == "failed" and "fake engine failure" in failed["error"]["message"]
    assert respond(client, "SAY:FAIL", **OFF).status_code == 500
    assert respond(client, "SAY:ok", **OFF).json()["status"] == "completed"


def test_previous_response_id_continues_the_stored_conversation():
    """The chain's inputs and outputs come before the new input (instructions not carried);
    store false keeps nothing; an unknown or evicted id is a 400 naming the field; GET
    returns a stored response."""
    app, _, engine, tok = make_app()
    with TestClient(app) as client:
        first = respond(client, "SAY:one", instructions="Sys.", **OFF).json()
        second = respond(client, "SAY:two", previous_response_id=first["id"], **OFF).json()
        third = respond(client, "SAY:three", previous_response_id=second["id"], **OFF).json()
        assert third["previous_response_id"] == second["id"]
        msgs = last_template(tok)["messages"]
        assert [(m["role"], m["content"]) for m in msgs] == [
            ("user", "SAY:one"), ("assistant", "one"), ("user", "SAY:two"),
            ("assistant", "two"), ("user", "SAY:three")]
        assert client.get(f"/v1/responses/{second['id']}").json()["id"] == second["id"]
        assert client.get("/v1/responses/resp_nope").status_code == 404
        gone = respond(client, "SAY:x", store=False, **OFF).json()
        openai_error(respond(client, "x", previous_response_id=gone["id"]), 400,
                     "previous_response_id", "not found")
    small = ResponseStore(max_entries=2)
    small.put("a", None, [{"role": "user", "content": "1"}], [], {"id": "a"})
    small.put("b", "a", [{"role": "user", "content": "2"}], [], {"id": "b"})
    assert [i["content"] for i in small.history("b")] == ["1", "2"]
    small.put("c", "b", [], [], {"id": "c"})  # evicts a
    with pytest.raises(Exception, match="earlier response of its conversation"):
        small.history("c")


@pytest.mark.parametrize("body, param, needle", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]", "text-only"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type", "item_reference"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
     "input[0].arguments", "JSON object"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "tool"),
    ({"input": "x", "tools": [{"type": "custom", "name": "apply_patch"}]}, "tools[0].type",
     "custom"),
    ({"input": "x", "tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name",
     "whitespace"),
    ({"input": "x", "tools": [{"type": "function", "name": "f",
                               "parameters": {"properties": {"a<b": {}}}}]},
     "tools[0].parameters", "<parameter=NAME>"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice", "needs function tools"),
    ({"input": "x", "truncation": "auto"}, "truncation", "auto"),
    ({"input": "x", "background": True}, "background", "not supported"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s"}}},
     "text.format.schema", "JSON Schema"),
    ({"input": "x", "reasoning": {"effort": "huge"}}, "reasoning.effort", "huge"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "greater than"),
    ({"input": "x", "model": "gpt-5"}, "model", "does not exist"),
    ({"input": []}, "input", "at least one"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include", "not supported"),
])
def test_bad_responses_requests_are_openai_errors_naming_the_field(fake, body, param, needle):
    client, _, _ = fake
    r = client.post("/v1/responses", json=body)
    openai_error(r, 404 if param == "model" else 400, param, needle)
    assert respond(client, "SAY:ok", **OFF).json()["status"] == "completed"


# ---- Messages: request -> template -------------------------------------------------------------

def test_messages_become_the_chat_template_input(fake):
    """system blocks (the billing header dropped) and a system message later in the
    conversation; tool_use with its thinking (from the sealed signature) into one assistant
    turn; tool_result a tool message; thinking absent = off, enabled/adaptive = on; tools and
    tool_choice translated; x-api-key accepted."""
    client, _, tok = fake
    msgs = [
        {"role": "user", "content": [{"type": "text", "text": "Weather?"},
                                     {"type": "text", "text": "In Paris.",
                                      "cache_control": {"type": "ephemeral"}}]},
        {"role": "system", "content": "Mind the units."},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "", "signature": seal("Use the tool.")},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "sunny"}]},
                                     {"type": "text", "text": "SAY:ok"}]},
    ]
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1;"},
              {"type": "text", "text": "You help."}]
    tools = [{"name": "get_weather", "description": "w", "input_schema": WEATHER,
              "cache_control": {"type": "ephemeral"}},
             {"type": "web_search_20250305", "name": "web_search"}]
    r = client.post("/v1/messages", headers={"x-api-key": "k", "anthropic-version": "2023-06-01"},
                    json={"model": MODEL, "max_tokens": 16, "messages": msgs, "system": system,
                          "tools": tools, "tool_choice": {"type": "auto"}})
    assert r.status_code == 200, r.text
    call = last_template(tok)
    assert call["enable_thinking"] is False
    assert call["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "parameters": WEATHER, "description": "w"}}]
    m = call["messages"]
    assert m[0] == {"role": "system", "content": "You help."}
    assert m[1] == {"role": "user", "content": "Weather?\n\nIn Paris."}
    assert m[2] == {"role": "user", "content": "Mind the units."}
    assert m[3]["reasoning_content"] == "Use the tool." and m[3]["content"] == "Checking."
    assert m[3]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert m[4] == {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}
    assert m[5] == {"role": "user", "content": "SAY:ok"}
    for thinking, on in (({"type": "adaptive"}, True), ({"type": "disabled"}, False),
                         ({"type": "enabled", "budget_tokens": 32}, True)):
        assert message(client, "SAY:x", thinking=thinking).status_code == 200
        assert last_template(tok)["enable_thinking"] is on


def test_messages_whole_and_streamed_answers(fake):
    client, _, _ = fake
    tools = [{"name": "get_weather", "input_schema": WEATHER}]
    said = f"SAY:hmm</think>\n\nLet me check.{CALL}"
    body = message(client, said, tools=tools, thinking={"type": "adaptive"}).json()
    assert body["type"] == "message" and body["stop_reason"] == "tool_use"
    th, text, use = body["content"]
    assert th["type"] == "thinking" and th["thinking"] == "hmm" and unseal(th["signature"]) == "hmm"
    assert text == {"type": "text", "text": "Let me check."}
    assert use["type"] == "tool_use" and use["id"].startswith("toolu_")
    assert use["input"] == {"city": "Paris"}
    u = body["usage"]
    assert u["input_tokens"] > 0 and u["output_tokens"] == len(said) - 4 + 1
    assert u["cache_read_input_tokens"] == 0 and u["cache_creation_input_tokens"] == 0
    r = message(client, said, tools=tools, thinking={"type": "adaptive"}, stream=True)
    evs = events(r.text)
    kinds = [k for k, _ in evs]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta",
                                                                     "message_stop"]
    starts = [d["content_block"]["type"] for k, d in evs if k == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    deltas = [d["delta"] for k, d in evs if k == "content_block_delta"]
    assert "".join(d["thinking"] for d in deltas if d["type"] == "thinking_delta") == "hmm"
    assert [d for d in deltas if d["type"] == "signature_delta"][0]["signature"] == seal("hmm")
    assert "".join(d["text"] for d in deltas if d["type"] == "text_delta") == "Let me check."
    args = "".join(d["partial_json"] for d in deltas if d["type"] == "input_json_delta")
    assert json.loads(args) == {"city": "Paris"}
    assert kinds.count("content_block_stop") == 3
    assert evs[-2][1]["delta"]["stop_reason"] == "tool_use"
    assert evs[-2][1]["usage"]["output_tokens"] == u["output_tokens"]
    hidden = message(client, said, tools=tools,
                     thinking={"type": "adaptive", "display": "omitted"}).json()
    assert hidden["content"][0]["thinking"] == ""
    assert unseal(hidden["content"][0]["signature"]) == "hmm"


def test_messages_stop_reasons(fake):
    client, engine, _ = fake
    assert message(client, "SAY:abc").json()["stop_reason"] == "end_turn"
    assert message(client, "SAY:abcdef", max_tokens=2).json()["stop_reason"] == "max_tokens"
    r = message(client, "SAY:abc STOP def", stop_sequences=["nope", "STOP"]).json()
    assert (r["stop_reason"], r["stop_sequence"]) == ("stop_sequence", "STOP")
    assert r["content"] == [{"type": "text", "text": "abc "}]
    # max_tokens past the context is cut to what the prompt leaves (as Anthropic does)
    long = "SAY:" + "z" * 300
    r = message(client, long, max_tokens=32000)
    assert r.status_code == 200, r.text
    assert r.json()["stop_reason"] == "model_context_window_exceeded"
    sampling = list(engine.added.values())[-1]
    assert sampling.max_tokens == MAX_LEN - r.json()["usage"]["input_tokens"]
    assert message(client, "SAY:ok", max_tokens=32000).json()["stop_reason"] == "end_turn"


def test_thinking_budget_ends_the_thinking_after_its_tokens(fake):
    """thinking.budget_tokens: after that many tokens the server closes the think block and
    the answer continues from a second engine request whose prompt holds the thinking so far
    and CLOSE_TEXT; usage counts both (and the closing tokens)."""
    client, engine, _ = fake
    before = set(engine.prompts)
    body = message(client, "SAY:abcdefghijklmnop", max_tokens=40,
                   thinking={"type": "enabled", "budget_tokens": 5}).json()
    th, text = body["content"]
    assert th["thinking"] == "abcde\n"  # 5 tokens, then the closing text's newline
    assert text["text"] == "abcdefghijklmnop"  # the fake writes its script again
    new = [rid for rid in engine.prompts if rid not in before]
    assert len(new) == 2 and new[1].endswith("-answer")
    second = bytes(i for i in engine.prompts[new[1]] if i < 256).decode()
    assert second.endswith("abcde" + CLOSE_TEXT)
    assert engine.added[new[1]].max_tokens == 40 - 5 - len(CLOSE_TEXT)
    assert body["usage"]["output_tokens"] == 5 + len(CLOSE_TEXT) + 16 + 1
    # a thinking that ends within the budget is left alone
    body = message(client, "SAY:ab</think>cd", max_tokens=40,
                   thinking={"type": "enabled", "budget_tokens": 12}).json()
    assert [b.get("thinking", b.get("text")) for b in body["content"]] == ["ab", "cd"]
    r = message(client, "SAY:abcdefghij", max_tokens=40, stream=True,
                thinking={"type": "enabled", "budget_tokens": 3})
    deltas = [d["delta"] for k, d in events(r.text) if k == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == "abc\n"
    assert "".join(d.get("text", "") for d in deltas) == "abcdefghij"


def test_count_tokens_is_the_prompt_length(fake):
    client, engine, _ = fake
    n = len(engine.added)
    r = client.post("/v1/messages/count_tokens", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hello"}]})
    expect = len("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n<think>\n\n"
                 "</think>\n\n")
    assert r.json() == {"input_tokens": expect} and len(engine.added) == n


def test_messages_engine_failure_mid_stream_is_an_error_event(fake):
    client, _, _ = fake
    r = message(client, "SAY:FAIL", stream=True)
    assert events(r.text)[-1] == ("error", {"type": "error", "error": {
        "type": "api_error", "message": "engine error: fake engine failure"}})
    anthropic_error(message(client, "SAY:FAIL"), 500, "api_error", "fake engine failure")


@pytest.mark.parametrize("body, status, kind, needle", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "invalid_request_error", "'messages[0].content[0]': image blocks are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                  "content": [{"type": "image"}]}]}]}, 400,
     "invalid_request_error", "messages[0].content[0].content[0]"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
     400, "invalid_request_error", "prefill"),
    ({"messages": [{"role": "bot", "content": "x"}]}, 400, "invalid_request_error",
     "messages[0].role"),
    ({"messages": []}, 400, "invalid_request_error", "must not be empty"),
    ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
    ({"thinking": {"type": "enabled"}}, 400, "invalid_request_error", "budget_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 64}}, 400, "invalid_request_error",
     "less than max_tokens"),
    ({"stop_sequences": ["a", "b", "c", "d", "e"]}, 400, "invalid_request_error",
     "stop_sequences"),
    ({"tools": [{"name": "f"}]}, 400, "invalid_request_error", "tools[0].input_schema"),
    ({"tools": [{"type": "bash_20250124", "name": "bash"}]}, 400, "invalid_request_error",
     "tools[0].type"),
    ({"tool_choice": {"type": "tool", "name": "f"}}, 400, "invalid_request_error",
     "needs tools"),
    ({"temperature": 1.5}, 400, "invalid_request_error", "temperature"),
    ({"model": "claude-sonnet-4-5"}, 404, "not_found_error", "does not exist"),
    ({"mcp_servers": [{"url": "x"}]}, 400, "invalid_request_error", "mcp_servers"),
])
def test_bad_messages_requests_are_anthropic_errors(fake, body, status, kind, needle):
    client, _, _ = fake
    base = {"model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": "x"}]}
    r = client.post("/v1/messages", json={k: v for k, v in {**base, **body}.items()
                                          if v is not None})
    anthropic_error(r, status, kind, needle)
    assert message(client, "SAY:ok").json()["stop_reason"] == "end_turn"


def test_bodies_that_fail_before_parsing_answer_in_each_dialect(fake):
    client, _, _ = fake
    r = client.post("/v1/messages", content=b"{not json", headers={"content-type":
                                                                    "application/json"})
    anthropic_error(r, 400, "invalid_request_error", "malformed JSON")
    r = client.post("/v1/responses", content=b"[1]")
    openai_error(r, 400, None, "JSON object")
    many = [{"role": "user", "content": "x"}] * (MAX_LEN // 2 + 1)
    anthropic_error(message(client, messages=many), 400, "invalid_request_error",
                    "cannot fit")
    openai_error(respond(client, many), 400, "input", "cannot fit")


def test_front_doors_count_their_answers_under_their_routes():
    app, _, _, _ = make_app()
    with TestClient(app) as client:
        respond(client, "SAY:a", **OFF)
        message(client, "SAY:a")
        message(client, messages=[])
        lines = [line for line in client.get("/metrics").text.splitlines()
                 if line.startswith("tailored:http_requests_total{")]
    for route, status in (("/v1/responses", "200"), ("/v1/messages", "200"),
                          ("/v1/messages", "400")):
        assert any(f'handler="{route}"' in line and f'status="{status}"' in line
                   and line.endswith(" 1.0") for line in lines), lines


def test_agent_replay_grows_and_replays_a_session(tmp_path):
    """lab/agent_replay.py (the GPU replay's tool, docs/agents.md): `synth` grows a
    recorded first turn into tool round trips in each dialect; `replay` sends them and
    reports every turn."""
    import importlib.util

    from live_server import LiveServer

    path = __import__("pathlib").Path(__file__).resolve().parents[2] / "lab" / \
        "agent_replay.py"
    spec = importlib.util.spec_from_file_location("agent_replay", path)
    replay = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(replay)
    firsts = {
        "responses": {"path": "/v1/responses", "body": {
            "model": "x", "input": [{"role": "user", "content": "SAY:ok"}],
            "reasoning": {"effort": "none"},
            "tools": [{"type": "function", "name": "exec_command", "parameters": {
                "type": "object", "properties": {"cmd": {"type": "string"}},
                "required": ["cmd"]}}]}},
        "messages": {"path": "/v1/messages", "body": {
            "model": "x", "max_tokens": 8, "messages": [{"role": "user", "content": "SAY:ok"}],
            "tools": [{"name": "Read", "input_schema": {
                "type": "object", "properties": {"file_path": {"type": "string"}}}}]}},
    }
    app, _, _, _ = make_app()
    with LiveServer(app) as server:
        for name, first in firsts.items():
            recorded = tmp_path / f"{name}.jsonl"
            recorded.write_text(json.dumps(first) + "\n")
            grown = tmp_path / f"{name}-3.jsonl"
            replay.main(["synth", str(recorded), "--turns", "2", "--tool-tokens", "10",
                         "--out", str(grown)])
            turns = [json.loads(line) for line in grown.read_text().splitlines()]
            assert len(turns) == 3
            out = tmp_path / f"{name}.json"
            replay.main(["replay", str(grown), "--base-url", server.url, "--model", MODEL,
                         "--max-tokens", "4", "--json", str(out)])
            rows = json.loads(out.read_text())["rows"]
            assert [r["status"] for r in rows] == [200, 200, 200], rows
            assert all(r["ttft_ms"] is not None and r["prompt_tokens"] for r in rows)
            assert rows[2]["prompt_tokens"] > rows[1]["prompt_tokens"] > rows[0]["prompt_tokens"]
