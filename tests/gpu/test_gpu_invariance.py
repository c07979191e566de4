"""Engine-level invariances on the GPU (issue 4 §3, "GPU on full"): the kernel path with CUDA
graphs, through the real Engine, on the published widths.

Model: full width, 4 layers (3 GDN + 1 attention, every kind of layer), dummy weights with the
gate's stable init (kb/0008), in fp32 so that every comparison can be exact or near it (fp32
never runs FLA or TF32; graphs and eager kernels differ only in row layout). The CPU versions
(tiny model, plain path) are tests/engine/test_invariance.py. Skips itself without CUDA.

One engine at a time: each ModelRunner lays the model's weights out for its own kernel path
(worker/kernel_path.py: the projections fused into new tensors the modules then view), so each
engine is built after the previous one finished and is used alone.
"""

from __future__ import annotations

import invariance_checks as C
import pytest
import torch

from tailored.config import EngineConfig, ModelConfig
from tailored.engine.engine import Engine
from tailored.engine.types import SamplingParams
from tailored.gate.engine_side import engine_greedy
from tailored.synth import build_empty_model, init_dummy_weights, preset_config
from tailored.tokenizer import load_tokenizer
from tailored.worker.runner import ModelRunner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

TOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig.from_dict(preset_config("full", num_layers=4))
    m = build_empty_model(cfg, "cuda", torch.float32, with_mtp=False)
    init_dummy_weights(m, 0, init="stable")
    return m


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


