"""The hybrid cache: what a forward pass reads and writes besides weights (spec §5.8, §6.6).

  * KV pages for the full-attention layers: k/v [n_attn_layers, num_pages, page_size, Hkv, D];
    page 0 is the pad sink (never owned by a request);
  * GDN state slots: conv [n_gdn_layers, num_slots, C, W-1] (model dtype) and recurrent
    [n_gdn_layers, num_slots, HV, Dk, Dv] (fp32 or bf16); slot 0 is the pad sink.

Allocated once by the runner (sizes from worker/memory_plan.py); the engine's pools hand out
page and slot indices (engine/memory.py).
"""

from __future__ import annotations

import torch

from tailored.config import ModelConfig
from tailored.model.batch import SeqInfo, index_on, kv_rows, to_device


def _copy_along_1(tensors, moves) -> None:
    """t[:, dst] = t[:, src] for each tensor and every (src, dst) index pair of `moves` along
    dim 1 (the slot or page of every layer at once), on the tensors' device, no host sync."""
    if not moves:
        return
    src, dst = (index_on(list(x), tensors[0].device) for x in zip(*moves))
    for t in tensors:
        t.index_copy_(1, dst, t.index_select(1, src))


class HybridCache:
    """KV pages + GDN state slots for all layers (allocated once; pools hand out indices)."""

    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, num_slots: int,
                 dtype: torch.dtype, device, mtp_layers: int = 0,
                 state_dtype: torch.dtype = torch.float32):
        """mtp_layers: KV for that many MTP layers too (speculative decoding, worker/drafter.py),
        after the decoder's attention layers; MTP layer j is layer num_hidden_layers + j.
        state_dtype: the GDN recurrent states' storage (EngineConfig.gdn_state_dtype), fp32 or
        bf16; every path loads them to fp32 and rounds what it stores."""
        self.page_size = page_size
        self.num_pages = num_pages
        self.num_slots = num_slots
        n_attn, n_gdn = len(cfg.attn_layers), len(cfg.gdn_layers)
        kv_shape = (n_attn + mtp_layers, num_pages, page_size, cfg.num_key_value_heads,
                    cfg.head_dim)
        self.k = torch.zeros(kv_shape, dtype=dtype, device=device)
        self.v = torch.zeros(kv_shape, dtype=dtype, device=device)
        W = cfg.linear_conv_kernel_dim
        self.conv = torch.zeros((n_gdn, num_slots, cfg.conv_dim, W - 1), dtype=dtype, device=device)
        self.rec = torch.zeros(
            (n_gdn, num_slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
             cfg.linear_value_head_dim),
            dtype=state_dtype, device=device,
        )
        # layer index -> index inside its cache kind
        self.attn_index = {layer: i for i, layer in enumerate(cfg.attn_layers)}
        for j in range(mtp_layers):
            self.attn_index[cfg.num_hidden_layers + j] = n_attn + j
        self.gdn_index = {layer: i for i, layer in enumerate(cfg.gdn_layers)}
        # (GDN cache index, slot) -> [(conv, recurrent) state after each token] of the last
        # forward's keep_states chunks (plain path); `commit_states` picks one
        self.kept_states: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        # the same from a verify CUDA graph (worker/spec_graphs.py): (conv snapshots [G, N,
        # max_batch, ...], recurrent snapshots, {slot: b}, n = N + 1): [:, j, b] is the state
        # after token j of sequence b of the padded batch
        self.kept_batch: tuple | None = None

    def commit_states(self, slot: int, num_tokens: int) -> None:
        """Make slot's GDN state the one after the first `num_tokens` tokens of its last
        keep_states chunk (a speculative verify step that accepted num_tokens - 1 drafts; the
        state after the whole chunk is in place already, except after a verify graph's pad
        tokens). Raises KeyError if the last forward kept no states for the slot, ValueError
        for num_tokens outside 1..chunk length."""
        self.commit_many({slot: num_tokens})

    def commit_moves(self, snap_conv: torch.Tensor, snap_rec: torch.Tensor,
                     moves: torch.Tensor) -> None:
        """conv/rec[:, slot] = snapshot[:, j, b] for every (j, b, slot) column of moves [3, M]
        int64 on the cache's device with j ≥ 0 (a column with j < 0 moves nothing). Snapshots
        [G, N, MB, ...] of the verify graphs (worker/spec_graphs.py). On CUDA one launch a state,
        no temporary (kernels/state_commit.py); on the CPU (tests) the reference indexing."""
        if self.conv.is_cuda:
            from tailored.kernels.state_commit import commit_snapshots

            commit_snapshots(snap_conv, self.conv, moves)
            commit_snapshots(snap_rec, self.rec, moves)
            return
        mv = moves[:, moves[0] >= 0]
        self.conv[:, mv[2]] = snap_conv[:, mv[0], mv[1]]
        self.rec[:, mv[2]] = snap_rec[:, mv[0], mv[1]]

    def commit_many(self, commits: dict[int, int]) -> None:
        """`commit_states` for every {slot: num_tokens} of the last verify step at once: the
        verify graph's snapshots (`kept_batch`) in one copy launch per state on CUDA (a step of 32 sequences
        made 64 copy launches one by one; torch's advanced indexing would build a 1.9 GiB
        temporary); slots the graph did not run (the eager paths' `kept_states`) one by one.
        Same errors as commit_states."""
        kb = self.kept_batch
        rest = dict(commits)
        if kb is not None:
            snap_c, snap_r, where, n = kb
            picked = [(s, k) for s, k in commits.items()
                      if s in where and (0, s) not in self.kept_states]
            for s, k in picked:
                if not 1 <= k <= n:
                    raise ValueError(f"commit_states: {k} tokens of a {n}-token chunk")
            moves = [(s, k - 1, where[s]) for s, k in picked if k < n]  # pads: from a snapshot
            for s, _ in picked:
                del where[s], rest[s]
            if not where:
                self.kept_batch = None
            if moves:
                # (j, b, slot) of each move
                idx = to_device(torch.tensor([(j, b, sl) for sl, j, b in moves],
                                             dtype=torch.long).T.contiguous(), self.conv.device)
                self.commit_moves(snap_c, snap_r, idx)
        for s, k in rest.items():  # the eager paths' states, one slot at a time
            for li in range(self.conv.shape[0]):
                kept = self.kept_states.pop((li, s))
                if not 1 <= k <= len(kept):
                    raise ValueError(f"commit_states: {k} tokens of a {len(kept)}-token chunk")
                if k < len(kept):
                    cs, rs = kept[k - 1]
                    self.conv[li, s] = cs
                    self.rec[li, s] = rs

    def copy_states(self, moves) -> None:
        """conv/rec[:, dst] = conv/rec[:, src] for every (src, dst) slot pair of `moves`
        (distinct dst, none a src): the prefix cache's snapshots (engine/prefix_cache.py), on
        the device in stream order, no host sync."""
        _copy_along_1((self.conv, self.rec), moves)

    def copy_pages(self, moves) -> None:
        """k/v[:, dst] = k/v[:, src] for every (src, dst) page pair of `moves` (distinct dst,
        none a src), every attention layer's (the MTP's too): a reused prefix's partial last
        page, which the request then writes its own positions into."""
        _copy_along_1((self.k, self.v), moves)

    @staticmethod
    def bytes_per_page(cfg: ModelConfig, page_size: int, dtype: torch.dtype,
                       mtp_layers: int = 0) -> int:
        el = torch.tensor([], dtype=dtype).element_size()
        n = len(cfg.attn_layers) + mtp_layers
        return 2 * n * page_size * cfg.num_key_value_heads * cfg.head_dim * el

    @staticmethod
    def bytes_per_slot(cfg: ModelConfig, dtype: torch.dtype,
                       state_dtype: torch.dtype = torch.float32) -> int:
        el = torch.tensor([], dtype=dtype).element_size()
        n = len(cfg.gdn_layers)
        conv = n * cfg.conv_dim * (cfg.linear_conv_kernel_dim - 1) * el
        rec = (n * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim
               * torch.tensor([], dtype=state_dtype).element_size())
        return conv + rec

    def token_index(self, seq: SeqInfo, start: int, end: int) -> torch.Tensor:
        """Flat KV row indices (page*page_size + offset) of positions [start, end) of `seq`."""
        return torch.from_numpy(kv_rows(seq.page_ids, start, end, self.page_size)).to(
            self.k.device)
