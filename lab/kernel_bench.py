"""What the kernel benches share (lab/bench_moe.py, bench_route.py, bench_moe_gemv.py,
bench_fp8_gemv.py): timing a step of GPU launches through one CUDA graph, the
manifest of a run and a row log written as it grows; and for the in-process engine benches
(bench_prefix_turns.py, bench_prompts_together.py) the stack they build. Imported by name, as
the scripts run from lab/ (`python3 lab/bench_x.py`)."""

from __future__ import annotations

import json
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


def manifest(args, weights: str) -> dict:
    """Commit, versions (torch, CUDA, Triton), GPU, the bench's arguments and its weights."""
    import triton

    from tailored.gate.manifest import device_name, git_commit, versions

    return {**git_commit(), **versions(), "triton": triton.__version__,
            "device": device_name(torch.device("cuda")), "workload": vars(args),
            "weights": weights}


def row_log(man: dict, json_path: str | None, line):
    """A `record(row)` that appends row, prints line(row) and rewrites json_path (when given)
    with {"manifest", "rows"}: a GPU fault later loses no earlier row. Returns (record, rows)."""
    rows: list = []

    def record(row: dict) -> None:
        rows.append(row)
        print(line(row), flush=True)
        if json_path:
            with open(json_path, "w") as f:
                json.dump({"manifest": man, "rows": rows}, f, indent=1)

    return record, rows


def engine_stack(ckpt: str | None, nano: bool, **kw):
    """The in-process engine benches' stack: the embedded nano model on the CPU (plain path,
    fp32: a dry run), or `ckpt` with dummy weights as `tailored serve` runs on CUDA (bf16,
    8192-token steps, prefill graphs). kw: more EngineConfig fields."""
    from tailored.stack import build_stack, embedded_checkpoint

    if nano:
        return build_stack(embedded_checkpoint(), device="cpu", dtype="float32",
                           kernels="off", **kw)
    return build_stack(ckpt, load_format="dummy", device="cuda", dtype="bfloat16",
                       max_num_batched_tokens=8192, prefill_graphs=True, **kw)
