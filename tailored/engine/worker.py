"""What the engine needs from the worker that runs its steps on the device.

The engine (scheduler, detokenizer, grammars) never touches tensors and never imports the
worker: it drives any object with this shape. `worker.runner.ModelRunner` is the real one;
the engine tests drive fakes. A runner without `launch`/`collect` (only `execute`) runs every
step synchronously; one without `resample` gets no structured rows launched ahead.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from tailored.engine.types import ModelOutput, ScheduledSeq, SchedulerOutput


@runtime_checkable
class StepRunner(Protocol):
    """Runs one scheduled step to its sampled tokens. num_pages / num_slots: the sizes of the
    cache the engine's pools hand out (index 0 of each is the pad sink)."""

    num_pages: int
    num_slots: int

    def execute(self, sched: SchedulerOutput) -> ModelOutput: ...


@runtime_checkable
class AsyncStepRunner(StepRunner, Protocol):
    """A runner that can enqueue a step and read it later (async scheduling, kb/0015).

    launch(sched, feed): enqueue a step; `feed`, the previous launched step still running,
    supplies the device ids of PENDING_TOKEN rows. collect(step): wait for its tokens.
    resample(step, fixes): sample rows [(row, seq)] of a launched step again before collect.
    `timer` (engine/step_timing.StepTimer or None) is set by the engine; `spec_stats` is
    [verify steps, drafts verified, drafts kept]."""

    timer: Any
    spec_stats: list[int]

    def launch(self, sched: SchedulerOutput, feed: Any = None) -> Any: ...

    def collect(self, step: Any) -> ModelOutput: ...

    def resample(self, step: Any, fixes: list[tuple[int, ScheduledSeq]]) -> None: ...
