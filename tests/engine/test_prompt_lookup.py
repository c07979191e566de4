"""Prompt lookup (engine/prompt_lookup.py): the drafts are what followed the most recent earlier
occurrence of the longest n-gram (min_n..max_n) ending the context; the incremental token array
equals the request's tokens; a lookup stays cheap on a 32k-token context."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

from tailored.engine.prompt_lookup import PromptLookup


def _reference(ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The rule, spelled out: n from max_n down to min_n, the last earlier occurrence."""
    L = len(ids)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = ids[L - n:]
        for end in range(L - 1, n - 1, -1):  # occurrence ids[end - n:end], end < L
            if ids[end - n:end] == suffix:
                return ids[end:end + k]
    return []


def _lookup(ids, k, min_n=2, max_n=4):
    pl = PromptLookup(min_n, max_n)
    pl.sync(ids, [])
    return pl.propose(k)


def test_longest_match_wins_then_the_most_recent():
    # "1 2 3" occurs at 0 (followed by 7) and "2 3" again at 5 (followed by 8): the 3-gram wins
    ids = [1, 2, 3, 7, 9, 2, 3, 8, 5, 1, 2, 3]
    assert _lookup(ids, 2) == [7, 9]
    assert _lookup(ids, 2, max_n=2) == [8, 5]  # only 2-grams: the most recent "2 3"
    # two occurrences of the same 4-gram: the later one's continuation
    ids = [4, 5, 6, 7, 1, 4, 5, 6, 7, 2, 0, 4, 5, 6, 7]
    assert _lookup(ids, 3) == [2, 0, 4]


def test_min_n_and_short_continuations():
    assert _lookup([5, 1, 9, 1], 3) == []  # only a 1-gram matches, min_n 2
    assert _lookup([5, 1, 9, 1], 3, min_n=1) == [9, 1]  # continuation up to the end
    assert _lookup([3, 3, 3, 3], 4) == [3]  # a run: the overlapping occurrence ends at L - 2
    assert _lookup([1, 2], 4, min_n=1) == []  # nothing earlier
    assert _lookup([1, 2, 1, 2], 0) == []
    assert _lookup([], 3, min_n=1) == []
    with pytest.raises(ValueError):
        PromptLookup(3, 2)


@pytest.mark.parametrize("min_n,max_n", [(1, 1), (1, 4), (2, 4), (3, 5)])
def test_equals_the_reference_on_random_contexts(min_n, max_n):
    rng = random.Random(min_n * 10 + max_n)
    for _ in range(300):
        L = rng.randint(1, 60)
        ids = [rng.randint(0, 4) for _ in range(L)]  # a small alphabet: many matches
        k = rng.randint(1, 5)
        assert _lookup(ids, k, min_n, max_n) == _reference(ids, k, min_n, max_n), (ids, k)


def test_incremental_sync_equals_a_fresh_array():
    """Tokens come a few at a time (prompt, then outputs, drafts kept or not); a preemption
    keeps them; a request whose outputs shrank (never while it runs) starts over."""
    rng = random.Random(0)
    prompt = [rng.randint(0, 9) for _ in range(50)]
    out: list[int] = []
    pl = PromptLookup(1, 3)
    for _ in range(200):
        out += [rng.randint(0, 9) for _ in range(rng.randint(0, 3))]
        pl.sync(prompt, out)
        assert pl.ids[:pl.n].tolist() == prompt + out
        assert pl.propose(3) == _reference(prompt + out, 3, 1, 3)
    del out[10:]
    pl.sync(prompt, out)
    assert pl.ids[:pl.n].tolist() == prompt + out


def test_a_lookup_on_a_32k_context_is_cheap():
    """No O(L²), no Python loop over the context: a lookup at 32k tokens takes well under a
    millisecond (kb/0062: ~20 µs on one core; the bound leaves room for a busy machine), and
    the worst case, one token repeated 32k times, a few."""
    rng = np.random.default_rng(0)
    ids = (rng.zipf(1.3, 32768) % 5000).tolist()  # frequent tokens, like text
    pl = PromptLookup(2, 4)
    pl.sync(ids, [])
    out: list[int] = []
    took, got = 0.0, []
    for i in range(200):
        out.append(ids[i])  # the output copies the prompt: every lookup matches
        pl.sync(ids, out)
        t = time.perf_counter()
        got.append(pl.propose(4))
        took += time.perf_counter() - t
    assert took / 200 < 1e-3, took / 200
    assert all(len(g) == 4 for g in got)
    for i in (0, 57, 199):
        assert got[i] == _reference(ids + out[:i + 1], 4, 2, 4)
    pl.sync([7] * 32768, [])
    t = time.perf_counter()
    assert pl.propose(4) == [7]
    assert time.perf_counter() - t < 20e-3
