"""Async scheduling (kb/0025): a request whose logits hold a NaN at every step is recomputed
once, then never launched ahead again (the synchronous engine's fallback each step), instead of
being preempted and recomputed every other token."""

import pytest

import tailored.worker.runner as R
from tailored.engine.types import SamplingParams
from test_async_fuzz import ids, make, run

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def tok(qwen_tok):
    return qwen_tok


def test_persistent_nan_row_is_recomputed_once_not_every_other_token(tiny_model, tok, monkeypatch):
    orig = R.sample_on_device

    def sod(logits, seqs):
        for i, s in enumerate(seqs):
            if s.request_id == "nan":
                logits = logits.clone()
                logits[i, 17] = float("nan")  # one NaN entry: fallback == the normal argmax
        return orig(logits, seqs)

    monkeypatch.setattr(R, "sample_on_device", sod)
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    script = {0: [("add", "nan", ids(50, 1), sp), ("add", "ok", ids(20, 2), sp)]}
    res = {}
    for on in (False, True):
        e = make(tiny_model, tok, on, max_model_len=128, budget=256)
        orig_launch = e.runner.launch
        tokens = [0]

        def launch(sched, feed=None, _o=orig_launch, _t=tokens):
            _t[0] += sched.num_tokens
            return _o(sched, feed=feed)

        e.runner.launch = launch
        out = run(e, script)
        res[on] = (out, tokens[0])
    (a, ta), (b, tb) = res[False], res[True]
    assert a["toks"] == b["toks"]
    print("sync: preemptions", a["stats"]["num_preemptions"], "tokens computed", ta)
    print("async: preemptions", b["stats"]["num_preemptions"], "tokens computed", tb)
    assert b["stats"]["num_preemptions"] <= 2 and tb < 1.5 * ta, (b["stats"], ta, tb)
