"""Incremental detokenization of one request's output ids, with stop strings.

`IncrementalDetokenizer(tokenizer, skip_special_tokens=True, stop=(), include_stop_str_in_output=False)`
    tokenizer: a `tailored.tokenizer.Tokenizer` (uses `token_bytes` and `is_special`).
    stop: stop strings (empty strings are ignored).

`add(token_ids: list[int]) -> tuple[str, str | None]`
    Feeds newly generated ids; returns (delta_text, matched_stop_string or None).
    * Works on the tokens' raw bytes, so a UTF-8 character split across tokens (CJK, emoji) is
      never emitted half: an incomplete trailing sequence is held back until it completes; bytes
      that can never complete become U+FFFD (same result as `Tokenizer.decode` on all ids).
    * Special tokens (spec §10.2 `special=True`) produce no text when skip_special_tokens.
    * Text that could still be the beginning of a stop string is held back until it cannot.
      When a stop string matches, delta_text is the text before it (plus the stop string with
      include_stop_str_in_output) and the match is returned; the rest of the batch is dropped and
      add() must not be called again.  If several match, the one that is complete first as the
      text grows wins (smallest end, then earliest start), so the result does not depend on how
      the ids are batched.

`flush() -> str`
    Held-back text at the end of generation (a partial stop-string prefix, or U+FFFD for an
    incomplete UTF-8 tail), e.g. when the request ends by length or EOS.  "" after a stop match.

The concatenation of all deltas (+ flush()) equals `tokenizer.decode(ids, skip_special_tokens)`
truncated at the first stop string.  Source: model spec §10 (tokens), vLLM stop-string semantics.
"""

from __future__ import annotations

import codecs


def prefix_hold(text: str, markers: tuple[str, ...], max_hold: int) -> int:
    """Length of the longest suffix of text, at most max_hold characters, that is a beginning
    of one of markers: the text to hold back until the next piece tells whether a marker
    completes (stop strings here; `</think>` in server/reasoning.py)."""
    for k in range(min(len(text), max_hold), 0, -1):
        tail = text[-k:]
        if any(s.startswith(tail) for s in markers):
            return k
    return 0


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True, stop=(),
                 include_stop_str_in_output: bool = False):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._stops = tuple(dict.fromkeys(s for s in stop if s))
        self._include = include_stop_str_in_output
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._held = ""  # decoded text not yet emitted (a possible stop-string prefix)
        self.stopped: str | None = None  # the stop string that matched

    def add(self, token_ids: list[int], check_stops: bool = True) -> tuple[str, str | None]:
        """check_stops False (tokens before min_tokens): the text is not searched for stop
        strings and nothing is held back for them."""
        if self.stopped is not None:
            raise RuntimeError("add() after a stop string matched")
        tok = self._tok
        data = b"".join(tok.token_bytes(t) for t in token_ids
                        if not (self._skip and tok.is_special(t)))
        text = self._held + self._utf8.decode(data)
        if not self._stops or not check_stops:
            self._held = ""
            return text, None
        match = None  # (end, start, stop): the occurrence that completes first, then the longest
        for s in self._stops:
            i = text.find(s)
            if i >= 0 and (match is None or (i + len(s), i) < match[:2]):
                match = (i + len(s), i, s)
        if match is not None:
            _, i, s = match
            self.stopped = s
            self._held = ""
            return text[:i] + (s if self._include else ""), s
        # a proper prefix of a stop string at most (max_hold: the longest stop's length - 1)
        keep = prefix_hold(text, self._stops, self._max_hold)
        self._held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], None

    def flush(self) -> str:
        if self.stopped is not None:
            return ""
        text = self._held + self._utf8.decode(b"", final=True)
        self._held = ""
        return text
