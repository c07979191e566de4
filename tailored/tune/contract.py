"""The deployment contract: what a deployment serves and what it must meet (docs/tune.md).

A YAML file, validated with pydantic. Every error names the field (dotted path) and the fix:

    contract.yaml: traffic.concurrency: must be >= 1 (got 0); fix: the requests in flight ...

`load_contract(path)` returns a `Contract`; `ContractError` is a ValueError, so the CLI prints
it as one line. Unknown fields are errors too (a typo would otherwise tune for the default).
"""

from __future__ import annotations

import difflib
import hashlib
import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

GOALS = ("throughput", "latency")
PROMPT_SOURCES = ("random", "chat-mix", "agent-mix")


class ContractError(ValueError):
    """A contract that cannot be used; the message names the field and the fix."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SharedPrefix(_Strict):
    """Conversations over shared system prompts (the bench's agent mix)."""

    system_prompts: int = Field(4, ge=1, description="distinct system prompts")
    tokens: int = Field(2000, ge=16, description="tokens of each system prompt")
    turns: int = Field(4, ge=1, description="turns per conversation")
    conversations: int = Field(16, ge=1, description="conversations in the run")


class Traffic(_Strict):
    prompts: str = Field("random", description="random | chat-mix | agent-mix | a JSONL path "
                         "(lines {prompt} or {messages}, optional max_tokens: the length "
                         "distribution)")
    input_tokens: int = Field(1024, ge=1, description="random prompts: tokens in")
    output_tokens: int = Field(256, ge=1, description="tokens out (max_tokens, EOS ignored)")
    concurrency: int | None = Field(None, ge=1, description="closed loop: requests in flight")
    request_rate: float | None = Field(None, gt=0, description="Poisson arrivals, requests/s "
                                       "(concurrency then caps the requests in flight)")
    num_prompts: int | None = Field(None, ge=1, description="requests per measurement "
                                    "(default: 8 x concurrency, at least 8)")
    structured_share: float = Field(0.0, ge=0, le=1, description="share of response_format "
                                    "requests")
    tool_share: float = Field(0.0, ge=0, le=1, description="share of tool-calling requests")
    long_context_share: float = Field(0.0, ge=0, le=1, description="share of prompts past 32k")
    shared_prefix: SharedPrefix | None = Field(None, description="conversations over shared "
                                               "system prompts (prompts: agent-mix)")

    @model_validator(mode="after")
    def _shape(self):
        if self.concurrency is None and self.request_rate is None:
            raise ValueError("give traffic.concurrency or traffic.request_rate")
        if self.prompts not in PROMPT_SOURCES and not self.prompts.endswith(".jsonl"):
            raise ValueError(f"traffic.prompts must be one of {', '.join(PROMPT_SOURCES)} or "
                             f"a .jsonl file, got {self.prompts!r}")
        if self.prompts == "agent-mix" and self.request_rate is not None:
            raise ValueError("traffic.request_rate does not apply to prompts: agent-mix (turns "
                             "are sent as answers end): give traffic.concurrency")
        return self

    @property
    def requests(self) -> int:
        return self.num_prompts or max(8, 8 * (self.concurrency or 1))

    @property
    def has_shared_prefix(self) -> bool:
        return self.shared_prefix is not None or self.prompts == "agent-mix"


class SLO(_Strict):
    ttft_p50_ms: float | None = Field(None, gt=0)
    ttft_p99_ms: float | None = Field(None, gt=0)
    itl_p99_ms: float | None = Field(None, gt=0)
    min_output_tok_s: float | None = Field(None, gt=0, description="output tokens/s, all "
                                           "requests together")

    def bounds(self) -> dict[str, tuple[str, float]]:
        """{bench result key: ('<=' | '>=', bound)} of the SLOs set."""
        out = {}
        for field, key, op in (("ttft_p50_ms", "p50_ttft_ms", "<="),
                               ("ttft_p99_ms", "p99_ttft_ms", "<="),
                               ("itl_p99_ms", "p99_itl_ms", "<="),
                               ("min_output_tok_s", "output_throughput", ">=")):
            v = getattr(self, field)
            if v is not None:
                out[key] = (op, float(v))
        return out


class Memory(_Strict):
    gpu_memory_utilization: float = Field(0.90, gt=0, le=1)
    max_model_len: int | None = Field(None, ge=16, description="default: the traffic's longest "
                                      "request with a margin")


class Numerics(_Strict):
    may_change: bool = Field(False, description="may a candidate change the numerics (within "
                             "the accuracy gate)?")
    gate_prompts: list[str] | None = Field(None, description="the gate's prompts a "
                                           "numerics-changing candidate must pass (default: "
                                           "chosen from the traffic)")
    gate_max_new_tokens: int = Field(32, ge=1, le=512)


class Search(_Strict):
    trials: int = Field(20, ge=1, le=10000, description="candidates measured, the defaults "
                        "included")
    time_budget_s: float | None = Field(None, gt=0)
    seed: int = 0
    options: list[str] | None = Field(None, description="engine options searched (default: "
                                      "all that apply); tailored tune --list-space")
    switches: list[str] | Literal["auto", "none", "all"] = Field(
        "auto", description="TAILORED_* switches searched: auto = the kernel path's on a GPU, "
        "none on the CPU")
    fixed: dict[str, int | float | str | bool] = Field(default_factory=dict, description=
                                                       "options pinned to a value")


class Contract(_Strict):
    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    checkpoint: str | None = Field(None, description="checkpoint directory (default: the "
                                   "embedded nano model)")
    precision: Literal["bf16", "fp8"] | None = Field(None, description="the checkpoint's "
                                                     "weights (checked against config.json)")
    gpu: str = Field("cpu", description="H200, H100 or cpu: the profile is refused elsewhere")
    goal: Literal["throughput", "latency"] = "throughput"
    traffic: Traffic
    slo: SLO = Field(default_factory=SLO)
    memory: Memory = Field(default_factory=Memory)
    numerics: Numerics = Field(default_factory=Numerics)
    search: Search = Field(default_factory=Search)

    def sha256(self) -> str:
        return hashlib.sha256(json.dumps(self.model_dump(mode="json"), sort_keys=True)
                              .encode()).hexdigest()


# the fix each field's error suggests (dotted path prefixes, longest match first)
FIXES = {
    "name": "a short id of letters, digits, '.', '_' or '-' (it names the study and files)",
    "precision": "bf16 or fp8, as the checkpoint's config.json has it (quantization_config: "
                 "fp8)",
    "goal": "throughput (most output tokens/s within the SLOs) or latency (lowest TTFT p99 "
            "within them)",
    "traffic": "see docs/tune.md#the-contract for the traffic fields",
    "traffic.concurrency": "the requests in flight, an integer >= 1 (e.g. 1 for one user, 64 "
                           "for a batch job)",
    "traffic.request_rate": "requests per second > 0, or leave it out for a closed loop",
    "traffic.prompts": "random, chat-mix, agent-mix or the path of a .jsonl prompt file",
    "traffic.input_tokens": "prompt tokens, an integer >= 1",
    "traffic.output_tokens": "max_tokens of each request, an integer >= 1",
    "slo": "latency bounds in ms > 0, throughput in tokens/s > 0; leave out those you do not "
           "have",
    "memory.gpu_memory_utilization": "a share of GPU memory in (0, 1], e.g. 0.9",
    "numerics.may_change": "true lets candidates that change numerics in, if they pass the "
                           "accuracy gate; false keeps the defaults' exact outputs",
    "search.trials": "how many candidates to measure, e.g. 20 (4-6 for a smoke run)",
    "search.switches": "auto, none, all, or a list of TAILORED_* names (docs/switches.md)",
}


def _fix(loc: str) -> str:
    for k in sorted(FIXES, key=len, reverse=True):
        if loc == k or loc.startswith(k + "."):
            return FIXES[k]
    return "see docs/tune.md#the-contract"


def _known(loc: tuple) -> list[str]:
    model: type[BaseModel] | None = Contract
    for part in loc[:-1]:
        f = model.model_fields.get(str(part)) if model else None
        ann = getattr(f, "annotation", None)
        model = next((a for a in (ann, *getattr(ann, "__args__", ())) if isinstance(a, type)
                      and issubclass(a, BaseModel)), None)
    return list(model.model_fields) if model else []


def _message(e: ValidationError, source: str) -> str:
    lines = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            near = difflib.get_close_matches(str(err["loc"][-1]), _known(err["loc"]), n=1)
            hint = f"did you mean {near[0]!r}?" if near else f"known: {', '.join(_known(err['loc']))}"
            lines.append(f"{source}: {loc}: unknown field; fix: remove it ({hint})")
            continue
        got = err.get("input")
        shown = "" if err["type"] == "missing" or isinstance(got, dict) else f" (got {got!r})"
        if err["type"] == "missing":
            msg = "required field missing"
        lines.append(f"{source}: {loc}: {msg}{shown}; fix: {_fix(loc)}")
    return "\n".join(lines)


def parse_contract(data, source: str = "contract") -> Contract:
    if not isinstance(data, dict):
        raise ContractError(f"{source}: expected a mapping of fields (name, traffic, slo, ...), "
                            f"got {type(data).__name__}; fix: see docs/tune.md#the-contract")
    try:
        return Contract.model_validate(data)
    except ValidationError as e:
        raise ContractError(_message(e, source)) from None


def load_contract(path: str | Path) -> Contract:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ContractError(f"{p}: no such contract file")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ContractError(f"{p}: not valid YAML: {e}") from None
    return parse_contract(data, p.name)
