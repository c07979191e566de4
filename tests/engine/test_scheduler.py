"""Scheduler decisions with hand-built model outputs (no model, no torch)."""

from __future__ import annotations

import random

import pytest

from tailored.config import EngineConfig
from tailored.engine.scheduler import Scheduler
from tailored.engine.types import (
    FinishReason,
    ModelOutput,
    Request,
    RequestStatus,
    SamplingParams,
)

EOS = (62, 63)


def make(page_size=4, max_num_seqs=8, budget=64, max_model_len=1024, num_pages=64, num_slots=9):
    cfg = EngineConfig(
        page_size=page_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
    )
    return Scheduler(cfg, num_pages=num_pages, num_slots=num_slots)


def req(rid, n_prompt=5, max_tokens=8, **sp):
    prompt = [(sum(map(ord, rid)) + i) % 50 for i in range(n_prompt)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **sp), eos_token_ids=EOS)


def token_of(seq) -> int:
    """A deterministic non-EOS token for a sampling sequence."""
    return (seq.start_pos * 7 + len(seq.token_ids) + len(seq.request_id)) % 50


def step(s: Scheduler, token_fn=token_of):
    out = s.schedule()
    check_invariants(s, out)
    finished = s.update(out, ModelOutput({q.request_id: token_fn(q) for q in out.seqs if q.sample}))
    check_invariants(s)
    return out, finished


