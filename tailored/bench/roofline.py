"""Roofline of one decode step: bytes moved and FLOPs from a ModelConfig, precision and batch.

A decode step advances B sequences by one token each (context `ctx_len` tokens per sequence).
Bytes (HBM traffic that no implementation can avoid; spec §11.3):
* dense weights, read once per step whatever B: GDN and attention projections, router, shared
  expert and its gate, norms, conv taps, lm_head;
* routed experts: each distinct expert touched in a layer is read once. With uniform routing of
  B tokens to k of E experts the expected number of distinct experts is E·(1 − (1 − k/E)^B)
  (= k at B = 1, → E for large B); dummy-weight runs route near-uniformly;
* embedding rows: one per token;
* per sequence: the GDN recurrent state (fp32, read + write) and conv state (bf16, read + write)
  of every GDN layer (spec §5.8); the KV cache of the attention layers, read for `ctx_len` tokens
  and written for the new one (spec §6.6).
Activations, logits and sampling are left out (small next to the above at B ≤ 32 when fused).

Precision (spec §9.1 for fp8): "bf16" = every weight 2 B. "fp8" = Qwen's block-FP8 format:
q/k/v/o, in_proj_qkv, in_proj_z, out_proj, the shared-expert and routed-expert projections are
e4m3 (1 B) with one fp32 scale per 128×128 block; router, in_proj_a/b, shared_expert_gate,
norms, conv, A_log, dt_bias, embeddings and lm_head stay bf16.

FLOPs: 2 per multiply-add of every matmul a token touches (dense + k routed experts + shared +
lm_head), plus the GDN recurrence (≈ 7·K·V per value head), the causal conv, and attention
scores + weighted sum over the context (spec §11.2).

The time floor is max(bytes / HBM bandwidth, FLOPs / peak FLOP/s). The default bandwidth,
4.3e12 B/s, is what a copy kernel reaches on our H200 (the nominal figure is 4.8e12); pass the
value you measured. The issue-3 figures (≈1.43 ms BF16, ≈0.85 ms FP8) are weights only over
4.1e12 B/s; `weight_bytes / bw` reproduces them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from tailored.config import ModelConfig

DEFAULT_HBM_BW = 4.3e12  # B/s, measured on our H200 (keep it a parameter)
# H200 SXM dense tensor-core peaks (no sparsity), FLOP/s
PEAK_FLOPS = {"bf16": 989e12, "fp8": 1979e12}
PRECISIONS = ("bf16", "fp8")
FP8_BLOCK = 128
SCALE_BYTES = 4  # fp32 weight_scale_inv per block


@dataclass(frozen=True)
class Linear:
    name: str
    out_features: int
    in_features: int
    fp8_ok: bool  # quantised in the Qwen FP8 format

    @property
    def params(self) -> int:
        return self.out_features * self.in_features

    def nbytes(self, precision: str) -> float:
        if precision == "fp8" and self.fp8_ok:
            blocks = math.ceil(self.out_features / FP8_BLOCK) * math.ceil(
                self.in_features / FP8_BLOCK
            )
            return self.params * 1 + blocks * SCALE_BYTES
        return self.params * 2


def layer_linears(cfg: ModelConfig, layer: int) -> list[Linear]:
    """Dense (always-read) matrices of one decoder layer, excluding the routed experts."""
    H = cfg.hidden_size
    out: list[Linear] = []
    if cfg.layer_types[layer] == "linear_attention":
        out += [
            Linear("in_proj_qkv", cfg.conv_dim, H, True),
            Linear("in_proj_z", cfg.value_dim, H, True),
            Linear("in_proj_b", cfg.linear_num_value_heads, H, False),
            Linear("in_proj_a", cfg.linear_num_value_heads, H, False),
            Linear("out_proj", H, cfg.value_dim, True),
        ]
    else:
        nq, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        out += [
            Linear("q_proj", nq * hd * 2, H, True),  # query + output gate (spec §6.1)
            Linear("k_proj", nkv * hd, H, True),
            Linear("v_proj", nkv * hd, H, True),
            Linear("o_proj", H, nq * hd, True),
        ]
    Is = cfg.shared_expert_intermediate_size
    out += [
        Linear("router", cfg.num_experts, H, False),
        Linear("shared_gate_proj", Is, H, True),
        Linear("shared_up_proj", Is, H, True),
        Linear("shared_down_proj", H, Is, True),
        Linear("shared_expert_gate", 1, H, False),
    ]
    return out


def layer_small_params(cfg: ModelConfig, layer: int) -> int:
    """bf16 vectors of one layer: norms, conv taps, A_log, dt_bias."""
    n = 2 * cfg.hidden_size  # input / post-attention norms
    if cfg.layer_types[layer] == "linear_attention":
        n += cfg.conv_dim * cfg.linear_conv_kernel_dim + 2 * cfg.linear_num_value_heads
        n += cfg.linear_value_head_dim
    else:
        n += 2 * cfg.head_dim
    return n


def expert_linears(cfg: ModelConfig) -> list[Linear]:
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    return [
        Linear("expert_gate", I, H, True),
        Linear("expert_up", I, H, True),
        Linear("expert_down", H, I, True),
    ]


def expected_distinct_experts(num_experts: int, top_k: int, batch: int) -> float:
    """E·(1 − (1 − k/E)^B): expected distinct experts hit by B tokens routed uniformly."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


