"""Random prompts as text of an exact Qwen3.6 token count, for servers and gateways that take
no token-id prompts (SMG's `/v1/completions` accepts a string or strings only).

The words are the Qwen3.6 vocabulary's tokens that are a space and 3-10 lowercase ASCII
letters (40,506 of them): a text of n such words joined without separators encodes to exactly
n tokens (the pre-tokenizer splits before each space; each piece is one vocabulary entry), so
`input_len` holds for Qwen3.6 servers as for token-id prompts. Another tokenizer (the nano
model's) counts other lengths; the server's usage reports them.
"""

from __future__ import annotations

import random
import re
from functools import lru_cache

WORD = re.compile(rb" [a-z]{3,10}")


@lru_cache(maxsize=1)
def words() -> tuple[str, ...]:
    from tailored.tokenizer import load_tokenizer

    tok = load_tokenizer(None)  # added tokens (<|...|>) never match WORD
    return tuple(b.decode() for i in range(tok.vocab_size)
                 if WORD.fullmatch(b := tok.token_bytes(i)))


def random_text_prompts(n: int, input_len: int, seed: int) -> list[str]:
    """n texts of input_len Qwen3.6 tokens each, from random.Random(seed)."""
    w = words()
    rng = random.Random(seed)
    return ["".join(rng.choices(w, k=input_len)) for _ in range(n)]
