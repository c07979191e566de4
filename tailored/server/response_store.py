"""Responses kept in memory for `previous_response_id` and GET /v1/responses/{id}.

A stored response keeps the input items of its own request and its output items (both in the
Responses API's item shape), the id of the response it continued, and its response object.
A request naming `previous_response_id` continues the chain: the input items and outputs of
every response up the chain, oldest first, come before its own input (`instructions` are not
carried over, as OpenAI's API does). Each entry holds only its own turn, so a long
conversation costs its length once, not once per turn.

Bounded: at most `max_entries` responses and `max_bytes` of their JSON; the least recently
used go first. A chain whose link was evicted (or an id never stored, or stored with
`store: false`) is a 400 naming the id, never a silently shorter conversation.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from tailored.server.errors import OpenAIError, shown

DEFAULT_MAX_ENTRIES = 1024
DEFAULT_MAX_BYTES = 256 * 2**20
MAX_CHAIN = 10_000  # links followed at most (a cycle cannot form, but stay bounded)


@dataclass
class _Entry:
    parent: str | None
    items: list[dict[str, Any]]  # its request's input items, then its output items
    response: dict[str, Any]  # the response object (GET /v1/responses/{id})
    size: int


class ResponseStore:
    """The bounded in-memory store (see the module docstring). Thread-safe."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, parent: str | None, input_items: list[dict[str, Any]],
            output_items: list[dict[str, Any]], response: dict[str, Any]) -> None:
        items = list(input_items) + list(output_items)
        size = len(json.dumps(items, ensure_ascii=False)) + len(json.dumps(response))
        with self._lock:
            if size > self.max_bytes:
                return  # larger than the whole store: a later continuation gets the 400
            old = self._entries.pop(response_id, None)
            if old is not None:
                self._bytes -= old.size
            self._entries[response_id] = _Entry(parent, items, response, size)
            self._bytes += size
            while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
                _, gone = self._entries.popitem(last=False)
                self._bytes -= gone.size

    def get(self, response_id: str) -> dict[str, Any] | None:
        """The stored response object, or None."""
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is None:
                return None
            self._entries.move_to_end(response_id)
            return entry.response

    def history(self, response_id: str) -> list[dict[str, Any]]:
        """Every item of the chain that ends with `response_id`, oldest first; OpenAIError
        (400, param previous_response_id) when a link is not stored."""
        chain: list[list[dict[str, Any]]] = []
        with self._lock:
            rid: str | None = response_id
            while rid is not None and len(chain) < MAX_CHAIN:
                entry = self._entries.get(rid)
                if entry is None:
                    which = ("" if rid == response_id
                             else f" (an earlier response of its conversation, {shown(rid, 80)})")
                    raise OpenAIError(
                        f"previous response {shown(response_id, 80)} not found{which}: it was "
                        "never stored here (store: false, or another server), or it was "
                        "evicted (the store keeps the most recent responses); send the whole "
                        "conversation as input instead", param="previous_response_id",
                        code="previous_response_not_found")
                self._entries.move_to_end(rid)
                chain.append(entry.items)
                rid = entry.parent
        return [item for items in reversed(chain) for item in items]
