"""IncrementalDetokenizer: split UTF-8 sequences, skipped special tokens, stop strings."""

from __future__ import annotations

import random

import pytest

from tailored.engine.detokenizer import IncrementalDetokenizer


# The tiktoken backend only: tests/test_tokenizer.py checks that token_bytes() of the HF backend
# is identical for every id, so the detokenizer sees the same bytes with either backend.
@pytest.fixture(scope="module")
def tt(qwen_tok):  # the session's load_tokenizer(None)
    return qwen_tok


@pytest.fixture
def tok(tt):
    return tt


CJK_EMOJI = ("今天天气很好，我们去公园散步吧。龘䨻𠀀 日本語のテキスト、한국어 텍스트. "
             "Emoji 🦜😀👨‍👩‍👧‍👦🏳️‍🌈🇯🇵 ✅ and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 done.")


def run(tok, ids, step=1, **kw):
    """Feed ids `step` at a time; return (deltas, matched stop, flushed text)."""
    d = IncrementalDetokenizer(tok, **kw)
    deltas, matched = [], None
    for i in range(0, len(ids), step):
        text, matched = d.add(ids[i:i + step])
        deltas.append(text)
        if matched is not None:
            break
    return deltas, matched, d.flush()


def test_cjk_emoji_one_token_at_a_time(tok):
    ids = tok.encode(CJK_EMOJI)
    assert len(ids) > 40
    deltas, matched, rest = run(tok, ids)
    assert matched is None
    assert "".join(deltas) + rest == tok.decode(ids) == CJK_EMOJI
    for d in deltas:
        assert "\ufffd" not in d
        d.encode("utf-8")  # no lone surrogates
    assert rest == ""
    # some token ended mid-character, so some delta must have been empty
    assert "" in deltas


@pytest.mark.parametrize("step", [2, 3, 7])
def test_batched_feeding_gives_same_text(tt, step):
    ids = tt.encode(CJK_EMOJI)
    deltas, _, rest = run(tt, ids, step)
    assert "".join(deltas) + rest == CJK_EMOJI


def test_invalid_bytes_become_replacement_char(tt):
    parrot = tt.encode("🦜")  # three tokens: f0 9f | a6 | 9c
    a = tt.encode("A")
    ids = parrot[:2] + a  # a sequence that can never complete
    deltas, _, rest = run(tt, ids)
    assert "".join(deltas) + rest == tt.decode(ids) == "\ufffdA"
    # an incomplete tail at the end of generation is flushed as U+FFFD
    d = IncrementalDetokenizer(tt)
    assert d.add(parrot[:2]) == ("", None)
    assert d.flush() == "\ufffd"


def test_special_tokens(tt):
    ids = tt.encode("<|im_start|>assistant\n<think>\nhm</think>\n\nOK<|im_end|>")
    deltas, _, _ = run(tt, ids)
    assert "".join(deltas) == "assistant\n<think>\nhm</think>\n\nOK"
    deltas, _, _ = run(tt, ids, skip_special_tokens=False)
    assert "".join(deltas) == "<|im_start|>assistant\n<think>\nhm</think>\n\nOK<|im_end|>"
    d = IncrementalDetokenizer(tt)
    assert d.add([248046]) == ("", None)  # a skipped special token produces no text


def test_special_token_between_split_bytes_is_skipped(tt):
    parrot = tt.encode("🦜")
    ids = parrot[:1] + [248046] + parrot[1:]
    deltas, _, rest = run(tt, ids)
    assert "".join(deltas) + rest == tt.decode(ids) == "🦜"


def test_stop_string_spanning_tokens(tok):
    text = "The quick brown fox jumps over the lazy dog"
    ids = tok.encode(text)
    deltas, matched, rest = run(tok, ids, stop=["fox jumps"])
    assert matched == "fox jumps"
    assert "".join(deltas) == "The quick brown "
    assert rest == ""
    # held back while it could still be the stop string, then released
    deltas, matched, rest = run(tok, ids, stop=["fox jumpy"])
    assert matched is None and "".join(deltas) + rest == text
    i = next(k for k, d in enumerate(deltas) if "fox" in d)
    assert deltas[i].startswith("fox jumps")  # "fox" was held until " jumps" ruled it out


