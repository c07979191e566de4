"""NVFP4 weights (model spec §9.2): 4-bit E2M1 values, one e4m3 scale per 16, one fp32 global.

The format, as read in NVIDIA ModelOpt's NVFP4 export and the compressed-tensors package
(docs/nvfp4.md names the files; tests/model/test_nvfp4_format.py pins every point below
against compressed-tensors when it is installed, and against constants read from ModelOpt):
  * a code is 4 bits: bit 3 the sign, bits 0-2 an index into the magnitudes
    {0, 0.5, 1, 1.5, 2, 3, 4, 6} (E2M1: the index's bit 0 is the mantissa bit);
  * two codes a byte along the input dimension, the even element in the low nibble:
    `packed[o, j] = code[o, 2j] | code[o, 2j + 1] << 4` → uint8 [out, in/2];
  * one float8_e4m3fn scale per 16 consecutive inputs of a row → [out, in/16];
  * one fp32 global scale per tensor. ModelOpt stores it as `weight_scale_2` = amax / (6·448),
    a multiplier; compressed-tensors stores `weight_global_scale` = 6·448 / amax, its inverse
    (a divisor). We hold ModelOpt's direction and load compressed-tensors' as 1 / g (one fp32
    rounding: ≤ 6e-8 relative, far below the 4-bit step);
  * W = e2m1(code) · float(scale[o, k // 16]) · scale_2; `dequantize` forms code · scale
    first (exact in fp32: a 2-bit times a 4-bit significand) and rounds once at · scale_2.

The reference quantizer (what `tailored synth --dtype nvfp4` writes): scale_2 = amax / (6·448)
(1 for an all-zero tensor); a block's scale = its amax / (6 · scale_2), 1 for an all-zero block,
clamped to [2^-9, 448] and rounded to e4m3; codes = w / (scale · scale_2) rounded to the
nearest E2M1 value, ties to the even code (0.25 → 0, 0.75 → 1, 2.5 → 2, 5 → 4), saturating at
±6. Execution is W4A16: the weights stay 4-bit in memory, activations stay in the model dtype
and every product accumulates in fp32 (Hopper has no FP4 tensor cores; spec §9.3).
This module holds the format, the plain-PyTorch reference every NVFP4 kernel is tested against,
and the model's NVFP4 modules; the checkpoint config is `nvfp4_config.py`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tailored.model import fp8

GROUP = 16  # inputs per e4m3 scale
FP4_MAX = 6.0
FP8 = fp8.FP8
FP8_MAX = fp8.FP8_MAX  # 448
E4M3_MIN = 2.0 ** -9  # smallest e4m3fn subnormal: a block scale never rounds to 0
MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# value of each of the 16 codes (8..15: the negatives; code 8 is -0)
E2M1_VALUES = torch.tensor(MAGNITUDES + tuple(-m for m in MAGNITUDES), dtype=torch.float32)
PACKED = torch.uint8


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Float values (already divided by their scales) → 4-bit codes (uint8, one a byte):
    the nearest E2M1 magnitude, ties to the even code, |x| ≥ 6 → 6; bit 3 set where x < 0."""
    a = x.float().abs()
    mags = E2M1_VALUES[:8].to(a.device)
    lo = (torch.bucketize(a, mags, right=True) - 1).clamp_(0, 7)  # largest magnitude ≤ |x|
    hi = (lo + 1).clamp_(max=7)
    mid = (mags[lo] + mags[hi]) / 2  # midpoints are exact in fp32
    up = (a > mid) | ((a == mid) & (lo % 2 == 1))
    code = torch.where((hi > lo) & up, hi, lo).to(PACKED)
    return code | ((x < 0).to(PACKED) << 3)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """Codes [..., K] (K even) → bytes [..., K/2]: element 2j in the low nibble, 2j+1 high."""
    if codes.shape[-1] % 2:
        raise ValueError(f"nvfp4.pack: the last dimension {codes.shape[-1]} is odd")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """Bytes [..., K/2] → codes [..., K] (uint8), the inverse of `pack`."""
    if packed.dtype != PACKED:
        raise ValueError(f"nvfp4.unpack: packed weights are uint8, got {packed.dtype}")
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def global_scale(w: torch.Tensor) -> torch.Tensor:
    """ModelOpt's `weight_scale_2` of w: amax / (6·448), fp32 0-d (1 for an all-zero w)."""
    amax = w.detach().abs().amax().float()
    return torch.where(amax > 0, amax / (FP4_MAX * FP8_MAX), torch.ones_like(amax))


