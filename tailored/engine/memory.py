"""Index pools for the hybrid cache: KV pages (attention layers) and GDN state slots.

    python -m pytest -q tests/engine/test_memory.py

Pure Python, no torch: the pools hand out *indices* into tensors that the runner owns.
Index 0 of each pool is reserved as the pad sink (padding rows of a batch / CUDA graph write
there), so it is never handed out and never freed.

Pages are reference counted: a prefix-cache entry (engine/prefix_cache.py) and the requests
that reuse its prefix hold the same full pages (`PagePool.share`); `free` drops one reference
and a page goes back to the free list when none is left. Slots are never shared (a reused
prefix's GDN state is copied into the request's own slot).
"""

from __future__ import annotations


class _IndexPool:
    """Free list over indices 1..size-1, LIFO so a freed index is reused at once.

    LIFO reuse is deliberate: it makes stale-state bugs (a slot or page reused without reset)
    show up in tests instead of hiding behind a long free list.
    """

    def __init__(self, size: int, what: str) -> None:
        if size < 2:
            raise ValueError(
                f"{what} pool needs at least 2 entries (entry 0 is the pad sink), got {size}"
            )
        self.size = size
        self._what = what
        # pop() from the end yields 1, 2, 3, ... on a fresh pool
        self._free: list[int] = list(range(size - 1, 0, -1))
        self._refs = [0] * size  # holders of each index; entry 0 stays 0 forever
        self.num_allocs = 0  # lifetime counters, for tests and stats
        self.num_frees = 0

    @property
    def capacity(self) -> int:
        """Entries that can ever be handed out (size - 1: the pad sink is excluded)."""
        return self.size - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def _take(self, n: int) -> list[int]:
        out = [self._free.pop() for _ in range(n)]
        for i in out:
            self._refs[i] = 1
        self.num_allocs += n
        return out

    def _give(self, indices: list[int]) -> None:
        for i in indices:
            assert 0 < i < self.size, f"{self._what} {i} is not a valid index (1..{self.size - 1})"
            assert self._refs[i] > 0, f"double free of {self._what} {i}"
            self._refs[i] -= 1
            if not self._refs[i]:
                self._free.append(i)
                self.num_frees += 1

    def refs(self, i: int) -> int:
        """Holders of index i (0: free)."""
        return self._refs[i]

    def check_integrity(self) -> None:
        """Assert the free list and the reference counts agree (cheap; run when idle / in
        tests)."""
        assert not self._refs[0], f"{self._what} 0 (pad sink) is marked in use"
        assert len(set(self._free)) == len(self._free), f"duplicate {self._what} in free list"
        assert all(not self._refs[i] for i in self._free)
        assert sum(1 for r in self._refs if r) + len(self._free) == self.capacity
        assert self.num_allocs - self.num_frees == self.num_used


class PagePool(_IndexPool):
    """KV pages of `page_size` tokens. Page 0 is the pad sink and never handed out."""

    def __init__(self, num_pages: int) -> None:
        super().__init__(num_pages, "page")

    def allocate(self, n: int) -> list[int] | None:
        """Return `n` distinct page ids, or None (nothing taken) when fewer than `n` are free.

        None rather than an exception: running short is the normal admission/preemption signal.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            return None
        return self._take(n)

    def share(self, pages) -> None:
        """One more holder for each of `pages` (all in use): a prefix reused by a request
        (engine/prefix_cache.py). Each holder calls `free` once. AssertionError for a free or
        invalid id."""
        for i in pages:
            assert 0 < i < self.size and self._refs[i] > 0, f"share of free page {i}"
            self._refs[i] += 1

    def free(self, pages: list[int]) -> None:
        """Drop one holder of each page; a page with none left returns to the pool.
        AssertionError on a double free or an invalid id."""
        self._give(pages)


class SlotPool(_IndexPool):
    """GDN state slots (conv window + recurrent matrix per request). Slot 0 is the pad sink."""

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots, "slot")

    def allocate(self) -> int | None:
        """Return a free slot id (never 0), or None when all are in use."""
        if not self._free:
            return None
        return self._take(1)[0]

    def free(self, slot: int) -> None:
        """Return a slot. AssertionError on a double free or an invalid id (0 included)."""
        self._give([slot])


def pool_stats(pages: PagePool, slots: SlotPool, prefix) -> dict:
    """The pools' occupancy, for engine.stats(): KV pages and GDN state slots in use and in all,
    and the prefix cache's entries (`prefix`: the scheduler's PrefixCache or None) with the pages
    only it holds (given back on demand, so a gateway should not count them as load)."""
    return {
        "total_pages": pages.capacity,
        "used_pages": pages.num_used,
        "cached_pages": prefix.cache_only_pages() if prefix is not None else 0,
        "total_slots": slots.capacity,
        "used_slots": slots.num_used,
        "prefix_cache_entries": len(prefix) if prefix is not None else 0,
        "prefix_cache_capacity": prefix.capacity if prefix is not None else 0,
    }
