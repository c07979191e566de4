"""Structured output: hold a request's tokens to a JSON grammar (OpenAI `response_format`).

    python -m pytest -q tests/test_structured.py

xgrammar (Dong et al. 2024, "XGrammar: Flexible and Efficient Structured Generation Engine for
Large Language Models"; the library vLLM and SGLang use) compiles a JSON Schema, or its builtin
JSON grammar, against the tokenizer's vocabulary and gives, per step, the tokens allowed next as
a packed bitmask (int32 words, bit j of word i = token 32 i + j). The engine fills one row per
structured request before a step (`Guide.mask`), the sampler sets every other logit to -inf
(sampler.py), and the sampled token is fed back (`Guide.accept`). The request stops (STOP) when
the grammar is complete and only a stop token may follow.

Thinking: Qwen3.6 thinks first unless the prompt closed the think block. When the prompt ends
inside `<think>` (its last `<think>` after its last `</think>`), the grammar starts after the
model writes `</think>`: the reasoning is free text, the answer is the JSON (vLLM's
"structured outputs after reasoning" in its reasoning parsers does the same).

The vocabulary given to xgrammar is the tokenizer's token bytes, with every added token
(`<|im_end|>`, `<think>`, `<tool_call>`, ...; `Tokenizer.is_added`) given as empty bytes so no
grammar can allow it, bar the stop tokens (EOS ids) xgrammar allows at the end. Bits past
the tokenizer's vocabulary, up to the model's (padded) vocab size, are 0.

xgrammar is optional: without it, a structured request is refused (ValueError -> HTTP 400).
"""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future

import torch

from tailored.engine.types import StructuredOutput

logger = logging.getLogger(__name__)

# a compiled grammar is reused by every request with the same spec (agents send one schema
# many times); xgrammar's own compiler cache is keyed the same way, this one skips its lock
_CACHE_SIZE = 256
# whitespace characters allowed in a row between JSON tokens: pretty-printed JSON (newline and
# indentation) fits, and a model that would pad with whitespace forever cannot (a small model
# did, up to max_tokens, with no bound)
MAX_WHITESPACE = 64
LEADING_WHITESPACE = 8  # whitespace characters allowed before a JSON answer
COMPILE_WORKERS = 2  # grammars compiled at once (each on its own thread)
# a prompt leaves thinking open when its last `<think>` is among its last tokens (the chat
# template ends the generation prompt with "<think>\n"); a `<think>` earlier in a completions
# prompt is text about the tag, not an open block
THINK_TAIL_TOKENS = 3
_ANY_OBJECT = '{"type": "object"}'


class Grammars:
    """The engine's grammar compiler: built once (`warm_in_background` at engine start when
    EngineConfig.grammar_warmup, as `tailored serve` sets it; else at the first structured
    request): xgrammar's tokenizer info and compiler preprocess the whole
    vocabulary, ~2.5 s for Qwen's 248k tokens on one CPU core.

    tokenizer: tailored.tokenizer.Tokenizer (token_bytes, vocab_size, eos_token_ids,
        token_to_id); vocab_size: the model's vocab size (lm_head rows, ≥ the tokenizer's);
    eos_token_ids: the ids that end a request (allowed once the grammar is complete)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.think_start = tokenizer.token_to_id("<think>")
        self.think_end = tokenizer.token_to_id("</think>")
        self._compiler = None
        self._slots = threading.BoundedSemaphore(COMPILE_WORKERS)
        self._cache: OrderedDict = OrderedDict()  # (kind, schema) -> compiled grammar, LRU
        self._lock = threading.Lock()

    def warm_in_background(self) -> threading.Thread | None:
        """Build the compiler, and JSON mode's grammar, on a daemon thread (~2.5 s for Qwen's
        vocabulary on one core): the first structured request would otherwise stall every
        stream of the engine's thread that long. None (nothing started) without xgrammar."""
        import importlib.util

        if importlib.util.find_spec("xgrammar") is None:
            return None

        def build():
            try:
                self.compile(StructuredOutput("json_object"))
            except Exception:  # noqa: BLE001 - the first request raises it again, as a 400
                logger.exception("structured output: building the grammar compiler failed")

        t = threading.Thread(target=build, name="grammar-warmup", daemon=True)
        t.start()
        return t

    def _xgr(self):
        try:
            import xgrammar
        except ImportError as e:  # optional dependency
            raise ValueError("response_format needs the xgrammar package on the server "
                             "(pip install xgrammar)") from e
        return xgrammar

    def compiler(self):
        with self._lock:
            if self._compiler is None:
                xgr = self._xgr()
                tok = self.tokenizer
                vocab = [b"" if tok.is_added(i) else tok.token_bytes(i)
                         for i in range(tok.vocab_size)]
                info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=self.vocab_size,
                                         stop_token_ids=list(self.eos_token_ids))
                self._compiler = xgr.GrammarCompiler(info, max_threads=2)
            return self._compiler

    def compile(self, spec: StructuredOutput):
        """The compiled grammar of `spec`. Raises ValueError (one line) for a schema xgrammar
        cannot compile, or without xgrammar."""
        return _compile(self, spec)

    def submit(self, spec: StructuredOutput) -> Future:
        """`compile` on a worker thread (xgrammar releases the GIL while it compiles: the
        engine loop keeps stepping; a pathological regex can take minutes). Raises ValueError
        at once without xgrammar."""
        self.compiler()
        future: Future = Future()

        def run():
            with self._slots:  # at most COMPILE_WORKERS compile at once
                if not future.set_running_or_notify_cancel():
                    return
                try:
                    future.set_result(_compile(self, spec))
                except BaseException as e:  # noqa: BLE001 - the engine reads it from the future
                    future.set_exception(e)

        # a daemon thread, not a ThreadPoolExecutor's: those are joined at interpreter exit,
        # so a compile running for minutes would hold the server's shutdown
        threading.Thread(target=run, name="grammar", daemon=True).start()
        return future

    def guide(self, spec: StructuredOutput, prompt_ids: list[int], compiled=None) -> "Guide":
        """A new request's matcher (`compiled`: its grammar if compiled already); it waits for
        `</think>` when the prompt ends in an open think block (the chat template's generation
        prompt with thinking on: `<think>` then at most a newline). Raises ValueError as
        `compile`."""
        if compiled is None:
            compiled = self.compile(spec)
        xgr = self._xgr()
        start = _last(prompt_ids, self.think_start) if self.think_start is not None else -1
        waiting = (start >= 0 and start >= len(prompt_ids) - THINK_TAIL_TOKENS
                   and _last(prompt_ids, self.think_end) < start)
        return Guide(xgr, xgr.GrammarMatcher(compiled), self.vocab_size,
                     self.think_end if waiting else None)


