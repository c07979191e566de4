"""Qwen3.6's thinking split out of a chat answer: the reasoning and the `content`
(`tailored serve --reasoning-parser qwen3`, the flag of vLLM's parser; the server sends the
reasoning as both `reasoning`, vLLM's field since late 2025, and `reasoning_content`, DeepSeek's
and LiteLLM's).

With thinking on, Qwen3.6's chat template ends the generation prompt with `<think>\\n`, so the
model's output is reasoning up to `</think>`, then the answer; with thinking off the template
holds an empty `<think>\\n\\n</think>\\n\\n` and the output is all answer. The split works on
the streamed text as the detokenizer hands it over: a `</think>` may arrive cut between two
deltas, so a tail that could be its beginning (a delta ending in `<`, say) is held back until
the next delta settles it (at most 7 characters, one token's delay).

Where this differs from vLLM's `qwen3` parser: the newlines after `</think>` are dropped from
the answer, as the chat template drops them from earlier assistant turns
(`content.split('</think>')[-1].lstrip('\\n')`), also with thinking off; an empty reasoning is
left out rather than sent as ""; only a `<think>` the model writes at the very start is dropped.
Like vLLM: an empty answer after `</think>` is null. With tools in the request a `<tool_call>`
that opens a call of one of them (`<function=NAME>` follows) also ends the reasoning (vLLM's
`qwen3` parser does the same: the model at times opens its call without closing the think
block); the call goes to the answer, where the tool-call parser finds it (`tool_calls.py`).
A `<tool_call>` followed by other text stays reasoning, so a later `</think>` still splits.

Source: the Qwen3 / Qwen3.6 chat template (spec §2, the tokenizer's chat template) and vLLM's
`qwen3` reasoning parser (the response fields).
"""

from __future__ import annotations

from tailored.engine.detokenizer import prefix_hold
from tailored.server.tool_calls import TOOL_START, opens_call

THINK_START = "<think>"
THINK_END = "</think>"
REASONING_PARSERS = (None, "qwen3")  # `--reasoning-parser` values (None: no split)


class ReasoningSplitter:
    """Splits one answer's text, fed delta by delta, into (reasoning, content) pieces.

    thinking: whether the output starts inside the reasoning (the request's enable_thinking
    with a generation prompt). tools: the request's tool names; a `<tool_call>` opening a
    call of one of them also ends the reasoning (kept in the answer). `feed(text)` returns the (reasoning, content) text of that delta
    (either may be ""); `finish()` returns what was held back, at the end. Joined over all
    deltas, reasoning + "</think>" + (dropped newlines) + content is the text fed, less a
    leading "<think>".
    """

    def __init__(self, thinking: bool, tools: set[str] | None = None) -> None:
        self.thinking = thinking  # still inside the reasoning
        self._tools = tools or set()  # the request's tool names: a call of one ends it
        self._ends = (THINK_END, TOOL_START) if tools else (THINK_END,)
        self._held = ""  # the tail that may begin THINK_END (or, at the start, THINK_START)
        self._started = False  # past the start: a leading <think> was dropped or ruled out
        self._content_started = False  # any answer text given out (leading newlines dropped)

    def feed(self, text: str) -> tuple[str, str]:
        buf = self._held + text
        self._held = ""
        if not self.thinking:
            return "", self._content(buf)
        if not self._started:
            if THINK_START.startswith(buf) and buf != THINK_START:  # may begin "<think>": wait
                self._held = buf
                return "", ""
            if buf.startswith(THINK_START):
                buf = buf[len(THINK_START):]
            self._started = True  # one leading <think> at most
        pos = 0
        while found := [(i, t) for t in self._ends if (i := buf.find(t, pos)) >= 0]:
            end, tag = min(found)
            if tag == TOOL_START:
                opens = opens_call(buf[end + len(TOOL_START):], self._tools)
                if opens is None:  # the text after the tag does not tell yet: held
                    self._held = buf[end:]
                    return buf[:end], ""
                if not opens:  # "<tool_call>" written in the thinking: reasoning text
                    pos = end + len(TOOL_START)
                    continue
            self.thinking = False
            after = end + len(tag) if tag == THINK_END else end  # a tool call stays the answer's
            return buf[:end], self._content(buf[after:])
        # (a whole tag was found above, so at most its length - 1)
        keep = prefix_hold(buf, self._ends, max(map(len, self._ends)) - 1)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], ""

    def finish(self) -> tuple[str, str]:
        """What was held back: reasoning if the thinking never ended, else answer."""
        held, self._held = self._held, ""
        if self.thinking:
            return held, ""
        return "", self._content(held)

    def _content(self, text: str) -> str:
        if not self._content_started:
            text = text.lstrip("\n")
            self._content_started = bool(text)
        return text


def split(text: str, thinking: bool,
          tools: set[str] | None = None) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole answer fed at once, as `fields` gives them (the
    reference the tests hold a stream's pieces to)."""
    s = ReasoningSplitter(thinking, tools)
    r1, c1 = s.feed(text)
    r2, c2 = s.finish()
    return fields(r1 + r2, c1 + c2, thinking)


def fields(reasoning: str, content: str, thinking: bool | None) -> tuple[str | None, str | None]:
    """A whole answer's (reasoning, content) response fields from its joined split pieces:
    without the split (thinking None) or with thinking off, reasoning None and content as it
    is; with thinking on, an empty reasoning is None, and so is the content when the reasoning
    never ended (the answer was cut inside it, e.g. by max_tokens) or the answer is empty."""
    if not thinking:
        return None, content
    return reasoning or None, content or None


class ThinkGate:
    """With thinking on and no reasoning split, content is the raw text, the reasoning
    included; tool calls are read only in the answer after `</think>` (a call the model drafts
    or mentions while thinking is no call). `feed(text)` returns (before, after): the text up
    to and with the first `</think>`, unchanged, and the text past it; a tail that may begin
    `</think>` is held back (`finish()` gives it out)."""

    def __init__(self) -> None:
        self._open = True  # </think> not seen yet
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        if not self._open:
            return "", text
        buf, self._held = self._held + text, ""
        end = buf.find(THINK_END)
        if end >= 0:
            self._open = False
            return buf[:end + len(THINK_END)], buf[end + len(THINK_END):]
        keep = prefix_hold(buf, (THINK_END,), len(THINK_END) - 1)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], ""

    def finish(self) -> str:
        held, self._held = self._held, ""
        return held
