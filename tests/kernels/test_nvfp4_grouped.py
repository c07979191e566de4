"""kernels/nvfp4_grouped.py (the W4A16 grouped GEMM of NVFP4 prefill experts) against its
plain-PyTorch reference (the experts dequantized by `nvfp4.DequantExperts` in fp32, fp32
matmuls): odd token counts, an expert with no rows, H/I that leave partial N tiles and K
steps, expert blocks of several BLOCK_M rows, NaN-poisoned outputs, bf16 and fp32
activations, the sorted-rows contract with the combine, and bad operands refused.

CPU: Triton's interpreter at small shapes; the GPU runs the same file compiled, plus the
model's shapes (E=256, k=8, H=2048, I=512)."""

from __future__ import annotations

import pytest
import torch
from poison import nan_empty

from tailored import kernels
from tailored.model import nvfp4

pytestmark = pytest.mark.skipif(not kernels.available(), reason="triton not installed")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
GPU = pytest.mark.skipif(DEV != "cuda", reason="needs a CUDA GPU")


def _experts(E, H, I, seed):
    """NVFP4 experts by the reference quantizer, with a range of group scales."""
    g = torch.Generator().manual_seed(seed)
    gu = torch.randn(E, 2 * I, H, generator=g) * H ** -0.5
    dn = torch.randn(E, H, I, generator=g) * I ** -0.5
    gu[:, : I // 3] *= 8.0
    dn[:, :, : I // 4] *= 0.01
    return ([t.to(DEV) for t in nvfp4.quantize_experts(gu.to(DEV), 2)],
            [t.to(DEV) for t in nvfp4.quantize_experts(dn.to(DEV), 1)])


def _routing(T, E, k, seed, empty=(1,)):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(T, E, generator=g)
    scores[:, list(empty)] = -1.0  # experts with no rows
    return scores.topk(k, dim=1).indices.to(DEV), torch.rand(T, k, generator=g).to(DEV)


def _ref(x, w, ids, gu, dn):
    from tailored.kernels.nvfp4_grouped import nvfp4_grouped_ref

    return nvfp4_grouped_ref(x, w, ids, nvfp4.DequantExperts(*gu, torch.float32),
                             nvfp4.DequantExperts(*dn, torch.float32))


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# bf16: act and y rounded to bf16 (truncated in Triton's interpreter), ~2^-8 each
BOUND = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}


@pytest.mark.parametrize("T,H,I", [(1, 256, 128), (7, 208, 96), (33, 256, 128),
                                   (130, 208, 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_matches_reference(T, H, I, dtype):
    """E=8, k=2, expert 1 without rows; (208, 96): a partial last N tile and K step in both
    GEMMs (64-wide tiles), K groups of 16 that end mid-tile."""
    from tailored.kernels.nvfp4_grouped import nvfp4_grouped_experts

    E, k = 8, 2
    gu, dn = _experts(E, H, I, H + I)
    ids, w = _routing(T, E, k, T)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(T)).to(DEV, dtype)
    with nan_empty():
        got = nvfp4_grouped_experts(x, w, ids, gu, dn)
    want = _ref(x, w, ids, gu, dn)
    assert got.shape == (T * k, H) and got.dtype == torch.float32
    assert torch.isfinite(got).all()
    print(f"T={T} H={H} I={I} {dtype}: grouped vs reference {_rel(got, want):.2e}")
    assert _rel(got, want) < BOUND[dtype], _rel(got, want)


def test_expert_blocks_of_several_row_blocks():
    """BLOCK_M forced to 16 (gate_up) and 32 (down): each expert's ~30 rows span several
    blocks, the last one partial, and the two GEMMs number their blocks differently."""
    from tailored.kernels.nvfp4_grouped import nvfp4_grouped_experts

    E, k, T, H, I = 8, 2, 130, 208, 96
    gu, dn = _experts(E, H, I, 5)
    ids, w = _routing(T, E, k, 6, empty=(1, 6))
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(7)).to(DEV)
    with nan_empty():
        got = nvfp4_grouped_experts(x, w, ids, gu, dn, block_m=(16, 32))
    assert _rel(got, _ref(x, w, ids, gu, dn)) < 1e-5


def test_sorted_rows_compose_with_the_combine():
    """bf16 activations (the served dtype): `nvfp4_grouped_experts_sorted` + the combine's
    gather equals unsort_weighted + the combine bit for bit (the grouped path's contract,
    kb/0031), and the sum over slots is the reference's at bf16's rounding."""
    from tailored.kernels.moe_combine import moe_combine
    from tailored.kernels.moe_grouped import unsort_weighted
    from tailored.kernels.moe_route import moe_align
    from tailored.kernels.nvfp4_grouped import nvfp4_grouped_experts_sorted

    E, k, T, H, I = 8, 2, 21, 256, 128
    gu, dn = _experts(E, H, I, 3)
    ids, w = _routing(T, E, k, 4)
    bf = torch.bfloat16
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, H, generator=g).to(DEV, bf)
    w = w.to(bf)
    seg = torch.randn(T, 1, generator=g).to(DEV, bf)
    shared = torch.randn(T, H, generator=g).to(DEV, bf)
    order, offsets = moe_align(ids, E)
    y, rows = nvfp4_grouped_experts_sorted(x, w, ids, gu, dn, aligned=(order, offsets))
    assert y.dtype == bf and y.shape == (T * k, H) and rows.dtype == torch.int32
    got = moe_combine(y, k, seg, shared, rows=rows, weights=w)
    pairs = unsort_weighted(y, order, w)
    assert torch.equal(got, moe_combine(pairs, k, seg, shared))
    assert _rel(pairs, _ref(x, w, ids, gu, dn)) < BOUND[bf]


def test_bad_operands_are_refused():
    from tailored.kernels.nvfp4_grouped import nvfp4_grouped_experts

    E, k, T, H, I = 4, 2, 3, 64, 32
    gu, dn = _experts(E, H, I, 1)
    ids, w = _routing(T, E, k, 2, empty=())
    x = torch.randn(T, H, device=DEV)
    bad = [
        (x[:, :48], w, ids, gu, dn),                             # H ≠ the experts'
        (x.to(torch.int32), w, ids, gu, dn),                     # not a float x
        (x, w, ids.float(), gu, dn),                             # float ids
        (x, w[:, :1], ids, gu, dn),                              # weights ≠ ids
        (x, w, ids, [gu[0].float(), gu[1], gu[2]], dn),          # unpacked weights
        (x, w, ids, gu, [dn[0], dn[1].float(), dn[2]]),          # scales not e4m3
        (x, w, ids, [gu[0], gu[1][:, :, :2], gu[2]], dn),        # scale shape
        (x, w, ids, gu, [dn[0], dn[1], dn[2][:, :0]]),           # global scales
        (x, w, ids, [gu[0].transpose(1, 2).contiguous().transpose(1, 2), gu[1], gu[2]], dn),
    ]
    for args in bad:
        with pytest.raises(ValueError, match="nvfp4_grouped"):
            nvfp4_grouped_experts(*args)
    # H not a multiple of 16 cannot hold NVFP4 groups
    x40 = torch.randn(T, 40, device=DEV)
    gu40 = [torch.zeros(E, 2 * I, 20, dtype=torch.uint8, device=DEV),
            torch.zeros(E, 2 * I, 2, device=DEV).to(torch.float8_e4m3fn), gu[2]]
    with pytest.raises(ValueError, match="multiples of 16"):
        nvfp4_grouped_experts(x40, w, ids, gu40, dn)


@GPU
@pytest.mark.parametrize("T", [1000, 8192])
def test_full_size_prefill_shapes_on_the_gpu(T):
    """The model's routed experts: E=256 of [1024, 2048] / [2048, 512], k=8, bf16, autotuned
    launch configs; against the reference and against the scratch path it replaces (the
    experts dequantized to bf16, then torch's grouped GEMM)."""
    from tailored.kernels import moe_grouped
    from tailored.kernels.nvfp4_gemv import dequantize_into
    from tailored.kernels.nvfp4_grouped import nvfp4_grouped_experts

    E, k, H, I = 256, 8, 2048, 512
    torch.manual_seed(0)
    gu = nvfp4.quantize_experts(torch.randn(E, 2 * I, H, device=DEV) * H ** -0.5, 2)
    dn = nvfp4.quantize_experts(torch.randn(E, H, I, device=DEV) * I ** -0.5, 1)
    x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16)
    ids = torch.rand(T, E, device=DEV).topk(k, dim=1).indices
    w = torch.rand(T, k, device=DEV)
    got = nvfp4_grouped_experts(x, w, ids, gu, dn)
    want = _ref(x, w, ids, gu, dn)
    rel = _rel(got, want)
    print(f"T={T}: grouped vs reference {rel:.2e}")
    assert torch.isfinite(got).all() and rel < BOUND[torch.bfloat16]
    if moe_grouped.available():
        bgu = dequantize_into(*gu, out=torch.empty(E, 2 * I, H, dtype=torch.bfloat16,
                                                   device=DEV))
        bdn = dequantize_into(*dn, out=torch.empty(E, H, I, dtype=torch.bfloat16, device=DEV))
        scratch = moe_grouped.grouped_experts(x, w, ids, bgu, bdn)
        print(f"T={T}: scratch path vs reference {_rel(scratch, want):.2e}")
        assert _rel(got, want) <= 2 * _rel(scratch, want) + 1e-3
