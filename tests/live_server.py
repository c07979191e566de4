"""A real uvicorn server for tests: 127.0.0.1, a free port, run in a thread."""

from __future__ import annotations

import socket
import threading
import time
from typing import Self

import uvicorn


class LiveServer:
    """`with LiveServer(app, start_timeout=10) as s:` serves `app` at `s.url` until the block ends."""

    def __init__(self, app, start_timeout: float = 10.0) -> None:
        self.start_timeout = start_timeout
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def __enter__(self) -> Self:
        self.thread.start()
        deadline = time.monotonic() + self.start_timeout
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()
