"""HTTP servers on 127.0.0.1 for the remote reward's tests: ``serve(app)`` runs a FastAPI app in a thread, and
``fake_server(answers)`` is a reward server whose answers the test chooses."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FunctionType

import uvicorn
from fastapi import FastAPI

FAKE = {"scorer": "fake"}  # what the fake server's answers name: a scorer without arguments


@contextmanager
def serve(app: FastAPI, *, port: int = 0) -> Iterator[str]:
    """``app`` on 127.0.0.1:``port`` (0: a free one) in a thread; yields its URL and stops it on exit."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a server restarted on the port it had
    sock.bind(("127.0.0.1", port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "the test server did not start within 10 s"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def fake_server(*answers: object, delay_s: float = 0.0) -> FastAPI:
    """A server whose /health names the scorer "fake" and whose n-th /score answers ``answers[n]`` (the last one
    from then on), after ``delay_s``: a function's value for the request's number of images, a Response as it
    is, anything else as JSON."""
    app = FastAPI()
    calls = []

    @app.get("/health")
    def health() -> dict:
        return FAKE

    @app.post("/score")
    async def score(body: dict) -> object:
        await asyncio.sleep(delay_s)
        answer = answers[min(len(calls), len(answers) - 1)]
        calls.append(1)
        return answer(body["shape"][0]) if isinstance(answer, FunctionType) else answer

    return app
