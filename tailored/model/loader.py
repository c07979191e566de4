"""Checkpoint loading: Hugging Face safetensors (sharded or single) → Qwen36ForCausalLM.

Accepted names (model spec §2): `model.language_model.*` (or `model.*` in text-only exports),
`lm_head.weight`, `mtp.*`; routed experts either fused 3-D (`mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`) or per expert (`mlp.experts.E.{gate,up,down}_proj.weight`); vision
tensors (`model.visual.*`) are skipped. Block-FP8 checkpoints (spec §9.1, `model/fp8.py`): a
converted linear's float8_e4m3fn `weight` and its `weight_scale_inv` (fp32 or bf16, kept fp32);
per-expert scales go into the fused `gate_up_proj_scale_inv[e, 0|1]` / `down_proj_scale_inv[e]`.
An FP8 tensor for a module the config does not convert, or a bf16 one for a converted module,
is a LoadError (no silent re-quantization or up-cast). NVFP4 checkpoints, ModelOpt's or
compressed-tensors' (spec §9.2, `model/nvfp4_tensors.py` says where each of their tensors goes):
packed uint8 weights, e4m3 group scales and fp32 global scales into the NVFP4 modules, ModelOpt's
per-tensor FP8 scales into the block scales of `Fp8Linear`; input and KV-cache scales are checked
and dropped (weight-only execution). Every text tensor is consumed exactly once and every
parameter is set exactly once; shapes and dtypes are checked. Anything else is a LoadError that
names the tensor.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from tailored.model import nvfp4_tensors
from tailored.model.qwen36 import Qwen36ForCausalLM

log = logging.getLogger("tailored.loader")

ALLOWED_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.uint8)
_PER_EXPERT = re.compile(
    r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)$")
_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")


class LoadError(RuntimeError):
    """The checkpoint does not match the model (missing, extra, mis-shaped or mis-typed tensor)."""


def checkpoint_files(ckpt_dir: Path) -> dict[str, list[str]]:
    """Map safetensors file → tensor names, from the index when sharded."""
    index = ckpt_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files: dict[str, list[str]] = {}
        for name, fname in weight_map.items():
            files.setdefault(fname, []).append(name)
        for fname in files:
            if not (ckpt_dir / fname).is_file():
                raise LoadError(f"shard {fname} named in {index.name} is missing from {ckpt_dir}")
        return files
    single = ckpt_dir / "model.safetensors"
    if single.is_file():
        with _open_shard(single) as f:
            return {single.name: list(f.keys())}
    raise LoadError(f"no model.safetensors or model.safetensors.index.json in {ckpt_dir}")


def param_name(ckpt_name: str) -> str | None:
    """Checkpoint tensor name → model parameter name (None = not part of the text model)."""
    if ckpt_name.startswith("model.visual.") or ckpt_name.startswith("visual."):
        return None
    if ckpt_name.startswith("model.language_model."):
        return "model." + ckpt_name[len("model.language_model."):]
    if ckpt_name.startswith(("model.", "lm_head.", "mtp.")):
        return ckpt_name
    return ckpt_name  # unknown → reported as extra by the caller


class _Tracker:
    """Records which parameter pieces were written so that nothing is set twice or missed."""

    def __init__(self, params: dict[str, torch.nn.Parameter], fmt: str | None = None):
        self.params, self.fmt = params, fmt  # fmt: the NVFP4 layout, None otherwise
        self.whole: set[str] = set()
        self.pieces: dict[str, set[tuple[int, str]]] = {}

    def mark(self, pname: str, piece: tuple[int, str] | None, src: str):
        if pname in self.whole or (piece is None and pname in self.pieces):
            raise LoadError(f"tensor {src} sets parameter {pname} a second time")
        if piece is None:
            self.whole.add(pname)
            return
        got = self.pieces.setdefault(pname, set())
        if piece in got:
            raise LoadError(f"tensor {src} sets {pname}[expert {piece[0]} {piece[1]}] a second time")
        got.add(piece)

    def missing(self, num_experts: int) -> list[str]:
        out = []
        for name in self.params:
            if name in self.whole:
                continue
            if name in self.pieces:
                part = ("gate", "up") if "gate_up_proj" in name else ("down",)
                want = {(e, p) for e in range(num_experts) for p in part}
                lack = want - self.pieces[name]
                if lack:
                    e, p = min(lack)
                    # the per-expert tensor name as it is on disk
                    prefix, _, pleaf = name.rpartition(".")
                    leaf = _expert_leaf(pleaf, self.fmt)
                    more = f" (and {len(lack) - 1} more expert pieces)" if len(lack) > 1 else ""
                    out.append(f"{_disk_name(prefix)}.{e}.{p}_proj.{leaf}{more}")
                continue
            out.append(_disk_name(name))
        return out


def _expert_leaf(pleaf: str, fmt: str | None) -> str:
    """The on-disk leaf of a fused expert parameter's per-expert pieces."""
    if pleaf.endswith("_scale_inv"):
        return "weight_scale_inv"
    if not fmt:
        return "weight"
    suffix = next((x for x in ("_scale_2", "_scale") if pleaf.endswith(x)), "")
    return nvfp4_tensors.disk_leaf(suffix, fmt)