def _compile_uncached(grammars: Grammars, kind: str, schema: str | None):
    compiler = grammars.compiler()
    xgr = grammars._xgr()
    try:
        if kind in ("json_object", "json_schema"):
            if kind == "json_schema":
                problem = unsupported_schema(json.loads(schema))
                if problem:
                    raise ValueError(problem)
            # json_object: OpenAI's JSON mode is an object (not any JSON value); json_schema
            # strict: no properties beyond the schema's unless it allows them
            body = xgr.Grammar.from_json_schema(
                _ANY_OBJECT if kind == "json_object" else schema, any_whitespace=True,
                max_whitespace_cnt=MAX_WHITESPACE, strict_mode=kind == "json_schema")
            # a few whitespace characters may come first: Qwen writes "</think>\n\n" before
            # its answer, and a grammar that forbids them forces an unlikely first token
            return compiler.compile_grammar(xgr.Grammar.concat(_leading_space(xgr), body))
        if kind == "regex":
            return compiler.compile_regex(schema)
        if kind == "choice":  # one of the strings, exactly (JSON string escapes are EBNF's)
            options = json.loads(schema)
            return compiler.compile_grammar(
                "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options))
        if kind == "grammar":
            return compiler.compile_grammar(schema)
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError for bad input
        text = str(e).strip()
        first = text.splitlines()[0] if text else type(e).__name__
        # "[13:22:29] /project/cpp/regex_converter.cc:94: Regex parsing error at ..." -> the message
        first = _XGR_PREFIX.sub("", first)
        raise ValueError(f"{_WHAT[kind]} cannot be used: {first[:300]}") from None
    raise ValueError(f"structured output: unknown kind {kind!r}")


@functools.lru_cache(maxsize=1)
def _leading_space(xgr):
    return xgr.Grammar.from_ebnf(f"root ::= [ \\t\\n]{{0,{LEADING_WHITESPACE}}}")


_XGR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")
_WHAT = {"json_object": "response_format: the JSON schema",
         "json_schema": "response_format: the JSON schema",
         "regex": "structured_outputs.regex", "choice": "structured_outputs.choice",
         "grammar": "structured_outputs.grammar"}


def _compile(grammars: Grammars, spec: StructuredOutput):
    """`spec`'s grammar from the instance's LRU cache (per instance: a module-level cache would
    keep every engine's compiler alive, ~GBs over a test session), else compiled now."""
    key = (spec.kind, spec.schema)
    with grammars._lock:
        compiled = grammars._cache.get(key)
        if compiled is not None:
            grammars._cache.move_to_end(key)
            return compiled
    compiled = _compile_uncached(grammars, spec.kind, spec.schema)  # ValueError: not cached
    with grammars._lock:
        grammars._cache[key] = compiled
        while len(grammars._cache) > _CACHE_SIZE:
            grammars._cache.popitem(last=False)
    return compiled


# JSON Schema keywords xgrammar 0.2 does not enforce (it compiles the schema without them, so
# the answer would ignore them): refused, as vLLM refuses them for xgrammar
_UNSUPPORTED_KEYWORDS = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas",
                         "patternProperties", "unevaluatedItems", "contains", "$anchor",
                         "$dynamicRef", "propertyNames")
