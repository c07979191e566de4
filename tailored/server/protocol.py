"""Pydantic schemas of the OpenAI Completions / Chat Completions API (exact OpenAI field names).

Requests: `CompletionRequest`, `ChatCompletionRequest`. Validation happens in three stages:
0. the server refuses bodies nested deeper than MAX_JSON_DEPTH (`json_too_deep`, before
   parsing) and, via `check_json_body`, any string (anywhere, keys included) holding a lone
   UTF-16 surrogate, naming the field.
1. `Model.model_validate(body)` checks types and ranges; `validation_error_to_openai` turns a
   pydantic ValidationError into one readable `OpenAIError` naming the field(s).
2. `request.check_supported()` raises `OpenAIError` for parameters that would change the result
   but are not implemented (prompt_logprobs, best_of > 1, tool_choice "required", ...). Other unknown fields
   are ignored.
`request.sampling_params(max_tokens, defaults)` then builds the engine's `SamplingParams`.

Responses and stream chunks: `CompletionResponse`, `CompletionStreamResponse`,
`ChatCompletionResponse`, `ChatCompletionChunk`, `ModelList`, `ErrorResponse`.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

from tailored.engine.types import MAX_LOGPROBS, SamplingParams, StructuredOutput
from tailored.server.arg_types import describes_object
# a longer function or parameter name is not parsed as a call (tool_calls._tag_name)
from tailored.server.tool_calls import MAX_NAME_CHARS as MAX_TOOL_NAME_CHARS

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP_STRINGS = 4  # OpenAI's limit
# characters a stop string may have: the detokenizer re-checks a tail of this length after each
# token, so megabyte stop strings made every token of the request slower (and any match needs
# that much output first)
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024  # the engine checks each sampled token against them
MAX_LOGIT_BIAS = 1024  # biased tokens a request (the sampler adds them in one indexed write)
MAX_JSON_DEPTH = 64  # nesting levels of a request body (arrays/objects); deeper -> 400
MAX_ERROR_MESSAGE_CHARS = 2000
MAX_CHOICES = 128  # `n`: pass@k evaluations ask for up to ~100 samples of one prompt
MAX_PROMPTS = 128  # a completions batch; prompts x n is capped at MAX_CHOICES too
# response_format's JSON Schema (compact JSON text), a regex or a grammar: parsed on the
# engine's thread (~0.1 s at most for a schema this size), so its size is bounded; the time a
# grammar takes to compile or mask is bounded by the engine (COMPILE_TIMEOUT_S, MASK_LIMIT_S)
MAX_SCHEMA_CHARS = 65536
# repetition_penalty outside this range only produces inf/NaN logits (or no effect at all)
REPETITION_PENALTY_MIN, REPETITION_PENALTY_MAX = 0.01, 100.0
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
SUPPORTED_TEMPLATE_KWARGS = ("enable_thinking",)


class OpenAIError(Exception):
    """An error returned to the client as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",  # OpenAI's field name
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        # Messages may quote user input: keep them short and always encodable as UTF-8.
        message = _safe_text(message)
        if len(message) > MAX_ERROR_MESSAGE_CHARS:
            message = message[: MAX_ERROR_MESSAGE_CHARS - 3] + "..."
        param = _safe_text(param) if param is not None else None
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = (
            message,
            status,
            type,
            param,
            code,
        )

    def to_dict(self) -> dict:
        return ErrorResponse(
            error=ErrorDetail(
                message=self.message, type=self.type, param=self.param, code=self.code
            )
        ).model_dump()


_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate_at(text: str) -> int:
    """Index of the first lone UTF-16 surrogate in `text` (JSON `"\\ud800"`), else -1.

    Paired surrogates in JSON become one code point when parsed, so any surrogate code point
    left in a str is a lone one: not valid Unicode, and neither the tokenizer nor UTF-8 output
    can handle it."""
    if text.isascii():
        return -1
    m = _SURROGATE.search(text)
    return -1 if m is None else m.start()


