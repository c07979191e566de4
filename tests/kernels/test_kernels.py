"""Every Triton kernel against its plain-PyTorch reference on fresh random inputs.

On the CPU the kernels run in Triton's interpreter in fp32 (conftest sets TRITON_INTERPRET=1
when there is no GPU); on the H200 they run compiled, in fp32 and bf16. State caches and KV
pages the step must not touch are poisoned with NaN and checked bit-identical afterwards; sizes
are odd and slots/pages are permuted so that indexing bugs show.
"""

from __future__ import annotations

import json

import pytest
import torch
from poison import nan_empty

from tailored import kernels
from tailored.ops import reference as ref

pytestmark = pytest.mark.skipif(not kernels.available(), reason="triton not installed")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if DEV == "cuda" else [torch.float32]
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def _fixed_configs(switches):
    """Fixed launch configs on the GPU too: autotuning every odd test shape took longer than
    the tests (kernels.autotune_enabled); the tuned configs run in test_gpu.py's full-size tests."""
    switches(autotune=False)


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,E,k,H,I", [(1, 8, 2, 64, 32), (3, 32, 4, 64, 48), (5, 8, 2, 64, 48),
                                       (37, 16, 4, 128, 64),
                                       (100, 8, 2, 64, 48),  # 25 rows an expert: 64-row tiles
                                       (203, 8, 2, 64, 48)])  # 50 rows an expert: 128-row tiles
@pytest.mark.contract("kernel-equals-reference")
def test_fused_moe(dtype, T, E, k, H, I):
    """T·k < E (the first two cases): the compact expert grid (kb/0016)."""
    from tailored.kernels.moe import fused_moe

    g = torch.Generator().manual_seed(T * 100 + E)
    x = torch.randn(T, H, generator=g).to(DEV, dtype)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * H ** -0.5).to(DEV, dtype)
    down = (torch.randn(E, H, I, generator=g) * I ** -0.5).to(DEV, dtype)
    w, ids = ref.route_topk(torch.randn(T, E, generator=g).to(DEV, dtype), k)
    got = fused_moe(x, w, ids, gate_up, down)
    want = ref.moe_experts(x.float(), w.float(), ids, gate_up.float(), down.float())
    assert got.dtype == dtype and torch.isfinite(got).all()
    assert rel_err(got, want) < TOL[dtype]


def _fp8_experts(E, H, I, g):
    """Random experts quantized to block FP8: (gate_up q, down q, the model's block scales for
    the reference, the kernel's block-scale layout, `fp8.expert_block_scales`)."""
    from tailored.model import fp8

    qgu, sgu = fp8.quantize_experts(torch.randn(E, 2 * I, H, generator=g) * H ** -0.5, True)
    qd, sd = fp8.quantize_experts(torch.randn(E, H, I, generator=g) * I ** -0.5, False)
    rows = (fp8.expert_block_scales(sgu, True), fp8.expert_block_scales(sd, False))
    return qgu, qd, (sgu, sd), rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,E,k,H,I", [(1, 8, 2, 64, 32), (5, 8, 2, 200, 48),
                                       (37, 16, 4, 256, 160), (3, 256, 8, 2048, 512),
                                       (150, 8, 2, 128, 48)])  # 37 rows an expert: 64-row tiles
def test_fused_moe_fp8(dtype, T, E, k, H, I):
    """Block-FP8 experts (W8A16) against the reference over the dequantized weights; sizes off
    the 128 grid so that partial scale blocks and the gate/up split inside a block show."""
    from tailored.kernels.moe import fused_moe
    from tailored.model import fp8

    if DEV == "cpu" and E == 256:
        pytest.skip("full-size case: GPU only (minutes in the interpreter)")
    g = torch.Generator().manual_seed(T * 100 + E + 7)
    x = torch.randn(T, H, generator=g).to(DEV, dtype)
    qgu, qd, (sgu, sd), (rgu, rd) = _fp8_experts(E, H, I, g)
    w, ids = ref.route_topk(torch.randn(T, E, generator=g).to(DEV, dtype), k)
    got = fused_moe(x, w, ids, qgu.to(DEV), qd.to(DEV), None, rgu.to(DEV), rd.to(DEV))
    want = ref.moe_experts(x.float(), w.float(), ids,
                           fp8.DequantExperts(qgu.to(DEV), sgu.to(DEV), torch.float32, True),
                           fp8.DequantExperts(qd.to(DEV), sd.to(DEV), torch.float32, False))
    assert got.dtype == dtype and torch.isfinite(got).all()
    assert rel_err(got, want) < TOL[dtype]
    with pytest.raises(ValueError, match="block scales"):
        fused_moe(x, w, ids, qgu.to(DEV), qd.to(DEV))
    with pytest.raises(ValueError, match="block scales"):  # the per-row layout of before kb/0027
        fused_moe(x, w, ids, qgu.to(DEV), qd.to(DEV), None,
                  fp8.row_scales(sgu.reshape(E, -1, sgu.shape[-1]), 2 * I).to(DEV), rd.to(DEV))


@pytest.mark.parametrize("switch", ["moe_fp8_dot_f16", "moe_fp8_down_f16"])
@pytest.mark.parametrize("T", [1, 5, 37])
def test_fused_moe_fp8_f16_dots(T, switch, switches):
    """moe_fp8_dot_f16 (kb/0029): the gate_up GEMM's e4m3 weights and bf16 activations both convert
    to float16 exactly (activations inside its normal range), so the products are those of the
    bf16 dots. moe_fp8_down_f16 (kb/0042): the down GEMM's too, each activation row first scaled
    into float16's range by a power of 2, so even activations far above 65504 (x·300 here)
    give the bf16 dots' result. GPU: against the reference over the dequantized experts, and
    equal to the bf16 dots up to fp32 summation order (the MMA's internal order is the
    hardware's). Everywhere: float32 activations keep the fp32 dots (the switch would round
    them). The interpreter runs bf16 dots wrongly (the CPU suite is fp32), so the bf16 half is
    GPU only; its compile for sm_90 is checked on the CPU (test_kernels_sm90.py). Since
    kb/0045 the down switch acts on decode-size launches only (≤ 4 pairs an expert: T = 1, 5
    here); at T = 37 (prefill tiles) the down GEMM keeps bf16 dots, so the switch changes no
    bit there."""
    from tailored.kernels import moe
    from tailored.model import fp8

    if DEV == "cpu" and T != 1:
        pytest.skip("the interpreter's half (fp32 activations ignore the switch) is one dtype "
                    "check, the same at every T: T = 1 runs it")
    E, k, H, I = 16, 4, 256, 160
    g = torch.Generator().manual_seed(T + (40 if switch == "moe_fp8_dot_f16" else 50))
    x = torch.randn(T, H, generator=g).to(DEV, torch.bfloat16)
    qgu, qd, (sgu, sd), (rgu, rd) = _fp8_experts(E, H, I, g)
    w, ids = ref.route_topk(torch.randn(T, E, generator=g).to(DEV), k)

    def run(f16, xx):
        switches(**{switch: f16})
        return moe.fused_moe(xx, w, ids, qgu.to(DEV), qd.to(DEV), None, rgu.to(DEV), rd.to(DEV))

    x32 = x.float()
    assert torch.equal(run(True, x32), run(False, x32))
    if DEV == "cuda":
        want = ref.moe_experts(x32, w.float(), ids,
                               fp8.DequantExperts(qgu.to(DEV), sgu.to(DEV), torch.float32, True),
                               fp8.DequantExperts(qd.to(DEV), sd.to(DEV), torch.float32, False))
        got = run(True, x)
        assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
        assert rel_err(got, want) < TOL[torch.bfloat16]
        assert rel_err(got, run(False, x)) < 1e-5
        big = x * 300  # silu(g)·u ~1e5-1e6: float16 overflows without the down's row scales
        got = run(True, big)
        assert torch.isfinite(got).all() and rel_err(got, run(False, big)) < 1e-5
        if switch == "moe_fp8_down_f16" and T == 37:
            assert torch.equal(run(True, x), run(False, x))


