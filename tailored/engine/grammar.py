"""Structured output: hold a request's tokens to a JSON grammar (OpenAI `response_format`).

    python -m pytest -q tests/engine/test_structured.py

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

Tool calls (chat `tool_choice` "required" or a named function; or "auto" beside a
response_format, where the answer is calls or the schema's JSON): the answer is held to
Qwen3.6's tool-call XML (tool_calls.py) by xgrammar's structural tag for this model family,
each argument exactly per its JSON Schema (tool_grammar.py). A schema's `date`, `time`,
`date-time` and `ipv4` formats are held exactly (schema_formats.py).

The vocabulary given to xgrammar is the tokenizer's token bytes, with every added token
(`<|im_end|>`, `<think>`, ...; `Tokenizer.is_added`) given as empty bytes so no grammar can
allow it, bar the stop tokens (EOS ids) xgrammar allows at the end, and `<tool_call>` /
`</tool_call>` (engine/tool_format.py), which keep their text: the tool-call grammar names them (a
JSON string may then hold them too: plain text there). Bits past the tokenizer's vocabulary, up
to the model's (padded) vocab size, are 0.

xgrammar is optional: without it, a structured request is refused (ValueError -> HTTP 400).
"""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import replace

import torch

from tailored.engine.grammar_text import safe_grammar
from tailored.engine.schema_formats import SCHEMA_LISTS, SCHEMA_MAPS, SCHEMA_ONE, exact_formats
from tailored.engine.tool_grammar import tool_call_grammar
from tailored.engine.types import StructuredOutput
# the markers the tool-call grammar names (they keep their text in the vocabulary)
from tailored.engine.tool_format import TOOL_END, TOOL_START

logger = logging.getLogger(__name__)

