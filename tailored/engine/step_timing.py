"""Where an engine step's wall time goes, for the server's periodic log line (kb/0011).

The served decode step at 32 streams took 22.7 ms between tokens on the H200 where the same
step in-process took 14.5 ms; this splits each step into host phases so the served log says
which one grows. Phases (milliseconds, `time.perf_counter`):
  gap       end of the previous step() → start of this one (output dispatch, commands, GIL waits)
  schedule  scheduler.schedule()
  build     runner: batch layout → device tensors
  launch    runner: model forward (host time to enqueue the kernels / replay the graph)
  wait      runner: logits, sampling and the wait for the GPU (≈ GPU time not hidden by host work)
  draft     runner, speculative decoding only: acceptance, GDN state commits and the MTP's
            drafts after the tokens are read (its own sync included); left out of the line
            for a kind that never had it
  finish    scheduler.update + detokenize + outputs
and, on CUDA, `gpu`: CUDA-event span from the forward's first enqueue to the logits (not part of
the sum; `wait` well above `gpu − launch` means the engine thread waited for the GIL, not for
the GPU, after the sampler's sync).
Steps are grouped by kind: decode (every row one token), verify (every row a decode row, some
with speculative drafts), prefill (no decode row), mixed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

PHASES = ("gap", "schedule", "build", "launch", "wait", "draft", "finish")
# reported by the runner through runner_phase(); draft: speculative decoding's acceptance, state
# commits and MTP drafts after the step's tokens are read (its own sync included)
RUNNER_PHASES = ("build", "launch", "wait", "draft")


@dataclass
class _Kind:
    steps: int = 0
    rows: int = 0
    tokens: int = 0
    ms: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    gpu_ms: float = 0.0
    gpu_steps: int = 0  # steps with a GPU span (not: CPU, or no sampled row)


def step_kind(seqs) -> str:
    """The kind of a step of ScheduledSeqs: prefill (no decode row), decode (every row one
    token), verify (every row a decode row, some with drafts) or mixed."""
    # a decode row: its last token and its drafts (a verify chunk of speculative decoding)
    decode_rows = sum(1 for s in seqs if len(s.token_ids) == 1 + s.num_draft and s.start_pos > 0)
    return ("prefill" if not decode_rows else "mixed" if decode_rows < len(seqs)
            else "verify" if any(s.num_draft for s in seqs) else "decode")


class StepTimer:
    """Accumulates phase times per step kind; `summary()` renders and `reset()` clears them."""

    def __init__(self) -> None:
        self.kinds: dict[str, _Kind] = {}
        self.runner_ms: dict[str, float] = {}  # build/launch/wait of the step in flight
        self._last_end: float | None = None
        self.notes = None  # a callable whose line ends the summary (the step budget's fit)

    def runner_phase(self, name: str, t0: float) -> float:
        """Record runner phase `name` as now − t0 ms; returns now (the next phase's t0)."""
        now = time.perf_counter()
        self.runner_ms[name] = (now - t0) * 1e3
        return now

    def record(self, kind: str, rows: int, tokens: int, t_start: float, t_sched: float,
               t_exec: float, t_end: float) -> None:
        k = self.kinds.setdefault(kind, _Kind())
        k.steps += 1
        k.rows += rows
        k.tokens += tokens
        ms = k.ms
        if self._last_end is not None and t_start - self._last_end < 1.0:  # not an idle gap
            ms["gap"] += (t_start - self._last_end) * 1e3
        ms["schedule"] += (t_sched - t_start) * 1e3
        named = 0.0
        for name in RUNNER_PHASES:
            v = self.runner_ms.get(name, 0.0)
            ms[name] += v
            named += v
        # execute's time outside the runner's named phases (all of it for a runner without them)
        ms["launch"] += max((t_exec - t_sched) * 1e3 - named, 0.0)
        ms["finish"] += (t_end - t_exec) * 1e3
        if "gpu" in self.runner_ms:
            k.gpu_ms += self.runner_ms["gpu"]
            k.gpu_steps += 1
        self.runner_ms = {}
        self._last_end = t_end

    @property
    def steps(self) -> int:
        return sum(k.steps for k in self.kinds.values())

    def summary(self) -> str:
        """One line per kind: steps, mean rows/tokens, mean ms per phase and per step."""
        parts = []
        for name, k in sorted(self.kinds.items()):
            n = max(k.steps, 1)
            phases = " ".join(f"{p} {k.ms[p] / n:.2f}" for p in PHASES
                              if p != "draft" or k.ms[p] > 0)
            parts.append(f"{name}: {k.steps} steps, {k.rows / n:.1f} rows, {k.tokens / n:.0f} tokens, "
                         f"ms/step {sum(k.ms.values()) / n:.2f} = {phases}"
                         + (f" (gpu {k.gpu_ms / k.gpu_steps:.2f})" if k.gpu_steps else ""))
        if self.notes is not None:
            parts.append(self.notes())
        return "; ".join(parts)

    def reset(self) -> None:
        self.kinds = {}


class TimingLog:
    """When to log a StepTimer: every `every_s` while the engine is busy, and once more when it
    goes idle (a last window of ≥ 1 s, not a line per request). Idle time is not part of a
    window. Used by the engine loop in a thread (server/async_engine.py) and in a process
    (server/engine_process.py). timer None (an engine without one): never logs."""

    def __init__(self, timer: StepTimer | None, every_s: float, logger) -> None:
        self.timer, self.every_s, self.logger = timer, every_s, logger
        self.t0 = time.monotonic()
        self.carried_s = 0.0  # busy time of earlier short busy periods not logged yet

    def after_step(self) -> None:
        self._maybe_log(self.every_s)

    def going_idle(self) -> None:
        if not self._maybe_log(min(1.0, self.every_s)):
            self.carried_s += time.monotonic() - self.t0  # its steps stay in the timer

    def waking(self) -> None:
        self.t0 = time.monotonic()

    def _maybe_log(self, window_s: float) -> bool:
        now = time.monotonic()
        busy = self.carried_s + now - self.t0  # the window: busy time only, idle left out
        if self.timer is None or busy < window_s:
            return False
        if self.timer.steps:
            self.logger.info("step timing over %.0f s: %s", busy, self.timer.summary())
            self.timer.reset()
        self.t0, self.carried_s = now, 0.0
        return True
