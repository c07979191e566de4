"""Block-FP8 checkpoints (spec §9.1): format, synth, loader, plain-path numerics (CPU)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import checkpoint_tensors, copy_checkpoint
from safetensors import safe_open

from tailored.config import ConfigError, ModelConfig
from tailored.model import fp8
from tailored.model.loader import LoadError, load_checkpoint
from tailored.synth import build_empty_model, init_dummy_weights, preset_config


def test_quantize_round_trip_and_scales():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 200, generator=g)
    w[128:256, 128:] = 0  # an all-zero block gets scale 1, not a division by zero
    q, s = fp8.quantize_block(w)
    assert q.dtype == fp8.FP8 and q.shape == w.shape and s.shape == (3, 2)
    assert s[1, 1] == 1.0
    assert torch.allclose(s[0, 0], w[:128, :128].abs().max() / 448)
    d = fp8.dequantize_block(q, s, torch.float32)
    # e4m3 keeps 3 mantissa bits: |error| <= 2^-4 relative, plus the subnormal floor of a block
    err = (d - w).abs()
    bound = w.abs() / 16 + fp8.expand_scale(s, 300, 200) * 2 ** -9
    assert (err <= bound + 1e-12).all()
    assert torch.equal(fp8.row_scales(s, 300)[129], s[1])


def test_config_parsing_and_module_matching():
    raw = preset_config("tiny", precision="fp8")
    cfg = ModelConfig.from_dict(raw)
    assert cfg.precision == "fp8" and ModelConfig.from_dict(preset_config("tiny")).fp8 is None
    q = cfg.fp8
    assert not q.converts("model.layers.0.mlp.gate")
    assert q.converts("model.layers.0.mlp.shared_expert.gate_proj")
    assert not q.converts("model.layers.0.mlp.shared_expert_gate")
    assert not q.converts("mtp.layers.0.self_attn.q_proj") and not q.converts("lm_head")
    assert q.converts("model.layers.0.linear_attn.in_proj_qkv")
    assert not q.converts("model.layers.0.linear_attn.in_proj_a")
    for bad, msg in [({"quant_method": "awq"}, "quant_method"),
                     ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt"),
                     ({"quant_method": "fp8"}, "weight_block_size"),
                     ({"quant_method": "fp8", "weight_block_size": [64, 64]}, "weight_block_size")]:
        with pytest.raises(ConfigError, match=msg):
            ModelConfig.from_dict(dict(raw, quantization_config=bad))


def test_synth_fp8_layout(tiny_fp8_ckpt):
    cfg = json.loads((tiny_fp8_ckpt / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "fp8"
    idx = json.loads((tiny_fp8_ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    pre = "model.language_model.layers.0."
    assert pre + "mlp.experts.7.up_proj.weight_scale_inv" in idx
    assert pre + "mlp.experts.gate_up_proj" not in idx  # per expert, as the official release
    f = safe_open(str(tiny_fp8_ckpt / idx[pre + "linear_attn.in_proj_qkv.weight"]), "pt")
    assert f.get_tensor(pre + "linear_attn.in_proj_qkv.weight").dtype == fp8.FP8
    assert f.get_tensor(pre + "linear_attn.in_proj_qkv.weight_scale_inv").dtype == torch.float32
    assert f.get_tensor(pre + "linear_attn.in_proj_a.weight").dtype == torch.bfloat16
    assert f.get_tensor(pre + "mlp.gate.weight").dtype == torch.bfloat16
    assert not any(k.startswith("mtp.") and k.endswith("scale_inv") for k in idx)


@pytest.fixture(scope="module")
def fp8_and_bf16(tiny_ckpt, tiny_fp8_ckpt):
    mf = build_empty_model(ModelConfig.from_dir(tiny_fp8_ckpt), "cpu", torch.float32)
    load_checkpoint(mf, tiny_fp8_ckpt, progress=False)
    mb = build_empty_model(ModelConfig.from_dir(tiny_ckpt), "cpu", torch.float32)
    load_checkpoint(mb, tiny_ckpt, progress=False)
    return mf, mb


def test_loader_fp8_is_the_quantized_bf16_checkpoint(fp8_and_bf16):
    mf, mb = fp8_and_bf16
    ex = mf.model.layers[2].mlp.experts
    assert ex.gate_up_proj.dtype == fp8.FP8 and ex.gate_up_proj_scale_inv.shape == (8, 2, 1, 1)
    sd, sb = fp8.dequantized_state_dict(mf, torch.float32), mb.state_dict()
    assert set(sd) == {k for k in sb if not k.endswith("_scale_inv")}
    for k, v in sd.items():
        b = sb[k]
        if v.data_ptr() == dict(mf.state_dict())[k].data_ptr():  # not converted: identical
            assert torch.equal(v, b), k
        else:  # dequantized: within e4m3 rounding of the bf16 values
            q, s = fp8.quantize_block(b) if b.dim() == 2 else (None, None)
            assert (v - b).abs().max() <= b.abs().max() / 16 + 1e-6, k
            if q is not None:
                assert torch.equal(v, fp8.dequantize_block(q, s, torch.float32)), k


def test_consuming_dequantization_gives_the_same_weights_and_frees_the_fp8_ones(tiny_fp8_ckpt):
    """consume=True (the FP8 gate on an 80 GB card): the same dequantized values as the plain
    call, and afterwards every FP8 weight and scale of the model is empty except lm_head."""
    m = build_empty_model(ModelConfig.from_dir(tiny_fp8_ckpt), "cpu", torch.float32)
    load_checkpoint(m, tiny_fp8_ckpt, progress=False)
    want = fp8.dequantized_state_dict(m, torch.float32)
    fp8_keys = [k for k, v in m.state_dict().items() if v.dtype == fp8.FP8]
    assert fp8_keys
    got = fp8.dequantized_state_dict(m, torch.float32, consume=True)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    after = m.state_dict()
    for k in fp8_keys:
        assert after[k].numel() == 0 and after[k].dtype == fp8.FP8, k
        scale = k + "_scale_inv" if not k.endswith(".weight") else k[:-6] + "weight_scale_inv"
        assert after[scale].numel() == 0, scale
    assert after["model.norm.weight"].numel() > 0 and after["lm_head.weight"].numel() > 0


def test_fp8_plain_forward_is_the_dequantized_model(fp8_and_bf16):
    """The FP8 model computes exactly what a bf16-layout model holding the dequantized weights
    computes (fp32 on the CPU); how far both are from the bf16 checkpoint is the gate's
    business (random tiny weights amplify any weight change chaotically, kb/0001)."""
    from helpers import new_cache, rel_err, run_seq

    mf, mb = fp8_and_bf16
    md = build_empty_model(mb.config, "cpu", torch.float32)
    md.load_state_dict(fp8.dequantized_state_dict(mf, torch.float32), strict=False)
    ids = torch.randint(0, 248000, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    lf = run_seq(mf, new_cache(mf.config), ids, 0, 1, [1, 2, 3])
    ld = run_seq(md, new_cache(md.config), ids, 0, 1, [1, 2, 3])
    lb = run_seq(mb, new_cache(mb.config), ids, 0, 1, [1, 2, 3])
    assert torch.isfinite(lf).all() and rel_err(lf, ld) < 1e-5
    assert rel_err(lf, lb) > 1e-3  # the weights did change


def test_dummy_fp8_is_the_quantized_dummy_bf16():
    cf = ModelConfig.from_dict(preset_config("tiny", precision="fp8"))
    cb = ModelConfig.from_dict(preset_config("tiny"))
    mf, mb = build_empty_model(cf, "cpu", torch.bfloat16), build_empty_model(cb, "cpu", torch.bfloat16)
    init_dummy_weights(mf, 3)
    init_dummy_weights(mb, 3)
    m = mf.model.layers[1].linear_attn.out_proj
    q, s = fp8.quantize_block(mb.model.layers[1].linear_attn.out_proj.weight)
    assert torch.equal(m.weight.float(), q.float()) and torch.equal(m.weight_scale_inv, s)
    ex, eb = mf.model.layers[1].mlp.experts, mb.model.layers[1].mlp.experts
    q, s = fp8.quantize_block(eb.gate_up_proj[5, 32:])
    assert torch.equal(ex.gate_up_proj[5, 32:].float(), q.float())
    assert torch.equal(ex.gate_up_proj_scale_inv[5, 1], s)
    assert torch.equal(mf.lm_head.weight, mb.lm_head.weight)


@pytest.mark.parametrize("case", ["fp8_for_bf16_module", "bf16_for_fp8_module", "missing_scale"])
def test_loader_rejects_mixed_up_fp8(case, tiny_fp8_ckpt, tmp_path):
    pre = "model.language_model.layers.0."

    def edit(t):
        if case == "fp8_for_bf16_module":
            t[pre + "mlp.gate.weight"] = t[pre + "mlp.gate.weight"].to(fp8.FP8)
        if case == "bf16_for_fp8_module":
            t[pre + "linear_attn.out_proj.weight"] = t[pre + "linear_attn.out_proj.weight"].to(torch.bfloat16)
        if case == "missing_scale":
            t.pop(pre + "mlp.experts.3.down_proj.weight_scale_inv")

    d = copy_checkpoint(tiny_fp8_ckpt, tmp_path / "ckpt", edit)
    m = build_empty_model(ModelConfig.from_dir(d), "cpu", torch.float32)
    msg = {"fp8_for_bf16_module": "is FP8 but", "bf16_for_fp8_module": "says this module is FP8",
           "missing_scale": r"experts\.3\.down_proj\.weight_scale_inv"}[case]
    with pytest.raises(LoadError, match=msg):
        load_checkpoint(m, d, progress=False)


def test_fp8_checkpoint_without_quantization_config_is_refused(tiny_fp8_ckpt, tmp_path):
    d = tmp_path / "noq"
    shutil.copytree(tiny_fp8_ckpt, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("quantization_config")
    (d / "config.json").write_text(json.dumps(cfg))
    m = build_empty_model(ModelConfig.from_dir(d), "cpu", torch.float32)
    with pytest.raises(LoadError, match="FP8|scale"):
        load_checkpoint(m, d, progress=False)


def test_scales_keep_the_checkpoints_exact_values(tiny_fp8_ckpt, tmp_path):
    """failure-cases §6: scales rounded to powers of two cost accuracy. Loaded scales equal the
    file's bit for bit (fp32 on disk, and bf16 on disk — the release's scale dtype is
    unconfirmed, spec §9.1), none is a power of two by accident, and the kernel path's per-row
    scales are the same numbers."""
    from tailored.model.projections import Proj

    pre = "model.language_model.layers.0."
    name = pre + "linear_attn.out_proj.weight_scale_inv"

    def as_bf16(t):
        for k in list(t):
            if k.endswith("weight_scale_inv"):
                t[k] = t[k].to(torch.bfloat16)

    d = copy_checkpoint(tiny_fp8_ckpt, tmp_path / "bf16-scales", as_bf16)
    for ckpt in (tiny_fp8_ckpt, d):
        want = checkpoint_tensors(ckpt)[name]
        m = build_empty_model(ModelConfig.from_dir(ckpt), "cpu", torch.float32)
        load_checkpoint(m, ckpt, progress=False)
        got = m.model.layers[0].linear_attn.out_proj.weight_scale_inv
        assert got.dtype == torch.float32 and torch.equal(got, want.float())
        assert not torch.equal(got, torch.exp2(torch.log2(got).round()))
        rows = Proj([m.model.layers[0].linear_attn.out_proj]).scale
        assert torch.equal(rows[::128], got) and torch.equal(rows[-1], got[-1])
