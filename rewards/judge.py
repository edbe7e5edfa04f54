"""A reward read from a vision-language judge served behind the OpenAI-compatible chat API (vLLM, SGLang).

Each image of a batch is one request, ``POST <base_url>/chat/completions``, at most ``max_in_flight`` at once:

    {"model": model, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,<the image as PNG>"}},
        {"type": "text", "text": prompt_template with {prompt} replaced by the image's caption}]}],
     "temperature": 0, "seed": seed, "max_tokens": max_tokens[, "logprobs": true, "top_logprobs": 20]}

The score is read from the answer's verdict (``content``, or the reasoning field when a reasoning parser took the
whole answer: rewards/chat_answer.py) by ``score_pattern`` (a regular expression with one group; its last match
counts, the final verdict coming after any reasoning), or with ``score_from="logprobs"`` as the expected value
over the candidate tokens of that number, weighted by their probabilities (``top_logprobs``, those that are
numbers inside ``score_range``): a smoother reward than the sampled digit. The number's token is found among
every generated token, the reasoning's included. Logprobs read one token's candidates, so they need a score of
one token: a ``score_range`` reaching 10 is refused when the scorer is built (Qwen-family tokenizers write "10"
as "1", "0", whose first candidates would read it as 1), and a score the judge wrote in several tokens (a
decimal "3.5" is "3", ".", "5") is an error naming ``score_from=text``. The score is mapped to [0, 1] by
(x - low) / (high - low) over ``score_range`` (UnifiedReward's 1 to 5: (x - 1) / 4, as verl-omni maps it).
Temperature 0 and a fixed seed make a score reproducible.

The default template asks in UnifiedReward-2.0's pointwise format: the caption, three axes scored 1 to 5, and a
closing ``Final Score: <1-5>`` line, which the default pattern reads.

The requests go through rewards/served.py: each try within ``timeout_s`` (the whole request), ``retries`` more
tries on connection errors, timeouts, 429 (``Retry-After`` honoured) and 5xx. Failures:
    * a setting: ``check_arguments``, before any request (a caller may run it on the arguments alone); a 404 at
      ``<base_url>/models`` where ``/v1/models`` answers: "add /v1" (vLLM and SGLang serve the API there);
    * the tries run out: the batch scores NaN, with a warning naming the judge and the last error (what a NaN
      batch does to a step is the caller's to decide);
    * an answer that holds no score (no match of the pattern, a refusal: ``finish_reason`` content_filter or
      a ``refusal`` message), an answer cut at ``max_tokens`` (``finish_reason`` length: a score before the
      cut may be a draft), a score outside ``score_range`` or not finite, logprobs asked for and not returned
      or in several tokens, an answer that is not the chat API's JSON, a 4xx other than 429 (a wrong model, a
      refused key: the server's own error message, vLLM's or SGLang's shape, is quoted): ``RemoteRewardError``,
      one line naming the fields read and quoting the start of what they held;
    * the API key: ``api_key_env`` names an environment variable (the key itself never goes in the arguments,
      which callers log); a variable that is not set is one line when the scorer is built.
"""

from __future__ import annotations

import base64
import io
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
import torch
from PIL import Image
from torch import Tensor

from rewards.chat_answer import (
    QUOTED,
    TokensDoNotSpell,
    Verdict,
    error_message,
    parsed_number,
    quoted,
    score_tokens,
    verdict_of,
)
from rewards.preprocess import to_uint8
from rewards.served import RemoteRewardError, ServedScorer, Server, bearer_headers, check_address, check_tries
from settings import Choice, member

UNIFIED_REWARD_TEMPLATE = (
    "You are given an image generated from a text caption. Judge the image against the caption on three axes, "
    "each scored from 1 (poor) to 5 (excellent):\n"
    "- Alignment: how well the image shows what the caption describes.\n"
    "- Coherence: how consistent and free of visual errors (distorted objects, glitches) the image is.\n"
    "- Style: how aesthetically pleasing the image is, regardless of the caption.\n"
    "Then give one overall score from 1 to 5. Answer in exactly this format:\n\n"
    "Alignment Score: X\nCoherence Score: Y\nStyle Score: Z\nFinal Score: W\n\n"
    "Text caption: {prompt}"
)
FINAL_SCORE_PATTERN = r"Final Score(?:\s*\(\d+\s*-\s*\d+\))?\s*:\s*\**\s*([-+]?\d+(?:\.\d+)?)"
TOP_LOGPROBS = 20  # candidates per position asked for with score_from=logprobs (OpenAI's maximum)
# an error's ``param`` -> the argument of ours that set that field of the request
REQUEST_FIELDS = {"model": "model", "max_tokens": "max_tokens", "temperature": "temperature", "seed": "seed"}
REQUEST_FIELDS |= {"logprobs": "score_from", "top_logprobs": "score_from"}


