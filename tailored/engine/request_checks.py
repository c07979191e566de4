"""What a request must satisfy before the engine queues it: a prompt of valid ids that fits
max_model_len with its max_tokens, and sampling settings the sampler can honour.

    python -m pytest -q tests/engine/test_engine.py

Each check raises ValueError with a one-line message (the server answers it as a 400).
"""

from __future__ import annotations

import math

from tailored.engine.types import MAX_LOGPROBS, SamplingParams


def check_request(prompt_ids: list[int], sampling: SamplingParams, vocab_size: int,
                  max_model_len: int) -> None:
    """Raise ValueError if the request cannot be served (the engine checks ids separately)."""
    if not prompt_ids:
        raise ValueError("prompt is empty: at least one token is needed")
    lo, hi = min(prompt_ids), max(prompt_ids)
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(f"prompt token id {bad} is out of range [0, {vocab_size})")
    check_sampling(sampling)
    total = len(prompt_ids) + sampling.max_tokens
    if total > max_model_len:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({sampling.max_tokens}) = {total}"
            f" exceeds max_model_len {max_model_len}"
        )


def check_sampling(sp: SamplingParams) -> None:
    """Raise ValueError for settings the sampler cannot honour."""
    if sp.prompt_logprobs is not None and not 0 <= sp.prompt_logprobs <= MAX_LOGPROBS:
        raise ValueError(f"prompt_logprobs must be in 0..{MAX_LOGPROBS}, got "
                         f"{sp.prompt_logprobs}")
    if sp.max_tokens < (0 if sp.prompt_logprobs is not None else 1):
        raise ValueError(f"max_tokens must be >= 1 (0 only with prompt logprobs, the prompt "
                         f"alone), got {sp.max_tokens}")
    if not 0 <= sp.min_tokens <= sp.max_tokens:
        raise ValueError(f"min_tokens must be in 0..max_tokens ({sp.max_tokens}), got "
                         f"{sp.min_tokens}")
    if sp.temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {sp.temperature}")
    if not 0 < sp.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {sp.top_p}")
    if not 0 <= sp.min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1], got {sp.min_p}")
    if sp.repetition_penalty <= 0:
        raise ValueError(f"repetition_penalty must be > 0, got {sp.repetition_penalty}")
    if sp.logprobs is not None and not 0 <= sp.logprobs <= MAX_LOGPROBS:
        raise ValueError(f"logprobs must be in 0..{MAX_LOGPROBS}, got {sp.logprobs}")
    if sp.logit_bias and not all(math.isfinite(b) for b in sp.logit_bias.values()):
        raise ValueError("logit_bias values must be finite numbers")
