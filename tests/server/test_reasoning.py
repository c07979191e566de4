"""server/reasoning.py: the thinking of a Qwen3.6 answer split from its content, whole and as
streamed deltas cut anywhere (a `</think>` across two deltas): both give the same split."""

from __future__ import annotations

import pytest

from tailored.server.reasoning import ReasoningSplitter, split

CASES = [
    # (generated text, thinking, reasoning, content)
    ("Let me think.\n</think>\n\nThe answer is 4.", True, "Let me think.\n", "The answer is 4."),
    ("<think>\nhmm</think>\n\nyes", True, "\nhmm", "yes"),  # the model's own <think>: dropped
    ("</think>\n\nstraight away", True, None, "straight away"),  # nothing thought
    ("cut off inside the thinking </thi", True, "cut off inside the thinking </thi", None),
    ("a < b and </ thinking> is not the tag", True,
     "a < b and </ thinking> is not the tag", None),
    ("x</think>line one\n\nline two</think>", True, "x", "line one\n\nline two</think>"),
    ("\n\nno thinking here", False, None, "no thinking here"),  # thinking off: all content
    ("2 </think> 3", False, None, "2 </think> 3"),
    ("<think>", True, None, None),  # stopped right after a <think> of its own
    ("<think><think>x</think>y", True, "<think>x", "y"),  # one leading <think> at most
    ("why</think>\n\n", True, "why", None),  # an empty answer is null (as vLLM's parser)
    ("", True, None, None),
]


@pytest.mark.contract("openai-api-behaviour")
@pytest.mark.parametrize("text,thinking,reasoning,content", CASES)
def test_split_whole_and_every_cut(text, thinking, reasoning, content):
    assert split(text, thinking) == (reasoning, content)
    # streamed: every way of cutting the text in two and in single characters gives the same
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for parts in cuts:
        s = ReasoningSplitter(thinking)
        rs, cs = zip(*[s.feed(p) for p in parts], s.finish())
        r, c = "".join(rs), "".join(cs)
        assert (r or None if thinking else None) == reasoning, parts
        assert (c or None) == content or (c == content == "" and not thinking), parts
