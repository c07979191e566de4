"""HTTP server tests against a fake engine and tokenizer (CPU only, no model, a few seconds).

FakeTokenizer: one id per UTF-8 byte (0..255) plus EOS (256); vocab_size 260.
FakeEngine: echoes a script chosen by the prompt, one token per step per request:
  "SAY:<text>" anywhere in the prompt -> generates <text> (up to "<|im_end|>" or the end), then EOS;
  otherwise it echoes the prompt bytes. "FAIL" in the script -> RequestOutput.error on the first
  step; "CRASH" -> step() raises (the engine loop dies); a prompt ending in "REJECT" ->
  add_request raises ValueError. Stop strings, stop_token_ids, ignore_eos and max_tokens follow
  SamplingParams. Every engine call records its thread so tests can check single-threadedness.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from live_server import LiveServer

from tailored.engine.types import FinishReason, RequestOutput, SamplingParams
from tailored.server.app import build_app
from tailored.server.async_engine import AsyncEngine, EngineDeadError

MODEL = "qwen3.6-test"
MAX_LEN = 512
EOS = 256


class FakeTokenizer:
    vocab_size = 260
    eos_token_ids = (EOS,)

    def __init__(self) -> None:
        self.template_calls: list[dict] = []

    def encode(self, text: str) -> list[int]:
        if "BOOM" in text:
            raise RuntimeError("tokenizer exploded")
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(
        self, messages, add_generation_prompt=True, enable_thinking=True, tools=None
    ) -> str:
        self.template_calls.append({"messages": messages, "enable_thinking": enable_thinking,
                                    "tools": tools})
        out = []
        for m in messages:
            content = m["content"]
            if isinstance(content, list):
                texts = []
                for part in content:
                    if part.get("type") != "text":
                        raise ValueError(f"unsupported content part type {part.get('type')!r}")
                    texts.append(part["text"])
                content = "".join(texts)
            out.append(f"<|im_start|>{m['role']}\n{content}<|im_end|>\n")
        if add_generation_prompt:
            out.append("<|im_start|>assistant\n")
            out.append("<think>\n" if enable_thinking else "<think>\n\n</think>\n\n")
        return "".join(out)


class _Req:
    def __init__(self, rid: str, prompt_ids: list[int], sampling: SamplingParams) -> None:
        text = bytes(i for i in prompt_ids if i < 256).decode("utf-8", errors="replace")
        if "SAY:" in text:
            text = text.split("SAY:")[-1].split("<|im_end|>")[0]
            self.script = list(text.encode()) + [EOS]
        else:
            self.script = list(prompt_ids) + [EOS]
        self.rid, self.sampling, self.prompt_len = rid, sampling, len(prompt_ids)
        self.fail = "FAIL" in text
        self.crash = "CRASH" in text
        self.out_ids: list[int] = []
        self.text = ""
        self.sent = 0  # chars of text already returned


class FakeEngine:
    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.reqs: dict[str, _Req] = {}
        self.added: dict[str, SamplingParams] = {}
        self.prompts: dict[str, list[int]] = {}
        self.aborted: list[str] = []
        self.threads: set[int] = set()
        self.idle_checks = 0

    def _mark(self) -> None:
        self.threads.add(threading.get_ident())

    def add_request(self, request_id, prompt_ids, sampling) -> None:
        self._mark()
        if bytes(i for i in prompt_ids if i < 256).endswith(b"REJECT"):
            raise ValueError("prompt rejected by the engine")
        self.added[request_id] = sampling
        self.prompts[request_id] = list(prompt_ids)
        self.reqs[request_id] = _Req(request_id, prompt_ids, sampling)

    def abort_request(self, request_id) -> None:
        self._mark()
        self.aborted.append(request_id)
        self.reqs.pop(request_id, None)

    def has_unfinished(self) -> bool:
        self._mark()
        if not self.reqs:
            self.idle_checks += 1
        return bool(self.reqs)

    def stats(self) -> dict:
        self._mark()
        return {"running": len(self.reqs)}

    def step(self) -> list[RequestOutput]:
        self._mark()
        if self.delay_s:
            time.sleep(self.delay_s)
        outs = []
        for r in list(self.reqs.values()):
            if r.crash:
                raise RuntimeError("fake engine crashed")
            outs.append(self._advance(r))
            if outs[-1].finished:
                del self.reqs[r.rid]
        return outs

    def _advance(self, r: _Req) -> RequestOutput:
        sp = r.sampling

        def out(text, ids, reason=None, error=None):
            return RequestOutput(
                r.rid, text, ids, reason is not None, reason, r.prompt_len, len(r.out_ids), error
            )

        if r.fail:
            return out("", [], FinishReason.ERROR, "fake engine failure")
        tok = r.script[len(r.out_ids) % len(r.script)]
        if tok == EOS and sp.ignore_eos:
            tok = r.script[0]
        r.out_ids.append(tok)
        if tok == EOS or tok in sp.stop_token_ids:
            return out("", [tok], FinishReason.STOP)
        r.text += bytes([tok]).decode("latin-1")
        for s in sp.stop:
            if s in r.text:
                keep = r.text.index(s) + (len(s) if sp.include_stop_str_in_output else 0)
                return out(self._emit(r, keep), [tok], FinishReason.STOP)
        if len(r.out_ids) >= sp.max_tokens:
            return out(self._emit(r, len(r.text)), [tok], FinishReason.LENGTH)
        # hold back a tail that could still become a stop string, as a real detokenizer does
        held = max(
            (k for s in sp.stop for k in range(1, len(s)) if r.text.endswith(s[:k])), default=0
        )
        return out(self._emit(r, len(r.text) - held), [tok])

    @staticmethod
    def _emit(r: _Req, upto: int) -> str:
        delta, r.sent = r.text[r.sent : upto], max(r.sent, upto)
        return delta


# ---- fixtures ----------------------------------------------------------------------------


def make_app(delay_s: float = 0.0, **kw):
    engine = FakeEngine(delay_s)
    tok = FakeTokenizer()
    aengine = AsyncEngine(engine)
    app = build_app(aengine, tok, MODEL, MAX_LEN, **kw)
    return app, aengine, engine, tok


@pytest.fixture
def srv():
    app, aengine, engine, tok = make_app()
    with TestClient(app) as client:  # runs the lifespan: starts and stops the engine thread
        yield client, engine, tok
    assert not aengine.healthy


def completion(client, **body):
    return client.post("/v1/completions", json={"model": MODEL, "max_tokens": 64, **body})


def chat(client, content="SAY:hello", **body):
    msgs = body.pop("messages", [{"role": "user", "content": content}])
    return client.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, **body})


def sse_events(text: str) -> list:
    """Parse an SSE body into JSON payloads; the terminating [DONE] becomes the string 'DONE'."""
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append("DONE" if data == "[DONE]" else json.loads(data))
    return events


def assert_openai_error(resp, status: int, *needles: str) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for needle in needles:
        assert needle in err["message"], err
    return err


# ---- basic endpoints ---------------------------------------------------------------------


def test_health_and_models(srv):
    client, _, _ = srv
    assert client.get("/health").json() == {"status": "ok"}
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["object"] == "model" and models["data"][0]["max_model_len"] == MAX_LEN
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert_openai_error(client.get("/v1/models/other"), 404)
    r = client.head("/health")  # load balancers' health checks (session 26)
    assert r.status_code == 200 and not r.content
    # a trailing slash is a 404 in the OpenAI format, not a 307 to the Host header's server
    r = client.post("/v1/completions/", json={"model": MODEL, "prompt": "SAY:x"},
                    headers={"host": "evil.example"}, follow_redirects=False)
    assert_openai_error(r, 404)
    assert "location" not in r.headers


def test_completion_non_streaming(srv):
    client, engine, _ = srv
    r = completion(client, prompt="SAY:hello world")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == MODEL and isinstance(body["created"], int)
    choice = body["choices"][0]
    assert choice == {"index": 0, "text": "hello world", "logprobs": None, "finish_reason": "stop"}
    # 11 text tokens + EOS, all returned as ids
    assert body["usage"] == {"prompt_tokens": 15, "completion_tokens": 12, "total_tokens": 27}
    assert body["id"] in engine.added


@pytest.mark.parametrize("prompt", ["SAY:abc", ["SAY:abc"], list(b"SAY:abc"), [list(b"SAY:abc")]])
def test_completion_prompt_forms(srv, prompt):
    client, engine, _ = srv
    r = completion(client, prompt=prompt)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "abc"
    assert engine.prompts[r.json()["id"]] == list(b"SAY:abc")


def test_completion_streaming(srv):
    client, _, _ = srv
    r = completion(client, prompt="SAY:stream me", stream=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "DONE"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert "".join(c["choices"][0]["text"] for c in chunks) == "stream me"
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "stop"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert all(c["choices"][0]["logprobs"] is None for c in chunks)


def test_chat_non_streaming(srv):
    client, _, tok = srv
    r = chat(client, "SAY:hi there")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "hi there"}
    assert choice["finish_reason"] == "stop" and choice["logprobs"] is None
    prompt = tok.apply_chat_template([{"role": "user", "content": "SAY:hi there"}])
    assert body["usage"]["prompt_tokens"] == len(prompt.encode())
    assert body["usage"]["completion_tokens"] == len("hi there") + 1  # + EOS


def test_chat_streaming(srv):
    client, _, _ = srv
    r = chat(client, "SAY:xyz", stream=True)
    events = sse_events(r.text)
    assert events[-1] == "DONE"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == "xyz"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])


def _deltas(text: str) -> tuple[str, str, list]:
    """(joined reasoning, joined content, chunks) of a chat SSE body."""
    events = sse_events(text)
    assert events[-1] == "DONE"
    chunks = [e for e in events[:-1] if e["choices"]]
    deltas = [c["choices"][0]["delta"] for c in chunks[1:]]  # after the role chunk
    return ("".join(d.get("reasoning_content", "") for d in deltas),
            "".join(d.get("content", "") for d in deltas), chunks)


def test_reasoning_parser_splits_the_thinking_from_the_answer():
    """--reasoning-parser qwen3: the text up to </think> is reasoning_content, the answer after
    it (its leading newlines dropped) content, whole and streamed (one character a delta here,
    so "</think>" arrives cut across eight deltas); thinking off: all content, a literal
    "</think>" included; cut by max_tokens inside the thinking: content null, no content delta;
    completions and usage are untouched."""
    app, _, _, _ = make_app(reasoning_parser="qwen3")
    with TestClient(app) as client:
        said = "SAY:x < y, so</think>\n\nfour"
        m = chat(client, said).json()["choices"][0]["message"]
        assert m == {"role": "assistant", "content": "four", "reasoning": "x < y, so",
                     "reasoning_content": "x < y, so"}
        r = chat(client, said, stream=True, stream_options={"include_usage": True})
        reasoning, content, chunks = _deltas(r.text)
        assert (reasoning, content) == ("x < y, so", "four")
        assert len({c["created"] for c in sse_events(r.text)[:-1]}) == 1  # one timestamp
        for c in chunks[1:]:  # the reasoning under both names, always together
            d = c["choices"][0]["delta"]
            assert d.get("reasoning") == d.get("reasoning_content")
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        usage = sse_events(r.text)[-2]["usage"]
        assert usage["completion_tokens"] == len("x < y, so</think>\n\nfour") + 1
        off = {"chat_template_kwargs": {"enable_thinking": False}}
        m = chat(client, "SAY:2 </think> 3", **off).json()["choices"][0]["message"]
        assert m == {"role": "assistant", "content": "2 </think> 3"}
        assert _deltas(chat(client, "SAY:2 </think> 3", stream=True, **off).text)[:2] == (
            "", "2 </think> 3")
        cut = chat(client, said, max_tokens=5).json()["choices"][0]
        assert cut["message"] == {"role": "assistant", "content": None, "reasoning": "x < y",
                                  "reasoning_content": "x < y"}
        assert cut["finish_reason"] == "length"
        assert _deltas(chat(client, said, max_tokens=5, stream=True).text)[:2] == ("x < y", "")
        text = completion(client, prompt="SAY:a</think>b").json()["choices"][0]["text"]
        assert text == "a</think>b"
    with pytest.raises(ValueError, match="reasoning_parser"):
        make_app(reasoning_parser="deepseek_r1")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_stream_include_usage(srv, path):
    client, _, _ = srv
    body = {
        "model": MODEL,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 5,
    }
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": "SAY:abcdefgh"}]
    else:
        body["prompt"] = "SAY:abcdefgh"
    events = sse_events(client.post(path, json=body).text)
    assert events[-1] == "DONE"
    usage_chunk = events[-2]
    assert usage_chunk["choices"] == []
    usage = usage_chunk["usage"]
    assert usage["completion_tokens"] == 5
    assert usage["total_tokens"] == usage["prompt_tokens"] + 5
    assert all(c["usage"] is None for c in events[:-2])  # OpenAI: null on the other chunks
    assert events[-3]["choices"][0]["finish_reason"] == "length"


def test_finish_reason_length_and_stop_strings(srv):
    client, _, _ = srv
    r = completion(client, prompt="SAY:abcdefgh", max_tokens=3).json()
    assert r["choices"][0] == {
        "index": 0,
        "text": "abc",
        "logprobs": None,
        "finish_reason": "length",
    }
    assert r["usage"]["completion_tokens"] == 3
    r = completion(client, prompt="SAY:abcdefgh", stop=["de"]).json()
    assert (r["choices"][0]["text"], r["choices"][0]["finish_reason"]) == ("abc", "stop")
    assert r["usage"]["completion_tokens"] == 5  # a, b, c, d, e were generated and returned as ids
    r = completion(client, prompt="SAY:abcdefgh", stop="de", include_stop_str_in_output=True)
    assert r.json()["choices"][0]["text"] == "abcde"
    r = chat(client, "SAY:abcdefgh", stop_token_ids=[ord("c")]).json()
    assert (r["choices"][0]["message"]["content"], r["choices"][0]["finish_reason"]) == (
        "ab",
        "stop",
    )


def test_sampling_params_reach_engine(srv):
    client, engine, tok = srv
    r = chat(
        client,
        "SAY:q",
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        min_p=0.05,
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        stop=["x"],
        stop_token_ids=[5],
        ignore_eos=True,
        skip_special_tokens=False,
        max_completion_tokens=9,
        max_tokens=3,
        user="u",
        n=1,
        chat_template_kwargs={"enable_thinking": False},
    )
    assert r.status_code == 200, r.text
    sp = engine.added[r.json()["id"]]
    assert sp == SamplingParams(
        max_tokens=9,
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        min_p=0.05,
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        stop=["x"],
        stop_token_ids=[5],
        ignore_eos=True,
        skip_special_tokens=False,
    )
    assert tok.template_calls[-1]["enable_thinking"] is False
    assert engine.prompts[r.json()["id"]][-len(b"</think>\n\n") :] == list(b"</think>\n\n")
    chat(client, "SAY:q")
    assert tok.template_calls[-1]["enable_thinking"] is True


def test_default_max_tokens_fills_context(srv):
    client, engine, _ = srv
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "SAY:a"})
    assert engine.added[r.json()["id"]].max_tokens == MAX_LEN - len("SAY:a")
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200  # model may be omitted
    assert engine.added[r.json()["id"]].max_tokens == MAX_LEN - r.json()["usage"]["prompt_tokens"]


def test_sampling_defaults_apply_to_omitted_fields():
    app, _, engine, _ = make_app(sampling_defaults={"temperature": 0.6, "top_k": 20})
    with TestClient(app) as client:
        r = completion(client, prompt="SAY:a", top_k=5)
        sp = engine.added[r.json()["id"]]
        assert (sp.temperature, sp.top_k) == (0.6, 5)


def test_unknown_extra_fields_are_ignored(srv):
    client, _, _ = srv
    r = chat(
        client,
        "SAY:ok",
        metadata={"a": "b"},
        store=False,
        service_tier="auto",
        parallel_tool_calls=True,
        frobnicate=3,
        stream_options=None,
        tool_choice="none",
        response_format={"type": "text"},
        logprobs=False,
        top_logprobs=0,
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "ok"


# ---- bad input ---------------------------------------------------------------------------

MSGS = [{"role": "user", "content": "SAY:x"}]
BAD_REQUESTS = [
    # (path, body or raw bytes, status, substrings of the message, param)
    ("c", b"{not json", 400, ["malformed JSON"], None),
    # an integer over Python's 4300-digit str->int limit is a ValueError, not a JSONDecodeError
    ("c", b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", 400, ["malformed JSON"], None),
    ("c", b'{"prompt": "x", "zzz": ' + b"9" * 5000 + b"}", 400, ["malformed JSON"], None),
    ("c", b"[1, 2]", 400, ["JSON object"], None),
    ("c", {"prompt": "x", "temperature": "hot"}, 400, ["temperature"], "temperature"),
    ("c", {"prompt": "x", "max_tokens": "ten"}, 400, ["max_tokens"], "max_tokens"),
    ("c", {"prompt": "x", "max_tokens": 1.5}, 400, ["max_tokens"], "max_tokens"),
    ("c", {"prompt": "x", "temperature": True}, 400, ["temperature"], "temperature"),
    ("c", {"prompt": "x", "seed": "42"}, 400, ["seed"], "seed"),
    ("c", {"prompt": "x", "stream": "yes"}, 400, ["stream"], "stream"),
    (
        "c",
        b'{"prompt": "x", "repetition_penalty": Infinity}',
        400,
        ["repetition_penalty"],
        "repetition_penalty",
    ),
    ("c", {"prompt": "x", "model": "gpt-4"}, 404, ["gpt-4"], "model"),
    ("m", {"messages": MSGS, "model": "gpt-4"}, 404, ["gpt-4"], "model"),
    ("m", {"messages": []}, 400, ["messages must not be empty"], "messages"),
    ("m", {}, 400, ["missing required parameter 'messages'"], "messages"),
    ("m", {"messages": "hi"}, 400, ["messages"], "messages"),
    ("m", {"messages": [{"role": "wizard", "content": "x"}]}, 400, ["role"], "messages[0].role"),
    ("m", {"messages": [{"role": "user", "content": 5}]}, 400, ["content"], "messages[0].content"),
    (
        "m",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        ["image_url"],
        "messages",
    ),
    ("c", {"prompt": ""}, 400, ["prompt must not be empty"], "prompt"),
    ("c", {"prompt": []}, 400, ["prompt must not be empty"], "prompt"),
    ("c", {}, 400, ["missing required parameter 'prompt'"], "prompt"),
    # batches are served (tests/test_choices.py); their items are checked one by one
    ("c", {"prompt": ["a", ""]}, 400, ["prompt 1 must not be empty"], "prompt"),
    ("c", {"prompt": [[1, 2], [3, True]]}, 400, ["prompt 1 must be"], "prompt"),
    ("c", {"prompt": ["a"] * 129}, 400, ["at most 128 prompts"], "prompt"),
    ("c", {"prompt": ["a"] * 3, "n": 50}, 400, ["150 completions"], "n"),
    ("c", {"prompt": [1, "a"]}, 400, ["prompt"], "prompt"),
    ("c", {"prompt": [1, 9999]}, 400, ["outside the vocabulary"], "prompt"),
    ("c", {"prompt": "x", "max_tokens": 0}, 400, ["max_tokens"], "max_tokens"),
    ("c", {"prompt": "x", "max_tokens": -5}, 400, ["max_tokens"], "max_tokens"),
    (
        "m",
        {"messages": MSGS, "max_completion_tokens": 0},
        400,
        ["max_completion_tokens"],
        "max_completion_tokens",
    ),
    (
        "m",
        {"messages": MSGS, "max_completion_tokens": MAX_LEN},
        400,
        ["maximum context length", "max_completion_tokens"],
        "max_completion_tokens",
    ),
    (
        "c",
        {"prompt": "x", "max_tokens": MAX_LEN + 1},
        400,
        ["larger than the maximum context"],
        "max_tokens",
    ),
    (
        "c",
        {"prompt": "x" * 100, "max_tokens": MAX_LEN - 50},
        400,
        [f"maximum context length is {MAX_LEN}", "100 in the prompt"],
        "max_tokens",
    ),
    ("c", {"prompt": "x" * MAX_LEN}, 400, [f"prompt has {MAX_LEN} tokens"], "prompt"),
    ("c", {"prompt": "x", "temperature": 2.5}, 400, ["temperature"], "temperature"),
    ("c", {"prompt": "x", "temperature": -1}, 400, ["temperature"], "temperature"),
    ("c", {"prompt": "x", "top_p": 0}, 400, ["top_p"], "top_p"),
    ("c", {"prompt": "x", "top_p": 1.5}, 400, ["top_p"], "top_p"),
    ("c", {"prompt": "x", "presence_penalty": 3}, 400, ["presence_penalty"], "presence_penalty"),
    (
        "c",
        {"prompt": "x", "frequency_penalty": -3},
        400,
        ["frequency_penalty"],
        "frequency_penalty",
    ),
    (
        "c",
        {"prompt": "x", "repetition_penalty": 0},
        400,
        ["repetition_penalty"],
        "repetition_penalty",
    ),
    ("c", {"prompt": "x", "top_k": -2}, 400, ["top_k"], "top_k"),
    ("c", {"prompt": "x", "min_p": 1.5}, 400, ["min_p"], "min_p"),
    ("c", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, ["at most 4"], "stop"),
    ("c", {"prompt": "x", "stop": [""]}, 400, ["stop"], "stop"),
    ("c", {"prompt": "x", "stop": 5}, 400, ["stop"], "stop"),
    ("c", {"prompt": "x", "stop_token_ids": [100000]}, 400, ["stop_token_ids"], "stop_token_ids"),
    ("c", {"prompt": "x", "n": 0}, 400, ["'n'"], "n"),
    ("c", {"prompt": "x", "n": 129}, 400, ["'n'", "128"], "n"),  # MAX_CHOICES
    ("c", {"prompt": "x", "best_of": 2}, 400, ["best_of"], "best_of"),
    ("c", {"prompt": "x", "best_of": 3}, 400, ["best_of"], "best_of"),
    ("c", {"prompt": "x", "logprobs": 21}, 400, ["logprobs", "20"], "logprobs"),
    # 0 still asks for the sampled token's logprob (OpenAI, vLLM): not "off"
    ("c", {"prompt": "x", "logprobs": True}, 400, ["logprobs"], "logprobs"),
    ("c", {"prompt": "x", "top_logprobs": 2}, 400, ["top_logprobs"], "top_logprobs"),
    # OpenAI and vLLM refuse stream_options without streaming
    ("c", {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     ["only allowed when 'stream' is true"], "stream_options"),
    # prompt logprobs, echo, min_tokens (issue 58): bad values and combinations name the field
    ("c", {"prompt": "x", "prompt_logprobs": 21}, 400, ["prompt_logprobs", "20"],
     "prompt_logprobs"),
    ("c", {"prompt": "x", "prompt_logprobs": -1}, 400, ["prompt_logprobs"], "prompt_logprobs"),
    ("c", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, 400, ["'stream'"],
     "prompt_logprobs"),
    ("m", {"messages": MSGS, "prompt_logprobs": 0, "stream": True}, 400, ["'stream'"],
     "prompt_logprobs"),
    ("m", {"messages": MSGS, "prompt_logprobs": 21}, 400, ["20"], "prompt_logprobs"),
    ("c", {"prompt": "x", "echo": 1}, 400, ["echo"], "echo"),
    ("m", {"messages": MSGS, "echo": True}, 400, ["echo"], "echo"),  # a completions field
    ("c", {"prompt": "x", "max_tokens": 0}, 400, ["at least 1", "echo"], "max_tokens"),
    ("m", {"messages": MSGS, "max_completion_tokens": 0}, 400, ["at least 1"],
     "max_completion_tokens"),
    ("c", {"prompt": "x", "min_tokens": 5, "max_tokens": 4}, 400, ["min_tokens", "(4)"],
     "min_tokens"),
    ("c", {"prompt": "x", "min_tokens": -1}, 400, ["min_tokens"], "min_tokens"),
    ("c", {"prompt": "x", "min_tokens": MAX_LEN}, 400, ["min_tokens", f"({MAX_LEN - 1}"],
     "min_tokens"),
    ("m", {"messages": MSGS, "min_tokens": 3, "max_completion_tokens": 2}, 400,
     ["min_tokens", "'max_completion_tokens' (2)"], "min_tokens"),
    ("c", {"prompt": "x", "suffix": "end"}, 400, ["suffix"], "suffix"),
    ("c", {"prompt": "x", "logit_bias": {"a": 5}}, 400, ["token ids"], "logit_bias"),
    ("c", {"prompt": "x", "logit_bias": {"9" * 5000: 5}}, 400, ["token ids"], "logit_bias"),
    ("c", {"prompt": "x", "logit_bias": {"1": 101}}, 400, ["[-100, 100]"], "logit_bias"),
    ("c", {"prompt": "x", "logit_bias": {"1": True}}, 400, ["logit_bias"], "logit_bias.1"),
    ("c", {"prompt": "x", "logit_bias": {"99999": 1}}, 400, ["outside the vocabulary"],
     "logit_bias"),
    ("m", {"messages": MSGS, "logit_bias": {str(i): 1 for i in range(1025)}}, 400,
     ["at most 1024"], "logit_bias"),
    ("m", {"messages": MSGS, "logprobs": 1}, 400, ["logprobs"], "logprobs"),
    ("m", {"messages": MSGS, "top_logprobs": 3}, 400, ["needs 'logprobs'"], "top_logprobs"),
    ("m", {"messages": MSGS, "logprobs": True, "top_logprobs": 21}, 400, ["20"],
     "top_logprobs"),
    # tools are a chat parameter (tests/test_tool_calls.py); completions refuse them
    ("c", {"prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     ["tools"], "tools"),
    ("c", {"prompt": "x", "tool_choice": "auto"}, 400, ["tool_choice"], "tool_choice"),
    ("m", {"messages": MSGS, "tool_choice": "required"}, 400,
     ["'required'", "needs tools"], "tool_choice"),
    ("m", {"messages": MSGS, "tool_choice": {"type": "function", "function": {"name": "f"}}},
     400, ["needs tools"], "tool_choice"),
    ("m", {"messages": MSGS, "tool_choice": 5}, 400, ["not valid", "'required'"],
     "tool_choice"),
    ("m", {"messages": MSGS, "tool_choice": {"type": "function", "name": "f"}}, 400,
     ["not valid"], "tool_choice"),
    ("m", {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f"}}],
           "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400,
     ["'g'", "not among tools"], "tool_choice"),
    ("m", {"messages": MSGS, "tools": {"type": "function"}}, 400, ["tools"], "tools"),
    ("m", {"messages": MSGS, "tools": [{"type": "code", "function": {"name": "f"}}]}, 400,
     ["tools[0].type", "function"], "tools[0].type"),
    ("m", {"messages": MSGS, "tools": [{"type": "function"}]}, 400, ["tools[0].function"],
     "tools[0].function"),
    ("m", {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "a>b"}}]},
     400, ["without whitespace, '<' or '>'"], "tools[0].function.name"),
    ("m", {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f",
                                                                         "parameters": "x"}}]},
     400, ["parameters"], "tools[0].function.parameters"),
    ("m", {"messages": MSGS, "functions": [{"name": "f"}]}, 400, ["functions"], "functions"),
    (
        "m",
        {"messages": MSGS, "response_format": {"type": "json_schema"}},
        400,
        ["json_schema"],
        "response_format",
    ),
    ("m", {"messages": MSGS, "n": True}, 400, ["'n'"], "n"),
    (
        "m",
        {"messages": MSGS, "chat_template_kwargs": {"tools": 1}},
        400,
        ["'tools'", "own field"],
        "chat_template_kwargs",
    ),
    ("c", {"prompt": "SAY:REJECT"}, 400, ["rejected by the engine"], "prompt"),
]


@pytest.mark.parametrize("path,body,status,needles,param", BAD_REQUESTS)
def test_bad_requests_get_openai_errors(srv, path, body, status, needles, param):
    client, engine, _ = srv
    url = "/v1/chat/completions" if path == "m" else "/v1/completions"
    if isinstance(body, bytes):
        r = client.post(url, content=body, headers={"content-type": "application/json"})
    else:
        r = client.post(url, json=body)
    err = assert_openai_error(r, status, *needles)
    assert err["param"] == param
    assert err["type"] == "invalid_request_error"
    assert not engine.reqs  # nothing leaked into the engine
    # the server still answers a good request afterwards
    ok = completion(client, prompt="SAY:fine")
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "fine"


# ---- hostile input (regressions) ------------------------------------------------------------


def post_raw(client, path: str, body: dict | bytes, **headers):
    """POST a body that httpx's json= cannot send (lone surrogates): json.dumps escapes them."""
    url = "/v1/chat/completions" if path == "m" else "/v1/completions"
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(
        url, content=content, headers={"content-type": "application/json", **headers}
    )


