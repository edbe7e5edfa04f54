"""The judge reward against a stand-in OpenAI-compatible server on 127.0.0.1: what it sends, how it reads a score
from the text or the log-probabilities, and how each failure ends (one line, or a NaN batch with a warning)."""

from __future__ import annotations

import base64
import inspect
import io
import math
import re
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from email.utils import formatdate

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("fastapi")
from fastapi.responses import JSONResponse, PlainTextResponse  # noqa: E402
from reward_servers import chat, judge_server, serve, silent_server, warnings_of  # noqa: E402

from rewards.base import build_scorer  # noqa: E402
from rewards.judge import FINAL_SCORE_PATTERN, UNIFIED_REWARD_TEMPLATE, JudgeScorer  # noqa: E402
from rewards.reward_config import RewardConfig  # noqa: E402
from rewards.served import RemoteRewardError, retry_after  # noqa: E402

PROMPTS = ["a cat", "a red car on a bridge", "two dogs"]


def _images(count: int = 3) -> torch.Tensor:
    """Images on the uint8 grid, so the PNG's pixels equal them exactly."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (count, 3, 12, 16), generator=g).float() / 255


def _caption(body: dict) -> str:
    text = body["messages"][0]["content"][1]["text"]
    return text.rsplit("Text caption: ", 1)[1]


def unified(body: dict, number: int) -> dict:
    """UnifiedReward's answer format, its final score 1 + (caption length mod 5)."""
    final = 1 + len(_caption(body)) % 5
    return chat(f"Alignment Score: 3\nCoherence Score: 4\nStyle Score: 2\nFinal Score: {final}")


def _expected(prompts: list[str]) -> torch.Tensor:
    return torch.tensor([(len(p) % 5) / 4 for p in prompts])  # (1 + len % 5 - 1) / 4


@contextmanager
def judge(answer, *, delay_s: float = 0.0, **arguments) -> Iterator[tuple[JudgeScorer, object]]:
    """A JudgeScorer of the stand-in server that answers ``answer(body, n)``, and the server's log."""
    app, seen = judge_server(answer, delay_s=delay_s)
    with serve(app) as url:
        yield JudgeScorer(f"{url}/v1", "judge", **{"timeout_s": 10, "retries": 0, **arguments}), seen


def test_scores_are_read_from_the_final_score_and_mapped_to_0_1():
    images = _images()
    with judge(unified, seed=7, max_tokens=64) as (scorer, seen):
        scores = scorer(images, PROMPTS)
    torch.testing.assert_close(scores, _expected(PROMPTS))
    by_caption = {_caption(body): body for body in seen.bodies}
    for image, prompt in zip(images, PROMPTS):
        body = by_caption[prompt]  # one request per image, each with its own caption and image
        assert (body["model"], body["temperature"], body["seed"], body["max_tokens"]) == ("judge", 0.0, 7, 64)
        assert "logprobs" not in body
        picture, text = body["messages"][0]["content"]
        assert text["text"] == UNIFIED_REWARD_TEMPLATE.replace("{prompt}", prompt)
        url = picture["image_url"]["url"]
        assert url.startswith("data:image/png;base64,")
        png = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
        assert png.format == "PNG"
        assert torch.equal(torch.from_numpy(np.array(png)).permute(2, 0, 1) / 255, image)


@pytest.mark.parametrize(
    "text, score",
    [
        ("Final Score: 4", 4.0),
        ("Final Score (1-5): 2.5", 2.5),
        ("**Final Score:** 5", 5.0),
        ("Final Score: 2 ... on reflection, Final Score: 3", 3.0),  # the last one is the verdict
    ],
)
def test_the_default_pattern_reads_the_final_score(text, score):
    assert float(re.findall(FINAL_SCORE_PATTERN, text)[-1]) == score
    with judge(lambda body, n: chat(text)) as (scorer, _):
        assert scorer(_images(1), PROMPTS[:1]).item() == pytest.approx((score - 1) / 4)


def _logprobs(tokens: list[str], at: int, candidates: dict[str, float]) -> dict:
    """Log-probabilities of an answer spelt by ``tokens``; token ``at`` has ``candidates`` (token -> probability)."""
    top = [{"token": t, "logprob": math.log(p), "bytes": None} for t, p in candidates.items()]
    return {
        "content": [{"token": t, "logprob": -0.1, "top_logprobs": top if i == at else []} for i, t in enumerate(tokens)]
    }


