"""Model and engine configuration.

`ModelConfig` is the only view of a Hugging Face ``config.json`` the engine uses: the fields of
``text_config`` that the Qwen3.6 text decoder needs (model spec §1), validated once and frozen.
`EngineConfig` holds the serving knobs (memory, batching, page size).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tailored import flags

ACCEPTED_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")


class ConfigError(ValueError):
    """A config.json that this engine cannot serve; the message is one line naming what was found."""


@dataclass(frozen=True)
class ModelConfig:
    """Text-decoder hyper-parameters of Qwen3.5/3.6-MoE (model spec §1).

    Derived sizes are properties so that they can never disagree with the stored fields.
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float
    # gated full attention (spec §6)
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    mrope_section: tuple[int, ...]
    max_position_embeddings: int
    # Gated DeltaNet (spec §5)
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # MoE (spec §7)
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    # MTP head (spec §8)
    mtp_num_hidden_layers: int
    # stopping (spec §10.3)
    eos_token_ids: tuple[int, ...] = (248046, 248044)
    dtype: str = "bfloat16"
    tie_word_embeddings: bool = False
    # block-FP8 weights (spec §9.1; tailored.model.fp8.Fp8Config), None for a bf16 checkpoint
    fp8: Any = None
    # NVFP4 weights, ModelOpt or compressed-tensors layout (spec §9.2;
    # tailored.model.nvfp4_config.Nvfp4Config), None otherwise
    nvfp4: Any = None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ---- derived -------------------------------------------------------------------------
    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def precision(self) -> str:
        """'fp8' for a block-FP8 checkpoint, 'nvfp4' for an NVFP4 one, else 'bf16' (the
        weights' storage, not --dtype)."""
        if self.nvfp4 is not None:
            return "nvfp4"
        return "fp8" if self.fp8 is not None else "bf16"

    @property
    def quantized(self) -> bool:
        """Whether the checkpoint stores quantized weights (FP8 or NVFP4)."""
        return self.fp8 is not None or self.nvfp4 is not None

    @property
    def load_max_layers(self) -> int | None:
        """`max_layers` for load_checkpoint: this config's layer count when `with_num_layers`
        cut it below the checkpoint's (config.json), else None (load every layer)."""
        text = self.raw.get("text_config", self.raw) if self.raw else {}
        full = text.get("num_hidden_layers", self.num_hidden_layers)
        return self.num_hidden_layers if self.num_hidden_layers < full else None

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def attn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    # ---- construction --------------------------------------------------------------------
    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        """Build from a parsed config.json (top level ``qwen3_5_moe`` or text ``qwen3_5_moe_text``).

        Raises ConfigError (one line) for any other architecture or an inconsistent config.
        """
        if not isinstance(cfg, dict):
            raise ConfigError(f"config.json must hold a JSON object, found {type(cfg).__name__}")
        model_type = cfg.get("model_type")
        if model_type not in ACCEPTED_MODEL_TYPES:
            archs = cfg.get("architectures")
            raise ConfigError(
                f"unsupported model: config.json has model_type={model_type!r}"
                f" architectures={archs!r}; tailored serves only qwen3_5_moe (Qwen3.5/3.6-MoE)"
            )
        text = cfg.get("text_config", cfg) if model_type == "qwen3_5_moe" else cfg
        if model_type == "qwen3_5_moe" and not isinstance(cfg.get("text_config"), dict):
            raise ConfigError("config.json of model_type 'qwen3_5_moe' has no text_config object")
        if text.get("model_type", "qwen3_5_moe_text") != "qwen3_5_moe_text":
            raise ConfigError(
                f"unsupported text_config.model_type={text.get('model_type')!r}; expected qwen3_5_moe_text"
            )

        def need(key: str) -> Any:
            if key not in text:
                raise ConfigError(f"config.json text_config lacks required field {key!r}")
            return text[key]

        n_layers = int(need("num_hidden_layers"))
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = int(text.get("full_attention_interval", 4))
            layer_types = [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention"
                for i in range(n_layers)
            ]
        rope = text.get("rope_parameters") or {}
        # older configs keep rope fields at the text_config top level
        rope_theta = rope.get("rope_theta", text.get("rope_theta", 10_000_000))
        partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default":
            raise ConfigError(f"unsupported rope_type {rope_type!r}; only 'default' is implemented")
        eos = text.get("eos_token_id", 248044)
        # the Qwen release lists only <|endoftext|> here; <|im_end|> (248046) comes from
        # generation_config.json, which the tokenizer reads; add it only for the Qwen vocabulary
        if isinstance(eos, list):
            eos_ids = tuple(int(e) for e in eos)
        elif int(eos) == 248044:
            eos_ids = (248046, 248044)
        else:
            eos_ids = (int(eos),)
        from tailored.model.fp8 import Fp8Config, Fp8FormatError
        from tailored.model.nvfp4_config import Nvfp4Config, Nvfp4FormatError

        try:
            nvfp4 = Nvfp4Config.from_config(cfg)
            fp8 = None if nvfp4 is not None else Fp8Config.from_config(cfg)
        except (Fp8FormatError, Nvfp4FormatError) as e:
            raise ConfigError(str(e)) from None
        head_dim = int(text.get("head_dim") or need("hidden_size") // need("num_attention_heads"))
        mc = cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            num_hidden_layers=n_layers,
            layer_types=tuple(layer_types),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            num_attention_heads=int(need("num_attention_heads")),
            num_key_value_heads=int(need("num_key_value_heads")),
            head_dim=head_dim,
            rope_theta=float(rope_theta),
            partial_rotary_factor=float(partial),
            mrope_section=tuple(rope.get("mrope_section", (11, 11, 10))),
            max_position_embeddings=int(text.get("max_position_embeddings", 262144)),
            linear_num_key_heads=int(need("linear_num_key_heads")),
            linear_num_value_heads=int(need("linear_num_value_heads")),
            linear_key_head_dim=int(need("linear_key_head_dim")),
            linear_value_head_dim=int(need("linear_value_head_dim")),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            num_experts=int(need("num_experts")),
            num_experts_per_tok=int(need("num_experts_per_tok")),
            moe_intermediate_size=int(need("moe_intermediate_size")),
            shared_expert_intermediate_size=int(need("shared_expert_intermediate_size")),
            mtp_num_hidden_layers=int(text.get("mtp_num_hidden_layers", 0)),
            eos_token_ids=eos_ids,
            dtype=str(text.get("dtype", text.get("torch_dtype", "bfloat16"))),
            tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
            fp8=fp8,
            nvfp4=nvfp4,
            raw=cfg,
        )
        mc.validate()
        return mc

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        p = Path(path) / "config.json"
        if not Path(path).is_dir():
            raise ConfigError(f"no such checkpoint directory: {path} (a Hugging Face "
                              "checkpoint directory: config.json, safetensors, tokenizer)")
        if not p.is_file():
            raise ConfigError(f"no config.json in {path}")
        try:
            cfg = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p} is not valid JSON: {e}") from None
        return cls.from_dict(cfg)

    def validate(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers"
            )
        bad = set(self.layer_types) - {"linear_attention", "full_attention"}
        if bad:
            raise ConfigError(f"unknown layer types {sorted(bad)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if 2 * sum(self.mrope_section) != self.rotary_dim:
            raise ConfigError(
                f"mrope_section {self.mrope_section} does not cover rotary_dim {self.rotary_dim}"
            )
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError("num_experts_per_tok must be in 1..num_experts")

    def with_num_layers(self, n: int) -> "ModelConfig":
        """A copy keeping the first `n` layers (for full-width runs with fewer layers)."""
        from dataclasses import replace

        if not 0 < n <= self.num_hidden_layers:
            raise ConfigError(f"--num-layers must be in 1..{self.num_hidden_layers}, got {n}")
        return replace(self, num_hidden_layers=n, layer_types=self.layer_types[:n])


GDN_STATE_DTYPES = flags.GDN_STATE_DTYPES  # EngineConfig.gdn_state_dtype's names
MAX_SPECULATIVE_TOKENS = 8  # drafts a step at most (vLLM's recipe uses 1-3 with this head)
# EngineConfig.speculative_method's names: the MTP head's drafts, prompt lookup's (n-gram,
# engine/prompt_lookup.py), or prompt lookup's where it finds a match, else the MTP's
SPECULATIVE_METHODS = ("mtp", "ngram", "ngram+mtp")


@dataclass(frozen=True)
class EngineConfig:
    """Serving knobs. Units: tokens, pages, slots, bytes.

    page_size: tokens per KV page of the 10 attention layers.
    max_num_seqs: most requests running at once (= GDN state slots in use, slot 0 is the pad sink).
    max_num_batched_tokens: token budget of one engine step (decode + prefill chunks).
    prefill_stall_factor: while requests decode, a step carrying prompt tokens is cut to take
        at most this many times the measured decode-only step (its first chunk at least
        TAILORED_MIN_PREFILL_CHUNK tokens; at a load too low for such chunks the token budget
        decides); engine/step_budget.py, docs/scheduling.md. 0 = off.
    max_model_len: longest prompt + completion accepted.
    num_pages: KV pages; None = sized from memory (GPU) or from max_num_seqs*max_model_len (CPU).
    kernels: 'auto' runs the Triton kernel path (model/kernel_model.py) on CUDA and the plain PyTorch
      path on the CPU; 'on' forces the kernel path (on the CPU through Triton's interpreter:
      TRITON_INTERPRET=1 and fp32 only, for tests); 'off' forces the plain path.
    enforce_eager: never replay CUDA graphs (kernel path only).
    prefill_graphs: replay CUDA graphs for a fresh prompt alone in its step, padded to a token
        bucket (kb/0013; kernel path with graphs only). `tailored serve` passes "auto" to
        build_stack, which turns it on on CUDA (`stack.prefill_graphs_auto`, kb/0026).
    async_scheduling: a pure decode step is launched before the previous step's tokens are
        read, its input ids fed on the device (kb/0015): the host's detokenize/stream/schedule
        work of step N overlaps the device's step N+1. Other steps run synchronously.
    num_speculative_tokens: drafts the MTP head proposes per decode step of a greedy request
        without penalties (0 = off; spec §8, worker/drafter.py). Each step verifies them with the
        target and keeps the matching prefix plus one token of its own, so the output is the
        greedy output either way. Such steps run synchronously (the next step's drafts come
        from this one).
    spec_synthetic_acceptance: benchmarking with random weights only: accept each draft with
        this probability instead of comparing it with the target's token (vLLM's 'synthetic'
        rejection sampler, used by the baseline kit's `serve mtp`); the output is then not the
        greedy output. None = real verification.
    speculative_method: where drafts come from (SPECULATIVE_METHODS): "mtp" the MTP head;
        "ngram" prompt lookup alone (engine/prompt_lookup.py: the tokens that followed the last
        earlier occurrence of the request's last n tokens, n from prompt_lookup_max down to
        prompt_lookup_min; the MTP head is then neither loaded nor run); "ngram+mtp" prompt
        lookup where it finds a match, else the MTP's drafts.
    spec_max_running: requests draft only while at most this many run; verify steps are
        captured in CUDA graphs up to this batch size (worker/spec_graphs.py), with GDN snapshots
        of num_speculative_tokens states a sequence. 2: on an H100 (FP8, acceptance 0.8) two
        drafts made c=1 15-37 % faster and c=8 27 % slower; interpolated in log(c) the gain
        is gone between c=2 and c=4 (kb/0062).
    spec_min_acceptance: adaptive draft length (engine/draft_pace.py): a request's next step
        verifies the largest k <= num_speculative_tokens drafts with a^k >= this, a being its
        recent share of drafts kept; below it for one draft, the request pauses drafting and
        probes again later. 0 = always num_speculative_tokens drafts.
    """

    page_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 16384
    num_pages: int | None = None
    gpu_memory_utilization: float = 0.90
    device: str = "cpu"
    dtype: str = "bfloat16"
    kernels: str = "auto"  # auto: Triton kernel path on CUDA; on: also on CPU (interpreter); off
    enforce_eager: bool = False  # no CUDA graphs for decode steps
    prefill_graphs: bool = False  # CUDA graphs for single-prompt prefill (kb/0013)
    async_scheduling: bool = True  # launch decode step N+1 before reading step N's tokens
    num_speculative_tokens: int = 0  # MTP drafts per decode step (greedy requests), 0 = off
    spec_synthetic_acceptance: float | None = None  # benchmarks with random weights only
    spec_max_running: int = 2  # draft only while at most this many requests run
    speculative_method: str = "mtp"  # mtp, ngram or ngram+mtp (SPECULATIVE_METHODS)
    prompt_lookup_max: int = 4  # n-gram lengths prompt lookup tries, longest first
    prompt_lookup_min: int = 2
    spec_min_acceptance: float = 0.5  # adaptive draft length; 0 = always N drafts
    # while requests decode, a step that also carries prompt tokens is sized to take at most
    # this many times the measured decode-only step (engine/step_budget.py); 0 = off, the fixed
    # max_num_batched_tokens budget alone (`tailored serve` turns it on on CUDA)
    prefill_stall_factor: float = 0.0
    # build structured output's grammar compiler on a thread at start (`tailored serve`: ~2.5 s
    # of one core for Qwen's vocabulary); off, the first structured request builds it
    grammar_warmup: bool = False
    # prefix caching (engine/prefix_cache.py): this many prompts' GDN states kept in snapshot
    # slots (with their KV pages) for later prompts that extend them; 0 = off
    prefix_cache_entries: int = 0
    # the GDN recurrent state's storage dtype (`HybridCache.rec`; the kernels' math is fp32
    # either way): "auto" = bfloat16 for a bf16 model (as vLLM stores it: its
    # mamba_ssm_cache_dtype "auto" is the model dtype), float32 otherwise; or "float32" /
    # "bfloat16". bf16 halves the state's bytes, which every decode step reads and writes:
    # c=32 step -3 to -4 % on the H200, the gates passed (kb/0056). The default is the
    # `gdn_state_dtype` switch (TAILORED_GDN_STATE_DTYPE), so the gate, the benches and the
    # side by side can A/B it unchanged
    gdn_state_dtype: str = field(default_factory=lambda: flags.current().gdn_state_dtype)

    def __post_init__(self) -> None:
        # a bad TAILORED_GDN_STATE_DTYPE says so before the weights load, not after
        if self.gdn_state_dtype not in GDN_STATE_DTYPES:
            raise ValueError(f"gdn_state_dtype (TAILORED_GDN_STATE_DTYPE) must be one of "
                             f"{', '.join(GDN_STATE_DTYPES)}, got {self.gdn_state_dtype!r}")
        if self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method must be one of {', '.join(SPECULATIVE_METHODS)}"
                             f", got {self.speculative_method!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"prompt lookup needs 1 <= prompt_lookup_min <= prompt_lookup_max, "
                             f"got {self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if not 0 <= self.prefill_stall_factor < 100:  # also NaN
            raise ValueError(f"prefill_stall_factor must be 0 (off) or in (0, 100), got "
                             f"{self.prefill_stall_factor}")
        if not 0 <= self.spec_min_acceptance <= 1:  # also NaN
            raise ValueError(f"spec_min_acceptance must be in [0, 1], got "
                             f"{self.spec_min_acceptance}")

    @property
    def uses_mtp(self) -> bool:
        """Speculative decoding drafts with the MTP head (its weights, KV layer and graphs)."""
        return self.num_speculative_tokens > 0 and self.speculative_method != "ngram"

    @property
    def uses_ngram(self) -> bool:
        """Speculative decoding drafts by prompt lookup (engine/prompt_lookup.py)."""
        return self.num_speculative_tokens > 0 and self.speculative_method != "mtp"

    @property
    def gdn_state_dtype_name(self) -> str:
        """gdn_state_dtype with "auto" resolved: bfloat16 for a bfloat16 model, else float32."""
        if self.gdn_state_dtype != "auto":
            return self.gdn_state_dtype
        return "bfloat16" if self.dtype == "bfloat16" else "float32"