LONE = "a\ud800b"
SURROGATE_CASES = [
    ("c", {"prompt": LONE}, "prompt"),
    ("c", {"prompt": "x", "stop": [LONE]}, "stop[0]"),
    ("c", {"prompt": "x", "model": LONE}, "model"),
    ("m", {"messages": [{"role": "user", "content": LONE}]}, "messages[0].content"),
    (
        "m",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
        "messages[0].content[0].text",
    ),
    (
        "m",
        {"messages": [MSGS[0], {"role": "assistant", "content": "", "reasoning_content": LONE}]},
        "messages[1].reasoning_content",
    ),
    (
        "m",
        {
            "messages": [
                MSGS[0],
                {
                    "role": "assistant",
                    "tool_calls": [{"type": "function", "function": {"name": LONE}}],
                },
            ]
        },
        "messages[1].tool_calls[0].function.name",
    ),
    ("m", {"messages": [{"role": "user", "content": "x", "name": LONE}]}, "messages[0].name"),
]


@pytest.mark.parametrize("path,body,field", SURROGATE_CASES)
def test_lone_surrogates_are_400_naming_the_field(srv, path, body, field):
    client, engine, _ = srv
    r = post_raw(client, path, body)
    err = assert_openai_error(r, 400, f"invalid '{field}': contains a lone surrogate")
    assert err["param"] == field
    r.content.decode("utf-8")  # the error body is valid UTF-8
    assert not engine.reqs
    assert completion(client, prompt="SAY:fine").json()["choices"][0]["text"] == "fine"


