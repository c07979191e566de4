"""Prefix caching (engine/prefix_cache.py): failure-cases §3 — a cache hit must decode exactly
as a cold run (the GDN state taken at the right position, the KV pages shared or copied
right), the hit rate must be reported and non-zero when prefixes repeat, and no page or slot
may leak through eviction, preemption, abort or a failed step.

The index alone (pure Python), then the real engine and runner on the tiny model (CPU plain
path, fp32), synchronous and with async scheduling.
"""

from __future__ import annotations

import pytest
import torch

from tailored.config import EngineConfig
from tailored.engine.engine import Engine
from tailored.engine.memory import PagePool
from tailored.engine.prefix_cache import MIN_TOKENS, PrefixCache
from tailored.engine.types import SamplingParams
from tailored.worker.runner import ModelRunner

pytestmark = pytest.mark.usefixtures("one_thread")

PS = 16


# ---- the index -------------------------------------------------------------------------------
def _made(pc: PrefixCache, pool: PagePool, rid: str, ids: list[int]):
    """An entry for ids as the scheduler makes one: the request's pages, a snapshot, commit;
    the request then frees its own pages (the entry keeps its references)."""
    pages = pool.allocate(-(-len(ids) // PS) + 1)  # one page more, as a decoding request has
    snap = pc.reserve(rid, ids, slot=1, pages=pages)
    if snap is not None:
        pc.commit(snap)
    pool.free(pages)
    pc.forget(rid)
    return snap


def test_lookup_finds_the_longest_whole_earlier_prompt_that_leaves_a_token_to_run():
    pool = PagePool(64)
    pc = PrefixCache(PS, range(10, 14), pool)
    a = list(range(1000, 1000 + 100))  # 6 full pages + 4
    b = a + list(range(5000, 5030))
    assert _made(pc, pool, "a", a) is not None
    assert _made(pc, pool, "b", b) is not None
    assert len(pc) == 2
    # extends b: b is found; extends a only: a; a itself: none (its last token must run)
    hit = pc.lookup("q1", b + [7, 8])
    assert hit.length == len(b)
    assert pc.lookup("q2", a + [1, 2, 3]).length == len(a)
    assert pc.lookup("q3", a) is None
    assert pc.lookup("q4", a[:99] + [1] + b[100:]) is None  # differs in a's tail
    assert pc.lookup("q5", [1] + a[1:] + [2]) is None  # differs in a full page
    # the entry's pages: ceil(len / 16), each held once by it
    assert len(hit.pages) == -(-len(b) // PS)
    assert all(pool.refs(p) >= 1 for p in hit.pages)
    pc.check_integrity()
    pool.check_integrity()


def test_short_prompts_duplicates_and_lru_eviction():
    pool = PagePool(256)
    pc = PrefixCache(PS, range(10, 12), pool)  # two snapshot slots
    assert _made(pc, pool, "s", list(range(MIN_TOKENS - 1))) is None  # too short
    p = [list(range(k * 1000, k * 1000 + 80)) for k in range(3)]
    assert _made(pc, pool, "0", p[0]) is not None
    assert _made(pc, pool, "0b", p[0]) is None  # already an entry
    assert _made(pc, pool, "1", p[1]) is not None
    pc.lookup("x", p[0] + [1])  # p[0] becomes most recently used
    assert _made(pc, pool, "2", p[2]) is not None  # evicts p[1], the least recently used
    assert pc.lookup("y", p[1] + [1]) is None
    assert pc.lookup("z", p[0] + [1]) is not None and pc.lookup("w", p[2] + [1]) is not None
    pc.clear()
    pc.check_integrity()
    assert pool.num_free == pool.capacity  # every page back


def test_a_discarded_snapshot_leaves_nothing_behind():
    pool = PagePool(32)
    pc = PrefixCache(PS, range(5, 6), pool)
    pages = pool.allocate(6)
    snap = pc.reserve("r", list(range(90)), slot=1, pages=pages)
    assert snap is not None and pc.reserve("r2", list(range(1, 91)), 2, pages) is None  # no slot
    pc.discard(snap)
    pool.free(pages)
    pc.check_integrity()
    assert pool.num_free == pool.capacity and len(pc) == 0


# ---- the engine ------------------------------------------------------------------------------
def test_the_same_point_reached_twice_in_a_step_evicts_nothing():
    """Requests that reach the same save point in one step (the choices of n, a burst of new
    chats on a new system prompt) take one snapshot between them; the session-34 review
    found each of them evicting an entry for a copy that commit then threw away."""
    pool = PagePool(64)
    pc = PrefixCache(PS, range(10, 13), pool)
    for k in range(3):  # three entries: every snapshot slot taken
        _made(pc, pool, f"w{k}", ids(80, 40 + k))
    prompt = ids(100, 50)
    pages = [pool.allocate(7) for _ in range(3)]
    snaps = [pc.reserve(f"r{i}", prompt, i + 1, pages[i]) for i in range(3)]
    assert [s is not None for s in snaps] == [True, False, False]
    assert len(pc) == 2  # one entry evicted for the one snapshot
    pc.commit(snaps[0])
    assert len(pc) == 3 and pc.lookup("q", prompt + [1]).length == 100
    assert pc.reserve("r9", prompt, 4, pages[0]) is None  # an entry now: nothing reserved
    pc.check_integrity()


@pytest.fixture
def tok(qwen_tok):
    return qwen_tok


def make(model, tok, entries: int, on: bool = False, **kw):
    ec = EngineConfig(page_size=PS, max_num_seqs=kw.pop("max_num_seqs", 8),
                      max_num_batched_tokens=kw.pop("budget", 512),
                      max_model_len=kw.pop("max_model_len", 512), device="cpu",
                      dtype="float32", async_scheduling=on, prefix_cache_entries=entries, **kw)
    runner = ModelRunner(model, model.config, ec, "cpu", model.lm_head.weight.dtype)
    return Engine(model.config, ec, runner, tok)


def ids(n, seed):
    return torch.randint(0, 248044, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(n):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def run(engine, script, limit: int = 3000) -> dict:
    """script: {step_no: [(rid, prompt, SamplingParams) | ("abort", rid)]} before that step;
    tokens by request id. AssertionError (with the scheduler's state) after `limit` steps."""
    out = {}
    n = 0
    while engine.has_unfinished() or n <= max(script):
        for cmd in script.get(n, []):
            if cmd[0] == "abort":
                engine.abort_request(cmd[1])
            else:
                engine.add_request(*cmd)
                out[cmd[0]] = []
        for o in engine.step():
            assert o.error is None, o.error
            out[o.request_id] += o.delta_token_ids
        n += 1
        if n >= limit:
            s = engine.scheduler
            raise AssertionError(
                f"no progress after {n} steps: waiting={[r.request_id for r in s.waiting]} "
                f"running={[r.request_id for r in s.running]} free_pages={s.pages.num_free} "
                f"entries={len(s.prefix) if s.prefix else 0}")
    return out


def cold(model, tok, prompt, sp, first: int, **kw) -> list[int]:
    """The request alone on an engine without prefix caching, its prompt computed in two
    chunks split where the hit's prefix ends (so the reference sums in the same order)."""
    e = make(model, tok, 0, budget=first, **kw)
    return run(e, {0: [("r", prompt, sp)]})["r"]


def check_idle(engine, entries_kept: bool = True):
    """No request left: the pools hold exactly the cache's entries' pages and slots."""
    s = engine.scheduler
    s.pages.check_integrity()
    s.slots.check_integrity()
    s.prefix.check_integrity()
    assert s.slots.num_free == s.slots.capacity
    held = {p for e in s.prefix._entries.values() for p in e.pages}
    assert s.pages.num_used == len(held)
    s.prefix.clear()
    assert s.pages.num_free == s.pages.capacity


@pytest.mark.contract("prefix-cache-hit-equals-cold")
@pytest.mark.parametrize("on", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("plen", [96, 101], ids=["page_aligned", "partial_page"])
def test_next_turn_hits_and_decodes_as_a_cold_run(tiny_model, tok, on, plen):
    """A prompt that extends an earlier prompt reuses its KV and GDN state (the hit counted)
    and gives the tokens of a cold run, whether the prefix ends on a page boundary or inside
    a page (then copied), with the earlier request still decoding into that page."""
    p = ids(plen, 1)
    q = p + ids(37, 2)
    e = make(tiny_model, tok, 4, on)
    out = run(e, {0: [("a", p, greedy(12))], 3: [("b", q, greedy(10))]})
    s = e.scheduler.prefix
    assert s.hits == plen, (s.hits, s.queries)
    assert s.queries == plen + len(q)
    assert out["b"] == cold(tiny_model, tok, q, greedy(10), plen)
    assert out["a"] == cold(tiny_model, tok, p, greedy(12), 512)
    assert e.stats()["prefix_cache_hits"] == plen
    check_idle(e)


def test_off_by_default_and_no_hit_without_it(tiny_model, tok):
    e = make(tiny_model, tok, 0)
    p = ids(90, 3)
    run(e, {0: [("a", p, greedy(3))], 4: [("b", p + [5, 6], greedy(3))]})
    assert e.scheduler.prefix is None
    assert e.stats()["prefix_cache_hits"] == 0


def test_chained_turns_chunked_prefill_and_the_same_prompt_again(tiny_model, tok):
    """Three turns, each prompt the last one plus more, prefilled in chunks of 48 tokens: each
    turn hits the one before (the longest entry); the same prompt again computes at least its
    last token and decodes as before."""
    t1 = ids(100, 4)
    t2 = t1 + ids(60, 5)
    t3 = t2 + ids(70, 6)
    e = make(tiny_model, tok, 4, budget=48)
    out = run(e, {0: [("1", t1, greedy(5))], 12: [("2", t2, greedy(5))],
                  30: [("3", t3, greedy(5))], 50: [("3b", t3, greedy(5))]})
    assert e.scheduler.prefix.hits == len(t1) + len(t2) + len(t2)
    assert out["3"] == out["3b"]
    # cold references chunked at 48 from the hit: the hit's prefix ends at 160 (t2)
    ref = make(tiny_model, tok, 0, budget=48)
    ref_out = run(ref, {0: [("3", t3, greedy(5))]})
    assert out["3"] == ref_out["3"]
    check_idle(e)


@pytest.mark.contract("prefix-cache-hit-equals-cold")
def test_eviction_and_preemption_keep_answers_and_leak_nothing(tiny_model, tok):
    """A page pool too small for everyone: entries are evicted before running requests are
    preempted, preempted requests recompute (hitting their own prompt's entry), and every
    answer is the answer of the same requests with prefix caching off."""
    base = ids(80, 7)
    reqs = [(f"r{i}", base + ids(20 + 7 * i, 10 + i), greedy(24)) for i in range(6)]
    script = {0: [("seed", base, greedy(2))], 3: reqs[:3], 6: reqs[3:]}
    e = make(tiny_model, tok, 3, num_pages=24, max_num_seqs=4)
    got = run(e, script)
    ref = run(make(tiny_model, tok, 0, num_pages=24, max_num_seqs=4), script)
    assert got == ref
    assert e.scheduler.prefix.hits > 0
    assert e.scheduler.num_preemptions > 0
    check_idle(e)


def test_abort_while_prefilling_on_a_hit(tiny_model, tok):
    p = ids(120, 8)
    e = make(tiny_model, tok, 2, budget=32)
    out = run(e, {0: [("a", p, greedy(2))], 6: [("b", p + ids(200, 9), greedy(4))],
                  8: [("abort", "b")], 9: [("c", p + [1, 2, 3], greedy(3))]})
    assert out["c"] == cold(tiny_model, tok, p + [1, 2, 3], greedy(3), 120)
    check_idle(e)


def test_a_failed_step_makes_no_entry(tiny_model, tok, monkeypatch):
    """The step that completes a prompt fails (its requests get errors): the snapshot it was
    to copy is discarded, so a later prompt extending it finds nothing (a stale state would
    decode differently, failure-cases §3), and nothing leaks."""
    e = make(tiny_model, tok, 2)
    p = ids(90, 11)
    real = e.runner.model.forward
    calls = {"n": 0}

    def failing(*a, **kw):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected")
        return real(*a, **kw)

    monkeypatch.setattr(e.runner.model, "forward", failing)
    e.add_request("a", p, greedy(3))
    errors = [o for o in e.step() if o.error]
    assert errors and errors[0].request_id == "a"
    assert len(e.scheduler.prefix) == 0
    out = run(e, {0: [("b", p + [4, 5], greedy(3))]})
    assert e.scheduler.prefix.hits == 0
    assert out["b"] == cold(tiny_model, tok, p + [4, 5], greedy(3), 512)
    check_idle(e)


def test_kernel_path_and_speculative_decoding_hit_as_a_cold_run(tiny4_ckpt):
    """The same on the kernel path (Triton's interpreter, fp32; the tiny preset cut to 4
    layers, both layer kinds) with speculative decoding: the hit's first chunk continues from
    the copied state with the prefill kernels (a prefix ending inside a page: that page
    copied), the shared pages carry the MTP layer's KV too, and the verify steps that follow
    read the copied states as decode steps would, keeping the greedy output. (Without drafts
    the hit's chunk is the same prefill, the decode steps the kernel path's own: checked
    against the plain path in tests/worker/test_kernel_path.py.)"""
    from tailored import kernels
    from tailored.stack import build_stack

    if not kernels.available():
        pytest.skip("triton not installed")

    def stack(entries, budget=256):
        return build_stack(tiny4_ckpt, device="cpu", dtype="float32", progress=False,
                           kernels="on", max_model_len=128, max_num_seqs=4, num_pages=40,
                           max_num_batched_tokens=budget, async_scheduling=False,
                           num_speculative_tokens=2, prefix_cache_entries=entries).engine

    p = ids(MIN_TOKENS + 1, 12)
    q = p + ids(7, 13)
    e = stack(2)
    assert e.runner.kernel is not None and e.runner.spec.drafter is not None
    out = run(e, {0: [("a", p, greedy(2))], 2: [("b", q, greedy(3))]})
    assert e.scheduler.prefix.hits == len(p)
    assert out["b"] == run(stack(0, budget=len(p)), {0: [("b", q, greedy(3))]})["b"]
    check_idle(e)


def test_chat_turns_hit_at_the_end_of_the_last_message(tiny_model, tok):
    """A chat prompt ends with the generation prompt (`<|im_start|>assistant\\n<think>\\n`),
    which the next turn replaces by the answer: the entry ends before it (one extra prefill
    step of those few tokens), so turn 2 hits the whole of turn 1 but its generation prompt
    — with an entry at the prompt's end it would never hit (failure-cases §3: 0 % hits) — and
    the same conversation sent again hits too."""
    import invariance_checks as C

    p1, p2, cut = C.chat_turns(tok)  # cut: where turn 1's generation prompt starts
    assert p2[:cut] == p1[:cut] and p2[:len(p1)] != p1  # the premise
    e = make(tiny_model, tok, 4)
    out = run(e, {0: [("t1", p1, greedy(6))], 5: [("t2", p2, greedy(6))],
                  12: [("t1b", p1, greedy(6))]})
    assert e.scheduler.prefix.hits == cut + cut
    assert out["t1b"] == out["t1"]
    assert out["t2"] == cold(tiny_model, tok, p2, greedy(6), cut)
    check_idle(e)


def test_the_choices_of_n_keep_the_other_system_prompts_entries(tiny_model, tok):
    """4 entries: chat X on system prompt A (entries: A, X's end), then a chat on a new
    system prompt B with two choices (both reach B's end and their last message's end in the
    same steps): one snapshot each, so A's entry stays and a new chat on A hits it (the
    session-34 review measured 0 cached tokens there with n=2 against 154 with n=1)."""
    def chat(system, question):
        return tok.encode(tok.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": question}]),
            allow_special=True)

    a = "You answer questions about the weather in short sentences. " * 8
    b = "You translate every message into French, word for word. " * 8
    x, y, z = chat(a, "Is it raining?"), chat(b, "Good morning"), chat(a, "Is it cold?")
    a_end = x.index(tok.token_to_id("<|im_start|>"), 1)
    e = make(tiny_model, tok, 4)
    run(e, {0: [("x", x, greedy(3))], 6: [("y1", y, greedy(3)), ("y2", y, greedy(3))],
            14: [("z", z, greedy(3))]})
    assert e.scheduler.prefix.hits == a_end
    assert e.stats()["prefix_cache_hits"] == e.scheduler.prefix.hits
    check_idle(e)


def test_save_points():
    pc = PrefixCache(PS, range(3, 5), PagePool(8))
    pc.boundary_ids = frozenset({9})
    assert pc.save_points("a", [1] * (MIN_TOKENS - 1)) == ()  # too short
    assert pc.save_points("b", [1] * 100) == (100,)  # no boundary: the whole prompt
    assert pc.save_points("c", [1] * 80 + [9] + [1] * 5 + [9, 2]) == (86,)  # before the last
    assert pc.save_points("d", [9] + [1] * 99) == (100,)  # a boundary too early: the whole
    assert pc.save_points("c", []) == (86,)  # memoised per request until forget
    pc.forget("c")
    assert pc.save_points("c", [1] * 70) == (70,)
    assert PrefixCache(PS, range(0), PagePool(8)).save_points("e", [1] * 100) == ()  # no slots
    # a leading system message (lead ids 9, 7) of MIN_TOKENS or more ends a save point too
    pc.lead_ids = (9, 7)
    system = [9, 7] + [1] * 70
    assert pc.save_points("f", system + [9, 3] + [1] * 20 + [9, 4]) == (72, 94)
    assert pc.save_points("g", [9, 7] + [1] * 40 + [9, 3] + [1] * 40 + [9, 4]) == (84,)  # short
    assert pc.save_points("h", [9, 5] + [1] * 70 + [9, 3] + [1] * 20 + [9, 4]) == (94,)  # user
    assert pc.save_points("i", system + [9, 4]) == (72,)  # the system message is the last one
    assert pc.save_points("j", system + [1] * 5) == (77,)  # no boundary after it: the whole


def test_a_new_chat_with_the_same_system_prompt_hits_at_its_end(tiny_model, tok):
    """Two conversations that share only their system prompt: the second hits where that
    message ends (the first chat's turn 1 saved a state there, one extra chunk end) and gives
    the tokens of a cold run; its own generation prompt's save point still follows."""
    import invariance_checks as C

    p1, _, _ = C.chat_turns(tok)
    other, sys_end = C.new_chat(tok)
    assert other[:sys_end] == p1[:sys_end] and other[sys_end + 3] != p1[sys_end + 3]
    e = make(tiny_model, tok, 4)
    lead = e.scheduler.prefix.lead_ids
    assert lead and p1[:len(lead)] == list(lead)
    out = run(e, {0: [("c1", p1, greedy(6))], 6: [("c2", other, greedy(6))]})
    assert e.scheduler.prefix.hits == sys_end
    assert out["c2"] == cold(tiny_model, tok, other, greedy(6), sys_end)
    assert len(e.scheduler.prefix) == 3  # c1's system and last message, c2's last message
    check_idle(e)


def test_usage_reports_the_cached_prompt_tokens(tok):
    """OpenAI's `usage.prompt_tokens_details.cached_tokens` on a chat's next turn, whole and
    streamed (with include_usage); absent where nothing was cached."""
    import invariance_checks as C
    from fastapi.testclient import TestClient
    from test_server import sse_events

    from tailored.server.app import build_app
    from tailored.server.async_engine import AsyncEngine
    from tailored.stack import build_stack

    st = build_stack(None, device="cpu", dtype="float32", progress=False, kernels="off",
                     max_model_len=512, max_num_seqs=4, prefix_cache_entries=4)
    p1, p2, cut = C.chat_turns(st.tokenizer)  # ids through the completions API
    with TestClient(build_app(AsyncEngine(st.engine), st.tokenizer, "m", 512)) as client:
        body = {"model": "m", "prompt": p1, "max_tokens": 3, "temperature": 0}
        first = client.post("/v1/completions", json=body).json()
        assert "prompt_tokens_details" not in first["usage"]
        again = client.post("/v1/completions", json={**body, "prompt": p2}).json()
        assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": cut}
        assert again["usage"]["prompt_tokens"] == len(p2)
        events = sse_events(client.post("/v1/completions", json={
            **body, "prompt": p2, "stream": True,
            "stream_options": {"include_usage": True}}).text)
        usage = [e["usage"] for e in events if isinstance(e, dict) and e.get("usage")]
        assert usage[-1]["prompt_tokens_details"]["cached_tokens"] >= cut  # p2's own entry


def test_too_many_entries_for_the_memory_names_the_flag(tiny_cfg):
    """Snapshot slots come out of the cache's memory first: too many leave no room for one
    request, and the error says which flag did it (a new user's finding: it read '-126238
    pages fit ... lower --max-model-len or --max-num-seqs')."""
    from tailored.worker.memory_plan import plan_cache

    ec = EngineConfig(page_size=PS, max_model_len=512, device="cpu", dtype="float32",
                      prefix_cache_entries=10**7)
    with pytest.raises(RuntimeError, match=r"0 pages .*--prefix-cache-entries \(10000000 GDN"):
        plan_cache(tiny_cfg, ec, torch.float32, torch.device("cpu"))


def test_eviction_for_pages_spares_entries_that_would_free_none():
    """An entry whose pages running requests all share frees no page when evicted: eviction
    for pages passes it over (it stays, in use), and takes the next one that gives pages."""
    pool = PagePool(64)
    pc = PrefixCache(PS, range(10, 13), pool)
    used = list(range(2000, 2096))  # 6 full pages: a request reusing it shares them all
    other = list(range(5000, 5080))
    assert _made(pc, pool, "u", used) is not None and _made(pc, pool, "o", other) is not None
    hit = pc.lookup("x", used + [1])
    pool.share(list(hit.pages))  # the request running on it
    pc.lookup("y", other + [1])  # `other` most recently used: plain LRU would drop `used`
    free = pool.num_free
    assert pc.evict_one(for_pages=True)
    assert pool.num_free == free + 5 and pc.lookup("z", used + [1]) is not None
    assert not pc.evict_one(for_pages=True)  # what is left frees nothing
    assert pc.evict_one()  # (a snapshot slot still may take it)
    pool.free(list(hit.pages))
    pc.check_integrity()
    assert pool.num_free == pool.capacity


def test_pages_only_the_cache_holds_and_the_pool_stats():
    """What /metrics and /v1/loads report: the pages only entries hold (free on demand, so
    not load) apart from the ones a running request shares; a flush keeps the latter."""
    from tailored.engine.memory import SlotPool, pool_stats

    pool = PagePool(64)
    pc = PrefixCache(PS, range(10, 13), pool)
    used = list(range(2000, 2096))  # 6 full pages
    assert _made(pc, pool, "u", used) is not None
    assert _made(pc, pool, "o", list(range(5000, 5080))) is not None  # 5 pages
    assert pc.cache_only_pages() == 11
    hit = pc.lookup("x", used + [1])
    pool.share(list(hit.pages))  # a request running on `used`
    slots = SlotPool(5)
    slots.allocate()
    assert pool_stats(pool, slots, pc) == {
        "total_pages": 63, "used_pages": 11, "cached_pages": 5, "total_slots": 4,
        "used_slots": 1, "prefix_cache_entries": 2, "prefix_cache_capacity": 3}
    pc.clear()  # a gateway's flush: the request keeps its pages
    assert pool.num_used == 6 and pc.cache_only_pages() == 0
    pool.free(list(hit.pages))
    assert pool.num_free == pool.capacity
    assert pool_stats(pool, slots, None)["prefix_cache_entries"] == 0
