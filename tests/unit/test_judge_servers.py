"""The judge reward against answers shaped as vLLM and SGLang send them (tests/fixtures/servers/*_chat.json, each
naming the source files and commits its shapes were read from): with and without a reasoning parser, in text and
logprobs modes, answers cut at max_tokens, multi-token numbers, the servers' error bodies; and the console lines
of a judge whose tries run out, as an optional and as a required term."""

from __future__ import annotations

import copy
import inspect
import json
import logging
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
from fastapi.responses import JSONResponse  # noqa: E402
from reward_servers import judge_server, serve  # noqa: E402
from stage_toys import ToyRollout, ToyScorer, brightness, toy_stage  # noqa: E402

from rewards.base import build_scorer  # noqa: E402
from rewards.judge import JudgeScorer  # noqa: E402
from rewards.served import RemoteRewardError  # noqa: E402
from train.ground.errors import ConfigError, config_key  # noqa: E402
from train.loop.step import roll_out_and_score  # noqa: E402
from train.parts.observe.perf import PhaseTimer  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "servers"
SERVERS = ["vllm", "sglang"]
# the candidates at the verdict's digit in the fixtures: 4 (p 0.5), 5 (0.3), 3 (0.15), and "**" (0.05), no number
EXPECTED_4 = (0.5 * 4 + 0.3 * 5 + 0.15 * 3) / 0.95


def fixture(server: str) -> dict:
    return json.loads((FIXTURES / f"{server}_chat.json").read_text())


def response(server: str, case: str) -> JSONResponse:
    answer = fixture(server)["answers"][case]
    return JSONResponse(answer["body"], status_code=answer["status"])


def score_of(body: object, **arguments) -> float:
    """The judge's score of one image whose answer is ``body`` (a Response, or JSON)."""
    app, _ = judge_server(lambda request, number: body)
    with serve(app) as url:
        scorer = JudgeScorer(f"{url}/v1", "judge", **{"timeout_s": 10, "retries": 0, **arguments})
        return scorer(torch.full((1, 3, 8, 8), 0.5), ["a red car on a bridge"]).item()


def refusal_of(body: object, **arguments) -> str:
    with pytest.raises(RemoteRewardError) as err:
        score_of(body, **arguments)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_every_fixture_names_its_sources():
    for server in SERVERS:
        sources = fixture(server)["source"]
        assert sources and all(len(s["commit"]) == 40 and s["file"] and s["repo"] for s in sources)


# (case, score_range, the score before mapping to [0, 1])
TEXT_CASES = [
    ("plain", [1, 5], 4.0),
    ("thinking", [1, 5], 4.0),  # the verdict in content, not the draft 2 in the reasoning
    ("whole-in-reasoning", [1, 5], 4.0),  # content null (vLLM) or empty (SGLang): the reasoning field read
    ("ten", [1, 10], 10.0),
    ("decimal", [1, 5], 3.5),
]


@pytest.mark.parametrize("server", SERVERS)
@pytest.mark.parametrize("case, bounds, score", TEXT_CASES)
def test_text_mode_reads_the_verdict_where_each_server_puts_it(server, case, bounds, score):
    low, high = bounds
    assert score_of(response(server, case), score_range=bounds) == pytest.approx((score - low) / (high - low))


def test_an_older_vllm_that_names_the_field_reasoning_content_is_read_the_same():
    assert score_of(response("vllm", "thinking-older-field")) == pytest.approx(0.75)


@pytest.mark.parametrize("server", SERVERS)
@pytest.mark.parametrize("case", ["plain-logprobs", "thinking-logprobs", "whole-in-reasoning-logprobs"])
def test_logprobs_mode_finds_the_score_among_every_generated_token(server, case):
    """The token list holds the reasoning's tokens and </think> too; the draft score there has other candidates
    (2 at p 0.9), which must not be the ones read."""
    score = score_of(response(server, case), score_from="logprobs")
    assert score == pytest.approx((EXPECTED_4 - 1) / 4, rel=1e-5)  # the logprobs are rounded to 1e-6


@pytest.mark.parametrize("server", SERVERS)
def test_a_score_in_several_tokens_is_one_line_naming_score_from(server):
    line = refusal_of(response(server, "decimal-logprobs"), score_from="logprobs")
    assert "wrote its score 3.5 as 3 tokens ('3', '.', '5')" in line and "use score_from=text" in line, line


