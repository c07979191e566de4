"""Agent-shaped traffic: multi-turn conversations over a few long shared system prompts.

What a coding agent sends: a long system prompt (instructions, project notes) with tool
definitions, a task, then turn after turn the whole conversation again plus the previous
answer and a tool result (or a user message). Here:

* `system_prompts` distinct system prompts of about `system_tokens` Qwen3.6 tokens each, plus
  eight tool definitions (OpenAI `tools`, rendered into the prompt by the server's template);
  conversation j uses system prompt j mod `system_prompts`;
* each of `conversations` conversations has `turns` turns; turn 1 = [system, user task]; turn
  k + 1 = turn k's messages + the assistant's answer to turn k (its streamed text) + either a
  tool call on that answer and the tool's result (`tool_tokens` tokens of text), or, every
  third turn, a short user message. So every turn's prompt extends the previous one's;
* turns of one conversation are sent in order, each once the previous answer has ended;
  conversations run concurrently (at most `concurrency` at once, 0 = all). A failed turn is
  counted as failed and the conversation goes on with the text that arrived (every
  conversation sends all its turns, so sent = conversations x turns);
* thinking off (`chat_template_kwargs.enable_thinking = false`) unless --extra-body sets
  chat_template_kwargs: the answer is the content the next turn resends.

The text (system prompts, tool results) comes from a prompt file, by default the chat mix
(bench/prompts/chat-mix.jsonl: CPython's documentation and standard library), cut with the
Qwen3.6 tokenizer; all choices follow `seed`.

Reported per turn: requests, TTFT p50/p99, prompt tokens and cached tokens as the server's
usage says (`usage.prompt_tokens_details.cached_tokens`; tailored sends it when its prefix
cache hit, vLLM with --enable-prompt-tokens-details); in total: prompt vs cached tokens.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tailored.bench import loadgen
from tailored.bench.goodput import SLO, goodput

DEFAULT_SOURCE = Path(__file__).resolve().parents[2] / "bench" / "prompts" / "chat-mix.jsonl"
TOOLS = (
    ("read_file", "Read a file of the repository and return its text.", "path"),
    ("grep", "Search the repository for a regular expression; returns matching lines.",
     "pattern"),
    ("list_dir", "List the entries of a directory of the repository.", "path"),
    ("run_tests", "Run the test suite, or the tests matching an expression.", "expr"),
    ("run_shell", "Run a shell command in the repository and return its output.", "command"),
    ("apply_patch", "Apply a unified diff to the working tree.", "patch"),
    ("git_diff", "Show the uncommitted changes of the working tree.", "paths"),
    ("search_docs", "Search the project's documentation.", "query"),
)
TASKS = (
    "Find why the test suite fails on the parser and fix it.",
    "Add type hints to the public functions of the module you find most used.",
    "Explain how the configuration files are read, then simplify that code.",
    "Write tests for the date handling code and fix what they find.",
    "Rename the helper that formats messages and update every caller.",
    "Find dead code in the package and remove it.",
)
FOLLOW_UPS = (
    "Good. Keep going, but do not change the public interface.",
    "That is not what I meant; look at the caller first.",
    "Run the tests again after that change.",
    "Also update the documentation for this.",
)


@dataclass
class AgentMix:
    system_prompts: int = 4
    conversations: int = 32
    turns: int = 6
    system_tokens: int = 8000
    tool_tokens: int = 400
    max_tokens: int = 128
    seed: int = 0
    source: str = str(DEFAULT_SOURCE)

    def describe(self) -> dict[str, Any]:
        return {"workload": "agent-mix", **asdict(self)}


@dataclass
class Conversation:
    index: int
    system: int  # which system prompt
    tools: list[dict]
    messages: list[dict]  # turn 1's
    # per later turn: ("tool", tool name, arguments, result text) or ("user", text)
    steps: list[tuple] = field(default_factory=list)


def _paragraphs(source: str | Path) -> list[str]:
    out = []
    for it in loadgen.load_prompt_files([str(source)]):
        msgs = it.get("messages") or [{"content": it.get("prompt") or ""}]
        for m in msgs:
            c = m.get("content")
            if isinstance(c, str):
                out += [p.strip() for p in c.split("\n\n") if len(p.strip()) > 40]
    if not out:
        raise ValueError(f"{source}: no text to build the agent mix from")
    return out


class _Cutter:
    """Text of exactly n Qwen3.6 tokens (from tailored.tokenizer) out of the paragraphs."""

    def __init__(self, paragraphs: list[str]):
        from tailored.tokenizer import load_tokenizer

        self.tok = load_tokenizer(None)
        self.paras = paragraphs

    def take(self, rng: random.Random, n: int) -> str:
        k = rng.randrange(len(self.paras))
        ids: list[int] = []
        while len(ids) < n:
            ids += self.tok.encode(self.paras[k % len(self.paras)] + "\n\n", allow_special=False)
            k += 1
        return self.tok.decode(ids[:n])


def tool_defs(system: int) -> list[dict]:
    return [{"type": "function", "function": {
        "name": name, "description": f"{desc} (workspace {system})",
        "parameters": {"type": "object", "properties": {arg: {"type": "string"}},
                       "required": [arg]}}} for name, desc, arg in TOOLS]


def build(mix: AgentMix) -> list[Conversation]:
    """The conversations: deterministic in `mix` (and the source file)."""
    if min(mix.system_prompts, mix.conversations, mix.turns) < 1:
        raise ValueError("the agent mix needs >= 1 system prompt, conversation and turn")
    cut = _Cutter(_paragraphs(mix.source))
    rng = random.Random(mix.seed)
    systems = []
    for s in range(mix.system_prompts):
        head = (f"You are coding agent {s}, working in the repository of project {s}. Use the "
                "tools to read and change code; answer briefly. Project notes follow.\n\n")
        body_tokens = max(0, mix.system_tokens - len(cut.tok.encode(head)))
        systems.append(head + cut.take(rng, body_tokens))
    convs = []
    for j in range(mix.conversations):
        s = j % mix.system_prompts
        c = Conversation(j, s, tool_defs(s), [
            {"role": "system", "content": systems[s]},
            {"role": "user", "content": f"Task {j}: {rng.choice(TASKS)}"}])
        for k in range(1, mix.turns):
            if k % 3 == 0:
                c.steps.append(("user", rng.choice(FOLLOW_UPS)))
            else:
                name, _, arg = TOOLS[rng.randrange(len(TOOLS))]
                args = json.dumps({arg: f"src/module_{rng.randrange(100)}.py"})
                c.steps.append(("tool", name, args, cut.take(rng, mix.tool_tokens)))
        convs.append(c)
    return convs


def next_messages(c: Conversation, turn: int, answer: str) -> list[dict]:
    """What turn `turn` + 1 adds to turn `turn`'s messages (turn counts from 0)."""
    step = c.steps[turn]
    if step[0] == "user":
        return [{"role": "assistant", "content": answer}, {"role": "user", "content": step[1]}]
    _, name, args, result = step
    call_id = f"call_{c.index}_{turn}"
    return [{"role": "assistant", "content": answer, "tool_calls": [
                {"id": call_id, "type": "function",
                 "function": {"name": name, "arguments": args}}]},
            {"role": "tool", "tool_call_id": call_id, "content": result}]


