"""Async scheduling (kb/0025): randomized differential tests, async on vs off on the same
script of adds and aborts per step (greedy, seeded, penalty requests; stop ids, EOS, stop
strings; max_tokens 1-2; prompts near max_model_len; page pressure with preemptions; NaN rows):
tokens, texts, finish reasons, output counts, one final output each, idle stats at the end."""

from __future__ import annotations

import os
import random

import pytest
import torch

from tailored.config import EngineConfig
from tailored.engine.engine import Engine
from tailored.engine.scheduler import PENDING_TOKEN
from tailored.engine.types import SamplingParams
from tailored.worker.runner import ModelRunner

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def tok(qwen_tok):
    return qwen_tok


def make(model, tok, on, **kw):
    ec = EngineConfig(page_size=kw.pop("page_size", 4), max_num_seqs=kw.pop("max_num_seqs", 6),
                      max_num_batched_tokens=kw.pop("budget", 64),
                      max_model_len=kw.pop("max_model_len", 96), device="cpu", dtype="float32",
                      async_scheduling=on, **kw)
    runner = ModelRunner(model, model.config, ec, "cpu", model.lm_head.weight.dtype)
    return Engine(model.config, ec, runner, tok)


def ids(n, seed):
    return torch.randint(0, 248044, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(engine, script, eos=None):
    if eos is not None:
        engine.eos_token_ids = tuple(eos)
    idle = engine.stats()
    toks, text, why, finals = {}, {}, {}, {}
    n = 0
    last = max(script) if script else 0
    while True:
        for cmd in script.get(n, []):
            if cmd[0] == "add":
                try:
                    engine.add_request(cmd[1], cmd[2], cmd[3])
                except ValueError:
                    SKIP[0] += 1
                    continue
                toks[cmd[1]], text[cmd[1]] = [], ""
            else:
                engine.abort_request(cmd[1])
        if not engine.has_unfinished() and n > last:
            break
        outs = engine.step()
        AHEAD[0] += engine._inflight is not None
        for o in outs:
            assert PENDING_TOKEN not in o.delta_token_ids
            assert o.request_id not in why, f"output after final for {o.request_id}"
            toks[o.request_id] += o.delta_token_ids
            text[o.request_id] += o.delta_text
            if o.finished:
                why[o.request_id] = o.finish_reason
                finals[o.request_id] = (o.num_output_tokens, o.error)
        n += 1
        assert n < 3000
    st = engine.stats()
    return dict(toks=toks, text=text, why=why, finals=finals, stats=st, idle=idle)


def rand_script(rng, n_req, max_model_len, vocab_toks, max_step=30, abort_p=0.2):
    script = {}
    aborted = set()
    for i in range(n_req):
        rid = f"r{i}"
        step = rng.randrange(0, max_step)
        plen = rng.choice([1, 2, 3, 5, 8, 13, 20, 33, rng.randrange(1, max_model_len - 1)])
        mt = rng.choice([1, 2, 3, 4, 7, 12, 25])
        mt = max(1, min(mt, max_model_len - plen))
        kind = rng.choice(KINDS)
        kw = dict(max_tokens=mt, temperature=0.0, ignore_eos=True)
        if kind == "seeded":
            kw.update(temperature=rng.choice([0.7, 1.0]), top_p=rng.choice([1.0, 0.9]),
                      top_k=rng.choice([0, 5]), min_p=rng.choice([0.0, 0.05]), seed=rng.randrange(1000))
        elif kind == "pen":
            kw.update(repetition_penalty=rng.choice([1.0, 1.3]), presence_penalty=rng.choice([0.0, 0.5]),
                      frequency_penalty=0.2)
        elif kind == "stopid":
            kw.update(stop_token_ids=rng.sample(vocab_toks, min(3, len(vocab_toks))))
        elif kind == "eos":
            kw.update(ignore_eos=False)
        elif kind == "stopstr":
            kw.update(stop=[rng.choice(["a", "e", " ", "th", "\n", "in"])],
                      include_stop_str_in_output=rng.random() < 0.5)
        script.setdefault(step, []).append(("add", rid, ids(plen, 1000 + i + 7 * rng.randrange(99)),
                                            SamplingParams(**kw)))
        if rng.random() < abort_p:
            script.setdefault(step + rng.randrange(0, 12), []).append(("abort", rid))
            aborted.add(rid)
    return script, aborted


def compare(a, b, aborted):
    assert b["idle"] == a["idle"]
    for name in (a, b):
        assert name["stats"]["free_pages"] == name["idle"]["free_pages"], name["stats"]
        assert name["stats"]["free_slots"] == name["idle"]["free_slots"], name["stats"]
        assert name["stats"]["running"] == 0 and name["stats"]["waiting"] == 0
    assert set(a["why"]) == set(b["why"]) == set(a["toks"]), (set(a["why"]), set(b["why"]))
    for rid in a["toks"]:
        if rid in aborted:
            x, y = a["toks"][rid], b["toks"][rid]
            k = min(len(x), len(y))
            assert x[:k] == y[:k], (rid, x, y)
            continue
        assert a["toks"][rid] == b["toks"][rid], (rid, a["toks"][rid], b["toks"][rid])
        assert a["text"][rid] == b["text"][rid], rid
        assert a["why"][rid] == b["why"][rid], rid
        assert a["finals"][rid] == b["finals"][rid], rid


_PROBED = {}


def probe_tokens(model, tok):
    """The 8 tokens the model emits most (stop ids and EOS for the scripts); the same for a
    model every time, so worked out once per model (and NaN injection on or off) a process."""
    key = (id(model), NAN["on"])
    if key not in _PROBED:
        _PROBED[key] = (model, _probe_tokens(model, tok))
    return list(_PROBED[key][1])


def _probe_tokens(model, tok):
    e = make(model, tok, False)
    out = run(e, {0: [("add", f"p{i}", ids(7 + 5 * i, 77 + i), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)) for i in range(4)]})
    from collections import Counter
    c = Counter(t for v in out["toks"].values() for t in v)
    return [t for t, _ in c.most_common(8)]


