"""pydantic-ai against `tailored serve`, set up as docs/clients.md tells a user: its vLLM
provider (`VLLMProvider(base_url=...)`) and `OpenAIChatModel` with the served name; thinking
off by the unified `thinking=False` setting, which that provider sends as reasoning_effort
"none" (the thinking stayed on before the server read it, and the run ran out of tokens
inside it). Output modes: text, ToolOutput (a forced call of the output tool), NativeOutput
(response_format) with and without a function tool."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest
from served import (COMPACT, MAX_TOKENS, MODEL, NO_CALL, STRUCTURED_TOKENS, Verdict,
                    get_weather)

pydantic_ai = pytest.importorskip("pydantic_ai")
from pydantic_ai import Agent, NativeOutput, ToolOutput, UsageLimits  # noqa: E402
from pydantic_ai.capabilities import AbstractCapability  # noqa: E402
from pydantic_ai.models.openai import OpenAIChatModel  # noqa: E402
from pydantic_ai.providers.vllm import VLLMProvider  # noqa: E402

SHORT = {"thinking": False, "temperature": 0, "max_tokens": MAX_TOKENS}
ROOM = {"thinking": False, "temperature": 0, "max_tokens": STRUCTURED_TOKENS,
        "parallel_tool_calls": False}
LIMITS = UsageLimits(request_limit=3)


@pytest.fixture(scope="module")
def model(served):
    return OpenAIChatModel(MODEL, provider=VLLMProvider(base_url=f"{served.url}/v1",
                                                        api_key="none"))


def test_run_and_stream_with_usage(model):
    result = Agent(model, model_settings=SHORT).run_sync("Say hi.")
    assert isinstance(result.output, str)
    assert result.usage.output_tokens == MAX_TOKENS

    async def streamed():
        async with Agent(model, model_settings=SHORT).run_stream("Say hi.") as run:
            text = await run.get_output()
            return text, run.usage

    text, usage = asyncio.run(streamed())
    assert isinstance(text, str) and usage.output_tokens == MAX_TOKENS


@dataclass
class CallFirst(AbstractCapability):
    """tool_choice "required" on the run's first request only (pydantic-ai's way to force a
    tool for one step): the nano model calls get_weather, then answers."""

    def get_model_settings(self):
        return lambda ctx: {"tool_choice": "required"} if ctx.run_step <= 1 else {}


def test_tool_round_trip(model):
    agent = Agent(model, tools=[get_weather], capabilities=[CallFirst()],
                  model_settings={**ROOM, "logit_bias": COMPACT})
    result = agent.run_sync("Weather in Paris?", usage_limits=LIMITS)
    calls = [p for m in result.all_messages() for p in m.parts if p.part_kind == "tool-call"]
    returns = [p for m in result.all_messages() for p in m.parts if p.part_kind == "tool-return"]
    assert [c.tool_name for c in calls] == ["get_weather"]
    assert returns[0].content.startswith("sunny in ")
    assert isinstance(result.output, str)


@pytest.mark.parametrize("mode", ["tool", "native"])
def test_structured_output(model, mode):
    output = ToolOutput(Verdict) if mode == "tool" else NativeOutput(Verdict)
    agent = Agent(model, output_type=output, model_settings={**ROOM, "logit_bias": COMPACT})
    result = agent.run_sync("Is it sunny?", usage_limits=LIMITS)
    assert isinstance(result.output, Verdict) and len(result.output.label) <= 12


def test_native_output_with_a_tool(model):
    """NativeOutput beside a function tool: response_format and tools in one request (a 400
    before); the `<tool_call>` token biased away, the model answers in the schema."""
    agent = Agent(model, output_type=NativeOutput(Verdict), tools=[get_weather],
                  model_settings={**ROOM, "logit_bias": NO_CALL})
    result = agent.run_sync("Is it sunny in Paris?", usage_limits=LIMITS)
    assert isinstance(result.output, Verdict)
