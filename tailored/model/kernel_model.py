"""The kernel path: the model's computation arranged for the GPU, layer by layer.

Same computation as the plain path in `qwen36.py` (spec §3–§7), checked against it in
tests/worker/test_kernel_path.py (CPU, Triton's interpreter, fp32) and tests/gpu/test_gpu.py:
  * projections that read one input are one GEMM (`projections.py`), FP8 dense weights
    optionally held dequantized as well (`fp8_dense_dequant`, kb/0026);
  * residual add + RMSNorm fused (`kernels.norm`); the mixers and the MoE block per step
    shape in `kernel_gdn.py`, `kernel_attention.py`, `kernel_moe.py`.

`KernelModel` owns the weight layout and exposes the per-layer calls: `layers(x, cos, sin,
mixer)` runs the residual stream with a caller's mixer, so the worker's CUDA-graph bodies
(worker/graphs.py) and `forward_eager` share every layer's code. It is bound to one cache
(the worker's `HybridCache`) and never decides what is captured or replayed: the worker does.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from tailored import flags
from tailored.kernels.norm import add_rms_norm_1p
from tailored.kernels.nvfp4_gemv import nvfp4_linear
from tailored.model import fp8, nvfp4
from tailored.model.batch import ForwardBatch
from tailored.model.kernel_attention import AttentionBlocks
from tailored.model.kernel_gdn import GdnBlocks, fla_chunk
from tailored.model.kernel_moe import MoEBlocks
from tailored.model.kernel_moe_w4 import Scratch, W4Experts
from tailored.model.moe_stack import ExpertStack, stack_shared_expert
from tailored.model.projections import (
    Proj,
    ProjGroup,
    dense_dequant_bytes,
    held_dequantized,
    layer_projections,
)
from tailored.model.step_plan import build_plan
from tailored.ops import reference as ref

log = logging.getLogger("tailored.kernels")


def nvfp4_experts(ex: nn.Module) -> tuple:
    """NVFP4 routed experts as the W4A16 kernels take them: ((gate_up packed, scale,
    scale_2), (down packed, scale, scale_2)), the module's own tensors."""
    return ((ex.gate_up_proj.data, ex.gate_up_proj_scale.data, ex.gate_up_proj_scale_2.data),
            (ex.down_proj.data, ex.down_proj_scale.data, ex.down_proj_scale_2.data))


