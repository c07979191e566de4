"""CUDA graphs of speculative decode steps (worker/drafter.py): verify, MTP and chain graphs.

A step whose every sequence is a verify chunk (a drafting request's last token and up to N
drafts, or a lone decode row of the same step; `SeqInfo.keep_states`) is the c ≤
spec_max_running case of speculative decoding. Eagerly it would be
host-bound like any eager step (~660 launches for ~3.5 ms of GPU work, kb/0029), so it replays
two graphs per padded batch size B (SPEC_BATCH_SIZES):

  verify: the target over B·n rows, n = N + 1, laid out token-major (row j·B + b is token j of
    sequence b). Every row is a decode row of its own: attention reads keys 0..its position
    (the chunk's keys are all stored in the k-norm launch before it), projections and experts
    are row-wise. The GDN layers run the n tokens of all B sequences in one launch each of
    the verify conv and recurrence (kernels/gdn_verify.py; the `gdn_verify_kernels` switch off:
    token j at a time through the decode kernels), in place on the slots; the state after
    each token j < n-1 also goes into a snapshot (`snap_conv`, `snap_rec`; no extra launch or
    read): `HybridCache.commit_many` takes the one after the last kept token from there. A
    chunk shorter than n is padded (ids 0, KV into the sink row): its state is always
    committed from a snapshot, so the pad tokens' updates vanish.
  mtp: the MTP layer over the same B·n rows, fed the verify graph's hidden output and the
    tokens the step emitted (host-filled after acceptance), which writes the MTP KV of those
    positions; then from each sequence's last emitted row, draft 1 and N-1 chained drafts at
    the next positions, each one paged-decode row a sequence (spec §8.2). Output [B, N].

  chain: the acceptance of the drafts, the GDN state commits and the mtp body, all on the
    device from the sampled tokens (`chain_body`, kb/0034). After a step that was one verify
    replay the runner replays it right after the sampler: no sync until the tokens and the
    next drafts are read, together. Output [B, 1 + N]: kept drafts, then the next drafts.

Without an MTP layer (prompt-lookup drafts alone, `--speculative-method ngram`: the cache has
none) only the verify graphs are captured; the runner accepts and commits on the host.

Steps where the verify graph ran beside other work (prompt chunks, `KernelForward.forward`) take the
host path instead: the runner reads the verified tokens, keeps the matching drafts and commits
the states (one sync), then fills and replays the mtp graph (the second). Rows of pad
sequences use slot 0 and page 0 (the sinks). Checked on the CPU by running the bodies eagerly
against the eager step and the host path (tests/worker/test_kernel_path.py); the graphs
themselves run on the GPU (tests/gpu/test_gpu_spec.py).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from tailored.model.batch import ForwardBatch, pinned, to_device
from tailored.model.kernel_mtp import mtp_input, mtp_layer
from tailored.ops import reference as ref
from tailored.worker.cache import HybridCache
from tailored.worker.draft_head import draft_argmax
from tailored.worker.graphs import GraphPool

log = logging.getLogger("tailored.worker")

SPEC_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32)


def snapshot_bytes(cfg, num_draft: int, max_batch: int, dtype: torch.dtype,
                   state_dtype: torch.dtype = torch.float32) -> int:
    """GPU bytes of the verify graphs' GDN snapshots: N states of every GDN layer for
    max_batch sequences (full size: 61.5 MB a sequence and draft with fp32 states)."""
    return num_draft * max_batch * HybridCache.bytes_per_slot(cfg, dtype, state_dtype)


class SpecGraphs:
    """The verify, MTP and chain graphs of one kernel path (the verify graphs alone where
    it has no MTP layer). num_draft: N drafts a step; max_batch: the largest padded batch
    captured; max_pages: page-table width; draft_head: the FP8 lm_head copy the MTP drafts
    with (worker/draft_head.py) or None."""

    def __init__(self, km, pool: GraphPool, num_draft: int, max_batch: int, max_pages: int,
                 draft_head=None):
        self.has_mtp = km.mtp_layer is not None
        self.km, self.pool, self.max_pages, self.draft_head = km, pool, max_pages, draft_head
        self.N, self.n = num_draft, num_draft + 1
        self.sizes = tuple(b for b in SPEC_BATCH_SIZES if b < max_batch) + (max_batch,)
        self.max_batch = max_batch
        cache, dev = km.cache, km.device
        R, P, G = max_batch * self.n, max_pages, cache.conv.shape[0]
        self.st = {
            "ids": torch.zeros(R, dtype=torch.long, device=dev),
            "pos": torch.zeros(R, dtype=torch.long, device=dev),
            "kv": torch.zeros(R, dtype=torch.long, device=dev),
            "table": torch.zeros(R, P, dtype=torch.int32, device=dev),
            "lens": torch.ones(R, dtype=torch.int32, device=dev),
            "slots": torch.zeros(max_batch, dtype=torch.int32, device=dev),
            "m_ids": torch.zeros(R, dtype=torch.long, device=dev),
            "m_sel": torch.zeros(max_batch, dtype=torch.long, device=dev),
            "c_pos": torch.zeros(max(self.N - 1, 1), max_batch, dtype=torch.long, device=dev),
            "c_kv": torch.zeros(max(self.N - 1, 1), max_batch, dtype=torch.long, device=dev),
            "c_lens": torch.ones(max(self.N - 1, 1), max_batch, dtype=torch.int32, device=dev),
            # the chain graph (`chain_body`): the target's tokens at the verify rows, and per
            # sequence its drafts, first position, positions its pages cover, 1 for a real
            # sequence (0: a pad), the synthetic kept count (-1: the greedy rule)
            "y": torch.zeros(R, dtype=torch.long, device=dev),
            "y_bad": torch.zeros(R, dtype=torch.bool, device=dev),  # NaN rows (the sampler's)
            "seq": torch.zeros(4, max_batch, dtype=torch.long, device=dev),
            "syn": torch.full((max_batch,), -1, dtype=torch.long, device=dev),
        }
        self.snap_conv = torch.zeros((G, self.N, max_batch) + tuple(cache.conv.shape[2:]),
                                     dtype=cache.conv.dtype, device=dev)
        self.snap_rec = torch.zeros((G, self.N, max_batch) + tuple(cache.rec.shape[2:]),
                                    dtype=cache.rec.dtype, device=dev)
        self.verify: dict[int, tuple] = {}  # padded B -> (graph, hidden [B·n, H])
        self.mtp: dict[int, tuple] = {}  # padded B -> (graph, drafts [B, N])
        # padded B -> (graph, [B, 1 + N]: kept drafts, then the next drafts of each sequence)
        self.chains: dict[int, tuple] = {}
        self._layout = None  # (padded B, {slot: (b, SeqInfo)}) of the last verify replay
        self._back = None  # graph row of every batch row of the last verify replay

    def forget(self) -> None:
        """Drop the last verify step's layout: a later `propose` runs the MTP eagerly."""
        self._layout = self._back = None

    # ---- which steps --------------------------------------------------------------------------
    def fits(self, batch: ForwardBatch) -> bool:
        """Every sequence a verify chunk of ≤ n tokens, at most max_batch of them."""
        return self.fits_seqs(batch.seqs)

    def fits_seqs(self, seqs) -> bool:
        """`fits` for a list of SeqInfos."""
        return (0 < len(seqs) <= self.max_batch
                and all(s.keep_states and not s.reset_state and s.num_tokens <= self.n
                        for s in seqs))

    # ---- bodies (what the graphs capture; eager on the CPU in tests) --------------------------
    def verify_body(self, B: int) -> torch.Tensor:
        km, st = self.km, self.st
        R = B * self.n
        kv, table, lens = st["kv"][:R], st["table"][:R], st["lens"][:R]
        x, cos, sin = km.embed(st["ids"][:R], st["pos"][:R])
        slots = st["slots"][:B]

        def mixer(i, hn):
            if km.is_gdn(i):
                li = km.cache.gdn_index[i]
                return km.gdn.verify_graph(i, hn, slots, self.n, self.snap_conv[li, :, :B],
                                           self.snap_rec[li, :, :B])
            return km.attn.decode(i, hn, cos, sin, kv, table, lens)

        return km.layers_forward(x, mixer)

    def mtp_body(self, B: int) -> torch.Tensor:
        km, st, cfg = self.km, self.st, self.km.cfg
        R = B * self.n
        hidden = self.verify[B][1] if B in self.verify else self._eager_hidden
        pos, kv, table, lens = st["pos"][:R], st["kv"][:R], st["table"][:R], st["lens"][:R]
        cos, sin = ref.rope_cos_sin(pos, cfg.rotary_dim, cfg.rope_theta, hidden.dtype)
        out = mtp_layer(km, mtp_input(km, hidden, st["m_ids"][:R]),
                        lambda i, hn: km.attn.decode(i, hn, cos, sin, kv, table, lens))
        h = out.index_select(0, st["m_sel"][:B])
        tok = draft_argmax(km.model, self.draft_head, h)
        drafts = [tok]
        for k in range(self.N - 1):  # chain: own hidden, previous draft, one position on
            c_pos, c_kv, c_lens = st["c_pos"][k, :B], st["c_kv"][k, :B], st["c_lens"][k, :B]
            cos, sin = ref.rope_cos_sin(c_pos, cfg.rotary_dim, cfg.rope_theta, h.dtype)
            h = mtp_layer(km, mtp_input(km, h, tok),
                          lambda i, hn: km.attn.decode(i, hn, cos, sin, c_kv, table[:B],
                                                       c_lens))
            tok = draft_argmax(km.model, self.draft_head, h)
            drafts.append(tok)
        return torch.stack(drafts, 1)

    def chain_body(self, B: int) -> torch.Tensor:
        """Acceptance, state commits and the MTP of a whole verify step on the device, from
        the target's tokens at the verify rows (`st["y"]`): what `ModelRunner._speculate`,
        `HybridCache.commit_many` and `propose` do on the host, without the sync between the
        verify graph and the MTP (kb/0034). Per sequence b: kept_b = the synthetic count
        (capped at its drafts), else the longest prefix with d_{j+1} == y_j (`drafter.accept`);
        it emits d_1..d_kept, y_kept (`drafter.emitted`: with the greedy rule the same tokens);
        its GDN state becomes the one after token kept_b (snapshot kept_b, none when it kept
        every token of an n-long chunk). Returns [B, 1 + N] int64: kept_b, then the N drafts
        from its last emitted row (`mtp_body`)."""
        st, n, N = self.st, self.n, self.N
        dev = st["y"].device
        ps = self.km.cache.page_size
        R = B * n
        y = st["y"][:R].view(n, B)
        ids = st["ids"][:R].view(n, B)  # row j: token j of the chunk (d_j for j ≥ 1)
        nd, start, plim, live = st["seq"][:, :B]
        j = torch.arange(n, device=dev).unsqueeze(1)
        # a NaN row (its id is the sampler's fallback, patched on the host only) ends the
        # prefix: every kept draft matched a clean target token
        bad = st["y_bad"][:R].view(n, B)
        match = ((ids[1:] == y[:N]) & ~bad[:N] & (j[:N] < nd)).long()
        greedy = match.cumprod(0).sum(0)
        syn = st["syn"][:B]
        kept = torch.where(syn >= 0, torch.minimum(syn, nd), greedy)
        # emitted token j (j ≤ kept) is the MTP's next id at row j: d_{j+1} below kept, then
        # y_kept; rows past it get 0, as `propose` gives them (their MTP KV is rewritten
        # before anything reads it)
        nxt = torch.cat([ids[1:], y[N:]], 0)
        em = torch.where(j < kept, nxt, torch.where(j == kept, y, torch.zeros_like(y)))
        st["m_ids"][:R].copy_(em.reshape(-1))
        b = torch.arange(B, device=dev)
        st["m_sel"][:B].copy_(kept * B + b)
        if N > 1:  # chained drafts at the next positions, where the pages reach (else sinks)
            p = start + kept + 1 + torch.arange(N - 1, device=dev).unsqueeze(1)  # [N-1, B]
            ok = p < plim
            pc = torch.where(ok, p, 0)
            page = st["table"][:B].long().gather(1, (pc // ps).T).T  # rows j=0: sequence b
            st["c_pos"][:, :B].copy_(pc)
            st["c_kv"][:, :B].copy_(torch.where(ok, page * ps + pc % ps, 0))
            st["c_lens"][:, :B].copy_(torch.where(ok, p + 1, 1).to(st["c_lens"].dtype))
        # the state after token kept: from snapshot kept, unless it is the chunk's last token
        # (n tokens, already in place); pads move nothing
        move = torch.where((kept < n - 1) & (live > 0), kept, -1)
        self.km.cache.commit_moves(self.snap_conv, self.snap_rec,
                                   torch.stack([move, b, st["slots"][:B].long()]))
        return torch.cat([kept.unsqueeze(1), self.mtp_body(B)], 1)

    def whole_step(self, batch: ForwardBatch, sampled_rows: int) -> bool:
        """Whether the last verify replay was this whole step and every row of it was
        sampled in batch order (then `chain` can follow it)."""
        return (self._layout is not None and len(self._layout[1]) == len(batch.seqs)
                and sampled_rows == batch.input_ids.shape[0])

    def chain(self, sampled_ids: torch.Tensor, synthetic: list[int] | None,
              bad: torch.Tensor | None = None) -> torch.Tensor:
        """After a whole verify step (`whole_step`): its sampled ids [T] (batch row order) and
        their NaN flags `bad` [T] bool (the sampler's; None: none) →
        [B, 1 + N] on the device (`chain_body`: kept drafts and next drafts of each sequence
        in batch order), from the chain graph. synthetic: each sequence's kept count drawn
        on the host (synthetic acceptance), or None for the greedy rule. Commits the states
        (the cache's kept_batch is dropped) and consumes the layout."""
        Bp, layout = self._layout
        B = len(layout)
        st = self.st
        st["y"].index_copy_(0, self._back, sampled_ids)
        if bad is None:
            st["y_bad"].zero_()
        else:
            st["y_bad"].index_copy_(0, self._back, bad)
        if synthetic is None:
            st["syn"][:Bp].fill_(-1)
        else:
            syn = np.full(Bp, -1, dtype=np.int64)
            syn[:B] = synthetic
            st["syn"][:Bp].copy_(to_device(torch.from_numpy(syn), self.km.device))
        if Bp in self.chains:
            g, out = self.chains[Bp]
            g.replay()
        else:
            out = self.chain_body(Bp)
        self._layout = self._back = None
        self.km.cache.kept_batch = None
        return out[:B]

    # ---- steps --------------------------------------------------------------------------------
    def _padded(self, B: int) -> int:
        return min(b for b in self.sizes if b >= B)

    def fill_verify(self, batch: ForwardBatch) -> tuple[int, torch.Tensor]:
        """Static buffers of a verify step: returns (padded B, graph row of every batch row)."""
        ps, n = self.km.cache.page_size, self.n
        B = len(batch.seqs)
        Bp = self._padded(B)
        R = Bp * n
        table = np.zeros((R, self.max_pages), dtype=np.int32)
        meta = np.zeros((4, R), dtype=np.int64)  # pos, kv rows, lens, id source (-1: pad)
        meta[2] = 1
        meta[3] = -1
        slots = np.zeros(Bp, dtype=np.int64)
        seq = np.zeros((4, Bp), dtype=np.int64)  # drafts, first position, page reach, real
        back = np.zeros(batch.input_ids.shape[0], dtype=np.int64)
        layout = {}
        for b, s in enumerate(batch.seqs):
            slots[b] = s.slot
            seq[:, b] = (s.num_tokens - 1, s.start_pos, len(s.page_ids) * ps, 1)
            layout[s.slot] = (b, s)
            for j in range(n):
                row = j * Bp + b
                table[row, :len(s.page_ids)] = s.page_ids
                p = s.start_pos + j
                meta[0, row] = p
                if j < s.num_tokens:
                    meta[1, row] = s.page_ids[p // ps] * ps + p % ps
                    meta[2, row] = p + 1
                    meta[3, row] = s.q_start + j
                    back[s.q_start + j] = row
                # else a pad token: KV into the sink row, its state never committed
        st, dev = self.st, self.km.device
        st["table"][:R].copy_(pinned(torch.from_numpy(table), dev), non_blocking=True)
        m = to_device(torch.from_numpy(np.concatenate([meta.reshape(-1), slots,
                                                       seq.reshape(-1), back])), dev)
        st["pos"][:R].copy_(m[:R])
        st["kv"][:R].copy_(m[R:2 * R])
        st["lens"][:R].copy_(m[2 * R:3 * R])
        src = m[3 * R:4 * R]
        st["ids"][:R].copy_(torch.where(src >= 0, batch.input_ids[src.clamp(min=0)], 0))
        st["slots"][:Bp].copy_(m[4 * R:4 * R + Bp])
        st["seq"][:, :Bp].copy_(m[4 * R + Bp:4 * R + 5 * Bp].view(4, Bp))
        self._layout = (Bp, layout)
        self._back = m[4 * R + 5 * Bp:]
        return Bp, self._back

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Final-normed hidden states [T, H] of a verify batch (`fits`), from the verify graph
        (eagerly through its body without graphs). Leaves the GDN snapshots for
        `HybridCache.commit_states` (cache.kept_batch)."""
        Bp, back = self.fill_verify(batch)
        if Bp in self.verify:
            g, hidden = self.verify[Bp]
            g.replay()
        else:
            hidden = self._eager_hidden = self.verify_body(Bp)
        cache = self.km.cache
        cache.kept_states.clear()
        cache.kept_batch = (self.snap_conv, self.snap_rec,
                            {slot: b for slot, (b, _) in self._layout[1].items()}, self.n)
        return hidden.index_select(0, back)

    def propose(self, rows) -> list[list[int]] | None:
        """Drafts for the DraftRows of the last verify step (some or all of its sequences, any
        order), or None when one is not that step's (the caller runs the MTP eagerly)."""
        if self._layout is None:
            return None
        Bp, layout = self._layout
        if any(r.seq.slot not in layout for r in rows):
            return None
        # sequences of the step without a row (they draft no more, or hit a NaN) keep pad
        # inputs: their MTP rows compute garbage that nobody reads
        ps, n = self.km.cache.page_size, self.n
        R = Bp * n
        ids = np.zeros(R, dtype=np.int64)
        sel = np.zeros(Bp, dtype=np.int64)
        C = max(self.N - 1, 1)
        chain = np.zeros((3, C, Bp), dtype=np.int64)  # pos, kv rows, lens
        chain[2] = 1
        for r in rows:
            b, s = layout[r.seq.slot]
            kept = r.seq.num_tokens  # rows up to the last emitted one
            if len(r.next_ids) != kept or not 1 <= kept <= s.num_tokens:
                return None
            for j, t in enumerate(r.next_ids):
                ids[j * Bp + b] = t
            sel[b] = (kept - 1) * Bp + b
            for k in range(self.N - 1):
                p = s.start_pos + kept + k
                if p // ps < len(s.page_ids):
                    chain[0, k, b] = p
                    chain[1, k, b] = s.page_ids[p // ps] * ps + p % ps
                    chain[2, k, b] = p + 1
        st, dev = self.st, self.km.device
        m = to_device(torch.from_numpy(np.concatenate([ids, sel, chain.reshape(-1)])), dev)
        st["m_ids"][:R].copy_(m[:R])
        st["m_sel"][:Bp].copy_(m[R:R + Bp])
        c = m[R + Bp:].view(3, C, Bp)
        st["c_pos"][:, :Bp].copy_(c[0])
        st["c_kv"][:, :Bp].copy_(c[1])
        st["c_lens"][:, :Bp].copy_(c[2])
        if Bp in self.mtp:
            g, drafts = self.mtp[Bp]
            g.replay()
        else:
            drafts = self.mtp_body(Bp)
        self._layout = None
        got = drafts.tolist()
        return [got[layout[r.seq.slot][0]][:r.num_drafts] for r in rows]

    # ---- capture ------------------------------------------------------------------------------
    @torch.no_grad()
    def capture(self) -> None:
        """Capture the verify graphs, then the MTP graphs and the chain graphs (both read the
        verify graphs' outputs), largest batch first, in the worker's graph pool."""
        st = self.st
        for name in ("ids", "pos", "kv", "table", "slots", "m_ids", "m_sel", "c_pos", "c_kv"):
            st[name].zero_()
        st["lens"].fill_(1)
        st["c_lens"].fill_(1)
        sizes = sorted(self.sizes, reverse=True)
        self.pool.capture(self.verify, sizes, self.verify_body)
        if not self.has_mtp:
            log.info("captured verify CUDA graphs (%d drafts, no MTP) for batch sizes %s",
                     self.N, sorted(self.verify))
            return
        self.pool.capture(self.mtp, sizes, self.mtp_body)
        # every sequence a pad (st["seq"] zero): the bodies the capture runs commit nothing.
        # Their warm-up also compiles the commit kernel for both state dtypes (else the first
        # verify step compiled it inside a request: 0.4 s)
        st["seq"].zero_()
        st["syn"].fill_(-1)
        self.pool.capture(self.chains, sizes, self.chain_body)
        log.info("captured speculative-decoding CUDA graphs (%d drafts) for batch sizes %s",
                 self.N, sorted(self.verify))