if kernels.available():
    import triton
    import triton.language as tl

    from tailored.kernels.fp8_linear import pow2_rows_f16

    @triton.jit
    def _pow2_rows_kernel(a_ptr, o_ptr, b_ptr, M: tl.constexpr, K: tl.constexpr):
        """pow2_rows_f16 of an [M, K] fp32 tile: the float16 tile and the row scales back."""
        r = tl.arange(0, M)
        c = tl.arange(0, K)
        a16, back = pow2_rows_f16(tl.load(a_ptr + r[:, None] * K + c[None, :]))
        tl.store(o_ptr + r[:, None] * K + c[None, :], a16)
        tl.store(b_ptr + r, back)


def test_pow2_rows_f16_scales_each_row_exactly_into_float16():
    """`fp8_linear.pow2_rows_f16` (moe_fp8_down_f16, kb/0042): each row times one power of 2, its
    largest magnitude below 2^15, every value float16-exact, and back·2^k = 1; rows far above
    65504, tiny, zero, with inf and with NaN. Reference: the same scale from torch.frexp."""
    g = torch.Generator().manual_seed(5)
    M, K = 16, 32  # rows 9-15: plain randn
    a = torch.randn(M, K, generator=g)
    a[0] *= 1e6  # far above float16's 65504
    a[1] *= 1e-30  # far below its normal range
    a[2] = 0.0
    a[3, 5] = float("inf")
    a[4, 7] = float("nan")
    a[5] *= 65504.0
    a[6] = 2.0 ** 15  # exactly a power of 2
    a[7] *= 2.0 ** 120  # near bf16's top: k = -107
    a = a.to(DEV, torch.bfloat16).float()  # bf16 values, as the down GEMM's activations
    a[8] = torch.randn(K, generator=g).to(torch.bfloat16).float() * 2.0 ** -130  # subnormal
    o = torch.full((M, K), float("nan"), device=DEV, dtype=torch.float16)
    back = torch.full((M,), float("nan"), device=DEV)
    _pow2_rows_kernel[(1,)](a, o, back, M=M, K=K)
    o, back = o.cpu().float(), back.cpu()
    a = a.cpu()
    # finite rows: exact, scaled below 2^15 by frexp's power of 2; the fp32-subnormal row only
    # in the interpreter (the GPU may flush subnormals, which activations never are)
    for i in (0, 1, 5, 6, 7, *range(9, M)) + ((8,) if DEV == "cpu" else ()):
        _, e = torch.frexp(a[i].abs().max())
        assert back[i].item() == 2.0 ** max(-126, e.item() - 15)
        assert torch.equal(o[i] * back[i], a[i]) and o[i].abs().max() < 2 ** 15
    assert o[7].abs().max() >= 2 ** 14 and (a[8] != 0).any()
    assert torch.isfinite(o[8]).all() and back[8].item() == 2.0 ** -126
    assert torch.equal(o[2], torch.zeros(K)) and torch.isfinite(back[2])
    assert torch.isinf(o[3, 5]) and torch.isfinite(o[3]).sum() == K - 1
    assert torch.isnan(o[4, 7]) and torch.equal(o[4, :7] * back[4], a[4, :7])


def test_fused_moe_fp8_wide_k_iterations_are_bitwise_the_128_ones(monkeypatch):
    """FP8 experts with 256 of K per iteration as two 128-wide dots (the decode configs added
    in session 7) accumulate exactly as one 128-wide dot per iteration."""
    from tailored.kernels import moe

    g = torch.Generator().manual_seed(11)
    T, E, k, H, I = 3, 8, 2, 512, 384
    x = torch.randn(T, H, generator=g).to(DEV)
    qgu, qd, _, (rgu, rd) = _fp8_experts(E, H, I, g)
    w, ids = ref.route_topk(torch.randn(T, E, generator=g).to(DEV), k)
    outs = []
    for bk in (128, 256):
        monkeypatch.setattr(moe, "_blocks", lambda pairs, experts, fp8=False, bk=bk: (16, 32, bk, 4))
        outs.append(moe.fused_moe(x, w, ids, qgu.to(DEV), qd.to(DEV), None, rgu.to(DEV),
                                  rd.to(DEV), reduce=False))
    assert torch.equal(outs[0], outs[1])


def test_moe_align_groups_pairs_by_expert():
    from tailored.kernels.moe_route import moe_align

    ids = torch.tensor([[3, 0], [0, 2], [3, 1]], device=DEV)
    order, offsets = moe_align(ids, 5)
    assert offsets.tolist() == [0, 2, 3, 4, 6, 6]
    assert order.tolist() == [1, 2, 5, 3, 0, 4]  # stable within an expert


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (3, 16, 4), (12, 256, 8), (33, 256, 8), (64, 256, 8)])
def test_route_align_equals_route_topk_then_align(dtype, T, E, k):
    """T ≤ 8: one program; above: top-k programs + the sorting align program (kb/0021)."""
    from tailored.kernels.moe_route import expert_partition_ref, moe_align, route_align

    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(T * E)).to(DEV, dtype)
    w, ids, order, offsets, experts = route_align(logits, k)
    w_ref, ids_ref = ref.route_topk(logits, k)
    # bf16 logits tie often; tied experts may come in another order (same set, same weights)
    a, ia = ids.sort(dim=-1)
    b, ib = ids_ref.sort(dim=-1)
    assert torch.equal(a, b)
    assert w.dtype == w_ref.dtype
    assert torch.allclose(w.gather(1, ia).float(), w_ref.gather(1, ib).float(), rtol=1e-6)
    o_ref, off_ref = moe_align(ids, E)  # the pair order must be that of our own ids
    assert torch.equal(offsets, off_ref) and torch.equal(order, o_ref)
    assert torch.equal(experts, expert_partition_ref(offsets))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,E,k", [(1, 256, 8), (3, 16, 4), (7, 256, 8)])