@pytest.mark.parametrize(
    "raw,ok",
    [
        (rb'"SAY:ok \ud83d\ude00"', True),  # an escaped pair is one code point: fine
        (rb'"SAY:ok \\ud800"', True),  # an escaped backslash: the text "\ud800"
        (rb'"SAY:ok \\\ud800"', False),  # backslash, then a lone surrogate
        (rb'"SAY:ok \ud83d\\ude00"', False),
        (rb'"SAY:ok \ude00\ud83d"', False),  # wrong order
        (rb'"SAY:ok \ud83d\ud83d\ude00"', False),  # the first high one is lone
        (rb'"SAY:ok \ud83d\ude00\ude00"', False),  # the last low one is lone
        (b'"SAY:ok \xed\xa0\x80"', False),  # a UTF-8-encoded surrogate is not UTF-8
    ],
)
def test_surrogate_detection_is_exact(srv, raw, ok):
    client, engine, _ = srv
    r = post_raw(client, "c", b'{"max_tokens": 64, "prompt": ' + raw + b"}")
    if ok:
        assert r.status_code == 200, r.text
        (ids,) = engine.prompts.values()
        assert ids == list(json.loads(raw).encode())
    else:
        assert_openai_error(r, 400, "malformed JSON" if b"\xed" in raw else "lone surrogate")


