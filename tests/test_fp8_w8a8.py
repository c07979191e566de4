"""kernels/fp8_w8a8.py (kb/0056 §5, built blind, not in the model): the per-group activation
quantization and the W8A8 block-FP8 GEMM against their fp32 references. The references and the
input checks run on the CPU; the kernels on the GPU only (the interpreter's FP8 dots and
casts are not the hardware's)."""

from __future__ import annotations

import pytest
import torch

from tailored.kernels.fp8_w8a8 import (E4M3_MAX, GROUP, quant_act_ref, w8a8_linear,
                                       w8a8_linear_ref)
from tailored.model import fp8

CUDA = torch.cuda.is_available()


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_quant_act_ref_scales_codes_and_rounding():
    """Scale = the group's absmax / 448 (the largest code is ±448), codes round to nearest
    e4m3 (relative error ≤ 2^-4 for normal codes), an all-zero group gets the floor scale and
    zero codes; K must be a multiple of 128."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3 * GROUP, generator=g) * torch.tensor([1e-3, 1.0, 50.0]).repeat_interleave(GROUP)
    x[2, GROUP:2 * GROUP] = 0.0
    q, s = quant_act_ref(x.to(torch.bfloat16))
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and s.shape == (5, 3)
    xb = x.to(torch.bfloat16).float().view(5, 3, GROUP)
    want = xb.abs().amax(-1).clamp(min=1e-10) / E4M3_MAX
    assert torch.equal(s, want)
    assert s[2, 1] == pytest.approx(1e-10 / E4M3_MAX) and not q.view(5, 3, GROUP)[2, 1].float().any()
    codes = q.float().view(5, 3, GROUP)
    assert codes.abs().amax(-1)[s > 1e-9].eq(E4M3_MAX).all()
    back = codes * s[..., None]
    normal = codes.abs() >= 2 ** -6  # e4m3's smallest normal
    assert ((back - xb).abs() <= xb.abs() * 2 ** -4 + 1e-30)[normal].all()
    # a partial last group (K = 200): its own scale over its 72 values
    y = torch.randn(2, 200, generator=g)
    q2, s2 = quant_act_ref(y)
    assert q2.shape == (2, 200) and s2.shape == (2, 2)
    assert torch.equal(s2[:, 1], y[:, 128:].abs().amax(-1) / E4M3_MAX)


def test_w8a8_linear_ref_is_the_dequantized_product():
    """The reference: (codes · group scales) times (weight codes · block scales)ᵀ in fp32,
    with N not a multiple of 128 (the last block row partial; the scales in row layout)."""
    g = torch.Generator().manual_seed(1)
    M, N, K = 3, 200, 256
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g) * K ** -0.5
    wq, ws = fp8.quantize_block(w)
    xq, xs = quant_act_ref(x)
    got = w8a8_linear_ref(xq, xs, wq, fp8.row_scales(ws, N), torch.float32)
    xd = torch.stack([xq[:, k:k + GROUP].float() * xs[:, k // GROUP, None]
                      for k in range(0, K, GROUP)], 1).reshape(M, K)
    wd = fp8.dequantize_block(wq, ws, torch.float32)
    assert _rel(got, xd @ wd.t()) < 1e-6
    assert _rel(got, x @ w.t()) < 0.1  # both roundings together: a few % at these sizes


def test_w8a8_linear_rejects_bad_input():
    """Shapes, dtypes and tile sizes are checked before any launch (CPU tensors suffice)."""
    xq = torch.zeros(4, 256, dtype=torch.float8_e4m3fn)
    xs = torch.ones(4, 2)
    w = torch.zeros(200, 256, dtype=torch.float8_e4m3fn)
    ws = torch.ones(200, 2)
    with pytest.raises(ValueError, match="e4m3"):
        w8a8_linear(xq.float(), xs, w, ws)
    with pytest.raises(ValueError, match="to quantize"):
        w8a8_linear(xq.to(torch.float16), None, w, ws)
    with pytest.raises(ValueError, match="128-wide groups"):
        w8a8_linear(xq, torch.ones(4, 3), w, ws)
    with pytest.raises(ValueError, match="row scales"):
        w8a8_linear(xq, xs, w, torch.ones(2, 2))
    with pytest.raises(ValueError, match="block_n"):
        w8a8_linear(xq, xs, w, ws, block_n=96)
    with pytest.raises(ValueError, match="k_split"):
        w8a8_linear(xq, xs, w, ws, k_split=100)
    with pytest.raises(ValueError, match="unit stride"):
        w8a8_linear(xq, xs, torch.zeros(256, 200, dtype=torch.float8_e4m3fn).t(), ws)


@pytest.mark.skipif(CUDA, reason="the interpreter's run; the GPU has its own tests below")
@pytest.mark.parametrize("K", [384, 200])
@pytest.mark.parametrize("k_split,block_n", [(None, 128), (128, 64), (256, 32)])
def test_w8a8_linear_in_the_interpreter(k_split, block_n, K):
    """The GEMM's indexing, masks, scales and split-K in Triton's interpreter (fp32 output:
    summation order only): N = 200 (a partial tile and block row), K = 384 (a partial last
    split of 256) or 200 (a partial last group), 5 rows in a 16-row tile. The interpreter's own fp8 cast is not the GPU's,
    so the operands come from the torch reference quantizer; the in-GEMM quantization is held
    to the reference loosely."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, K, generator=g)
    w = torch.randn(200, K, generator=g) * K ** -0.5
    wq, ws = fp8.quantize_block(w)
    ws = fp8.row_scales(ws, 200)
    xq, xs = quant_act_ref(x)
    y = w8a8_linear(xq, xs, wq, ws, k_split=k_split, block_n=block_n, out_dtype=torch.float32)
    want = w8a8_linear_ref(xq, xs, wq, ws, torch.float32)
    assert _rel(y, want) < 1e-5
    # the activation quantized inside the GEMM: the interpreter's e4m3 cast truncates (the
    # GPU rounds to nearest, tested bitwise below), so only near the reference here
    yq = w8a8_linear(x, None, wq, ws, k_split=k_split, block_n=block_n, out_dtype=torch.float32)
    assert _rel(yq, want) < 0.1  # truncation: up to 2^-3 a code


