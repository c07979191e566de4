"""`n` choices: n engine requests of one prompt, answered as one response (whole and streamed),
each choice with its own index, seed, splitters and finish; a failure or a disconnect ends all."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient
from test_server import (
    MODEL,
    FakeEngine,
    FakeTokenizer,
    assert_openai_error,
    chat,
    completion,
    sse_events,
)
from test_tool_calls import TOOLS, call_xml

from tailored.engine.types import FinishReason, RequestOutput
from tailored.server.app import build_app
from tailored.server.async_engine import AsyncEngine
from tailored.server.protocol import INT64_MAX, INT64_MIN


class FailingChoiceEngine(FakeEngine):
    """Fails the engine request of choice 1 (id ending in "-1") at its first step."""

    def _advance(self, r) -> RequestOutput:
        if r.rid.endswith("-1"):
            return RequestOutput(r.rid, "", [], True, FinishReason.ERROR, r.prompt_len, 0,
                                 "choice 1 broke")
        return super()._advance(r)


def serve(engine=None, **kw):
    engine = engine or FakeEngine()
    app = build_app(AsyncEngine(engine), FakeTokenizer(), MODEL, 4096, **kw)
    return TestClient(app), engine


@pytest.fixture
def srv():
    client, engine = serve(reasoning_parser="qwen3")
    with client:
        yield client, engine


def test_completion_choices(srv):
    client, engine = srv
    r = completion(client, prompt="SAY:abc", n=3)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["text"] for c in body["choices"]] == ["abc"] * 3
    assert all(c["finish_reason"] == "stop" for c in body["choices"])
    # the prompt counts once, the completion tokens of every choice (3 chars + EOS each)
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 12, "total_tokens": 19}
    ids = list(engine.added)[-3:]
    assert ids == [f"{body['id']}-{i}" for i in range(3)]
    # n = 1 (or unset) keeps the response id as the engine request id
    one = completion(client, prompt="SAY:x", n=1).json()
    assert list(engine.added)[-1] == one["id"] and len(one["choices"]) == 1


def test_seeded_choices_draw_with_seed_plus_index(srv):
    client, engine = srv
    completion(client, prompt="SAY:a", n=3, seed=5, temperature=1.0)
    assert [sp.seed for sp in list(engine.added.values())[-3:]] == [5, 6, 7]
    completion(client, prompt="SAY:a", n=2, seed=INT64_MAX, temperature=1.0)
    assert [sp.seed for sp in list(engine.added.values())[-2:]] == [INT64_MAX, INT64_MIN]
    completion(client, prompt="SAY:a", n=2)
    assert [sp.seed for sp in list(engine.added.values())[-2:]] == [None, None]


@pytest.mark.parametrize("include_usage", [False, True])
def test_streamed_chat_choices_join_to_the_whole(srv, include_usage):
    client, _ = srv
    kw = dict(n=2, chat_template_kwargs={"enable_thinking": False})
    whole = chat(client, "SAY:hello there", **kw).json()
    opts = {"stream_options": {"include_usage": True}} if include_usage else {}
    events = sse_events(chat(client, "SAY:hello there", stream=True, **kw, **opts).text)
    assert events[-1] == "DONE" and events.count("DONE") == 1
    if include_usage:
        assert events[-2]["choices"] == [] and events[-2]["usage"] == whole["usage"]
        events = events[:-1]
    chunks = [c for e in events[:-1] for c in e["choices"]]
    assert all(len(e["choices"]) == 1 for e in events[:-1])  # one choice a chunk
    for i in range(2):
        mine = [c for c in chunks if c["index"] == i]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content") or "" for c in mine) == \
            whole["choices"][i]["message"]["content"] == "hello there"
        assert [c["finish_reason"] for c in mine if c["finish_reason"]] == ["stop"]


def test_tool_calls_in_every_choice(srv):
    client, _ = srv
    script = "SAY:" + call_xml("now")
    body = chat(client, script, n=2, tools=TOOLS,
                chat_template_kwargs={"enable_thinking": False}).json()
    assert [c["finish_reason"] for c in body["choices"]] == ["tool_calls"] * 2
    ids = [c["message"]["tool_calls"][0]["id"] for c in body["choices"]]
    assert len(set(ids)) == 2  # each call its own id
    events = sse_events(chat(client, script, n=2, tools=TOOLS, stream=True,
                             chat_template_kwargs={"enable_thinking": False}).text)
    named = sorted(c["index"] for e in events[:-1] for c in e["choices"]
                   for d in c["delta"].get("tool_calls", []) if "id" in d)
    assert named == [0, 1]


def test_a_failing_choice_fails_the_request_and_ends_the_others():
    client, engine = serve(FailingChoiceEngine(delay_s=0.002))
    with client:
        r = completion(client, prompt="SAY:" + "x" * 50, n=3)
        assert_openai_error(r, 500, "choice 1 broke")
        events = sse_events(completion(client, prompt="SAY:" + "y" * 50, n=3, stream=True).text)
        assert events[-1] == "DONE" and "choice 1 broke" in events[-2]["error"]["message"]
        deadline = time.monotonic() + 5  # aborts reach the engine thread by its queue
        while engine.reqs and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not engine.reqs  # nothing left running
        assert {rid[-2:] for rid in engine.aborted} >= {"-0", "-2"}
        assert completion(client, prompt="SAY:ok").json()["choices"][0]["text"] == "ok"


def test_n_over_the_engines_context_is_refused_before_any_choice_starts(srv):
    client, engine = srv
    before = len(engine.added)
    r = completion(client, prompt="SAY:x", n=2, max_tokens=10**6)
    assert_openai_error(r, 400, "max_tokens")
    assert len(engine.added) == before


class RecordingEngine(FakeEngine):
    """Records the engine step each request was added at and, at each abort, which requests
    were still running; choice 1 (id ending in "-1") writes 300 more characters first."""

    def __init__(self, delay_s: float = 0.0) -> None:
        super().__init__(delay_s)
        self.num_steps = 0
        self.added_at: dict[str, int] = {}
        self.running_at_abort: dict[str, set] = {}

    def step(self):
        self.num_steps += 1
        return super().step()

    def add_request(self, request_id, prompt_ids, sampling) -> None:
        super().add_request(request_id, prompt_ids, sampling)
        self.added_at[request_id] = self.num_steps
        if request_id.endswith("-1"):
            r = self.reqs[request_id]
            r.script = list(b"x" * 300) + r.script

    def abort_request(self, request_id) -> None:
        self.running_at_abort[request_id] = set(self.reqs)
        super().abort_request(request_id)


def test_every_choice_joins_the_engine_in_one_step():
    """The n adds are submitted before any is awaited: the engine takes them between the same
    two steps (one batched prefill), not one a step."""
    client, engine = serve(RecordingEngine(delay_s=0.005))
    with client:
        completion(client, prompt="SAY:warm", max_tokens=3)
        r = completion(client, prompt="SAY:abc", n=16)
        ids = [f"{r.json()['id']}-{i}" for i in range(16)]
        assert len({engine.added_at[i] for i in ids}) == 1


def test_a_choice_whose_call_ended_stops_at_once_beside_longer_ones():
    client, engine = serve(RecordingEngine(delay_s=0.003))
    with client:
        r = chat(client, "SAY:" + call_xml("now") + "y" * 200, n=2, tools=TOOLS,
                 parallel_tool_calls=False, chat_template_kwargs={"enable_thinking": False})
        body = r.json()
        assert [c["finish_reason"] for c in body["choices"]] == ["tool_calls"] * 2
        first = f"{body['id']}-0"
        # choice 0 left the engine while choice 1 was still writing its 300 characters
        assert f"{body['id']}-1" in engine.running_at_abort[first]


@pytest.mark.parametrize("stream", [False, True])
def test_a_completions_batch_gives_n_choices_a_prompt(srv, stream):
    client, engine = srv
    prompts = ["SAY:ab", "SAY:cde", list(b"SAY:f")]
    r = completion(client, prompt=prompts, n=2, stream=stream,
                   **({"stream_options": {"include_usage": True}} if stream else {}))
    assert r.status_code == 200, r.text
    if stream:
        events = sse_events(r.text)
        usage = events[-2]["usage"]
        texts: dict[int, str] = {}
        for e in events[:-2]:
            for c in e["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
        texts = [texts[k] for k in range(6)]
    else:
        body = r.json()
        usage = body["usage"]
        assert [c["index"] for c in body["choices"]] == list(range(6))
        texts = [c["text"] for c in body["choices"]]
    # choice k answers prompt k // n; each prompt counts once in usage
    assert texts == ["ab", "ab", "cde", "cde", "f", "f"]
    assert usage["prompt_tokens"] == 6 + 7 + 5 and usage["completion_tokens"] == 2 * (3 + 4 + 2)
    assert len({rid.rsplit("-", 1)[0] for rid in list(engine.added)[-6:]}) == 1


def test_a_bad_prompt_of_a_batch_is_named(srv):
    client, engine = srv
    before = len(engine.added)
    err = assert_openai_error(completion(client, prompt=[[1, 2], [3, 99999]]), 400,
                              "outside the vocabulary")
    assert err["param"] == "prompt[1]" and len(engine.added) == before


def test_logit_bias_reaches_the_engine_as_ids(srv):
    client, engine = srv
    r = completion(client, prompt="SAY:x", logit_bias={"65": -100, "7": 2.5})
    assert r.status_code == 200, r.text
    assert list(engine.added.values())[-1].logit_bias == {65: -100.0, 7: 2.5}


def test_a_batch_prompt_too_long_is_named(srv):
    client, engine = srv
    before = len(engine.added)
    err = assert_openai_error(completion(client, prompt=["SAY:a", "x" * 5000], max_tokens=None),
                              400, "maximum context length")
    assert err["param"] == "prompt[1]" and len(engine.added) == before