KINDS = ["greedy", "greedy", "greedy", "seeded", "seeded", "pen", "stopid", "stopstr", "eos", "eos"]
AHEAD = [0]
SKIP = [0]
# 4 seeds a config: every config that ever preempts (4 of 7), stops or aborts does so within
# seeds 0-3 (seeds 4-5 added none of these to any config); more: FUZZ_SEEDS=30 (the review
# ran 30)
SEEDS = int(os.environ.get("FUZZ_SEEDS", "4"))


@pytest.mark.parametrize("cfg", [
    dict(),
    dict(num_pages=14),
    dict(num_pages=10, max_num_seqs=4, budget=16),
    dict(max_model_len=40, page_size=8, budget=24),
    dict(budget=8, max_num_seqs=3),
    dict(max_num_seqs=2, num_pages=12),
    dict(page_size=16, max_model_len=64, num_pages=6, budget=32),
])
def test_fuzz_async_vs_sync(tiny_model, tok, cfg):
    common = probe_tokens(tiny_model, tok)
    fails = []
    for seed in range(SEEDS):
        rng = random.Random(seed * 31 + len(str(cfg)))
        mml = cfg.get("max_model_len", 96)
        script, aborted = rand_script(rng, rng.randrange(2, 9), mml, common)
        # requests that cannot ever fit (num_pages) are dropped from the script
        eos = common[:2]
        try:
            a = run(make(tiny_model, tok, False, **cfg), script, eos=eos)
        except ValueError:
            SKIP[0] += 1
            continue
        b = run(make(tiny_model, tok, True, **cfg), script, eos=eos)
        try:
            compare(a, b, aborted)
        except AssertionError as e:
            fails.append((seed, str(e)[:400]))
    print("ahead", AHEAD, "skip", SKIP, "seeds", SEEDS)
    assert not fails, fails


NAN = {"on": False}


@pytest.fixture
def nan_injection(monkeypatch):
    import tailored.worker.runner as R
    orig = R.sample_on_device

    def sod(logits, seqs):
        if NAN["on"]:
            rows = [i for i, s in enumerate(seqs)
                    if hash((s.request_id, s.num_generated)) % 5 == 0]
            if rows:
                logits = logits.clone()
                for i in rows:
                    logits[i, 17 + (i % 3)] = float("nan")
        return orig(logits, seqs)

    monkeypatch.setattr(R, "sample_on_device", sod)
    NAN["on"] = True
    yield
    NAN["on"] = False


@pytest.mark.parametrize("cfg", [dict(), dict(num_pages=14)])
def test_fuzz_with_nan_rows(tiny_model, tok, cfg, nan_injection):
    import os as _os
    _os.environ["PYTHONHASHSEED"] = "0"
    common = probe_tokens(tiny_model, tok)
    fails = []
    for seed in range(SEEDS):
        rng = random.Random(seed * 17 + 5)
        mml = cfg.get("max_model_len", 96)
        script, aborted = rand_script(rng, rng.randrange(2, 9), mml, common)
        a = run(make(tiny_model, tok, False, **cfg), script, eos=common[:2])
        b = run(make(tiny_model, tok, True, **cfg), script, eos=common[:2])
        try:
            compare(a, b, aborted)
        except AssertionError as e:
            fails.append((seed, str(e)[:400]))
    print("ahead", AHEAD, "skip", SKIP, "pre", a["stats"], b["stats"])
    assert not fails, fails
