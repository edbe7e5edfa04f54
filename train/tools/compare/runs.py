"""Reading the runs to compare.

A **run** is a run folder of ``python -m train`` (its ``metrics.jsonl``, the record of truth, and
the ``config.yaml`` the trainer writes beside it, or Hydra's ``.hydra/config.yaml``) or a wandb
run: an offline run folder (``wandb/offline-run-*``, read from its ``.wandb`` file), or an online
run, one by id or every run of a group (train/tools/compare/wandb_runs.py). Inside a run folder, metrics.jsonl
is read and its own ``wandb/`` folder is not. A sweep folder stands for every run folder (and offline
wandb run outside one) below it; folders without a metrics file (``compare/``) or with an empty one (a
probe's) are skipped and named, and so are a run's retired timelines (``checkpoints/retired/*/``, the rows a
resume branched away from: a run counts once, as the timeline its folder holds). A run whose recorded
configuration cannot be read whole (damaged YAML, empty, ended mid-line, or holding only the beginning of
the keys every other run records: a write or a copy cut short) is left out and named, so that it neither
stops the comparison nor stands as an arm of its own that splits the seeds of its real one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from train.ground.layout import METRICS, RunLayout
from train.tools.compare.wandb_runs import WandbRun, read_offline, read_offline_file, read_online, run_file

WANDB_PREFIX = "wandb:"


@dataclass
class RunMetrics:
    source: str  # the folder or wandb path it was read from
    steps: dict[int, dict[str, float]]  # logged step -> every metric logged at that step
    config: dict[str, Any] = field(default_factory=dict)  # flattened resolved configuration; {} if unknown
    name: str = ""  # the folder or wandb run name, a fallback label
    config_file: bool = False  # config read from a run folder's file (its keys in the order written)

    @property
    def seed(self) -> int | None:
        seed = self.config.get("seed")
        return int(seed) if seed is not None else None

    def series(self, key: str) -> dict[int, float]:
        return {step: values[key] for step, values in sorted(self.steps.items()) if key in values}


def _numbers(record: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in record.items() if isinstance(v, int | float) and not isinstance(v, bool)}


def read_metrics_file(path: Path) -> dict[int, dict[str, float]]:
    """Steps of one metrics.jsonl; a line that is not a JSON object with an integer "step" is an error.

    A step logged twice (a resumed run replays from its checkpoint) keeps the later values.
    """
    steps: dict[int, dict[str, float]] = {}
    for lineno, raw in enumerate(path.read_bytes().splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as err:
            raise ValueError(
                f"{path}:{lineno} is not UTF-8 (byte 0x{raw[err.start]:02x} at column {err.start + 1}); the file is "
                "damaged: delete that line or put back a copy of the file"
            ) from None
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{lineno} is not valid JSON ({err.msg}); the file is damaged") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError(f'{path}:{lineno} is not a metrics record (a JSON object with an integer "step")')
        steps.setdefault(record["step"], {}).update(_numbers(record))
    return steps


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"a.b": leaf} of a nested dict; lists stay leaves."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out |= flatten(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value}
    return out


class UnreadConfig(ValueError):
    """A run's recorded configuration that cannot be read whole: the run is left out, named."""


def _read_config(folder: Path) -> dict[str, Any]:
    """The run's resolved configuration: the trainer's ``config.yaml``, else Hydra's; {} if neither. UnreadConfig
    when the file is damaged or cut short (the YAML writers end every line, the last one included, with a newline)."""
    from omegaconf import OmegaConf

    layout = RunLayout(folder)
    for path in (layout.config, layout.hydra_config):
        if path.is_file():
            try:
                if not path.read_bytes().endswith(b"\n"):
                    raise UnreadConfig(f"{path} ends mid-line (cut short)")
                tree = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
            except (ValueError, yaml.YAMLError) as err:  # UnicodeDecodeError is a ValueError
                first = str(err).splitlines()[0] if str(err) else type(err).__name__
                raise UnreadConfig(f"{path} does not read as the YAML the trainer writes ({first})") from None
            if not isinstance(tree, dict) or not tree:
                raise UnreadConfig(f"{path} holds no setting")
            return flatten(tree)
    return {}


def _cut_short(run: RunMetrics, others: list[RunMetrics]) -> list[str]:
    """The keys that the fullest other configuration file records and ``run``'s lacks, when they all come after its
    last key: the end of a file written or copied short ([] otherwise; an older run that lacks a later-added
    setting here and there is compared as it is). Only files are checked: wandb keeps its own order."""
    files = [o.config for o in others if o.config and o.config_file]
    if not run.config_file or not run.config or not files:
        return []
    fullest: dict[str, Any] = max(files, key=len)
    order = list(fullest)
    missing = [k for k in order if k not in run.config]
    last = next((k for k in reversed(run.config) if k in order), None)
    if not missing or last is None or order.index(missing[0]) < order.index(last):
        return []
    return missing


def _left_out(runs: list[RunMetrics]) -> tuple[list[RunMetrics], list[str]]:
    """The runs whose configuration reads whole, and a line naming each one cut short."""
    kept, notes = [], []
    for i, run in enumerate(runs):
        missing = _cut_short(run, runs[:i] + runs[i + 1 :])
        if missing:
            why = f"its configuration stops before {missing[0]}, which the other runs record (cut short?)"
            notes.append(_not_read(run.source, why))
        else:
            kept.append(run)
    return kept, notes


