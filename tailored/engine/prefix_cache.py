"""Prefix cache for the hybrid model: a prompt's KV pages and its GDN state, kept for the next
prompt that starts with it.

    python -m pytest -q tests/engine/test_prefix_cache.py

Why it differs from a transformer's prefix cache: KV pages can be shared from any page
boundary, but a Gated DeltaNet layer's state is one matrix per request that each token
overwrites, so a prefix can only be reused where its state was saved, exactly at its last
token (failure-cases §3: a state taken at the wrong position makes cache hits decode
differently from cold runs). The state is in the request's slot at the end of each prefill
chunk, so an entry is made where a chunk ends: at the prompt's **save point** (`save_points`),
the scheduler ends a chunk there and asks for a snapshot (`reserve`), the runner copies the
slot's conv and recurrent state into a snapshot slot right after that step's forward, and the
entry counts once the step's results are in (`commit`; a step that failed is `discard`ed).

The save point is where the prompt's last chat message ends: before its last `<|im_start|>`
(`boundary_ids`, set by the engine from the tokenizer). A chat prompt ends with the generation
prompt (`<|im_start|>assistant\n<think>\n`), which the next turn does not repeat (it renders the
answer there instead): an entry at the prompt's end would never hit — the "0 % hits on this
architecture" of failure-cases §3. Ending a chunk there costs one more prefill step of those
few tokens (a prompt with no `<|im_start|>` is saved at its end, no extra step). What hits: a
later prompt that extends an earlier prompt up to its save point — the next turn of a chat or
an agent loop, the same conversation sent again, a preempted request's recompute.

A prompt that opens with a system message (`lead_ids`: `<|im_start|>system`) of at least
MIN_TOKENS has a second save point where that message ends (before the next `<|im_start|>`):
a new conversation with the same system prompt — and tool list, which the template renders
into it — hits there. It costs a cold prompt one more chunk end, and an entry per distinct
system prompt. Prompts sharing some other part before their last message do not hit: that
would need states inside a prefill chunk (vLLM's "align" mode for hybrid models).

An entry holds one reference to each of its ceil(length / page_size) pages (their KV of
positions [0, length) never changes: requests only append) and one snapshot slot. A hit
shares the entry's full pages, copies its partial last page into a page of its own (the
request writes its next positions there) and copies the snapshot into its own slot; the
copies run on the device before the step's forward, in stream order
(`SchedulerOutput.state_copies` / `page_copies`). Entries are evicted least recently used
first when a snapshot slot or pages are needed (before any running request is preempted).

Keys: a chain hash over full pages (BLAKE2b of the previous page's hash and the page's ids)
plus the tail of ids after the last full page, compared exactly; a request's chain is computed
once and extended as its ids grow.
"""

from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from dataclasses import dataclass

import numpy as np

from tailored.engine.memory import PagePool

# shorter prompts are not worth a snapshot (a slot's state is ~64 MB at full size, its copy
# ~25 µs on the H200) nor the LRU place they would take
MIN_TOKENS = 64


@dataclass(frozen=True)
class Snapshot:
    """A prefix entry being made: the runner copies `slot`'s state into snapshot slot `snap`
    after the step's forward; `length` ids (`chain`: the hash of their full pages, `tail`: the
    ids after them) are in that state and in `pages`' KV."""

    request_id: str
    slot: int
    snap: int
    length: int
    chain: bytes
    tail: tuple[int, ...]
    pages: tuple[int, ...]


@dataclass
class PrefixHit:
    """A lookup's answer: the entry's first `length` ids prefix the request's ids."""

    length: int
    snap: int
    pages: tuple[int, ...]  # ceil(length / page_size): the full ones shared, the last copied


