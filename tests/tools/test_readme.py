"""README.md as a front page: at most 8 KB, the CI command, and every API example as written.

The examples (fenced blocks right after `<!-- example -->`) run against a live server of the
embedded nano model, served as `tailored serve` serves it. They use localhost:8000; the test
only swaps in the free port its server took.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from live_server import LiveServer

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
EXAMPLE = re.compile(r"<!-- example -->\s*```(\w+)\n(.*?)```", re.S)


def _examples() -> list[tuple[str, str]]:
    return EXAMPLE.findall(README.read_text())


def test_readme_is_at_most_8_kb():
    assert len(README.read_bytes()) <= 8192


def test_readme_test_command_is_what_ci_runs():
    """The README's second command is the last line of .ci/run, word for word."""
    ci = [line for line in (REPO / ".ci/run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    assert ci[-1].strip() in README.read_text()


def test_readme_has_the_examples():
    kinds = [lang for lang, _ in _examples()]
    assert kinds.count("python") >= 4 and "bash" in kinds
    text = "\n".join(code for _, code in _examples())
    for what in ("/v1/completions", "stream=True", "tool_calls or []", "json_schema"):
        assert what in text, what


@pytest.fixture(scope="module")
def server_url():
    from tailored.cli import DEFAULT_MODEL_NAME
    from tailored.server.app import build_app
    from tailored.server.async_engine import AsyncEngine
    from tailored.stack import build_stack

    # as `tailored serve` with no checkpoint builds it (smaller limits: the examples are short)
    stack = build_stack(None, max_model_len=1024, max_num_seqs=4, max_num_batched_tokens=1024,
                        progress=False, grammar_warmup=True)
    gen = json.loads((stack.checkpoint_dir / "generation_config.json").read_text())
    defaults = {k: gen[k] for k in ("temperature", "top_p", "top_k") if k in gen}
    app = build_app(AsyncEngine(stack.engine), stack.tokenizer, DEFAULT_MODEL_NAME, 1024,
                    sampling_defaults=defaults)
    with LiveServer(app, start_timeout=30) as srv:
        yield srv.url


def _on_port(code: str, url: str) -> str:
    assert "localhost:8000" in code, "README examples talk to localhost:8000"
    return code.replace("http://localhost:8000", url).replace("localhost:8000", url)


@pytest.mark.parametrize("index", range(len(_examples())))
def test_readme_example_runs_as_written(server_url, index, capsys):
    lang, code = _examples()[index]
    code = _on_port(code, server_url)
    if lang == "bash":
        out = subprocess.run(["bash", "-euo", "pipefail", "-c", code], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        body = json.loads(out.stdout)
        assert body["choices"][0]["text"] and body["usage"]["completion_tokens"] > 0, body
        return
    assert lang == "python", f"example {index}: {lang} blocks are not run"
    if "response_format" in code:
        pytest.importorskip("xgrammar")
    exec(compile(code, f"README.md example {index}", "exec"), {"__name__": "__readme__"})
    # the nano model samples: a chat answer may be empty; the structured one must parse and
    # follow its schema
    if "json.loads" in code:
        printed = capsys.readouterr().out
        assert printed.strip() in ("{'answer': 'yes'}", "{'answer': 'no'}"), printed


def test_bash_examples_quote_their_json():
    """The curl example's JSON body is one shell word (a copy-paste must not split it)."""
    for lang, code in _examples():
        if lang == "bash":
            words = shlex.split(code.replace("\\\n", " "))
            body = words[words.index("-d") + 1]
            assert json.loads(body)["model"] == "qwen36-35b-a3b"
