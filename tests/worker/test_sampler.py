"""Sampler rules on small hand-made logits (CPU; the same code runs on the GPU's logits)."""

from __future__ import annotations

import math

import pytest
import torch

from tailored.worker.sampler import _apply_penalties, sample
from tailored.engine.types import SamplingParams, ScheduledSeq


def seq(rid="r", prompt=(), output=(), num_generated=0, **sp) -> ScheduledSeq:
    return ScheduledSeq(
        request_id=rid,
        token_ids=(0,),
        start_pos=0,
        slot=1,
        reset_state=True,
        page_ids=(1,),
        sample=True,
        sampling=SamplingParams(**sp),
        prompt_ids=tuple(prompt),
        output_ids=tuple(output),
        num_generated=num_generated,
    )


PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()


def draws(logits_row: torch.Tensor, n: int, **sp) -> torch.Tensor:
    """Counts per token of n unseeded draws from one row (batched as n identical rows)."""
    toks = sample(logits_row.expand(n, -1).contiguous(), [seq(**sp)] * n)
    return torch.bincount(torch.tensor(toks), minlength=logits_row.numel())


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_greedy_is_argmax_any_dtype():
    torch.manual_seed(0)
    logits = torch.randn(6, 1000)
    want = logits.argmax(-1).tolist()
    assert sample(logits, [seq(temperature=0.0)] * 6) == want
    assert (
        sample(logits.bfloat16(), [seq(temperature=0.0)] * 6)
        == logits.bfloat16().argmax(-1).tolist()
    )
    # bf16 ties (many, from the rounding) go to the lowest id on the no-copy greedy path too
    tied = torch.zeros(2, 50, dtype=torch.bfloat16)
    tied[0, [7, 3, 30]] = 1.0
    tied[1, [40, 41]] = torch.tensor([1.0001, 1.0002]).bfloat16()  # both round to 1.0
    assert sample(tied, [seq(temperature=0.0)] * 2) == [3, 40]
    # a greedy batch with a penalty row takes the float32 path: same choices where none applies
    mixed = [seq(temperature=0.0)] * 5 + [seq(temperature=0.0, repetition_penalty=1.0001)]
    assert sample(logits, mixed)[:5] == want[:5]
    before = logits.clone()
    sample(logits, [seq(temperature=1.0, repetition_penalty=2.0, prompt=(1, 2))] * 6)
    assert torch.equal(logits, before)  # input not modified
    assert sample(torch.empty(0, 10), []) == []


def test_top_k_1_and_tiny_top_p_are_greedy():
    torch.manual_seed(1)
    logits = torch.randn(32, 500)
    want = logits.argmax(-1).tolist()
    assert sample(logits, [seq(temperature=1.5, top_k=1)] * 32) == want
    assert sample(logits, [seq(temperature=1.5, top_p=1e-6)] * 32) == want
    assert sample(logits, [seq(temperature=1.0, min_p=1.0)] * 32) == want


def test_top_k_top_p_min_p_keep_the_right_tokens():
    torch.manual_seed(2)
    assert draws(LOGITS, 4000, top_k=2)[2:].sum() == 0
    c = draws(LOGITS, 4000, top_p=0.8)  # 0.5 + 0.3 reaches 0.8: tokens 0 and 1 only
    assert c[2:].sum() == 0 and c[:2].min() > 0
    c = draws(LOGITS, 4000, top_p=0.81)  # needs token 2 as well
    assert c[3] == 0 and c[:3].min() > 0
    c = draws(LOGITS, 4000, min_p=0.2)  # threshold 0.1: only token 3 (0.05) is dropped
    assert c[3] == 0 and c[:3].min() > 0
    # renormalised distribution after filtering
    assert chi2(c, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95) < 25
    # a top_k past the vocabulary is no limit, also beside a top_p (2^63 - 1 went negative
    # through the float32 knobs, masked every token and fell back to greedy: session 26)
    for k in (2**63 - 1, 2**40, len(LOGITS)):
        c = draws(LOGITS, 4000, top_k=k, top_p=0.81)
        assert c[3] == 0 and c[:3].min() > 0, k


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0], ids=lambda t: f"T{t}")
def test_temperature_matches_softmax(temperature):
    torch.manual_seed(3)
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.3, -2.0])
    counts = draws(logits, 20000, temperature=temperature)
    # chi-square with 5 degrees of freedom: P(X > 25) ~ 1.4e-4
    assert chi2(counts, (logits / temperature).softmax(-1)) < 25


def test_seeded_draws_match_softmax():
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.3, -2.0])
    n = 8000
    toks = sample(logits.expand(n, -1).contiguous(), [seq(seed=s) for s in range(n)])
    counts = torch.bincount(torch.tensor(toks), minlength=6)
    assert chi2(counts, logits.softmax(-1)) < 25


