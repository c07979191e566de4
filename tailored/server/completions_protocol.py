"""POST /v1/completions: the request (`CompletionRequest`) and its responses and stream
chunks (OpenAI's legacy completions shapes)."""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Literal

from pydantic import BaseModel, Field, field_validator

from tailored.engine.types import MAX_LOGPROBS
from tailored.server.errors import OpenAIError
from tailored.server.protocol import (MAX_CHOICES, MAX_PROMPTS, BaseRequest, PromptLogprobsOut,
                                      UsageInfo, unix_now)

def _is_token_ids(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in x)


class CompletionRequest(BaseRequest):
    """POST /v1/completions. `prompt` is normalised to a non-empty str or list[int], or, for
    a batch, a list of 2 to MAX_PROMPTS of those (`prompts` lists them either way; each prompt
    gets `n` choices, numbered prompt * n + choice, as OpenAI and vLLM).
    logprobs: k in 0..MAX_LOGPROBS: each generated token's logprob and its k most likely
    alternatives (0 still asks for the sampled token's).
    echo: the choice's text starts with the prompt's, and with logprobs its tokens' entries
    start with the prompt's (OpenAI's legacy semantics; the first prompt token's logprob is
    null); max_tokens 0 with echo: the prompt alone (as vLLM). lm-evaluation-harness scores
    multiple choice with echo, logprobs 1 and max_tokens 1."""

    prompt: str | list[int] | list[str | list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = None

    UNSUPPORTED: ClassVar[dict[str, Callable[[Any], bool]]] = {
        k: v for k, v in BaseRequest.UNSUPPORTED.items() if k != "echo"
    }
    PROMPT_ALONE_WITH: ClassVar[str] = "with echo or prompt_logprobs"

    @property
    def logprobs_k(self) -> int | None:
        return self.logprobs

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """The prompt logprobs the answer shows: `prompt_logprobs`'s, and with echo the
        prompt's part of `logprobs` (the engine computes the larger k once). Echo with
        max_tokens 0 asks for them even without logprobs: the engine's request for the prompt
        alone."""
        ks = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None)
              if k is not None]
        if not ks and self.echo and self.max_tokens == 0:
            ks = [0]
        return max(ks) if ks else None

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


class CompletionChoice(PromptLogprobsOut):
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
