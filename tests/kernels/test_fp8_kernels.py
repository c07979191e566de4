"""The block-FP8 projection kernels against their references (spec §9.1): the W8A16 GEMM
(`fp8_linear`) and the one-pass dequant (`fp8_dequant`) of the dense projections (kb/0026), on odd
sizes (N and K not multiples of 128, so the last scale block is partial), on weights that are
row views of a fused tensor (the kernel path's layout), and into NaN-poisoned buffers.

CPU: Triton's interpreter in fp32; H200: compiled, fp32 and bf16.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from poison import nan_empty

from tailored import kernels
from tailored.model import fp8

pytestmark = pytest.mark.skipif(not kernels.available(), reason="triton not installed")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if DEV == "cuda" else [torch.float32]
SHAPES = [(200, 320), (128, 128), (64, 2048), (300, 96)]  # (N, K)


@pytest.fixture(autouse=True)
def _fixed_configs(monkeypatch):
    monkeypatch.setenv("TAILORED_AUTOTUNE", "0")  # as tests/test_kernels.py


def _weight(N, K, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * K ** -0.5
    w[: N // 3] *= 40.0  # a range of block scales
    q, s = fp8.quantize_block(w)
    return q.to(DEV), s.to(DEV)


@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_rows_is_bitwise_the_reference(N, K, dtype):
    from tailored.kernels.fp8_dequant import dequantize_rows

    q, s = _weight(N, K, N + K)
    rows = fp8.row_scales(s, N)
    want = fp8.dequantize_block(q, s, dtype)
    assert torch.equal(dequantize_rows(q, rows, dtype=dtype), want)
    # into a NaN-poisoned buffer with a wider row stride: the [N, K] view only, nothing else
    buf = torch.full((N, K + 37), float("nan"), dtype=dtype, device=DEV)
    out = dequantize_rows(q, rows, out=buf[:, :K])
    assert out.data_ptr() == buf.data_ptr() and torch.equal(out, want)
    assert torch.isnan(buf[:, K:]).all()


def test_dequantize_rows_of_a_fused_weight_view():
    """The kernel path fuses linears along N and hands out row views (fast.fuse_linears): the
    view of the second linear, starting mid scale block, dequantizes to that linear alone."""
    from tailored.kernels.fp8_dequant import dequantize_rows

    (qa, sa), (qb, sb) = _weight(72, 256, 1), _weight(100, 256, 2)
    fused = torch.cat([qa, qb])
    rows = torch.cat([fp8.row_scales(sa, 72), fp8.row_scales(sb, 100)])
    got = dequantize_rows(fused[72:], rows[72:], dtype=torch.float32)
    assert torch.equal(got, fp8.dequantize_block(qb, sb, torch.float32))


def test_dequantize_rows_rejects_bad_input():
    from tailored.kernels.fp8_dequant import dequantize_rows

    q, s = _weight(64, 256, 3)
    rows = fp8.row_scales(s, 64)
    with pytest.raises(ValueError, match="scale_rows"):
        dequantize_rows(q, rows[:, :1])
    with pytest.raises(ValueError, match="float8"):
        dequantize_rows(q.float(), rows)
    with pytest.raises(ValueError, match="unit column"):
        dequantize_rows(q, rows, out=torch.empty(256, 64, device=DEV).t())
    with pytest.raises(ValueError, match="fp32 scales"):
        dequantize_rows(q, rows.double())


@pytest.mark.parametrize("M", [1, 5, 70])
@pytest.mark.parametrize("N,K", SHAPES[:2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_linear_against_dequantize_then_linear(M, N, K, dtype):
    """The W8A16 GEMM sums per-128-block fp32 products times the block's scale; the reference
    rounds the scaled weight once and then multiplies: equal to fp32 rounding (1e-5), to a bf16
    rounding of the weights in bf16."""
    from tailored.kernels.fp8_linear import fp8_linear

    q, s = _weight(N, K, 7 * M)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(DEV, dtype)
    got = fp8_linear(x, q, fp8.row_scales(s, N))
    want = F.linear(x.float(), fp8.dequantize_block(q, s, torch.float32))
    err = ((got.float() - want).norm() / want.norm()).item()
    assert got.shape == (M, N) and got.dtype == dtype
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err


GEMV_SHAPES = SHAPES + [(130, 4096)]
GEMV_CFGS = [None, (4, 256, 4), (16, 128, 2)]


# every shape with every config, and each of them at every T (a Latin square: T by shape and
# config, not all 45 triples; each launch only loops over its T rows)
@pytest.mark.parametrize("N,K,cfg,T", [(N, K, cfg, (i - j) % 3 + 1)
                                       for i, (N, K) in enumerate(GEMV_SHAPES)
                                       for j, cfg in enumerate(GEMV_CFGS)],
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_fp8_gemv_against_dequantize_then_linear(T, N, K, cfg):
    """The FP8 GEMV (kb/0039 §4; FastPath's FP8 projections of 1-2 rows) sums each 128-wide K
    block in fp32, scales it by the row's block scale and adds: equal to the reference to
    fp32 rounding, for any (ROWS, BLOCK_K, warps), partial rows/K blocks and strided x; 5 rows
    and a BLOCK_K of 384 are refused."""
    from tailored.kernels.fp8_gemv import fp8_gemv

    dtype = torch.float32 if DEV == "cpu" else torch.bfloat16
    q, s = _weight(N, K, 3 * T + K)
    x = torch.randn(T, K + 5, generator=torch.Generator().manual_seed(T)).to(DEV, dtype)[:, 2:2 + K]
    got = fp8_gemv(x, q, fp8.row_scales(s, N), cfg)
    want = F.linear(x.float(), fp8.dequantize_block(q, s, torch.float32))
    assert got.shape == (T, N) and got.dtype == dtype and torch.isfinite(got).all()
    err = ((got.float() - want).norm() / want.norm()).item()
    assert err < (1e-5 if dtype == torch.float32 else 1e-2), err
    with pytest.raises(ValueError):
        fp8_gemv(torch.zeros(5, K, dtype=dtype, device=DEV), q, fp8.row_scales(s, N))
    with pytest.raises(ValueError):
        fp8_gemv(x, q, fp8.row_scales(s, N), (8, 384, 4))


def test_fp8_gemv_takes_its_config_from_the_shape_table(monkeypatch):
    """FP8_CFGS (kb/0040) holds valid configs for 1-2 rows only and is looked up by (N + NB,
    K, rows): a bad entry planted for exactly that key is what the launch refuses."""
    from tailored.kernels import fp8_gemv as mod

    for (n, k, t), (rows, bk, warps) in mod.FP8_CFGS.items():
        assert t in (1, 2) and n > 0 and k % 128 == 0
        assert rows & (rows - 1) == 0 and bk >= 128 and bk & (bk - 1) == 0 and warps in (2, 4, 8)
    dtype = torch.float32 if DEV == "cpu" else torch.bfloat16
    q, s = _weight(96, 256, 5)
    other = torch.randn(7, 256).to(DEV, dtype)
    x = torch.randn(2, 256).to(DEV, dtype)
    mod.fp8_gemv(x, q, fp8.row_scales(s, 96), other=other)  # no entry: CFG
    monkeypatch.setitem(mod.FP8_CFGS, (103, 256, 2), (8, 384, 4))
    with pytest.raises(ValueError):
        mod.fp8_gemv(x, q, fp8.row_scales(s, 96), other=other)
    mod.fp8_gemv(x[:1], q, fp8.row_scales(s, 96), other=other)  # another key


def test_bf16_table_survives_an_emptied_fp8_table(monkeypatch):
    """bench_decode's fp8_gemv_one_cfg empties FP8_CFGS; the bf16 mapping of the measured
    winners (bf16_gemv_fp8_cfgs) must still build (it raised KeyError before, kb/0040 §6)."""
    from tailored.kernels import fp8_gemv as mod

    monkeypatch.setattr(mod, "FP8_CFGS", {})
    table = mod.fp8_cfgs_for_bf16()
    assert table[(1344, 2048, 1)] == table[(1281, 2048, 1)]
    assert (12352, 2048, 1) in table


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("N,K", [(200, 320), (7, 4096)])
def test_bf16_gemv_against_linear(T, N, K):
    """The same GEMV over a weight in x's dtype (kb/0039 §7.3): F.linear to fp32 rounding
    (bf16 on the GPU: to a bf16 rounding), odd N; a weight of another dtype is refused."""
    from tailored.kernels.fp8_gemv import bf16_gemv

    dtype = torch.float32 if DEV == "cpu" else torch.bfloat16
    g = torch.Generator().manual_seed(N + T)
    w = torch.randn(N, K, generator=g).to(DEV, dtype)
    x = torch.randn(T, K, generator=g).to(DEV, dtype)
    got = bf16_gemv(x, w, (8, 256, 4))
    want = F.linear(x.float(), w.float())
    assert got.shape == (T, N) and torch.isfinite(got).all()
    assert ((got.float() - want).norm() / want.norm()).item() < (1e-5 if DEV == "cpu" else 1e-2)
    with pytest.raises(ValueError):
        bf16_gemv(x, w.to(torch.float16))


@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("other_first", [False, True])
def test_fp8_gemv_with_bf16_rows_in_the_launch(T, other_first):
    """A fused projection's bf16 members (GDN b/a, the router) in the FP8 GEMV's launch: their
    columns after (or before) the FP8 rows', each equal to its own reference; NaN-poisoned
    output fully written; rows of another dtype are refused."""
    from tailored.kernels import fp8_gemv as mod

    dtype = torch.float32 if DEV == "cpu" else torch.bfloat16
    N, K, NB = 200, 320, 37
    q, s = _weight(N, K, 11)
    g = torch.Generator().manual_seed(T)
    other = torch.randn(NB, K, generator=g).to(DEV, dtype)
    x = torch.randn(T, K, generator=g).to(DEV, dtype)
    with nan_empty():
        got = mod.fp8_gemv(x, q, fp8.row_scales(s, N), (16, 256, 4), other, other_first)
    want8 = F.linear(x.float(), fp8.dequantize_block(q, s, torch.float32))
    wantb = F.linear(x.float(), other.float())
    want = torch.cat([wantb, want8] if other_first else [want8, wantb], 1)
    assert got.shape == (T, N + NB) and torch.isfinite(got).all()
    assert ((got.float() - want).norm() / want.norm()).item() < (1e-5 if DEV == "cpu" else 1e-2)
    with pytest.raises(ValueError):
        mod.fp8_gemv(x, q, fp8.row_scales(s, N), other=other.to(torch.float16))


@pytest.mark.parametrize("M", [3, 33, 70])
def test_fp8_linear_writes_every_element(M):
    """`fp8_linear` at odd sizes (N = 200 is no multiple of the 32-wide tiles, K = 320 no
    multiple of 128): the NaN-poisoned output is fully written and equals the reference;
    other weight dtypes and scale shapes are refused. GPU: bf16 activations over a wide range
    of magnitudes stay finite and within bf16 rounding (the interpreter runs bf16 dots wrongly;
    the sm_90 compile: test_kernels_sm90.py)."""
    from tailored.kernels.fp8_linear import fp8_linear

    N, K = 200, 320
    q, s = _weight(N, K, 13 + M)
    rows = fp8.row_scales(s, N)
    x32 = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(DEV)
    want = F.linear(x32, fp8.dequantize_block(q, s, torch.float32))
    with nan_empty():
        got = fp8_linear(x32, q, rows)
    assert got.shape == (M, N) and got.dtype == torch.float32 and torch.isfinite(got).all()
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    for bad_w, bad_s in ((q.float(), rows), (q, rows[:, :-1]), (q[:, :-1], rows)):
        with pytest.raises(ValueError):
            fp8_linear(x32, bad_w, bad_s)
    if DEV != "cuda":
        return
    x = x32.to(torch.bfloat16)
    for scale in (1.0, 1e5, 1e-6):
        xs = (x.float() * scale).to(torch.bfloat16)
        with nan_empty():
            a = fp8_linear(xs, q, rows).float()
        assert torch.isfinite(a).all(), scale
        ref8 = F.linear(xs.float(), fp8.dequantize_block(q, s, torch.float32))
        assert ((a - ref8).norm() / ref8.norm()).item() < 1e-2, scale


def test_splitk_configs_are_valid_and_only_at_the_rows_they_won():
    """fp8_splitk.CFGS (kb/0047 §2) holds the H200 sweep's 8-row winners: each a k_split the
    launcher accepts (a positive multiple of 128, at most K), a power-of-2 N tile in 16-256, and
    keyed only by the 4- and 8-row buckets (at 32 rows split-K tied or lost: the guess CFG
    stays there, and the switch's A/B is owed)."""
    from tailored.kernels import fp8_splitk as mod

    assert mod.CFGS and {rows for (_, _, rows) in mod.CFGS} == {4, 8}
    for (n, k, rows), (k_split, block_n, warps, stages, f16) in mod.CFGS.items():
        assert k_split % 128 == 0 and 0 < k_split <= k, (n, k, rows)
        assert block_n in (16, 32, 64, 128, 256) and warps in (4, 8) and stages in (3, 4)
        assert isinstance(f16, bool)
    assert mod.config(12352, 2048, 5) == mod.CFGS[(12352, 2048, 8)]
    assert mod.config(12352, 2048, 3) == mod.CFGS[(12352, 2048, 4)]
    assert mod.config(12352, 2048, 32) == mod.CFG


SPLITK_M = [1, 5, 33, 70]
SPLITK_CFGS = [(128, 32), (256, 64), (1024, 32)]


# every M with every (k_split, block_n), each M and each config at both K (not all 24)
@pytest.mark.parametrize("M,k_split,block_n,K", [(M, ks, bn, (640, 600)[(i + j) % 2])
                                                 for i, M in enumerate(SPLITK_M)
                                                 for j, (ks, bn) in enumerate(SPLITK_CFGS)])
def test_fp8_linear_splitk_against_dequantize_then_linear(M, k_split, block_n, K):
    """`fp8_splitk.fp8_linear_splitk` (kb/0045 §4): K split over programs (partials summed in
    split order by a second launch; one split writes y itself) at odd sizes (N = 200 no
    multiple of the tiles; K = 640 five 128-blocks, the last split partial; K = 600 a partial
    last 128-block too), NaN-poisoned output fully written, equal to the reference to fp32
    rounding, and to one split's result up to fp32 summation order; bad k_split, block_n and
    shapes refused. GPU: bf16 with bf16 and
    float16 dots (×1, ×1e5, ×1e-6) within bf16 rounding of the reference, the two dot kinds
    equal up to summation order."""
    from tailored.kernels.fp8_splitk import fp8_linear_splitk

    N = 200
    q, s = _weight(N, K, 17 + M)
    rows = fp8.row_scales(s, N)
    x32 = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(DEV)
    want = F.linear(x32, fp8.dequantize_block(q, s, torch.float32))
    with nan_empty():
        got = fp8_linear_splitk(x32, q, rows, k_split, block_n)
    assert got.shape == (M, N) and got.dtype == torch.float32 and torch.isfinite(got).all()
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    whole = fp8_linear_splitk(x32, q, rows, 1024, block_n)  # one split: no partials
    assert ((got - whole).norm() / whole.norm()).item() < 1e-6
    for bad in (0, 64, -128):
        with pytest.raises(ValueError):
            fp8_linear_splitk(x32, q, rows, bad)
    with pytest.raises(ValueError):
        fp8_linear_splitk(x32, q, rows, 128, block_n=8)
    with pytest.raises(ValueError):
        fp8_linear_splitk(x32, q, rows[:, :-1], 128)
    if DEV != "cuda":
        return
    for scale in (1.0, 1e5, 1e-6):
        xs = (x32 * scale).to(torch.bfloat16)
        ref8 = F.linear(xs.float(), fp8.dequantize_block(q, s, torch.float32))
        outs = []
        for f16 in (False, True):
            with nan_empty():
                a = fp8_linear_splitk(xs, q, rows, k_split, block_n, dot_f16=f16).float()
            assert torch.isfinite(a).all(), (scale, f16)
            assert ((a - ref8).norm() / ref8.norm()).item() < 1e-2, (scale, f16)
            outs.append(a)
        assert ((outs[0] - outs[1]).norm() / outs[0].norm()).item() < 1e-2


@pytest.mark.parametrize("M", [3, 33])
@pytest.mark.parametrize("other_first", [False, True])
@pytest.mark.parametrize("k_split", [128, 2048])
def test_fp8_linear_splitk_with_bf16_rows(M, other_first, k_split):
    """The split-K GEMM with a fused projection's rows in x's dtype in the same launch
    (FastPath's GDN in b|a after, MoE group router|shared gate before: `fp8_gemv`'s layout),
    split or not: each column block equals its own reference, the NaN-poisoned output is fully
    written; other rows of another dtype or width are refused."""
    from tailored.kernels.fp8_splitk import fp8_linear_splitk

    N, K, NB = 200, 320, 37
    q, s = _weight(N, K, 29 + M)
    rows = fp8.row_scales(s, N)
    g = torch.Generator().manual_seed(M + 7)
    other = torch.randn(NB, K, generator=g).to(DEV)
    x = torch.randn(M, K, generator=g).to(DEV)
    want8 = F.linear(x, fp8.dequantize_block(q, s, torch.float32))
    wantb = F.linear(x, other)
    want = torch.cat([wantb, want8] if other_first else [want8, wantb], 1)
    with nan_empty():
        got = fp8_linear_splitk(x, q, rows, k_split, 64, other=other, other_first=other_first)
    assert got.shape == (M, N + NB) and torch.isfinite(got).all()
    assert ((got - want).norm() / want.norm()).item() < 1e-5
    for bad in (other.to(torch.float16), other[:, :-1], other[0]):
        with pytest.raises(ValueError):
            fp8_linear_splitk(x, q, rows, 128, other=bad)


@pytest.mark.skipif(DEV != "cuda", reason="the autotuned launcher runs on CUDA only")
def test_fp8_linear_autotuned_writes_every_element(monkeypatch):
    """The served launcher (autotune on): every candidate config's grid covers the output
    (NaN-poisoned, fully written) at a decode bucket and a prefill size."""
    from tailored.kernels.fp8_linear import fp8_linear

    monkeypatch.setenv("TAILORED_AUTOTUNE", "1")
    N, K = 1024, 2048
    q, s = _weight(N, K, 31)
    g = torch.Generator().manual_seed(4)
    for M in (32, 130):
        x = torch.randn(M, K, generator=g).to(DEV, torch.bfloat16)
        with nan_empty():
            got = fp8_linear(x, q, fp8.row_scales(s, N))
        want = F.linear(x.float(), fp8.dequantize_block(q, s, torch.float32))
        assert torch.isfinite(got).all()
        assert ((got.float() - want).norm() / want.norm()).item() < 1e-2
