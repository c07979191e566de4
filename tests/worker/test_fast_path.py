"""The kernel path (model/fast.py) equals the plain path, step by step, state by state.

Runs on the CPU through Triton's interpreter in fp32 on the tiny preset: mixed prefill+decode
steps, chunked prefill, decode-only steps through the graph body with pad rows (the code a CUDA
graph captures), and whole greedy generations through the engine with kernels on vs off.
"""

from __future__ import annotations

import pytest
import torch

from conftest import new_cache, rel_err
from tailored import kernels
from tailored.model.batch import ForwardBatch
from tailored.model.loader import load_checkpoint
from tailored.synth import build_empty_model

pytestmark = pytest.mark.skipif(not kernels.available(), reason="triton not installed")


def _ids(T, seed):
    return torch.randint(0, 248044, (T,), generator=torch.Generator().manual_seed(seed)).tolist()


def _make_pair(ckpt, state_dtype=torch.float32):
    from tailored.config import ModelConfig
    from tailored.model.fast import FastPath

    cfg = ModelConfig.from_dir(ckpt)
    plain = build_empty_model(cfg, "cpu", torch.float32)
    load_checkpoint(plain, ckpt, progress=False)
    fastm = build_empty_model(cfg, "cpu", torch.float32)
    load_checkpoint(fastm, ckpt, progress=False)
    cache = new_cache(cfg, state_dtype=state_dtype)
    fastm.fast = FastPath(fastm, cache, max_batch=4, max_pages=12, use_graphs=False)
    return plain, fastm, cache


@pytest.fixture(scope="module", params=["bf16", "fp8"])
def pair(request, tiny_ckpt, tiny_fp8_ckpt):
    """(plain model, kernel-path model with its cache) loaded from the same checkpoint: the
    tiny preset in bf16 layout, and in block-FP8 with TAILORED_FP8_DENSE_DEQUANT=0 (the kernel
    path reads the FP8 weights through fp8_linear and the FP8 MoE; the plain path dequantizes).
    The default FP8 layout, dense projections held dequantized, has its own test below."""
    if request.param == "bf16":
        return _make_pair(tiny_ckpt)
    from tailored.model import fast as fastmod

    held, fastmod.FP8_DENSE_DEQUANT = fastmod.FP8_DENSE_DEQUANT, False
    try:  # read once, when FastPath lays the projections out
        return _make_pair(tiny_fp8_ckpt)
    finally:
        fastmod.FP8_DENSE_DEQUANT = held


def test_fused_weights_are_views_with_the_same_values(pair):
    plain, fastm, _ = pair
    for (n1, p1), (n2, p2) in zip(plain.named_parameters(), fastm.named_parameters()):
        assert n1 == n2 and p1.dtype == p2.dtype and torch.equal(p1.float(), p2.float()), n1
    m = fastm.model.layers[0].linear_attn
    assert m.in_proj_z.weight.data_ptr() != m.in_proj_qkv.weight.data_ptr()
    proj, idx = fastm.fast.p_in[0].parts[0]
    assert idx[:2] == [0, 1]  # qkv|z are one GEMM in both precisions
    assert m.in_proj_qkv.weight.untyped_storage().data_ptr() == \
        proj.weight.untyped_storage().data_ptr()
    # the shared expert as expert E (kb/0019): the routed experts are views of the stack
    mlp = fastm.model.layers[0].mlp
    st, E = fastm.fast.stacks[0], mlp.experts.gate_up_proj.shape[0]
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
        assert len(fastm.fast.p_in[0].parts) == 2


@pytest.mark.parametrize("variant", ["defaults", "switches", "route_in_gate_up"])
def test_steps_match_plain_path(pair, variant, monkeypatch):
    """defaults: the module defaults, as served (two-launch routing up to 64 rows, kb/0021;
    the GDN step over 2 programs a head, kb/0022; the combine doing the next add + norm,
    kb/0023). switches: every kernel switch on at once (one variant, since each costs minutes
    in the interpreter): also the shared expert as routed expert E (kb/0019; threshold raised
    so that the 80-row mixed steps take it too), and the
    GDN step over 4 programs a head. (The FP8 experts' float16 gate_up dots, on by default,
    apply to bf16 activations only: these fp32 steps keep fp32 dots; test_kernels.py covers
    them.) Routing inside the gate_up programs (kb/0036) up to 4 rows: with the shared
    expert in switches, without it in route_in_gate_up.
    The previous defaults (the fused GDN step, separate norms) stay reachable through the
    environment; their kernels keep their own tests (test_kernels.py)."""
    from tailored.kernels import gdn_decode, moe
    from tailored.model import fast as fastmod

    if variant == "switches":
        monkeypatch.setattr(fastmod, "SHARED_IN_MOE", True)
        monkeypatch.setattr(fastmod, "SHARED_IN_MOE_UP_TO", 4096)
        monkeypatch.setattr(fastmod, "COMBINE_NEXT_NORM", True)
        monkeypatch.setattr(gdn_decode, "DV_SPLIT", 4)
        monkeypatch.setattr(moe, "ROUTE_ALIGN_USE_UP_TO", 64)
    if variant != "defaults":
        monkeypatch.setattr(fastmod, "ROUTE_IN_GATE_UP_UP_TO", 4)
    if variant == "switches":
        monkeypatch.setattr(fastmod, "ATTN_GATE_IN_MERGE", True)
        monkeypatch.setattr(fastmod, "MOE_GEMV_UP_TO", 4)  # kb/0039: the GEMVs at 3-4 rows too
        monkeypatch.setattr(fastmod, "BF16_GEMV_UP_TO", 4)  # dense projections too (kb/0039)
    plain, fastm, fcache = pair
    _run_steps(plain, fastm, fcache)


