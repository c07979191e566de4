"""Async scheduling (kb/0015): a pure decode step is launched before the previous step's tokens
are read, its input ids fed on the device. Outputs must be those of the synchronous engine,
token for token, whatever finishes, stops, aborts or arrives in between (failure-cases §1 state
reuse, §5 stop conditions, §7 long generation).

The real runner and the tiny model on the CPU (plain path, fp32): every step there is
synchronous on the device, so these tests pin the bookkeeping (pending tokens, the feed, void
rows, deferred resolves), not the overlap; the overlap is measured on the H200.
"""

from __future__ import annotations

import pytest
import torch

from tailored.config import EngineConfig
from tailored.engine.engine import Engine
from tailored.engine.scheduler import PENDING_TOKEN, Scheduler
from tailored.engine.types import (
    FinishReason,
    ModelOutput,
    Request,
    SamplingParams,
    ScheduledSeq,
    SchedulerOutput,
)
from tailored.worker.runner import ModelRunner

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def tok(qwen_tok):
    return qwen_tok


def make(model, tok, on: bool, **kw):
    ec = EngineConfig(page_size=16, max_num_seqs=kw.pop("max_num_seqs", 8),
                      max_num_batched_tokens=kw.pop("budget", 256), max_model_len=kw.pop(
                          "max_model_len", 512), device="cpu", dtype="float32",
                      async_scheduling=on, **kw)
    runner = ModelRunner(model, model.config, ec, "cpu", model.lm_head.weight.dtype)
    return Engine(model.config, ec, runner, tok)


def ids(n, seed):
    return torch.randint(0, 248044, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(engine, script):
    """script: {step_no: [("add", rid, prompt, SamplingParams) | ("abort", rid)]} applied
    before that step. Returns (tokens by rid, text by rid, finish reason by rid, steps ahead)."""
    toks, text, why = {}, {}, {}
    ahead = 0
    n = 0
    while True:
        for cmd in script.get(n, []):
            if cmd[0] == "add":
                engine.add_request(cmd[1], cmd[2], cmd[3])
                toks[cmd[1]], text[cmd[1]] = [], ""
            else:
                engine.abort_request(cmd[1])
        if not engine.has_unfinished() and n > max(script):
            break
        for o in engine.step():
            assert o.error is None, o.error
            assert PENDING_TOKEN not in o.delta_token_ids
            toks[o.request_id] += o.delta_token_ids
            text[o.request_id] += o.delta_text
            if o.finished:
                assert o.request_id not in why, f"two final outputs for {o.request_id}"
                why[o.request_id] = o.finish_reason
        ahead += engine._inflight is not None
        n += 1
        assert n < 2000
    return toks, text, why, ahead


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def test_async_equals_sync_through_stops_aborts_arrivals_and_sampling(tiny_model, tok):
    """Staggered lengths (requests finish while the next step is in flight), a stop token id
    that ends one request early (its launched-ahead row is void), an abort mid-decode, a
    request arriving mid-decode (admission drains the pipeline), seeded sampling (its stream
    depends on num_generated) and a penalty request (never launched ahead)."""
    first = sync_run = None
    plain = greedy(6)
    base = run(make(tiny_model, tok, False), {0: [("add", "probe", ids(9, 99), plain)]})
    stop_id = base[0]["probe"][3]  # the 4th greedy token of "probe": it stops there
    script = {
        0: [("add", "a", ids(20, 1), greedy(12)), ("add", "b", ids(5, 2), greedy(3)),
            ("add", "probe", ids(9, 99), SamplingParams(max_tokens=6, temperature=0.0,
                                                         stop_token_ids=[stop_id])),
            ("add", "s", ids(7, 3), SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9,
                                                   seed=1234, ignore_eos=True)),
            ("add", "x", ids(11, 4), greedy(20))],
        5: [("abort", "x")],
        7: [("add", "late", ids(13, 5), greedy(7))],
        9: [("add", "pen", ids(6, 6), SamplingParams(max_tokens=5, temperature=0.0,
                                                     repetition_penalty=1.3, ignore_eos=True))],
    }
    for on in (False, True):
        got = run(make(tiny_model, tok, on), script)
        if first is None:
            first = got
            sync_run = got
        else:
            toks, text, why, ahead = got
            assert toks == sync_run[0] and text == sync_run[1] and why == sync_run[2]
            assert ahead >= 3, "no step was launched ahead: the async path was not exercised"
    toks, _, why, ahead_sync = sync_run
    assert ahead_sync == 0
    assert toks["probe"] == base[0]["probe"][:4] and why["probe"] is FinishReason.STOP
    assert why["x"] is FinishReason.ABORT and why["a"] is FinishReason.LENGTH
    assert len(toks["a"]) == 12 and len(toks["b"]) == 3 and len(toks["late"]) == 7


