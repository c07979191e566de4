"""Drafts that stay on the device between verify steps (kb/0035).

After a whole verify step the device chain (`SpecGraphs.chain`, kb/0034) accepts, commits the
GDN states and runs the MTP for the next drafts. The host needs only the kept counts to emit
this step's tokens, and it knows them without the chain: they are the synthetic counts it drew
before the step, or the greedy rule over the target's tokens it has just read. So the runner
hands the scheduler placeholder drafts (`PENDING_TOKEN`), the engine schedules and launches the
next verify step while the chain still runs, and that step takes its draft ids from the chain's
output device to device (`feed_drafts`). The host reads the draft values one step later, when they are
long done (`ChainDrafts.read`), to emit that step's tokens, and checks there that the device
kept what the host said.

Before: the host waited for the chain (~0.9 ms a step at c=1, `draft` in the step timing), then
spent ~0.5 ms scheduling and building while the GPU idled. Now that host time runs under the
chain.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tailored.engine.types import PENDING_TOKEN
from tailored.model.batch import index_on
from tailored.worker.sampler import HostCopy


@dataclass
class ChainDrafts:
    """The chain result of one verify step.

    dev: [B, N] int64 on the device, the next drafts of each sequence (batch order), a copy of
      the chain graph's output, which the next chain replay overwrites;
    host: the whole [B, 1 + N] result (kept, then drafts) behind an event;
    kept: the kept counts the host emitted with, per sequence (checked on `read`)."""

    dev: torch.Tensor
    host: HostCopy
    kept: list[int]
    _rows: list[list[int]] | None = field(default=None, repr=False)

    def read(self) -> list[list[int]]:
        """[B][N] draft ids on the host (waits for the chain on first use). Raises RuntimeError
        when the device kept another count than the host emitted with: the GDN states would
        then belong to other tokens than the request's (a bug, never silent)."""
        if self._rows is None:
            got = self.host.tolist()
            dev_kept = [g[0] for g in got]
            if dev_kept != self.kept:
                raise RuntimeError(f"device chain kept {dev_kept}, the host emitted with "
                                   f"{self.kept}")
            self._rows = [g[1:] for g in got]
        return self._rows


def pending_drafts(token_ids, num_draft: int) -> bool:
    """Whether a scheduled chunk's drafts are placeholders for a chain's device output."""
    return num_draft > 0 and token_ids[-1] == PENDING_TOKEN


class DraftSources:
    """Where each request's pending drafts are: its state slot → (request id, ChainDrafts,
    row). Keyed by slot, so the map never outgrows the slots: a finished request's entry is
    overwritten by the next request in its slot, and a lookup checks the request id."""

    def __init__(self) -> None:
        self._by_slot: dict[int, tuple[str, ChainDrafts, int]] = {}

    def put(self, slot: int, request_id: str, rec: ChainDrafts, row: int) -> None:
        self._by_slot[slot] = (request_id, rec, row)

    def get(self, slot: int, request_id: str) -> tuple[ChainDrafts, int]:
        """Raises RuntimeError when no chain drafted for this request in this slot."""
        got = self._by_slot.get(slot)
        if got is None or got[0] != request_id:
            raise RuntimeError(f"pending drafts of {request_id!r} without the step that "
                               "drafted them")
        return got[1], got[2]


def feed_drafts(input_ids: torch.Tensor, fed: list[tuple[int, ChainDrafts, int, int]]) -> None:
    """Write pending drafts into a step's input ids, device to device. fed: per chunk (row of
    its first draft in input_ids, source, source row, number of drafts). One gather and one
    scatter per source (one in the common case: every chunk drafted by the previous step)."""
    groups: dict[int, tuple[ChainDrafts, list[int], list[int]]] = {}
    for q, rec, b, nd in fed:
        _, dst, src = groups.setdefault(id(rec), (rec, [], []))
        N = rec.dev.shape[1]
        dst.extend(range(q, q + nd))
        src.extend(range(b * N, b * N + nd))
    dev = input_ids.device
    for rec, dst, src in groups.values():
        input_ids.index_copy_(0, index_on(dst, dev),
                              rec.dev.reshape(-1).index_select(0, index_on(src, dev)))
