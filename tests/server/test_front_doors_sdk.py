"""The front doors with their own clients against the nano model (CPU, one server for the
session: nano_server.py): the openai SDK's `responses` (create, stream, function tools with a
round trip, text.format, previous_response_id), the anthropic SDK's `messages` (create,
stream, tools with a round trip, count_tokens), the OpenAI Agents SDK with its default
(Responses) model, and a bad request in each dialect answered as the SDK expects. Forced tool
choices and enum schemas fix the shape of the answers: the protocol is under test, not the
nano model's skill. A tool round trip's second turn hits the prefix cache of the first."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import pytest
from nano_server import MODEL, nano_server, nano_servers  # noqa: F401

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"]}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather of a city.",
          "parameters": CITY}]
OFF = {"reasoning": {"effort": "none"}}
# a first message long enough (64+ tokens) for the prefix cache to keep it
LONG = ("You answer questions about the weather of European cities, briefly, in one line, "
        "and you call the weather tool whenever a city is named. ") * 4


@pytest.fixture(scope="module")
def url(nano_servers):  # noqa: F811 - the imported fixture
    return nano_server().url


@pytest.fixture(scope="module")
def oa(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="test", max_retries=0)


@pytest.fixture(scope="module")
def an(url):
    return anthropic.Anthropic(base_url=url, api_key="test", max_retries=0)


def test_responses_create_and_stream(oa):
    r = oa.responses.create(model=MODEL, input="def fibonacci(n):", max_output_tokens=8, **OFF)
    assert r.object == "response" and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert isinstance(r.output_text, str) and r.usage.output_tokens == 8
    events = list(oa.responses.create(model=MODEL, input="import os", max_output_tokens=8,
                                      stream=True, **OFF))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"  # (the SDK's stream helper wants "completed")
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.output_text == text and final.usage.total_tokens == final.usage.input_tokens + 8


def test_responses_function_tool_round_trip_hits_the_prefix_cache(oa):
    first = oa.responses.create(model=MODEL, instructions=LONG, input="Weather in Paris?",
                                tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                max_output_tokens=120, **OFF)
    assert first.status == "completed", first
    [call] = [o for o in first.output if o.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Rome")
    history = [{"role": "user", "content": "Weather in Paris?"}, call.model_dump(),
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    # (tool_choice "none" would leave the tools out of the prompt, and so miss the cache)
    second = oa.responses.create(model=MODEL, instructions=LONG, input=history, tools=TOOLS,
                                 max_output_tokens=8, **OFF)
    assert second.output
    cached = second.usage.input_tokens_details.cached_tokens
    # hit up to the end of the first prompt's last message (its generation prompt is not kept)
    assert first.usage.input_tokens - 16 <= cached < second.usage.input_tokens


def test_responses_streamed_tool_call_arguments(oa):
    with oa.responses.stream(model=MODEL, input="Weather in Rome?", tools=TOOLS,
                             tool_choice={"type": "function", "name": "get_weather"},
                             parallel_tool_calls=False, max_output_tokens=120, **OFF) as stream:
        deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    [call] = final.output
    assert "".join(deltas) == call.arguments and json.loads(call.arguments)["city"]


def test_responses_text_format_json_schema(oa):
    schema = {"type": "object", "properties": {"pick": {"enum": ["red", "green"]}},
              "required": ["pick"]}
    r = oa.responses.create(model=MODEL, input="Pick a colour.", max_output_tokens=300,
                            text={"format": {"type": "json_schema", "name": "pick",
                                             "schema": schema}}, temperature=0, **OFF)
    assert r.status == "completed"
    assert json.loads(r.output_text)["pick"] in ("red", "green")


def test_previous_response_id(oa):
    first = oa.responses.create(model=MODEL, input=LONG, max_output_tokens=4, **OFF)
    second = oa.responses.create(model=MODEL, input="And Rome?", max_output_tokens=4,
                                 previous_response_id=first.id, **OFF)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 16
    with pytest.raises(openai.BadRequestError, match="previous_response_id|not found"):
        oa.responses.create(model=MODEL, input="x", previous_response_id="resp_unknown")


def test_responses_bad_input_is_a_400_naming_the_field(oa):
    with pytest.raises(openai.BadRequestError) as e:
        oa.responses.create(model=MODEL, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "https://example.com/x.png"}]}])
    assert e.value.body["param"] == "input[0].content[0]"
    assert oa.responses.create(model=MODEL, input="x", max_output_tokens=2, **OFF).usage


def test_messages_create_stream_and_count_tokens(an):
    m = an.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user",
                                                                 "content": "import sys"}])
    assert m.type == "message" and m.stop_reason == "max_tokens"
    assert m.content[0].type == "text" and m.usage.output_tokens == 8
    count = an.messages.count_tokens(model=MODEL, messages=[{"role": "user",
                                                             "content": "import sys"}])
    assert count.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens
    with an.messages.stream(model=MODEL, max_tokens=24, messages=[{"role": "user",
                                                                   "content": "hi"}],
                            thinking={"type": "enabled", "budget_tokens": 6}) as stream:
        kinds = {event.type for event in stream}
        final = stream.get_final_message()
    assert {"message_start", "content_block_start", "content_block_delta",
            "content_block_stop", "message_delta", "message_stop"} <= kinds
    assert final.content[0].type == "thinking" and final.content[0].signature
    assert final.content[-1].type == "text"  # the budget closed the thinking


def test_messages_tool_round_trip_hits_the_prefix_cache(an):
    tools = [{"name": "get_weather", "description": "The weather of a city.",
              "input_schema": CITY}]
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    first = an.messages.create(model=MODEL, max_tokens=120, system=LONG, messages=ask,
                               tools=tools, tool_choice={"type": "tool", "name": "get_weather",
                                                         "disable_parallel_tool_use": True})
    assert first.stop_reason == "tool_use"
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert use.input["city"] in ("Paris", "Rome")
    again = ask + [{"role": "assistant", "content": first.content},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                 "content": "sunny"}]}]
    with an.messages.stream(model=MODEL, max_tokens=8, system=LONG, messages=again,
                            tools=tools) as stream:
        second = stream.get_final_message()
    assert second.content
    first_prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert second.usage.cache_read_input_tokens >= first_prompt - 16


def test_messages_bad_input_is_an_anthropic_error(an):
    with pytest.raises(anthropic.BadRequestError) as e:
        an.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}]}])
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "messages[0].content[0]" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        an.messages.create(model="claude-opus-4-1", max_tokens=8,
                           messages=[{"role": "user", "content": "x"}])
    assert an.messages.create(model=MODEL, max_tokens=2, messages=[
        {"role": "user", "content": "x"}]).usage.output_tokens == 2


def test_agents_sdk_default_model_runs_tools_and_structured_output(url):
    agents = pytest.importorskip("agents")
    from openai.types.shared import Reasoning
    from pydantic import BaseModel

    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="test", max_retries=0)
    calls = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather of a city."""
        calls.append(city)
        return "sunny"

    class Pick(BaseModel):
        colour: Literal["red", "green"]

    provider = agents.OpenAIProvider(openai_client=client, use_responses=True)
    config = agents.RunConfig(model_provider=provider, tracing_disabled=True)
    off = Reasoning(effort="none")
    weather = agents.Agent(
        name="weather", instructions="Answer with the weather.", model=MODEL,
        tools=[get_weather], tool_use_behavior="stop_on_first_tool",
        model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                            max_tokens=120, reasoning=off))
    picker = agents.Agent(name="picker", instructions="Pick a colour.", model=MODEL,
                          output_type=Pick, model_settings=agents.ModelSettings(
                              max_tokens=300, temperature=0, reasoning=off))

    async def run():
        model = provider.get_model(MODEL)
        assert type(model).__name__ == "OpenAIResponsesModel"  # the default model class
        done = await agents.Runner.run(weather, "Weather in Paris?", run_config=config)
        streamed = agents.Runner.run_streamed(weather, "Weather in Rome?", run_config=config)
        async for _ in streamed.stream_events():
            pass
        picked = await agents.Runner.run(picker, "Which colour?", run_config=config)
        return done.final_output, streamed.final_output, picked.final_output

    first, second, picked = asyncio.run(run())
    assert first == second == "sunny" and len(calls) == 2
    assert picked.colour in ("red", "green")