# a compiled grammar is reused by every request with the same spec (agents send one schema
# many times); xgrammar's own compiler cache is keyed the same way, this one skips its lock
_CACHE_SIZE = 256
# whitespace characters allowed in a row between JSON tokens: pretty-printed JSON (newline and
# indentation) fits, and a model that would pad with whitespace forever cannot (a small model
# did, up to max_tokens, with no bound)
MAX_WHITESPACE = 64
LEADING_WHITESPACE = 8  # whitespace characters allowed before a JSON answer
COMPILE_WORKERS = 4  # grammars compiled at once (each on its own thread)
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
        # StructuredOutput (frozen: kind, schema, compact) -> compiled grammar, LRU
        self._cache: OrderedDict = OrderedDict()
        self._lock = threading.Lock()  # the compiler's build (seconds)
        # the cache's own lock: the engine thread reads the cache while a worker may hold
        # `_lock` for the compiler's build
        self._cache_lock = threading.Lock()

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

    def _xgr(self, field: str = "response_format"):
        try:
            import xgrammar
        except ImportError as e:  # optional dependency
            raise ValueError(f"{field} needs the xgrammar package on the server "
                             "(pip install xgrammar)") from e
        return xgrammar

    def compiler(self):
        with self._lock:
            if self._compiler is None:
                xgr = self._xgr()
                tok = self.tokenizer
                # the added tokens a grammar may produce: the markers the tool-call grammar names
                markers = {tok.token_to_id(t) for t in (TOOL_START, TOOL_END)}
                vocab = [b"" if tok.is_added(i) and i not in markers else tok.token_bytes(i)
                         for i in range(tok.vocab_size)]
                info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=self.vocab_size,
                                         stop_token_ids=list(self.eos_token_ids))
                self._compiler = xgr.GrammarCompiler(info, max_threads=2)
            return self._compiler

    def compile(self, spec: StructuredOutput):
        """The compiled grammar of `spec`, now, on this thread. Raises ValueError (one line)
        for a grammar xgrammar cannot parse or compile, or without xgrammar."""
        compiled = self.cached(spec)
        return compiled if compiled is not None else self._compile(spec, self.parse(spec))

    def cached(self, spec: StructuredOutput):
        """`spec`'s compiled grammar if compiled before (LRU), else None."""
        with self._cache_lock:
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
            return compiled

    def parse(self, spec: StructuredOutput):
        """`spec` as an xgrammar Grammar, not yet compiled against the vocabulary: fast (a
        JSON schema with a long pattern ~70 ms; a regex ~0.2 ms), so the engine thread does it
        and a bad grammar is a 400 at once. Characters U+0080-U+00FF before a hex digit are
        kept as written (`grammar_text.safe_grammar`: xgrammar 0.2.9 would compile "é" + "a"
        as U+0E9A). Raises ValueError (one line)."""
        xgr = self._xgr(spec.field)
        grammar = self._parse(xgr, spec)
        try:
            return safe_grammar(xgr, grammar)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError for bad input
            raise _one_line(spec.kind, e) from None

    def _parse(self, xgr, spec: StructuredOutput):
        kind, text = spec.kind, spec.schema
        if kind == "tool_calls":
            return self._tool_calls(xgr, json.loads(text))
        try:
            if kind in ("json_object", "json_schema"):
                source = _ANY_OBJECT
                if kind == "json_schema":
                    schema = json.loads(text)
                    problem = unsupported_schema(schema)
                    if problem:
                        raise ValueError(problem)
                    source = json.dumps(exact_formats(schema))  # (schema_formats.py)
                # json_object: OpenAI's JSON mode is an object (not any JSON value);
                # json_schema strict: no properties beyond the schema's unless it allows them
                if spec.compact:  # xgrammar's compact separators, no free whitespace
                    return xgr.Grammar.from_json_schema(
                        source, any_whitespace=False, separators=(",", ":"),
                        strict_mode=kind == "json_schema")
                body = xgr.Grammar.from_json_schema(
                    source, any_whitespace=True, max_whitespace_cnt=MAX_WHITESPACE,
                    strict_mode=kind == "json_schema")
                # a few whitespace characters may come first: Qwen writes "</think>\n\n"
                # before its answer, and a grammar that forbids them forces an unlikely token
                return xgr.Grammar.concat(_leading_space(xgr), body)
            if kind == "regex":
                return xgr.Grammar.from_regex(text)
            if kind == "choice":  # one of the strings, exactly (JSON string escapes are EBNF's)
                options = json.loads(text)
                return xgr.Grammar.from_ebnf(
                    "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in options))
            if kind == "grammar":
                return xgr.Grammar.from_ebnf(text)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError for bad input
            raise _one_line(kind, e) from None
        raise ValueError(f"structured output: unknown kind {kind!r}")

    def _tool_calls(self, xgr, spec: dict):
        """The grammar of a "tool_calls" spec (types.StructuredOutput, parsed): forced calls,
        or with tool_choice "auto" calls or the spec's `answer` (tool_grammar.py). Errors
        name tool_choice, or the answer's own field for its grammar."""
        choice = spec["tool_choice"]
        answer = None
        if choice == "auto":  # the answer's own errors name its field (response_format, ...)
            a = spec["answer"]
            answer = self._parse(xgr, StructuredOutput(a["kind"], a.get("schema"),
                                                       compact=a.get("compact", False)))
        named = choice["function"]["name"] if isinstance(choice, dict) else None
        try:
            for i, tool in enumerate(spec["tools"]):
                fn = tool["function"]
                if named is not None and fn["name"] != named:
                    continue  # the grammar holds only the named function
                if fn.get("strict") is False:
                    continue  # xgrammar leaves its arguments free (any JSON object)
                # (unique names and parameters that describe an object: the server's checks,
                # protocol.py)
                problem = unsupported_schema(fn.get("parameters"),
                                             f"tools[{i}].function.parameters")
                if problem:
                    raise ValueError(problem)
            return tool_call_grammar(xgr, spec, self.tokenizer, answer)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError for bad input
            raise _one_line("tool_calls", e) from None

    def _compile(self, spec: StructuredOutput, grammar):
        """Compile a parsed grammar against the vocabulary and cache it."""
        compiler = self.compiler()
        try:
            compiled = compiler.compile_grammar(grammar)
        except Exception as e:  # noqa: BLE001
            raise _one_line(spec.kind, e) from None
        with self._cache_lock:
            self._cache[spec] = compiled
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def submit(self, spec: StructuredOutput, grammar) -> Future:
        """Compile a parsed grammar (`parse`) on a daemon thread, at most COMPILE_WORKERS at
        once: xgrammar releases the GIL while it compiles, so the engine loop keeps stepping
        (a pathological pattern compiles for minutes). The future's `started_at` is the
        monotonic time its compile began (None while it queues); `cancel()` drops a queued
        one. The compiler itself is built on that thread if it is not yet (never here: the
        engine thread must not wait for it)."""
        future: Future = Future()
        future.started_at = None

        def run():
            with self._slots:
                if not future.set_running_or_notify_cancel():
                    return
                future.started_at = time.monotonic()
                try:
                    future.set_result(self._compile(spec, grammar))
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
        xgr = self._xgr(spec.field)
        start = _last(prompt_ids, self.think_start) if self.think_start is not None else -1
        waiting = (start >= 0 and start >= len(prompt_ids) - THINK_TAIL_TOKENS
                   and _last(prompt_ids, self.think_end) < start)
        return Guide(xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, self.vocab_size),
                     self.think_end if waiting else None)


