"""A reward scored by another process over HTTP: reward models whose dependencies clash with ours.

Protocol (``scripts/reward_server.py`` is the server; both ends use ``encode_batch``/``decode_batch``):

    GET  <url>/health  -> {"scorer": "<name>", "arguments": {<its constructor's arguments>}}
    POST <url>/score   {"prompts": [B strings], "shape": [B, H, W, 3], "images": base64 of uint8 HWC bytes}
                       -> {"scores": [B numbers], "scorer": "<name>", "arguments": {...}}

Every answer names the scorer behind the URL (``arguments`` may be left out: none); the client reads it at
start-up and checks it on each answer, so a server restarted with another scorer mid-run is not used.

Images travel as raw uint8 (round(255 x) of the [0, 1] floats) inside JSON: nothing that arrives is
unpickled or evaluated, only decoded as bytes of a stated shape. When the environment variable
``JAGG_REWARD_TOKEN`` is set, the client sends it as ``Authorization: Bearer <token>`` and the server
refuses any other; it is read from the environment on both ends, never from a config file (configs
are logged and copied into run folders).

Failures:
    * the server is unreachable when the scorer is built (before the transformer loads): one line
      naming the URL;
    * a connection error, a timeout past ``timeout_s`` or a 5xx answer during the run is retried
      ``retries`` times; then the batch scores NaN, which skips the step on every rank as a NaN reward
      does (rewards/combine.py), with a warning naming the URL and the last error. Skipping, not
      stopping: raising on one rank would leave the others waiting in the next collective until
      dist.timeout_s, and a restarted server costs one step instead of the run;
    * an answer that breaks the protocol (not JSON, a wrong number of scores, a non-number, another scorer, a
      redirect, a 4xx such as a refused token) is a bug or a setting, not a hiccup: ``RemoteRewardError``, one
      sentence naming the URL, stops the run.
"""

from __future__ import annotations

import base64
import logging
import math
import os
import time
from collections.abc import Sequence

import httpx
import numpy as np
import torch
from torch import Tensor

from rewards.base import Scorer

log = logging.getLogger(__name__)

TOKEN_ENV = "JAGG_REWARD_TOKEN"


class RemoteRewardError(ValueError):
    """The reward server answered outside the protocol, refused the request, or was unreachable at start-up."""


class RemoteUnavailable(ConnectionError):
    """The reward server did not answer (down, too slow, or a server-side error): worth a retry."""


def encode_batch(images: Tensor, prompts: Sequence[str]) -> dict:
    """The JSON body of a score request: images [B, 3, H, W] in [0, 1] as uint8 HWC bytes."""
    pixels = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
    array = np.ascontiguousarray(pixels.cpu().numpy())
    data = base64.b64encode(array.tobytes()).decode("ascii")
    return {"prompts": list(prompts), "shape": list(array.shape), "images": data}


def decode_batch(body: dict) -> tuple[Tensor, list[str]]:
    """Images [B, 3, H, W] float32 in [0, 1] and B prompts from a score request; ValueError when malformed."""
    prompts, shape, data = body.get("prompts"), body.get("shape"), body.get("images")
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise ValueError("prompts must be a list of strings")
    if not (isinstance(shape, list) and len(shape) == 4 and all(isinstance(n, int) and n > 0 for n in shape)):
        raise ValueError("shape must be [B, H, W, 3] of positive integers")
    if shape[3] != 3 or shape[0] != len(prompts):
        raise ValueError(f"shape {shape} must be [B, H, W, 3] with B = {len(prompts)} prompts")
    if not isinstance(data, str):
        raise ValueError("images must be a base64 string")
    raw = base64.b64decode(data, validate=True)
    if len(raw) != math.prod(shape):
        raise ValueError(f"images hold {len(raw)} bytes, shape {shape} needs {math.prod(shape)}")
    pixels = torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(shape)
    return pixels.permute(0, 3, 1, 2).float() / 255, prompts


def scorer_identity(body: object, *, url: str) -> str:
    """``name(key=value, ...)``: the scorer an answer names (its "scorer" and "arguments"); RemoteRewardError
    naming the URL when it names none."""
    name = body.get("scorer") if isinstance(body, dict) else None
    arguments = body.get("arguments", {}) if isinstance(body, dict) else None
    if not isinstance(name, str) or not isinstance(arguments, dict):
        raise RemoteRewardError(
            f"reward server {url} answered without naming its scorer ('scorer': a name, 'arguments': an object), "
            f"which the protocol requires (docs/rewards.md): {str(body)[:200]}"
        )
    listed = ", ".join(f"{key}={value!r}" for key, value in sorted(arguments.items()))
    return f"{name}({listed})"


