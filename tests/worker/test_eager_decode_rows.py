"""Review of the eager step's decode rows in one paged-decode launch (StepPlan.dec_kv /
dec_table / dec_lens / dec_index, AttentionBlocks.eager): `forward_eager` on mixed batches
equals the plain path, rows, GDN states and KV pages of every slot. Decode rows of several
context lengths and page-table widths, not first in the batch and interleaved with prompt
chunks, a 1-token chunk continuing a prompt (a decode row), a verify chunk beside them, a
1-token fresh prompt (prefill path)."""

from __future__ import annotations

import pytest
import torch
from helpers import new_cache, rel_err

from tailored import kernels
from tailored.model.batch import ForwardBatch, SeqInfo
from tailored.model.step_plan import build_plan

pytestmark = [pytest.mark.skipif(not kernels.available(), reason="triton not installed"),
              pytest.mark.usefixtures("one_thread")]

from test_kernel_path import _ids, _make_pair  # noqa: E402


@pytest.fixture(scope="module")
def pair4(tiny4_ckpt):
    return _make_pair(tiny4_ckpt)


def _both(plain, kf, pcache, layout, keep=()):
    rows = list(range(sum(len(t[0]) for t in layout)))
    hp = plain(ForwardBatch.build(layout, rows, "cpu"), pcache)
    hf = kf.km.forward_eager(ForwardBatch.build(layout, rows, "cpu"))
    for slot, k in keep:
        pcache.commit_states(slot, k)
        kf.km.cache.commit_states(slot, k)
    return hf, hp


def _check(hf, hp, fcache, pcache, what):
    assert rel_err(hf, hp) < 1e-4, what
    assert rel_err(fcache.rec, pcache.rec) < 1e-4, what
    assert rel_err(fcache.conv, pcache.conv) < 1e-5, what
    assert rel_err(fcache.k, pcache.k) < 1e-5, what
    assert rel_err(fcache.v, pcache.v) < 1e-5, what


def test_eager_mixed_step_decode_rows_match_plain_path(pair4):
    plain, kf, fcache = pair4
    for t in (fcache.conv, fcache.rec, fcache.k, fcache.v):
        t.zero_()
    pcache = new_cache(plain.config)
    A, B, C, D, E, F, G = (_ids(n, s) for n, s in
                           ((21, 11), (40, 12), (5, 13), (10, 14), (12, 15), (6, 16), (1, 17)))
    pA, pB, pC, pD, pE, pF, pG = [1, 2], [3, 4, 5, 20], [6], [7], [8], [9], [10]
    # step 1: prompts (D leaves its last token for a 1-token continuing chunk)
    s1 = [(A[:20], 0, 1, True, pA), (B, 0, 2, True, pB), (C, 0, 3, True, pC),
          (D[:9], 0, 4, True, pD), (E[:9], 0, 5, True, pE)]
    hf, hp = _both(plain, kf, pcache, s1)
    _check(hf, hp, fcache, pcache, "prefill")
    # step 2: a fresh prompt first, decode rows of different contexts and table widths
    # interleaved with a verify chunk, a 1-token continuing chunk and a 1-token fresh prompt
    s2 = [(F, 0, 6, True, pF),                # fresh prompt (prefill path)
          ([A[20]], 20, 1, False, pA),         # decode, 21 keys, 2 pages
          (E[9:12], 9, 5, False, pE, True),    # verify chunk (keep_states)
          ([77], 40, 2, False, pB),            # decode, 41 keys, 4 pages (one unused)
          ([D[9]], 9, 4, False, pD),           # 1-token chunk continuing a prompt
          (G, 0, 7, True, pG),                 # 1-token fresh prompt (resets its slot)
          ([88], 5, 3, False, pC)]             # decode, 6 keys, 1 page
    hf, hp = _both(plain, kf, pcache, s2, keep=[(5, 2)])
    _check(hf, hp, fcache, pcache, "mixed")
    # step 3: decode only (eager), rows in an order unlike their slots'
    s3 = [([99], 6, 3, False, pC), ([55], 41, 2, False, pB), ([66], 21, 1, False, pA),
          ([44], 1, 7, False, pG), ([33], 10, 4, False, pD), ([22], 6, 6, False, pF)]
    hf, hp = _both(plain, kf, pcache, s3)
    _check(hf, hp, fcache, pcache, "decode")


def test_build_plan_decode_fields():
    """dec_kv / dec_table / dec_lens / dec_index for decode rows not in seqs order, odd-length
    parts before the table (alignment pads), tables of different widths."""
    pre = [SeqInfo(0, 3, 0, 5, True, [1])]
    d1 = SeqInfo(4, 1, 33, 1, False, [6, 7, 8])
    d2 = SeqInfo(3, 1, 0, 2, False, [9])   # 1 token, start 0, not reset
    d3 = SeqInfo(5, 1, 16, 3, False, [10, 11, 12, 13])
    seqs = [pre[0], d2, d1, d3]
    dec = [d1, d3, d2]  # not seqs order
    plan = build_plan(seqs, pre, dec, 16, torch.device("cpu"))
    assert plan.dec_rows.tolist() == [4, 5, 3]
    assert plan.dec_kv.tolist() == [8 * 16 + 1, 11 * 16 + 0, 9 * 16]
    assert plan.dec_table.tolist() == [[6, 7, 8, 0], [10, 11, 12, 13], [9, 0, 0, 0]]
    assert plan.dec_table.dtype == torch.int32 and plan.dec_table.is_contiguous()
    assert plan.dec_lens.tolist() == [34, 17, 1] and plan.dec_lens.dtype == torch.int32
    assert set(plan.dec_index) == {1, 2, 3}
