"""Speculative decoding on the H200 (skipped without CUDA): the verify and MTP CUDA graphs
(worker/spec_graphs.py) against their bodies run eagerly, and whole generations with drafts.

The CPU checks the bodies against the eager kernel path (tests/worker/test_kernel_path.py) and
the engine logic on the nano checkpoint (tests/worker/test_spec_decode.py); what only a GPU shows is the
capture itself: static buffers, the shared memory pool, the MTP graph reading the verify
graph's output, and bf16.
"""

from __future__ import annotations

import pytest
import torch

from tailored.config import ModelConfig
from tailored.model.batch import ForwardBatch, SeqInfo
from tailored.synth import build_empty_model, init_dummy_weights, preset_config
from tailored.worker.cache import HybridCache

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _model(dtype, precision):
    """The full-width model cut to 4 layers, with its MTP head (random weights)."""
    cfg = ModelConfig.from_dict(preset_config("full", num_layers=4, precision=precision))
    m = build_empty_model(cfg, "cuda", dtype)
    init_dummy_weights(m, seed=3)
    return m


def _spec_setup(precision, seed):
    """The 4-layer model with its kernel path (decode graph of 4) and SpecGraphs (2 drafts, up
    to 4 sequences) captured, after 40-token prompts in slots 1..3 (pages 1-3, 4-6, 7-9).
    Returns (model, cache, kernel path, its SpecGraphs, pages)."""
    from tailored.model.kernel_model import KernelModel
    from tailored.worker.kernel_forward import KernelForward
    from tailored.worker.spec_graphs import SpecGraphs

    model = _model(torch.bfloat16, precision)
    cache = HybridCache(model.config, 64, 16, 5, torch.bfloat16, "cuda", mtp_layers=1)
    kf = KernelForward(KernelModel(model, cache), max_batch=4, max_pages=16, use_graphs=True)
    g = torch.Generator().manual_seed(seed)
    ids = {s: torch.randint(0, 248044, (40,), generator=g).tolist() for s in (1, 2, 3)}
    pages = {1: [1, 2, 3], 2: [4, 5, 6], 3: [7, 8, 9]}
    for s in (1, 2, 3):
        kf.forward(ForwardBatch.build([(ids[s], 0, s, True, pages[s])], [39], "cuda"))
    kf.decode.capture(sizes=[4])
    spec = kf.spec = SpecGraphs(kf.km, kf.pool, 2, 4, kf.max_pages)
    spec.capture()
    return model, cache, kf, spec, pages


def _drafter(model, cache, kf):
    """The drafter as the runner makes it over this kernel path: the MTP layer on the kernel
    path, the MTP graph after a verify graph (`SpecGraphs.propose`)."""
    from tailored.worker.drafter import MTPDrafter

    return MTPDrafter(model, cache, km=kf.km, spec=kf.spec)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@torch.no_grad()
