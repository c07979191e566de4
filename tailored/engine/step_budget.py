"""How many prompt tokens a step may carry while requests decode: from the measured step cost.

    python -m pytest -q tests/engine/test_step_budget.py

A step that carries a prompt chunk holds every running decode for its whole duration (issue
56: at c=128 on an H100 a 128-row decode step took 21.8 ms and a step with ~8k prompt tokens
230-370 ms, so a big chunk cost each stream 10-15 steps' worth of time at once). The fixed
token budget (max_num_batched_tokens) says nothing about time; this module turns a time budget
into a token count.

`StepCost` predicts a step's wall time from its shape, a model fitted online (ridge regression
of relative errors towards the H100 FP8 prior below, over the last `window` decode-only steps
and the last `window` steps that carried prompt tokens; the two windows are kept apart so that
hundreds of decode steps do not push the rarer prefill samples out):

    ms ≈ a + w·cover(D) + c·D + d·[P > 0] + b·P + e·pairs / 1e6

D: decode tokens (rows + drafts); cover(D) = 1 - (1 - 8/256)^D, the share of the 256 experts
that D tokens' top-8 routing touches (a decode step's MoE reads each touched expert once, so
its cost saturates with D); P: prompt tokens; pairs: prompt token x context key pairs of the
chunks (the attention's quadratic part: a chunk deep into a long prompt costs more than its
tokens say); d: a prompt forward's own fixed cost (in a mixed step the decode rows replay
their graph and the chunks run after it, worker/kernel_forward.py: the weights are read
twice).

`StepBudget.plan(D, W)` gives a `PrefillPlan`, which the scheduler asks, chunk by chunk in
FIFO order (running prompts, then the queue), how many tokens fit. While decodes run (D > 0)
the step is sized to take at most
    target(D) = stall_factor · decode(D)
decode(D) being the predicted decode-only step, i.e. what those streams' ITL is otherwise.
The first chunk always gets at least `min_chunk` tokens (or the rest of its prompt), so the
oldest prompt progresses every step. The token budget alone decides (as with the policy off,
stall_factor 0):
  * with no decode running: time to first token is all that matters then;
  * before the model has `min_samples` steps (today's fixed budget meanwhile);
  * at a load too low for chunks (`chunked`, the load being D + W, W the requests waiting
    for their first token): where (stall_factor - 1) · decode(D + W) cannot pay for d and a
    minimum chunk, every chunk breaks the target anyway, and a few large stalls hurt the
    streams less (and ITL p99 not at all while they stay under 1 % of the gaps) than many
    small ones that each pay d.
The values (--prefill-stall-factor 2.5 proposed, off by default until measured on the GPU;
256 tokens) and what lab/sched_sim.py predicts for them: kb/0063, docs/scheduling.md.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

NUM_EXPERTS, TOP_K = 256, 8  # the model's routing (spec §7)
# the features: intercept, expert cover, decode tokens, a prompt forward, prompt tokens, pairs/1e6
NAMES = ("base", "cover", "decode_tok", "prefill", "prefill_tok", "mpairs")
# prior (ms) from the H100 FP8 load sweep of 2026-12-07 (bench/results/2026-12-07-h100-load,
# docs/benchmarks.md): decode 2.4 ms at 1 row, ~10 ms at 32, 21.8 ms at 128; one fresh 1024-token
# prompt ~46 ms; ~8k prompt tokens beside 128 rows 230-370 ms; the 120k prompt's 9.3 s
# (7.2e9 pairs) gives e
PRIOR = (2.07, 7.67, 0.0953, 8.0, 0.035, 0.7)
# the granule (PrefillPlan) aims at the mixed-step graphs' buckets (worker/mixed_graphs.py,
# kb/0068): multiples of 128 up to 1024 tokens (above, 1536 and 2048: rounding to 128 would
# give progress up for no smaller pad), in steps of at least 32 decode rows (fewer keep the
# two-part split); tests/engine/test_step_budget.py pins them against the worker's
GRANULE_UP_TO = 1024
GRANULE_FROM_ROWS = 32
# the prior counts as this share of one sample of typical feature size (SCALES) and step time
# (TYPICAL_MS): where data identify a coefficient they decide it; elsewhere the prior does
PRIOR_WEIGHT = 0.1
SCALES = (1.0, 1.0, 64.0, 1.0, 2048.0, 10.0)
TYPICAL_MS = 20.0


def expert_cover(tokens: int) -> float:
    """Expected share of the experts `tokens` tokens' top-k routing touches (uniform routing)."""
    return 1.0 - (1.0 - TOP_K / NUM_EXPERTS) ** tokens


def chunk_pairs(start: int, n: int) -> float:
    """Attention (query, key) pairs of a causal chunk of n tokens after `start` cached ones."""
    return n * (start + (n + 1) / 2)