def test_route_align_two_launch_path_at_few_rows(dtype, T, E, k, monkeypatch):
    """The two-launch path below its default threshold (an odd T leaves the last top-k
    program half empty): lab/bench_route.py --one-program-up-to times both paths there."""
    from tailored.kernels import moe

    monkeypatch.setattr(moe, "ROUTE_ONE_PROGRAM_UP_TO", 0)
    test_route_align_equals_route_topk_then_align(dtype, T, E, k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (3, 16, 4), (7, 256, 8), (33, 256, 8)])
def test_route_align_with_the_shared_expert(dtype, T, E, k):
    """shared_gate: expert E joins as slot k of every token with weight sigmoid(gate) — what
    route_topk with that extra column gives through moe_align(ids, E+1) and the partition."""
    from tailored.kernels.moe_route import expert_partition_ref, moe_align, route_align

    g = torch.Generator().manual_seed(T + E + 1)
    logits = torch.randn(T, E, generator=g).to(DEV, dtype)
    # a strided [T, 1] view, as the fused router|shared-gate GEMM gives it
    seg = torch.randn(T, 3, generator=g).to(DEV, dtype)[:, 1:2]
    w, ids, order, offsets, experts = route_align(logits, k, shared_gate=seg)
    w0, ids0, *_ = route_align(logits, k)
    assert w.shape == ids.shape == (T, k + 1) and w.dtype == logits.dtype
    assert torch.equal(ids[:, :k], ids0) and torch.equal(w[:, :k], w0)
    assert (ids[:, k] == E).all()
    assert torch.allclose(w[:, k].float(), torch.sigmoid(seg.float())[:, 0].to(dtype).float(),
                          rtol=1e-6, atol=0)
    o_ref, off_ref = moe_align(ids, E + 1)
    assert torch.equal(offsets, off_ref) and torch.equal(order, o_ref)
    assert torch.equal(experts, expert_partition_ref(offsets))
    with pytest.raises(ValueError):
        route_align(logits, k, shared_gate=seg[:1] if T > 1 else seg.expand(T, 2))


@pytest.mark.parametrize("E,T,k", [(8, 1, 2), (16, 3, 4), (200, 5, 8), (256, 1, 8), (256, 40, 8)])
def test_expert_partition(E, T, k):
    """Active experts first, then the empty ones, each ascending; a permutation of 0..E-1."""
    from tailored.kernels.moe_route import expert_partition, expert_partition_ref, moe_align

    ids = torch.randint(0, E, (T, k), generator=torch.Generator().manual_seed(E + T)).to(DEV)
    _, offsets = moe_align(ids, E)
    got = expert_partition(offsets)
    want = expert_partition_ref(offsets)
    assert torch.equal(got, want)
    assert sorted(got.tolist()) == list(range(E))
    n_active = len(set(ids.flatten().tolist()))
    assert set(got[:n_active].tolist()) == set(ids.flatten().tolist())


@pytest.mark.parametrize("T,E,k", [(1, 16, 4), (3, 32, 4), (6, 32, 4)])
def test_fused_moe_compact_grid_is_bitwise_the_full_grid(T, E, k, monkeypatch):
    """The compact grid (T·k programs over the active-first experts) changes which program
    computes an expert, never how: results are bitwise those of one program per expert, with
    the experts from route_align or from expert_partition."""
    from tailored.kernels import moe, moe_route

    g = torch.Generator().manual_seed(T + E)
    H, I = 64, 32
    x = torch.randn(T, H, generator=g).to(DEV)
    gate_up = (torch.randn(E, 2 * I, H, generator=g) * H ** -0.5).to(DEV)
    down = (torch.randn(E, H, I, generator=g) * I ** -0.5).to(DEV)
    w, ids, *aligned = moe_route.route_align(torch.randn(T, E, generator=g).to(DEV), k)
    compact = moe.fused_moe(x, w, ids, gate_up, down, aligned, reduce=False)
    compact2 = moe.fused_moe(x, w, ids, gate_up, down, None, reduce=False)
    monkeypatch.setattr(moe, "COMPACT_GRID", False)
    full = moe.fused_moe(x, w, ids, gate_up, down, aligned, reduce=False)
    assert torch.equal(compact, full) and torch.equal(compact2, full)


def _routed_call_inputs(dtype, T, E, H, I, shared, fp8, g):
    """(x [T, H] with strided rows, router logits [T, E], shared gate [T, 1] view or None,
    gate_up, down (E+1 experts with the shared one; FP8 with block scales), scales) for the
    routing-in-gate_up MoE calls."""
    En = E + 1 if shared else E
    x = torch.randn(T, H + 8, generator=g).to(DEV, dtype)[:, 3:3 + H]  # strided rows
    logits = torch.randn(T, E, generator=g).to(DEV, dtype)
    seg = torch.randn(T, 3, generator=g).to(DEV, dtype)[:, 1:2] if shared else None
    if fp8:
        qgu, qd, _, (rgu, rd) = _fp8_experts(En, H, I, g)
        return x, logits, seg, qgu.to(DEV), qd.to(DEV), (rgu.to(DEV), rd.to(DEV))
    gate_up = (torch.randn(En, 2 * I, H, generator=g) * H ** -0.5).to(DEV, dtype)
    down = (torch.randn(En, H, I, generator=g) * I ** -0.5).to(DEV, dtype)
    return x, logits, seg, gate_up, down, (None, None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,E,k,shared,fp8", [(1, 16, 4, True, False), (1, 8, 2, False, False),
                                              (3, 32, 4, True, False), (4, 16, 2, False, False),
                                              (4, 8, 2, True, False),  # T·S ≥ E+1: full grid
                                              (2, 16, 4, True, True),
                                              (1, 256, 8, True, False), (1, 256, 8, True, True),
                                              (2, 256, 8, True, True)])