class PrefixCache:
    """The entries, their snapshot slots and their page references.

    page_size: tokens a KV page holds. snap_slots: the cache's state slots reserved for
    snapshots (after the requests' slots). pages: the scheduler's page pool.
    """

    def __init__(self, page_size: int, snap_slots: range, pages: PagePool) -> None:
        self.page_size = page_size
        self.pages = pages
        self._free_snaps = list(reversed(snap_slots))
        self.capacity = len(snap_slots)
        # (chain, tail) -> Snapshot, least recently used first
        self._entries: OrderedDict[tuple[bytes, tuple[int, ...]], Snapshot] = OrderedDict()
        self._by_chain: dict[bytes, set[tuple[bytes, tuple[int, ...]]]] = {}
        self._chains: dict[str, list[bytes]] = {}  # request id -> hash of its first i pages
        # keys of the snapshots reserved, not yet committed or discarded
        self._pending: set[tuple[bytes, tuple[int, ...]]] = set()
        # tokens a saved prefix ends before (the chat format's <|im_start|>); see save_points
        self.boundary_ids: frozenset[int] = frozenset()
        # the ids a prompt opens with when its first message is the system prompt
        # (`<|im_start|>system`): that message's end is a save point too; see save_points
        self.lead_ids: tuple[int, ...] = ()
        self._points: dict[str, tuple[int, ...]] = {}  # request id -> its save points
        self.queries = 0  # tokens looked up (prompts admitted with a lookup), vLLM's counter
        self.hits = 0  # tokens of those found in the cache

    def __len__(self) -> int:
        return len(self._entries)

    # ---- hashing -----------------------------------------------------------------------------
    def _chain(self, request_id: str, ids: list[int], n_pages: int) -> list[bytes]:
        """Hashes of ids' first 0..n_pages full pages (memoised per request)."""
        chain = self._chains.setdefault(request_id, [b""])
        ps = self.page_size
        for i in range(len(chain) - 1, n_pages):
            block = np.asarray(ids[i * ps:(i + 1) * ps], dtype=np.int64).tobytes()
            chain.append(hashlib.blake2b(chain[i] + block, digest_size=16).digest())
        return chain

    def forget(self, request_id: str) -> None:
        """Drop a request's memoised hashes and save point (it left the scheduler)."""
        self._chains.pop(request_id, None)
        self._points.pop(request_id, None)

    def save_points(self, request_id: str, prompt: list[int]) -> tuple[int, ...]:
        """Where `prompt`'s entries end (ids before each), ascending; () for a prompt shorter
        than MIN_TOKENS or without snapshot slots. The last: before the prompt's last boundary
        id (the start of the chat's generation prompt) when that leaves MIN_TOKENS, else the
        whole prompt. Before it, with `lead_ids` opening the prompt: the end of that first
        (system) message — before the next boundary id — when it has MIN_TOKENS. Memoised
        per request."""
        pts = self._points.get(request_id)
        if pts is None:
            p = len(prompt) if len(prompt) >= MIN_TOKENS and self.capacity else 0
            if p and self.boundary_ids:
                b = self.boundary_ids
                last = next((i for i in range(len(prompt) - 1, MIN_TOKENS - 1, -1)
                             if prompt[i] in b), None)
                if last is not None:
                    p = last
            pts = (p,) if p else ()
            lead = self.lead_ids
            if p and lead and tuple(prompt[:len(lead)]) == lead:
                first = next((i for i in range(len(lead), p) if prompt[i] in self.boundary_ids),
                             None)
                if first is not None and first >= MIN_TOKENS:
                    pts = (first, p)
            self._points[request_id] = pts
        return pts

    # ---- lookup ------------------------------------------------------------------------------
    def lookup(self, request_id: str, ids: list[int]) -> PrefixHit | None:
        """The longest entry whose ids prefix `ids` and leave at least one of them to run (its
        logits give the next token); None when none does. Made most recently used. (The
        scheduler counts `queries` and `hits` for the requests it admits.)"""
        n = len(ids)
        if not self._entries or n <= MIN_TOKENS:
            return None
        ps = self.page_size
        chain = self._chain(request_id, ids, (n - 1) // ps)
        for i in range((n - 1) // ps, MIN_TOKENS // ps - 1, -1):
            keys = self._by_chain.get(chain[i])
            if not keys:
                continue
            best = None
            for key in keys:
                e = self._entries[key]
                if e.length <= n - 1 and tuple(ids[i * ps:e.length]) == e.tail and (
                        best is None or e.length > best.length):
                    best = e
            if best is not None:
                key = (best.chain, best.tail)
                self._entries.move_to_end(key)
                return PrefixHit(best.length, best.snap, best.pages)
        return None

    # ---- making entries ----------------------------------------------------------------------
    def reserve(self, request_id: str, ids: list[int], slot: int,
                pages: list[int]) -> Snapshot | None:
        """A snapshot of the state after all of `ids` (in `slot` after this step's forward)
        with their KV in `pages`, or None: too short, already an entry (made most recently
        used), already reserved in this step, or every snapshot slot taken by snapshots of
        this step. Evicts the least recently used entry for its slot; takes one reference to
        each of the entry's pages."""
        n = len(ids)
        if n < MIN_TOKENS or self.capacity == 0:
            return None
        ps = self.page_size
        chain = self._chain(request_id, ids, n // ps)[n // ps]
        tail = tuple(ids[(n // ps) * ps:])
        if (chain, tail) in self._entries:
            self._entries.move_to_end((chain, tail))
            return None
        if (chain, tail) in self._pending:
            # the same ids reach this point in another request of the step (the choices of n,
            # a burst of chats on a new system prompt): one snapshot serves, and none of the
            # entries is evicted for a copy that commit would throw away (kb/0054 §3)
            return None
        if not self._free_snaps and not self.evict_one():
            return None
        own = tuple(pages[:-(-n // ps)])
        self.pages.share(own)
        self._pending.add((chain, tail))
        return Snapshot(request_id, slot, self._free_snaps.pop(), n, chain, tail, own)

    def commit(self, snap: Snapshot) -> None:
        """The step that copied it ran: the snapshot is an entry (most recently used)."""
        key = (snap.chain, snap.tail)
        self._pending.discard(key)
        # no duplicate can exist: reserve refuses a key that is an entry or already reserved
        assert key not in self._entries, "a prefix-cache snapshot reserved twice"
        self._entries[key] = snap
        self._by_chain.setdefault(snap.chain, set()).add(key)

    def discard(self, snap: Snapshot) -> None:
        """The step that was to copy it failed: give back its slot and page references."""
        self._pending.discard((snap.chain, snap.tail))
        self._release(snap)

    # ---- eviction ----------------------------------------------------------------------------
    def evict_one(self, for_pages: bool = False) -> bool:
        """Drop the least recently used entry; False when there is none. Its pages return to
        the pool once no request shares them. for_pages: only an entry that would give a page
        back (one that no request shares; an entry whose pages running requests all share
        frees none and stays: kb/0053)."""
        key = next((k for k, e in self._entries.items()
                    if not for_pages or any(self.pages.refs(p) == 1 for p in e.pages)), None)
        if key is None:
            return False
        snap = self._entries.pop(key)
        keys = self._by_chain[snap.chain]
        keys.discard(key)
        if not keys:
            del self._by_chain[snap.chain]
        self._release(snap)
        return True

    def clear(self) -> None:
        """Drop every entry."""
        while self.evict_one():
            pass

    def cache_only_pages(self) -> int:
        """Pages that no request holds, only entries: what evicting every entry would free."""
        held = Counter(p for e in self._entries.values() for p in e.pages)
        return sum(1 for p, n in held.items() if self.pages.refs(p) == n)

    def _release(self, snap: Snapshot) -> None:
        self.pages.free(list(snap.pages))
        self._free_snaps.append(snap.snap)

    def check_integrity(self) -> None:
        """Assert the snapshot slots add up and every entry's pages are held."""
        assert len(self._free_snaps) + len(self._entries) + len(self._pending) == self.capacity
        assert len(set(self._free_snaps)) == len(self._free_snaps)
        for e in self._entries.values():
            assert all(self.pages.refs(p) > 0 for p in e.pages)
