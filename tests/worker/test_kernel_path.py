"""The kernel path (model/kernel_*.py, worker/kernel_forward.py) equals the plain path, step by
step, state by state; the worker's graph bodies equal the eager kernel path.

Runs on the CPU through Triton's interpreter in fp32 on the tiny preset cut to 4 layers (3 GDN
+ 1 attention: both layer kinds; the interpreter costs per program launched, so every layer
counts): mixed prefill+decode steps, chunked prefill, decode steps through the decode graph's
body with pad rows (the code a CUDA graph captures), the prefill, verify, MTP and chain graph
bodies, and whole greedy generations through the engine with kernels on vs off. The graphs
themselves replay on the GPU (tests/gpu/test_gpu.py, test_gpu_spec.py).

The models and their caches are built once per module (`bf16_pair`, `fp8_pair`,
`fp8dq_pair`, `spec_path`); every test sets the cache state it starts from.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import load_cpu_fp32, new_cache, rel_err

from tailored import flags, kernels
from tailored.model.batch import ForwardBatch, SeqInfo
from tailored.model.kernel_model import KernelModel
from tailored.worker.cache import HybridCache
from tailored.worker.kernel_forward import KernelForward

pytestmark = [pytest.mark.skipif(not kernels.available(), reason="triton not installed"),
              pytest.mark.usefixtures("one_thread")]


def _ids(T, seed):
    return torch.randint(0, 248044, (T,), generator=torch.Generator().manual_seed(seed)).tolist()


def _tensors(cache):
    return (cache.conv, cache.rec, cache.k, cache.v)


def _make_pair(ckpt, state_dtype=torch.float32):
    """(plain model, the kernel path of a second copy over its cache (eager: no graphs on the
    CPU), that cache). Two copies: the kernel path fuses its model's weights into views."""
    plain, m = load_cpu_fp32(ckpt), load_cpu_fp32(ckpt)
    cache = new_cache(m.config, state_dtype=state_dtype)
    kf = KernelForward(KernelModel(m, cache), max_batch=4, max_pages=12, use_graphs=False)
    return plain, kf, cache


@pytest.fixture(scope="module")
def bf16_pair(tiny4_ckpt):
    return _make_pair(tiny4_ckpt)


@pytest.fixture(scope="module")
def fp8_pair(tiny4_fp8_ckpt):
    """The block-FP8 checkpoint with `fp8_dense_dequant` off: the kernel path reads the FP8
    weights through fp8_linear and the FP8 MoE (the plain path dequantizes). The switch is
    read once, when KernelModel lays the projections out."""
    with flags.override(fp8_dense_dequant=False):
        return _make_pair(tiny4_fp8_ckpt)


@pytest.fixture(scope="module")
def fp8dq_pair(tiny4_fp8_ckpt):
    """The block-FP8 checkpoint in the served layout: dense projections held dequantized
    (`fp8_dense_dequant`, kb/0026), read through the FP8 GEMV / split-K GEMM at few rows."""
    return _make_pair(tiny4_fp8_ckpt)


@pytest.fixture(params=["bf16", "fp8"])
def pair(request):
    """(plain model, kernel path, its cache) from the bf16 and the FP8 checkpoint."""
    return request.getfixturevalue(f"{request.param}_pair")


def test_fused_weights_are_views_with_the_same_values(pair):
    plain, kf, _ = pair
    km, kmodel = kf.km, kf.km.model
    for (n1, p1), (n2, p2) in zip(plain.named_parameters(), kmodel.named_parameters()):
        assert n1 == n2 and p1.dtype == p2.dtype and torch.equal(p1.float(), p2.float()), n1
    m = kmodel.model.layers[0].linear_attn
    assert m.in_proj_z.weight.data_ptr() != m.in_proj_qkv.weight.data_ptr()
    proj, idx = km.p_in[0].parts[0]
    assert idx[:2] == [0, 1]  # qkv|z are one GEMM in both precisions
    assert m.in_proj_qkv.weight.untyped_storage().data_ptr() == \
        proj.weight.untyped_storage().data_ptr()
    # the shared expert as expert E (kb/0019): the routed experts are views of the stack
    mlp = kmodel.model.layers[0].mlp
    st, E = km.moe.stacks[0], mlp.experts.gate_up_proj.shape[0]
    assert st.gate_up.shape[0] == st.down.shape[0] == E + 1
    assert mlp.experts.gate_up_proj.data_ptr() == st.gate_up.data_ptr()
    assert mlp.experts.down_proj.data_ptr() == st.down.data_ptr()
    se = mlp.shared_expert
    assert torch.equal(st.gate_up[E], torch.cat([se.gate_proj.weight, se.up_proj.weight]))
    assert torch.equal(st.down[E], se.down_proj.weight)
    assert (st.gate_up_scale is None) == (plain.config.fp8 is None)
    if plain.config.fp8 is not None:
        assert m.in_proj_qkv.weight.dtype == torch.float8_e4m3fn and proj.fp8
        assert m.in_proj_a.weight.dtype == torch.float32  # not converted (spec §9.1)
        assert len(km.p_in[0].parts) == 2


# the switches of the "fp8_switches" variant: every per-step kernel choice of a few-row step
# pushed to 4 rows
SWITCHES = {"shared_in_moe_up_to": 128, "gdn_dv_split": 4, "moe_route_in_gate_up_up_to": 4,
            "moe_gemv_up_to": 4, "bf16_gemv_up_to": 4}


