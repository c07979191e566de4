"""Prompt-lookup (n-gram) drafts through the engine (engine/prompt_lookup.py, engine/drafting.py;
the runner's host acceptance, worker/spec_decoding.py): CPU, the nano checkpoint, plain path.

The invariant: a greedy request's tokens, text and finish reason are those without drafts, alone
and beside the MTP head's drafts, with fixed and adaptive draft lengths, across stop ids and
strings inside accepted blocks, max_tokens, min_tokens, prefix-cache hits, preemption, async
scheduling and a batch of drafting and non-drafting (sampled, penalised) requests. With prompt
lookup alone no MTP head is loaded or run. (The kernel path's verify graphs without an MTP
layer: tests/worker/test_kernel_path.py.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import stop_id_cases

import tailored
from tailored.config import EngineConfig
from tailored.engine.scheduler import Scheduler
from tailored.engine.types import ModelOutput, Request, SamplingParams
from tailored.stack import build_stack
from tailored.tokenizer import load_tokenizer

NANO = Path(tailored.__file__).parent / "data" / "nano"
pytestmark = pytest.mark.usefixtures("one_thread")

# text the nano model copies (licence texts are in its training data; docs/nano.md), and code
QUOTE = ("Permission is hereby granted, free of charge, to any person obtaining a copy of this "
         "software and associated documentation files (the \"Software\"), to deal in the "
         "Software without restriction, including without limitation the rights to use, copy, "
         "modify, merge, publish, distribute, sublicense.\n\nQuoted again:\n\nPermission is "
         "hereby granted, free of charge, to any person")
GPL = ("This program is free software; you can redistribute it and/or modify it under the "
       "terms of the GNU General Public License as published by the Free Software Foundation; "
       "either version 2 of the License.\n\nThe notice reads: \"This program is free software;")
CODE = ("def parse_args(argv):\n    parser = argparse.ArgumentParser()\n"
        "    parser.add_argument('--input', default=None)\n"
        "    parser.add_argument('--verbose', action='store_true')\n"
        "    return parser.parse_args(argv)\n\n\ndef parse_args(argv):\n")
PROMPTS = [QUOTE, GPL, CODE]


def _stack(n: int = 0, **kw):
    kw.setdefault("max_model_len", 512)
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("async_scheduling", False)
    if n:
        kw.setdefault("speculative_method", "ngram")
        kw.setdefault("spec_max_running", 8)
    return build_stack(NANO, device="cpu", dtype="float32", progress=False, kernels="off",
                       num_speculative_tokens=n, **kw)


def _run(engine, reqs):
    """reqs: {id: (prompt ids, SamplingParams)} → ({id: ids}, {id: finish reason}, {id: text})."""
    for rid, (ids, sp) in reqs.items():
        engine.add_request(rid, ids, sp)
    out, why, text, steps = {}, {}, {}, 0
    while engine.has_unfinished():
        for o in engine.step():
            assert o.error is None, o.error
            out.setdefault(o.request_id, []).extend(o.delta_token_ids)
            text[o.request_id] = text.get(o.request_id, "") + o.delta_text
            assert o.num_output_tokens == len(out[o.request_id])
            if o.finished:
                why[o.request_id] = o.finish_reason
        steps += 1
        assert steps < 5000
    return out, why, text


def _greedy(n: int = 40, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(NANO)


@pytest.fixture(scope="module")
def reqs(tok):
    return {f"p{i}": (tok.encode(p), _greedy()) for i, p in enumerate(PROMPTS)}


@pytest.fixture(scope="module")
def plain(reqs):
    return _run(_stack(0).engine, reqs)


@pytest.mark.parametrize("method,min_acceptance", [("ngram", 0.0), ("ngram", 0.5),
                                                    ("ngram+mtp", 0.5)])
def test_greedy_output_unchanged_by_ngram_drafts(plain, reqs, method, min_acceptance):
    st = _stack(4, speculative_method=method, spec_min_acceptance=min_acceptance)
    eng = st.engine
    assert _run(eng, reqs) == plain
    verify, drafted, kept = eng.runner.spec_stats
    # the quoted licence is copied: most lookups' drafts are kept
    assert verify > 0 and kept > 0.5 * drafted
    runner = eng.runner
    if method == "ngram":  # no MTP head: not built, no KV layer for it, no drafter
        assert runner.model.mtp is None and runner.spec.drafter is None
        assert runner.cache.k.shape[0] == len(st.model_config.attn_layers)
    else:
        assert runner.spec.drafter is not None


def test_stops_and_limits_inside_accepted_blocks(plain, tok):
    """A stop id at each of the first 12 output positions, max_tokens just below, at and above
    it, and stop strings ending at several positions: 4 n-gram drafts a step end each request
    where the engine without drafts does (ids, text, finish reason)."""
    ref = plain[0]["p0"]
    ids = tok.encode(QUOTE)
    cases = stop_id_cases(ids, ref, 12)
    text = tok.decode(ref)
    for k, end in enumerate(range(5, len(text), max(1, len(text) // 10))):
        cases[f"str{k}"] = (ids, _greedy(stop=[text[end - 3:end]]))
    engines = (_stack(0).engine, _stack(4, spec_min_acceptance=0).engine)
    for rid, (p, sp) in cases.items():  # one at a time: each drafts from its first step
        want, got = (_run(e, {rid: (p, sp)}) for e in engines)
        assert got == want, rid
    assert engines[1].runner.spec_stats[2] > 0


def test_a_batch_of_drafting_and_non_drafting_requests(plain, reqs, tok):
    """Greedy requests that draft beside seeded sampled ones, a penalised greedy one and one
    with min_tokens (none of which draft), all at once, with the MTP's drafts too: every
    request's tokens are those without drafts."""
    batch = dict(reqs)
    for i, p in enumerate(PROMPTS):
        batch[f"s{i}"] = (tok.encode(p), SamplingParams(max_tokens=24, temperature=0.8,
                                                        top_p=0.9, seed=3 + i, ignore_eos=True))
    batch["pen"] = (tok.encode(CODE), _greedy(24, repetition_penalty=1.2))
    batch["min"] = (tok.encode(GPL), SamplingParams(max_tokens=24, temperature=0,
                                                    min_tokens=20))
    base = _run(_stack(0).engine, batch)
    for method in ("ngram", "ngram+mtp"):
        eng = _stack(3, speculative_method=method).engine
        assert _run(eng, batch) == base
        assert eng.runner.spec_stats[2] > 0


