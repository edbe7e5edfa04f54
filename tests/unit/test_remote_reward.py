"""The remote reward against scripts/reward_server.py and hand-made servers, all on 127.0.0.1."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import math
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
import uvicorn  # noqa: E402
from fastapi import FastAPI  # noqa: E402

from rewards.base import build_scorer  # noqa: E402
from rewards.remote import TOKEN_ENV, RemoteRewardError, RemoteScorer, RemoteUnavailable  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "reward_server.py"
PROMPTS = ["a cat", "a dog", "a red car"]


def _server_module():
    spec = importlib.util.spec_from_file_location("reward_server", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    """``app`` on a free 127.0.0.1 port in a thread; yields its URL and stops it on exit."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "the test server did not start within 10 s"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@contextmanager
def warnings_of_remote() -> Iterator[list[str]]:
    """The warning lines rewards.remote logs inside the block (without pytest's logging plugin)."""
    lines: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("rewards.remote")
    logger.addHandler(handler)
    try:
        yield lines
    finally:
        logger.removeHandler(handler)


def _images(seed: int = 0) -> torch.Tensor:
    """Images on the uint8 grid, so the wire's quantisation loses nothing."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (3, 3, 24, 32), generator=g).float() / 255


def _free_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


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
    with warnings_of_remote() as lines:
        scores = scorer(_images(), PROMPTS)
    assert scores.shape == (3,) and all(math.isnan(s) for s in scores.tolist())  # a NaN reward: the step skips
    assert len(lines) == 1 and f"reward server {url} is unreachable" in lines[0] and "after 2 tries" in lines[0]


def _fake(answer: object, *, delay_s: float = 0.0) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    def health() -> dict:
        return {"scorer": "fake"}

    @app.post("/score")
    async def score() -> object:
        await asyncio.sleep(delay_s)
        return answer

    return app


@pytest.mark.parametrize(
    "answer, message",
    [
        ({"scores": [1.0, 2.0]}, "returned 2 scores for 3 images"),
        ({"scores": [1.0, "high", 2.0]}, "returned a non-number score 'high'"),
        ({"scores": [1.0, None, 2.0]}, "returned a non-number score None"),
        ({"score": [1.0, 2.0, 3.0]}, "answered without a 'scores' list"),
    ],
)
def test_answers_outside_the_protocol_stop_the_run(answer, message):
    with serve(_fake(answer)) as url:
        with pytest.raises(RemoteRewardError, match=f"reward server {url} {message}".replace("(", r"\(")):
            RemoteScorer(url, timeout_s=5, retries=0)(_images(), PROMPTS)


def test_a_slow_answer_past_timeout_s():
    with serve(_fake({"scores": [1.0, 2.0, 3.0]}, delay_s=1.5)) as url:
        scorer = RemoteScorer(url, timeout_s=0.3, retries=0)
        with pytest.raises(RemoteUnavailable, match=f"reward server {url} did not answer within timeout_s=0.3"):
            scorer._post({"prompts": PROMPTS}, 3)
        with warnings_of_remote() as lines:
            assert scorer(_images(), PROMPTS).isnan().all()
    assert "did not answer within timeout_s=0.3" in lines[0]


def test_token_from_the_environment_is_checked(monkeypatch):
    app = _server_module().make_app(build_scorer("jpeg_compressibility"), max_bytes=2**20, token="s3cret")
    with serve(app) as url:
        monkeypatch.delenv(TOKEN_ENV, raising=False)
        with pytest.raises(RemoteRewardError, match=f"refused the request: 401.*{TOKEN_ENV}"):
            RemoteScorer(url, timeout_s=5, retries=0)
        monkeypatch.setenv(TOKEN_ENV, "s3cret")
        assert RemoteScorer(url, timeout_s=5, retries=0)(_images(), PROMPTS).isfinite().all()


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
