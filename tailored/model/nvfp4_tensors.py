"""The tensors of an NVFP4 checkpoint by name, both ways: what synth writes for a weight, and
where the loader puts what it reads (spec §9.2, `nvfp4_config.py` for the two layouts).

Per quantized linear `X` (and per routed expert `…mlp.experts.E.{gate,up,down}_proj`):
  ModelOpt NVFP4      X.weight u8 [out, in/2], X.weight_scale e4m3 [out, in/16],
                      X.weight_scale_2 fp32 [] (a multiplier), X.input_scale fp32 []
  ModelOpt FP8        X.weight e4m3 [out, in], X.weight_scale fp32 [], X.input_scale fp32 []
  compressed-tensors  X.weight_packed u8, X.weight_scale e4m3, X.weight_global_scale fp32 [1]
                      (a divisor: its inverse is our scale_2), X.input_global_scale fp32 [1]
Input scales are read, checked to be one fp32 value and dropped: execution is weight-only
(W4A16 / W8A16). ModelOpt's FP8 KV-cache scales (`…k_proj.k_scale`, `…v_proj.v_scale`) are
dropped too: the KV cache stays in the model dtype. The model's side of each tensor:
`nvfp4.Nvfp4Linear` (weight, weight_scale, weight_scale_2), `fp8.Fp8Linear` (a per-tensor FP8
scale fills its block scales), NVFP4 experts (gate_up_proj[_scale[_2]], down_proj[_scale[_2]]).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch

from tailored.model import nvfp4
from tailored.model.fp8 import FP8
from tailored.model.nvfp4_config import COMPRESSED_TENSORS, MODELOPT

# on-disk leaf names by role, per format
LEAVES = {
    MODELOPT: {"weight": "weight", "weight_scale": "scale", "weight_scale_2": "global",
               "input_scale": "input"},
    COMPRESSED_TENSORS: {"weight_packed": "weight", "weight_scale": "scale",
                         "weight_global_scale": "global", "input_global_scale": "input"},
}
DROPPED = ("k_scale", "v_scale")  # ModelOpt's FP8 KV-cache scales
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)$")
_PARAM = {"weight": "weight", "scale": "weight_scale", "global": "weight_scale_2"}
_DTYPE = {"weight": nvfp4.PACKED, "scale": FP8, "global": torch.float32}
_PARTS = {"gate_proj": ("gate_up_proj", 0, "gate"), "up_proj": ("gate_up_proj", 1, "up"),
          "down_proj": ("down_proj", 0, "down")}


class TensorError(ValueError):
    """A tensor that does not fit the NVFP4 layout (the loader turns it into a LoadError)."""


@dataclass
class Plan:
    """Where one checkpoint tensor goes: `dst` (a view of parameter `target`, piece `piece`
    for the tracker) receives `convert(tensor)`; `dtype` is what the file must hold.
    dst None: the tensor is checked (`dtype`, one value) and dropped."""

    target: str | None
    piece: tuple | None
    dst: torch.Tensor | None
    dtype: torch.dtype
    convert: Callable = staticmethod(lambda t: t)


def _scalar(fmt: str, role: str) -> Callable:
    if role == "global" and fmt == COMPRESSED_TENSORS:
        return nvfp4.global_from_compressed_tensors
    return lambda t: t.float().reshape(())


def plan(pname: str, params: dict, fmt: str, inter: int) -> Plan | None:
    """The Plan of checkpoint tensor `pname` (our naming) in an NVFP4 model, or None when it
    is an ordinary tensor (a bf16 weight, a norm, an FP8 `weight`) the loader copies by name.
    Raises TensorError for a name of the other layout or an unknown leaf of a quantized one."""
    owner, _, leaf = pname.rpartition(".")
    if leaf in DROPPED:
        return Plan(None, None, None, torch.float32)
    m = _EXPERT.match(pname)
    if m and (m.group(1) + ".gate_up_proj_scale") in params:
        return _expert_plan(m, pname, params, fmt, inter)
    role = LEAVES[fmt].get(leaf)
    if role is None:
        return None
    if role == "input":
        return Plan(None, None, None, torch.float32)
    if f"{owner}.weight_scale_inv" in params:  # a per-tensor FP8 linear held as block FP8
        if role == "weight":
            return None  # its e4m3 weight: copied by name
        if role != "scale":
            _unexpected(pname, fmt)
        dst = params[f"{owner}.weight_scale_inv"].data
        return Plan(f"{owner}.weight_scale_inv", None, dst, torch.float32,
                    lambda t: t.float().reshape(()).expand(dst.shape))
    if f"{owner}.weight_scale_2" not in params:  # not an NVFP4 linear
        if leaf == "weight":
            return None
        raise TensorError(f"tensor {pname} quantizes {owner}, which config.json's "
                          "quantization_config leaves unquantized")
    target = owner + "." + _PARAM[role]
    conv = _scalar(fmt, role) if role == "global" else (lambda t: t)
    return Plan(target, None, params[target].data, _DTYPE[role], conv)


def _expert_plan(m, pname, params, fmt, inter) -> Plan:
    prefix, e, kind, leaf = m.group(1), int(m.group(2)), m.group(3), m.group(4)
    role = LEAVES[fmt].get(leaf)
    if role is None:
        _unexpected(pname, fmt)
    if role == "input":
        return Plan(None, None, None, torch.float32)
    fused, j, part = _PARTS[kind]
    suffix = {"weight": "", "scale": "_scale", "global": "_scale_2"}[role]
    target = prefix + "." + fused + suffix
    p = params[target]
    if e >= p.shape[0]:
        raise TensorError(f"tensor {pname}: expert {e} >= num_experts {p.shape[0]}")
    if role == "global":
        dst = p.data[e, j]
    elif fused == "gate_up_proj":
        dst = p.data[e, j * inter:(j + 1) * inter]
    else:
        dst = p.data[e]
    conv = _scalar(fmt, role) if role == "global" else (lambda t: t)
    return Plan(target, (e, part), dst, _DTYPE[role], conv)


def _unexpected(pname: str, fmt: str):
    raise TensorError(f"unexpected tensor {pname}: not a tensor of a {fmt} NVFP4 checkpoint "
                      f"(its quantized tensors end in {', '.join(LEAVES[fmt])})")


def disk_leaf(param_suffix: str, fmt: str) -> str:
    """Our parameter suffix ('' / '_scale' / '_scale_2') → the per-expert on-disk leaf."""
    role = {"": "weight", "_scale": "scale", "_scale_2": "global"}[param_suffix]
    return next(k for k, v in LEAVES[fmt].items() if v == role)


# ---- the writer (tailored synth) -------------------------------------------------------------
def checkpoint_tensors(kind: str, fmt: str, name: str, t: torch.Tensor):
    """(name, tensor) pairs storing bf16 weight `t` (checkpoint name `name`: a linear's
    `X.weight`, or fused experts `…mlp.experts.{gate_up_proj,down_proj}`, split per expert
    here) as `kind` ('nvfp4' or 'fp8') in layout `fmt`, quantized by the reference quantizer."""
    for fused, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
        if name.endswith("mlp.experts." + fused):
            if kind != "nvfp4":
                raise ValueError(f"{name}: only NVFP4 routed experts can be written")
            prefix, rows = name[:-len(fused) - 1], t.shape[1] // len(parts)
            for e in range(t.shape[0]):
                for j, part in enumerate(parts):
                    yield from _linear(kind, fmt, f"{prefix}.{e}.{part}",
                                       t[e, j * rows:(j + 1) * rows])
            return
    yield from _linear(kind, fmt, name[:-len(".weight")], t)


def _linear(kind: str, fmt: str, base: str, w: torch.Tensor):
    one = torch.ones((), dtype=torch.float32)  # input scales: placeholders, unused (W4A16)
    if kind == "fp8":
        if fmt != MODELOPT:
            raise ValueError(f"{base}: per-tensor FP8 is written in the ModelOpt layout only")
        q, s = nvfp4.quantize_fp8_tensor(w)
        yield from ((f"{base}.weight", q), (f"{base}.weight_scale", s.cpu()),
                    (f"{base}.input_scale", one))
        return
    packed, scale, s2 = nvfp4.quantize(w)
    if fmt == MODELOPT:
        yield from ((f"{base}.weight", packed), (f"{base}.weight_scale", scale),
                    (f"{base}.weight_scale_2", s2.cpu().clone()), (f"{base}.input_scale", one))
    else:
        yield from ((f"{base}.weight_packed", packed), (f"{base}.weight_scale", scale),
                    (f"{base}.weight_global_scale", nvfp4.global_to_compressed_tensors(s2).cpu()),
                    (f"{base}.input_global_scale", one.reshape(1)))


def stored_bytes(kind: str | None, shape: tuple[int, ...]) -> int:
    """Bytes a bf16 tensor of `shape` takes once stored as `kind` (shard planning)."""
    n = 1
    for d in shape:
        n *= d
    if kind == "nvfp4":
        return n // 2 + n // nvfp4.GROUP
    return n if kind == "fp8" else 2 * n
