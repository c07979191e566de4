"""Logprobs: the sampler's values against log_softmax on fresh logits, and through the engine
(nano model, CPU): one per generated token, aligned with the ids, cut with them by stop strings,
and never through speculative drafts."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from test_sampler import seq

import tailored
from tailored.worker.sampler import sample_on_device
from tailored.engine.types import MAX_LOGPROBS, SamplingParams
from tailored.stack import build_stack

NANO = Path(tailored.__file__).parent / "data" / "nano"

pytestmark = pytest.mark.usefixtures("one_thread")


def test_sampler_logprobs_match_log_softmax():
    torch.manual_seed(0)
    V = 37
    logits = torch.randn(5, V, dtype=torch.bfloat16) * 4
    seqs = [seq("a", logprobs=3, temperature=0.0), seq("b"), seq("c", logprobs=0, temperature=0.7),
            seq("d", logprobs=MAX_LOGPROBS, temperature=1.0, top_k=5),
            seq("e", logprobs=1, repetition_penalty=1.5, output=(1, 2))]
    s = sample_on_device(logits, seqs)
    ids = s.tolist()
    lps = s.logprobs()
    ref = logits.float().log_softmax(dim=-1)  # the raw distribution, whatever the sampling
    assert lps[1] is None
    for i in (0, 2, 3, 4):
        k = seqs[i].sampling.logprobs
        assert lps[i].logprob == pytest.approx(ref[i, ids[i]].item(), abs=1e-5)
        assert len(lps[i].top) == k
        top = ref[i].topk(k) if k else None
        if k:
            assert [t for t, _ in lps[i].top] == top.indices.tolist()
            assert [v for _, v in lps[i].top] == pytest.approx(top.values.tolist(), abs=1e-5)
    assert lps[0].top[0][0] == ids[0]  # greedy: the most likely token


def test_sampler_logprobs_of_nan_rows_stay_json_numbers():
    logits = torch.randn(2, 11)
    logits[1, 3] = float("nan")
    s = sample_on_device(logits, [seq("a", logprobs=2), seq("b", logprobs=2, temperature=0.0)])
    s.tolist()
    lp = s.logprobs()
    assert s.bad_rows == [1] and lp[1].logprob == -9999.0
    assert all(math.isfinite(v) for _, v in lp[1].top)
    assert math.isfinite(lp[0].logprob)


def test_logprobs_keep_a_request_from_drafting():
    assert SamplingParams(temperature=0.0).can_draft
    assert not SamplingParams(temperature=0.0, logprobs=0).can_draft


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def engine(request):
    # speculative decoding on: requests without logprobs draft beside those with; with async
    # scheduling the logprobs ride with ids read a step later
    return build_stack(NANO, device="cpu", dtype="float32", progress=False, kernels="off",
                       max_model_len=512, max_num_seqs=8, num_speculative_tokens=2,
                       spec_max_running=8, async_scheduling=request.param).engine


def run(engine, reqs):
    for rid, (ids, sp) in reqs.items():
        engine.add_request(rid, ids, sp)
    got: dict[str, dict] = {}
    while engine.has_unfinished():
        for o in engine.step():
            g = got.setdefault(o.request_id, {"ids": [], "lps": [], "text": "", "none": 0})
            g["ids"] += o.delta_token_ids
            g["text"] += o.delta_text
            if o.delta_logprobs is None:
                g["none"] += len(o.delta_token_ids)
            else:
                assert len(o.delta_logprobs) == len(o.delta_token_ids)
                g["lps"] += o.delta_logprobs
    return got


def test_engine_gives_one_logprob_per_token(engine):
    tok = engine.tokenizer
    p = tok.encode("def fibonacci(n):")
    got = run(engine, {
        "lp": (p, SamplingParams(temperature=0.0, max_tokens=24, logprobs=4)),
        "plain": (p, SamplingParams(temperature=0.0, max_tokens=24)),
        "sampled": (p, SamplingParams(temperature=0.8, seed=3, max_tokens=16, logprobs=0)),
    })
    lp, plain = got["lp"], got["plain"]
    assert lp["ids"] == plain["ids"]  # the same greedy tokens, drafted or not
    assert plain["none"] == len(plain["ids"]) and not plain["lps"]
    assert lp["none"] == 0 and len(lp["lps"]) == len(lp["ids"])
    for t, x in zip(lp["ids"], lp["lps"]):
        assert x.top[0] == (t, x.logprob)  # greedy: the chosen token is the most likely
        vals = [v for _, v in x.top]
        assert vals == sorted(vals, reverse=True) and len(vals) == 4
        assert sum(math.exp(v) for v in vals) <= 1 + 1e-4
    s = got["sampled"]
    assert len(s["lps"]) == len(s["ids"]) and all(x.top == () and x.logprob <= 0
                                                  for x in s["lps"])


def test_stop_string_cuts_logprobs_with_the_ids(engine):
    tok = engine.tokenizer
    p = tok.encode("def fibonacci(n):")
    full = run(engine, {"a": (p, SamplingParams(temperature=0.0, max_tokens=20, logprobs=1))})["a"]
    stop = full["text"][len(full["text"]) // 2:][:3]
    assert stop.strip()
    cut = run(engine, {"b": (p, SamplingParams(temperature=0.0, max_tokens=20, logprobs=1,
                                               stop=[stop]))})["b"]
    assert len(cut["lps"]) == len(cut["ids"]) < len(full["ids"])
    assert cut["lps"] == full["lps"][:len(cut["ids"])]


def test_engine_logit_bias_bans_a_token(engine):
    """logit_bias through the engine (beside a request that drafts): a banned token never
    comes, and its logprob (raw distribution) still reports what the model gave it."""
    p = engine.tokenizer.encode("def fibonacci(n):")
    plain = run(engine, {"p": (p, SamplingParams(temperature=0.0, max_tokens=12))})["p"]["ids"]
    banned = plain[0]
    got = run(engine, {
        "b": (p, SamplingParams(temperature=0.0, max_tokens=12, logprobs=1,
                                logit_bias={banned: -100.0})),
        "d": (p, SamplingParams(temperature=0.0, max_tokens=12)),
    })
    assert banned not in got["b"]["ids"] and got["d"]["ids"] == plain
    assert got["b"]["lps"][0].top[0][0] == banned  # the raw distribution's favourite


def test_engine_refuses_too_many_logprobs_and_non_finite_biases(engine):
    with pytest.raises(ValueError, match="logprobs"):
        engine.add_request("x", [1, 2], SamplingParams(logprobs=MAX_LOGPROBS + 1))
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request("y", [1, 2], SamplingParams(logit_bias={1: float("inf")}))


# ---- the HTTP shapes (OpenAI's), through the nano engine ---------------------------------


@pytest.fixture(scope="module")
def client():
    from fastapi.testclient import TestClient

    from tailored.server.app import build_app
    from tailored.server.async_engine import AsyncEngine

    st = build_stack(NANO, device="cpu", dtype="float32", progress=False, kernels="off",
                     max_model_len=512, max_num_seqs=8, num_speculative_tokens=2,
                     spec_max_running=8)
    with TestClient(build_app(AsyncEngine(st.engine), st.tokenizer, "nano", 512,
                              reasoning_parser="qwen3")) as c:
        yield c


def test_chat_logprobs_whole_and_streamed(client):
    from test_server import sse_events

    body = {"model": "nano", "messages": [{"role": "user", "content": "def fibonacci(n):"}],
            "max_tokens": 12, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    whole = client.post("/v1/chat/completions", json=body).json()
    content = whole["choices"][0]["logprobs"]["content"]
    assert len(content) == whole["usage"]["completion_tokens"] == 12
    for e in content:
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"}
        assert bytes(e["bytes"]).decode("utf-8", "replace") == e["token"]
        assert len(e["top_logprobs"]) == 3 and e["top_logprobs"][0]["logprob"] == e["logprob"]
    events = sse_events(client.post("/v1/chat/completions", json={**body, "stream": True}).text)
    streamed = [e for ev in events[:-1] for c in ev["choices"]
                for e in (c.get("logprobs") or {}).get("content", [])]
    assert streamed == content
    # without logprobs: null, as before
    plain = client.post("/v1/chat/completions", json={**body, "logprobs": False,
                                                     "top_logprobs": 0}).json()
    assert plain["choices"][0]["logprobs"] is None


def test_completion_logprobs_legacy_shape(client):
    from test_server import sse_events

    body = {"model": "nano", "prompt": "def fibonacci(n):", "max_tokens": 8, "temperature": 0,
            "logprobs": 2}
    whole = client.post("/v1/completions", json=body).json()
    lp = whole["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 8
    assert "".join(lp["tokens"]) == whole["choices"][0]["text"]
    assert lp["text_offset"][0] == 0 and all(
        b - a == len(t) for a, b, t in zip(lp["text_offset"], lp["text_offset"][1:],
                                          lp["tokens"]))
    assert all(tok in top and 1 <= len(top) <= 3 for tok, top in zip(lp["tokens"],
                                                                       lp["top_logprobs"]))
    events = sse_events(client.post("/v1/completions", json={**body, "stream": True}).text)
    pieces = [c["logprobs"] for ev in events[:-1] for c in ev["choices"] if c["logprobs"]]
    assert sum((p["tokens"] for p in pieces), []) == lp["tokens"]
    assert sum((p["text_offset"] for p in pieces), []) == lp["text_offset"]
    assert sum((p["token_logprobs"] for p in pieces), []) == lp["token_logprobs"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_engine_logprobs_on_the_gpu_beside_graphs_and_drafts():
    """The device path: pinned host copies behind the ids' event, async scheduling, the decode
    and verify CUDA graphs replayed for the requests that draft beside those asking logprobs."""
    eng = build_stack(NANO, device="cuda", dtype="bfloat16", progress=False,
                      max_model_len=512, max_num_seqs=8, num_speculative_tokens=2,
                      spec_max_running=8).engine
    p = eng.tokenizer.encode("def fibonacci(n):")
    got = run(eng, {
        "lp": (p, SamplingParams(temperature=0.0, max_tokens=32, logprobs=5)),
        "plain": (p, SamplingParams(temperature=0.0, max_tokens=32)),
        "hot": (p, SamplingParams(temperature=1.0, seed=1, max_tokens=32, logprobs=0)),
    })
    # (no ids comparison with "plain": a verify step's bf16 numerics may differ from the
    # decode graph's at a near tie; tests/test_gpu_invariance.py owns that question)
    assert len(got["plain"]["ids"]) == 32 and got["plain"]["none"] == 32
    for name in ("lp", "hot"):
        g = got[name]
        assert g["none"] == 0 and len(g["lps"]) == len(g["ids"]) == 32
    for t, x in zip(got["lp"]["ids"], got["lp"]["lps"]):
        assert x.top[0][0] == t and x.top[0][1] == x.logprob and len(x.top) == 5


def test_partial_utf8_tokens_are_named_by_their_bytes_and_offsets_index_the_text():
    from tailored.engine.types import TokenLogprob
    from tailored.server.formatter import Formatter

    class Tok:
        table = {1: b"\xf0\x9f", 2: b"\x98\x80", 3: b" KIND", 4: b"\xe4\xb8", 9: b"<|end|>"}

        def token_bytes(self, i):
            return self.table[i]

        def is_special(self, i):
            return i == 9

    fmt = Formatter("cmpl-x", "m", False, 3, False, logprobs=2, tokenizer=Tok())
    lps = [TokenLogprob(-0.5, ((1, -0.5), (4, -1.5))), TokenLogprob(-0.1, ((2, -0.1), (3, -3.0))),
           TokenLogprob(-0.2, ((3, -0.2), (1, -2.0)))]
    first = fmt.logprobs_payload([1, 2], lps[:2])
    second = fmt.logprobs_payload([3, 9], [lps[2], TokenLogprob(-0.3, ())])
    assert first["tokens"] == ["bytes:\\xf0\\x9f", "bytes:\\x98\\x80"]
    assert set(first["top_logprobs"][0]) == {"bytes:\\xf0\\x9f", "bytes:\\xe4\\xb8"}
    # the text is "😀 KIND": the emoji's two tokens both start at 0, " KIND" at 1, and the
    # special token (no text) after it at 6
    assert first["text_offset"] + second["text_offset"] == [0, 0, 1, 6]
