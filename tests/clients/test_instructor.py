"""instructor against `tailored serve`, set up as docs/clients.md tells a user:
`instructor.from_openai(OpenAI(base_url=...), mode=...)` with its two modes that hold the
answer to the schema (TOOLS: a forced function call; JSON_SCHEMA: response_format), plain
and streamed (partial objects), with the completion's usage; thinking off by
reasoning_effort "none". (instructor does structured output only: no tool round trip.)"""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel, Field
from served import COMPACT, MAX_TOKENS, MODEL, STRUCTURED_TOKENS, Verdict

instructor = pytest.importorskip("instructor")
openai = pytest.importorskip("openai")

ASK = [{"role": "user", "content": "Is it sunny in Paris today?"}]
SETTINGS = dict(model=MODEL, temperature=0, reasoning_effort="none")


@pytest.fixture(scope="module")
def oa(served):
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0)


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_structured_output_and_its_usage(oa, mode):
    client = instructor.from_openai(oa, mode=getattr(instructor.Mode, mode))
    got, completion = client.chat.completions.create_with_completion(
        messages=ASK, response_model=Verdict, max_retries=0, max_tokens=STRUCTURED_TOKENS,
        logit_bias=COMPACT, **SETTINGS)
    assert isinstance(got, Verdict) and len(got.label) <= 12
    assert completion.usage.completion_tokens > 0 and completion.usage.prompt_tokens > 0


class Short(BaseModel):
    """(no date: instructor validates partial objects strictly from Python values, where a
    date's string is refused whatever the server sent)"""

    answer: Literal["yes", "no"]
    label: str = Field(max_length=12)


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_streamed_partial_objects(oa, mode):
    client = instructor.from_openai(oa, mode=getattr(instructor.Mode, mode))
    parts = list(client.chat.completions.create_partial(
        messages=ASK, response_model=Short, max_retries=0, max_tokens=STRUCTURED_TOKENS,
        logit_bias=COMPACT, **SETTINGS))
    assert len(parts) > 1 and Short.model_validate(parts[-1].model_dump())


def test_plain_answer_through_the_patched_client(oa):
    client = instructor.from_openai(oa)
    r = client.chat.completions.create(messages=ASK, response_model=None,
                                       max_tokens=MAX_TOKENS, **SETTINGS)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == MAX_TOKENS
