"""kernels/gdn_conv.py (the prefill causal conv of every sequence in one launch, kb/0029) against
`ref.causal_conv1d` run per sequence: odd channel counts, sequences shorter than the window,
continued (carried state) and reset sequences, inputs interleaved with rows no sequence reads
(the decode rows of a mixed step), NaN-poisoned output and state buffers, padded grids.

CPU: Triton's interpreter in fp32; GPU: compiled, fp32 and bf16.
"""

from __future__ import annotations

import pytest
import torch

from tailored import kernels
from tailored.ops import reference as ref

pytestmark = pytest.mark.skipif(not kernels.available(), reason="triton not installed")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if DEV == "cuda" else [torch.float32]


def _case(C, W, lens, resets, dtype, seed, gap=2):
    """x with `gap` foreign rows before each sequence; states of 5 slots, NaN in the slot 0 sink
    and in slots nobody uses; sequences in slots 3, 1, 4, ... Returns (x, state, weight, meta,
    slots, where each sequence's rows are)."""
    g = torch.Generator().manual_seed(seed)
    rows, q = [], 0
    for L in lens:
        q += gap
        rows.append((q, L))
        q += L
    x = torch.randn(q + 1, C, generator=g).to(DEV, dtype)
    w = (torch.randn(C, W, generator=g) * 0.5).to(DEV, dtype)
    state = torch.randn(6, C, W - 1, generator=g).to(DEV, dtype)
    order = [3, 1, 4, 5, 2][:len(lens)]
    for s in set(range(6)) - set(order):
        state[s] = float("nan")
    o, meta = 0, []
    for (q0, L), r in zip(rows, resets):
        meta.append([q0, L, o, int(r)])
        o += L
    meta_t = torch.tensor(meta, dtype=torch.int64).t().contiguous().to(DEV)
    return x, state, w, meta_t, torch.tensor(order, dtype=torch.int32, device=DEV), rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("C,W,lens,resets", [
    (200, 4, [1, 2, 3, 40], [True, False, False, True]),  # shorter than the window, carried
    (130, 4, [17], [False]),
    (64, 3, [5, 1], [False, True]),
    (96, 2, [7, 3, 1], [False, False, True]),
])
def test_conv_prefill_and_state_update_equal_the_per_sequence_reference(dtype, C, W, lens,
                                                                       resets):
    from tailored.kernels.gdn_conv import conv_prefill, conv_state_update

    x, state, w, meta, slots, rows = _case(C, W, lens, resets, dtype, seed=C + W + len(lens))
    want_y, want_s = [], {}
    for (q0, L), r, s in zip(rows, resets, slots.tolist()):
        cs = torch.zeros_like(state[s]) if r else state[s]
        y, ns = ref.causal_conv1d(x[q0:q0 + L].float(), cs.float(), w.float())
        want_y.append(y)
        want_s[s] = ns
    n = sum(lens)
    before = state.clone()
    out = conv_prefill(x, state, w, meta, slots, n + 3, max_len=max(lens) + 20)
    assert out.shape == (n + 3, C) and out.dtype == dtype
    assert torch.equal(state.isnan(), before.isnan()) and torch.equal(
        state.nan_to_num(), before.nan_to_num())  # read only
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    got = out[:n].float()
    assert torch.isfinite(got).all()
    assert ((got - torch.cat(want_y)).abs().max() / torch.cat(want_y).abs().max()) < tol
    conv_state_update(x, state, w, meta, slots)
    for s in range(6):
        if s in want_s:
            assert torch.equal(state[s].float(), want_s[s].to(dtype).float()), s
        else:  # untouched (NaN stays NaN)
            assert torch.equal(state[s].isnan(), before[s].isnan()), s


def test_conv_prefill_of_a_padded_bucket_keeps_real_rows_and_pads_finite():
    """The prefill-graph layout: one fresh sequence in a bucket of n rows; the conv runs over
    all n (pads last, so real rows never read them) and the state update over the real T."""
    from tailored.kernels.gdn_conv import conv_prefill, conv_state_update

    C, W, T, n = 72, 4, 5, 16
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, C, generator=g).to(DEV)
    w = torch.randn(C, W, generator=g).to(DEV)
    state = torch.full((3, C, W - 1), float("nan"), device=DEV)
    slots = torch.tensor([2], device=DEV)
    conv_meta = torch.tensor([[0], [n], [0], [1]], dtype=torch.int64, device=DEV)
    y = conv_prefill(x, state, w, conv_meta, slots, n, max_len=n)
    want, ns = ref.causal_conv1d(x[:T], torch.zeros(C, W - 1, device=DEV), w)
    assert torch.isfinite(y).all() and torch.allclose(y[:T], want, atol=1e-5, rtol=1e-5)
    conv_state_update(x, state, w, torch.tensor([[0], [T], [0], [1]], device=DEV), slots)
    assert torch.equal(state[2], ns) and state[:2].isnan().all()


def test_gdn_conv_rejects_bad_input():
    from tailored.kernels.gdn_conv import conv_prefill

    x, state, w, meta, slots, _ = _case(32, 4, [3], [True], torch.float32, seed=1)
    with pytest.raises(ValueError, match="seq_meta"):
        conv_prefill(x, state, w, meta.int(), slots, 3, 3)
    with pytest.raises(ValueError, match="state"):
        conv_prefill(x, state[:, :, :2], w, meta, slots, 3, 3)
    with pytest.raises(ValueError, match="x"):
        conv_prefill(x.t(), state, w, meta, slots, 3, 3)
