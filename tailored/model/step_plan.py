"""The device index tensors of one eager kernel-path forward, built on the host, sent at once.

Every layer used to build its own (`torch.tensor(...)` of slots, reset flags, KV rows): a
pageable host-to-device copy that synchronizes the stream, ~70 times per prefill forward, so
the host could never run ahead of the GPU (kb/0007: a 1024-token prefill took 131 ms of wall
time for 58 ms of GPU time; kb/0010).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tailored.model.batch import h2d, kv_rows, token_rows


@dataclass
class StepPlan:
    """Device index tensors of one eager forward. Views of one int64 buffer:
      pre_rows [n]: batch rows of the prefill sequences' tokens (in `pre` order);
      pre_slots [N], pre_reset [N] (bool): their state slots and reset flags;
      pre_seq [4, N]: per prefill sequence its first batch row, token count, first row in
        `pre` order and reset flag (`kernels.gdn_conv`; pre_reset is its last row);
      kv_new[j], kv_ctx[j]: flat KV rows (page·page_size + offset) of seqs[j]'s new tokens and of
        its whole context 0..end_pos (None when the chunk is the whole context);
      dec_rows, dec_slots: the decode rows (None when there are none);
      dec_kv, dec_table, dec_lens, dec_index: their new tokens' flat KV rows, page tables
        [n, max pages] and key counts (int32: `paged_decode_attention`'s), and which of
        `seqs` they are (a host set), so the eager attention runs them in one launch;
      ver_rows[j], ver_slots[j]: the rows and slots of token j of the verify chunks longer
        than j (speculative decoding, `SeqInfo.keep_states`), and ver_seqs[j] those chunks.
    """

    pre_rows: torch.Tensor
    pre_slots: torch.Tensor
    pre_reset: torch.Tensor
    pre_seq: torch.Tensor
    kv_new: list
    kv_ctx: list
    dec_rows: torch.Tensor | None
    dec_slots: torch.Tensor | None
    ver_rows: list = None
    ver_slots: list = None
    ver_seqs: list = None
    dec_kv: torch.Tensor | None = None
    dec_table: torch.Tensor | None = None
    dec_lens: torch.Tensor | None = None
    dec_index: frozenset = frozenset()


def build_plan(seqs, pre, dec, page_size: int, device, ver=()) -> StepPlan:
    """StepPlan for an eager forward over `seqs` (all), `pre` (prefill-path seqs), `dec`
    (decode rows) and `ver` (verify chunks); one host-to-device copy."""
    parts: list[np.ndarray] = []
    size = [0]  # elements in parts so far

    def add(a) -> tuple[int, int]:
        a = np.asarray(a, dtype=np.int64).reshape(-1)
        parts.append(a)
        start = size[0]
        size[0] += len(a)
        if len(a) % 2:
            # every view starts 16-byte aligned: Triton compiles a kernel variant per pointer
            # alignment, and an odd offset made the conv kernels compile again inside a c=32
            # benchmark, after the warm-up
            parts.append(np.zeros(1, dtype=np.int64))
            size[0] += 1
        return start, start + len(a)

    r_rows = add(token_rows(pre))
    r_slots = add([q.slot for q in pre])
    lens = [q.num_tokens for q in pre]
    r_seq = add([[q.q_start for q in pre], lens, np.cumsum([0] + lens)[:-1],
                 [int(q.reset_state) for q in pre]])
    rows = kv_rows
    r_new = [add(rows(q.page_ids, q.start_pos, q.end_pos, page_size)) for q in seqs]
    r_ctx = [add(rows(q.page_ids, 0, q.end_pos, page_size)) if q.start_pos else None for q in seqs]
    r_dec = add([q.q_start for q in dec])
    r_dslot = add([q.slot for q in dec])
    r_dkv = add([q.page_ids[q.start_pos // page_size] * page_size + q.start_pos % page_size
                 for q in dec])
    width = max((len(q.page_ids) for q in dec), default=0)
    table = np.zeros((len(dec), width), dtype=np.int64)
    for n, q in enumerate(dec):
        table[n, :len(q.page_ids)] = q.page_ids
    r_dtable = add(table)
    r_dlens = add([q.end_pos for q in dec])
    mine = {id(q) for q in dec}
    ver_seqs = [[q for q in ver if q.num_tokens > j]
                for j in range(max((q.num_tokens for q in ver), default=0))]
    r_ver = [(add([q.q_start + j for q in sel]), add([q.slot for q in sel]))
             for j, sel in enumerate(ver_seqs)]
    buf = h2d(np.concatenate(parts), device)

    def view(r):
        return buf[r[0]:r[1]]

    pre_seq = view(r_seq).view(4, len(pre))
    return StepPlan(view(r_rows), view(r_slots), pre_seq[3].bool(), pre_seq,
                    [view(r) for r in r_new], [view(r) if r else None for r in r_ctx],
                    view(r_dec) if dec else None,
                    view(r_dslot).to(torch.int32) if dec else None,
                    [view(r) for r, _ in r_ver], [view(r).to(torch.int32) for _, r in r_ver],
                    ver_seqs,
                    view(r_dkv) if dec else None,
                    view(r_dtable).view(len(dec), width).to(torch.int32) if dec else None,
                    view(r_dlens).to(torch.int32) if dec else None,
                    frozenset(j for j, q in enumerate(seqs) if id(q) in mine))
