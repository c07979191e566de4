"""The OpenAI Agents SDK against `tailored serve`, set up as docs/clients.md tells a user: an
AsyncOpenAI client with base_url, its Chat Completions model (`OpenAIChatCompletionsModel`)
and its default Responses model, tracing off (it would export traces to OpenAI), thinking off
by `reasoning.effort` "none". An agent's run: text, streamed events with usage, a tool round
trip (tool_choice "required" for the first turn: the SDK resets it after a call), typed output,
and typed output with tools (`output_type` and `tools`: a 400 before, on both APIs)."""

from __future__ import annotations

import asyncio

import pytest
from served import END, MAX_TOKENS, MODEL, NO_CALL, STRUCTURED_TOKENS, Verdict, get_weather

agents = pytest.importorskip("agents")
from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel,  # noqa: E402
                    OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled)
from openai import AsyncOpenAI  # noqa: E402
from openai.types.shared import Reasoning  # noqa: E402

set_tracing_disabled(True)
OFF = Reasoning(effort="none")
WEATHER = function_tool(get_weather)


@pytest.fixture(params=["chat", "responses"])
def model(request, served):
    """(one per test: its client's connections belong to the test's event loop)"""
    client = AsyncOpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0)
    if request.param == "chat":
        return OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
    return OpenAIResponsesModel(model=MODEL, openai_client=client)


def _settings(tokens=STRUCTURED_TOKENS, bias=END, **kw) -> ModelSettings:
    """Text answers end at once (served.END), JSON and calls where their grammar ends."""
    return ModelSettings(temperature=0, max_tokens=tokens, reasoning=OFF, include_usage=True,
                         extra_body={"logit_bias": bias}, **kw)


def _run(agent, text="Weather in Paris?", **kw):
    return asyncio.run(Runner.run(agent, text, max_turns=3, **kw))


def test_run_and_stream_with_usage(model):
    agent = Agent(name="a", model=model, model_settings=_settings(MAX_TOKENS))

    async def both():
        result = await Runner.run(agent, "Say hi.", max_turns=1)
        run = Runner.run_streamed(agent, "Say hi.", max_turns=1)
        kinds = [e.type async for e in run.stream_events()]
        return result, run, kinds

    result, run, kinds = asyncio.run(both())
    assert isinstance(result.final_output, str)
    assert result.context_wrapper.usage.output_tokens == 1  # the end, at once
    assert "raw_response_event" in kinds and isinstance(run.final_output, str)
    assert run.context_wrapper.usage.output_tokens == 1


def test_tool_round_trip(model):
    agent = Agent(name="a", model=model, tools=[WEATHER],
                  model_settings=_settings(tool_choice="required", parallel_tool_calls=False))
    result = _run(agent)
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"], kinds
    assert result.new_items[1].output.startswith("sunny in ")
    assert isinstance(result.final_output, str)


def test_typed_output(model):
    agent = Agent(name="a", model=model, output_type=Verdict, model_settings=_settings())
    result = _run(agent, "Is it sunny?")
    assert isinstance(result.final_output, Verdict)


def test_typed_output_with_tools(model):
    """A forced first call, then (tool_choice auto again, the `<tool_call>` token biased
    away) the answer in the output type's schema: response_format / text.format beside
    tools."""
    agent = Agent(name="a", model=model, output_type=Verdict, tools=[WEATHER],
                  model_settings=_settings(bias=NO_CALL, tool_choice="required",
                                           parallel_tool_calls=False))
    result = _run(agent)
    assert [item.type for item in result.new_items][:2] == ["tool_call_item",
                                                            "tool_call_output_item"]
    assert isinstance(result.final_output, Verdict)
