"""Prompt lookup (n-gram) drafts: what followed the last earlier occurrence of a request's last
n tokens in its own prompt + output (EngineConfig.speculative_method "ngram", "ngram+mtp").

    python -m pytest -q tests/engine/test_prompt_lookup.py

The drafter that repetitive text wants: a code edit that copies most of the code it was given,
JSON reformatted or extracted, a passage quoted back. It runs on the host, needs no model, and
its drafts are verified like the MTP head's (the output stays the greedy output).

Rule (vLLM's `prompt_lookup_max` / `prompt_lookup_min`): the longest n in min_n..max_n for
which the last n tokens occur earlier in prompt + output; of those occurrences the most recent;
the drafts are the (up to) k tokens after it. Nothing when even the last min_n tokens never
occurred before.

Cost: each request keeps its tokens in a growing int32 array (4 bytes a token, appended as
tokens come). A lookup is min_n vectorised comparisons over the array (the occurrences of the
last min_n tokens), then one narrowing pass per further n over those occurrences only: O(L)
in numpy, no Python loop over the context (kb/0062: ~20 µs at L = 32k on one core; 32k
copies of one token, the worst case, ~0.5 ms). It runs only for requests that draft, while at most
spec_max_running requests run.
"""

from __future__ import annotations

import numpy as np


class PromptLookup:
    """One request's tokens (prompt + output) and the lookup over them. min_n..max_n: the
    n-gram lengths tried, the longest that matches wins."""

    def __init__(self, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"PromptLookup needs 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self.ids = np.zeros(0, dtype=np.int32)
        self.n = 0  # tokens held: ids[:n]

    def sync(self, prompt_ids: list[int], output_ids: list[int]) -> None:
        """Take the tokens of prompt + output not held yet. A request's tokens only grow while
        it runs (a preemption keeps its outputs); should they ever shrink, start over."""
        P = len(prompt_ids)
        total = P + len(output_ids)
        if total < self.n:
            self.n = 0
        if total == self.n:
            return
        if total > len(self.ids):
            grown = np.zeros(max(total, 2 * len(self.ids), 64), dtype=np.int32)
            grown[:self.n] = self.ids[:self.n]
            self.ids = grown
        if self.n < P:
            self.ids[self.n:P] = prompt_ids[self.n:]
            self.n = P
        self.ids[self.n:total] = output_ids[self.n - P:]
        self.n = total

    def propose(self, k: int) -> list[int]:
        """Up to k draft ids after the held tokens (fewer where the match is near the end);
        [] when no n-gram of min_n..max_n tokens ending the context occurred before."""
        L = self.n
        if k <= 0 or L <= self.min_n:
            return []
        a = self.ids[:L]
        # cand: where the earlier occurrences of the last m tokens end (p < L - 1), first for
        # m = min_n in one vectorised pass (min_n comparisons over the context), then narrowed
        m = self.min_n
        mask = a[m - 1:L - 1] == a[L - 1]
        for i in range(1, m):
            mask &= a[m - 1 - i:L - 1 - i] == a[L - 1 - i]
        cand = np.flatnonzero(mask) + (m - 1)
        while cand.size and m < self.max_n and m < L - 1:
            longer = cand[cand >= m]
            longer = longer[a[longer - m] == a[L - 1 - m]]
            if not longer.size:
                break
            cand, m = longer, m + 1
        if not cand.size:
            return []
        p = int(cand[-1])
        return a[p + 1:p + 1 + k].tolist()
