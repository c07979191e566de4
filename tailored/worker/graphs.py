"""CUDA graphs of decode steps and of a fresh prompt's prefill, and their shared memory pool.

A decode-only step (every sequence one token) replays a graph captured per padded batch size
(`GRAPH_BATCH_SIZES`): no Python, launch or host sync inside the step. Pad rows (slot 0, page
0, length 1) compute garbage into the sinks and are never read.

A fresh prompt alone in its step (the c=1 TTFT case) is padded to a bucket of tokens
(`PREFILL_BUCKETS`) and replayed from a graph: its eager forward is host-bound (~150 ms of
Python and launches for ~58 ms of GPU work at 1024 tokens, kb/0010, kb/0013). Pad rows come
after the real ones, so every causal operation leaves the real rows exact; pads write KV into
the sink page 0, and have g = 0, β = 0 in the delta rule (decay 1, no write), so the state
after the bucket is the state after the prompt (tests/kernels/test_ops_reference.py pins
that property).

The bodies are the kernel path's own layers (`KernelModel.layers_forward`) over static
buffers; tests run them eagerly on the CPU against the eager forward.
"""

from __future__ import annotations

import gc
import logging

import numpy as np
import torch

from tailored.model.batch import ForwardBatch, h2d, kv_rows, pinned, to_device

log = logging.getLogger("tailored.worker")

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128)
# prefill graphs (kb/0013): one per padded token count; padding costs ≤ 1/8 of the work to 2048
PREFILL_BUCKETS = tuple(range(128, 2049, 128)) + (3072, 4096, 6144, 8192)


def replay_bucket(graphs: dict, size: int, fill, batch: ForwardBatch) -> torch.Tensor:
    """Rows [:size] of the output of the smallest captured bucket n ≥ size of `graphs` ({n:
    (graph, output)}), replayed after `fill(batch, n)` wrote its static inputs: the one
    replay of the decode, prefill and context-chunk graphs."""
    n = min(b for b in graphs if b >= size)
    fill(batch, n)
    g, out = graphs[n]
    g.replay()
    return out[:size]


def prefill_static(n_max: int, device, reset: bool) -> dict:
    """Static inputs of a one-sequence prefill graph of up to n_max rows (on `device`): ids,
    positions, valid mask, flat KV row per token, slot, and gdn_conv's sequence meta (q, len,
    o, reset) of the conv and of the state update. reset: a fresh prompt (zero conv state);
    else the rows continue the slot's conv state (worker/ctx_graphs.py)."""
    r = int(reset)
    return {
        "ids": torch.zeros(n_max, dtype=torch.long, device=device),
        "pos": torch.zeros(n_max, dtype=torch.long, device=device),
        "valid": torch.zeros(n_max, dtype=torch.bool, device=device),
        "kv": torch.zeros(n_max, dtype=torch.long, device=device),  # flat KV row per token
        "slot": torch.zeros(1, dtype=torch.long, device=device),
        # gdn_conv's sequence rows: the conv over the whole bucket (n_max, cut to the bucket
        # by its output rows; pads last, never read by real rows), the carried state from the
        # real tokens (one row until a fill says more: never past a bucket's rows, also in a
        # warm-up)
        "conv_meta": torch.tensor([[0], [n_max], [0], [r]], dtype=torch.long).to(device),
        "state_meta": torch.tensor([[0], [1], [0], [r]], dtype=torch.long).to(device),
    }


def check_rows(st: dict, n_max: int, what: str) -> None:
    """Raise ValueError when static buffers `st` (`prefill_static`'s) hold fewer than n_max
    rows: they are allocated once, by the first capture (or a mixed-step capture,
    worker/mixed_graphs.py), and captured graphs point at them, so a larger capture cannot
    re-allocate them; over fewer rows its bodies would run on truncated slices."""
    if st["ids"].shape[0] < n_max:
        raise ValueError(f"{what} graphs' static buffers hold {st['ids'].shape[0]} rows, "
                         f"{n_max} asked: capture the largest bucket first")