def _safe_text(text: str) -> str:
    """`text` with lone surrogates written as `\\udXXX` escapes (so it encodes as UTF-8)."""
    if lone_surrogate_at(text) < 0:
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def shown(value: Any, limit: int = 60) -> str:
    """Short, printable rendering of user input for error messages (repr, truncated)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---- screening raw JSON before/after json.loads (all C-speed scans, no recursion) -----------

_STRING = re.compile(rb'"[^"]*"')  # once escapes are gone, a string holds no quote
# bytes.translate tables: keep only brackets and quotes; then [ { -> +1, ] } -> -1 (int8)
_DELETE_ALL_BUT_BRACKETS_AND_QUOTES = bytes(range(256)).translate(None, b'[]{}"')
_BRACKET_STEP = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
# a high-surrogate escape without a low one right after it, or a low one without a high one
# right before it (the lookbehind sees the 12 characters that end the match)
_LONE_SURROGATE_ESCAPE = re.compile(
    r"\\u[dD](?:[89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])"
    r"|[c-fC-F][0-9a-fA-F]{2}(?<!\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}))"
)
_NAMING_WALK_LIMIT = 100_000  # containers visited to name the field of a lone surrogate


def json_too_deep(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """True if UTF-8 JSON text nests arrays/objects more than `limit` deep (brackets inside
    strings ignored), without parsing or recursion: bytes operations and one numpy cumsum
    (~0.1-1 s for 32 MB; json.loads of the same text costs about as much or more). For
    malformed text the answer is a guess (the parse fails anyway)."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    # Drop escaped backslashes, then escaped quotes: every quote left delimits a string.
    raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    compact = raw.translate(None, _DELETE_ALL_BUT_BRACKETS_AND_QUOTES)
    # Two adjacent quotes (an empty string, or a string's end and the next one's start with no
    # bracket between) can go without changing which brackets lie inside strings; one pass
    # leaves no two quotes adjacent.
    compact = compact.replace(b'""', b"")
    if b'"' in compact:  # strings holding brackets (rare): drop them
        compact = _STRING.sub(b"", compact)
    steps = np.frombuffer(compact.translate(_BRACKET_STEP), dtype=np.int8)
    return steps.size > 0 and int(steps.cumsum(dtype=np.int64).max()) > limit


def find_lone_surrogate_escape(text: str) -> str | None:
    """The first \\uXXXX escape of JSON text that parses to a lone surrogate, else None.

    Exact for JSON text decoded strictly (so it holds no raw surrogate): json.loads pairs a
    high-surrogate escape with a low one right after it, and nothing else."""
    if "\\u" not in text:
        return None
    # escaped backslashes go first (same length), so every backslash left starts an escape
    m = _LONE_SURROGATE_ESCAPE.search(text.replace("\\\\", "__"))
    return None if m is None else m.group()


