"""Speculative decoding with the MTP head (worker/drafter.py, worker/spec_decoding.py, spec §8):
CPU, the nano checkpoint, the plain path (the kernel path: test_kernel_path.py).

The output of a greedy request must not change with drafts (the verify chunk keeps the state
after each token, the scheduler cuts drafts at every limit, the engine emits several tokens a
step); the drafter must be the MTP head of spec §8.1-§8.2 (checked against the training code's
teacher-forced chain); sampling requests never draft and keep their seeded outputs.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
from helpers import stop_id_cases

import tailored
from tailored.config import EngineConfig, ModelConfig
from tailored.engine.scheduler import Scheduler
from tailored.engine.types import FinishReason, Request, SamplingParams
from tailored.model.batch import ForwardBatch, SeqInfo
from tailored.worker.cache import HybridCache
from tailored.worker.drafter import MTPDrafter, accept, emitted
from tailored.stack import build_stack
from tailored.tokenizer import load_tokenizer

NANO = Path(tailored.__file__).parent / "data" / "nano"
pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["def fibonacci(n):", "import os\n\nclass Reader:\n    def __init__(self",
           "for i in range(10):\n", "    return"]


def _stack(n: int, **kw):
    kw.setdefault("max_model_len", 512)
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("async_scheduling", False)
    kw.setdefault("spec_max_running", 8)  # the tests run several drafting requests at once
    return build_stack(NANO, device="cpu", dtype="float32", progress=False, kernels="off",
                       num_speculative_tokens=n, **kw)


def _run(engine, reqs):
    """reqs: {id: (prompt ids, SamplingParams)} → ({id: output ids}, {id: finish reason},
    {id: text}, engine steps)."""
    for rid, (ids, sp) in reqs.items():
        engine.add_request(rid, ids, sp)
    out, why, text, steps = {}, {}, {}, 0
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.delta_token_ids)
            text[o.request_id] = text.get(o.request_id, "") + o.delta_text
            assert o.num_output_tokens == len(out[o.request_id])
            if o.finished:
                why[o.request_id] = o.finish_reason
        steps += 1
        assert steps < 10_000
    return out, why, text, steps


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(NANO)


@pytest.fixture(scope="module")
def plain(tok):
    """Outputs without drafts: 48 greedy tokens per prompt."""
    eng = _stack(0).engine
    reqs = {f"g{i}": (tok.encode(p), SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))
            for i, p in enumerate(PROMPTS)}
    return _run(eng, reqs)


# ---- acceptance rule ---------------------------------------------------------------------------
def test_accept_greedy_prefix():
    assert accept([5, 6, 7], [5, 6, 9, 1]) == 2
    assert accept([5, 6, 7], [5, 6, 7, 1]) == 3
    assert accept([5, 6, 7], [4, 6, 7, 1]) == 0
    assert emitted([5, 6, 7], [5, 6, 9, 1], 2, False) == [5, 6, 9]
    assert emitted([5, 6, 7], [4, 6, 7, 1], 0, False) == [4]
    with pytest.raises(ValueError, match="target tokens"):
        accept([1, 2], [1, 2])


def test_accept_synthetic_rates():
    rng = random.Random(1)
    assert accept([5, 6, 7], [0, 0, 0, 0], 1.0, rng) == 3
    assert accept([5, 6, 7], [5, 6, 7, 0], 0.0, rng) == 0
    # synthetic: the kept drafts, then the target's token after them
    assert emitted([5, 6, 7], [0, 1, 2, 3], 2, True) == [5, 6, 2]
    kept = [accept([1], [1, 1], 0.8, rng) for _ in range(4000)]
    assert abs(sum(kept) / len(kept) - 0.8) < 0.03


# ---- the verify chunk's GDN states -------------------------------------------------------------
def test_verify_chunk_commits_the_state_of_its_kept_prefix():
    """A keep_states chunk of 4 tokens committed at k tokens leaves the GDN state (and gives the
    hidden rows) that k one-token decode steps give; KV rows past k are left behind unread."""
    st = _stack(0)
    model = st.engine.runner.model
    cfg = model.config
    cache_a = HybridCache(cfg, 16, 16, 3, torch.float32, "cpu")
    cache_b = HybridCache(cfg, 16, 16, 3, torch.float32, "cpu")
    prompt = load_tokenizer(NANO).encode(PROMPTS[1])
    L = len(prompt)
    pages = [1, 2, 3]
    for c in (cache_a, cache_b):
        model(ForwardBatch.build([(prompt, 0, 1, True, pages)], [L - 1], "cpu"), c)
    chunk = [17, 230, 5, 99]
    h_chunk = model(ForwardBatch.build([(chunk, L, 1, False, pages, True)], [], "cpu"), cache_a)
    for k in (1, 2, 3, 4):
        ca = HybridCache(cfg, 16, 16, 3, torch.float32, "cpu")
        for name in ("k", "v", "conv", "rec"):
            getattr(ca, name).copy_(getattr(cache_a, name))
        ca.kept_states = {key: list(v) for key, v in cache_a.kept_states.items()}
        ca.commit_states(1, k)
        cb = HybridCache(cfg, 16, 16, 3, torch.float32, "cpu")
        for name in ("k", "v", "conv", "rec"):
            getattr(cb, name).copy_(getattr(cache_b, name))
        for j in range(k):
            h = model(ForwardBatch.build([([chunk[j]], L + j, 1, False, pages)], [], "cpu"), cb)
            torch.testing.assert_close(h[0], h_chunk[j], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ca.conv[:, 1], cb.conv[:, 1], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ca.rec[:, 1], cb.rec[:, 1], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="tokens of a 4-token chunk"):
        cache_a.commit_states(1, 5)
    cache_a.kept_states.clear()
    with pytest.raises(KeyError):
        cache_a.commit_states(1, 1)


# ---- the drafter -------------------------------------------------------------------------------
def test_drafter_matches_the_training_chain():
    """MTPDrafter.propose from rows 0..t equals lab/nano/evaluate.py's teacher-forced drafts
    of position t (drafts 1-3, spec §8.1-§8.2), which test_nano checks against brute force."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "lab"))
    from nano import evaluate as ev

    st = _stack(3)
    model = st.engine.runner.model
    ids = load_tokenizer(NANO).encode(PROMPTS[1] + "):\n        self.path = path\n")[:40]
    seq = torch.tensor([ids])
    with torch.no_grad():
        want, _ = ev.mtp_drafts(model, seq, 3)
        cache = HybridCache(model.config, 8, 16, 2, torch.float32, "cpu", mtp_layers=1)
        hidden = model(ForwardBatch.build([(ids, 0, 1, True, [1, 2, 3, 4])], [], "cpu"), cache)
    from tailored.worker.drafter import DraftRow

    drafter = MTPDrafter(model, cache)
    assert len(ids) > 12
    for t in (0, 5, len(ids) // 2, len(ids) - 2):
        rows = [DraftRow(SeqInfo(0, t + 1, 0, 1, False, [1, 2, 3, 4]), ids[1:t + 2], 3)]
        got = drafter.propose(hidden, rows)
        assert got == [want[0, t].tolist()], t
    with pytest.raises(ValueError, match="next ids"):
        drafter.propose(hidden, [DraftRow(SeqInfo(0, 3, 0, 1, False, [1]), [1, 2], 1)])


def test_drafter_needs_the_mtp_head():
    # without MTP drafts the head is not even loaded (a whole MoE layer at full size)
    assert _stack(0).engine.runner.model.mtp is None
    st = _stack(3)
    model = st.engine.runner.model
    mtp, model.mtp = model.mtp, None
    cache = HybridCache(model.config, 4, 16, 2, torch.float32, "cpu", mtp_layers=1)
    try:
        with pytest.raises(ValueError, match="MTP head"):
            MTPDrafter(model, cache)
    finally:
        model.mtp = mtp
    with pytest.raises(ValueError, match="holds no MTP layer"):
        MTPDrafter(model, HybridCache(model.config, 4, 16, 2, torch.float32, "cpu"))
    assert cache.k.shape[0] == len(model.config.attn_layers) + 1
    assert cache.attn_index[model.config.num_hidden_layers] == len(model.config.attn_layers)


# ---- the engine --------------------------------------------------------------------------------
@pytest.mark.contract("spec-greedy-equals-plain")
@pytest.mark.parametrize("n", [1, 2, 3])
def test_greedy_output_unchanged_by_drafts(plain, tok, n):
    # fixed draft lengths (no adaptive pace): the kept share below measures the MTP head
    eng = _stack(n, spec_min_acceptance=0).engine
    reqs = {f"g{i}": (tok.encode(p), SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))
            for i, p in enumerate(PROMPTS)}
    out, why, text, steps = _run(eng, reqs)
    assert out == plain[0]
    assert text == plain[2]
    assert all(w is FinishReason.LENGTH for w in why.values())
    verify, drafted, kept = eng.runner.spec_stats
    # the trained nano head keeps ~0.8 of first drafts (docs/nano.md: 0.814)
    assert drafted > 0 and kept / verify > 0.6 * min(n, 2)
    assert steps < plain[3] * 0.75
    # the step timing names verify steps and their draft phase (the MTP after the tokens)
    kinds = eng.timer.kinds
    assert "verify" in kinds and kinds["verify"].ms["draft"] > 0


