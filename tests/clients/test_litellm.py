"""LiteLLM against `tailored serve`, set up as docs/clients.md tells a user: the model as
"openai/<served name>" with api_base and any api_key, thinking off by reasoning_effort "none",
and its model cost map read from the package (LITELLM_LOCAL_MODEL_COST_MAP, set before the
import: it would fetch it from the internet)."""

from __future__ import annotations

import json
import os

import pytest
from served import (CALL, COMPACT, MAX_TOKENS, MODEL, NO_CALL, STRUCTURED_TOKENS, WEATHER_TOOL,
                    Verdict, Weather, get_weather)

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
litellm = pytest.importorskip("litellm")

ASK = [{"role": "user", "content": "Weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def call(served):
    def completion(**kw):
        kw.setdefault("max_tokens", MAX_TOKENS)
        return litellm.completion(model=f"openai/{MODEL}", api_base=f"{served.url}/v1",
                                  api_key="none", temperature=0, reasoning_effort="none",
                                  **{"messages": ASK, **kw})
    return completion


def test_completion_and_stream_with_usage(call):
    r = call()
    assert isinstance(r.choices[0].message.content, str)
    assert r.usage.completion_tokens == MAX_TOKENS and r.choices[0].finish_reason == "length"
    chunks = list(call(stream=True, stream_options={"include_usage": True}))
    usage = [c.usage for c in chunks if getattr(c, "usage", None)]
    assert usage and usage[-1].completion_tokens == MAX_TOKENS


def test_forced_tool_call_and_round_trip(call):
    r = call(tools=[WEATHER_TOOL], tool_choice=NAMED, parallel_tool_calls=False,
             max_tokens=STRUCTURED_TOKENS, logit_bias=COMPACT)
    msg = r.choices[0].message
    [tc] = msg.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and tc.function.name == "get_weather"
    args = Weather.model_validate_json(tc.function.arguments)
    history = ASK + [msg.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": tc.id,
                      "content": get_weather(**args.model_dump())}]
    r = call(messages=history, tools=[WEATHER_TOOL])
    assert isinstance(r.choices[0].message.content, str) and not r.choices[0].message.tool_calls


def test_structured_output_as_a_schema_and_as_a_call(call):
    r = call(response_format=Verdict, max_tokens=STRUCTURED_TOKENS, logit_bias=COMPACT)
    assert Verdict.model_validate_json(r.choices[0].message.content)
    tool = {"type": "function", "function": {"name": "verdict",
                                             "parameters": Verdict.model_json_schema()}}
    r = call(tools=[tool], tool_choice="required", parallel_tool_calls=False,
             max_tokens=STRUCTURED_TOKENS, logit_bias=COMPACT)
    Verdict.model_validate_json(r.choices[0].message.tool_calls[0].function.arguments)


def test_typed_output_with_tools(call):
    for bias, calls in ((NO_CALL, False), (CALL, True)):
        r = call(tools=[WEATHER_TOOL], response_format=Verdict, parallel_tool_calls=False,
                 max_tokens=STRUCTURED_TOKENS, logit_bias=bias)
        msg = r.choices[0].message
        if calls:
            Weather.model_validate(json.loads(msg.tool_calls[0].function.arguments))
        else:
            assert not msg.tool_calls and Verdict.model_validate_json(msg.content)
