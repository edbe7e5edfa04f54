"""RunLogger (JSONL, sample grids, wandb offline and wandb failures), the console lines, PhaseTimer."""

from __future__ import annotations

import json
import logging
import os
import time
import warnings

import numpy as np
import pytest
import torch
import wandb
from PIL import Image

from train.ground.layout import RunLayout
from train.loop.epilogue import files_section
from train.parts.config.schema import TrainConfig
from train.parts.observe.console import Heartbeat, format_seconds, progress_bar
from train.parts.observe.grid import MIN_TILE, image_grid
from train.parts.observe.logger import RunLogger
from train.parts.observe.observe_config import LoggingConfig
from train.parts.observe.perf import PhaseTimer


def run_logger(run_dir, *, is_main: bool = True, config: dict | None = None, **logging) -> RunLogger:
    """The RunLogger of ``run_dir`` with the settings ``logging`` (LoggingConfig's fields)."""
    return RunLogger(LoggingConfig(**logging), RunLayout(run_dir), is_main=is_main, config=config)


def read_lines(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_jsonl_has_one_flushed_line_per_call(tmp_path) -> None:
    logger = run_logger(tmp_path)
    logger.log({"loss": torch.tensor(0.25), "reward/hps": 0.5, "count/grad_forwards": 4}, step=1)
    # flushed at once: readable before finish()
    assert read_lines(tmp_path)[0]["loss"] == 0.25
    logger.log({"loss": torch.tensor([1.5], dtype=torch.bfloat16)}, step=2)
    logger.finish()
    first, second = read_lines(tmp_path)
    assert {k: first[k] for k in ("step", "loss", "reward/hps", "count/grad_forwards")} == {
        "step": 1,
        "loss": 0.25,
        "reward/hps": 0.5,
        "count/grad_forwards": 4.0,
    }
    assert isinstance(first["count/grad_forwards"], float) and first["wall_time"] >= 0
    assert (second["step"], second["loss"]) == (2, 1.5)


def test_rejects_non_scalar_metrics_and_unknown_mode(tmp_path) -> None:
    logger = run_logger(tmp_path)
    with pytest.raises(ValueError, match="'rewards'"):
        logger.log({"rewards": torch.zeros(3)}, step=0)
    with pytest.raises(ValueError, match="wandb_mode"):
        LoggingConfig(wandb_mode="cloud")


def test_off_rank_zero_nothing_is_written(tmp_path, monkeypatch) -> None:
    def must_not_run(**kwargs):
        raise AssertionError("wandb.init called off rank 0")

    monkeypatch.setattr(wandb, "init", must_not_run)
    run_dir = tmp_path / "run"
    logger = run_logger(run_dir, is_main=False, wandb_mode="offline")
    logger.log({"loss": 1.0}, step=0)
    assert logger.log_images("samples", torch.rand(1, 3, 4, 4), ["a"], step=0) is None
    logger.finish()
    assert not run_dir.exists()


def test_log_images_writes_a_captioned_upscaled_grid(tmp_path) -> None:
    logger = run_logger(tmp_path)
    images = torch.zeros(4, 3, 8, 8)
    images[1] = 1.0  # second image white
    images[2] = 0.5  # the one below the first grey
    captions = ["a cat", "a dog", "x", "y"]
    path = logger.log_images("train/samples", images, captions, step=7, scores=[0.5, 0.25, 1.0, 0.0])
    assert path == tmp_path / "samples" / "train_samples_00000007.png"
    grid = np.asarray(Image.open(path).convert("L"))
    # 8 px images are upscaled 16x (nearest neighbour) to MIN_TILE = 128 px tiles, 2 per row, 2 px gaps
    assert grid.shape[1] == 2 * (MIN_TILE + 2) + 2
    rows = np.nonzero((grid[:, 2 : 2 + MIN_TILE] == 0).all(axis=1))[0]  # the rows crossing the black first tile
    assert len(rows) == MIN_TILE and rows[-1] - rows[0] == MIN_TILE - 1
    assert (grid[rows[0] : rows[-1] + 1, 4 + MIN_TILE : 4 + 2 * MIN_TILE] == 255).all()  # the white second tile
    label = grid[rows[-1] + 1 : rows[-1] + 30, 2 : 2 + MIN_TILE]
    assert (label < 128).any() and (label == 255).any()  # text on white under the image
    lines = path.with_suffix(".txt").read_text().splitlines()
    assert lines == ["index\treward\tcaption", "0\t0.5000\ta cat", "1\t0.2500\ta dog", "2\t1.0000\tx", "3\t0.0000\ty"]
    with pytest.raises(ValueError, match="captions"):
        logger.log_images("s", images, ["only one"], step=8)


def test_labelled_grid_cuts_long_captions() -> None:
    caption = "#3 0.5000\n" + "word " * 60
    grids = [
        np.asarray(image_grid(torch.ones(1, 3, 8, 8), labels=[caption], min_tile=MIN_TILE, label_lines=n).convert("L"))
        for n in (3, 4)
    ]
    labels = [grid[2 + MIN_TILE :] for grid in grids]  # the label strips under the white tile
    assert all((label[:, 2 + MIN_TILE :] == 255).all() for label in labels)  # no text past the tile's width
    line_height = labels[1].shape[0] - labels[0].shape[0]  # one line more, one line height taller
    for label, count in zip(labels, (3, 4)):
        bands = [label[k * line_height : (k + 1) * line_height] for k in range(count)]
        assert all((band < 128).any() for band in bands)  # the caption fills every line it is given
        assert (label[count * line_height :] == 255).all()  # and none past them


def test_image_grid_layout() -> None:
    images = torch.zeros(5, 3, 8, 8)
    images[4] = 1.0
    images[1, 0] = 1.0  # second image pure red
    grid = image_grid(images, nrow=3)
    # make_grid: 3 columns x 2 rows of 8 px cells with 2 px white gaps around every cell.
    assert grid.size == (3 * 10 + 2, 2 * 10 + 2) and grid.mode == "RGB"
    assert grid.getpixel((2 + 10 + 4, 2 + 4)) == (255, 0, 0)
    assert grid.getpixel((2 + 4, 2 + 4)) == (0, 0, 0)
    assert grid.getpixel((2 + 20 + 4, 12 + 4)) == (255, 255, 255)  # the empty sixth cell is padding


def test_image_grid_checks_layout() -> None:
    assert image_grid(torch.rand(3, 3, 4, 4), nrow=3).size == (3 * 4 + 4 * 2, 4 + 2 * 2)
    with pytest.raises(ValueError, match=r"\[B, 3, H, W\]"):
        image_grid(torch.rand(3, 4, 4))


def test_wandb_init_failure_warns_once_and_training_goes_on(tmp_path, monkeypatch) -> None:
    def broken_init(**kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(wandb, "init", broken_init)
    with pytest.warns(RuntimeWarning, match="no network"):
        logger = run_logger(tmp_path, wandb_mode="online", project="p", config={"a": 1})
    assert wandb.run is None  # wandb's own state: no run was started
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no further warning
        logger.log({"loss": 1.0}, step=1)
        logger.finish()
    assert read_lines(tmp_path)[0]["loss"] == 1.0


class BrokenRun:
    def __init__(self) -> None:
        self.log_calls = 0

    def log(self, *args, **kwargs) -> None:
        self.log_calls += 1
        raise OSError("disk full")

    def finish(self) -> None:
        raise AssertionError("a failed run is not used again")


def test_wandb_log_failure_disables_wandb_for_the_run(tmp_path, monkeypatch) -> None:
    run = BrokenRun()
    monkeypatch.setattr(wandb, "init", lambda **kwargs: run)
    logger = run_logger(tmp_path, wandb_mode="offline")
    with pytest.warns(RuntimeWarning, match="disk full"):
        logger.log({"loss": 1.0}, step=1)
    logger.log({"loss": 2.0}, step=2)
    logger.log_images("samples", torch.rand(1, 3, 4, 4), ["a"], step=2)
    logger.finish()
    assert run.log_calls == 1  # the first log reached the run; after its failure nothing did
    assert [line["loss"] for line in read_lines(tmp_path)] == [1.0, 2.0]


def test_wandb_offline_writes_into_run_dir(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("WANDB_SILENT", raising=False)  # restored after the test
    monkeypatch.delenv("WANDB_DIR", raising=False)
    logger = run_logger(
        tmp_path, wandb_mode="offline", project="p", group="exp", name="jagg-s0", tags=["jagg", "seed0"]
    )
    assert wandb.run is not None  # wandb's own state: the run the logger started
    sheet = tmp_path / "sheet.png"
    image_grid(torch.rand(2, 3, 4, 4)).save(sheet)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a wandb failure warns: none may happen
        logger.log({"loss": 0.5}, step=1)
        logger.log_images("samples", torch.rand(2, 3, 4, 4), ["a", "b"], step=1, scores=[0.1, 0.2])
        logger.log_wandb_images("eval/images", torch.rand(2, 3, 4, 4), ["#0 0.1: a", "#1 0.2: b"], step=1)
        logger.log_wandb_images("eval/before_after", sheet, ["step 0 | step 1"], step=1)
    assert wandb.run is not None  # no call failed, so the logger kept the run
    logger.finish()
    assert wandb.run is None
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    assert len(list(runs[0].glob("files/media/images/**/*.png"))) == 5  # 2 samples, 2 eval images, 1 sheet
    assert os.environ["WANDB_SILENT"] == "true"
    # the end-of-run summary says how to upload it
    cfg = TrainConfig()
    cfg.run_dir = str(tmp_path)
    assert f"upload it later: wandb sync {runs[0]}" in "\n".join(files_section(cfg, "offline"))


def test_a_later_session_continues_the_wandb_run_and_the_wall_clock(tmp_path, monkeypatch) -> None:
    """A resumed run (a new RunLogger on the same folder) keeps its wandb run id, so offline runs sync
    into one wandb run, and its wall_time goes on from the last record instead of restarting at 0."""
    monkeypatch.delenv("WANDB_DIR", raising=False)
    first = run_logger(tmp_path, wandb_mode="offline", project="p", entity="team", notes="why")
    first.log({"loss": 1.0}, step=0)
    first.finish()
    run_id = RunLayout(tmp_path).wandb_run_id.read_text().strip()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    (tmp_path / "metrics.jsonl").write_text("\n".join([*lines, '{"step": 1, "wall_time": 100.0}', '{"step": 2, "wa']))
    second = run_logger(tmp_path, wandb_mode="offline", project="p")
    second.log({"loss": 2.0}, step=2)
    second.finish()
    assert RunLayout(tmp_path).wandb_run_id.read_text().strip() == run_id
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(f"-{run_id}" in r.name for r in runs)  # offline-run-<time>-<id>[-1]
    assert read_lines_tolerant(tmp_path)[-1]["wall_time"] >= 100.0  # the cut line is skipped


def read_lines_tolerant(run_dir) -> list[dict]:
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def test_metrics_file_is_created_by_the_first_record(tmp_path) -> None:
    logger = run_logger(tmp_path)
    logger.finish()
    assert not (tmp_path / "metrics.jsonl").exists()  # a tool that logs nothing leaves no empty file
    with pytest.raises(RuntimeError, match="after finish"):
        logger.log({"loss": 1.0}, step=0)


def test_heartbeat_lines(caplog) -> None:
    caplog.set_level(logging.INFO)
    beat = Heartbeat(LoggingConfig(heartbeat_s=3600), 4, start=1, enabled=True)
    for done, reward in ((2, 0.5), (3, float("nan")), (4, 0.25)):
        beat.tick(done, reward)
    lines = [r.getMessage() for r in caplog.records]
    # the first step and the last are always shown; in between only every heartbeat_s seconds
    assert len(lines) == 2 and lines[0].startswith("step 2/4  reward 0.5000") and "eta" in lines[0]
    assert lines[1].startswith("step 4/4  reward 0.2500")
    Heartbeat(LoggingConfig(heartbeat_s=0), 4, start=0, enabled=False).tick(1, 0.0)
    assert len(caplog.records) == 2
    assert (format_seconds(42), format_seconds(185), format_seconds(7440)) == ("42.0s", "3m05s", "2h04m")


def test_phase_timer_accumulates_and_resets() -> None:
    timer = PhaseTimer()
    for _ in range(2):
        with timer.phase("rollout"):
            time.sleep(0.01)
    with timer.phase("reward"):
        pass
    times = timer.pop()
    assert set(times) == {"time/rollout", "time/reward"}
    assert 0.02 <= times["time/rollout"] < 1.0
    assert times["time/reward"] < times["time/rollout"]
    assert timer.pop() == {}
    with pytest.raises(KeyError), timer.phase("update"):
        raise KeyError("failed step")
    assert "time/update" in timer.pop()  # time of a failed phase is still counted


def test_progress_bar_only_on_rank_zero() -> None:
    assert progress_bar(10, is_main=False).disable
    bar = progress_bar(10, is_main=True, initial=3)
    assert not bar.disable and bar.n == 3
    bar.close()


def test_rewind_drops_the_rows_a_resumed_run_replays(tmp_path) -> None:
    """Resumed at step 2: training rows of steps >= 2 go, the evaluation after 2 steps stays (it was logged
    before the checkpoint of step 2), and a line cut short by a crash goes; resumed at 0 everything goes."""
    logger = run_logger(tmp_path)
    for step, metrics in [(0, {"eval/r": 1}), (0, {"loss": 1}), (1, {"loss": 2}), (2, {"eval/r": 3}), (2, {"loss": 4})]:
        logger.log(metrics, step)
    with (tmp_path / "metrics.jsonl").open("a", encoding="utf-8") as file:
        file.write('{"step": 3, "lo')  # the crash: a line cut short
    assert logger.rewind(2) == 2
    logger.log({"loss": 5}, 2)
    logger.finish()
    assert [(row["step"], row.get("loss")) for row in read_lines(tmp_path)] == [
        (0, None),
        (0, 1),
        (1, 2),
        (2, None),
        (2, 5),
    ]
    again = run_logger(tmp_path)
    assert again.rewind(0) == 5 and read_lines(tmp_path) == []
    again.finish()
    assert run_logger(tmp_path, is_main=False).rewind(0) == 0
