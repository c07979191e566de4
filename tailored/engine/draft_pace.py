"""How many drafts a request's next step verifies: as many as its recent acceptance pays for,
down to none (EngineConfig.spec_min_acceptance).

    python -m pytest -q tests/engine/test_draft_pace.py

Per draft position j (1..N) the pace keeps a_j, the chance that draft j is kept when drafts
1..j-1 were: a verify chunk of d drafts that kept k tested positions 1..k (kept) and k + 1 if
k < d (rejected; the first rejected draft ends the chunk). Each a_j is kept / tested, both sums
decayed by DECAY at every chunk that tests position j (a new request starts as if PRIOR drafts
had been tested and kept at each). Draft j is then kept with chance P_j = a_1 · … · a_j, and the
next step proposes the largest k <= N with P_k >= threshold (EngineConfig.spec_min_acceptance;
at least 1: a step that drafts at all proposes one). Positions past the chunks' lengths are not
tested: their sums drift back to the prior by DRIFT a chunk, so a position that once failed is
tried again some 10-20 chunks later (a request's text changes).

Per position, not one rate: MTP drafts of nano keep the first draft of a prompt 0.95 of the
time and its second 0.05 (the one rate would be ~0.5, and pause drafts that pay).

When a_1 < threshold the request pauses: its next `wait` decode steps draft nothing (no MTP run,
no prompt lookup, no verify rows: on CUDA they are launched ahead like any plain decode), then
one step drafts a single draft as a probe. A probe that is kept starts the estimates afresh (the
prior); one that is not doubles the wait, FIRST_WAIT up to MAX_WAIT steps. So a request whose
drafts are all rejected pays one draft every MAX_WAIT steps, and one whose text turns repetitive
drafts again within the wait.

With prompt lookup alone, a step that finds no match counts as a rejected first draft: being
ready to draft costs the step (on CUDA it cannot be launched ahead), and text that never repeats
should pause like drafts that never match.

The constants come from a simulation of Bernoulli acceptances (kb/0062): at a steady a = 0.8 a
request drafts at ~98 % of its steps; at a <= 0.3 at ~3-8 % (probes); a collapse from high to no
acceptance pauses within ~7 verify steps. Deterministic: the same kept counts give the same
lengths (tests/engine/test_draft_pace.py feeds fake acceptance sequences). The lengths only
decide what is proposed; verification keeps the output the greedy output whatever they are.
"""

from __future__ import annotations

DECAY = 0.9  # weight of a position's older chunks at each chunk that tests it
DRIFT = 0.95  # an untested position's sums move (1 - DRIFT) of the way to the prior a chunk
PRIOR = 4.0  # a new request's estimates: as if PRIOR drafts were tested and kept at each position
FIRST_WAIT = 4  # decode steps without drafts after the first pause
MAX_WAIT = 64  # the longest pause between probes


class DraftPace:
    """One request's adaptive draft length. max_drafts: N (num_speculative_tokens);
    threshold: EngineConfig.spec_min_acceptance (0: always N, never paused)."""

    def __init__(self, max_drafts: int, threshold: float):
        self.max_drafts, self.threshold = max_drafts, threshold
        self._fresh()
        self.wait = 0  # decode steps left without drafts (0: drafting)
        self.next_wait = FIRST_WAIT
        self.probing = False  # the pause is over: the next step drafts one draft as a probe

    def _fresh(self) -> None:
        self.kept = [PRIOR] * self.max_drafts  # per position, decayed sums
        self.tested = [PRIOR] * self.max_drafts

    def rate(self, j: int = 0) -> float:
        """a_{j+1}: the chance that draft j + 1 is kept when the drafts before it were."""
        return self.kept[j] / self.tested[j]

    @property
    def active(self) -> bool:
        """Whether the request drafts at its next step (not paused)."""
        return self.wait == 0

    def length(self) -> int:
        """Drafts the next step verifies: 0 while paused, 1 for a probe, else the largest k in
        1..N with a_1 · … · a_k >= threshold."""
        if self.wait:
            return 0
        if self.probing:
            return 1
        k, p = 0, 1.0
        while k < self.max_drafts:
            p *= self.rate(k)
            if p < self.threshold:
                break
            k += 1
        return max(k, 1)

    def record(self, proposed: int, kept: int) -> None:
        """A verify chunk's result: `proposed` drafts, `kept` of them kept (the first kept
        prefix). Pauses the request when a_1 falls below the threshold."""
        if self.probing:
            self.probing = False
            if kept == proposed:  # drafts match again: start afresh
                self._fresh()
                self.next_wait = FIRST_WAIT
            else:
                self._pause()
            return
        for j in range(self.max_drafts):
            if j < kept or (j == kept < proposed):  # tested: kept below `kept`, then rejected
                self.kept[j] = DECAY * self.kept[j] + (j < kept)
                self.tested[j] = DECAY * self.tested[j] + 1
            else:  # not tested: back towards the prior
                self.kept[j] = DRIFT * self.kept[j] + (1 - DRIFT) * PRIOR
                self.tested[j] = DRIFT * self.tested[j] + (1 - DRIFT) * PRIOR
        if self.rate(0) < self.threshold:
            self._pause()

    def _pause(self) -> None:
        self.wait = self.next_wait
        self.next_wait = min(2 * self.next_wait, MAX_WAIT)

    def tick(self) -> None:
        """A decode step of the request while paused."""
        if self.wait:
            self.wait -= 1
            self.probing = self.wait == 0