def decode_scores(body: object, *, url: str, expected: int) -> Tensor:
    """The [B] float32 scores of a score answer; RemoteRewardError naming the URL when malformed."""
    scores = body.get("scores") if isinstance(body, dict) else None
    if not isinstance(scores, list):
        raise RemoteRewardError(f"reward server {url} answered without a 'scores' list: {str(body)[:200]}")
    if len(scores) != expected:
        raise RemoteRewardError(f"reward server {url} returned {len(scores)} scores for {expected} images")
    for score in scores:
        if isinstance(score, bool) or not isinstance(score, int | float):
            raise RemoteRewardError(f"reward server {url} returned a non-number score {score!r}")
    return torch.tensor(scores, dtype=torch.float32)


def auth_headers() -> dict[str, str]:
    token = os.environ.get(TOKEN_ENV)
    return {"Authorization": f"Bearer {token}"} if token else {}


class RemoteScorer(Scorer):
    """Scores from the server at ``url`` (module docstring): ``timeout_s`` per request, ``retries`` more tries."""

    name = "remote"
    runs_remotely = True

    def __init__(self, url: str, *, timeout_s: float = 60.0, retries: int = 2) -> None:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url must be an http(s) URL, got {url!r}")
        if not timeout_s > 0 or retries < 0:
            raise ValueError(f"timeout_s must be > 0 and retries >= 0, got {timeout_s} and {retries}")
        self.url, self.timeout_s, self.retries = url.rstrip("/"), float(timeout_s), int(retries)
        self.client = httpx.Client(timeout=self.timeout_s, headers=auth_headers())
        try:
            answer = self.client.get(f"{self.url}/health")
            self.scorer = scorer_identity(self._payload(answer), url=self.url)  # the one every answer must name
        except httpx.HTTPError as err:
            # a setting (a wrong url, a server not started): a ValueError, which the trainer prints as one line
            reason = type(err).__name__
            raise RemoteRewardError(f"reward server {self.url} is unreachable ({reason}): start it first") from None
        except RemoteUnavailable as err:
            raise RemoteRewardError(f"{err} at start-up: check that it runs") from None

    def _payload(self, answer: httpx.Response) -> object:
        """The JSON of a 2xx answer; RemoteUnavailable for a 5xx (worth a retry), else RemoteRewardError."""
        status = answer.status_code
        if status >= 500:
            raise RemoteUnavailable(f"reward server {self.url} answered {status}")
        if 300 <= status < 400:
            where = answer.headers.get("location", "elsewhere")
            raise RemoteRewardError(
                f"reward server {self.url} redirected the request ({status}) to {where}: give url the address "
                "that serves the protocol itself"
            )
        if status >= 400 or status < 200:
            hint = f" (is {TOKEN_ENV} the server's token?)" if status == 401 else ""
            raise RemoteRewardError(f"reward server {self.url} refused the request: {status} {answer.text[:200]}{hint}")
        try:
            return answer.json()
        except ValueError:
            raise RemoteRewardError(f"reward server {self.url} answered non-JSON: {answer.text[:200]!r}") from None

    def _post(self, body: dict, expected: int) -> Tensor:
        try:
            answer = self.client.post(f"{self.url}/score", json=body)
        except httpx.TimeoutException:
            late = f"reward server {self.url} did not answer within timeout_s={self.timeout_s:g}"
            raise RemoteUnavailable(late) from None
        except httpx.HTTPError as err:
            raise RemoteUnavailable(f"reward server {self.url} is unreachable ({type(err).__name__})") from None
        payload = self._payload(answer)
        scorer = scorer_identity(payload, url=self.url)
        if scorer != self.scorer:
            raise RemoteRewardError(
                f"reward server {self.url} now scores with {scorer}, not {self.scorer} as when the run started (was "
                "it restarted with another scorer?): restart it as it was, or start a new run for the new scorer"
            )
        return decode_scores(payload, url=self.url, expected=expected)

    def score(self, images: Tensor, prompts: Sequence[str]) -> Tensor:
        body = encode_batch(images, prompts)
        for attempt in range(self.retries + 1):
            try:
                return self._post(body, images.shape[0])
            except RemoteUnavailable as err:
                last = err
                if attempt < self.retries:
                    time.sleep(min(0.5 * 2**attempt, 10.0))  # a restarting server gets a moment
        log.warning("%s after %d tries: this step's rewards are NaN and its update is skipped", last, self.retries + 1)
        return torch.full((images.shape[0],), math.nan)

    def to(self, device: torch.device | str) -> RemoteScorer:
        return self  # the model lives in the server; scores come back to the images' device