def check_json_body(data: Any, text: str | None = None) -> None:
    """Raise OpenAIError (400) when a string of a parsed body (object key or value) holds a
    lone surrogate, naming the field ("invalid 'messages[0].content': contains a lone
    surrogate ..."); also when it nests deeper than MAX_JSON_DEPTH.

    text: the JSON text `data` was parsed from; when given, the scan runs on it at C speed and
    the walk over `data` (to name the field; at most _NAMING_WALK_LIMIT containers) only runs
    when there is something to report."""
    escape = None
    if text is not None:
        escape = find_lone_surrogate_escape(text)
        if escape is None:
            return
    walked = frozenset({dict, list, str})
    stack: list[tuple[Any, int, Any]] = [(data, 1, ())]  # path: nested (parent, key) pairs
    visited = 0
    while stack:
        obj, depth, path = stack.pop()
        visited += 1
        if depth > MAX_JSON_DEPTH:
            raise OpenAIError(
                f"malformed JSON body: nested too deeply (more than {MAX_JSON_DEPTH} levels)"
            )
        if visited > _NAMING_WALK_LIMIT and escape is not None:
            break
        is_dict = isinstance(obj, dict)
        if is_dict:
            for key in obj:
                if isinstance(key, str) and lone_surrogate_at(key) >= 0:
                    where = _path_name(path)
                    raise OpenAIError(
                        f"invalid key {key!a}{f' in {where!r}' if where else ''}: contains a "
                        "lone surrogate (strings must be valid Unicode)",
                        param=where or None,
                    )
        if walked.isdisjoint(map(type, obj.values() if is_dict else obj)):
            continue
        for key, value in obj.items() if is_dict else enumerate(obj):
            if type(value) is str:
                if (i := lone_surrogate_at(value)) >= 0:
                    field = _path_name((path, key))
                    raise OpenAIError(
                        f"invalid '{field}': contains a lone surrogate "
                        f"(U+{ord(value[i]):04X} at character {i}; strings must be valid "
                        "Unicode)",
                        param=field,
                    )
            elif isinstance(value, (dict, list)):
                stack.append((value, depth + 1, (path, key)))
    if escape is not None:
        raise OpenAIError(
            f"invalid request body: a string holds a lone surrogate (the escape {escape!a}); "
            "strings must be valid Unicode"
        )


def _path_name(path: tuple) -> str:
    keys = []
    while path:
        path, key = path
        keys.append(key)
    return _loc_name(tuple(reversed(keys)))


def _loc_name(loc: tuple) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'."""
    name = ""
    for part in loc:
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else str(part))
    return name


def validation_error_to_openai(exc: ValidationError) -> OpenAIError:
    """One message for all errors (at most 3 shown), each naming its field; param = first field."""
    parts = []
    errors = exc.errors(include_url=False)
    for err in errors[:3]:
        field = _loc_name(err["loc"]) or "body"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "missing":
            parts.append(f"missing required parameter '{field}'")
        elif err["type"] == "value_error":  # our own validators: message is complete
            parts.append(f"invalid '{field}': {msg}")
        else:
            got = shown(err.get("input"))
            parts.append(f"invalid '{field}': {msg} (got {got})")
    if len(errors) > 3:
        parts.append(f"and {len(errors) - 3} more error(s)")
    param = _loc_name(errors[0]["loc"]) if errors else None
    return OpenAIError("; ".join(parts), param=param or None)


def _unset(value: Any) -> bool:
    """True for the values that mean "feature off": None, False, 0, "", [] and {}."""
    return value is None or value in (False, 0, "", [], {})


def _one_or_unset(value: Any) -> bool:
    return value is None or value == 1


# strict: no silent coercions such as true -> 1.0 or "42" -> 42 (ints are still accepted for
# floats); allow_inf_nan=False: JSON's NaN/Infinity extensions are not valid sampling values.
REQUEST_CONFIG = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


