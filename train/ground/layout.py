"""The run folder's layout: the one place that names its files and folders.

<run>/
  config.yaml            the resolved configuration (config.<n>.yaml for each resumed session)
  metrics.jsonl          one JSON row per training step (train/observe/metrics.py)
  checkpoints/step_*/    training checkpoints (train/checkpoint/manager.py)
  checkpoints/retired/   the checkpoints of a timeline a resume branched away from (train/run/timeline.py)
  eval/                  evaluation results, before/after sheets and curve.png (train/evaluation/)
  samples/               sample grids of training steps
  export/                the weights the trainer's evaluations scored (the EMA when kept)
  export_raw/            with an EMA: the trained weights without it
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
CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"
EVAL = "eval"
LOCK_FILE = "LOCK"
RUN_ID_FILE = "run_id"


class RunLayout:
    """The paths of a run folder ``root``; nothing is created or read."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"RunLayout({str(self.root)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RunLayout) and other.root == self.root

    def __hash__(self) -> int:
        return hash(self.root)

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    def session_config(self, n: int) -> Path:
        """The resolved configuration of a resumed session ``n`` (2, 3, ...)."""
        return self.root / f"config.{n}.yaml"

    @property
    def hydra_config(self) -> Path:
        return self.root / ".hydra" / "config.yaml"

    @property
    def hydra(self) -> Path:
        return self.root / ".hydra"

    @property
    def metrics(self) -> Path:
        return self.root / METRICS

    @property
    def checkpoints(self) -> Path:
        return self.root / CHECKPOINTS

    @property
    def eval(self) -> Path:
        return self.root / EVAL

    @property
    def eval_curve(self) -> Path:
        """The run's evaluations against the step, written at its end (train/evaluation/curve.py)."""
        return self.eval / "curve.png"

    @property
    def samples(self) -> Path:
        return self.root / "samples"

    @property
    def export(self) -> Path:
        return self.root / EXPORT

    @property
    def export_raw(self) -> Path:
        return self.root / RAW_EXPORT

    @property
    def wandb(self) -> Path:
        return self.root / "wandb"

    @property
    def wandb_run_id(self) -> Path:
        return self.root / "wandb_run_id"

    @property
    def lock(self) -> Path:
        return self.root / LOCK_FILE

    @property
    def run_id(self) -> Path:
        return self.root / RUN_ID_FILE

    @property
    def retired(self) -> Path:
        return self.checkpoints / "retired"

    @property
    def probe(self) -> Path:
        return self.root / "probe.json"

    @property
    def preflight(self) -> Path:
        return self.root / "preflight.json"

    @property
    def preflight_scratch(self) -> Path:
        """The preflight's model cut to a few blocks and its one-step run, removed when it ends."""
        return self.root / ".preflight"

    def run_files(self) -> tuple[Path, ...]:
        """What a run leaves in its folder that a second run would overwrite or mix with its own (Hydra's
        files aside)."""
        return (
            self.checkpoints,
            self.metrics,
            self.export,
            self.export_raw,
            self.eval,
            self.samples,
            self.wandb,
            self.wandb_run_id,
            self.run_id,
            self.probe,
        )
