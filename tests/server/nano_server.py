"""The embedded nano model behind a real uvicorn server, for the front-door tests (the openai,
anthropic and Agents SDKs, Codex CLI and Claude Code talk to it over HTTP).

`nano_server(script)` starts one server per distinct `script` and keeps it for the whole
session (building the engine costs ~2 s; the prefix cache is on, as agents use it); a module
that uses it imports the `nano_servers` fixture, which stops them all at the session's end. A script
sets each request's grammar from its prompt (`ScriptedEngine`): the agents' tests fix the
shape of every turn (a forced tool call, then a fixed answer), so they test the protocol, not
the nano model's skill.
"""

from __future__ import annotations

import functools

import pytest
from live_server import LiveServer

from tailored.server.app import build_app
from tailored.server.async_engine import AsyncEngine

MODEL = "nano"
MAX_MODEL_LEN = 8192


class ScriptedEngine(AsyncEngine):
    """An AsyncEngine whose requests' SamplingParams pass through `script(prompt_ids,
    sampling)` first (it may set a grammar or max_tokens)."""

    def __init__(self, engine, script) -> None:
        super().__init__(engine)
        self.script = script

    def generate(self, request_id, prompt_ids, sampling):
        return super().generate(request_id, prompt_ids, self.script(prompt_ids, sampling))


@functools.cache
def nano_server(script=None) -> LiveServer:
    """A running server of the nano model (see the module docstring); `.url`, `.engine`."""
    from tailored.stack import build_stack

    stack = build_stack(None, device="cpu", dtype="float32", progress=False, kernels="off",
                        max_model_len=MAX_MODEL_LEN, max_num_seqs=4, prefix_cache_entries=16)
    engine = ScriptedEngine(stack.engine, script) if script else AsyncEngine(stack.engine)
    app = build_app(engine, stack.tokenizer, MODEL, MAX_MODEL_LEN)
    server = LiveServer(app, start_timeout=60).__enter__()
    server.engine, server.tokenizer = stack.engine, stack.tokenizer
    _running.append(server)
    return server


_running: list[LiveServer] = []


@pytest.fixture(scope="session")
def nano_servers():
    """Import into a test module that uses `nano_server`: stops every server it started at
    the end of the session (before the interpreter's shutdown, which the engine thread and
    uvicorn's lifespan must not outlive)."""
    yield
    while _running:
        _running.pop().__exit__(None, None, None)
    nano_server.cache_clear()
