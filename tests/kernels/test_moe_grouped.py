"""kernels/moe_grouped.py against plain PyTorch: the grouped-GEMM routed experts of large prefill
steps, its fp32 unsort, and the block-FP8 expert dequantization (CPU: Triton's interpreter and
torch's CPU grouped_mm; the H200 runs the same tests compiled, and test_gpu.py at full size)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tailored import kernels
from tailored.kernels import moe_grouped
from tailored.model import fp8
from tailored.ops import reference as ref

pytestmark = pytest.mark.skipif(not kernels.available() or not moe_grouped.available(),
                                reason="triton or torch._grouped_mm missing")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# Triton's CPU interpreter rounds fp32 -> bf16 stores differently from torch (not RNE), so the
# bitwise dequantization check runs in fp32 there and in both dtypes on the GPU
DTYPES = [torch.float32, torch.bfloat16] if DEV == "cuda" else [torch.float32]


def pair_terms_ref(x, w, ids, gate_up, down):
    """[T·k, H] fp32: w · Expert_e(x) per (token, slot), each expert as bf16 F.linear calls."""
    T, k = ids.shape
    I = down.shape[2]
    out = torch.empty(T * k, x.shape[1], dtype=torch.float32, device=x.device)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            g, u = F.linear(x[t:t + 1], gate_up[e]).split(I, dim=-1)
            y = F.linear(F.silu(g) * u, down[e])
            out[t * k + j] = y[0].float() * w[t, j].float()
    return out


@pytest.mark.parametrize("T,E,k,H,I", [(37, 16, 4, 64, 32), (5, 8, 2, 128, 48)])
def test_grouped_experts_matches_reference(T, E, k, H, I):
    g = torch.Generator(device=DEV).manual_seed(T)
    bf = torch.bfloat16
    x = torch.randn(T, H, device=DEV, generator=g).to(bf)
    gate_up = (torch.randn(E, 2 * I, H, device=DEV, generator=g) * H ** -0.5).to(bf)
    down = (torch.randn(E, H, I, device=DEV, generator=g) * I ** -0.5).to(bf)
    # expert 1 gets no rows: an empty group must be skipped, not read out of bounds
    scores = torch.rand(T, E, device=DEV, generator=g)
    scores[:, 1] = -1.0
    ids = scores.topk(k, dim=1).indices
    w = torch.rand(T, k, device=DEV, generator=g).to(bf)
    got = moe_grouped.grouped_experts(x, w, ids, gate_up, down)
    want = pair_terms_ref(x, w, ids, gate_up, down)
    assert got.dtype == torch.float32 and got.shape == (T * k, H)
    assert torch.isfinite(got).all()
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 1e-2, rel
    summed = got.view(T, k, H).sum(1)
    moe = ref.moe_experts(x.float(), w.float(), ids, gate_up.float(), down.float())
    assert ((summed - moe).norm() / moe.norm()).item() < 2e-2


def test_grouped_experts_refuses_bad_input():
    bf = torch.bfloat16
    x = torch.zeros(4, 64, dtype=bf, device=DEV)
    gu, dn = torch.zeros(8, 64, 64, dtype=bf, device=DEV), torch.zeros(8, 64, 32, dtype=bf, device=DEV)
    ids, w = torch.zeros(4, 2, dtype=torch.long, device=DEV), torch.ones(4, 2, device=DEV)
    with pytest.raises(ValueError, match="bf16"):
        moe_grouped.grouped_experts(x.float(), w, ids, gu, dn)
    with pytest.raises(ValueError, match="shapes"):
        moe_grouped.grouped_experts(x, w, ids, gu, dn[:, :32])
    with pytest.raises(ValueError, match="shapes"):
        moe_grouped.grouped_experts(x, w[:, :1], ids, gu, dn)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unsort_weighted(dtype):
    g = torch.Generator(device=DEV).manual_seed(3)
    T, k, H = 13, 3, 200  # H not a power of 2: a masked last column block
    y = torch.randn(T * k, H, device=DEV, generator=g).to(dtype)
    order = torch.randperm(T * k, device=DEV, generator=g).to(torch.int32)
    w = torch.rand(T, k, device=DEV, generator=g).to(dtype)
    got = moe_grouped.unsort_weighted(y, order, w)
    want = torch.full((T * k, H), float("nan"), device=DEV)
    want[order.long()] = y.float() * w.reshape(-1)[order.long()].float()[:, None]
    assert torch.equal(got, want)
    with pytest.raises(ValueError):
        moe_grouped.unsort_weighted(y, order[:-1], w)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gate_up,N,K", [(True, 192, 200), (True, 256, 128), (False, 200, 96)])
def test_dequantize_experts_is_blockwise_reference(gate_up, N, K, dtype):
    """Bitwise `fp8.dequantize_block` per expert (per half of a gate_up expert), with halves
    (I = 96) and K (200) that are not multiples of 128."""
    g = torch.Generator(device=DEV).manual_seed(N + K)
    E = 3
    w = torch.randn(E, N, K, device=DEV, generator=g)
    q, s = fp8.quantize_experts(w, gate_up)
    bs = fp8.expert_block_scales(s, gate_up)
    out = torch.full((E, N, K), float("nan"), dtype=dtype, device=DEV)
    got = moe_grouped.dequantize_experts(q, bs, gate_up, out=out)
    assert got is out
    for e in range(E):
        if gate_up:
            want = torch.cat([fp8.dequantize_block(q[e, :N // 2], s[e, 0], dtype),
                              fp8.dequantize_block(q[e, N // 2:], s[e, 1], dtype)])
        else:
            want = fp8.dequantize_block(q[e], s[e], dtype)
        assert torch.equal(got[e], want), e


def test_dequantize_experts_refuses_bad_input():
    q = torch.zeros(2, 128, 128, device=DEV).to(torch.float8_e4m3fn)
    s = torch.ones(2, 1, 1, device=DEV)
    with pytest.raises(ValueError):
        moe_grouped.dequantize_experts(q, s, gate_up=True)  # gate_up wants 2 block rows
    with pytest.raises(ValueError):
        moe_grouped.dequantize_experts(q.float(), s, gate_up=False)
    with pytest.raises(ValueError):
        moe_grouped.dequantize_experts(q, s, gate_up=False,
                                       out=torch.empty(2, 128, 64, device=DEV))


@pytest.mark.parametrize("with_norm", [False, True])
def test_combine_gathering_sorted_outputs_is_bitwise_the_unsorted_path(with_norm):
    """moe_combine(y, ..., rows=, weights=) over expert-sorted outputs equals, bit for bit,
    unsort_weighted then moe_combine: the same fp32 products, summed in the same order
    (kb/0031), with and without the next norm."""
    from tailored.kernels.moe_combine import moe_combine

    g = torch.Generator(device=DEV).manual_seed(5)
    bf = torch.bfloat16
    T, E, k, H, I = 21, 16, 4, 64, 32
    x = torch.randn(T, H, device=DEV, generator=g).to(bf)
    gate_up = (torch.randn(E, 2 * I, H, device=DEV, generator=g) * H ** -0.5).to(bf)
    down = (torch.randn(E, H, I, device=DEV, generator=g) * I ** -0.5).to(bf)
    ids = torch.rand(T, E, device=DEV, generator=g).topk(k, dim=1).indices
    w = torch.rand(T, k, device=DEV, generator=g).to(bf)
    seg = torch.randn(T, 1, device=DEV, generator=g).to(bf)
    shared = torch.randn(T, H, device=DEV, generator=g).to(bf)
    norm = ((torch.randn(T, H, device=DEV, generator=g).to(bf),
             torch.randn(H, device=DEV, generator=g).to(bf), 1e-6) if with_norm else None)
    want = moe_combine(moe_grouped.grouped_experts(x, w, ids, gate_up, down), k, seg, shared,
                       norm)
    y, rows = moe_grouped.grouped_experts_sorted(x, w, ids, gate_up, down)
    assert y.dtype == bf and rows.shape == (T * k,)
    got = moe_combine(y, k, seg, shared, norm, rows=rows, weights=w)
    for a, b in zip(got if with_norm else [got], want if with_norm else [want]):
        assert torch.equal(a, b)
    with pytest.raises(ValueError):
        moe_combine(y, k, seg, shared, rows=rows)  # weights missing
    with pytest.raises(ValueError):
        moe_combine(y, k, seg, shared, rows=rows[:-1], weights=w)
    with pytest.raises(ValueError):
        moe_combine(y, k, seg, shared)  # bf16 pairs without rows
