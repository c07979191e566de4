"""GPU checks of the context-chunk graphs (worker/ctx_graphs.py, kb/0055), skipped without CUDA:
the replay computes exactly its body, and tracks the eager forward of the same chunk.
"""

from __future__ import annotations

import pytest
import torch
from helpers import rel_err
from test_gpu import _no_tf32, _with_graphs, pytestmark  # noqa: F401 - the autouse fixture

from tailored.model.batch import ForwardBatch


@pytest.mark.parametrize("dtype,precision", [(torch.float32, "bf16"), (torch.bfloat16, "bf16"),
                                             (torch.bfloat16, "fp8")])
@torch.no_grad()
def test_context_graph_replay_equals_its_body_and_tracks_eager(dtype, precision):
    """After a C-token context in slot 2 (prefilled through the prefill graph), a T-token
    chunk dispatched by the model replays the context graph of its bucket: bitwise its body,
    the sinks aside; against the eager forward of the chunk, fp32 within 1e-4 (hidden rows and
    recurrent state), bf16 within the prefill graph test's bounds (another attention kernel,
    FLA fixed-length vs varlen, a random-weight model's near-ties: kb/0001). Also a chunk
    beside a decode row (`KernelForward._split`)."""
    from tailored.worker.ctx_graphs import ContextGraphs

    _, cache, kf = _with_graphs(dtype, precision, 3, [1024])
    kf.ctx = ContextGraphs(kf.km, kf.pool, kf.max_pages)
    kf.ctx.capture(512, buckets=[4, 64, 512])
    assert sorted(kf.ctx.graphs) == [4, 64, 512]
    tensors = (cache.conv, cache.rec, cache.k, cache.v)
    for C, T in ((700, 3), (1000, 60), (300, 500), (16, 2)):
        g = torch.Generator().manual_seed(C + T)
        ids = torch.randint(0, 248044, (C + T,), generator=g).tolist()
        pages = list(range(1, 2 + (C + T) // 16))
        kf.forward(ForwardBatch.build([(ids[:C], 0, 2, True, pages)], [C - 1], "cuda"))
        layout = [(ids[C:], C, 2, False, pages)]
        batch = ForwardBatch.build(layout, [T - 1], "cuda")
        assert kf.ctx.fits(batch) and not kf.prefill.fits(batch)
        snap = [t.clone() for t in tensors]
        eager = kf.km.forward_eager(ForwardBatch.build(layout, [T - 1], "cuda")).clone()
        after_eager = [t.clone() for t in tensors]
        n = min(b for b in kf.ctx.graphs if b >= T)
        for t, s in zip(tensors, snap):
            t.copy_(s)
        kf.ctx.fill(batch, n)
        body = kf.ctx.body(n)[:T].clone()
        after_body = [t.clone() for t in tensors]
        for t, s in zip(tensors, snap):
            t.copy_(s)
        graph = kf.forward(ForwardBatch.build(layout, [T - 1], "cuda")).clone()  # dispatches
        assert torch.equal(graph, body), (C, T)
        for t, s in zip(tensors, after_body):
            assert torch.equal(t[:, 1:], s[:, 1:]), (C, T)  # slot/page 0: the pad sinks
        assert not torch.isnan(graph).any()
        tok = (graph.float() - eager.float()).norm(dim=-1) / eager.float().norm(dim=-1)
        rec = rel_err(cache.rec[:, 2], after_eager[1][:, 2])
        print(f"context graph vs eager ({dtype}, {precision}, C={C}, T={T}): per-token rel err "
              f"median {tok.median().item():.2e} max {tok.max().item():.2e}; rec {rec:.2e}")
        if dtype == torch.float32:
            assert tok.max() <= 1e-4 and rec <= 1e-4, (C, T, tok, rec)
        else:
            assert tok.median() <= 0.12 and tok.max() <= 0.3, (C, T, tok)
            assert rec <= 5e-2
    # beside a decode row: the decode graph takes the row, the context graph the chunk
    g = torch.Generator().manual_seed(11)
    a = torch.randint(0, 248044, (40,), generator=g).tolist()
    kf.forward(ForwardBatch.build([(a, 0, 3, True, [120, 121, 122])], [39], "cuda"))
    chunk = torch.randint(0, 248044, (50,), generator=g).tolist()
    layout = [([5], 40, 3, False, [120, 121, 122]), (chunk, 18, 2, False, [1, 2, 3, 4, 5])]
    snap = [t.clone() for t in tensors]
    eager = kf.km.forward_eager(ForwardBatch.build(layout, [0, 50], "cuda")).clone()
    for t, s in zip(tensors, snap):
        t.copy_(s)
    replays = []
    real = kf.ctx.forward
    kf.ctx.forward = lambda b: replays.append(b.seqs[0].num_tokens) or real(b)
    try:
        mixed = kf.forward(ForwardBatch.build(layout, [0, 50], "cuda"))
    finally:
        del kf.ctx.forward
    assert replays == [50]
    tok = (mixed.float() - eager.float()).norm(dim=-1) / eager.float().norm(dim=-1)
    assert tok.max() <= (1e-4 if dtype == torch.float32 else 0.3), tok


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_several_prompts_replay_their_own_graphs(dtype, switches):
    """`prompts_in_graphs_up_to` (`KernelForward.prompts`; 1024 by default): a step of a
    fresh prompt and a chunk after its context replays the prefill graph, then the context
    graph, and tracks the eager step of both (fp32 within 1e-4; bf16 within the prefill graph
    test's bound)."""
    from tailored.worker.ctx_graphs import ContextGraphs

    _, cache, kf = _with_graphs(dtype, "bf16", 3, [128, 1024])
    kf.ctx = ContextGraphs(kf.km, kf.pool, kf.max_pages)
    kf.ctx.capture(512, buckets=[64, 512])
    g = torch.Generator().manual_seed(4)
    a = torch.randint(0, 248044, (300,), generator=g).tolist()
    b = torch.randint(0, 248044, (100,), generator=g).tolist()
    pa, pb = list(range(1, 20)), list(range(30, 37))
    kf.forward(ForwardBatch.build([(a[:200], 0, 2, True, pa)], [199], "cuda"))
    layout = [(b, 0, 3, True, pb), (a[200:], 200, 2, False, pa)]
    tensors = (cache.conv, cache.rec, cache.k, cache.v)
    snap = [t.clone() for t in tensors]
    eager = kf.km.forward_eager(ForwardBatch.build(layout, [99, 199], "cuda")).clone()
    for t, s in zip(tensors, snap):
        t.copy_(s)
    replays = []
    real_p, real_c = kf.prefill.forward, kf.ctx.forward
    kf.prefill.forward = lambda b: replays.append(("prefill", b.seqs[0].num_tokens)) \
        or real_p(b)
    kf.ctx.forward = lambda b: replays.append(("ctx", b.seqs[0].num_tokens)) or real_c(b)
    switches(prompts_in_graphs_up_to=4096)
    try:
        got = kf.forward(ForwardBatch.build(layout, [99, 199], "cuda"))
    finally:
        del kf.prefill.forward, kf.ctx.forward
    assert replays == [("prefill", 100), ("ctx", 100)]
    tok = (got.float() - eager.float()).norm(dim=-1) / eager.float().norm(dim=-1)
    assert tok.max() <= (1e-4 if dtype == torch.float32 else 0.3), tok
