"""Checkpoint loading: every tensor consumed once, every parameter set once, clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import copy_checkpoint

from tailored.config import ConfigError, ModelConfig
from tailored.model.loader import LoadError, load_checkpoint
from tailored.synth import build_empty_model, preset_config, tensor_specs


def _load(path, cfg):
    m = build_empty_model(cfg, "cpu", torch.float32)
    load_checkpoint(m, path, progress=False)
    return m


def test_official_names_present(tiny_cfg):
    names = {n for n, _ in tensor_specs(tiny_cfg)}
    p = "model.language_model.layers."
    for n in ["model.language_model.embed_tokens.weight", "model.language_model.norm.weight",
              "lm_head.weight", p + "0.linear_attn.in_proj_qkv.weight", p + "0.linear_attn.A_log",
              p + "0.linear_attn.conv1d.weight", p + "0.linear_attn.dt_bias", p + "0.linear_attn.norm.weight",
              p + "0.mlp.experts.gate_up_proj", p + "0.mlp.experts.down_proj", p + "0.mlp.gate.weight",
              p + "0.mlp.shared_expert_gate.weight", p + "3.self_attn.q_proj.weight", p + "3.self_attn.q_norm.weight",
              "mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
              "mtp.norm.weight", "mtp.layers.0.self_attn.k_norm.weight", "mtp.layers.0.mlp.experts.gate_up_proj"]:
        assert n in names, n


def test_full_preset_sizes():
    cfg = ModelConfig.from_dict(preset_config("full"))
    specs = tensor_specs(cfg)
    total = sum(torch.Size(s).numel() for n, s in specs if not n.startswith("mtp."))
    mtp = sum(torch.Size(s).numel() for n, s in specs if n.startswith("mtp."))
    assert abs(total / 1e9 - 34.66) < 0.01, total  # spec §11.1
    assert abs(mtp / 1e9 - 0.845) < 0.01, mtp
    shapes = dict(specs)
    assert shapes["model.language_model.layers.0.mlp.experts.gate_up_proj"] == (256, 1024, 2048)
    assert shapes["model.language_model.layers.3.self_attn.q_proj.weight"] == (8192, 2048)
    assert shapes["model.language_model.layers.0.linear_attn.conv1d.weight"] == (8192, 1, 4)


def test_missing_tensor_is_named(tiny_ckpt, tiny_cfg, tmp_path):
    name = "model.language_model.layers.2.linear_attn.dt_bias"
    d = copy_checkpoint(tiny_ckpt, tmp_path / "c", lambda sd: sd.pop(name))
    with pytest.raises(LoadError, match="layers.2.linear_attn.dt_bias"):
        _load(d, tiny_cfg)


def test_extra_tensor_is_named(tiny_ckpt, tiny_cfg, tmp_path):
    d = copy_checkpoint(tiny_ckpt, tmp_path / "c", lambda sd: sd.update({"model.language_model.bogus.weight": torch.zeros(2)}))
    with pytest.raises(LoadError, match="bogus"):
        _load(d, tiny_cfg)


def test_wrong_shape_is_named(tiny_ckpt, tiny_cfg, tmp_path):
    name = "model.language_model.layers.0.linear_attn.in_proj_b.weight"
    d = copy_checkpoint(tiny_ckpt, tmp_path / "c", lambda sd: sd.update({name: torch.zeros(3, 3, dtype=torch.bfloat16)}))
    with pytest.raises(LoadError, match="in_proj_b.*shape"):
        _load(d, tiny_cfg)


def test_wrong_dtype_is_refused(tiny_ckpt, tiny_cfg, tmp_path):
    name = "model.language_model.norm.weight"
    d = copy_checkpoint(tiny_ckpt, tmp_path / "c", lambda sd: sd.update({name: sd[name].to(torch.int32)}))
    with pytest.raises(LoadError, match="norm.weight.*dtype"):
        _load(d, tiny_cfg)


def test_per_expert_layout_and_vision_tensors(tiny_ckpt, tiny_cfg, tiny_model, tmp_path):
    """Per-expert names (quantized-export style) load to the same parameters; vision is skipped."""
    I = tiny_cfg.moe_intermediate_size

    def split(sd):
        for key in [k for k in sd if k.endswith("mlp.experts.gate_up_proj")]:
            base = key[: -len(".gate_up_proj")]
            gu, dn = sd.pop(key), sd.pop(base + ".down_proj")
            for e in range(gu.shape[0]):
                sd[f"{base}.{e}.gate_proj.weight"] = gu[e, :I].clone()
                sd[f"{base}.{e}.up_proj.weight"] = gu[e, I:].clone()
                sd[f"{base}.{e}.down_proj.weight"] = dn[e].clone()
        sd["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(4, 4)

    d = copy_checkpoint(tiny_ckpt, tmp_path / "c", split)
    m = _load(d, tiny_cfg)
    for (n, p), (_, q) in zip(m.named_parameters(), tiny_model.named_parameters()):
        assert torch.equal(p, q), n


def test_duplicate_expert_piece_is_refused(tiny_ckpt, tiny_cfg, tmp_path):
    def dup(sd):
        gu = sd["model.language_model.layers.0.mlp.experts.gate_up_proj"]
        sd["model.language_model.layers.0.mlp.experts.1.gate_proj.weight"] = gu[1, :32].clone()

    d = copy_checkpoint(tiny_ckpt, tmp_path / "c", dup)
    with pytest.raises(LoadError, match="second time"):
        _load(d, tiny_cfg)


def test_other_architectures_refused():
    with pytest.raises(ConfigError, match="model_type='llama'"):
        ModelConfig.from_dict({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})


def test_text_only_config_accepted():
    cfg = preset_config("tiny")["text_config"]
    mc = ModelConfig.from_dict(json.loads(json.dumps(cfg)))
    assert mc.attn_layers == (3, 7) and mc.gdn_layers == (0, 1, 2, 4, 5, 6)
    assert mc.rotary_dim == 8


def test_model_parameters_never_require_grad(tiny_cfg):
    """Startup forwards (CUDA-graph warm-up and capture) run outside inference_mode: a
    parameter with requires_grad would make them keep autograd's saved activations (~60 GB at a
    4096-token prefill bucket on the H200, session 7)."""
    for fp8 in (False, True):
        cfg = ModelConfig.from_dict(preset_config("tiny", precision="fp8")) if fp8 else tiny_cfg
        m = build_empty_model(cfg, "cpu", torch.bfloat16)
        assert not any(p.requires_grad for p in m.parameters())
