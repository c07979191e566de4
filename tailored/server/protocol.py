"""The request parameters and response objects common to the OpenAI APIs (exact OpenAI field
names): `BaseRequest` (sampling, stop, structured output, streaming), `UsageInfo`, the model list.

The schemas, by API: completions_protocol.py (`CompletionRequest` and its responses),
chat_protocol.py (`ChatCompletionRequest`, messages, chat responses and chunks),
tools_protocol.py (function tools and tool_choice), structured.py (`response_format`,
`structured_outputs`), errors.py (`OpenAIError`), json_screen.py (raw-body checks); the front
doors' own: responses_protocol.py (OpenAI Responses), messages_protocol.py (Anthropic
Messages), both translated into a `ChatCompletionRequest`.

Validation happens in three stages:
0. the server refuses bodies nested deeper than MAX_JSON_DEPTH (`json_too_deep`, before
   parsing) and, via `check_json_body`, any string (anywhere, keys included) holding a lone
   UTF-16 surrogate, naming the field.
1. `Model.model_validate(body)` checks types and ranges; `validation_error_to_openai` turns a
   pydantic ValidationError into one readable `OpenAIError` naming the field(s).
2. `request.check_supported()` raises `OpenAIError` for parameters that would change the result
   but are not implemented (best_of > 1, suffix, ...) and for combinations that cannot be
   honoured (prompt_logprobs with stream, min_tokens over max_tokens, ...). Other unknown
   fields are ignored.
`request.sampling_params(max_tokens, defaults)` then builds the engine's `SamplingParams`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

from tailored.engine.types import MAX_LOGPROBS, SamplingParams, StructuredOutput
from tailored.server.errors import OpenAIError, shown
from tailored.server.structured import ResponseFormat, StructuredOutputsParams

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP_STRINGS = 4  # OpenAI's limit
# characters a stop string may have: the detokenizer re-checks a tail of this length after each
# token, so megabyte stop strings made every token of the request slower (and any match needs
# that much output first)
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024  # the engine checks each sampled token against them
MAX_LOGIT_BIAS = 1024  # biased tokens a request (the sampler adds them in one indexed write)
MAX_CHOICES = 128  # `n`: pass@k evaluations ask for up to ~100 samples of one prompt
MAX_PROMPTS = 128  # a completions batch; prompts x n is capped at MAX_CHOICES too
# repetition_penalty outside this range only produces inf/NaN logits (or no effect at all)
REPETITION_PENALTY_MIN, REPETITION_PENALTY_MAX = 0.01, 100.0
# reasoning effort (chat's `reasoning_effort`, the Responses API's `reasoning.effort`): the
# values OpenAI takes; "none" and "minimal" turn the thinking off (the chat template's
# enable_thinking false, as vLLM maps them), every other effort leaves it on
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
THINKING_OFF_EFFORTS = ("none", "minimal")


def thinking_for_effort(effort: str | None) -> bool | None:
    """The chat template's enable_thinking for a reasoning effort (None: no effort given, the
    template's default)."""
    return None if effort is None else effort not in THINKING_OFF_EFFORTS


def unset(value: Any) -> bool:
    """True for the values that mean "feature off": None, False, 0, "", [] and {}."""
    return value is None or value in (False, 0, "", [], {})


def one_or_unset(value: Any) -> bool:
    return value is None or value == 1


# strict: no silent coercions such as true -> 1.0 or "42" -> 42 (ints are still accepted for
# floats); allow_inf_nan=False: JSON's NaN/Infinity extensions are not valid sampling values.
REQUEST_CONFIG = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk also carries its choice's usage so far
    continuous_usage_stats: bool = False


