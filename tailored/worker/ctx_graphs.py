"""CUDA graphs for a prompt chunk that continues a cached context (kb/0055).

A prefill graph (`graphs.PrefillGraphs`, kb/0013) serves a *fresh* prompt only: position
0, zero states, causal attention over the chunk itself. Every other prompt chunk ran eagerly,
and an eager forward of this model is host-bound at ~100-150 ms whatever its size (~800
launches and FLA's Python; kb/0010). That chunk is common:

  - a prefix-cache hit (engine/prefix_cache.py) prefills the rest of its prompt after the
    cached context: the next turn of a chat, a new chat under a cached system prompt;
  - with the prefix cache on, a cold chat prompt ends a chunk at each save point, so its
    generation prompt (a few tokens) is a chunk of its own;
  - a prompt longer than the step's token budget (8192) prefills in several chunks.

Measured on an H100 (FP8, 8192-token system prompts, kb/0055): a hit's TTFT was ~185 ms
for 38 new tokens after 8194 cached ones, and the cache *added* ~190 ms to a cold chat turn
(three eager chunks more). With these graphs: the hit 27.6 ms, the next turn 44.8 ms (192.2
before), the cold turn with the cache 286.3 ms (519.9 before).

When: with the prefill graphs, unless the `ctx_graphs` switch is off (kb/0056); the worker
captures them after the prefill graphs. Then one sequence whose chunk starts at position
start_pos > 0 with its state in its slot (`SeqInfo.reset_state` false) replays a graph of the
smallest bucket ≥ its T tokens:

  - GDN layers: `GdnBlocks.chunk(carried=True)`: the conv continues the slot's
    conv state (meta "no reset") and the chunked delta rule starts from the slot's recurrent
    state, as the eager `_gdn_prefill` does; pad rows have g = 0, β = 0 (no state change).
  - attention layers: the chunk's K/V go into the cache first, then every row t is one
    paged-decode query over keys 0..start_pos + t (`paged_decode_attention` with the
    sequence's page table row broadcast to all rows, stride 0, and per-row lengths): the
    causal mask within the chunk and the cached context in one kernel, with lengths read on
    the device, so one graph serves every start_pos. Pad rows have length 1: they read key 0
    of the sequence's own first page (harmless, their output is dropped), not the sink page.

Each row re-reads the context's keys (from L2 while they fit: 2 KB a key a layer, so ~16k
keys; beyond, only as far as the rows running together share them), so the attention costs
~T·(start_pos + T) key reads a layer: the graph is taken while that product is at most
`ctx_graph_max_pairs`, else the chunk stays eager (where SDPA shares the reads). Timed up to
8k-token contexts only (kb/0055); the bound itself is an estimate. With
`TAILORED_PREFILL_ATTENTION=fa3` when the graphs are captured, the attention layers run the
chunk's rows in one FlashAttention-3 launch over the pages instead (`fa3.paged_attention`: the
chunk's rows and keys as device lengths, so one graph still serves every start_pos; pad rows
zeroed), each key tile read once for many rows: no pairs bound (kb/0069).

Numerics: the attention sums in another order than the eager path's SDPA over gathered keys
(H100: fp32 per-token rel. error ≤ 2.3e-7 against the eager chunk; bf16 rounding, within the
prefill graphs' bounds). tests/worker/test_ctx_graphs.py runs the body eagerly against the eager
forward on the CPU; tests/gpu/test_gpu_ctx.py replays the graphs against their bodies and the
eager path on the GPU.
"""

from __future__ import annotations

import numpy as np
import torch

from tailored import flags
from tailored.model.batch import ForwardBatch, h2d, kv_rows
from tailored.worker.graphs import GraphPool, check_rows, prefill_static, replay_bucket