def test_score_from_logprobs_is_the_expected_value_at_the_score_token():
    tokens = ["Alignment", " Score", ": 4", "\n", "Final", " Score", ":", " ", "4", "\n"]
    # at the score: 4 with p 0.5, 5 with 0.3, 3 with 0.1; "x" (not a number) and "9" (outside 1-5) do not count
    logprobs = _logprobs(tokens, 8, {"4": 0.5, "5": 0.3, "3": 0.1, "x": 0.05, "9": 0.05})
    with judge(lambda body, n: chat("".join(tokens), logprobs=logprobs), score_from="logprobs") as (scorer, seen):
        score = scorer(_images(1), PROMPTS[:1])
    expected = (0.5 * 4 + 0.3 * 5 + 0.1 * 3) / 0.9  # renormalised over the score tokens
    assert score.item() == pytest.approx((expected - 1) / 4, rel=1e-6)
    assert seen.bodies[0]["logprobs"] is True and seen.bodies[0]["top_logprobs"] == 20


# (the answer, what the one line says after the judge's name); each quotes the start of the answer
BAD_ANSWERS = {
    "no-number": (chat("The image shows a cat. It is nice."), r"answered without a score matching score_pattern: 'The"),
    "cut-short": (
        chat("Alignment Score: 4\nCoherence", finish_reason="length"),
        r"was cut at max_tokens=512 before its answer ended: raise max_tokens; it wrote: "
        r"'Alignment Score: 4 Coherence'",
    ),
    "content-filter": (chat("", finish_reason="content_filter"), r"refused to score \('content_filter'\)"),
    "refusal": (chat(None, refusal="I can't help with that."), r"refused to score \(\"I can't help with that.\"\)"),
    "out-of-range": (chat("Final Score: 7"), r"gave a score outside score_range \[1, 5\]: 7: 'Final Score: 7'"),
    "not-json": (PlainTextResponse("<html>Bad Gateway</html>"), r"answered non-JSON: '<html>Bad Gateway</html>'"),
    "no-choices": ({"object": "list", "data": []}, r"answered without 'choices' \(not the chat completions API\?\)"),
    "unknown-model": (
        JSONResponse({"error": {"message": "The model `judge` does not exist."}}, status_code=404),
        r"refused the request: 404 error: 'The model `judge` does not exist\.'",
    ),
    "refused-key": (JSONResponse({"error": "bad key"}, status_code=401), r"refused the request: 401 \(is api_key_env"),
}


@pytest.mark.parametrize("case", list(BAD_ANSWERS))
def test_an_answer_without_a_score_is_one_line_quoting_it(case):
    answer, message = BAD_ANSWERS[case]
    with judge(lambda body, n: answer) as (scorer, _):
        with pytest.raises(RemoteRewardError, match=rf"^judge 'judge' at http://127\.0\.0\.1:\d+/v1 {message}") as err:
            scorer(_images(), PROMPTS)
    assert "\n" not in str(err.value)


def test_logprobs_asked_for_and_not_returned_is_one_line():
    with judge(lambda body, n: chat("Final Score: 4"), score_from="logprobs") as (scorer, _):
        with pytest.raises(RemoteRewardError, match=r"answered without logprobs, which score_from=logprobs needs"):
            scorer(_images(1), PROMPTS[:1])


def test_a_slow_answer_fails_at_its_deadline_and_the_batch_scores_nan():
    with judge(unified, delay_s=3.0, timeout_s=0.3) as (scorer, seen):
        start = time.monotonic()
        with warnings_of("rewards.judge") as lines:
            scores = scorer(_images(), PROMPTS)
        elapsed = time.monotonic() - start
    assert scores.isnan().all() and elapsed < 2.0  # the deadline, not the 3 s answer
    assert len(lines) == 1 and "did not answer POST /chat/completions within timeout_s=0.3 after 1 tries" in lines[0]


