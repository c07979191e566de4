"""Engine loop end to end with a fake runner (no model) and a fake 64-token tokenizer.

The fake runner behaves like the real cache: it keeps a rolling hash per GDN slot (reset only on
reset_state) and writes every token into its KV pages; before sampling it re-reads the whole
context from the pages and checks it against the slot hash. The next token is a function of
that context only, so any slot/page mix-up, a missing reset, or a wrong recompute changes the
tokens (failure-cases §1), and outputs must not depend on batching, chunking or preemption.
"""

from __future__ import annotations

import pytest
import torch

from tailored.config import EngineConfig, ModelConfig
from tailored.engine.engine import Engine
from tailored.worker.sampler import sample
from tailored.engine.types import FinishReason, ModelOutput, SamplingParams, SchedulerOutput

V = 64
EOS = (62, 63)
ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456 "  # ids 0..59
MASK64 = (1 << 64) - 1


class FakeTokenizer:
    """ids 0..59 are one character each; 60..63 are special (62, 63 are EOS)."""

    eos_token_ids = EOS

    def is_special(self, i: int) -> bool:
        return i >= 60

    def token_bytes(self, i: int) -> bytes:
        return ALPHABET[i].encode() if i < 60 else f"<|s{i}|>".encode()

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(
            self.token_bytes(i).decode() for i in ids if not (skip_special_tokens and i >= 60)
        )


def _mix(h: int, t: int) -> int:
    return ((h ^ (t + 0x9E3779B97F4A7C15)) * 0xBF58476D1CE4E5B9 + 1) & MASK64