@functools.lru_cache(maxsize=1)
def _leading_space(xgr):
    return xgr.Grammar.from_ebnf(f"root ::= [ \\t\\n]{{0,{LEADING_WHITESPACE}}}")


_XGR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")
_WHAT = {"json_object": "response_format: the JSON schema",
         "json_schema": "response_format: the JSON schema",
         "regex": "structured_outputs.regex", "choice": "structured_outputs.choice",
         "grammar": "structured_outputs.grammar", "tool_calls": "tool_choice"}


def _one_line(kind: str, e: Exception) -> ValueError:
    """xgrammar's error as a one-line ValueError naming the request field."""
    text = str(e).strip()
    first = text.splitlines()[0] if text else type(e).__name__
    # "[13:22:29] /project/cpp/regex_converter.cc:94: Regex parsing error at ..." -> the message
    first = _XGR_PREFIX.sub("", first)
    return ValueError(f"{_WHAT.get(kind, 'structured output')} cannot be used: {first[:300]}")


# JSON Schema keywords xgrammar 0.2 does not enforce (it compiles the schema without them, so
# the answer would ignore them): refused, as vLLM refuses them for xgrammar
_UNSUPPORTED_KEYWORDS = ("not", "if", "then", "else", "dependentRequired", "dependentSchemas",
                         "patternProperties", "unevaluatedItems", "contains", "$anchor",
                         "$dynamicRef", "propertyNames")
_LOOKAROUND = re.compile(r"\(\?<?[=!]")


# the keywords that hold subschemas (schema_formats.py) are walked; anything else is a value
# (enum, const, examples, vendor extensions such as pydantic's json_schema_extra): not checked
# keywords that only annotate: they may stand beside `$ref` / a one-schema `allOf`
_ANNOTATIONS = {"title", "description", "default", "examples", "$comment", "$schema", "$id",
                "$defs", "definitions", "deprecated", "readOnly", "writeOnly"}
_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool,
               "object": dict, "array": list, "null": type(None)}


def _is_type(value, name: str) -> bool:
    if name in ("integer", "number") and isinstance(value, bool):
        return False
    if name == "integer" and isinstance(value, float):
        return value.is_integer()
    return isinstance(value, _JSON_TYPES.get(name, object))