def engine(model, tok, *, budget=2048, max_num_seqs=8, max_model_len=4200, enforce_eager=False,
           num_pages=None, **kw) -> Engine:
    ec = EngineConfig(page_size=16, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                      max_model_len=max_model_len, device="cuda", dtype="float32",
                      num_pages=num_pages or max_num_seqs * (max_model_len // 16 + 1) + 1,
                      kernels="on", enforce_eager=enforce_eager, **kw)
    e = Engine(model.config, ec, ModelRunner(model, model.config, ec, "cuda", torch.float32), tok)
    assert e.runner.kernel is not None  # the kernel path runs
    assert e.runner.kernel.km.cache is e.runner.cache
    return e


def test_alone_equals_inside_a_batch_of_32(model, tok):
    C.alone_equals_inside_a_batch_of_32(lambda **kw: engine(model, tok, **kw), max_len=200,
                                        target_len=90, new=12, budget=96, max_model_len=512,
                                        tol=TOL)


def test_identical_prompts_concurrently_identical_outputs(model, tok):
    C.identical_prompts_identical_outputs(lambda **kw: engine(model, tok, **kw),
                                          prompt_len=150, max_model_len=512)


@pytest.mark.parametrize("T", [1, 63, 64, 65, 127, 128, 129, 4097])
def test_chunked_prefill_equals_single_pass_and_prefill_decode(model, tok, T):
    """Budgets 8192 (single pass), 64 (page multiple), 37 (misaligned): same tokens and hidden
    states at every position; then prefill(T−1)+decode == prefill(T)."""
    P = C.ids(T, 1000 + T)
    runs = {b: engine_greedy(engine(model, tok, budget=b, max_num_seqs=2), {"p": P}, 3,
                             capture=True) for b in (8192, 64, 37)}
    C.chunked_equals_single_pass(runs, 8192, TOL)
    if T > 1:
        C.prefill_then_decode_equals_prefill(engine(model, tok, budget=64, max_num_seqs=2), P, TOL)


def test_cuda_graph_replay_equals_eager_through_the_engine(model, tok):
    """Same prompts with decode CUDA graphs and with --enforce-eager: same tokens, hidden states
    equal to fp32 rounding (the eager decode runs the prefill-capable kernel layout)."""
    prompts = {f"r{i}": C.ids(20 + 37 * i, 300 + i) for i in range(5)}
    e = engine(model, tok, max_num_seqs=8, max_model_len=512)
    g_t, g_h = engine_greedy(e, prompts, 24, capture=True)
    assert e.runner.kernel.decode.graphs, "no decode graph was captured"
    del e
    e_t, e_h = engine_greedy(engine(model, tok, max_num_seqs=8, max_model_len=512,
                                    enforce_eager=True), prompts, 24, capture=True)
    assert g_t == e_t
    for k in prompts:
        assert C.rel(g_h[k], e_h[k]) <= TOL, k


def test_steps_leave_other_slots_and_pages_bit_identical(model, tok):
    """Prefill-only steps with several new requests, mixed steps (decode rows replay a graph,
    prefill chunks run eagerly) and steps that skip a running request leave every state slot
    and KV page they do not name bit-identical (failure-cases §1)."""
    C.steps_leave_other_slots_and_pages_bit_identical(lambda **kw: engine(model, tok, **kw))


def test_long_generation_equals_one_prefill_at_spot_positions(model, tok):
    """failure-cases §7: 8192 decode steps through the CUDA graphs vs one eager prefill."""
    C.long_generation_equals_one_prefill(lambda **kw: engine(model, tok, **kw), n=8192, tol=TOL)


def test_abort_frees_pages_and_slots(model, tok):
    C.abort_frees_pages_and_slots(engine(model, tok, budget=32, max_num_seqs=3, max_model_len=128,
                                         num_pages=30))


def test_async_scheduling_same_tokens_and_no_sync_in_launched_ahead_steps(model, tok):
    """Async scheduling (kb/0025) on the kernel path with graphs: greedy tokens equal to the
    synchronous engine's for 8 requests of staggered lengths, three of them ending on a stop
    token id while the next step is in flight (void rows whose slot and pages are freed at
    once), one aborted mid-decode and one arriving later into the freed slot; and a step
    launched ahead of the previous one's tokens makes no host-device synchronization
    (torch's sync debug mode): otherwise it would only wait where it used to."""
    import warnings

    prompts = {f"r{i}": C.ids(20 + 13 * i, 300 + i) for i in range(8)}
    late = C.ids(40, 399)

    def run(on: bool, stops: dict, watch: bool = False):
        e = engine(model, tok, max_model_len=512)
        e._async = on and e._async
        syncs, ahead = [], [0]
        if watch:
            orig = e.runner.launch

            def launch(sched, feed=None):
                if feed is None:
                    return orig(sched)
                ahead[0] += 1
                with warnings.catch_warnings(record=True) as w:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        return orig(sched, feed=feed)
                    finally:
                        torch.cuda.set_sync_debug_mode(0)
                        # torch's own "sync debug mode is a prototype" notice is no sync
                        syncs.extend(str(x.message)[:160] for x in w
                                     if "called a synchronizing" in str(x.message))

            e.runner.launch = launch
        out = {name: [] for name in list(prompts) + ["late"]}
        for name, ids in prompts.items():
            e.add_request(name, ids, SamplingParams(
                max_tokens=10 + 3 * int(name[1:]), temperature=0.0, ignore_eos=True,
                stop_token_ids=[stops[name]] if name in stops else []))
        n = 0
        while e.has_unfinished():
            if n == 6:
                e.abort_request("r7")
            if n == 9:
                e.add_request("late", late, SamplingParams(max_tokens=12, temperature=0.0,
                                                           ignore_eos=True))
            for o in e.step():
                out[o.request_id] += o.delta_token_ids
            n += 1
        assert e.stats()["free_slots"] == e.runner.num_slots - 1  # every slot back
        return out, syncs, ahead[0]

    plain, _, _ = run(False, {})
    stops = {name: plain[name][4] for name in ("r0", "r2", "r4")}  # each stops at its 5th token
    sync_out, _, _ = run(False, stops)
    async_out, syncs, ahead = run(True, stops, watch=True)
    assert async_out == sync_out
    assert all(len(sync_out[n]) <= 5 for n in stops)
    assert ahead > 10, "no step was launched ahead"
    assert not syncs, syncs[:5]


def test_async_structured_rows_resampled_with_the_sync_tokens_and_no_sync(model, tok):
    """Structured requests launched ahead (kb/0052) on the kernel path with graphs: their
    rows are sampled unmasked at launch and again, masked, once the previous token reached
    the grammar (`runner.resample`); the tokens of every request — greedy and seeded under a
    regex, plain ones beside them — are the synchronous engine's, steps run ahead, and
    neither a launch ahead nor a resample synchronizes with the device."""
    import warnings

    from tailored.engine.types import StructuredOutput

    pytest.importorskip("xgrammar")
    digits = StructuredOutput("regex", "[0-9]{4,16}")
    reqs = {
        "g": (C.ids(30, 501), SamplingParams(max_tokens=20, temperature=0.0, structured=digits)),
        "s": (C.ids(44, 502), SamplingParams(max_tokens=20, temperature=0.9, seed=11,
                                             structured=digits)),
        "p": (C.ids(25, 503), SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)),
        "q": (C.ids(37, 504), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)),
    }

    def run(on: bool):
        e = engine(model, tok, max_model_len=512)
        e._async = on and e._async
        e.scheduler.structured_ahead = on and e.scheduler.structured_ahead
        syncs, counts = [], {"ahead": 0, "resample": 0}

        def watched(fn, key):
            def call(*a, **kw):
                if key == "ahead" and kw.get("feed") is None:
                    return fn(*a, **kw)
                counts[key] += 1
                with warnings.catch_warnings(record=True) as w:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        return fn(*a, **kw)
                    finally:
                        torch.cuda.set_sync_debug_mode(0)
                        syncs.extend(str(x.message)[:160] for x in w
                                     if "called a synchronizing" in str(x.message))
            return call

        e.runner.launch = watched(e.runner.launch, "ahead")
        e.runner.resample = watched(e.runner.resample, "resample")
        out = {rid: [] for rid in reqs}
        for rid, (ids, sp) in reqs.items():
            e.add_request(rid, ids, sp)
        while e.has_unfinished():
            for o in e.step():
                assert o.error is None, o.error
                out[o.request_id] += o.delta_token_ids
        return out, syncs, counts

    sync_out, _, _ = run(False)
    async_out, syncs, counts = run(True)
    assert async_out == sync_out
    for rid in ("g", "s"):
        assert tok.decode(async_out[rid]).isdigit(), tok.decode(async_out[rid])
    assert counts["ahead"] > 5 and counts["resample"] > 5, counts
    assert not syncs, syncs[:5]


