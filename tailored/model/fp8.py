"""Qwen block-FP8 weights (model spec §9.1): e4m3 weights with one scale per 128×128 block.

Format (Qwen's official FP8 release, also what `tailored synth --dtype fp8` writes):
  * config.json `quantization_config`: quant_method "fp8", fmt "e4m3", weight_block_size
    [128, 128], activation_scheme "dynamic", modules_to_not_convert [...];
  * a converted linear stores `weight` float8_e4m3fn [out, in] and `weight_scale_inv` fp32
    [ceil(out/128), ceil(in/128)]. Despite its name the scale is multiplicative:
    W ≈ weight[n, k] · weight_scale_inv[n // 128, k // 128] (spec §9.1, vLLM `fp8.py`);
  * routed experts are per expert: `mlp.experts.E.{gate,up,down}_proj.weight` (+ scale).

Converted: every nn.Linear of the decoder except those named in modules_to_not_convert (router
`mlp.gate`, `shared_expert_gate`, GDN `in_proj_a/b`, `lm_head`, MTP), plus the routed experts.
Embeddings, norms, conv taps, A_log and dt_bias are not linears and stay in the model dtype.

Execution is W8A16: weights stay FP8 in memory (half the bytes of bf16, which is what decode
pays for), activations stay bf16, every product accumulates in fp32. The checkpoint's
`activation_scheme: dynamic` (vLLM quantizes activations per token-group to FP8) is not
followed: W8A16 is closer to the BF16 model and, at decode batch sizes, as fast.
This module holds the format, the plain-PyTorch dequantization (the reference every FP8 kernel
is tested against) and the model conversion; the kernels are in `tailored.kernels.fp8_linear`
and `tailored.kernels.moe`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
BLOCK = 128

# The official exclusion list as transcribed for Qwen3.6-35B-A3B-FP8 (spec §9.1) and used by the
# baseline kit's FP8 config; used when a config gives none.
DEFAULT_NOT_CONVERT = ("lm_head", "mlp.gate", "shared_expert_gate", "in_proj_a", "in_proj_b",
                       "in_proj_ba", "visual", "mtp")


class Fp8FormatError(ValueError):
    """A quantization_config this engine cannot load (one line, naming the field)."""


@dataclass(frozen=True)
class Fp8Config:
    """The parsed `quantization_config` of a block-FP8 checkpoint."""

    modules_to_not_convert: tuple[str, ...] = DEFAULT_NOT_CONVERT
    activation_scheme: str = "dynamic"
    scale_dtype: str = "float32"

    @classmethod
    def from_config(cls, raw: dict) -> "Fp8Config | None":
        """From a config.json dict (top level or text_config); None when not quantized.
        Raises Fp8FormatError for any quantization other than Qwen's e4m3 128×128 block FP8."""
        q = raw.get("quantization_config") or (raw.get("text_config") or {}).get("quantization_config")
        if not q:
            return None
        if not isinstance(q, dict):
            raise Fp8FormatError("quantization_config must be a JSON object")
        method = q.get("quant_method")
        if method != "fp8":
            raise Fp8FormatError(f"unsupported quantization_config.quant_method {method!r}: "
                                 "tailored loads bf16 checkpoints, Qwen's block FP8 ('fp8') and "
                                 "NVFP4 ('modelopt', 'compressed-tensors')")
        fmt = q.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise Fp8FormatError(f"unsupported FP8 fmt {fmt!r}; only e4m3 is supported")
        block = q.get("weight_block_size")
        if block is None or list(block) != [BLOCK, BLOCK]:
            raise Fp8FormatError(f"unsupported weight_block_size {block!r}; only [128, 128] "
                                 "block scales are supported (per-tensor FP8 is not)")
        skip = q.get("modules_to_not_convert")
        return cls(tuple(skip) if skip is not None else DEFAULT_NOT_CONVERT,
                   str(q.get("activation_scheme", "dynamic")))

    def converts(self, module_name: str) -> bool:
        """Whether the linear `module_name` (our/HF dotted name) is FP8: not when one of
        modules_to_not_convert matches a run of its dotted components ("mlp.gate" matches
        "model.layers.3.mlp.gate" but not "...mlp.shared_expert.gate_proj")."""
        padded = "." + module_name + "."
        return not any("." + key + "." in padded for key in self.modules_to_not_convert)

    def to_json(self) -> dict:
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": self.activation_scheme,
                "weight_block_size": [BLOCK, BLOCK],
                "modules_to_not_convert": list(self.modules_to_not_convert)}


def num_blocks(n: int) -> int:
    return math.ceil(n / BLOCK)


