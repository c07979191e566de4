"""Speculative decoding with the MTP draft head (spec §8): drafting and greedy verification.

One engine step of a drafting request runs, for its scheduled tokens x_s..x_e (a prompt chunk,
a plain decode token, or a verify chunk [x_p, d_1..d_N]):
  1. the target over the chunk (a verify chunk keeps its GDN state after every token,
     `SeqInfo.keep_states`), logits of every row that predicts a token;
  2. `accept`: the target's greedy tokens y_0..y_N of a verify chunk against the drafts: the
     longest prefix with d_{j+1} == y_j (a drafts) is kept, plus y_a of the target's own; the
     step emits y_0..y_a. The KV of the rejected positions is left behind (the next step
     overwrites it) and the GDN state is set back to the one after x_p, d_1..d_a
     (`HybridCache.commit_states`, worker/cache.py);
  3. `MTPDrafter.propose`: the MTP layer over the same rows, row t fed the target's final
     hidden state h_t and the token at t+1 (the next prompt token, or the token the target
     emitted there), which fills the MTP layer's own KV cache for those positions; draft 1 is
     the argmax of the row of the last emitted position, drafts 2..N chain from the MTP's own
     output hidden state and the previous draft at the next positions (spec §8.2).

Greedy verification makes the output exactly the target's greedy output (up to the rounding
of a chunk's GEMMs against one-row GEMMs). Requests that sample (temperature > 0) or use
penalties never draft (`SamplingParams.can_draft`). Sources: spec §8.1–§8.4; vLLM `EagleProposer` / `Qwen3_5MoeMTP`
(row shift, chained drafts, shared embedding and lm_head); Leviathan et al. 2023 (greedy case).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from tailored.model.batch import SeqInfo
from tailored.model.kernel_mtp import mtp_eager
from tailored.model.mtp import mtp_hidden
from tailored.worker.cache import HybridCache
from tailored.worker.draft_head import DraftHead, draft_argmax


def accept(drafts: list[int], target: list[int], synthetic: float | None = None,
           rng: random.Random | None = None, bad: list[bool] | None = None) -> int:
    """Number of drafts kept (0..len(drafts)) of a verify chunk.

    drafts: d_1..d_N; target: the target's tokens y_0..y_N at the chunk's rows (y_j follows
    x_p, d_1..d_j). Greedy rule: the longest prefix with d_{j+1} == y_j; bad (per row, the
    sampler's NaN flags) ends it at a flagged row, as the device chain does
    (`spec_graphs.SpecGraphs.chain_body`). synthetic: accept each draft with this probability instead, up
    to the first rejection (benchmarks on random weights; rng draws). Raises ValueError if
    len(target) != len(drafts) + 1."""
    if len(target) != len(drafts) + 1:
        raise ValueError(f"accept: {len(target)} target tokens for {len(drafts)} drafts")
    a = 0
    for j, d in enumerate(drafts):
        ok = ((rng or random).random() < synthetic if synthetic is not None
              else d == target[j] and not (bad and bad[j]))
        if not ok:
            break
        a += 1
    return a


def emitted(drafts: list[int], target: list[int], kept: int, synthetic: bool) -> list[int]:
    """The tokens a verify chunk that kept `kept` drafts emits: y_0..y_kept (greedy: equal to
    d_1..d_kept, y_kept), or with synthetic acceptance the kept drafts then y_kept."""
    if synthetic:
        return list(drafts[:kept]) + [target[kept]]
    return list(target[:kept + 1])


@dataclass
class DraftRow:
    """One drafting sequence of a step, for `MTPDrafter.propose`.

    seq: the rows of the step's flat batch to run, up to the last emitted position (a verify
      chunk's rejected rows are left out), with their positions and pages;
    next_ids: the token at position t+1 of every row t (seq.num_tokens of them);
    num_drafts: drafts to propose from the last row (0 still fills the MTP cache)."""

    seq: SeqInfo
    next_ids: list[int]
    num_drafts: int


class MTPDrafter:
    """The MTP head over its KV cache: the target's HybridCache built with mtp_layers=1, whose
    extra attention layer is layer num_hidden_layers (pages are the target's: a request's page
    ids index both). km: the kernel path over that cache (its MTP layer runs there), or None
    for the plain path; spec: its speculative graphs (`propose` replays the MTP graph after a
    verify graph), or None; draft_head: the FP8 lm_head copy to draft with, or None."""

    def __init__(self, model, cache: HybridCache, km=None, spec=None,
                 draft_head: DraftHead | None = None):
        if model.mtp is None:
            raise ValueError("speculative decoding needs the checkpoint's MTP head (mtp.*); this "
                             "model has mtp_num_hidden_layers = 0 or was built without it")
        self.layer = model.config.num_hidden_layers
        if self.layer not in cache.attn_index:
            raise ValueError("MTPDrafter: the cache holds no MTP layer (HybridCache mtp_layers=1)")
        self.model = model
        self.cache = cache
        self.km = km if km is not None and km.mtp_layer is not None else None
        self.spec = spec
        self.draft_head = draft_head

    def _layer(self, h: torch.Tensor, ids: torch.Tensor, seqs: list[SeqInfo]) -> torch.Tensor:
        """MTP layer (spec §8.1) over rows with target/own hidden h [R, H] and next-token ids
        [R]; seqs lay the rows out (positions, pages). Returns the post-`mtp.norm` hidden [R, H]."""
        if self.km is not None:
            pos = torch.cat([torch.arange(s.start_pos, s.end_pos) for s in seqs]).to(h.device)
            return mtp_eager(self.km, h, ids, pos, seqs)
        return mtp_hidden(self.model, self.cache, h, ids, seqs)

    @torch.no_grad()
    def propose(self, hidden: torch.Tensor, rows: list[DraftRow]) -> list[list[int]]:
        """Drafts per row of `rows` (greedy, spec §8.2). hidden: the target's final-normed
        hidden states of the step [T, H]. Pages must cover position seq.end_pos + num_drafts
        - 2 of each row (the chain writes the MTP KV there). Raises ValueError for next_ids of
        the wrong length."""
        if not rows:
            return []
        if self.spec is not None:
            got = self.spec.propose(rows)  # after a verify graph: the MTP graph
            if got is not None:
                return got
        dev = hidden.device
        seqs, h_idx, ids, q = [], [], [], 0
        for r in rows:
            s = r.seq
            if len(r.next_ids) != s.num_tokens:
                raise ValueError(f"propose: {len(r.next_ids)} next ids for {s.num_tokens} rows")
            seqs.append(SeqInfo(q, s.num_tokens, s.start_pos, 0, False, s.page_ids))
            h_idx.extend(range(s.q_start, s.q_start + s.num_tokens))
            ids.extend(r.next_ids)
            q += s.num_tokens
        h_idx_t = torch.tensor(h_idx, device=dev)
        out = self._layer(hidden[h_idx_t], torch.tensor(ids, device=dev), seqs)
        pick = torch.tensor([sq.q_start + sq.num_tokens - 1 for sq in seqs], device=dev)
        h = out[pick]
        drafts: list[list[int]] = [[] for _ in rows]
        live = [i for i, r in enumerate(rows) if r.num_drafts > 0]  # rows still drafting
        step = 0
        while live:
            live_t = torch.tensor(live, device=dev)
            tok = draft_argmax(self.model, self.draft_head, h[live_t])
            for i, t in zip(live, tok.tolist()):
                drafts[i].append(t)
            step += 1
            keep = [j for j, i in enumerate(live) if rows[i].num_drafts > step]
            if not keep:
                break
            # chain: the MTP's own hidden and the previous draft, one position further
            live = [live[j] for j in keep]
            keep_t = torch.tensor(keep, device=dev)
            chain = [SeqInfo(j, 1, rows[i].seq.end_pos - 1 + step, 0, False,
                             rows[i].seq.page_ids) for j, i in enumerate(live)]
            h = h.index_copy(0, torch.tensor(live, device=dev),
                             self._layer(h[live_t[keep_t]], tok[keep_t], chain))
        return drafts