@pytest.mark.skipif(not CUDA, reason="GPU kernels")
@pytest.mark.parametrize("M", [1, 7, 33])
def test_quant_act_is_the_reference_bit_for_bit(M):
    """`quant_act` on the GPU: codes and scales equal `quant_act_ref`'s (IEEE divisions, RNE
    casts), from a row-strided bf16 input with groups of very different magnitudes."""
    from tailored.kernels.fp8_w8a8 import quant_act

    g = torch.Generator(device="cuda").manual_seed(M)
    wide = torch.randn(M, 2048 + 64, device="cuda", generator=g, dtype=torch.bfloat16)
    x = wide[:, 32:32 + 2048] * torch.logspace(-4, 3, 2048, device="cuda").to(torch.bfloat16)
    x[0, :GROUP] = 0
    q, s = quant_act(x)
    qr, sr = quant_act_ref(x)
    assert torch.equal(s, sr)
    assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8))


@pytest.mark.skipif(not CUDA, reason="GPU kernels")
@pytest.mark.parametrize("M", [1, 5, 32, 33, 64])
@pytest.mark.parametrize("N,K", [(200, 512), (2048, 2048)])
@pytest.mark.parametrize("k_split,block_n", [(None, 128), (256, 64), (512, 128)])
def test_w8a8_linear_matches_its_reference(M, N, K, k_split, block_n):
    """The GEMM against the fp32 product of the same quantized operands: the summation order
    differs, then one rounding to bf16; N not a multiple of the tile, rows past a tile,
    split K (partials summed in a fixed order: two calls give the same bits)."""
    from tailored.kernels.fp8_w8a8 import quant_act

    g = torch.Generator(device="cuda").manual_seed(M + N)
    x = torch.randn(M, K, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", generator=g) * K ** -0.5
    wq, ws = fp8.quantize_block(w)
    ws = fp8.row_scales(ws, N)
    xq, xs = quant_act(x)
    y = w8a8_linear(xq, xs, wq, ws, k_split=k_split, block_n=block_n)
    want = w8a8_linear_ref(xq, xs, wq, ws, torch.float32)
    assert y.dtype == torch.bfloat16 and y.shape == (M, N) and torch.isfinite(y).all()
    assert _rel(y, want) < 8e-3  # bf16's rounding of y (~2e-3 a value)
    assert torch.equal(y, w8a8_linear(xq, xs, wq, ws, k_split=k_split, block_n=block_n))
    # quantized inside the GEMM: the same codes and scales, so the same sums bit for bit
    assert torch.equal(y, w8a8_linear(x, None, wq, ws, k_split=k_split, block_n=block_n))
    # against the W8A16 reference (bf16 activations): the activation rounding's share
    wd = wq.float() * ws.repeat_interleave(GROUP, 1)
    assert _rel(y, x.float() @ wd.t()) < 0.06
