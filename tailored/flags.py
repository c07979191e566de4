"""The switch table: every `TAILORED_*` environment variable, declared once, read once.

A switch is a setting an operator or a benchmark may flip without a code change: a kernel
variant kept for its A/B, a threshold measured on one GPU, a path for a cache. Each field of
`Flags` below is one switch: its type, default, allowed values, one line of why and the kb
note that measured it. Nothing else in the package reads a `TAILORED_*` variable.

The record is parsed strictly, once: `Flags.from_env()` refuses an unknown `TAILORED_*` name
(a typo would otherwise measure the default), a value of the wrong type or outside its range,
naming the variable. `tailored serve` and `build_stack` parse it at start and `activate` it;
the engine process receives the parent's record. Code reads the active record with
`current()` where it decides (at construction for layouts, at each call for per-step
choices), so a test or an in-process A/B flips a switch with `override(...)` and re-runs.

`docs/switches.md` is generated from this table (`python -m tailored.flags`); a test checks
that it is current.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Generic, TypeVar

PREFIX = "TAILORED_"


def _switch(env: str, default, why: str, kb: str = "", layer: str = "kernel path", *,
            lo: int | None = None, hi: int | None = None, power_of_2: bool = False,
            choices: tuple[str, ...] | None = None, secret: bool = False,
            numerics: bool | None = None, tune: bool | None = None):
    """A dataclass field carrying its switch's declaration in the field metadata. secret: its
    value is never shown (snapshot and changed say "(set)"). numerics: flipping it may change
    the model's output bits (default: every switch outside "settings"; False only where the
    two sides are bitwise the same or the output is the greedy output either way); `tailored
    tune` gates such a candidate with the accuracy gate (docs/tune.md). tune: `tailored tune`
    may search it (default: every switch outside "settings")."""
    meta = {"env": PREFIX + env, "why": why, "kb": kb, "layer": layer, "lo": lo, "hi": hi,
            "power_of_2": power_of_2, "choices": choices, "secret": secret,
            "numerics": layer != "settings" if numerics is None else numerics,
            "tune": layer != "settings" if tune is None else tune}
    return field(default=default, metadata=meta, repr=not secret)


# the GDN recurrent states' storage names: this switch's values and EngineConfig's
# (--gdn-state-dtype); config.py takes them from here (it imports this module)
GDN_STATE_DTYPES = ("auto", "float32", "bfloat16")
# upper bounds shared with the kernels (kernels/moe.py asserts them at import)
ROUTE_ONE_PROGRAM_UP_TO = 4  # MoE inputs routed and aligned by one program (kb/0024)
ROUTE_ALIGN_MAX_TOKENS = 64  # one align program per step (a [T, E] tile or T·k sort keys)


@dataclass(frozen=True)
class Flags:
    """One value per switch; construct with `from_env`, change with `replace`."""

    # --- the kernel path's layout and per-step choices (model/kernel_*.py) ---
    shared_in_moe: bool = _switch(
        "SHARED_IN_MOE", True,
        "the shared expert runs as routed expert E of the fused MoE at few rows", "kb/0036")
    shared_in_moe_up_to: int = _switch(
        "SHARED_IN_MOE_UP_TO", 1,
        "largest MoE input (rows) that takes the shared expert as expert E: one row gains, "
        "two lose", "kb/0036", lo=1, hi=128)
    combine_next_norm: bool = _switch(
        "COMBINE_NEXT_NORM", True,
        "the MoE combine also adds the residual and applies the next norm: one launch fewer "
        "a layer", "kb/0023")
    attn_gate_in_merge: bool = _switch(
        "ATTN_GATE_IN_MERGE", True,
        "decode attention applies the output gate in its merge launch: -3.3 % at B=1",
        "kb/0037")
    moe_route_in_gate_up_up_to: int = _switch(
        "MOE_ROUTE_IN_GATE_UP_UP_TO", 2,
        "MoE inputs of up to this many rows route inside the gate_up programs (no routing "
        "launch); 0 = off", "kb/0036", lo=0, hi=ROUTE_ONE_PROGRAM_UP_TO)
    moe_gemv_up_to: int = _switch(
        "MOE_GEMV_UP_TO", 2,
        "FP8 experts of inputs up to this many rows run as GEMVs, one (token, expert) pair a "
        "program; 0 = tiled GEMMs", "kb/0039", lo=0, hi=ROUTE_ONE_PROGRAM_UP_TO)
    nvfp4_gemv_up_to: int = _switch(
        "NVFP4_GEMV_UP_TO", 64,
        "NVFP4 routed experts (a program per token-expert pair) and lm_head (16 rows a launch) "
        "of inputs up to this many rows run as W4A16 GEMVs on the packed weights; above, they "
        "are dequantized into a bf16 scratch first (all experts of a layer: ~2 GB of traffic); "
        "0 = never", "kb/0065", lo=0, hi=256)
    fp8_dense_dequant: bool = _switch(
        "FP8_DENSE_DEQUANT", True,
        "FP8 dense projections are also held dequantized (2.8 GB) for cuBLAS above the GEMV "
        "sizes: faster prefill and B=32", "kb/0029")
    fp8_gemv_up_to: int = _switch(
        "FP8_GEMV_UP_TO", 2,
        "projections of up to this many rows read their FP8 weights through the FP8 GEMV "
        "(-13 % B=1 step); 0 = off", "kb/0040", lo=0, hi=4)
    bf16_gemv_up_to: int = _switch(
        "BF16_GEMV_UP_TO", 1,
        "bf16 projections of up to this many rows through the GEMV instead of cuBLAS, which "
        "takes no part in PDL; 0 = cuBLAS", "kb/0042", lo=0, hi=4)
    fp8_dense_splitk_up_to: int = _switch(
        "FP8_DENSE_SPLITK_UP_TO", 8,
        "projections above the GEMV's rows and up to this many read FP8 weights through the "
        "split-K GEMM (-2.2 % at B=8); 0 = off", "kb/0049", lo=0, hi=64)
    proj_row_align: int = _switch(
        "PROJ_ROW_ALIGN", 64,
        "fused bf16 projections are padded with zero rows to a multiple of this, so cuBLAS "
        "takes an aligned kernel (1 = none)", "kb/0030", lo=1, hi=256, power_of_2=True)
    moe_grouped: bool = _switch(
        "MOE_GROUPED", True,
        "routed experts of large eager prefill steps through torch's grouped GEMM "
        "(CUTLASS) instead of the Triton expert GEMMs", "kb/0031")
    moe_grouped_from: int = _switch(
        "MOE_GROUPED_FROM", 6144,
        "smallest eager prefill step (tokens) that takes the grouped experts", "kb/0031",
        lo=1, hi=1 << 20)
    moe_w8a8_from: int = _switch(
        "MOE_W8A8_FROM", 0,
        "eager prefill steps of at least this many tokens run FP8 routed experts W8A8 (e4m3 "
        "activations per 128-wide group, FP8 tensor-core dots) instead of the grouped "
        "dequant path or fused_moe W8A16; 0 = off (GPU A/B and FP8 gate owed)", "kb/0061",
        lo=0, hi=1 << 20)
    nvfp4_grouped_from: int = _switch(
        "NVFP4_GROUPED_FROM", 0,
        "steps of at least this many tokens (above the GEMV rows; eager ones and decode "
        "graphs, not prefill graphs) run NVFP4 routed experts as the W4A16 grouped GEMM on the "
        "packed weights instead of dequantizing them into the bf16 scratch each layer (65 = "
        "every such step); 0 = off (GPU timing owed)", "kb/0067",
        lo=0, hi=1 << 20)

    prefill_attention: str = _switch(
        "PREFILL_ATTENTION", "sdpa",
        "a prompt chunk's causal attention on the kernel path: sdpa (key/value heads repeated; "
        "a chunk after a cached context passes a mask, so no flash kernel), flash (SDPA's flash "
        "kernel with the bottom-right mask, grouped heads where it takes them) or fa3 "
        "(FlashAttention-3, lab/build_fa3.sh; also the context-chunk graphs'); GPU A/B and "
        "gates owed; not searched by tune (fa3 needs its library)", "kb/0069",
        choices=("sdpa", "flash", "fa3"), tune=False)
    fa3_lib: str = _switch(
        "FA3_LIB", "",
        "FlashAttention-3 library for prefill_attention=fa3; empty = .fa3/libtailored_fa3.so "
        "beside the package", "kb/0069", numerics=False, tune=False)

    # --- the worker: graphs, dispatch, speculative decoding (worker/) ---
    prompts_in_graphs_up_to: int = _switch(
        "PROMPTS_IN_GRAPHS_UP_TO", 1024,
        "several prompt chunks of a step each replay their own graph while the step has at "
        "most this many tokens; 0 = eager", "kb/0056", "worker", lo=0, hi=65536)
    prompts_in_graphs_chunks: int = _switch(
        "PROMPTS_IN_GRAPHS_CHUNKS", 2,
        "... and at most this many chunks: each replay reads the experts again", "kb/0056",
        "worker", lo=2, hi=256)
    mixed_graph_tokens: int = _switch(
        "MIXED_GRAPH_TOKENS", 0,
        "capture CUDA graphs of decode rows (32+) beside one prompt chunk of up to this many "
        "tokens, so such a step reads the weights once, not twice (beside its decode graph), "
        "and the step budget cuts chunks on their 128-token grid; 0 = off (GPU A/B and "
        "capture time owed)", "kb/0068", "worker", lo=0, hi=2048)
    mixed_eager_from: int = _switch(
        "MIXED_EAGER_FROM", 0,
        "a mixed step whose prompt chunks run eagerly with at least this many tokens takes "
        "its decode rows into the same eager forward (one read of the weights) instead of "
        "replaying their decode graph first; 0 = off (GPU A/B owed)", "kb/0068", "worker",
        lo=0, hi=1 << 20)
    ctx_graphs: bool = _switch(
        "CTX_GRAPHS", True,
        "a prompt chunk after a cached context (prefix-cache hit, long prompt's tail) "
        "replays a CUDA graph instead of an eager step", "kb/0055", "worker")
    ctx_graph_max_pairs: int = _switch(
        "CTX_GRAPH_MAX_PAIRS", 16 * 1024 * 1024,
        "such a chunk takes its graph while new tokens x context keys stay at most this "
        "(each row re-reads the keys); not applied with TAILORED_PREFILL_ATTENTION=fa3", "kb/0055",
        "worker", lo=0, hi=1 << 40)
    gdn_verify_kernels: bool = _switch(
        "GDN_VERIFY_KERNELS", True,
        "a verify step's GDN layers run all its tokens in one launch each instead of token "
        "by token", "kb/0033", "worker")
    mtp_fp8_head: bool = _switch(
        "MTP_FP8_HEAD", True,
        "the MTP drafts through an FP8 copy of lm_head (half the bytes; verify keeps bf16)",
        "kb/0035", "worker", numerics=False)
    spec_drafts_on_device: bool = _switch(
        "SPEC_DRAFTS_ON_DEVICE", True,
        "after a whole verify step the next drafts stay on the device and the next step "
        "launches under the chain", "kb/0035", "worker", numerics=False)

    # --- Triton kernels (kernels/) ---
    gdn_dv_split: int = _switch(
        "GDN_DV_SPLIT", 2,
        "programs per (row, head) of the GDN decode step over the state's value columns "
        "(-3 to -4 % at B=1..32)", "kb/0024", "kernels", lo=1, hi=16, power_of_2=True)
    moe_fp8_dot_f16: bool = _switch(
        "MOE_FP8_DOT_F16", True,
        "FP8 experts' gate_up dots in float16 instead of bf16 (exact for e4m3 values): "
        "faster decode and prefill", "kb/0030", "kernels")
    moe_fp8_down_f16: bool = _switch(
        "MOE_FP8_DOWN_F16", True,
        "FP8 experts' down dots in float16 at decode size where the tuned config says so",
        "kb/0045", "kernels")
    route_align_up_to: int = _switch(
        "ROUTE_ALIGN_UP_TO", ROUTE_ALIGN_MAX_TOKENS,
        "MoE inputs of up to this many rows route + align in one or two launches instead "
        "of ~10 torch kernels", "kb/0024", "kernels", lo=0, hi=ROUTE_ALIGN_MAX_TOKENS)
    pdl: bool = _switch(
        "PDL", True,
        "programmatic dependent launch for every Triton kernel on sm_90 (bitwise the same; "
        "FP8 c=1 +7 %)", "kb/0041", "kernels", numerics=False)
    bf16_gemv_fp8_cfgs: bool = _switch(
        "BF16_GEMV_FP8_CFGS", True,
        "the bf16 GEMV takes the FP8 GEMV's launch configs by shape", "kb/0042", "kernels")
    autotune: bool = _switch(
        "AUTOTUNE", True,
        "Triton autotuning on CUDA; 0 = the fixed configs the interpreter uses (GPU kernel "
        "tests: tuning odd shapes took longer than the tests)", "kb/0020", "kernels")
    tuning: str = _switch(
        "TUNING", "",
        "launch-config table to pre-fill the autotuners from: empty = the shipped "
        "one of this GPU model (kernels/tuned*.json), a path, or 'off'", "kb/0020", "kernels", tune=False)
    tuning_dump: str = _switch(
        "TUNING_DUMP", "",
        "write the launch configs tuned at warm-up to this path (merged with a table of the "
        "same GPU there)", "kb/0020", "kernels", numerics=False, tune=False)

    # --- the engine's scheduler (engine/step_budget.py, docs/scheduling.md) ---
    min_prefill_chunk: int = _switch(
        "MIN_PREFILL_CHUNK", 256,
        "with --prefill-stall-factor on, the oldest prompt gets at least this many tokens "
        "a step however short the time budget (no prompt starves)", "kb/0063", "engine",
        lo=1, hi=1 << 20)

    # --- settings ---
    gdn_state_dtype: str = _switch(
        "GDN_STATE_DTYPE", "auto",
        "default of --gdn-state-dtype: the GDN recurrent states' storage (auto = bf16 for a "
        "bf16 model)", "kb/0056", "settings", choices=GDN_STATE_DTYPES)
    cache: str = _switch(
        "CACHE", "",
        "directory for generated files (the embedded tiny checkpoint); empty = "
        "~/.cache/tailored", "", "settings")
    commit: str = _switch(
        "COMMIT", "",
        "the commit manifests record when the tree has no git (a copy on the GPU machine)",
        "", "settings")
    api_key: str = _switch(
        "API_KEY", "",
        "API keys `tailored serve` / `tailored cluster` accept, comma-separated, beside "
        "--api-key and --api-key-file (docs/serving.md); never shown", "", "settings",
        secret=True)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check(f, getattr(self, f.name))

    @classmethod
    def from_env(cls, environ=None) -> "Flags":
        """The record from `environ` (default os.environ): unset or empty variables keep
        their defaults. Raises ValueError naming the variable for an unknown TAILORED_* name
        or a bad value."""
        env = os.environ if environ is None else environ
        known = {f.metadata["env"]: f for f in dataclasses.fields(cls)}
        refuse_unknown(env, PREFIX, known, "tailored", "docs/switches.md")
        values = {}
        for name, f in known.items():
            raw = env.get(name, "").strip()
            if raw:
                values[f.name] = _parse(f, raw)
        return cls(**values)

    def replace(self, **changes) -> "Flags":
        """A copy with fields changed (validated; unknown names raise TypeError)."""
        return dataclasses.replace(self, **changes)

    def snapshot(self) -> dict:
        """{variable name: value} of every switch: what manifests record (a secret one's
        value is "(set)" or empty)."""
        return shown(self)

    def changed(self) -> dict:
        """{variable name: value} of the switches away from their defaults."""
        return shown(self, changed_only=True)


def shown(record, changed_only: bool = False) -> dict:
    """{variable name: value} of a switch table's record (this one's, sammie's), a secret
    switch's value as "(set)" or empty; changed_only: the switches away from their defaults."""
    out = {}
    for f in dataclasses.fields(record):
        v = getattr(record, f.name)
        if not changed_only or v != f.default:
            out[f.metadata["env"]] = ("(set)" if v else v) if f.metadata["secret"] else v
    return out


