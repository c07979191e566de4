"""Prefix caching under attack (the session-33 review, kb/0053): random scripts against the
same engine with prefix caching off, token for token (sync, async, chunked prefill, small
pools with preemption, one entry, speculative decoding; aborts, reused ids, n > 1), structured
requests on hits, and the three faults the review found, kept as regression tests: a hit
that fits alone was never admitted on a tight pool (its own entry could not be evicted), a
step launched ahead admitted a hit (async scheduling's steps ahead are decodes only), and a
failed launch ahead left such a request running on a state it never got. Helpers from
tests/test_prefix_cache.py."""

from __future__ import annotations

import random

import pytest

from tailored.engine.prefix_cache import MIN_TOKENS
from tailored.engine.types import SamplingParams
from test_prefix_cache import PS, check_idle, cold, greedy, ids, make, run

pytestmark = pytest.mark.usefixtures("one_thread")

IM_START = 248045
SYSTEM = 8678  # "system": `<|im_start|>system` opens a prompt with a system message (lead ids)


@pytest.fixture
def tok(qwen_tok):
    return qwen_tok


def test_a_hit_that_fits_alone_is_admitted_on_a_tight_pool(tiny_model, tok):
    """8 pages of 16 = 128 tokens. a: 70 tokens -> entry of 5 pages (the last partial).
    b = a + 50 tokens, max_tokens 9: needs 8 pages at most (fits alone, check_fits passes).
    Admitting b on the hit needs 4 new pages while the entry keeps its 5: 9 > 8. The review
    found admission kept the hit's own entry, so b waited forever with nothing running; now
    the shared pages are taken first and the entry itself may be evicted."""
    p = ids(70, 21)
    q = p + ids(50, 22)
    e = make(tiny_model, tok, 2, num_pages=9)  # 8 usable pages (page 0 is the pad sink)
    out = run(e, {0: [("a", p, greedy(2))], 6: [("b", q, greedy(9))]}, limit=400)
    ref = run(make(tiny_model, tok, 0, num_pages=9), {0: [("b", q, greedy(9))]}, limit=400)
    assert out["b"] == ref["b"]
    check_idle(e)


