"""The served rewards (docs/reliability.md, The reward server and the judge): their settings refused by the
launchers' check and the trainer alike, without the network; a judge's base_url without /v1 named at start-up; an
answer outside the protocol or a judge's answer without a score ends the run in one line once the steps before it
are saved; a server that drips its answer ends each step at the request's deadline; one that never answers at
start-up is named as stuck; one that never answers a score holds a step in many chunks for one request, not one
per chunk, on one rank and on two. A served scorer among eval.scorers is built before the model loads, in the trainer
and in train.eval, its bound checked against dist.timeout_s, and one that fails during an evaluation is left out of
it in one line, on one rank and on each of two."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
from run_folders import ROOT, copy_run, metrics, refused_line
from small_run import FAST, the_error

import train.cli.check as check_command
import train.tools.eval.command as eval_command
from rewards.served import request_bound_s
from train.parts.policy import builder

pytestmark = pytest.mark.usefixtures("repo_root")  # the tiny experiment's prompt file is relative to the repository

# A served scorer's setting the server is never asked about: (its overrides, what the one line says). No server
# listens at these addresses: the check reaches none.
JUDGE = "+reward.components.judge={{base_url: '{url}', model: judge, retries: 0{more}}}"
REMOTE = "+reward.components.remote={{url: '{url}', timeout_s: {timeout}, retries: {retries}}}"
BAD_SERVED = {
    "judge-ftp": (
        [JUDGE.format(url="ftp://127.0.0.1:8000/v1", more="")],
        r"reward\.components\.judge\.base_url must start with http:// or https:// .*got 'ftp://127\.0\.0\.1:8000/v1'",
    ),
    "remote-timeout-text": (
        [REMOTE.format(url="http://127.0.0.1:9", timeout="abc", retries=0)],
        r"reward\.components\.remote\.timeout_s must be a number of seconds > 0 .*got 'abc'",
    ),
    "remote-port": (
        [REMOTE.format(url="http://127.0.0.1:70000", timeout=1, retries=0)],
        r"reward\.components\.remote\.url must be http\(s\)://HOST\[:PORT\] with a port from 1 to 65535",
    ),
    "remote-retries-fraction": (
        [REMOTE.format(url="http://127.0.0.1:9", timeout=1, retries=1.5)],
        r"reward\.components\.remote\.retries must be a whole number >= 0 .*got 1\.5",
    ),
    "judge-key-line-ending": (
        [JUDGE.format(url="http://127.0.0.1:9/v1", more=", api_key_env: JUDGE_KEY")],
        r"reward\.components\.judge\.api_key_env: the key in the environment variable JUDGE_KEY holds '\\r' at its end",
    ),
    "eval-judge-bound": (
        ["eval.every=1", "+eval.scorers.judge={base_url: 'http://127.0.0.1:9/v1', model: judge, timeout_s: 1000}"],
        r"^python -m train: error: eval\.scorers\.judge: a request its server does not answer takes up to 5000 s .*"
        r"not below dist\.timeout_s=1800",
    ),
}


@pytest.mark.parametrize("case", list(BAD_SERVED))
def test_a_served_setting_is_refused_by_the_launchers_check_and_the_trainer_alike(case, launch, tmp_path, capsys,
                                                                                  monkeypatch):  # fmt: skip
    """python -m train.cli.check passed these (the launcher then started torchrun, which restarted the refused
    worker), and the trainer refused them with a traceback (timeout_s 'abc', a port beyond 65535), took 1.5 retries
    as 1, or called a key ending in \\r "unreachable", and neither bound an evaluation's judge by dist.timeout_s:
    both now refuse each in the same one line, and nothing is written."""
    monkeypatch.setenv("JUDGE_KEY", "s3cret\r")
    served, expected = BAD_SERVED[case]
    run_dir = tmp_path / "run"
    try:
        status = check_command.main(["experiment=tiny", f"hydra.run.dir={run_dir}", *served])
    except SystemExit as end:  # a refusal after the settings composed ends the process, as the trainer's does
        status = end.code
    err = capsys.readouterr().err
    assert status == 2 and re.search(expected, the_error(err)), err
    assert re.search(expected, refused_line(launch, run_dir, *served)) and not run_dir.exists()


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
    assert "HTTP Request" not in (tmp_path / "run" / "__main__.log").read_text()  # httpx's line for every image


def test_a_judge_base_url_without_v1_is_one_line_at_start_up(launch, tmp_path):
    """A vLLM-shaped server (FastAPI, /v1/models and /v1/chat/completions) and base_url without /v1: the 404 at
    /models was taken for a server without a model list, and step 0 stopped with a bare 404."""
    pytest.importorskip("fastapi")
    from reward_servers import chat, judge_server, serve

    app, seen = judge_server(lambda body, number: chat("Final Score: 3"))
    with serve(app) as url:
        line = refused_line(launch, tmp_path / "run", f"+reward.components.judge={{base_url: '{url}', model: judge}}")
    expected = f"reward.components.judge: judge 'judge' at {url} answered 404 at /models and serves /v1/models: add "
    assert expected + f"/v1 to base_url ({url}/v1; vLLM" in line, line
    assert not seen.bodies and not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_a_served_setting_refused_by_the_launcher_never_starts_torchrun(tmp_path):
    """scripts/launch/train.sh with a judge's base_url ftp://...: one line, status 2, torchrun never started (it
    started before, and each restart printed the line again)."""
    torchrun = tmp_path / "torchrun"  # a stand-in that records that it was started
    torchrun.write_text('#!/usr/bin/env bash\ntouch "$(dirname "$0")/started"\n')
    torchrun.chmod(0o755)
    env = {**os.environ, "TORCHRUN": str(torchrun), "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    env |= {"RUN_DIR": str(tmp_path / "run"), "OMP_NUM_THREADS": "1"}
    served = JUDGE.format(url="ftp://127.0.0.1:8000/v1", more="")
    script = [str(ROOT / "scripts" / "launch" / "train.sh"), "tiny", served]
    done = subprocess.run(script, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert re.search(BAD_SERVED["judge-ftp"][1], the_error(done.stderr))
    assert not (tmp_path / "started").exists() and not (tmp_path / "run").exists()


# The evaluation's scorers of the small run: 3 prompts, 2 per batch, a 4-step ODE.
EVAL = ["eval.num_steps=4", "eval.batch_size=2", "eval.num_prompts=3"]
LOCAL = "jpeg_compressibility"  # a local scorer beside the served one
UNREACHABLE_JUDGE = "+eval.scorers.judge={base_url: 'http://127.0.0.1:9/v1', model: judge, timeout_s: 1, retries: 0}"


@pytest.mark.parametrize("command", ["train", "train.eval"])
def test_an_unreachable_served_eval_scorer_is_one_line_before_the_model_loads(command, trained, launch, tmp_path,
                                                                             monkeypatch):  # fmt: skip
    """A judge among eval.scorers that nothing answers: the trainer built it after the resume and the model, and
    train.eval after the backbone, each failing with a traceback; now one line, status 2, no model loaded, and the
    run resumed (or evaluated) left as it was."""
    monkeypatch.setattr(builder, "load_backbone", lambda *args, **kwargs: pytest.fail("the model loaded"))
    run_dir = copy_run(trained, tmp_path)
    if command == "train":
        overrides = ["num_steps=3", "resume=auto", "eval.every=1", *EVAL, UNREACHABLE_JUDGE]
        line = refused_line(launch, run_dir, *overrides, kept=run_dir)
    else:
        weights = f"eval.transformer={run_dir / 'checkpoints' / 'step_00000002'}"
        line = refused_line(launch, tmp_path / "eval", weights, *EVAL, UNREACHABLE_JUDGE, module=eval_command,
                            kept=run_dir)  # fmt: skip
        assert not list((tmp_path / "eval").glob("eval_*"))
    assert line.endswith(
        "eval.scorers.judge: judge 'judge' at http://127.0.0.1:9/v1 is unreachable (ConnectError) at start-up: start "
        "it, or check base_url"
    ), line


@pytest.mark.parametrize("command", ["train", "train.eval"])
def test_a_served_eval_scorer_that_would_outlast_dist_timeout_is_one_line(command, launch, tmp_path, monkeypatch):
    """A judge among eval.scorers whose request to a server that never answers takes (2 x 2 + 1) x 100 s = 500 s,
    dist.timeout_s=300: the other ranks, waiting for this rank's scores in the evaluation's collectives, would end
    the run. The reward's terms were checked against dist.timeout_s, the evaluation's scorers were not: now one line
    naming eval.scorers.judge, status 2, before the model loads and before any server is asked."""
    monkeypatch.setattr(builder, "load_backbone", lambda *args, **kwargs: pytest.fail("the model loaded"))
    judge = "+eval.scorers.judge={base_url: 'http://127.0.0.1:9/v1', model: judge, timeout_s: 100, retries: 2}"
    overrides = [*EVAL, judge, "dist.timeout_s=300"]
    if command == "train":
        line = refused_line(launch, tmp_path / "run", "eval.every=1", *overrides)
    else:
        line = refused_line(launch, tmp_path / "eval", *overrides, module=eval_command)
    assert line.endswith(
        "eval.scorers.judge: a request its server does not answer takes up to 500 s ((2 x retries + 1) x timeout_s "
        "with retries=2, timeout_s=100), not below dist.timeout_s=300, so the other ranks' wait for this rank's "
        "scores would end the run: lower eval.scorers.judge.timeout_s or eval.scorers.judge.retries, or raise "
        "dist.timeout_s"
    ), line
    assert not (tmp_path / "run").exists() and not (tmp_path / "eval").exists()


SCORER_FAULTS = {"non-json": r"it failed: reward server \S+ answered non-JSON", "unavailable": r"its server could not"}


@pytest.mark.parametrize("case", list(SCORER_FAULTS))
def test_a_served_eval_scorer_that_fails_mid_run_is_left_out_of_that_evaluation(case, launch, tmp_path):
    """A reward server among eval.scorers answers at start-up, then not (non-JSON; 503 on its only try) in the
    evaluation before training: it is left out of that evaluation in one line, the other scorer kept, and the
    last evaluation scores it again; the run ends with status 0 (it ended with a traceback: summarize's ValueError
    on the NaN, or the protocol error; then the end summary's pairing of step 0 and step 1)."""
    pytest.importorskip("fastapi")
    from fastapi.responses import JSONResponse, PlainTextResponse
    from reward_servers import FAKE, fake_server, serve

    def good(count):
        return {"scores": [0.25] * count, **FAKE}

    fault = PlainTextResponse("Bad Gateway") if case == "non-json" else JSONResponse({}, status_code=503)
    with serve(fake_server(fault, good)) as url:
        scorers = [f"+eval.scorers.remote={{url: '{url}', timeout_s: 10, retries: 0}}", f"+eval.scorers.{LOCAL}={{}}"]
        status, stderr = launch(tmp_path / "run", "num_steps=1", "eval.every=1", *EVAL, *scorers)
    assert status == 0 and "Traceback" not in stderr, stderr
    log = (tmp_path / "run" / "__main__.log").read_text()
    left_out = [line for line in log.splitlines() if "eval.scorers.remote is left out" in line]
    assert len(left_out) == 1 and re.search(
        r"eval\.scorers\.remote is left out of the evaluation step_00000000 \(the other scorers are kept, the next "
        rf"evaluation asks it again\): {SCORER_FAULTS[case]}",
        left_out[0],
    ), log
    rows = {row["step"]: row for row in metrics(tmp_path / "run") if any(key.startswith("eval/") for key in row)}
    assert f"eval/{LOCAL}" in rows[0] and "eval/remote" not in rows[0]
    assert rows[1][f"eval/{LOCAL}"] and rows[1]["eval/remote"] == pytest.approx(0.25)


@pytest.mark.slow
def test_a_served_eval_scorer_that_fails_on_both_of_two_ranks_is_left_out_on_each(tiny_flux_dir, tmp_path):
    """Two ranks (gloo) share a reward server among eval.scorers that answers their first requests, the evaluation
    before training's, with non-JSON: each rank leaves it out of that evaluation in one line of its own, goes on
    with the local scorer, and the ranks agree (no hang, both exit 0); the last evaluation scores it again. The
    run's log holds rank 0's line, rank 1's is on its own output."""
    pytest.importorskip("fastapi")
    from fastapi.responses import PlainTextResponse
    from reward_servers import FAKE, fake_server, serve
    from two_ranks import run_ranks

    bad = PlainTextResponse("Bad Gateway")
    with serve(fake_server(bad, bad, lambda count: {"scores": [0.25] * count, **FAKE})) as url:
        scorers = [f"+eval.scorers.remote={{url: '{url}', timeout_s: 10, retries: 0}}", f"+eval.scorers.{LOCAL}={{}}"]
        run_dir = tmp_path / "run"
        args = [*FAST, f"model.path={tiny_flux_dir}", "num_steps=1", "eval.every=1", *EVAL, *scorers]
        ranks = run_ranks("-m", "train", *args, "dist.timeout_s=120", f"hydra.run.dir={run_dir}", timeout=300)
    assert [rank.returncode for rank in ranks] == [0, 0], [rank.stderr[-2000:] for rank in ranks]
    left_out = re.compile(
        r"eval\.scorers\.remote is left out of the evaluation step_00000000 \(the other scorers are kept, the next "
        rf"evaluation asks it again\): {SCORER_FAULTS['non-json']}"
    )
    log = (run_dir / "__main__.log").read_text()
    for output in (log, ranks[1].stdout):  # one line each: rank 0's in the run's log, rank 1's on its own output
        lines = [line for line in output.splitlines() if "eval.scorers.remote is left out" in line]
        assert len(lines) == 1 and left_out.search(lines[0]), output
    rows = {row["step"]: row for row in metrics(run_dir) if any(key.startswith("eval/") for key in row)}
    assert f"eval/{LOCAL}" in rows[0] and "eval/remote" not in rows[0]
    assert rows[1][f"eval/{LOCAL}"] and rows[1]["eval/remote"] == pytest.approx(0.25)
    scored = [json.loads(line) for line in (run_dir / "eval" / "step_00000000.scores.jsonl").read_text().splitlines()]
    assert len(scored) == 3 and all(LOCAL in row and "remote" not in row for row in scored), scored


def test_train_eval_with_its_only_served_scorer_failing_is_one_line(launch, tmp_path):
    """train.eval of the pretrained model whose one scorer, a reward server, answers /score with 503: one line,
    status 2, nothing written (it was summarize's ValueError on the NaN scores)."""
    pytest.importorskip("fastapi")
    from fastapi.responses import JSONResponse
    from reward_servers import fake_server, serve

    with serve(fake_server(JSONResponse({}, status_code=503))) as url:
        remote = f"+eval.scorers.remote={{url: '{url}', timeout_s: 10, retries: 0}}"
        line = refused_line(launch, tmp_path / "eval", *EVAL, remote, module=eval_command)
    assert line.endswith(
        "eval.scorers: none of remote could score the evaluation eval_pretrained (the lines above say why), so "
        "nothing was written: run it again once its server answers"
    ), line
    assert not list((tmp_path / "eval").glob("eval_*"))


@pytest.mark.slow
def test_a_reward_server_one_rank_cannot_reach_stops_both_ranks_each_with_its_line(tiny_flux_dir, tmp_path):
    """Two ranks (gloo), the reward server reachable from rank 0 only (rank 1's url, 127.0.1.1, has no server): rank
    1 stopped alone with no line and rank 0 lost its peer in the next collective; now both exit 2 in seconds, rank 1
    with its own line, rank 0 with the line naming rank 1's, no traceback, and no run folder is left."""
    pytest.importorskip("fastapi")
    from reward_servers import FAKE, fake_server, serve
    from two_ranks import run_ranks

    with serve(fake_server({"scores": [0.5, 0.5], **FAKE})) as url:
        port = url.rsplit(":", 1)[1]
        remote = f"+reward.components.remote={{url: 'http://127.0.${{oc.env:RANK}}.1:{port}', retries: 0}}"
        run_dir = tmp_path / "run"
        args = [*FAST, f"model.path={tiny_flux_dir}", remote, "dist.timeout_s=600", f"hydra.run.dir={run_dir}"]
        ranks = run_ranks("-m", "train", *args, timeout=300)  # a rank waiting in a collective would wait 600 s
    assert [rank.returncode for rank in ranks] == [2, 2], [rank.stderr[-2000:] for rank in ranks]
    own = f"reward.components.remote: reward server http://127.0.1.1:{port} "
    assert the_error(ranks[0].stderr).startswith("python -m train: error: rank 1: " + own), ranks[0].stderr
    assert "Traceback" not in ranks[1].stderr, ranks[1].stderr
    (line,) = [x for x in ranks[1].stderr.splitlines() if "error:" in x]
    assert line.startswith("[rank 1] python -m train: error: " + own), line
    assert not run_dir.exists()


# A served term that never answers, in a rollout of HUNG_CHUNKS chunks (reward.chunk_groups=1): each try's deadline
# and the tries after the first. One request's bound, request_bound_s = (2 x retries + 1) x timeout_s = 6 s (a hung
# request takes 2 + 0.5 + 2 s); a request per chunk took HUNG_CHUNKS x 4.5 s, at least 8 x 2 tries x 2 s = 32 s.
HUNG_TIMEOUT_S, HUNG_RETRIES, HUNG_CHUNKS = 2, 1, 8
HUNG_RUN = ["num_steps=1", f"batch.prompts_per_rank={HUNG_CHUNKS}", "reward.chunk_groups=1", "checkpoint.every=5"]
HUNG_TRIES = f"timeout_s: {HUNG_TIMEOUT_S}, retries: {HUNG_RETRIES}"
JUDGE_MODELS = {"object": "list", "data": [{"id": "judge", "object": "model"}]}  # what a judge's /v1/models lists
NONE_COULD_LEARN = "health.max_bad_steps: none of steps 0 to 0 could change the weights"  # the one step skipped


def assert_step_within_one_request(row: dict) -> None:
    """The logged step (a metrics row), its update skipped, waited for its served term beyond its rollout less than
    one request's bound and a margin of one more (the decode, the local scores, a loaded machine): far below the
    wait of a request per chunk, whose lower bound is checked to be over twice that limit."""
    limit = 2 * request_bound_s(HUNG_TIMEOUT_S, HUNG_RETRIES)
    assert HUNG_CHUNKS * (HUNG_RETRIES + 1) * HUNG_TIMEOUT_S > 2 * limit  # the test tells the two apart
    assert row["train/skipped_nan_reward"] == 1.0 and row["time/step"] - row["time/rollout"] < limit, row


@pytest.mark.slow
def test_a_hung_judge_holds_a_chunked_step_for_one_request_not_one_per_chunk(launch, tmp_path):
    """reward=judge's component against a judge that answers /v1/models and never a chat request, the rollout in
    8 chunks of one group (reward.chunk_groups=1, as docs/rewards.md suggests with a served reward): the first
    chunk's request runs out of its tries, the term fails for the step, its later chunks are never requested, and
    the step (skipped: its reward is NaN) ends one request after its rollout. Before, the term's one worker
    took the next queued chunk as soon as one failed, before the step's wait could cancel it: every chunk went
    through all its tries (measured: 36 s beyond the rollout, 32 POSTs, "scores NaN" 8 times), which fails each
    of the three assertions below."""
    from reward_servers import hung_server

    with hung_server(JUDGE_MODELS) as (url, posted):
        judge = f"+reward.components.judge={{base_url: '{url}/v1', model: judge, {HUNG_TRIES}}}"
        line = refused_line(launch, tmp_path / "run", *HUNG_RUN, judge)
    assert line.startswith(f"python -m train: error: {NONE_COULD_LEARN}"), line
    assert_step_within_one_request(metrics(tmp_path / "run")[0])
    group_size = 2  # SMALL_RUN's grpo.group_size: the images of one chunk, each its own request
    assert len(posted) <= group_size * (HUNG_RETRIES + 1), posted
    log = (tmp_path / "run" / "__main__.log").read_text()
    assert log.count("scores NaN") == 1, log


@pytest.mark.slow
def test_a_reward_server_hung_for_one_of_two_ranks_holds_the_step_for_one_request(tiny_flux_dir, tmp_path):
    """Two ranks (gloo), each with its own reward server at the same port (rank 0's at 127.0.0.1 answers, rank 1's at
    127.0.1.1 never answers /score), the rollout in 8 chunks: rank 1's term fails after its first chunk's tries,
    the ranks agree to skip the step, and rank 0, which waited for rank 1 in the step's all-reduce, logs a step
    one request longer than its rollout. Before, rank 1 requested every chunk through all its tries and rank 0
    waited the 36 s with it (a dist.timeout_s below that ended the run)."""
    pytest.importorskip("fastapi")
    from reward_servers import FAKE, fake_server, hung_server, serve
    from two_ranks import run_ranks

    with hung_server(FAKE, host="127.0.1.1") as (hung, posted):
        port = int(hung.rsplit(":", 1)[1])
        with serve(fake_server(lambda count: {"scores": [0.5] * count, **FAKE}), port=port):
            url = f"http://127.0.${{oc.env:RANK}}.1:{port}"
            remote = f"+reward.components.remote={{url: '{url}', {HUNG_TRIES}}}"
            run_dir = tmp_path / "run"
            args = [*FAST, *HUNG_RUN, f"model.path={tiny_flux_dir}", remote, f"hydra.run.dir={run_dir}"]
            ranks = run_ranks("-m", "train", *args, timeout=300)
    assert [rank.returncode for rank in ranks] == [2, 2], [rank.stderr[-2000:] for rank in ranks]
    assert NONE_COULD_LEARN in the_error(ranks[0].stderr), ranks[0].stderr
    assert_step_within_one_request(metrics(run_dir)[0])
    assert len(posted) == HUNG_RETRIES + 1, posted  # one request per chunk, a batch each: the first chunk's tries