def test_utf16_body_still_accepted_and_checked(srv):
    client, engine, _ = srv
    body = json.dumps({"prompt": "SAY:hé", "max_tokens": 8}, ensure_ascii=False)
    r = post_raw(client, "c", body.encode("utf-16"))
    assert r.status_code == 200, r.text
    assert list(engine.prompts.values()) == [list("SAY:hé".encode())]
    r = post_raw(client, "c", json.dumps({"prompt": "x\ud800"}).encode("utf-16-le"))
    assert_openai_error(r, 400, "invalid 'prompt': contains a lone surrogate")


def test_lone_surrogate_in_a_huge_body_gets_a_generic_message(srv):
    client, _, _ = srv
    # the walk that names the field gives up after 100k containers
    body = {"prompt": "x", "metadata": [{"a": "\ud800"}] + [{}] * 200_000}
    err = assert_openai_error(post_raw(client, "c", body), 400, "lone surrogate", "'\\\\ud800'")
    assert err["param"] is None


def test_lone_surrogate_in_tool_call_arguments_string(srv):
    client, _, _ = srv
    call = {"type": "function", "function": {"name": "f", "arguments": '{"a": "\\ud800"}'}}
    msgs = [MSGS[0], {"role": "assistant", "tool_calls": [call]}]
    err = assert_openai_error(post_raw(client, "m", {"messages": msgs}), 400, "lone surrogate")
    assert err["param"] == "messages[1].tool_calls"


