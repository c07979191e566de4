"""CUDA graphs of a mixed step: decode rows and one prompt chunk in one graph (kb/0068).

Without them a mixed step runs in two parts (worker/kernel_forward.py): the decode rows replay
their decode graph, then the prompt chunk replays its prefill or context graph, and each part
reads every weight, the routed experts above all (at 128 decode rows ~22 ms of a step on an
H100, kb/0063's fit). With the step budget on (`--prefill-stall-factor`) under load nearly
every step is such a pair, and that second read is its −12 % output (kb/0063); kb/0068's
simulation puts the budget with one read at the throughput of no budget.

A mixed graph computes both in one pass of the layers (`KernelModel.layers_forward`): the
decode rows first (padded to a bucket of rows), then the chunk (padded to a bucket of
tokens). Norms, the MoE and the dense MLPs run over all rows together; each layer's token
mixer runs per part with the part's own graph code: the decode graph's mixer over the first
rows (`DecodeGraphs.mixer`), the prefill or context graph's over the rest
(`PrefillGraphs.mixer`, `ContextGraphs.mixer`). The static buffers are those graphs' own:
a mixed replay fills both with their own `fill` (the parts' pads go to the sinks as there),
so no layout code is repeated. Sequences are independent, so the split of the mixer
changes no row; the MoE's rows are more, which changes its tiles, not its results beyond
rounding (fp32 on the CPU: tests/worker/test_mixed_graphs.py; the GPU replay:
tests/gpu/test_gpu.py).

Captured when the `mixed_graph_tokens` switch is on (off by default until the GPU A/B), after
the prefill and context graphs, for every (rows, tokens) pair of `MIXED_ROWS` (≤ the decode
graphs' largest batch, which is added) and `MIXED_TOKENS` (≤ the switch): one family beside
fresh prompts and one beside continuing chunks. A failed capture leaves such steps to the
two-part split, never an error.
"""

from __future__ import annotations

import torch

from tailored import flags
from tailored.model.batch import ForwardBatch, h2d, sub_batch, token_rows

# decode rows of a mixed step: below 32 the decode part is small beside the chunk, and each
# bucket multiplies the captures by len(MIXED_TOKENS) (x2: fresh and continuing chunks)
MIXED_ROWS = (32, 64, 128)
# prompt tokens: the step budget's chunks under load are a few hundred to ~2k tokens; pads
# cost what real tokens do (~0.035 ms each on an H100, kb/0063), so steps of 128 to 1024
MIXED_TOKENS = tuple(range(128, 1025, 128)) + (1536, 2048)


