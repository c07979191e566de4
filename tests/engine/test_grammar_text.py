"""engine/grammar_text.py: xgrammar 0.2.9 compiles a character U+0080-U+00FF followed by a hex
digit as one wrong character ("é" + "a" → U+0E9A); the rewrite of the printed grammar keeps
what was written, in literals (choice, enum, const, property and tool names) and classes
(new-user attack, session 37)."""

from __future__ import annotations

import json

import pytest

from tailored.engine import grammar_text

xgr = pytest.importorskip("xgrammar")

EOS = "<eos>"
VOCAB = [chr(c) for c in range(32, 127)] + ["é", "ÿ", "\u0e9a", "\u0ff0", EOS]


@pytest.fixture(scope="module")
def compiler():
    info = xgr.TokenizerInfo(VOCAB, vocab_size=len(VOCAB), stop_token_ids=[len(VOCAB) - 1])
    return xgr.GrammarCompiler(info)


def _accepts(compiled, text: str) -> bool:
    m = xgr.GrammarMatcher(compiled)
    for ch in text:
        if not m.accept_token(VOCAB.index(ch)):
            return False
    return m.is_terminated() or m.accept_token(len(VOCAB) - 1)


def test_xgrammar_still_misreads_the_escape(compiler):
    """The bug this works around (when this fails, xgrammar fixed it: drop the workaround)."""
    raw = compiler.compile_grammar(xgr.Grammar.from_ebnf('root ::= "éa"'))
    assert _accepts(raw, "\u0e9a") and not _accepts(raw, "éa")


@pytest.mark.parametrize("make,good,bad", [
    (lambda: xgr.Grammar.from_ebnf('root ::= "Montréal" | "Québec"'),
     ["Montréal", "Québec"], ["Montr\u0e9al"]),
    (lambda: xgr.Grammar.from_ebnf("root ::= [éa]+"), ["éa", "é", "a"], ["\u0e9a", "b"]),
    (lambda: xgr.Grammar.from_ebnf("root ::= [^éa]+"), ["b", "\u0e9a"], ["é", "a"]),
    (lambda: xgr.Grammar.from_ebnf("root ::= [0-9é-ÿa-f]+ \"x\""), ["é9x", "ÿax"],
     ["\u0e9ax", "gx"]),
    (lambda: xgr.Grammar.from_ebnf('root ::= ("ÿ0")* "é"'), ["ÿ0ÿ0é", "é"], ["\u0ff0é"]),
    (lambda: xgr.Grammar.from_regex("[éa]+x"), ["éax"], ["\u0e9ax"]),
    (lambda: xgr.Grammar.from_json_schema(json.dumps({"enum": ["éa", "Québec"]}),
                                          any_whitespace=False),
     ['"éa"', '"Québec"'], ['"\u0e9a"']),
    (lambda: xgr.Grammar.from_json_schema(json.dumps(
        {"type": "object", "properties": {"données": {"type": "boolean"}},
         "required": ["données"]}), any_whitespace=False),
     ['{"données": true}'], ['{"donn\u0e9as": true}']),
])
def test_safe_grammar_keeps_what_was_written(compiler, make, good, bad):
    compiled = compiler.compile_grammar(grammar_text.safe_grammar(xgr, make()))
    assert [_accepts(compiled, s) for s in good] == [True] * len(good)
    assert [_accepts(compiled, s) for s in bad] == [False] * len(bad)


def test_a_grammar_without_the_escape_is_kept_as_is():
    g = xgr.Grammar.from_ebnf('root ::= "Montreal" | [a-f]+ | "é!"')
    assert grammar_text.safe_grammar(xgr, g) is g


def test_rewrite_splits_literals_and_reorders_classes():
    assert grammar_text.rewrite('r ::= "Montr\\xe9al" "x"') == 'r ::= ("Montr\\xe9" "al") "x"'
    assert grammar_text.rewrite('r ::= [^\\xe9a\\"]') == 'r ::= [^a\\xe9\\"]'
    assert grammar_text.rewrite('r ::= [\\x20-\\xff0-9]') == 'r ::= [0-9\\x20-\\xff]'
    # unambiguous text is unchanged, escapes of every width included
    same = 'r ::= "\\u0e9a1" [\\U0001f600a] "\\\\x41" "\\xe9!" [\\n\\-]'
    assert grammar_text.rewrite(same) == same
    with pytest.raises(ValueError, match="cannot keep"):
        grammar_text.rewrite("r ::= [0-\\xe9a-\\xff1]")
