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

Failures (the requests themselves: rewards/served.py):
    * a setting no server needs to judge (the URL's scheme or port, ``timeout_s``, ``retries``, a token a header
      cannot carry): ``check_arguments``, before any request (a caller may run it on the arguments alone);
    * the server is unreachable, stuck (it accepts the connection but does not answer within ``timeout_s``)
      or answers 5xx when the scorer is built: one line naming the URL and
      which of these it was;
    * a connection error, a try past ``timeout_s`` (the whole request, not one read: a server that answers a
      byte at a time fails at its deadline), a 429 or a 5xx answer during the run is retried ``retries`` times;
      then the batch scores NaN, with a warning naming the URL and the last error: a required term's NaN skips
      the step, an optional term is left out of it (rewards/combine.py). Skipping, not stopping: raising in one
      process of a distributed job would leave the others waiting in their next collective until it times out, and a
      restarted server costs one step instead of the run;
    * an answer that breaks the protocol (not JSON, a wrong number of scores, a non-number or one beyond
      float32's range, another scorer, a redirect, a 4xx such as a refused token) is a bug or a setting, not a
      hiccup: ``RemoteRewardError``, one sentence naming the URL, stops the run.
"""

from __future__ import annotations

import base64
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
import numpy as np
import torch
from torch import Tensor

from rewards.preprocess import to_uint8
from rewards.served import RemoteRewardError, ServedScorer, Server, bearer_headers, check_address, check_tries

TOKEN_ENV = "JAGG_REWARD_TOKEN"
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def encode_batch(images: Tensor, prompts: Sequence[str]) -> dict:
    """The JSON body of a score request: images [B, 3, H, W] in [0, 1] as uint8 HWC bytes."""
    array = np.ascontiguousarray(to_uint8(images).numpy())
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
        if not fits_float32(score):
            shown = f"an integer of {len(str(abs(score)))} digits" if isinstance(score, int) else f"{score:g}"
            raise RemoteRewardError(
                f"reward server {url} returned a score beyond float32's range (+-{FLOAT32_MAX:.3g}): {shown}"
            )
    return torch.tensor(scores, dtype=torch.float32)


def fits_float32(score: int | float) -> bool:
    """Whether a number becomes a float32 without overflowing to inf (inf and NaN themselves pass: a non-finite
    reward is a batch to skip, rewards/combine.py)."""
    try:
        value = float(score)
    except OverflowError:  # an integer beyond float64 itself
        return False
    return not math.isfinite(value) or abs(value) <= FLOAT32_MAX


class RemoteScorer(ServedScorer):
    """Scores from the server at ``url`` (module docstring): each try of a request within ``timeout_s``, whole;
    ``retries`` more tries (rewards/served.py)."""

    name = "remote"
    score_path = "/score"

    def __init__(self, url: str, *, timeout_s: float = 60.0, retries: int = 2) -> None:
        self.check_arguments({"url": url, "timeout_s": timeout_s, "retries": retries})
        self.url = url.rstrip("/")
        headers = bearer_headers(TOKEN_ENV, os.environ.get(TOKEN_ENV))
        self.server = Server(self.url, f"reward server {self.url}", float(timeout_s), retries, headers)
        answer = self._first_answer("/health", "start it, or check that it runs")
        self.scorer = scorer_identity(self._payload(answer), url=self.url)  # the one every answer must name

    @classmethod
    def check_arguments(cls, arguments: Mapping[str, Any]) -> None:
        """The address, the tries and the token in ``JAGG_REWARD_TOKEN``, without contacting the server."""
        check_address("url", arguments["url"], "http://127.0.0.1:8100")
        check_tries(arguments["timeout_s"], arguments["retries"])
        bearer_headers(TOKEN_ENV, os.environ.get(TOKEN_ENV))

    def _payload(self, answer: httpx.Response) -> object:
        """The JSON of a 2xx answer (429 and 5xx were retried by ``request``); else RemoteRewardError."""
        status = answer.status_code
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

    def bodies(self, images: Tensor, prompts: Sequence[str]) -> list[dict]:
        return [encode_batch(images, prompts)]

    def read_scores(self, answers: list[httpx.Response], count: int) -> Tensor:
        payload = self._payload(answers[0])
        scorer = scorer_identity(payload, url=self.url)
        if scorer != self.scorer:
            raise RemoteRewardError(
                f"reward server {self.url} now scores with {scorer}, not {self.scorer} as when the run started (was "
                "it restarted with another scorer?): restart it as it was, or start a new run for the new scorer"
            )
        return decode_scores(payload, url=self.url, expected=count)
