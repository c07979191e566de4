"""GPU checks (skipped without CUDA): the same model code on the device vs the CPU and vs transformers.

Run on the GPU by lab/gpu_call.sh (PARTS=tests).
"""

from __future__ import annotations

import pytest
import torch
from helpers import new_cache, rel_err, run_seq

from tailored.config import ModelConfig
from tailored.model.batch import ForwardBatch, sub_batch
from tailored.synth import build_empty_model, init_dummy_weights, preset_config
from tailored.worker.cache import HybridCache

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _on(model, device, dtype):
    m = build_empty_model(model.config, device, dtype)
    m.load_state_dict(model.state_dict())
    return m


def _run(model, ids, device, dtype):
    cache = HybridCache(model.config, 64, 16, 4, dtype, device)
    T = len(ids)
    b = ForwardBatch.build([(ids, 0, 1, True, list(range(1, 2 + T // 16)))], list(range(T)), device)
    return model.compute_logits(model(b, cache)).cpu()


@pytest.mark.parametrize("T", [1, 65, 129])
def test_tiny_cuda_fp32_matches_cpu(tiny_model, T):
    ids = torch.randint(0, 248044, (T,), generator=torch.Generator().manual_seed(T)).tolist()
    cpu = run_seq(tiny_model, new_cache(tiny_model.config), ids, 0, 1, list(range(1, 2 + T // 16)))
    gpu = _run(_on(tiny_model, "cuda", torch.float32), ids, "cuda", torch.float32)
    assert rel_err(gpu, cpu) <= 1e-4


@pytest.mark.parametrize("layer", [0, 3])
def test_tiny_cuda_bf16_layer_close_to_fp32(tiny_model, layer):
    """One GDN layer and one attention layer in bf16 on the GPU vs fp32, same input.

    Whole-model bf16-vs-fp32 error of the random-weight tiny model is dominated by chaotic
    amplification across layers (transformers' own bf16 path shows the same growth: kb/0001),
    so precision is checked per layer; exactness is checked end to end in fp32.
    """
    from tailored.ops import reference as ref

    T = 100
    x = torch.randn(T, tiny_model.config.hidden_size, generator=torch.Generator().manual_seed(layer))
    b = ForwardBatch.build([(list(range(T)), 0, 1, True, list(range(1, 9)))], [], "cpu")
    cos, sin = ref.rope_cos_sin(b.positions, tiny_model.config.rotary_dim, tiny_model.config.rope_theta,
                                torch.float32)
    with torch.no_grad():
        want = tiny_model.model.layers[layer](x, cos, sin, b, new_cache(tiny_model.config), layer)
        m16 = _on(tiny_model, "cuda", torch.bfloat16)
        bg = ForwardBatch.build([(list(range(T)), 0, 1, True, list(range(1, 9)))], [], "cuda")
        cache = HybridCache(tiny_model.config, 64, 16, 4, torch.bfloat16, "cuda")
        got = m16.model.layers[layer](x.cuda().bfloat16(), cos.cuda().bfloat16(), sin.cuda().bfloat16(),
                                      bg, cache, layer)
    assert torch.isfinite(got).all()
    # per token: a near-tie in the router can pick another expert for a few tokens in bf16
    # (a discrete flip, seen on the H200 for the attention layer: whole-tensor error 0.045),
    # so bound the median token and 90% of tokens rather than the whole tensor
    err = (got.cpu().float() - want).norm(dim=-1) / want.norm(dim=-1)
    assert err.median() <= 1e-2
    assert (err <= 2e-2).float().mean() >= 0.9


def test_full_width_4_layers_matches_transformers():
    """Published dimensions, 4 layers (3 GDN + 1 attention), dummy weights, fp32 on the GPU."""
    transformers = pytest.importorskip("transformers")
    from tailored.gate.reference import torch_only_transformers

    torch_only_transformers()  # not FLA's TF32 kernels, when fla-core is installed
    cfg_dict = preset_config("full", num_layers=4)
    cfg = ModelConfig.from_dict(cfg_dict)
    ours = build_empty_model(cfg, "cuda", torch.float32, with_mtp=False)
    init_dummy_weights(ours, seed=1)
    hcfg = transformers.Qwen3_5MoeTextConfig(**cfg_dict["text_config"])
    hcfg._attn_implementation = "eager"
    with torch.device("cuda"):
        hf = transformers.Qwen3_5MoeForCausalLM(hcfg).float().eval()
    missing, unexpected = hf.load_state_dict(ours.state_dict(), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    T = 130
    ids = torch.randint(0, 248044, (1, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids.cuda()).logits[0].float().cpu()
    del hf
    cache = HybridCache(cfg, 64, 16, 4, torch.float32, "cuda")
    pages = list(range(1, 2 + T // 16))
    b = ForwardBatch.build([(ids[0, :-1].tolist(), 0, 1, True, pages)], [T - 2], "cuda")
    pre = ours.compute_logits(ours(b, cache)[b.logits_rows]).cpu()
    b2 = ForwardBatch.build([(ids[0, -1:].tolist(), T - 1, 1, False, pages)], [0], "cuda")
    dec = ours.compute_logits(ours(b2, cache)[b2.logits_rows]).cpu()
    assert torch.isfinite(pre).all()
    assert rel_err(pre[0], ref[T - 2]) <= 1e-4
    assert rel_err(dec[0], ref[T - 1]) <= 1e-4


# ---------------------------------------------------------------------------------------------
# the kernel path (model/kernel_*.py, worker/kernel_forward.py) on the GPU: vs the plain path,
# and CUDA graph replay vs eager
# ---------------------------------------------------------------------------------------------
def _full4(dtype, seed=1, precision="bf16"):
    cfg = ModelConfig.from_dict(preset_config("full", num_layers=4, precision=precision))
    m = build_empty_model(cfg, "cuda", dtype, with_mtp=False)
    init_dummy_weights(m, seed=seed)
    return m


def _kernel_path(model, cache, max_batch=4, max_pages=16, use_graphs=True):
    """The kernel path of `model` over `cache` (a KernelForward: `.forward(batch)` dispatches
    to its graphs). Its weight layout leaves the model's own forward (the plain path) intact,
    so one model serves both, each over its own cache."""
    from tailored.model.kernel_model import KernelModel
    from tailored.worker.kernel_forward import KernelForward

    return KernelForward(KernelModel(model, cache), max_batch=max_batch, max_pages=max_pages,
                         use_graphs=use_graphs)


def _after_steps(seed: int, precision: str):
    """(cache, kernel path, `_steps`' state) of a 4-layer full-width bf16 model whose kernel
    path has run every `_steps` layout eagerly: the sequences the graph tests replay."""
    model = _full4(torch.bfloat16, seed=seed, precision=precision)
    cache = HybridCache(model.config, 32, 16, 5, torch.bfloat16, "cuda")
    kf = _kernel_path(model, cache)
    steps, state = _steps()
    for layout in steps:
        kf.forward(ForwardBatch.build(layout, [0], "cuda"))
    return cache, kf, state


def _steps(T_a=130, T_b=77):
    g = torch.Generator().manual_seed(5)
    a = torch.randint(0, 248044, (T_a,), generator=g).tolist()
    b = torch.randint(0, 248044, (T_b,), generator=g).tolist()
    pa, pb = list(range(1, 12)), list(range(12, 20))
    return [  # two prefills (a chunked), then a continuation mixed with a 1-token prompt
        [(a[:64], 0, 1, True, pa), (b, 0, 2, True, pb)],
        [(a[64:], 64, 1, False, pa), ([7], 0, 3, True, [20])],
    ], {1: (T_a, pa), 2: (T_b, pb), 3: (1, [20, 21])}


@pytest.mark.parametrize("variant", ["default", "new"])
@pytest.mark.parametrize("precision", ["bf16", "fp8", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fast_path_matches_plain_full_width(dtype, precision, variant, switches):
    """Published dims, 4 layers: prefill (FLA when installed), mixed steps, graph decode steps.
    fp8: block-FP8 weights (W8A16 kernels vs the plain path's dequantize-then-matmul); nvfp4:
    ModelOpt's NVFP4 layout (W4A16 GEMVs at decode, the experts' bf16 scratch at prefill).
    switches "new": every kernel switch on — the shared expert inside the fused MoE
    (kb/0019); route_align up to 64 rows
    (kb/0021) and the MoE combine with the next norm (kb/0023), on by default; the GDN step
    over 4 programs a head (kb/0022; default 2); the grouped-GEMM prefill experts from 64
    tokens (kb/0031; bf16 activations only, so the fp32 runs keep fused_moe)."""
    if variant == "new":  # "default": the switches' defaults, as served
        switches(shared_in_moe=True, gdn_dv_split=4, combine_next_norm=True,
                 route_align_up_to=64, moe_grouped=True,
                 moe_grouped_from=64,  # both _steps prefills
                 moe_route_in_gate_up_up_to=4,  # kb/0036
                 attn_gate_in_merge=True,
                 moe_gemv_up_to=4,  # kb/0039
                 bf16_gemv_up_to=4,
                 fp8_dense_splitk_up_to=64)  # kb/0045 §4

    model = _full4(dtype, precision=precision)
    cfg = model.config
    cp = HybridCache(cfg, 32, 16, 5, dtype, "cuda")
    cf = HybridCache(cfg, 32, 16, 5, dtype, "cuda")
    kf = _kernel_path(model, cf)
    kf.decode.capture(sizes=[4])
    steps, state = _steps()
    errs = []

    def compare(layout, rows):
        hp = model(ForwardBatch.build(layout, rows, "cuda"), cp)  # the plain path
        hf = kf.forward(ForwardBatch.build(layout, rows, "cuda"))
        tok = (hf.float() - hp.float()).norm(dim=-1) / hp.float().norm(dim=-1)
        errs.append(tok.max().item())
        return tok

    for layout in steps:
        rows = [sum(len(t[0]) for t in layout[:i + 1]) - 1 for i in range(len(layout))]
        tok = compare(layout, rows)
        if dtype == torch.float32:
            assert tok.max() <= 1e-4, tok.max()  # fp32 never runs FLA (TF32 dots)
        else:
            assert tok.median() <= 3e-2
    for step in range(4):  # decode-only: graph replay (3 rows padded to 4)
        layout = [([100 + 7 * step + s], state[s][0] + step, s, False, state[s][1]) for s in (1, 2, 3)]
        tok = compare(layout, [0, 1, 2])
        # bf16: a near-tie router flip moves one token a lot on random weights (kb/0001), so
        # only fp32 is bounded per token; bf16 is reported and bounded loosely
        assert tok.max() <= (1e-4 if dtype == torch.float32 else 0.3), (step, tok)
    # mixed step: the decode rows replay the graph alone, a new 40-token prefill runs eagerly
    new = torch.randint(0, 248044, (40,), generator=torch.Generator().manual_seed(9)).tolist()
    layout = [([5], state[1][0] + 4, 1, False, state[1][1]), (new, 0, 4, True, [22, 23, 24]),
              ([6], state[2][0] + 4, 2, False, state[2][1])]
    tok = compare(layout, [0, 40, 41])
    assert tok.max() <= (1e-4 if dtype == torch.float32 else 0.3), tok.max()
    print(f"fast vs plain ({dtype}, {precision}): max per-token rel err per step {errs}")


@pytest.mark.contract("graph-replay-equals-eager")
@pytest.mark.parametrize("precision", ["bf16", "fp8", "nvfp4"])
def test_cuda_graph_replay_equals_eager_bitwise(precision):
    """The captured decode graph computes exactly what its body computes eagerly (bf16)."""
    cache, kf, state = _after_steps(2, precision)
    kf.decode.capture(sizes=[4])
    layout = [([9 + s], state[s][0], s, False, state[s][1]) for s in (1, 2, 3)]
    snap = [t.clone() for t in (cache.conv, cache.rec, cache.k, cache.v)]
    kf.decode.fill(ForwardBatch.build(layout, [0, 1, 2], "cuda"), 4)
    eager = kf.decode.body(4)[:3].clone()
    after_eager = [t.clone() for t in (cache.conv, cache.rec, cache.k, cache.v)]
    for t, s in zip((cache.conv, cache.rec, cache.k, cache.v), snap):
        t.copy_(s)
    graph = kf.decode.forward(ForwardBatch.build(layout, [0, 1, 2], "cuda")).clone()
    assert torch.equal(graph, eager)
    for t, s in zip((cache.conv, cache.rec, cache.k, cache.v), after_eager):
        assert torch.equal(t[:, 1:], s[:, 1:])  # slot/page 0 is the pad sink: skip it


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_mixed_graph_replay_equals_its_body_bitwise(precision):
    """A mixed-step graph (worker/mixed_graphs.py, kb/0068): two decode rows and a fresh
    20-token prompt replayed from one captured graph (4 rows, 128 tokens) through the
    dispatch compute exactly what the graph's body computes eagerly, rows in batch order, and
    leave the same cache."""
    from tailored.worker.mixed_graphs import MixedGraphs

    cache, kf, state = _after_steps(4, precision)
    m = MixedGraphs(kf.km, kf.pool, kf.decode, kf.prefill, "fresh prompt")
    m.min_rows = 1  # 2 decode rows: below the served minimum (32), the same code
    m.capture(max_rows=4, max_tokens=128)
    assert list(m.graphs) == [(4, 128)]
    prompt = torch.randint(0, 248044, (20,), generator=torch.Generator().manual_seed(9)).tolist()
    layout = [([9 + s], state[s][0], s, False, state[s][1]) for s in (1, 2)]
    layout.append((prompt, 0, 4, True, [22, 23]))
    rows = [0, 1, 21]
    tensors = (cache.conv, cache.rec, cache.k, cache.v)
    snap = [t.clone() for t in tensors]
    batch = ForwardBatch.build(layout, rows, "cuda")
    m.fill(sub_batch(batch, [0, 1]), sub_batch(batch, [2]), (4, 128))
    body = m.body((4, 128))
    eager = torch.cat([body[:2], body[4:24]]).clone()
    after_eager = [t.clone() for t in tensors]
    for t, s in zip(tensors, snap):
        t.copy_(s)
    kf.mixed = [m]
    graph = kf.forward(ForwardBatch.build(layout, rows, "cuda")).clone()
    assert torch.equal(graph, eager)
    for t, s in zip(tensors, after_eager):
        assert torch.equal(t[:, 1:], s[:, 1:])  # slot/page 0 is the pad sink: skip it


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="PDL needs sm_90")
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_pdl_changes_no_bit(precision, switches):
    """PDL (kernels/pdl.py, kb/0030; on by default since kb/0041): every Triton kernel waits
    for the one before it before reading what that one writes, so a decode graph captured
    with PDL, and an eager prefill of two sequences, give the same bits, and leave the same
    cache, as without it. A missed wait would race; so would a read before the wait (the
    GEMV's weights, the GDN state: kb/0040) of something the step writes. Decode at 3 rows and at 1 row (the FP8 GEMV
    and, switched on here, the bf16 GEMV; FP8's dense projections at 3 rows through the
    split-K GEMM, kb/0045 §4)."""
    switches(bf16_gemv_up_to=2, fp8_dense_splitk_up_to=64)  # FP8's 3 rows: split-K
    model = _full4(torch.bfloat16, seed=3, precision=precision)
    cache = HybridCache(model.config, 32, 16, 5, torch.bfloat16, "cuda")
    kf = _kernel_path(model, cache)
    steps, state = _steps()
    layout = [([9 + s], state[s][0], s, False, state[s][1]) for s in (1, 2, 3)]
    results = []
    for on in (False, True):
        switches(pdl=on)
        for t in (cache.conv, cache.rec, cache.k, cache.v):
            t.zero_()
        pre = kf.forward(ForwardBatch.build(steps[0], [0], "cuda")).clone()
        for lay in steps[1:]:
            kf.forward(ForwardBatch.build(lay, [0], "cuda"))
        kf.drop_decode_graphs()
        kf.decode.capture(sizes=[1, 4])
        snap = [t.clone() for t in (cache.conv, cache.rec, cache.k, cache.v)]
        for _ in range(3):  # a race need not show in every replay
            outs = []
            for rows in (layout, layout[:1]):
                for t, s in zip((cache.conv, cache.rec, cache.k, cache.v), snap):
                    t.copy_(s)
                outs.append(kf.decode.forward(
                    ForwardBatch.build(rows, list(range(len(rows))), "cuda")).clone())
                torch.cuda.synchronize()
                outs.append([t[:, 1:].clone() for t in (cache.conv, cache.rec, cache.k, cache.v)])
            results.append((pre, outs))
    p0, o0 = results[0]
    for p1, o1 in results[1:]:
        assert torch.equal(p0, p1)
        for a, b in zip(o0, o1):
            if isinstance(a, list):
                assert all(torch.equal(x, y) for x, y in zip(a, b))
            else:
                assert torch.equal(a, b)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_eager_prefill_forward_barely_syncs(precision):
    """A prefill forward (two sequences, one continuing a chunk) issues at most a handful of
    host-GPU synchronizations: the index tensors come from one pinned copy per forward
    (StepPlan), not from a pageable copy per layer (~70 before, kb/0007)."""
    import warnings

    model = _full4(torch.bfloat16, precision=precision)
    cache = HybridCache(model.config, 32, 16, 5, torch.bfloat16, "cuda")
    kf = _kernel_path(model, cache, use_graphs=False)
    steps, _ = _steps()
    kf.forward(ForwardBatch.build(steps[0], [0], "cuda"))
    # the counted batch once outside the count: its MoE launcher (by pairs per expert) is
    # autotuned here, and autotuning synchronizes
    kf.forward(ForwardBatch.build(steps[1], [0], "cuda"))
    b = ForwardBatch.build(steps[1], [0], "cuda")
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            kf.forward(b)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    # torch's own "sync debug mode is a prototype" notice is no sync
    syncs = [x for x in w if "called a synchronizing" in str(x.message)]
    print(f"{precision}: {len(syncs)} synchronizing calls in a 4-layer prefill forward")
    assert len(syncs) <= 6, [str(x.message)[:120] for x in syncs]


def _with_graphs(dtype, precision, seed, buckets):
    """(model, cache, kernel path) of the 4-layer full-width model: 5 slots, 160 pages, a
    4-row decode graph and prefill graphs at `buckets`."""
    model = _full4(dtype, seed=seed, precision=precision)
    cache = HybridCache(model.config, 160, 16, 5, dtype, "cuda")
    kf = _kernel_path(model, cache, max_pages=80)
    kf.decode.capture(sizes=[4])
    kf.prefill.capture(max(buckets), buckets=buckets)
    return model, cache, kf


def _mixed_step(kf):
    """Prefill two running sequences of 20 tokens (slots 3, 4); returns (layout of a step of
    their next tokens and a fresh 300-token prompt in slot 2, the prompt, its pages)."""
    g = torch.Generator().manual_seed(9)
    for slot, base in ((3, 40), (4, 60)):
        ids = torch.randint(0, 248044, (20,), generator=g).tolist()
        kf.forward(ForwardBatch.build([(ids, 0, slot, True, [base, base + 1])], [19], "cuda"))
    prompt = torch.randint(0, 248044, (300,), generator=g).tolist()
    pages = list(range(1, 2 + len(prompt) // 16))
    layout = [([7], 20, 3, False, [40, 41]), ([9], 20, 4, False, [60, 61]),
              (prompt, 0, 2, True, pages)]
    return layout, prompt, pages


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="PDL needs sm_90")
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@torch.no_grad()
def test_pdl_changes_no_bit_in_a_mixed_step_with_a_prefill_graph(precision, switches):
    """PDL is on by default (kb/0041), and prefill graphs are captured by default on CUDA:
    a step of two decode rows and a fresh 300-token prompt (the decode graph and the prompt's
    512-token prefill graph, kb/0028), both graphs captured with PDL and without, gives the
    same bits and leaves the same cache (test_pdl_changes_no_bit covers decode graphs and
    eager prefill only; the review of kb/0041 found this path never run with PDL)."""
    switches(pdl=False)
    _, cache, kf = _with_graphs(torch.bfloat16, precision, 4, [512])
    layout, prompt, _ = _mixed_step(kf)
    T = len(prompt)
    tensors = (cache.conv, cache.rec, cache.k, cache.v)
    snap = [t.clone() for t in tensors]
    results = []
    for on in (False, True):
        switches(pdl=on)
        kf.drop_decode_graphs()  # graphs bake the launch attributes in: capture anew
        kf.decode.capture(sizes=[4])
        kf.prefill.graphs.clear()
        kf.prefill.capture(512, buckets=[512])
        assert 512 in kf.prefill.graphs
        for _ in range(3):  # a race need not show in every replay
            for t, s_ in zip(tensors, snap):
                t.copy_(s_)
            out = kf.forward(ForwardBatch.build(layout, [0, 1, 1 + T], "cuda")).clone()
            torch.cuda.synchronize()
            results.append((out, [t[:, 1:].clone() for t in tensors]))  # slot/page 0: sinks
    out0, cache0 = results[0]
    for out, after in results[1:]:
        assert torch.equal(out, out0)
        assert all(torch.equal(a, b) for a, b in zip(after, cache0))


@pytest.mark.parametrize("dtype,precision", [(torch.float32, "bf16"), (torch.bfloat16, "fp8")])
@torch.no_grad()
def test_mixed_step_replays_both_graphs(dtype, precision):
    """kb/0028: decode rows + one fresh prompt in one step replay the decode graph and the
    prompt's prefill graph. The prompt's rows and its slot/KV are bitwise what the prompt alone
    (one prefill-graph replay) gives, the decode rows track the eager step (fp32: 1e-4), and
    nothing outside the step's slots and pages is touched."""
    _, cache, kf = _with_graphs(dtype, precision, 4, [512])
    layout, prompt, pages = _mixed_step(kf)
    T = len(prompt)
    rows = [0, 1, 1 + T]
    tensors = (cache.conv, cache.rec, cache.k, cache.v)
    snap = [t.clone() for t in tensors]
    replays = []
    real = kf.prefill.forward
    kf.prefill.forward = lambda b: replays.append(b.seqs[0].num_tokens) or real(b)
    try:
        mixed = kf.forward(ForwardBatch.build(layout, rows, "cuda")).clone()
    finally:
        del kf.prefill.forward
    assert replays == [T]
    after_mixed = [t.clone() for t in tensors]
    for t, s_ in zip(tensors, snap):
        t.copy_(s_)
    eager = kf.km.forward_eager(ForwardBatch.build(layout, rows, "cuda")).clone()
    for t, s_ in zip(tensors, snap):
        t.copy_(s_)
    alone = kf.forward(ForwardBatch.build([(prompt, 0, 2, True, pages)], [T - 1], "cuda"))
    assert torch.equal(mixed[2:], alone), "prompt rows differ from the prompt's graph alone"
    assert torch.equal(cache.rec[:, 2], after_mixed[1][:, 2])
    assert torch.equal(cache.k[:, 1:len(pages) + 1], after_mixed[2][:, 1:len(pages) + 1])
    step_pages = set(pages) | {40, 41, 60, 61}
    other_pages = [q for q in range(1, 160) if q not in step_pages]
    for j in (0, 1):  # conv, rec: slot 1 is nobody's
        assert torch.equal(after_mixed[j][:, 1], snap[j][:, 1])
    for j in (2, 3):  # k, v
        assert torch.equal(after_mixed[j][:, other_pages], snap[j][:, other_pages])
    tok = (mixed.float() - eager.float()).norm(dim=-1) / eager.float().norm(dim=-1)
    print(f"mixed step, both graphs vs eager ({dtype}, {precision}): decode rows max "
          f"{tok[:2].max().item():.2e}, prompt rows median {tok[2:].median().item():.2e}")
    if dtype == torch.float32:
        assert tok.max() <= 1e-4, tok
    else:
        assert tok[2:].median() <= 0.12 and tok.max() <= 0.3


@pytest.mark.parametrize("dtype,precision", [(torch.float32, "bf16"), (torch.bfloat16, "bf16"),
                                             (torch.bfloat16, "fp8")])
@pytest.mark.contract("graph-replay-equals-eager")
@torch.no_grad()
def test_prefill_graph_replay_equals_its_body_and_tracks_eager(dtype, precision):
    """Prefill CUDA graphs (kb/0013): the replay computes exactly its body, and the padded
    body tracks the eager varlen prefill in hidden rows and states. fp32 (no FLA, exact
    kernels): the pads must be neutral to 1e-4. bf16: GEMMs at another row count, the MoE's
    prefill kernel instead of its decode one at T=5 and FLA fixed-length vs varlen round
    differently, and a random-weight model amplifies that (a near-tie router flip moves a
    whole token, kb/0001): the bound is the bf16 fast-vs-plain one (max 0.3), with a median
    bound loose enough for 5 tokens (H200, session 7: T=5 median 0.078)."""
    _, cache, kf = _with_graphs(dtype, precision, 3, [128, 1024])
    assert sorted(kf.prefill.graphs) == [128, 1024]
    tensors = (cache.conv, cache.rec, cache.k, cache.v)
    for T in (5, 128, 1000):
        ids = torch.randint(0, 248044, (T,), generator=torch.Generator().manual_seed(T)).tolist()
        pages = list(range(1, 2 + T // 16))
        layout = [(ids, 0, 2, True, pages)]
        batch = ForwardBatch.build(layout, [T - 1], "cuda")
        assert kf.prefill.fits(batch)
        snap = [t.clone() for t in tensors]
        eager = kf.km.forward_eager(ForwardBatch.build(layout, [T - 1], "cuda")).clone()
        after_eager = [t.clone() for t in tensors]
        n = min(b for b in kf.prefill.graphs if b >= T)
        for t, s in zip(tensors, snap):
            t.copy_(s)
        kf.prefill.fill(batch, n)
        body = kf.prefill.body(n)[:T].clone()
        after_body = [t.clone() for t in tensors]
        for t, s in zip(tensors, snap):
            t.copy_(s)
        graph = kf.forward(ForwardBatch.build(layout, [T - 1], "cuda")).clone()  # dispatches
        assert torch.equal(graph, body), T
        for t, s in zip(tensors, after_body):
            assert torch.equal(t[:, 1:], s[:, 1:]), T  # slot/page 0: the pad sinks
        tok = (graph.float() - eager.float()).norm(dim=-1) / eager.float().norm(dim=-1)
        rec = rel_err(cache.rec[:, 2], after_eager[1][:, 2])
        print(f"prefill graph vs eager ({dtype}, {precision}, T={T}): per-token rel err median "
              f"{tok.median().item():.2e} max {tok.max().item():.2e}; rec state {rec:.2e}")
        if dtype == torch.float32:
            assert tok.max() <= 1e-4 and rec <= 1e-4, (T, tok, rec)
        else:
            assert tok.median() <= 0.12 and tok.max() <= 0.3, (T, tok)
            assert rec <= 5e-2