class ScoreFrom(Choice):
    """Where a judge's score is read (rewards/judge.py)."""

    text = "text"
    logprobs = "logprobs"


class JudgeScorer(ServedScorer):
    """Scores from the vision-language judge ``model`` served at ``base_url`` (module docstring)."""

    name = "judge"
    score_path = "/chat/completions"

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        prompt_template: str = UNIFIED_REWARD_TEMPLATE,
        score_pattern: str = FINAL_SCORE_PATTERN,
        score_range: Sequence[float] = (1.0, 5.0),
        score_from: ScoreFrom | str = ScoreFrom.text,
        timeout_s: float = 60.0,
        retries: int = 2,
        api_key_env: str | None = None,
        temperature: float = 0.0,
        seed: int = 0,
        max_tokens: int = 512,
        max_in_flight: int = 8,
    ) -> None:
        self.check_arguments(locals())  # every argument by name, before anything reaches the server
        self.pattern = compiled_pattern(score_pattern)
        self.template, self.model = prompt_template, model
        self.low, self.high = float(score_range[0]), float(score_range[1])
        self.score_from = member(ScoreFrom, score_from, "score_from")
        self.sampling = {"temperature": float(temperature), "seed": int(seed), "max_tokens": int(max_tokens)}
        if self.score_from is ScoreFrom.logprobs:
            self.sampling |= {"logprobs": True, "top_logprobs": TOP_LOGPROBS}
        self.max_in_flight = int(max_in_flight)
        url = base_url.rstrip("/")
        name = f"judge {model!r} at {url}"
        self.server = Server(url, name, float(timeout_s), retries, api_key_headers(api_key_env))
        self._check_model()

    @classmethod
    def check_arguments(cls, arguments: Mapping[str, Any]) -> None:
        """Every argument, the key in ``api_key_env``'s variable included, without contacting the judge."""
        check_address("base_url", arguments["base_url"], "http://127.0.0.1:8000/v1")
        check_tries(arguments["timeout_s"], arguments["retries"])
        check_request(arguments["model"], arguments["prompt_template"], arguments["score_range"])
        check_sampling(arguments["temperature"], arguments["seed"], arguments["max_tokens"], arguments["max_in_flight"])
        compiled_pattern(arguments["score_pattern"])
        low, high = arguments["score_range"]
        check_logprobs_range(member(ScoreFrom, arguments["score_from"], "score_from"), float(low), float(high))
        api_key_headers(arguments["api_key_env"])

    def _check_model(self) -> None:
        """At start-up (before the transformer loads): the server answers and serves ``model``, or one line."""
        answer = self._first_answer("/models", "start it, or check base_url")
        if answer.status_code == 404:
            self._check_root()
            return  # a server without the model list: the first request will say whether it serves the model
        body = self._json(answer)
        data = body.get("data") if isinstance(body, dict) else None
        listed = [str(m.get("id")) for m in data if isinstance(m, dict)] if isinstance(data, list) else []
        if self.model not in listed:
            shown = ", ".join(repr(name) for name in listed[:10]) or "none"
            raise RemoteRewardError(
                f"{self.server.name}: the server does not serve it (it serves {shown}): check model"
            )

    def _check_root(self) -> None:
        """A 404 at ``<base_url>/models``: one line saying "add /v1" when the server answers at
        ``<base_url>/v1/models``, as vLLM and SGLang do (a base_url without /v1 is the commonest mistake)."""
        url = self.server.url
        if url.endswith("/v1") or self._first_answer("/v1/models", "check base_url").status_code == 404:
            return
        raise RemoteRewardError(
            f"{self.server.name} answered 404 at /models and serves /v1/models: add /v1 to base_url ({url}/v1; "
            "vLLM and SGLang serve the API under /v1)"
        )

    def bodies(self, images: Tensor, prompts: Sequence[str]) -> list[dict]:
        return [self._body(image, prompt) for image, prompt in zip(images, prompts)]

    def _body(self, image: Tensor, prompt: str) -> dict:
        text = self.template.replace("{prompt}", prompt)
        content = [{"type": "image_url", "image_url": {"url": png_data_url(image)}}, {"type": "text", "text": text}]
        return {"model": self.model, "messages": [{"role": "user", "content": content}], **self.sampling}

    def read_scores(self, answers: list[httpx.Response], count: int) -> Tensor:
        return torch.tensor([self._score(answer) for answer in answers], dtype=torch.float32)

    def _score(self, answer: httpx.Response) -> float:
        """The score of one answer in [0, 1]; RemoteRewardError, one line quoting it, when it holds none."""
        choice = self._choice(answer)
        message = choice.get("message")
        verdict = verdict_of(message if isinstance(message, dict) else {})
        finish = choice.get("finish_reason")
        refusal = isinstance(message, dict) and message.get("refusal") or (finish == "content_filter" and finish)
        if refusal:
            raise self._error(f"refused to score ({str(refusal)[:QUOTED]!r})", verdict.text, verdict.where)
        if finish == "length":  # whatever it wrote before the cut, a score there may be a draft
            cut = f"was cut at max_tokens={self.sampling['max_tokens']} before its answer ended: raise max_tokens"
            raise self._error(f"{cut}; it wrote", verdict.text, verdict.where)
        matches = list(self.pattern.finditer(verdict.text))  # the last counts: the verdict after any reasoning
        if not matches:
            raise self._error("answered without a score matching score_pattern", verdict.text, verdict.where)
        value = parsed_number(matches[-1].group(1))
        if value is None:
            what = f"answered {matches[-1].group(1)!r} where score_pattern reads a number"
            raise self._error(what, verdict.text, verdict.where)
        if not self.low <= value <= self.high:  # a NaN or inf fails it too
            what = f"gave a score outside score_range [{self.low:g}, {self.high:g}]: {value:g}"
            raise self._error(what, verdict.text, verdict.where)
        if self.score_from is ScoreFrom.logprobs:
            value = self._expected(choice.get("logprobs"), value, verdict)
        return (value - self.low) / (self.high - self.low)

    def _json(self, answer: httpx.Response) -> object:
        """The JSON of a 200 answer; RemoteRewardError for any other status (429 and 5xx were retried) or no JSON."""
        if answer.status_code != 200:
            hint = " (is api_key_env's variable the server's key?)" if answer.status_code in (401, 403) else ""
            error = error_of(answer)
            if error is None:  # not the API's error: a path it does not serve answers 404
                hint = hint or (" (is base_url the API's root, ending in /v1?)" if answer.status_code == 404 else "")
                raise self._error(f"refused the request: {answer.status_code}{hint}", answer.text)
            kind, param, text = error
            hint = hint or (f" (check {REQUEST_FIELDS[param]})" if param in REQUEST_FIELDS else "")
            raise self._error(f"refused the request: {answer.status_code} {kind}{hint}", text)
        try:
            return answer.json()
        except ValueError:
            raise self._error("answered non-JSON", answer.text) from None

    def _choice(self, answer: httpx.Response) -> dict:
        """The first choice of a chat answer; RemoteRewardError for any other status or shape."""
        body = self._json(answer)
        choices = body.get("choices") if isinstance(body, dict) else None
        if not (isinstance(choices, list) and choices and isinstance(choices[0], dict)):
            raise self._error("answered without 'choices' (not the chat completions API?)", answer.text)
        return choices[0]

    def _expected(self, logprobs: object, value: float, verdict: Verdict) -> float:
        """The probability-weighted mean of the numbers in ``score_range`` among the top_logprobs of the one token
        that spells the score ``value`` (rewards/chat_answer.py finds it among every generated token)."""
        tokens = logprobs.get("content") if isinstance(logprobs, dict) else None
        if not isinstance(tokens, list) or not tokens:
            what = "answered without logprobs, which score_from=logprobs needs (use text)"
            raise self._error(what, verdict.text, verdict.where)
        try:
            spelt = score_tokens(tokens, self.pattern, value)
        except TokensDoNotSpell as err:
            raise self._error(str(err), verdict.text, verdict.where) from None
        if len(spelt) > 1:  # a digit per token (Qwen): the first one's candidates are not the number's
            pieces = ", ".join(repr(entry["token"]) for entry in spelt)
            what = (
                f"wrote its score {value:g} as {len(spelt)} tokens ({pieces}), and score_from=logprobs reads the "
                "candidates of one: ask for a whole number in prompt_template, or use score_from=text"
            )
            raise self._error(what, verdict.text, verdict.where)
        return self._mean_of(spelt[0].get("top_logprobs"), verdict)

    def _mean_of(self, candidates: object, verdict: Verdict) -> float:
        weighted = [
            (math.exp(c["logprob"]), value)
            for c in (candidates if isinstance(candidates, list) else [])
            if isinstance(c, dict) and isinstance(c.get("logprob"), int | float)
            for value in [parsed_number(str(c.get("token", "")))]
            if value is not None and self.low <= value <= self.high
        ]
        total = sum(weight for weight, _ in weighted)
        if not total > 0:
            what = "answered no score token among the top_logprobs at the score"
            raise self._error(what, verdict.text, verdict.where)
        return sum(weight * value for weight, value in weighted) / total

    def _error(self, what: str, answer: str, where: str = "") -> RemoteRewardError:
        """One line: the judge, what went wrong, the fields read (``where``) and the start of ``answer``."""
        return RemoteRewardError(f"{self.server.name} {what}{where}: {quoted(answer)}")