# fine small buckets: a pad row routes to experts of its own, so a 5-token generation prompt
# padded to 64 rows would read ~3x the expert weights of its own 5 rows
CTX_BUCKETS = (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
# with FlashAttention-3 (no pairs bound) also these: an eager chunk of 2-4k rows is host-bound
# (~100-150 ms of host time for ~60-90 ms of GPU work, kb/0055); from 6144 rows the eager MoE
# takes the grouped GEMM that the graphs' fused_moe does not (kb/0031), so those stay eager
CTX_BUCKETS_FA3 = (3072, 4096)
# `ctx_graph_max_pairs` (T·(start_pos + T) key reads a layer at most, see the module
# docstring): its default 16M is 2048 new tokens after 6k, or 38 after 420k. At the bound,
# 32 GB of key reads a layer (320 GB a step): ~30 ms from L2, ~80-100 ms from HBM if the rows
# shared nothing (untimed), against ~100-150 ms of eager host time


def ctx_splits(n: int, kv_heads: int) -> int:
    """Key ranges per (row, KV head) of a bucket of n rows: 8 (the decode kernel's) while
    n·kv_heads·8 ≤ 1024 programs, halved above that down to 1: the fp32 partials take
    n·kv_heads·splits·16·D·4 bytes (8 splits at 2048 rows would be 537 MB)."""
    s = 8
    while s > 1 and n * kv_heads * s > 1024:
        s //= 2
    return s


class ContextGraphs:
    """Graphs of one sequence's prompt chunk after a cached context, per bucket of rows.

    `fits(batch)` says whether a batch (or a step's prompt part) is such a chunk;
    `forward(batch)` fills the static buffers and replays, returning hidden states [T, H].
    `capture(max_tokens)` captures every bucket ≤ max_tokens in the pool; a failed capture
    logs a warning and leaves such chunks eager, never an error."""

    def __init__(self, km, pool: GraphPool, max_pages: int) -> None:
        self.km, self.pool, self.max_pages = km, pool, max_pages
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.st: dict | None = None
        # the attention way the bodies were built with: FlashAttention-3 over the pages
        # (`prefill_attention` = fa3 when the statics were made) or the paged decode kernel
        self.fa3 = False

    # -- static buffers ---------------------------------------------------------------------------
    def alloc(self, n_max: int) -> None:
        dev = self.km.device
        # the fresh prefill graph's inputs, continuing the slot's conv state (reset 0), and
        # the keys of row t: 0..lens[t]-1 through the sequence's page table
        self.st = prefill_static(n_max, dev, reset=False)
        self.st["lens"] = torch.ones(n_max, dtype=torch.int32, device=dev)
        self.st["table"] = torch.zeros(1, self.max_pages, dtype=torch.int32, device=dev)
        # FlashAttention-3's device lengths: the chunk's rows and its keys; row numbers
        self.st["used_q"] = torch.ones(1, dtype=torch.int32, device=dev)
        self.st["used_k"] = torch.ones(1, dtype=torch.int32, device=dev)
        self.st["row_index"] = torch.arange(n_max, dtype=torch.int32, device=dev)
        self.fa3 = flags.current().prefill_attention == "fa3"

    def to_sinks(self, n_max: int) -> None:
        """Allocate the static buffers for up to n_max rows if needed, and make their content
        the warm-up's and capture's: every row reads and writes the sinks (slot 0, page 0)."""
        if self.st is None:
            self.alloc(n_max)
        st = self.st
        check_rows(st, n_max, "context-chunk")
        st["valid"].fill_(True)
        st["kv"].zero_()
        st["slot"].zero_()
        st["lens"].fill_(1)
        st["table"].zero_()
        st["used_q"].fill_(1)  # FlashAttention-3: row 0 over key 0 of the sink page
        st["used_k"].fill_(1)
        st["state_meta"][1].fill_(1)  # a fill's T may exceed a smaller bucket's rows

    def fill(self, batch: ForwardBatch, n: int) -> None:
        """The chunk's ids/positions (device-to-device) and one host-to-device copy of the
        rest: KV rows of its positions (pads → the sink page 0), the slot, the valid mask,
        the conv state meta, the rows' key counts and the sequence's page table."""
        s = batch.seqs[0]
        T, ps, st = s.num_tokens, self.km.cache.page_size, self.st
        P = len(s.page_ids)
        st["ids"][:T].copy_(batch.input_ids)
        st["pos"][:T].copy_(batch.positions)
        st["ids"][T:n].zero_()
        st["pos"][T:n].zero_()
        meta = np.zeros(3 * n + 7 + P, dtype=np.int64)
        meta[:T] = kv_rows(s.page_ids, s.start_pos, s.end_pos, ps)
        meta[n] = s.slot
        meta[n + 1:n + 1 + T] = 1
        meta[2 * n + 1:2 * n + 5] = [0, T, 0, 0]  # state_meta [4, 1]: continue the state
        lens = meta[2 * n + 5:3 * n + 5]
        lens[:] = 1
        lens[:T] = np.arange(s.start_pos + 1, s.end_pos + 1)
        meta[3 * n + 5:3 * n + 5 + P] = s.page_ids
        meta[3 * n + 5 + P:] = [T, s.end_pos]  # FlashAttention-3's rows and keys
        m = h2d(meta, self.km.device)
        st["kv"][:n].copy_(m[:n])
        st["slot"].copy_(m[n:n + 1])
        st["valid"][:n].copy_(m[n + 1:2 * n + 1] != 0)
        st["state_meta"].copy_(m[2 * n + 1:2 * n + 5].view(4, 1))
        st["lens"][:n].copy_(m[2 * n + 5:3 * n + 5])
        st["table"][0, :P].copy_(m[3 * n + 5:3 * n + 5 + P])
        st["used_q"].copy_(m[3 * n + 5 + P:3 * n + 6 + P])
        st["used_k"].copy_(m[3 * n + 6 + P:])

    # -- body -------------------------------------------------------------------------------------
    def mixer(self, n: int, cos: torch.Tensor, sin: torch.Tensor):
        """mixer(i, normed) of the static buffers' first n rows: each layer's token mixer over
        the chunk (alone, or beside decode rows: worker/mixed_graphs.py)."""
        km, st = self.km, self.st
        valid, kv = st["valid"][:n], st["kv"][:n]
        table = st["table"].expand(n, -1)  # stride 0: every row reads the sequence's table
        lens = st["lens"][:n]
        splits = ctx_splits(n, km.cache.k.shape[3])
        fa3_lens = (st["used_q"], st["used_k"], st["row_index"][:n]) if self.fa3 else None

        def mixer(i, hn):
            if km.is_gdn(i):
                return km.gdn.chunk(i, hn, valid, st["slot"], st, carried=True)
            return km.attn.context_chunk(i, hn, cos, sin, kv, table, lens, splits, fa3_lens)

        return mixer

    def body(self, n: int) -> torch.Tensor:
        """Final-normed hidden states [n, H] of the static buffers' first n rows."""
        x, cos, sin = self.km.embed(self.st["ids"][:n], self.st["pos"][:n])
        return self.km.layers_forward(x, self.mixer(n, cos, sin))

    # -- dispatch ---------------------------------------------------------------------------------
    def takes(self, s) -> bool:
        """Whether sequence `s`'s chunk is one a context graph computes: 2 or more tokens
        continuing its slot's state from position start_pos > 0 (not a verify chunk), within
        the page table and, with the paged decode kernel (each row reads its keys),
        `ctx_graph_max_pairs` (FlashAttention-3 reads each key tile once for many rows)."""
        return (s.start_pos > 0 and not s.reset_state and not s.keep_states
                and s.num_tokens > 1
                and (self.fa3 or s.num_tokens * s.end_pos <= flags.current().ctx_graph_max_pairs)
                and len(s.page_ids) <= self.max_pages)

    def fits(self, batch: ForwardBatch) -> bool:
        """One sequence whose chunk the graphs compute (`takes`), of at most the largest
        bucket's tokens."""
        if not self.graphs or len(batch.seqs) != 1:
            return False
        s = batch.seqs[0]
        return self.takes(s) and s.num_tokens <= max(self.graphs)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [T, H] of the chunk, replayed from the smallest bucket ≥ T."""
        return replay_bucket(self.graphs, batch.seqs[0].num_tokens, self.fill, batch)

    @staticmethod
    def buckets() -> tuple[int, ...]:
        """The buckets a capture takes by default: CTX_BUCKETS, and CTX_BUCKETS_FA3 where the
        bodies run FlashAttention-3 (`prefill_attention` = fa3)."""
        fa3 = flags.current().prefill_attention == "fa3"
        return CTX_BUCKETS + (CTX_BUCKETS_FA3 if fa3 else ())

    @torch.no_grad()  # startup forwards: never keep autograd's saved activations
    def capture(self, max_tokens: int, buckets=None) -> None:
        """Capture one graph per bucket ≤ max_tokens (largest first) in the pool. The warm-up
        and capture content reads and writes the sinks only (slot 0, page 0)."""
        sizes = sorted({b for b in (buckets or self.buckets()) if b <= max_tokens},
                       reverse=True)
        if not sizes:
            return
        self.to_sinks(sizes[0])
        self.pool.capture_guarded(self.graphs, sizes, self.body, "context-chunk",
                                  "such chunks stay eager")
