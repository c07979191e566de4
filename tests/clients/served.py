"""`tailored serve` of the embedded nano model in a subprocess, as a user starts it, for the
client-framework matrix (tests/clients/): one server for the package, its log kept (the access
log shows what each framework sent). What every framework's tests share: the served model's
name, the tool and output schemas, the settings that turn the nano model's thinking off and
keep its answers short.

The nano model has random weights: it writes tool calls only when a grammar holds it to them
and never ends its thinking, so the tests fix the shape of each turn with the API itself
(a forced tool_choice, a response_format, thinking off, greedy decoding) and `logit_bias`
(COMPACT, NO_CALL, CALL below). They test the protocol, not the model's wording.
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Literal

import httpx
from pydantic import BaseModel, Field

ROOT = Path(__file__).resolve().parents[2]
MODEL = "qwen36-35b-a3b"  # `tailored serve`'s default name (pydantic-ai's vLLM provider reads
# a "qwen3..." name as a model whose thinking reasoning_effort turns off)
MAX_TOKENS = 8  # plain answers
STRUCTURED_TOKENS = 160  # a schema's JSON or a call
START_TIMEOUT_S = 180


def _biases() -> tuple[dict[str, int], str, str]:
    from tailored.tokenizer import load_tokenizer

    tok = load_tokenizer(ROOT / "tailored" / "data" / "nano")
    space = {str(i): -100 for i in range(tok.vocab_size)
             if not tok.is_added(i) and tok.token_bytes(i) and not tok.token_bytes(i).strip()}
    return space, str(tok.token_to_id("<tool_call>")), str(tok.eos_token_ids[0])


# the nano model pads JSON with whitespace runs wherever a grammar allows them (up to 64
# characters a gap): COMPACT biases every whitespace token away (the grammar still puts the
# tool-call format's newlines where they must be); NO_CALL and CALL also push the `<tool_call>`
# token out or in, for a turn whose grammar allows calls or an answer; END makes a free text
# answer end at once (the Agents SDK takes a Responses answer cut by max_output_tokens for a
# failure, and the nano model never ends by itself)
COMPACT, _TOOL_CALL, _EOS = _biases()
NO_CALL = {**COMPACT, _TOOL_CALL: -100}
CALL = {**COMPACT, _TOOL_CALL: 100}
END = {**COMPACT, _EOS: 100}


class Weather(BaseModel):
    """The tool's arguments."""

    city: Literal["Paris", "Rome"]
    days: int = Field(ge=1, le=7)


class Verdict(BaseModel):
    """The typed output: an enum, a bounded string (maxLength 12: a 13th character broke
    three frameworks' validation before the fix) and a date."""

    answer: Literal["yes", "no"]
    label: str = Field(max_length=12)
    day: datetime.date


def get_weather(city: Literal["Paris", "Rome"], days: Annotated[int, Field(ge=1, le=7)]) -> str:
    """The weather of a city for the next days."""
    return f"sunny in {city} for {days} days"


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": get_weather.__doc__,
    "parameters": Weather.model_json_schema()}}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """A running `tailored serve` (the nano model): `url` (no /v1), `log()` its output so far."""

    def __init__(self, log_path: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(ROOT), os.environ.get("PYTHONPATH", "")])}
        self._log_file = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tailored.cli", "serve", "--port", str(self.port),
             "--max-model-len", "4096", "--access-log", "on"],
            stdout=self._log_file, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tailored serve exited: {self.log()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"tailored serve did not start: {self.log()[-2000:]}")
            time.sleep(0.2)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()
