#!/usr/bin/env python3
"""The scheduler under closed-loop load on a fake clock (issue 56 item 2, kb/0063).

The real Scheduler and its step budget (engine/step_budget.py); the model step replaced by a
cost function of the step's shape times lognormal noise. Clients as `tailored bench` runs
them: `concurrency` workers, all starting at t=0, each sending its next prompt (random ids,
ignore_eos) as soon as its previous answer ended. The step's time is reported to the budget
as the engine does. Per run: TTFT and ITL p50/p99 (ITL pooled over every gap, as
bench/loadgen.py), output tok/s, steps by kind, the longest step that held decodes.

    python lab/sched_sim.py                                  # c=1..128, off vs on
    python lab/sched_sim.py --concurrency 64,128 --prompts 256,512 --factors 0,2,2.5,3 \
        --floors 0,30 --min-chunks 128,256

The default cost is `h100_fp8_ms`: the H100 FP8 numbers of the 2026-12-07 load sweep (the
budget's prior, engine/step_budget.py PRIOR). It is a model: the GPU A/B of kb/0063 decides.
tests/engine/test_step_budget.py runs small versions of these runs.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tailored import flags  # noqa: E402
from tailored.config import EngineConfig  # noqa: E402
from tailored.engine.scheduler import Scheduler  # noqa: E402
from tailored.engine.step_budget import PRIOR, StepShape  # noqa: E402
from tailored.engine.types import ModelOutput, Request, SamplingParams  # noqa: E402
from tailored.worker.mixed_graphs import MIXED_TOKENS  # noqa: E402


def linear_ms(theta=PRIOR):
    """A cost function of the budget's own form with coefficients `theta` (ms)."""
    def cost(shape: StepShape) -> float:
        return sum(t * x for t, x in zip(theta, shape.features()))
    return cost


h100_fp8_ms = linear_ms(PRIOR)


# a decode row's own token-mixer work (its GDN state read and written, its attention over its
# context: ~4 ms of 128 rows' decode step at ~1.5k-token contexts, estimated from bytes), which
# a one-read step keeps; the rest of its cost becomes a prompt token's (the MoE and dense rows)
MIXER_ROW_MS = 0.03


def folded_ms(fold: int = 0, graph_tokens: int = 0, theta=PRIOR):
    """`linear_ms` with a mixed step's weights read once (kb/0068): with
    TAILORED_MIXED_EAGER_FROM=fold a step of decode rows and at least `fold` prompt tokens,
    with TAILORED_MIXED_GRAPH_TOKENS=graph_tokens one of 32+ decode rows and at most that many
    prompt tokens (taken as one chunk, padded to its MIXED_TOKENS bucket), costs what its
    prompt tokens cost plus per decode row a prompt token's cost and MIXER_ROW_MS: neither the
    expert-cover nor the per-row decode term of a separate decode read. A model of the change,
    as the prior is of today's step."""
    base = linear_ms(theta)

    def cost(shape: StepShape) -> float:
        D, P = shape.decode_tokens, shape.prefill_tokens
        if D and P:
            if graph_tokens and D >= 32 and P <= graph_tokens:
                P = min(t for t in MIXED_TOKENS if t >= P)
            elif not (fold and P >= fold):
                return base(shape)
            return base(StepShape(0, P, shape.pairs)) + D * (theta[4] + MIXER_ROW_MS)
        return base(shape)
    return cost