def test_route_fused_moe_is_bitwise_route_align_then_fused_moe(dtype, T, E, k, shared, fp8):
    """The gate_up programs that route the tokens themselves (kb/0036) give bitwise the
    routing, alignment and pair terms of route_align + fused_moe(reduce=False); the act and
    pair rows poisoned with NaN beforehand may not survive; other T are refused."""
    from tailored.kernels import moe, moe_route
    from tailored.model import fp8 as fp8m

    if DEV == "cpu" and E == 256:
        pytest.skip("full-size case: GPU only (minutes in the interpreter)")
    # FP8: partial 128-blocks of scales; E = 256: the model's dims (spec §7)
    H, I = (2048, 512) if E == 256 else (256, 160) if fp8 else (64, 48)
    x, logits, seg, gate_up, down, scales = _routed_call_inputs(
        dtype, T, E, H, I, shared, fp8, torch.Generator().manual_seed(T * 31 + E + shared))
    w0, ids0, *aligned = moe_route.route_align(logits, k, shared_gate=seg)
    want = moe.fused_moe(x, w0, ids0, gate_up, down, aligned, *scales, reduce=False)
    pairs, w, ids = moe.route_fused_moe(x, logits, k, gate_up, down, seg, *scales)
    assert torch.isfinite(pairs).all()
    assert torch.equal(w, w0) and torch.equal(ids, ids0)
    assert torch.equal(pairs, want)
    del fp8m
    with pytest.raises(ValueError):
        moe.route_fused_moe(torch.zeros(5, H, dtype=dtype, device=DEV),
                            torch.zeros(5, E, dtype=dtype, device=DEV), k, gate_up, down,
                            None if not shared else torch.zeros(5, 1, dtype=dtype, device=DEV),
                            *scales)
    with pytest.raises(ValueError):  # the stack does not match the routing's expert count
        moe.route_fused_moe(x, logits, k, gate_up, down, None if shared else
                            torch.zeros(T, 1, dtype=dtype, device=DEV), *scales)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,E,k,shared,fp8,rows", [(1, 16, 4, True, False, (4, 4)),
                                                   (3, 8, 2, False, False, (2, 2)),
                                                   (4, 16, 4, True, False, (8, 8)),
                                                   # FP8, several programs a scale block
                                                   # (16 rows in the interpreter: 8 cost 2x)
                                                   (2, 16, 4, True, True,
                                                    (8, 4) if DEV == "cuda" else (16, 8)),
                                                   (1, 8, 2, False, True, (128, 128)),
                                                   (1, 256, 8, True, False, None),
                                                   (2, 256, 8, True, True, None)])
def test_route_gemv_moe_matches_route_fused_moe(dtype, T, E, k, shared, fp8, rows):
    """The one-pair-a-program GEMV experts (kb/0039) give route_fused_moe's routing and pair
    terms up to the summation order, for any ROWS (odd H/I: masked rows and K, FP8
    partial scale blocks); NaN-poisoned outputs are all overwritten; other T are refused."""
    from tailored.kernels import moe, moe_gemv

    if DEV == "cpu" and E == 256:
        pytest.skip("full-size case: GPU only (minutes in the interpreter)")
    H, I = (2048, 512) if E == 256 else (200, 160) if fp8 else (72, 40)
    x, logits, seg, gate_up, down, scales = _routed_call_inputs(
        dtype, T, E, H, I, shared, fp8, torch.Generator().manual_seed(T * 7 + E + fp8))
    want, w0, ids0 = moe.route_fused_moe(x, logits, k, gate_up, down, seg, *scales)
    cfg = {} if rows is None else {"gate_up_cfg": (rows[0], 4), "down_cfg": (rows[1], 4)}
    with nan_empty():  # NaN-poisoned act / pair buffers: every element must be written
        pairs, w, ids = moe_gemv.route_gemv_moe(x, logits, k, gate_up, down, seg, *scales, **cfg)
    assert torch.isfinite(pairs).all()
    # the routing weights: bitwise at 4 warps; other warp counts sum the softmax in another
    # order (CFG's 2 / 8 warps at full size)
    assert torch.equal(ids, ids0) and rel_err(w, w0) < TOL[dtype]
    assert rel_err(pairs, want) < TOL[dtype]
    with pytest.raises(ValueError):  # more rows a program than one block of scales
        moe_gemv.route_gemv_moe(x, logits, k, gate_up, down, seg, *scales,
                                down_cfg=(256, 4))
    with pytest.raises(ValueError):
        moe_gemv.route_gemv_moe(torch.zeros(5, H, dtype=dtype, device=DEV),
                                torch.zeros(5, E, dtype=dtype, device=DEV), k, gate_up, down,
                                None if not shared else torch.zeros(5, 1, dtype=dtype, device=DEV),
                                *scales)


@pytest.mark.parametrize("fused", [False, True])
def test_routing_of_a_nan_row_picks_distinct_experts(fused):
    """A row of NaN / inf router logits (a poisoned token) still routes to k distinct experts
    in range, so the alignment writes every pair the expert GEMMs read (on the GPU the top-k
    rounds would all pick one expert otherwise, and the shared expert's down program read
    unwritten pair ids, kb/0036); the other rows route as without it."""
    from tailored.kernels import moe, moe_route

    T, E, k, H, I = 3, 16, 4, 64, 48
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(T, E, generator=g).to(DEV)
    bad = logits.clone()
    bad[1, 3] = float("nan")
    bad[2, 5] = float("inf")
    seg = torch.randn(T, 1, generator=g).to(DEV)
    x = torch.randn(T, H, generator=g).to(DEV)
    gate_up = (torch.randn(E + 1, 2 * I, H, generator=g) * H ** -0.5).to(DEV)
    down = (torch.randn(E + 1, H, I, generator=g) * I ** -0.5).to(DEV)
    for lg in (logits, bad):
        if fused:
            pairs, w, ids = moe.route_fused_moe(x, lg, k, gate_up, down, seg)
            assert torch.isfinite(pairs[:k + 1]).all()  # row 0's pairs
        else:
            w, ids, order, offsets, experts = moe_route.route_align(lg, k, shared_gate=seg)
            assert sorted(order.tolist()) == list(range(T * (k + 1)))
        for t in range(T):
            assert len(set(ids[t].tolist())) == k + 1 and int(ids[t].max()) == E
    w0, ids0, *_ = moe_route.route_align(logits, k, shared_gate=seg)
    assert torch.equal(ids[0], ids0[0]) and torch.equal(w[0], w0[0])


def _gdn_setup(dtype, B, HK, HV, Dk, Dv, num_slots, seed):
    g = torch.Generator().manual_seed(seed)
    C = 2 * HK * Dk + HV * Dv
    conv_state = torch.full((num_slots, C, 3), float("nan")).to(DEV, dtype)
    rec_state = torch.full((num_slots, HV, Dk, Dv), float("nan"), device=DEV)
    slots = torch.randperm(num_slots - 1, generator=g)[:B] + 1  # distinct, never the sink
    conv_state[slots.to(DEV)] = torch.randn(B, C, 3, generator=g).to(DEV, dtype)
    rec_state[slots.to(DEV)] = torch.randn(B, HV, Dk, Dv, generator=g).to(DEV) * 0.1
    return g, C, conv_state, rec_state, slots.to(DEV)


def _gdn_inputs(g, dtype, T, C, HV, Dv):
    """Conv weight [C, 4], T rows of conv input / a / b / z, and a layer's A_log, dt_bias and
    norm weight, drawn from g in this order."""
    weight = torch.randn(C, 4, generator=g).to(DEV, dtype) * 0.5
    x = torch.randn(T, C, generator=g).to(DEV, dtype)
    a = torch.randn(T, HV, generator=g).to(DEV, dtype)
    b = torch.randn(T, HV, generator=g).to(DEV, dtype)
    z = torch.randn(T, HV * Dv, generator=g).to(DEV, dtype)
    A_log = torch.randn(HV, generator=g).to(DEV) * 0.5
    dt_bias = torch.randn(HV, generator=g).to(DEV)
    norm_w = (1 + 0.1 * torch.randn(Dv, generator=g)).to(DEV, dtype)
    return weight, x, a, b, z, A_log, dt_bias, norm_w