@torch.no_grad()
def quantize(w: torch.Tensor, scale_2: torch.Tensor | None = None):
    """w [..., N, K] (K a multiple of 16) → (packed uint8 [..., N, K/2], scale float8_e4m3fn
    [..., N, K/16], scale_2 fp32 0-d): the reference quantizer of the module docstring.
    scale_2: the global scale to use (default `global_scale(w)`)."""
    *lead, N, K = w.shape
    if K % GROUP:
        raise ValueError(f"nvfp4.quantize: the input dimension {K} is not a multiple of {GROUP}")
    s2 = (global_scale(w) if scale_2 is None else scale_2.float().reshape(())).to(w.device)
    blocks = w.float().reshape(*lead, N, K // GROUP, GROUP)
    amax = blocks.abs().amax(-1)
    s = amax / (FP4_MAX * s2)
    s = torch.where(amax > 0, s, torch.ones_like(s)).clamp_(E4M3_MIN, FP8_MAX).to(fp8.FP8)
    codes = encode_e2m1(blocks / (s.float() * s2)[..., None])
    return pack(codes.reshape(*lead, N, K)).contiguous(), s.contiguous(), s2


def dequantize(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor,
               dtype=torch.bfloat16) -> torch.Tensor:
    """packed [..., N, K/2], scale [..., N, K/16] (e4m3), scale_2 (fp32, 0-d, or one value per
    leading index: [...] or [..., 1]) → W [..., N, K] in `dtype`: (e2m1 · scale) · scale_2 in
    fp32, rounded once."""
    codes = unpack(packed)
    vals = E2M1_VALUES.to(packed.device)[codes.long()]
    w = vals * scale.float().repeat_interleave(GROUP, -1)
    s2 = scale_2.float()
    if s2.dim():  # per leading index: broadcast over [N, K]
        s2 = s2.reshape(*s2.shape[:packed.dim() - 2], 1, 1)
    return (w * s2).to(dtype)


def global_from_compressed_tensors(g: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' `weight_global_scale` (a divisor) → our `scale_2` (a multiplier)."""
    return (1.0 / g.float()).reshape(())


def global_to_compressed_tensors(scale_2: torch.Tensor) -> torch.Tensor:
    """Our `scale_2` → compressed-tensors' `weight_global_scale` [1] (what synth writes)."""
    return (1.0 / scale_2.float()).reshape(1)


@torch.no_grad()
def quantize_fp8_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ModelOpt's per-tensor FP8 (the GDN / attention projections of the NVFP4 release):
    (float8_e4m3fn weight, fp32 0-d scale = amax / 448, 1 for an all-zero w), W = q · scale."""
    amax = w.detach().abs().amax().float()
    s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (w.float() / s).clamp_(-FP8_MAX, FP8_MAX).to(fp8.FP8), s


class Nvfp4Linear(nn.Module):
    """A bias-free linear with an NVFP4 weight; forward = x @ dequantize(weight)ᵀ (the plain
    path dequantizes on every call). `fast`: the kernel path's W4A16 forward, set by it
    (`fast(x, weight, weight_scale, weight_scale_2)`, kernels/nvfp4_gemv.py) for the linears
    it calls through the module (lm_head)."""

    fast = None

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        if in_features % GROUP:
            raise ValueError(f"an NVFP4 linear needs in_features % {GROUP} == 0, got {in_features}")
        self.in_features, self.out_features = in_features, out_features
        self.weight = _param((out_features, in_features // 2), PACKED)
        self.weight_scale = _param((out_features, in_features // GROUP), fp8.FP8)
        self.weight_scale_2 = _param((), torch.float32)

    def dequantized(self, dtype) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale, self.weight_scale_2, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fast is not None:
            return self.fast(x, self.weight, self.weight_scale, self.weight_scale_2)
        return F.linear(x, self.dequantized(x.dtype))


class DequantExperts:
    """Indexable view of NVFP4 routed experts for `ref.moe_experts`: `[e]` is expert e's
    weight dequantized to `dtype` (gate_up: the gate rows with global scale_2[e, 0], the up
    rows with scale_2[e, 1]; down: scale_2[e, 0])."""

    def __init__(self, packed, scale, scale_2, dtype):
        self.packed, self.scale, self.scale_2, self.dtype = packed, scale, scale_2, dtype
        E, R, half = packed.shape
        self.shape = (E, R, 2 * half)
        self.parts = scale_2.shape[1]  # 2: gate and up halves; 1: down

    def __getitem__(self, e: int) -> torch.Tensor:
        rows = self.shape[1] // self.parts
        return torch.cat([
            dequantize(self.packed[e, j * rows:(j + 1) * rows], self.scale[e, j * rows:(j + 1) * rows],
                       self.scale_2[e, j], self.dtype) for j in range(self.parts)])

    def all(self) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=self.dtype, device=self.packed.device)
        for e in range(self.shape[0]):
            out[e] = self[e]
        return out


def experts_view(experts: nn.Module, dtype) -> tuple[DequantExperts, DequantExperts]:
    """(gate_up, down) of NVFP4 experts as `DequantExperts` views."""
    return (DequantExperts(experts.gate_up_proj, experts.gate_up_proj_scale,
                           experts.gate_up_proj_scale_2, dtype),
            DequantExperts(experts.down_proj, experts.down_proj_scale,
                           experts.down_proj_scale_2, dtype))


def is_nvfp4_experts(experts: nn.Module) -> bool:
    return experts.gate_up_proj.dtype == PACKED


def _param(shape, dtype, device=None) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def convert_model_(model: nn.Module, qcfg) -> list[str]:
    """Swap the linears `qcfg` (an `Nvfp4Config`) names for Nvfp4Linear (NVFP4) or
    fp8.Fp8Linear (per-tensor FP8, held as block FP8 whose blocks share the tensor's one scale:
    the same values, and the FP8 kernels apply as they are), and NVFP4 routed experts for
    packed weights + scales, in place (on the meta device, before allocation, as
    fp8.convert_model_). Returns the converted module names. Raises ValueError for a layout
    this engine cannot hold (FP8 experts, an input size not a multiple of 16)."""
    done = []
    for name, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            kind = qcfg.kind(full) if isinstance(child, nn.Linear) else None
            if kind is None:
                continue
            with torch.device(child.weight.device):
                new = (Nvfp4Linear(child.in_features, child.out_features) if kind == "nvfp4"
                       else fp8.Fp8Linear(child.in_features, child.out_features))
            setattr(mod, child_name, new)
            done.append(full)
        if type(mod).__name__ == "Experts" and qcfg.kind(name) is not None:
            if qcfg.kind(name) != "nvfp4":
                raise ValueError(f"{name}: {qcfg.kind(name)} routed experts are not supported "
                                 "in an NVFP4 checkpoint (NVFP4 or bf16 experts)")
            E, two_i, H = mod.gate_up_proj.shape
            inter, dev = two_i // 2, mod.gate_up_proj.device
            if H % GROUP or inter % GROUP:
                raise ValueError(f"{name}: NVFP4 experts need hidden and intermediate sizes "
                                 f"divisible by {GROUP}, got {H} and {inter}")
            mod.gate_up_proj = _param((E, two_i, H // 2), PACKED, dev)
            mod.gate_up_proj_scale = _param((E, two_i, H // GROUP), fp8.FP8, dev)
            mod.gate_up_proj_scale_2 = _param((E, 2), torch.float32, dev)
            mod.down_proj = _param((E, H, inter // 2), PACKED, dev)
            mod.down_proj_scale = _param((E, H, inter // GROUP), fp8.FP8, dev)
            mod.down_proj_scale_2 = _param((E, 1), torch.float32, dev)
            done.append(name)
    return done


@torch.no_grad()
def quantize_experts(w: torch.Tensor, parts: int):
    """Routed experts w [E, R, C] (parts 2: gate rows then up rows; 1: down) → the model's
    NVFP4 expert tensors (packed [E, R, C/2], scale [E, R, C/16], scale_2 [E, parts]): each
    expert's gate, up and down are separate linears with their own global scale, as in the
    per-expert checkpoint."""
    E, R, C = w.shape
    rows = R // parts
    packed = torch.empty(E, R, C // 2, dtype=PACKED, device=w.device)
    scale = torch.empty(E, R, C // GROUP, dtype=fp8.FP8, device=w.device)
    scale_2 = torch.empty(E, parts, dtype=torch.float32, device=w.device)
    for e in range(E):
        for j in range(parts):
            sl = slice(j * rows, (j + 1) * rows)
            packed[e, sl], scale[e, sl], scale_2[e, j] = quantize(w[e, sl])
    return packed, scale, scale_2


@torch.no_grad()
def dequantized_state_dict(model: nn.Module, dtype) -> dict[str, torch.Tensor]:
    """Our NVFP4 model's state dict with every quantized weight (NVFP4 and per-tensor FP8)
    dequantized to `dtype` and the scales dropped: the weights "dequantized into the
    reference". Unquantized tensors are shared (no copy)."""
    sd = {}
    mods = dict(model.named_modules())
    for key, t in model.state_dict().items():
        owner, _, leaf = key.rpartition(".")
        mod = mods.get(owner)
        if leaf.endswith(("_scale", "_scale_2", "_scale_inv")):
            continue
        if isinstance(mod, Nvfp4Linear) and leaf == "weight":
            t = mod.dequantized(dtype)
        elif isinstance(mod, fp8.Fp8Linear) and leaf == "weight":
            t = fp8.dequantize_block(mod.weight, mod.weight_scale_inv, dtype)
        elif t.dtype == PACKED and leaf in ("gate_up_proj", "down_proj"):
            t = DequantExperts(t, getattr(mod, leaf + "_scale"), getattr(mod, leaf + "_scale_2"),
                               dtype).all()
        sd[key] = t
    return sd