class FakeRunner:
    """Deterministic stand-in for the model runner (see module docstring).

    eos_mod: emit EOS when the context hash says so (about 1 in eos_mod tokens); None = never.
    use_sampler: draw from random logits seeded by the context hash through the real sampler.
    fail_if: predicate on the SchedulerOutput; when true, execute raises (a failing batch).
    """

    def __init__(
        self, num_pages=64, num_slots=9, page_size=4, eos_mod=None, use_sampler=False, fail_if=None
    ):
        self.num_pages, self.num_slots, self.page_size = num_pages, num_slots, page_size
        self.eos_mod, self.use_sampler, self.fail_if = eos_mod, use_sampler, fail_if
        self.kv: dict[int, list[int | None]] = {}
        self.state = [0] * num_slots
        self.num_steps = 0
        self.max_batch = 0

    def execute(self, so: SchedulerOutput) -> ModelOutput:
        self.num_steps += 1
        self.max_batch = max(self.max_batch, len(so.seqs))
        if self.fail_if is not None and self.fail_if(so):
            raise RuntimeError("boom")
        ps, slots, pages, hashes = self.page_size, set(), set(), {}
        for s in so.seqs:
            assert s.slot != 0 and s.slot not in slots, "slot 0 or a shared slot"
            assert 0 not in s.page_ids and pages.isdisjoint(s.page_ids), "page 0 or shared page"
            slots.add(s.slot)
            pages.update(s.page_ids)
            end = s.start_pos + len(s.token_ids)
            assert len(s.page_ids) == -(-end // ps)
            if s.reset_state:
                self.state[s.slot] = 0
            h = self.state[s.slot]
            for i, t in enumerate(s.token_ids):
                pos = s.start_pos + i
                self.kv.setdefault(s.page_ids[pos // ps], [None] * ps)[pos % ps] = t
                h = _mix(h, t)
            self.state[s.slot] = h
            if s.sample:
                ctx = [self.kv[s.page_ids[p // ps]][p % ps] for p in range(end)]
                h_kv = 0
                for t in ctx:
                    h_kv = _mix(h_kv, t)
                assert h_kv == h, "slot state and KV pages disagree"
                hashes[s.request_id] = h
        sampled = [s for s in so.seqs if s.sample]
        if self.use_sampler:
            rows = []
            for s in sampled:
                g = torch.Generator().manual_seed(hashes[s.request_id] & 0x7FFFFFFF)
                rows.append(torch.randn(60, generator=g) * 3)
            logits = torch.full((len(sampled), V), -1e9)
            if rows:
                logits[:, :60] = torch.stack(rows)
            return ModelOutput(dict(zip([s.request_id for s in sampled], sample(logits, sampled))))
        return ModelOutput({s.request_id: self._token(hashes[s.request_id]) for s in sampled})

    def _token(self, h: int) -> int:
        if self.eos_mod and (h >> 40) % self.eos_mod == 0:
            return EOS[0]
        return (h >> 20) % 60


def model_config() -> ModelConfig:
    return ModelConfig(
        vocab_size=V,
        hidden_size=8,
        num_hidden_layers=4,
        layer_types=("linear_attention",) * 3 + ("full_attention",),
        rms_norm_eps=1e-6,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        rope_theta=1e6,
        partial_rotary_factor=0.5,
        mrope_section=(1, 0, 0),
        max_position_embeddings=4096,
        linear_num_key_heads=1,
        linear_num_value_heads=1,
        linear_key_head_dim=4,
        linear_value_head_dim=4,
        linear_conv_kernel_dim=4,
        num_experts=2,
        num_experts_per_tok=1,
        moe_intermediate_size=4,
        shared_expert_intermediate_size=4,
        mtp_num_hidden_layers=0,
        eos_token_ids=EOS,
    )


def make_engine(runner=None, page_size=4, max_num_seqs=8, budget=64, max_model_len=256, **kw):
    runner = runner or FakeRunner(page_size=page_size, **kw)
    cfg = EngineConfig(
        page_size=page_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
    )
    return Engine(model_config(), cfg, runner, FakeTokenizer())


def prompt(i: int, n: int) -> list[int]:
    return [(i * 7 + j * 3) % 60 for j in range(n)]


def run(engine: Engine, max_steps=5000, allow_errors=False) -> dict[str, dict]:
    """Step until done; collect text, ids and finish per request; check the output contract.

    The fake runner's own checks raise inside execute(), which the engine turns into ERROR
    outputs; so unless a test expects errors, an ERROR finish fails the test.
    """
    res: dict[str, dict] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            r = res.setdefault(o.request_id, {"text": "", "ids": [], "finish": None, "n": 0})
            assert r["finish"] is None, "output after the finished one"
            r["text"] += o.delta_text
            r["ids"] += o.delta_token_ids
            assert o.finished == (o.finish_reason is not None)
            r["finish"], r["n"], r["error"] = o.finish_reason, o.num_output_tokens, o.error
            assert allow_errors or o.finish_reason is not FinishReason.ERROR, o.error
    else:
        raise AssertionError("engine made no progress")
    st = engine.stats()
    assert st["running"] == st["waiting"] == 0
    assert st["free_pages"] == engine.runner.num_pages - 1
    assert st["free_slots"] == engine.runner.num_slots - 1
    return res


def workload(engine: Engine, n=12, **sp) -> None:
    for i in range(n):
        params = SamplingParams(max_tokens=5 + (i * 5) % 17, **sp)
        engine.add_request(f"r{i}", prompt(i, 3 + (i * 11) % 29), params)


@pytest.mark.contract("stops-and-usage")
def test_single_request_text_ids_usage():
    e = make_engine()
    e.add_request("a", prompt(0, 10), SamplingParams(max_tokens=12, temperature=0.0))
    (r,) = run(e).values()
    assert r["finish"] is FinishReason.LENGTH and len(r["ids"]) == r["n"] == 12
    assert r["text"] == FakeTokenizer().decode(r["ids"])


@pytest.mark.parametrize(
    "budget,num_pages,num_slots,max_num_seqs",
    [(5, 64, 9, 8), (64, 16, 9, 8), (7, 14, 4, 8), (64, 64, 3, 1)],
    ids=["chunked", "preempting", "chunked-preempting-3slots", "serial"],
)
@pytest.mark.contract("mixed-step-isolation")
@pytest.mark.parametrize("use_sampler", [False, True], ids=["hash", "seeded-sampler"])
def test_outputs_independent_of_batching_chunking_and_preemption(
    budget, num_pages, num_slots, max_num_seqs, use_sampler
):
    sp = {"temperature": 0.8, "seed": 11} if use_sampler else {"temperature": 0.0}
    ref = make_engine(use_sampler=use_sampler)
    workload(ref, **sp)
    want = run(ref)
    e = make_engine(
        budget=budget,
        num_pages=num_pages,
        num_slots=num_slots,
        max_num_seqs=max_num_seqs,
        use_sampler=use_sampler,
    )
    workload(e, **sp)
    got = run(e)
    assert got == want
    if num_pages < 64:
        assert e.scheduler.num_preemptions > 0
    assert e.runner.max_batch <= max_num_seqs


@pytest.mark.contract("identical-concurrent-greedy")
def test_identical_prompts_concurrently_identical_outputs():
    e = make_engine(num_slots=5, eos_mod=None)
    for i in range(12):  # more than the slots: slots are reused (LIFO) while others run
        e.add_request(
            f"same{i}", prompt(3, 17), SamplingParams(max_tokens=9 + i % 3, temperature=0)
        )
        e.add_request(f"other{i}", prompt(i, 5 + i), SamplingParams(max_tokens=4, temperature=0))
    res = run(e)
    same = [res[f"same{i}"]["ids"] for i in range(12)]
    longest = max(same, key=len)
    for ids in same:
        assert ids == longest[: len(ids)]


def test_eos_and_stop_token_ids():
    e = make_engine(eos_mod=3)
    for i in range(6):
        e.add_request(f"r{i}", prompt(i, 4), SamplingParams(max_tokens=30, temperature=0))
    res = run(e)
    stopped = [r for r in res.values() if r["finish"] is FinishReason.STOP]
    assert stopped, "eos_mod=3 should produce EOS"
    for r in stopped:
        assert r["ids"][-1] in EOS and "<|" not in r["text"]
        assert r["text"] == FakeTokenizer().decode(r["ids"])

    base = run_one(prompt(1, 6), max_tokens=10)
    x = base["ids"][3]
    k = base["ids"].index(x)
    for include in (False, True):
        r = run_one(
            prompt(1, 6), max_tokens=10, stop_token_ids=[x], include_stop_str_in_output=include
        )
        assert r["finish"] is FinishReason.STOP and r["ids"] == base["ids"][: k + 1]
        want = FakeTokenizer().decode(base["ids"][: k + (1 if include else 0)])
        assert r["text"] == want


def run_one(p, **sp) -> dict:
    e = make_engine()
    e.add_request("x", p, SamplingParams(temperature=0, **sp))
    return run(e)["x"]


@pytest.mark.contract("stops-and-usage")
def test_stop_beats_max_tokens_on_the_same_token():
    base = run_one(prompt(2, 5), max_tokens=8)
    # EOS as the max_tokens-th token (via stop_token_ids on whatever that token is)
    last = base["ids"][4]
    assert last not in base["ids"][:4]
    r = run_one(prompt(2, 5), max_tokens=5, stop_token_ids=[last])
    assert r["finish"] is FinishReason.STOP and r["ids"] == base["ids"][:5]
    # a stop string completed by the max_tokens-th token
    text = base["text"]
    stop = text[3:5]
    assert text.find(stop) == 3
    r = run_one(prompt(2, 5), max_tokens=5, stop=[stop])
    assert r["finish"] is FinishReason.STOP and r["text"] == text[:3]
    r = run_one(prompt(2, 5), max_tokens=4, stop=[stop])  # one token short: length wins
    assert r["finish"] is FinishReason.LENGTH and r["text"] == text[:4]


def test_stop_strings_cut_text_and_free_resources():
    base = run_one(prompt(5, 7), max_tokens=20)
    text = base["text"]
    stop = text[6:9]
    cut = text.find(stop)
    e = make_engine()
    e.add_request("s", prompt(5, 7), SamplingParams(max_tokens=20, temperature=0, stop=[stop]))
    e.add_request(
        "i",
        prompt(5, 7),
        SamplingParams(max_tokens=20, temperature=0, stop=[stop], include_stop_str_in_output=True),
    )
    e.add_request("n", prompt(5, 7), SamplingParams(max_tokens=20, temperature=0, stop=["@@"]))
    res = run(e)
    assert res["s"]["finish"] is FinishReason.STOP and res["s"]["text"] == text[:cut]
    assert res["i"]["text"] == text[: cut + len(stop)]
    assert len(res["s"]["ids"]) == cut + len(stop)  # tokens stop at the one completing the match
    assert res["n"]["finish"] is FinishReason.LENGTH and res["n"]["text"] == text


def test_abort_mid_stream_and_while_waiting():
    e = make_engine(max_num_seqs=1)
    e.add_request("a", prompt(0, 6), SamplingParams(max_tokens=50, temperature=0))
    e.add_request("w", prompt(1, 6), SamplingParams(max_tokens=5, temperature=0))
    for _ in range(3):
        outs = e.step()
    assert [o.request_id for o in outs] == ["a"]
    e.abort_request("a")
    st = e.stats()
    assert st["running"] == 0 and st["free_pages"] == 63 and st["free_slots"] == 8
    with pytest.raises(ValueError, match="duplicate"):  # id stays taken until its final output
        e.add_request("a", prompt(0, 6), SamplingParams())
    outs = e.step()
    final = [o for o in outs if o.request_id == "a"]
    assert len(final) == 1 and final[0].finished and final[0].finish_reason is FinishReason.ABORT
    e.abort_request("a")  # already gone: ignored
    e.abort_request("never")
    e.add_request("x", prompt(2, 3), SamplingParams(max_tokens=5))
    e.abort_request("x")  # still waiting
    res = run(e)
    assert res["x"]["finish"] is FinishReason.ABORT and res["x"]["ids"] == []
    assert res["w"]["finish"] is FinishReason.LENGTH


def test_runner_error_fails_only_that_batch():
    calls = {"n": 0}

    def fail_second_step(so):
        calls["n"] += 1
        return calls["n"] == 2

    e = make_engine(runner=FakeRunner(fail_if=fail_second_step), max_num_seqs=2)
    for i in range(3):
        e.add_request(f"r{i}", prompt(i, 4), SamplingParams(max_tokens=4, temperature=0))
    res = run(e, allow_errors=True)
    assert res["r0"]["finish"] is res["r1"]["finish"] is FinishReason.ERROR
    assert "boom" in res["r0"]["error"]
    assert res["r2"]["finish"] is FinishReason.LENGTH and len(res["r2"]["ids"]) == 4


def test_idle_step_and_runner_missing_a_token():
    e = make_engine()
    assert e.step() == [] and not e.has_unfinished()

    class Forgetful(FakeRunner):
        def execute(self, so):
            out = super().execute(so)
            return ModelOutput({k: v for k, v in out.token_ids.items() if k != "b"})

    e = make_engine(runner=Forgetful())
    e.add_request("a", prompt(0, 3), SamplingParams(max_tokens=3, temperature=0))
    e.add_request("b", prompt(1, 3), SamplingParams(max_tokens=3, temperature=0))
    res = run(e, allow_errors=True)
    assert res["a"]["finish"] is res["b"]["finish"] is FinishReason.ERROR
    assert "no token" in res["b"]["error"]


def test_add_request_validation():
    e = make_engine(max_model_len=32, num_pages=6)  # 5 usable pages of 4 tokens
    sp = SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match="empty"):
        e.add_request("a", [], sp)
    with pytest.raises(ValueError, match="max_model_len"):
        e.add_request("a", [1] * 30, sp)
    with pytest.raises(ValueError, match="out of range"):
        e.add_request("a", [1, V], sp)
    with pytest.raises(ValueError, match="out of range"):
        e.add_request("a", [-1, 2], sp)
    with pytest.raises(ValueError, match="KV pages"):
        e.add_request("a", [1] * 20, sp)
    with pytest.raises(ValueError, match="max_tokens"):
        e.add_request("a", [1], SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="top_p"):
        e.add_request("a", [1], SamplingParams(top_p=0.0))
    e.add_request("a", [1, 2], sp)
    with pytest.raises(ValueError, match="duplicate"):
        e.add_request("a", [1, 2], sp)
    assert e.stats()["waiting"] == 1 and e.has_unfinished()
    run(e)
    assert not e.has_unfinished()


class _NoScanList(list):
    """A stop_token_ids list that fails if anyone searches it linearly per token."""

    def __contains__(self, item):
        raise AssertionError("stop_token_ids scanned as a list")


def test_stop_token_ids_checked_through_a_frozenset():
    base = run_one(prompt(1, 6), max_tokens=10)
    x = base["ids"][3]
    k = base["ids"].index(x)
    e = make_engine()
    many = _NoScanList(range(1000, 1000 + 100_000))  # ids the model never samples...
    many.append(x)  # ...and one it does
    e.add_request(
        "x", prompt(1, 6), SamplingParams(temperature=0, max_tokens=10, stop_token_ids=many)
    )
    stop_ids = e.scheduler.stop_ids["x"]
    assert isinstance(stop_ids, frozenset) and x in stop_ids and set(EOS) <= stop_ids
    r = run(e)["x"]
    assert r["finish"] is FinishReason.STOP and r["ids"] == base["ids"][: k + 1]
    assert e.scheduler.stop_ids == {}  # dropped with the request
    # ignore_eos: EOS ids are not in the set, stop_token_ids still are
    e = make_engine()
    e.add_request(
        "y", prompt(1, 6), SamplingParams(max_tokens=3, ignore_eos=True, stop_token_ids=[5])
    )
    assert e.scheduler.stop_ids["y"] == frozenset({5})
    e.abort_request("y")
    assert e.scheduler.stop_ids == {}


def test_underflowing_temperature_and_top_p_run_greedy_through_the_engine():
    """temperature 1e-45 / top_p 1e-300 pass the API but are 0 in float32: they must behave
    as greedy (same tokens as temperature 0), not emit token 0 from NaN probabilities."""
    want = make_engine(use_sampler=True)
    workload(want, temperature=0.0)
    want = run(want)
    for sp in ({"temperature": 1e-45}, {"top_p": 1e-300, "seed": 3}):
        e = make_engine(use_sampler=True)
        workload(e, **sp)
        assert run(e) == want
