"""The `quantization_config` of an NVFP4 checkpoint, in either of its two layouts (spec §9.2).

ModelOpt (`nvidia/Qwen3.6-35B-A3B-NVFP4`): quant_method "modelopt", quant_algo
"MIXED_PRECISION", a `quantized_layers` map from module name to {quant_algo, group_size}
("W4A16_NVFP4" group 16: routed experts, shared expert, lm_head; "FP8": per-tensor FP8 GDN
in_proj_qkv / in_proj_z / out_proj and attention q/k/v/o), `ignore` (["mtp*"]); everything not
listed stays bf16. Its `config_groups` describe the 4-bit layers with 4-bit input activations
too; `quantized_layers` (and the producer's hf_quant_config.json) say W4A16, and a layer listed
"NVFP4" (W4A4) has the same weight tensors: tailored serves every NVFP4 layer weight-only, with
activations in the model dtype, as vLLM does on Hopper (Marlin, spec §9.3; docs/nvfp4.md).
On disk: `weight` uint8, `weight_scale` e4m3, `weight_scale_2` fp32 scalar, `input_scale`
(unused); FP8: `weight` e4m3, `weight_scale` fp32 scalar, `input_scale` (unused).

compressed-tensors (llm-compressor): quant_method "compressed-tensors", format
"nvfp4-pack-quantized", `config_groups` whose `targets` name module classes ("Linear") or
modules ("re:" regexes allowed), 4-bit float weights of group 16 (strategy tensor_group), and an
`ignore` list (usually lm_head, the router, gates and the GDN block). On disk: `weight_packed`,
`weight_scale` e4m3, `weight_global_scale` fp32 [1] (the inverse of ModelOpt's weight_scale_2),
`input_global_scale` (unused).

Anything else (another quant_algo, group size, bit width, asymmetric weights, FP8 experts) is an
Nvfp4FormatError: one line naming the field or the layer.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field

from tailored.model import nvfp4

MODELOPT, COMPRESSED_TENSORS = "modelopt", "compressed-tensors"
FORMATS = (MODELOPT, COMPRESSED_TENSORS)
CT_FORMAT = "nvfp4-pack-quantized"
# ModelOpt's per-layer algorithms this engine loads, and what it runs them as
MODELOPT_ALGOS = {"W4A16_NVFP4": "nvfp4", "NVFP4": "nvfp4", "FP8": "fp8"}

# the release's layout (spec §9.2), by our module-name suffix
RELEASE_NVFP4 = ("mlp.experts", "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj",
                 "mlp.shared_expert.down_proj")
RELEASE_FP8 = ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj",
               "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
# what llm-compressor NVFP4 exports of this model usually leave in bf16 (issue 48)
CT_IGNORE = ("lm_head", "re:.*mlp\\.gate$", "re:.*mlp\\.shared_expert_gate$",
             "re:.*linear_attn\\..*", "re:^mtp\\..*")


class Nvfp4FormatError(ValueError):
    """A quantization_config this engine cannot load (one line, naming the field or layer)."""


def our_name(name: str) -> str:
    """A checkpoint module name → ours (`model.language_model.` → `model.`)."""
    pre = "model.language_model."
    return "model." + name[len(pre):] if name.startswith(pre) else name


def disk_name(name: str) -> str:
    return "model.language_model." + name[len("model."):] if name.startswith("model.") else name


@dataclass(frozen=True)
class Nvfp4Config:
    """The parsed config: `format`, and per module either an explicit map (ModelOpt:
    `layers`, our names → 'nvfp4' | 'fp8') or rules (compressed-tensors: `targets` and
    `ignore`). `kind(module)` answers 'nvfp4', 'fp8' or None (bf16)."""

    format: str
    layers: dict = field(default_factory=dict, hash=False)  # (a dict cannot be hashed)
    ignore: tuple[str, ...] = ()
    targets: tuple[str, ...] = ()
    activations_note: str = ""

    @classmethod
    def from_config(cls, raw: dict) -> "Nvfp4Config | None":
        """From a config.json dict whose quantization_config is ModelOpt's or
        compressed-tensors'; None for any other quant_method (the FP8 parser's business)."""
        q = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
        if not isinstance(q, dict):
            return None
        method = q.get("quant_method")
        if method == MODELOPT:
            return cls._modelopt(q)
        if method == COMPRESSED_TENSORS:
            return cls._compressed_tensors(q)
        return None

    @classmethod
    def _modelopt(cls, q: dict) -> "Nvfp4Config":
        algo = q.get("quant_algo")
        if algo != "MIXED_PRECISION":
            raise Nvfp4FormatError(f"unsupported ModelOpt quant_algo {algo!r}: tailored loads "
                                   "the MIXED_PRECISION layout with a quantized_layers map")
        layers = q.get("quantized_layers")
        if not isinstance(layers, dict) or not layers:
            raise Nvfp4FormatError("ModelOpt quantization_config has no quantized_layers map")
        kinds, w4a4 = {}, []
        for name, spec in layers.items():
            a = (spec or {}).get("quant_algo")
            if a not in MODELOPT_ALGOS:
                raise Nvfp4FormatError(f"quantized_layers[{name!r}]: quant_algo {a!r} is not "
                                       f"supported (one of {', '.join(MODELOPT_ALGOS)})")
            g = (spec or {}).get("group_size", nvfp4.GROUP)
            if MODELOPT_ALGOS[a] == "nvfp4" and g != nvfp4.GROUP:
                raise Nvfp4FormatError(f"quantized_layers[{name!r}]: group_size {g} is not "
                                       f"supported (NVFP4 groups are {nvfp4.GROUP})")
            if a == "NVFP4":
                w4a4.append(name)
            kinds[our_name(name)] = MODELOPT_ALGOS[a]
        ignore = tuple(q.get("ignore") or q.get("exclude_modules") or ())
        note = (f"{len(w4a4)} layer(s) listed NVFP4 (W4A4) served weight-only" if w4a4 else "")
        return cls(MODELOPT, kinds, ignore, (), note)

    @classmethod
    def _compressed_tensors(cls, q: dict) -> "Nvfp4Config":
        fmt = q.get("format")
        groups = q.get("config_groups") or {}
        if not groups:
            raise Nvfp4FormatError("compressed-tensors quantization_config has no config_groups")
        targets, note = [], ""
        for gname, g in groups.items():
            gfmt = g.get("format") or fmt
            if gfmt != CT_FORMAT:
                raise Nvfp4FormatError(f"config_groups.{gname}: format {gfmt!r} is not supported "
                                       f"(tailored loads compressed-tensors {CT_FORMAT!r})")
            w = g.get("weights") or {}
            got = (w.get("num_bits"), w.get("type"), w.get("group_size"), w.get("symmetric", True))
            if got != (4, "float", nvfp4.GROUP, True):
                raise Nvfp4FormatError(f"config_groups.{gname}.weights: num_bits/type/group_size/"
                                       f"symmetric {got} are not NVFP4's (4, 'float', 16, True)")
            a = g.get("input_activations")
            if a:
                note = (f"input activations declared {a.get('num_bits')}-bit "
                        f"{a.get('type')}: served weight-only")
            targets += list(g.get("targets") or [])
        if not targets:
            raise Nvfp4FormatError("compressed-tensors config_groups name no targets")
        return cls(COMPRESSED_TENSORS, {}, tuple(q.get("ignore") or ()), tuple(targets), note)

    # ---- which modules are quantized ------------------------------------------------------
    def kind(self, module: str) -> str | None:
        """'nvfp4', 'fp8' or None (bf16) for our module name (`model.layers.0.mlp.experts`,
        `lm_head`, `mtp.…`); routed experts are the module `…mlp.experts`."""
        if self._ignored(module):
            return None
        if self.format == MODELOPT:
            return self.layers.get(module)
        for t in self.targets:  # compressed-tensors: class names or module names
            if t == "Linear" or _matches(t, module) or _matches(t, disk_name(module)):
                return "nvfp4"
        return None

    def _ignored(self, module: str) -> bool:
        for pat in self.ignore:
            for name in (module, disk_name(module)):
                if pat.startswith("re:") and re.match(pat[3:], name):
                    return True
                if not pat.startswith("re:") and (fnmatch.fnmatchcase(name, pat) or name == pat):
                    return True
        return False


def _matches(target: str, name: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


def release_layout(num_layers: int, layer_types, fmt: str) -> dict:
    """The quantization_config `tailored synth --dtype nvfp4 --format FMT` writes: ModelOpt's
    as the official release has it (a quantized_layers entry per module, config_groups as
    published, ignore ["mtp*"]; issue 48), or compressed-tensors' usual llm-compressor export
    (every Linear NVFP4 but `CT_IGNORE`)."""
    if fmt == COMPRESSED_TENSORS:
        args = {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                "group_size": nvfp4.GROUP, "symmetric": True, "dynamic": False}
        return {"quant_method": COMPRESSED_TENSORS, "format": CT_FORMAT,
                "quantization_status": "compressed",
                "config_groups": {"group_0": {
                    "targets": ["Linear"], "weights": args, "format": CT_FORMAT,
                    "input_activations": dict(args, dynamic="local")}},
                "ignore": list(CT_IGNORE)}
    if fmt != MODELOPT:
        raise ValueError(f"unknown NVFP4 format {fmt!r}; choose {' or '.join(FORMATS)}")
    layers, fp8_targets, fp4_targets = {}, [], ["lm_head"]
    for i in range(num_layers):
        pre = f"model.language_model.layers.{i}."
        mixer = ("linear_attn." if layer_types[i] == "linear_attention" else "self_attn.")
        for m in RELEASE_FP8:
            if m.startswith(mixer):
                layers[pre + m] = {"quant_algo": "FP8"}
                fp8_targets.append(pre + m)
        for m in RELEASE_NVFP4:
            layers[pre + m] = {"quant_algo": "W4A16_NVFP4", "group_size": nvfp4.GROUP}
            fp4_targets.append(pre + m)
    layers["lm_head"] = {"quant_algo": "W4A16_NVFP4", "group_size": nvfp4.GROUP}
    f8 = {"dynamic": False, "num_bits": 8, "type": "float"}
    f4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": nvfp4.GROUP}
    return {"config_groups": {
                "group_0": {"input_activations": f8, "weights": f8, "targets": fp8_targets},
                "group_1": {"input_activations": f4, "weights": f4, "targets": fp4_targets}},
            "quantized_layers": layers, "ignore": ["mtp*"], "quant_algo": "MIXED_PRECISION",
            "producer": {"name": "tailored synth"}, "quant_method": MODELOPT}