class MixedGraphs:
    """Graphs of decode rows beside one prompt chunk of one kind: `chunk` is the worker's
    PrefillGraphs (fresh prompts) or ContextGraphs (chunks after a cached context), whose
    `takes`, `mixer`, `fill` and static buffers the mixed graphs use; `decode` the worker's
    DecodeGraphs likewise. graphs: {(rows, tokens): (graph, output)}."""

    def __init__(self, km, pool, decode, chunk, kind: str) -> None:
        self.km, self.pool, self.decode, self.chunk, self.kind = km, pool, decode, chunk, kind
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.min_rows = MIXED_ROWS[0]  # fewer decode rows keep the split (`bucket`)

    # -- body -------------------------------------------------------------------------------------
    def body(self, key: tuple[int, int]) -> torch.Tensor:
        """Final-normed hidden states [b + t, H] of the decode buffers' first b rows, then the
        chunk buffers' first t rows (key = (b, t))."""
        b, t = key
        km, dst, cst = self.km, self.decode.st, self.chunk.st
        x, cos, sin = km.embed(torch.cat([dst["ids"][:b], cst["ids"][:t]]),
                               torch.cat([dst["pos"][:b], cst["pos"][:t]]))
        dec = self.decode.mixer(b, cos[:b], sin[:b])
        chunk = self.chunk.mixer(t, cos[b:], sin[b:])

        def mixer(i, hn):
            return torch.cat([dec(i, hn[:b]), chunk(i, hn[b:])])

        return km.layers_forward(x, mixer)

    def fill(self, dec: ForwardBatch, prompt: ForwardBatch, key: tuple[int, int]) -> None:
        """Both parts' static inputs, each by its own graph's fill."""
        self.decode.fill(dec, key[0])
        self.chunk.fill(prompt, key[1])

    # -- dispatch ---------------------------------------------------------------------------------
    def bucket(self, rows: int, prompt: ForwardBatch):
        """The smallest captured (rows, tokens) key that holds `rows` decode rows and the
        prompt part `prompt`, when that part is one chunk of this kind; else None. Below
        `min_rows` (MIXED_ROWS[0]) rows the two-part split stays: its decode part is small,
        and padding a few rows (a c=1 arrival) to 32, or a few-token chunk to 128, would
        cost more."""
        if (rows < self.min_rows or not self.graphs or len(prompt.seqs) != 1
                or not self.chunk.takes(prompt.seqs[0])):
            return None
        t = prompt.seqs[0].num_tokens
        keys = [k for k in self.graphs if k[0] >= rows and k[1] >= t]
        return min(keys, key=lambda k: (k[1], k[0])) if keys else None

    def forward(self, batch: ForwardBatch, dec_rows: list[int], rest: list[int],
                prompt: ForwardBatch, key) -> torch.Tensor:
        """Hidden states [T, H] of a mixed step whose sequences `dec_rows` are decode rows and
        whose other sequence `rest` (one index), the chunk, is the sub-batch `prompt`,
        replayed from graph `key` (`bucket`)."""
        self.fill(sub_batch(batch, dec_rows), prompt, key)
        g, res = self.graphs[key]
        g.replay()
        b, dev = key[0], batch.input_ids.device
        t = prompt.seqs[0].num_tokens
        out = torch.empty(batch.input_ids.shape[0], self.km.cfg.hidden_size,
                          dtype=self.km.dtype, device=dev)
        out[h2d(token_rows([batch.seqs[j] for j in dec_rows]), dev)] = res[:len(dec_rows)]
        out[h2d(token_rows([batch.seqs[j] for j in rest]), dev)] = res[b:b + t]
        return out

    # -- capture ----------------------------------------------------------------------------------
    @staticmethod
    def keys(max_rows: int, max_tokens: int,
             min_rows: int = MIXED_ROWS[0]) -> list[tuple[int, int]]:
        """The (rows, tokens) pairs to capture, largest first: MIXED_ROWS up to `max_rows`
        and `max_rows` itself, by MIXED_TOKENS up to `max_tokens`; none below `min_rows`."""
        if max_rows < min_rows:
            return []
        rows = sorted({r for r in MIXED_ROWS if r < max_rows} | {max_rows}, reverse=True)
        tokens = sorted((t for t in MIXED_TOKENS if t <= max_tokens), reverse=True)
        return [(b, t) for t in tokens for b in rows]

    @torch.no_grad()  # startup forwards: never keep autograd's saved activations
    def capture(self, max_rows: int, max_tokens: int) -> None:
        """Capture every `keys` pair in the pool, with both parts' buffers at the sinks
        first; a failure logs a warning and leaves mixed steps to the two-part split."""
        keys = self.keys(max_rows, max_tokens, self.min_rows)
        if not keys:
            return
        self.decode.to_sinks()
        self.chunk.to_sinks(max(t for _, t in keys))
        self.pool.capture_guarded(self.graphs, keys, self.body, f"mixed ({self.kind})",
                                  "such steps replay their decode and chunk graphs apart")


def output_bytes(max_rows: int, max_tokens: int, hidden: int, itemsize: int) -> int:
    """GPU bytes the mixed graphs' outputs keep (each graph's [rows + tokens, hidden] result
    stays alive in the pool), both families: what the memory plan reserves for them. Their
    activations reuse the pool the largest prefill graph sized (memory_plan.plan_cache)."""
    keys = MixedGraphs.keys(max_rows, max_tokens)
    return 2 * sum(b + t for b, t in keys) * hidden * itemsize


def mixed_families(kf) -> list[MixedGraphs]:
    """The mixed graphs the worker `kf` (worker/kernel_forward.py) captures at start when the
    `mixed_graph_tokens` switch is on: beside fresh prompts when it has prefill graphs, beside
    continuing chunks when it has context graphs; each captured (families whose capture
    failed are dropped)."""
    limit = flags.current().mixed_graph_tokens
    if not limit or not kf.use_graphs:
        return []
    fams = []
    for chunk, kind in ((kf.prefill, "fresh prompt"), (kf.ctx, "continuing chunk")):
        if chunk is None or not chunk.graphs:
            continue
        m = MixedGraphs(kf.km, kf.pool, kf.decode, chunk, kind)
        m.capture(kf.max_batch, min(limit, max(chunk.graphs)))
        if m.graphs:
            fams.append(m)
    return fams
