"""HTTP for the served rewards (rewards/remote.py, rewards/judge.py): requests whose every try has one deadline
for the whole of it, retried with back-off.

A try's deadline (``timeout_s``) bounds all of it: connecting, sending, and reading the whole answer. A timeout
per read would not: a server that sends its answer a byte at a time restarts it with every byte and holds the
request, and whatever waits for its scores, forever. Each try runs as an asyncio
task cancelled at its deadline, which closes its connection. The event loop, the client and its connections
are made and closed inside each call, so nothing outlives it, and at most ``max_in_flight`` requests of a call
are in flight at once.

Retried, ``retries`` more times: a connection error, a try past its deadline, a 429 or a 5xx answer. The wait
before the next try is the server's ``Retry-After`` when it sends one (seconds or an HTTP date), else
0.5 s x 2^k after the k-th failed try (at most 10 s), and never longer than ``timeout_s``: a server that asks for
an hour does not hold its caller for an hour. A request thus ends within (retries + 1) x timeout_s plus its waits.
When the tries run out: ``RemoteUnavailable``. Every other answer (2xx, 3xx, other 4xx) is the caller's to read.

A caller stops the requests its thread makes with ``stopped_by(stop)``: ``stop()`` is asked every ``STOP_POLL_S``
while a request waits (for an answer or between tries), and once it is true the request ends at once
(``RequestStopped``, its connections closed) instead of after its tries: a caller that no longer needs the
scores (it stops early, on a signal) ends its requests without waiting for their deadlines.

The settings of a served reward are checked without the network (``check_address``, ``check_tries``,
``bearer_headers``: a scheme other than http(s), a port beyond 65535, a deadline that is not a number, a fractional
number of retries, a key that an HTTP header cannot carry), by each scorer's ``check_arguments``, which its
constructor calls, and a caller may call on the arguments alone, before anything reaches the server.

``ServedScorer`` is what the served scorers share: the request at start-up, and a batch that scores NaN when its
tries run out, with a warning naming the server and the last error (what a NaN batch does to a step, the term left
out or the step skipped, is the caller's to decide and to say).
"""

from __future__ import annotations

import abc
import asyncio
import logging
import math
import re
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import ClassVar
from urllib.parse import urlsplit

import httpx
import torch
from torch import Tensor

from rewards.base import Scorer

MAX_BACKOFF_S = 10.0
STOP_POLL_S = 0.05  # how often a request asks its thread's stop (``stopped_by``)
_stops = threading.local()  # .check: the stop of this thread's requests


class RemoteRewardError(ValueError):
    """A served reward answered outside its protocol, refused the request, or could not be used: one line to show."""


class RemoteUnavailable(RemoteRewardError):
    """A served reward did not answer in time, or answered 429 or 5xx, on every try: worth trying again later."""


class RequestStopped(RemoteUnavailable):
    """A request ended before its answer by its caller's stop (``stopped_by``)."""


@dataclass(frozen=True)
class Server:
    """A served reward: where it is, how messages name it, and how each request to it goes."""

    url: str  # the base URL, without a trailing slash; a request's path is appended to it
    name: str  # how messages call it, e.g. "reward server http://127.0.0.1:8100"
    timeout_s: float  # the deadline of one try, whole (connect, send, every read)
    retries: int  # more tries after the first
    headers: Mapping[str, str] = field(default_factory=dict)  # sent with every request (a bearer token)


class ServedScorer(Scorer):
    """A scorer whose model lives in the server ``self.server``: each batch is ``bodies`` posted to ``score_path``,
    at most ``max_in_flight`` at once, and its scores are read from the answers."""

    runs_remotely: ClassVar[bool] = True
    score_path: ClassVar[str]
    server: Server
    max_in_flight: int = 1

    def _first_answer(self, path: str, hint: str) -> httpx.Response:
        """The answer to ``GET path`` at start-up; ``RemoteRewardError`` ending in ``hint`` when the tries run out (a
        setting: a wrong address, a server not started or stuck), one line before the transformer loads."""
        try:
            return request(self.server, "GET", path)[0]
        except RemoteUnavailable as err:
            raise RemoteRewardError(f"{err} at start-up: {hint}") from None

    @abc.abstractmethod
    def bodies(self, images: Tensor, prompts: Sequence[str]) -> list[dict]:
        """The JSON bodies of one batch's requests."""

    @abc.abstractmethod
    def read_scores(self, answers: list[httpx.Response], count: int) -> Tensor:
        """The ``count`` scores [count] of one batch from its answers; ``RemoteRewardError`` when they break the
        protocol."""

    def score(self, images: Tensor, prompts: Sequence[str]) -> Tensor:
        bodies = self.bodies(images, prompts)
        try:
            answers = request(self.server, "POST", self.score_path, bodies, max_in_flight=self.max_in_flight)
        except RemoteUnavailable as err:
            tries = "" if isinstance(err, RequestStopped) else f" after {self.server.retries + 1} tries"
            logging.getLogger(type(self).__module__).warning(
                "%s%s: this batch of %d images scores NaN", err, tries, images.shape[0]
            )
            return torch.full((images.shape[0],), math.nan)
        return self.read_scores(answers, images.shape[0])

    def to(self, device: torch.device | str) -> ServedScorer:
        return self  # the model lives in its server; scores come back to the images' device


