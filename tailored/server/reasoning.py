"""Qwen3.6's thinking split out of a chat answer: `reasoning_content` and `content`
(`tailored serve --reasoning-parser qwen3`, the flag and field names of vLLM's reasoning parsers).

With thinking on, Qwen3.6's chat template ends the generation prompt with `<think>\\n`, so the
model's output is reasoning up to `</think>`, then the answer; with thinking off the template
holds an empty `<think>\\n\\n</think>\\n\\n` and the output is all answer. The split works on
the streamed text as the detokenizer hands it over: a `</think>` may arrive cut between two
deltas, so a tail that could be its beginning is held back until the next delta settles it (at
most 7 characters; `</think>` is one token of the vocabulary, so in practice nothing is held).
The newlines that follow `</think>` are dropped from the answer, as the chat template drops them
from earlier assistant turns (`content.split('</think>')[-1].lstrip('\\n')`); a `<think>` the
model writes itself at the start is dropped too.

Source: the Qwen3 / Qwen3.6 chat template (spec §2, the tokenizer's chat template) and vLLM's
`qwen3` reasoning parser (the response fields).
"""

from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"


class ReasoningSplitter:
    """Splits one answer's text, fed delta by delta, into (reasoning, content) pieces.

    thinking: whether the output starts inside the reasoning (the request's enable_thinking
    with a generation prompt). `feed(text)` returns the (reasoning, content) text of that delta
    (either may be ""); `finish()` returns what was held back, at the end. Joined over all
    deltas, reasoning + "</think>" + (dropped newlines) + content is the text fed, less a
    leading "<think>".
    """

    def __init__(self, thinking: bool) -> None:
        self.thinking = thinking  # still inside the reasoning
        self._held = ""  # the tail that may begin THINK_END (or, at the start, THINK_START)
        self._started = False  # any reasoning given out (a leading <think> is dropped before)
        self._content_started = False  # any answer text given out (leading newlines dropped)

    @property
    def ended_thinking(self) -> bool:
        """Whether the reasoning is over (or never began)."""
        return not self.thinking

    def feed(self, text: str) -> tuple[str, str]:
        buf = self._held + text
        self._held = ""
        if not self.thinking:
            return "", self._content(buf)
        if not self._started:
            if THINK_START.startswith(buf):  # "" or a beginning of "<think>": wait
                self._held = buf
                return "", ""
            if buf.startswith(THINK_START):
                buf = buf[len(THINK_START):]
        end = buf.find(THINK_END)
        if end >= 0:
            self.thinking = False
            self._started = True
            return buf[:end], self._content(buf[end + len(THINK_END):])
        keep = _prefix_tail(buf, THINK_END)
        self._held = buf[len(buf) - keep:] if keep else ""
        out = buf[:len(buf) - keep]
        self._started = self._started or bool(out)
        return out, ""

    def finish(self) -> tuple[str, str]:
        """What was held back: reasoning if the thinking never ended, else answer."""
        held, self._held = self._held, ""
        if self.thinking:
            return ("" if held == THINK_START and not self._started else held), ""
        return "", self._content(held)

    def _content(self, text: str) -> str:
        if not self._content_started:
            text = text.lstrip("\n")
            self._content_started = bool(text)
        return text


def _prefix_tail(text: str, marker: str) -> int:
    """The length of the longest tail of text that is a proper beginning of marker (0 if none)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def split(text: str, thinking: bool) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a whole answer, as a non-streaming response gives them:
    reasoning None when thinking is off or empty; content None when the reasoning never ended
    (the answer was cut inside it, e.g. by max_tokens)."""
    s = ReasoningSplitter(thinking)
    r1, c1 = s.feed(text)
    r2, c2 = s.finish()
    if not thinking:
        return None, c1 + c2
    return (r1 + r2) or None, (c1 + c2) if s.ended_thinking else None
