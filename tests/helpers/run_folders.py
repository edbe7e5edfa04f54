"""The run folders the end-to-end tests of the trainer's faults share (tests/e2e/test_faults_*.py,
tests/e2e/test_run_record.py).

* ``train_small``: a finished 2-step run with checkpoints after steps 1 and 2 (tests/e2e/conftest.py's ``trained``
  fixture; copy it: ``copy_run``).
* ``files_of`` and ``contents``: every file under a folder, to show that a refused command wrote nothing;
  ``refused_line``: a launch refused with status 2, its one error line (and a folder it left as it was).
* ``metrics``: the rows of a run's metrics.jsonl; ``exported``: its export's weights; ``assert_same_export``: two runs
  exported the same weights; ``assert_same_run``: a resumed run logged and exported what an uninterrupted one did.
* ``sigterm_at`` and ``nan_rewards``: a scheduler's signal during a step, and rewards that are all NaN.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
from safetensors.torch import load_file
from small_run import FAST, the_error

import train.__main__ as train_command
import train.loop.trainer as trainer
from train.cli.reporting import run_hydra

ROOT = Path(__file__).resolve().parents[2]


def files_of(folder: Path) -> dict[str, tuple[int, int, str]]:
    """Every file under ``folder``: (size, mtime in ns, sha1), to show that nothing was written."""
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns, hashlib.sha1(p.read_bytes()).hexdigest())
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def contents(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` -> its sha1 (a refused launch may rewrite a file with the same bytes)."""
    return {
        str(p.relative_to(folder)): hashlib.sha1(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()
    }


def refused_line(
    launch: Callable[..., tuple],
    run_dir: Path | None,
    *overrides: str,
    module: ModuleType = train_command,
    kept: Path | None = None,
) -> str:
    """``launch(run_dir, *overrides)`` of ``module``, refused: status 2 and its one error line, which this returns;
    with ``kept``, every file under that folder as it was before (``contents``)."""
    saved = contents(kept) if kept else None
    status, stderr = launch(run_dir, *overrides, module=module)
    line = the_error(stderr, module.PROG)
    assert status == 2, stderr
    if kept:
        assert contents(kept) == saved
    return line


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def exported(run_dir: Path) -> dict[str, torch.Tensor]:
    """The exported transformer, or its LoRA adapters."""
    lora = run_dir / "export" / "pytorch_lora_weights.safetensors"
    return load_file(lora if lora.is_file() else run_dir / "export" / "diffusion_pytorch_model.safetensors")


def assert_same_export(a: Path, b: Path) -> None:
    """The runs in ``a`` and ``b`` exported the same weights, bit for bit."""
    final_a, final_b = exported(a), exported(b)
    assert final_a.keys() == final_b.keys()
    for name in final_a:
        assert torch.equal(final_a[name], final_b[name]), name


def assert_same_run(straight: Path, resumed: Path, steps: int) -> None:
    """The resumed run logged each of ``steps`` steps once, with the uninterrupted run's loss, reward
    and gradient norm, and exported the same weights, bit for bit."""
    rows_a, rows_b = metrics(straight), metrics(resumed)
    assert [m["step"] for m in rows_b] == list(range(steps))
    for a, b in zip(rows_a, rows_b):
        for key in ("train/loss", "reward/total", "train/grad_norm"):
            assert a[key] == b[key], (a["step"], key)
    assert_same_export(straight, resumed)


def train_small(run_dir: Path, tiny_flux_dir: Path) -> Path:
    """A finished 2-step run in ``run_dir`` with checkpoints after steps 1 and 2."""
    overrides = [*FAST, f"model.path={tiny_flux_dir}", "num_steps=2", "checkpoint.every=1"]
    run_hydra(train_command.main, prog=train_command.PROG, argv=[*overrides, f"hydra.run.dir={run_dir}"])
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000001", "step_00000002"]
    return run_dir


def copy_run(trained: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(trained, tmp_path / "run"))


def sigterm_at(step: int, monkeypatch, signum: int = signal.SIGTERM) -> None:
    """SIGTERM (or ``signum``) to this process during training step ``step``, as a scheduler would send it."""
    real = trainer.train_step

    def step_then_signal(run, k, *stop):
        out = real(run, k, *stop)
        if k == step:
            os.kill(os.getpid(), signum)
        return out

    monkeypatch.setattr(trainer, "train_step", step_then_signal)


def nan_rewards(monkeypatch) -> None:
    from rewards.combine import NonFiniteRewardError, RewardCombiner

    def score_term(self, name, images, prompts):
        raise NonFiniteRewardError("reward.components.jpeg_compressibility: NaN scores")

    monkeypatch.setattr(RewardCombiner, "score_term", score_term)


def metrics_refused_after_one_row(monkeypatch, errno: int, message: str) -> None:
    """The metrics file accepts its first row and refuses every later write with OSError(errno, message), as a
    disk that fills or a folder that turns read-only after step 0 does."""
    from train.parts.observe import metrics as metrics_module

    real_open, rows = open, []

    class RefusedAfterOneRow:
        def __init__(self, file):
            self.file = file

        def write(self, text):
            rows.append(text)
            if len(rows) > 1:
                raise OSError(errno, message)
            return self.file.write(text)

        def __getattr__(self, name):
            return getattr(self.file, name)

    def opened(path, *args, **kwargs):
        file = real_open(path, *args, **kwargs)
        return RefusedAfterOneRow(file) if str(path).endswith("metrics.jsonl") else file

    monkeypatch.setattr(metrics_module, "open", opened, raising=False)
