"""README.md's sammie example runs as written against `sammie serve`'s default (the tiny
synthetic model), on the free port its server took."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from live_server import LiveServer
from tailored.server.guard import AccessPolicy

from sammie.cli import build_server
from sammie.server.app import ServeSettings

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = re.compile(r"<!-- sammie-example -->\s*```bash\n(.*?)```", re.S)


def test_readme_sammie_example_runs(tmp_path, monkeypatch):
    from sammie import flags

    flags.activate(flags.Flags(cache=str(tmp_path)))  # the embedded checkpoint goes here
    try:
        (code,) = EXAMPLE.findall((REPO / "README.md").read_text())
        app = build_server(None, "cpu", "float32", ServeSettings(), AccessPolicy())
        with LiveServer(app, start_timeout=30) as srv:
            code = code.replace("localhost:8100", srv.url.removeprefix("http://"))
            out = subprocess.run(["bash", "-euo", "pipefail", "-c", code], capture_output=True,
                                 text=True, timeout=60, cwd=REPO)
    finally:
        flags.activate(flags.Flags.from_env())
    assert out.returncode == 0, out.stderr
    body = json.loads(out.stdout)
    assert body["results"][0]["prompt"]["text"] == "red circle"
    assert body["image"]["width"] == 256