def test_encode_time_valueerror_is_400(srv):
    """Backstop: text the tokenizer refuses (ValueError) is a 400 naming the field, not a 500."""
    client, _, tok = srv

    def refuse(text):
        raise ValueError("text contains a lone surrogate")

    tok.encode = refuse
    err = assert_openai_error(completion(client, prompt="x"), 400, "invalid 'prompt'", "surrogate")
    assert err["param"] == "prompt"
    err = assert_openai_error(chat(client, "x"), 400, "invalid 'messages'")
    assert err["param"] == "messages"


def test_error_response_always_renders():
    from tailored.server.errors import OpenAIError
    from tailored.server.http_io import error_response

    err = OpenAIError("model `\ud800` " + "x" * 10_000, status=404, param="a\udfff")
    resp = error_response(err)
    body = json.loads(bytes(resp.body).decode("ascii"))
    assert body["error"]["message"].startswith("model `\\ud800` ")
    assert len(body["error"]["message"]) <= 2000
    assert body["error"]["param"] == "a\\udfff"


def test_unknown_model_names_are_shown_escaped_and_short(srv):
    client, _, _ = srv
    err = assert_openai_error(client.get("/v1/models/" + "m" * 5000), 404, "mmm")
    assert len(err["message"]) < 300
    err = assert_openai_error(completion(client, prompt="x", model="y" * 5000), 404, "yyy")
    assert len(err["message"]) < 300


def test_json_too_deep_ignores_brackets_in_strings():
    from tailored.server.json_screen import MAX_JSON_DEPTH, json_too_deep

    def deep(n: int) -> bytes:
        return b"[" * n + b"]" * n

    assert not json_too_deep(deep(MAX_JSON_DEPTH)) and json_too_deep(deep(MAX_JSON_DEPTH + 1))
    brackets_in_strings = json.dumps({"a": ["[" * 500, '\\"[{' * 100, '\\"' + "{" * 100]})
    assert not json_too_deep(brackets_in_strings.encode())
    wrapped = b'{"s": "]]]]\\"]]]", "x": ' + deep(MAX_JSON_DEPTH) + b"}"
    assert json_too_deep(wrapped)


