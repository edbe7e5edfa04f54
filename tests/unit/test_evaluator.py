"""The trainer's Evaluator without a model: the protocol (``evaluate``) is replaced by one that returns
a made-up result and writes its files, so what is tested is what the Evaluator adds: its cadence,
the step-0 result kept in one session and read back from the run folder by a resumed one, the
console line and the before/after sheet against it."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import train.parts.eval.evaluator as evaluator_module
from train.distributed.collectives import DistInfo
from train.ground.layout import RunLayout
from train.loop.epilogue import run_summary
from train.parts.config.schema import TrainConfig
from train.parts.eval.evaluator import Evaluator, evaluates, read_result
from train.parts.eval.protocol import EvalParts, EvalResult, write_result
from train.parts.observe.logger import RunLogger
from train.parts.observe.observe_config import LoggingConfig
from train.parts.observe.perf import Peak

SCORER = "jpeg_compressibility"
# the made-up mean score of each evaluation
VALUE = {"step_00000000": 0.25, "step_00000002": 0.5, "step_00000003": 0.6}
VALUE |= {"step_00000000_held-out": 0.1, "step_00000003_held-out": 0.2}


def fake_evaluate(parts, records, *, tag, out, before_writing=None) -> EvalResult:
    """Prompt i scores VALUE[tag] + i / 100; the grid is every prompt, random pixels."""
    rows = [
        {"index": i, "prompt": r.prompt, "category": None, "seed": 0, SCORER: VALUE[tag] + i / 100}
        for i, r in enumerate(records)
    ]
    mean = sum(row[SCORER] for row in rows) / len(rows)
    result = EvalResult(tag, {SCORER: mean}, rows, torch.rand(len(rows), 3, 8, 8), list(range(len(rows))))
    write_result(result, records, out)
    return result


def config(tmp_path: Path, *, heldout: bool = False) -> TrainConfig:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red square\na blue circle\n")
    cfg = TrainConfig()
    if heldout:
        cfg.eval.heldout_prompts = str(prompts)
    cfg.run_dir, cfg.num_steps = str(tmp_path), 3
    cfg.data.train_prompts = str(prompts)
    cfg.eval.every = 2
    cfg.eval.scorers = {SCORER: {}}
    cfg.eval.samples_per_prompt = 1
    return cfg


def session(tmp_path: Path, *, start: int, heldout: bool = False) -> Evaluator:
    """The Evaluator a session starting at ``start`` builds, on one rank, around no model."""
    cfg = config(tmp_path, heldout=heldout)
    cpu = torch.device("cpu")
    dist = DistInfo(rank=0, world_size=1, local_rank=0, device=cpu, is_main=True)
    logger = RunLogger(LoggingConfig(), RunLayout(tmp_path), is_main=True)
    parts = EvalParts(None, lambda z, t, cond: z, {}, cfg.eval, cfg.sampler, cfg.model, dist, cpu)
    folder = RunLayout(cfg.run_dir).eval
    return Evaluator(
        parts, train_prompts=cfg.data.train_prompts, folder=folder, num_steps=3, start=start, ema=None, logger=logger
    )


@pytest.fixture(autouse=True)
def _no_model(monkeypatch):
    monkeypatch.setattr(evaluator_module, "evaluate", fake_evaluate)


def test_cadence_is_every_eval_every_steps_and_the_last(tmp_path):
    evaluator = session(tmp_path, start=0)
    assert [done for done in range(1, 4) if evaluator.due(done)] == [2, 3]
    cfg = evaluator.parts.cfg
    assert not evaluates(cfg, start=3, num_steps=3, again=False)  # no step left
    assert evaluates(cfg, start=3, num_steps=3, again=True)  # the last step's evaluation, lost to a crash
    cfg.every = 0
    assert not evaluates(cfg, start=0, num_steps=3, again=False)


def test_a_resumed_session_reads_step_0_back_and_compares_with_it(tmp_path, caplog):
    first = session(tmp_path, start=0)
    assert first.before is None
    first(0)
    kept = first.before
    assert kept is not None and kept.tag == "step_00000000"
    first.logger.finish()

    resumed = session(tmp_path, start=1)  # a new process: nothing of the first session but its files
    before = resumed.before
    assert before is not None and before is not kept
    assert before.indices == kept.indices and before.rows == kept.rows
    assert before.summary[SCORER] == kept.summary[SCORER]
    torch.testing.assert_close(before.images, kept.images, atol=0.5 / 255, rtol=0)  # saved as uint8
    with caplog.at_level(logging.INFO, logger=evaluator_module.__name__):
        resumed(2)
    resumed.logger.finish()
    assert f"eval step 2: {SCORER} 0.5050 (step 0: 0.2550)" in caplog.messages
    assert (tmp_path / "eval" / "before_after_step_00000002.png").is_file()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(row["step"], row[f"eval/{SCORER}"]) for row in rows] == [(0, 0.255), (2, 0.505)]


def test_the_held_out_prompts_are_shown_in_the_eval_lines_and_the_summary(tmp_path, monkeypatch):
    """They were in the JSON files only: the console showed the trained captions' gain alone."""
    lines: list[str] = []
    monkeypatch.setattr(evaluator_module, "log", SimpleNamespace(info=lines.append))
    evaluator = session(tmp_path, start=0, heldout=True)
    evaluator(0)
    evaluator(3)
    evaluator.logger.finish()
    assert lines[-1] == f"eval step 3: {SCORER} 0.6050 (step 0: 0.2550); held-out: {SCORER} 0.2050 (step 0: 0.1050)"
    summary = run_summary(
        config(tmp_path, heldout=True), start=0, history=[], seconds=1.0, peak=Peak(None, "none")
    ).splitlines()
    assert summary[1].startswith(f"{SCORER}: step 0 0.2550") and "paired difference +0.3500" in summary[1]
    assert summary[2].startswith(f"held-out prompts, {SCORER}: step 0 0.1050") and "+0.1000" in summary[2]
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert row[f"eval/{SCORER}/held-out"] == pytest.approx(0.205)


def test_a_fresh_session_reads_nothing_back(tmp_path):
    session(tmp_path, start=0)(0)
    assert session(tmp_path, start=0).before is None  # it evaluates step 0 itself
    assert read_result(tmp_path / "eval", "step_00000002") is None  # no such evaluation