def test_spec_graphs_replay_equal_their_bodies_bitwise(precision):
    from tailored.worker.drafter import DraftRow

    model, cache, kf, spec, pages = _spec_setup(precision, 4)
    assert sorted(spec.verify) == sorted(spec.mtp) == [1, 2, 4]
    layout = [([11, 12, 13], 40, 1, False, pages[1], True), ([21, 22], 40, 2, False, pages[2], True),
              ([31, 32, 33], 40, 3, False, pages[3], True)]
    kept = {1: 3, 2: 1, 3: 2}
    tensors = (cache.conv, cache.rec, cache.k, cache.v)
    snap = [t.clone() for t in tensors]
    results = []
    for graphs in (True, False):
        for t, s_ in zip(tensors, snap):
            t.copy_(s_)
        held = (spec.verify, spec.mtp)
        if not graphs:  # the same step through the bodies, eagerly
            spec.verify, spec.mtp = {}, {}
        try:
            b = ForwardBatch.build(layout, [], "cuda")
            h = kf.forward(b).clone() if graphs else spec.forward(b).clone()
            for slot, k in kept.items():
                cache.commit_states(slot, k)
            rows = [DraftRow(SeqInfo(sq.q_start, kept[sq.slot], sq.start_pos, sq.slot, False,
                                     sq.page_ids), [5] * kept[sq.slot], 2) for sq in b.seqs]
            d = _drafter(model, cache, kf).propose(h, rows)
        finally:
            spec.verify, spec.mtp = held
        results.append((h, [t.clone() for t in tensors], d))
    (h0, t0, d0), (h1, t1, d1) = results
    assert torch.equal(h0, h1)
    for a, b_ in zip(t0, t1):
        assert torch.equal(a[:, 1:], b_[:, 1:])  # slot / page 0: the pad sinks
    assert d0 == d1 and all(len(d) == 2 for d in d0)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_engine_with_drafts_on_the_gpu(precision, tmp_path):
    """Whole greedy generations through the engine with 2 drafts a step (verify graphs) and
    without (decode graphs), bf16 at full width (4 layers): random weights keep few drafts,
    so most steps commit early; the outputs may part once a bf16 rounding flips an argmax
    (the verify rows are GEMMs of 3 rows where decode has 1), so the check is on the first
    tokens, the lengths, and that steps took the graphs. Synthetic acceptance 1.0 then keeps
    every draft: 3 tokens a step."""
    from tailored.engine.types import SamplingParams
    from tailored.stack import build_stack
    from tailored.synth import write_synthetic_checkpoint

    ckpt = write_synthetic_checkpoint(tmp_path / "m", "full", seed=0, progress=False,
                                      num_layers=4, config_only=True,
                                      precision=precision)
    outs, steps = {}, {}
    for n, rate in ((0, None), (2, None), (2, 1.0)):
        st = build_stack(ckpt, load_format="dummy", device="cuda", progress=False,
                         max_model_len=512, max_num_seqs=4, num_speculative_tokens=n,
                         spec_max_running=4, spec_synthetic_acceptance=rate,
                         prefill_graphs=False)
        eng = st.engine
        sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        for i in range(3):
            eng.add_request(f"r{i}", list(range(100 + i, 140 + i)), sp)
        got, k = {}, 0
        while eng.has_unfinished():
            for o in eng.step():
                got.setdefault(o.request_id, []).extend(o.delta_token_ids)
            k += 1
        outs[(n, rate)], steps[(n, rate)] = got, k
        if n:
            assert eng.runner.kernel.spec is not None and eng.runner.kernel.spec.verify
        del st, eng
        torch.cuda.empty_cache()
    for r in ("r0", "r1", "r2"):
        assert len(outs[(2, None)][r]) == len(outs[(2, 1.0)][r]) == 24
        assert outs[(2, None)][r][:2] == outs[(0, None)][r][:2]
    assert steps[(2, 1.0)] <= 2 + 24 // 3 + 1


