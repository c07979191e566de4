"""LangChain (langchain-openai's ChatOpenAI) against `tailored serve`, set up as docs/clients.md
tells a user: base_url, any api_key, the served model's name, reasoning_effort "none"."""

from __future__ import annotations

import pytest
from served import (CALL, COMPACT, MAX_TOKENS, MODEL, NO_CALL, STRUCTURED_TOKENS, Verdict,
                    Weather, get_weather)

lc = pytest.importorskip("langchain_openai")
from langchain_core.messages import HumanMessage, ToolMessage  # noqa: E402


def _chat(served, **kw):
    return lc.ChatOpenAI(base_url=f"{served.url}/v1", api_key="none", model=MODEL,
                         temperature=0, reasoning_effort="none", max_retries=0, **kw)


@pytest.fixture(scope="module")
def llm(served):
    return _chat(served, max_completion_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def structured(served):
    """For JSON and calls: room for them, whitespace biased away (served.COMPACT)."""
    return _chat(served, max_completion_tokens=STRUCTURED_TOKENS, logit_bias=COMPACT)


def test_invoke_and_stream_with_usage(llm, served):
    ai = llm.invoke("Say hi.")
    assert isinstance(ai.content, str)
    assert ai.usage_metadata["output_tokens"] == MAX_TOKENS
    assert ai.response_metadata["finish_reason"] == "length"
    chunks = list(llm.stream("Say hi.", stream_usage=True))
    whole = sum(chunks[1:], chunks[0])
    assert whole.content == "".join(c.content for c in chunks)
    usage = whole.usage_metadata
    assert usage["output_tokens"] == MAX_TOKENS and usage["input_tokens"] > 0
    assert '"POST /v1/chat/completions" 200 stream prompt_tokens=' in served.log()


def test_forced_tool_call_and_round_trip(llm, structured):
    bound = structured.bind_tools([get_weather], tool_choice="get_weather",
                                  parallel_tool_calls=False)
    question = HumanMessage("Weather in Paris?")
    ai = bound.invoke([question])
    [call] = ai.tool_calls
    assert call["name"] == "get_weather"
    Weather.model_validate(call["args"])
    result = ToolMessage(get_weather(**call["args"]), tool_call_id=call["id"])
    answer = llm.bind_tools([get_weather]).invoke([question, ai, result])
    assert isinstance(answer.content, str) and not answer.tool_calls


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_structured_output(structured, method):
    got = structured.with_structured_output(Verdict, method=method).invoke("Is it sunny?")
    assert isinstance(got, Verdict) and len(got.label) <= 12


def test_typed_output_with_tools(structured):
    """bind_tools(..., response_format=Model): the model may call the tool or answer in the
    schema (a 400 before); logit_bias picks which, to see both."""
    for bias, calls in ((NO_CALL, False), (CALL, True)):
        bound = structured.bind_tools([get_weather], response_format=Verdict, strict=True,
                                      parallel_tool_calls=False)
        ai = bound.invoke("Is it sunny in Paris?", logit_bias=bias)
        if calls:
            [call] = ai.tool_calls
            Weather.model_validate(call["args"])
        else:
            assert not ai.tool_calls
            assert isinstance(ai.additional_kwargs["parsed"], Verdict)
