"""Mixed-step graphs (worker/mixed_graphs.py, kb/0068): decode rows and one prompt chunk in one
graph.

On the CPU there are no CUDA graphs: the body a mixed graph captures runs eagerly (Triton
interpreter, fp32, the tiny preset cut to 4 layers) against the eager forward of the same
step, a replay is stood in for by the body writing the graph's output, and the dispatch
(worker/kernel_forward.py) is pinned. tests/gpu/test_gpu.py replays captured graphs.
"""

from __future__ import annotations

import pytest
import torch
from helpers import rel_err
from test_kernel_path import _ids, _make_pair, _tensors, graph_stand_ins

from tailored import kernels
from tailored.model.batch import ForwardBatch, sub_batch
from tailored.worker.ctx_graphs import ContextGraphs
from tailored.worker.graphs import PrefillGraphs
from tailored.worker.mixed_graphs import MIXED_TOKENS, MixedGraphs, mixed_families

pytestmark = [pytest.mark.skipif(not kernels.available(), reason="triton not installed"),
              pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def pair(tiny4_ckpt):
    """(plain model, kernel path, its cache), bf16 layout (fp32 on the CPU)."""
    return _make_pair(tiny4_ckpt)


def _family(kf, kind: str) -> MixedGraphs:
    chunk = (PrefillGraphs(kf.km, kf.pool) if kind == "fresh"
             else ContextGraphs(kf.km, kf.pool, kf.max_pages))
    m = MixedGraphs(kf.km, kf.pool, kf.decode, chunk, kind)
    m.min_rows = 1  # the tiny model's steps have a few decode rows (the rule: test_bucket_*)
    return m


def _step(kf, cache, kind: str, T: int):
    """Two sequences prefilled eagerly (slots 1, 2) and, for a continuing chunk, a 20-token
    context in slot 3, over stale random states; returns the mixed step's layout: their two
    decode rows, then the chunk of T tokens into slot 3 (fresh at position 0, or after the
    context)."""
    g = torch.Generator().manual_seed(T + (kind == "fresh"))
    for t in _tensors(cache):
        t.copy_(torch.randn(t.shape, generator=g, dtype=t.dtype))
    a, b, c = _ids(17, 21), _ids(9, 22), _ids(20 + T, 23)
    warm = [(a, 0, 1, True, [1, 2]), (b, 0, 2, True, [3])]
    if kind == "continuing":
        warm.append((c[:20], 0, 3, True, [4, 5, 6]))
    kf.km.forward_eager(ForwardBatch.build(warm, [0] * len(warm), "cpu"))
    chunk = (c[20:], 20, 3, False, [4, 5, 6]) if kind == "continuing" else (c[:T], 0, 3, True,
                                                                           [4, 5, 6])
    return [([5], 17, 1, False, [1, 2]), ([6], 9, 2, False, [3]), chunk]


@pytest.mark.parametrize("kind,T,key", [("fresh", 11, (4, 16)), ("continuing", 13, (4, 13)),
                                        ("fresh", 2, (2, 8))])
def test_mixed_body_equals_the_eager_step(pair, kind, T, key):
    """The body of a mixed graph (key = (rows, tokens)), filled by the decode and chunk
    graphs' own fills, computes what the eager forward of the whole step computes: the two
    decode rows and the chunk's rows, every state of slots 1-3 and the step's KV rows; no
    other slot or page changes but the sinks (slot 0, page 0), where the pads go. (2, 8): no
    decode pads; (4, 13): no chunk pads."""
    _, kf, cache = pair
    layout = _step(kf, cache, kind, T)
    rows = [0, 1, 2 + T - 1]
    before = [t.clone() for t in _tensors(cache)]
    want = kf.km.forward_eager(ForwardBatch.build(layout, rows, "cpu"))
    eager = [t.clone() for t in _tensors(cache)]
    for t, b in zip(_tensors(cache), before):
        t.copy_(b)
    m = _family(kf, kind)
    m.decode.to_sinks()
    m.chunk.to_sinks(32)
    batch = ForwardBatch.build(layout, rows, "cpu")
    m.fill(sub_batch(batch, [0, 1]), sub_batch(batch, [2]), key)
    got = m.body(key)
    b = key[0]
    assert got.shape[0] == key[0] + key[1]
    assert rel_err(got[:2], want[:2]) < 1e-5
    assert rel_err(got[b:b + T], want[2:]) < 1e-5
    conv, rec, k, v = _tensors(cache)
    for s in (1, 2, 3):
        assert rel_err(conv[:, s], eager[0][:, s]) < 1e-5
        assert rel_err(rec[:, s], eager[1][:, s]) < 1e-5
    for p in (1, 2, 3, 4, 5, 6):
        assert rel_err(k[:, p], eager[2][:, p]) < 1e-5 and rel_err(v[:, p], eager[3][:, p]) < 1e-5
    others = [s for s in range(conv.shape[1]) if s not in (0, 1, 2, 3)]
    assert torch.equal(conv[:, others], before[0][:, others])
    assert torch.equal(rec[:, others], before[1][:, others])
    free = [p for p in range(k.shape[1]) if p not in (0, 1, 2, 3, 4, 5, 6)]
    assert torch.equal(k[:, free], before[2][:, free])
    assert torch.equal(v[:, free], before[3][:, free])


def _through_the_dispatch(kf, cache, monkeypatch, kind, layout, rows, n_max, keys=()):
    """(the eager step's rows, the rows `KernelForward.forward` returns with the mixed family
    of `kind` holding one graph (4 rows, 16 tokens) whose replay is stood in for by its body
    writing the graph's output, from the same cache state; `keys`: more (unused) graphs)."""
    before = [t.clone() for t in _tensors(cache)]
    want = kf.km.forward_eager(ForwardBatch.build(layout, rows, "cpu"))
    for t, b in zip(_tensors(cache), before):
        t.copy_(b)
    m = _family(kf, kind)
    m.decode.to_sinks()
    m.chunk.to_sinks(n_max)
    key = (4, 16)
    out = torch.zeros(20, kf.km.cfg.hidden_size)

    class Replay:
        def replay(self):
            out.copy_(m.body(key))

    m.graphs = {key: (Replay(), out), **{k: (None, None) for k in keys}}
    monkeypatch.setattr(kf, "mixed", [m])
    return want, kf.forward(ForwardBatch.build(layout, rows, "cpu"))


def test_forward_scatters_a_replay_into_batch_order(pair, monkeypatch):
    """`MixedGraphs.forward` through the dispatch (`KernelForward.forward`): a step of two
    decode rows and a fresh prompt replays the mixed graph, the rows land in batch order and
    equal the eager step; the decode and prefill graphs are not called."""
    _, kf, cache = pair
    calls = graph_stand_ins(kf, monkeypatch, ("decode", "prefill"), compute=False)
    layout = _step(kf, cache, "fresh", 11)
    want, got = _through_the_dispatch(kf, cache, monkeypatch, "fresh", layout, [0, 1, 12], 32,
                                      keys=[(4, 32)])
    assert calls == []
    assert got.shape == want.shape and rel_err(got, want) < 1e-5


def test_bucket_takes_one_chunk_of_its_kind(pair, switches):
    """Which steps a family replays: one chunk of its kind (fresh prompt / continuing chunk)
    beside at most the largest rows bucket, in the smallest (tokens, rows) key that holds
    them; not two chunks, a chunk past the largest tokens bucket, or too many rows."""
    _, kf, _ = pair
    fresh, cont = _family(kf, "fresh"), _family(kf, "continuing")
    fresh.min_rows = cont.min_rows = 32  # the shipped minimum (MIXED_ROWS[0])
    assert fresh.bucket(2, ForwardBatch.build([(_ids(5, 1), 0, 3, True, [4])], [0], "cpu")) is None
    keys = {(64, 8): None, (32, 8): None, (64, 16): None, (32, 16): None}
    fresh.graphs, cont.graphs = dict(keys), dict(keys)

    def one(*seqs):
        return ForwardBatch.build(list(seqs), [0], "cpu")

    new, more = (_ids(5, 1), 0, 3, True, [4]), (_ids(9, 1), 30, 3, False, [4, 5])
    assert fresh.bucket(32, one(new)) == (32, 8) and fresh.bucket(33, one(new)) == (64, 8)
    assert fresh.bucket(40, one((_ids(16, 1), 0, 3, True, [4]))) == (64, 16)
    assert fresh.bucket(31, one(new)) is None  # fewer rows than MIXED_ROWS[0]: the split
    assert fresh.bucket(65, one(new)) is None  # more rows than the largest bucket
    assert fresh.bucket(32, one((_ids(17, 1), 0, 3, True, [4, 5]))) is None  # too long
    assert fresh.bucket(32, one(more)) is None and cont.bucket(32, one(new)) is None
    assert cont.bucket(32, one(more)) == (32, 16)
    assert fresh.bucket(32, one(new, (_ids(3, 2), 0, 4, True, [6]))) is None  # two chunks


def test_keys_and_families(pair, switches):
    """The captured keys: the MIXED_ROWS below the decode graphs' largest batch and that
    batch, by the MIXED_TOKENS up to the limit, largest first. No family without the switch,
    or without CUDA graphs (the CPU)."""
    _, kf, _ = pair
    m = _family(kf, "fresh")
    assert m.keys(48, 256) == [(48, 256), (32, 256), (48, 128), (32, 128)]
    assert m.keys(128, 2048)[0] == (128, 2048) and len(m.keys(128, 2048)) == 3 * len(MIXED_TOKENS)
    assert m.keys(16, 100) == [] and m.keys(16, 2048) == []  # below 32 rows: none
    from tailored.worker.mixed_graphs import output_bytes
    assert output_bytes(48, 256, 8, 2) == 2 * (304 + 288 + 176 + 160) * 8 * 2
    assert output_bytes(16, 2048, 8, 2) == 0
    switches(mixed_graph_tokens=1024)
    assert mixed_families(kf) == []  # use_graphs is off on the CPU
    switches(mixed_graph_tokens=0)
    assert mixed_families(kf) == []


def test_forward_rows_in_any_order_beside_a_continuing_chunk(pair, monkeypatch):
    """The scatter of `MixedGraphs.forward` with the chunk first and the decode rows after
    it (batch order is the scheduler's, not the graph's: decode rows first there), for a
    chunk continuing its cached context: every row equals the eager step's."""
    _, kf, cache = pair
    graph_stand_ins(kf, monkeypatch, ("decode", "prefill"), compute=False)
    dec_a, dec_b, chunk = _step(kf, cache, "continuing", 13)
    want, got = _through_the_dispatch(kf, cache, monkeypatch, "continuing",
                                      [chunk, dec_a, dec_b], [12, 13, 14], 16)
    assert got.shape == want.shape and rel_err(got, want) < 1e-5


@pytest.mark.parametrize("kind", ["fresh", "continuing"])
def test_to_sinks_never_outgrows_buffers_graphs_point_at(pair, kind):
    """The chunk graphs' static buffers are allocated once (captured graphs point at them): a
    later `to_sinks` for more rows (a capture of a larger bucket after a mixed-step capture
    allocated them) raises instead of running bodies over truncated slices."""
    _, kf, _ = pair
    chunk = _family(kf, kind).chunk
    chunk.to_sinks(16)
    chunk.to_sinks(8)  # fewer rows: the buffers serve every smaller bucket
    with pytest.raises(ValueError, match="16 rows, 32 asked"):
        chunk.to_sinks(32)


def test_drop_decode_graphs_drops_the_mixed_graphs(pair, monkeypatch):
    """A decode re-capture with other switches (A/B benches) must not leave mixed steps
    replaying graphs captured under the old ones: `drop_decode_graphs` forgets them too."""
    _, kf, _ = pair
    monkeypatch.setattr(kf, "mixed", [_family(kf, "fresh")])
    kf.drop_decode_graphs()
    assert kf.mixed == []
