"""``RunFolder``, a Hydra callback (``hydra.callbacks.run_folder`` in configs/train.yaml), looks at the run
folder before Hydra creates it or writes its ``.hydra/`` and log file there: a folder that holds a run
(train/run/folder.py) is refused unless the launch resumes or overwrites it, as are a folder another live
process owns and one that cannot be written. It records the folder as it was (train/cli/launch.py), so
that a launch refused later, before it did any work, takes back what it wrote. A sweep (Hydra's basic
sweeper) has every job's folder checked so before it writes anything, and is refused whole for one; a
sweep's job that fails is reported, takes back its own folder, and the other jobs still run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException

from train.cli.launch import Launch, made_for_rank_zero
from train.cli.reporting import env_rank, progress, report_error
from train.ground.errors import ConfigError, Stop, UserError
from train.ground.layout import RunLayout
from train.run.folder import RunLock, check_one_run


class RunFolder(Callback):
    """Hydra's callback before the run folder is created (``hydra.callbacks.run_folder``, configs/train.yaml).

    ``one_run``: refuse a folder that holds a run unless ``resume`` or ``checkpoint.overwrite`` is set, and
    one whose lock a live process holds (the trainer's; train.eval and train.probe write beside runs).
    ``lock``: take the folder's lock (rank 0) before Hydra writes into it, for commands that own their folder
    (the trainer, the probe; not train.eval, whose folder is inside the run it evaluates).
    """

    def __init__(self, one_run: bool = True, lock: bool = True) -> None:
        self.one_run, self.lock = one_run, lock

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            folder = Path(str(OmegaConf.select(config, "hydra.run.dir"))).absolute()
        except OmegaConfBaseException:
            return  # Hydra resolves it again in a moment and reports the error its own way
        if self.one_run and config.get("resume") == "auto" and _new_each_launch(config) and env_rank() == 0:
            folder = _resume_latest(config, folder)  # the other ranks train where rank 0 does (train/run/build.py)
        problem = self._refusal(folder, config)
        if problem is not None:
            raise SystemExit(report_error(problem, progress.prog))  # Hydra's callbacks swallow Exceptions
        if env_rank() != 0:  # rank 0 owns the folder and takes back what a refused launch wrote there
            if self.lock:
                made_for_rank_zero(folder)
            _leave_folder_record_to_rank_zero(config)
            return
        if not self.lock:
            progress.launch = Launch.before(folder)
            return
        try:
            progress.launch = Launch.claimed(folder)
        except UserError as err:  # another launch owns the folder: this one has written nothing
            raise SystemExit(report_error(err, progress.prog)) from None
        except OSError:  # the folder cannot be created: Hydra fails to and reports it (train/cli/reporting.py)
            progress.launch = Launch.before(folder)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Every job's folder, before the sweep writes anything: one refused folder refuses the sweep."""
        jobs = _sweep_jobs(config)
        if jobs is None:
            return  # a sweeper plugin of its own: each job's folder is checked when it starts (claim_folder)
        problems = [f"job #{num} ({folder}): {p}" for num, folder, job in jobs if (p := self._refusal(folder, job))]
        if problems:
            message = f"the sweep starts none of its {len(jobs)} jobs: {'; '.join(problems)}"
            raise SystemExit(report_error(ConfigError(message), progress.prog))
        sweep_dir = Path(str(config.hydra.sweep.dir)).absolute()
        progress.launches = {folder: Launch.before(folder, within=sweep_dir) for _, folder, _ in jobs}

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if HydraConfig.get().mode == RunMode.MULTIRUN:  # the job's folder as it was before the sweep began
            progress.launch = progress.launches.get(Path(config.hydra.runtime.output_dir))

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            progress.launch = None

    def _refusal(self, folder: Path, config: DictConfig) -> Stop | None:
        """Why a launch of ``config`` may not write into ``folder`` (unwritable; with ``one_run``, a run held
        there that the launch neither resumes nor overwrites, or a live owner), or None."""
        if folder.is_dir() and not os.access(folder, os.W_OK | os.X_OK):
            return ConfigError(
                f"cannot write the run folder (Permission denied: {folder}); pass a writable hydra.run.dir=<folder>"
            )
        if not self.one_run:
            return None
        try:
            overwrite = bool(OmegaConf.select(config, "checkpoint.overwrite", default=False))
            check_one_run(folder, resume=config.get("resume"), overwrite=overwrite)
        except Stop as err:
            return err
        busy = RunLock(folder).busy() if env_rank() == 0 else None  # rank 0 owns the folder
        return UserError(busy) if busy else None


def _leave_folder_record_to_rank_zero(config: DictConfig) -> None:
    """On a rank other than 0: Hydra writes no ``.hydra/`` and no log file of this rank's into the shared run folder
    (rank 0 writes the same ``.hydra/`` files; this rank's lines go to its own output, docs/logging.md). Written by
    every rank, ``.hydra/`` raced rank 0's record of the folder (a refused two-rank resume once took back a
    config.yaml rank 1 was writing, and left it empty), and the log file held rank 1's lines untagged beside rank
    0's, cut or kept by rank 0's take-back of a refused launch depending on which rank wrote first."""
    with read_write(config.hydra), open_dict(config.hydra):
        config.hydra.output_subdir = None
        job_logging = config.hydra.job_logging
        files = [name for name, handler in (job_logging.get("handlers") or {}).items() if "filename" in handler]
        for name in files:
            del job_logging.handlers[name]
        for logger in [job_logging.get("root"), *(job_logging.get("loggers") or {}).values()]:
            if logger is not None and logger.get("handlers"):
                logger.handlers = [name for name in logger.handlers if name not in files]


def _sweep_jobs(config: DictConfig) -> list[tuple[int, Path, DictConfig]] | None:
    """Each job of a sweep of Hydra's basic sweeper: (its number, its folder, its configuration), composed as
    the launcher composes them; None for another sweeper (its jobs are not known ahead)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if OmegaConf.select(config, "hydra.sweeper._target_") != f"{BasicSweeper.__module__}.{BasicSweeper.__name__}":
        return None
    params = [f"{key}={value}" for key, value in (config.hydra.sweeper.params or {}).items()]
    overrides = OverridesParser.create().parse_overrides([*params, *config.hydra.overrides.task])
    OmegaConf.select(config, "hydra.sweep.dir")  # resolved once here: the jobs copy its ${now:} from this cache
    loader, hydra_config = GlobalHydra.instance().config_loader(), HydraConfig.instance().cfg
    jobs = []
    try:
        for num, job_overrides in enumerate(BasicSweeper.split_arguments(overrides, None)[0]):
            job = loader.load_sweep_config(config, list(job_overrides))
            with open_dict(job):
                job.hydra.job.id = job.hydra.job.num = num
            HydraConfig.instance().set_config(job)  # for ${hydra:...} in the folder's name, as the launcher does
            folder = Path(str(job.hydra.sweep.dir), str(job.hydra.sweep.subdir)).absolute()
            jobs.append((num, folder, job))
    finally:
        HydraConfig.instance().cfg = hydra_config
    return jobs


def _new_each_launch(config: DictConfig) -> bool:
    """The run folder is the default one, named by the launch's time (no hydra.run.dir= nor run_dir= given)."""
    raw = OmegaConf.to_container(config.hydra.run, resolve=False)
    named = isinstance(raw, dict) and "${now:" in str(raw.get("dir", ""))
    return named and not config.get("run_dir")


def _interrupted(parent: Path, num_steps: int) -> list[tuple[float, Path, int]]:
    """The runs under ``parent`` that ``resume=auto`` can continue: (when their latest checkpoint was written,
    the folder, its step), newest first; a run whose latest checkpoint holds num_steps, or that a live process
    owns, is not one."""
    from train.parts.checkpoint.files import MARKER, complete_in  # torch: only for this search, not every launch

    found = []
    for folder in sorted(p for p in parent.iterdir() if p.is_dir()) if parent.is_dir() else []:
        saved = list(complete_in(RunLayout(folder).checkpoints).items())
        if not saved or saved[-1][1] >= num_steps or RunLock(folder).busy():
            continue
        latest, step = saved[-1]
        found.append(((latest / MARKER).stat().st_mtime, folder, step))
    return sorted(found, reverse=True)


def _resume_latest(config: DictConfig, default: Path) -> Path:
    """``resume=auto`` without a run folder: the latest interrupted run of the experiment beside the folder this
    launch would have made (``runs/<experiment>/``) becomes its run folder, named in the console; none: one line."""
    parent, experiment, num_steps = default.parent, config.get("experiment"), int(config.get("num_steps", 0))
    runs = _interrupted(parent, num_steps)
    if not runs:
        message = (
            f"resume=auto names no run folder and {parent} holds no interrupted run of experiment {experiment} "
            f"(a folder with a complete checkpoint before num_steps={num_steps}, owned by no live process): start "
            "a new run without resume=auto, or name the folder to continue with hydra.run.dir=<folder>"
        )
        raise SystemExit(report_error(ConfigError(message), progress.prog))
    _, folder, step = runs[0]
    others = f"; the others: {', '.join(f.name for _, f, _ in runs[1:])}" if runs[1:] else ""
    progress.note = (
        f"resume=auto: continuing {folder}, the latest interrupted run of experiment {experiment} (its latest "
        f"checkpoint after step {step}){others}; hydra.run.dir=<folder> resumes another one"
    )
    with open_dict(config):
        config.hydra.run.dir = str(folder)
    return folder