def test_async_long_decode_equals_sync_at_the_context_limit(tiny_model, tok):
    """Requests decoding up to max_model_len (the step that reaches it is never launched
    ahead) and across page boundaries."""
    script = {0: [("add", f"r{i}", ids(30 + 7 * i, 10 + i), greedy(60 - 7 * i)) for i in range(4)]}
    sync = run(make(tiny_model, tok, False, max_model_len=90), script)
    on = run(make(tiny_model, tok, True, max_model_len=90), script)
    assert on[:3] == sync[:3] and on[3] > 20


def test_async_stop_string_void_row(tiny_model, tok):
    """A stop string found while the next step is in flight: the request ends with the same
    text as the synchronous engine and gets exactly one final output."""
    plain = run(make(tiny_model, tok, False), {0: [("add", "p", ids(12, 7), greedy(10))]})
    text = plain[1]["p"]
    stop = text[len(text) // 2:len(text) // 2 + 2] or text[:1]
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, stop=[stop])
    a = run(make(tiny_model, tok, False), {0: [("add", "p", ids(12, 7), sp)]})
    b = run(make(tiny_model, tok, True), {0: [("add", "p", ids(12, 7), sp)]})
    assert a[:3] == b[:3]


# ---- scheduler: when a step may be scheduled ahead -------------------------------------------
def _sched(n_req=2, max_tokens=8, **sp_kw):
    ec = EngineConfig(page_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    s = Scheduler(ec, num_pages=40, num_slots=5)
    for i in range(n_req):
        s.add(Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=max_tokens, **sp_kw)))
    out = s.schedule()  # prefill
    s.update(out, ModelOutput({q.request_id: 7 for q in out.seqs}))
    return s


def test_can_schedule_ahead_only_pure_decodes_of_every_running_request():
    s = _sched()
    dec = s.schedule()
    assert s.can_schedule_ahead(dec)
    s.add(Request("new", [1], SamplingParams(max_tokens=4)))  # waiting for admission
    assert not s.can_schedule_ahead(dec)
    assert not _sched(repetition_penalty=1.2).can_schedule_ahead(_sched().schedule())
    pen = _sched(presence_penalty=0.5)
    assert not pen.can_schedule_ahead(pen.schedule())
    last = _sched(max_tokens=2)  # 1 output so far: this step makes the 2nd, the last
    assert not last.can_schedule_ahead(last.schedule())