def _check_schema_size(text: str, what: str, param: str) -> None:
    """OpenAIError (400) for a schema over MAX_SCHEMA_CHARS characters of JSON text."""
    if len(text) > MAX_SCHEMA_CHARS:
        raise OpenAIError(f"{what} may have at most {MAX_SCHEMA_CHARS} characters as JSON, "
                          f"got {len(text)}", param=param)


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema` (OpenAI): the schema the answer must follow. `name`,
    `description` and `strict` are accepted and change nothing: the schema is always enforced
    (xgrammar's strict mode: no properties beyond the schema's)."""

    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)
    name: str | None = Field(None, max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI `response_format`: "text" (no constraint), "json_object" (any JSON object) or
    "json_schema" (JSON that follows `json_schema.schema`); engine/grammar.py enforces it."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("'json_schema' is required with type 'json_schema' and only then")
        return self

    def structured(self) -> StructuredOutput | None:
        """The engine's record; raises OpenAIError for a schema over MAX_SCHEMA_CHARS."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutput("json_object")
        text = json.dumps(self.json_schema.json_schema, separators=(",", ":"))
        _check_schema_size(text, "response_format's schema", "response_format")
        return StructuredOutput("json_schema", text)


class StructuredOutputsParams(BaseModel):
    """vLLM's `structured_outputs` request field (its `StructuredOutputsParams`): exactly one of
    `json` (a JSON Schema, object or JSON text), `json_object` (true), `regex`, `choice` (a
    list of strings), `grammar` (EBNF, xgrammar's dialect). `disable_any_whitespace`: JSON
    without free whitespace (xgrammar's compact separators); vLLM's other fields
    (`whitespace_pattern`, ...) are accepted and change nothing; `structural_tag` is
    refused."""

    model_config = ConfigDict(extra="allow", strict=True)
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = Field(None, max_length=MAX_SCHEMA_CHARS)
    choice: list[str] | None = Field(None, min_length=1, max_length=1024)
    grammar: str | None = Field(None, max_length=MAX_SCHEMA_CHARS)
    structural_tag: Any = None
    disable_any_whitespace: bool = False

    @model_validator(mode="after")
    def _exactly_one(self) -> "StructuredOutputsParams":
        if self.structural_tag is not None:
            raise ValueError("'structural_tag' is not supported by this server")
        kinds = [k for k in ("json_", "json_object", "regex", "choice", "grammar")
                 if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError("exactly one of 'json', 'json_object', 'regex', 'choice', "
                             "'grammar' must be set")
        return self

    def structured(self) -> StructuredOutput:
        """The engine's record; raises OpenAIError for a schema over MAX_SCHEMA_CHARS."""
        compact = self.disable_any_whitespace
        if self.json_object:
            return StructuredOutput("json_object", compact=compact)
        if self.regex is not None:
            return StructuredOutput("regex", self.regex)
        if self.grammar is not None:
            return StructuredOutput("grammar", self.grammar)
        if self.choice is not None:
            text = json.dumps(self.choice)
            kind = "choice"
        else:
            text = (self.json_ if isinstance(self.json_, str)
                    else json.dumps(self.json_, separators=(",", ":")))
            kind = "json_schema"
        _check_schema_size(text, "structured_outputs", "structured_outputs")
        return StructuredOutput(kind, text, compact=compact and kind == "json_schema")


class _BaseRequest(BaseModel):
    """Parameters shared by both APIs. Ranges follow OpenAI (and vLLM for the extensions)."""

    model_config = REQUEST_CONFIG  # unknown fields are kept to be screened, then ignored

    model: str | None = None  # omitted = the served model
    max_tokens: int | None = Field(None, ge=1)
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
        "best_of": _one_or_unset,
        "top_logprobs": _unset,  # chat requests take it (ChatCompletionRequest)
        "echo": _unset,
        "suffix": _unset,
        "tools": _unset,  # chat requests take them (ChatCompletionRequest)
        "tool_choice": lambda v: v is None or v == "none",
        "functions": _unset,
        "function_call": lambda v: v is None or v == "none",
        "continue_final_message": _unset,
        "guided_json": _unset,
        "guided_regex": _unset,
        "guided_choice": _unset,
        "guided_grammar": _unset,
        "prompt_logprobs": _unset,
        "min_tokens": _unset,
        "use_beam_search": _unset,
        "truncate_prompt_tokens": _unset,
        "bad_words": _unset,
        "allowed_token_ids": _unset,
        "logits_processors": _unset,
        "prompt_embeds": _unset,
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
        extra = self.model_extra or {}
        for name, harmless in self.UNSUPPORTED.items():
            value = getattr(self, name) if name in type(self).model_fields else extra.get(name)
            if not harmless(value):
                raise OpenAIError(
                    f"parameter '{name}' is not supported by this server (got {shown(value)})",
                    param=name,
                    code="unsupported_parameter",
                )

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
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        """Name of the field the completion budget came from, for error messages."""
        return "max_tokens"

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


def _is_token_ids(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in x)


class CompletionRequest(_BaseRequest):
    """POST /v1/completions. `prompt` is normalised to a non-empty str or list[int], or, for
    a batch, a list of 2 to MAX_PROMPTS of those (`prompts` lists them either way; each prompt
    gets `n` choices, numbered prompt * n + choice, as OpenAI and vLLM).
    logprobs: k in 0..MAX_LOGPROBS: each generated token's logprob and its k most likely
    alternatives (0 still asks for the sampled token's)."""

    prompt: str | list[int] | list[str | list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @property
    def logprobs_k(self) -> int | None:
        return self.logprobs

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, one for a single prompt."""
        one = isinstance(self.prompt, str) or _is_token_ids(self.prompt)
        return [self.prompt] if one else list(self.prompt)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, v: Any) -> str | list[int] | list[str | list[int]]:
        if isinstance(v, list) and v and all(isinstance(x, (str, list)) for x in v):
            if len(v) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts a request (got {len(v)})")
            for i, x in enumerate(v):
                if not isinstance(x, str) and not _is_token_ids(x):
                    raise ValueError(f"prompt {i} must be a string or a list of token ids")
                if len(x) == 0:
                    raise ValueError(f"prompt {i} must not be empty")
            return v[0] if len(v) == 1 else v  # ["text"] or [[ids]]: one prompt
        if not isinstance(v, str) and not _is_token_ids(v):
            raise ValueError(
                "must be a string, a list of token ids, or a list of those (a batch)"
            )
        if len(v) == 0:
            raise ValueError("prompt must not be empty")
        return v

    def check_supported(self) -> None:
        total = len(self.prompts) * (self.n or 1)
        if total > MAX_CHOICES:
            raise OpenAIError(
                f"{len(self.prompts)} prompts x n={self.n or 1} make {total} completions; at "
                f"most {MAX_CHOICES} a request", param="n")
        super().check_supported()


def tool_name_error(name: str) -> str | None:
    """Why a function name cannot be a tool's (None: it can). The model writes a call as
    <function=NAME> and the template renders history calls so: a name ends at the first '>'."""
    if (not name or len(name) > MAX_TOOL_NAME_CHARS
            or any(c in "<>" or c.isspace() or not c.isprintable() for c in name)):
        return (f"must be 1 to {MAX_TOOL_NAME_CHARS} characters without whitespace, '<' or '>' "
                f"(got {shown(name)})")
    return None


class ChatMessage(BaseModel):
    """One input message; extra fields (name, tool_calls, tool_call_id, ...) pass to the template.

    content: a string, a list of content parts (dicts; the tokenizer rejects kinds it cannot
    render), or null (only meaningful for assistant messages carrying tool calls)."""

    model_config = REQUEST_CONFIG

    role: str
    content: Any = None
    reasoning_content: str | None = None
    tool_calls: Any = None  # list of {"type": "function", "function": {"name", "arguments"}}

    @field_validator("role")
    @classmethod
    def _known_role(cls, v: str) -> str:
        if v not in CHAT_ROLES:
            raise ValueError(f"unknown role {v!r}; expected one of {', '.join(CHAT_ROLES)}")
        return v

    @field_validator("content")
    @classmethod
    def _content_shape(cls, v: Any) -> Any:
        ok = v is None or isinstance(v, str)
        ok = ok or (isinstance(v, list) and all(isinstance(p, dict) for p in v))
        if not ok:
            raise ValueError("must be a string, a list of content parts (objects), or null")
        # Parts of other types are left to the tokenizer, which names the type it cannot render.
        for i, part in enumerate(v if isinstance(v, list) else ()):
            if part.get("type") == "text" and not isinstance(part.get("text"), str):
                got = "missing" if "text" not in part else f"got {shown(part['text'])}"
                raise ValueError(f"content part {i}: 'text' must be a string ({got})")
        return v

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> "ChatMessage":
        """OpenAI: only an assistant message (one carrying tool calls) may leave content out or
        null; a user, system, developer or tool message without it is a client bug."""
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs 'content' (a string or content parts)")
        return self

    @field_validator("tool_calls")
    @classmethod
    def _tool_calls_shape(cls, v: Any) -> Any:
        """OpenAI's shape: [{"id"?: str, "type": "function", "function": {"name": str,
        "arguments": str holding a JSON object (or "") | object}}]. null or [] = no calls."""
        if v is None:
            return v
        if not isinstance(v, list):
            raise ValueError(  # noqa: TRY004
                "must be a list of tool calls, each {'type': 'function', 'function': "
                f"{{'name': ..., 'arguments': ...}}}} (got {type(v).__name__} {shown(v)})"
            )
        for i, call in enumerate(v):
            if not isinstance(call, dict):
                raise ValueError(  # noqa: TRY004
                    f"item {i} must be an object {{'type': 'function', 'function': {{...}}}} "
                    f"(got {shown(call)})"
                )
            if call.get("type", "function") != "function":
                raise ValueError(
                    f"item {i}: 'type' must be 'function' (got {shown(call.get('type'))})"
                )
            if "id" in call and not isinstance(call["id"], str):
                raise ValueError(f"item {i}: 'id' must be a string (got {shown(call['id'])})")
            fn = call.get("function")
            if not isinstance(fn, dict):
                got = "missing" if "function" not in call else f"got {shown(fn)}"
                raise ValueError(  # noqa: TRY004
                    f"item {i}: 'function' must be an object with 'name' and 'arguments' ({got})"
                )
            name = fn.get("name")
            if not isinstance(name, str) or not name:
                got = "missing" if "name" not in fn else f"got {shown(name)}"
                raise ValueError(f"item {i}: 'function.name' must be a non-empty string ({got})")
            if (bad := tool_name_error(name)) is not None:  # rendered as <function=NAME>
                raise ValueError(f"item {i}: 'function.name' {bad}")
            args = fn.get("arguments")
            if isinstance(args, str):
                if args.strip():
                    if json_too_deep(args.encode("utf-8", "surrogatepass")):
                        raise ValueError(
                            f"item {i}: 'function.arguments' is nested too deeply (more than "
                            f"{MAX_JSON_DEPTH} levels)"
                        )
                    try:
                        parsed = json.loads(args)
                    except (json.JSONDecodeError, RecursionError) as e:
                        raise ValueError(
                            f"item {i}: 'function.arguments' is not valid JSON ({e})"
                        ) from None
                    if not isinstance(parsed, dict):
                        raise ValueError(
                            f"item {i}: 'function.arguments' must encode a JSON object "
                            f"(got {type(parsed).__name__})"
                        )
                    try:  # depth and lone surrogates ("\\ud800" escapes) of the decoded text
                        check_json_body(parsed, args)
                    except OpenAIError as e:
                        raise ValueError(f"item {i}: 'function.arguments': {e.message}") from None
            elif args is not None and not isinstance(args, dict):
                raise ValueError(
                    f"item {i}: 'function.arguments' must be a JSON string or an object "
                    f"(got {shown(args)})"
                )
        return v

    def to_template(self) -> dict[str, Any]:
        """Dict for tokenizer.apply_chat_template. `developer` is OpenAI's new name for
        `system`; the Qwen template only knows `system`. Null content becomes "" because the
        template does string operations on it."""
        d = self.model_dump(exclude_none=True)
        if d["role"] == "developer":
            d["role"] = "system"
        d.setdefault("content", "")
        return d


class FunctionDefinition(BaseModel):
    """A tool's function: {"name", "description"?, "parameters"? (a JSON schema), "strict"?};
    other fields pass to the chat template as given."""

    model_config = REQUEST_CONFIG

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name_fits_the_format(cls, v: str) -> str:
        if (bad := tool_name_error(v)) is not None:
            raise ValueError(bad)
        return v

    @field_validator("parameters")
    @classmethod
    def _parameter_names_fit_the_format(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        # the model writes each argument as <parameter=NAME>: a name ends at the first '>'
        props = v.get("properties") if v else None
        for name in props if isinstance(props, dict) else ():
            if not name or any(c in "<>\r\n" for c in name) or len(name) > MAX_TOOL_NAME_CHARS:
                raise ValueError(
                    f"property {shown(name)} cannot be written as <parameter=NAME> (1 to "
                    f"{MAX_TOOL_NAME_CHARS} characters without '<', '>' or a line break)"
                )
        return v


class ChatTool(BaseModel):
    """One entry of `tools`: {"type": "function", "function": FunctionDefinition}."""

    model_config = REQUEST_CONFIG

    type: Literal["function"]
    function: FunctionDefinition


# tool_choice values served: "auto" (the model decides), "none" (no tools in the prompt,
# nothing parsed, as vLLM's default), and the forced ones, held to the tool-call XML by a
# grammar (engine/grammar.py, StructuredOutput "tool_calls"): "required" (one or more calls)
# and {"type": "function", "function": {"name": NAME}} (one call of NAME)
TOOL_CHOICES = (None, "auto", "none")


class ChatCompletionRequest(_BaseRequest):
    """POST /v1/chat/completions. max_completion_tokens wins over max_tokens when both given.

    tools: OpenAI function tools, rendered by the chat template; the answer's calls come back
    as `tool_calls` (`tool_calls.py`) unless tool_choice is "none". parallel_tool_calls false
    ends the answer (and its generation) once its first call ended."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None  # false: the answer ends with its first call
    # each generated token's logprob, with its top_logprobs most likely alternatives
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    UNSUPPORTED: ClassVar[dict[str, Callable[[Any], bool]]] = {
        k: v for k, v in _BaseRequest.UNSUPPORTED.items()
        if k not in ("tools", "tool_choice", "top_logprobs")
    }

    @property
    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_supported(self) -> None:
        if self.top_logprobs and not self.logprobs:  # OpenAI's rule
            raise OpenAIError("parameter 'top_logprobs' needs 'logprobs' set to true",
                              param="top_logprobs")
        if self.active_tools and super().structured_output() is not None:
            # the JSON grammar leaves no room for a `<tool_call>` block
            raise OpenAIError("response_format json_object / json_schema (or "
                              "structured_outputs) cannot be combined with tools (set "
                              "tool_choice to 'none' or leave the tools out)",
                              param="response_format")
        if self.tool_choice not in TOOL_CHOICES:
            self._check_forced_tool_choice()
        super().check_supported()

    def _check_forced_tool_choice(self) -> None:
        """tool_choice "required" or a named function: valid only with tools (OpenAI's rules),
        the name one of theirs, each name once, and each callable function's parameters an
        object."""
        choice = self.tool_choice
        if choice == "required":
            name = None
        elif (isinstance(choice, dict) and choice.get("type") == "function"
              and isinstance(choice.get("function"), dict)
              and isinstance(choice["function"].get("name"), str) and len(choice) == 2
              and len(choice["function"]) == 1):
            name = choice["function"]["name"]
        else:
            raise OpenAIError(
                f"tool_choice {shown(choice)} is not valid: 'none', 'auto', 'required' or "
                '{"type": "function", "function": {"name": ...}}', param="tool_choice")
        if not self.tools:
            raise OpenAIError(f"tool_choice {shown(choice)} needs tools", param="tool_choice")
        names = [t.function.name for t in self.tools]
        for i, n in enumerate(names):
            if n in names[:i]:  # the grammar names each function once
                raise OpenAIError(f"tools[{i}].function.name {shown(n)} is given twice",
                                  param=f"tools[{i}].function.name")
        if name is not None and name not in names:
            raise OpenAIError(f"tool_choice names the function {shown(name)}, which is not "
                              "among tools", param="tool_choice")
        for i, tool in enumerate(self.tools):
            if (name is None or tool.function.name == name) and \
                    not describes_object(tool.function.parameters):
                raise OpenAIError(
                    "a forced tool call needs each function's parameters to describe an object "
                    "(type 'object': named arguments)", param=f"tools[{i}].function.parameters")

    def structured_output(self) -> StructuredOutput | None:
        """The grammar of `response_format` / `structured_outputs`, or of a forced
        tool_choice (StructuredOutput "tool_calls": the tools as rendered; a named function's
        tool_choice in xgrammar's (OpenAI's) shape). Tools with response_format: `check`."""
        if self.forced_tool_calls:
            return StructuredOutput("tool_calls", json.dumps({
                "tools": self.active_tools, "tool_choice": self.tool_choice,
                "parallel_tool_calls": self.parallel_tool_calls is not False}))
        return super().structured_output()

    @property
    def forced_tool_calls(self) -> bool:
        """tool_choice "required" or a named function (with tools): the answer is calls only,
        by a grammar (`structured_output`)."""
        return bool(self.tools) and self.tool_choice not in TOOL_CHOICES

    @property
    def max_tool_calls(self) -> int | None:
        """parallel_tool_calls false: 1 (the answer ends once its first call ended)."""
        return 1 if self.parallel_tool_calls is False else None

    @property
    def active_tools(self) -> list[dict[str, Any]] | None:
        """The tools to render and parse calls of: None without tools or with tool_choice
        "none"."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not v:
            raise ValueError("messages must not be empty")
        return v

    @field_validator("chat_template_kwargs")
    @classmethod
    def _known_kwargs(cls, v: dict | None) -> dict | None:
        # Unknown template switches would silently change the prompt, so they are rejected.
        for key in v or {}:
            if key not in SUPPORTED_TEMPLATE_KWARGS:
                raise ValueError(
                    f"key {key!r} is not supported (supported: {', '.join(SUPPORTED_TEMPLATE_KWARGS)})"
                )
        if v and not isinstance(v.get("enable_thinking", True), bool):
            raise ValueError("enable_thinking must be a boolean")
        return v

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def enable_thinking(self) -> bool:
        """Qwen3.6 thinks unless chat_template_kwargs.enable_thinking is false."""
        return (self.chat_template_kwargs or {}).get("enable_thinking", True)


# ---- responses ---------------------------------------------------------------------------


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


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    # {"tokens", "token_logprobs", "top_logprobs", "text_offset"} (OpenAI's legacy shape)
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=unix_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(BaseModel):
    """One SSE chunk of /v1/completions (OpenAI uses the same object name as non-streaming)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=unix_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatResponseMessage(BaseModel):
    """content: the answer (the raw generated text, or with `--reasoning-parser` the text after
    `</think>`); the reasoning under both names clients read (`reasoning`, vLLM's since late
    2025; `reasoning_content`, DeepSeek's, LiteLLM's), both omitted while None."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    # [{"id", "type": "function", "function": {"name", "arguments": JSON text}}], omitted if none
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _drop_empty_reasoning(self, handler):
        d = handler(self)
        for k in ("reasoning", "reasoning_content", "tool_calls"):
            if d.get(k) is None:
                d.pop(k, None)
        return d


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: dict[str, Any] | None = None  # {"content": [token entries]}
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=unix_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    """Stream delta; fields that are None are left out (the final delta is `{}`)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None  # the same text under both names (ChatResponseMessage)
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # ToolCallDelta.to_openai() pieces

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: dict[str, Any] | None = None  # {"content": [the delta's token entries]}
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=unix_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=unix_now)
    owned_by: str = "tailored"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