def check_address(name: str, url: object, example: str) -> None:
    """``url`` (the argument ``name``) is an http(s) address with a host and a port a socket can take; ValueError
    naming ``name`` and showing ``example`` (how the address is written) otherwise."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"{name} must start with http:// or https:// (e.g. {example}), got {url!r}")
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:  # beyond 65535, or not a number
        port = 0
    if not parts.hostname or port == 0 or any(c.isspace() for c in url):
        shape = f"http(s)://HOST[:PORT] with a port from 1 to 65535 (e.g. {example})"
        raise ValueError(f"{name} must be {shape}, got {url!r}")


def check_tries(timeout_s: object, retries: object) -> None:
    """The deadline of one try and the tries after the first, as ``Server`` takes them; ValueError naming each."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not 0 < timeout_s < math.inf:
        raise ValueError(f"timeout_s must be a number of seconds > 0 (the deadline of one try), got {timeout_s!r}")
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise ValueError(f"retries must be a whole number >= 0 (the tries after the first), got {retries!r}")


def bearer_headers(variable: str, key: str | None) -> dict[str, str]:
    """``Authorization: Bearer <key>`` (none without a key), the key read from the environment variable
    ``variable``; ValueError naming the variable (never the key) when a header cannot carry it: a space, a line
    ending (a key saved by a Windows editor ends in \\r) or a character beyond printable ASCII."""
    if not key:
        return {}
    bad = re.search(r"[^\x21-\x7e]", key)
    if bad:
        where = "at its end" if bad.start() == len(key) - 1 else f"at character {bad.start() + 1} of {len(key)}"
        copied = " (a line ending copied with it?)" if bad.group() in "\r\n" else ""
        raise ValueError(
            f"the key in the environment variable {variable} holds {bad.group()!r} {where}, which an HTTP header "
            f"cannot carry{copied}: export {variable} with the key alone"
        )
    return {"Authorization": f"Bearer {key}"}


def request_bound_s(timeout_s: float, retries: int) -> float:
    """The longest a request to a server that never answers takes: ``retries + 1`` tries of ``timeout_s`` and a
    wait of at most ``timeout_s`` between two of them."""
    return (2 * retries + 1) * timeout_s


@contextmanager
def stopped_by(stop: Callable[[], bool]) -> Iterator[None]:
    """The requests this thread makes in the block end at once with ``RequestStopped`` when ``stop()`` is true
    (asked every ``STOP_POLL_S``; it must not block)."""
    previous = getattr(_stops, "check", None)
    _stops.check = stop
    try:
        yield
    finally:
        _stops.check = previous


def request(
    server: Server, method: str, path: str, bodies: Sequence[object] = (None,), *, max_in_flight: int = 1
) -> list[httpx.Response]:
    """The answers to ``method server.url+path``, one per JSON body in ``bodies`` (None: no body), in order, at
    most ``max_in_flight`` at once; RemoteUnavailable when one of them ran out of tries (the others are
    cancelled), RequestStopped when this thread's stop (``stopped_by``) is or turns true first."""
    stop = getattr(_stops, "check", None)
    if stop is None:
        return asyncio.run(_all(server, method, path, bodies, max_in_flight))
    if stop():
        raise _stopped(server, method, path)
    return asyncio.run(_unless_stopped(_all(server, method, path, bodies, max_in_flight), stop, server, method, path))


async def _unless_stopped(
    work: Coroutine[object, object, list[httpx.Response]],
    stop: Callable[[], bool],
    server: Server,
    method: str,
    path: str,
) -> list[httpx.Response]:
    """``work``'s result, or RequestStopped once ``stop()`` is true (``work`` cancelled: its connections close)."""
    task = asyncio.ensure_future(work)
    while not task.done():
        if stop():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise _stopped(server, method, path)
        await asyncio.wait({task}, timeout=STOP_POLL_S)
    return task.result()


def _stopped(server: Server, method: str, path: str) -> RequestStopped:
    return RequestStopped(f"{method} {path} to {server.name} was stopped before its answer (the step ended early)")


async def _all(
    server: Server, method: str, path: str, bodies: Sequence[object], max_in_flight: int
) -> list[httpx.Response]:
    limit = asyncio.Semaphore(max_in_flight)
    # no timeout of httpx's own: the deadline of each try bounds it whole
    async with httpx.AsyncClient(headers=dict(server.headers), timeout=None) as client:

        async def one(body: object) -> httpx.Response:
            async with limit:
                return await _tries(client, server, method, path, body)

        tasks = [asyncio.ensure_future(one(body)) for body in bodies]
        try:
            return list(await asyncio.gather(*tasks))
        finally:  # a failed request ends the call: the others stop too, before the client closes
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def _tries(client: httpx.AsyncClient, server: Server, method: str, path: str, body: object) -> httpx.Response:
    """The first answer that is neither 429 nor 5xx, within ``server.retries`` more tries."""
    failure = ""
    for attempt in range(server.retries + 1):
        wait = min(0.5 * 2**attempt, MAX_BACKOFF_S)
        try:
            answer = await asyncio.wait_for(
                client.request(method, server.url + path, json=body), timeout=server.timeout_s
            )
        except asyncio.TimeoutError:
            failure = f"{server.name} did not answer {method} {path} within timeout_s={server.timeout_s:g}"
        except httpx.HTTPError as err:
            failure = f"{server.name} is unreachable ({type(err).__name__})"
        else:
            if answer.status_code != 429 and answer.status_code < 500:
                return answer
            failure = f"{server.name} answered {answer.status_code}"
            asked = retry_after(answer.headers.get("retry-after"))
            wait = wait if asked is None else asked
        if attempt < server.retries:
            await asyncio.sleep(min(wait, server.timeout_s))
    raise RemoteUnavailable(failure)


def retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """The seconds a ``Retry-After`` header asks to wait (a number of seconds, or an HTTP date: its distance from
    ``now``, a Unix time, default the clock's); None when there is none or it is neither."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    return max(seconds, 0.0) if math.isfinite(seconds) else None