class KernelModel:
    """The kernel path of one model over one cache (worker/cache.py `HybridCache`).

    use_fla: FLA's chunked delta rule for eager prefill where it applies (CUDA, not fp32).
    Attributes: layers (decoder layers, then the MTP layer when the cache holds its KV),
    mtp_layer (its index or None), moe / gdn / attn (the blocks), p_fc (the MTP's fc)."""

    def __init__(self, model: nn.Module, cache, use_fla: bool = True):
        self.model = model
        self.cfg = model.config
        self.cache = cache
        self.device = cache.k.device
        self.dtype = model.model.embed_tokens.weight.dtype
        fla = (fla_chunk() if (use_fla and self.device.type == "cuda"
                               and self.dtype != torch.float32) else None)
        # per layer: the input projections (one GEMM per weight kind), the mixer's output
        # projection, the MoE's router|shared-expert gate|shared gate|shared up, shared down
        p_in: dict[int, ProjGroup] = {}
        p_out: dict[int, Proj] = {}
        p_moe: dict[int, ProjGroup] = {}
        p_route: dict[int, Proj] = {}  # router|shared-expert gate rows of p_moe's GEMM
        p_down: dict[int, Proj] = {}
        # routed experts + the shared one as expert E (kb/0019; FP8: with block scales)
        stacks: dict[int, ExpertStack] = {}
        experts: dict[int, tuple] = {}  # FP8 experts: block scales (gate_up, down)
        w4: dict[int, tuple] = {}  # NVFP4 experts: (gate_up, down) packed + scales
        dt = self.dtype

        def group(mods):  # linears sharing an input (`held_dequantized`: also held in dt)
            return ProjGroup(mods, dequant=dt if held_dequantized(mods) else None)

        def single(m):  # one linear's projection
            return Proj.dequantized([m], dt) if held_dequantized([m]) else Proj([m])

        # the decoder layers, then the MTP layer when the cache holds its KV (speculative
        # decoding): layer num_hidden_layers, run by `kernel_mtp.mtp_eager`
        self.layers = list(model.model.layers)
        self.mtp_layer = None
        self.p_fc = None
        if model.mtp is not None and len(self.layers) in cache.attn_index:
            self.mtp_layer = len(self.layers)
            self.layers += list(model.mtp.layers)[:1]
            self.p_fc = Proj([model.mtp.fc])
        for i, layer in enumerate(self.layers):
            ins, out, moe, down = layer_projections(layer)
            p_in[i] = group(ins)
            p_out[i] = single(out)
            p_moe[i] = group(moe)
            p_route[i] = p_moe[i].leading(2)
            p_down[i] = single(down)
            mlp = layer.mlp
            ex = mlp.experts
            scales = None
            if nvfp4.is_nvfp4_experts(ex):  # no stack: the shared expert stays dense
                w4[i] = nvfp4_experts(ex)
                continue
            if fp8.is_fp8_experts(ex):
                scales = (
                    fp8.expert_block_scales(ex.gate_up_proj_scale_inv, True),
                    fp8.expert_block_scales(ex.down_proj_scale_inv, False))
            stack = stack_shared_expert(mlp, scales)
            if stack is not None:
                stacks[i] = stack
                scales = stack.routed_scales() if scales is not None else None
            if scales is not None:
                experts[i] = scales
        if w4:  # one bf16 scratch for every layer's experts above the GEMV sizes
            (gu, _, _), (dn, _, _) = next(iter(w4.values()))
            scratch = Scratch((*gu.shape[:2], 2 * gu.shape[2]), (*dn.shape[:2], 2 * dn.shape[2]),
                              dt, self.device)
            w4 = {i: W4Experts(*e, self.cfg.num_experts_per_tok, scratch) for i, e in w4.items()}
        held = dense_dequant_bytes(model, dt)
        if held:
            log.info("quantized dense projections held dequantized in %s as well (%.2f GiB; "
                     "FP8: TAILORED_FP8_DENSE_DEQUANT, kb/0026; NVFP4 always, kb/0065)",
                     str(dt).removeprefix("torch."), held / 1024**3)
        if isinstance(model.lm_head, nvfp4.Nvfp4Linear):
            model.lm_head.fast = nvfp4_linear  # W4A16 GEMVs on CUDA (kernels/nvfp4_gemv.py)
        self.p_in, self.p_out = p_in, p_out
        self.moe = MoEBlocks(self.layers, self.cfg, p_moe, p_route, p_down, stacks, experts,
                             w4)
        self.gdn = GdnBlocks(self.layers, self.cfg, cache, p_in, p_out, fla)
        self.attn = AttentionBlocks(self.layers, self.cfg, cache, p_in, p_out)

    def embed(self, ids: torch.Tensor, pos: torch.Tensor):
        """(x, cos, sin): the embedded ids [T, H] and RoPE tables of their positions."""
        x = self.model.model.embed_tokens(ids)
        cos, sin = ref.rope_cos_sin(pos, self.cfg.rotary_dim, self.cfg.rope_theta, x.dtype)
        return x, cos, sin

    def is_gdn(self, i: int) -> bool:
        return self.layers[i].layer_type == "linear_attention"

    def layers_forward(self, x, mixer) -> torch.Tensor:
        """Residual stream through all decoder layers; mixer(i, normed) → the mixer output of
        layer i. Returns the final-normed hidden states [T, H]."""
        layers = self.model.model.layers
        first = layers[0].input_layernorm
        res, hn = add_rms_norm_1p(x, None, first.weight, first.eps)
        for i, layer in enumerate(layers):
            h = mixer(i, hn)
            res, hn = add_rms_norm_1p(res, h, layer.post_attention_layernorm.weight,
                                      layer.post_attention_layernorm.eps)
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.model.norm
            if flags.current().combine_next_norm:
                # the MoE's combine also adds the residual and applies the next norm (the next
                # layer's input norm, or the final norm): one launch fewer per layer (kb/0023)
                res, hn = self.moe(i, hn, (res, nxt.weight, nxt.eps))
            else:
                res, hn = add_rms_norm_1p(res, self.moe(i, hn), nxt.weight, nxt.eps)
        return hn

    def forward_eager(self, batch: ForwardBatch) -> torch.Tensor:
        """Final-normed hidden states [T, H] of any batch, every kernel launched eagerly: decode
        rows, prefill chunks and verify chunks together (the plain path's contract)."""
        self.gdn.new_forward()
        x, cos, sin = self.embed(batch.input_ids, batch.positions)
        # a 1-token verify chunk (a lone decode row of a verify step) is a verify chunk: its
        # state must be kept for commit_states
        dec = [s for s in batch.seqs
               if s.num_tokens == 1 and not s.reset_state and not s.keep_states]
        ver = [s for s in batch.seqs if s.keep_states]
        # sequences that start with a 1-token prompt take the prefill path (it resets the slot)
        pre = [s for s in batch.seqs
               if not (s.num_tokens == 1 and not s.reset_state) and not s.keep_states]
        plan = build_plan(batch.seqs, pre, dec, self.cache.page_size, x.device, ver)

        def mixer(i, hn):
            if self.is_gdn(i):
                return self.gdn.eager(i, hn, pre, plan)
            return self.attn.eager(i, hn, cos, sin, batch, plan)

        return self.layers_forward(x, mixer)