@dataclass(frozen=True)
class StepShape:
    """What a step's cost depends on: decode tokens (rows + drafts), prompt tokens, pairs."""

    decode_tokens: int = 0
    prefill_tokens: int = 0
    pairs: float = 0.0

    @classmethod
    def of(cls, seqs) -> "StepShape":
        """The shape of a step of ScheduledSeqs (a decode row: its last token and its drafts,
        as step_timing.step_kind counts them)."""
        dec = pre = 0
        pairs = 0.0
        for s in seqs:
            n = len(s.token_ids)
            if n == 1 + s.num_draft and s.start_pos > 0:
                dec += n
            else:
                pre += n
                pairs += chunk_pairs(s.start_pos, n)
        return cls(dec, pre, pairs)

    def features(self) -> tuple[float, ...]:
        p = 1.0 if self.prefill_tokens else 0.0
        return (1.0, expert_cover(self.decode_tokens), float(self.decode_tokens), p,
                float(self.prefill_tokens), self.pairs / 1e6)


class StepCost:
    """Online step-time model (module docstring): `observe(shape, ms)`, `predict(shape)`."""

    def __init__(self, prior: tuple[float, ...] = PRIOR, window: int = 256,
                 min_samples: tuple[int, int] = (8, 2), prior_weight: float = PRIOR_WEIGHT):
        self.prior = tuple(prior)
        self.window = window
        self.min_steps, self.min_prefill = min_samples
        k = len(NAMES)
        self.reg = [prior_weight * (s / TYPICAL_MS) ** 2 for s in SCALES]
        self.decode: deque = deque()  # (features, ms) of decode-only steps
        self.prefill: deque = deque()  # ... of steps that carried prompt tokens
        self.xtx = [[0.0] * k for _ in range(k)]
        self.xty = [0.0] * k
        self.outliers = 0
        self._theta: list[float] | None = None
        self._adds = 0

    @property
    def ready(self) -> bool:
        """Enough samples (all steps, and of those that carried prompt tokens) to trust the
        fit over the fixed budget."""
        return (len(self.decode) + len(self.prefill) >= self.min_steps
                and len(self.prefill) >= self.min_prefill)

    def observe(self, shape: StepShape, ms: float) -> bool:
        """Add one step's wall time; False when it was set aside as an outlier (once the model
        is ready: slower than 3x its prediction + 50 ms, e.g. a pause, a compile, a GC)."""
        if not (ms > 0 and math.isfinite(ms)) or not (shape.decode_tokens or shape.prefill_tokens):
            return False
        if self.ready and ms > 3 * self.predict(shape) + 50:
            self.outliers += 1
            return False
        x = shape.features()
        q = self.prefill if shape.prefill_tokens else self.decode
        q.append((x, ms))
        self._add(x, ms, 1.0)
        if len(q) > self.window:
            self._add(*q.popleft(), -1.0)
        self._adds += 1
        if self._adds % 4096 == 0:  # float drift of the running sums: rebuild them
            self._rebuild()
        self._theta = None
        return True

    def theta(self) -> list[float]:
        """The fitted coefficients (ms), in NAMES order."""
        if self._theta is None:
            k = len(NAMES)
            a = [[self.xtx[i][j] + (self.reg[i] if i == j else 0.0) for j in range(k)]
                 for i in range(k)]
            b = [self.xty[i] + self.reg[i] * self.prior[i] for i in range(k)]
            self._theta = _solve(a, b)
        return self._theta

    def predict(self, shape: StepShape) -> float:
        return sum(t * x for t, x in zip(self.theta(), shape.features()))

    def _add(self, x, y: float, sign: float) -> None:
        # weighted by 1/y²: the fit minimises relative errors (step-time noise is relative; a
        # 3 ms step matters as much as a 300 ms one)
        w = sign / (y * y)
        for i, xi in enumerate(x):
            if xi:
                self.xty[i] += w * xi * y
                row = self.xtx[i]
                for j, xj in enumerate(x):
                    row[j] += w * xi * xj

    def _rebuild(self) -> None:
        k = len(NAMES)
        self.xtx = [[0.0] * k for _ in range(k)]
        self.xty = [0.0] * k
        for x, y in list(self.decode) + list(self.prefill):
            self._add(x, y, 1.0)


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """x with a·x = b (Gaussian elimination with partial pivoting; a is positive definite)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        m[c], m[p] = m[p], m[c]
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            if f:
                for j in range(c, n + 1):
                    m[r][j] -= f * m[c][j]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][j] * x[j] for j in range(r + 1, n))) / m[r][r]
    return x


class PrefillPlan:
    """One step's prompt-token allowance, spent chunk by chunk in the scheduler's order."""

    def __init__(self, limit_ms: float | None, theta: list[float] | None, min_chunk: int,
                 granule: int = 1):
        self.limit_ms = limit_ms  # prompt chunks' share of the step (ms); None: no time limit
        self.left = limit_ms
        self.theta = theta
        self.min_chunk = min_chunk
        # a chunk the limit cuts ends on a multiple of this many tokens: mixed-step graphs
        # pad a chunk to their next bucket (multiples of 128), and a pad costs what a token
        # does (kb/0068); a chunk the limit leaves whole (the rest of a prompt) is not cut
        self.granule = granule
        self.chunks = 0
        self.forced = False  # the first chunk got min_chunk beyond the limit

    @property
    def limited(self) -> bool:
        return self.limit_ms is not None

    def take(self, start: int, want: int) -> int:
        """Tokens of a chunk of up to `want` tokens after `start` cached ones that fit; 0 when
        nothing more fits this step. The first chunk gets at least min(want, min_chunk)."""
        if want <= 0:
            return 0
        if self.left is None:
            self.chunks += 1
            return want
        _, _, _, d, b, e = self.theta
        b, e = max(b, 1e-4), max(e, 0.0) / 1e6  # a noisy fit never makes tokens free
        left = self.left - (max(d, 0.0) if self.chunks == 0 else 0.0)
        # largest n with b·n + e·n·(start + (n + 1) / 2) <= left
        lin = b + e * (start + 0.5)
        if left <= 0:
            n = 0
        elif e > 0:
            n = int((-lin + math.sqrt(lin * lin + 2 * e * left)) / e)
        else:
            n = int(left / lin)
        n = min(n, want)
        if n < want and self.granule <= n <= GRANULE_UP_TO:
            # not below what the chunk would pass unrounded (the first chunk's minimum, the
            # sliver floor): rounding there dropped or forced a chunk the limit let through
            floor = self.min_chunk if self.chunks == 0 else max(1, self.min_chunk // 4)
            if n - n % self.granule >= min(want, floor):
                n -= n % self.granule
        if self.chunks == 0 and n < min(want, self.min_chunk):
            n = min(want, self.min_chunk)  # the oldest prompt always progresses
            self.forced = True
        elif n < min(want, max(1, self.min_chunk // 4)):
            return 0  # a sliver of a chunk is not worth its own forward
        self.left = left - (b * n + e * chunk_pairs(start, n))
        self.chunks += 1
        return n


class StepBudget:
    """The policy (module docstring). stall_factor 0: off, every plan is unlimited."""

    def __init__(self, stall_factor: float, min_chunk: int, cost: StepCost | None = None,
                 granule: int = 1):
        self.stall_factor = stall_factor
        self.min_chunk = min_chunk
        self.granule = granule  # PrefillPlan's: cut chunks end on multiples of it
        self.cost = cost if cost is not None else StepCost()

    @property
    def on(self) -> bool:
        return self.stall_factor > 0

    def observe(self, seqs, seconds: float) -> None:
        """One step's ScheduledSeqs and wall time (the engine calls this after each step)."""
        if self.on:
            self.cost.observe(StepShape.of(seqs), seconds * 1e3)

    def describe(self) -> str:
        """One line for the server's step-timing log: the fit and its samples."""
        t = self.cost.theta()
        c = self.cost
        return (f"step cost ms = {t[0]:.2f} + {t[1]:.2f} cover + {t[2]:.4f}/decode token + "
                f"{t[3]:.2f} a prompt forward + {t[4]:.4f}/prompt token + {t[5]:.3f}/M pairs "
                f"({len(c.decode)} decode, {len(c.prefill)} prompt samples, {c.outliers} "
                f"outliers{'' if c.ready else ', not ready'}; target {self.stall_factor:g}x "
                f"decode: {self.target_ms(64):.1f} ms at 64 rows, {self.target_ms(128):.1f} at 128)")

    def target_ms(self, decode_tokens: int) -> float:
        """The longest a step may take that holds `decode_tokens` decode tokens for prompt
        chunks: stall_factor x their decode-only step (what their ITL is otherwise)."""
        return self.stall_factor * self.cost.predict(StepShape(decode_tokens))

    def chunked(self, rows: int) -> bool:
        """Whether at a load of `rows` decoding requests a step held to the target can carry a
        minimum chunk: (stall_factor - 1) x decode(rows) must cover the prompt forward's own
        cost d and min_chunk tokens. Not so at low load (an H100 FP8 decode step of 8 rows
        takes ~5 ms, d ~8 ms): every chunk would break the target, and fewer, larger stalls
        (the token budget's) then beat many small ones that each pay d."""
        theta = self.cost.theta()
        dec = self.cost.predict(StepShape(rows))
        return (self.stall_factor - 1) * dec >= max(theta[3], 0.0) + max(theta[4], 1e-4) * \
            self.min_chunk

    def plan(self, decode_tokens: int, waiting: int = 0) -> PrefillPlan:
        """The prompt-token allowance of a step with `decode_tokens` decode tokens, `waiting`
        more requests without their first token (the load is both: `chunked`). Unlimited (the
        token budget decides) with the policy off, the model not ready, no decode running or a
        load too low for chunks."""
        if (not self.on or decode_tokens == 0 or not self.cost.ready
                or not self.chunked(decode_tokens + waiting)):
            return PrefillPlan(None, None, self.min_chunk)
        # a mixed graph takes 32 or more decode rows (worker/mixed_graphs.py MIXED_ROWS)
        granule = self.granule if decode_tokens >= GRANULE_FROM_ROWS else 1
        return PrefillPlan(self.target_ms(decode_tokens)
                           - self.cost.predict(StepShape(decode_tokens)), self.cost.theta(),
                           self.min_chunk, granule)
