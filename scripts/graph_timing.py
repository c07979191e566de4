"""Timing of a step of GPU launches through one CUDA graph, shared by the kernel benches
(scripts/bench_moe.py, bench_route.py, bench_moe_gemv.py, bench_fp8_gemv.py); imported by
name, as the scripts run from scripts/ (`python3 scripts/bench_x.py`)."""

from __future__ import annotations

import statistics

import torch


def time_graph(step, calls: int, reps: int, rounds: int) -> tuple[float, list]:
    """(median over `rounds` of the µs per call, copies of the captured step's outputs) of
    `step()`, a function making `calls` calls and returning their outputs: run once eagerly
    (compiles and autotuning stay outside the capture), once on a side stream, captured, then
    replayed `reps` times a round between CUDA events."""
    step()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ys = step()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(rounds):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(reps):
            graph.replay()
        t1.record()
        torch.cuda.synchronize()
        times.append(t0.elapsed_time(t1) * 1e3 / reps / calls)
    return statistics.median(times), [y.clone() for y in ys]