def refuse_unknown(environ, prefix: str, known, table: str, docs: str) -> None:
    """ValueError for the first variable of `environ` that starts with `prefix` and is not in
    `known` (a typo must not be a silent default), with the closest known name as a hint; the
    switch tables of tailored and of sammie share it."""
    for name in environ:
        if name.startswith(prefix) and name not in known:
            near = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise ValueError(f"{name}: not a {table} switch{hint}; {docs} lists them")


def _check(f: dataclasses.Field, v) -> None:
    m, name = f.metadata, f.metadata["env"]
    if f.type in ("bool", bool):
        if not isinstance(v, bool):
            raise ValueError(f"{name}={v!r}: expected 0 or 1")
    elif f.type in ("int", int):
        if (isinstance(v, bool) or not isinstance(v, int) or not m["lo"] <= v <= m["hi"]
                or (m["power_of_2"] and v & (v - 1))):
            kind = "a power of 2" if m["power_of_2"] else "an integer"
            raise ValueError(f"{name}={v!r}: expected {kind} in [{m['lo']}, {m['hi']}]")
    elif not isinstance(v, str) or (m["choices"] and v not in m["choices"]):
        raise ValueError(f"{name}={v!r}: expected one of {', '.join(m['choices'] or ())}")


def _parse(f: dataclasses.Field, raw: str):
    name = f.metadata["env"]
    if f.type in ("bool", bool):
        if raw not in ("0", "1"):
            raise ValueError(f"{name}={raw!r}: expected 0 or 1")
        return raw == "1"
    if f.type in ("int", int):
        try:
            return int(raw)
        except ValueError:
            _check(f, raw)  # raises, naming the range
    return raw


