"""Which graph runs a step: the kernel path's forward, as the runner calls it.

`KernelForward.forward(batch)` has the plain path's contract (final-normed hidden states
[T, H]). With CUDA graphs (not --enforce-eager, CUDA only):
  * a verify step of speculative decoding replays the verify graph (worker/spec_graphs.py);
  * decode rows replay a decode graph; in a mixed step they replay it on their own and the
    prompt chunks run after: a fresh prompt from its prefill graph, a chunk continuing its
    cached context from its context graph (worker/ctx_graphs.py), several chunks each from
    their own graph within `prompts_in_graphs_up_to` / `_chunks` (kb/0056), else eagerly.
    Sequences are independent, so the split changes no result: the decode rows' pages and
    slots are disjoint from the prefills'. Verify chunks beside prompt chunks split the same
    way, with the verify graph. The split reads every weight twice, once for the decode
    graph and once for the chunks (kb/0063, kb/0068): with mixed graphs captured
    (worker/mixed_graphs.py) decode rows beside one chunk replay one graph of both; with
    `mixed_eager_from` on, a mixed step whose prompt chunks would run eagerly with at least
    that many tokens runs whole, decode rows included, in one eager forward;
  * anything else (more decode rows than the largest graph) runs eagerly.
"""

from __future__ import annotations

import gc

import torch

from tailored import flags
from tailored.model.batch import ForwardBatch, h2d, sub_batch, token_rows
from tailored.worker.graphs import DecodeGraphs, GraphPool, PrefillGraphs


def others(batch: ForwardBatch, picked: list[int]) -> list[int]:
    """The indices of batch's sequences not in `picked`, in batch order."""
    skip = set(picked)
    return [j for j in range(len(batch.seqs)) if j not in skip]


