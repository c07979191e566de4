"""Synthetic Qwen3.6 checkpoints: official layout and names, random values.

`tailored synth OUT --preset {tiny,full}` writes config.json, generation_config.json, tokenizer
files and sharded safetensors (official names, bf16) shard by shard, so writing `full`
(34.66 B text parameters + MTP, ≈ 69 GB) never holds more than one shard in host memory.
`init_dummy_weights` fills an allocated model in place with the same statistics (used by
`--load-format dummy`, on the GPU).

Statistics (chosen so activations stay finite and non-degenerate over 40 layers): linear
weights N(0, 1/fan_in); zero-centred norm weights N(0, 0.05²); the GDN gated-norm weight
1 + N(0, 0.05²); conv taps N(0, 0.5²); A = exp(A_log) ~ U(0.05, 1) and dt_bias ~ N(0, 0.5²)
so the per-step decay exp(g) lies in ≈ (0.5, 0.97); embeddings N(0, 1); lm_head N(0, 4/H)
so that next-token distributions are peaked rather than flat.
"""

from __future__ import annotations

import json
import math
import zlib
from copy import deepcopy
from pathlib import Path

import torch
from safetensors.torch import save_file

from tailored.config import ModelConfig

# Published Qwen3.6-35B-A3B text_config (model spec §1; identical to the baseline kit's config).
FULL_TEXT_CONFIG = {
    "model_type": "qwen3_5_moe_text",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_output_gate": True,
    "bos_token_id": 248044,
    "dtype": "bfloat16",
    "eos_token_id": 248044,
    "full_attention_interval": 4,
    "head_dim": 256,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],  # × 10, expanded below
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "mamba_ssm_dtype": "float32",
    "max_position_embeddings": 262144,
    "moe_intermediate_size": 512,
    "mtp_num_hidden_layers": 1,
    "mtp_use_dedicated_embeddings": False,
    "num_attention_heads": 16,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 40,
    "num_key_value_heads": 2,
    "output_router_logits": False,
    "pad_token_id": None,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {
        "mrope_interleaved": True,
        "mrope_section": [11, 11, 10],
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000000,
        "rope_type": "default",
    },
    "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False,
    "use_cache": True,
    "vocab_size": 248320,
}

# Same architecture, small enough for seconds on 2 CPU cores: 2 blocks of 3 GDN + 1 attention,
# GQA 4:2 with partial RoPE 0.25 of head_dim 32, 8 experts top-2 + shared expert, MTP, real vocab.
TINY_OVERRIDES = {
    "hidden_size": 64,
    "num_hidden_layers": 8,
    "head_dim": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "rope_parameters": {
        "mrope_interleaved": True,
        "mrope_section": [2, 1, 1],
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000000,
        "rope_type": "default",
    },
}

GENERATION_CONFIG = {
    "bos_token_id": 248044,
    "do_sample": True,
    "eos_token_id": [248046, 248044],
    "pad_token_id": 248044,
    "temperature": 1.0,
    "top_k": 20,
    "top_p": 0.95,
}

SHARD_BYTES = 4 * 1024**3


PRECISIONS = ("bf16", "fp8", "nvfp4")


