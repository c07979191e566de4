"""engine/step_timing.py: the phases of a step add up to its wall time, kinds are told apart."""

import time

from tailored.engine.step_timing import PHASES, StepTimer, TimingLog
from tailored.engine.types import SamplingParams
from tailored.stack import build_stack


def test_phases_sum_to_the_step_and_runner_phases_land():
    t = StepTimer()
    t0 = time.perf_counter()
    t.runner_ms = {"build": 1.0, "launch": 2.0, "wait": 3.0}
    t.record("decode", rows=4, tokens=4, t_start=t0, t_sched=t0 + 0.001, t_exec=t0 + 0.008,
             t_end=t0 + 0.010)
    k = t.kinds["decode"]
    assert k.steps == 1 and k.rows == 4
    assert abs(k.ms["schedule"] - 1.0) < 1e-6 and abs(k.ms["finish"] - 2.0) < 1e-6
    # execute took 7 ms, 6 ms in named runner phases: the other 1 ms counts as launch
    assert abs(k.ms["launch"] - 3.0) < 1e-6 and abs(k.ms["wait"] - 3.0) < 1e-6
    assert abs(sum(k.ms.values()) - 10.0) < 1e-6
    # draft only where speculative decoding ran (never here)
    assert "decode: 1 steps" in t.summary() and all(p in t.summary() for p in PHASES
                                                    if p != "draft")
    assert "draft" not in t.summary()
    t.reset()
    assert t.steps == 0 and t.summary() == ""


def test_engine_records_prefill_then_decode_steps():
    st = build_stack(None, device="cpu", max_model_len=256, max_num_seqs=4)
    e = st.engine
    e.add_request("a", list(range(10, 30)), SamplingParams(max_tokens=3, temperature=0.0))
    while e.has_unfinished():
        e.step()
    kinds = e.timer.kinds
    assert kinds["prefill"].steps == 1 and kinds["prefill"].tokens == 20
    assert kinds["decode"].steps == 2 and kinds["decode"].rows == 2
    # the runner reported its phases (build, launch, wait all ran)
    assert all(kinds["decode"].ms[p] > 0 for p in ("build", "launch", "wait"))


def test_gpu_span_is_reported_apart_from_the_phases():
    t = StepTimer()
    t0 = time.perf_counter()
    t.runner_ms = {"build": 1.0, "launch": 1.0, "wait": 5.0, "gpu": 5.5}
    t.record("decode", 1, 1, t0, t0, t0 + 0.007, t0 + 0.007)
    k = t.kinds["decode"]
    assert abs(sum(k.ms.values()) - 7.0) < 1e-6 and k.gpu_ms == 5.5
    assert "(gpu 5.50)" in t.summary()


def _timing_log():
    """(lines logged, StepTimer, TimingLog every 10 s writing into lines)."""
    lines = []

    class Log:
        def info(self, fmt, *args):
            lines.append(fmt % args)

    timer = StepTimer()
    return lines, timer, TimingLog(timer, 10.0, Log())


def test_timing_log_windows():
    """TimingLog (both engine loops): a line every every_s while busy, a last window of >= 1 s
    on going idle, nothing without steps, and idle time left out of the next window."""
    lines, timer, log = _timing_log()
    t = time.perf_counter()
    timer.record("decode", 1, 1, t, t, t, t)
    log.after_step()
    log.going_idle()
    assert lines == []  # under both windows
    log.t0 -= 2.0
    log.after_step()
    assert lines == []  # busy: 2 s < 10 s
    log.going_idle()
    assert len(lines) == 1 and lines[0].startswith("step timing over 2 s: decode: 1 steps")
    assert timer.steps == 0  # reset after logging
    log.t0 -= 20.0
    log.after_step()
    assert len(lines) == 1  # no steps in the window: nothing to say
    log.waking()
    timer.record("decode", 1, 1, t, t, t, t)
    log.going_idle()
    assert len(lines) == 1  # the idle time before waking does not count
    log.t0 -= 11.0
    log.after_step()
    assert len(lines) == 2


def test_timing_log_window_counts_short_busy_periods_it_carried():
    """Busy periods too short to log keep their steps in the timer; the line that finally
    reports them names their summed busy time, not only the last period's (attack run,
    session 7: "over 2 s" for ~6 s of steps)."""
    lines, timer, log = _timing_log()
    t = time.perf_counter()
    for _ in range(3):  # three 0.7 s bursts, idle in between
        log.waking()
        timer.record("decode", 1, 1, t, t, t, t)
        log.t0 -= 0.7
        log.going_idle()
    # the 2nd burst brings the busy sum to 1.4 s >= 1 s: one line for both bursts' steps
    assert len(lines) == 1 and lines[0].startswith("step timing over 1 s: decode: 2 steps"), lines
    assert timer.steps == 1 and abs(log.carried_s - 0.7) < 0.05