@dataclass
class SimResult:
    ttft_ms: list[float] = field(default_factory=list)  # by request, in submission order
    itl_ms: list[float] = field(default_factory=list)
    first_token_order: list[int] = field(default_factory=list)  # request numbers
    steps: dict = field(default_factory=dict)  # kind -> count
    max_held_ms: float = 0.0  # longest step with decode rows and prompt tokens
    # steps whose prompt chunks the budget limited: (ms taken, its target ms, first chunk forced
    # to the minimum beyond the target)
    held: list[tuple[float, float, bool]] = field(default_factory=list)
    max_decode_ms: float = 0.0  # longest decode-only step
    duration_ms: float = 0.0
    output_tokens: int = 0
    finished: int = 0
    submitted: int = 0

    def pct(self, xs, q) -> float:
        if not xs:
            return float("nan")
        s = sorted(xs)
        return s[min(len(s) - 1, int(q / 100 * len(s)))]

    def summary(self) -> dict:
        return {"ttft_p50": self.pct(self.ttft_ms, 50), "ttft_p99": self.pct(self.ttft_ms, 99),
                "itl_p50": self.pct(self.itl_ms, 50), "itl_p99": self.pct(self.itl_ms, 99),
                "tok_s": self.output_tokens / max(self.duration_ms, 1e-9) * 1e3,
                "max_held_ms": self.max_held_ms, "steps": dict(self.steps)}


