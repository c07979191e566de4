"""PagePool / SlotPool accounting: pad sink never handed out, no leaks, double frees caught."""

from __future__ import annotations

import random

import pytest

from tailored.engine.memory import PagePool, SlotPool


def test_page_pool_never_hands_out_zero_and_drains_exactly():
    pool = PagePool(9)
    assert pool.capacity == pool.num_free == 8
    got = pool.allocate(8)
    assert sorted(got) == list(range(1, 9))
    assert pool.num_free == 0 and pool.num_used == 8
    assert pool.allocate(1) is None  # short: nothing taken
    assert pool.allocate(0) == []
    pool.free(got)
    assert pool.num_free == 8
    pool.check_integrity()


def test_page_pool_short_allocation_takes_nothing():
    pool = PagePool(5)
    a = pool.allocate(3)
    assert pool.allocate(2) is None
    assert pool.num_free == 1
    pool.free(a)
    assert pool.num_free == 4


def test_page_pool_double_free_and_bad_ids():
    pool = PagePool(4)
    pages = pool.allocate(2)
    pool.free(pages[:1])
    with pytest.raises(AssertionError, match="double free"):
        pool.free(pages[:1])
    with pytest.raises(AssertionError):
        pool.free([0])  # the pad sink is never owned
    with pytest.raises(AssertionError):
        pool.free([4])
    with pytest.raises(ValueError):
        pool.allocate(-1)


def test_slot_pool():
    pool = SlotPool(3)
    a, b = pool.allocate(), pool.allocate()
    assert {a, b} == {1, 2}
    assert pool.allocate() is None
    pool.free(a)
    assert pool.allocate() == a  # LIFO reuse: stale-state bugs show up at once
    pool.free(b)
    with pytest.raises(AssertionError, match="double free"):
        pool.free(b)
    with pytest.raises(AssertionError):
        pool.free(0)
    with pytest.raises(ValueError):
        SlotPool(1)


def test_random_churn_returns_to_baseline():
    rng = random.Random(0)
    pool = PagePool(33)
    held: list[list[int]] = []
    for _ in range(2000):
        if held and rng.random() < 0.5:
            pool.free(held.pop(rng.randrange(len(held))))
        else:
            got = pool.allocate(rng.randint(1, 6))
            if got is not None:
                assert 0 not in got
                held.append(got)
        owned = [p for h in held for p in h]
        assert len(owned) == len(set(owned)) == pool.num_used
    for h in held:
        pool.free(h)
    assert pool.num_free == pool.capacity
    assert pool.num_allocs == pool.num_frees
    pool.check_integrity()
