"""Codex CLI (`codex exec`, the Responses API) and Claude Code (`claude -p`, the Messages API),
unchanged, complete a task against the nano server and exit 0.

The versions are pinned in .ci/agents/package.json (and its lock file); .ci/run installs them
with `npm ci --prefix .ci/agents` and sets CI_REQUIRE_AGENT_CLIS=1, so in CI a missing
binary fails the test. Elsewhere the tests skip unless they find the pinned binaries (install
them the same way, or point AGENT_CLIS_DIR at another node_modules folder).

The round trip is fixed so that the protocol is under test, not the nano model's skill: the
server's engine (nano_server.ScriptedEngine) holds each turn to a grammar: the first turn to a
call of the agent's file tool (Claude Code's Read, Codex's exec_command) on notes.txt, the
turn after the tool's result to the answer "Done.". The agent runs the tool itself and sends
its output back: the test checks that the file's content reached the model, and that the agent
printed the answer and exited 0. Each agent is set up as docs/agents.md tells a user, with its
prompt and tools cut down (Claude Code --bare with one tool; Codex without its optional
tools and with short instructions) so the nano model's CPU prefill stays short.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from nano_server import MAX_MODEL_LEN, MODEL, nano_server, nano_servers  # noqa: F401

from tailored.engine.types import StructuredOutput

ROOT = Path(__file__).resolve().parents[2]
PINS = json.loads((ROOT / ".ci" / "agents" / "package.json").read_text())["dependencies"]
MAGIC = "MAGIC-4217"  # notes.txt's content: seen in a prompt only if the tool really ran
ANSWER = "Done."
# per agent: its file tool, the argument the grammar fixes, and that argument's value
# ({dir}: the task's working directory)
TASKS = {"Read": ("file_path", "{dir}/notes.txt"), "exec_command": ("cmd", "cat notes.txt")}
TIMEOUT_S = 240


def _modules() -> Path:
    return Path(os.environ.get("AGENT_CLIS_DIR") or ROOT / ".ci" / "agents" /
                "node_modules")


def _binary(name: str) -> Path:
    """The pinned CLI's executable, or a skip (a failure in CI) saying how to install it."""
    modules = _modules()
    found = None
    if name == "claude":  # the native binary (the wrapper's postinstall copies it to .bin)
        native = sorted(glob.glob(str(modules / "@anthropic-ai" / "claude-code-*" / "claude")))
        found = Path(native[0]) if native else None
    if found is None and (modules / ".bin" / name).exists():
        found = modules / ".bin" / name
    needs_node = name == "codex" and shutil.which("node") is None
    if found is None or needs_node:
        pins = " ".join(f"{pkg}@{ver}" for pkg, ver in PINS.items())
        why = (f"{name} is not installed in {modules} (`npm ci --prefix .ci/agents`, or "
               f"`npm install --prefix .ci/agents {pins}`)" if found is None
               else "codex needs node on PATH")
        if os.environ.get("CI_REQUIRE_AGENT_CLIS"):
            pytest.fail(f"{why}; CI must run this test")
        pytest.skip(why)
    return found


seen_prompts: list[str] = []


def script(prompt_ids, sampling):
    """Each turn's grammar (see the module docstring), by what the prompt holds."""
    text = nano_server(script).tokenizer.decode(prompt_ids, skip_special_tokens=False)
    seen_prompts.append(text)
    if "<tool_response>" in text:
        return replace(sampling, max_tokens=min(sampling.max_tokens, 16),
                       structured=StructuredOutput("regex", ANSWER.replace(".", r"\.")))
    tool = next((name for name in TASKS if f'"name": "{name}"' in text), None)
    if tool is None:  # a request of the agent's own beside the task: answered, not scripted
        return replace(sampling, max_tokens=min(sampling.max_tokens, 16),
                       structured=StructuredOutput("regex", ANSWER.replace(".", r"\.")))
    arg, value = TASKS[tool]
    value = value.format(dir=script.workdir)
    spec = {"tools": [{"type": "function", "function": {
                "name": tool, "parameters": {"type": "object",
                                             "properties": {arg: {"enum": [value]}},
                                             "required": [arg]}}}],
            "tool_choice": {"type": "function", "function": {"name": tool}},
            "parallel_tool_calls": False}
    return replace(sampling, max_tokens=min(sampling.max_tokens, 300),
                   structured=StructuredOutput("tool_calls", json.dumps(spec)))