def _disk_name(pname: str) -> str:
    """Our parameter name → the official checkpoint name (for messages)."""
    return "model.language_model." + pname[len("model."):] if pname.startswith("model.") else pname


def load_checkpoint(model: Qwen36ForCausalLM, ckpt_dir: str | Path, progress: bool = True,
                    max_layers: int | None = None) -> None:
    """Copy every tensor of the checkpoint into `model` (whose params are already allocated).

    max_layers: skip decoder layers >= this index (for reduced-depth runs of a deeper checkpoint).
    Raises LoadError naming the first offending tensor or the missing parameters.
    """
    ckpt_dir = Path(ckpt_dir)
    params = dict(model.named_parameters())
    cfg = model.config
    inter = cfg.moe_intermediate_size
    tracker = _Tracker(params, cfg.nvfp4.format if cfg.nvfp4 is not None else None)
    files = checkpoint_files(ckpt_dir)
    total = sum(len(v) for v in files.values())
    bar = tqdm(total=total, desc="loading weights", unit="tensor", disable=not progress)
    try:
        _load_files(model, ckpt_dir, files, params, tracker, bar, inter, max_layers)
    finally:
        bar.close()  # ends the bar's line, so an error message starts on its own line
    missing = tracker.missing(cfg.num_experts)
    if missing:
        raise LoadError(
            f"checkpoint {ckpt_dir} lacks {len(missing)} tensor(s), first: {missing[0]}"
        )


