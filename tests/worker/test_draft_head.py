"""The FP8 draft head (worker/draft_head.py): quantization round trip, the CPU reference, the
fallback to lm_head, and on a GPU the fp8_linear path against the reference (skipped without
one)."""

from __future__ import annotations

import pytest
import torch

from tailored.worker.draft_head import DraftHead, dequantize_rows, draft_argmax, quantize_rows


def _weight(N=300, K=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.05
    w[7] = 0  # an all-zero row: scale 1, q 0
    w[11, 130:] *= 40  # one block much larger than the rest of its row
    return w


def test_quantize_rows_round_trip_and_layout():
    w = _weight()
    q, s = quantize_rows(w, chunk=64)  # chunks that do not divide N
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.shape == (300, 2) and s.dtype == torch.float32
    assert torch.all(s[7] == 1) and torch.all(q[7].float() == 0)
    back = dequantize_rows(q, s)
    # e4m3 keeps 3 mantissa bits: |err| ≤ 2^-4 of each value's magnitude, and ≤ scale·2^-9 near 0
    err = (back - w).abs()
    assert torch.all(err <= w.abs() * 2**-4 + s.repeat_interleave(128, 1)[:, :200] * 2**-9)
    # the scale is the block's amax / 448: its largest value maps to ±448 exactly
    assert torch.allclose(s[11, 1], w[11, 128:].abs().max() / 448)


def test_draft_head_reference_and_argmax():
    w = _weight(N=500, K=256, seed=1)
    h = torch.randn(6, 256, generator=torch.Generator().manual_seed(2))
    head = DraftHead(w)
    got = head.logits(h)
    want = h @ dequantize_rows(head.q, head.scale).T
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert head.nbytes == 500 * 256 + 500 * 2 * 4

    class M:  # draft_argmax: the draft head when there is one, else the model's lm_head
        def compute_logits(self, x):
            return x @ w.T

    m = M()
    assert torch.equal(draft_argmax(m, None, h), (h @ w.T).argmax(-1))
    assert torch.equal(draft_argmax(m, head, h), want.argmax(-1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("B", [1, 3, 8])
def test_gpu_draft_head_equals_its_reference_at_full_vocab(B):
    """fp8_linear over the full-size lm_head shape (248320 × 2048, bf16 activations) against
    the dequantized reference in fp32; the argmax agrees with the bf16 lm_head's on rows with
    a clear winner, as a trained head has."""
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(B)
    w = (torch.randn(248320, 2048, generator=g, device=dev) * 0.02).bfloat16()
    h = torch.randn(B, 2048, generator=g, device=dev).bfloat16()
    winners = torch.randint(0, 248320, (B,), generator=g, device=dev)
    h += 0.5 * w[winners].float().sign().bfloat16()  # each row points at its winner
    head = DraftHead(w)
    got = head.logits(h).float()
    want = h.float() @ dequantize_rows(head.q, head.scale).T
    assert (got - want).abs().max().item() <= 2e-2 * want.abs().max().item()
    assert torch.equal(got.argmax(-1), winners)
    assert torch.equal((h @ w.T).float().argmax(-1), winners)
