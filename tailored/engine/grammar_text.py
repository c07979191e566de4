"""Workarounds for xgrammar 0.2.9 (the newest release) on its printed grammars.

1. Characters U+0080-U+00FF followed by a hex digit change meaning when a grammar compiles.

Its printer writes such a character as a two-digit escape (`é` → `\\xe9`), and `compile_grammar`
prints the grammar and parses it again. The parser's `\\x` takes every hex digit that follows,
so `"éa"` compiles to `"\\u0e9a"`. A choice of "Montréal" then answers "Montrບl", and an enum,
const, property name or tool name with "é" + [0-9a-fA-F] comes out wrong under a 200 (new-user
attack, kb/0057 §5). Character classes break the same way: `[éa]` becomes `[\\u0e9a]`.

The fix runs on the printed grammar, where every `\\x` has exactly two digits, so nothing is
ambiguous yet. A literal is split after such an escape: `"Montr\\xe9al"` becomes
`("Montr\\xe9" "al")`, which is the same language and survives the print and parse inside
`compile_grammar`. A class is reordered so that no escape is followed by a raw hex digit; a
class is a set, so the order does not matter.

2. A JSON string with a length bound (`maxLength`, `minLength`) is compiled to characters of
the class `[^"\\\r\n]`, which lets the other control characters (U+0000-U+001F) stand raw in
the string: no JSON (a strict parser, Python's json and pydantic, refuses the answer; a
random-weight model wrote U+0015 in a forced call's nested object). The class is written
`[^\0-\x1f"\\]`, as xgrammar's own unbounded strings have it.

3. A character counted by a length bound (those classes, and `[\0-\U0010ffff]`: a tool-call
argument's) may be a UTF-16 surrogate's three UTF-8 bytes, which no decoder reads as one
character: the detokenizer gives three U+FFFD, and a maxLength-6 value came back with 8
characters. Both classes leave U+D800-U+DFFF out.

`safe_grammar` rewrites only where the printed text has one of these, and keeps the grammar as it is
otherwise.
"""

from __future__ import annotations

import re

_HEX = frozenset("0123456789abcdefABCDEF")
# a two-digit escape right before a hex digit (a cheap test; `rewrite` reads the escapes)
_AMBIGUOUS = re.compile(r"\\x[0-9a-fA-F]{2}[0-9a-fA-F]")
_ESCAPE_DIGITS = {"x": 2, "u": 4, "U": 8}
# a bounded JSON string's characters as xgrammar prints them, and as they should be
_LOOSE_JSON_CHARS = '[^\\"\\\\\\r\\n]'
_JSON_CHARS = '[^\\0-\\x1f\\"\\\\\\U0000d800-\\U0000dfff]'
_ANY_CHAR = '[\\0-\\U0010ffff]'
_SCALAR_CHAR = '[\\0-\\U0000d7ff\\U0000e000-\\U0010ffff]'  # (no surrogate)


def _escape(text: str, i: int) -> int:
    """The end of the escape starting at text[i] == '\\'."""
    return i + 2 + _ESCAPE_DIGITS.get(text[i + 1], 0) if i + 1 < len(text) else i + 1


def _ends_in_x(unit: str) -> bool:
    return len(unit) >= 4 and unit[-4:-2] == "\\x"


def _literal(text: str, i: int) -> tuple[str, int]:
    """The literal starting at text[i] == '"', rewritten, and the index after it."""
    parts, cur, j = [], "", i + 1
    while text[j] != '"':
        end = _escape(text, j) if text[j] == "\\" else j + 1
        cur += text[j:end]
        if _ends_in_x(text[j:end]) and text[end] in _HEX:
            parts.append(cur)
            cur = ""
        j = end
    parts.append(cur)
    if len(parts) == 1:
        return text[i:j + 1], j + 1
    return "(" + " ".join(f'"{p}"' for p in parts) + ")", j + 1


def _class(text: str, i: int) -> tuple[str, int]:
    """The character class starting at text[i] == '[', reordered, and the index after it.
    Raises ValueError when no order of its elements is unambiguous."""
    j = i + 1
    head = "["
    if text[j] == "^":
        head, j = "[^", j + 1
    units = []  # each char of the class as written: a raw char or an escape
    while text[j] != "]":
        end = _escape(text, j) if text[j] == "\\" else j + 1
        units.append(text[j:end])
        j = end
    if not any(_ends_in_x(u) and len(v) == 1 and v in _HEX for u, v in zip(units, units[1:])):
        return text[i:j + 1], j + 1  # unambiguous as written
    elements, k = [], 0  # a char, or a range "a-z" (a '-' between two chars)
    while k < len(units):
        if k + 2 < len(units) and units[k + 1] == "-":
            elements.append(units[k:k + 3])
            k += 3
        else:
            elements.append(units[k:k + 1])
            k += 1

    def starts_hex(e):
        return len(e[0]) == 1 and e[0] in _HEX

    # elements opening with a raw hex digit first, the one of them that ends in an escape
    # last among them (two such elements cannot both be safe), then the rest: after an
    # escape comes either an escape, a non-hex char or the closing bracket
    first = [e for e in elements if starts_hex(e) and not _ends_in_x(e[-1])]
    tail = [e for e in elements if starts_hex(e) and _ends_in_x(e[-1])]
    rest = [e for e in elements if not starts_hex(e)]
    if len(tail) > 1:
        raise ValueError(f"a character class xgrammar 0.2.9 cannot keep: {text[i:j + 1][:80]}")
    order = first + tail + rest
    return head + "".join("".join(e) for e in order) + "]", j + 1


def rewrite(text: str) -> str:
    """Printed xgrammar EBNF with no two-digit escape followed by a raw hex digit, the same
    language. Raises ValueError for a class no order can fix (two ranges that both start
    with a raw hex digit and end in such an escape)."""
    out, i = [], 0
    while i < len(text):
        c = text[i]
        if c == '"':
            piece, i = _literal(text, i)
        elif c == "[":
            piece, i = _class(text, i)
        else:
            piece, i = c, i + 1
        out.append(piece)
    return "".join(out)


def safe_grammar(xgr, grammar):
    """`grammar` unchanged when its printed form has neither an ambiguous escape nor a loose
    JSON string class (the module docstring), else parsed again from the rewritten text (root
    rule `root`, as xgrammar prints it). Raises ValueError as `rewrite`, or when xgrammar
    cannot parse its own printed grammar."""
    text = str(grammar)
    if not (_LOOSE_JSON_CHARS in text or _ANY_CHAR in text or _AMBIGUOUS.search(text)):
        return grammar
    text = text.replace(_LOOSE_JSON_CHARS, _JSON_CHARS).replace(_ANY_CHAR, _SCALAR_CHAR)
    return xgr.Grammar.from_ebnf(rewrite(text), root_rule_name="root")
