"""Is the engine loop still making progress? The stall half of `/health` (the other half: has
the loop's thread or process died).

A replica whose loop hangs inside a step (a wedged GPU, a deadlock) keeps answering HTTP; a
health check that only asks "is the process there" stays green while every request waits, and
gateways keep sending it traffic (peer engines shipped exactly that). So the loop reports each
sign of life and the front end judges: the loop is *stalled* when work waits and the loop has
not finished a step (or picked the work up) for longer than a bound.

    loop (engine thread or engine process)      front end (the HTTP server's threads)
    beat(idle=False) after every step           submitted() for every command it queues
    beat(idle=True) before sleeping, idle       stalled_for() -> seconds work has waited
    beat(idle=False) on waking

Work waits when the loop was busy at its last beat (it runs requests: the wait counts from that
beat), or when it went idle and a command was queued after that (the wait counts from the
first such command). The two numbers live in a `cell`: a list for a thread, shared memory
(`multiprocessing` RawArray) for the engine process. Times are `time.monotonic()`, which on
Linux is one clock for every process of the machine. The loop writes the time before the flag,
so a reader between the two writes sees a fresh time: never a false stall.
"""

from __future__ import annotations

import time

BEAT, IDLE = 0, 1  # the cell's entries: time of the last beat, 1.0 if the loop went idle then


class LoopWatch:
    """The loop's last beat and the front end's oldest unanswered command.

    cell: two floats [beat time, idle flag] shared with the loop (None: a new list, for a loop
    in a thread of this process)."""

    def __init__(self, cell=None) -> None:
        self.cell = cell if cell is not None else [0.0, 0.0]
        self.cell[BEAT] = time.monotonic()
        self.cell[IDLE] = 1.0
        self._pending_since: float | None = None

    @classmethod
    def shared(cls, ctx) -> LoopWatch:
        """A watch whose cell is shared memory of the multiprocessing context `ctx`: pass
        `.cell` to the child, which wraps it in `LoopWatch(cell)`."""
        return cls(ctx.RawArray("d", 2))

    # ---- the loop ----------------------------------------------------------------------------
    def beat(self, idle: bool) -> None:
        """A sign of life: a step finished (idle False), the loop goes to sleep with nothing to
        do (True), or it woke up (False)."""
        self.cell[BEAT] = time.monotonic()
        self.cell[IDLE] = 1.0 if idle else 0.0

    # ---- the front end -----------------------------------------------------------------------
    def submitted(self) -> None:
        """A command was queued for the loop (a request, a stats call)."""
        p = self._pending_since
        if p is None or p < self.cell[BEAT]:  # the loop has beaten since: a new wait starts
            self._pending_since = time.monotonic()

    def stalled_for(self) -> float:
        """Seconds work has waited without the loop finishing a step or picking it up; 0 when
        nothing waits."""
        beat, idle = self.cell[BEAT], self.cell[IDLE]
        if idle:
            p = self._pending_since
            if p is None or p < beat:
                return 0.0
            beat = p
        return max(0.0, time.monotonic() - beat)
