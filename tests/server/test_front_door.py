"""The front door (server/guard.py, serve_options.py): API keys on every route but the exempt
ones, OpenAI's 401 (Anthropic's on the Messages routes), keys from flags, a file and the
environment compared in constant time; the Host allow-list against DNS rebinding; 415 for
non-JSON bodies; every chat_template_kwargs key reaching the template; continuous usage
stats. Fake engine and tokenizer: a few seconds."""

from __future__ import annotations

import argparse

import pytest
from fastapi.testclient import TestClient
from test_server import (MAX_LEN, MODEL, FakeEngine, FakeTokenizer, assert_openai_error, chat,
                         make_app, sse_events)

from tailored import flags
from tailored.server.app import build_app
from tailored.server.async_engine import AsyncEngine
from tailored.server import guard
from tailored.server.guard import AccessPolicy
from tailored.server.serve_options import (access_policy, add_front_door_options,
                                           allowed_hosts, exempt_paths, read_keys)

KEYS = ("key-one", "key-two")
MSG = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "SAY:hi"}]}


def client_for(access: AccessPolicy | None, base_url: str = "http://testserver"):
    app, *_ = make_app(access=access)
    return TestClient(app, base_url=base_url)


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_every_route_needs_a_key_but_the_exempt_ones():
    with client_for(AccessPolicy(api_keys=KEYS)) as c:
        for method, path, body in [("post", "/v1/completions", {"prompt": "SAY:x"}),
                                   ("post", "/v1/chat/completions", MSG),
                                   ("post", "/v1/responses", {"input": "x"}),
                                   ("get", "/v1/models", None), ("get", "/v1/loads", None),
                                   ("post", "/tokenize", {"prompt": "x"}),
                                   ("post", "/flush_cache", None),
                                   ("get", "/no/such/route", None)]:  # not a 404: no hints
            r = c.request(method, path, json=body)
            err = assert_openai_error(r, 401, "Missing API key", "Authorization: Bearer")
            assert err["code"] == "invalid_api_key", path
            assert r.headers["www-authenticate"] == "Bearer"
        wrong = c.post("/v1/completions", json={"prompt": "SAY:x"},
                       headers=bearer("key-three"))
        assert_openai_error(wrong, 401, "Incorrect API key")
        # OpenAI SDKs send the key as a bearer token; either key works
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": "SAY:ok", "max_tokens": 4},
                   headers=bearer("key-two"))
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok"
        assert c.get("/v1/models", headers=bearer("key-one")).status_code == 200
        # x-api-key is the Messages routes' header, not OpenAI's
        r = c.post("/v1/completions", json={"prompt": "SAY:x"}, headers={"x-api-key": KEYS[0]})
        assert r.status_code == 401
        # exempt by default: probes and scrapers carry no key
        for path in ("/health", "/metrics", "/version"):
            assert c.get(path).status_code == 200, path


def test_messages_routes_take_x_api_key_and_answer_in_anthropic_shape():
    body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "SAY:hi"}]}
    with client_for(AccessPolicy(api_keys=KEYS)) as c:
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            r = c.post(path, json=body)
            assert r.status_code == 401
            assert r.json()["type"] == "error"
            assert r.json()["error"]["type"] == "authentication_error"
            assert "x-api-key" in r.json()["error"]["message"]
        for headers in ({"x-api-key": KEYS[1]}, bearer(KEYS[0])):  # Claude Code sends either
            r = c.post("/v1/messages", json=body, headers=headers)
            assert r.status_code == 200 and r.json()["type"] == "message", r.text


def test_exempt_routes_are_configurable():
    policy = AccessPolicy(api_keys=KEYS, exempt_paths=exempt_paths("none"))
    with client_for(policy) as c:
        for path in ("/health", "/metrics", "/version", "/health_generate"):
            assert c.get(path).status_code == 401, path
            assert c.get(path, headers=bearer(KEYS[0])).status_code == 200, path
    assert exempt_paths("metrics") == frozenset({"/metrics"})
    with pytest.raises(ValueError, match="unknown 'healthz'"):
        exempt_paths("health,healthz")