def test_stop_string_inside_split_character(tt):
    text = "前面的文字龘后面的文字"
    ids = tt.encode(text)
    deltas, matched, _ = run(tt, ids, stop=["龘"])
    assert matched == "龘" and "".join(deltas) == "前面的文字"
    deltas, matched, _ = run(tt, ids, stop=["龘"], include_stop_str_in_output=True)
    assert "".join(deltas) == "前面的文字龘"


def test_stop_string_at_start(tt):
    ids = tt.encode("STOP right here")
    deltas, matched, rest = run(tt, ids, stop=["STOP"])
    assert matched == "STOP" and "".join(deltas) == "" and rest == ""
    deltas, matched, _ = run(tt, ids, stop=["STOP"], include_stop_str_in_output=True)
    assert "".join(deltas) == "STOP"


def test_include_stop_str_in_output(tt):
    ids = tt.encode("answer: 42\n\nUser: next")
    deltas, matched, _ = run(tt, ids, stop=["\n\nUser:"], include_stop_str_in_output=True)
    assert matched == "\n\nUser:" and "".join(deltas) == "answer: 42\n\nUser:"


def test_stop_in_one_batch_drops_the_rest(tt):
    d = IncrementalDetokenizer(tt, stop=["world"])
    assert d.add(tt.encode("hello world and more")) == ("hello ", "world")
    with pytest.raises(RuntimeError):
        d.add([9419])
    assert d.flush() == ""


def test_first_completed_stop_wins(tt):
    ids = tt.encode("xx abcd yy")
    for step in (1, len(ids)):
        deltas, matched, _ = run(tt, ids, step, stop=["abcd", "bc"])
        assert matched == "bc" and "".join(deltas) == "xx a"
    deltas, matched, _ = run(tt, ids, len(ids), stop=["cd", "abcd"])
    assert matched == "abcd" and "".join(deltas) == "xx "


def test_flush_returns_partial_stop_prefix(tt):
    ids = tt.encode("the end is EN")
    deltas, matched, rest = run(tt, ids, stop=["END"])
    assert matched is None
    assert "".join(deltas) == "the end is " and rest == "EN"


def test_stop_matches_special_token_text_only_when_not_skipped(tt):
    ids = tt.encode("hi<|im_end|>")
    deltas, matched, rest = run(tt, ids, stop=["<|im_end|>"])
    assert matched is None and "".join(deltas) + rest == "hi"
    deltas, matched, _ = run(tt, ids, stop=["<|im_end|>"], skip_special_tokens=False)
    assert matched == "<|im_end|>" and "".join(deltas) == "hi"


def test_random_text_and_stops_match_full_decode(tt):
    rng = random.Random(0)
    alphabet = "abc 的一是😀🦜龘\n" + "xyz"
    for _ in range(150):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        ids = tt.encode(text)
        full = tt.decode(ids)
        stops = []
        for _ in range(rng.randint(0, 3)):
            a = rng.randrange(len(full))
            stops.append(full[a:a + rng.randint(1, 4)])
        if rng.random() < 0.3:
            stops.append("qq")  # never matches
        include = rng.random() < 0.5
        deltas, matched, rest = run(tt, ids, rng.choice([1, 1, 2, 5]), stop=stops,
                                    include_stop_str_in_output=include)
        hits = [(full.find(s) + len(s), full.find(s), s) for s in stops if s in full]
        if hits:
            end, start, s = min(hits)
            assert matched == s
            assert "".join(deltas) + rest == full[:end if include else start]
        else:
            assert matched is None and "".join(deltas) + rest == full
        assert all("\ufffd" not in d for d in deltas)