def _load_files(model, ckpt_dir, files, params, tracker, bar, inter, max_layers) -> None:
    for fname, names in sorted(files.items()):
        with _open_shard(ckpt_dir / fname) as f:
            for name in names:
                bar.update(1)
                pname = param_name(name)
                if pname is None:
                    continue
                m = _LAYER.match(pname[len("model."):] if pname.startswith("model.") else "")
                if max_layers is not None and m and int(m.group(1)) >= max_layers:
                    continue
                if model.mtp is None and pname.startswith("mtp."):
                    continue
                try:
                    t = f.get_tensor(name)
                except Exception as e:
                    raise LoadError(f"cannot read tensor {name} from {fname}: {e}") from None
                if t.dtype not in ALLOWED_DTYPES:
                    raise LoadError(
                        f"tensor {name} has dtype {t.dtype}; tailored loads bf16/fp16/fp32 "
                        "checkpoints, Qwen's block FP8 (float8_e4m3fn + weight_scale_inv) and "
                        "NVFP4 (uint8 + e4m3 scales)"
                    )
                if model.config.nvfp4 is not None and _load_nvfp4(name, pname, t, params,
                                                                  tracker, inter, model):
                    continue
                pe = _PER_EXPERT.match(pname)
                if pe:
                    prefix, e, kind, leaf = pe.group(1), int(pe.group(2)), pe.group(3), pe.group(4)
                    target = prefix + (".down_proj" if kind == "down_proj" else ".gate_up_proj")
                    scale = leaf == "weight_scale_inv"
                    if scale:
                        target += "_scale_inv"
                    if target not in params:
                        why = (" (the config has no quantization_config: this build reads "
                               "scales of FP8 checkpoints only)" if scale else "")
                        raise LoadError(f"unexpected tensor {name} (no parameter {target}){why}")
                    p = params[target]
                    if e >= p.shape[0]:
                        raise LoadError(f"tensor {name}: expert {e} >= num_experts {p.shape[0]}")
                    if kind == "gate_proj":
                        dst, piece = (p.data[e, 0] if scale else p.data[e, :inter]), (e, "gate")
                    elif kind == "up_proj":
                        dst, piece = (p.data[e, 1] if scale else p.data[e, inter:]), (e, "up")
                    else:
                        dst, piece = p.data[e], (e, "down")
                    _copy(dst, t, name)
                    tracker.mark(target, piece, name)
                    continue
                if pname not in params:
                    raise LoadError(f"unexpected tensor {name} in {fname}: the model has no {pname}")
                _copy(params[pname].data, t, name)
                tracker.mark(pname, None, name)


def _load_nvfp4(name, pname, t, params, tracker, inter, model) -> bool:
    """Load tensor `name` (ours: `pname`) of an NVFP4 checkpoint if it is one of the
    layout's own (nvfp4_tensors.plan); False when it is an ordinary tensor."""
    try:
        p = nvfp4_tensors.plan(pname, params, model.config.nvfp4.format, inter)
    except nvfp4_tensors.TensorError as e:
        raise LoadError(str(e)) from None
    if p is None:
        return False
    if t.dtype != p.dtype:
        raise LoadError(f"tensor {name} is {t.dtype}; the NVFP4 layout has {p.dtype} here")
    if p.dst is None:  # an input or KV-cache scale: one value, dropped
        if t.numel() != 1:
            raise LoadError(f"tensor {name} has shape {tuple(t.shape)}; expected one value")
        return True
    if p.dtype == torch.float32 and t.numel() != 1:
        raise LoadError(f"tensor {name} has shape {tuple(t.shape)}; a global or per-tensor "
                        "scale is one value")
    _copy(p.dst, p.convert(t), name)  # scalars: [] or [1] on disk
    tracker.mark(p.target, p.piece, name)
    return True


def _open_shard(path: Path):
    """safe_open with a LoadError naming the shard when it is truncated or not safetensors."""
    try:
        return safe_open(str(path), "pt", device="cpu")
    except Exception as e:  # safetensors raises its own SafetensorError / OSError
        raise LoadError(f"cannot read shard {path.name} in {path.parent}: {e}") from None


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise LoadError(f"tensor {name} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    fp8, u8 = torch.float8_e4m3fn, torch.uint8
    if (src.dtype == u8) != (dst.dtype == u8):
        raise LoadError(f"tensor {name} is {src.dtype} where the model holds {dst.dtype}: "
                        "config.json's quantization_config does not match the tensors (packed "
                        "uint8 NVFP4 weights go with an NVFP4 quantization_config entry)")
    if (src.dtype == fp8) != (dst.dtype == fp8):
        if src.dtype == fp8:
            raise LoadError(f"tensor {name} is FP8 but config.json's quantization_config does "
                            "not convert this module (no quantization_config, or it is in "
                            "modules_to_not_convert)")
        raise LoadError(f"tensor {name} is {src.dtype} but config.json's quantization_config "
                        "says this module is FP8 (float8_e4m3fn + weight_scale_inv expected)")
    dst.copy_(src.to(dst.dtype))