class GraphPool:
    """The one memory pool of a worker's CUDA graphs (decode, prefill, context-chunk,
    speculative): they never replay at once, and each keeps its output alive."""

    def __init__(self, km) -> None:
        self.km = km
        self.pool = None

    def capture(self, graphs: dict, sizes, body) -> None:
        """graphs[n] = (graph, output) of body(n) for each size, largest first. Every size runs
        once on a side stream first, so Triton compiles and autotuners run outside the
        capture."""
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for n in sizes:
                body(n)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        # the warm-up's blocks stay cached for its side stream, where no graph pool can take
        # them: hand them back first
        torch.cuda.empty_cache()
        for n in sizes:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                out = body(n)
            if self.pool is None:
                self.pool = g.pool()
            graphs[n] = (g, out)
        torch.cuda.synchronize()

    def capture_guarded(self, graphs: dict, sizes, body, what: str, fallback: str) -> None:
        """`capture` with the MoE held to fused_moe (the bodies' warm-up and capture launch the
        same MoE; a capture that took the grouped path tuned a new tile inside it, kb/0031),
        logging the buckets captured (token counts, `sizes` descending). A failure (an op that
        syncs or allocates on the host inside FLA or torch, out of memory) logs a warning
        naming `what` and `fallback`, and empties `graphs`: never an error."""
        failed = None
        self.km.moe.fused_only = True
        try:
            self.capture(graphs, sizes, body)
        except Exception as e:  # noqa: BLE001 - serving continues eagerly
            failed = f"{type(e).__name__}: {e}"
        finally:
            self.km.moe.fused_only = False
        if failed is None:
            log.info("captured %s CUDA graphs for %s..%s tokens (%d buckets)", what, sizes[-1],
                     sizes[0], len(sizes))
            return
        # after the except block: inside it the exception being handled still holds the
        # failed warm-up's frames (and tensors) through its traceback; those frames form a
        # cycle that only the cyclic GC frees (GPU memory is no pressure for it), so collect
        # now, or an out-of-memory capture leaves that memory taken for the whole serve.
        # (Memory a failed *capture* took stays in the pool shared with the other graphs.)
        log.warning("%s CUDA graphs not captured (%s); %s", what, failed, fallback)
        graphs.clear()
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