@dataclass
class StepCost:
    """Bytes and FLOPs of one decode step (B sequences, one new token each)."""

    precision: str
    batch: int
    ctx_len: int
    dense_weight_bytes: float  # body without routed experts
    routed_expert_bytes: float
    lm_head_bytes: float
    embedding_bytes: float
    gdn_state_bytes: float  # recurrent + conv, read + write, all sequences
    kv_bytes: float  # read ctx_len tokens + write 1, all sequences
    distinct_experts_per_layer: float
    matmul_flops: float
    other_flops: float  # GDN recurrence, conv, attention over the context

    @property
    def weight_bytes(self) -> float:
        return self.dense_weight_bytes + self.routed_expert_bytes + self.lm_head_bytes

    @property
    def total_bytes(self) -> float:
        return self.weight_bytes + self.embedding_bytes + self.gdn_state_bytes + self.kv_bytes

    @property
    def flops(self) -> float:
        return self.matmul_flops + self.other_flops

    def time_floor_s(
        self, hbm_bw: float = DEFAULT_HBM_BW, peak_flops: float | None = None
    ) -> float:
        peak = peak_flops or PEAK_FLOPS[self.precision]
        return max(self.total_bytes / hbm_bw, self.flops / peak)

    def weights_time_s(self, hbm_bw: float = DEFAULT_HBM_BW) -> float:
        return self.weight_bytes / hbm_bw

    def to_dict(self, hbm_bw: float = DEFAULT_HBM_BW, peak_flops: float | None = None) -> dict:
        d = asdict(self)
        floor = self.time_floor_s(hbm_bw, peak_flops)
        d.update(
            weight_bytes=self.weight_bytes,
            total_bytes=self.total_bytes,
            flops=self.flops,
            hbm_bw_Bps=hbm_bw,
            peak_flops=peak_flops or PEAK_FLOPS[self.precision],
            time_floor_ms=floor * 1e3,
            weights_only_ms=self.weights_time_s(hbm_bw) * 1e3,
            tokens_per_s_ceiling=self.batch / floor,
            arithmetic_intensity=self.flops / self.total_bytes,
        )
        return d