def test_logprobs_mode_refuses_a_range_of_two_digit_numbers_before_asking():
    """A 1-10 judge's "10" is "1", "0" for Qwen's tokenizers: refused when built, the trainer's key in front."""
    arguments = {"base_url": "http://127.0.0.1:1/v1", "model": "judge", "score_from": "logprobs"}
    with pytest.raises(ConfigError, match=r"^reward\.components\.judge\.score_from=logprobs reads a score from"):
        with config_key("reward.components.judge", inspect.signature(JudgeScorer).parameters):
            build_scorer("judge", **arguments, score_range=[1, 10])


@pytest.mark.parametrize("server", SERVERS)
@pytest.mark.parametrize("mode", ["text", "logprobs"])
def test_an_answer_cut_at_max_tokens_is_an_error_naming_it_after_a_draft_score(server, mode):
    line = refusal_of(response(server, "cut-after-draft"), score_from=mode, max_tokens=64)
    assert "was cut at max_tokens=64 before its answer ended: raise max_tokens" in line, line
    assert "it wrote: 'Alignment Score: 4 Coherence Score: 2" in line, line


@pytest.mark.parametrize("server, field", [("vllm", "reasoning"), ("sglang", "reasoning_content")])
def test_an_answer_cut_while_thinking_names_max_tokens_and_the_field_read(server, field):
    line = refusal_of(response(server, "cut-while-thinking"))
    held = "null" if server == "vllm" else "''"
    assert f"raise max_tokens; it wrote in {field} (content was {held}: a reasoning parser took" in line, line
    assert line.endswith(": 'The caption asks for a red car. A first guess: Final Score: 2, but the bridge'"), line


def test_an_answer_with_no_text_says_which_fields_were_read():
    body = copy.deepcopy(fixture("vllm")["answers"]["plain"]["body"])
    body["choices"][0]["message"]["content"] = None
    line = refusal_of(body)
    assert "without a score matching score_pattern (content was null, no reasoning or reasoning_content)" in line


# (server, case, what the line says after the judge's name)
ERRORS = [
    ("vllm", "unknown-model", "refused the request: 404 NotFoundError (check model): 'The model `judge` does not"),
    ("vllm", "max-tokens-too-large", "refused the request: 400 BadRequestError (check max_tokens): \"'max_tokens'"),
    ("sglang", "bad-request", 'refused the request: 400 BadRequestError: "The input (1300 tokens) is longer'),
]


@pytest.mark.parametrize("server, case, said", ERRORS)
def test_the_servers_error_bodies_are_one_line_with_their_message(server, case, said):
    line = refusal_of(response(server, case))
    assert said in line, line


def _stage_lines(optional: bool, caplog) -> tuple[str, object]:
    """The console of one step whose judge term answers 503 on every try, beside a local term."""
    app, _ = judge_server(lambda request, number: JSONResponse({"error": "overloaded"}, 503))
    with serve(app) as url:
        judge = JudgeScorer(f"{url}/v1", "judge", timeout_s=10, retries=0)
        stage = toy_stage({"a": (ToyScorer(brightness), 1.0), "judge": (judge, 1.0)}, optional=["judge"] * optional)
        with caplog.at_level(logging.WARNING):
            _, _, scored = roll_out_and_score(ToyRollout(num_groups=2), stage, PhaseTimer())  # type: ignore[arg-type]
    return caplog.text, scored


def test_an_optional_judge_that_fails_says_it_is_left_out_not_that_the_step_is_skipped(caplog):
    console, scored = _stage_lines(True, caplog)
    assert scored.advantages is not None and scored.metrics["reward/judge/missing"] == 1.0
    assert "answered 503 after 1 tries: this batch of 4 images scores NaN" in console, console
    assert "reward.components.judge (optional) is left out of this step's advantages and the other weights " in console
    assert "skip" not in console, console


def test_a_required_judge_that_fails_still_skips_the_step(caplog):
    console, scored = _stage_lines(False, caplog)
    assert scored.advantages is None and "skipping the update of this step: reward component 'judge'" in console