def unsupported_schema(schema, path: str = "schema", depth: int = 0) -> str | None:
    """Why xgrammar would not enforce `schema` (a JSON Schema as Python values), or None when
    these checks see nothing it would ignore: keywords it ignores (`not`, `if`, ...), `allOf`
    of several schemas, `uniqueItems`, non-local or escaped `$ref`, constraints beside a `$ref`
    or a one-schema `allOf`, lookaround in `pattern`, `pattern` with a length bound,
    `multipleOf` on non-integers, enum / const values of another `type`, a `required` property
    the schema's own `properties` forbid, an empty `type`, `anyOf`, `oneOf` or `allOf` list.
    `oneOf` is enforced as
    `anyOf` (exact for discriminated unions, as pydantic writes them)."""
    if depth > 64:
        return f"{path}: nested too deeply"
    if not isinstance(schema, dict):
        return None
    for key in _UNSUPPORTED_KEYWORDS:
        if key in schema:
            return f"{path}: the keyword '{key}' is not supported"
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        return f"{path}: 'allOf' of more than one schema is not supported"
    if schema.get("uniqueItems") is True:
        return f"{path}: 'uniqueItems' is not supported"
    ref = schema.get("$ref")
    if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
        return f"{path}: only local '$ref's (\"#/...\") are supported, got {ref[:80]!r}"
    if isinstance(ref, str) and "%" in ref:
        return f"{path}: escaped '$ref' pointers are not supported, got {ref[:80]!r}"
    if "$ref" in schema or isinstance(all_of, list):
        extra = sorted(set(schema) - _ANNOTATIONS - {"$ref", "allOf"})
        if extra:
            return (f"{path}: constraints beside '$ref' / 'allOf' are not supported "
                    f"({', '.join(extra[:4])}): move them into the referenced schema")
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        if _LOOKAROUND.search(pattern):
            return f"{path}: lookaround in 'pattern' is not supported"
        if "minLength" in schema or "maxLength" in schema:
            return f"{path}: 'pattern' together with 'minLength' / 'maxLength' is not supported"
    for key in ("type", "anyOf", "oneOf", "allOf"):
        # no value matches an empty type list, anyOf or oneOf; xgrammar let whitespace alone
        # through for the last three (new-user attack, kb/0057 §5)
        if schema.get(key) == []:
            return f"{path}: '{key}' must not be an empty list"
    types = schema.get("type")
    type_list = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    if "multipleOf" in schema and type_list != ["integer"]:
        return f"{path}: 'multipleOf' is only supported with type 'integer'"
    values = list(schema.get("enum", [])) if isinstance(schema.get("enum"), list) else []
    if "const" in schema:
        values.append(schema["const"])
    if type_list and values:
        bad = [v for v in values if not any(_is_type(v, t) for t in type_list)]
        if bad:
            return f"{path}: the value {json.dumps(bad[0])[:40]} is not of its 'type' {types}"
    props = schema.get("properties")
    required = schema.get("required")
    if (isinstance(props, dict) and isinstance(required, list)
            and schema.get("additionalProperties", False) is False):
        missing = [r for r in required if isinstance(r, str) and r not in props]
        if missing:
            return (f"{path}: required property {missing[0]!r} is not in 'properties' (no "
                    "other property is allowed)")
    for key in SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                why = unsupported_schema(sub, f"{path}.{key}.{name}", depth + 1)
                if why:
                    return why
    for key in SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                why = unsupported_schema(sub, f"{path}.{key}[{i}]", depth + 1)
                if why:
                    return why
    for key in SCHEMA_ONE:
        why = unsupported_schema(schema.get(key), f"{path}.{key}", depth + 1)
        if why:
            return why
    return None


def with_mask(seq, mask: torch.Tensor | None):
    """A sampled row (ScheduledSeq) under its grammar's next-token mask. Where the grammar
    can only end (the mask allows nothing but the row's banned stop ids: min_tokens not
    reached), the stop ids stay allowed: the grammar's end wins over min_tokens, as every
    token masked would send the sampler past the mask (a token the grammar refuses)."""
    banned = seq.banned_ids
    if banned and mask is not None:
        ids = torch.tensor(banned, dtype=torch.long)
        ids = ids[ids // 32 < mask.shape[0]]
        bits = torch.zeros_like(mask)  # the banned ids' bits (distinct bits: sum = or)
        bits.index_put_((ids // 32,), (1 << (ids % 32)).to(torch.int32), accumulate=True)
        if not bool((mask & ~bits).any()):
            banned = ()
    return replace(seq, allowed=mask, banned_ids=banned)


def _last(ids: list[int], token: int) -> int:
    """The index of the last `token` in ids, -1 if none."""
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] == token:
            return i
    return -1


class Guide:
    """One request's grammar state. `mask()` before a step that samples it, `accept(token)`
    with each token it got, `done` once the grammar ended (stop the request)."""

    def __init__(self, matcher, bitmask: torch.Tensor, wait_for: int | None):
        self._matcher = matcher
        self._wait_for = wait_for  # a token before which the grammar is not applied
        self._bitmask = bitmask  # [1, ceil(V / 32)] int32, xgrammar's allocate_token_bitmask
        self.failed = False  # a token the grammar refused (only if the mask was bypassed)
        # the grammar allowed no token at all (a grammar no text satisfies, e.g. the regex
        # "[^\\s\\S]", or "abc" then such a class): the sampler then falls back past the
        # empty mask like on NaN logits, and the request is the one at fault
        self.dead = False
        self.too_slow: float | None = None  # seconds of a mask over the engine's limit

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
        if not bool(self._bitmask.any()) and not self._matcher.is_terminated():
            self.dead = True
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
