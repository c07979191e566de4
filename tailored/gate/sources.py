"""Where the gate's checkpoints come from: its presets, and the bf16 weights behind a quantized
(FP8 or NVFP4) checkpoint, the second reference (`--bf16-reference`), checked before the run."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from tailored.gate.prompts import REPO

# preset → (cache directory name, precision, NVFP4 layout)
PRESETS = {"tiny": ("tiny-seed0", "bf16", None), "tiny-fp8": ("tiny-fp8-seed0", "fp8", None),
           "tiny-nvfp4": ("tiny-nvfp4-seed0", "nvfp4", "modelopt"),
           "tiny-nvfp4-ct": ("tiny-nvfp4-ct-seed0", "nvfp4", "compressed-tensors")}
# relative error of layer 0's dequantized weights against the bf16 ones that a genuine
# quantization stays under (block FP8 gives ~0.03, NVFP4 ~0.09)
QUANTIZED_FROM_BOUND = {"fp8": 0.1, "nvfp4": 0.2}


def preset_checkpoint(name: str) -> Path:
    """tiny: the synthetic tiny preset, seed 0 (random weights; the goldens' model), written
    once to $TAILORED_CACHE/tiny-seed0; tiny-fp8: the same values in block FP8
    ($TAILORED_CACHE/tiny-fp8-seed0); tiny-nvfp4 / tiny-nvfp4-ct: in NVFP4, ModelOpt's and
    compressed-tensors' layouts. nano: the packaged trained nano model (tailored/data/nano),
    the better fixture for bf16 (kb/0001)."""
    from tailored.stack import cache_dir
    from tailored.synth import write_synthetic_checkpoint

    if name == "nano":
        d = REPO / "tailored" / "data" / "nano"
        if not (d / "config.json").is_file():
            raise FileNotFoundError(f"no nano checkpoint in {d}")
        return d
    dirname, precision, fmt = PRESETS[name]
    d = cache_dir() / dirname
    if not (d / "model.safetensors.index.json").is_file() or not (d / "tokenizer.json").is_file():
        tmp = d.with_name(f"{d.name}.tmp{os.getpid()}")  # rename: never a half-written dir
        write_synthetic_checkpoint(tmp, "tiny", seed=0, progress=False, precision=precision,
                                   nvfp4_format=fmt or "modelopt")
        if d.exists():
            shutil.rmtree(d)
        tmp.rename(d)
    return d


def bf16_source(args, ckpt: Path):
    """Where the bf16 weights behind a quantized checkpoint come from: --bf16-reference DIR,
    the tiny preset for the quantized tiny presets (quantized from it), 'dummy' for
    --load-format dummy (same seed), else None (that comparison is then reported as not run)."""
    if args.bf16_reference:
        return Path(args.bf16_reference)
    if args.preset in PRESETS and args.preset != "tiny":
        return preset_checkpoint("tiny")
    if args.load_format == "dummy":
        return "dummy"
    return None


def check_bf16_source(src, ckpt: Path, args):
    """Validate the bf16 reference of a quantized gate before the run: FP8 or NVFP4
    checkpoint only; a directory must be a bf16 checkpoint of the same architecture whose
    weights the quantized ones come from (layer 0's quantized projections and one expert:
    dequantized within `QUANTIZED_FROM_BOUND` of the bf16 tensor, relative). Raises
    ValueError naming the problem. Returns src."""
    from tailored.config import ModelConfig

    cfg = ModelConfig.from_dir(ckpt)
    if not cfg.quantized:
        if args.bf16_reference:
            raise ValueError("--bf16-reference applies to FP8 and NVFP4 checkpoints only; "
                             f"{ckpt} is not one (no FP8 or NVFP4 quantization_config)")
        return None
    if src is None or src == "dummy" or args.load_format == "dummy":
        return src
    src = Path(src)
    other = ModelConfig.from_dir(src)  # ConfigError for a missing/bad config.json
    if other.quantized:
        raise ValueError(f"--bf16-reference {src} is itself an {other.precision.upper()} "
                         "checkpoint")
    same = ("hidden_size", "num_hidden_layers", "num_experts", "moe_intermediate_size",
            "vocab_size", "layer_types")
    diff = [f for f in same if getattr(other, f) != getattr(cfg, f)]
    if diff:
        raise ValueError(f"--bf16-reference {src} is another model: {diff[0]} differs")
    check_quantized_from(ckpt, src, cfg)
    return src


def check_quantized_from(q_dir: Path, bf16_dir: Path, cfg) -> None:
    """Layer 0's quantized GDN / attention input projection, shared-expert up projection and
    expert 0's down projection, dequantized, against the bf16 checkpoint's tensors."""
    from safetensors import safe_open

    from tailored.model.loader import checkpoint_files

    def where(d):
        return {n: d / f for f, names in checkpoint_files(d).items() for n in names}

    qf, bf = where(q_dir), where(bf16_dir)

    def get(files, name):
        with safe_open(str(files[name]), "pt") as f:
            return f.get_tensor(name)

    prec = cfg.precision
    pre = "model.language_model.layers.0."
    checked = 0
    for mod in ("linear_attn.in_proj_qkv", "self_attn.q_proj", "mlp.shared_expert.up_proj",
                "mlp.experts.0.down_proj"):
        w = _dequantized(qf, get, pre + mod, cfg)
        fused = pre + "mlp.experts.down_proj"
        if w is None:
            continue
        if pre + mod + ".weight" in bf:
            b = get(bf, pre + mod + ".weight").float()
        elif mod.startswith("mlp.experts.0.") and fused in bf:  # fused bf16 experts
            b = get(bf, fused)[0].float()
        else:
            continue
        if b.shape != w.shape:
            raise ValueError(f"--bf16-reference {bf16_dir}: {pre + mod} has shape "
                             f"{tuple(b.shape)}, the {prec.upper()} one {tuple(w.shape)}")
        err = ((w - b).norm() / b.norm().clamp_min(1e-12)).item()
        if not err <= QUANTIZED_FROM_BOUND[prec]:
            raise ValueError(f"--bf16-reference {bf16_dir} is not what the {prec.upper()} "
                             f"weights were quantized from: {pre + mod} differs from its bf16 "
                             f"tensor by {err:.2f} (relative; {prec.upper()} rounding gives "
                             f"~{QUANTIZED_FROM_BOUND[prec] / 2.5:.2f})")
        checked += 1
    if not checked:
        raise ValueError(f"--bf16-reference {bf16_dir}: none of layer 0's {prec.upper()} "
                         "weights is there")


def _dequantized(qf: dict, get, base: str, cfg) -> torch.Tensor | None:
    """Linear `base` of the quantized checkpoint dequantized to fp32, or None when it is not
    stored quantized there."""
    from tailored.model import fp8, nvfp4

    names = {leaf: f"{base}.{leaf}" for leaf in (
        "weight", "weight_packed", "weight_scale", "weight_scale_inv", "weight_scale_2",
        "weight_global_scale")}
    has = {k for k, n in names.items() if n in qf}
    if cfg.fp8 is not None:
        if not {"weight", "weight_scale_inv"} <= has:
            return None
        return fp8.dequantize_block(get(qf, names["weight"]), get(qf, names["weight_scale_inv"]),
                                    torch.float32)
    if {"weight", "weight_scale_2"} <= has:  # ModelOpt NVFP4
        return nvfp4.dequantize(get(qf, names["weight"]), get(qf, names["weight_scale"]),
                                get(qf, names["weight_scale_2"]), torch.float32)
    if {"weight_packed", "weight_global_scale"} <= has:  # compressed-tensors NVFP4
        s2 = nvfp4.global_from_compressed_tensors(get(qf, names["weight_global_scale"]))
        return nvfp4.dequantize(get(qf, names["weight_packed"]), get(qf, names["weight_scale"]),
                                s2, torch.float32)
    if {"weight", "weight_scale"} <= has:  # ModelOpt per-tensor FP8
        q = get(qf, names["weight"])
        return q.float() * get(qf, names["weight_scale"]).float() if q.dtype == fp8.FP8 else None
    return None
