"""NVFP4 checkpoints (spec §9.2) in both layouts: config, synth, loader, plain-path numerics
(CPU). The format itself is pinned in test_nvfp4_format.py."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import checkpoint_tensors, copy_checkpoint, new_cache, rel_err, run_seq

from tailored.config import ConfigError, ModelConfig
from tailored.model import fp8, nvfp4
from tailored.model.loader import LoadError, load_checkpoint
from tailored.model.nvfp4_config import Nvfp4Config
from tailored.synth import build_empty_model, init_dummy_weights, preset_config

PRE = "model.language_model.layers."


def _load(d, dtype=torch.float32):
    m = build_empty_model(ModelConfig.from_dir(d), "cpu", dtype)
    load_checkpoint(m, d, progress=False)
    return m


def test_modelopt_config_is_the_release_layout():
    raw = preset_config("full", precision="nvfp4")
    q = raw["quantization_config"]
    assert (q["quant_method"], q["quant_algo"], q["ignore"]) == ("modelopt", "MIXED_PRECISION",
                                                                  ["mtp*"])
    # 30 GDN layers × 3 + 10 attention × 4 FP8; 40 × 4 + lm_head W4A16: spec §9.2's 291 entries
    algos = [v["quant_algo"] for v in q["quantized_layers"].values()]
    assert algos.count("FP8") == 130 and algos.count("W4A16_NVFP4") == 161 and len(algos) == 291
    c = ModelConfig.from_dict(raw).nvfp4
    assert c.kind("model.layers.0.mlp.experts") == "nvfp4" and c.kind("lm_head") == "nvfp4"
    assert c.kind("model.layers.0.mlp.shared_expert.down_proj") == "nvfp4"
    assert c.kind("model.layers.0.linear_attn.in_proj_z") == "fp8"
    assert c.kind("model.layers.3.self_attn.o_proj") == "fp8"
    for bf16 in ("model.layers.0.linear_attn.in_proj_a", "model.layers.0.mlp.gate",
                 "model.layers.0.mlp.shared_expert_gate", "mtp.layers.0.mlp.experts", "mtp.fc"):
        assert c.kind(bf16) is None, bf16


def test_compressed_tensors_config_reads_targets_and_ignore():
    c = ModelConfig.from_dict(preset_config("tiny", precision="nvfp4",
                                            nvfp4_format="compressed-tensors")).nvfp4
    assert c.format == "compressed-tensors" and "weight-only" in c.activations_note
    assert c.kind("model.layers.0.mlp.experts") == "nvfp4"
    assert c.kind("model.layers.3.self_attn.q_proj") == "nvfp4"
    for bf16 in ("lm_head", "model.layers.0.mlp.gate", "model.layers.0.mlp.shared_expert_gate",
                 "model.layers.0.linear_attn.in_proj_qkv", "mtp.layers.0.mlp.experts"):
        assert c.kind(bf16) is None, bf16
    # module-name targets and plain-name ignores, as llm-compressor also writes them
    c2 = Nvfp4Config.from_config({"quantization_config": {
        "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
        "config_groups": {"g": {"targets": ["re:.*mlp\\.experts.*"],
                                "weights": {"num_bits": 4, "type": "float", "group_size": 16}}},
        "ignore": ["model.language_model.layers.1.mlp.experts"]}})
    assert c2.kind("model.layers.0.mlp.experts") == "nvfp4"
    assert c2.kind("model.layers.1.mlp.experts") is None and c2.kind("lm_head") is None


@pytest.mark.parametrize("edit,msg", [
    (lambda q: q.update(quant_algo="NVFP4"), "quant_algo 'NVFP4'"),
    (lambda q: q["quantized_layers"]["lm_head"].update(quant_algo="W4A8_AWQ"),
     r"quantized_layers\['lm_head'\]: quant_algo 'W4A8_AWQ'"),
    (lambda q: q["quantized_layers"]["lm_head"].update(group_size=32), "group_size 32"),
    (lambda q: q.pop("quantized_layers"), "no quantized_layers"),
])
def test_modelopt_config_refusals_are_one_line(edit, msg):
    raw = preset_config("tiny", precision="nvfp4")
    edit(raw["quantization_config"])
    with pytest.raises(ConfigError, match=msg):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("edit,msg", [
    (lambda g: g["weights"].update(num_bits=8), r"weights: num_bits.*\(8,"),
    (lambda g: g["weights"].update(symmetric=False), "symmetric"),
    (lambda g: g.update(format="float-quantized"), "format 'float-quantized'"),
])
def test_compressed_tensors_config_refusals_are_one_line(edit, msg):
    raw = preset_config("tiny", precision="nvfp4", nvfp4_format="compressed-tensors")
    edit(raw["quantization_config"]["config_groups"]["group_0"])
    with pytest.raises(ConfigError, match=msg):
        ModelConfig.from_dict(raw)


def test_a_w4a4_layer_is_served_weight_only():
    raw = preset_config("tiny", precision="nvfp4")
    raw["quantization_config"]["quantized_layers"]["lm_head"]["quant_algo"] = "NVFP4"
    c = ModelConfig.from_dict(raw).nvfp4
    assert c.kind("lm_head") == "nvfp4" and "weight-only" in c.activations_note


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
def test_synth_layout_and_loader_fidelity(fmt, tiny_ckpt, tiny_nvfp4_ckpt, tiny_nvfp4_ct_ckpt):
    """Both layouts on disk as issue 48 lists them, and loaded into the model bit for bit as
    the reference quantizer makes them from the bf16 preset of the same seed."""
    d = tiny_nvfp4_ckpt if fmt == "modelopt" else tiny_nvfp4_ct_ckpt
    sd, bf = checkpoint_tensors(d), checkpoint_tensors(tiny_ckpt)
    e = PRE + "2.mlp.experts.5.up_proj."
    w_name = "weight" if fmt == "modelopt" else "weight_packed"
    g_name = "weight_scale_2" if fmt == "modelopt" else "weight_global_scale"
    assert sd[e + w_name].dtype == torch.uint8 and sd[e + w_name].shape == (32, 32)
    assert sd[e + "weight_scale"].dtype == fp8.FP8 and sd[e + "weight_scale"].shape == (32, 4)
    assert sd[e + g_name].dtype == torch.float32
    assert sd[e + g_name].shape == (() if fmt == "modelopt" else (1,))
    assert PRE + "2.mlp.experts.gate_up_proj" not in sd  # per expert
    assert sd[PRE + "2.mlp.gate.weight"].dtype == torch.bfloat16
    assert not any(k.startswith("mtp.") and k.endswith("scale") for k in sd)
    if fmt == "modelopt":
        assert sd[PRE + "0.linear_attn.in_proj_qkv.weight"].dtype == fp8.FP8
        assert sd[PRE + "0.linear_attn.in_proj_qkv.weight_scale"].shape == ()
        assert sd["lm_head.weight"].dtype == torch.uint8
    else:
        assert sd[PRE + "0.linear_attn.in_proj_qkv.weight"].dtype == torch.bfloat16
        assert sd[PRE + "3.self_attn.o_proj.weight_packed"].dtype == torch.uint8
    m = _load(d)
    ex = m.model.layers[2].mlp.experts
    up_bf16 = bf[PRE + "2.mlp.experts.gate_up_proj"][5, 32:]
    p, s, s2 = nvfp4.quantize(up_bf16)
    assert torch.equal(ex.gate_up_proj[5, 32:], p) and torch.equal(ex.gate_up_proj_scale[5, 32:], s)
    assert torch.allclose(ex.gate_up_proj_scale_2[5, 1], s2, rtol=1e-7)
    if fmt == "modelopt":
        qkv = m.model.layers[0].linear_attn.in_proj_qkv
        q, sc = nvfp4.quantize_fp8_tensor(bf[PRE + "0.linear_attn.in_proj_qkv.weight"])
        assert isinstance(qkv, fp8.Fp8Linear) and torch.equal(qkv.weight.float(), q.float())
        assert (qkv.weight_scale_inv == sc).all()  # the one scale in every block


@pytest.fixture(scope="module")
def nvfp4_and_bf16(tiny_ckpt, tiny_nvfp4_ckpt, tiny_nvfp4_ct_ckpt):
    return _load(tiny_nvfp4_ckpt), _load(tiny_nvfp4_ct_ckpt), _load(tiny_ckpt)


def test_plain_forward_is_the_dequantized_model(nvfp4_and_bf16):
    """The NVFP4 model computes what a bf16-layout model holding its dequantized weights does
    (fp32, CPU); against the bf16 weights it came from it differs (how much is the gate's
    bound, eval/thresholds.json)."""
    mo, mc, mb = nvfp4_and_bf16
    ids = torch.randint(0, 248000, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    lb = run_seq(mb, new_cache(mb.config), ids, 0, 1, [1, 2, 3])
    for m in (mo, mc):
        md = build_empty_model(mb.config, "cpu", torch.float32)
        sd = nvfp4.dequantized_state_dict(m, torch.float32)
        assert set(sd) == set(md.state_dict())
        md.load_state_dict(sd)
        lf = run_seq(m, new_cache(m.config), ids, 0, 1, [1, 2, 3])
        ld = run_seq(md, new_cache(md.config), ids, 0, 1, [1, 2, 3])
        assert torch.isfinite(lf).all() and rel_err(lf, ld) < 1e-5
        assert rel_err(lf, lb) > 1e-2


def test_dummy_nvfp4_is_the_quantized_dummy_bf16():
    cn = ModelConfig.from_dict(preset_config("tiny", precision="nvfp4"))
    cb = ModelConfig.from_dict(preset_config("tiny"))
    mn, mb = build_empty_model(cn, "cpu", torch.bfloat16), build_empty_model(cb, "cpu", torch.bfloat16)
    init_dummy_weights(mn, 3)
    init_dummy_weights(mb, 3)
    p, s, s2 = nvfp4.quantize(mb.lm_head.weight)
    assert torch.equal(mn.lm_head.weight, p) and torch.equal(mn.lm_head.weight_scale, s)
    ex, eb = mn.model.layers[1].mlp.experts, mb.model.layers[1].mlp.experts
    p, s, s2 = nvfp4.quantize(eb.down_proj[6])
    assert torch.equal(ex.down_proj[6], p) and torch.equal(ex.down_proj_scale_2[6, 0], s2)
    q, sc = nvfp4.quantize_fp8_tensor(mb.model.layers[3].self_attn.k_proj.weight)
    k = mn.model.layers[3].self_attn.k_proj
    assert torch.equal(k.weight.float(), q.float()) and (k.weight_scale_inv == sc).all()
    assert torch.equal(mn.model.layers[0].mlp.gate.weight, mb.model.layers[0].mlp.gate.weight)


@pytest.mark.parametrize("case,msg", [
    ("bf16_for_nvfp4", "up_proj.weight is torch.bfloat16; the NVFP4 layout has torch.uint8"),
    ("nvfp4_for_bf16", "quantizes model.layers.0.mlp.gate"),
    ("missing_global", r"experts\.3\.down_proj\.weight_scale_2"),
    ("other_layout", "unexpected tensor .*weight_packed"),
    ("scale_dtype", "weight_scale is torch.float32; the NVFP4 layout has torch.float8_e4m3fn"),
    ("input_scale_shape", "input_scale has shape .*one value"),
])
def test_loader_refusals_name_the_tensor(case, msg, tiny_nvfp4_ckpt, tmp_path):
    up = PRE + "0.mlp.shared_expert.up_proj."

    def edit(t):
        if case == "bf16_for_nvfp4":
            t[up + "weight"] = torch.zeros(32, 64, dtype=torch.bfloat16)
        if case == "nvfp4_for_bf16":
            t[PRE + "0.mlp.gate.weight_scale"] = torch.zeros(8, 4, dtype=fp8.FP8)
        if case == "missing_global":
            t.pop(PRE + "0.mlp.experts.3.down_proj.weight_scale_2")
        if case == "other_layout":
            t[up + "weight_packed"] = t.pop(up + "weight")
        if case == "scale_dtype":
            t[up + "weight_scale"] = t[up + "weight_scale"].float()
        if case == "input_scale_shape":
            t[up + "input_scale"] = torch.ones(3)

    d = copy_checkpoint(tiny_nvfp4_ckpt, tmp_path / "ckpt", edit)
    m = build_empty_model(ModelConfig.from_dir(d), "cpu", torch.float32)
    with pytest.raises(LoadError, match=msg):
        load_checkpoint(m, d, progress=False)


def test_kv_cache_scales_and_scalar_shapes_are_accepted(tiny_nvfp4_ckpt, tmp_path):
    """ModelOpt's FP8 KV-cache scales are dropped (the cache stays in the model dtype), and a
    global scale stored as [1] instead of [] loads the same."""
    att = PRE + "3.self_attn."
    g = PRE + "1.mlp.experts.2.gate_proj.weight_scale_2"

    def edit(t):
        t[att + "k_proj.k_scale"] = torch.ones(())
        t[att + "v_proj.v_scale"] = torch.ones(())
        t[g] = t[g].reshape(1)

    d = copy_checkpoint(tiny_nvfp4_ckpt, tmp_path / "ckpt", edit)
    a, b = _load(d), _load(tiny_nvfp4_ckpt)
    assert torch.equal(a.model.layers[1].mlp.experts.gate_up_proj_scale_2,
                       b.model.layers[1].mlp.experts.gate_up_proj_scale_2)


def test_config_json_of_both_layouts_round_trips(tiny_nvfp4_ckpt, tiny_nvfp4_ct_ckpt):
    for d, fmt in ((tiny_nvfp4_ckpt, "modelopt"), (tiny_nvfp4_ct_ckpt, "compressed-tensors")):
        raw = json.loads((d / "config.json").read_text())
        assert raw["quantization_config"]["quant_method"] == fmt
        cfg = ModelConfig.from_dir(d)
        assert cfg.precision == "nvfp4" and cfg.quantized and cfg.fp8 is None


def test_synth_cli_writes_either_layout_and_refuses_format_without_nvfp4(tmp_path, capsys):
    from tailored.cli import main

    out = tmp_path / "ct"
    assert main(["synth", str(out), "--dtype", "nvfp4", "--format", "compressed-tensors"]) == 0
    assert "nvfp4 (compressed-tensors)" in capsys.readouterr().out
    assert ModelConfig.from_dir(out).nvfp4.format == "compressed-tensors"
    assert main(["synth", str(tmp_path / "x"), "--format", "compressed-tensors"]) == 2
    assert "--dtype nvfp4 only" in capsys.readouterr().err and not (tmp_path / "x").exists()
