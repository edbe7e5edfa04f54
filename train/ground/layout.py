"""The run folder's layout: the one place that names its files and folders.

<run>/
  config.yaml            the resolved configuration (config.<n>.yaml for each resumed session)
  metrics.jsonl          one JSON row per training step (train/parts/observe/metrics.py)
  checkpoints/step_*/    training checkpoints (train/parts/checkpoint/manager.py)
  checkpoints/best/      with checkpoint.keep_best: the checkpoint of the best evaluation (hard links)
  checkpoints/retired/   the checkpoints of a timeline a resume branched away from (train/run/timeline.py)
  eval/                  evaluation results and before/after sheets (train/parts/eval/),
                         curve.png (train/loop/epilogue.py)
  samples/               sample grids of training steps
  export/                the weights the trainer's evaluations scored (the EMA when kept)
  export_raw/            with an EMA: the trained weights without it
  export_best/           with checkpoint.keep_best: the weights of the best evaluation, as export/ holds them
  wandb/, wandb_run_id   wandb's files and the run id a resumed session continues
  LOCK                   the lock of the process that owns the folder (train/run/folder.py)
  run_id                 the run's identity, recorded in every checkpoint (train/run/timeline.py)
  probe.json             the gradient-quality probe's report (python -m train.probe)
  preflight.json         the preflight's verdict (python -m train.preflight; .preflight/ while it runs)
  .hydra/config.yaml     Hydra's copy of the composed configuration
"""

from __future__ import annotations

from pathlib import Path

EXPORT, RAW_EXPORT = "export", "export_raw"  # the folder names of the two exports (a Weights tag too)
BEST_EXPORT = "export_best"
CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"
EVAL = "eval"
LOCK_FILE = "LOCK"
RUN_ID_FILE = "run_id"


class _Under:
    """A path in the run folder, as an attribute of ``RunLayout`` (``layout.metrics``)."""

    def __init__(self, *parts: str) -> None:
        self.parts = parts

    def __get__(self, layout: RunLayout, owner: type) -> Path:
        return layout.root.joinpath(*self.parts)


class RunLayout:
    """The paths of a run folder ``root``; nothing is created or read."""

    config = _Under("config.yaml")
    hydra = _Under(".hydra")
    hydra_config = _Under(".hydra", "config.yaml")
    metrics = _Under(METRICS)
    checkpoints = _Under(CHECKPOINTS)
    retired = _Under(CHECKPOINTS, "retired")
    best_checkpoint = _Under(CHECKPOINTS, "best")
    eval = _Under(EVAL)
    eval_curve = _Under(EVAL, "curve.png")  # the evaluations against the step, written at the end of a run
    samples = _Under("samples")
    export = _Under(EXPORT)
    export_raw = _Under(RAW_EXPORT)
    export_best = _Under(BEST_EXPORT)
    wandb = _Under("wandb")
    wandb_run_id = _Under("wandb_run_id")
    lock = _Under(LOCK_FILE)
    run_id = _Under(RUN_ID_FILE)
    probe = _Under("probe.json")
    preflight = _Under("preflight.json")
    preflight_scratch = _Under(".preflight")  # the preflight's cut model and one-step run, removed when it ends

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"RunLayout({str(self.root)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunLayout) and other.root == self.root

    def __hash__(self) -> int:
        return hash(self.root)

    def session_config(self, n: int) -> Path:
        """The resolved configuration of a resumed session ``n`` (2, 3, ...)."""
        return self.root / f"config.{n}.yaml"

    def run_files(self) -> tuple[Path, ...]:
        """What a run leaves in its folder that a second run would overwrite or mix with its own (Hydra's
        files aside)."""
        return (
            self.checkpoints,
            self.metrics,
            self.export,
            self.export_raw,
            self.export_best,
            self.eval,
            self.samples,
            self.wandb,
            self.wandb_run_id,
            self.run_id,
            self.probe,
        )