def error_of(answer: httpx.Response) -> tuple[str, str | None, str] | None:
    """(type, param, message) of an error answer in vLLM's or SGLang's shape (rewards/chat_answer.py)."""
    try:
        body = answer.json()
    except ValueError:
        return None
    return error_message(body)


def check_request(model: str, template: str, score_range: Sequence[float]) -> None:
    """The judge's model, template and score range, in the scorer's words."""
    if not isinstance(model, str) or not model:
        raise ValueError(f"model must name the served model (its name in <base_url>/models), got {model!r}")
    if not isinstance(template, str) or "{prompt}" not in template:
        raise ValueError("prompt_template must contain {prompt}, where each image's caption goes")
    bounds = list(score_range) if isinstance(score_range, Sequence) and not isinstance(score_range, str) else []
    finite = all(isinstance(b, int | float) and not isinstance(b, bool) and math.isfinite(b) for b in bounds)
    if len(bounds) != 2 or not finite or bounds[0] >= bounds[1]:
        raise ValueError(f"score_range must be [low, high] with finite numbers low < high, got {score_range!r}")


def check_sampling(temperature: float, seed: int, max_tokens: int, max_in_flight: int) -> None:
    """What each request asks of the judge, and how many go at once, in the scorer's words."""
    if not (isinstance(temperature, int | float) and 0 <= temperature < math.inf):
        raise ValueError(f"temperature must be a number >= 0 (0: the most likely answer), got {temperature!r}")
    for name, value, least in (("seed", seed, 0), ("max_tokens", max_tokens, 1), ("max_in_flight", max_in_flight, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")


def check_logprobs_range(score_from: ScoreFrom, low: float, high: float) -> None:
    """With ``score_from=logprobs``, a ``score_range`` whose numbers are single digits: a two-digit score is two
    tokens for Qwen-family tokenizers ("10" is "1", "0"), and its first token's candidates would read it as 1."""
    if score_from is ScoreFrom.logprobs and max(abs(low), abs(high)) >= 10:
        raise ValueError(
            f"score_from=logprobs reads a score from the candidates of one token, and score_range [{low:g}, "
            f"{high:g}] holds numbers of two digits, which Qwen-family tokenizers write a digit per token: use "
            "score_from=text, or a range of single digits such as [1, 5]"
        )


def compiled_pattern(pattern: str) -> re.Pattern[str]:
    """``score_pattern`` compiled; ValueError unless it is a regular expression with exactly one group."""
    try:
        compiled = re.compile(pattern)
    except (re.error, TypeError) as err:
        raise ValueError(f"score_pattern {pattern!r} is not a regular expression: {err}") from None
    if compiled.groups != 1:
        raise ValueError(f"score_pattern must have exactly one group (the score), {pattern!r} has {compiled.groups}")
    return compiled


def api_key_headers(api_key_env: str | None) -> dict[str, str]:
    """``Authorization: Bearer <key>`` with the key read from the variable ``api_key_env`` names (None: no key)."""
    if api_key_env is None:
        return {}
    if not isinstance(api_key_env, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", api_key_env):
        # a key pasted here would end up in every logged config: refuse it without repeating it
        raise ValueError("api_key_env must be the NAME of an environment variable (e.g. OPENAI_API_KEY), not a key")
    key = os.environ.get(api_key_env)
    if not key:
        raise ValueError(f"api_key_env: the environment variable {api_key_env} is not set: export it with the key")
    try:
        return bearer_headers(api_key_env, key)
    except ValueError as err:
        raise ValueError(f"api_key_env: {err}") from None


def png_data_url(image: Tensor) -> str:
    """A [3, H, W] image in [0, 1] as a PNG data URL, its pixels round(255 x). PIL encodes it, as for the JPEG
    rewards (torchvision's encode_png is deprecated since 0.29)."""
    buffer = io.BytesIO()
    Image.fromarray(to_uint8(image).numpy()).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
