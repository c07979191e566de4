"""Batching, chunking and state-isolation invariants of the model forward (failure-cases §1, §2)."""

from __future__ import annotations

import pytest
import torch

from helpers import new_cache, rel_err, run_seq
from tailored.model.batch import ForwardBatch


def _ids(T, seed):
    return torch.randint(0, 248044, (T,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.contract("chunked-prefill-equals-single-pass")
@pytest.mark.parametrize("T,chunk", [(65, 16), (129, 64), (130, 50), (64, 1)])
def test_chunked_prefill_equals_single_pass(tiny_model, T, chunk):
    ids = _ids(T, T)
    pages = list(range(1, 2 + T // 16))
    ref = run_seq(tiny_model, new_cache(tiny_model.config), ids, 0, 1, pages, [T - 1])
    cache = new_cache(tiny_model.config)
    for s in range(0, T, chunk):
        last = run_seq(tiny_model, cache, ids[s:s + chunk], s, 1, pages, [min(chunk, T - s) - 1])
    assert rel_err(last, ref) <= 1e-5


@pytest.mark.contract("mixed-step-isolation")
def test_mixed_batch_equals_separate_runs_and_spares_other_slots(tiny_model):
    """Decode rows + several new prefills in one step == each alone; slots outside untouched."""
    cfg = tiny_model.config
    cache = new_cache(cfg)
    a, b = _ids(40, 1), _ids(70, 2)
    pa, pb, pc, pd = [1, 2, 3], [4, 5, 6, 7, 8], [9, 10], [11, 12, 13]
    run_seq(tiny_model, cache, a[:-1], 0, 1, pa, [38])
    run_seq(tiny_model, cache, b[:-1], 0, 2, pb, [68])
    # poison an unused slot and page: they must stay bit-identical
    cache.rec[:, 7].normal_()
    cache.conv[:, 7].normal_()
    spare_rec, spare_conv = cache.rec[:, 7].clone(), cache.conv[:, 7].clone()
    c, d = _ids(20, 3), _ids(33, 4)
    batch = ForwardBatch.build(
        [(a[-1:], 39, 1, False, pa), (b[-1:], 69, 2, False, pb), (c, 0, 3, True, pc), (d, 0, 4, True, pd)],
        [0, 1, 21, 54], "cpu")
    # slot 3 holds garbage from an earlier request: reset_state must clear it
    cache.rec[:, 3].normal_()
    mixed = tiny_model.compute_logits(tiny_model(batch, cache)[batch.logits_rows])
    assert torch.equal(cache.rec[:, 7], spare_rec) and torch.equal(cache.conv[:, 7], spare_conv)
    alone = []
    for ids, pages in ((a, pa), (b, pb), (c, pc), (d, pd)):
        alone.append(run_seq(tiny_model, new_cache(cfg), ids, 0, 1, pages, [len(ids) - 1])[0])
    for i in range(4):
        assert rel_err(mixed[i], alone[i]) <= 1e-5


def test_activations_finite_and_not_degenerate(tiny_model):
    cache = new_cache(tiny_model.config)
    l1 = run_seq(tiny_model, cache, _ids(50, 9), 0, 1, [1, 2, 3, 4])
    l2 = run_seq(tiny_model, new_cache(tiny_model.config), _ids(50, 10), 0, 1, [1, 2, 3, 4])
    assert torch.isfinite(l1).all()
    assert l1.std() > 0.5
    assert not torch.equal(l1.argmax(-1), l2.argmax(-1))
