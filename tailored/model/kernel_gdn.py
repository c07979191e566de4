"""The Gated DeltaNet mixer on the kernel path (spec §5): one call per step shape.

Same computation as `GatedDeltaNet` of the plain path, over the cache's state slots in place:
  * decode rows: the conv step and the delta-rule step with the gated norm in Triton
    (`kernels.gdn_decode`), one token a row;
  * prefill chunks (eager): the causal conv of every sequence in one launch
    (`kernels.gdn_conv`, kb/0029), then FLA's `chunk_gated_delta_rule` over all of them at once
    when fla-core is installed (CUDA, bf16/fp16; its chunk kernel uses TF32 dots, so fp32,
    the exactness mode, keeps the reference recurrence), else the reference per sequence;
  * verify chunks of speculative decoding: token j of every chunk through the decode kernels,
    each state after token j kept for the commit (`cache.kept_states`);
  * one sequence's chunk in a graph body (`chunk`): the prefill computation with device
    indices only, pad rows neutralised (g = 0, β = 0: decay 1, no write);
  * a verify graph's B sequences of n tokens (`verify_graph`): n tokens a launch
    (`kernels.gdn_verify`, kb/0033) or token by token, states after each token j < n-1 into
    snapshots.
"""

from __future__ import annotations

import logging

import torch

from tailored import flags
from tailored.kernels.gdn_conv import conv_prefill, conv_state_update
from tailored.kernels.gdn_decode import conv_step, recurrent_step
from tailored.kernels.gdn_verify import conv_verify, recurrent_verify
from tailored.model.step_plan import StepPlan
from tailored.ops import reference as ref

log = logging.getLogger("tailored.kernels")