def check_invariants(s: Scheduler, out=None):
    s.pages.check_integrity()
    s.slots.check_integrity()
    owned_pages = [p for r in s.running for p in r.pages]
    assert len(owned_pages) == len(set(owned_pages)) == s.pages.num_used
    assert 0 not in owned_pages
    slots = [r.slot for r in s.running]
    assert len(slots) == len(set(slots)) == s.slots.num_used and 0 not in slots
    assert len(s.running) <= s.max_running
    for r in s.running:
        assert r.status is RequestStatus.RUNNING
    for r in s.waiting:
        assert r.status is RequestStatus.WAITING and not r.pages and r.slot == 0
        assert r.num_computed_tokens == 0
    if out is not None:
        assert out.num_tokens <= s.config.max_num_batched_tokens
        assert out.num_tokens == sum(len(q.token_ids) for q in out.seqs)
        assert len({q.request_id for q in out.seqs}) == len(out.seqs)
        for q in out.seqs:
            end = q.start_pos + len(q.token_ids)
            assert len(q.page_ids) == -(-end // s.page_size)
            assert q.reset_state == (q.start_pos == 0)
            r = s.requests[q.request_id]
            assert q.sample == (end == r.num_tokens)
            assert list(q.token_ids) == r.all_ids[q.start_pos : end]


def drain(s: Scheduler, token_fn=token_of, max_steps=10_000):
    steps = 0
    while s.has_unfinished():
        step(s, token_fn)
        steps += 1
        assert steps < max_steps, "no progress"
    assert s.pages.num_free == s.pages.capacity and s.slots.num_free == s.slots.capacity
    return steps


def test_chunked_prefill_only_last_chunk_samples():
    s = make(budget=4)
    r = req("a", n_prompt=10, max_tokens=2)
    s.add(r)
    chunks = []
    for _ in range(3):
        out, _ = step(s)
        (q,) = out.seqs
        chunks.append((q.start_pos, len(q.token_ids), q.sample, q.reset_state, len(q.page_ids)))
    assert chunks == [(0, 4, False, True, 1), (4, 4, False, False, 2), (8, 2, True, False, 3)]
    assert len(r.output_ids) == 1 and r.num_computed_tokens == 10
    out, finished = step(s)  # decode: the last sampled token at position 10
    (q,) = out.seqs
    assert (q.start_pos, q.token_ids, q.sample) == (10, (r.output_ids[0],), True)
    assert finished == [r] and r.finish_reason is FinishReason.LENGTH
    assert s.pages.num_free == s.pages.capacity


def test_decodes_come_first_then_prefill_within_budget():
    s = make(budget=8)
    a = req("a", n_prompt=3)
    s.add(a)
    step(s)  # a prefilled, now decoding
    b, c = req("b", n_prompt=20), req("c", n_prompt=2)
    s.add(b)
    s.add(c)
    out = s.schedule()
    assert [q.request_id for q in out.seqs] == ["a", "b"]
    assert len(out.seqs[0].token_ids) == 1 and len(out.seqs[1].token_ids) == 7
    assert out.num_tokens == 8  # c waits: no budget left


def test_budget_smaller_than_max_num_seqs_bounds_the_batch():
    s = make(budget=2, max_num_seqs=4)
    reqs = [req(f"r{i}", n_prompt=1, max_tokens=4) for i in range(4)]
    for r in reqs:
        s.add(r)
    while s.has_unfinished():
        out, _ = step(s)
        assert out.num_tokens <= 2 and len(s.running) <= 2  # decodes alone fill the budget
    assert all(len(r.output_ids) == 4 for r in reqs)


def test_max_num_seqs_and_slots_bound_running():
    s = make(max_num_seqs=2)
    for i in range(4):
        s.add(req(f"r{i}", max_tokens=3))
    out, _ = step(s)
    assert len(out.seqs) == 2 and len(s.running) == 2 and len(s.waiting) == 2
    drain(s)

    s = make(num_slots=2)  # one usable slot: requests run one at a time
    for i in range(3):
        s.add(req(f"r{i}", max_tokens=2))
    while s.has_unfinished():
        out, _ = step(s)
        assert len(s.running) <= 1
    assert s.slots.num_free == 1


def test_admission_waits_for_pages_fifo_and_everything_finishes():
    s = make(page_size=4, num_pages=5, budget=64)  # 4 usable pages = 16 tokens
    big, small = req("big", n_prompt=12, max_tokens=4), req("small", n_prompt=2, max_tokens=2)
    s.add(big)
    s.add(small)
    out, _ = step(s)
    # big takes 3 pages; small's 1 page fits too
    assert [q.request_id for q in out.seqs] == ["big", "small"]
    s2 = make(page_size=4, num_pages=4)
    first, second = req("1", n_prompt=8, max_tokens=4), req("2", n_prompt=8, max_tokens=4)
    third = req("3", n_prompt=1)
    for r in (first, second, third):
        s2.add(r)
    out, _ = step(s2)
    # "2" does not fit; "3" would, but FIFO: the head blocks the queue
    assert [q.request_id for q in out.seqs] == ["1"]
    assert [r.request_id for r in s2.waiting] == ["2", "3"]
    drain(s2)
    assert all(r.finish_reason is FinishReason.LENGTH for r in (first, second, third))


def test_request_larger_than_pool_is_rejected():
    s = make(page_size=4, num_pages=3)  # 2 usable pages
    with pytest.raises(ValueError, match="KV pages"):
        s.add(req("x", n_prompt=8, max_tokens=2))
    s.add(req("ok", n_prompt=8, max_tokens=1))  # the last sampled token needs no page


def test_decode_growth_preempts_newest_and_recomputes():
    s = make(page_size=4, num_pages=5, budget=64)  # 4 usable pages
    old, new = req("old", n_prompt=4, max_tokens=8), req("new", n_prompt=4, max_tokens=8)
    s.add(old)
    s.add(new)
    step(s)  # both prefilled: 1 page each, 1 token sampled each
    step(s)  # decode at position 4: a second page each -> pool empty
    assert s.pages.num_free == 0
    for _ in range(3):
        step(s)  # positions 5..7 fit in the second page
    out, _ = step(s)  # position 8 needs a third page: "new" (newest) is preempted
    assert [q.request_id for q in out.seqs] == ["old"]
    assert new.status is RequestStatus.WAITING and new.num_computed_tokens == 0
    assert new.pages == [] and new.slot == 0 and s.waiting[0] is new
    assert s.num_preemptions == 1
    n_out = len(new.output_ids)
    assert n_out == 5
    drain(s)
    assert old.finish_reason is new.finish_reason is FinishReason.LENGTH
    assert len(new.output_ids) == 8


def test_recompute_is_chunked_and_samples_only_after_all_known_tokens():
    s = make(page_size=4, budget=4, num_pages=64)
    r = req("r", n_prompt=3, max_tokens=20)
    s.add(r)
    for _ in range(6):
        step(s)
    known = list(r.all_ids)
    s._preempt(r)  # as pages running out would
    assert r.num_computed_tokens == 0 and r.num_tokens == len(known) == 9
    seen = []
    while True:
        out, _ = step(s)
        (q,) = out.seqs
        seen.append((q.start_pos, len(q.token_ids), q.sample, q.reset_state, q.num_generated))
        if q.sample:
            break
    assert seen == [(0, 4, False, True, 6), (4, 4, False, False, 6), (8, 1, True, False, 6)]
    assert r.output_ids[:6] == known[3:] and len(r.output_ids) == 7  # one new token, not two


def test_stop_order_eos_beats_max_tokens_and_stop_token_ids():
    s = make()
    a = req("a", max_tokens=1)
    b = req("b", max_tokens=5, stop_token_ids=[7])
    c = req("c", max_tokens=2, ignore_eos=True)
    for r in (a, b, c):
        s.add(r)
    fixed = {"a": 62, "b": 7, "c": 63}
    _, finished = step(s, lambda q: fixed[q.request_id])
    assert a.finish_reason is FinishReason.STOP  # EOS on the max_tokens token: stop, not length
    assert b.finish_reason is FinishReason.STOP
    assert c.status is RequestStatus.RUNNING  # EOS ignored
    _, finished = step(s, lambda q: fixed[q.request_id])
    assert finished == [c] and c.finish_reason is FinishReason.LENGTH
    assert c.output_ids == [63, 63]


def test_max_model_len_finishes_with_length():
    s = make(max_model_len=8)
    r = req("r", n_prompt=6, max_tokens=100)
    s.add(r)
    drain(s)
    assert r.finish_reason is FinishReason.LENGTH and r.num_tokens == 8


def test_abort_frees_at_once_and_update_skips_aborted():
    s = make()
    a, b, w = req("a"), req("b"), req("w")
    s.add(a)
    s.add(b)
    step(s)
    out = s.schedule()
    assert s.abort("a") is a and a.finish_reason is FinishReason.ABORT
    assert a.pages == [] and a.slot == 0
    s.update(out, ModelOutput({q.request_id: 1 for q in out.seqs}))  # "a" silently skipped
    assert len(a.output_ids) == 1 and len(b.output_ids) == 2
    s.add(w)
    assert s.abort("w") is w and not s.waiting
    assert s.abort("nope") is None
    s.abort("b")
    assert s.pages.num_free == s.pages.capacity and s.slots.num_free == s.slots.capacity


def test_penalty_ids_filled_only_when_used():
    s = make()
    s.add(req("plain"))
    s.add(req("rep", repetition_penalty=1.2))
    s.add(req("freq", frequency_penalty=0.5))
    step(s)
    out = s.schedule()
    by_id = {q.request_id: q for q in out.seqs}
    assert by_id["plain"].prompt_ids == () and by_id["plain"].output_ids == ()
    assert by_id["rep"].prompt_ids and len(by_id["rep"].output_ids) == 1
    assert by_id["freq"].prompt_ids == () and len(by_id["freq"].output_ids) == 1
    assert all(q.num_generated == 1 for q in out.seqs)


@pytest.mark.parametrize("seed", range(4), ids=lambda i: f"seed{i}")
def test_random_load_small_pools_no_leak(seed):
    rng = random.Random(seed)
    s = make(page_size=4, num_pages=12, num_slots=5, max_num_seqs=4, budget=rng.choice([3, 8, 32]))
    reqs = []
    for i in range(30):
        r = req(f"r{i}", n_prompt=rng.randint(1, 20), max_tokens=rng.randint(1, 16))
        reqs.append(r)
        s.add(r)

    def token_fn(q):  # occasional EOS
        return 62 if (q.start_pos * 31 + len(q.request_id)) % 17 == 0 else 5

    steps = 0
    while s.has_unfinished():
        step(s, token_fn)
        steps += 1
        if steps % 7 == 0 and s.running and rng.random() < 0.3:
            s.abort(rng.choice(s.running).request_id)
        assert steps < 5000
    assert s.pages.num_free == s.pages.capacity and s.slots.num_free == s.slots.capacity
    assert all(r.status is RequestStatus.FINISHED for r in reqs)
    for r in reqs:
        if r.finish_reason is FinishReason.LENGTH:
            assert len(r.output_ids) == r.sampling.max_tokens