def simulate(concurrency: int, num_prompts: int, *, prompt_len: int = 1024,
             output_len: int = 512, stall_factor: float = 0.0, min_chunk: int = 256,
             cost=h100_fp8_ms, noise: float = 0.05,
             max_num_seqs: int = 128, max_batched: int = 8192, prompt_lens=None,
             think_ms: float = 0.0, rate: float | None = None, seed: int = 0,
             max_steps: int = 1_000_000, mixed_graph_tokens: int = 0) -> SimResult:
    """One closed-loop run (module docstring). prompt_lens: a length per prompt (default
    prompt_len each). think_ms: a client's next prompt reaches the scheduler a uniform random
    0..think_ms after its previous answer ended (HTTP, the client's loop). rate: open loop
    instead, prompts arriving at Poisson times of this many a second (concurrency unused). Raises
    RuntimeError if it does not finish within max_steps steps."""
    rng = random.Random(seed)
    lens = list(prompt_lens) if prompt_lens is not None else [prompt_len] * num_prompts
    page = 16
    longest = max(lens) + output_len
    cfg = EngineConfig(page_size=page, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=max_batched, max_model_len=longest,
                       prefill_stall_factor=stall_factor)
    pages = max_num_seqs * -(-longest // page) + 1
    # mixed_graph_tokens: the scheduler cuts chunks on the mixed graphs' grid (kb/0068); the
    # cost of such steps is `cost`'s (folded_ms)
    with flags.override(min_prefill_chunk=min_chunk, mixed_graph_tokens=mixed_graph_tokens):
        s = Scheduler(cfg, num_pages=pages, num_slots=max_num_seqs + 1)
    res = SimResult()
    now = 0.0
    arrival, last_tok = {}, {}
    coming: list[tuple[float, int]] = []  # (time it reaches the scheduler, prompt number)

    def submit(at: float):
        coming.append((at, res.submitted))
        res.submitted += 1

    def arrive():
        coming.sort()
        while coming and coming[0][0] <= now:
            at, i = coming.pop(0)
            ids = [rng.randrange(100, 50_000) for _ in range(lens[i])]
            s.add(Request(str(i), ids, SamplingParams(max_tokens=output_len, ignore_eos=True)))
            arrival[str(i)] = at

    if rate is not None:
        at = 0.0
        for _ in range(num_prompts):
            submit(at)
            at += rng.expovariate(rate) * 1e3
    else:
        for _ in range(min(concurrency, num_prompts)):
            submit(0.0)
    plans = []
    plan_of = s.budget.plan

    def plan(*args):  # the scheduler's plan of each step, kept for `held`
        plans.append(plan_of(*args))
        return plans[-1]

    s.budget.plan = plan
    steps = 0
    while s.has_unfinished() or coming:
        steps += 1
        if steps > max_steps:
            raise RuntimeError(f"not finished after {max_steps} steps")
        arrive()
        if not s.has_unfinished():
            now = min(at for at, _ in coming)  # idle until the next prompt comes
            continue
        plans.clear()
        out = s.schedule()
        if out.empty:
            raise RuntimeError("nothing scheduled with requests unfinished")
        shape = StepShape.of(out.seqs)
        target = (s.budget.target_ms(shape.decode_tokens)
                  if plans and plans[0].limited and shape.prefill_tokens else None)
        ms = cost(shape) * math.exp(rng.gauss(0.0, noise))
        if target is not None:
            res.held.append((ms, target, plans[0].forced))
        now += ms
        kind = ("decode" if not shape.prefill_tokens else
                "prefill" if not shape.decode_tokens else "mixed")
        res.steps[kind] = res.steps.get(kind, 0) + 1
        if kind == "mixed":
            res.max_held_ms = max(res.max_held_ms, ms)
        elif kind == "decode":
            res.max_decode_ms = max(res.max_decode_ms, ms)
        tokens = {q.request_id: 7 for q in out.seqs if q.sample}
        finished = s.update(out, ModelOutput(tokens))
        s.budget.observe(out.seqs, ms / 1e3)
        for rid in tokens:
            if rid in last_tok:
                res.itl_ms.append(now - last_tok[rid])
            else:
                res.ttft_ms.append(now - arrival[rid])
                res.first_token_order.append(int(rid))
            last_tok[rid] = now
            res.output_tokens += 1
        for r in finished:
            res.finished += 1
            if rate is None and res.submitted < len(lens):
                submit(now + rng.uniform(0.0, think_ms))
    res.duration_ms = now
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", default="1,8,32,64,128")
    ap.add_argument("--prompts", default="8,48,160,256,512")
    ap.add_argument("--factors", default="0,2.5", help="stall factors (0 = today's budget)")
    ap.add_argument("--min-chunks", default="256", help="TAILORED_MIN_PREFILL_CHUNK values")
    ap.add_argument("--folds", default="0",
                    help="TAILORED_MIXED_EAGER_FROM values (0 = off; kb/0068)")
    ap.add_argument("--mixed-graphs", default="0",
                    help="TAILORED_MIXED_GRAPH_TOKENS values (0 = off; kb/0068)")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--noise", type=float, default=0.05)
    ap.add_argument("--think-ms", type=float, default=30.0,
                    help="a client's next prompt arrives up to this long after its answer")
    ap.add_argument("--rates", default="",
                    help="open loop: Poisson arrival rates (req/s), one per --prompts value "
                         "(--concurrency then only labels the rows)")
    a = ap.parse_args()
    cs = [int(x) for x in a.concurrency.split(",")]
    ns = [int(x) for x in a.prompts.split(",")]
    rates = [float(x) for x in a.rates.split(",")] if a.rates else []
    print(f"{'c':>4} {'factor':>6} {'chunk':>5} {'fold':>5} {'graph':>5} {'TTFT p50':>9} {'p99':>7} "
          f"{'ITL p50':>8} "
          f"{'p99':>7} {'p99/p50':>7} {'tok/s':>7} {'held max':>8}  steps")
    grid = [(float(f), int(mc), int(fo), int(mg)) for f in a.factors.split(",")
            for mc in a.min_chunks.split(",") for fo in a.folds.split(",")
            for mg in a.mixed_graphs.split(",")]
    for k, (c, n) in enumerate(zip(cs, ns)):
        seen = set()
        for f, mc, fo, mg in grid:
            if f == 0:
                mc = 0  # the minimum chunk does nothing with the budget off
            if (f, mc, fo, mg) in seen:
                continue
            seen.add((f, mc, fo, mg))
            r = simulate(c, n, prompt_len=a.input_len, output_len=a.output_len, stall_factor=f,
                         min_chunk=max(mc, 1), noise=a.noise, think_ms=a.think_ms,
                         rate=rates[k] if rates else None, cost=folded_ms(fo, mg),
                         mixed_graph_tokens=mg)
            m = r.summary()
            print(f"{c:>4} {f:>6g} {mc:>5} {fo:>5} {mg:>5} {m['ttft_p50']:>9.0f} {m['ttft_p99']:>7.0f} "
                  f"{m['itl_p50']:>8.1f} {m['itl_p99']:>7.1f} "
                  f"{m['itl_p99'] / m['itl_p50']:>7.2f} {m['tok_s']:>7.0f} "
                  f"{m['max_held_ms']:>8.0f}  {m['steps']}", flush=True)


if __name__ == "__main__":
    main()
