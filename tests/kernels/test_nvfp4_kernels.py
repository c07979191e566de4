"""The NVFP4 W4A16 kernels against their plain-PyTorch references (spec §9.2): the dense GEMV
(`nvfp4_gemv`, 1–16 rows), the one-pass dequantization (`dequantize_into`, bitwise) and the
MoE pair GEMVs (`nvfp4_moe_pairs`), on odd sizes, row views and NaN-poisoned outputs.

CPU: Triton's interpreter in fp32 at small shapes; GPU: compiled, fp32 and bf16, and the
model's decode shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from poison import nan_empty

from tailored import kernels
from tailored.model import nvfp4
from tailored.ops import reference as ref

pytestmark = pytest.mark.skipif(not kernels.available(), reason="triton not installed")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if DEV == "cuda" else [torch.float32]
GPU = pytest.mark.skipif(DEV != "cuda", reason="needs a CUDA GPU")


def _weight(N, K, seed, lead=()):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*lead, N, K, generator=g) * K ** -0.5
    w[..., : max(1, N // 3), :] *= 40.0  # a range of group scales
    return w


def _q(w):
    p, s, s2 = nvfp4.quantize(w)
    return p.to(DEV), s.to(DEV), s2.to(DEV)


def _tol(dtype):
    return (2e-5, 2e-5) if dtype == torch.float32 else (2e-2, 2e-2)


@pytest.mark.parametrize("T,N,K", [(1, 40, 64), (3, 24, 96), (16, 9, 48), (2, 130, 1040)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_matches_dequantize_then_linear(T, N, K, dtype):
    p, s, s2 = _q(_weight(N, K, T * N + K))
    x = torch.randn(T, K, generator=torch.Generator().manual_seed(T)).to(DEV, dtype)
    from tailored.kernels.nvfp4_gemv import nvfp4_gemv

    with nan_empty():
        y = nvfp4_gemv(x, p, s, s2)
    want = F.linear(x.float(), nvfp4.dequantize(p, s, s2, torch.float32))
    assert y.dtype == dtype and torch.isfinite(y).all()
    torch.testing.assert_close(y.float(), want, rtol=_tol(dtype)[0], atol=_tol(dtype)[1] * want.abs().max())
    # configs that split K into several steps and rows into several programs agree
    y2 = nvfp4_gemv(x, p, s, s2, cfg=(4, 32 if K < 500 else 256, 1))
    torch.testing.assert_close(y2.float(), want, rtol=_tol(dtype)[0], atol=_tol(dtype)[1] * want.abs().max())


def test_gemv_reads_a_row_view_and_refuses_bad_input():
    from tailored.kernels.nvfp4_gemv import nvfp4_gemv

    p, s, s2 = _q(_weight(50, 64, 7))
    x = torch.randn(2, 64, device=DEV)
    # rows 10.. of a fused weight: a view whose rows start mid-tensor
    got = nvfp4_gemv(x, p[10:], s[10:], s2)
    want = F.linear(x, nvfp4.dequantize(p[10:], s[10:], s2, torch.float32))
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5 * want.abs().max())
    for bad in [(torch.randn(17, 64, device=DEV), p, s), (x, p.float(), s), (x, p, s[:, :2]),
                (torch.randn(2, 40, device=DEV), p[:, :20], s[:, :2])]:
        with pytest.raises(ValueError, match="nvfp4_gemv"):
            nvfp4_gemv(bad[0], bad[1], bad[2], s2)


@pytest.mark.parametrize("lead,N,K,parts", [((), 37, 48, 1), ((3,), 8, 32, 2), ((2,), 24, 64, 1)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_into_is_bitwise_the_reference(lead, N, K, parts, dtype):
    from tailored.kernels.nvfp4_gemv import dequantize_into

    w = _weight(N, K, N + K, lead)
    if lead:
        p, s, s2 = (t.to(DEV) for t in nvfp4.quantize_experts(w, parts))
        want = nvfp4.DequantExperts(p, s, s2, dtype).all()
    else:
        p, s, s2 = _q(w)
        want = nvfp4.dequantize(p, s, s2, dtype)
    out = torch.full(want.shape, float("nan"), dtype=dtype, device=DEV)
    assert dequantize_into(p, s, s2, out) is out and torch.equal(out, want)


@pytest.mark.parametrize("T,E,H,I,k", [(1, 8, 64, 32, 2), (3, 4, 32, 48, 2), (40, 4, 32, 16, 2)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_pairs_match_the_reference_experts(T, E, H, I, k, dtype):
    from tailored.kernels.nvfp4_moe import nvfp4_moe_pairs

    g = torch.Generator().manual_seed(T * E + H)
    gu = [t.to(DEV) for t in nvfp4.quantize_experts(_weight(2 * I, H, 1, (E,)), 2)]
    dn = [t.to(DEV) for t in nvfp4.quantize_experts(_weight(H, I, 2, (E,)), 1)]
    x = torch.randn(T, H, generator=g).to(DEV, dtype)
    w, ids = ref.route_topk(torch.randn(T, E, generator=g).to(DEV), k)
    with nan_empty():
        pairs = nvfp4_moe_pairs(x, w, ids, gu, dn)
    assert pairs.shape == (T * k, H) and pairs.dtype == torch.float32 and torch.isfinite(pairs).all()
    got = pairs.view(T, k, H).sum(1)
    want = ref.moe_experts(x.float(), w.float(), ids,
                           nvfp4.DequantExperts(*gu, torch.float32),
                           nvfp4.DequantExperts(*dn, torch.float32))
    rtol, atol = _tol(dtype)
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol * want.abs().max())


@GPU
def test_full_size_decode_shapes_on_the_gpu():
    """The model's shapes: lm_head [248320, 2048] at 1 and 16 rows, 256 experts of
    [1024, 2048] / [2048, 512], k = 8, bf16."""
    from tailored.kernels.nvfp4_gemv import nvfp4_gemv
    from tailored.kernels.nvfp4_moe import nvfp4_moe_pairs

    torch.manual_seed(0)
    p, s, s2 = nvfp4.quantize(torch.randn(248320, 2048, device=DEV) * 2048 ** -0.5)
    wd = nvfp4.dequantize(p, s, s2, torch.float32)
    for T in (1, 16):
        x = torch.randn(T, 2048, device=DEV, dtype=torch.bfloat16)
        want = F.linear(x.float(), wd)
        torch.testing.assert_close(nvfp4_gemv(x, p, s, s2).float(), want, rtol=2e-2,
                                   atol=2e-2 * want.abs().max())
    del wd
    gu = nvfp4.quantize_experts(torch.randn(256, 1024, 2048, device=DEV) * 2048 ** -0.5, 2)
    dn = nvfp4.quantize_experts(torch.randn(256, 2048, 512, device=DEV) * 512 ** -0.5, 1)
    x = torch.randn(4, 2048, device=DEV, dtype=torch.bfloat16)
    w, ids = ref.route_topk(torch.randn(4, 256, device=DEV), 8)
    got = nvfp4_moe_pairs(x, w, ids, gu, dn).view(4, 8, 2048).sum(1)
    want = ref.moe_experts(x.float(), w.float(), ids, nvfp4.DequantExperts(*gu, torch.float32),
                           nvfp4.DequantExperts(*dn, torch.float32))
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max())
