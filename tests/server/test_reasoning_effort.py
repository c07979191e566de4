"""Chat's `reasoning_effort` (OpenAI's field): "none" and "minimal" turn the thinking off, as
vLLM maps them onto the template's enable_thinking (pydantic-ai's vLLM provider sends "none"
with thinking off); other efforts leave it on; chat_template_kwargs.enable_thinking, when
given, wins; a value OpenAI does not take is a 400 naming the field. The Responses API's
`reasoning.effort` goes through the same mapping (protocol.thinking_for_effort)."""

from __future__ import annotations

import pytest
from test_server import assert_openai_error, chat, srv  # noqa: F401

from tailored.server.protocol import EFFORTS, thinking_for_effort


@pytest.mark.parametrize("effort,thinking", [
    ("none", False), ("minimal", False), ("low", True), ("medium", True), ("high", True),
    ("xhigh", True), (None, True),
])
def test_reasoning_effort_sets_the_thinking(srv, effort, thinking):  # noqa: F811
    client, engine, tok = srv
    body = {} if effort is None else {"reasoning_effort": effort}
    r = chat(client, "SAY:q", **body)
    assert r.status_code == 200, r.text
    assert tok.template_calls[-1]["enable_thinking"] is thinking
    closed = list(b"</think>\n\n")
    assert (engine.prompts[r.json()["id"]][-len(closed):] == closed) is not thinking


def test_chat_template_kwargs_win_over_the_effort(srv):  # noqa: F811
    client, _, tok = srv
    for effort, flag in (("none", True), ("high", False)):
        r = chat(client, "SAY:q", reasoning_effort=effort,
                 chat_template_kwargs={"enable_thinking": flag})
        assert r.status_code == 200, r.text
        assert tok.template_calls[-1]["enable_thinking"] is flag


@pytest.mark.parametrize("effort", ["huge", "", 1, "None"])
def test_an_unknown_effort_is_a_400_naming_the_field(srv, effort):  # noqa: F811
    client, engine, _ = srv
    err = assert_openai_error(chat(client, "SAY:q", reasoning_effort=effort), 400)
    assert err["param"] == "reasoning_effort"
    assert not engine.added


def test_the_responses_api_maps_its_effort_the_same_way(srv):  # noqa: F811
    client, _, tok = srv
    for effort in EFFORTS:
        r = client.post("/v1/responses", json={"input": "SAY:q", "max_output_tokens": 4,
                                               "reasoning": {"effort": effort}})
        assert r.status_code == 200, r.text
        assert tok.template_calls[-1]["enable_thinking"] is thinking_for_effort(effort)
