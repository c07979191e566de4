"""The reference: transformers' `Qwen3_5MoeForCausalLM` holding the engine's weights.

Two ways to give it weights (`load_reference`):
  * shared      — the HF module is built on the meta device and `load_state_dict(assign=True)`
                  adopts the engine model's parameter tensors: no second copy (needed for the
                  full model on one H200: 67 GB of bf16 weights fit once, not twice). It checks
                  the compute path only; weight loading is checked by tests/model/test_loader.py and
                  by the goldens.
  * checkpoint  — a second, independent load of the checkpoint files (our loader into a fresh
                  model, then adopted the same way): a weight changed in the engine's model after
                  loading (a quantization pass, a bug, tests/tools/test_gate.py's nudge) shows up.
  * FP8 and NVFP4 engines: both modes hand the reference the quantized weights dequantized to
    the model dtype (`fp8.dequantized_state_dict`, `nvfp4.dequantized_state_dict`; new tensors:
    ≈ 67 GB at full size) — "the quantized weights dequantized into the reference" of issues 4
    and 48. The other reference, the bf16 checkpoint they were quantized from, is
    `bf16_reference`.

Parameter names: ours equal HF's (`model.*`, `lm_head.weight`; fused experts
`mlp.experts.gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I]); `mtp.*` is not part of HF's
causal LM. The rotary `inv_freq` buffers are not in the state dict, so the rotary module is
rebuilt on the target device after adoption.

Reference outputs are final-normed hidden states [L, H] (row p predicts token p+1); logits are
computed from them on demand with `lm_head`, so no [L, vocab] tensor is ever held.
  * `reference_forward`: one teacher-forced pass over given ids (what the gate uses: the engine's
    greedy continuation is checked position by position, metrics.py).
  * `reference_greedy`: prefill + sequential greedy decode with HF's cache (the goldens: the
    reference's own continuation, independent of the engine).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def torch_only_transformers() -> list[str]:
    """Make transformers' Qwen3.5-MoE GDN run its plain PyTorch functions even when fla-core or
    causal-conv1d are installed (transformers picks those up at import: the GPU machine carries
    fla-core for our own prefill, and a reference that runs the same FLA kernel as the engine
    would not be independent, nor fp32-exact — FLA uses TF32 dots). Idempotent; returns the
    names it unwrapped."""
    import inspect

    import transformers.models.qwen3_5_moe.modeling_qwen3_5_moe as mod

    done = []
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",
                 "causal_conv1d_fn", "causal_conv1d_update"):
        fn = getattr(mod, name, None)
        if fn is not None and hasattr(fn, "__wrapped__"):
            setattr(mod, name, inspect.unwrap(fn))
            done.append(name)
    return done


def reference_from_files(ckpt_dir, attn_impl: str = "eager", dtype=torch.float32):
    """transformers' `Qwen3_5MoeForCausalLM` (CPU, `dtype`, torch GDN) built from a checkpoint
    directory's `config.json` text_config and its safetensors files, read without our loader
    (names `model.language_model.*` → `model.*`, `mtp.*` skipped). Raises RuntimeError when a
    tensor is missing or left over. Used by the CPU reference tests and the nano evaluation."""
    import json
    from pathlib import Path

    import transformers
    from safetensors.torch import load_file

    torch_only_transformers()
    raw = json.loads((Path(ckpt_dir) / "config.json").read_text())["text_config"]
    hcfg = transformers.Qwen3_5MoeTextConfig(**raw)
    hcfg._attn_implementation = attn_impl
    hf = transformers.Qwen3_5MoeForCausalLM(hcfg).to(dtype).eval()
    sd = {}
    for f in sorted(Path(ckpt_dir).glob("*.safetensors")):
        for k, v in load_file(f).items():
            if not k.startswith("mtp."):
                sd[k.replace("model.language_model.", "model.")] = v.to(dtype)
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"transformers load: missing {missing[:3]} unexpected {unexpected[:3]}")
    return hf


def hf_text_config(cfg, attn_impl: str = "sdpa"):
    """transformers Qwen3_5MoeTextConfig for our ModelConfig (its raw config.json, with the
    layer count of `cfg`, which may be cut by --num-layers)."""
    import transformers

    raw = cfg.raw.get("text_config", cfg.raw) if cfg.raw else {}
    raw = dict(raw, num_hidden_layers=cfg.num_hidden_layers, layer_types=list(cfg.layer_types))
    hcfg = transformers.Qwen3_5MoeTextConfig(**raw)
    hcfg._attn_implementation = attn_impl
    return hcfg


def shared_state_dict(model, consume: bool = False) -> dict[str, torch.Tensor]:
    """Our model's tensors under HF names (the same storage; MTP dropped). Block-FP8 and
    NVFP4 weights are dequantized to the model dtype (new tensors) and their scales dropped;
    consume: each FP8 weight is emptied in `model` once dequantized
    (`fp8.dequantized_state_dict`)."""
    dtype = model.model.embed_tokens.weight.dtype  # lm_head may be NVFP4 (uint8)
    if model.config.nvfp4 is not None:
        from tailored.model.nvfp4 import dequantized_state_dict

        sd = dequantized_state_dict(model, dtype)
    elif model.config.fp8 is not None:
        from tailored.model.fp8 import dequantized_state_dict

        sd = dequantized_state_dict(model, dtype, consume)
    else:
        sd = model.state_dict()
    return {k: v for k, v in sd.items() if not k.startswith("mtp.")}


def reference_from_state_dict(cfg, state_dict: dict[str, torch.Tensor], device,
                              attn_impl: str = "sdpa"):
    """Build the HF model on meta and adopt `state_dict`'s tensors (no copy). Every parameter
    must be provided (strict); device/dtype are those of the tensors."""
    import transformers

    torch_only_transformers()
    hcfg = hf_text_config(cfg, attn_impl)
    with torch.device("meta"):
        hf = transformers.Qwen3_5MoeForCausalLM(hcfg)
    missing, unexpected = hf.load_state_dict(state_dict, strict=False, assign=True)
    if missing or unexpected:
        raise RuntimeError(f"reference weights do not match: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    rot = hf.model.rotary_emb
    with torch.device(device):
        hf.model.rotary_emb = type(rot)(hcfg)
    meta = [n for n, t in list(hf.named_parameters()) + list(hf.named_buffers()) if t.is_meta]
    if meta:
        raise RuntimeError(f"reference tensors left on meta: {meta[:5]}")
    return hf.eval().requires_grad_(False)  # new Parameter objects; ours keep their flags


def load_reference(cfg, model, mode: str, checkpoint_dir=None, attn_impl: str = "sdpa",
                   consume: bool = False):
    """The reference for the engine `model` (our Qwen36ForCausalLM).

    mode 'shared': adopt `model`'s tensors (consume: an FP8 model's weights are emptied as they
    are dequantized; only its lm_head still runs). mode 'checkpoint': load `checkpoint_dir`
    again (same dtype/device as `model`) and adopt that copy.
    """
    if mode == "shared":
        sd = shared_state_dict(model, consume)
    elif mode == "checkpoint":
        from tailored.model.loader import load_checkpoint

        if cfg.quantized and model.lm_head.weight.is_cuda:
            # engine FP8 + a second FP8 load + its dequantized bf16 copy: ~137 GB at full size
            raise ValueError("--reference-weights checkpoint with a quantized checkpoint on "
                             "CUDA needs three copies of the weights; use shared (the default)")
        from tailored.synth import build_empty_model

        p = model.model.embed_tokens.weight
        fresh = build_empty_model(cfg, p.device, p.dtype, with_mtp=False)
        load_checkpoint(fresh, checkpoint_dir, progress=False,  # skips mtp.*
                        max_layers=cfg.load_max_layers)
        sd = shared_state_dict(fresh)
    else:
        raise ValueError(f"unknown reference weights mode {mode!r}; use shared or checkpoint")
    return reference_from_state_dict(cfg, sd, model.model.embed_tokens.weight.device, attn_impl)


def bf16_reference(cfg, device, dtype, source, attn_impl: str = "sdpa", seed: int = 0,
                   dummy_init: str = "default"):
    """The reference with the bf16 weights an FP8 model was quantized from: `source` is a bf16
    checkpoint directory of the same model, or 'dummy' (the dummy weights of `seed`, which the
    FP8 dummy model is the quantization of). `cfg` may be the FP8 config (its quantization is
    dropped here). The caller has checked `source` (gate.run.check_bf16_source: a bf16
    checkpoint of this model). Raises LoadError when the checkpoint does not fit."""
    from dataclasses import replace

    from tailored.model.loader import load_checkpoint
    from tailored.synth import build_empty_model, init_dummy_weights

    cfg_b = replace(cfg, fp8=None, nvfp4=None)
    m = build_empty_model(cfg_b, device, dtype, with_mtp=False)
    if source == "dummy":
        init_dummy_weights(m, seed, init=dummy_init)
    else:
        load_checkpoint(m, source, progress=False, max_layers=cfg.load_max_layers)
    return reference_from_state_dict(cfg_b, shared_state_dict(m), device, attn_impl)


@torch.inference_mode()
def reference_forward(hf, ids: list[int]) -> torch.Tensor:
    """Hidden states [len(ids), H] (model dtype) of one causal pass, no cache."""
    dev = hf.lm_head.weight.device
    return hf.model(torch.tensor([ids], device=dev), use_cache=False).last_hidden_state[0]


@dataclass
class RefOutput:
    """tokens: greedy continuation (N ids). hidden: [T+N-1, H] final-normed states, model dtype.
    step_top: (values [N, K] fp32 logits, ids [N, K]) of the reference's top-K at each generated
    step, for classifying a divergence as a tie."""

    tokens: list[int]
    hidden: torch.Tensor
    step_top: tuple[torch.Tensor, torch.Tensor]


@torch.inference_mode()
def reference_greedy(hf, prompt_ids: list[int], max_new_tokens: int, top_k: int = 20) -> RefOutput:
    """Prefill `prompt_ids` (one pass, HF cache) and decode `max_new_tokens` greedily (EOS not
    special: the gate compares the model function, not stopping)."""
    dev = hf.lm_head.weight.device
    out = hf.model(torch.tensor([prompt_ids], device=dev), use_cache=True)
    cache, hidden = out.past_key_values, [out.last_hidden_state[0]]
    tokens, vals, ids = [], [], []
    last = hidden[0][-1:]
    for i in range(max_new_tokens):
        logits = hf.lm_head(last).float()[0]  # [V]
        tok = int(logits.argmax())  # first max on exact ties, as the engine's sampler
        v, j = logits.topk(top_k)
        tokens.append(tok)
        vals.append(v.cpu())
        ids.append(j.cpu())
        if i == max_new_tokens - 1:
            break
        out = hf.model(torch.tensor([[tok]], device=dev), past_key_values=cache, use_cache=True)
        cache, last = out.past_key_values, out.last_hidden_state[0]
        hidden.append(last)
    return RefOutput(tokens, torch.cat(hidden), (torch.stack(vals), torch.stack(ids)))


@torch.inference_mode()
def reference_logits(hf, hidden: torch.Tensor) -> torch.Tensor:
    """hidden [N, H] → logits [N, V] fp32 (lm_head in the model dtype, as HF computes them)."""
    return hf.lm_head(hidden).float()