def test_engine_lone_rows_and_arriving_prompts_take_the_verify_graph(tmp_path):
    """Session 15 (kb/0033): a sampling request (no drafts) beside drafting ones rides the
    verify graph as 1-token verify chunks, and a prompt arriving while others draft splits
    (verify graph + prefill) instead of sending the step eager. bf16 at full width (4 layers),
    synthetic acceptance 1.0: every request ends at its length, steps took the verify graph
    and the split."""
    from tailored.engine.types import SamplingParams
    from tailored.stack import build_stack
    from tailored.synth import write_synthetic_checkpoint
    from tailored.worker.kernel_forward import KernelForward

    ckpt = write_synthetic_checkpoint(tmp_path / "m", "full", seed=0, progress=False,
                                      num_layers=4, config_only=True, precision="bf16")
    st = build_stack(ckpt, load_format="dummy", device="cuda", progress=False,
                     max_model_len=512, max_num_seqs=4, num_speculative_tokens=2,
                     spec_max_running=4, spec_synthetic_acceptance=1.0, prefill_graphs=False)
    eng = st.engine
    kf = eng.runner.kernel
    splits = []
    orig = KernelForward._split

    def counting(self, batch, picked, sub, graph_forward):
        splits.append(getattr(graph_forward, "__func__", None) is type(kf.spec).forward)
        return orig(self, batch, picked, sub, graph_forward)

    KernelForward._split = counting
    try:
        greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
        eng.add_request("g0", list(range(100, 140)), greedy)
        eng.add_request("s0", list(range(200, 240)),
                        SamplingParams(max_tokens=30, temperature=0.8, seed=1, ignore_eos=True))
        got = {}
        for k in range(200):
            if k == 4:
                eng.add_request("g1", list(range(300, 350)), greedy)
            for o in eng.step():
                got.setdefault(o.request_id, []).extend(o.delta_token_ids)
            if not eng.has_unfinished():
                break
    finally:
        KernelForward._split = orig
    assert {r: len(t) for r, t in got.items()} == {"g0": 30, "s0": 30, "g1": 30}
    assert "verify" in eng.timer.kinds
    assert any(splits), splits  # the arriving prompt beside verify chunks


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@torch.no_grad()
def test_spec_chain_graph_equals_its_body_and_the_host_path(precision):
    """The chain graph (acceptance, commits and MTP on the device after a whole verify step,
    kb/0034) against its body run eagerly and against the host path it replaces (commit_many
    + propose through the MTP graph), bitwise: kept counts, next drafts, GDN states, KV."""
    from tailored.worker.drafter import DraftRow, accept

    model, cache, kf, spec, pages = _spec_setup(precision, 5)
    assert sorted(spec.chains) == [1, 2, 4]
    chunks = {1: [11, 12, 13], 2: [21, 22], 3: [31, 32, 33]}
    layout = [(chunks[s], 40, s, False, pages[s], True) for s in (1, 2, 3)]
    targets = {1: [12, 13, 99], 2: [5, 6], 3: [32, 7, 8]}  # keeps 2, 0 and 1 drafts
    y = torch.tensor(targets[1] + targets[2] + targets[3], device="cuda")
    kept = {s: accept(chunks[s][1:], targets[s]) for s in (1, 2, 3)}
    assert kept == {1: 2, 2: 0, 3: 1}
    tensors = (cache.conv, cache.rec, cache.k, cache.v)
    snap = [t.clone() for t in tensors]
    results = []
    for mode in ("graph", "body", "host"):
        for t, s_ in zip(tensors, snap):
            t.copy_(s_)
        held = (spec.verify, spec.mtp, spec.chains)
        if mode == "body":
            spec.verify, spec.mtp, spec.chains = {}, {}, {}
        try:
            b = ForwardBatch.build(layout, [], "cuda")
            h = kf.forward(b) if mode != "body" else spec.forward(b)
            if mode == "host":
                cache.commit_many({s: k + 1 for s, k in kept.items()})
                rows = [DraftRow(SeqInfo(sq.q_start, kept[sq.slot] + 1, sq.start_pos, sq.slot,
                                         False, sq.page_ids),
                                 targets[sq.slot][:kept[sq.slot] + 1], 2) for sq in b.seqs]
                d = [[kept[sq.slot]] + x
                     for sq, x in zip(b.seqs, _drafter(model, cache, kf).propose(h, rows))]
            else:
                assert spec.whole_step(b, y.numel())
                d = spec.chain(y, None).tolist()
        finally:
            spec.verify, spec.mtp, spec.chains = held
        torch.cuda.synchronize()
        results.append(([t.clone() for t in tensors], d))
    (t0, d0) = results[0]
    for t1, d1 in results[1:]:
        for a, b_ in zip(t0, t1):
            assert torch.equal(a[:, 1:], b_[:, 1:])  # slot / page 0: the pad sinks
        assert d1 == d0
    assert [r[0] for r in d0] == [2, 0, 1]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="PDL needs sm_90")
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@torch.no_grad()
def test_pdl_changes_no_bit_in_the_verify_and_chain_graphs(precision, switches):
    """PDL (on by default, kb/0041) in a speculative step: the verify graph's GDN loops write
    the state inside the step, the chain graph commits snapshots into it, and the recurrent
    kernel reads it before its PDL wait (safe only because the kernel launched just before it
    never writes it). The verify + chain graphs captured with PDL and without give the same
    hidden states, kept counts, next drafts and cache, three replays each (a race need not
    show in every one)."""
    from tailored.worker.spec_graphs import SpecGraphs

    switches(pdl=False)
    _, cache, kf, spec, pages = _spec_setup(precision, 6)
    chunks = {1: [11, 12, 13], 2: [21, 22], 3: [31, 32, 33]}
    layout = [(chunks[s], 40, s, False, pages[s], True) for s in (1, 2, 3)]
    y = torch.tensor([12, 13, 99, 5, 6, 32, 7, 8], device="cuda")  # keeps 2, 0 and 1 drafts
    tensors = (cache.conv, cache.rec, cache.k, cache.v)
    snap = [t.clone() for t in tensors]
    results = []
    for on in (False, True):
        switches(pdl=on)
        for graphs in (spec.verify, spec.mtp, spec.chains):  # the old captures go first
            graphs.clear()
        kf.drop_decode_graphs()  # graphs bake the launch attributes in: capture anew
        kf.decode.capture(sizes=[4])
        spec = kf.spec = SpecGraphs(kf.km, kf.pool, 2, 4, kf.max_pages)
        spec.capture()
        assert 4 in spec.verify and 4 in spec.chains  # no eager fallback passes silently
        for _ in range(3):
            for t, s_ in zip(tensors, snap):
                t.copy_(s_)
            b = ForwardBatch.build(layout, [], "cuda")
            h = kf.forward(b).clone()
            assert spec.whole_step(b, y.numel())
            d = spec.chain(y, None).tolist()
            torch.cuda.synchronize()
            results.append((h, [t[:, 1:].clone() for t in tensors], d))  # slot/page 0: sinks
    h0, t0, d0 = results[0]
    assert [r[0] for r in d0] == [2, 0, 1]
    for h, t, d in results[1:]:
        assert torch.equal(h, h0) and d == d0
        assert all(torch.equal(a, b_) for a, b_ in zip(t, t0))