class DecodeGraphs:
    """One graph per padded decode batch size ≤ max_batch; max_pages: page-table width."""

    def __init__(self, km, pool: GraphPool, max_batch: int, max_pages: int) -> None:
        self.km, self.pool = km, pool
        self.max_batch, self.max_pages = max_batch, max_pages
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.st: dict | None = None

    def alloc(self) -> None:
        dev, B, P = self.km.device, self.max_batch, self.max_pages
        self.st = {
            "ids": torch.zeros(B, dtype=torch.long, device=dev),
            "pos": torch.zeros(B, dtype=torch.long, device=dev),
            "slots": torch.zeros(B, dtype=torch.int32, device=dev),
            "table": torch.zeros(B, P, dtype=torch.int32, device=dev),
            "lens": torch.ones(B, dtype=torch.int32, device=dev),
            "kv_rows": torch.zeros(B, dtype=torch.long, device=dev),
        }

    def mixer(self, n: int, cos: torch.Tensor, sin: torch.Tensor):
        """mixer(i, normed) of the static buffers' first n rows (`layers_forward`'s): the
        decode step of each layer's token mixer, alone or beside a prompt chunk
        (worker/mixed_graphs.py)."""
        st, km = self.st, self.km
        slots, table, lens = st["slots"][:n], st["table"][:n], st["lens"][:n]
        kv_rows_ = st["kv_rows"][:n]

        def mixer(i, hn):
            if km.is_gdn(i):
                return km.gdn.decode(i, hn, slots)
            return km.attn.decode(i, hn, cos, sin, kv_rows_, table, lens)

        return mixer

    def body(self, n: int) -> torch.Tensor:
        """Final-normed hidden states [n, H] of the static buffers' first n rows."""
        x, cos, sin = self.km.embed(self.st["ids"][:n], self.st["pos"][:n])
        return self.km.layers_forward(x, self.mixer(n, cos, sin))

    def fill(self, batch: ForwardBatch, n: int) -> None:
        """Copy the step's layout into the static buffers; rows len(batch.seqs)..n are pad rows
        (slot 0, page 0, length 1): they compute garbage into the sinks and are never read.
        Token ids and positions are already on the device (device-to-device copies, no sync);
        the page table is built in numpy and sent in one host-to-device copy per tensor."""
        ps = self.km.cache.page_size
        B = len(batch.seqs)
        table = np.zeros((n, self.max_pages), dtype=np.int32)
        meta = np.zeros((3, n), dtype=np.int64)  # lens, slots, kv_rows
        meta[0, :] = 1
        for j, s in enumerate(batch.seqs):
            table[j, :len(s.page_ids)] = s.page_ids
            meta[0, j] = s.end_pos
            meta[1, j] = s.slot
            meta[2, j] = s.page_ids[s.start_pos // ps] * ps + s.start_pos % ps
        st, dev = self.st, self.km.device
        st["ids"][:B].copy_(batch.input_ids)
        st["pos"][:B].copy_(batch.positions)
        if n > B:
            st["ids"][B:n].zero_()
            st["pos"][B:n].zero_()
        st["table"][:n].copy_(pinned(torch.from_numpy(table), dev), non_blocking=True)
        m = to_device(torch.from_numpy(meta), dev)
        st["lens"][:n].copy_(m[0])
        st["slots"][:n].copy_(m[1])
        st["kv_rows"][:n].copy_(m[2])

    def to_sinks(self) -> None:
        """Point every row at the sinks (slot 0, page 0, length 1), allocating the buffers
        first: warm-up and capture run real forwards over the static buffers, and after served
        steps they hold live sequences' slots, pages and KV rows, so a re-capture would
        advance those sequences."""
        if self.st is None:
            self.alloc()
        st = self.st
        for name in ("ids", "pos", "slots", "table", "kv_rows"):
            st[name].zero_()
        st["lens"].fill_(1)

    @torch.no_grad()  # startup forwards: never keep autograd's saved activations
    def capture(self, sizes=None) -> None:
        """Capture one graph per padded batch size (largest first, in the pool)."""
        self.to_sinks()
        sizes = sorted({b for b in (sizes or GRAPH_BATCH_SIZES) if b <= self.max_batch}
                       | {self.max_batch}, reverse=True)
        self.pool.capture(self.graphs, sizes, self.body)
        log.info("captured decode CUDA graphs for batch sizes %s", sorted(self.graphs))

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        if not self.graphs:
            self.capture()
        return replay_bucket(self.graphs, len(batch.seqs), self.fill, batch)


class PrefillGraphs:
    """One graph per token bucket for a fresh prompt alone (position 0, state reset)."""

    def __init__(self, km, pool: GraphPool) -> None:
        self.km, self.pool = km, pool
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.st: dict | None = None

    @staticmethod
    def takes(s) -> bool:
        """Whether sequence `s`'s chunk is one a prefill graph computes: a fresh prompt
        (position 0, state reset) of 2 or more tokens."""
        return s.start_pos == 0 and s.reset_state and s.num_tokens > 1

    def fits(self, batch: ForwardBatch) -> bool:
        """One sequence, a fresh prompt (`takes`) of at most the largest bucket's tokens."""
        if not self.graphs or len(batch.seqs) != 1:
            return False
        s = batch.seqs[0]
        return self.takes(s) and s.num_tokens <= max(self.graphs)

    def fill(self, batch: ForwardBatch, n: int) -> None:
        """The prompt's ids/positions (device-to-device) and one host-to-device copy of the
        rest: KV rows (pads → row 0 of the sink page 0), the slot, the valid mask and the conv
        state update's sequence meta (its T real rows)."""
        s = batch.seqs[0]
        T, ps = s.num_tokens, self.km.cache.page_size
        st = self.st
        st["ids"][:T].copy_(batch.input_ids)
        st["pos"][:T].copy_(batch.positions)
        st["ids"][T:n].zero_()
        st["pos"][T:n].zero_()
        meta = np.zeros(2 * n + 5, dtype=np.int64)
        meta[:T] = kv_rows(s.page_ids, 0, T, ps)
        meta[n] = s.slot
        meta[n + 1:n + 1 + T] = 1
        meta[2 * n + 1:] = [0, T, 0, 1]  # state_meta [4, 1]
        m = h2d(meta, self.km.device)
        st["kv"][:n].copy_(m[:n])
        st["slot"].copy_(m[n:n + 1])
        st["valid"][:n].copy_(m[n + 1:2 * n + 1] != 0)
        st["state_meta"].copy_(m[2 * n + 1:].view(4, 1))

    def mixer(self, n: int, cos: torch.Tensor, sin: torch.Tensor):
        """mixer(i, normed) of the static buffers' first n rows: each layer's token mixer
        over the fresh prompt (alone, or beside decode rows: worker/mixed_graphs.py)."""
        st, km = self.st, self.km
        valid, kv = st["valid"][:n], st["kv"][:n]

        def mixer(i, hn):
            if km.is_gdn(i):
                return km.gdn.chunk(i, hn, valid, st["slot"], st)
            return km.attn.chunk(i, hn, cos, sin, kv)

        return mixer

    def body(self, n: int) -> torch.Tensor:
        """Final-normed hidden states [n, H] of the static buffers' first n rows."""
        x, cos, sin = self.km.embed(self.st["ids"][:n], self.st["pos"][:n])
        return self.km.layers_forward(x, self.mixer(n, cos, sin))

    def to_sinks(self, n_max: int) -> None:
        """Allocate the static buffers for up to n_max rows if needed, and make their content
        the warm-up's and capture's: all rows real, KV and state → the sinks."""
        if self.st is None:
            self.st = prefill_static(n_max, self.km.device, reset=True)
        st = self.st
        check_rows(st, n_max, "prefill")
        st["valid"].fill_(True)
        st["kv"].zero_()
        st["slot"].zero_()
        st["state_meta"][1].fill_(1)  # a fill's T may exceed a smaller bucket's rows

    @torch.no_grad()  # startup forwards: never keep autograd's saved activations
    def capture(self, max_tokens: int, buckets=None) -> None:
        """Capture one graph per bucket up to max_tokens (largest first, in the pool). A failed
        capture (an op that syncs or allocates on the host inside FLA or torch) logs a warning
        and leaves prefill eager: never an error."""
        sizes = sorted({b for b in (buckets or PREFILL_BUCKETS) if b <= max_tokens}, reverse=True)
        if not sizes:
            return
        self.to_sinks(sizes[0])
        self.pool.capture_guarded(self.graphs, sizes, self.body, "prefill",
                                  "prefill stays eager")

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [T, H] of one fresh prompt, replayed from the smallest bucket ≥ T."""
        return replay_bucket(self.graphs, batch.seqs[0].num_tokens, self.fill, batch)