def set_in_env(environ=None) -> frozenset[str]:
    """The switches' variables `environ` (default os.environ) sets to a non-empty value: the
    ones an explicit environment setting outranks (e.g. a serve profile's switches give way)."""
    env = os.environ if environ is None else environ
    return frozenset(f.metadata["env"] for f in dataclasses.fields(Flags)
                     if env.get(f.metadata["env"], "").strip())


R = TypeVar("R")  # a switch table's record class


class Active(Generic[R]):
    """The active record of a switch table (this one, sammie's): parsed from the environment
    at the first `current()` unless a start-up `activate`d one, which is how the engine
    process takes its parent's. One per table; the table's module exposes its methods."""

    def __init__(self, kind: type[R]) -> None:
        self.kind = kind
        self.record: R | None = None

    def current(self) -> R:
        """The active record; the first call without an `activate` parses the environment."""
        if self.record is None:
            self.record = self.kind.from_env()
        return self.record

    def activate(self, record: R) -> R:
        """Make `record` the active one (start-up: the CLI, build_stack, the engine process)."""
        if not isinstance(record, self.kind):
            raise TypeError(f"activate: a {self.kind.__module__}.{self.kind.__name__} record, "
                            f"got {type(record).__module__}.{type(record).__name__}")
        self.record = record
        return record

    @contextmanager
    def override(self, **changes):
        """The active record with `changes` for the duration of a `with` block (tests, A/Bs)."""
        before = self.current()
        self.record = dataclasses.replace(before, **changes)
        try:
            yield self.record
        finally:
            self.record = before