@pytest.mark.parametrize("prefill_graphs", [False, True], ids=["eager_prefill", "prefill_graphs"])
def test_prefix_cache_hits_decode_as_cold_runs(model, tok, prefill_graphs):
    """Prefix caching (engine/prefix_cache.py, failure-cases §3) on the kernel path with CUDA
    graphs and async scheduling: a chat's next turn, the same conversation again and a new
    chat with the same system prompt hit the cache (the GDN state copied on the device, the
    partial KV page copied), and their tokens are those of cold runs (fp32: where a prefill
    splits changes no greedy token); no page leaks."""
    p1, p2, cut = C.chat_turns(tok, system_repeats=20)
    p3, sys_end = C.new_chat(tok, system_repeats=20)
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    def run(e, reqs):
        out = {}
        for rid, ids in reqs:
            e.add_request(rid, ids, sp)
            out[rid] = []
            while e.has_unfinished():
                for o in e.step():
                    assert o.error is None, o.error
                    out[o.request_id] += o.delta_token_ids
        return out

    e = engine(model, tok, max_model_len=1024, prefix_cache_entries=4,
               prefill_graphs=prefill_graphs)
    got = run(e, [("t1", p1), ("t2", p2), ("t1b", p1), ("c2", p3)])
    s = e.scheduler
    assert s.prefix.hits == 2 * cut + sys_end, (s.prefix.hits, cut, sys_end)
    s.prefix.clear()
    s.pages.check_integrity()
    assert s.pages.num_free == s.pages.capacity
    del e
    ref = engine(model, tok, max_model_len=1024, budget=cut)  # cold, split where t2's hit ends
    want = run(ref, [("t1", p1), ("t2", p2), ("c2", p3)])
    assert got["t1"] == want["t1"] and got["t1b"] == want["t1"]
    assert got["t2"] == want["t2"] and got["c2"] == want["c2"]
