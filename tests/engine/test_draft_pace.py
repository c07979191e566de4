"""Adaptive draft length (engine/draft_pace.py), fed fake acceptance sequences: drafts that are
kept keep their full length; drafts that are rejected cost ~nothing (a pause with probes that
back off); a position that never holds is dropped and tried again later; a request whose drafts
match again drafts again within its wait; the same sequence gives the same lengths."""

from __future__ import annotations

import random

from tailored.engine.draft_pace import FIRST_WAIT, MAX_WAIT, DraftPace


def _drive(pace: DraftPace, kept_of, steps: int) -> list[int]:
    """Run `steps` decode steps: each asks the pace for its length, a paused step ticks, a
    drafting one records kept_of(step, length) kept drafts. Returns the lengths."""
    lengths = []
    for i in range(steps):
        k = pace.length()
        lengths.append(k)
        if k == 0:
            pace.tick()
        else:
            pace.record(k, min(k, kept_of(i, k)))
    return lengths


def test_kept_drafts_keep_the_full_length():
    pace = DraftPace(3, 0.5)
    assert _drive(pace, lambda i, k: k, 100) == [3] * 100
    assert pace.rate(0) > 0.99 and pace.active


def test_rejected_drafts_pause_with_probes_that_back_off():
    pace = DraftPace(3, 0.5)
    lengths = _drive(pace, lambda i, k: 0, 600)
    first_pause = lengths.index(0)
    assert first_pause <= 4  # a few rejected chunks from the prior
    after = lengths[first_pause:]
    probes = [i for i, k in enumerate(after) if k]
    assert all(after[i] == 1 for i in probes)  # a probe is one draft
    gaps = [probes[0]] + [b - a - 1 for a, b in zip(probes, probes[1:])]
    assert gaps[:5] == [FIRST_WAIT, 2 * FIRST_WAIT, 4 * FIRST_WAIT, 8 * FIRST_WAIT, MAX_WAIT]
    assert set(gaps[5:]) == {MAX_WAIT}
    # the cost of never-kept drafts: ~one draft every MAX_WAIT steps
    assert sum(lengths[100:]) / 500 < 1.5 / MAX_WAIT


def test_a_kept_probe_resumes_drafting_at_full_length():
    pace = DraftPace(2, 0.5)
    lengths = _drive(pace, lambda i, k: 0 if i < 200 else k, 400)
    resumed = next(i for i in range(200, 400) if lengths[i])
    assert resumed - 200 <= MAX_WAIT
    assert lengths[resumed] == 1 and lengths[resumed + 1:] == [2] * (399 - resumed)


def test_a_position_that_never_holds_is_dropped_and_tried_again():
    """The first draft always kept, the second never: one draft a step, the second position
    tried again now and then (it may start to hold), never a pause."""
    pace = DraftPace(3, 0.5)
    lengths = _drive(pace, lambda i, k: 1, 300)
    assert 0 not in lengths
    tail = lengths[50:]
    assert tail.count(1) > 0.8 * len(tail)
    assert any(k > 1 for k in tail)  # a retry past the first position


def test_middling_acceptance_keeps_drafting_most_steps():
    """Each draft kept with chance 0.8 (seeded): the pace drafts at nearly every step and
    proposes 1-3; at 0.1 it drafts at few steps (probes)."""
    for a, least, most in ((0.8, 0.9, 1.0), (0.1, 0.0, 0.1)):
        rng = random.Random(1)

        def kept(i, k, a=a, rng=rng):
            n = 0
            while n < k and rng.random() < a:
                n += 1
            return n

        lengths = _drive(DraftPace(3, 0.5), kept, 4000)
        share = sum(1 for k in lengths if k) / len(lengths)
        assert least <= share <= most, (a, share)


def test_threshold_zero_is_the_fixed_length_and_runs_are_deterministic():
    pace = DraftPace(3, 0.0)
    assert _drive(pace, lambda i, k: 0, 50) == [3] * 50
    rng = random.Random(7)
    seq = [rng.choice((0, 0, 0, 1, 3)) for _ in range(500)]
    runs = [_drive(DraftPace(3, 0.5), lambda i, k: seq[i], 500) for _ in range(2)]
    assert runs[0] == runs[1] and set(runs[0]) >= {0, 1, 3}