def test_bf16_gdn_states_match_plain_path(tiny_ckpt):
    """EngineConfig.gdn_state_dtype = bfloat16 (kb/0056): the recurrent states stored in bf16 by
    the decode kernels, the chunked prefill and the plain path alike (fp32 math, rounded on
    store), so the two paths agree step by step as with fp32 states, at bf16's scale."""
    plain, fastm, fcache = _make_pair(tiny_ckpt, state_dtype=torch.bfloat16)
    assert fcache.rec.dtype == torch.bfloat16
    _run_steps(plain, fastm, fcache)
    assert fcache.rec.abs().sum() > 0


@pytest.mark.parametrize("gemv_up_to,splitk_up_to", [(0, 0), (4, 0), (0, 64), (4, 64)])
def test_fp8_dense_dequant_matches_plain_path(gemv_up_to, splitk_up_to, tiny_fp8_ckpt,
                                              monkeypatch):
    """TAILORED_FP8_DENSE_DEQUANT (kb/0026): the dense projections held dequantized, one GEMM
    per input (qkv|z|b|a, router|gates|shared up), the modules' FP8 weights untouched; the
    routed experts stay FP8. Same steps as the plain path. gemv_up_to (FP8_GEMV_UP_TO,
    kb/0039 §4): steps of up to 4 rows read the FP8 weights through the GEMV instead, the
    bf16 members' rows (b/a, router) viewing the dequantized weight. splitk_up_to
    (FP8_DENSE_SPLITK_UP_TO, kb/0045 §4): the steps above the GEMV's rows (prefills up to 64
    rows included here) through the split-K GEMM with the bf16 rows in its launch."""
    from tailored.model import fast as fastmod

    monkeypatch.setattr(fastmod, "FP8_DENSE_DEQUANT", True)
    monkeypatch.setattr(fastmod, "FP8_GEMV_UP_TO", gemv_up_to)
    monkeypatch.setattr(fastmod, "FP8_DENSE_SPLITK_UP_TO", splitk_up_to)
    plain, fastm, fcache = _make_pair(tiny_fp8_ckpt)
    fast = fastm.fast
    for g in (fast.p_in, fast.p_moe):
        for pg in g.values():
            assert len(pg.parts) == 1 and not pg.parts[0][0].fp8
    assert not any(p.fp8 for g in (fast.p_out, fast.p_down) for p in g.values())
    assert fastm.model.layers[0].linear_attn.in_proj_qkv.weight.dtype == torch.float8_e4m3fn
    # the bytes runner.plan_cache keeps out of the KV budget are the bytes FastPath allocated:
    # every projection tensor that is not a view of a module's parameter
    params = {q.untyped_storage().data_ptr() for q in fastm.parameters()}
    projs = [p for g in (fast.p_in, fast.p_moe) for pg in g.values() for p, _ in pg.parts]
    projs += list(fast.p_out.values()) + list(fast.p_down.values())
    new = [p.weight for p in projs if p.weight.untyped_storage().data_ptr() not in params]
    assert len(new) == len(projs)
    got = sum(w.numel() * w.element_size() for w in new)
    got += sum(p.gemv[1].numel() * 4 for p in projs)  # the FP8 GEMV's fp32 row scales
    assert fastmod.dense_dequant_bytes(fastm, torch.float32) == got > 0
    w8, s8, wb, bf16_first = fast.p_in[0].parts[0][0].gemv  # GDN in: qkv|z FP8, then b|a
    assert w8.dtype == torch.float8_e4m3fn and not bf16_first
    assert wb.untyped_storage().data_ptr() == fast.p_in[0].parts[0][0].weight.untyped_storage().data_ptr()
    assert fast.p_moe[0].parts[0][0].gemv[3]  # router|gate first
    calls, tiles, splitk = [], [], []
    real, real_tiles, real_sk = fastmod.fp8_gemv, fastmod.fp8_linear, fastmod.fp8_dense_splitk
    monkeypatch.setattr(fastmod, "fp8_gemv", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(fastmod, "fp8_linear",
                        lambda *a, **kw: tiles.append(a[0].shape[0]) or real_tiles(*a, **kw))
    monkeypatch.setattr(fastmod, "fp8_dense_splitk",
                        lambda *a, **kw: splitk.append(a[0].shape[0]) or real_sk(*a, **kw))
    _run_steps(plain, fastm, fcache)
    assert bool(calls) == bool(gemv_up_to)
    assert not tiles  # never fp8_linear: cuBLAS over the dequantized copy, or split-K
    assert bool(splitk) == bool(splitk_up_to) and all(gemv_up_to < t <= 64 for t in splitk)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_proj_row_align_pads_fused_gemms_and_matches_plain_path(precision, tiny_ckpt,
                                                                tiny_fp8_ckpt, monkeypatch):
    """TAILORED_PROJ_ROW_ALIGN (kb/0029, default 64 since kb/0030): fused cuBLAS projections
    get zero rows up to a multiple of 64 (FP8: the dense-dequant layout), the module weights
    stay views of the padded tensor, single linears and W8A16 parts are left alone, the memory
    reserve counts the pad; same steps as the plain path."""
    from tailored.model import fast as fastmod

    monkeypatch.setattr(fastmod, "PROJ_ROW_ALIGN", 64)
    plain, fastm, fcache = _make_pair(tiny_ckpt if precision == "bf16" else tiny_fp8_ckpt)
    fast = fastm.fast
    padded = 0
    for g in (fast.p_in, fast.p_moe):
        for pg in g.values():
            for proj, idx in pg.parts:
                rows = sum(proj.sizes)
                if len(idx) > 1 and not proj.fp8:
                    assert proj.weight.shape[0] % 64 == 0 and proj.weight.shape[0] - rows == proj.pad
                    assert not proj.weight[rows:].any()
                    padded += proj.pad > 0
                else:
                    assert proj.pad == 0 and proj.weight.shape[0] == rows
    assert padded > 0
    mlp = fastm.model.layers[0].mlp
    proj = fast.p_moe[0].parts[0][0]
    if precision == "bf16":  # the module weights are views of the padded GEMM weight
        assert mlp.gate.weight.untyped_storage().data_ptr() == \
            proj.weight.untyped_storage().data_ptr()
    else:
        params = {q.untyped_storage().data_ptr() for q in fastm.parameters()}
        projs = [p for g in (fast.p_in, fast.p_moe) for pg in g.values() for p, _ in pg.parts]
        projs += list(fast.p_out.values()) + list(fast.p_down.values())
        got = sum(p.weight.numel() * p.weight.element_size() for p in projs
                  if p.weight.untyped_storage().data_ptr() not in params)
        got += sum(p.gemv[1].numel() * 4 for p in projs)  # the FP8 GEMV's row scales
        assert fastmod.dense_dequant_bytes(fastm, torch.float32) == got
    assert all(p.pad == 0 for p in fast.p_route.values())
    _run_steps(plain, fastm, fcache)


def _run_steps(plain, fastm, fcache):
    """Prefill, mixed and decode steps (eager and graph body) on both models: same hidden
    rows, GDN states and KV pages. bf16 recurrent states (fcache's dtype, the plain path's
    too): both round what they store, and a value next to a rounding boundary may round to
    neighbouring bf16 values, so the states are compared at a bf16 ulp's scale."""
    cfg = plain.config
    fcache.rec.zero_(), fcache.conv.zero_(), fcache.k.zero_(), fcache.v.zero_()
    pcache = new_cache(cfg, state_dtype=fcache.rec.dtype)
    tol = 1e-4 if fcache.rec.dtype == torch.float32 else 2e-3
    a, b, c = _ids(40, 1), _ids(70, 2), _ids(1, 3)
    pa, pb, pc = [1, 2, 3], [4, 5, 6, 7, 8], [9]
    steps = [
        # two prefills (one chunked) in one step
        [(a[:30], 0, 1, True, pa), (b[:50], 0, 2, True, pb)],
        # mixed: a chunk continuation, a finishing prefill, and a 1-token prompt (resets slot 3)
        [(a[30:], 30, 1, False, pa), (b[50:], 50, 2, False, pb), (c, 0, 3, True, pc)],
    ]
    for layout in steps:
        rows = [sum(len(t[0]) for t in layout[:i + 1]) - 1 for i in range(len(layout))]
        bp = ForwardBatch.build(layout, rows, "cpu")
        bf = ForwardBatch.build(layout, rows, "cpu")
        hp, hf = plain(bp, pcache), fastm(bf, fcache)
        assert rel_err(hf, hp) < tol
        assert rel_err(fcache.rec, pcache.rec) < tol and rel_err(fcache.conv, pcache.conv) < 1e-5
    # decode-only steps: eager kernels, then the graph body with pad rows (n = 4 > 3 rows)
    toks = {1: 11, 2: 22, 3: 33}
    pos = {1: 40, 2: 70, 3: 1}
    pages = {1: pa, 2: pb, 3: pc + [10]}
    fast = fastm.fast
    for step in range(3):
        layout = [([toks[s]], pos[s], s, False, pages[s]) for s in (1, 2, 3)]
        bp = ForwardBatch.build(layout, [0, 1, 2], "cpu")
        hp = plain(bp, pcache)
        if step == 0:
            hf = fastm(ForwardBatch.build(layout, [0, 1, 2], "cpu"), fcache)
        else:
            if fast._static is None:
                fast._alloc_static()
            fast._fill_static(ForwardBatch.build(layout, [0, 1, 2], "cpu"), 4)
            hf = fast._decode_body(4)[:3]
        assert rel_err(hf, hp) < tol, step
        assert rel_err(fcache.rec[:, 1:4], pcache.rec[:, 1:4]) < tol
        assert rel_err(fcache.k[:, 1:11], pcache.k[:, 1:11]) < 1e-5
        for s in pos:
            pos[s] += 1
            toks[s] += 7


@pytest.mark.parametrize("precision,drafts", [("bf16", 0), ("fp8", 0), ("bf16", 2)])
def test_engine_greedy_same_with_kernels_on_and_off(precision, drafts, tiny_ckpt, tiny_fp8_ckpt):
    """drafts: speculative decoding on the kernel path (model/mtp.py) against the plain path
    without it; random weights reject most drafts, so most verify chunks commit early."""
    from tailored.engine.types import SamplingParams
    from tailored.stack import build_stack

    outs = {}
    for mode in ("off", "on"):
        st = build_stack(tiny_ckpt if precision == "bf16" else tiny_fp8_ckpt, device="cpu", dtype="float32", progress=False, kernels=mode,
                         max_model_len=256, max_num_seqs=4, num_pages=80,
                         num_speculative_tokens=drafts if mode == "on" else 0)
        eng = st.engine
        sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        for i, T in enumerate((5, 40, 17)):
            eng.add_request(f"r{i}", _ids(T, 50 + i), sp)
        got = {f"r{i}": [] for i in range(3)}
        while eng.has_unfinished():
            for o in eng.step():
                got[o.request_id].extend(o.delta_token_ids)
        outs[mode] = got
        if drafts and mode == "on":
            assert eng.runner.spec_stats[1] > 0  # drafts were verified
    assert outs["on"] == outs["off"]


def test_kernel_path_steps_leave_other_slots_and_pages_bit_identical(tiny_ckpt):
    """The slot/page isolation check of the invariance suite on the kernel path (eager: the
    interpreter has no graphs; tests/test_gpu_invariance.py runs it with graphs)."""
    import invariance_checks as C

    from tailored.stack import build_stack

    def make(budget, max_num_seqs, max_model_len, num_pages):
        return build_stack(tiny_ckpt, device="cpu", dtype="float32", progress=False, kernels="on",
                           max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                           max_model_len=max_model_len, num_pages=num_pages).engine

    C.steps_leave_other_slots_and_pages_bit_identical(make, quick=True)


@pytest.mark.parametrize("T,n", [(3, 16), (65, 128), (2, 16)])
def test_prefill_graph_body_equals_eager_prefill(pair, T, n):
    """The body a prefill CUDA graph captures (kb/0013), run eagerly on n ≥ T padded rows,
    computes what the eager prefill of the T-token prompt computes: hidden rows, the slot's
    conv and recurrent states, the prompt's KV rows; pads touch only the sinks (slot 0, page 0).
    The conv is kernels/gdn_conv.py's in both (kb/0029); T=2 is shorter than the conv window."""
    _, fastm, cache = pair
    if fastm.config.fp8 is not None:
        pytest.skip("bf16 layout only: the body's FP8 projections are the eager path's (covered "
                    "above), and the interpreter is slow (CI time)")
    fast = fastm.fast
    ps, slot = cache.page_size, 3
    pages = [5 + j for j in range(T // ps + 1)]
    layout = [(_ids(T, 100 + T), 0, slot, True, pages)]
    g = torch.Generator().manual_seed(T)
    for t in (cache.conv, cache.rec, cache.k, cache.v):  # stale state the prompt must ignore
        t.copy_(torch.randn(t.shape, generator=g, dtype=t.dtype))
    before = [t.clone() for t in (cache.conv, cache.rec, cache.k, cache.v)]
    want = fast.forward_eager(ForwardBatch.build(layout, [T - 1], "cpu"))
    after_eager = [t.clone() for t in (cache.conv, cache.rec, cache.k, cache.v)]
    for t, b in zip((cache.conv, cache.rec, cache.k, cache.v), before):
        t.copy_(b)
    fast._alloc_prefill_static(128)
    fast._fill_prefill_static(ForwardBatch.build(layout, [T - 1], "cpu"), n)
    got = fast._prefill_body(n)
    assert got.shape[0] == n
    assert rel_err(got[:T], want) < 1e-5
    conv, rec, k, v = cache.conv, cache.rec, cache.k, cache.v
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


def graph_stand_ins(fast, monkeypatch,
                    names=("forward_decode_graph", "forward_prefill_graph")) -> list:
    """Turn `fast`'s graphs on and stand its graph entry points `names` (and `fast.ctx.forward`
    when it has context graphs) in with the eager forward, which is what a replay computes (the
    CPU has no CUDA graphs), with prefill graphs at {128}. Returns the list each call appends
    (kind, [(tokens, start_pos, slot) of each sequence]) to: kind is the name's middle word
    (decode, prefill, eager) or "ctx"."""
    real_eager = fast.forward_eager
    calls = []

    def as_graph(kind):
        def run(batch):
            calls.append((kind, [(s.num_tokens, s.start_pos, s.slot) for s in batch.seqs]))
            return real_eager(batch)
        return run

    monkeypatch.setattr(fast, "use_graphs", True)
    monkeypatch.setattr(fast, "prefill_graphs", {128: None})
    for name in names:
        monkeypatch.setattr(fast, name, as_graph(name.split("_")[1]))
    if fast.ctx is not None:
        monkeypatch.setattr(fast.ctx, "forward", as_graph("ctx"))
    return calls


def test_mixed_step_sends_a_lone_fresh_prompt_to_the_prefill_graph(pair, monkeypatch):
    """kb/0028: a step of decode rows and one fresh prompt replays the decode graph for the
    rows and the prefill graph for the prompt (the CPU has no CUDA graphs: the two graph entry
    points are stood in for by the eager forward, which is what a replay computes, and the
    test pins the split: which rows go where, and that the outputs land in batch order). Two
    short prompts replay a graph each since kb/0056, or stay eager with that off."""
    plain, fastm, fcache = pair
    fast = fastm.fast
    calls = graph_stand_ins(fast, monkeypatch)
    cfg = plain.config
    for c in (fcache.rec, fcache.conv, fcache.k, fcache.v):
        c.zero_()
    pcache = new_cache(cfg)
    a, b, p = _ids(20, 11), _ids(9, 12), _ids(33, 13)
    warm = [(a, 0, 1, True, [1, 2]), (b, 0, 2, True, [3])]
    plain(ForwardBatch.build(warm, [19, 28], "cpu"), pcache)
    fast.forward_eager(ForwardBatch.build(warm, [19, 28], "cpu"))
    calls.clear()
    # decode rows first (the scheduler's order), then the fresh prompt into slot 3
    layout = [([5], 20, 1, False, [1, 2]), ([6], 9, 2, False, [3]),
              (p, 0, 3, True, [4, 5, 6])]
    rows = [0, 1, 2 + 32]
    hp = plain(ForwardBatch.build(layout, rows, "cpu"), pcache)
    hf = fastm(ForwardBatch.build(layout, rows, "cpu"), fcache)
    assert calls == [("decode", [(1, 20, 1), (1, 9, 2)]), ("prefill", [(33, 0, 3)])], calls
    assert rel_err(hf, hp) < 1e-4
    assert rel_err(fcache.rec[:, 1:4], pcache.rec[:, 1:4]) < 1e-4
    # two fresh prompts beside a decode row: each replays its own prefill graph (at most 2
    # chunks and 1024 tokens, PROMPTS_IN_GRAPHS_*, kb/0056); with that off they run eagerly,
    # together (the eager stand-in records nothing)
    from tailored.model import fast as fastmod

    layout = [([7], 21, 1, False, [1, 2]), (p[:10], 0, 2, True, [3]), (p[10:], 0, 3, True, [4, 5])]
    for bound, want in ((1024, [("prefill", [(10, 0, 2)]), ("prefill", [(23, 0, 3)])]), (0, [])):
        monkeypatch.setattr(fastmod, "PROMPTS_IN_GRAPHS_UP_TO", bound)
        calls.clear()
        fastm(ForwardBatch.build(layout, [0, 10, 33], "cpu"), fcache)
        assert calls == [("decode", [(1, 21, 1)])] + want, calls


def test_warmup_prefill_touches_only_the_sinks(pair):
    """The startup warm-up (single prompts, then three sequences of an odd total: kb/0030)
    writes only slot 0 and page 0 of the cache: every other slot and page is bit-identical."""
    _, fastm, cache = pair
    g = torch.Generator().manual_seed(7)
    for t in (cache.conv, cache.rec, cache.k, cache.v):
        t.copy_(torch.randn(t.shape, generator=g, dtype=t.dtype))
    before = [t.clone() for t in (cache.conv, cache.rec, cache.k, cache.v)]
    fastm.fast.warmup_prefill([5], batch_tokens=40)  # then lengths 20, 10, 9
    (conv, rec, k, v), (c0, r0, k0, v0) = (cache.conv, cache.rec, cache.k, cache.v), before
    assert torch.equal(conv[:, 1:], c0[:, 1:]) and torch.equal(rec[:, 1:], r0[:, 1:])
    assert torch.equal(k[:, 1:], k0[:, 1:]) and torch.equal(v[:, 1:], v0[:, 1:])
    assert not torch.equal(conv[:, 0], c0[:, 0])  # it ran
    for t, b in zip((cache.conv, cache.rec, cache.k, cache.v), before):  # module-scoped pair
        t.copy_(b)


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_warmup_lengths_reach_every_moe_launch_class(fp8, grouped, monkeypatch):
    """Every prefill of 33..8192 tokens picks a MoE launch class (fused_moe's M tile and, for
    few-row steps, pair bucket; or, eager from MOE_GROUPED_FROM, the grouped path) that the
    warm-up already ran: it runs every length through fused_moe (prefill graphs of any size
    launch it) and the grouped path where it applies, so nothing is tuned or compiled for a
    new class inside a served step or a graph capture (kb/0030, kb/0031). Up to 32 rows the
    decode graphs' warm-up covers them."""
    from types import SimpleNamespace

    import triton

    from tailored.kernels import moe
    from tailored.model import fast as fastm

    monkeypatch.setattr(fastm, "MOE_GROUPED", grouped)
    E, k, bt = 256, 8, 8192
    fake = SimpleNamespace(cfg=SimpleNamespace(num_experts=E, num_experts_per_tok=k),
                           dtype=torch.bfloat16, device=torch.device("cuda"))
    lengths = fastm.FastPath.warmup_lengths(fake, bt)
    assert max(lengths) == bt and all(1 < n <= bt for n in lengths)

    def fused_class(T):
        bm = moe._blocks(T * k, E, fp8)[0]
        return bm, triton.next_power_of_2(T * k) if bm == 16 else 0

    def classes(T):  # what a prefill of T tokens may launch: graph (fused) or eager
        return {fused_class(T)} | ({"grouped"} if grouped and T >= fastm.MOE_GROUPED_FROM
                                   else set())

    warmed = set().union(*(classes(n) for n in lengths))
    missing = sorted(set().union(*(classes(T) for T in range(33, bt + 1))) - warmed, key=str)
    assert not missing, missing


def test_grouped_experts_only_in_eager_steps_past_the_threshold(monkeypatch):
    """MOE_GROUPED applies to bf16 CUDA inputs of ≥ MOE_GROUPED_FROM rows, never in a prefill
    graph body, a warm-up run (`_moe_fused_only`) or a capture; the warm-up runs each length
    through fused_moe and, where an eager step would take them, the grouped experts too
    (kb/0031)."""
    from types import SimpleNamespace

    from tailored.model import fast as fastm

    monkeypatch.setattr(fastm, "MOE_GROUPED", True)
    monkeypatch.setattr(fastm, "MOE_GROUPED_FROM", 6144)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # CPU torch
    use = fastm.FastPath._use_grouped

    def x(T, dtype=torch.bfloat16, cuda=True):
        return SimpleNamespace(shape=(T, 2048), dtype=dtype,
                               device=torch.device("cuda" if cuda else "cpu"))

    me = SimpleNamespace(_moe_fused_only=False)
    assert use(me, x(6144)) and not use(me, x(6143))
    assert not use(me, x(8192, torch.float32)) and not use(me, x(8192, cuda=False))
    assert not use(SimpleNamespace(_moe_fused_only=True), x(8192))
    monkeypatch.setattr(fastm, "MOE_GROUPED", False)
    assert not use(me, x(8192))
    monkeypatch.setattr(fastm, "MOE_GROUPED", True)

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not use(me, x(8192))  # inside a capture
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

    # the warm-up: a CUDA bf16 model runs 7000 tokens twice, an fp32 one once (no grouped path)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    for dtype, want in ((torch.bfloat16, [([100], True), ([7000], True), ([7000], False)]),
                        (torch.float32, [([100], True), ([7000], True)])):
        runs = []
        fake = SimpleNamespace(_moe_fused_only=False, device=torch.device("cuda"), dtype=dtype,
                               _sink_prefill=lambda lengths: lengths, mtp_layer=None)
        fake.forward_eager = lambda lengths, f=fake: runs.append((lengths, f._moe_fused_only))
        fastm.FastPath.warmup_prefill(fake, [100, 7000], batch_tokens=0)
        assert runs == want and fake._moe_fused_only is False


def test_prefill_graph_capture_launches_fused_moe_only(monkeypatch):
    """capture_prefill sets `_moe_fused_only` for the bodies' warm-up runs and capture (the
    session-13 bf16 gate tuned a new tile inside the capture when they took the grouped path,
    kb/0031), and resets it when the capture fails."""
    from types import SimpleNamespace

    from tailored.model import fast as fastm

    seen = []

    def capture_into(graphs, sizes, body):
        seen.append(fake._moe_fused_only)
        raise RuntimeError("capture failed")

    st = {k: torch.zeros(2, dtype=torch.long) for k in ("valid", "kv", "slot")}
    st["state_meta"] = torch.zeros(4, 1, dtype=torch.long)
    fake = SimpleNamespace(use_graphs=True, _pstatic=st, prefill_graphs={}, _moe_fused_only=False,
                           _capture_into=capture_into, _prefill_body=None)
    fake._capture_guarded = lambda *a: fastm.FastPath._capture_guarded(fake, *a)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    fastm.FastPath.capture_prefill(fake, 256, buckets=[128, 256])
    assert seen == [True] and fake._moe_fused_only is False and fake.prefill_graphs == {}


def test_verify_chunk_matches_plain_path(pair):
    """A speculative verify chunk (`SeqInfo.keep_states`, model/mtp.py) beside a decode row:
    the kernel path's hidden rows and, after `commit_states` at each kept length, its GDN
    states equal the plain path's (which equal decode steps, test_spec_decode.py)."""
    plain, fastm, fcache = pair
    if plain.config.fp8 is not None:
        pytest.skip("the bf16 layout covers the verify chunk's code; FP8 adds nothing to it")
    cfg = plain.config
    pcache = new_cache(cfg)
    prompt = _ids(9, 3)
    other = _ids(5, 4)
    for m, c in ((plain, pcache), (fastm, fcache)):
        c.conv.zero_()
        c.rec.zero_()
        m(ForwardBatch.build([(prompt, 0, 1, True, [1]), (other, 0, 2, True, [2])], [], "cpu"), c)
    snap = {n: getattr(fcache, n).clone() for n in ("conv", "rec")}
    psnap = {n: getattr(pcache, n).clone() for n in ("conv", "rec")}
    chunk = _ids(3, 5)
    for k in (1, 3):
        outs = []
        for m, c, sn in ((plain, pcache, psnap), (fastm, fcache, snap)):
            for n, t in sn.items():
                getattr(c, n).copy_(t)
            b = ForwardBatch.build([([7], 5, 2, False, [2]), (chunk, 9, 1, False, [1], True)],
                                   [], "cpu")
            outs.append(m(b, c))
            c.commit_states(1, k)
            assert not c.kept_states
        assert rel_err(outs[1], outs[0]) < 1e-4
        assert rel_err(fcache.rec[:, 1], pcache.rec[:, 1]) < 1e-4
        assert rel_err(fcache.conv[:, 1], pcache.conv[:, 1]) < 1e-4
        assert rel_err(fcache.rec[:, 2], pcache.rec[:, 2]) < 1e-4


def test_mtp_layer_matches_plain_path(tiny_ckpt):
    """The MTP head on the kernel path (model/fast_mtp.py) against the plain path: the layer's
    hidden rows over a prompt and a chained proposal of 3 drafts."""
    from tailored.config import ModelConfig
    from tailored.model.batch import SeqInfo
    from tailored.worker.cache import HybridCache
    from tailored.model.fast import FastPath
    from tailored.worker.drafter import DraftRow, MTPDrafter

    cfg = ModelConfig.from_dir(tiny_ckpt)
    models, caches = [], []
    for fast in (False, True):
        m = build_empty_model(cfg, "cpu", torch.float32)
        load_checkpoint(m, tiny_ckpt, progress=False)
        c = HybridCache(cfg, 16, 16, 4, torch.float32, "cpu", mtp_layers=1)
        if fast:
            m.fast = FastPath(m, c, max_batch=4, max_pages=12, use_graphs=False)
            assert m.fast.mtp_layer == cfg.num_hidden_layers
        models.append(m)
        caches.append(c)
    ids = _ids(20, 9)
    hs, drafts, layer = [], [], []
    for m, c in zip(models, caches):
        h = m(ForwardBatch.build([(ids, 0, 1, True, [1, 2])], [], "cpu"), c)
        d = MTPDrafter(m, c)
        seq = SeqInfo(0, 19, 0, 1, False, [1, 2])
        layer.append(d._layer(h[:19], torch.tensor(ids[1:]), [seq]))
        drafts.append(d.propose(h, [DraftRow(SeqInfo(0, 20, 0, 1, False, [1, 2]),
                                             ids[1:] + [5], 3)]))
        hs.append(h)
    assert rel_err(hs[1], hs[0]) < 1e-4
    assert rel_err(layer[1], layer[0]) < 1e-4
    assert drafts[1] == drafts[0] and len(drafts[0][0]) == 3
    assert rel_err(caches[1].k[-1], caches[0].k[-1]) < 1e-4  # the MTP layer's KV


def test_spec_graph_bodies_match_the_eager_verify_step(tiny_ckpt):
    """The verify and MTP graph bodies (model/fast_spec.py), run eagerly over their static
    buffers, against the eager kernel path: two verify chunks (one padded: fewer drafts than
    N), a lone decode row, and the batch padded to a larger size; hidden rows, committed GDN
    states at several kept lengths, the MTP KV and the proposed drafts."""
    from tailored.model.batch import SeqInfo
    from tailored.worker.drafter import DraftRow, MTPDrafter

    m, cache, fp, spec = _spec_model(tiny_ckpt, 3)  # forward() routes to it with graphs only
    p1, p2, p3 = _ids(11, 21), _ids(6, 22), _ids(9, 25)
    m(ForwardBatch.build([(p1, 0, 1, True, [1]), (p2, 0, 2, True, [2]), (p3, 0, 3, True, [3])],
                         [], "cpu"), cache)
    base = {n: getattr(cache, n).clone() for n in ("k", "v", "conv", "rec")}
    # the third: a lone decode row of the verify step (a request without drafts, runner.launch)
    layout = [(_ids(4, 23), 11, 1, False, [1], True), (_ids(2, 24), 6, 2, False, [2], True),
              (_ids(1, 26), 9, 3, False, [3], True)]
    kept = {1: 2, 2: 1, 3: 1}  # tokens kept of each chunk (4, 2 and 1 long)
    rows_of = {1: 4, 2: 2, 3: 1}
    results = []
    for use_spec in (False, True):
        for n, t in base.items():
            getattr(cache, n).copy_(t)
        b = ForwardBatch.build(layout, [], "cpu")
        assert spec.fits(b)
        h = spec.forward(b) if use_spec else fp.forward_eager(b)
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
        assert spec._layout is not None if use_spec else True
        drafts = MTPDrafter(m, cache).propose(h, rows)
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
    assert rows_of  # (documentation of the chunk lengths above)


def test_verify_chunks_beside_a_prompt_split_like_the_eager_step(tiny_ckpt):
    """A step with verify chunks and a fresh prompt (a request arriving while others draft):
    FastPath._split replays the verify graph (its body here, eagerly) for the chunks and runs
    the prompt after it; hidden rows, the committed states and the prompt's state equal the
    whole step through the eager kernel path."""
    from tailored.model.batch import sub_batch as _sub_batch

    m, cache, fp, spec = _spec_model(tiny_ckpt, 2)
    m(ForwardBatch.build([(_ids(7, 41), 0, 1, True, [1]), (_ids(5, 42), 0, 2, True, [2])], [],
                         "cpu"), cache)
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
            sub = _sub_batch(b, ver)
            assert spec.fits(sub)
            h = fp._split(b, ver, sub, spec.forward)
        else:
            h = fp.forward_eager(b)
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
    from tailored.model.batch import SeqInfo
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


@pytest.mark.parametrize("synthetic", [None, [1, 1, 0]])
def test_spec_chain_on_the_device_equals_the_host_acceptance(tiny_ckpt, synthetic):
    """SpecGraphs.chain (acceptance, state commits and the MTP after a whole verify step, on
    the device; its body eagerly here) against the host path it replaces (mtp.accept,
    HybridCache.commit_many, propose): a 3-draft chunk that keeps 2 by the greedy rule, a
    1-draft chunk that keeps none, a lone decode row, the batch padded 3 → 4; kept counts,
    next drafts, committed GDN states and the MTP KV of the emitted rows. synthetic: drawn
    kept counts instead (capped at each chunk's drafts)."""
    from tailored.model.batch import SeqInfo
    from tailored.worker.drafter import DraftRow, MTPDrafter, accept, emitted

    m, cache, fp, spec = _spec_model(tiny_ckpt, 3)
    m(ForwardBatch.build([(_ids(11, 51), 0, 1, True, [1]), (_ids(6, 52), 0, 2, True, [2]),
                          (_ids(9, 53), 0, 3, True, [3])], [], "cpu"), cache)
    base = {n: getattr(cache, n).clone() for n in ("k", "v", "conv", "rec")}
    c1, c2, c3 = _ids(4, 54), _ids(2, 55), _ids(1, 56)
    layout = [(c1, 11, 1, False, [1], True), (c2, 6, 2, False, [2], True),
              (c3, 9, 3, False, [3], True)]
    # the target's tokens at every row: chunk 1 matches d1, d2 then not d3; chunk 2 misses d1
    y = [c1[1], c1[2], (c1[3] + 1) % 1000, 7, (c2[1] + 1) % 1000, 8, 9]
    targets = [y[0:4], y[4:6], y[6:7]]
    results = []
    for use_chain in (False, True):
        for n, t in base.items():
            getattr(cache, n).copy_(t)
        b = ForwardBatch.build(layout, [], "cpu")
        h = spec.forward(b)
        drafts_in = [c[1:] for c in (c1, c2, c3)]
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
            drafts = MTPDrafter(m, cache).propose(h, rows)
        results.append((cache.conv[:, 1:].clone(), cache.rec[:, 1:].clone(),
                        cache.k[-1].clone(), drafts))
    (cv0, r0, k0, d0), (cv1, r1, k1, d1) = results
    assert rel_err(cv1, cv0) < 1e-6 and rel_err(r1, r0) < 1e-6
    for page, start, k in ((1, 11, kept[0]), (2, 6, kept[1]), (3, 9, kept[2])):
        rows = slice(start, start + k + 1)
        assert rel_err(k1[page, rows], k0[page, rows]) < 1e-5
    assert d1 == d0 and all(len(d) == 3 for d in d0)
    if synthetic is None:
        assert kept == [2, 0, 0]
        # a NaN row (the sampler's flag) ends chunk 1's prefix there, though its id matches
        b = ForwardBatch.build(layout, [], "cpu")
        spec.forward(b)
        bad = torch.zeros(len(y), dtype=torch.bool)
        bad[1] = True
        assert [g[0] for g in spec.chain(torch.tensor(y), None, bad).tolist()] == [1, 0, 0]


def test_warmup_prefill_runs_the_mtp_over_the_sinks_only(tiny_ckpt):
    """With speculative decoding (an MTP layer in the cache) the warm-up also runs the MTP
    over each prompt length, as every prompt chunk does (FastPath._warm_mtp): its KV goes to
    page 0 only, every other page and slot of the cache is bit-identical."""
    from tailored.config import ModelConfig
    from tailored.worker.cache import HybridCache
    from tailored.model.fast import FastPath

    cfg = ModelConfig.from_dir(tiny_ckpt)
    m = build_empty_model(cfg, "cpu", torch.float32)
    load_checkpoint(m, tiny_ckpt, progress=False)
    cache = HybridCache(cfg, 8, 16, 4, torch.float32, "cpu", mtp_layers=1)
    fp = FastPath(m, cache, max_batch=4, max_pages=6, use_graphs=False)
    assert fp.mtp_layer is not None
    g = torch.Generator().manual_seed(8)
    for t in (cache.conv, cache.rec, cache.k, cache.v):
        t.copy_(torch.randn(t.shape, generator=g, dtype=t.dtype))
    before = [t.clone() for t in (cache.conv, cache.rec, cache.k, cache.v)]
    fp.warmup_prefill([5, 12])
    for t, b in zip((cache.conv, cache.rec, cache.k, cache.v), before):
        assert torch.equal(t[:, 1:], b[:, 1:])
    assert not torch.equal(cache.k[-1, 0], before[2][-1, 0])  # the MTP layer's KV: it ran


def _spec_model(ckpt, num_draft: int):
    """The tiny model (fp32) with an MTP cache (16 pages of 16, 4 slots), an eager FastPath
    and its SpecGraphs (num_draft drafts, up to 4 sequences; bodies run eagerly)."""
    from tailored.config import ModelConfig
    from tailored.worker.cache import HybridCache
    from tailored.model.fast import FastPath
    from tailored.worker.spec_graphs import SpecGraphs

    cfg = ModelConfig.from_dir(ckpt)
    m = build_empty_model(cfg, "cpu", torch.float32)
    load_checkpoint(m, ckpt, progress=False)
    cache = HybridCache(cfg, 16, 16, 4, torch.float32, "cpu", mtp_layers=1)
    fp = m.fast = FastPath(m, cache, max_batch=4, max_pages=6, use_graphs=False)
    fp.spec = SpecGraphs(fp, num_draft, 4)
    return m, cache, fp, fp.spec


@pytest.mark.parametrize("rate", [None, 0.5])
def test_engine_device_chain_with_drafts_left_on_the_device_equals_the_host_path(tiny_ckpt,
                                                                                 rate):
    """The engine with the device chain after whole verify steps (SpecGraphs bodies run
    eagerly), whose next drafts stay on the device as placeholders that the next step takes
    from there (chain_drafts.py, kb/0035), against the host path (no SpecGraphs): the same
    tokens, greedy (random weights: most drafts rejected) and at synthetic acceptance 0.5
    (the same draws), with the device's kept counts checked against the host's at every
    read (ChainDrafts.read). One request is short, so later steps mix a lone chunk."""
    from tailored.worker.chain_drafts import ChainDrafts
    from tailored.engine.types import SamplingParams
    from tailored.worker.spec_graphs import SpecGraphs
    from tailored.stack import build_stack

    reads = []
    orig = ChainDrafts.read

    def counting_read(self):
        reads.append(len(self.kept))
        return orig(self)

    outs = {}
    for chain in (False, True):
        st = build_stack(tiny_ckpt, device="cpu", dtype="float32", progress=False, kernels="on",
                         max_model_len=256, max_num_seqs=4, num_pages=80,
                         async_scheduling=False, spec_max_running=4,
                         num_speculative_tokens=2, spec_synthetic_acceptance=rate)
        eng = st.engine
        if chain:
            fp = eng.runner.fast
            fp.spec = SpecGraphs(fp, 2, 4)
            eager = fp.forward

            def forward(batch, fp=fp, eager=eager):  # the routing of forward with graphs
                fp.spec.forget()
                return fp.spec.forward(batch) if fp.spec.fits(batch) else eager(batch)

            fp.forward = forward
        got = {}
        for i, (T, n) in enumerate(((5, 7), (23, 3), (12, 7))):
            eng.add_request(f"r{i}", _ids(T, 70 + i),
                            SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        ChainDrafts.read = counting_read
        try:
            while eng.has_unfinished():
                for o in eng.step():
                    got.setdefault(o.request_id, []).extend(o.delta_token_ids)
        finally:
            ChainDrafts.read = orig
        outs[chain] = got
        assert eng.runner.spec_stats[1] > 0
    assert outs[True] == outs[False]
    assert [len(outs[True][f"r{i}"]) for i in range(3)] == [7, 3, 7]
    assert reads  # later steps took their drafts from a chain, and checked its kept counts


def test_fp8_gemv_parts_need_one_run_of_each_kind():
    """`_fp8_gemv_parts` (kb/0039): FP8 members before or after the bf16 ones, as one run
    each; bf16 rows around the FP8 ones (the GEMV writes two blocks of columns) or no FP8
    member give None, so the projection keeps cuBLAS over the dequantized weight."""
    from torch import nn

    from tailored.model import fast as fastmod
    from tailored.model.fp8 import Fp8Linear

    def f8(n):
        m = Fp8Linear(16, n)
        m.weight.data = torch.zeros(n, 16).to(torch.float8_e4m3fn)
        m.weight_scale_inv.data.fill_(1.0)
        return m

    def bf(n):
        return nn.Linear(16, n, bias=False)

    def parts(mods):
        deq = torch.cat([torch.full((m.weight.shape[0], 16), float(j)) for j, m in enumerate(mods)])
        return fastmod._fp8_gemv_parts(mods, deq)

    assert parts([bf(3), bf(5)]) is None
    assert parts([bf(3), f8(4), bf(5)]) is None
    w8, s8, wb, bf16_first = parts([bf(3), bf(2), f8(4), f8(6)])
    assert bf16_first and w8.shape == (10, 16) and s8.shape == (10, 1)
    assert wb.shape == (5, 16) and wb[:3].eq(0).all() and wb[3:].eq(1).all()
    w8, s8, wb, bf16_first = parts([f8(4), bf(3)])
    assert not bf16_first and wb.shape == (3, 16) and wb.eq(1).all()
    assert parts([f8(4)])[2] is None