@pytest.mark.contract("kernel-path-equals-plain")
@pytest.mark.parametrize("variant", ["bf16", "fp8_switches", "fp8_dense_dequant"])
def test_steps_match_plain_path(variant, request, switches, monkeypatch):
    """bf16, fp8_dense_dequant: the switches' defaults, as served (routing + align in one or
    two launches up to 64 rows, kb/0021; the GDN step over 2 programs a head, kb/0022; the
    combine doing the next add + norm, kb/0023; the gate in the attention merge, kb/0037), at
    decode steps of 1, 2, 3 and 4 rows (`_run_steps`), so every few-row class of the
    defaults runs: 1 row the shared expert as routed expert E (kb/0019, kb/0036), routing
    inside the gate_up programs (kb/0036) and the bf16 / FP8 GEMVs (kb/0039, kb/0040,
    kb/0042); 2 rows routing in gate_up without the shared expert; 3-4 rows route + align
    then the expert GEMMs. (The FP8 experts' float16 gate_up dots apply to bf16 activations
    only: these fp32 steps keep fp32 dots; tests/kernels covers them.)

    fp8_switches: the FP8 checkpoint with `fp8_dense_dequant` off (W8A16 fp8_linear
    projections, FP8 experts) and every few-row switch pushed to 4 rows at once (each variant
    costs in the interpreter): the shared expert as expert E at every step size (the threshold
    raised so that the 65- and 15-row prefill steps take it too, through the top-k and the
    one-launch routing), routing inside gate_up and the FP8 expert GEMVs at 3-4 rows (decode
    steps of 3 and 4 rows only: 1-2 rows launch the same kernels), the bf16 GEMV for the
    router rows, the GDN step over 4 programs a head.

    fp8_dense_dequant (kb/0026): the served FP8 layout, dense projections held dequantized,
    one GEMM per input (qkv|z|b|a, router|gates|shared up), the modules' FP8 weights
    untouched, the routed experts FP8: steps of up to `fp8_gemv_up_to` (2) rows read the FP8
    weights through the GEMV (kb/0039 §4), up to `fp8_dense_splitk_up_to` (8) through the
    split-K GEMM (kb/0045 §4), larger ones cuBLAS over the dequantized copy; never
    fp8_linear. (Each switch's rule at every row count, off included:
    test_proj_picks_its_kernel_by_rows.)

    The first step has 65 rows (past the 64 routed + aligned in one launch: the top-k path,
    with the shared expert as expert E in fp8_switches) in bf16 and fp8_switches, 33 in the
    others, whose own code (dequantized projections, bf16 states) has no 64-row boundary."""
    fixture = {"bf16": "bf16_pair", "fp8_switches": "fp8_pair",
               "fp8_dense_dequant": "fp8dq_pair"}[variant]
    plain, kf, fcache = request.getfixturevalue(fixture)
    if variant == "fp8_switches":
        switches(**SWITCHES)
    if variant == "bf16":
        _run_steps(plain, kf, fcache, long_prefill=True)
        return
    if variant == "fp8_switches":  # 1-2 rows take the same kernels at 3-4 here
        _run_steps(plain, kf, fcache, long_prefill=True, decode=DECODE_STEPS[:2])
        return
    from tailored.model import projections

    calls, tiles, splitk = [], [], []
    real, real_tiles, real_sk = (projections.fp8_gemv, projections.fp8_linear,
                                 projections.fp8_dense_splitk)
    monkeypatch.setattr(projections, "fp8_gemv",
                        lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    monkeypatch.setattr(projections, "fp8_linear",
                        lambda *a, **kw: tiles.append(a[0].shape[0]) or real_tiles(*a, **kw))
    monkeypatch.setattr(projections, "fp8_dense_splitk",
                        lambda *a, **kw: splitk.append(a[0].shape[0]) or real_sk(*a, **kw))
    _run_steps(plain, kf, fcache)
    f = flags.current()
    assert set(calls) == {1, 2} and f.fp8_gemv_up_to == 2
    assert not tiles  # never fp8_linear: cuBLAS over the dequantized copy, GEMV or split-K
    assert set(splitk) == {3, 4} and f.fp8_dense_splitk_up_to == 8


def test_bf16_gdn_states_match_plain_path(tiny4_ckpt):
    """EngineConfig.gdn_state_dtype = bfloat16 (kb/0056): the recurrent states stored in bf16 by
    the decode kernels, the chunked prefill and the plain path alike (fp32 math, rounded on
    store), so the two paths agree step by step as with fp32 states, at bf16's scale."""
    plain, kf, fcache = _make_pair(tiny4_ckpt, state_dtype=torch.bfloat16)
    assert fcache.rec.dtype == torch.bfloat16
    # the decode kernels store the states the same way at any batch size: two decode steps
    _run_steps(plain, kf, fcache, decode=DECODE_STEPS[:2])
    assert fcache.rec.abs().sum() > 0


# decode steps of `_run_steps`: (slots, rows of the decode graph's body or None: eager)
DECODE_STEPS = (((1, 2, 3), None), ((1, 2, 3), 4), ((1, 2), 2), ((3,), 1))


def _run_steps(plain, kf, fcache, long_prefill: bool = False, decode=DECODE_STEPS):
    """Prefill, mixed and decode steps (eager and through the decode graph's body) on both
    paths: same hidden rows, GDN states and KV pages. Steps: two prefills (long_prefill: 65
    rows, past the 64 that route + align in one launch; else 33); chunks continuing their
    prompt across a page boundary (12 tokens) and shorter than the conv window (2), with a
    1-token prompt that resets its slot; decode steps (`decode`) of 3 rows eagerly, then the
    graph body at 3 rows + a pad (n=4), 2 rows (n=2) and 1 row (n=1). bf16 recurrent states (fcache's
    dtype, the plain path's too): both round what they store, and a value next to a rounding
    boundary may round to neighbouring bf16 values, so the states are compared at a bf16
    ulp's scale."""
    cfg = plain.config
    for t in _tensors(fcache):
        t.zero_()
    pcache = new_cache(cfg, state_dtype=fcache.rec.dtype)
    tol = 1e-4 if fcache.rec.dtype == torch.float32 else 2e-3
    nb = 52 if long_prefill else 20
    a, b, c = _ids(25, 1), _ids(nb + 2, 2), _ids(1, 3)
    pa, pb, pc = [1, 2], [4, 5, 6, 7], [9]
    steps = [
        # two prefills (both continued next step) in one step
        [(a[:13], 0, 1, True, pa), (b[:nb], 0, 2, True, pb)],
        # mixed: a chunk across a page boundary, a 2-token chunk, a 1-token prompt (slot 3)
        [(a[13:], 13, 1, False, pa), (b[nb:], nb, 2, False, pb), (c, 0, 3, True, pc)],
    ]
    for layout in steps:
        rows = [sum(len(t[0]) for t in layout[:i + 1]) - 1 for i in range(len(layout))]
        hp = plain(ForwardBatch.build(layout, rows, "cpu"), pcache)
        hf = kf.forward(ForwardBatch.build(layout, rows, "cpu"))
        assert rel_err(hf, hp) < tol
        assert rel_err(fcache.rec, pcache.rec) < tol and rel_err(fcache.conv, pcache.conv) < 1e-5
    # decode-only steps: eager kernels, then the decode graph's body (n rows, pads after B)
    toks = {1: 11, 2: 22, 3: 33}
    pos = {1: 25, 2: nb + 2, 3: 1}
    pages = {1: pa, 2: pb, 3: pc + [10]}
    dec = kf.decode
    if dec.st is None:
        dec.alloc()
    for slots, n in decode:
        layout = [([toks[s]], pos[s], s, False, pages[s]) for s in slots]
        rows = list(range(len(slots)))
        hp = plain(ForwardBatch.build(layout, rows, "cpu"), pcache)
        if n is None:
            hf = kf.forward(ForwardBatch.build(layout, rows, "cpu"))
        else:
            dec.fill(ForwardBatch.build(layout, rows, "cpu"), n)
            hf = dec.body(n)[:len(slots)]
        assert rel_err(hf, hp) < tol, (slots, n)
        assert rel_err(fcache.rec[:, 1:4], pcache.rec[:, 1:4]) < tol
        assert rel_err(fcache.k[:, 1:11], pcache.k[:, 1:11]) < 1e-5
        for s in slots:
            pos[s] += 1
            toks[s] += 7


def _projs(km):
    projs = [p for g in (km.p_in, km.moe.p_moe) for pg in g.values() for p, _ in pg.parts]
    return projs + list(km.p_out.values()) + list(km.moe.p_down.values())


def test_fp8_dense_dequant_layout_and_its_memory_reserve(fp8dq_pair):
    """`fp8_dense_dequant` (kb/0026, on by default): every dense group is one GEMM over a
    dequantized copy, the modules keep their FP8 weights, and the bytes memory_plan keeps out
    of the KV budget (`dense_dequant_bytes`) are the bytes the kernel path allocated: every
    projection tensor that is not a view of a module's parameter, and the FP8 GEMV's fp32 row
    scales. (Its steps: test_steps_match_plain_path[fp8_dense_dequant].)"""
    from tailored.model.projections import dense_dequant_bytes

    _, kf, _ = fp8dq_pair
    km = kf.km
    for g in (km.p_in, km.moe.p_moe):
        for pg in g.values():
            assert len(pg.parts) == 1 and not pg.parts[0][0].fp8
    assert not any(p.fp8 for g in (km.p_out, km.moe.p_down) for p in g.values())
    assert km.model.model.layers[0].linear_attn.in_proj_qkv.weight.dtype == torch.float8_e4m3fn
    params = {q.untyped_storage().data_ptr() for q in km.model.parameters()}
    projs = _projs(km)
    new = [p.weight for p in projs if p.weight.untyped_storage().data_ptr() not in params]
    assert len(new) == len(projs)
    got = sum(w.numel() * w.element_size() for w in new)
    got += sum(p.gemv[1].numel() * 4 for p in projs)  # the FP8 GEMV's fp32 row scales
    assert dense_dequant_bytes(km.model, torch.float32) == got > 0
    w8, s8, wb, bf16_first = km.p_in[0].parts[0][0].gemv  # GDN in: qkv|z FP8, then b|a
    assert w8.dtype == torch.float8_e4m3fn and not bf16_first and s8.shape[0] == w8.shape[0]
    assert wb.untyped_storage().data_ptr() == \
        km.p_in[0].parts[0][0].weight.untyped_storage().data_ptr()
    assert km.moe.p_moe[0].parts[0][0].gemv[3]  # router|gate first


@pytest.mark.parametrize("precision", ["bf16", "fp8dq"])
def test_proj_row_align_pads_fused_gemms(precision, request):
    """`proj_row_align` (kb/0029, default 64 since kb/0030): fused cuBLAS projections get
    zero rows up to a multiple of 64 (FP8: the dense-dequant layout), the module weights stay
    views of the padded tensor, single linears and W8A16 parts are left alone, the memory
    reserve counts the pad. Both layouts' steps run padded in test_steps_match_plain_path."""
    from tailored.model.projections import dense_dequant_bytes

    assert flags.current().proj_row_align == 64
    _, kf, _ = request.getfixturevalue(f"{precision}_pair")
    km = kf.km
    padded = 0
    for g in (km.p_in, km.moe.p_moe):
        for pg in g.values():
            for proj, idx in pg.parts:
                rows = sum(proj.sizes)
                if len(idx) > 1 and not proj.fp8:
                    assert proj.weight.shape[0] % 64 == 0
                    assert proj.weight.shape[0] - rows == proj.pad
                    assert not proj.weight[rows:].any()
                    padded += proj.pad > 0
                else:
                    assert proj.pad == 0 and proj.weight.shape[0] == rows
    assert padded > 0
    mlp = km.model.model.layers[0].mlp
    proj = km.moe.p_moe[0].parts[0][0]
    if precision == "bf16":  # the module weights are views of the padded GEMM weight
        assert mlp.gate.weight.untyped_storage().data_ptr() == \
            proj.weight.untyped_storage().data_ptr()
    else:
        params = {q.untyped_storage().data_ptr() for q in km.model.parameters()}
        projs = _projs(km)
        got = sum(p.weight.numel() * p.weight.element_size() for p in projs
                  if p.weight.untyped_storage().data_ptr() not in params)
        got += sum(p.gemv[1].numel() * 4 for p in projs)  # the FP8 GEMV's row scales
        assert dense_dequant_bytes(km.model, torch.float32) == got
    assert all(p.pad == 0 for p in km.moe.p_route.values())


def test_proj_picks_its_kernel_by_rows(bf16_pair, fp8_pair, fp8dq_pair, switches, monkeypatch):
    """A Proj's kernel per call, by row count and switch, 0 turning each off: a dequantized
    FP8 group reads its FP8 weights through the GEMV up to `fp8_gemv_up_to` rows, the split-K
    GEMM above that up to `fp8_dense_splitk_up_to`, cuBLAS over the dequantized copy beyond;
    a W8A16 group always through fp8_linear; a bf16 group through the bf16 GEMV up to
    `bf16_gemv_up_to` rows, else cuBLAS. (The kernels are stood in for: their numbers are
    checked in test_steps_match_plain_path and tests/kernels.)"""
    from tailored.model import projections

    seen = []
    for name in ("fp8_gemv", "fp8_dense_splitk", "fp8_linear", "bf16_gemv"):
        monkeypatch.setattr(projections, name, lambda *a, name=name, **kw: seen.append(name))

    def kernel(proj, rows):
        seen.clear()
        proj(torch.zeros(rows, proj.weight.shape[1]))
        return seen[0] if seen else "cublas"

    dq, w8a16, bf = (p[1].km.p_in[0].parts[0][0] for p in (fp8dq_pair, fp8_pair, bf16_pair))
    assert dq.gemv is not None and w8a16.fp8 and not bf.fp8
    rows = (1, 2, 3, 4, 5, 8, 9, 64, 65)
    for gemv, splitk in ((0, 0), (4, 0), (0, 64), (4, 64), (2, 8)):
        switches(fp8_gemv_up_to=gemv, fp8_dense_splitk_up_to=splitk)
        # past both, the dequantized copy is a bf16 weight like any: its GEMV at 1 row
        # (`bf16_gemv_up_to`'s default), cuBLAS above
        assert [kernel(dq, r) for r in rows] == [
            "fp8_gemv" if r <= gemv else "fp8_dense_splitk" if r <= splitk else
            "bf16_gemv" if r == 1 else "cublas" for r in rows], (gemv, splitk)
        assert {kernel(w8a16, r) for r in rows} == {"fp8_linear"}
    for up_to in (0, 1, 4):
        switches(bf16_gemv_up_to=up_to)
        assert [kernel(bf, r) for r in rows] == ["bf16_gemv" if r <= up_to else "cublas"
                                                 for r in rows]


def test_fp8_gemv_parts_need_one_run_of_each_kind():
    """`fp8_gemv_parts` (kb/0039): FP8 members before or after the bf16 ones, as one run
    each; bf16 rows around the FP8 ones (the GEMV writes two blocks of columns) or no FP8
    member give None, so the projection keeps cuBLAS over the dequantized weight."""
    from torch import nn

    from tailored.model.fp8 import Fp8Linear
    from tailored.model.projections import fp8_gemv_parts

    def f8(n):
        m = Fp8Linear(16, n)
        m.weight.data = torch.zeros(n, 16).to(torch.float8_e4m3fn)
        m.weight_scale_inv.data.fill_(1.0)
        return m

    def bf(n):
        return nn.Linear(16, n, bias=False)

    def parts(mods):
        deq = torch.cat([torch.full((m.weight.shape[0], 16), float(j)) for j, m in enumerate(mods)])
        return fp8_gemv_parts(mods, deq)

    assert parts([bf(3), bf(5)]) is None
    assert parts([bf(3), f8(4), bf(5)]) is None
    w8, s8, wb, bf16_first = parts([bf(3), bf(2), f8(4), f8(6)])
    assert bf16_first and w8.shape == (10, 16) and s8.shape == (10, 1)
    assert wb.shape == (5, 16) and wb[:3].eq(0).all() and wb[3:].eq(1).all()
    w8, s8, wb, bf16_first = parts([f8(4), bf(3)])
    assert not bf16_first and wb.shape == (3, 16) and wb.eq(1).all()
    assert parts([f8(4)])[2] is None


def _stack(ckpt, kernels_, **kw):
    from tailored.stack import build_stack

    kw.setdefault("max_model_len", 128)
    kw.setdefault("max_num_seqs", 4)
    kw.setdefault("num_pages", 40)
    return build_stack(ckpt, device="cpu", dtype="float32", progress=False, kernels=kernels_,
                       **kw)


def _generate(eng, prompts: dict, max_tokens) -> dict:
    """Greedy tokens of {id: prompt} added at once; max_tokens: one int or {id: n}."""
    from tailored.engine.types import SamplingParams

    for rid, p in prompts.items():
        n = max_tokens if isinstance(max_tokens, int) else max_tokens[rid]
        eng.add_request(rid, p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    got = {rid: [] for rid in prompts}
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id].extend(o.delta_token_ids)
    return got


def test_engine_greedy_same_with_kernels_on_and_off(tiny4_fp8_ckpt):
    """The engine (async scheduling, its default) with the kernel path against the plain
    path: the same greedy tokens, and the hidden states the engine computed at every position
    (the gate's capture, `engine_greedy`, which must see the kernel path's forward too) within
    1e-4. The FP8 checkpoint in the served layout (dense projections dequantized); the bf16
    layout runs through the engine with drafts in
    test_engine_with_drafts_device_chain_equals_the_plain_path_and_the_host_path."""
    from tailored.gate.engine_side import engine_greedy

    prompts = {f"r{i}": _ids(T, 50 + i) for i, T in enumerate((5, 14, 9))}
    outs = {}
    for mode in ("off", "on"):
        eng = _stack(tiny4_fp8_ckpt, mode).engine
        assert (eng.runner.kernel is not None) == (mode == "on")
        outs[mode] = engine_greedy(eng, prompts, 5, capture=True)
    (t_off, h_off), (t_on, h_on) = outs["off"], outs["on"]
    assert t_on == t_off and all(len(t) == 5 for t in t_on.values())
    for r in prompts:
        assert rel_err(h_on[r], h_off[r]) < 1e-4, r


@pytest.mark.contract("mixed-step-isolation")
def test_kernel_path_steps_leave_other_slots_and_pages_bit_identical(tiny4_ckpt):
    """The slot/page isolation check of the invariance suite on the kernel path (eager: the
    interpreter has no graphs; tests/gpu/test_gpu_invariance.py runs it with graphs)."""
    import invariance_checks as C

    def make(budget, max_num_seqs, max_model_len, num_pages):
        return _stack(tiny4_ckpt, "on", max_num_batched_tokens=budget,
                      max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                      num_pages=num_pages).engine

    C.steps_leave_other_slots_and_pages_bit_identical(make, quick=True)


@pytest.mark.contract("kernel-path-equals-plain")
@pytest.mark.parametrize("T,n", [(2, 8), (65, 72)])
def test_prefill_graph_body_equals_eager_prefill(bf16_pair, T, n):
    """The body a prefill CUDA graph captures (kb/0013), run eagerly on n ≥ T padded rows of
    static buffers sized for 128, computes what the eager prefill of the T-token prompt
    computes: hidden rows, the slot's conv and recurrent states, the prompt's KV rows; pads
    touch only the sinks (slot 0, page 0). The conv is kernels/gdn_conv.py's in both
    (kb/0029); T=2 is shorter than the conv window; T=65 crosses a GDN chunk (64) and four
    pages, its pads fill most of the second chunk. bf16 layout only: the body's projections
    are the eager path's (both layouts: test_steps_match_plain_path)."""
    from tailored.worker.graphs import prefill_static

    _, kf, cache = bf16_pair
    km = kf.km
    ps, slot = cache.page_size, 3
    pages = [5 + j for j in range(T // ps + 1)]
    layout = [(_ids(T, 100 + T), 0, slot, True, pages)]
    g = torch.Generator().manual_seed(T)
    for t in _tensors(cache):  # stale state the prompt must ignore
        t.copy_(torch.randn(t.shape, generator=g, dtype=t.dtype))
    before = [t.clone() for t in _tensors(cache)]
    want = km.forward_eager(ForwardBatch.build(layout, [T - 1], "cpu"))
    after_eager = [t.clone() for t in _tensors(cache)]
    for t, b in zip(_tensors(cache), before):
        t.copy_(b)
    kf.prefill.st = prefill_static(128, km.device, reset=True)
    kf.prefill.fill(ForwardBatch.build(layout, [T - 1], "cpu"), n)
    got = kf.prefill.body(n)
    assert got.shape[0] == n
    assert rel_err(got[:T], want) < 1e-5
    conv, rec, k, v = _tensors(cache)
    e_conv, e_rec, e_k, e_v = after_eager
    assert rel_err(conv[:, slot], e_conv[:, slot]) < 1e-5  # later layers' inputs differ ~1e-6
    assert rel_err(rec[:, slot], e_rec[:, slot]) < 1e-5
    for j, p in enumerate(pages):  # the prompt's KV rows
        rows = slice(0, min(ps, T - j * ps))
        assert rel_err(k[:, p, rows], e_k[:, p, rows]) < 1e-5
        assert rel_err(v[:, p, rows], e_v[:, p, rows]) < 1e-5
    # everything else is bit-identical to before, except the sinks (slot 0, page 0)
    others = [s for s in range(conv.shape[1]) if s not in (0, slot)]
    assert torch.equal(conv[:, others], before[0][:, others])
    assert torch.equal(rec[:, others], before[1][:, others])
    used = set(pages) | {0}
    free = [p for p in range(k.shape[1]) if p not in used]
    assert torch.equal(k[:, free], before[2][:, free]) and torch.equal(v[:, free], before[3][:, free])
    last = pages[-1]
    tail = slice(T - (len(pages) - 1) * ps, ps)  # unused rows of the prompt's last page
    assert torch.equal(k[:, last, tail], before[2][:, last, tail])


def graph_stand_ins(kf, monkeypatch, names=("decode", "prefill"), compute: bool = True) -> list:
    """Turn `kf`'s graphs on and stand its graph entry points `names` ("decode", "prefill":
    `kf.decode.forward`, `kf.prefill.forward`; "eager": `kf.km.forward_eager`), and
    `kf.ctx.forward` when it has context graphs, in with the eager forward, which is what a
    replay computes (the CPU has no CUDA graphs), with prefill graphs at {128}. Returns the
    list each call appends (kind, [(tokens, start_pos, slot) of each sequence]) to: kind is
    the name, or "ctx". compute=False: the stand-ins return zeros (dispatch only)."""
    real_eager = kf.km.forward_eager
    calls = []

    def as_graph(kind):
        def run(batch):
            calls.append((kind, [(s.num_tokens, s.start_pos, s.slot) for s in batch.seqs]))
            if not compute:
                return torch.zeros(batch.input_ids.shape[0], kf.km.cfg.hidden_size)
            return real_eager(batch)
        return run

    monkeypatch.setattr(kf, "use_graphs", True)
    monkeypatch.setattr(kf.prefill, "graphs", {128: None})
    where = {"decode": (kf.decode, "forward"), "prefill": (kf.prefill, "forward"),
             "eager": (kf.km, "forward_eager")}
    for name in names:
        monkeypatch.setattr(*where[name], as_graph(name))
    if kf.ctx is not None:
        monkeypatch.setattr(kf.ctx, "forward", as_graph("ctx"))
    return calls


def test_mixed_step_sends_a_lone_fresh_prompt_to_the_prefill_graph(bf16_pair, monkeypatch,
                                                                   switches):
    """kb/0028: a step of decode rows and one fresh prompt replays the decode graph for the
    rows and the prefill graph for the prompt (the CPU has no CUDA graphs: the two graph entry
    points are stood in for by the eager forward, which is what a replay computes, and the
    test pins the split: which rows go where, and that the outputs land in batch order). Two
    short prompts replay a graph each since kb/0056, or stay eager with that off. The
    dispatch is precision-blind: the bf16 layout."""
    plain, kf, fcache = bf16_pair
    calls = graph_stand_ins(kf, monkeypatch)
    cfg = plain.config
    for c in _tensors(fcache):
        c.zero_()
    pcache = new_cache(cfg)
    a, b, p = _ids(17, 11), _ids(9, 12), _ids(12, 13)
    warm = [(a, 0, 1, True, [1, 2]), (b, 0, 2, True, [3])]
    plain(ForwardBatch.build(warm, [16, 25], "cpu"), pcache)
    kf.km.forward_eager(ForwardBatch.build(warm, [16, 25], "cpu"))
    calls.clear()
    # decode rows first (the scheduler's order), then the fresh prompt into slot 3
    layout = [([5], 17, 1, False, [1, 2]), ([6], 9, 2, False, [3]), (p, 0, 3, True, [4])]
    rows = [0, 1, 2 + 11]
    hp = plain(ForwardBatch.build(layout, rows, "cpu"), pcache)
    hf = kf.forward(ForwardBatch.build(layout, rows, "cpu"))
    assert calls == [("decode", [(1, 17, 1), (1, 9, 2)]), ("prefill", [(12, 0, 3)])], calls
    assert rel_err(hf, hp) < 1e-4
    assert rel_err(fcache.rec[:, 1:4], pcache.rec[:, 1:4]) < 1e-4
    # two fresh prompts beside a decode row: each replays its own prefill graph (at most 2
    # chunks and 1024 tokens, prompts_in_graphs_*, kb/0056); with that off they run eagerly,
    # together (the dispatch only: every entry point stood in for by zeros)
    calls = graph_stand_ins(kf, monkeypatch, ("decode", "prefill", "eager"), compute=False)
    layout = [([7], 18, 1, False, [1, 2]), (p[:5], 0, 2, True, [3]), (p[5:], 0, 3, True, [4])]
    for bound, want in ((1024, [("prefill", [(5, 0, 2)]), ("prefill", [(7, 0, 3)])]),
                        (0, [("eager", [(5, 0, 2), (7, 0, 3)])])):
        switches(prompts_in_graphs_up_to=bound)
        calls.clear()
        kf.forward(ForwardBatch.build(layout, [0, 5, 12], "cpu"))
        assert calls == [("decode", [(1, 18, 1)])] + want, calls


def test_mixed_step_folds_its_decode_rows_into_an_eager_prompt_step(bf16_pair, monkeypatch,
                                                                      switches):
    """kb/0068: with `mixed_eager_from` on, a step of decode rows beside prompt chunks that
    run eagerly with at least that many tokens runs whole in one eager forward (the split
    reads the weights twice); fewer prompt tokens, or chunks that replay their own graphs,
    keep the split; off (0), the split always. Dispatch only: every entry point stood in
    for by zeros (the eager forward of a mixed batch is the plain path's, tested above)."""
    _, kf, _ = bf16_pair
    calls = graph_stand_ins(kf, monkeypatch, ("decode", "prefill", "eager"), compute=False)
    p = _ids(12, 13)
    layout = [([7], 18, 1, False, [1, 2]), (p[:5], 0, 2, True, [3]), (p[5:], 0, 3, True, [4])]
    split_eager = [("decode", [(1, 18, 1)]), ("eager", [(5, 0, 2), (7, 0, 3)])]
    for graphs_up_to, fold, want in (
            (0, 12, [("eager", [(1, 18, 1), (5, 0, 2), (7, 0, 3)])]),
            (0, 13, split_eager),
            (0, 0, split_eager),
            (1024, 1, [("decode", [(1, 18, 1)]), ("prefill", [(5, 0, 2)]),
                       ("prefill", [(7, 0, 3)])])):
        switches(prompts_in_graphs_up_to=graphs_up_to, mixed_eager_from=fold)
        calls.clear()
        out = kf.forward(ForwardBatch.build(layout, [0, 5, 12], "cpu"))
        assert out.shape == (13, kf.km.cfg.hidden_size)
        assert calls == want, (graphs_up_to, fold, calls)


def test_warmup_prefill_touches_only_the_sinks(bf16_pair):
    """The startup warm-up (single prompts, then three sequences of an odd total: kb/0030)
    writes only slot 0 and page 0 of the cache: every other slot and page is bit-identical.
    (The sinks are precision-blind: the bf16 layout.)"""
    from tailored.worker.warmup import warmup_prefill

    _, kf, cache = bf16_pair
    g = torch.Generator().manual_seed(7)
    for t in _tensors(cache):
        t.copy_(torch.randn(t.shape, generator=g, dtype=t.dtype))
    before = [t.clone() for t in _tensors(cache)]
    warmup_prefill(kf.km, [5], batch_tokens=9)  # then lengths 4, 2, 3
    (conv, rec, k, v), (c0, r0, k0, v0) = _tensors(cache), before
    assert torch.equal(conv[:, 1:], c0[:, 1:]) and torch.equal(rec[:, 1:], r0[:, 1:])
    assert torch.equal(k[:, 1:], k0[:, 1:]) and torch.equal(v[:, 1:], v0[:, 1:])
    assert not torch.equal(conv[:, 0], c0[:, 0])  # it ran


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_warmup_lengths_reach_every_moe_launch_class(fp8, grouped, switches):
    """Every prefill of 33..8192 tokens picks a MoE launch class (fused_moe's M tile and, for
    few-row steps, pair bucket; or, eager from `moe_grouped_from`, the grouped path) that the
    warm-up already ran: it runs every length through fused_moe (prefill graphs of any size
    launch it) and the grouped path where it applies, so nothing is tuned or compiled for a
    new class inside a served step or a graph capture (kb/0030, kb/0031). Up to 32 rows the
    decode graphs' warm-up covers them."""
    import triton

    from tailored.kernels import moe
    from tailored.worker.warmup import warmup_lengths

    switches(moe_grouped=grouped)
    E, k, bt = 256, 8, 8192
    fake = SimpleNamespace(cfg=SimpleNamespace(num_experts=E, num_experts_per_tok=k),
                           dtype=torch.bfloat16, device=torch.device("cuda"))
    lengths = warmup_lengths(fake, bt)
    assert max(lengths) == bt and all(1 < n <= bt for n in lengths)

    def fused_class(T):
        bm = moe._blocks(T * k, E, fp8)[0]
        return bm, triton.next_power_of_2(T * k) if bm == 16 else 0

    def classes(T):  # what a prefill of T tokens may launch: graph (fused) or eager
        return {fused_class(T)} | ({"grouped"} if grouped
                                   and T >= flags.current().moe_grouped_from else set())

    warmed = set().union(*(classes(n) for n in lengths))
    missing = sorted(set().union(*(classes(T) for T in range(33, bt + 1))) - warmed, key=str)
    assert not missing, missing


def test_grouped_experts_only_in_eager_steps_past_the_threshold(switches, monkeypatch):
    """`moe_grouped` applies to bf16 CUDA inputs of ≥ `moe_grouped_from` rows, never in a
    prefill graph body, a warm-up run (`MoEBlocks.fused_only`) or a capture; the warm-up runs
    each length through fused_moe and, where an eager step would take them, the grouped
    experts too (kb/0031)."""
    from tailored.model.kernel_moe import MoEBlocks
    from tailored.worker import warmup

    switches(moe_grouped=True, moe_grouped_from=6144)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # CPU torch
    use = MoEBlocks.use_grouped

    def x(T, dtype=torch.bfloat16, cuda=True):
        return SimpleNamespace(shape=(T, 2048), dtype=dtype,
                               device=torch.device("cuda" if cuda else "cpu"))

    me = SimpleNamespace(fused_only=False)
    assert use(me, x(6144)) and not use(me, x(6143))
    assert not use(me, x(8192, torch.float32)) and not use(me, x(8192, cuda=False))
    assert not use(SimpleNamespace(fused_only=True), x(8192))
    switches(moe_grouped=False)
    assert not use(me, x(8192))
    switches(moe_grouped=True)

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not use(me, x(8192))  # inside a capture
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

    # the warm-up: a CUDA bf16 model runs 7000 tokens twice, an fp32 one once (no grouped
    # path); then an eager step with a decode row (kb/0068)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(warmup, "sink_prefill",
                        lambda km, lengths, decode_rows=0: lengths + ["dec"] * decode_rows)
    dec = ([3, "dec"], False)
    for dtype, want in ((torch.bfloat16, [([100], True), ([7000], True), ([7000], False), dec]),
                        (torch.float32, [([100], True), ([7000], True), dec])):
        runs = []
        moe = SimpleNamespace(fused_only=False)
        fake = SimpleNamespace(moe=moe, device=torch.device("cuda"), dtype=dtype,
                               mtp_layer=None)
        fake.forward_eager = lambda lengths, m=moe, r=runs: r.append((lengths, m.fused_only))
        warmup.warmup_prefill(fake, [100, 7000], batch_tokens=0)
        assert runs == want and moe.fused_only is False


def test_prefill_graph_capture_launches_fused_moe_only(monkeypatch):
    """`PrefillGraphs.capture` holds the MoE to fused_moe (`fused_only`) for the bodies'
    warm-up runs and capture (the session-13 bf16 gate tuned a new tile inside the capture
    when they took the grouped path, kb/0031), and resets it when the capture fails; a failed
    capture leaves no graph, so no prompt `fits`."""
    from tailored.worker.graphs import GraphPool, PrefillGraphs

    km = SimpleNamespace(moe=SimpleNamespace(fused_only=False), device=torch.device("cpu"))
    pool = GraphPool(km)
    seen = []

    def capture(graphs, sizes, body):
        seen.append((km.moe.fused_only, list(sizes)))
        raise RuntimeError("capture failed")

    monkeypatch.setattr(pool, "capture", capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    pg = PrefillGraphs(km, pool)
    pg.capture(256, buckets=[128, 256, 512])
    assert seen == [(True, [256, 128])] and km.moe.fused_only is False and pg.graphs == {}
    assert not pg.fits(ForwardBatch.build([(_ids(5, 1), 0, 1, True, [1])], [4], "cpu"))


def test_verify_chunk_matches_plain_path(bf16_pair):
    """A speculative verify chunk (`SeqInfo.keep_states`, worker/drafter.py) beside a decode
    row: the kernel path's hidden rows and, after `commit_states` at each kept length, its GDN
    states equal the plain path's (which equal decode steps, test_spec_decode.py). The bf16
    layout covers the verify chunk's code; FP8 adds nothing to it."""
    plain, kf, fcache = bf16_pair
    pcache = new_cache(plain.config)
    paths = ((lambda b: plain(b, pcache), pcache), (kf.forward, fcache))
    prompt = _ids(9, 3)
    other = _ids(5, 4)
    for fwd, c in paths:
        c.conv.zero_()
        c.rec.zero_()
        fwd(ForwardBatch.build([(prompt, 0, 1, True, [1]), (other, 0, 2, True, [2])], [], "cpu"))
    snap = {n: getattr(fcache, n).clone() for n in ("conv", "rec")}
    psnap = {n: getattr(pcache, n).clone() for n in ("conv", "rec")}
    chunk = _ids(3, 5)
    for k in (1, 3):
        outs = []
        for (fwd, c), sn in zip(paths, (psnap, snap)):
            for n, t in sn.items():
                getattr(c, n).copy_(t)
            b = ForwardBatch.build([([7], 5, 2, False, [2]), (chunk, 9, 1, False, [1], True)],
                                   [], "cpu")
            outs.append(fwd(b))
            c.commit_states(1, k)
            assert not c.kept_states
        assert rel_err(outs[1], outs[0]) < 1e-4
        assert rel_err(fcache.rec[:, 1], pcache.rec[:, 1]) < 1e-4
        assert rel_err(fcache.conv[:, 1], pcache.conv[:, 1]) < 1e-4
        assert rel_err(fcache.rec[:, 2], pcache.rec[:, 2]) < 1e-4


# ---- speculative decoding: the MTP layer, the verify / MTP / chain graph bodies ---------------
@pytest.fixture(scope="module")
def spec_path(tiny4_ckpt):
    """(model, its MTP cache (16 pages of 16, 4 slots), the eager kernel path over it)."""
    m = load_cpu_fp32(tiny4_ckpt)
    cache = HybridCache(m.config, 16, 16, 4, torch.float32, "cpu", mtp_layers=1)
    kf = KernelForward(KernelModel(m, cache), max_batch=4, max_pages=6, use_graphs=False)
    return m, cache, kf


def _spec(spec_path, num_draft: int, max_batch: int = 4):
    """spec_path with a zeroed cache and SpecGraphs of num_draft drafts for up to max_batch
    sequences (their bodies run eagerly); (model, cache, kernel path, SpecGraphs)."""
    from tailored.worker.spec_graphs import SpecGraphs

    m, cache, kf = spec_path
    for t in _tensors(cache):
        t.zero_()
    cache.kept_states.clear()
    cache.kept_batch = None
    return m, cache, kf, SpecGraphs(kf.km, kf.pool, num_draft, max_batch, kf.max_pages)


def test_warmup_prefill_runs_the_mtp_over_the_sinks_only(spec_path):
    """With speculative decoding (an MTP layer in the cache) the warm-up also runs the MTP
    over each prompt length, as every prompt chunk does (`warm_mtp`): its KV goes to page 0
    only, every other page and slot of the cache is bit-identical."""
    from tailored.worker.warmup import warmup_prefill

    _, cache, kf = spec_path
    assert kf.km.mtp_layer is not None
    g = torch.Generator().manual_seed(8)
    for t in _tensors(cache):
        t.copy_(torch.randn(t.shape, generator=g, dtype=t.dtype))
    before = [t.clone() for t in _tensors(cache)]
    warmup_prefill(kf.km, [5, 12])
    for t, b in zip(_tensors(cache), before):
        assert torch.equal(t[:, 1:], b[:, 1:])
    assert not torch.equal(cache.k[-1, 0], before[2][-1, 0])  # the MTP layer's KV: it ran


def test_mtp_layer_matches_plain_path(spec_path, tiny4_ckpt):
    """The MTP head on the kernel path (model/kernel_mtp.py) against the plain path
    (model/mtp.py): the layer's hidden rows over a prompt and a chained proposal of 3 drafts."""
    from tailored.worker.drafter import DraftRow, MTPDrafter

    m, c, kf, _ = _spec(spec_path, 1)
    cfg = m.config
    assert kf.km.mtp_layer == cfg.num_hidden_layers
    plain = load_cpu_fp32(tiny4_ckpt)
    pc = HybridCache(cfg, 16, 16, 4, torch.float32, "cpu", mtp_layers=1)
    runs = ((lambda b: plain(b, pc), MTPDrafter(plain, pc), pc),
            (kf.forward, MTPDrafter(m, c, km=kf.km), c))
    ids = _ids(20, 9)
    hs, drafts, layer = [], [], []
    for fwd, d, _ in runs:
        h = fwd(ForwardBatch.build([(ids, 0, 1, True, [1, 2])], [], "cpu"))
        seq = SeqInfo(0, 19, 0, 1, False, [1, 2])
        layer.append(d._layer(h[:19], torch.tensor(ids[1:]), [seq]))
        drafts.append(d.propose(h, [DraftRow(SeqInfo(0, 20, 0, 1, False, [1, 2]),
                                             ids[1:] + [5], 3)]))
        hs.append(h)
    assert rel_err(hs[1], hs[0]) < 1e-4
    assert rel_err(layer[1], layer[0]) < 1e-4
    assert drafts[1] == drafts[0] and len(drafts[0][0]) == 3
    assert rel_err(c.k[-1], pc.k[-1]) < 1e-4  # the MTP layer's KV


def test_spec_graph_bodies_match_the_eager_verify_step(spec_path):
    """The verify and MTP graph bodies (worker/spec_graphs.py), run eagerly over their static
    buffers, against the eager kernel path: two verify chunks (one padded: fewer drafts than
    N), a lone decode row, and the batch padded to a larger size; hidden rows, committed GDN
    states at several kept lengths, the MTP KV and the proposed drafts."""
    from tailored.worker.drafter import DraftRow, MTPDrafter

    m, cache, kf, spec = _spec(spec_path, 3)
    p1, p2, p3 = _ids(11, 21), _ids(6, 22), _ids(9, 25)
    kf.forward(ForwardBatch.build([(p1, 0, 1, True, [1]), (p2, 0, 2, True, [2]),
                                   (p3, 0, 3, True, [3])], [], "cpu"))
    base = {n: getattr(cache, n).clone() for n in ("k", "v", "conv", "rec")}
    # the third: a lone decode row of the verify step (a request without drafts, runner.launch)
    layout = [(_ids(4, 23), 11, 1, False, [1], True), (_ids(2, 24), 6, 2, False, [2], True),
              (_ids(1, 26), 9, 3, False, [3], True)]
    kept = {1: 2, 2: 1, 3: 1}  # tokens kept of each chunk (4, 2 and 1 long)
    results = []
    for use_spec in (False, True):
        for n, t in base.items():
            getattr(cache, n).copy_(t)
        b = ForwardBatch.build(layout, [], "cpu")
        assert spec.fits(b)
        h = spec.forward(b) if use_spec else kf.km.forward_eager(b)
        if use_spec:  # batched from the snapshots (the runner's call) against one by one
            cache.commit_many(kept)
        else:
            for slot, k in kept.items():
                cache.commit_states(slot, k)
        assert cache.kept_batch is None and not cache.kept_states
        seqs = {s.slot: s for s in b.seqs}
        rows = [DraftRow(SeqInfo(seqs[sl].q_start, k, seqs[sl].start_pos, sl, False,
                                 seqs[sl].page_ids), _ids(k, 30 + sl), 3)
                for sl, k in kept.items()]
        assert spec._layout is not None if use_spec else spec._layout is None
        # after the verify body, the drafter fills and runs the MTP body; else the eager MTP
        drafts = MTPDrafter(m, cache, km=kf.km, spec=spec).propose(h, rows)
        results.append((h, cache.conv.clone(), cache.rec.clone(), cache.k[-1].clone(), drafts))
        assert spec._layout is None
    (h0, c0, r0, k0, d0), (h1, c1, r1, k1, d1) = results
    assert rel_err(h1, h0) < 1e-4
    # slot 0 is the sink: the pad sequence of the padded batch (3 -> 4) writes it
    assert rel_err(c1[:, 1:], c0[:, 1:]) < 1e-5 and rel_err(r1[:, 1:], r0[:, 1:]) < 1e-5
    # the MTP KV of the kept rows (the rest is rewritten before it is read)
    for slot, k in kept.items():
        page, start = {1: (1, 11), 2: (2, 6), 3: (3, 9)}[slot]
        rows = slice(start, start + k)
        assert rel_err(k1[page, rows], k0[page, rows]) < 1e-4
    assert d1 == d0 and all(len(d) == 3 for d in d0)
    # the lone decode row's state is the one-token decode's (not its pad tokens')
    assert rel_err(r1[:, 3], r0[:, 3]) < 1e-5


def test_verify_chunks_beside_a_prompt_split_like_the_eager_step(spec_path):
    """A step with verify chunks and a fresh prompt (a request arriving while others draft):
    `KernelForward._split` replays the verify graph (its body here, eagerly) for the chunks
    and runs the prompt after it; hidden rows, the committed states and the prompt's state
    equal the whole step through the eager kernel path."""
    from tailored.model.batch import sub_batch

    _, cache, kf, spec = _spec(spec_path, 2)
    kf.forward(ForwardBatch.build([(_ids(7, 41), 0, 1, True, [1]),
                                   (_ids(5, 42), 0, 2, True, [2])], [], "cpu"))
    base = {n: getattr(cache, n).clone() for n in ("k", "v", "conv", "rec")}
    # a verify chunk, a fresh 10-token prompt in slot 3, a lone decode row (1-token verify)
    layout = [(_ids(3, 43), 7, 1, False, [1], True), (_ids(10, 44), 0, 3, True, [3]),
              (_ids(1, 45), 5, 2, False, [2], True)]
    results = []
    for split in (False, True):
        for n, t in base.items():
            getattr(cache, n).copy_(t)
        b = ForwardBatch.build(layout, [], "cpu")
        assert not spec.fits(b)
        if split:
            ver = [0, 2]
            sub = sub_batch(b, ver)
            assert spec.fits(sub)
            h = kf._split(b, ver, sub, spec.forward)
        else:
            h = kf.km.forward_eager(b)
        cache.commit_many({1: 2, 2: 1})
        assert cache.kept_batch is None and not cache.kept_states
        results.append((h, cache.conv[:, 1:].clone(), cache.rec[:, 1:].clone()))
    (h0, c0, r0), (h1, c1, r1) = results
    assert rel_err(h1, h0) < 1e-4
    assert rel_err(c1, c0) < 1e-5 and rel_err(r1, r0) < 1e-5


def test_step_plan_views_are_16_byte_aligned():
    """build_plan's index views all start 16 bytes apart at least: Triton compiles a kernel
    variant per pointer alignment, and odd counts (3 prompts, an odd decode row count) put
    the conv kernels' sequence meta at an 8-byte offset, a compile inside session 15's c=32
    benchmark window. Odd sizes everywhere; the views' values are what the plan says."""
    from tailored.model.step_plan import build_plan

    pre = [SeqInfo(0, 3, 0, 5, True, [1]), SeqInfo(3, 7, 16, 2, False, [3, 4])]
    dec = [SeqInfo(10, 1, 9, 1, False, [6]), SeqInfo(11, 1, 3, 7, False, [8]),
           SeqInfo(12, 1, 2, 4, False, [9])]
    ver = [SeqInfo(13, 3, 5, 6, False, [10], True)]
    plan = build_plan(pre + dec + ver, pre, dec, 16, torch.device("cpu"), ver)
    views = [plan.pre_rows, plan.pre_slots, plan.pre_seq, plan.dec_rows,
             *plan.kv_new, *[v for v in plan.kv_ctx if v is not None], *plan.ver_rows]
    for v in views:
        assert v.data_ptr() % 16 == 0, v
    assert plan.pre_rows.tolist() == list(range(10))
    assert plan.pre_seq.tolist() == [[0, 3], [3, 7], [0, 3], [1, 0]]
    assert plan.dec_rows.tolist() == [10, 11, 12] and plan.dec_slots.tolist() == [1, 7, 4]
    assert plan.kv_ctx[1].tolist() == [3 * 16 + i for i in range(16)] + [4 * 16 + i for i in range(7)]


def test_spec_chain_on_the_device_equals_the_host_acceptance(spec_path, monkeypatch):
    """SpecGraphs.chain (acceptance, state commits and the MTP after a whole verify step, on
    the device; its body eagerly here) against the host path it replaces (drafter.accept,
    HybridCache.commit_many, propose through the MTP body): kept counts, next drafts,
    committed GDN states and the MTP KV of the emitted rows. Greedy: a 3-draft chunk that
    keeps 2, a 1-draft chunk that keeps none, a lone decode row; synthetic kept counts
    (3, 2, 1), capped at each chunk's drafts: the 3-draft chunk keeps all (its state stays in
    place), the 1-draft chunk keeps its draft, the whole of a chunk shorter than n (its state
    from a snapshot). Then a NaN row (the sampler's flag) ends a greedy prefix. The batch is
    not padded (max_batch 3): pad sequences in the chain are test_spec_graph_bodies' and the
    engine test's (3 requests → 4). Every branch starts from one verify step's result (its
    body against the eager step: test_spec_graph_bodies_match_the_eager_verify_step)."""
    from tailored.worker.drafter import DraftRow, MTPDrafter, accept, emitted

    m, cache, kf, spec = _spec(spec_path, 3, max_batch=3)
    kf.forward(ForwardBatch.build([(_ids(11, 51), 0, 1, True, [1]),
                                   (_ids(6, 52), 0, 2, True, [2]),
                                   (_ids(9, 53), 0, 3, True, [3])], [], "cpu"))
    c1, c2, c3 = _ids(4, 54), _ids(2, 55), _ids(1, 56)
    layout = [(c1, 11, 1, False, [1], True), (c2, 6, 2, False, [2], True),
              (c3, 9, 3, False, [3], True)]
    # the target's tokens at every row: chunk 1 matches d1, d2 then not d3; chunk 2 misses d1
    y = [c1[1], c1[2], (c1[3] + 1) % 1000, 7, (c2[1] + 1) % 1000, 8, 9]
    targets = [y[0:4], y[4:6], y[6:7]]
    drafts_in = [c[1:] for c in (c1, c2, c3)]
    # the verify step once (its body eagerly): every branch below starts from what it left
    b = ForwardBatch.build(layout, [], "cpu")
    h = spec.forward(b)
    after = {n: getattr(cache, n).clone() for n in ("k", "v", "conv", "rec")}
    kb = cache.kept_batch
    for synthetic in (None, [3, 2, 1]):
        results = []
        for use_chain in (False, True):
            for n, t in after.items():
                getattr(cache, n).copy_(t)
            cache.kept_batch = (kb[0], kb[1], dict(kb[2]), kb[3])  # commit_many consumes it
            spec.fill_verify(b)  # the step's layout, which chain and propose consume
            if synthetic is None:
                kept = [accept(d, t) for d, t in zip(drafts_in, targets)]
            else:
                kept = [min(k, len(d)) for k, d in zip(synthetic, drafts_in)]
            if use_chain:
                assert spec.whole_step(b, len(y))
                got = spec.chain(torch.tensor(y), synthetic).tolist()
                assert cache.kept_batch is None and spec._layout is None
                assert [g[0] for g in got] == kept
                drafts = [g[1:] for g in got]
            else:
                cache.commit_many({s.slot: k + 1 for s, k in zip(b.seqs, kept)})
                rows = []
                for s, k, d, t in zip(b.seqs, kept, drafts_in, targets):
                    em = emitted(d, t, k, True)
                    rows.append(DraftRow(SeqInfo(s.q_start, k + 1, s.start_pos, s.slot, False,
                                                 s.page_ids), em, 3))
                drafts = MTPDrafter(m, cache, km=kf.km, spec=spec).propose(h, rows)
            results.append((cache.conv[:, 1:].clone(), cache.rec[:, 1:].clone(),
                            cache.k[-1].clone(), drafts))
        (cv0, r0, k0, d0), (cv1, r1, k1, d1) = results
        assert rel_err(cv1, cv0) < 1e-6 and rel_err(r1, r0) < 1e-6, synthetic
        for page, start, k in ((1, 11, kept[0]), (2, 6, kept[1]), (3, 9, kept[2])):
            rows = slice(start, start + k + 1)
            assert rel_err(k1[page, rows], k0[page, rows]) < 1e-5, synthetic
        assert d1 == d0 and all(len(d) == 3 for d in d0), synthetic
        assert kept == ([2, 0, 0] if synthetic is None else [3, 1, 0])
    # a NaN row (the sampler's flag) ends chunk 1's prefix there, though its id matches: the
    # kept counts only (the verify step's static inputs filled, the MTP after them stood in for)
    spec.fill_verify(b)
    monkeypatch.setattr(spec, "mtp_body", lambda B: torch.zeros(B, spec.N, dtype=torch.long))
    bad = torch.zeros(len(y), dtype=torch.bool)
    bad[1] = True
    assert [g[0] for g in spec.chain(torch.tensor(y), None, bad).tolist()] == [1, 0, 0]


@pytest.mark.parametrize("rate", [None, 0.5])
def test_engine_with_drafts_device_chain_equals_the_plain_path_and_the_host_path(tiny4_ckpt,
                                                                                 rate):
    """Speculative decoding through the engine on the kernel path, 2 drafts a step:
      chain: `KernelForward.forward`'s routing with graphs (no graph captured: each body runs
        eagerly), verify steps through the verify body (prompts beside them split off), then
        the device chain after whole verify steps (acceptance, commits, MTP body), whose next
        drafts stay on the device as placeholders that the next step takes from there
        (chain_drafts.py, kb/0035), with the device's kept counts checked against the host's
        at every read (ChainDrafts.read);
      greedy (random weights: most drafts rejected, so most verify chunks commit early): the
        tokens of the plain path without drafts;
      synthetic acceptance 0.5: the tokens of the host path (no SpecGraphs: the runner
        accepts, commits and runs the eager MTP, `SpecDecoding.speculate`; async scheduling,
        the default) with the same draws, which are drawn before the step on the one and after
        it on the other. (The host path's parts on the kernel path against the plain path:
        test_verify_chunk_matches_plain_path, test_mtp_layer_matches_plain_path; greedy,
        whole: the prefix-cache test's cold run and tests/worker/test_spec_decode.py.)
    One request is short, so later steps mix a lone chunk."""
    from tailored.worker.chain_drafts import ChainDrafts
    from tailored.worker.spec_graphs import SpecGraphs

    reads = []
    orig = ChainDrafts.read

    def counting_read(self):
        reads.append(len(self.kept))
        return orig(self)

    prompts = {f"r{i}": _ids(T, 70 + i) for i, T in enumerate((5, 11, 8))}
    n = {"r0": 5, "r1": 2, "r2": 4} if rate is None else {"r0": 4, "r1": 2, "r2": 3}
    ref = "plain" if rate is None else "host"
    outs = {}
    for mode in (ref, "chain"):
        eng = _stack(tiny4_ckpt, "off" if mode == "plain" else "on",
                     async_scheduling=mode != "chain", spec_max_running=4,
                     num_speculative_tokens=0 if mode == "plain" else 2,
                     spec_synthetic_acceptance=rate).engine
        if mode == "chain":
            kf = eng.runner.kernel
            kf.spec = SpecGraphs(kf.km, kf.pool, 2, 4, kf.max_pages)
            eng.runner.spec.drafter.spec = kf.spec
            kf.use_graphs = True
            kf.decode.forward = kf.km.forward_eager  # no decode graph: what a replay computes
        ChainDrafts.read = counting_read
        try:
            outs[mode] = _generate(eng, prompts, n)
        finally:
            ChainDrafts.read = orig
        if mode != "plain":
            verified, kept = eng.runner.spec_stats[1:]
            assert verified > 0 and (kept > 0 or rate is None)
        if mode == "host":
            assert not reads
    assert outs["chain"] == outs[ref]
    assert [len(outs["chain"][r]) for r in n] == list(n.values())
    assert reads  # later steps took their drafts from a chain, and checked its kept counts
