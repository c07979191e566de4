"""Typed records passed between the stages of one engine step.

    server --Request--> Engine.add_request
    Engine.step():  Scheduler.schedule() -> SchedulerOutput
                    ModelRunner.execute(SchedulerOutput) -> ModelOutput      (the only GPU-touching stage)
                    Scheduler.update(SchedulerOutput, ModelOutput) -> finished/stopped requests
                    Detokenizer -> RequestOutput (delta text) --> server

None of these records hold tensors (`ModelOutput.token_ids` is a Python dict, copied from the
device once per step), but for the sampler's cache of a request's logit_bias as two small CPU
tensors (`SamplingParams._bias_cache`, built at its first step, never sent between processes).
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any


GREEDY_TEMPERATURE = 1e-5  # the sampler picks greedily below this temperature (worker/sampler.py)
MAX_LOGPROBS = 20  # most likely alternatives a token's logprobs may list (OpenAI's limit)
# the output id of a step whose result the host has not read yet (async scheduling: the
# worker feeds the device-side id into the next step; Scheduler.resolve fills it in)
PENDING_TOKEN = -1


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS id, stop token id or stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # client went away / cancelled
    ERROR = "error"  # the engine could not run the request (message in RequestOutput.error)


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no pages/slot
    RUNNING = "running"  # holds a state slot and KV pages
    FINISHED = "finished"


@dataclass
class SamplingParams:
    """Per-request decoding settings (OpenAI semantics; vLLM names for the extensions).

    temperature == 0 means greedy. top_k <= 0 and top_p == 1 and min_p == 0 disable those filters.
    Penalties follow OpenAI (presence/frequency, additive on logits of generated tokens) and
    CTRL/vLLM (repetition, divides positive / multiplies negative logits of prompt+output tokens).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # None: no logprobs; k in 0..MAX_LOGPROBS: each generated token's logprob and its k most
    # likely alternatives (TokenLogprob)
    logprobs: int | None = None
    # None: none; k in 0..MAX_LOGPROBS: each prompt token's logprob given the tokens before it
    # (the first has none) and its k most likely alternatives (vLLM's prompt_logprobs; OpenAI's
    # echo). Such a request computes its whole prompt: it takes no prefix-cache hit
    prompt_logprobs: int | None = None
    # EOS and stop token ids are masked, and stop strings not looked for, until this many
    # tokens are out (vLLM's and SGLang's min_tokens)
    min_tokens: int = 0
    # OpenAI's logit_bias: token id -> a value added to its logit before anything else
    logit_bias: dict[int, float] | None = None
    # the sampler's (ids, biases) of logit_bias, built at the request's first step (it would
    # otherwise rebuild up to 1024 entries a row every step: 36 ms at 128 rows)
    _bias_cache: Any = field(default=None, init=False, repr=False, compare=False)
    # structured output (OpenAI response_format): the tokens are held to a JSON grammar
    structured: StructuredOutput | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        """Any penalty on: sampling then reads the request's token history on the host."""
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def can_draft(self) -> bool:
        """Whether speculative decoding may draft for this request (worker/drafter.py): the sampler
        picks greedily (temperature below GREEDY_TEMPERATURE), no penalty reads the token
        history, which drafts would extend before they are verified, and no logprobs are asked
        (the sampler gives them for one token a row; a request that drafts gets several), and
        no logit_bias (the MTP head would draft unbiased tokens, mostly rejected), and no
        structured output (its grammar masks one token a row, from the tokens before it), and
        no min_tokens (its stop-id mask depends on the row's count of tokens out)."""
        return (self.temperature < GREEDY_TEMPERATURE and not self.uses_penalties
                and self.logprobs is None and not self.logit_bias and self.structured is None
                and self.min_tokens == 0)


@dataclass(frozen=True)
class StructuredOutput:
    """A grammar the generated text must follow (engine/grammar.py; OpenAI `response_format`).

    kind: "json_object" (any JSON object), "json_schema" (`schema`: the JSON Schema as JSON
    text), or vLLM's `structured_outputs` kinds: "regex" (`schema`: the pattern), "choice"
    (`schema`: a JSON list of the allowed strings), "grammar" (`schema`: xgrammar EBNF), or
    "tool_calls" (a chat request's forced tool calls, `schema`: JSON {"tools": the OpenAI
    tools, "tool_choice": "required" or {"type": "function", "function": {"name": ...}},
    "parallel_tool_calls": bool}). Picklable: it travels to the engine process with
    SamplingParams; the grammar is compiled there. Frozen: the grammar cache's key."""

    kind: str
    schema: str | None = None
    # JSON kinds: no free whitespace (vLLM's disable_any_whitespace; xgrammar's compact
    # separators), for models that would spend tokens on it
    compact: bool = False

    @property
    def field(self) -> str:
        """The request field it came from, for error messages (a json_schema from
        `structured_outputs.json` is named response_format)."""
        if self.kind == "tool_calls":
            return "tool_choice"
        return "structured_outputs" if self.kind in ("regex", "choice", "grammar") \
            else "response_format"


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability (natural log) under the model's distribution
    (log_softmax of its raw logits: before penalties, temperature and top-k/p, as vLLM's
    default `raw_logprobs`), and `top`: the k most likely tokens [(id, logprob)], most likely
    first. A value that is not finite (NaN logits) is given as -9999.0, as OpenAI does for
    tokens of no probability, so the JSON stays valid. rank: the token's rank in that
    distribution, 1 + the number of other tokens at least as likely (vLLM's `rank`); given for
    prompt logprobs only (None for generated tokens)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    rank: int | None = None


_req_counter = itertools.count()


@dataclass
class Request:
    """One generation request inside the engine.

    prompt_ids: token ids of the prompt (no BOS is added for this model).
    output_ids: generated ids so far.
    num_computed_tokens: tokens whose KV / GDN state is already in the cache (prompt + output).
    pages: KV page ids (index 0 never handed out; it is the pad sink).
    slot: GDN state slot (0 = none / pad sink).
    """

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...] = (248046, 248044)
    arrival_time: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    pages: list[int] = field(default_factory=list)
    slot: int = 0
    finish_reason: FinishReason | None = None
    seq_no: int = field(default_factory=lambda: next(_req_counter))
    draft_ids: list[int] = field(default_factory=list)  # MTP drafts for the next step
    num_new_tokens: int = 0  # output ids the last Scheduler.resolve appended
    new_logprobs: list[TokenLogprob] | None = None  # theirs, with SamplingParams.logprobs
    num_cached_tokens: int = 0  # prompt tokens a prefix-cache hit supplied (engine/prefix_cache.py)
    # with SamplingParams.prompt_logprobs: the logprob of each prompt token given those before
    # it (None for the first, and for positions not computed yet); handed out once, complete
    prompt_logprobs: list | None = None
    prompt_logprobs_sent: bool = False

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_prefill(self) -> bool:
        """True while prompt tokens remain to be computed."""
        return self.num_computed_tokens < len(self.prompt_ids)