def test_deeply_nested_json_is_400(srv):
    client, _, _ = srv
    for body in (b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 100_000 + b"1" + b"}" * 100_000):
        assert_openai_error(
            post_raw(client, "c", body), 400, "malformed JSON body: nested too deeply"
        )
    nested: list = []
    for _ in range(100):  # parses fine, but deeper than MAX_JSON_DEPTH
        nested = [nested]
    r = post_raw(client, "c", {"prompt": "x", "metadata": nested})
    assert_openai_error(r, 400, "nested too deeply")
    assert completion(client, prompt="SAY:fine").json()["choices"][0]["text"] == "fine"


TOOL_CALLS_BAD = [
    (5, "must be a list"),
    (True, "must be a list"),
    (1.5, "must be a list"),
    ("abc", "must be a list"),
    ({"a": 1}, "must be a list"),
    ([None], "item 0 must be an object"),
    ([{"function": "x"}], "item 0: 'function' must be an object"),
    ([{"type": "function"}], "'function' must be an object"),
    ([{"type": "code", "function": {"name": "f"}}], "'type' must be 'function'"),
    ([{"function": {"arguments": "{}"}}], "'function.name' must be a non-empty string"),
    ([{"function": {"name": 5}}], "'function.name' must be a non-empty string"),
    ([{"function": {"name": "f", "arguments": 5}}], "'function.arguments' must be"),
    ([{"function": {"name": "f", "arguments": "{nope"}}], "not valid JSON"),
    ([{"function": {"name": "f", "arguments": "[1]"}}], "must encode a JSON object"),
    ([{"id": 7, "function": {"name": "f"}}], "'id' must be a string"),
]


@pytest.mark.parametrize("tool_calls,needle", TOOL_CALLS_BAD)
def test_bad_tool_calls_are_400_naming_the_field(srv, tool_calls, needle):
    client, engine, _ = srv
    msgs = [MSGS[0], {"role": "assistant", "content": None, "tool_calls": tool_calls}]
    err = assert_openai_error(chat(client, messages=msgs), 400, "messages[1].tool_calls", needle)
    assert err["param"] == "messages[1].tool_calls"
    assert not engine.reqs


def test_good_tool_calls_reach_the_template(srv):
    client, _, tok = srv
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
        {"function": {"name": "g", "arguments": {"y": [1, 2]}}},
        {"type": "function", "function": {"name": "h", "arguments": ""}},
    ]
    msgs = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "content": "r"},
        {"role": "user", "content": "SAY:ok"},
    ]
    r = chat(client, messages=msgs)
    assert r.status_code == 200, r.text
    assert tok.template_calls[-1]["messages"][1]["tool_calls"] == calls
    for empty in (None, []):
        msgs[1]["tool_calls"] = empty
        assert chat(client, messages=msgs).status_code == 200


def test_prompt_text_longer_than_the_context_can_hold_is_refused_before_encoding(srv):
    from tailored.server.serving import MAX_CHARS_PER_TOKEN

    client, _, tok = srv
    limit = MAX_LEN * MAX_CHARS_PER_TOKEN
    calls = []
    encode = tok.encode
    tok.encode = lambda text: calls.append(len(text)) or encode(text)
    err = assert_openai_error(
        completion(client, prompt="x" * (limit + 1)), 400, "too long", f"{MAX_LEN} tokens"
    )
    assert err["param"] == "prompt" and err["code"] == "context_length_exceeded"
    err = assert_openai_error(chat(client, "y" * (limit + 1)), 400, "too long")
    assert err["param"] == "messages" and err["code"] == "context_length_exceeded"
    assert calls == []  # the tokenizer never saw the text
    # below the character bound the usual token check applies
    err = assert_openai_error(completion(client, prompt="x" * limit), 400, "maximum context length")
    assert calls == [limit]


def test_request_body_size_cap():
    app, _, engine, _ = make_app(max_body_bytes=1000)
    with TestClient(app) as client:
        big = {"model": MODEL, "prompt": "x" * 2000}
        err = assert_openai_error(post_raw(client, "c", big), 413, "too large")
        assert err["code"] == "request_too_large"

        def chunks():  # no content-length: the cap applies while reading
            for _ in range(10):
                yield b" " * 200
            yield json.dumps({"prompt": "SAY:x"}).encode()

        r = client.post(
            "/v1/completions", content=chunks(), headers={"content-type": "application/json"}
        )
        assert_openai_error(r, 413, "too large")
        assert not engine.reqs
        ok = completion(client, prompt="SAY:fine")
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "fine"


def test_a_compressed_body_is_a_415_naming_its_encoding():
    import gzip

    app, _, engine, _ = make_app()
    with TestClient(app) as client:
        body = gzip.compress(json.dumps({"model": MODEL, "prompt": "SAY:x"}).encode())
        err = assert_openai_error(post_raw(client, "c", body, **{"content-encoding": "gzip"}),
                                  415, "'gzip' is not supported")
        assert err["code"] == "unsupported_media_type" and not engine.reqs
        ok = post_raw(client, "c", {"model": MODEL, "prompt": "SAY:fine"},
                      **{"content-encoding": "identity"})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "fine"


def test_default_body_cap_scales_with_the_context():
    """Without max_body_bytes the cap is 256 bytes a token of max_model_len, 2 to 32 MiB
    (session 26: a 27 MB body of 2.2M unknown keys held the event loop, and every stream, for
    2.4 s of parsing under the old fixed 32 MiB): 2 MiB at this test's small context, 4 MiB at
    16k, 32 MiB from 128k; one byte over gets 413 before any parsing."""
    from tailored.server.http_io import default_max_body_bytes

    assert default_max_body_bytes(MAX_LEN) == 2 * 2**20
    assert default_max_body_bytes(16384) == 4 * 2**20
    assert default_max_body_bytes(262144) == 32 * 2**20  # the ceiling (the old fixed cap)
    app, _, engine, _ = make_app()
    with TestClient(app) as client:
        pad = 2 * 2**20 - len(json.dumps({"model": MODEL, "prompt": "SAY:x", "k": ""}))
        body = json.dumps({"model": MODEL, "prompt": "SAY:x", "k": " " * (pad + 1)})
        r = client.post("/v1/completions", content=body,
                        headers={"content-type": "application/json"})
        assert_openai_error(r, 413, "too large")
        assert not engine.reqs


@pytest.mark.parametrize(
    "body,status,needle",
    [
        ({"repetition_penalty": 1e-50}, 400, "repetition_penalty"),
        ({"repetition_penalty": 0.009}, 400, "repetition_penalty"),
        ({"repetition_penalty": 101}, 400, "repetition_penalty"),
        ({"repetition_penalty": 0.01}, 200, None),
        ({"repetition_penalty": 100}, 200, None),
        ({"temperature": 1e-45}, 200, None),
        ({"top_p": 1e-300}, 200, None),
    ],
)
def test_sampling_value_ranges(srv, body, status, needle):
    client, engine, _ = srv
    r = completion(client, prompt="SAY:ok", **body)
    if status == 200:
        assert r.status_code == 200, r.text
        (sp,) = engine.added.values()
        assert {k: getattr(sp, k) for k in body} == body
    else:
        err = assert_openai_error(r, status, needle)
        assert err["param"] == needle