# ---- fuzz ------------------------------------------------------------------------------------
def _scenario(seed: int, n_req: int = 10, max_len: int = 300, aborts: bool = True,
              max_new: int = 12):
    """Prompts that extend earlier ones (at their save point, their end, a page boundary, or
    anywhere), some with <|im_start|> boundaries, some opening with a system message that
    later prompts share; random arrival steps and aborts. Returns the
    script and the ids of aborted requests."""
    rng = random.Random(seed)
    prompts = []
    systems = []  # system messages made so far: later chats open with one of them
    script: dict[int, list] = {}
    aborted = set()
    step = 0
    for i in range(n_req):
        kind = rng.random()
        if prompts and kind < 0.75:
            base = rng.choice(prompts)
            how = rng.random()
            if how < 0.3:  # cut before its last boundary (the save point)
                last = max((j for j, t in enumerate(base) if t == IM_START and j >= MIN_TOKENS),
                           default=len(base))
                base = base[:last]
            elif how < 0.45:  # cut at a page boundary
                base = base[:max(MIN_TOKENS, (len(base) // PS) * PS)]
            elif how < 0.55:
                base = base[:rng.randint(MIN_TOKENS - 2, len(base))]
            extra = [rng.randrange(1000, 200000) for _ in range(rng.choice([0, 1, 2, 5, 17, 40]))]
        elif kind < 0.88 and systems:  # a new chat under an earlier system message
            base = rng.choice(systems) + [IM_START] + [rng.randrange(1000, 200000)
                                                      for _ in range(rng.choice([1, 9, 30]))]
            extra = []
        elif kind < 0.94:  # a system message (of MIN_TOKENS - 1 .. 100 ids) then a user's
            sys_ = [IM_START, SYSTEM] + [rng.randrange(1000, 200000) for _ in range(
                rng.choice([MIN_TOKENS - 3, MIN_TOKENS - 2, MIN_TOKENS - 1, 70, 98]))]
            systems.append(sys_)
            base = sys_ + [IM_START] + [rng.randrange(1000, 200000) for _ in range(20)]
            extra = []
        else:
            base = [rng.randrange(1000, 200000)
                    for _ in range(rng.choice([MIN_TOKENS - 1, MIN_TOKENS, MIN_TOKENS + 1, 80, 96, 130]))]
            extra = []
        if rng.random() < 0.4:  # a chat-like tail: a boundary then a few tokens
            extra = extra + [IM_START] + [rng.randrange(1000, 200000)
                                          for _ in range(rng.choice([0, 1, 3, 6]))]
        p = (base + extra)[:max_len]
        if not p:
            p = [5]
        prompts.append(p)
        rid = f"r{i}"
        if rng.random() < 0.15 and i > 0:  # reuse an id of an earlier request (if finished)
            rid = f"r{rng.randrange(i)}"
        step += rng.choice([0, 0, 1, 2, 4, 8])
        script.setdefault(step, []).append((rid, p, greedy(rng.randint(1, max_new))))
        if rng.random() < 0.15:  # n > 1: the same prompt again in the same step
            for c in range(rng.randint(1, 2)):
                script[step].append((f"{rid}x{c}", p, greedy(rng.randint(1, max_new))))
        if aborts and rng.random() < 0.12:
            s = step + rng.randint(0, 6)
            script.setdefault(s, []).append(("abort", rid))
            aborted.add(rid)
    return script, aborted


def run_ids(engine, script, limit=3000, errors=None) -> dict:
    """Like run(), but keyed by (rid, arrival index) so reused ids are kept apart; an add that
    is refused for a duplicate id is skipped (both engines see the same sequence)."""
    out, n = {}, 0
    cur = {}
    k = 0
    while engine.has_unfinished() or n <= max(script):
        for cmd in script.get(n, []):
            if cmd[0] == "abort":
                engine.abort_request(cmd[1])
            else:
                try:
                    engine.add_request(*cmd)
                except ValueError:
                    out[(cmd[0], k, "refused")] = []
                    k += 1
                    continue
                cur[cmd[0]] = (cmd[0], k)
                out[cur[cmd[0]]] = []
                k += 1
        for o in engine.step():
            if errors is not None and o.error is not None:
                errors.add(cur[o.request_id])
                continue
            assert o.error is None, o.error
            out[cur[o.request_id]] += o.delta_token_ids
        n += 1
        assert n < limit, "no progress"
    return out


CONFIGS = {
    "plain": dict(),
    "async": dict(on=True),
    "chunked": dict(budget=40),
    "chunked_async": dict(budget=40, on=True),
    "small_pool": dict(num_pages=26, max_num_seqs=4),
    "small_pool_async_chunked": dict(num_pages=26, max_num_seqs=4, budget=48, on=True),
    "one_entry": dict(entries=1),
    "one_entry_small_pool": dict(entries=1, num_pages=24, budget=64),
    "spec": dict(num_speculative_tokens=2, spec_max_running=8),
    "spec_small_pool_chunked": dict(num_speculative_tokens=2, spec_max_running=8, num_pages=26,
                                    budget=48),
}


def _compare(tiny_model, tok, cfg: dict, seed: int, aborts: bool = True, fail_every=None,
             n_req: int = 10):
    cfg = dict(cfg)
    entries = cfg.pop("entries", 3)
    on = cfg.pop("on", False)
    script, aborted = _scenario(seed, aborts=aborts, n_req=n_req)
    e = make(tiny_model, tok, entries, on, **cfg)
    errors = set()
    if fail_every:
        rng = random.Random(seed)
        real = e.runner.model.forward

        def failing(*a, **kw):
            if rng.random() < fail_every:
                raise RuntimeError("injected")
            return real(*a, **kw)
        e.runner.model.forward = failing
    try:
        got = run_ids(e, script, errors=errors)
    finally:
        if fail_every:
            del e.runner.model.forward  # the model is shared by the reference engine
    ref = run_ids(make(tiny_model, tok, 0, on, **cfg), script)
    # aborted requests' outputs depend on timing, and so does whether a reused id is refused
    skip = {k[0] for k in set(got) | set(ref) if len(k) == 3} | aborted
    bad = {k: (got.get(k), ref.get(k)) for k in set(got) | set(ref)
           if k[0] not in skip and k not in errors and got.get(k) != ref.get(k)}
    check_idle(e)
    return bad, e.scheduler.prefix.hits


# 2 scenarios a config: seed 2 hit less than seed 0 in every config, evicted as often as seed
# 0 or 1 and preempted nowhere (seed 0 holds the one preemption on a hit, one_entry_small_pool)
@pytest.mark.parametrize("cfg", list(CONFIGS), ids=list(CONFIGS))
@pytest.mark.parametrize("seed", range(2))
def test_fuzz_against_prefix_caching_off(tiny_model, tok, cfg, seed):
    bad, hits = _compare(tiny_model, tok, CONFIGS[cfg], seed)
    assert not bad, bad


@pytest.mark.parametrize("on", [False, True], ids=["sync", "async"])
def test_structured_requests_on_hits(tiny_model, tok, on):
    """Structured requests (regex, choice) whose prompts extend earlier prompts, beside plain
    ones: the answers of an engine with prefix caching off."""
    import json

    from tailored.engine.types import StructuredOutput

    digits = StructuredOutput("regex", "[0-9]{3,12}")
    choice = StructuredOutput("choice", json.dumps(["alpha", "beta", "gamma"]))
    base = ids(90, 31)
    reqs = []
    for i in range(8):
        p = base + ids(3 + 11 * i, 40 + i) + ([IM_START] + ids(4, 60 + i) if i % 3 == 0 else [])
        st = [digits, choice, None][i % 3]
        sp = SamplingParams(max_tokens=14, temperature=0.0, structured=st)
        reqs.append((f"s{i}", p, sp))
    script = {0: [reqs[0]], 3: reqs[1:4], 25: [(f"t{i}", r[1] + ids(5, 80 + i), r[2])
                                              for i, r in enumerate(reqs[:3])], 40: reqs[4:]}
    e = make(tiny_model, tok, 3, on, num_pages=64, max_num_seqs=4)
    got = run(e, script)
    ref = run(make(tiny_model, tok, 0, on, num_pages=64, max_num_seqs=4), script)
    assert got == ref
    assert e.scheduler.prefix.hits > 0
    check_idle(e)


def _ahead_scenario(tiny_model, tok, fail: bool):
    """Async scheduling: A decodes; B extends the cached prompt P. Before the review's fix
    `can_schedule_ahead` counted B's first chunk as cdiv(len(B), 16) = 7 pages (more than are
    free) while the admission with the hit needs 1 page, so B was admitted in a step launched
    *ahead*. fail: that launch fails in the model's 4th layer (after 3 GDN layers updated the
    slots)."""
    P = ids(96, 51)
    B = P + ids(10, 52)
    A = ids(20, 53)
    e = make(tiny_model, tok, 2, True, num_pages=13)
    launches = []
    real_launch = e.runner.launch
    layer = e.runner.model.model.layers[3]
    real_layer = layer.forward

    def launch(sched, feed=None):
        rids = [s.request_id for s in sched.seqs]
        launches.append((feed is not None, [(s.request_id, len(s.token_ids)) for s in sched.seqs]))
        if fail and feed is not None and "b" in rids and not getattr(launch, "done", False):
            launch.done = True

            def boom(*a, **kw):
                raise RuntimeError("injected mid-forward")
            layer.forward = boom
            try:
                return real_launch(sched, feed=feed)
            finally:
                del layer.forward
        return real_launch(sched, feed=feed)

    e.runner.launch = launch
    out, errs, n = {}, {}, 0
    script = {0: [("seed", P, greedy(1))], 4: [("a", A, greedy(60))], 8: [("b", B, greedy(8))]}
    while e.has_unfinished() or n <= max(script):
        for cmd in script.get(n, []):
            e.add_request(*cmd)
            out[cmd[0]] = []
        for o in e.step():
            if o.error:
                errs[o.request_id] = o.error
            out[o.request_id] += o.delta_token_ids
        n += 1
        assert n < 500
    del real_layer
    return e, out, errs, launches


def test_no_step_launched_ahead_admits_a_hit(tiny_model, tok):
    e, out, errs, launches = _ahead_scenario(tiny_model, tok, fail=False)
    assert not errs
    assert out["b"] == cold(tiny_model, tok, ids(96, 51) + ids(10, 52), greedy(8), 96)
    check_idle(e)
    ahead_with_b = [r for ahead, r in launches if ahead and any(n > 1 for _, n in r)]
    # the ahead step was meant to hold only the running requests' decodes (kb/0015)
    assert not ahead_with_b, f"steps launched ahead that admit b: {ahead_with_b[:2]}"


def test_a_failed_launch_ahead_leaves_no_request_on_a_state_it_never_got(tiny_model, tok):
    e, out, errs, launches = _ahead_scenario(tiny_model, tok, fail=True)
    B = ids(96, 51) + ids(10, 52)
    ref = cold(tiny_model, tok, B, greedy(8), 96)
    assert "b" in errs or out["b"] == ref, (errs, out["b"], ref)
    check_idle(e)
