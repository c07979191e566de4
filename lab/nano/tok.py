"""Byte-level BPE tokenizer of the nano model, built like the Qwen3.5/3.6 one (model spec §10).

Same normaliser (NFC), pre-tokeniser (the Qwen regex, then byte-level), decoder and the same 33
added tokens in the same order (<|endoftext|>, <|im_start|>, <|im_end|>, …, <think>, </think>,
…) with the same special flags; only the regular vocabulary is smaller and trained here. Ids:
regular tokens 0…R−1 (R = vocab − 64 by default, ids 0…255 the byte alphabet), added tokens
R…R+32, embedding rows R+33…vocab−1 padded (no token), as the real model pads 248077…248319.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tailored.tokenizer import ADDED_TOKENS, NON_SPECIAL, set_byte_level_pipeline
from tailored.tokenizer import tokenizer_config as qwen_tokenizer_config

PAD_ROWS = 64  # regular vocab = vocab_size - PAD_ROWS; 33 added tokens + 31 padded rows

# The Qwen regex (PAT_STR) lets a punctuation run absorb the newlines after it (`):\n`). With a
# 4k vocabulary that made `):` at the very end of a prompt (`def fibonacci(n):`) a token the
# model had never seen followed by anything, and greedy decoding collapsed into `~ ~ ~` (first
# H200 run, kb/0004). Here punctuation runs stop before newlines; newlines are their own tokens.
NANO_PAT_STR = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"""
    r""" ?[^\s\p{L}\p{M}\p{N}]+|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


def train_tokenizer(texts, num_regular: int):
    """Train the BPE on an iterable of strings; returns a tokenizers.Tokenizer with added tokens."""
    from tokenizers import AddedToken, Tokenizer, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    tok = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    set_byte_level_pipeline(tok, NANO_PAT_STR)
    trainer = BpeTrainer(vocab_size=num_regular, min_frequency=2, show_progress=False,
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(texts, trainer)
    n = tok.get_vocab_size()
    tok.add_tokens([AddedToken(t, special=t not in NON_SPECIAL, normalized=False)
                    for t in ADDED_TOKENS])
    for i, t in enumerate(ADDED_TOKENS):
        if tok.token_to_id(t) != n + i:
            raise RuntimeError(f"added token {t} got id {tok.token_to_id(t)}, expected {n + i}")
    return tok


def token_ids(tok) -> dict[str, int]:
    return {t: tok.token_to_id(t) for t in ADDED_TOKENS}


def tokenizer_config(tok, model_max_length: int) -> dict:
    """tokenizer_config.json as the Qwen release writes it, with this tokenizer's ids
    (train_tokenizer adds the 33 tokens contiguously after the BPE vocabulary)."""
    return qwen_tokenizer_config(token_ids(tok)[ADDED_TOKENS[0]], model_max_length,
                                 tokenizer_class="Qwen2TokenizerFast")


def write_tokenizer(tok, out: Path, model_max_length: int) -> str:
    """Write tokenizer.json + tokenizer_config.json; returns sha256 of tokenizer.json."""
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(tok, model_max_length), indent=2, ensure_ascii=False) + "\n",
        encoding="utf-8")
    return hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()
