"""A run's record with no hole and no silent change: what a resume reads of the folder's past.

* ``recorded_config``: the settings the folder's latest session trained with, from the configuration it wrote
  (``config.<n>.yaml``, ``config.yaml``, else Hydra's ``.hydra/config.yaml``), for the checkpoints that recorded
  none of their own, or fewer (an older run's): train/run/startup_checks.py compares them as it compares a
  checkpoint's own.
* ``unfinished``: the checkpoint folders of a run whose saves never finished (no ``COMPLETE`` marker), which
  ``resume=auto`` refuses to start again over (``no_complete_checkpoint``).
* ``lost_rows``: the training steps before the resumed checkpoint that metrics.jsonl no longer holds (emptied or
  cut short since), named in one line.
* ``not_a_folder``: a file where the export's folder goes, refused before training.
* ``due_evaluations`` and ``missing_evaluations``: the evaluations the cadence (``eval.every``) asked for, and
  those without a row in metrics.jsonl (lost to a crash, a full disk): the trainer evaluates again the one
  at the step it resumes from, and the curve and the summary name the others.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from hydra.core.hydra_config import HydraConfig

from train.ground.errors import CheckpointError
from train.ground.layout import CHECKPOINTS, RunLayout
from train.parts.checkpoint.files import MARKER, STEP_DIR
from train.parts.data.prompts import prompts_digest, read_prompts
from train.parts.observe.metrics import evaluation_only, metrics_row, read_lines


def after_steps(steps: list[int]) -> str:
    """``after step 4``, ``after steps 2, 4-6``."""
    return f"after step{'s' if len(steps) > 1 else ''} {steps_text(steps)}"


def steps_text(steps: Iterable[int]) -> str:
    """``0-3, 6, 8-9``: sorted steps as runs of consecutive ones."""
    spans: list[list[int]] = []
    for step in sorted(set(steps)):
        if spans and step == spans[-1][1] + 1:
            spans[-1][1] = step
        else:
            spans.append([step, step])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def rows(path: Path) -> list[dict[str, Any]]:
    """The readable rows of a metrics.jsonl (a line cut short by a crash left out); none when there is no file."""
    return [row for line in read_lines(path) if (row := metrics_row(line)) is not None]


def lost_rows(metrics: Path, step: int) -> list[int]:
    """The training steps before ``step`` (the resumed checkpoint's) that ``metrics`` holds no row of, from its
    first row on (a run continued from another run's checkpoint logs from that checkpoint's step); all of them
    when it holds none."""
    logged = {int(row["step"]) for row in rows(metrics) if not evaluation_only(row)}
    return [k for k in range(min(logged, default=0), step) if k not in logged]


def due_evaluations(every: int, num_steps: int, upto: int) -> list[int]:
    """The steps ``<= upto`` after which the trainer evaluates: 0, every ``every`` steps, and after the last."""
    if not every:
        return []
    return [k for k in range(upto + 1) if k % every == 0 or k == num_steps]


def missing_evaluations(metrics: Path, due: list[int]) -> list[int]:
    """The steps of ``due`` that ``metrics`` holds no evaluation row of."""
    evaluated = {int(row["step"]) for row in rows(metrics) if any(key.startswith("eval/") for key in row)}
    return [k for k in due if k not in evaluated]


def unfinished(checkpoints: Path) -> list[str]:
    """The names of the checkpoint folders whose save did not finish (``.tmp``, or no ``COMPLETE`` marker)."""
    if not checkpoints.is_dir():
        return []
    found = [p for p in checkpoints.iterdir() if p.is_dir() and p.name.startswith("step_")]
    cut = [p for p in found if p.name.endswith(".tmp") or (STEP_DIR.match(p.name) and not (p / MARKER).is_file())]
    return sorted(p.name for p in cut)


def no_complete_checkpoint(checkpoints: Path, names: list[str]) -> CheckpointError:
    """The line that refuses ``resume=auto`` when every checkpoint of the folder lacks its marker."""
    run = checkpoints.parent
    return CheckpointError(
        f"resume=auto: no checkpoint under {checkpoints} is complete ({', '.join(names)}: saves cut short before "
        f"their {MARKER} marker), so there is nothing to resume and starting again would replace the run in {run}: "
        f"start it again from step 0 with checkpoint.overwrite=true, or train in a new folder (another "
        "hydra.run.dir=<folder>)",
        damaged=False,
    )


def _config_files(layout: RunLayout) -> list[Path]:
    """The configurations the folder's sessions wrote, the latest first; Hydra's copy last, unless this launch
    rewrote it (its output folder is the run folder: it holds this launch's settings, not the run's)."""
    sessions = [p for p in layout.root.glob("config.*.yaml") if p.name.split(".")[1].isdigit()]
    sessions.sort(key=lambda p: int(p.name.split(".")[1]), reverse=True)
    rewritten = (
        HydraConfig.initialized() and Path(HydraConfig.get().runtime.output_dir).resolve() == layout.root.resolve()
    )
    return [*sessions, layout.config, *([] if rewritten else [layout.hydra_config])]


def recorded_config(layout: RunLayout) -> tuple[dict[str, Any], Path] | None:
    """The configuration the folder's latest session wrote and its file; None when the folder holds none that
    reads as one."""
    for path in _config_files(layout):
        try:
            tree = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue
        if isinstance(tree, dict):
            return tree, path
    return None


def run_folder_of(checkpoint: Path) -> RunLayout:
    """The run folder that wrote ``checkpoint`` (``<run>/checkpoints/[retired/<timeline>/]step_N``)."""
    folder = next((p for p in checkpoint.absolute().parents if p.name == CHECKPOINTS), checkpoint.absolute().parent)
    return RunLayout(folder.parent)


def _select(tree: dict[str, Any], key: str) -> tuple[bool, Any]:
    node: Any = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _prompts_then(recorded: Any, now: str) -> str:
    """What the recorded training prompt file holds now, as a checkpoint records prompts; the path when it
    cannot be read (then it differs from ``now`` unless the path is the same)."""
    try:
        return prompts_digest(read_prompts(str(recorded)))
    except (OSError, ValueError):
        return now if recorded is None else f"{recorded} (unreadable now)"


def settings_from_config(tree: dict[str, Any], now: dict[str, Any], train_prompts: str) -> dict[str, Any]:
    """The values of the settings ``now`` (a checkpoint's recorded settings, train/parts/checkpoint/settings.py) as the
    configuration ``tree`` gives them; the prompts as their digest (``train_prompts``: the file given now)."""
    found = {}
    for key in now:
        present, value = _select(tree, key)
        if not present or (isinstance(value, str) and "${" in value):  # an interpolation Hydra's copy left
            continue
        if key == "data.train_prompts":
            value = now[key] if str(value) == train_prompts else _prompts_then(value, now[key])
        found[key] = value
    return found


def not_a_folder(layout: RunLayout) -> str | None:
    """Why the export at the end of training could not be written: a file where its folder goes; or None."""
    for folder in (layout.export, layout.export_raw):
        if folder.exists() and not folder.is_dir():
            return (
                f"{folder} is a file, where the export at the end of training writes a folder: move it away (or "
                "rename it), then launch again"
            )
    return None