def test_seeded_reproducible_regardless_of_batch():
    torch.manual_seed(4)
    V = 300
    row = torch.randn(V)
    target = seq("t", seed=1234, num_generated=5, temperature=0.9, top_p=0.95)
    alone = sample(row[None], [target])[0]
    for trial in range(20):
        torch.manual_seed(100 + trial)  # global RNG state must not matter
        B = 1 + trial % 7
        pos = trial % B
        batch = torch.randn(B, V)
        batch[pos] = row
        others = [seq(f"o{i}", temperature=1.0, seed=(i if trial % 2 else None)) for i in range(B)]
        others[pos] = target
        assert sample(batch, others)[pos] == alone
    # the step number is part of the stream: different steps are different draws
    flat = torch.zeros(1, V)
    steps = [sample(flat, [seq(seed=7, num_generated=g)])[0] for g in range(20)]
    assert len(set(steps)) > 10
    # and the seed is too
    assert len({sample(flat, [seq(seed=s)])[0] for s in range(20)}) > 10


def test_penalties_on_hand_made_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [2.0, -1.0, 0.5, 3.0]])
    s = seq(
        prompt=(0,),
        output=(1, 1, 2),
        repetition_penalty=2.0,
        frequency_penalty=0.1,
        presence_penalty=0.5,
    )
    _apply_penalties(logits, [s, seq()])
    # repetition (prompt + output): 2/2, -1*2, 0.5/2; then -0.1*count - 0.5*(count > 0)
    want = [1.0, -2.0 - 0.2 - 0.5, 0.25 - 0.1 - 0.5, 3.0]
    assert torch.allclose(logits[0], torch.tensor(want))
    assert torch.equal(logits[1], torch.tensor([2.0, -1.0, 0.5, 3.0]))  # no penalty row untouched

    only_output = torch.tensor([[1.0, 1.0, 1.0]])
    _apply_penalties(only_output, [seq(prompt=(0,), output=(2,), presence_penalty=1.0)])
    assert only_output.tolist() == [[1.0, 1.0, 0.0]]  # presence ignores the prompt (OpenAI)


def test_penalty_changes_greedy_choice():
    logits = torch.tensor([[1.0, 0.9, -5.0]])
    assert sample(logits, [seq(temperature=0.0)]) == [0]
    assert sample(logits, [seq(temperature=0.0, output=(0,), frequency_penalty=0.2)]) == [1]
    assert sample(logits, [seq(temperature=0.0, prompt=(0,), repetition_penalty=1.2)]) == [1]


def test_mixed_batch_each_row_follows_its_own_rule():
    torch.manual_seed(5)
    logits = torch.randn(4, 50)
    seqs = [seq(temperature=0.0), seq(top_k=1), seq(seed=3), seq(temperature=0.0, top_k=5)]
    out = sample(logits, seqs)
    am = logits.argmax(-1).tolist()
    assert out[0] == am[0] and out[1] == am[1] and out[3] == am[3]
    assert 0 <= out[2] < 50 and not math.isnan(out[2])


# ---- values that pass validation but used to give NaN (token 0) -------------------------------


def test_underflowing_temperature_is_greedy():
    torch.manual_seed(6)
    logits = torch.randn(8, 300) + 5.0  # token 0 must not win by accident
    want = logits.argmax(-1).tolist()
    for t in (1e-45, 1e-30, 9e-6):
        assert sample(logits, [seq(temperature=t)] * 8) == want
        assert sample(logits, [seq(temperature=t, seed=1)] * 8) == want
        mixed = sample(logits, [seq(temperature=t), seq(temperature=1.0)] * 4)
        assert mixed[0::2] == want[0::2]


def test_top_token_survives_any_top_p():
    torch.manual_seed(7)
    logits = torch.randn(8, 300)
    want = logits.argmax(-1).tolist()
    for p in (1e-300, 1e-45, 1e-12):  # 1e-300 and 1e-45 are 0 in float32
        assert sample(logits, [seq(top_p=p)] * 8) == want
        assert sample(logits, [seq(top_p=p, top_k=5, min_p=0.5, seed=3)] * 8) == want