def test_stop_token_ids_are_capped(srv):
    client, _, _ = srv
    from tailored.server.protocol import MAX_STOP_TOKEN_IDS

    ids = [1] * (MAX_STOP_TOKEN_IDS + 1)
    err = assert_openai_error(completion(client, prompt="x", stop_token_ids=ids), 400, "at most")
    assert err["param"] == "stop_token_ids"
    r = completion(client, prompt="x" * 1000, stop_token_ids=[5] * 1_000_000, max_tokens=1)
    err = assert_openai_error(r, 400, "at most 1024 stop token ids", "1000000")
    r = completion(client, prompt="SAY:ok", stop_token_ids=ids[:-1])
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "part,needle",
    [
        ({"type": "text", "text": 5}, "content part 0: 'text' must be a string (got 5)"),
        ({"type": "text"}, "content part 0: 'text' must be a string (missing)"),
        ({"type": "text", "text": None}, "'text' must be a string"),
    ],
)
def test_text_content_part_without_string_text(srv, part, needle):
    client, _, _ = srv
    msgs = [{"role": "user", "content": [{"type": "text", "text": "ok"}, part]}]
    err = assert_openai_error(chat(client, messages=msgs), 400, needle.replace("part 0", "part 1"))
    assert err["param"] == "messages[0].content"


def test_real_tokenizer_refuses_lone_surrogates_and_bad_text_parts():
    from tailored.tokenizer import load_tokenizer

    tok = load_tokenizer(None)  # tiktoken backend (the HF one shares the check)
    with pytest.raises(ValueError, match="lone surrogate"):
        tok.encode("a\ud800")
    assert tok.encode("a\U0001f600") == tok.encode("a😀")
    for part in ({"type": "text", "text": 5}, {"type": "text"}):
        with pytest.raises(ValueError, match="'text' must be a string"):
            tok.apply_chat_template([{"role": "user", "content": [part]}])
    with pytest.raises(ValueError, match="unsupported content part type 'image_url'"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url"}]}])


def test_hf_tokenizer_long_text_and_lone_surrogate(tmp_path):
    """Long texts go through encode_batch (releases the GIL) with the same ids as encode."""
    from tailored import tokenizer as tk

    hf = tk.load_tokenizer(tk.write_tokenizer_files(tmp_path))
    assert hf.backend == "hf"
    text = "Hello, world! <|im_start|>user\n" * (tk._ENCODE_BATCH_MIN_CHARS // 8)
    assert len(text) >= tk._ENCODE_BATCH_MIN_CHARS
    want = hf._hf.encode(text, add_special_tokens=False).ids
    assert hf.encode(text) == want
    assert hf.encode(text, allow_special=False) == tk.load_tokenizer(None).encode(
        text, allow_special=False
    )
    with pytest.raises(ValueError, match="lone surrogate"):
        hf.encode("x" * tk._ENCODE_BATCH_MIN_CHARS + "\udc00")


def test_unknown_route_and_wrong_method(srv):
    client, _, _ = srv
    err = assert_openai_error(client.get("/v1/nope"), 404, "/v1/nope")
    assert err["code"] == "not_found"
    err = assert_openai_error(client.get("/v1/completions"), 405, "GET")
    assert err["code"] == "method_not_allowed"
    assert completion(client, prompt="SAY:a").status_code == 200


def test_unexpected_exception_is_500_and_server_survives(srv):
    client, _, _ = srv
    err = assert_openai_error(completion(client, prompt="BOOM"), 500, "tokenizer exploded")
    assert err["type"] == "server_error"
    assert completion(client, prompt="SAY:alive").json()["choices"][0]["text"] == "alive"


def test_engine_request_error(srv):
    client, _, _ = srv
    err = assert_openai_error(completion(client, prompt="SAY:FAIL"), 500, "fake engine failure")
    assert err["type"] == "server_error"
    events = sse_events(chat(client, "SAY:FAIL", stream=True).text)
    assert events[-1] == "DONE"
    assert "fake engine failure" in events[-2]["error"]["message"]
    assert client.get("/health").status_code == 200


def test_engine_death_fails_pending_and_health_503():
    app, aengine, _, _ = make_app(delay_s=0.01)
    with TestClient(app) as client:
        err = assert_openai_error(completion(client, prompt="SAY:CRASH"), 500, "engine loop died")
        assert err["type"] == "server_error"
        health = client.get("/health")
        assert health.status_code == 503 and "fake engine crashed" in health.json()["message"]
        err = assert_openai_error(completion(client, prompt="SAY:a"), 503, "engine unavailable")
        assert not aengine.healthy
        # a dead server must not advertise its model to load generators and routers
        for path in ("/v1/models", f"/v1/models/{MODEL}", "/v1/models/other"):
            err = assert_openai_error(client.get(path), 503, "fake engine crashed")
            assert err["type"] == "service_unavailable"


# ---- concurrency and abort ---------------------------------------------------------------


def test_concurrent_requests_get_their_own_text():
    asyncio.run(_concurrent_requests())


async def _concurrent_requests():
    app, aengine, engine, _ = make_app(delay_s=0.001)
    aengine.start()
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:

            async def one(i: int):
                if i % 2:
                    r = await client.post(
                        "/v1/chat/completions",
                        json={
                            "messages": [{"role": "user", "content": f"SAY:answer-{i}"}],
                            "stream": i % 4 == 1,
                        },
                    )
                    if i % 4 == 1:
                        chunks = sse_events(r.text)[:-1]
                        return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
                    return r.json()["choices"][0]["message"]["content"]
                r = await client.post("/v1/completions", json={"prompt": f"SAY:answer-{i}"})
                return r.json()["choices"][0]["text"]

            results = await asyncio.gather(*(one(i) for i in range(24)))
        assert results == [f"answer-{i}" for i in range(24)]
        assert len(engine.threads) == 1  # every engine call ran on the engine thread
        assert threading.get_ident() not in engine.threads
    finally:
        aengine.shutdown()


def test_async_engine_generate_abort_and_errors():
    asyncio.run(_async_engine_generate_abort_and_errors())


async def _async_engine_generate_abort_and_errors():
    engine = FakeEngine(delay_s=0.002)
    aengine = AsyncEngine(engine)
    with pytest.raises(EngineDeadError):
        await aengine.generate("early", [1], SamplingParams())
    aengine.start()
    try:
        # ValueError from add_request surfaces before any output
        with pytest.raises(ValueError, match="rejected"):
            await aengine.generate("bad", list(b"REJECT"), SamplingParams())
        # closing a stream early aborts the request in the engine
        sp = SamplingParams(max_tokens=10_000, ignore_eos=True)
        stream = await aengine.generate("long", list(b"SAY:abc"), sp)
        got = [await anext(stream) for _ in range(3)]
        assert "".join(o.delta_text for o in got) == "abc"
        await stream.aclose()
        deadline = time.monotonic() + 10.0  # generous: a loaded 2-core CI machine (was 1 s)
        while "long" not in engine.aborted and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        assert engine.aborted == ["long"] and not engine.reqs
        # the one-shot iteration form works too and ends with a finished output
        outs = [o async for o in aengine.generate("short", list(b"SAY:hi"), SamplingParams())]
        assert outs[-1].finished and outs[-1].finish_reason == FinishReason.STOP
        assert "".join(o.delta_text for o in outs) == "hi"
        assert await aengine.stats() == {"running": 0}
        # idle: the loop sleeps instead of polling has_unfinished
        await asyncio.sleep(0.2)  # the loop's last checks after stats() land before `before`
        before = engine.idle_checks
        await asyncio.sleep(0.2)
        assert engine.idle_checks - before <= 1
        assert len(engine.threads) == 1
    finally:
        aengine.shutdown()
    assert not aengine.healthy


# ---- live uvicorn server -----------------------------------------------------------------


def wait_for(cond, timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_openai_client_streaming_chat_live_server():
    openai = pytest.importorskip("openai")
    app, _, _, _ = make_app(delay_s=0.001)
    with LiveServer(app) as live:
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == [MODEL]
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "SAY:Hello from tailored"}],
            stream=True,
            stream_options={"include_usage": True},
            max_tokens=100,
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == "Hello from tailored"
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
        assert chunks[-1].usage.completion_tokens == len(text) + 1
        with pytest.raises(openai.BadRequestError, match="temperature"):
            client.chat.completions.create(model=MODEL, messages=MSGS, temperature=5)
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="nope", messages=MSGS)