@dataclass(frozen=True)
class ScheduledSeq:
    """One request's share of a step.

    token_ids: the tokens to run this step (a prompt chunk, or the last sampled token for decode).
    start_pos: position of token_ids[0] (= tokens already in the cache).
    slot: GDN state slot; reset_state: zero the slot before running (first chunk of a request).
    page_ids: KV pages covering positions [0, start_pos + len(token_ids)).
    sample: whether this step ends at the prompt's last token or is a decode (a token is sampled).
    """

    request_id: str
    token_ids: tuple[int, ...]
    start_pos: int
    slot: int
    reset_state: bool
    page_ids: tuple[int, ...]
    sample: bool
    sampling: SamplingParams
    # ids used for penalties: prompt ids and output ids so far (only filled when penalties are on)
    prompt_ids: tuple[int, ...] = ()
    output_ids: tuple[int, ...] = ()
    num_generated: int = 0  # tokens already generated (seeds the per-request RNG stream)
    # speculative decoding (worker/drafter.py), for requests that draft:
    num_draft: int = 0  # the last num_draft of token_ids are MTP drafts to verify
    mtp: bool = False  # run the MTP head over this chunk (its KV cache) after the target
    num_propose: int = 0  # drafts to propose for the next step (when sample)
    next_token: int = -1  # the known token after a chunk that does not sample (the MTP's input)
    # structured output: the tokens its grammar allows next, a packed bitmask (int32 CPU tensor
    # [ceil(vocab / 32)], bit j of word i = token 32 i + j; engine/grammar.py); None: any
    allowed: Any = None
    # ids the sampler must not pick this step: the stop ids while fewer than min_tokens are out
    banned_ids: tuple[int, ...] = ()
    # prompt logprobs (SamplingParams.prompt_logprobs = k): the token after each of this
    # chunk's first len(logprob_targets) rows, whose logprob (and the row's top k) is wanted
    logprob_targets: tuple[int, ...] = ()


@dataclass(frozen=True)
class SchedulerOutput:
    """What to run this step. Decode sequences come first, then prefill chunks."""

    seqs: tuple[ScheduledSeq, ...]
    num_tokens: int
    # prefix caching (engine/prefix_cache.py), run by the runner in stream order: before the
    # forward, (snapshot slot, request slot) state copies and (page, page) KV copies of the
    # requests admitted on a cached prefix; after it, the snapshots (prefix_cache.Snapshot)
    # of the prompts this step completes
    state_copies: tuple[tuple[int, int], ...] = ()
    page_copies: tuple[tuple[int, int], ...] = ()
    snapshots: tuple = ()

    @property
    def empty(self) -> bool:
        return not self.seqs


@dataclass(frozen=True)
class ModelOutput:
    """Sampled token per scheduled sequence with `sample=True` (request_id -> token id).
    bad: requests whose token is the sampler's NaN fallback (sampler.Sampled)."""

    token_ids: dict[str, int]
    bad: frozenset[str] = frozenset()
    # speculative decoding: the tokens a verify chunk emits after token_ids[id] (its kept
    # drafts' successors), and the drafts proposed for each request's next step
    extra_ids: dict[str, tuple[int, ...]] = field(default_factory=dict)
    draft_ids: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # requests that asked for logprobs: those of token_ids[id] (they never draft)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    # prompt logprobs: request id -> (position of the first, TokenLogprobs of the chunk's
    # logprob_targets in order)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)


@dataclass
class RequestOutput:
    """What the server sees after each step for one request.

    delta_text: text new since the last RequestOutput (never a broken UTF-8 sequence).
    delta_token_ids: ids new since the last RequestOutput.
    finished: True on the last output; finish_reason then says why.
    delta_logprobs: with SamplingParams.logprobs, one TokenLogprob per delta_token_ids entry.
    """

    request_id: str
    delta_text: str
    delta_token_ids: list[int]
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    error: str | None = None
    delta_logprobs: list[TokenLogprob] | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (usage's cached_tokens)
    # with SamplingParams.prompt_logprobs, in the first output after the prompt ran: one entry
    # per prompt token, None for the first
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # the error is the request's fault (a grammar that failed to compile after the request was
    # admitted): the server answers 400 instead of 500
    bad_request: bool = False