def test_sampling_requests_do_not_draft_and_keep_their_seeded_output(tok):
    """failure-cases §4 (MTP with batch > 2 and temperature > 0 corrupting tokens): seeded
    sampling requests beside drafting greedy ones, 6 at once, give the tokens they give
    without speculation (a stronger check than matching distributions: they never draft)."""
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    reqs = {"p": (tok.encode(PROMPTS[2]), SamplingParams(
        max_tokens=24, temperature=0, repetition_penalty=1.3, ignore_eos=True))}
    for i in range(3):
        reqs[f"s{i}"] = (tok.encode(PROMPTS[i]), SamplingParams(
            max_tokens=24, temperature=0.8, top_p=0.9, seed=7 + i, ignore_eos=True))
    for i in (1, 3):
        reqs[f"g{i}"] = (tok.encode(PROMPTS[i]), greedy)
    base = _run(_stack(0).engine, reqs)[0]
    eng = _stack(2).engine
    got = _run(eng, reqs)[0]
    assert got == base
    assert eng.runner.spec_stats[0] > 0


@pytest.mark.contract("stops-and-usage")
def test_stops_at_every_position_of_an_accepted_block(plain, tok):
    """failure-cases §5: a stop token id at each of the first 16 output positions, with
    max_tokens just below, at and above it, and stop strings ending at several positions: the
    engine with 3 drafts a step ends each request exactly where the plain engine does (ids,
    text, finish reason; usage = the ids returned, checked in _run), nothing after a stop."""
    ref = plain[0]["g0"]
    ids = tok.encode(PROMPTS[0])
    reqs = stop_id_cases(ids, ref, 16)
    text = tok.decode(ref)
    for k, end in enumerate(range(6, len(text), max(1, len(text) // 12))):
        reqs[f"str{k}"] = (ids, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True,
                                               stop=[text[end - 3:end]]))
    engines = (_stack(0).engine, _stack(3).engine)
    for rid, (p, sp) in reqs.items():  # one at a time: every request drafts
        want, got = (_run(e, {rid: (p, sp)}) for e in engines)
        assert got[:3] == want[:3], rid
        if rid.startswith("id"):
            cut, mt = map(int, rid[2:].split("-"))
            assert got[0][rid] == ref[:min(cut + 1, mt)], rid
    assert engines[1].runner.spec_stats[2] > 0


@pytest.mark.contract("spec-greedy-equals-plain")
def test_preemption_and_recompute_with_drafts(plain, tok):
    """A KV pool too small for all four requests at once: preempted requests recompute and
    draft again; outputs unchanged."""
    reqs = {f"g{i}": (tok.encode(p), SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))
            for i, p in enumerate(PROMPTS)}
    eng = _stack(2, num_pages=12, max_model_len=96).engine
    out = _run(eng, reqs)[0]
    assert eng.scheduler.num_preemptions > 0
    assert out == plain[0]


def test_synthetic_acceptance_keeps_the_rate():
    reqs = lambda: {"a": ([1, 2, 3, 4], SamplingParams(max_tokens=41, temperature=0,  # noqa: E731
                                                       ignore_eos=True))}
    eng = _stack(2, spec_synthetic_acceptance=1.0).engine
    out, _, _, steps = _run(eng, reqs())
    assert len(out["a"]) == 41
    assert steps <= 15  # a prefill step, then 3 tokens a step
    eng = _stack(2, spec_synthetic_acceptance=0.0).engine
    out, _, _, steps = _run(eng, reqs())
    assert len(out["a"]) == 41 and eng.runner.spec_stats[2] == 0


# ---- the scheduler's drafts --------------------------------------------------------------------
def _sched(n=2, **kw) -> Scheduler:
    ec = EngineConfig(num_speculative_tokens=n, max_num_batched_tokens=kw.pop("budget", 64),
                      max_model_len=kw.pop("max_model_len", 256), **kw)
    return Scheduler(ec, num_pages=kw.get("num_pages") or 64, num_slots=9)


def test_scheduler_cuts_drafts_at_max_tokens_and_budget():
    s = _sched(3, budget=3)
    req = Request("r", [1] * 2, SamplingParams(max_tokens=4, temperature=0))
    s.add(req)
    out = s.schedule()
    assert out.seqs[0].mtp and out.seqs[0].num_propose == 2  # max_tokens 4: 1 now, 1 + 2 next
    s.advance(out)
    from tailored.engine.types import ModelOutput

    s.resolve(out, ModelOutput({"r": 7}, draft_ids={"r": (8, 9)}))
    out = s.schedule()
    seq = out.seqs[0]
    assert seq.token_ids == (7, 8, 9) and seq.num_draft == 2
    s.advance(out)
    s.resolve(out, ModelOutput({"r": 8}, extra_ids={"r": (9,)}, draft_ids={"r": (3, 4, 5)}))
    assert req.output_ids == [7, 8, 9] and req.num_computed_tokens == 4
    out = s.schedule()  # one token left: no drafts
    assert out.seqs[0].token_ids == (9,) and out.seqs[0].num_draft == 0
    assert out.seqs[0].num_propose == 0
    # the step budget: 2 tokens leave room for one draft
    s = _sched(3, budget=2)
    s.add(Request("q", [1], SamplingParams(max_tokens=20, temperature=0)))
    out = s.schedule()
    s.advance(out)
    s.resolve(out, ModelOutput({"q": 7}, draft_ids={"q": (8, 9, 10)}))
    assert s.schedule().seqs[0].token_ids == (7, 8)


def test_scheduler_no_drafts_for_sampling_or_when_off():
    s = _sched(2)
    s.add(Request("t", [1] * 4, SamplingParams(max_tokens=8, temperature=0.7)))
    assert not s.schedule().seqs[0].mtp
    s = _sched(0)
    s.add(Request("g", [1] * 4, SamplingParams(max_tokens=8, temperature=0)))
    assert not s.schedule().seqs[0].mtp


def test_bad_settings():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        _stack(9)
    with pytest.raises(ValueError, match="synthetic_acceptance"):
        _stack(1, spec_synthetic_acceptance=1.5)
    assert ModelConfig.from_dir(NANO).mtp_num_hidden_layers == 1


# ---- regressions of the session-14 review ------------------------------------------------------
def test_no_stale_drafts_after_a_preemption_lets_a_request_draft_again(tok):
    """A request that did not draft (more than spec_max_running running) keeps no drafts; when
    a preemption in the same schedule brings the count down, the step launched ahead (async
    scheduling) must not verify stale drafts behind a pending token (it fed id -1 to the
    embedding). Scheduler level, then the engine with async scheduling."""
    from tailored.engine.scheduler import PENDING_TOKEN
    from tailored.engine.types import ModelOutput

    ec = EngineConfig(page_size=4, num_speculative_tokens=1, spec_max_running=2,
                      max_num_batched_tokens=64, max_model_len=64, max_num_seqs=4)
    s = Scheduler(ec, num_pages=4, num_slots=5)  # 3 usable pages
    g = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    t = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    for rid, p, sp in (("A", [11], g), ("S", [12] * 4, t), ("G", [13] * 4, g)):
        s.add(Request(rid, p, sp))
    o1 = s.schedule()
    s.update(o1, ModelOutput({"A": 1, "S": 2, "G": 3}, draft_ids={"A": (5,)}))
    o2 = s.schedule()
    assert s.num_preemptions == 1 and not s.requests["A"].draft_ids
    # A drafts at its next step, so that step waits for o2's token (Drafting.wants_sync); were
    # it launched ahead anyway, it would verify no drafts behind the pending token
    assert not s.can_schedule_ahead(o2)
    s.advance(o2)
    for q in s.schedule().seqs:
        assert q.num_draft == 0 and not q.mtp and PENDING_TOKEN in q.token_ids
    eng = _stack(1, spec_max_running=2, page_size=4, num_pages=4, max_model_len=64,
                 max_num_seqs=4, async_scheduling=True).engine
    reqs = {"A": ([11], g), "S": ([12] * 4, SamplingParams(max_tokens=8, temperature=1.0,
                                                            seed=1, ignore_eos=True)),
            "G": ([13] * 4, g)}
    out, why, _, _ = _run(eng, reqs)
    assert all(w is FinishReason.LENGTH for w in why.values()) and len(why) == 3


def test_mtp_cache_filled_by_prompt_chunks_that_do_not_sample(tok):
    """A prompt longer than the step budget: its first chunks sample nothing, and the MTP
    still writes its KV for every prompt position (spec §8.1)."""
    eng = _stack(2, max_num_batched_tokens=16).engine
    ids = tok.encode("def fibonacci(n):\n    if n < 2:\n        return n\n    return "
                     "fibonacci(n - 1) + fibonacci(n - 2)\n\nclass Reader:\n")
    assert len(ids) > 40
    eng.add_request("a", ids, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    cache = eng.runner.cache
    mi = cache.attn_index[eng.runner.model.config.num_hidden_layers]
    pages = None
    while eng.has_unfinished():
        req = eng.scheduler.requests.get("a")
        pages = list(req.pages) if req else pages
        eng.step()
    ps = cache.page_size
    for p in range(len(ids)):
        assert cache.k[mi, pages[p // ps], p % ps].abs().sum() > 0, p


def test_chain_pages_never_take_a_newer_requests_pages():
    """The MTP chain's extra pages come after every request of the step has its chunk's pages:
    an admission that fits without them is not blocked by them."""
    from tailored.engine.types import ModelOutput

    ec = EngineConfig(page_size=4, num_speculative_tokens=3, max_num_batched_tokens=64,
                      max_model_len=64, max_num_seqs=4)
    s = Scheduler(ec, num_pages=5, num_slots=5)  # 4 usable pages
    s.add(Request("A", [1] * 3, SamplingParams(max_tokens=10, temperature=0)))
    o = s.schedule()  # A's 3-token prompt: 1 page, and the chain's page as it is free
    assert o.seqs[0].num_propose == 3 and len(s.requests["A"].pages) == 2
    s.update(o, ModelOutput({"A": 7}, draft_ids={"A": (8, 9, 10)}))
    s.add(Request("B", [2] * 8, SamplingParams(max_tokens=4, temperature=0.5)))
    o = s.schedule()
    assert [q.request_id for q in o.seqs] == ["A", "B"] and s.num_preemptions == 0
    assert len(s.requests["B"].pages) == 2 and s.pages.num_free == 0
    a = o.seqs[0]
    # A's verify chunk at positions 3..6 holds its pages; no page was left for a longer chain
    assert a.num_draft == 3 and a.num_propose == len(a.page_ids) * 4 - (a.start_pos + 4) + 1


def test_commit_many_equals_commit_states_one_by_one():
    """HybridCache.commit_many (one gather and scatter per state from a verify graph's
    snapshots) leaves the states commit_states leaves slot by slot, clears kept_batch, and
    raises the same ValueError for a length outside the chunk."""
    cfg = _stack(0).engine.runner.model.config
    g = torch.Generator().manual_seed(5)
    n, B = 3, 3

    def fresh():
        c = HybridCache(cfg, 4, 16, 5, torch.float32, "cpu")
        c.conv.copy_(torch.randn(c.conv.shape, generator=torch.Generator().manual_seed(1)))
        c.rec.copy_(torch.randn(c.rec.shape, generator=torch.Generator().manual_seed(2)))
        return c

    G = fresh().conv.shape[0]
    snap_c = torch.randn((G, n - 1, B) + tuple(fresh().conv.shape[2:]), generator=g)
    snap_r = torch.randn((G, n - 1, B) + tuple(fresh().rec.shape[2:]), generator=g)
    commits = {4: 1, 2: 3, 1: 2}  # slot -> tokens kept; 3 = the whole chunk: state in place
    a, b = fresh(), fresh()
    for c in (a, b):
        c.kept_batch = (snap_c, snap_r, {4: 0, 2: 1, 1: 2}, n)
    a.commit_many(commits)
    for slot, k in commits.items():
        b.commit_states(slot, k)
    assert a.kept_batch is None and b.kept_batch is None
    assert torch.equal(a.conv, b.conv) and torch.equal(a.rec, b.rec)
    assert torch.equal(a.rec[:, 4], snap_r[:, 0, 0]) and torch.equal(a.rec[:, 1], snap_r[:, 1, 2])
    a.kept_batch = (snap_c, snap_r, {4: 0}, n)
    with pytest.raises(ValueError, match="tokens of a 3-token chunk"):
        a.commit_many({4: 4})

