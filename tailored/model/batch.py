"""The layout of one forward pass: B sequences' new tokens back to back (T tokens in all).

`ForwardBatch` and `SeqInfo` describe which rows belong to which sequence, at which
positions, in which GDN state slot and KV pages of the cache (worker/cache.py); the helpers
below move host indices to the device without a stream sync and cut a batch into parts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class SeqInfo:
    """One sequence of the batch: rows [q_start, q_start+num_tokens) of the flat token arrays."""

    q_start: int
    num_tokens: int
    start_pos: int  # tokens already cached before this step
    slot: int  # GDN state slot
    reset_state: bool  # zero the slot before use (first chunk)
    page_ids: list[int]  # KV pages covering positions [0, start_pos + num_tokens)
    # a speculative verify chunk (worker/drafter.py): the GDN layers keep their state after every
    # token, so that the state after the last accepted one can be committed (spec §8.4)
    keep_states: bool = False

    @property
    def end_pos(self) -> int:
        return self.start_pos + self.num_tokens


@dataclass
class ForwardBatch:
    """input_ids/positions: [T] int64 on the model device; seqs: per-sequence layout;
    logits_rows: rows of the flat batch whose logits are needed (one per sampling sequence)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    seqs: list[SeqInfo]
    logits_rows: list[int]

    @classmethod
    def build(cls, seqs_tokens: list[tuple[list[int], int, int, bool, list[int]]], logits_rows,
              device) -> "ForwardBatch":
        """seqs_tokens: per sequence (token_ids, start_pos, slot, reset_state, page_ids) and
        optionally a sixth item, keep_states (a speculative verify chunk)."""
        ids, pos, seqs = [], [], []
        for toks, start, slot, reset, pages, *keep in seqs_tokens:
            seqs.append(SeqInfo(len(ids), len(toks), start, slot, reset, list(pages),
                                bool(keep and keep[0])))
            ids.extend(toks)
            pos.extend(range(start, start + len(toks)))
        return cls(
            input_ids=to_device(torch.tensor(ids, dtype=torch.long), device),
            positions=to_device(torch.tensor(pos, dtype=torch.long), device),
            seqs=seqs,
            logits_rows=list(logits_rows),
        )


def pinned(t: torch.Tensor, device) -> torch.Tensor:
    """Host tensor t in page-locked memory when it is bound for a CUDA device, else t: the
    source of a non-blocking copy (a pageable copy may wait for the step still running, which
    async scheduling launched this one behind, kb/0025)."""
    return t.pin_memory() if torch.device(device).type == "cuda" else t


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """Host tensor t on `device` without a stream sync (pinned, non-blocking on CUDA)."""
    return pinned(t, device).to(device, non_blocking=True)


def index_on(rows, device) -> torch.Tensor:
    """int64 row indices on `device`, without a blocking copy."""
    return to_device(torch.tensor(list(rows), dtype=torch.long), device)


def h2d(a: np.ndarray, device) -> torch.Tensor:
    """int64 numpy → device tensor without a stream sync (pinned, non-blocking on CUDA)."""
    return to_device(torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)), device)


def kv_rows(page_ids, start: int, end: int, page_size: int) -> np.ndarray:
    """Flat KV row indices (page·page_size + offset) of positions [start, end) of a sequence
    owning `page_ids`, int64 on the host (a step's index tensors send many in one copy)."""
    pos = np.arange(start, end, dtype=np.int64)
    return np.asarray(page_ids, dtype=np.int64)[pos // page_size] * page_size + pos % page_size


def token_rows(seqs) -> np.ndarray:
    """Batch rows of these sequences' tokens, in order (int64, host)."""
    if not seqs:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(q.q_start, q.q_start + q.num_tokens) for q in seqs])


def sub_batch(batch: ForwardBatch, picked: list[int]) -> ForwardBatch:
    """The sequences `picked` of `batch` as a batch of their own (rows renumbered from 0)."""
    dev = batch.input_ids.device
    rows = h2d(token_rows([batch.seqs[j] for j in picked]), dev)
    seqs, q = [], 0
    for j in picked:
        s = batch.seqs[j]
        seqs.append(SeqInfo(q, s.num_tokens, s.start_pos, s.slot, s.reset_state, s.page_ids,
                            s.keep_states))
        q += s.num_tokens
    return ForwardBatch(batch.input_ids[rows], batch.positions[rows], seqs, [])