def fla_chunk():
    """FLA's chunked gated delta rule, or None when fla-core is not installed or its import
    fails here."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # not installed, or its triton import fails here
        return None
    return chunk_gated_delta_rule


class GdnBlocks:
    """The GDN mixer of every linear-attention layer: projections p_in (qkv|z|b|a) and p_out
    as laid out by `KernelModel`, states in `cache`. fla: FLA's chunk function or None."""

    def __init__(self, layers: list, cfg, cache, p_in: dict, p_out: dict, fla):
        self.layers, self.cfg, self.cache = layers, cfg, cache
        self.p_in, self.p_out = p_in, p_out
        self.fla = fla
        self._fla_ctx = None  # (lens, cu_seqlens, cu_seqlens_cpu, chunk_indices) this forward

    def new_forward(self) -> None:
        """Forget the last forward's FLA sequence layout (it is rebuilt once per forward)."""
        self._fla_ctx = None

    def _states(self, i: int):
        li = self.cache.gdn_index[i]
        return li, self.cache.conv[li], self.cache.rec[li]

    def _decode_rows(self, i, qkv, a, b, z, slots):
        m = self.layers[i].linear_attn
        _, conv_cache, rec_cache = self._states(i)
        w = m.conv1d.weight[:, 0, :]
        return recurrent_step(conv_step(qkv, conv_cache, w, slots), a, b, z, rec_cache, slots,
                              m.A_log, m.dt_bias, m.norm.weight, self.cfg.linear_num_key_heads,
                              m.norm.eps)

    def decode(self, i: int, x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Every row of x [T, H] (normed) a decode row of the sequence in its slot."""
        qkv, z, b, a = self.p_in[i](x)
        return self.p_out[i](self._decode_rows(i, qkv, a, b, z, slots))

    def eager(self, i: int, x: torch.Tensor, pre, plan: StepPlan) -> torch.Tensor:
        """An eager step: the plan's decode rows, the prefill sequences `pre` (SeqInfos) and the
        plan's verify chunks."""
        qkv, z, b, a = self.p_in[i](x)
        core = torch.empty(x.shape[0], self.cfg.value_dim, dtype=x.dtype, device=x.device)
        if plan.dec_rows is not None:
            r = plan.dec_rows
            core[r] = self._decode_rows(i, qkv[r], a[r], b[r], z[r], plan.dec_slots)
        if pre:
            self._prefill(i, pre, qkv, a, b, z, core, plan)
        if plan.ver_seqs:
            self._verify(i, qkv, a, b, z, core, plan)
        return self.p_out[i](core)

    def _verify(self, i, qkv, a, b, z, core, plan: StepPlan):
        """The verify chunks of speculative decoding: token j of every chunk through the decode
        kernels, as decode steps would run it, then each chunk's state after token j kept
        (`cache.kept_states`) for `commit_states`."""
        m = self.layers[i].linear_attn
        li, conv_cache, rec_cache = self._states(i)
        HK = self.cfg.linear_num_key_heads
        w = m.conv1d.weight[:, 0, :]
        for sel in plan.ver_seqs[0]:
            self.cache.kept_states[(li, sel.slot)] = []
        for j, (rows, slots, sel) in enumerate(zip(plan.ver_rows, plan.ver_slots,
                                                   plan.ver_seqs)):
            last = [q.num_tokens == j + 1 for q in sel]
            # the state after a chunk's last token stays in its slot; before that, the kernels
            # also write each new state into a snapshot (as the verify graph does)
            cs = rs = None
            if not all(last):
                cs = conv_cache.new_empty((len(sel),) + tuple(conv_cache.shape[1:]))
                rs = rec_cache.new_empty((len(sel),) + tuple(rec_cache.shape[1:]))
            y = conv_step(qkv[rows], conv_cache, w, slots, snapshot=cs)
            core[rows] = recurrent_step(y, a[rows], b[rows], z[rows], rec_cache, slots,
                                        m.A_log, m.dt_bias, m.norm.weight, HK, m.norm.eps,
                                        snapshot=rs)
            for n, q in enumerate(sel):
                self.cache.kept_states[(li, q.slot)].append(
                    None if last[n] else (cs[n], rs[n]))

    def _prefill(self, i, seqs, qkv, a, b, z, core, plan: StepPlan):
        cfg, m = self.cfg, self.layers[i].linear_attn
        _, conv_cache, rec_cache = self._states(i)
        HK, HV = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        Dk, Dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        w = m.conv1d.weight[:, 0, :]
        g, beta = ref.gdn_gates(a, b, m.A_log, m.dt_bias)
        # the causal conv of every sequence in one launch, then their carried states: per
        # sequence cat + cuDNN conv + cat took 50 ms of an 8 x 1024-token step (kb/0029, 0030)
        y = conv_prefill(qkv, conv_cache, w, plan.pre_seq, plan.pre_slots,
                         plan.pre_rows.shape[0], max(s.num_tokens for s in seqs))
        conv_state_update(qkv, conv_cache, w, plan.pre_seq, plan.pre_slots)
        rows, slots, reset = plan.pre_rows, plan.pre_slots, plan.pre_reset
        h0 = torch.where(reset[:, None, None, None], 0.0, rec_cache[slots].float())
        q, k, v = torch.split(y, [cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
        n = y.shape[0]
        o = None
        if self.fla is not None:
            try:
                o, hT = self._fla_prefill(seqs, q, k, v, g[rows], beta[rows], h0)
            except Exception as e:  # keep serving: fall back to the reference recurrence
                log.error("fla chunk_gated_delta_rule failed (%s); using the reference path", e)
                self.fla = None
        if o is None:
            outs, states, off = [], [], 0
            for j, s in enumerate(seqs):
                r = slice(off, off + s.num_tokens)
                oj, sj = ref.gated_delta_rule_chunked(
                    q[r].view(-1, HK, Dk), k[r].view(-1, HK, Dk), v[r].view(-1, HV, Dv),
                    g[rows[r]], beta[rows[r]], h0[j])
                outs.append(oj)
                states.append(sj)
                off += s.num_tokens
            o, hT = torch.cat(outs), torch.stack(states)
        rec_cache[slots] = hT.to(rec_cache.dtype)
        out = ref.gated_rms_norm(o.reshape(n, HV, Dv).to(core.dtype), z[rows].view(n, HV, Dv),
                                 m.norm.weight, m.norm.eps)
        core[rows] = out.reshape(n, -1)

    def _fla_prefill(self, seqs, q, k, v, g, beta, h0):
        """All prefill sequences in one varlen FLA call. q,k [n, HK·Dk]; v [n, HV·Dv];
        g, beta [n, HV] fp32; h0 [N, HV, Dk, Dv] fp32. Returns (o [n, HV, Dv], final states)."""
        cfg = self.cfg
        HK, HV = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        Dk, Dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        n = q.shape[0]
        ctx = self._fla_ctx
        if ctx is None or ctx[0] != [s.num_tokens for s in seqs]:
            # once per forward, shared by the 30 GDN layers: FLA caches per cu_seqlens tensor,
            # and with the host copy and chunk indices given it never syncs to read them
            from fla.ops.utils.index import prepare_chunk_indices

            lens = [s.num_tokens for s in seqs]
            cu_cpu = torch.tensor([0] + lens).cumsum(0)
            cu = (cu_cpu.pin_memory().to(q.device, non_blocking=True) if q.is_cuda
                  else cu_cpu.to(q.device))  # pinned + async: no stream sync
            ctx = self._fla_ctx = (lens, cu, cu_cpu,
                                   prepare_chunk_indices(cu, 64, cu_seqlens_cpu=cu_cpu))
        _, cu, cu_cpu, chunk_indices = ctx
        o, hT = self.fla(q.reshape(1, n, HK, Dk), k.reshape(1, n, HK, Dk),
                         v.reshape(1, n, HV, Dv), g.unsqueeze(0),
                         beta.unsqueeze(0), initial_state=h0.contiguous(),
                         output_final_state=True, use_qk_l2norm_in_kernel=True,
                         cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, chunk_indices=chunk_indices)
        return o[0], hT

    def chunk(self, i: int, x: torch.Tensor, valid, slot, st: dict,
              carried: bool = False) -> torch.Tensor:
        """GDN over a graph bucket of one sequence's chunk: the eager prefill's computation with
        zero initial states (a fresh prompt), or with the slot's conv and recurrent states when
        `carried` (a chunk continuing a cached context: `st`'s conv meta says "no reset"), pads
        neutralized (g = 0, β = 0), states written with device indices (nothing in here
        depends on the prompt length on the host). st: the graph's static buffers
        (worker/graphs.py `prefill_static`)."""
        cfg, m = self.cfg, self.layers[i].linear_attn
        _, conv_cache, rec_cache = self._states(i)
        n = x.shape[0]
        HK, HV = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        Dk, Dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        qkv, z, b, a = self.p_in[i](x)
        w = m.conv1d.weight[:, 0, :]
        y = conv_prefill(qkv, conv_cache, w, st["conv_meta"], slot, n, n)
        conv_state_update(qkv, conv_cache, w, st["state_meta"], slot)
        g, beta = ref.gdn_gates(a, b, m.A_log, m.dt_bias)
        keep = valid[:, None]
        g, beta = torch.where(keep, g, 0.0), torch.where(keep, beta, 0.0)
        q, k, v = torch.split(y, [cfg.key_dim, cfg.key_dim, cfg.value_dim], dim=-1)
        if carried:  # the state after the cached context (the eager path's h0 on no reset)
            h0 = rec_cache.index_select(0, slot).float()
        else:
            h0 = torch.zeros(1, HV, Dk, Dv, dtype=torch.float32, device=x.device)
        if self.fla is not None:
            o, hT = self.fla(q.reshape(1, n, HK, Dk), k.reshape(1, n, HK, Dk),
                             v.reshape(1, n, HV, Dv), g.unsqueeze(0), beta.unsqueeze(0),
                             initial_state=h0, output_final_state=True,
                             use_qk_l2norm_in_kernel=True)
            o = o[0]
        else:
            o, hT = ref.gated_delta_rule_chunked(q.view(n, HK, Dk), k.view(n, HK, Dk),
                                                 v.view(n, HV, Dv), g, beta, h0[0])
        rec_cache.index_copy_(0, slot, hT.to(rec_cache.dtype).reshape(1, HV, Dk, Dv))
        out = ref.gated_rms_norm(o.reshape(n, HV, Dv).to(x.dtype), z.reshape(n, HV, Dv),
                                 m.norm.weight, m.norm.eps)
        return self.p_out[i](out.reshape(n, -1))

    def verify_graph(self, i: int, x: torch.Tensor, slots: torch.Tensor, n: int,
                     snap_conv: torch.Tensor, snap_rec: torch.Tensor) -> torch.Tensor:
        """A verify graph body's GDN: x [n·B, H] token-major (row j·B + b is token j of
        sequence b), B = len(slots). The n tokens in one launch each of the verify conv and
        recurrence (`gdn_verify_kernels`, conv width 4: the model's), or token j of the B at a
        time through the decode kernels; the state after each token j < n-1 also goes into the
        snapshots [n-1, B, ...] of this layer."""
        m = self.layers[i].linear_attn
        _, conv, rec = self._states(i)
        HK = self.cfg.linear_num_key_heads
        B = slots.shape[0]
        qkv, z, b, a = self.p_in[i](x)
        w = m.conv1d.weight[:, 0, :]
        if flags.current().gdn_verify_kernels and conv.shape[-1] == 3:
            y = conv_verify(qkv, conv, w, slots, snap_conv)
            core = recurrent_verify(y, a, b, z, rec, slots, m.A_log, m.dt_bias, m.norm.weight,
                                    HK, m.norm.eps, snap_rec)
            return self.p_out[i](core)
        core = torch.empty(x.shape[0], self.cfg.value_dim, dtype=x.dtype, device=x.device)
        for j in range(n):
            r = slice(j * B, (j + 1) * B)
            # the kernels write the states after token j into the snapshot as well: no copies
            last = j == n - 1
            y = conv_step(qkv[r], conv, w, slots, snapshot=None if last else snap_conv[j])
            core[r] = recurrent_step(y, a[r], b[r], z[r], rec, slots, m.A_log, m.dt_bias,
                                     m.norm.weight, HK, m.norm.eps,
                                     snapshot=None if last else snap_rec[j])
        return self.p_out[i](core)