def test_prefix_cache_hits_and_preemption(plain, reqs, tok):
    """Prompts that extend earlier ones (a chat's next turn) start from the prefix cache's
    entries, and the prompts run in a KV pool too small to hold them all at once (preempted
    requests recompute): the tokens without drafts and without the cache."""
    eng = _stack(3, prefix_cache_entries=4).engine
    assert _run(eng, reqs) == plain
    more = tok.encode("\n\nAnd once more: ")
    longer = {f"{rid}b": (ids + more, sp) for rid, (ids, sp) in reqs.items()}
    got = _run(eng, longer)
    assert eng.scheduler.prefix.hits > 0
    assert got == _run(_stack(0).engine, longer)
    eng = _stack(3, num_pages=16, max_model_len=128).engine
    assert _run(eng, reqs) == plain
    assert eng.scheduler.num_preemptions > 0 and eng.runner.spec_stats[2] > 0


def test_async_scheduling_with_ngram_drafts(plain, reqs):
    """Async scheduling on: a step whose requests draft next is not launched ahead (their
    drafts follow the token it samples); outputs unchanged."""
    eng = _stack(3, async_scheduling=True).engine
    assert eng._async
    assert _run(eng, reqs) == plain
    assert eng.runner.spec_stats[2] > 0


# ---- the scheduler's side (engine/drafting.py) --------------------------------------------------
def _sched(n=3, **kw) -> Scheduler:
    ec = EngineConfig(num_speculative_tokens=n, speculative_method=kw.pop("method", "ngram"),
                      max_num_batched_tokens=64, max_model_len=256, spec_max_running=4, **kw)
    return Scheduler(ec, num_pages=64, num_slots=9)


def _step(s: Scheduler, tokens: dict, extra: dict | None = None):
    out = s.schedule()
    s.advance(out)
    s.resolve(out, ModelOutput(tokens, extra_ids=extra or {}))
    return out


def test_scheduler_proposes_lookup_drafts_without_the_mtp():
    s = _sched()
    req = Request("r", [5, 6, 7, 8, 9, 5, 6], SamplingParams(max_tokens=20, temperature=0))
    s.add(req)
    first = _step(s, {"r": 7})  # the prompt: its token 7 makes "5 6 7" end the context
    assert not first.seqs[0].mtp and first.seqs[0].num_propose == 0
    out = s.schedule()
    seq = out.seqs[0]
    assert seq.token_ids == (7, 8, 9, 5) and seq.num_draft == 3 and not seq.mtp
    assert not s.can_schedule_ahead(out)  # the next step drafts after this step's tokens
    s.advance(out)
    s.resolve(out, ModelOutput({"r": 8}, extra_ids={"r": (9, 3)}))  # 2 of 3 drafts kept
    assert req.output_ids == [7, 8, 9, 3] and req.num_computed_tokens == 10
    assert s.drafts.pace(req).rate(0) == 1.0 and s.drafts.pace(req).rate(2) < 1.0
    # sampled requests never look up
    s.add(Request("t", [5, 6, 5, 6], SamplingParams(max_tokens=8, temperature=0.7)))
    assert all(q.num_draft == 0 for q in s.schedule().seqs if q.request_id == "t")