@dataclass
class TurnResult:
    conversation: int
    turn: int
    messages: int  # messages sent in this turn's request
    result: loadgen.RequestResult


def _body(w: loadgen.Workload, model: str, c: Conversation, msgs: list[dict],
          max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model, "messages": msgs, "tools": c.tools, "max_tokens": max_tokens,
        "temperature": w.temperature, "stream": True,
        "stream_options": {"include_usage": True},
        "chat_template_kwargs": {"enable_thinking": False}}
    if w.ignore_eos:
        body["ignore_eos"] = True
    body.update(w.extra_body)
    return body


async def run_conversations(client, root: str, w: loadgen.Workload, model: str,
                            convs: list[Conversation], max_tokens: int,
                            t0: float) -> list[TurnResult]:
    out: list[TurnResult] = []
    sem = asyncio.Semaphore(w.concurrency if w.concurrency > 0 else len(convs))

    async def one(c: Conversation) -> None:
        async with sem:
            msgs = list(c.messages)
            for turn in range(len(c.steps) + 1):
                req = loadgen.PreparedRequest("chat", _body(w, model, c, list(msgs), max_tokens),
                                              None, max_tokens, keep_text=True)
                res = await loadgen.send_request(client, root, req, t0)
                out.append(TurnResult(c.index, turn, len(msgs), res))
                if turn < len(c.steps):
                    msgs += next_messages(c, turn, res.text)

    await asyncio.gather(*(one(c) for c in convs))
    return out