def test_a_rate_limit_is_retried_after_the_time_the_server_asks():
    def limited(body: dict, number: int) -> object:
        return JSONResponse({"error": "rate limited"}, 429, {"Retry-After": "1"}) if number == 0 else unified(body, 0)

    with judge(limited, retries=1) as (scorer, seen):
        start = time.monotonic()
        scores = scorer(_images(1), PROMPTS[:1])
        elapsed = time.monotonic() - start
    torch.testing.assert_close(scores, _expected(PROMPTS[:1]))
    assert len(seen.bodies) == 2 and elapsed >= 0.9  # the second try came after the 1 s asked, not 0.5 s of back-off


def test_a_server_error_is_retried():
    def flaky(body: dict, number: int) -> object:
        return JSONResponse({"error": "overloaded"}, 503) if number < 2 else unified(body, number)

    with judge(flaky, retries=2) as (scorer, seen):
        torch.testing.assert_close(scorer(_images(1), PROMPTS[:1]), _expected(PROMPTS[:1]))
    assert len(seen.bodies) == 3


def test_when_the_retries_run_out_the_batch_scores_nan_with_one_warning():
    with judge(lambda body, n: JSONResponse({"error": "down"}, 503), retries=1) as (scorer, seen):
        with warnings_of("rewards.judge") as lines:
            scores = scorer(_images(1), PROMPTS[:1])
    assert scores.isnan().all() and len(seen.bodies) == 2  # the try and one retry
    assert len(lines) == 1 and re.search(r"judge 'judge' at \S+ answered 503 after 2 tries", lines[0])


def test_retry_after_reads_seconds_and_http_dates():
    now = 1_800_000_000.0
    assert retry_after("3", now=now) == 3.0 and retry_after("0.5") == 0.5
    assert retry_after(formatdate(now + 4, usegmt=True), now=now) == pytest.approx(4.0)
    assert retry_after(formatdate(now - 60, usegmt=True), now=now) == 0.0  # a date past: at once
    assert retry_after(None) is None and retry_after("soon") is None and retry_after("nan") is None


def test_at_most_max_in_flight_requests_at_once():
    with judge(unified, delay_s=0.3, max_in_flight=2) as (scorer, seen):
        scores = scorer(_images(6), PROMPTS * 2)
    torch.testing.assert_close(scores, _expected(PROMPTS * 2))  # the answers in the images' order
    assert len(seen.bodies) == 6 and seen.peak == 2


def test_the_api_key_comes_from_the_variable_api_key_env_names(monkeypatch):
    monkeypatch.delenv("JUDGE_KEY", raising=False)
    with pytest.raises(ValueError, match=r"^api_key_env: the environment variable JUDGE_KEY is not set"):
        JudgeScorer("http://127.0.0.1:1/v1", "judge", api_key_env="JUDGE_KEY")
    with pytest.raises(ValueError, match=r"^api_key_env must be the NAME of an environment variable") as err:
        JudgeScorer("http://127.0.0.1:1/v1", "judge", api_key_env="sk-abc123")
    assert "sk-abc123" not in str(err.value)  # a key pasted in a config is not repeated in the logs
    monkeypatch.setenv("JUDGE_KEY", "s3cret")
    with judge(unified, api_key_env="JUDGE_KEY") as (scorer, seen):
        scorer(_images(1), PROMPTS[:1])
    assert seen.headers[0]["authorization"] == "Bearer s3cret"


def _free_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_the_server_and_the_model_are_checked_when_the_judge_is_built():
    """Before the transformer loads: a server that is down, one that never answers, and one that serves
    another model are each one line."""
    url = _free_url()
    with pytest.raises(RemoteRewardError, match=rf"^judge 'judge' at {url}/v1 is unreachable \(ConnectError\) at st"):
        JudgeScorer(f"{url}/v1", "judge", retries=0)
    with silent_server() as url:
        with pytest.raises(RemoteRewardError, match=r"did not answer GET /models within timeout_s=0.5 at start-up"):
            JudgeScorer(f"{url}/v1", "judge", timeout_s=0.5, retries=0)
    app, _ = judge_server(unified)
    with serve(app) as url:
        with pytest.raises(RemoteRewardError, match=r"^judge 'Qwen/Qwen3-VL-8B' at \S+: the server does not serve"):
            JudgeScorer(f"{url}/v1", "Qwen/Qwen3-VL-8B", retries=0)