def test_client_disconnect_aborts_live_server():
    app, _, engine, _ = make_app(delay_s=0.005, disconnect_poll_s=0.02)
    body = {"prompt": "SAY:abc", "ignore_eos": True, "max_tokens": 400}
    with LiveServer(app) as live, httpx.Client(base_url=live.url) as client:
        # streaming: read a few events, then close the connection
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            lines = r.iter_lines()
            first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
        rid = first["id"]
        assert wait_for(lambda: rid in engine.aborted), "stream abort did not reach the engine"
        # non-streaming: the client gives up (timeout) while the server is still generating
        with pytest.raises(httpx.ReadTimeout):
            client.post("/v1/completions", json=body, timeout=0.3)
        assert wait_for(lambda: len(engine.aborted) == 2), "disconnect abort did not reach engine"
        assert not engine.reqs
        ok = client.post("/v1/completions", json={"prompt": "SAY:ok"})
        assert ok.json()["choices"][0]["text"] == "ok"


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("include_usage", [False, True])
def test_stream_chunk_template_equals_the_models(chat, include_usage):
    """Formatter.chunk fills a template for text-only chunks (answer text, and chat reasoning
    text with --reasoning-parser); it must say what the pydantic models say (JSON-equal, same
    keys in the same order), for any text."""
    import json as _json

    from tailored.server.formatter import Formatter

    f = Formatter("cmpl-x", "m", chat, 7, include_usage)
    for text in ["hi", 'q"uote\\ back\nnew\ttab\x01ctl', "é中文😀", "@@tailored-text@@", " "]:
        pairs = [(f.chunk(text, None), f._render(text, "", None))]
        if chat:  # a reasoning delta
            pairs.append((f.chunk("", None, text), f._render("", text, None)))
        for fast, slow in pairs:
            assert fast.startswith("data: ") and fast.endswith("\n\n")
            a, b = _json.loads(fast[6:]), _json.loads(slow[6:])
            a.pop("created"), b.pop("created")
            assert list(a) == list(b) and a == b
    if chat:
        d = _json.loads(f.chunk("", None, "why")[6:])["choices"][0]["delta"]
        assert d == {"reasoning": "why", "reasoning_content": "why"}
        d = _json.loads(f.chunk("so", "stop", "why")[6:])["choices"][0]
        assert d["delta"] == {"content": "so", "reasoning": "why", "reasoning_content": "why"}
    assert _json.loads(f.chunk("", "stop")[6:])["choices"][0]["finish_reason"] == "stop"
    # a model named like the placeholder: the template is not unique, the models render
    g = Formatter("cmpl-y", "@@tailored-text@@", chat, 7, include_usage)
    assert _json.loads(g.chunk("ok", None)[6:])["model"] == "@@tailored-text@@"
    assert g._templates["content"] == []


def test_chat_messages_that_cannot_fit_are_refused_before_validation(srv):
    """Review of session 10: 300k one-character messages (9 MB, under the body limit) took
    ~2 s of the event loop in validation and templating before the length check, stalling
    every stream. Too many messages, or too many content characters summed over messages,
    are refused on the raw JSON; the template never runs."""
    from tailored.server.serving import MAX_CHARS_PER_TOKEN, MIN_TOKENS_PER_MESSAGE

    client, _, tok = srv
    n_before = len(tok.template_calls)
    many = [{"role": "user", "content": "x"}] * (MAX_LEN // MIN_TOKENS_PER_MESSAGE + 1)
    err = assert_openai_error(chat(client, messages=many), 400, "messages cannot fit")
    assert err["param"] == "messages" and err["code"] == "context_length_exceeded"
    part = "z" * (MAX_LEN * MAX_CHARS_PER_TOKEN // 2 + 1)
    two = [{"role": "user", "content": part},
           {"role": "user", "content": [{"type": "text", "text": part}]}]
    err = assert_openai_error(chat(client, messages=two), 400, "too long")
    assert err["code"] == "context_length_exceeded"
    assert len(tok.template_calls) == n_before
    ok = [{"role": "user", "content": "x"}] * 8
    assert chat(client, messages=ok).status_code == 200


def test_long_stop_strings_and_contentless_messages_are_refused(srv):
    """New-user trial (session 12): 8 MB stop strings were accepted and slowed every token of
    the request; a user message without content was rendered as empty. Both are 400s now,
    while an assistant message may still carry only tool calls."""
    client, _, _ = srv
    from tailored.server.protocol import MAX_STOP_STRING_CHARS

    r = completion(client, prompt="x", stop=["s" * (MAX_STOP_STRING_CHARS + 1)])
    err = assert_openai_error(r, 400, f"at most {MAX_STOP_STRING_CHARS} characters")
    assert err["param"] == "stop"
    r = completion(client, prompt="SAY:ok", stop=["s" * MAX_STOP_STRING_CHARS], max_tokens=2)
    assert r.status_code == 200, r.text
    for role in ("user", "system", "tool"):
        r = client.post("/v1/chat/completions", json={"messages": [{"role": role}],
                                                      "max_tokens": 2})
        assert_openai_error(r, 400, f"a {role} message needs 'content'")


def test_body_cut_short_is_a_client_disconnect_not_an_error(srv, caplog):
    """A client that leaves before sending its declared body: no 'unexpected error' log, no
    traceback (starlette's ClientDisconnect is the client's doing)."""
    import asyncio

    client, _, _ = srv
    app = client.app
    sent = []

    async def receive():
        return {"type": "http.disconnect"}

    async def send(msg):
        sent.append(msg)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "server": ("test", 80), "client": ("c", 1),
             "headers": [(b"content-type", b"application/json"), (b"content-length", b"1000")]}
    with caplog.at_level("INFO", logger="tailored.server.serving"):
        asyncio.run(app(scope, receive, send))
    assert "unexpected error" not in caplog.text
    assert "client left before sending the whole body" in caplog.text


def test_version_names_the_package_and_every_switch(srv):
    """GET /version (gateways and `tailored bench`'s manifest read it): the package version
    and the whole switch record the server runs with."""
    from tailored import flags

    client, _, _ = srv
    r = client.get("/version")
    assert r.status_code == 200
    body = r.json()
    assert body["version"] and body["switches"] == flags.current().snapshot()
