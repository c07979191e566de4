"""Structured output (`response_format`, engine/grammar.py): the sampler's bitmask against a
plain boolean mask on fresh logits; xgrammar's guide on the nano tokenizer (a valid answer ends
it, thinking defers it, bad schemas are ValueErrors); the engine (nano model, CPU, sync and
async scheduling, speculative decoding on) returns JSON that follows the schema; the HTTP API
maps response_format and refuses bad ones with OpenAI errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from test_sampler import seq
from test_server import MODEL, assert_openai_error, chat, completion, srv  # noqa: F401

import tailored
from tailored.engine import grammar as grammar_mod
from tailored.worker.sampler import sample_on_device
from tailored.engine.types import FinishReason, SamplingParams, StructuredOutput

xgr = pytest.importorskip("xgrammar")

NANO = Path(tailored.__file__).parent / "data" / "nano"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}
CHOICE = {"type": "object", "properties": {"pick": {"enum": ["red", "green"]}},
          "required": ["pick"]}


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """[V] bool -> packed int32 words, xgrammar's layout (bit j of word i = token 32 i + j)."""
    V = allowed.shape[0]
    padded = torch.zeros((V + 31) // 32 * 32, dtype=torch.int64)
    padded[:V] = allowed.cpu().long()
    words = (padded.view(-1, 32) << torch.arange(32)).sum(dim=1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("V", [37, 64, 100, 248320])
def test_sampler_mask_against_a_boolean_mask(V, device):
    """Rows with `allowed` only ever sample allowed tokens (greedy: the best allowed one; bit 31
    of a word, a negative int32, included); rows without keep the plain result; ids past the
    mask's words are masked. On the GPU too (the model's vocab: the serving case)."""
    torch.manual_seed(V)
    logits = (torch.randn(4, V) * 3).to(device)
    allowed = (torch.rand(4, V) < 0.3).to(device)
    allowed[:, 31] = True  # the sign bit of word 0
    allowed[:, 0] = False
    masks = [_pack(allowed[i]) for i in range(4)]
    short = masks[3][:-1]  # the last word missing: its ids are not allowed
    seqs = [seq("g", temperature=0.0), seq("s", temperature=1.0, seed=5),
            seq("plain", temperature=0.0),
            seq("short", temperature=0.0)]
    from dataclasses import replace
    seqs = [replace(seqs[0], allowed=masks[0]), replace(seqs[1], allowed=masks[1]), seqs[2],
            replace(seqs[3], allowed=short)]
    for _ in range(20 if V < 1000 else 3):
        ids = sample_on_device(logits, seqs).tolist()
        assert allowed[0, ids[0]] and allowed[1, ids[1]]
        assert ids[0] == logits[0].masked_fill(~allowed[0], -float("inf")).argmax().item()
        want3 = allowed[3].clone()
        want3[32 * short.shape[0]:] = False
        assert ids[3] == logits[3].masked_fill(~want3, -float("inf")).argmax().item()
        assert ids[2] == logits[2].argmax().item()  # the row without a mask: untouched


@pytest.fixture(scope="module")
def grammars():
    from tailored.tokenizer import load_tokenizer

    tok = load_tokenizer(NANO)
    return grammar_mod.Grammars(tok, 4160, tok.eos_token_ids), tok


def _feed(guide, tok, text):
    for t in tok.encode(text, allow_special=False):
        assert guide.mask() is not None
        guide.accept(t)


def test_guide_ends_after_the_json_and_a_stop_token(grammars):
    g, tok = grammars
    guide = g.guide(StructuredOutput("json_schema", json.dumps(PERSON)), tok.encode("hi"))
    _feed(guide, tok, '{"name": "Bo", "age": 7}')
    assert not guide.done
    mask = guide.mask()
    allowed = [t for t in range(4160) if (int(mask[t // 32]) >> (t % 32)) & 1]
    assert set(allowed) == set(tok.eos_token_ids)  # only a stop token may follow
    guide.accept(tok.eos_token_ids[0])
    assert guide.done and not guide.failed


def test_guide_masks_added_tokens_and_refuses_off_grammar_tokens(grammars):
    g, tok = grammars
    guide = g.guide(StructuredOutput("json_object"), tok.encode("hi"))
    mask = guide.mask()
    bit = lambda t: (int(mask[t // 32]) >> (t % 32)) & 1  # noqa: E731
    assert all(not bit(t) for t in range(tok.vocab_size) if tok.is_added(t))
    assert all(not bit(t) for t in range(tok.vocab_size, 4160))  # the model's padded rows
    assert bit(tok.encode("{")[0])
    guide.accept(tok.encode("hello")[0])  # not an object's start (a NaN fallback's token)
    assert guide.failed and guide.done


def test_guide_waits_for_the_end_of_thinking(grammars):
    g, tok = grammars
    think, end = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    closed = g.guide(StructuredOutput("json_object"), tok.encode("a") + [think, 5, end])
    assert closed.active
    open_ = g.guide(StructuredOutput("json_object"), tok.encode("a") + [think])
    assert not open_.active and open_.mask() is None
    open_.accept(tok.encode("hello")[0])  # free text while thinking
    assert not open_.done and open_.mask() is None
    open_.accept(end)
    assert open_.active and open_.mask() is not None


@pytest.mark.parametrize("schema", ['{"type": 5}', '{"type": "object", "properties": 3}'])
def test_bad_schema_is_a_one_line_value_error(grammars, schema):
    g, tok = grammars
    with pytest.raises(ValueError, match="schema cannot be used") as e:
        g.guide(StructuredOutput("json_schema", schema), [1])
    assert "\n" not in str(e.value) and "/project/" not in str(e.value)


def test_without_xgrammar_a_structured_request_is_a_value_error(monkeypatch):
    import builtins

    from tailored.tokenizer import load_tokenizer

    real = builtins.__import__

    def no_xgrammar(name, *a, **kw):
        if name == "xgrammar":
            raise ImportError("no xgrammar")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_xgrammar)
    tok = load_tokenizer(NANO)
    g = grammar_mod.Grammars(tok, 4160, tok.eos_token_ids)
    with pytest.raises(ValueError, match="pip install xgrammar"):
        g.guide(StructuredOutput("json_object"), [1])


def test_structured_requests_never_draft():
    assert not SamplingParams(temperature=0.0, structured=StructuredOutput("json_object")).can_draft


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def engine(request):
    from tailored.stack import build_stack

    # speculative decoding and async scheduling on: structured requests run beside plain ones
    # that draft and are launched ahead
    return build_stack(NANO, device="cpu", dtype="float32", progress=False, kernels="off",
                       max_model_len=768, max_num_seqs=8, num_speculative_tokens=2,
                       spec_max_running=8, async_scheduling=request.param).engine


def _run(engine, reqs):
    for rid, (ids, sp) in reqs.items():
        engine.add_request(rid, ids, sp)
    got = {rid: {"text": "", "ids": [], "reason": None} for rid in reqs}
    while engine.has_unfinished():
        for o in engine.step():
            g = got[o.request_id]
            g["text"] += o.delta_text
            g["ids"] += o.delta_token_ids
            g["reason"] = o.finish_reason
    return got


def test_async_launches_structured_requests_ahead_with_the_sync_answers():
    """Async scheduling keeps running ahead while structured requests decode (before session
    32 one kept its whole batch synchronous, ~11-20 % of every stream's speed): their rows
    launch unmasked and are sampled again from the same logits once the previous step's
    token gave the grammar's mask (`Engine._resample_deferred`). Every answer — greedy and
    seeded sampling under a schema and a regex, plain requests beside them (one with
    logprobs) — is the synchronous engine's; a structured request with logprobs keeps its
    steps synchronous."""
    from tailored.stack import build_stack

    tok = None
    got, resampled, ahead = {}, {}, {}
    for on in (False, True):
        engine = build_stack(NANO, device="cpu", dtype="float32", progress=False,
                             kernels="off", max_model_len=768, max_num_seqs=8,
                             async_scheduling=on).engine
        tok = engine.tokenizer
        calls = []
        real = getattr(engine.runner, "resample", None)
        if real is not None:
            engine.runner.resample = lambda step, fixes: (calls.append(len(fixes)),
                                                          real(step, fixes))[1]
        p = tok.encode("def fibonacci(n):")
        spec = StructuredOutput("json_schema", json.dumps(CHOICE))
        digits = StructuredOutput("regex", "[0-9]{3,12}")
        reqs = {
            "greedy": (p, SamplingParams(temperature=0.0, max_tokens=300, structured=spec)),
            "seeded": (p, SamplingParams(temperature=1.0, seed=7, max_tokens=300,
                                         structured=spec)),
            "digits": (p, SamplingParams(temperature=0.9, seed=3, max_tokens=40,
                                         structured=digits)),
            "free": (p, SamplingParams(temperature=0.0, max_tokens=30)),
            # logprobs of a plain request beside them (found in review: its step's logprobs
            # made the structured rows' resample fail the batch)
            "free_lp": (p, SamplingParams(temperature=0.0, max_tokens=30, logprobs=2)),
        }
        n_ahead = 0
        for rid, (ids, sp) in reqs.items():
            engine.add_request(rid, ids, sp)
        out = {rid: [[], None] for rid in reqs}
        while engine.has_unfinished():
            for o in engine.step():
                assert o.error is None, o.error
                out[o.request_id][0] += o.delta_token_ids
                out[o.request_id][1] = o.finish_reason
            n_ahead += engine._inflight is not None
        got[on], resampled[on], ahead[on] = out, calls, n_ahead
        if on:  # logprobs: the first draw's would be reported, so no step runs ahead
            engine.add_request("lp", p, SamplingParams(temperature=0.0, max_tokens=8,
                                                       structured=digits, logprobs=2))
            lp_ahead = 0
            while engine.has_unfinished():
                engine.step()
                lp_ahead += engine._inflight is not None
            assert lp_ahead == 0
    assert got[True] == got[False]
    for rid in ("greedy", "seeded"):
        text = tok.decode(got[True][rid][0])
        assert json.loads(text)["pick"] in ("red", "green"), (rid, text)
    assert tok.decode(got[True]["digits"][0]).isdigit()
    assert ahead[False] == 0 and ahead[True] >= 5, ahead
    assert sum(resampled[True]) >= 5 and not resampled[False], resampled


@pytest.mark.contract("openai-api-behaviour")
def test_engine_answers_follow_the_schema(engine):
    tok = engine.tokenizer
    p = tok.encode("def fibonacci(n):")
    spec = StructuredOutput("json_schema", json.dumps(CHOICE))
    got = _run(engine, {
        "greedy": (p, SamplingParams(temperature=0.0, max_tokens=400, structured=spec)),
        "sampled": (p, SamplingParams(temperature=1.0, seed=2, max_tokens=400, structured=spec)),
        "free": (p, SamplingParams(temperature=0.0, max_tokens=24)),
        "ignore_eos": (p, SamplingParams(temperature=0.0, max_tokens=400, structured=spec,
                                         ignore_eos=True)),
    })
    for rid in ("greedy", "sampled", "ignore_eos"):
        g = got[rid]
        assert g["reason"] is FinishReason.STOP, (rid, g)
        assert json.loads(g["text"])["pick"] in ("red", "green"), (rid, g["text"])
    assert got["ignore_eos"]["text"] == got["greedy"]["text"]
    # the plain request beside them is what it is alone
    alone = _run(engine, {"free2": (p, SamplingParams(temperature=0.0, max_tokens=24))})
    assert got["free"]["ids"] == alone["free2"]["ids"]


def test_engine_refuses_a_bad_schema_and_keeps_serving(engine):
    with pytest.raises(ValueError, match="schema cannot be used"):
        engine.add_request("bad", [1, 2], SamplingParams(
            structured=StructuredOutput("json_schema", '{"type": 5}')))
    assert not engine.has_unfinished()
    got = _run(engine, {"ok": ([1, 2, 3], SamplingParams(
        temperature=0.0, max_tokens=300, structured=StructuredOutput("json_object")))})
    assert got["ok"]["reason"] in (FinishReason.STOP, FinishReason.LENGTH)


# ---- HTTP API (FakeEngine: what reaches the engine, and the 400s) ------------------------------

def test_response_format_reaches_the_engine(srv):  # noqa: F811
    client, engine, _ = srv
    r = chat(client, response_format={"type": "json_schema", "json_schema": {
        "name": "person", "schema": PERSON, "strict": True}})
    assert r.status_code == 200, r.text
    sp = next(iter(engine.added.values()))
    assert sp.structured.kind == "json_schema" and json.loads(sp.structured.schema) == PERSON
    engine.added.clear()
    assert completion(client, prompt="x", response_format={"type": "json_object"}).status_code \
        == 200
    assert next(iter(engine.added.values())).structured == StructuredOutput("json_object")
    engine.added.clear()
    assert chat(client, response_format={"type": "text"}).status_code == 200
    assert next(iter(engine.added.values())).structured is None


@pytest.mark.parametrize("fmt,needle", [
    ({"type": "json_schema"}, "json_schema"),
    ({"type": "json_object", "json_schema": {"schema": {}}}, "json_schema"),
    ({"type": "xml"}, "type"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema"),
    ({"type": "json_schema", "json_schema": {"schema": "not an object"}}, "schema"),
    ("json", "response_format"),
    ({"type": "json_schema", "json_schema": {"schema": {"enum": ["x" * 70000]}}}, "at most"),
])
def test_bad_response_format_is_a_400(srv, fmt, needle):  # noqa: F811
    client, engine, _ = srv
    assert_openai_error(chat(client, response_format=fmt), 400, needle)
    assert not engine.added


def test_response_format_with_tools_is_calls_or_the_answer(srv):  # noqa: F811
    """As OpenAI: response_format beside tools (tool_choice auto) is one grammar of tool calls
    or the format's answer (engine/tool_grammar.py); with tool_choice none the format alone."""
    client, engine, _ = srv
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for fmt, answer in (({"type": "json_object"}, {"kind": "json_object", "schema": None}),
                        ({"type": "json_schema", "json_schema": {"name": "p", "schema": CHOICE}},
                         {"kind": "json_schema", "schema": json.dumps(CHOICE,
                                                                      separators=(",", ":"))})):
        engine.added.clear()
        assert chat(client, tools=tools, response_format=fmt).status_code == 200
        spec = next(iter(engine.added.values())).structured
        got = json.loads(spec.schema)
        assert spec.kind == "tool_calls" and got["tool_choice"] == "auto"
        assert got["answer"] == {**answer, "compact": False}
        assert [t["function"]["name"] for t in got["tools"]] == ["f"]
    engine.added.clear()
    assert chat(client, tools=tools, tool_choice="none",
                response_format={"type": "json_object"}).status_code == 200
    assert next(iter(engine.added.values())).structured.kind == "json_object"


def test_nano_server_answers_json(engine):
    """The real stack behind the HTTP API: the chat answer's content parses and follows the
    schema; a schema xgrammar refuses is a 400 and the server keeps serving."""
    from tailored.server.app import build_app
    from tailored.server.async_engine import AsyncEngine

    aengine = AsyncEngine(engine)
    app = build_app(aengine, engine.tokenizer, MODEL, 768)
    with TestClient(app) as client:
        fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": CHOICE}}
        r = chat(client, content="Pick a colour.", response_format=fmt, max_tokens=400,
                 temperature=0, chat_template_kwargs={"enable_thinking": False})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        assert json.loads(choice["message"]["content"])["pick"] in ("red", "green")
        bad = {"type": "json_schema", "json_schema": {"name": "c", "schema": {"type": 5}}}
        assert_openai_error(chat(client, response_format=bad), 400, "schema cannot be used")
        assert chat(client, content="hi", max_tokens=4).status_code == 200


# ---- vLLM's structured_outputs -----------------------------------------------------------------

def test_choice_regex_and_grammar_in_the_engine(engine):
    tok = engine.tokenizer
    p = tok.encode("def fibonacci(n):")
    choices = ["yes", "no way", 'a "quoted" \\ one', "ünï\n"]
    got = _run(engine, {
        "choice": (p, SamplingParams(temperature=1.0, seed=4, max_tokens=50,
                                     structured=StructuredOutput("choice", json.dumps(choices)))),
        "regex": (p, SamplingParams(temperature=0.0, max_tokens=50,
                                    structured=StructuredOutput("regex", r"\d{3}-[a-z]{2,4}"))),
        "grammar": (p, SamplingParams(temperature=0.0, max_tokens=50, structured=StructuredOutput(
            "grammar", 'root ::= "(" [0-9]+ ")"'))),
    })
    assert got["choice"]["text"] in choices and got["choice"]["reason"] is FinishReason.STOP
    import re
    assert re.fullmatch(r"\d{3}-[a-z]{2,4}", got["regex"]["text"]), got["regex"]
    assert re.fullmatch(r"\(\d+\)", got["grammar"]["text"]) or \
        got["grammar"]["reason"] is FinishReason.LENGTH, got["grammar"]


@pytest.mark.parametrize("kind,text,needle", [
    ("regex", "(", "regex cannot be used: Regex parsing error"),
    ("grammar", "root ::= ", "grammar cannot be used: EBNF parser error"),
    ("json_schema", '{"type": 5}', "schema cannot be used"),
])
def test_bad_structured_outputs_are_value_errors(grammars, kind, text, needle):
    g, _ = grammars
    with pytest.raises(ValueError, match=needle) as e:
        g.guide(StructuredOutput(kind, text), [1])
    assert "/project/" not in str(e.value)


def test_structured_outputs_reach_the_engine(srv):  # noqa: F811
    client, engine, _ = srv
    cases = [({"choice": ["a", "b"]}, StructuredOutput("choice", '["a", "b"]')),
             ({"regex": "x+"}, StructuredOutput("regex", "x+")),
             ({"grammar": 'root ::= "x"'}, StructuredOutput("grammar", 'root ::= "x"')),
             ({"json": PERSON}, StructuredOutput("json_schema",
                                                 json.dumps(PERSON, separators=(",", ":")))),
             ({"json": '{"type": "object"}'}, StructuredOutput("json_schema",
                                                               '{"type": "object"}')),
             ({"json_object": True, "disable_any_whitespace": True},
              StructuredOutput("json_object", compact=True)),
             ({"json_object": True, "whitespace_pattern": " "}, StructuredOutput("json_object")),
             ({"regex": "x+", "disable_any_whitespace": True}, StructuredOutput("regex", "x+"))]
    for body, want in cases:
        engine.added.clear()
        r = completion(client, prompt="x", structured_outputs=body)
        assert r.status_code == 200, (body, r.text)
        assert next(iter(engine.added.values())).structured == want, body


@pytest.mark.parametrize("body", [
    {}, {"regex": "a", "choice": ["a"]}, {"json_object": False}, {"choice": []},
    {"structural_tag": "{}"}, {"choice": "a"}, {"regex": 5},
])
def test_bad_structured_outputs_are_400s(srv, body):  # noqa: F811
    client, engine, _ = srv
    assert_openai_error(chat(client, structured_outputs=body), 400, "structured_outputs")
    assert not engine.added


def test_structured_outputs_with_response_format_is_a_400(srv):  # noqa: F811
    client, engine, _ = srv
    r = chat(client, structured_outputs={"regex": "a"}, response_format={"type": "json_object"})
    assert_openai_error(r, 400, "not both")
    assert chat(client, structured_outputs={"regex": "a"},
                response_format={"type": "text"}).status_code == 200


# ---- review fixes: compiles off the engine loop, unenforceable schemas, thinking, NaN ----------

def _slow_compile(monkeypatch, delay_s, fail=None):
    import time as _time

    real = grammar_mod.Grammars._compile

    def slow(grammars, spec, grammar):
        _time.sleep(delay_s)
        if fail:
            raise ValueError(fail)
        return real(grammars, spec, grammar)

    monkeypatch.setattr(grammar_mod.Grammars, "_compile", slow)


def _fresh(kind="regex"):
    """A spec no earlier test compiled (the engine fixture's cache would answer at once)."""
    import uuid

    word = uuid.uuid4().hex[:8]
    if kind == "regex":
        return StructuredOutput("regex", f"(a|{word})+")
    return StructuredOutput("json_schema", json.dumps(
        {"type": "object", "properties": {"pick": {"enum": ["red", "green"]}},
         "required": ["pick"], "title": word}))


def test_a_slow_compile_does_not_hold_other_requests(engine, monkeypatch):
    """A grammar that compiles slowly (a pathological pattern took minutes in review) is
    compiled on a worker thread: the plain request beside it gets tokens meanwhile, and the
    structured one is admitted when its grammar is ready."""
    _slow_compile(monkeypatch, 3.0)
    tok = engine.tokenizer
    p = tok.encode("def fibonacci(n):")
    engine.add_request("slow", p, SamplingParams(
        temperature=0.0, max_tokens=300, structured=_fresh("json")))
    engine.add_request("plain", p, SamplingParams(temperature=0.0, max_tokens=4,
                                                  ignore_eos=True))
    plain_while_compiling, text = 0, ""
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == "plain" and o.delta_token_ids and "slow" in engine._compiling:
                plain_while_compiling += 1
                # /metrics' num_requests_waiting counts it while it compiles
                assert engine.stats()["waiting"] >= 1
            if o.request_id == "slow":
                text += o.delta_text
                assert o.error is None, o.error
    assert plain_while_compiling >= 1
    assert json.loads(text)["pick"] in ("red", "green")


def test_a_compile_that_fails_or_runs_too_long_fails_only_its_request(engine, monkeypatch):
    from tailored.engine import engine as engine_mod

    _slow_compile(monkeypatch, 0.3, fail="structured_outputs.regex cannot be used: no")
    engine.add_request("late_bad", [1, 2], SamplingParams(max_tokens=5, structured=_fresh()))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert len(outs) == 1 and outs[0].finish_reason is FinishReason.ERROR
    assert outs[0].bad_request and outs[0].error.startswith("structured_outputs.regex")

    monkeypatch.setattr(engine_mod, "COMPILE_TIMEOUT_S", 0.2)
    monkeypatch.undo()
    monkeypatch.setattr(engine_mod, "COMPILE_TIMEOUT_S", 0.2)
    _slow_compile(monkeypatch, 5.0)  # far past the timeout, whatever a step takes
    engine.add_request("too_slow", [1, 2], SamplingParams(max_tokens=5, structured=_fresh()))
    engine.add_request("fine", [1, 2], SamplingParams(max_tokens=3, temperature=0.0))
    got = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                got[o.request_id] = o
    assert got["too_slow"].bad_request and "did not compile within" in got["too_slow"].error
    assert got["fine"].finish_reason is FinishReason.LENGTH


def test_guide_marks_a_grammar_no_text_satisfies(grammars):
    """An empty mask (nothing can follow) marks the guide dead: at the start ("[^\\s\\S]")
    and after a prefix ("ab" then such a class); a satisfiable grammar never is."""
    g, tok = grammars
    for pattern, prefix in (("[^\\s\\S]", ""), ("ab[^\\s\\S]", "ab"), ("(ab)+", "abab")):
        guide = g.guide(StructuredOutput("regex", pattern), tok.encode("hi"))
        _feed(guide, tok, prefix)
        assert not guide.dead
        guide.mask()
        assert guide.dead == (pattern != "(ab)+"), pattern


def test_a_grammar_no_text_satisfies_is_a_bad_request_and_harms_no_one(engine):
    """The sampler falls back past the empty mask (as on NaN logits), the grammar refuses that
    token, and the request fails as the request's fault (a 400 in the server), naming its
    field; a plain request beside it runs as alone (new-user attack, session 37: this was a
    500 that blamed the model's logits)."""
    engine.add_request("dead", [1, 2], SamplingParams(max_tokens=5, structured=StructuredOutput(
        "regex", "q[^\\s\\S]")))
    engine.add_request("fine", [1, 2], SamplingParams(max_tokens=3, temperature=0.0))
    done, fine_ids = {}, []
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == "fine":
                fine_ids += o.delta_token_ids
            if o.finished:
                done[o.request_id] = o
    assert done["fine"].finish_reason is FinishReason.LENGTH and len(fine_ids) == 3
    dead = done["dead"]
    assert dead.finish_reason is FinishReason.ERROR and dead.bad_request
    assert dead.error.startswith("structured_outputs: the grammar allows no next token after 1 ")


def test_abort_while_compiling(engine, monkeypatch):
    _slow_compile(monkeypatch, 0.5)
    engine.add_request("gone", [1, 2], SamplingParams(max_tokens=5, structured=_fresh()))
    engine.abort_request("gone")
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.finish_reason for o in outs] == [FinishReason.ABORT]


@pytest.mark.parametrize("schema,needle", [
    ({"allOf": [{"type": "object"}, {"required": ["a"]}]}, "allOf"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"$ref": "http://example.com/s.json"}, "$ref"),
    ({"$defs": {"a b": {"type": "integer"}}, "$ref": "#/$defs/a%20b"}, "$ref"),
    ({"type": "string", "pattern": "^(?=a)b$"}, "lookaround"),
    ({"type": "object", "properties": {"a": {}}, "required": ["a", "b"]}, "'b'"),
    ({"not": {"type": "string"}}, "'not'"),
    ({"type": "object", "properties": {"x": {"if": {}, "then": {}}}}, "schema.properties.x"),
    ({"type": "object", "patternProperties": {"x": {"type": "integer"}}}, "patternProperties"),
    ({"type": []}, "empty list"),
    ({"anyOf": []}, "'anyOf' must not be an empty list"),
    ({"type": "object", "properties": {"a": {"oneOf": []}}}, "schema.properties.a"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "pattern"),
    ({"$defs": {"a": {"type": "integer"}}, "$ref": "#/$defs/a", "minimum": 5}, "beside"),
    ({"allOf": [{"type": "integer"}], "minimum": 5}, "beside"),
    ({"type": "string", "enum": [1, 2]}, "not of its 'type'"),
    ({"type": "object", "properties": {"a": {"type": "array", "items": {"not": {}}}}},
     "schema.properties.a.items"),
])
def test_unenforceable_schemas_are_refused(grammars, schema, needle):
    assert needle in grammar_mod.unsupported_schema(schema)
    g, _ = grammars
    with pytest.raises(ValueError, match="schema cannot be used"):
        g.compile(StructuredOutput("json_schema", json.dumps(schema)))


@pytest.mark.parametrize("schema", [
    PERSON, CHOICE, {"allOf": [{"type": "object"}]},
    {"$defs": {"n": {"type": "integer"}}, "type": "object",
     "properties": {"a": {"$ref": "#/$defs/n"}}, "required": ["a"]},
    {"type": "object", "properties": {}, "required": ["b"], "additionalProperties": True},
    {"type": "string", "enum": ["not", "if"]},
    # review 2's false positives: "at least one of", allOf of a $ref, vendor extensions
    {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
     "anyOf": [{"required": ["a"]}, {"required": ["b"]}]},
    {"$defs": {"B": {"type": "object", "properties": {"x": {"type": "integer"}}}},
     "allOf": [{"$ref": "#/$defs/B"}], "description": "d"},
    {"type": "object", "properties": {"a": {"type": "integer", "x-note": {"if": {}}}}},
    {"type": ["integer", "null"], "enum": [1, None]},
    {"type": "integer", "multipleOf": 3},
    {"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}}, "required": ["k"]},
               {"type": "object", "properties": {"k": {"const": "b"}}, "required": ["k"]}]},
])
def test_enforceable_schemas_pass_the_check(schema):
    assert grammar_mod.unsupported_schema(schema) is None


def test_json_may_start_after_a_little_whitespace(grammars):
    g, tok = grammars
    guide = g.guide(StructuredOutput("json_schema", json.dumps(PERSON)), [1])
    _feed(guide, tok, '\n\n{"name": "Bo", "age": 7}')
    guide.accept(tok.eos_token_ids[0])
    assert guide.done and not guide.failed
    long_ws = g.guide(StructuredOutput("json_object"), [1])
    for t in tok.encode(" " * 20, allow_special=False):
        long_ws.accept(t)
    assert long_ws.failed  # more than LEADING_WHITESPACE characters before the object


def test_a_think_tag_early_in_a_prompt_does_not_defer_the_grammar(grammars):
    g, tok = grammars
    think = tok.token_to_id("<think>")
    text = tok.encode("Explain the ") + [think] + tok.encode(" tag in a sentence. JSON:")
    assert g.guide(StructuredOutput("json_object"), text).active
    nl = tok.encode("\n")
    assert not g.guide(StructuredOutput("json_object"), tok.encode("a") + [think] + nl).active


def test_a_token_the_grammar_refuses_fails_the_request(engine, monkeypatch):
    """The sampler's NaN fallback can give a token past the mask: the request ends with an
    error, not a `stop` with broken JSON."""
    real = grammar_mod.Guide.accept

    def refuse(self, token):
        real(self, token)
        self.failed = True

    monkeypatch.setattr(grammar_mod.Guide, "accept", refuse)
    got = _run(engine, {"nan": ([1, 2, 3], SamplingParams(
        temperature=0.0, max_tokens=20, structured=StructuredOutput("json_object")))})
    assert got["nan"]["reason"] is FinishReason.ERROR


def test_http_errors_name_the_structured_field(engine, monkeypatch):
    """A schema refused at once and one that fails after admission are both 400s naming
    response_format / structured_outputs."""
    from tailored.server.app import build_app
    from tailored.server.async_engine import AsyncEngine

    app = build_app(AsyncEngine(engine), engine.tokenizer, MODEL, 768)
    with TestClient(app) as client:
        bad = {"type": "json_schema", "json_schema": {"name": "c", "schema": {"type": "foo"}}}
        err = assert_openai_error(chat(client, response_format=bad), 400, "schema cannot be used")
        assert err["param"] == "response_format"
        err = assert_openai_error(completion(client, prompt="x", structured_outputs={
            "regex": "("}), 400, "Regex parsing error")
        assert err["param"] == "structured_outputs"
        _slow_compile(monkeypatch, 0.3, fail="structured_outputs.grammar cannot be used: late")
        err = assert_openai_error(completion(client, prompt="x", max_tokens=5, structured_outputs={
            "grammar": 'root ::= "late"'}), 400, "late")
        assert err["param"] == "structured_outputs"


def test_compiled_grammars_do_not_keep_their_compiler_alive():
    """The cache is the instance's: an engine's compiler (hundreds of MB at Qwen's vocabulary)
    goes with it (a module-level cache held every test engine's, ~200 MB each: a local CI run
    grew to 15 GB)."""
    import gc
    import weakref

    from tailored.tokenizer import load_tokenizer

    tok = load_tokenizer(NANO)
    g = grammar_mod.Grammars(tok, 4160, tok.eos_token_ids)
    g.compile(StructuredOutput("json_object"))
    assert g.compile(StructuredOutput("json_object")) is g.compile(StructuredOutput("json_object"))
    ref = weakref.ref(g)
    del g
    gc.collect()
    assert ref() is None


def test_warmup_builds_the_compiler_on_a_thread():
    from tailored.tokenizer import load_tokenizer

    tok = load_tokenizer(NANO)
    g = grammar_mod.Grammars(tok, 4160, tok.eos_token_ids)
    t = g.warm_in_background()
    t.join(60)
    assert g._compiler is not None and g.cached(StructuredOutput("json_object")) is not None


def test_a_mask_over_the_time_limit_fails_its_request(engine, monkeypatch):
    """A grammar that compiles fast but masks slowly (review 2: a nested-repeat pattern took
    1.8 s a token by its 40th) must not stall every stream: past MASK_LIMIT_S the request
    fails as a bad request; the plain one beside it finishes."""
    from tailored.engine import engine as engine_mod

    monkeypatch.setattr(engine_mod, "MASK_LIMIT_S", 0.0)
    got = _run(engine, {
        "slow_mask": ([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=20,
                                                structured=StructuredOutput("json_object"))),
        "plain": ([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)),
    })
    assert got["slow_mask"]["reason"] is FinishReason.ERROR
    assert got["plain"]["reason"] is FinishReason.LENGTH and len(got["plain"]["ids"]) == 5


def test_busy_compile_threads_neither_delay_bad_grammars_nor_cached_ones(engine, monkeypatch):
    """With every compile thread busy: a grammar that does not parse is still a ValueError at
    once, a cached one is admitted at once, and a new one fails after the queue timeout
    (its queued compile is dropped)."""
    import threading as _threading

    from tailored.engine import engine as engine_mod

    engine.add_request("warm", [1, 2], SamplingParams(
        max_tokens=2, structured=StructuredOutput("json_object")))
    while engine.has_unfinished():
        engine.step()
    busy = _threading.BoundedSemaphore(1)
    busy.acquire()
    monkeypatch.setattr(engine._grammars, "_slots", busy)
    monkeypatch.setattr(engine_mod, "COMPILE_QUEUE_TIMEOUT_S", 0.3)
    with pytest.raises(ValueError, match="Regex parsing error"):
        engine.add_request("bad", [1, 2], SamplingParams(
            max_tokens=2, structured=StructuredOutput("regex", "(")))
    engine.add_request("cached", [1, 2], SamplingParams(
        max_tokens=2, structured=StructuredOutput("json_object")))
    assert "cached" not in engine._compiling
    engine.add_request("queued", [1, 2], SamplingParams(max_tokens=2, structured=_fresh()))
    future = engine._compiling["queued"][1]
    got = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                got[o.request_id] = o
    busy.release()
    assert got["cached"].error is None
    assert got["queued"].bad_request and "stayed busy" in got["queued"].error
    assert future.cancelled()


def test_add_request_does_not_wait_for_the_compiler_build(engine):
    """While a thread builds the compiler (seconds at Qwen's vocabulary, holding its lock),
    a new structured request is parsed and queued without waiting for it."""
    import time as _time

    engine.add_request("prime", [1, 2], SamplingParams(
        max_tokens=2, structured=StructuredOutput("json_object")))
    while engine.has_unfinished():
        engine.step()
    lock = engine._grammars._lock
    lock.acquire()  # as the warm-up thread does while it builds
    try:
        t = _time.monotonic()
        engine.add_request("during_build", [1, 2], SamplingParams(max_tokens=2,
                                                                  structured=_fresh()))
        engine.add_request("cached", [1, 2], SamplingParams(
            max_tokens=2, structured=StructuredOutput("json_object")))
        assert _time.monotonic() - t < 0.5
        assert "during_build" in engine._compiling and "cached" not in engine._compiling
    finally:
        lock.release()
    while engine.has_unfinished():
        engine.step()


def test_compact_json_has_no_free_whitespace(grammars):
    """structured_outputs.disable_any_whitespace (vLLM): only xgrammar's compact separators;
    a weak model cannot spend its tokens on whitespace (a new user's parse() ran out of
    max_tokens on the nano model without it)."""
    g, tok = grammars
    compact = StructuredOutput("json_schema", json.dumps(PERSON), compact=True)
    guide = g.guide(compact, [1])
    _feed(guide, tok, '{"name":"Bo","age":7}')
    guide.accept(tok.eos_token_ids[0])
    assert guide.done and not guide.failed
    spaced = g.guide(compact, [1])
    spaced.accept(tok.encode(" ", allow_special=False)[0])
    assert spaced.failed


# ---- forced tool calls (tool_choice "required" / a named function) ----------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}}
NOOP = {"type": "function", "function": {"name": "noop",
                                         "parameters": {"type": "object", "properties": {}}}}
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


def _tool_spec(choice, tools=(WEATHER, NOOP), parallel=True):
    return StructuredOutput("tool_calls", json.dumps(
        {"tools": list(tools), "tool_choice": choice, "parallel_tool_calls": parallel}))


def _takes(g, tok, spec, text):
    """Whether the grammar of `spec` takes `text` (tokenized with the markers as their tokens)
    whole, and then a stop token."""
    guide = g.guide(spec, tok.encode("hi"))
    for t in tok.encode(text, allow_special=True):
        mask = guide.mask()
        if not (int(mask[t // 32]) >> (t % 32)) & 1:
            return False
        guide.accept(t)
    mask = guide.mask()
    eos = tok.eos_token_ids[0]
    return bool((int(mask[eos // 32]) >> (eos % 32)) & 1)


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("choice,parallel,text,ok", [
    ("required", True, CALL, True),
    ("required", True, "\n\n" + CALL, True),  # Qwen's "</think>\n\n" before the answer
    ("required", True, CALL + "\n" + CALL.replace("Paris", "Rome"), True),
    ("required", False, CALL + "\n" + CALL, False),  # parallel_tool_calls false: one call
    ("required", True, "Sure.\n" + CALL, False),  # no free text: a call is forced
    ("required", True, CALL + "\nDone.", False),  # ... nor after the calls
    ("required", True, "\n\n\n" + CALL, False),  # at most Qwen's two newlines first
    ("required", True, " " + CALL, False),
    ("required", True, "", False),
    ("required", True, CALL.replace("get_weather", "get_time"), False),  # not a tool
    ("required", True, CALL.replace("\n3\n", "\nthree\n"), False),  # days is an integer
    ("required", True, CALL.replace("<parameter=city>\nParis\n</parameter>\n", ""), False),
    ("required", True, "<tool_call>\n<function=noop>\n\n</function>\n</tool_call>", True),
    ("required", True, CALL.replace("\nParis\n", "\n   Paris\n"), True),  # a string's text
    ("required", True, CALL.replace("\n3\n", "\n   3\n"), False),  # padding beside a number
    ("required", True, CALL.replace("</function>", "\n\n</function>"), False),
    # a string value cannot hold what would end it for the parser (tool_calls.py)
    ("required", True, CALL.replace("Paris", "Paris<parameter=x>"), False),
    ("required", True, CALL.replace("Paris", "Paris</function>"), False),
    ("required", True, CALL.replace("Paris", "Paris</parameter"), True),
    (NAMED, True, CALL, True),
    # a length bound is kept, and such a text cannot stand in the value either (the parser
    # would end it there: engine/tool_grammar.py)
    ("bounded", True, CALL.replace("Paris", "Paris<parameter=x>"), False),
    ("bounded", True, CALL.replace("Paris", "Paris<b"), True),
    ("bounded", True, CALL.replace("Paris", "P" * 31), False),  # maxLength 30 holds
    (NAMED, True, CALL + "\n" + CALL, False),  # a named function: exactly one call
    (NAMED, True, "<tool_call>\n<function=noop>\n\n</function>\n</tool_call>", False),
])
def test_forced_tool_call_grammar(grammars, choice, parallel, text, ok):
    g, tok = grammars
    tools = (WEATHER, NOOP)
    if choice == "bounded":
        w = json.loads(json.dumps(WEATHER))
        w["function"]["parameters"]["properties"]["city"]["maxLength"] = 30
        choice, tools = "required", (w, NOOP)
    assert _takes(g, tok, _tool_spec(choice, tools=tools, parallel=parallel), text) is ok


def test_accented_choice_schema_and_tool_names_are_kept_as_written(grammars):
    """engine/grammar_text.py (xgrammar 0.2.9 misreads "é" + a hex digit), through the
    engine's grammars and the real tokenizer: a choice, a json_schema enum and a forced call
    of a tool named "fée" with a parameter "données" take the text as written only."""
    g, tok = grammars
    choice = StructuredOutput("choice", json.dumps(["Montréal", "Québec"]))
    assert _takes(g, tok, choice, "Québec") and not _takes(g, tok, choice, "Qu\u0e9bec")
    enum = StructuredOutput("json_schema", json.dumps({"enum": ["décembre"]}), compact=True)
    assert _takes(g, tok, enum, '"décembre"') and not _takes(g, tok, enum, '"d\u0e9cembre"')
    tool = {"type": "function", "function": {"name": "fée", "parameters": {
        "type": "object", "properties": {"données": {"type": "boolean"}},
        "required": ["données"]}}}
    spec = StructuredOutput("tool_calls", json.dumps(
        {"tools": [tool], "tool_choice": "required", "parallel_tool_calls": True}))
    call = ("<tool_call>\n<function={}>\n<parameter={}>\ntrue\n</parameter>\n</function>\n"
            "</tool_call>")
    assert _takes(g, tok, spec, call.format("fée", "données"))
    assert not _takes(g, tok, spec, call.format("f\u0ee0", "donn\u0e9as"))


def test_forced_tool_calls_cannot_spell_the_markers(grammars):
    """After a call only a newline and the `<tool_call>` token may follow: text spelling
    `<tool_call>` (which the parser would read as a call of any name) is refused."""
    g, tok = grammars
    guide = g.guide(_tool_spec("required"), tok.encode("hi"))
    for t in tok.encode(CALL + "\n", allow_special=True):
        guide.accept(t)
    mask = guide.mask()
    bit = lambda t: (int(mask[t // 32]) >> (t % 32)) & 1  # noqa: E731
    assert bit(tok.token_to_id("<tool_call>"))
    assert not any(bit(t) for t in tok.encode("<tool", allow_special=False)[:1])
    assert sum(bin(int(w) & 0xFFFFFFFF).count("1") for w in mask) == 1


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_forced_tool_calls_refuse_duplicate_names(srv, choice):  # noqa: F811
    client, engine, _ = srv
    r = chat(client, tools=[WEATHER, NOOP, WEATHER], tool_choice=choice)
    assert_openai_error(r, 400, "given twice")
    assert r.json()["error"]["param"] == "tools[2].function.name"
    assert not engine.added


@pytest.mark.parametrize("params", [
    {"type": "string"}, {"type": ["object", "null"]}, {"enum": ["a"]},
    {"anyOf": [{"type": "string", "enum": ["hello"]}]},
    {"$ref": "#/$defs/S", "$defs": {"S": {"type": "string"}}},
    {"allOf": [{"type": "object"}, {"const": {}}]},
])
def test_forced_tool_calls_need_object_parameters(srv, params):  # noqa: F811
    client, engine, _ = srv
    bad = {"type": "function", "function": {"name": "f", "parameters": params}}
    r = chat(client, tools=[WEATHER, bad], tool_choice="required")
    assert_openai_error(r, 400, "describe an object")
    assert r.json()["error"]["param"] == "tools[1].function.parameters"
    assert not engine.added
    # a named choice looks at its own function only; auto mode does not refuse them
    for choice in (NAMED, "auto"):
        assert chat(client, tools=[WEATHER, bad], tool_choice=choice).status_code == 200


@pytest.mark.parametrize("params", [
    None, {}, {"type": "object"}, {"$ref": "#/$defs/O", "$defs": {"O": {
        "type": "object", "properties": {"n": {"type": "integer"}}}}},
    {"allOf": [{"properties": {"a": {"type": "string"}}}, {"type": "object"}]},
    {"$ref": "#"},  # a cycle: reads as what the rest says
])
def test_object_parameters_pass(params):
    from tailored.server.arg_types import describes_object

    assert describes_object(params)


def test_a_named_function_needs_only_its_own_schema_enforceable(grammars):
    g, _ = grammars
    other = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"not": {}}}}}}
    g.parse(_tool_spec(NAMED, tools=(WEATHER, other)))
    with pytest.raises(ValueError, match="'not'"):
        g.parse(_tool_spec("required", tools=(WEATHER, other)))


def test_forced_tool_call_grammar_checks_the_parameters(grammars):
    g, tok = grammars
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"not": {"type": "string"}}}}}}
    with pytest.raises(ValueError, match=r"tool_choice cannot be used: "
                                         r"tools\[1\]\.function\.parameters.*'not'"):
        g.parse(_tool_spec("required", tools=(WEATHER, bad)))
    # "strict": false leaves a function's arguments free: nothing to refuse
    free = {"type": "function", "function": {**bad["function"], "strict": False}}
    g.parse(_tool_spec("required", tools=(WEATHER, free)))


def test_the_tool_call_markers_are_the_only_added_tokens_a_grammar_may_allow(grammars):
    g, tok = grammars
    guide = g.guide(_tool_spec("required"), tok.encode("hi"))
    mask = guide.mask()
    allowed = {t for t in range(tok.vocab_size)
               if tok.is_added(t) and (int(mask[t // 32]) >> (t % 32)) & 1}
    assert allowed == {tok.token_to_id("<tool_call>")}


def test_forced_tool_choice_reaches_the_engine(srv):  # noqa: F811
    client, engine, _ = srv
    tools = [WEATHER, NOOP]
    for choice, parallel in (("required", None), (NAMED, False)):
        engine.added.clear()
        body = {"tools": tools, "tool_choice": choice}
        if parallel is not None:
            body["parallel_tool_calls"] = parallel
        r = chat(client, **body)
        assert r.status_code == 200, r.text
        spec = next(iter(engine.added.values())).structured
        assert spec.kind == "tool_calls" and spec.field == "tool_choice"
        got = json.loads(spec.schema)
        assert got["tool_choice"] == choice and got["parallel_tool_calls"] is (parallel is None)
        assert [t["function"]["name"] for t in got["tools"]] == ["get_weather", "noop"]
    # a forced choice wins over a response_format: this turn is calls (OpenAI's rule)
    engine.added.clear()
    r = chat(client, tools=tools, tool_choice="required", response_format={"type": "json_object"})
    assert r.status_code == 200, r.text
    got = json.loads(next(iter(engine.added.values())).structured.schema)
    assert got["tool_choice"] == "required" and "answer" not in got


def test_nano_server_forced_tool_calls(engine):
    """The real stack: a random-weight model that never calls a tool by itself answers
    tool_choice "required" and a named function with complete calls (finish_reason
    "tool_calls", arguments that parse and follow the schema), streamed too; a tool whose
    parameters the grammar cannot enforce is a 400 and the server keeps serving."""
    from tailored.server.app import build_app
    from tailored.server.async_engine import AsyncEngine

    # bounded values: a random-weight model would write an unbounded string forever
    weather = {"type": "function", "function": {
        "name": "get_weather", "parameters": {
            "type": "object", "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city"]}}}
    aengine = AsyncEngine(engine)
    app = build_app(aengine, engine.tokenizer, MODEL, 768)
    kw = dict(content="What is the weather in Paris?", max_tokens=300, temperature=0,
              chat_template_kwargs={"enable_thinking": False})
    with TestClient(app) as client:
        for choice, parallel in (("required", False), ("required", True), (NAMED, False)):
            r = chat(client, tools=[weather, NOOP], tool_choice=choice,
                     parallel_tool_calls=parallel, temperature=0.8, seed=2,
                     **{k: v for k, v in kw.items() if k != "temperature"})
            assert r.status_code == 200, r.text
            c = r.json()["choices"][0]
            assert c["finish_reason"] == "tool_calls", c
            assert not c["message"]["content"], c  # calls only: no text beside them
            calls = c["message"]["tool_calls"]
            assert len(calls) == 1 or (parallel and calls)
            for call in calls:
                fn = call["function"]
                args = json.loads(fn["arguments"])
                assert isinstance(args, dict)
                if fn["name"] == "get_weather":
                    assert args["city"] in ("Paris", "Rome")  # no padding kept
                    assert 1 <= args.get("days", 1) <= 7
                else:
                    assert fn["name"] == "noop" and choice == "required" and args == {}
        with client.stream("POST", "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": kw["content"]}],
                "tools": [weather], "tool_choice": NAMED, "stream": True,
                "max_tokens": 300, "temperature": 0,
                "chat_template_kwargs": {"enable_thinking": False}}) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines()
                      if line.startswith("data: {")]
        pieces = [d for e in events for d in e["choices"][0]["delta"].get("tool_calls") or []]
        assert pieces[0]["function"]["name"] == "get_weather"
        assert isinstance(json.loads("".join(p["function"].get("arguments") or ""
                                             for p in pieces))["city"], str)
        assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
        # cut by max_tokens before the function's name is whole: no call, and the partial
        # markup is not given out as content (a forced answer has none), streamed or not
        for stream in (False, True):
            r = chat(client, tools=[weather], tool_choice=NAMED, stream=stream,
                     **{**kw, "max_tokens": 2})
            assert r.status_code == 200, r.text
            if stream:
                chunks = [json.loads(line[6:])["choices"][0] for line in r.text.splitlines()
                          if line.startswith("data: {")]
                text = "".join(c["delta"].get("content") or "" for c in chunks)
                assert chunks[-1]["finish_reason"] == "length"
                assert not any(c["delta"].get("tool_calls") for c in chunks)
            else:
                c = r.json()["choices"][0]
                text = c["message"]["content"]
                assert c["finish_reason"] == "length" and not c["message"].get("tool_calls")
            assert not text, text
        bad = {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"not": {}}}}}}
        r = chat(client, tools=[bad], tool_choice="required", **kw)
        assert_openai_error(r, 400, "tools[0].function.parameters")
        assert r.json()["error"]["param"] == "tool_choice"
        assert chat(client, content="hi", max_tokens=4).status_code == 200