def test_extreme_repetition_penalty_is_clamped_not_nan():
    logits = torch.tensor([[0.0, 3.0, 2.0, -1.0]])
    tiny = seq(prompt=(1,), output=(3,), repetition_penalty=1e-50)  # would be 0 in float32
    huge = seq(prompt=(1,), output=(3,), repetition_penalty=1e50)  # would be inf
    out = logits.clone()
    _apply_penalties(out, [tiny])
    assert torch.isfinite(out).all()
    assert torch.allclose(out, torch.tensor([[0.0, 300.0, 2.0, -0.01]]))  # clamped to 0.01
    out = logits.clone()
    _apply_penalties(out, [huge])
    assert torch.allclose(out, torch.tensor([[0.0, 0.03, 2.0, -100.0]]))  # clamped to 100
    assert sample(logits, [tiny]) == [1]
    assert sample(logits, [huge]) == [2]
    assert sample(logits, [seq(temperature=0.0, prompt=(1,), repetition_penalty=1e-50)]) == [1]


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_nan_row_falls_back_to_greedy_and_spares_the_others(temperature, caplog):
    torch.manual_seed(8)
    B, V = 5, 200
    logits = torch.randn(B, V)
    seqs = [seq(f"r{i}", temperature=temperature, seed=10 + i, top_p=0.9) for i in range(B)]
    clean = sample(logits, seqs)
    bad = logits.clone()
    bad[2, ::3] = float("nan")
    bad[2, 100] = 50.0  # the best non-NaN logit
    with caplog.at_level("WARNING", logger="tailored.worker.sampler"):
        got = sample(bad, seqs)
    assert got[2] == 100
    assert got[:2] + got[3:] == clean[:2] + clean[3:]
    assert "'r2'" in caplog.text and "NaN" in caplog.text
    # an all -inf row (nothing left to sample) also falls back instead of emitting token 0
    inf_row = logits.clone()
    inf_row[1] = float("-inf")
    inf_row[1, 42] = float("inf")
    assert sample(inf_row, seqs)[1] == 42


def test_logit_bias_forces_bans_and_shifts():
    logits = LOGITS.expand(3, -1).contiguous()
    seqs = [seq("force", temperature=0.0, logit_bias={3: 100.0}),
            seq("ban", temperature=0.0, logit_bias={0: -100.0, 99: 5.0}),  # 99: past V, ignored
            seq("none", temperature=0.0)]
    assert sample(logits, seqs) == [3, 1, 0]
    assert logits.equal(LOGITS.expand(3, -1))  # the input is not modified


def test_logit_bias_shifts_the_sampled_distribution():
    n = 20000
    bias = math.log(3.0)  # token 3's weight x3: probs 0.5, 0.3, 0.15, 0.15 → renormalised
    counts = draws(LOGITS, n, temperature=1.0, logit_bias={3: bias})
    want = PROBS.clone()
    want[3] *= 3.0
    assert chi2(counts, want / want.sum()) < 16.3  # 3 dof, p = 0.001


def test_logit_bias_keeps_a_request_from_drafting():
    assert not SamplingParams(temperature=0.0, logit_bias={1: 1.0}).can_draft


def test_logit_bias_tensors_are_built_once_a_request():
    sp = SamplingParams(temperature=0.0, logit_bias={2: 50.0, 3: 20.0})
    s = ScheduledSeq(request_id="r", token_ids=(0,), start_pos=0, slot=1, reset_state=True,
                     page_ids=(1,), sample=True, sampling=sp)
    assert sample(LOGITS.unsqueeze(0), [s]) == [2]
    cache = sp._bias_cache
    assert cache is not None and cache[0].tolist() == [2, 3]
    assert sample(LOGITS.unsqueeze(0), [s]) == [2] and sp._bias_cache is cache


def test_patch_replaces_rows_and_their_host_copy():
    """Sampled.patch (runner.resample, a structured row launched ahead): the patched rows'
    ids and NaN flags replace the first draw's on the device and in what tolist() reads;
    raw_rows gives the step's logits; a step with logprobs or mismatched rows is refused."""
    from tailored.worker.sampler import sample_on_device

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 40, generator=g)
    seqs = [seq(f"r{i}", temperature=0.0) for i in range(3)]
    first = sample_on_device(logits, seqs)
    want = logits.argmax(dim=-1).tolist()
    masked = seq("r1", temperature=0.0)
    allowed = torch.zeros(2, dtype=torch.int32)
    allowed[0] = 1 << 5  # only id 5
    masked = ScheduledSeq(**{**masked.__dict__, "allowed": allowed})
    rows = torch.tensor([1])
    assert torch.equal(first.raw_rows(rows), logits[1:2])
    first.patch([1], rows, sample_on_device(first.raw_rows(rows), [masked]))
    assert first.tolist() == [want[0], 5, want[2]] and first.ids.tolist()[1] == 5
    with pytest.raises(ValueError):
        first.patch([0, 1], torch.tensor([0, 1]), sample_on_device(logits[:1], seqs[:1]))
    # a row that asked for logprobs cannot be patched; the rows beside it can
    lp = sample_on_device(logits, [seq("r0", temperature=0.0, logprobs=1), seqs[1], seqs[2]])
    with pytest.raises(ValueError):
        lp.patch([0], torch.tensor([0]), sample_on_device(logits[:1], seqs[:1]))
    lp.patch([1], rows, sample_on_device(lp.raw_rows(rows), [masked]))
    assert lp.tolist()[1] == 5 and lp.logprobs()[0] is not None
