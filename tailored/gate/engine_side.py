"""The engine's side of the gate: greedy continuations and the hidden states behind them.

`engine_greedy` sends every prompt through the real serving path at once — Engine.add_request,
then Engine.step() until done (scheduler with chunked prefill mixed with decode rows, runner,
sampler) — greedy, N tokens each (ignore_eos). With capture=True it also keeps the final-normed
hidden states the engine computed for each request (a forward hook on the runner's model;
Engine steps are matched to the model call through the SchedulerOutput). Those are exactly the
teacher-forced states of prompt + the engine's own continuation, positions 0..T+N-2: the
prompt's from its prefill chunks, the continuation's from the decode steps.

`engine_teacher_forced` is the other way to get them (`tailored gate --hidden-from forward`): a
separate model forward over the runner's HybridCache, prefilled in chunks, on any token list.
It borrows slot 1 and pages 1.. of an idle engine; the next request that takes them resets the
slot (reset_state) and rewrites the pages.
"""

from __future__ import annotations

import math

import torch

from tailored.engine.types import SamplingParams
from tailored.model.batch import ForwardBatch


def gate_engine_kwargs(prompt_lens: list[int], max_new_tokens: int, page_size: int = 16,
                       max_num_batched_tokens: int = 2048) -> dict:
    """EngineConfig fields that fit the whole prompt set at once, and no more memory.

    Pages: every request at its longest (prompt + N − 1 cached tokens) + the pad page; that
    also covers a separate teacher-forced pass, which runs alone afterwards.
    """
    longest = max(prompt_lens) + max_new_tokens
    pages = sum(math.ceil((t + max_new_tokens) / page_size) for t in prompt_lens) + 1
    return {"max_model_len": longest, "max_num_seqs": len(prompt_lens), "num_pages": pages,
            "page_size": page_size, "max_num_batched_tokens": max_num_batched_tokens}


def engine_greedy(engine, prompts: dict[str, list[int]], max_new_tokens: int,
                  capture: bool = False) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
    """Greedy ids per request name and, with capture, hidden states [T+N-1, H] per name."""
    sp = SamplingParams(max_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    runner, model = engine.runner, engine.runner.model
    hidden: dict[str, torch.Tensor] = {}
    filled: dict[str, torch.Tensor] = {}
    step: list = []  # the SchedulerOutput of the step being executed

    # the runner's entry that runs the forward: launch (async scheduling, kb/0015; execute
    # calls it too) or execute
    entry = "launch" if hasattr(runner, "launch") else "execute"

    def run_step(sched, *args, _orig=getattr(runner, entry), **kwargs):
        step[:] = sched.seqs
        return _orig(sched, *args, **kwargs)

    def record(batch, out):
        if len(batch.seqs) != len(step):
            raise RuntimeError("runner batch does not match the scheduled step: use "
                               "--hidden-from forward")
        for s, sch in zip(batch.seqs, step):
            assert (s.slot, s.start_pos) == (sch.slot, sch.start_pos), "batch/step order differs"
            if s.start_pos >= hidden[sch.request_id].shape[0]:
                continue  # a void row launched ahead after its request had finished
            rows = slice(s.q_start, s.q_start + s.num_tokens)
            hidden[sch.request_id][s.start_pos:s.end_pos] = out[rows]
            filled[sch.request_id][s.start_pos:s.end_pos] = True

    for name, ids in prompts.items():
        engine.add_request(name, ids, sp)
        if capture:
            n, H = len(ids) + max_new_tokens - 1, model.config.hidden_size
            dev, dt = runner.device, model.model.embed_tokens.weight.dtype
            hidden[name] = torch.zeros(n, H, dtype=dt, device=dev)
            filled[name] = torch.zeros(n, dtype=torch.bool, device=dev)

    def forward(batch, _orig=runner.forward):
        out = _orig(batch)
        record(batch, out)
        return out

    if capture:
        # the runner's forward, not a hook on the model: the kernel path never calls the
        # model module (worker/kernel_forward.py); instance attributes: the class's methods
        # are untouched
        setattr(runner, entry, run_step)
        runner.forward = forward
    out: dict[str, list[int]] = {name: [] for name in prompts}
    try:
        while engine.has_unfinished():
            for o in engine.step():
                if o.error:
                    raise RuntimeError(f"engine failed on {o.request_id}: {o.error}")
                out[o.request_id].extend(o.delta_token_ids)
    finally:
        if capture:
            delattr(runner, "forward")
            delattr(runner, entry)
    for name, f in filled.items():
        if not bool(f.all()):
            raise RuntimeError(f"engine hidden states of {name} not captured at every position")
    return out, hidden


@torch.inference_mode()
def engine_teacher_forced(engine, ids: list[int], chunk: int) -> torch.Tensor:
    """Hidden states [len(ids), H] (model dtype) of `ids` run as one request in chunks."""
    if engine.has_unfinished():
        raise RuntimeError("the engine must be idle for the teacher-forced pass")
    runner = engine.runner
    ps = runner.page_size
    need = math.ceil(len(ids) / ps)
    if need > runner.num_pages - 1 or runner.num_slots < 2:
        raise RuntimeError(f"cache too small for a {len(ids)}-token teacher-forced pass")
    pages = list(range(1, need + 1))
    out = []
    for s in range(0, len(ids), chunk):
        e = min(s + chunk, len(ids))
        b = ForwardBatch.build([(ids[s:e], s, 1, s == 0, pages[:math.ceil(e / ps)])], [],
                               runner.device)
        out.append(runner.forward(b))
    return torch.cat(out)
