"""min_tokens (SamplingParams.min_tokens, vLLM's and SGLang's): EOS and the stop token ids are
masked in the sampler and stop strings not looked for until that many tokens are out; such a
request does not draft, and beside requests that do (speculative decoding on the nano
model's MTP head) its tokens and theirs are those without drafts. The nano checkpoint, CPU;
streaming, n and structured output through the server: tests/server/test_evaluation.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import tailored
from tailored.engine.types import FinishReason, SamplingParams
from tailored.stack import build_stack

pytestmark = pytest.mark.usefixtures("one_thread")

NANO = Path(tailored.__file__).parent / "data" / "nano"
PROMPT = "import os\n\nclass Reader:\n    def __init__(self"


@pytest.fixture(scope="module")
def engines():
    """{num_speculative_tokens: engine}, built on first use."""
    built = {}

    def get(spec: int):
        if spec not in built:
            built[spec] = build_stack(NANO, device="cpu", dtype="float32", progress=False,
                                      kernels="off", max_model_len=256, max_num_seqs=4,
                                      num_speculative_tokens=spec).engine
        return built[spec]

    return get


def run(engine, reqs: dict) -> dict:
    """reqs: {id: (prompt ids, SamplingParams)} → {id: (output ids, text, finish reason)}."""
    for rid, (ids, sp) in reqs.items():
        engine.add_request(rid, ids, sp)
    ids, text, why, steps = {r: [] for r in reqs}, dict.fromkeys(reqs, ""), {}, 0
    while engine.has_unfinished():
        for o in engine.step():
            assert o.error is None, o.error
            ids[o.request_id] += o.delta_token_ids
            text[o.request_id] += o.delta_text
            if o.finished:
                why[o.request_id] = o.finish_reason
        steps += 1
        assert steps < 1000
    return {r: (ids[r], text[r], why[r]) for r in reqs}


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)


def test_stop_ids_wait_for_min_tokens_beside_drafting_requests(engines):
    """The greedy output's 2nd token as a stop id ends it there; with min_tokens 6 it and EOS
    cannot come before the 7th token. With speculative decoding the min_tokens request and a
    drafting greedy one beside it give the tokens they give without drafts."""
    e0 = engines(0)
    tok = e0.tokenizer
    prompt = tok.encode(PROMPT)
    free = run(e0, {"f": (prompt, greedy(12, ignore_eos=True))})["f"][0]
    stop = free[1]
    plain = run(e0, {"s": (prompt, greedy(12, stop_token_ids=[stop]))})["s"]
    assert plain[0] == free[:2] and plain[2] is FinishReason.STOP
    reqs = {"m": (prompt, greedy(12, stop_token_ids=[stop], min_tokens=6)),
            "g": (tok.encode("def fibonacci(n):"), greedy(24, ignore_eos=True))}
    want = run(e0, reqs)
    out, _, _ = want["m"]
    banned = {stop, *e0.eos_token_ids}
    assert len(out) >= 7 and not banned & set(out[:6])
    assert out[0] == free[0]  # (the first token was no stop id anyway)
    e2 = engines(2)
    before = e2.runner.spec_stats[1]
    assert run(e2, reqs) == want
    assert e2.runner.spec_stats[1] > before  # the greedy request drafted meanwhile


def test_stop_strings_wait_for_min_tokens(engines):
    """Every token forced to "a" (logit_bias), stop "a": the first match counts only after
    min_tokens tokens, so 4 of them are the text and the 5th ends it (kept with
    include_stop_str_in_output); without min_tokens the answer is empty."""
    e = engines(0)
    a = e.tokenizer.encode("a")
    assert len(a) == 1
    prompt = e.tokenizer.encode(PROMPT)
    force = {a[0]: 100.0}
    got = run(e, {
        "none": (prompt, greedy(10, stop=["a"], logit_bias=force)),
        "min4": (prompt, greedy(10, stop=["a"], logit_bias=force, min_tokens=4)),
        "kept": (prompt, greedy(10, stop=["a"], logit_bias=force, min_tokens=4,
                                include_stop_str_in_output=True)),
    })
    assert got["none"][1:] == ("", FinishReason.STOP)
    assert got["min4"][1:] == ("aaaa", FinishReason.STOP) and len(got["min4"][0]) == 5
    assert got["kept"][1:] == ("aaaaa", FinishReason.STOP)


def test_eos_waits_for_min_tokens(engines):
    """EOS pushed to the top (logit_bias) comes as the token after the min_tokens-th."""
    e = engines(0)
    eos = e.eos_token_ids[0]
    prompt = e.tokenizer.encode(PROMPT)
    for m in (0, 1, 5):
        ids, _, why = run(e, {"r": (prompt, greedy(10, min_tokens=m,
                                                     logit_bias={eos: 100.0}))})["r"]
        assert ids[-1] == eos and len(ids) == m + 1 and why is FinishReason.STOP