@pytest.mark.parametrize("dtype", DTYPES)
def test_commit_snapshots_equals_indexing(dtype):
    """kernels/state_commit.py: dst[g, slot] = src[g, j, b] for every layer and move in one
    launch, as torch's advanced indexing (the CPU path of HybridCache.commit_many) writes it;
    slots not moved keep their (NaN) contents; odd trailing sizes."""
    from tailored.kernels.state_commit import commit_snapshots

    g = torch.Generator().manual_seed(3)
    G, N, MB, S = 3, 2, 5, 7
    src = torch.randn(G, N, MB, 9, 5, 3, generator=g).to(DEV, dtype)
    dst = torch.full((G, S, 9, 5, 3), float("nan")).to(DEV, dtype)
    moves = torch.tensor([[1, 0, 1], [4, 2, 0], [3, 6, 5]]).to(DEV)  # rows: j, b, slot
    want = dst.clone()
    want[:, moves[2]] = src[:, moves[0], moves[1]]
    commit_snapshots(src, dst, moves)
    assert torch.equal(dst[:, moves[2]], want[:, moves[2]])
    rest = torch.tensor([s not in (3, 6, 5) for s in range(S)], device=DEV)
    assert dst[:, rest].isnan().all()
    commit_snapshots(src, dst, moves[:, :0])  # nothing to move
    # the moves as a slice of a wider tensor (row stride 4, not M): the kernel takes one
    # pointer and the row stride
    wide = torch.zeros(3, 4, dtype=torch.long, device=DEV)
    wide[:, :3] = moves
    dst2 = torch.full_like(dst, float("nan"))
    commit_snapshots(src, dst2, wide[:, :3])
    assert torch.equal(dst2[:, moves[2]], want[:, moves[2]]) and dst2[:, rest].isnan().all()
    # j < 0: no move (the chain graph decides on the device which sequences move)
    dst3 = torch.full_like(dst, float("nan"))
    skip = moves.clone()
    skip[0, 1] = -1
    commit_snapshots(src, dst3, skip)
    assert dst3[:, 6].isnan().all()
    assert torch.equal(dst3[:, moves[2, [0, 2]]], want[:, moves[2, [0, 2]]])


@pytest.mark.parametrize("dv_split", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,n,HK,HV,Dk,Dv", [(1, 3, 2, 4, 16, 16), (3, 2, 4, 8, 32, 32),
                                            (5, 4, 2, 4, 16, 32), (2, 1, 2, 4, 16, 16)])
def test_gdn_verify_equals_token_by_token_decode(dtype, B, n, HK, HV, Dk, Dv, dv_split):
    """kernels/gdn_verify.py: n tokens of each sequence (token-major rows) in one launch each
    of conv and recurrence give exactly what n gdn_decode steps give: outputs, the snapshot
    after every token but the last, and the final slot states (bitwise in bf16; NaN-poisoned
    outputs and snapshots, NaN in every slot not used)."""
    from tailored.kernels.gdn_decode import conv_step, recurrent_step
    from tailored.kernels.gdn_verify import conv_verify, recurrent_verify

    num_slots = 9
    g, C, conv_state, rec_state, slots = _gdn_setup(dtype, B, HK, HV, Dk, Dv, num_slots, 7 * n)
    T = n * B
    weight, x, a, b, z, A_log, dt_bias, norm_w = _gdn_inputs(g, dtype, T, C, HV, Dv)
    conv1, rec1 = conv_state.clone(), rec_state.clone()

    ys, outs, snaps_c, snaps_r = [], [], [], []
    for j in range(n):  # token by token, as the verify graph ran it before
        r = slice(j * B, (j + 1) * B)
        y = conv_step(x[r], conv_state, weight, slots)
        ys.append(y)
        outs.append(recurrent_step(y, a[r], b[r], z[r], rec_state, slots, A_log, dt_bias,
                                   norm_w, HK, 1e-6, dv_split=dv_split))
        snaps_c.append(conv_state[slots].clone())
        snaps_r.append(rec_state[slots].clone())

    # the snapshot buffers of fast_spec.py: [N, max_batch, ...] sliced to B, NaN-poisoned
    snap_c = torch.full((max(n - 1, 1), B + 2, C, 3), float("nan"), device=DEV, dtype=dtype)
    snap_r = torch.full((max(n - 1, 1), B + 2, HV, Dk, Dv), float("nan"), device=DEV)
    sc, sr = snap_c[:n - 1, :B], snap_r[:n - 1, :B]
    y = conv_verify(x, conv1, weight, slots, sc)
    out = recurrent_verify(y, a, b, z, rec1, slots, A_log, dt_bias, norm_w, HK, 1e-6, sr,
                           dv_split=dv_split)
    # bitwise in bf16, the served dtype (products of bf16 values are exact in fp32, so the
    # compiler's FMA contraction cannot differ), and in the interpreter; fp32 inputs on the
    # H200 differ in the last bit of the conv (4.8e-7, session 15 run6)
    if dtype == torch.float32 and DEV == "cuda":
        def same(u, w):
            return rel_err(u, w) < 1e-5
    else:
        same = torch.equal
    assert same(y, torch.cat(ys)) and same(out, torch.cat(outs))
    assert same(conv1[slots], conv_state[slots])
    assert same(rec1[slots], rec_state[slots])
    for j in range(n - 1):
        assert same(sc[j], snaps_c[j]) and same(sr[j], snaps_r[j])
    # untouched: the other slots (NaN) and the snapshot rows past B
    other = torch.ones(num_slots, dtype=torch.bool)
    other[slots.cpu()] = False
    assert conv1[other.to(DEV)].isnan().all() and rec1[other.to(DEV)].isnan().all()
    assert snap_c[:, B:].isnan().all() and snap_r[:, B:].isnan().all()
    with pytest.raises(ValueError):
        recurrent_verify(y, a, b, z, rec1, slots, A_log, dt_bias, norm_w, HK, 1e-6, sr,
                         dv_split=3)