def preset_config(preset: str, num_layers: int | None = None, precision: str = "bf16",
                  nvfp4_format: str = "modelopt", **overrides) -> dict:
    """The full config.json dict (top level qwen3_5_moe with text_config) for a preset.
    precision 'fp8' adds Qwen's block-FP8 quantization_config (spec §9.1); 'nvfp4' the NVFP4
    one of `nvfp4_format`, 'modelopt' (the official release's) or 'compressed-tensors'
    (spec §9.2, model/nvfp4_config.py)."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose {', '.join(PRECISIONS)}")
    if preset not in ("tiny", "full"):
        raise ValueError(f"unknown preset {preset!r}; choose tiny or full")
    text = deepcopy(FULL_TEXT_CONFIG)
    if preset == "tiny":
        text.update(deepcopy(TINY_OVERRIDES))
    text.update(overrides)
    n = num_layers or text["num_hidden_layers"]
    text["num_hidden_layers"] = n
    text["layer_types"] = [
        "full_attention" if (i + 1) % text["full_attention_interval"] == 0 else "linear_attention"
        for i in range(n)
    ]
    out = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": text,
        "tie_word_embeddings": False,
        "image_token_id": 248056,
        "video_token_id": 248057,
        "vision_start_token_id": 248053,
        "vision_end_token_id": 248054,
    }
    if precision == "fp8":
        from tailored.model.fp8 import Fp8Config

        out["quantization_config"] = Fp8Config().to_json()
    if precision == "nvfp4":
        from tailored.model.nvfp4_config import release_layout

        out["quantization_config"] = release_layout(n, text["layer_types"], nvfp4_format)
    return out


def to_checkpoint_name(param: str) -> str:
    """Model parameter name → official checkpoint name (spec §2)."""
    if param.startswith("model."):
        return "model.language_model." + param[len("model."):]
    return param


# the residual branches' output projections: what `init="stable"` scales down
RESIDUAL_OUT = ("linear_attn.out_proj.weight", "self_attn.o_proj.weight",
                "mlp.experts.down_proj", "mlp.shared_expert.down_proj.weight")
INITS = ("default", "stable")


def init_spec(name: str, shape: tuple[int, ...], init: str = "default", num_layers: int = 40):
    """(kind, a, b) describing the distribution of one tensor; see the module docstring.

    init 'stable' (the accuracy gate's full-size fixture, kb/0008): the residual branches'
    output projections get std / sqrt(2·num_layers) (GPT-2's scaled residual init), so that a
    rounding difference is not amplified chaotically over 40 layers as it is with 'default'.
    """
    if init not in INITS:
        raise ValueError(f"unknown dummy init {init!r}; choose {' or '.join(INITS)}")
    kind, a, b = _init_spec(name, shape)
    if init == "stable" and name.endswith(RESIDUAL_OUT) and not name.startswith("mtp."):
        b = b / math.sqrt(2 * num_layers)
    return kind, a, b


def _init_spec(name: str, shape: tuple[int, ...]):
    last = name.split(".")[-1]
    if name.endswith("embed_tokens.weight"):
        return ("normal", 0.0, 1.0)
    if name == "lm_head.weight":
        return ("normal", 0.0, 2.0 / math.sqrt(shape[-1]))
    if name.endswith("linear_attn.norm.weight"):
        return ("normal", 1.0, 0.05)
    if last == "weight" and len(shape) == 1:  # zero-centred RMSNorm weights
        return ("normal", 0.0, 0.05)
    if name.endswith("conv1d.weight"):
        return ("normal", 0.0, 0.5)
    if last == "A_log":
        return ("log_uniform", 0.05, 1.0)
    if last == "dt_bias":
        return ("normal", 0.0, 0.5)
    fan_in = shape[-1]
    return ("normal", 0.0, 1.0 / math.sqrt(fan_in))


def _seed_for(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def random_tensor(name: str, shape, seed: int, dtype=torch.bfloat16, device="cpu") -> torch.Tensor:
    """Deterministic random tensor for (seed, name): same values for the same seed and device type."""
    g = torch.Generator(device=device)
    g.manual_seed(_seed_for(seed, name))
    out = torch.empty(shape, dtype=torch.float32, device=device)
    fill_random_(out, name, g)
    return out.to(dtype)


def fill_random_(t: torch.Tensor, name: str, g: torch.Generator) -> None:
    kind, a, b = init_spec(name, tuple(t.shape))
    if kind == "normal":
        t.normal_(a, b, generator=g)
    else:  # log_uniform: log of U(a, b)
        t.uniform_(a, b, generator=g).log_()


def build_empty_model(cfg: ModelConfig, device, dtype, with_mtp: bool = True):
    """Allocate the model's parameters uninitialised on `device` (no CPU init pass). For a
    block-FP8 config (cfg.fp8) the converted linears and experts are FP8 + fp32 scales; for
    an NVFP4 one (cfg.nvfp4) packed NVFP4 + scales and per-tensor FP8 (model/nvfp4.py)."""
    from tailored.model import nvfp4
    from tailored.model.fp8 import convert_model_
    from tailored.model.qwen36 import Qwen36ForCausalLM

    with torch.device("meta"):
        model = Qwen36ForCausalLM(cfg, with_mtp=with_mtp)
        # cast on meta first: to_empty allocates in the params' dtype (fp32 would double the memory)
        model = model.to(dtype)
        if cfg.fp8 is not None:
            convert_model_(model, cfg.fp8)
        if cfg.nvfp4 is not None:
            nvfp4.convert_model_(model, cfg.nvfp4)
    model = model.to_empty(device=device)
    # An inference engine never back-propagates; with requires_grad left on, every forward
    # outside inference_mode (CUDA-graph warm-up and capture at startup) keeps autograd's saved
    # activations alive: at a 4096-token prefill bucket that was ~60 GB and the server ran out
    # of memory (H200, kb/0013).
    model.requires_grad_(False)
    model.eval()
    return model


def _draw_(t: torch.Tensor, name: str, seed: int, init: str = "default", num_layers: int = 40) -> None:
    """Fill `t` in place with the synthetic values of checkpoint tensor `name` (drawn in fp32
    chunks along dim 0 on t's device, then rounded to t's dtype)."""
    g = torch.Generator(device=t.device)
    g.manual_seed(_seed_for(seed, name))
    rows = max(1, (1 << 26) // max(1, t[0].numel() if t.dim() else 1))
    flat = t if t.dim() else t.view(1)
    kind, a, b = init_spec(name, tuple(t.shape), init, num_layers)
    for s in range(0, flat.shape[0], rows):
        chunk = torch.empty(flat[s:s + rows].shape, dtype=torch.float32, device=t.device)
        if kind == "normal":
            chunk.normal_(a, b, generator=g)
        else:
            chunk.uniform_(a, b, generator=g).log_()
        flat[s:s + rows].copy_(chunk)


@torch.no_grad()
def init_dummy_weights(model, seed: int = 0, dtype=torch.bfloat16, init: str = "default") -> None:
    """Fill every parameter in place with the synthetic statistics (on the model's device).
    init: 'default' or 'stable' (see init_spec).

    FP8 weights get the values the bf16 model of the same seed has (drawn, rounded to `dtype`),
    block-quantized: an FP8 dummy model is the quantization of the bf16 dummy model, so the
    gate can compare it with both.
    """
    from tailored.model.fp8 import FP8, quantize_block, quantize_experts
    from tailored.model.nvfp4 import PACKED

    params = dict(model.named_parameters())
    L = model.config.num_hidden_layers
    for name, p in params.items():
        if name.endswith(("_scale_inv", "_scale", "_scale_2")):
            continue  # set with its weight
        ck = to_checkpoint_name(name)
        if p.dtype == PACKED or model.config.nvfp4 is not None and p.dtype == FP8:
            _dummy_nvfp4_(params, name, p, ck, seed, init, L, dtype)
            continue
        if p.dtype != FP8:
            _draw_(p.data, ck, seed, init, L)
            continue
        base = name[:-len(".weight")] if name.endswith(".weight") else name
        scale = params[base + ".weight_scale_inv" if name.endswith(".weight") else name + "_scale_inv"]
        full = torch.empty(p.shape, dtype=dtype, device=p.device)  # as the bf16 model
        _draw_(full, ck, seed, init, L)
        q, s = (quantize_block(full) if p.dim() == 2
                else quantize_experts(full, name.endswith("gate_up_proj")))
        p.data.copy_(q)
        scale.data.copy_(s)
        del full, q


def _dummy_nvfp4_(params, name, p, ck, seed, init, L, dtype) -> None:
    """One quantized weight of an NVFP4 model (`name`: an NVFP4 or per-tensor FP8 linear's
    weight, or NVFP4 experts) from the bf16 values of the same seed, quantized as synth
    writes them (so the gate can compare it with the bf16 dummy model)."""
    from tailored.model import nvfp4

    full = torch.empty(_bf16_shape(name, p), dtype=dtype, device=p.device)
    _draw_(full, ck, seed, init, L)
    if p.dtype == nvfp4.FP8:  # per-tensor FP8: every block scale is the tensor's one
        q, s = nvfp4.quantize_fp8_tensor(full)
        p.data.copy_(q)
        params[name[:-len("weight")] + "weight_scale_inv"].data.fill_(s)
        return
    if p.dim() == 3:
        out = nvfp4.quantize_experts(full, 2 if name.endswith("gate_up_proj") else 1)
        base = name
    else:
        out = nvfp4.quantize(full)
        base = name[:-len(".weight")] + ".weight"
    for t, suffix in zip(out, ("", "_scale", "_scale_2")):
        params[base + suffix].data.copy_(t)


def _bf16_shape(name: str, p) -> tuple[int, ...]:
    """The bf16 shape of a quantized parameter: FP8 keeps it; packed NVFP4 halves the last
    dimension."""
    return tuple(p.shape) if p.dtype != torch.uint8 else (*p.shape[:-1], 2 * p.shape[-1])


def tensor_specs(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(checkpoint name, shape) of every text-model + MTP tensor, in model order."""
    from tailored.model.qwen36 import Qwen36ForCausalLM

    with torch.device("meta"):
        model = Qwen36ForCausalLM(cfg, with_mtp=True)
    return [(to_checkpoint_name(n), tuple(p.shape)) for n, p in model.named_parameters()]


def fp8_tensor_names(cfg: ModelConfig) -> set[str]:
    """Checkpoint names of the tensors stored FP8 under cfg's quantization_config: decided by
    the same conversion the loader's model gets (fp8.convert_model_), so synth and loader
    cannot disagree. Empty for a bf16 config."""
    if cfg.fp8 is None:
        return set()
    from tailored.model.fp8 import FP8, convert_model_
    from tailored.model.qwen36 import Qwen36ForCausalLM

    with torch.device("meta"):
        model = Qwen36ForCausalLM(cfg, with_mtp=True)
        convert_model_(model, cfg.fp8)
    return {to_checkpoint_name(n) for n, p in model.named_parameters() if p.dtype == FP8}


def nvfp4_tensor_kinds(cfg: ModelConfig) -> dict[str, str]:
    """Checkpoint name → 'nvfp4' or 'fp8' (per-tensor) of the bf16 tensors an NVFP4 config
    stores quantized, decided by the loader's own conversion (nvfp4.convert_model_). Empty for
    another config."""
    if cfg.nvfp4 is None:
        return {}
    from tailored.model import nvfp4
    from tailored.model.qwen36 import Qwen36ForCausalLM

    with torch.device("meta"):
        model = Qwen36ForCausalLM(cfg, with_mtp=True)
        nvfp4.convert_model_(model, cfg.nvfp4)
    kinds = {nvfp4.PACKED: "nvfp4", nvfp4.FP8: "fp8"}
    return {to_checkpoint_name(n): kinds[p.dtype] for n, p in model.named_parameters()
            if p.dtype in kinds and not n.endswith(("_scale", "_scale_inv"))}


def _checkpoint_tensors(fp8_names: set[str], name: str, t: torch.Tensor):
    """(name, tensor) pairs that store bf16 tensor `t` in the checkpoint: itself, or, when
    `name` is in fp8_names, its FP8 form (quantized weight + weight_scale_inv; fused experts
    split per expert)."""
    from tailored.model.fp8 import quantize_block, quantize_experts

    if name not in fp8_names:
        yield name, t
        return
    for fused, parts in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
        if name.endswith("mlp.experts." + fused):  # per expert, as the official release
            prefix, rows = name[:-len(fused) - 1], t.shape[1] // len(parts)
            q, s = quantize_experts(t, len(parts) == 2)
            s = s if len(parts) == 2 else s[:, None]
            for e in range(t.shape[0]):
                for j, kind in enumerate(parts):
                    # own storage: safetensors refuses tensors that share memory
                    yield f"{prefix}.{e}.{kind}.weight", q[e, j * rows:(j + 1) * rows].clone()
                    yield f"{prefix}.{e}.{kind}.weight_scale_inv", s[e, j].clone()
            return
    q, s = quantize_block(t)
    yield name, q
    yield name[:-len(".weight")] + ".weight_scale_inv", s


def write_synthetic_checkpoint(out_dir: str | Path, preset: str = "tiny", seed: int = 0,
                               num_layers: int | None = None, progress: bool = True,
                               shard_bytes: int = SHARD_BYTES, tokenizer: bool = True,
                               config_only: bool = False, device: str = "cpu",
                               precision: str = "bf16", nvfp4_format: str = "modelopt") -> Path:
    """Write a checkpoint directory; returns its path. Deterministic for (preset, seed, num_layers).

    precision 'fp8': Qwen's block-FP8 release layout (spec §9.1) — the bf16 values of the same
    seed, quantized: converted linears as float8_e4m3fn `weight` + fp32 `weight_scale_inv`
    [ceil(out/128), ceil(in/128)], routed experts per expert
    (`mlp.experts.E.{gate,up,down}_proj.weight` + scale), the rest bf16; config.json gets the
    quantization_config.
    precision 'nvfp4': the NVFP4 layout `nvfp4_format` ('modelopt': the official release's,
    'compressed-tensors': llm-compressor's), the bf16 values of the same seed quantized by the
    reference quantizer (model/nvfp4.py; tensors as model/nvfp4_tensors.py names them).

    config_only: write config, generation config and tokenizer files but no weights (for
    `tailored serve --load-format dummy`, e.g. the full preset on a machine without 70 GB of disk).
    device: where the random values are drawn ('cuda' is much faster for `full`; values are
    deterministic per seed and device type).
    """
    from tqdm import tqdm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    from tailored.model import nvfp4_tensors

    cfg_dict = preset_config(preset, num_layers, precision, nvfp4_format)
    cfg = ModelConfig.from_dict(cfg_dict)
    specs = [] if config_only else tensor_specs(cfg)
    fp8_names = fp8_tensor_names(cfg)
    kinds = nvfp4_tensor_kinds(cfg)
    # plan shards first so file names carry the total count, as HF does
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in specs:
        nbytes = ((1 if name in fp8_names else 2) * math.prod(shape) if not kinds
                  else nvfp4_tensors.stored_bytes(kinds.get(name), shape))
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    weight_map, total = {}, 0
    bar = tqdm(total=len(specs), desc=f"writing {preset} checkpoint", unit="tensor",
               disable=not progress or config_only)
    for i, shard in enumerate(shards if specs else []):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, shape in shard:
            t = random_tensor(name, shape, seed, device=device)
            pairs = (_checkpoint_tensors(fp8_names, name, t) if name not in kinds else
                     nvfp4_tensors.checkpoint_tensors(kinds[name], nvfp4_format, name, t))
            for out_name, out_t in pairs:
                tensors[out_name] = out_t.cpu()
                weight_map[out_name] = fname
                total += out_t.numel() * out_t.element_size()
            bar.update(1)
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        (out / fname).chmod(0o644)  # save_file creates 0600; match the other files
        del tensors
    bar.close()
    if specs:
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
    (out / "config.json").write_text(json.dumps(cfg_dict, indent=2))
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2))
    if tokenizer:
        from tailored.tokenizer import write_tokenizer_files

        write_tokenizer_files(out)
    return out
