"""The served rewards (docs/reliability.md, The reward server and the judge): an answer outside the protocol or a
judge's answer without a score ends the run in one line once the steps before it are saved; a server that drips its
answer ends each step at the request's deadline; one that never answers at start-up is named as stuck."""

from __future__ import annotations

import re
import time

import pytest
from run_folders import metrics, refused_line

pytestmark = pytest.mark.usefixtures("repo_root")  # the tiny experiment's prompt file is relative to the repository


# A reward server that answers step 0 and then outside the protocol: what the one line says after the URL.
SERVER_FAULTS = {
    "non-json": ("text", r"answered non-JSON: 'Bad Gateway'"),
    "another-scorer": ("other", r"now scores with pickscore\(\), not fake\(\) as when the run started"),
    "refused-token": ("401", r"refused the request: 401 .*JAGG_REWARD_TOKEN"),
    "too-large": ("huge", r"returned a score beyond float32's range \(\+-3\.4e\+38\): an integer of 401 digits"),
}


@pytest.mark.parametrize("case", list(SERVER_FAULTS))
def test_a_reward_server_answer_outside_the_protocol_is_one_line(case, launch, tmp_path):
    """Step 1's answer breaks the protocol: the step trained before it is checkpointed, then one line naming
    reward.components.remote and the server, status 2."""
    pytest.importorskip("fastapi")
    from fastapi.responses import JSONResponse, PlainTextResponse
    from reward_servers import FAKE, fake_server, serve

    def good(count):
        return {"scores": [0.5 * i for i in range(count)], **FAKE}

    fault = {
        "text": PlainTextResponse("Bad Gateway"),
        "other": lambda count: {**good(count), "scorer": "pickscore"},
        "401": JSONResponse({"detail": "missing or wrong bearer token"}, status_code=401),
        "huge": lambda count: {**good(count), "scores": [10**400] * count},
    }[SERVER_FAULTS[case][0]]
    with serve(fake_server(good, fault)) as url:
        remote = f"+reward.components.remote={{url: '{url}', timeout_s: 10, retries: 0}}"
        line = refused_line(launch, tmp_path / "run", "num_steps=3", remote)
    assert re.search(rf"reward\.components\.remote: reward server {url} {SERVER_FAULTS[case][1]}", line), line
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step_00000001"]


def test_a_reward_server_that_answers_a_byte_at_a_time_ends_each_step_at_its_deadline(launch, tmp_path):
    """Every byte of /score's answer comes within timeout_s, the whole answer would take a minute: each step ends
    at the request's deadline (its rewards NaN, skipped), and the run, none of whose steps learned, ends in one
    line within seconds."""
    pytest.importorskip("fastapi")
    from reward_servers import dripping_server

    with dripping_server() as url:
        remote = f"+reward.components.remote={{url: '{url}', timeout_s: 1, retries: 0}}"
        start = time.monotonic()
        line = refused_line(launch, tmp_path / "run", "num_steps=2", remote)
        elapsed = time.monotonic() - start
    assert "health.max_bad_steps: none of steps 0 to 1 could change the weights" in line, line
    log = (tmp_path / "run" / "__main__.log").read_text()
    assert elapsed < 60 and log.count(f"reward server {url} did not answer POST /score within timeout_s=1") == 2


def test_a_reward_server_that_never_answers_its_health_check_is_named_as_such(launch, tmp_path):
    """A server that accepts the connection and never answers is stuck, not unreachable: one line, status 2."""
    pytest.importorskip("fastapi")
    from reward_servers import silent_server

    with silent_server() as url:
        remote = f"+reward.components.remote={{url: '{url}', timeout_s: 1, retries: 0}}"
        line = refused_line(launch, tmp_path / "run", remote)
    assert line.startswith(
        f"python -m train: error: reward.components.remote: reward server {url} did not answer GET /health within "
        "timeout_s=1 at start-up"
    ), line


def test_a_judge_answer_without_a_score_is_one_line_after_the_steps_before_it(launch, tmp_path):
    """A judge (reward=judge's component against a stand-in OpenAI-compatible server) scores step 0, then answers
    step 1 without a score: step 0 is checkpointed and one line quotes the answer, status 2."""
    pytest.importorskip("fastapi")
    from reward_servers import chat, judge_server, serve

    def answer(body: dict, number: int) -> dict:
        return chat(f"Final Score: {1 + number % 5}") if number < 2 else chat("I cannot rate this image.")

    app, seen = judge_server(answer)
    with serve(app) as url:
        judge = f"+reward.components.judge={{base_url: '{url}/v1', model: judge, score_range: [1, 5], retries: 0}}"
        overrides = ["num_steps=3", "checkpoint.every=5", judge]
        line = refused_line(launch, tmp_path / "run", *overrides)
    assert f"judge 'judge' at {url}/v1 answered without a score matching score_pattern: 'I cannot" in line, line
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step_00000001"]
    assert metrics(tmp_path / "run")[0]["reward/judge"] == pytest.approx((0.0 + 0.25) / 2)  # scores 1 and 2 -> 0, 1/4
