"""The remote reward against scripts/reward_server.py and hand-made servers, all on 127.0.0.1."""

from __future__ import annotations

import importlib.util
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
from fastapi import FastAPI  # noqa: E402
from fastapi.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response  # noqa: E402
from reward_servers import FAKE, dripping_server, fake_server, serve, silent_server, warnings_of  # noqa: E402
from two_ranks import free_port  # noqa: E402

from rewards.base import build_scorer  # noqa: E402
from rewards.remote import TOKEN_ENV, RemoteRewardError, RemoteScorer  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "reward_server.py"
PROMPTS = ["a cat", "a dog", "a red car"]


def _server_module():
    spec = importlib.util.spec_from_file_location("reward_server", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _images(seed: int = 0) -> torch.Tensor:
    """Images on the uint8 grid, so the wire's quantisation loses nothing."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (3, 3, 24, 32), generator=g).float() / 255


def _free_port_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


@pytest.fixture(scope="module")
def jpeg_app():
    return _server_module().make_app(build_scorer("jpeg_compressibility"), max_bytes=2**20, token=None)


def test_remote_scores_equal_local_ones(jpeg_app):
    images = _images()
    local = build_scorer("jpeg_compressibility")(images, PROMPTS)
    with serve(jpeg_app) as url:
        remote = RemoteScorer(url, timeout_s=10, retries=0)(images, PROMPTS)
    assert torch.equal(remote, local)


def test_server_down_at_start_up_names_the_url():
    url = _free_port_url()
    with pytest.raises(RemoteRewardError, match=f"reward server {url} is unreachable"):
        RemoteScorer(url, timeout_s=2, retries=0)


def test_server_that_dies_mid_run_is_retried_then_the_step_skips(jpeg_app):
    with serve(jpeg_app) as url:
        scorer = RemoteScorer(url, timeout_s=2, retries=1)
    with warnings_of("rewards.remote") as lines:
        scores = scorer(_images(), PROMPTS)
    assert scores.shape == (3,) and all(math.isnan(s) for s in scores.tolist())  # a NaN reward: the step skips
    assert len(lines) == 1 and f"reward server {url} is unreachable" in lines[0] and "after 2 tries" in lines[0]


OUTSIDE_THE_PROTOCOL = {
    "wrong-count": ({"scores": [1.0, 2.0], **FAKE}, "returned 2 scores for 3 images"),
    "a-string-score": ({"scores": [1.0, "high", 2.0], **FAKE}, "returned a non-number score 'high'"),
    "a-null-score": ({"scores": [1.0, None, 2.0], **FAKE}, "returned a non-number score None"),
    "nested-lists": ({"scores": [[1.0], [2.0], [3.0]], **FAKE}, r"returned a non-number score \[1\.0\]"),
    "scores-a-string": ({"scores": "1 2 3", **FAKE}, "answered without a 'scores' list"),
    "no-scores": ({"score": [1.0, 2.0, 3.0], **FAKE}, "answered without a 'scores' list"),
    "a-bare-list": ([1.0, 2.0, 3.0], "answered without naming its scorer"),
    "no-scorer-name": ({"scores": [1.0, 2.0, 3.0]}, "answered without naming its scorer"),
    "another-scorer": (
        {"scores": [1.0, 2.0, 3.0], "scorer": "pickscore"},
        r"now scores with pickscore\(\), not fake\(\)",
    ),
    "non-json": (PlainTextResponse("<html>proxy error</html>"), "answered non-JSON: '<html>proxy error</html>'"),
    "redirect": (RedirectResponse("/elsewhere", status_code=307), r"redirected the request \(307\) to /elsewhere"),
    "refused-mid-run": (
        JSONResponse({"detail": "bad token"}, status_code=401),
        f"refused the request: 401.*{TOKEN_ENV}",
    ),
}


@pytest.mark.parametrize("case", list(OUTSIDE_THE_PROTOCOL))
def test_answers_outside_the_protocol_stop_the_run(case):
    answer, message = OUTSIDE_THE_PROTOCOL[case]
    with serve(fake_server(answer)) as url:
        scorer = RemoteScorer(url, timeout_s=5, retries=0)
        with pytest.raises(RemoteRewardError, match=f"^reward server {url} {message}"):
            scorer(_images(), PROMPTS)


def test_a_slow_answer_past_timeout_s():
    with serve(fake_server({"scores": [1.0, 2.0, 3.0], **FAKE}, delay_s=1.5)) as url:
        scorer = RemoteScorer(url, timeout_s=0.3, retries=0)
        with warnings_of("rewards.remote") as lines:
            assert scorer(_images(), PROMPTS).isnan().all()
    assert len(lines) == 1 and f"reward server {url} did not answer POST /score within timeout_s=0.3" in lines[0]


def test_an_answer_sent_a_byte_at_a_time_fails_at_the_deadline_of_the_request():
    """Each byte comes well within timeout_s, the whole answer would take a minute: the request's deadline, not a
    read's, ends it, so the step ends (and a SIGTERM's checkpoint can come)."""
    with dripping_server() as url:
        scorer = RemoteScorer(url, timeout_s=1, retries=0)
        start = time.monotonic()
        with warnings_of("rewards.remote") as lines:
            scores = scorer(_images(), PROMPTS)
        elapsed = time.monotonic() - start
    assert scores.isnan().all() and elapsed < 5
    assert len(lines) == 1 and f"reward server {url} did not answer POST /score within timeout_s=1" in lines[0]


def test_a_server_that_accepts_connections_and_never_answers_is_not_called_unreachable():
    with silent_server() as url:
        start = time.monotonic()
        with pytest.raises(RemoteRewardError) as err:
            RemoteScorer(url, timeout_s=0.5, retries=0)
    assert time.monotonic() - start < 5
    assert str(err.value).startswith(f"reward server {url} did not answer GET /health within timeout_s=0.5 at start-up")
    assert "unreachable" not in str(err.value)


@pytest.mark.parametrize(
    "score, shown",
    [(10**400, "an integer of 401 digits"), (1e300, "1e[+]300"), (-(2**200), "an integer of 61 digits")],
    ids=["int-beyond-float64", "float-beyond-float32", "int-beyond-float32"],
)
def test_a_score_beyond_float32_is_one_line(score, shown):
    with serve(fake_server({"scores": [1.0, score, 2.0], **FAKE})) as url:
        scorer = RemoteScorer(url, timeout_s=5, retries=0)
        with pytest.raises(
            RemoteRewardError, match=rf"^reward server {url} returned a score beyond float32's range.*{shown}"
        ):
            scorer(_images(), PROMPTS)


def test_a_server_that_answers_429_is_retried_after_the_time_it_asks():
    busy = JSONResponse({"detail": "busy"}, status_code=429, headers={"Retry-After": "1"})
    with serve(fake_server(busy, {"scores": [1.0, 2.0, 3.0], **FAKE})) as url:
        scorer = RemoteScorer(url, timeout_s=5, retries=1)
        start = time.monotonic()
        assert scorer(_images(), PROMPTS).tolist() == [1.0, 2.0, 3.0]
    assert time.monotonic() - start >= 0.9  # the second try after the 1 s the server asked, not 0.5 s of back-off


def test_the_server_without_its_extra_installed_is_one_line(tmp_path):
    """scripts/reward_server.py run where FastAPI cannot be imported (a package that refuses to import stands in
    for the missing extra): one line naming the extra, status 2."""
    (tmp_path / "fastapi").mkdir()
    (tmp_path / "fastapi" / "__init__.py").write_text(
        "raise ImportError(\"No module named 'fastapi'\", name='fastapi')\n"
    )
    root = SCRIPT.parents[1]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{tmp_path}:{root}", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--scorer", "jpeg_compressibility"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stderr.splitlines() == [
        "reward_server.py: error: fastapi is not installed: the reward server needs the server extra, pip install -e "
        '".[server]" (FastAPI and uvicorn)'
    ], done.stderr


def test_a_server_restarted_with_another_scorer_is_not_used():
    """The scorer and its arguments read at start-up are checked on every answer: the same scorer restarted on the
    same port is used, another one (or other arguments) is refused."""
    module, port = _server_module(), free_port()
    jpeg = build_scorer("jpeg_compressibility", quality=80)
    with serve(module.make_app(jpeg, max_bytes=2**20, token=None, arguments={"quality": 80}), port=port) as url:
        scorer = RemoteScorer(url, timeout_s=5, retries=0)
    assert scorer.scorer == "jpeg_compressibility(quality=80)"
    with serve(module.make_app(jpeg, max_bytes=2**20, token=None, arguments={"quality": 80}), port=port):
        assert scorer(_images(), PROMPTS).isfinite().all()
    other = build_scorer("jpeg_compressibility", quality=50)
    with serve(module.make_app(other, max_bytes=2**20, token=None, arguments={"quality": 50}), port=port):
        with pytest.raises(RemoteRewardError, match=r"now scores with jpeg_compressibility\(quality=50\), not .*80\)"):
            scorer(_images(), PROMPTS)


@pytest.mark.parametrize(
    "status, message", [(503, "answered 503 at start-up"), (307, r"redirected the request \(307\)")]
)
def test_a_server_that_fails_its_health_check_is_one_line(status, message):
    app = FastAPI()

    @app.get("/health")
    def health() -> Response:
        return Response(status_code=status, headers={"location": "/elsewhere"})

    with serve(app) as url:
        with pytest.raises(RemoteRewardError, match=f"^reward server {url} {message}"):
            RemoteScorer(url, timeout_s=5, retries=0)


BAD_ARGUMENTS = {
    "ftp": ({"url": "ftp://127.0.0.1:8100"}, r"^url must start with http:// or https:// \(e\.g\. http://127"),
    "port": ({"url": "http://127.0.0.1:70000"}, r"^url must be http\(s\)://HOST\[:PORT\] with a port from 1 to 65535"),
    "no-host": ({"url": "http://:8100"}, r"^url must be http\(s\)://HOST\[:PORT\]"),
    "timeout_s-text": ({"timeout_s": "abc"}, r"^timeout_s must be a number of seconds > 0 .*, got 'abc'"),
    "timeout_s-zero": ({"timeout_s": 0}, r"^timeout_s must be a number of seconds > 0"),
    "retries-fraction": ({"retries": 1.5}, r"^retries must be a whole number >= 0 .*, got 1\.5"),
    "retries-negative": ({"retries": -1}, r"^retries must be a whole number >= 0"),
}


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_each_argument_is_checked_in_the_scorers_words(case):
    """A TypeError (timeout_s 'abc'), an OverflowError (a port beyond 65535) and a silent int(1.5) before: each a
    ValueError naming the argument, from the constructor and ``check_arguments`` alike, before any request."""
    change, message = BAD_ARGUMENTS[case]
    arguments = {"url": _free_port_url(), "timeout_s": 1.0, "retries": 0, **change}
    with pytest.raises(ValueError, match=message):
        RemoteScorer(**arguments)
    with pytest.raises(ValueError, match=message):
        RemoteScorer.check_arguments(arguments)


def test_token_from_the_environment_is_checked(monkeypatch):
    app = _server_module().make_app(build_scorer("jpeg_compressibility"), max_bytes=2**20, token="s3cret")
    with serve(app) as url:
        monkeypatch.delenv(TOKEN_ENV, raising=False)
        with pytest.raises(RemoteRewardError, match=f"refused the request: 401.*{TOKEN_ENV}"):
            RemoteScorer(url, timeout_s=5, retries=0)
        monkeypatch.setenv(TOKEN_ENV, "s3cret")
        assert RemoteScorer(url, timeout_s=5, retries=0)(_images(), PROMPTS).isfinite().all()
        monkeypatch.setenv(TOKEN_ENV, "s3cret\r")  # was "unreachable (LocalProtocolError)"
        with pytest.raises(ValueError, match=rf"^the key in the environment variable {TOKEN_ENV} holds '\\r' at its"):
            RemoteScorer(url, timeout_s=5, retries=0)


def test_requests_over_the_size_limit_are_refused():
    app = _server_module().make_app(build_scorer("jpeg_compressibility"), max_bytes=1000, token=None)
    with serve(app) as url:
        with pytest.raises(RemoteRewardError, match="413.*exceeds the server's limit of 1000"):
            RemoteScorer(url, timeout_s=5, retries=0)(_images(), PROMPTS)


def test_each_rank_sends_only_its_own_rows(jpeg_app):
    """The scorer sends exactly the batch it is given (a rank's own samples), nothing gathered."""
    images = _images(1)
    with serve(jpeg_app) as url:
        scorer = RemoteScorer(url, timeout_s=10, retries=0)
        first, second = scorer(images[:1], PROMPTS[:1]), scorer(images[1:], PROMPTS[1:])
    torch.testing.assert_close(torch.cat([first, second]), build_scorer("jpeg_compressibility")(images, PROMPTS))


def test_server_arguments_are_literals_or_strings():
    module = _server_module()
    assert module.arg_value("95") == 95 and module.arg_value("0.5") == 0.5
    assert module.arg_value("/ckpt/PickScore_v1") == "/ckpt/PickScore_v1"
    assert module.arg_value("flow_grpo") == "flow_grpo"
    scorer = module.load_scorer("jpeg_compressibility", None, {"quality": module.arg_value("80")}, "cpu")
    assert scorer.name == "jpeg_compressibility"


# (the server's arguments, what its one line must say): each names the option to fix, and nothing is served
SERVER_MISTAKES = {
    "unknown-argument": (["--arg", "qualty=5"], r"--arg: got an unexpected keyword argument 'qualty' \(its arguments"),
    "out-of-range": (["--arg", "quality=500"], r"--arg quality=500: quality must be in \[1, 95\]"),
    "not-key-value": (["--arg", "quality"], r"--arg must be KEY=VALUE, got 'quality'"),
    "port": (["--port", "99999"], r"--port must be in 1 to 65535, got 99999"),
    "port-not-a-number": (["--port", "x"], r"argument --port: invalid int value: 'x'"),
    "max-mb": (["--max-mb", "0"], r"--max-mb must be a number > 0, got 0\.0"),
    "device": (["--device", "banana"], r"--device 'banana' is not a device"),
}
SERVER_CLASS_MISTAKES = {
    "no-module": ("nomod:Scorer", r"--scorer-class 'nomod:Scorer': cannot import nomod"),
    "not-a-scorer": ("rewards.base:freeze", r"--scorer-class 'rewards\.base:freeze' is not a Scorer class"),
    "no-class": ("rewards.base", r"--scorer-class 'rewards\.base' must be module:Class"),
}


def _server_error(capsys, argv: list[str]) -> str:
    module = _server_module()
    module.uvicorn = None  # nothing may be served: an error must come first
    with pytest.raises(SystemExit) as stop:
        module.main(argv)
    stderr = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in stderr and len(stderr.splitlines()) == 1, stderr
    assert stderr.startswith("reward_server.py: error: "), stderr
    return stderr


@pytest.mark.parametrize("case", list(SERVER_MISTAKES))
def test_a_server_argument_mistake_is_one_line_naming_it(case, capsys):
    argv, message = SERVER_MISTAKES[case]
    assert re.search(message, _server_error(capsys, ["--scorer", "jpeg_compressibility", *argv]))


@pytest.mark.parametrize("case", list(SERVER_CLASS_MISTAKES))
def test_a_wrong_scorer_class_is_one_line_naming_it(case, capsys):
    class_path, message = SERVER_CLASS_MISTAKES[case]
    assert re.search(message, _server_error(capsys, ["--scorer-class", class_path]))