NOT_READ = "not read: "  # the start of the line that names a run left out


def _not_read(source: str, why: str) -> str:
    return f"{NOT_READ}{source}: {why}; left out, the other runs compared (put back a whole copy to include it)"


def _from_wandb(run: WandbRun) -> RunMetrics:
    if not run.steps:
        raise ValueError(f"wandb run {run.source} has no logged step")
    steps = {step: _numbers(values) for step, values in run.steps.items()}
    return RunMetrics(run.source, steps, flatten(run.config), run.name or run.run_id)


def _read_wandb(path: str) -> list[RunMetrics]:
    try:
        found = read_online(path)
    except ValueError:
        raise
    except Exception as err:  # wandb raises its own error types (network, auth, missing run)
        raise ValueError(f"wandb run {path!r} could not be read: {err}") from None
    return [_from_wandb(run) for run in found]


def load_run(folder: Path) -> RunMetrics:
    """One run folder: its metrics.jsonl (at least one step) and its Hydra configuration."""
    metrics = RunLayout(folder).metrics
    steps = read_metrics_file(metrics)
    if not steps:
        raise ValueError(f"{metrics} holds no logged step (the file is empty)")
    return RunMetrics(str(folder), steps, _read_config(folder), folder.resolve().name, config_file=True)


def discover(specs: list[str]) -> tuple[list[RunMetrics], list[str]]:
    """(runs, notes): each spec is a run folder, a sweep folder (run folders or offline wandb runs below
    it), an offline wandb run folder or its ``.wandb`` file, or wandb:<entity>/<project>/<run id or group:name>.
    """
    runs: list[RunMetrics] = []
    notes: list[str] = []
    for spec in specs:
        if spec.startswith(WANDB_PREFIX):
            runs += _read_wandb(spec[len(WANDB_PREFIX) :])
            continue
        path = Path(spec)
        if not path.exists():
            raise FileNotFoundError(f"run folder {spec!r} does not exist (for a wandb run write wandb:<entity>/...)")
        if path.is_file() and path.suffix == ".wandb":
            runs.append(_from_wandb(read_offline_file(path)))
        elif path.is_file():
            raise ValueError(f"run {spec!r} is a file; pass a run folder (with metrics.jsonl) or a sweep folder")
        elif RunLayout(path).metrics.is_file():
            found, unread = _load_runs([path])
            runs, notes = runs + found, notes + unread
        elif run_file(path) is not None:
            runs += [_from_wandb(run) for run in read_offline([path])]
        else:
            found, skipped = _below(path)
            runs += found
            notes += skipped
    runs, cut = _left_out(runs)
    if not runs:
        raise ValueError("; ".join(["no run to compare", *notes, *cut]))
    return runs, notes + cut


def _load_runs(run_dirs: list[Path]) -> tuple[list[RunMetrics], list[str]]:
    """The runs of ``run_dirs``, and a line naming each one whose configuration cannot be read."""
    runs, notes = [], []
    for run_dir in run_dirs:
        try:
            runs.append(load_run(run_dir))
        except UnreadConfig as err:
            notes.append(_not_read(str(run_dir), str(err)))
    return runs, notes


def _owner(retired: Path) -> Path | None:
    """The run folder whose retired timeline ``retired`` is (``<run>/checkpoints/retired/<time>_after_step_N``)."""
    run = retired.parent.parent.parent
    return run if RunLayout(run).retired == retired.parent else None


def _timelines(folder: Path) -> tuple[list[Path], list[str]]:
    """The run folders below ``folder`` (a metrics.jsonl), and a line for each run's retired timelines
    (``checkpoints/retired/*/metrics.jsonl``: rows a resume branched away from, not a run of their own)."""
    found = sorted(p.parent for p in folder.rglob(METRICS))
    owners = [_owner(d) for d in found]
    notes = [
        f"left out {owners.count(run)} retired timeline(s) of {run} ({RunLayout(run).retired}: a resume branched "
        "away from them); the run counts once"
        for run in sorted({o for o in owners if o is not None})
    ]
    return [d for d, owner in zip(found, owners) if owner is None], notes


def _below(folder: Path) -> tuple[list[RunMetrics], list[str]]:
    """The runs of a sweep folder: run folders (metrics.jsonl), and offline wandb runs outside them."""
    run_dirs, notes = _timelines(folder)
    training = []
    for run_dir in run_dirs:
        if read_metrics_file(RunLayout(run_dir).metrics):
            training.append(run_dir)
        else:
            notes.append(f"skipped {run_dir}: its metrics.jsonl is empty (not a training run)")
    runs, unread = _load_runs(training)
    notes += unread
    offline = [p.parent for p in folder.rglob("run-*.wandb") if not any(d in p.parents for d in run_dirs)]
    runs += [_from_wandb(run) for run in read_offline(offline)]
    if not run_dirs and not offline:
        raise FileNotFoundError(
            f"{str(folder)!r} holds no metrics.jsonl and no wandb run: it is neither a run folder nor a sweep of runs"
        )
    return runs, notes