BAD_ARGUMENTS = {
    "base_url": ({"base_url": "127.0.0.1:8000"}, r"^base_url must start with http:// or https:// \(e\.g\. http"),
    "base_url-ftp": ({"base_url": "ftp://127.0.0.1/v1"}, r"^base_url must start with http:// or https://"),
    "base_url-port": ({"base_url": "http://127.0.0.1:80000/v1"}, r"^base_url must be http\(s\)://HOST\[:PORT\] with a"),
    "model": ({"model": ""}, r"^model must name the served model"),
    "prompt_template": ({"prompt_template": "Rate this image."}, r"^prompt_template must contain \{prompt\}"),
    "score_pattern": ({"score_pattern": "Final Score: \\d"}, r"^score_pattern must have exactly one group"),
    "score_pattern-regex": ({"score_pattern": "Final (Score"}, r"^score_pattern 'Final \(Score' is not a regular"),
    "score_range": ({"score_range": [5, 1]}, r"^score_range must be \[low, high\] with finite numbers low < high"),
    "score_from": ({"score_from": "tokens"}, r"^score_from='tokens' is not valid; accepted values: text, logprobs"),
    "timeout_s": ({"timeout_s": 0}, r"^timeout_s must be a number of seconds > 0"),
    "timeout_s-text": ({"timeout_s": "abc"}, r"^timeout_s must be a number of seconds > 0 .*, got 'abc'"),
    "retries": ({"retries": -1}, r"^retries must be a whole number >= 0"),
    "retries-fraction": ({"retries": 1.5}, r"^retries must be a whole number >= 0 .*, got 1\.5"),
    "temperature": ({"temperature": -0.5}, r"^temperature must be a number >= 0"),
    "seed": ({"seed": 1.5}, r"^seed must be an integer >= 0"),
    "max_tokens": ({"max_tokens": 0}, r"^max_tokens must be an integer >= 1"),
    "max_in_flight": ({"max_in_flight": 0}, r"^max_in_flight must be an integer >= 1"),
}


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_each_argument_is_checked_in_the_scorers_words(case):
    """By the constructor and by ``check_arguments`` alike, before anything reaches a server (none listens)."""
    change, message = BAD_ARGUMENTS[case]
    arguments = {"base_url": _free_url() + "/v1", "model": "judge", **change}
    with pytest.raises(ValueError, match=message):
        build_scorer("judge", **arguments)
    bound = inspect.signature(JudgeScorer).bind(**arguments)
    bound.apply_defaults()
    with pytest.raises(ValueError, match=message):
        JudgeScorer.check_arguments(bound.arguments)


@pytest.mark.parametrize("key, where", [("s3cret\r", r"'\\r' at its end"), ("s3 cret", "' ' at character 3 of 7")])
def test_a_key_a_header_cannot_carry_is_named_without_repeating_it(key, where, monkeypatch):
    """A key with a line ending (a file saved on Windows) or a space was "unreachable ... check base_url"."""
    monkeypatch.setenv("JUDGE_KEY", key)
    expected = rf"^api_key_env: the key in the environment variable JUDGE_KEY holds {where}"
    with pytest.raises(ValueError, match=expected) as err:
        JudgeScorer(_free_url() + "/v1", "judge", api_key_env="JUDGE_KEY")
    assert "s3" not in str(err.value)  # the key is not repeated in the logs


def test_a_base_url_without_v1_is_told_to_add_it():
    """vLLM and SGLang serve /v1/models: a 404 at <base_url>/models, when <base_url>/v1/models answers, is a
    base_url without /v1 (it was taken for a server without a model list, and step 0 stopped with a bare 404)."""
    app, seen = judge_server(unified)
    with serve(app) as url:
        with pytest.raises(RemoteRewardError, match=rf"^judge 'judge' at {url} answered 404 at /models and serves "):
            JudgeScorer(url, "judge", retries=0)
        with pytest.raises(RemoteRewardError, match=rf"add /v1 to base_url \({url}/v1; vLLM and SGLang serve"):
            JudgeScorer(url + "/", "judge", retries=0)
    assert not seen.bodies  # refused at start-up, before any image


@pytest.mark.parametrize("missing", ["base_url", "model"])
def test_the_reward_config_requires_the_judges_address_and_model(missing):
    component = {"weight": 1.0, "base_url": "http://127.0.0.1:8000/v1", "model": "judge"}
    del component[missing]
    with pytest.raises(ValueError, match=rf"^components\.judge\.{missing} is not set: give the"):
        RewardConfig(components={"judge": component})
