"""The small run the trainer's end-to-end tests train, and how they run a command in this process.

* ``SMALL_RUN``: 5 sampling steps -> 4 trainable transitions = one group of W = 4; one prompt of G = 2
  per step, no sample grids, no progress bar. ``FAST`` is it on the tiny experiment.
* ``TWO_SEGMENTS``: 9 sampling steps -> 8 trainable transitions -> 2 segments of W = 4; 1 prompt x G = 4 samples
  per step in micro-batches of 2, no progress bar.
* ``command(capsys, run_dir, overrides)``: ``python -m <module> overrides`` through the command's own
  entry (``train.cli.reporting.run_hydra``), as its console script runs it: the exit status and what it printed.
* ``the_error(stderr)``: the command's one error line (``kind="stopped"``: its line when a signal stopped it), with
  no traceback on stderr.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import train.__main__ as train_command
from train.cli.reporting import run_hydra

SMALL_RUN = [
    "sampler.num_steps=5",
    "grpo.group_size=2",
    "batch.prompts_per_rank=1",
    "batch.micro_batch=2",
    "batch.gradient_accumulation_steps=2",
    "logging.sample_every=0",
    "logging.progress_bar=false",
]
FAST = ["experiment=tiny", *SMALL_RUN]
TWO_SEGMENTS = [
    "sampler.num_steps=9",
    "grpo.group_size=4",
    "batch.prompts_per_rank=1",
    "batch.micro_batch=2",
    "batch.gradient_accumulation_steps=4",
    "logging.progress_bar=false",
]


def merged(*lists: list[str]) -> list[str]:
    """Overrides in order, a later one replacing an earlier one of the same key (Hydra refuses two)."""
    by_key = {}
    for override in (o for overrides in lists for o in overrides):
        by_key[override.split("=")[0].lstrip("+")] = override
    return list(by_key.values())


def command(
    capsys, run_dir: Path | None, overrides: list[str], module: ModuleType = train_command, *, stdout: bool = False
) -> tuple:
    """Run ``python -m <module> overrides`` in this process as its entry point does, in ``run_dir`` (None: Hydra's
    default folder under the current one): (exit status, stderr), with ``stdout`` (exit status, stderr, stdout)."""
    folder = [f"hydra.run.dir={run_dir}"] if run_dir else []
    try:
        run_hydra(module.main, prog=module.PROG, argv=[*merged(overrides), *folder])
        status = 0
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else 1
    captured = capsys.readouterr()
    return (status, captured.err, captured.out) if stdout else (status, captured.err)


def the_error(stderr: str, prog: str = "python -m train", *, kind: str = "error") -> str:
    """The one ``<prog>: <kind>: `` line of a command (other lines on stderr are library warnings); no traceback."""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.startswith(f"{prog}: {kind}: ")]
    assert len(lines) == 1, stderr
    return lines[0]