class BaseRequest(BaseModel):
    """Parameters shared by both APIs. Ranges follow OpenAI (and vLLM for the extensions)."""

    model_config = REQUEST_CONFIG  # unknown fields are kept to be screened, then ignored

    model: str | None = None  # omitted = the served model
    # 0: the prompt alone, only with prompt logprobs (`check_supported`)
    max_tokens: int | None = Field(None, ge=0)
    # EOS and stop strings are ignored until this many tokens are out (vLLM's, SGLang's)
    min_tokens: int | None = Field(None, ge=0)
    # vLLM's prompt_logprobs: each prompt token's logprob given those before it and its k most
    # likely alternatives (completions: per choice; chat: at the response's top level)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0 = disabled
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(
        None, ge=REPETITION_PENALTY_MIN, le=REPETITION_PENALTY_MAX
    )
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] | None = None
    # {"token id": bias in [-100, 100]} (OpenAI); the server checks the ids against the vocab
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None  # only with stream: true (as OpenAI and vLLM)
    # choices: n engine requests of the one prompt (each prefilled: no prefix sharing yet)
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None  # vLLM's extension
    user: str | None = None

    # Parameters that would change the result but are not implemented: name -> "is this value
    # harmless?". They are looked up among the declared fields and the extra fields; any other
    # unknown field is ignored silently (metadata, store, service_tier, parallel_tool_calls, ...).
    UNSUPPORTED: ClassVar[dict[str, Callable[[Any], bool]]] = {
        "best_of": one_or_unset,
        "top_logprobs": unset,  # chat requests take it (ChatCompletionRequest)
        "echo": unset,
        "suffix": unset,
        "tools": unset,  # chat requests take them (ChatCompletionRequest)
        "tool_choice": lambda v: v is None or v == "none",
        "functions": unset,
        "function_call": lambda v: v is None or v == "none",
        "continue_final_message": unset,
        "guided_json": unset,
        "guided_regex": unset,
        "guided_choice": unset,
        "guided_grammar": unset,
        "use_beam_search": unset,
        "truncate_prompt_tokens": unset,
        "bad_words": unset,
        "allowed_token_ids": unset,
        "logits_processors": unset,
        "prompt_embeds": unset,
    }

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if not v:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} tokens may be biased, got {len(v)}")
        for key, bias in v.items():
            if not key.isdecimal() or not key.isascii() or len(key) > 12:
                raise ValueError(f"keys must be token ids written as strings (got {shown(key)})")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"biases must be in [-100, 100] (got {bias} for {key})")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _check_stop(cls, v: Any) -> list[str]:
        if v is None:
            return []
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise ValueError("must be a string or a list of strings")
        if len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(v)}")
        if any(s == "" for s in v):
            raise ValueError("stop strings must not be empty")
        longest = max(map(len, v), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise ValueError(f"stop strings may have at most {MAX_STOP_STRING_CHARS} characters, "
                             f"got {longest}")
        return v

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _check_stop_token_ids(cls, v: Any) -> Any:
        # before the per-item validation: a huge list is refused without walking it
        if isinstance(v, list) and len(v) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"at most {MAX_STOP_TOKEN_IDS} stop token ids are allowed, got {len(v)}"
            )
        return v

    def check_supported(self) -> None:
        """Raise OpenAIError(400) naming the first parameter we cannot honour."""
        if (self.structured_outputs is not None and self.response_format is not None
                and self.response_format.type != "text"):
            raise OpenAIError("set 'response_format' or 'structured_outputs', not both",
                              param="structured_outputs")
        if self.stream_options is not None and not self.stream:
            raise OpenAIError("parameter 'stream_options' is only allowed when 'stream' is true",
                              param="stream_options")
        if self.prompt_logprobs is not None and self.stream:
            # as vLLM: a stream chunk has no place for them
            raise OpenAIError("parameter 'prompt_logprobs' is not available with 'stream': "
                              "true", param="prompt_logprobs")
        requested, name = self.requested_max_tokens, self.max_tokens_param
        if requested == 0 and self.engine_prompt_logprobs is None:
            raise OpenAIError(f"'{name}' must be at least 1 (0, the prompt alone, only "
                              f"{self.PROMPT_ALONE_WITH})", param=name)
        if self.min_tokens and requested is not None and self.min_tokens > requested:
            raise OpenAIError(f"'min_tokens' ({self.min_tokens}) must not exceed '{name}' "
                              f"({requested})", param="min_tokens")
        extra = self.model_extra or {}
        for name, harmless in self.UNSUPPORTED.items():
            value = getattr(self, name) if name in type(self).model_fields else extra.get(name)
            if not harmless(value):
                raise OpenAIError(
                    f"parameter '{name}' is not supported by this server (got {shown(value)})",
                    param=name,
                    code="unsupported_parameter",
                )

    # where max_tokens 0 is allowed (the 400's words)
    PROMPT_ALONE_WITH: ClassVar[str] = "with prompt_logprobs"

    def sampling_params(self, max_tokens: int, defaults: dict | None = None) -> SamplingParams:
        """Engine settings; omitted fields come from `defaults` (e.g. generation_config.json),
        then from SamplingParams' own defaults."""
        base = SamplingParams()
        defaults = defaults or {}

        def pick(name: str):
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, getattr(base, name))

        return SamplingParams(
            max_tokens=max_tokens,
            temperature=pick("temperature"),
            top_p=pick("top_p"),
            top_k=pick("top_k"),
            min_p=pick("min_p"),
            seed=pick("seed"),
            presence_penalty=pick("presence_penalty"),
            frequency_penalty=pick("frequency_penalty"),
            repetition_penalty=pick("repetition_penalty"),
            stop=list(self.stop),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=self.logprobs_k,
            prompt_logprobs=self.engine_prompt_logprobs,
            min_tokens=self.min_tokens or 0,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} or None
            if self.logit_bias else None,
            structured=self.structured_output(),
        )

    def structured_output(self) -> StructuredOutput | None:
        """The grammar of `response_format` or `structured_outputs` (one of them: `check`)."""
        if self.structured_outputs is not None:
            return self.structured_outputs.structured()
        return self.response_format.structured() if self.response_format else None

    @property
    def logprobs_k(self) -> int | None:
        """SamplingParams.logprobs: None, or how many alternatives each token lists."""
        return None

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """SamplingParams.prompt_logprobs: None, or how many alternatives each prompt token
        lists (the most any part of the answer shows)."""
        return self.prompt_logprobs

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        """Name of the field the completion budget came from, for error messages."""
        return "max_tokens"

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """stream_options.continuous_usage_stats with include_usage (vLLM's rule)."""
        return self.include_usage and self.stream_options.continuous_usage_stats



class UsageInfo(BaseModel):
    """OpenAI's usage; `prompt_tokens_details` ({"cached_tokens": n}, OpenAI's field) only
    when the prefix cache (engine/prefix_cache.py) supplied n > 0 of the prompt tokens."""

    model_config = ConfigDict(extra="allow")  # prompt_tokens_details, when there is one
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int,
           cached_tokens: int = 0) -> UsageInfo:
        details = {"prompt_tokens_details": {"cached_tokens": cached_tokens}} \
            if cached_tokens else {}
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            **details,
        )


def unix_now() -> int:
    return int(time.time())


class PromptLogprobsOut(BaseModel):
    """A response part with vLLM's `prompt_logprobs` of the prompt (formatter.py): left out of
    the JSON unless the request asked for them."""

    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None

    @model_serializer(mode="wrap")
    def _drop_unasked(self, handler):
        d = handler(self)
        if d.get("prompt_logprobs") is None:
            d.pop("prompt_logprobs", None)
        return d


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=unix_now)
    owned_by: str = "tailored"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]