def test_async_steps_wait_for_drafting_requests_and_paused_ones_run_ahead():
    s = _sched(2)
    req = Request("r", [1, 2, 3, 4], SamplingParams(max_tokens=100, temperature=0))
    s.add(req)
    out = _step(s, {"r": 9})  # no match for "4 9": a dry lookup at the next step
    out = s.schedule()
    assert out.seqs[0].num_draft == 0
    assert not s.can_schedule_ahead(out)  # still drafting: the next step waits for the token
    pace = s.drafts.pace(req)
    assert pace.rate(0) < 1.0  # the dry lookup counted as a rejected draft
    s.advance(out)
    s.resolve(out, ModelOutput({"r": 10}))
    for t in range(11, 30):  # never a match: the request pauses
        if not pace.active:
            break
        out = _step(s, {"r": t})
    assert not pace.active
    out = s.schedule()  # paused: a plain decode row that may run ahead (and counts the wait)
    assert out.seqs[0].num_draft == 0 and s.can_schedule_ahead(out)
    assert pace.wait < pace.next_wait


def test_config_and_cli_names():
    with pytest.raises(ValueError, match="speculative_method"):
        EngineConfig(speculative_method="eagle")
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineConfig(prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="spec_min_acceptance"):
        EngineConfig(spec_min_acceptance=1.5)
    ec = EngineConfig(num_speculative_tokens=2, speculative_method="ngram")
    assert ec.uses_ngram and not ec.uses_mtp
    ec = EngineConfig(num_speculative_tokens=2, speculative_method="ngram+mtp")
    assert ec.uses_ngram and ec.uses_mtp
    assert not EngineConfig(speculative_method="ngram").uses_ngram  # no drafts at all
    assert EngineConfig().spec_max_running == 2


# ---- the kernel path: verify graph bodies without an MTP layer --------------------------------
@pytest.mark.parametrize("method", ["ngram", "ngram+mtp"])
def test_kernel_path_verifies_lookup_drafts(tiny4_ckpt, monkeypatch, method):
    """Prompt lookup on the kernel path (Triton's interpreter, random tiny weights):
    `KernelForward.forward` sends verify steps to the verify graph's body (no graph captured:
    the body runs eagerly, as a replay computes it). Alone: a SpecGraphs with no MTP layer,
    whose snapshots the host path commits (`HybridCache.commit_many` from `kept_batch`).
    Beside the MTP head: the device chain accepts lookup drafts (host ids) and MTP drafts left
    on the device (placeholders) alike. Random weights never repeat a prompt, so the lookup is
    replaced by the plain run's next tokens with wrong ones among them (every kept count
    happens), and by nothing at some steps (the MTP's drafts then). Tokens: the plain path's
    without drafts."""
    from tailored import kernels
    from tailored.engine.drafting import Drafting
    from tailored.worker.spec_graphs import SpecGraphs

    if not kernels.available():
        pytest.skip("triton not installed")
    prompts = {"a": [11, 12, 13, 14, 15, 16] * 2, "b": [7, 8, 9], "c": [21, 22, 23, 21, 22]}
    n = {"a": 9, "b": 6, "c": 5}
    outs = {}

    def stack(kernels_, drafts):
        return build_stack(tiny4_ckpt, device="cpu", dtype="float32", progress=False,
                           kernels=kernels_, max_model_len=64, max_num_seqs=4, num_pages=24,
                           async_scheduling=False, num_speculative_tokens=drafts,
                           speculative_method=method, spec_min_acceptance=0,
                           spec_max_running=4).engine

    def generate(eng):
        for rid, p in prompts.items():
            eng.add_request(rid, p, SamplingParams(max_tokens=n[rid], temperature=0,
                                                   ignore_eos=True))
        return _run(eng, {})[0]

    outs["plain"] = generate(stack("off", 0))

    def lookup(self, req, k):
        m = len(req.output_ids)
        want = outs["plain"][req.request_id][m:m + k]
        if method == "ngram+mtp" and m % 4 == 1:
            return []
        return [t + 1 for t in want] if m % 3 == 0 else want[:-1] + [want[-1] + (m % 2)]

    monkeypatch.setattr(Drafting, "lookup", lookup)
    eng = stack("on", 2)
    kf = eng.runner.kernel
    kf.spec = SpecGraphs(kf.km, kf.pool, 2, 4, kf.max_pages)
    if method == "ngram":
        assert not kf.spec.has_mtp and eng.runner.spec.drafter is None
    else:
        assert kf.spec.has_mtp
        eng.runner.spec.drafter.spec = kf.spec
    kf.use_graphs = True
    kf.decode.forward = kf.km.forward_eager  # no decode graph: what a replay computes
    calls = []
    for name in ("verify_body", "chain_body"):
        body = getattr(kf.spec, name)
        setattr(kf.spec, name, lambda B, body=body, name=name: calls.append(name) or body(B))
    outs["verify"] = generate(eng)
    assert outs["verify"] == outs["plain"]
    verify, drafted, kept = eng.runner.spec_stats
    assert "verify_body" in calls and 0 < kept < drafted
    assert ("chain_body" in calls) == (method == "ngram+mtp")