class KernelForward:
    """The kernel path `km` (model/kernel_model.py) with the worker's CUDA graphs.

    max_batch: largest decode batch captured in a graph; max_pages: page-table width (pages
    of the longest sequence); use_graphs: capture graphs (CUDA only). `ctx` and `spec` are
    set by the start-up (worker/kernel_path.py) when those graphs are wanted."""

    def __init__(self, km, max_batch: int, max_pages: int, use_graphs: bool = True):
        self.km = km
        self.max_batch, self.max_pages = max_batch, max_pages
        self.use_graphs = use_graphs and km.device.type == "cuda"
        self.pool = GraphPool(km)
        self.decode = DecodeGraphs(km, self.pool, max_batch, max_pages)
        self.prefill = PrefillGraphs(km, self.pool)
        self.ctx = None  # ctx_graphs.ContextGraphs: a prompt chunk after a cached context
        self.spec = None  # spec_graphs.SpecGraphs: verify + MTP graphs (speculative decoding)
        self.mixed = []  # mixed_graphs.MixedGraphs: decode rows beside one chunk, per kind

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Final-normed hidden states [T, H] of the batch (see the module docstring)."""
        if not self.use_graphs:
            return self.km.forward_eager(batch)
        if self.spec is not None:
            self.spec.forget()  # its MTP graph reads the verify graph of this step only
            if self.spec.fits(batch):  # a speculative verify step
                return self.spec.forward(batch)
            ver = [j for j, s in enumerate(batch.seqs) if s.keep_states]
            if 0 < len(ver) < len(batch.seqs) and self.spec.fits_seqs([batch.seqs[j]
                                                                       for j in ver]):
                # new requests' prompts beside the verify chunks (every arrival at c=32):
                # eager, the whole step cost 300-1000 ms of host time (kb/0033)
                return self._split(batch, ver, sub_batch(batch, ver), self.spec.forward)
        dec = [j for j, s in enumerate(batch.seqs)
               if s.num_tokens == 1 and not s.reset_state and not s.keep_states]
        if not dec:
            return self.prompts(batch)
        if len(dec) > self.max_batch:
            return self.km.forward_eager(batch)
        if len(dec) == len(batch.seqs):
            return self.decode.forward(batch)
        rest = others(batch, dec)
        prompt = sub_batch(batch, rest)
        for m in self.mixed:
            key = m.bucket(len(dec), prompt)
            if key is not None:
                return m.forward(batch, dec, rest, prompt, key)
        fold = flags.current().mixed_eager_from
        if fold and prompt.input_ids.shape[0] >= fold and self.prompt_graphs(prompt) is None:
            return self.km.forward_eager(batch)
        return self._split(batch, dec, sub_batch(batch, dec), self.decode.forward, rest, prompt)

    def _split(self, batch: ForwardBatch, picked: list[int], sub: ForwardBatch,
               graph_forward, rest: list[int] | None = None,
               sub_p: ForwardBatch | None = None) -> torch.Tensor:
        """Hidden states of a step whose sequences `picked` (sub-batch `sub`) replay a graph
        (`graph_forward`: decode or verify) and whose other sequences `rest` (sub-batch
        `sub_p`; computed when not given) — prompt chunks, or verify chunks beside decode
        rows — run after it through `prompts`."""
        dev = batch.input_ids.device
        if rest is None:
            rest = others(batch, picked)
            sub_p = sub_batch(batch, rest)
        out = torch.empty(batch.input_ids.shape[0], self.km.cfg.hidden_size,
                          dtype=self.km.dtype, device=dev)
        out[h2d(token_rows([batch.seqs[j] for j in picked]), dev)] = graph_forward(sub)
        # a fresh prompt alone besides the decode rows (a request arriving while others decode:
        # every arrival of a serve whose requests do not come in waves) replays its prefill
        # graph too; eager, its ~1024 tokens cost ~150 ms of host time for ~56 ms of GPU work
        # (kb/0010, kb/0028). The first graph's output is copied out above, and the two
        # graphs' static buffers are disjoint, so replaying both in one step is safe.
        out[h2d(token_rows([batch.seqs[j] for j in rest]), dev)] = self.prompts(sub_p)
        return out

    def one_graph(self, batch: ForwardBatch):
        """The graph entry point of a one-sequence batch (a fresh prompt: its prefill graph;
        a chunk after its cached context: its context graph), or None."""
        if self.prefill.fits(batch):
            return self.prefill.forward
        if self.ctx is not None and self.ctx.fits(batch):
            return self.ctx.forward
        return None

    def prompt_graphs(self, batch: ForwardBatch):
        """How a step's prompt chunks (no decode rows) run: [(sub-batch, graph entry point)],
        one chunk from its graph when it has one; several, each from its own graph one after
        another, while the step has at most `prompts_in_graphs_chunks` chunks and
        `prompts_in_graphs_up_to` tokens and every chunk has a graph. None: eagerly, all
        together."""
        if len(batch.seqs) == 1:
            graph = self.one_graph(batch)
            return None if graph is None else [(batch, graph)]
        f = flags.current()
        if (batch.input_ids.shape[0] <= f.prompts_in_graphs_up_to
                and len(batch.seqs) <= f.prompts_in_graphs_chunks):
            subs = [sub_batch(batch, [j]) for j in range(len(batch.seqs))]
            graphs = [self.one_graph(sub) for sub in subs]
            if all(g is not None for g in graphs):
                return list(zip(subs, graphs))
        return None

    def prompts(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states of a step's prompt chunks (no decode rows), as `prompt_graphs` plans
        them (each output is copied out before the next replay, which may reuse the bucket)."""
        plan = self.prompt_graphs(batch)
        if plan is None:
            return self.km.forward_eager(batch)
        if len(plan) == 1:
            return plan[0][1](batch)
        out = torch.empty(batch.input_ids.shape[0], self.km.cfg.hidden_size,
                          dtype=self.km.dtype, device=batch.input_ids.device)
        for s, (sub, graph) in zip(batch.seqs, plan):
            out[s.q_start:s.q_start + s.num_tokens] = graph(sub)
        return out

    def drop_decode_graphs(self) -> None:
        """Forget the decode graphs, e.g. to capture again with other switches (A/B benches),
        and the mixed-step graphs with them: those hold decode steps captured under the same
        switches, so after a re-capture with others a mixed step would still run the old ones
        (`mixed_graphs.mixed_families` captures them again). The memory pool goes too unless
        prefill or context-chunk graphs still use it: capturing into a pool whose graphs are
        all gone trips an allocator assert in torch 2.11 ("use_count > 0")."""
        self.decode.graphs.clear()
        self.mixed = []
        if not self.prefill.graphs and not (self.ctx is not None and self.ctx.graphs):
            self.pool.pool = None
            gc.collect()
            torch.cuda.empty_cache()
