"""Async scheduling (kb/0025): runner exceptions in launch or collect fail only their batch
(not a new request that reused a finished id), count only delivered tokens, and leave the
engine usable."""

from __future__ import annotations

import random

import pytest

from tailored.engine.types import FinishReason, SamplingParams
from test_async_fuzz import ids, make, probe_tokens, rand_script, run

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def tok(qwen_tok):
    return qwen_tok


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def test_reused_id_is_not_failed_with_the_void_row_of_its_predecessor(tiny_model, tok):
    """X stops on a stop_token_id at step N while N+1 (with a void X row) is in flight; the
    client reuses the id "X" for a new request (the final output of X was already delivered,
    so add_request accepts it); step N+1's collect raises: Y (in that batch) fails, the *new*
    X, which was never in it, must not (it used to be failed and dropped from the queue)."""
    base = run(make(tiny_model, tok, False), {0: [("add", "X", ids(9, 5), greedy(8))]})
    stop = base["toks"]["X"][3]
    e = make(tiny_model, tok, True)
    e.add_request("X", ids(9, 5), SamplingParams(max_tokens=8, temperature=0.0,
                                                 ignore_eos=True, stop_token_ids=[stop]))
    e.add_request("Y", ids(11, 6), greedy(12))
    done = False
    while not done:
        for o in e.step():
            if o.request_id == "X" and o.finished:
                assert o.finish_reason is FinishReason.STOP
                done = True
    assert e._inflight is not None  # step N+1 with the void X row is in flight
    assert any(s.request_id == "X" for s in e._inflight.sched.seqs)
    # the client reuses the id at once
    e.add_request("X", ids(5, 7), greedy(3))
    orig = e.runner.collect

    def collect(step):
        e.runner.collect = orig
        raise RuntimeError("device error on this batch")

    e.runner.collect = collect
    outs = e.step()
    errs = {o.request_id: o.error for o in outs if o.finished}
    # Y was in the failing batch: ERROR is expected for it. The new X was not in it.
    assert "Y" in errs
    assert "X" not in errs, f"new request X failed for a batch it was never part of: {errs}"


def _collect_raising_once(e, when):
    """collect raises on the `when`-th call (1-based) only."""
    orig = e.runner.collect
    n = [0]

    def collect(step):
        n[0] += 1
        if n[0] == when:
            raise RuntimeError("boom collect")
        return orig(step)

    e.runner.collect = collect


def _launch_raising_once(e, when, fed_only=True):
    orig = e.runner.launch
    n = [0]

    def launch(sched, feed=None):
        if feed is not None or not fed_only:
            n[0] += 1
            if n[0] == when:
                raise RuntimeError("boom launch")
        return orig(sched, feed=feed)

    e.runner.launch = launch


@pytest.mark.parametrize("kind,when", [("collect", 3), ("collect", 6), ("launch", 2),
                                       ("launch", 5), ("launch_any", 4)])
def test_runner_error_fails_that_batch_and_engine_stays_usable(tiny_model, tok, kind, when):
    e = make(tiny_model, tok, True)
    idle = e.stats()
    if kind == "collect":
        _collect_raising_once(e, when)
    elif kind == "launch":
        _launch_raising_once(e, when)
    else:
        _launch_raising_once(e, when, fed_only=False)
    script = {0: [("add", "a", ids(12, 1), greedy(15)), ("add", "b", ids(7, 2), greedy(15))],
              12: [("add", "c", ids(9, 3), greedy(6))]}
    toks, why, err = {}, {}, {}
    n = 0
    while True:
        for cmd in script.get(n, []):
            e.add_request(cmd[1], cmd[2], cmd[3])
            toks[cmd[1]] = []
        if not e.has_unfinished() and n > 12:
            break
        for o in e.step():
            assert o.request_id not in why, f"second final output for {o.request_id}"
            toks[o.request_id] += o.delta_token_ids
            if o.finished:
                why[o.request_id], err[o.request_id] = o.finish_reason, o.error
        n += 1
        assert n < 500
    assert set(why) == {"a", "b", "c"}
    assert why["c"] is FinishReason.LENGTH and len(toks["c"]) == 6, (why, err)
    ref = run(make(tiny_model, tok, False), {0: [("add", "c", ids(9, 3), greedy(6))]})
    assert toks["c"] == ref["toks"]["c"]
    assert e.stats() == idle


@pytest.mark.parametrize("on", [False, True])
def test_error_output_counts_only_delivered_tokens(tiny_model, tok, on):
    """collect raises on a pure decode step: the ERROR output's num_output_tokens equals the
    tokens delivered (the step was advanced, so a PENDING_TOKEN was in output_ids and used to
    be counted)."""
    e = make(tiny_model, tok, on)
    e.add_request("a", ids(12, 1), greedy(15))
    got = []
    for _ in range(4):
        for o in e.step():
            got += o.delta_token_ids
    def boom(*a, **k):
        raise RuntimeError("boom")

    if on:
        e.runner.collect = boom
    else:
        e.runner.execute = boom
    outs = [o for o in e.step() if o.finished]
    assert len(outs) == 1 and outs[0].finish_reason is FinishReason.ERROR
    assert outs[0].num_output_tokens == len(got), (outs[0].num_output_tokens, len(got))


@pytest.mark.parametrize("seed", range(10))
def test_fuzz_runner_errors(tiny_model, tok, seed):
    rng = random.Random(seed)
    common = probe_tokens(tiny_model, tok) if seed == 0 or not hasattr(test_fuzz_runner_errors, "c") else test_fuzz_runner_errors.c
    test_fuzz_runner_errors.c = common
    cfg = rng.choice([dict(), dict(num_pages=14), dict(budget=16, max_num_seqs=3)])
    script, aborted = rand_script(rng, rng.randrange(2, 8), 96, common)
    ref = run(make(tiny_model, tok, False, **cfg), script, eos=common[:2])
    e = make(tiny_model, tok, True, **cfg)
    failed_ids = set()
    ol, oc = e.runner.launch, e.runner.collect
    frng = random.Random(seed + 1000)

    def launch(sched, feed=None):
        if frng.random() < 0.06:
            failed_ids.update(s.request_id for s in sched.seqs)
            raise RuntimeError("launch boom")
        return ol(sched, feed=feed)

    def collect(step):
        if frng.random() < 0.06:
            failed_ids.update(s.request_id for s in step.sched.seqs)
            raise RuntimeError("collect boom")
        return oc(step)

    e.runner.launch, e.runner.collect = launch, collect
    got = run(e, script, eos=common[:2])
    assert got["stats"]["free_pages"] == got["idle"]["free_pages"]
    assert got["stats"]["free_slots"] == got["idle"]["free_slots"]
    assert set(got["why"]) == set(got["toks"])
    for rid, why in got["why"].items():
        if why is FinishReason.ERROR:
            assert rid in failed_ids, rid
            r = ref["toks"][rid]
            assert got["toks"][rid] == r[:len(got["toks"][rid])], rid
        elif rid not in aborted:
            assert got["toks"][rid] == ref["toks"][rid], rid
            assert got["why"][rid] == ref["why"][rid], rid
            assert got["text"][rid] == ref["text"][rid], rid
