"""HTTP servers on 127.0.0.1 for the served rewards' tests: ``serve(app)`` runs a FastAPI app in a thread,
``fake_server(answers)`` is a reward server whose answers the test chooses, ``judge_server(answer)`` an
OpenAI-compatible chat server, and servers below HTTP: ``dripping_server()`` answers /score a byte at a
time, ``hung_server(ready)`` answers its start-up requests and never a score's, ``silent_server()`` accepts
connections and never answers."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from types import FunctionType

import uvicorn
from fastapi import FastAPI, Request

FAKE = {"scorer": "fake"}  # what the fake server's answers name: a scorer without arguments


@contextmanager
def serve(app: FastAPI, *, host: str = "127.0.0.1", port: int = 0) -> Iterator[str]:
    """``app`` on ``host``:``port`` (0: a free one) in a thread; yields its URL and stops it on exit."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a server restarted on the port it had
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "the test server did not start within 10 s"
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
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


@dataclass
class JudgeLog:
    """What a stand-in judge saw: each request's body and headers, and the most requests it held at once."""

    bodies: list[dict] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    in_flight: int = 0
    peak: int = 0


def chat(text: str | None, *, finish_reason: str = "stop", logprobs: dict | None = None, **message: object) -> dict:
    """A chat completions answer whose one choice says ``text``."""
    choice = {"index": 0, "message": {"role": "assistant", "content": text, **message}, "finish_reason": finish_reason}
    return {"object": "chat.completion", "model": "judge", "choices": [{**choice, "logprobs": logprobs}]}


def judge_server(answer: Callable[[dict, int], object], *, delay_s: float = 0.0) -> tuple[FastAPI, JudgeLog]:
    """An OpenAI-compatible server whose n-th ``POST /v1/chat/completions`` (n from 0) answers ``answer(body, n)``
    after ``delay_s`` (a Response as it is, anything else as JSON), and the log of what it saw."""
    app, seen = FastAPI(), JudgeLog()

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": "judge", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def completions(request: Request) -> object:
        body = await request.json()
        number = len(seen.bodies)
        seen.bodies.append(body)
        seen.headers.append(dict(request.headers))
        seen.in_flight += 1
        seen.peak = max(seen.peak, seen.in_flight)
        try:
            await asyncio.sleep(delay_s)
        finally:
            seen.in_flight -= 1
        return answer(body, number)

    return app, seen


@contextmanager
def raw_server(
    handle: Callable[[socket.socket, threading.Event], None], *, host: str = "127.0.0.1", port: int = 0
) -> Iterator[str]:
    """A TCP server on ``host``:``port`` (0: a free one) whose every connection ``handle(connection, stop)`` serves in
    a thread; yields its URL; on exit ``stop`` is set and the threads are joined."""
    listener = socket.create_server((host, port))
    listener.settimeout(0.1)
    stop, threads = threading.Event(), []

    def accept() -> None:
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except OSError:  # the accept's timeout: look at stop again
                continue
            thread = threading.Thread(target=handle, args=(connection, stop), daemon=True)
            thread.start()
            threads.append(thread)

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        yield f"http://{host}:{listener.getsockname()[1]}"
    finally:
        stop.set()
        for thread in [acceptor, *threads]:
            thread.join(10)
        listener.close()


def _read_request(connection: socket.socket) -> str:
    """The request line of an HTTP request, its headers and body read whole."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = connection.recv(65536)
        if not chunk:
            return ""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")), 0)
    while len(body) < length:
        body += connection.recv(65536)
    return head.split(b"\r\n")[0].decode()


def _http(body: dict, *, padding: int = 0) -> bytes:
    """A 200 answer with ``body`` as JSON, followed by ``padding`` spaces (still valid JSON)."""
    payload = json.dumps(body).encode() + b" " * padding
    head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    return head.encode() + payload


def dripping_server(*, byte_every_s: float = 0.05, padding: int = 1200) -> AbstractContextManager[str]:
    """A reward server whose /health answers at once and whose /score answer comes one byte every
    ``byte_every_s``: every read of the client gets a byte well within any timeout per read, while the whole
    answer (``padding`` spaces after the JSON) takes a minute. A context manager that yields its URL."""

    def handle(connection: socket.socket, stop: threading.Event) -> None:
        with connection:
            while (line := _read_request(connection)) and not stop.is_set():
                if "/health" in line:
                    connection.sendall(_http(FAKE))
                    continue
                for byte in _http({"scores": [1.0] * 8, **FAKE}, padding=padding):
                    if stop.wait(byte_every_s):
                        return
                    try:
                        connection.sendall(bytes([byte]))
                    except OSError:  # the client gave up, as it should
                        return

    return raw_server(handle)


@contextmanager
def hung_server(ready: dict, *, host: str = "127.0.0.1", port: int = 0) -> Iterator[tuple[str, list[str]]]:
    """A served reward that answers every GET with ``ready`` (a reward server's /health, a judge's /v1/models), so it
    passes start-up, and holds every POST (a batch to score) unanswered until the block ends, on ``host``:``port``
    (0: a free one); yields its URL and the request line of every POST it got, in order."""
    posted: list[str] = []

    def handle(connection: socket.socket, stop: threading.Event) -> None:
        with connection:
            while (line := _read_request(connection)) and not stop.is_set():
                if not line.startswith("POST"):
                    connection.sendall(_http(ready))
                    continue
                posted.append(line)
                stop.wait()
                return

    with raw_server(handle, host=host, port=port) as url:
        yield url, posted


@contextmanager
def silent_server() -> Iterator[str]:
    """A server that accepts TCP connections (the kernel does, up to its backlog) and never answers; yields its URL."""
    with socket.create_server(("127.0.0.1", 0), backlog=16) as listener:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


@contextmanager
def warnings_of(logger_name: str) -> Iterator[list[str]]:
    """The warning lines logger ``logger_name`` logs inside the block (without pytest's logging plugin)."""
    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger(logger_name)
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