def test_can_schedule_ahead_needs_pages_for_every_next_token():
    ec = EngineConfig(page_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    s = Scheduler(ec, num_pages=8, num_slots=5)
    s.add(Request("r", [1, 2, 3], SamplingParams(max_tokens=20)))
    out = s.schedule()
    s.update(out, ModelOutput({"r": 7}))  # 4 tokens, 3 cached: page 1 holds positions 0..3
    dec = s.schedule()  # position 3: page 1; the next, position 4, needs page 2
    assert s.can_schedule_ahead(dec)
    s.pages.allocate(s.pages.num_free)
    assert not s.can_schedule_ahead(dec)


def test_advance_resolve_equals_update_and_recompute_preempts():
    a, b = _sched(), _sched()
    da, db = a.schedule(), b.schedule()
    a.update(da, ModelOutput({"r0": 5, "r1": 6}))
    b.advance(db)
    assert [r.output_ids[-1] for r in b.running] == [PENDING_TOKEN] * 2
    ahead = b.schedule()  # decodes of the pending tokens
    assert [q.token_ids for q in ahead.seqs] == [(PENDING_TOKEN,)] * 2
    applied = b.resolve(db, ModelOutput({"r0": 5, "r1": 6}), recompute=frozenset({"r1"}))
    assert [r.request_id for r in applied] == ["r0", "r1"]
    assert a.requests["r0"].output_ids == b.requests["r0"].output_ids == [7, 5]
    r1 = b.requests["r1"]
    assert r1.output_ids == [7, 6] and r1 in b.waiting and r1.num_computed_tokens == 0
    # the launched-ahead step: r1's row is void, r0's is applied
    b.advance(ahead)
    assert [r.request_id for r in b.resolve(ahead, ModelOutput({"r0": 8, "r1": 9}))] == ["r0"]
    assert b.requests["r1"].output_ids == [7, 6]


def test_feed_without_a_previous_step_is_an_error(tiny_model, tok):
    e = make(tiny_model, tok, True)
    seq = ScheduledSeq("z", (PENDING_TOKEN,), 3, 1, False, (1,), True, SamplingParams())
    with pytest.raises(RuntimeError, match="pending token"):
        e.runner.launch(SchedulerOutput((seq,), 1))


def test_nan_fallback_row_fed_ahead_is_recomputed(tiny_model, tok):
    """The sampler's NaN fallback changes a token on the host after the next step was already
    fed the device-side id: that request is recomputed and its outputs are the synchronous
    engine's. Simulated: one row of one launched step is marked bad and its device id (what
    the next step reads) is corrupted; the raw logits' argmax (the fallback) is the right id."""
    script = {0: [("add", "a", ids(10, 21), greedy(14)), ("add", "b", ids(17, 22), greedy(14))]}
    sync = run(make(tiny_model, tok, False), script)
    e = make(tiny_model, tok, True)
    orig = e.runner.launch
    calls = []

    def launch(sched, feed=None):
        out = orig(sched, feed=feed)
        calls.append(feed is not None)
        if sum(calls) == 3:  # the third step launched ahead feeds the fourth: corrupt row 1
            with torch.inference_mode():
                out.sampled.ids[1] = 12345
                out.sampled._both[1, 1] = 1
        return out

    e.runner.launch = launch
    got = run(e, script)
    assert sum(calls) > 3 and got[:3] == sync[:3]


def test_auto_settings_resolve_by_device_and_precision(tiny_ckpt, tiny_fp8_ckpt):
    """--prefill-graphs auto: on on CUDA for bf16 and FP8 (kb/0026), off on the CPU;
    --async-scheduling auto: on CUDA only (the CLI resolves it; see cli.py)."""
    from tailored.stack import build_stack, prefill_graphs_auto

    assert prefill_graphs_auto(torch.device("cuda")) is True
    assert prefill_graphs_auto(torch.device("cpu")) is False
    # no graphs to capture: no activation reserve kept for them
    assert prefill_graphs_auto(torch.device("cuda"), kernels="off") is False
    assert prefill_graphs_auto(torch.device("cuda"), enforce_eager=True) is False

    for ck in (tiny_ckpt, tiny_fp8_ckpt):
        st = build_stack(ck, device="cpu", progress=False, max_model_len=64, max_num_seqs=2,
                         prefill_graphs="auto", async_scheduling=False)
        assert st.engine_config.prefill_graphs is False
        assert st.engine._async is False


def test_cli_async_auto_is_on_only_where_the_engine_runs_on_cuda(monkeypatch):
    from tailored.cli import async_scheduling_on

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine
    assert async_scheduling_on("auto", "/ckpt", "auto") is True
    assert async_scheduling_on("auto", None, "auto") is False  # embedded model: CPU
    assert async_scheduling_on("auto", "/ckpt", "cpu") is False
    assert async_scheduling_on("on", None, "cpu") is True
    assert async_scheduling_on("off", "/ckpt", "auto") is False
