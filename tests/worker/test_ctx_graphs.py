"""Context-chunk graphs (worker/ctx_graphs.py, kb/0055): a prompt chunk after a cached context.

On the CPU there are no CUDA graphs: the graph's body runs eagerly (Triton interpreter, fp32,
the tiny preset cut to 4 layers) against the eager forward of the same chunk, and the dispatch
(worker/kernel_forward.py) is pinned with the replay stood in for.
tests/gpu/test_gpu_ctx.py replays the captured graphs on the GPU.
"""

from __future__ import annotations

import pytest
import torch
from helpers import new_cache, rel_err
from test_kernel_path import _ids, _make_pair, _tensors, graph_stand_ins

from tailored import flags, kernels
from tailored.model.batch import ForwardBatch
from tailored.worker.ctx_graphs import ContextGraphs, ctx_splits

pytestmark = [pytest.mark.skipif(not kernels.available(), reason="triton not installed"),
              pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def pair(tiny4_ckpt):
    """(plain model, kernel path, its cache), bf16 layout: the body's projections and MoE are
    the eager path's, checked in both layouts by test_kernel_path.py."""
    return _make_pair(tiny4_ckpt)


def _ctx(kf) -> ContextGraphs:
    return ContextGraphs(kf.km, kf.pool, kf.max_pages)


@pytest.mark.parametrize("C,T,n", [(16, 2, 4), (31, 17, 32), (5, 11, 11)])
def test_context_body_equals_eager_continuation(pair, C, T, n):
    """The body a context-chunk graph captures, run eagerly on n ≥ T padded rows after a
    C-token context prefilled into the slot, computes what the eager forward of that chunk
    computes: hidden rows, the slot's conv and recurrent states, the chunk's KV rows; the
    context's KV rows and every other slot and page stay bit-identical, pads touch only the
    sinks (slot 0, page 0). C=16 starts the chunk on a page boundary with T=2, shorter than
    the conv window (the carried conv state); C=31 just before one, the chunk across two
    (32, 48) with 15 pads; T = n: a bucket without pads."""
    _, kf, cache = pair
    km, ps, slot = kf.km, cache.page_size, 3
    ids = _ids(C + T, 200 + C + T)
    pages = [5 + j for j in range((C + T - 1) // ps + 1)]
    g = torch.Generator().manual_seed(C * 100 + T)
    for t in _tensors(cache):  # stale state the context's prefill must ignore
        t.copy_(torch.randn(t.shape, generator=g, dtype=t.dtype))
    km.forward_eager(ForwardBatch.build([(ids[:C], 0, slot, True, pages)], [C - 1], "cpu"))
    layout = [(ids[C:], C, slot, False, pages)]
    before = [t.clone() for t in _tensors(cache)]
    want = km.forward_eager(ForwardBatch.build(layout, [T - 1], "cpu"))
    after_eager = [t.clone() for t in _tensors(cache)]
    for t, b in zip(_tensors(cache), before):
        t.copy_(b)
    ctx = _ctx(kf)
    ctx.alloc(64)
    ctx.fill(ForwardBatch.build(layout, [T - 1], "cpu"), n)
    got = ctx.body(n)
    assert got.shape[0] == n
    assert rel_err(got[:T], want) < 1e-5
    conv, rec, k, v = _tensors(cache)
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
    _, kf, _ = pair
    ctx = _ctx(kf)
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
    # FlashAttention-3's device lengths: the chunk's 3 rows over its 20 keys
    assert st["used_q"].item() == 3 and st["used_k"].item() == 20
    ctx.to_sinks(8)
    assert st["used_q"].item() == 1 and st["used_k"].item() == 1


def test_fits_takes_one_continuing_chunk_only(pair, switches):
    """Which chunks replay a context graph: one sequence, 2..largest bucket tokens, from
    start_pos > 0 with its state kept, within `ctx_graph_max_pairs`; not a fresh prompt, a
    decode row, a verify chunk, two sequences, or a chunk whose key reads exceed the bound."""
    _, kf, _ = pair
    ctx = _ctx(kf)
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
    switches(ctx_graph_max_pairs=5 * 13 - 1)
    assert not fits((_ids(5, 1), 8, 1, False, [1]))
    ctx.fa3 = True  # bodies built over FlashAttention-3: no pairs bound
    assert fits((_ids(5, 1), 8, 1, False, [1]))
    ctx.fa3 = False
    switches(ctx_graph_max_pairs=5 * 13)
    assert fits((_ids(5, 1), 8, 1, False, [1]))


def test_the_fa3_body_passes_the_chunk_and_its_keys_and_zeroes_the_pads(pair, monkeypatch,
                                                                        switches):
    """With prefill_attention = fa3 when the statics are made, the body's attention layers
    call `fa3.paged_attention` with the sequence's page table and the device lengths (the
    chunk's T rows, its end_pos keys), and zero the pad rows it does not write. FA3 is stood
    in for by the fp32 reference over the gathered pages, NaN in the rows it leaves: the body
    equals the eager continuation (as with the paged decode kernel), no NaN reaches a state."""
    from tailored.kernels import fa3

    _, kf, cache = pair
    km, ps, slot, C, T, n = kf.km, cache.page_size, 3, 31, 17, 32
    seen = []

    def stand_in(q, kc, vc, table, used_q, used_k):
        Tq, keys = int(used_q), int(used_k)
        seen.append((Tq, keys, table[:(keys + ps - 1) // ps].tolist()))
        rows = torch.arange(keys)
        flat = lambda c: c.view(-1, *c.shape[2:])  # noqa: E731
        idx = table.long()[rows // ps] * ps + rows % ps
        out = torch.full_like(q, float("nan"))
        out[:Tq] = fa3.causal_attention_reference(q[:Tq], flat(kc)[idx], flat(vc)[idx])
        return out

    monkeypatch.setattr(fa3, "paged_attention", stand_in)
    ids = _ids(C + T, 200 + C + T)
    pages = [5 + j for j in range((C + T - 1) // ps + 1)]
    km.forward_eager(ForwardBatch.build([(ids[:C], 0, slot, True, pages)], [C - 1], "cpu"))
    layout = [(ids[C:], C, slot, False, pages)]
    before = [t.clone() for t in _tensors(cache)]
    want = km.forward_eager(ForwardBatch.build(layout, [T - 1], "cpu"))
    for t, b in zip(_tensors(cache), before):
        t.copy_(b)
    switches(prefill_attention="fa3")
    ctx = _ctx(kf)
    ctx.alloc(64)
    assert ctx.fa3
    ctx.fill(ForwardBatch.build(layout, [T - 1], "cpu"), n)
    got = ctx.body(n)
    assert rel_err(got[:T], want) < 1e-5
    assert torch.isfinite(got).all()
    assert all(torch.isfinite(t).all() for t in _tensors(cache))
    assert seen and all(s == (T, C + T, pages) for s in seen)


def test_steps_send_a_continuing_chunk_to_its_graph(pair, monkeypatch):
    """A step of one chunk after its context replays the context graph; beside decode rows
    the decode graph takes the rows and the context graph the chunk (outputs in batch order,
    equal to the plain model's); a fresh prompt still takes the prefill graph. The graphs'
    entry points are stood in for by the eager forward, which is what a replay computes."""
    plain, kf, fcache = pair
    ctx = _ctx(kf)
    ctx.graphs = {64: None}
    monkeypatch.setattr(kf, "ctx", ctx)
    calls = graph_stand_ins(kf, monkeypatch)
    for c in _tensors(fcache):
        c.zero_()
    pcache = new_cache(plain.config)
    a, b = _ids(6, 11), _ids(24, 12)
    warm = [(a, 0, 1, True, [1]), (b[:17], 0, 2, True, [3, 4])]
    plain(ForwardBatch.build(warm, [5, 22], "cpu"), pcache)
    kf.km.forward_eager(ForwardBatch.build(warm, [5, 22], "cpu"))
    calls.clear()
    # a decode row, then the rest of b after its 17 cached tokens
    layout = [([5], 6, 1, False, [1]), (b[17:], 17, 2, False, [3, 4])]
    hp = plain(ForwardBatch.build(layout, [0, 7], "cpu"), pcache)
    hf = kf.forward(ForwardBatch.build(layout, [0, 7], "cpu"))
    assert calls == [("decode", [(1, 6, 1)]), ("ctx", [(7, 17, 2)])], calls
    assert rel_err(hf, hp) < 1e-4
    assert rel_err(fcache.rec[:, 1:3], pcache.rec[:, 1:3]) < 1e-4
    calls.clear()  # the chunk alone
    layout = [(_ids(4, 13), 24, 2, False, [3, 4])]
    hp = plain(ForwardBatch.build(layout, [3], "cpu"), pcache)
    hf = kf.forward(ForwardBatch.build(layout, [3], "cpu"))
    assert calls == [("ctx", [(4, 24, 2)])], calls
    assert rel_err(hf, hp) < 1e-4


def test_fa3_bodies_take_larger_buckets(switches):
    """With FlashAttention-3 over the pages (no pairs bound) the graphs also take 3072 and
    4096 rows (eager steps of that size are host-bound), never past 4096 (the eager MoE's
    grouped GEMM from 6144)."""
    from tailored.worker.ctx_graphs import CTX_BUCKETS

    assert ContextGraphs.buckets() == CTX_BUCKETS and max(CTX_BUCKETS) == 2048
    switches(prefill_attention="fa3")
    assert ContextGraphs.buckets() == CTX_BUCKETS + (3072, 4096)
    assert max(ContextGraphs.buckets()) < flags.current().moe_grouped_from


def test_ctx_splits_fill_the_gpu_and_bound_the_partials():
    assert [ctx_splits(n, 2) for n in (4, 8, 64, 128, 256, 512, 2048)] == [8, 8, 8, 4, 2, 1, 1]


def test_ctx_graphs_wanted_unless_told():
    """On by default since kb/0056 (the gates passed with them), with or without the prefix
    cache; TAILORED_CTX_GRAPHS=0 turns them off; another value is an error naming it."""
    assert flags.Flags().ctx_graphs
    assert flags.Flags.from_env({}).ctx_graphs
    assert flags.Flags.from_env({"TAILORED_CTX_GRAPHS": "1"}).ctx_graphs
    assert not flags.Flags.from_env({"TAILORED_CTX_GRAPHS": "0"}).ctx_graphs
    with pytest.raises(ValueError, match="TAILORED_CTX_GRAPHS"):
        flags.Flags.from_env({"TAILORED_CTX_GRAPHS": "yes"})


def test_ctx_graphs_captured_after_the_prefill_graphs_unless_switched_off(monkeypatch):
    """The start-up (worker/kernel_path.py) captures context-chunk graphs after the prefill
    graphs when `ctx_graphs` is on, and none when it is off or the prefill graphs failed."""
    from types import SimpleNamespace

    from tailored.worker import ctx_graphs, kernel_path

    captured = []

    class FakeCtx:
        def __init__(self, km, pool, max_pages):
            self.graphs = {}

        def capture(self, max_tokens):
            captured.append(max_tokens)

    monkeypatch.setattr(ctx_graphs, "ContextGraphs", FakeCtx)
    monkeypatch.setattr(kernel_path, "warmup_prefill", lambda *a, **kw: None)
    monkeypatch.setattr(kernel_path, "warmup_lengths", lambda *a, **kw: [])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (0, 0))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 0)
    from tailored.kernels import compile_watch, tuning

    monkeypatch.setattr(compile_watch, "watch_compiles", lambda: None)
    monkeypatch.setattr(tuning, "dump_if_requested", lambda *a: None)
    ec = SimpleNamespace(max_num_batched_tokens=512, max_model_len=300, prefill_graphs=True,
                         max_num_seqs=4)
    for on, prefill_ok in ((True, True), (False, True), (True, False)):
        captured.clear()
        graphs = {}
        prefill = SimpleNamespace(graphs=graphs, capture=lambda n, g=graphs, ok=prefill_ok:
                                  g.update({128: None} if ok else {}))
        kf = SimpleNamespace(km=None, pool=None, max_pages=20, use_graphs=True, spec=None,
                             ctx=None, prefill=prefill,
                             decode=SimpleNamespace(capture=lambda: None))
        with flags.override(ctx_graphs=on):
            kernel_path._warm_and_capture(kf, SimpleNamespace(fp8=None), ec,
                                          torch.device("cpu"))
        assert captured == ([300] if on and prefill_ok else []), (on, prefill_ok)
        assert (kf.ctx is not None) == (on and prefill_ok)


def test_a_failed_capture_leaves_chunks_eager(pair, monkeypatch, caplog):
    """A capture that raises (out of memory, a host sync inside FLA) logs a warning, leaves no
    graph (so `fits` is False: such chunks run eagerly) and resets `MoEBlocks.fused_only`,
    which was on for the warm-up and capture."""
    _, kf, _ = pair
    km = kf.km
    seen = []

    def capture(graphs, sizes, body):
        seen.append((km.moe.fused_only, list(sizes)))
        graphs[sizes[0]] = None  # a partial capture
        raise RuntimeError("out of memory")

    monkeypatch.setattr(kf.pool, "capture", capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    ctx = _ctx(kf)
    with caplog.at_level("WARNING", logger="tailored.worker"):
        ctx.capture(100)
    assert seen == [(True, [64, 32, 16, 8, 4])] and km.moe.fused_only is False
    assert ctx.graphs == {} and "context-chunk CUDA graphs not captured" in caplog.text
    assert not ctx.fits(ForwardBatch.build([(_ids(5, 1), 8, 1, False, [1])], [4], "cpu"))


def test_several_prompts_each_replay_their_graph_up_to_the_bound(pair, monkeypatch, switches):
    """`prompts_in_graphs_up_to` / `_chunks` (`KernelForward.prompts`, kb/0056): a step of
    several prompt chunks — here a fresh prompt and a chunk after its context, alone and
    beside a decode row — replays each one's graph in turn while the step has at most that
    many tokens and chunks and every chunk has a graph (outputs in batch order, equal to the
    plain model's); above either bound, or with a chunk no graph takes, the prompts run
    eagerly together. 0 tokens turns it off; the defaults (1024 tokens, 2 chunks) take two
    short prompts and not three."""
    plain, kf, fcache = pair
    real_eager = kf.km.forward_eager
    ctx = _ctx(kf)
    ctx.graphs = {64: None}
    monkeypatch.setattr(kf, "ctx", ctx)
    calls = graph_stand_ins(kf, monkeypatch, ("decode", "prefill", "eager"))
    for c in _tensors(fcache):
        c.zero_()
    pcache = new_cache(plain.config)
    a, b, p = _ids(6, 21), _ids(24, 22), _ids(9, 23)
    warm = [(a, 0, 1, True, [1]), (b[:17], 0, 2, True, [3, 4])]
    plain(ForwardBatch.build(warm, [5, 22], "cpu"), pcache)
    real_eager(ForwardBatch.build(warm, [5, 22], "cpu"))
    # a fresh 9-token prompt, and b's 7 tokens after its 17 cached ones: 16 tokens
    layout = [(p, 0, 3, True, [6]), (b[17:], 17, 2, False, [3, 4])]
    snap = [t.clone() for t in _tensors(fcache)]
    psnap = [t.clone() for t in _tensors(pcache)]

    f = flags.current()
    assert (f.prompts_in_graphs_up_to, f.prompts_in_graphs_chunks) == (1024, 2)

    def step(layout, rows, bound, chunks=2):
        for t, s in zip(_tensors(fcache), snap):
            t.copy_(s)
        for t, s in zip(_tensors(pcache), psnap):
            t.copy_(s)
        switches(prompts_in_graphs_up_to=bound, prompts_in_graphs_chunks=chunks)
        calls.clear()
        hp = plain(ForwardBatch.build(layout, rows, "cpu"), pcache)
        hf = kf.forward(ForwardBatch.build(layout, rows, "cpu"))
        assert rel_err(hf, hp) < 1e-4
        assert rel_err(fcache.rec[:, 1:4], pcache.rec[:, 1:4]) < 1e-4
        return list(calls)

    assert step(layout, [8, 15], 16) == [("prefill", [(9, 0, 3)]), ("ctx", [(7, 17, 2)])]
    assert step(layout, [8, 15], 15) == [("eager", [(9, 0, 3), (7, 17, 2)])]
    assert step(layout, [8, 15], 0) == [("eager", [(9, 0, 3), (7, 17, 2)])]
    mixed = [([5], 6, 1, False, [1])] + layout
    assert step(mixed, [0, 9, 16], 16) == [("decode", [(1, 6, 1)]),
                                           ("prefill", [(9, 0, 3)]), ("ctx", [(7, 17, 2)])]
    # a 1-token fresh prompt has no graph: the step's prompts run eagerly together
    one = [(p, 0, 3, True, [6]), (_ids(1, 24), 0, 4, True, [8])]
    assert step(one, [8, 9], 16) == [("eager", [(9, 0, 3), (1, 0, 4)])]
    # three chunks: eager together under the default 2, each its graph when 3 are allowed
    three = layout + [(_ids(3, 25), 0, 4, True, [8])]
    assert step(three, [8, 15, 18], 1024) == [("eager", [(9, 0, 3), (7, 17, 2), (3, 0, 4)])]
    assert step(three, [8, 15, 18], 1024, chunks=3) == [
        ("prefill", [(9, 0, 3)]), ("ctx", [(7, 17, 2)]), ("prefill", [(3, 0, 4)])]