def step_cost(
    cfg: ModelConfig,
    precision: str = "bf16",
    batch: int = 1,
    ctx_len: int = 0,
    kv_bytes_per_elem: int = 2,
    state_bytes_per_elem: int = 2,
    conv_bytes_per_elem: int = 2,
) -> StepCost:
    """Bytes and FLOPs of one decode step of `batch` sequences at context `ctx_len`.
    state_bytes_per_elem: the GDN recurrent states' storage, 2 (bf16) as the engine serves bf16
    and FP8 checkpoints (`--gdn-state-dtype auto`, kb/0056) and as vLLM stores them; 4 for
    fp32 states (the floors quoted in the kb notes before kb/0056)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if batch < 1:
        raise ValueError("batch must be >= 1")
    H, V, B = cfg.hidden_size, cfg.vocab_size, batch
    dense = 0.0
    dense_params = 0
    for layer in range(cfg.num_hidden_layers):
        lins = layer_linears(cfg, layer)
        dense += sum(lin.nbytes(precision) for lin in lins)
        dense_params += sum(lin.params for lin in lins)
        dense += 2 * layer_small_params(cfg, layer)
    dense += 2 * H  # final norm
    experts = expert_linears(cfg)
    per_expert_bytes = sum(lin.nbytes(precision) for lin in experts)
    per_expert_params = sum(lin.params for lin in experts)
    distinct = expected_distinct_experts(cfg.num_experts, cfg.num_experts_per_tok, B)
    routed = cfg.num_hidden_layers * distinct * per_expert_bytes
    lm_head = V * H * 2  # bf16 in both formats
    embedding = B * H * 2

    n_gdn, n_attn = len(cfg.gdn_layers), len(cfg.attn_layers)
    K, Vd, HV = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_num_value_heads
    rec_state = n_gdn * HV * K * Vd * state_bytes_per_elem
    conv_state = n_gdn * (cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim * conv_bytes_per_elem
    gdn_state = B * 2 * (rec_state + conv_state)  # read + write
    kv_per_token = n_attn * 2 * cfg.num_key_value_heads * cfg.head_dim * kv_bytes_per_elem
    kv = B * kv_per_token * (ctx_len + 1)

    active_params = (
        dense_params + cfg.num_hidden_layers * cfg.num_experts_per_tok * per_expert_params
    )
    matmul = 2.0 * B * (active_params + V * H)
    recurrence = n_gdn * HV * 7 * K * Vd
    conv = n_gdn * cfg.conv_dim * cfg.linear_conv_kernel_dim * 2
    attn = n_attn * cfg.num_attention_heads * cfg.head_dim * 2 * 2 * ctx_len
    other = B * (recurrence + conv + attn)
    return StepCost(
        precision,
        B,
        ctx_len,
        dense,
        routed,
        lm_head,
        embedding,
        gdn_state,
        kv,
        distinct,
        matmul,
        other,
    )


# ---------------------------------------------------------------------------------------------
# achieved fraction
# ---------------------------------------------------------------------------------------------
def roofline_fraction(
    cfg: ModelConfig,
    precision: str,
    *,
    tpot_ms: float | None = None,
    tokens_per_s: float | None = None,
    batch: int = 1,
    ctx_len: int = 0,
    hbm_bw: float = DEFAULT_HBM_BW,
    peak_flops: float | None = None,
) -> dict:
    """Achieved fraction of the roofline: floor time of one decode step / measured step time.

    The measured step time is `tpot_ms` (decode only; preferred) or, from a c=1 output rate,
    batch / tokens_per_s (which also carries the prefill share). 1.0 = at the physical limit.
    """
    if (tpot_ms is None) == (tokens_per_s is None):
        raise ValueError("give exactly one of tpot_ms or tokens_per_s")
    cost = step_cost(cfg, precision, batch, ctx_len)
    floor_s = cost.time_floor_s(hbm_bw, peak_flops)
    step_s = tpot_ms / 1e3 if tpot_ms is not None else batch / tokens_per_s
    return {
        "precision": precision,
        "batch": batch,
        "ctx_len": ctx_len,
        "hbm_bw_Bps": hbm_bw,
        "measured_step_ms": step_s * 1e3,
        "measured_from": "tpot" if tpot_ms is not None else "output_tok_s",
        "floor_ms": floor_s * 1e3,
        "weights_only_floor_ms": cost.weights_time_s(hbm_bw) * 1e3,
        "total_bytes": cost.total_bytes,
        "fraction": floor_s / step_s,
        "weights_only_fraction": cost.weights_time_s(hbm_bw) / step_s,
    }


def preset_model_config(preset: str = "full") -> ModelConfig:
    from tailored.synth import preset_config

    return ModelConfig.from_dict(preset_config(preset))


def format_report(
    cost: StepCost, hbm_bw: float = DEFAULT_HBM_BW, peak_flops: float | None = None
) -> str:
    d = cost.to_dict(hbm_bw, peak_flops)
    G = 1e9
    rows = [
        ("precision / batch / context", f"{cost.precision} / {cost.batch} / {cost.ctx_len}"),
        ("distinct experts per layer", f"{cost.distinct_experts_per_layer:.2f}"),
        ("dense body weights", f"{cost.dense_weight_bytes / G:.3f} GB"),
        ("routed experts", f"{cost.routed_expert_bytes / G:.3f} GB"),
        ("lm_head", f"{cost.lm_head_bytes / G:.3f} GB"),
        ("weights total", f"{cost.weight_bytes / G:.3f} GB"),
        ("GDN state (r+w)", f"{cost.gdn_state_bytes / G:.3f} GB"),
        ("KV cache (r+w)", f"{cost.kv_bytes / G:.4f} GB"),
        ("embedding rows", f"{cost.embedding_bytes / 1e6:.3f} MB"),
        ("bytes per step", f"{cost.total_bytes / G:.3f} GB"),
        ("FLOPs per step", f"{cost.flops / G:.2f} GFLOP (matmul {cost.matmul_flops / G:.2f})"),
        ("arithmetic intensity", f"{d['arithmetic_intensity']:.2f} FLOP/B"),
        ("HBM bandwidth", f"{hbm_bw / 1e12:.2f} TB/s"),
        ("floor: weights only", f"{d['weights_only_ms']:.3f} ms"),
        (
            "floor: step",
            (
                f"{d['time_floor_ms']:.3f} ms"
                f" (memory {cost.total_bytes / hbm_bw * 1e3:.3f}, compute "
                f"{cost.flops / d['peak_flops'] * 1e3:.3f})"
            ),
        ),
        ("ceiling", f"{d['tokens_per_s_ceiling']:.0f} output tok/s"),
    ]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{w}}  {v}" for k, v in rows)