@pytest.mark.contract("kernel-equals-reference")
@pytest.mark.parametrize("dv_split", [1, 2, 4])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,HK,HV,Dk,Dv", [(1, 2, 4, 16, 16), (3, 4, 8, 32, 32), (5, 2, 4, 16, 32)])
def test_gdn_decode_step(dtype, B, HK, HV, Dk, Dv, dv_split):
    """dv_split > 1: each head's state columns over several programs, then the gated norm in its
    own launch (kb/0022)."""
    from tailored.kernels.gdn_decode import conv_step, recurrent_step

    num_slots = 9
    g, C, conv_state, rec_state, slots = _gdn_setup(dtype, B, HK, HV, Dk, Dv, num_slots, B + Dv)
    weight, x, a, b, z, A_log, dt_bias, norm_w = _gdn_inputs(g, dtype, B, C, HV, Dv)
    conv0, rec0 = conv_state.clone(), rec_state.clone()

    # reference on gathered copies
    y_ref, cs_ref = ref.causal_conv1d_step(x, conv0[slots], weight)
    q, k, v = torch.split(y_ref, [HK * Dk, HK * Dk, HV * Dv], dim=-1)
    gg, beta = ref.gdn_gates(a, b, A_log, dt_bias)
    o_ref, rs_ref = ref.gated_delta_rule_recurrent(
        q.view(B, 1, HK, Dk), k.view(B, 1, HK, Dk), v.view(B, 1, HV, Dv),
        gg.unsqueeze(1), beta.unsqueeze(1), rec0[slots])
    out_ref = ref.gated_rms_norm(o_ref[:, 0], z.view(B, HV, Dv), norm_w, 1e-6).reshape(B, -1)

    # snapshots (speculative verify steps): the new states of each row, NaN-poisoned first
    snap_c = torch.full((B, C, 3), float("nan"), device=DEV, dtype=dtype)
    snap_r = torch.full((B, HV, Dk, Dv), float("nan"), device=DEV)
    y = conv_step(x, conv_state, weight, slots, snapshot=snap_c)
    out = recurrent_step(y, a, b, z, rec_state, slots, A_log, dt_bias, norm_w, HK, 1e-6,
                         dv_split=dv_split, snapshot=snap_r)
    assert torch.equal(snap_c, conv_state[slots]) and torch.equal(snap_r, rec_state[slots])
    with pytest.raises(ValueError):
        recurrent_step(y, a, b, z, rec_state.clone(), slots, A_log, dt_bias, norm_w, HK, 1e-6,
                       dv_split=3)
    assert rel_err(y, y_ref) < TOL[dtype]
    assert rel_err(conv_state[slots], cs_ref) < TOL[dtype]
    assert rel_err(rec_state[slots], rs_ref) < TOL[dtype]
    assert rel_err(out, out_ref) < TOL[dtype] * 2
    others = torch.ones(num_slots, dtype=torch.bool, device=DEV)
    others[slots] = False
    assert conv_state[others].isnan().all() and rec_state[others].isnan().all()  # untouched