_LOOKAROUND = re.compile(r"\(\?<?[=!]")


def unsupported_schema(schema, path: str = "schema", depth: int = 0) -> str | None:
    """Why xgrammar would not enforce `schema` (a JSON Schema as Python values): a keyword it
    ignores, `allOf` of several schemas, `uniqueItems`, a `$ref` other than "#..." JSON
    pointers, a `pattern` with lookaround, a `required` property a strict schema forbids, an
    empty `type` list. None when it can be enforced (as far as these checks see)."""
    if depth > 64:
        return f"{path}: nested too deeply"
    if isinstance(schema, list):
        for i, v in enumerate(schema):
            why = unsupported_schema(v, f"{path}[{i}]", depth + 1)
            if why:
                return why
        return None
    if not isinstance(schema, dict):
        return None
    for key in _UNSUPPORTED_KEYWORDS:
        if key in schema:
            return f"{path}: the keyword '{key}' is not supported"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return f"{path}: 'allOf' of more than one schema is not supported"
    if schema.get("uniqueItems") is True:
        return f"{path}: 'uniqueItems' is not supported"
    ref = schema.get("$ref")
    if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
        return f"{path}: only local '$ref's (\"#/...\") are supported, got {ref[:80]!r}"
    if isinstance(ref, str) and "%" in ref:
        return f"{path}: escaped '$ref' pointers are not supported, got {ref[:80]!r}"
    pattern = schema.get("pattern")
    if isinstance(pattern, str) and _LOOKAROUND.search(pattern):
        return f"{path}: lookaround in 'pattern' is not supported"
    if schema.get("type") == []:
        return f"{path}: 'type' must not be an empty list"
    props = schema.get("properties")
    required = schema.get("required")
    if (isinstance(required, list) and schema.get("additionalProperties", False) is False
            and not schema.get("patternProperties")):
        names = props if isinstance(props, dict) else {}
        missing = [r for r in required if isinstance(r, str) and r not in names]
        if missing:
            return (f"{path}: required property {missing[0]!r} is not in 'properties' (no "
                    "other property is allowed)")
    for key, value in schema.items():
        if key in ("enum", "const", "default", "examples", "description", "title"):
            continue  # values, not schemas
        if key in ("properties", "$defs", "definitions") and isinstance(value, dict):
            for name, sub in value.items():
                why = unsupported_schema(sub, f"{path}.{key}.{name}", depth + 1)
                if why:
                    return why
        elif isinstance(value, (dict, list)):
            why = unsupported_schema(value, f"{path}.{key}", depth + 1)
            if why:
                return why
    return None


def _last(ids: list[int], token: int) -> int:
    """The index of the last `token` in ids, -1 if none."""
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] == token:
            return i
    return -1


class Guide:
    """One request's grammar state. `mask()` before a step that samples it, `accept(token)`
    with each token it got, `done` once the grammar ended (stop the request)."""

    def __init__(self, xgr, matcher, vocab_size: int, wait_for: int | None):
        self._xgr = xgr
        self._matcher = matcher
        self._wait_for = wait_for  # a token before which the grammar is not applied
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # [1, ceil(V / 32)] int32
        self.failed = False  # a token the grammar refused (only if the mask was bypassed)

    @property
    def active(self) -> bool:
        return self._wait_for is None

    @property
    def done(self) -> bool:
        return self.failed or (self.active and self._matcher.is_terminated())

    def mask(self) -> torch.Tensor | None:
        """The allowed-token bitmask for the next token (a new int32 CPU tensor
        [ceil(vocab / 32)]), or None while the grammar has not started (thinking)."""
        if not self.active:
            return None
        self._matcher.fill_next_token_bitmask(self._bitmask, 0)
        return self._bitmask[0].clone()

    def accept(self, token: int) -> None:
        """Feed one generated token. A token the grammar refuses (possible only when the
        sampler fell back past the mask: NaN logits) marks the guide failed (`done`)."""
        if not self.active:
            if token == self._wait_for:
                self._wait_for = None
            return
        if self._matcher.is_terminated():
            return
        if not self._matcher.accept_token(token):
            logger.warning("structured output: the grammar refused token %d; stopping", token)
            self.failed = True