@torch.no_grad()
def quantize_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] (any float dtype) → (q float8_e4m3fn [..., N, K], scale fp32
    [..., ceil(N/128), ceil(K/128)]) with scale = amax(|block|) / 448 (1 for an all-zero block)
    and q = round_to_nearest(w / scale), so that dequantize_block(q, scale) ≈ w."""
    *lead, N, K = w.shape
    nb, kb = num_blocks(N), num_blocks(K)
    wf = w.float()
    pad = F.pad(wf, (0, kb * BLOCK - K, 0, nb * BLOCK - N))  # zeros do not change the amax
    blocks = pad.reshape(*lead, nb, BLOCK, kb, BLOCK)
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., nb, kb]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[..., :, None, :, None]).clamp_(-FP8_MAX, FP8_MAX)
    q = q.reshape(*lead, nb * BLOCK, kb * BLOCK)[..., :N, :K].to(FP8)
    return q.contiguous(), scale.contiguous()


def expand_scale(scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Block scales [..., nb, kb] → one value per weight element [..., n, k] (fp32)."""
    return row_scales(scale, n).repeat_interleave(BLOCK, -1)[..., :k]


def row_scales(scale: torch.Tensor, n: int) -> torch.Tensor:
    """Block scales [..., nb, kb] → per-row scales [..., n, kb] (fp32, contiguous): row r of the
    weight uses row_scales[r, k // 128]. The kernels take this layout because it stays right
    when weights of several linears are concatenated along N at sizes that are not multiples
    of 128."""
    return scale.float().repeat_interleave(BLOCK, -2)[..., :n, :].contiguous()