@pytest.fixture
def task(tmp_path, nano_servers):  # noqa: F811 - the imported fixture
    (tmp_path / "notes.txt").write_text(MAGIC + "\n")
    script.workdir = str(tmp_path)
    seen_prompts.clear()
    return nano_server(script), tmp_path


def _run(cmd: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "ANTHROPIC_",
                                                                    "CODEX_", "CLAUDE_"))} | env
    p = subprocess.run(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                       text=True, timeout=TIMEOUT_S)
    assert p.returncode == 0, f"exit {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    return p


def _version(binary: Path, pkg: str) -> None:
    out = subprocess.run([str(binary), "--version"], capture_output=True, text=True,
                         timeout=60).stdout
    assert PINS[pkg] in out, f"{binary} is not the pinned {pkg}@{PINS[pkg]}: {out!r}"


@pytest.fixture
def claude():  # (before `task`: a skip costs no server)
    binary = _binary("claude")
    _version(binary, "@anthropic-ai/claude-code")
    return binary


@pytest.fixture
def codex():
    binary = _binary("codex")
    _version(binary, "@openai/codex")
    return binary


def _round_trip(p: subprocess.CompletedProcess) -> None:
    """The agent called its tool, sent the file's content back, and printed the answer."""
    assert ANSWER in p.stdout, p.stdout
    assert seen_prompts and MAGIC not in seen_prompts[0]
    assert any(MAGIC in prompt for prompt in seen_prompts[1:])


def test_claude_code_completes_a_task(claude, task):
    server, work = task
    env = {"HOME": str(work), "ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": "test",
           "ANTHROPIC_MODEL": MODEL, "ANTHROPIC_DEFAULT_OPUS_MODEL": MODEL,
           "ANTHROPIC_DEFAULT_SONNET_MODEL": MODEL, "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,
           "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(MAX_MODEL_LEN),
           "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "1024", "MAX_THINKING_TOKENS": "0",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1",
           "DISABLE_TELEMETRY": "1"}
    p = _run([str(claude), "-p", "--bare", "--system-prompt", "You are a test agent.",
              "--tools", "Read", "--allowedTools", "Read", "--no-session-persistence",
              "Read notes.txt and say Done."], work, env)
    _round_trip(p)


def test_codex_cli_completes_a_task(codex, task):
    server, work = task
    home = work / "codex-home"
    home.mkdir()
    (work / "instructions.md").write_text("You are a test agent.")
    config = {"model": f'"{MODEL}"', "model_provider": '"tailored"',
              "model_providers.tailored.name": '"tailored"',
              "model_providers.tailored.base_url": f'"{server.url}/v1"',
              "model_providers.tailored.wire_api": '"responses"',
              "model_context_window": str(MAX_MODEL_LEN),
              "model_reasoning_effort": '"none"', "web_search": '"disabled"',
              "model_instructions_file": f'"{work / "instructions.md"}"',
              "check_for_update_on_startup": "false"}
    cmd = [str(codex), "exec", "--skip-git-repo-check",
           "--dangerously-bypass-approvals-and-sandbox"]
    for key, value in config.items():
        cmd += ["-c", f"{key}={value}"]
    for feature in ("goals", "multi_agent", "plugins", "apps"):
        cmd += ["--disable", feature]
    p = _run(cmd + ["Show notes.txt, then say Done."], work,
             {"CODEX_HOME": str(home), "HOME": str(work)})
    _round_trip(p)