def turn_table(turns: list[TurnResult]) -> dict[str, Any]:
    """Per turn and in total: requests, TTFT, prompt and cached tokens."""
    per = []
    for t in sorted({x.turn for x in turns}):
        rs = [x.result for x in turns if x.turn == t]
        ok = [r for r in rs if r.ok]
        ttft = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
        per.append({"turn": t + 1, "requests": len(rs), "completed": len(ok),
                    "p50_ttft_ms": loadgen.percentile(ttft, 50),
                    "p99_ttft_ms": loadgen.percentile(ttft, 99),
                    "prompt_tokens": sum(r.prompt_tokens or 0 for r in ok),
                    "cached_tokens": sum(r.cached_tokens or 0 for r in ok)})
    ok = [x.result for x in turns if x.result.ok]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    return {"per_turn": per, "prompt_tokens": prompt, "cached_tokens": cached,
            "cached_fraction": cached / prompt if prompt else float("nan"),
            "cached_tokens_reported": any(r.cached_tokens is not None for r in ok)}


async def run_agent_mix(w: loadgen.Workload, mix: AgentMix, *, keep_requests: bool = False,
                        log=None) -> dict[str, Any]:
    """Warm-ups (short chats of their own), then every conversation; the run dict."""
    root = loadgen.api_root(w.base_url)
    convs = build(mix)
    async with loadgen.make_client(w.concurrency or len(convs), w.request_timeout_s) as client:
        model = w.model or await loadgen.discover_model(client, root)
        if w.warmups:
            warm = []
            for i in range(w.warmups):  # no tools, no system prompt: no prefix to share
                body = _body(w, model, convs[0],
                             [{"role": "user", "content": f"Warm-up {i}: say hi."}], 8)
                body.pop("tools")
                warm.append(loadgen.PreparedRequest("chat", body, None, 8))
            t = time.perf_counter()
            wres = await asyncio.gather(*(loadgen.send_request(client, root, r, t) for r in warm))
            bad = [r.error for r in wres if not r.ok]
            if bad:
                raise RuntimeError(f"warm-up request failed: {bad[0]}")
        t0 = time.perf_counter()
        turns = await run_conversations(client, root, w, model, convs, mix.max_tokens, t0)
        duration = time.perf_counter() - t0
    results = [x.result for x in turns]
    run = loadgen.summarize(results, duration, w.concurrency or len(convs))
    run["model"] = model
    run.update(goodput(results, duration, SLO(w.slo_ttft_ms, w.slo_itl_ms), run))
    run["agent"] = turn_table(turns)
    if keep_requests:
        recs = loadgen.request_records(results)
        for rec, x in zip(recs, turns):
            rec.update(conversation=x.conversation, turn=x.turn + 1, messages=x.messages)
        run["requests"] = recs
    if log:
        a = run["agent"]
        log(f"  agent mix: {run['completed']}/{run['num_prompts']} ok, prompt tokens "
            f"{a['prompt_tokens']}, cached {a['cached_tokens']} "
            f"({100 * a['cached_fraction']:.1f} %), TTFT p50 {run['p50_ttft_ms']:.1f} ms")
    return run
