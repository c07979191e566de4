"""Context-chunk graphs (model/fast_ctx.py, kb/0055): a prompt chunk after a cached context.

On the CPU there are no CUDA graphs: the graph's body runs eagerly (Triton interpreter, fp32,
tiny preset) against the eager forward of the same chunk, and the dispatch is pinned with the
replay stood in for. tests/test_gpu_ctx.py replays the captured graphs on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from conftest import rel_err
from tailored.model.batch import ForwardBatch
from tailored.worker.ctx_graphs import ContextGraphs, ctx_splits
from test_fast_path import _ids, _make_pair, graph_stand_ins


@pytest.fixture(scope="module")
def pair(tiny_ckpt):
    """(plain model, kernel-path model, its cache), bf16 layout: the body's projections and
    MoE are the eager path's, checked in both layouts by test_fast_path.py."""
    return _make_pair(tiny_ckpt)


def _cache_tensors(cache):
    return (cache.conv, cache.rec, cache.k, cache.v)


@pytest.mark.parametrize("C,T,n", [(20, 3, 4), (37, 30, 32), (16, 2, 8), (5, 64, 64),
                                   (47, 17, 32)])
def test_context_body_equals_eager_continuation(pair, C, T, n):
    """The body a context-chunk graph captures, run eagerly on n ≥ T padded rows after a
    C-token context prefilled into the slot, computes what the eager forward of that chunk
    computes: hidden rows, the slot's conv and recurrent states, the chunk's KV rows; the
    context's KV rows and every other slot and page stay bit-identical, pads touch only the
    sinks (slot 0, page 0). T=2 is shorter than the conv window (the carried conv state); C=16
    and C=47 start the chunk on and just before a page boundary."""
    _, fastm, cache = pair
    fast, ps, slot = fastm.fast, cache.page_size, 3
    ids = _ids(C + T, 200 + C + T)
    pages = [5 + j for j in range((C + T - 1) // ps + 1)]
    g = torch.Generator().manual_seed(C * 100 + T)
    for t in _cache_tensors(cache):  # stale state the context's prefill must ignore
        t.copy_(torch.randn(t.shape, generator=g, dtype=t.dtype))
    fast.forward_eager(ForwardBatch.build([(ids[:C], 0, slot, True, pages)], [C - 1], "cpu"))
    layout = [(ids[C:], C, slot, False, pages)]
    before = [t.clone() for t in _cache_tensors(cache)]
    want = fast.forward_eager(ForwardBatch.build(layout, [T - 1], "cpu"))
    after_eager = [t.clone() for t in _cache_tensors(cache)]
    for t, b in zip(_cache_tensors(cache), before):
        t.copy_(b)
    ctx = ContextGraphs(fast)
    ctx.alloc(64)
    ctx.fill(ForwardBatch.build(layout, [T - 1], "cpu"), n)
    got = ctx.body(n)
    assert got.shape[0] == n
    assert rel_err(got[:T], want) < 1e-5
    conv, rec, k, v = _cache_tensors(cache)
    e_conv, e_rec, e_k, e_v = after_eager
    assert rel_err(conv[:, slot], e_conv[:, slot]) < 1e-5
    assert rel_err(rec[:, slot], e_rec[:, slot]) < 1e-5
    for pos in range(C, C + T):  # the chunk's KV rows
        p, r = pages[pos // ps], pos % ps
        assert rel_err(k[:, p, r], e_k[:, p, r]) < 1e-5
        assert rel_err(v[:, p, r], e_v[:, p, r]) < 1e-5
    for pos in range(C):  # the context's KV rows: untouched
        p, r = pages[pos // ps], pos % ps
        assert torch.equal(k[:, p, r], before[2][:, p, r])
    others = [s for s in range(conv.shape[1]) if s not in (0, slot)]
    assert torch.equal(conv[:, others], before[0][:, others])
    assert torch.equal(rec[:, others], before[1][:, others])
    free = [p for p in range(k.shape[1]) if p not in set(pages) | {0}]
    assert torch.equal(k[:, free], before[2][:, free])
    assert torch.equal(v[:, free], before[3][:, free])
    last, tail = pages[-1], slice((C + T - 1) % ps + 1, ps)  # unused rows of the last page
    assert torch.equal(k[:, last, tail], before[2][:, last, tail])


def test_fill_after_a_longer_chunk_leaves_no_stale_rows(pair):
    """A fill after a larger one: the new pads' ids, positions, KV rows, lengths and valid
    flags are the pads' (nothing of the earlier chunk's leaks into the bucket)."""
    _, fastm, _ = pair
    ctx = ContextGraphs(fastm.fast)
    ctx.alloc(32)
    ctx.fill(ForwardBatch.build([(_ids(30, 1), 40, 2, False, [1, 2, 3, 4, 5])], [29], "cpu"), 32)
    ctx.fill(ForwardBatch.build([(_ids(3, 2), 17, 4, False, [6, 7])], [2], "cpu"), 8)
    st = ctx.st
    assert st["ids"][3:8].eq(0).all() and st["pos"][3:8].eq(0).all()
    assert st["pos"][:3].tolist() == [17, 18, 19]
    assert st["kv"][:3].tolist() == [7 * 16 + 1, 7 * 16 + 2, 7 * 16 + 3]
    assert st["kv"][3:8].eq(0).all()  # pads → row 0 of the sink page
    assert st["lens"][:8].tolist() == [18, 19, 20, 1, 1, 1, 1, 1]
    assert st["valid"][:8].tolist() == [True] * 3 + [False] * 5
    assert st["table"][0, :2].tolist() == [6, 7] and st["slot"].item() == 4
    assert st["state_meta"].flatten().tolist() == [0, 3, 0, 0]


def test_fits_takes_one_continuing_chunk_only(pair, monkeypatch):
    """Which chunks replay a context graph: one sequence, 2..largest bucket tokens, from
    start_pos > 0 with its state kept, within CTX_GRAPH_MAX_PAIRS; not a fresh prompt, a
    decode row, a verify chunk, two sequences, or a chunk whose key reads exceed the bound."""
    from tailored.model import fast_ctx

    _, fastm, _ = pair
    ctx = ContextGraphs(fastm.fast)
    assert not ctx.fits(ForwardBatch.build([(_ids(5, 1), 8, 1, False, [1])], [4], "cpu"))
    ctx.graphs = {4: None, 64: None}

    def fits(*seqs):
        return ctx.fits(ForwardBatch.build(list(seqs), [0], "cpu"))

    assert fits((_ids(5, 1), 8, 1, False, [1]))
    assert fits((_ids(64, 1), 8, 1, False, [1, 2, 3, 4, 5]))
    assert not fits((_ids(65, 1), 8, 1, False, [1, 2, 3, 4, 5]))  # above the largest bucket
    assert not fits((_ids(5, 1), 0, 1, True, [1]))  # fresh: the prefill graphs
    assert not fits((_ids(1, 1), 8, 1, False, [1]))  # a decode row
    assert not fits((_ids(5, 1), 8, 1, True, [1]))  # a reset slot
    assert not fits((_ids(3, 1), 8, 1, False, [1], True))  # a verify chunk
    assert not fits((_ids(5, 1), 8, 1, False, [1]), (_ids(5, 2), 8, 2, False, [2]))
    monkeypatch.setattr(fast_ctx, "CTX_GRAPH_MAX_PAIRS", 5 * 13 - 1)
    assert not fits((_ids(5, 1), 8, 1, False, [1]))
    monkeypatch.setattr(fast_ctx, "CTX_GRAPH_MAX_PAIRS", 5 * 13)
    assert fits((_ids(5, 1), 8, 1, False, [1]))


def test_steps_send_a_continuing_chunk_to_its_graph(pair, monkeypatch):
    """A step of one chunk after its context replays the context graph; beside decode rows
    the decode graph takes the rows and the context graph the chunk (outputs in batch order,
    equal to the plain model's); a fresh prompt still takes the prefill graph. The graphs'
    entry points are stood in for by the eager forward, which is what a replay computes."""
    from conftest import new_cache

    plain, fastm, fcache = pair
    fast = fastm.fast
    ctx = ContextGraphs(fast)
    ctx.graphs = {64: None}
    monkeypatch.setattr(fast, "ctx", ctx)
    calls = graph_stand_ins(fast, monkeypatch)
    for c in _cache_tensors(fcache):
        c.zero_()
    pcache = new_cache(plain.config)
    a, b = _ids(20, 11), _ids(40, 12)
    warm = [(a, 0, 1, True, [1, 2]), (b[:25], 0, 2, True, [3, 4])]
    plain(ForwardBatch.build(warm, [19, 44], "cpu"), pcache)
    fast.forward_eager(ForwardBatch.build(warm, [19, 44], "cpu"))
    calls.clear()
    # a decode row, then the rest of b after its 25 cached tokens
    layout = [([5], 20, 1, False, [1, 2]), (b[25:], 25, 2, False, [3, 4, 5])]
    hp = plain(ForwardBatch.build(layout, [0, 15], "cpu"), pcache)
    hf = fastm(ForwardBatch.build(layout, [0, 15], "cpu"), fcache)
    assert calls == [("decode", [(1, 20, 1)]), ("ctx", [(15, 25, 2)])], calls
    assert rel_err(hf, hp) < 1e-4
    assert rel_err(fcache.rec[:, 1:3], pcache.rec[:, 1:3]) < 1e-4
    calls.clear()  # the chunk alone
    layout = [(_ids(6, 13), 40, 2, False, [3, 4, 5])]
    hp = plain(ForwardBatch.build(layout, [5], "cpu"), pcache)
    hf = fastm(ForwardBatch.build(layout, [5], "cpu"), fcache)
    assert calls == [("ctx", [(6, 40, 2)])], calls
    assert rel_err(hf, hp) < 1e-4


def test_ctx_splits_fill_the_gpu_and_bound_the_partials():
    assert [ctx_splits(n, 2) for n in (4, 8, 64, 128, 256, 512, 2048)] == [8, 8, 8, 4, 2, 1, 1]


def test_ctx_graphs_wanted_unless_told(monkeypatch):
    """On by default since kb/0056 (the gates passed with them), with or without the prefix
    cache; TAILORED_CTX_GRAPHS=0 turns them off; another value is an error."""
    from tailored.worker.ctx_graphs import ctx_graphs_wanted

    monkeypatch.delenv("TAILORED_CTX_GRAPHS", raising=False)
    assert ctx_graphs_wanted()
    monkeypatch.setenv("TAILORED_CTX_GRAPHS", "1")
    assert ctx_graphs_wanted()
    monkeypatch.setenv("TAILORED_CTX_GRAPHS", "0")
    assert not ctx_graphs_wanted()
    monkeypatch.setenv("TAILORED_CTX_GRAPHS", "yes")
    with pytest.raises(ValueError, match="TAILORED_CTX_GRAPHS"):
        ctx_graphs_wanted()


def test_a_failed_capture_leaves_chunks_eager(pair, monkeypatch, caplog):
    """A capture that raises (out of memory, a host sync inside FLA) logs a warning, leaves no
    graph (so `fits` is False: such chunks run eagerly) and resets `_moe_fused_only`, which
    was on for the warm-up and capture."""
    _, fastm, _ = pair
    fast = fastm.fast
    seen = []

    def capture_into(graphs, sizes, body):
        seen.append((fast._moe_fused_only, list(sizes)))
        graphs[sizes[0]] = None  # a partial capture
        raise RuntimeError("out of memory")

    monkeypatch.setattr(fast, "use_graphs", True)
    monkeypatch.setattr(fast, "_capture_into", capture_into)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    ctx = ContextGraphs(fast)
    with caplog.at_level("WARNING", logger="tailored.fast"):
        ctx.capture(100)
    assert seen == [(True, [64, 32, 16, 8, 4])] and fast._moe_fused_only is False
    assert ctx.graphs == {} and "context-chunk CUDA graphs not captured" in caplog.text
    assert not ctx.fits(ForwardBatch.build([(_ids(5, 1), 8, 1, False, [1])], [4], "cpu"))


def test_several_prompts_each_replay_their_graph_up_to_the_bound(pair, monkeypatch):
    """TAILORED_PROMPTS_IN_GRAPHS_UP_TO / _CHUNKS (`FastPath._prompts`): a step of several
    prompt chunks — here a fresh prompt and a chunk after its context, alone and beside a
    decode row — replays each one's graph in turn while the step has at most that many tokens
    and chunks and every chunk has a graph (outputs in batch order, equal to the plain
    model's); above either bound, or with a chunk no graph takes, the prompts run eagerly
    together. 0 tokens turns it off; the defaults (1024 tokens, 2 chunks, kb/0056) take two
    short prompts and not three."""
    from conftest import new_cache
    from tailored.model import fast as fastmod

    plain, fastm, fcache = pair
    fast = fastm.fast
    real_eager = fast.forward_eager
    ctx = ContextGraphs(fast)
    ctx.graphs = {64: None}
    monkeypatch.setattr(fast, "ctx", ctx)
    calls = graph_stand_ins(fast, monkeypatch, ("forward_decode_graph", "forward_prefill_graph",
                                                "forward_eager"))
    for c in _cache_tensors(fcache):
        c.zero_()
    pcache = new_cache(plain.config)
    a, b, p = _ids(20, 21), _ids(40, 22), _ids(30, 23)
    warm = [(a, 0, 1, True, [1, 2]), (b[:25], 0, 2, True, [3, 4])]
    plain(ForwardBatch.build(warm, [19, 44], "cpu"), pcache)
    real_eager(ForwardBatch.build(warm, [19, 44], "cpu"))
    layout = [(p, 0, 3, True, [6, 7]), (b[25:], 25, 2, False, [3, 4, 5])]
    snap = [t.clone() for t in _cache_tensors(fcache)]
    psnap = [t.clone() for t in _cache_tensors(pcache)]

    assert (fastmod.PROMPTS_IN_GRAPHS_UP_TO, fastmod.PROMPTS_IN_GRAPHS_CHUNKS) == (1024, 2)

    def step(layout, rows, bound, chunks=2):
        for t, s in zip(_cache_tensors(fcache), snap):
            t.copy_(s)
        for t, s in zip(_cache_tensors(pcache), psnap):
            t.copy_(s)
        monkeypatch.setattr(fastmod, "PROMPTS_IN_GRAPHS_UP_TO", bound)
        monkeypatch.setattr(fastmod, "PROMPTS_IN_GRAPHS_CHUNKS", chunks)
        calls.clear()
        hp = plain(ForwardBatch.build(layout, rows, "cpu"), pcache)
        hf = fastm(ForwardBatch.build(layout, rows, "cpu"), fcache)
        assert rel_err(hf, hp) < 1e-4
        assert rel_err(fcache.rec[:, 1:4], pcache.rec[:, 1:4]) < 1e-4
        return list(calls)

    assert step(layout, [29, 44], 45) == [("prefill", [(30, 0, 3)]), ("ctx", [(15, 25, 2)])]
    assert step(layout, [29, 44], 44) == [("eager", [(30, 0, 3), (15, 25, 2)])]
    assert step(layout, [29, 44], 0) == [("eager", [(30, 0, 3), (15, 25, 2)])]
    mixed = [([5], 20, 1, False, [1, 2])] + layout
    assert step(mixed, [0, 30, 45], 45) == [("decode", [(1, 20, 1)]),
                                            ("prefill", [(30, 0, 3)]), ("ctx", [(15, 25, 2)])]
    # a 1-token fresh prompt has no graph: the step's prompts run eagerly together
    one = [(p, 0, 3, True, [6, 7]), (_ids(1, 24), 0, 4, True, [8])]
    assert step(one, [29, 30], 45) == [("eager", [(30, 0, 3), (1, 0, 4)])]
    # three chunks: eager together under the default 2, each its graph when 3 are allowed
    three = layout + [(_ids(12, 25), 0, 4, True, [8])]
    assert step(three, [29, 44, 56], 1024) == [("eager", [(30, 0, 3), (15, 25, 2),
                                                          (12, 0, 4)])]
    assert step(three, [29, 44, 56], 1024, chunks=3) == [
        ("prefill", [(30, 0, 3)]), ("ctx", [(15, 25, 2)]), ("prefill", [(12, 0, 4)])]
