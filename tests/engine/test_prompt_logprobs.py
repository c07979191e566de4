"""Prompt logprobs (SamplingParams.prompt_logprobs; worker/prompt_logprobs.py) equal
transformers' log-softmax over the same weights (tiny model, fp32, CPU) at every prompt
position: a request alone, its prompt split over many chunks, after a prefix-cache hit was
there to take (such a request takes none), and in a batch beside other requests (async
scheduling on); the request's tokens do not change with them, and max_tokens 0 gives the
prompt alone. The server's shapes of them: tests/server/test_evaluation.py.
"""

from __future__ import annotations

import pytest
import torch

from tailored.config import EngineConfig
from tailored.engine.engine import Engine
from tailored.engine.types import FinishReason, SamplingParams
from tailored.worker.runner import ModelRunner

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 2e-4  # fp32, ours against transformers' (reductions in another order)


def make(model, tok, budget: int = 512, entries: int = 0, on: bool = False) -> Engine:
    ec = EngineConfig(page_size=16, max_num_seqs=8, max_num_batched_tokens=budget,
                      max_model_len=512, device="cpu", dtype="float32", async_scheduling=on,
                      prefix_cache_entries=entries)
    runner = ModelRunner(model, model.config, ec, "cpu", model.lm_head.weight.dtype)
    return Engine(model.config, ec, runner, tok)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 248044, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def sp(max_tokens: int = 3, prompt_logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                          prompt_logprobs=prompt_logprobs)


def run(engine: Engine, script: dict) -> dict:
    """script: {step: [(rid, prompt, SamplingParams)]}: added before that step. Returns
    {rid: {"ids": output ids, "plp": the prompt logprobs, "finish": reason}}; the prompt
    logprobs must come exactly once, with the request's first output."""
    out, n = {}, 0
    while engine.has_unfinished() or n <= max(script):
        for rid, prompt, params in script.get(n, []):
            engine.add_request(rid, prompt, params)
            out[rid] = {"ids": [], "plp": None, "outputs": 0}
        for o in engine.step():
            assert o.error is None, o.error
            r = out[o.request_id]
            if r["outputs"] == 0:
                r["plp"] = o.prompt_logprobs
            else:
                assert o.prompt_logprobs is None, "prompt logprobs came twice"
            r["outputs"] += 1
            r["ids"] += o.delta_token_ids
            if o.finished:
                r["finish"] = o.finish_reason
        n += 1
        assert n < 2000
    return out


def check(hf_model, prompt: list[int], plp, k: int) -> None:
    """One entry per prompt token: None for the first, then the token's logprob, its rank and
    the k most likely tokens, each as transformers' log-softmax gives them."""
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), -1)
    assert plp is not None and len(plp) == len(prompt) and plp[0] is None
    for p in range(1, len(prompt)):
        row, lp = ref[p - 1], plp[p]
        want = row[prompt[p]].item()
        assert abs(lp.logprob - want) <= TOL, (p, lp.logprob, want)
        # rank: 1 + the tokens more likely; near-ties within the tolerance may go either way
        lo = int((row > want + TOL).sum()) + 1
        hi = int((row >= want - TOL).sum())
        assert lo <= lp.rank <= hi, (p, lp.rank, lo, hi)
        assert len(lp.top) == k
        kth = row.topk(k).values[-1].item() if k else 0.0
        for i, v in lp.top:
            assert abs(v - row[i].item()) <= TOL and row[i].item() >= kth - TOL, (p, i, v)
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)


def test_alone_every_position_and_the_same_tokens(tiny_model, hf_model, qwen_tok):
    prompt = ids(40, 1)
    got = run(make(tiny_model, qwen_tok), {0: [("a", prompt, sp(4, 3)), ("b", prompt, sp(4))]})
    check(hf_model, prompt, got["a"]["plp"], 3)
    assert got["b"]["plp"] is None  # not asked: none
    assert got["a"]["ids"] == got["b"]["ids"] and len(got["a"]["ids"]) == 4


@pytest.mark.contract("prompt-logprobs-equal-reference")
def test_across_chunked_prefill(tiny_model, hf_model, qwen_tok):
    """A 70-token prompt in chunks of at most 16 (the LM head runs chunk by chunk)."""
    prompt = ids(70, 2)
    got = run(make(tiny_model, qwen_tok, budget=16), {0: [("a", prompt, sp(2, 2))]})
    check(hf_model, prompt, got["a"]["plp"], 2)


@pytest.mark.contract("prompt-logprobs-equal-reference")
def test_after_a_prefix_cache_entry_of_the_same_prefix(tiny_model, hf_model, qwen_tok):
    """A cached prefix would skip positions: the request takes no hit and is still exact; a
    request without prompt logprobs after it hits as usual."""
    p = ids(70, 3)  # (entries start at 64 tokens)
    q = p + ids(20, 4)
    e = make(tiny_model, qwen_tok, entries=2)
    got = run(e, {0: [("a", p, sp(2))], 6: [("b", q, sp(2, 1))]})
    assert e.scheduler.prefix.hits == 0
    check(hf_model, q, got["b"]["plp"], 1)
    again = run(e, {0: [("c", q, sp(2))]})
    assert e.scheduler.prefix.hits > 0  # the entries were there to take
    assert again["c"]["ids"] == got["b"]["ids"]


@pytest.mark.contract("prompt-logprobs-equal-reference")
def test_in_a_batch_with_other_requests(tiny_model, hf_model, qwen_tok):
    """Beside decoding requests and other prompts, with async scheduling and chunks of 24:
    each asking request exact, the others' tokens as when alone; max_tokens 0 with prompt
    logprobs is the prompt alone (no token, finished by length)."""
    a, b, c, d = ids(30, 5), ids(45, 6), ids(20, 7), ids(33, 8)
    script = {0: [("a", a, sp(8)), ("b", b, sp(3, 2))],
              2: [("c", c, sp(0, 0)), ("d", d, sp(6))]}
    got = run(make(tiny_model, qwen_tok, budget=24, on=True), script)
    check(hf_model, b, got["b"]["plp"], 2)
    check(hf_model, c, got["c"]["plp"], 0)
    assert got["c"]["ids"] == [] and got["c"]["finish"] is FinishReason.LENGTH
    assert got["c"]["outputs"] == 1
    alone = run(make(tiny_model, qwen_tok), {0: [("a", a, sp(8)), ("d", d, sp(6))]})
    assert got["a"]["ids"] == alone["a"]["ids"] and got["d"]["ids"] == alone["d"]["ids"]


def test_bad_values_are_refused(tiny_model, qwen_tok):
    e = make(tiny_model, qwen_tok)
    for params, words in ((sp(3, 21), "prompt_logprobs"), (sp(3, -1), "prompt_logprobs"),
                          (sp(0), "max_tokens"),
                          (SamplingParams(max_tokens=2, min_tokens=3), "min_tokens")):
        with pytest.raises(ValueError, match=words):
            e.add_request("x", ids(5, 9), params)
    assert not e.has_unfinished()