def dequantize_block(q: torch.Tensor, scale: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """q float8_e4m3fn [..., N, K], scale [..., ceil(N/128), ceil(K/128)] → q · scale in fp32,
    rounded once to `dtype` (the "FP8 weights dequantized into the reference" of issue 4)."""
    N, K = q.shape[-2:]
    return (q.float() * expand_scale(scale.float(), N, K)).to(dtype)


@torch.no_grad()
def quantize_experts(w: torch.Tensor, gate_up: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Routed experts w [E, R, C] → (q float8_e4m3fn [E, R, C], scales in the model's layout):
    gate_up (rows = gate then up, I each) keeps gate and up in their own blocks, as the
    per-expert checkpoint does → [E, 2, ceil(I/128), ceil(C/128)]; down → [E, ceil(R/128),
    ceil(C/128)]. One expert at a time (bounds the fp32 scratch)."""
    E, R, C = w.shape
    q = torch.empty(w.shape, dtype=FP8, device=w.device)
    halves = (slice(0, R // 2), slice(R // 2, R)) if gate_up else (slice(0, R),)
    scale = torch.empty(E, len(halves), num_blocks(R // len(halves)), num_blocks(C),
                        dtype=torch.float32, device=w.device)
    for e in range(E):
        for j, rows in enumerate(halves):
            q[e, rows], scale[e, j] = quantize_block(w[e, rows])
    return q, (scale if gate_up else scale[:, 0])


def expert_block_scales(scale: torch.Tensor, gate_up: bool) -> torch.Tensor:
    """Expert scales in the model's layout (quantize_experts) → the MoE kernels' block scales,
    fp32 contiguous: gate_up [E, 2, ceil(I/128), ceil(H/128)] → [E, 2·ceil(I/128), ceil(H/128)]
    (gate blocks, then up blocks); down [E, ceil(H/128), ceil(I/128)] unchanged. Weight row n of
    the gate (or up) half uses block row n // 128 of its half: 128× fewer bytes than per-row
    scales (~8 MB instead of ~1 GB at full size, kb/0009 note 5)."""
    if gate_up:
        E, two, nb_i, nb_h = scale.shape
        scale = scale.reshape(E, two * nb_i, nb_h)
    return scale.float().contiguous()


class Fp8Linear(nn.Module):
    """A bias-free linear with block-FP8 weight; forward = x @ dequantize(weight)ᵀ (plain path:
    dequantizes on every call; the kernel path reads the FP8 weight directly)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8),
                                   requires_grad=False)
        self.weight_scale_inv = nn.Parameter(
            torch.empty(num_blocks(out_features), num_blocks(in_features), dtype=torch.float32),
            requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, dequantize_block(self.weight, self.weight_scale_inv, x.dtype))


class DequantExperts:
    """Indexable view of FP8 routed experts for `ref.moe_experts`: `[e]` gives expert e's
    weight dequantized to `dtype` (gate_up: gate rows then up rows, each with its own scales)."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, dtype, gate_up: bool):
        self.q, self.scale, self.dtype, self.gate_up = q, scale, dtype, gate_up
        self.shape = q.shape

    def __getitem__(self, e: int) -> torch.Tensor:
        if not self.gate_up:
            return dequantize_block(self.q[e], self.scale[e], self.dtype)
        inter = self.q.shape[1] // 2
        return torch.cat([dequantize_block(self.q[e, :inter], self.scale[e, 0], self.dtype),
                          dequantize_block(self.q[e, inter:], self.scale[e, 1], self.dtype)])

    def all(self) -> torch.Tensor:
        """Every expert dequantized: [E, rows, cols] in `dtype` (one expert at a time in fp32)."""
        out = torch.empty(self.shape, dtype=self.dtype, device=self.q.device)
        for e in range(self.shape[0]):
            out[e] = self[e]
        return out


def experts_scale_shapes(E: int, H: int, inter: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the fused expert scales: gate_up [E, 2, ceil(I/128), ceil(H/128)] (gate and up
    keep their own blocks, as in the per-expert checkpoint) and down [E, ceil(H/128), ceil(I/128)]."""
    return (E, 2, num_blocks(inter), num_blocks(H)), (E, num_blocks(H), num_blocks(inter))


def is_fp8_experts(experts: nn.Module) -> bool:
    return experts.gate_up_proj.dtype == FP8


def _param(shape, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


def convert_model_(model: nn.Module, qcfg: Fp8Config) -> list[str]:
    """Swap the model's converted linears for Fp8Linear and its routed experts to FP8 + scales,
    in place, on whatever device the model is (call it on the meta device, after the dtype
    cast and before allocation). Returns the converted module names."""
    done = []
    for name, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(child, nn.Linear) and qcfg.converts(full):
                dev = child.weight.device
                with torch.device(dev):
                    setattr(mod, child_name, Fp8Linear(child.in_features, child.out_features))
                done.append(full)
        if type(mod).__name__ == "Experts" and qcfg.converts(name):
            E, two_i, H = mod.gate_up_proj.shape
            dev = mod.gate_up_proj.device
            gu_s, dn_s = experts_scale_shapes(E, H, two_i // 2)
            mod.gate_up_proj = _param((E, two_i, H), FP8, dev)
            mod.gate_up_proj_scale_inv = _param(gu_s, torch.float32, dev)
            mod.down_proj = _param((E, H, two_i // 2), FP8, dev)
            mod.down_proj_scale_inv = _param(dn_s, torch.float32, dev)
            done.append(name)
    return done


@torch.no_grad()
def dequantized_state_dict(model: nn.Module, dtype, consume: bool = False,
                           ) -> dict[str, torch.Tensor]:
    """Our model's state dict with every FP8 weight dequantized to `dtype` and the scales
    dropped: the bf16 weights of "the FP8 checkpoint dequantized into the reference". Tensors
    that are not FP8 are shared (no copy); FP8 ones are new tensors (the full model: ≈ 67 GB).
    consume: each FP8 weight and its scales are emptied in `model` once dequantized (lm_head
    kept), so the peak is the bf16 copy alone, not the copy beside the FP8 weights (≈ 35 GB
    more): how the FP8 gate fits an 80 GB card. `model` cannot run afterwards."""
    sd = {}
    mods = dict(model.named_modules())
    source = model.state_dict()
    for key in list(source):
        t = source.pop(key)  # no reference left here once `model`'s attribute is emptied
        if key.endswith("_scale_inv"):
            continue
        owner, _, leaf = key.rpartition(".")
        mod = mods.get(owner)
        if isinstance(mod, Fp8Linear) and leaf == "weight":
            t = dequantize_block(mod.weight, mod.weight_scale_inv, dtype)
            names = ("weight", "weight_scale_inv")
        elif t.dtype == FP8 and leaf in ("gate_up_proj", "down_proj"):
            t = DequantExperts(t, getattr(mod, leaf + "_scale_inv"), dtype,
                               leaf == "gate_up_proj").all()
            names = (leaf, leaf + "_scale_inv")
        else:
            names = ()
        sd[key] = t
        if consume and names and not key.startswith("lm_head."):
            for name in names:
                empty_tensor(mod, name)
    return sd


def empty_tensor(mod: nn.Module, name: str) -> None:
    """Replace `mod.<name>` (a parameter or buffer) by an empty tensor of its dtype and device:
    its storage is freed once nothing else holds it."""
    old = getattr(mod, name)
    new = torch.empty(0, dtype=old.dtype, device=old.device)
    if isinstance(old, nn.Parameter):
        setattr(mod, name, nn.Parameter(new, requires_grad=False))
    else:
        mod.register_buffer(name, new)