@pytest.mark.parametrize("method", ["ngram", "ngram+mtp"])
def test_engine_with_prompt_lookup_drafts_on_the_nano_model(method):
    """Prompt-lookup drafts on the GPU (the nano checkpoint, bf16, graphs): with prompt lookup
    alone no MTP head is loaded and only the verify graphs are captured (the host accepts and
    commits the verify graph's snapshots); beside the MTP head, lookup drafts go through the
    device chain. Three requests that quote their prompts, against the engine without drafts:
    the first tokens and the lengths (bf16: a verify GEMM of several rows may round an argmax
    otherwise than one row, kb/0033), drafts kept, verify graphs replayed."""
    from pathlib import Path

    import tailored
    from tailored.engine.types import SamplingParams
    from tailored.stack import build_stack

    nano = Path(tailored.__file__).parent / "data" / "nano"
    texts = ["Permission is hereby granted, free of charge, to any person obtaining a copy of "
             "this software, to deal in the Software without restriction.\n\nQuoted again:\n\n"
             "Permission is hereby granted, free of charge, to any person",
             "This program is free software; you can redistribute it and/or modify it under "
             "the terms of the GNU General Public License.\n\nThe notice reads: \"This program "
             "is free software;",
             "def parse_args(argv):\n    parser = argparse.ArgumentParser()\n"
             "    parser.add_argument('--input', default=None)\n"
             "    return parser.parse_args(argv)\n\n\ndef parse_args(argv):\n"]
    outs, engines = {}, {}
    for n in (0, 3):
        st = build_stack(nano, device="cuda", progress=False, max_model_len=512,
                         max_num_seqs=4, num_speculative_tokens=n, speculative_method=method,
                         spec_max_running=4, prefill_graphs=False)
        eng = engines[n] = st.engine
        for i, t in enumerate(texts):
            eng.add_request(f"r{i}", st.tokenizer.encode(t),
                            SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
        got = {}
        while eng.has_unfinished():
            for o in eng.step():
                got.setdefault(o.request_id, []).extend(o.delta_token_ids)
        outs[n] = got
    eng = engines[3]
    spec = eng.runner.kernel.spec
    assert spec is not None and spec.verify
    if method == "ngram":
        assert eng.runner.model.mtp is None and not spec.has_mtp and not spec.mtp
    else:
        assert spec.has_mtp and spec.chains
    verify, drafted, kept = eng.runner.spec_stats
    assert kept > 0.3 * drafted
    for r in outs[0]:
        assert len(outs[3][r]) == 40 and outs[3][r][:8] == outs[0][r][:8]
    same = sum(outs[3][r] == outs[0][r] for r in outs[0])
    print(f"{method}: {same} of {len(outs[0])} completions identical, {kept}/{drafted} kept")
