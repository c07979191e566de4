"""A dialect's conversation as Chat Completions messages (what the chat template renders).

`ChatBuilder` takes the turns of a Responses `input` or a Messages `messages` list piece by
piece and gives OpenAI chat messages in the form the Qwen3.6 template accepts:
- the system text: every system / developer message before the first other message, and the
  Responses `instructions`, joined into one leading system message (the template allows a
  system message only first); a system message later in the conversation (Claude Code sends
  one after the first user turn) becomes a user turn with the same text, where it was;
- consecutive assistant pieces (reasoning, text, tool calls: a Responses `reasoning`,
  `message` and `function_call` items in a row, an Anthropic assistant message's blocks) form
  one assistant message, its reasoning as `reasoning_content`, which the template renders in
  the turns after the last user query (the agent loop), as the model wrote it;
- tool results are `tool` messages (the template merges a run of them into one user turn).

Agents resend the whole conversation every turn; this rendering is a pure function of it, so
a turn's prompt extends the previous turn's prompt up to its save point (the end of its last
message, engine/prefix_cache.py) and hits the prefix cache there, as long as the client sends
its history back unchanged, reasoning included (`seal` / `unseal`).

Reasoning round trip: the Responses API's `reasoning.encrypted_content` and the Anthropic
API's thinking `signature` are opaque strings a client stores and sends back; here they carry
the reasoning text itself (`seal`: zlib + base64 with a prefix; not a secret, the client sees
the reasoning anyway), so a client that sends back only those (Codex with store off, Claude
Code with the thinking display omitted) still gets its earlier reasoning rendered.
"""

from __future__ import annotations

import base64
import binascii
import zlib
from typing import Any

SEAL_PREFIX = "tailored.r1."
MAX_UNSEALED_CHARS = 4 * 2**20  # a sealed string never expands past this (zlib bomb guard)


def seal(reasoning: str) -> str:
    """The reasoning as an opaque string (encrypted_content, signature)."""
    packed = zlib.compress(reasoning.encode("utf-8"), 6)
    return SEAL_PREFIX + base64.urlsafe_b64encode(packed).decode("ascii")


def unseal(value: Any) -> str | None:
    """The reasoning a `seal` string holds; None for any other value (another server's
    signature, a corrupt one)."""
    if not isinstance(value, str) or not value.startswith(SEAL_PREFIX):
        return None
    try:
        packed = base64.urlsafe_b64decode(value[len(SEAL_PREFIX):])
        d = zlib.decompressobj()
        raw = d.decompress(packed, MAX_UNSEALED_CHARS)
        if d.unconsumed_tail:
            return None
        return raw.decode("utf-8")
    except (binascii.Error, ValueError, zlib.error, UnicodeDecodeError):
        return None


class ChatBuilder:
    """Chat messages from a conversation's pieces, in order (see the module docstring)."""

    def __init__(self) -> None:
        self._system: list[str] = []
        self.messages: list[dict[str, Any]] = []

    def system(self, text: str) -> None:
        if self.messages:  # after the conversation began: a user turn where it was
            self.user(text)
        elif text:
            self._system.append(text)

    def user(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})

    def _assistant(self) -> dict[str, Any]:
        if not self.messages or self.messages[-1]["role"] != "assistant":
            self.messages.append({"role": "assistant", "content": ""})
        return self.messages[-1]

    def assistant_text(self, text: str) -> None:
        m = self._assistant()
        if m.get("tool_calls"):  # text after the calls: a turn of its own
            m = {"role": "assistant", "content": ""}
            self.messages.append(m)
        m["content"] += text

    def reasoning(self, text: str) -> None:
        m = self._assistant()
        if m["content"] or m.get("tool_calls"):  # reasoning opens a turn
            m = {"role": "assistant", "content": ""}
            self.messages.append(m)
        m["reasoning_content"] = m.get("reasoning_content", "") + text

    def tool_call(self, call_id: str, name: str, arguments: str | dict) -> None:
        self._assistant().setdefault("tool_calls", []).append(
            {"id": call_id, "type": "function",
             "function": {"name": name, "arguments": arguments}})

    def tool_result(self, call_id: str, text: str) -> None:
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": text})

    def build(self) -> list[dict[str, Any]]:
        """The messages: the joined system text first (if any), then the conversation."""
        head = [{"role": "system", "content": "\n\n".join(self._system)}] if self._system else []
        return head + self.messages