_active: Active[Flags] = Active(Flags)
current = _active.current
activate = _active.activate
override = _active.override


def markdown() -> str:
    """docs/switches.md: the table, grouped by layer."""
    out = ["# Switches", "",
           "Every `TAILORED_*` environment variable `tailored` reads, generated from "
           "`tailored/flags.py` (`python -m tailored.flags > docs/switches.md`). An unknown "
           "`TAILORED_*` name or a bad value stops the start with a message naming it. "
           "Manifests of the gate and the benchmarks record every value. *numerics*: flipping "
           "it may change output bits, so `tailored tune` lets it in only where the contract "
           "allows numerics to change and the accuracy gate passes (docs/tune.md).", ""]
    groups: dict[str, list] = {}
    for f in dataclasses.fields(Flags):
        groups.setdefault(f.metadata["layer"], []).append(f)
    for layer, fs in groups.items():
        out += [f"## {layer}", "", "| variable | default | values | why | kb | numerics |",
                "|---|---|---|---|---|---|"]
        for f in fs:
            m = f.metadata
            if f.type in ("bool", bool):
                values, default = "0 / 1", str(int(f.default))
            elif f.type in ("int", int):
                values = f"{m['lo']}..{m['hi']}" + (", power of 2" if m["power_of_2"] else "")
                default = str(f.default)
            else:
                values = " / ".join(m["choices"]) if m["choices"] else "text"
                default = f.default or "(empty)"
            out.append(f"| `{m['env']}` | {default} | {values} | {m['why']} | {m['kb']} | "
                       f"{'changes' if m['numerics'] else 'same'} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(markdown())