@pytest.mark.parametrize("dv_split", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_bf16_states_are_the_fp32_steps_rounded(dtype, dv_split):
    """EngineConfig.gdn_state_dtype = bfloat16 (kb/0056): the decode step (alone, with a
    snapshot) on a bf16 state gives the outputs of the same step on the fp32
    copy of that state, bit for bit (the math is fp32; the output reads the state before it
    is rounded), and stores that step's fp32 state rounded to nearest even as torch rounds
    it. The verify kernel over n tokens equals n such steps (the state rounded between
    tokens as each step stores it). Slots not used stay NaN."""
    from tailored.kernels.gdn_decode import conv_step, recurrent_step
    from tailored.kernels.gdn_verify import conv_verify, recurrent_verify

    B, HK, HV, Dk, Dv, n, num_slots = 3, 2, 4, 16, 32, 3, 9
    g, C, conv_state, rec32, slots = _gdn_setup(dtype, B, HK, HV, Dk, Dv, num_slots, 5 + dv_split)
    weight, x, a, b, z, A_log, dt_bias, norm_w = _gdn_inputs(g, dtype, n * B, C, HV, Dv)
    rec32 = rec32.to(torch.bfloat16).float()  # bf16 values (NaN stays NaN)
    rec16 = rec32.to(torch.bfloat16)
    others = torch.ones(num_slots, dtype=torch.bool, device=DEV)
    others[slots] = False
    r = slice(0, B)
    y = conv_step(x[r], conv_state.clone(), weight, slots)
    s32, s16 = rec32.clone(), rec16.clone()
    snap = torch.full((B, HV, Dk, Dv), float("nan"), device=DEV, dtype=torch.bfloat16)
    want = recurrent_step(y, a[r], b[r], z[r], s32, slots, A_log, dt_bias, norm_w, HK, 1e-6,
                          dv_split=dv_split)
    got = recurrent_step(y, a[r], b[r], z[r], s16, slots, A_log, dt_bias, norm_w, HK, 1e-6,
                         dv_split=dv_split, snapshot=snap)
    assert torch.equal(got, want)
    assert s16.dtype == torch.bfloat16 and torch.equal(s16[slots], s32[slots].to(torch.bfloat16))
    assert torch.equal(snap, s16[slots]) and s16[others].isnan().all()
    # n tokens: the verify kernel on the bf16 state against n decode steps on it
    cs_steps, s_steps, outs, snaps = conv_state.clone(), rec16.clone(), [], []
    for j in range(n):
        rj = slice(j * B, (j + 1) * B)
        yj = conv_step(x[rj], cs_steps, weight, slots)
        outs.append(recurrent_step(yj, a[rj], b[rj], z[rj], s_steps, slots, A_log, dt_bias,
                                   norm_w, HK, 1e-6, dv_split=dv_split))
        snaps.append(s_steps[slots].clone())
    cs_v, s_v = conv_state.clone(), rec16.clone()
    sr = torch.full((n - 1, B, HV, Dk, Dv), float("nan"), device=DEV, dtype=torch.bfloat16)
    yv = conv_verify(x, cs_v, weight, slots,
                     torch.empty(n - 1, B, C, 3, device=DEV, dtype=conv_state.dtype))
    out = recurrent_verify(yv, a, b, z, s_v, slots, A_log, dt_bias, norm_w, HK, 1e-6, sr,
                           dv_split=dv_split)
    if dtype == torch.float32 and DEV == "cuda":  # the conv's last bit (see the verify test)
        def same(u, w):
            return rel_err(u.float(), w.float()) < 1e-2
    else:
        same = torch.equal
    assert same(out, torch.cat(outs)) and same(s_v[slots], s_steps[slots])
    for j in range(n - 1):
        assert same(sr[j], snaps[j])
    assert s_v[others].isnan().all()


@pytest.mark.contract("kernel-equals-reference")
@pytest.mark.parametrize("splits", [1, 3, 16, 32, None])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page,lens", [(16, [1, 17, 100]), (4, [7, 64, 129, 2]), (16, [300])])
def test_paged_decode_attention(dtype, page, lens, splits):
    """splits: key ranges per (sequence, KV head); 1: the merge only divides (and gates); 16 and
    32 run 32-key blocks and the merge over D in programs; None: the decode default."""
    from tailored.kernels.attention_decode import paged_decode_attention

    if DEV == "cpu" and splits == 32 and len(lens) > 1:
        pytest.skip("32 splits (the 128-wide merge over D) on one length in the interpreter: "
                    "32 programs a (sequence, head) cost seconds; 16 splits run all lengths")
    g = torch.Generator().manual_seed(page + len(lens))
    Hq, Hkv, D = 4, 2, 128 if splits == 32 else 32  # D 128: the merge runs 2 programs over D
    B = len(lens)
    pages_per = [-(-n // page) for n in lens]
    num_pages = sum(pages_per) + 5
    kc = torch.full((num_pages, page, Hkv, D), float("nan")).to(DEV, dtype)
    vc = torch.full_like(kc, float("nan"))
    perm = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()  # page 0 = sink
    table = torch.zeros(B, max(pages_per) + 2, dtype=torch.int32)
    q = torch.randn(B, Hq, D, generator=g).to(DEV, dtype)
    want = []
    for i, n in enumerate(lens):
        own = [perm.pop() for _ in range(pages_per[i])]
        table[i, : len(own)] = torch.tensor(own)
        kk = torch.randn(n, Hkv, D, generator=g).to(DEV, dtype)
        vv = torch.randn(n, Hkv, D, generator=g).to(DEV, dtype)
        for t in range(n):
            kc[own[t // page], t % page] = kk[t]
            vc[own[t // page], t % page] = vv[t]
        want.append(ref.causal_attention(q[i : i + 1].float(), kk.float(), vv.float(), n - 1)[0])
    # partial last pages hold NaN past the length: the kernel must never read them
    out = paged_decode_attention(q, kc, vc, table.to(DEV),
                                 torch.tensor(lens, dtype=torch.int32, device=DEV),
                                 num_splits=splits)
    assert torch.isfinite(out).all()
    assert rel_err(out, torch.stack(want)) < TOL[dtype]
    # the output gate in the merge (kb/0036): a strided view of a wider projection, as the
    # model's q|gate rows give it; equal to the two torch ops, bitwise in fp32
    gate = torch.randn(B, Hq, 2 * D, generator=g).to(DEV, dtype)[..., D:]
    gated = paged_decode_attention(q, kc, vc, table.to(DEV),
                                   torch.tensor(lens, dtype=torch.int32, device=DEV),
                                   num_splits=splits,
                                   gate=gate)
    two_ops = out * torch.sigmoid(gate)
    if dtype == torch.float32:
        assert torch.allclose(gated, two_ops, rtol=1e-6, atol=1e-7)
    else:  # one bf16 ulp where Triton's and torch's sigmoid round differently
        assert (gated.float() - two_ops.float()).abs().max() <= 2 ** -7 * two_ops.float().abs().max()
    with pytest.raises(ValueError):
        paged_decode_attention(q, kc, vc, table.to(DEV),
                               torch.tensor(lens, dtype=torch.int32, device=DEV), gate=gate[:, :1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,N", [(1, 64), (7, 2048), (3, 96)])
def test_add_rms_norm(dtype, T, N):
    from tailored.kernels.norm import add_rms_norm_1p

    g = torch.Generator().manual_seed(T + N)
    x = torch.randn(T, N, generator=g).to(DEV, dtype)
    h = torch.randn(T, N, generator=g).to(DEV, dtype)
    w = (0.1 * torch.randn(N, generator=g)).to(DEV, dtype)
    res, out = add_rms_norm_1p(x, h, w, 1e-6)
    r_ref = x + h
    assert torch.equal(res, r_ref)
    o_ref = ref.rms_norm_1p(r_ref, w, 1e-6)
    assert rel_err(out, o_ref) < (1e-6 if dtype == torch.float32 else 1e-2)
    _, out2 = add_rms_norm_1p(x, None, w, 1e-6)
    assert rel_err(out2, ref.rms_norm_1p(x, w, 1e-6)) < (1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,D,R", [(1, 16, 256, 64), (7, 2, 256, 64), (5, 3, 32, 8)])
def test_qk_norm_rope(dtype, T, H, D, R):
    """Equals rms_norm_1p + apply_partial_rope on a strided view (q inside the fused q|gate
    GEMM output), at positions far apart; exact up to the fp32 sum order of the norm."""
    from tailored.kernels.qk_norm_rope import qk_norm_rope

    g = torch.Generator().manual_seed(T * H + D)
    qg = (3 * torch.randn(T, H, 2 * D, generator=g)).to(DEV, dtype)
    x = qg[..., :D]  # stride (H·2D, 2D, 1), as in the attention layer
    w = (0.2 * torch.randn(D, generator=g)).to(DEV, dtype)
    pos = torch.tensor([1000, 5, 17, 0, 4095, 70000, 3][:T], device=DEV)  # T=1 not at cos=1
    cos, sin = ref.rope_cos_sin(pos, R, 1e7, dtype)
    out = qk_norm_rope(x, w, cos, sin, 1e-6)
    want = ref.apply_partial_rope(ref.rms_norm_1p(x, w, 1e-6), cos, sin)
    assert out.shape == want.shape and out.is_contiguous() and torch.isfinite(out).all()
    if dtype == torch.float32:
        assert rel_err(out, want) < 1e-6
    else:  # the same roundings as PyTorch's eager ops: exact but where the fp32 sum order or
        # rsqrt approximation of the norm flips a bf16 rounding (the interpreter truncates
        # bf16 casts, so this runs on the GPU only)
        assert rel_err(out, want) < 1e-2
        assert (out == want).float().mean() > 0.95
    # the KV store in the same launch: rows of a flat cache (NaN-poisoned), v copied alongside
    N = 3 * T + 4
    rows = torch.randperm(N, generator=g)[:T].to(DEV)
    kc = torch.full((N, H, D), float("nan"), dtype=dtype, device=DEV)
    vc = torch.full_like(kc, float("nan"))
    v = torch.randn(T, H, 2 * D, generator=g).to(DEV, dtype)[..., D:]  # strided, like qkv
    got = qk_norm_rope(x, w, cos, sin, 1e-6, rows=rows, out=kc, v=v, v_out=vc)
    assert got is kc and torch.equal(kc[rows], out) and torch.equal(vc[rows], v)
    others = torch.ones(N, dtype=torch.bool, device=DEV)
    others[rows] = False
    assert kc[others].isnan().all() and vc[others].isnan().all()
    with pytest.raises(ValueError):
        qk_norm_rope(x, w, cos, sin, 1e-6, rows=rows)  # rows without out
    with pytest.raises(ValueError):
        qk_norm_rope(x, w, cos, sin, 1e-6, rows=rows, out=kc[:, :, : D // 2])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,k,N", [(1, 2048, 8, 512), (5, 96, 3, 40), (33, 200, 8, 24)])
def test_moe_glue(dtype, T, H, k, N):
    """silu_mul and moe_combine equal the eager ops they replace, on strided views of one fused
    GEMM output (router | shared gate | shared up | shared-expert gate)."""
    from tailored.kernels.moe_combine import moe_combine, silu_mul

    g = torch.Generator().manual_seed(T + H + k)
    r = (2 * torch.randn(T, 7 + 2 * N + 1, generator=g)).to(DEV, dtype)  # 7 router columns
    sg, su, seg = r[:, 7:7 + N], r[:, 7 + N:7 + 2 * N], r[:, 7 + 2 * N:]
    act = silu_mul(sg, su)
    want_act = torch.nn.functional.silu(sg) * su
    pairs = torch.randn(T * k, H, generator=g).to(DEV)
    shared = torch.randn(T, H, generator=g).to(DEV, dtype)
    out = moe_combine(pairs, k, seg, shared)
    want = pairs.view(T, k, H).sum(1).to(dtype) + torch.sigmoid(seg) * shared
    assert act.is_contiguous() and out.shape == (T, H)
    if dtype == torch.float32:
        assert rel_err(act, want_act) < 1e-6 and rel_err(out, want) < 1e-6
    else:  # the same roundings; exp approximations may flip a few bf16 roundings
        assert rel_err(act, want_act) < 1e-2 and rel_err(out, want) < 1e-2
        assert (act == want_act).float().mean() > 0.95 and (out == want).float().mean() > 0.95
    with pytest.raises(ValueError):
        moe_combine(pairs[:-1], k, seg, shared)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,k", [(1, 2048, 8), (5, 96, 3), (33, 200, 8)])
def test_moe_combine_folded(dtype, T, H, k):
    """The shared expert's weighted term as each token's last pair row (kb/0019):
    dt(dt(Σ_{j<k}) + dt(row k)), NaN in no output, no row of another token read."""
    from tailored.kernels.moe_combine import moe_combine_folded

    g = torch.Generator().manual_seed(T + H)
    pairs = torch.randn(T * (k + 1), H, generator=g).to(DEV)
    out = moe_combine_folded(pairs, k, dtype)
    p = pairs.view(T, k + 1, H)
    want = (p[:, :k].sum(1).to(dtype).float() + p[:, k].to(dtype).float()).to(dtype)
    assert out.shape == (T, H) and out.dtype == dtype and not out.isnan().any()
    if dtype == torch.float32:
        assert rel_err(out, want) < 1e-6
    else:
        assert rel_err(out, want) < 1e-2 and (out == want).float().mean() > 0.95
    with pytest.raises(ValueError):
        moe_combine_folded(pairs[:-1], k, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("folded", [False, True])
@pytest.mark.parametrize("T,H,k", [(1, 2048, 8), (3, 96, 3), (5, 200, 8)])
def test_moe_combine_with_the_next_norm(dtype, folded, T, H, k):
    """norm=(residual, w, eps): (residual + out, rms_norm_1p of it) from the combine's launch
    equal the combine then add_rms_norm_1p (kb/0023)."""
    from tailored.kernels.moe_combine import moe_combine, moe_combine_folded
    from tailored.kernels.norm import add_rms_norm_1p

    g = torch.Generator().manual_seed(T + H + k + folded)
    res = torch.randn(T, H, generator=g).to(DEV, dtype)
    w = (0.3 * torch.randn(H, generator=g)).to(DEV, dtype)
    if folded:
        pairs = torch.randn(T * (k + 1), H, generator=g).to(DEV)
        out = moe_combine_folded(pairs, k, dtype)
        got_res, got = moe_combine_folded(pairs, k, dtype, (res, w, 1e-6))
    else:
        pairs = torch.randn(T * k, H, generator=g).to(DEV)
        seg = torch.randn(T, 3, generator=g).to(DEV, dtype)[:, 1:2]
        shared = torch.randn(T, H, generator=g).to(DEV, dtype)
        out = moe_combine(pairs, k, seg, shared)
        got_res, got = moe_combine(pairs, k, seg, shared, (res, w, 1e-6))
    want_res, want = add_rms_norm_1p(res, out, w, 1e-6)
    assert torch.equal(got_res, want_res)  # the add rounds the same way
    assert not got.isnan().any()
    if dtype == torch.float32:
        assert rel_err(got, want) < 1e-6
    else:  # FMA contraction differs between the two kernels: a few bf16 roundings may flip
        assert rel_err(got, want) < 1e-2 and (got == want).float().mean() > 0.95
    with pytest.raises(ValueError):
        moe_combine_folded(torch.zeros(T * (k + 1), H, device=DEV), k, dtype, (res[:, :-1], w, 1e-6))


def test_pdl_launch_arguments(monkeypatch, switches):
    """kernels/pdl.py: switched off, or for a CPU tensor, {"PDL": False}; on (the default),
    only CUDA tensors of an sm_90+ device get Triton's launch_pdl with the kernels' PDL
    constexpr, and not in Triton's interpreter (no inline PTX there; the PTX is checked by
    test_kernels_sm90.py, the bits on the GPU by test_gpu.py)."""
    from types import SimpleNamespace

    from tailored.kernels import pdl

    t = torch.zeros(2)
    switches(pdl=False)
    monkeypatch.setattr(pdl, "_on_sm90", lambda x: True)
    assert pdl.launch(t) == {"PDL": False}  # switched off
    monkeypatch.undo()
    switches(pdl=True)
    assert pdl.launch(t) == {"PDL": False}  # a CPU tensor
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl._on_sm90(SimpleNamespace(is_cuda=True))  # interpreted on a GPU machine
    monkeypatch.setattr(pdl, "_on_sm90", lambda x: True)
    assert pdl.launch(t) == {"PDL": True, "launch_pdl": True}


def test_compile_watch_logs_and_chains(monkeypatch, caplog):
    """kernels/compile_watch.py (kb/0030): after the warm-up, each Triton compile is logged
    with the kernel and its specialization, and a hook installed before keeps being called."""
    knobs = pytest.importorskip("triton").knobs
    from tailored.kernels.compile_watch import watch_compiles

    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: seen.append(kw))
    assert watch_compiles()
    with caplog.at_level("WARNING", logger="tailored.kernels"):
        knobs.runtime.jit_post_compile_hook(key=1, repr="_k[num_warps=4](x: *bf16)",
                                            compile={"specialization_data": "{tt.divisibility}"})
    assert seen and "_k[num_warps=4]" in caplog.text and "tt.divisibility" in caplog.text
    assert watch_compiles()  # a second runner: no second wrapper, no doubled log lines
    caplog.clear()
    with caplog.at_level("WARNING", logger="tailored.kernels"):
        spec = {"attrs_keys": [[3]], "attrs_vals": [[["tt.divisibility", 16]]],
                "constant_vals": [8]}
        knobs.runtime.jit_post_compile_hook(repr="_k2",
                                            compile={"specialization_data": json.dumps(spec)})
    assert caplog.text.count("_k2") == 1 and "tt.divisibility" in caplog.text
    assert len(seen) == 2