def test_keys_compare_in_constant_time(monkeypatch):
    """Every configured key's digest is compared, whichever matches (or none): the time does
    not say which key, or how much of one, a guess got right."""
    calls = []
    real = guard.hmac.compare_digest
    monkeypatch.setattr(guard.hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    policy = AccessPolicy(api_keys=("a1", "b2", "c3"))
    for guess, ok in [("a1", True), ("c3", True), ("a", False), ("zz", False)]:
        calls.clear()
        assert policy.accepts(guess) is ok
        assert len(calls) == 3


def test_keys_from_flags_a_file_and_the_environment(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# the team's keys\nfile-key-1\n\n  file-key-2  \n")
    assert read_keys(["flag-key", "file-key-1"], str(f), " env-a, env-b ,") == (
        "flag-key", "file-key-1", "file-key-2", "env-a", "env-b")
    with pytest.raises(ValueError, match="--api-key-file .*: no key"):
        (tmp_path / "empty").write_text("# none\n")
        read_keys(None, str(tmp_path / "empty"), "")
    with pytest.raises(ValueError, match="--api-key-file"):
        read_keys(None, str(tmp_path / "missing"), "")
    with pytest.raises(ValueError, match="--api-key: a key must be printable ASCII"):
        read_keys(["two words"], None, "")
    # TAILORED_API_KEY is a declared switch (an unknown TAILORED_* name stops the server)
    # whose value never shows: not in /version, the manifests or the start log
    sw = flags.Flags.from_env({"TAILORED_API_KEY": "env-secret"})
    assert sw.api_key == "env-secret" and "env-secret" not in repr(sw)
    assert sw.snapshot()["TAILORED_API_KEY"] == "(set)" == sw.changed()["TAILORED_API_KEY"]
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    add_front_door_options(p)
    policy = access_policy(p.parse_args(["--api-key", "k1", "--api-key-exempt", "health"]),
                           sw.api_key)
    assert policy.api_keys == ("k1", "env-secret") and policy.exempt_paths == {
        "/health", "/health_generate"}
    assert policy.allowed_hosts == {"localhost", "127.0.0.1", "::1"}
    with pytest.raises(ValueError, match="--health-stall-timeout must be > 0"):
        access_policy(p.parse_args(["--health-stall-timeout", "0"]), "")


def test_version_hides_the_key():
    with flags.override(api_key="env-secret"), client_for(None) as c:
        assert c.get("/version").json()["switches"]["TAILORED_API_KEY"] == "(set)"


def test_host_allow_list_against_dns_rebinding():
    assert allowed_hosts("auto", "0.0.0.0") is None  # exposed: its names are not known
    assert allowed_hosts("*", "127.0.0.1") is None
    assert allowed_hosts("api.example.com,10.0.0.5", "0.0.0.0") == {"api.example.com",
                                                                    "10.0.0.5"}
    policy = AccessPolicy(allowed_hosts=allowed_hosts("auto", "127.0.0.1"))
    with client_for(policy, base_url="http://localhost:8000") as c:
        assert c.get("/health").status_code == 200
        # IP addresses are never rebound: 0.0.0.0 (curl 0.0.0.0:8000) and any other pass
        for host in ("127.0.0.1:8000", "[::1]:8000", "LOCALHOST", "localhost.", "0.0.0.0:8000",
                     "10.1.2.3"):
            assert c.get("/health", headers={"host": host}).status_code == 200, host
        # a page of evil.example whose name now points at 127.0.0.1
        for host in ("evil.example:8000", "evil.example", "localhost.evil.example"):
            r = c.post("/v1/completions", json={"prompt": "SAY:x"}, headers={"host": host})
            err = assert_openai_error(r, 400, "is not one this server answers to",
                                      "--allowed-hosts")
            assert err["code"] == "invalid_host"
        r = c.post("/v1/messages", json={"max_tokens": 4, "messages": []},
                   headers={"host": "evil.example"})
        assert r.status_code == 400 and r.json()["type"] == "error"


def test_non_json_bodies_get_415():
    with client_for(None) as c:
        # what a web page may POST anywhere without a CORS preflight
        for ctype in ("text/plain", "text/plain;charset=UTF-8",
                      "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
            r = c.post("/v1/completions", content=b'{"prompt": "SAY:x", "max_tokens": 2}',
                       headers={"content-type": ctype})
            err = assert_openai_error(r, 415, "Content-Type", "application/json")
            assert err["code"] == "unsupported_media_type"
        r = c.post("/v1/messages", content=b"{}", headers={"content-type": "text/plain"})
        assert r.status_code == 415 and r.json()["error"]["type"] == "invalid_request_error"
        # JSON, JSON with a charset, and no declared type at all are read as JSON
        for headers in ({"content-type": "application/json; charset=utf-8"},
                        {"content-type": "application/vnd.api+json"}, {}):
            r = c.post("/v1/completions", headers=headers,
                       content=b'{"prompt": "SAY:ok", "max_tokens": 4}')
            assert r.status_code == 200, (headers, r.text)


class KwargsTokenizer:
    """The fake tokenizer's template, recording every keyword it is rendered with; a
    `fail_on` keyword makes it fail as a template does."""

    def __init__(self, tok) -> None:
        self.tok, self.seen = tok, []

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def apply_chat_template(self, messages, add_generation_prompt=True, enable_thinking=True,
                            tools=None, **kwargs):
        from tailored.tokenizer import ChatTemplateError

        self.seen.append(kwargs)
        if kwargs.get("fail_on"):
            raise ChatTemplateError("chat template failed: UndefinedError: 'x' is undefined")
        return self.tok.apply_chat_template(messages, add_generation_prompt, enable_thinking,
                                            tools)


def test_every_chat_template_kwarg_reaches_the_template():
    tok = KwargsTokenizer(FakeTokenizer())
    with TestClient(build_app(AsyncEngine(FakeEngine()), tok, MODEL, MAX_LEN)) as c:
        kw = {"enable_thinking": False, "preserve_thinking": True, "custom": {"a": [1]}}
        r = chat(c, chat_template_kwargs=kw, max_tokens=4)
        assert r.status_code == 200, r.text
        assert tok.seen[-1] == {"preserve_thinking": True, "custom": {"a": [1]}}
        r = chat(c, chat_template_kwargs={"fail_on": 1}, max_tokens=4)
        err = assert_openai_error(r, 400, "chat template failed", "chat_template_kwargs",
                                  "fail_on")
        assert err["param"] == "messages"
        for key in ("messages", "tools", "add_generation_prompt"):
            r = chat(c, chat_template_kwargs={key: 1}, max_tokens=4)
            assert assert_openai_error(r, 400, "own field")["param"] == "chat_template_kwargs"
        r = chat(c, chat_template_kwargs={"enable_thinking": "no"}, max_tokens=4)
        assert_openai_error(r, 400, "enable_thinking must be a boolean")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats(path):
    body = {"model": MODEL, "max_tokens": 5, "stream": True}
    body.update({"prompt": "SAY:abcde"} if "chat" not in path else
                {"messages": [{"role": "user", "content": "SAY:abcde"}]})
    with client_for(None) as c:
        plain = sse_events(c.post(path, json={**body, "stream_options": {
            "include_usage": True}}).text)
        assert all(e["usage"] is None for e in plain[:-2])  # only the last chunk has usage
        events = sse_events(c.post(path, json={**body, "stream_options": {
            "include_usage": True, "continuous_usage_stats": True}}).text)
    assert events[-1] == "DONE"
    chunks, final = events[:-2], events[-2]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 5
    counts = [e["usage"]["completion_tokens"] for e in chunks]
    assert counts == sorted(counts) and counts[-1] == 5  # each chunk: the tokens so far
    prompt = final["usage"]["prompt_tokens"]
    assert all(e["usage"]["prompt_tokens"] == prompt and e["usage"]["total_tokens"] ==
               prompt + e["usage"]["completion_tokens"] for e in chunks)
    text = "".join(e["choices"][0].get("text") or e["choices"][0].get("delta", {}).get(
        "content") or "" for e in chunks)
    assert text == "abcde"
