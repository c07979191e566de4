"""One `tailored serve` for the client-framework matrix (served.py)."""

from __future__ import annotations

import pytest
from served import Served


@pytest.fixture(scope="package")
def served(tmp_path_factory):
    server = Served(tmp_path_factory.mktemp("serve") / "serve.log")
    yield server
    server.stop()
