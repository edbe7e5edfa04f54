"""What every rank does: the trainer's start-up checks, the machine, then (when every rank passed them) the
model cut to a few blocks built and trained for ``preflight.steps`` steps, its attention kernel and the
collectives timed on its mesh. The ranks agree after each stage (one gather), so a failure on one rank stops
every rank at the same point; rank 0 gets everything (``Found``)."""

from __future__ import annotations

import logging
import math
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from train.distributed.collectives import DistInfo, barrier, gather_objects
from train.distributed.parallelize import world_mesh
from train.ground.layout import RunLayout
from train.parts.checkpoint.manager import CheckpointManager
from train.parts.data.prompts import prompts_digest, read_prompts
from train.parts.policy.builder import check_room, model_folder
from train.run.build import open_run
from train.run.folder import RunLock, check_one_run
from train.run.start import load_config
from train.run.startup_checks import check_mesh, check_resume, unwritable
from train.tools.plan.counts import text_tokens
from train.tools.plan.frozen import read_json
from train.tools.preflight.links import LinkRate, block_numel, measure_links
from train.tools.preflight.machine import check_attention, check_compile, describe
from train.tools.preflight.preflight_config import PreflightRunConfig
from train.tools.preflight.reduced import StepMeasure, reduced_folder, run_steps, step_config
from train.tools.preflight.scorers import time_scorers
from train.tools.preflight.verdict import RankChecks, Status

log = logging.getLogger(__name__)


@dataclass
class Found:
    """Every rank's answers (on rank 0; elsewhere its own only)."""

    config: PreflightRunConfig | None
    checks: list[RankChecks]
    machines: list[dict[str, Any]]
    steps: list[StepMeasure | None] = field(default_factory=list)
    links: list[list[LinkRate]] = field(default_factory=list)

    def passed(self) -> bool:
        return not any(rc.failed() for rc in self.checks)


def _failed_ranks(checks: RankChecks) -> list[int]:
    """The ranks that failed a check so far (a collective)."""
    return [rank for rank, failed in enumerate(gather_objects(checks.failed())) if failed]


def _run_folder(checks: RankChecks, cfg: PreflightRunConfig, dist: DistInfo) -> None:
    """Writable from this rank; on rank 0, free for the run (no run held that it neither resumes nor overwrites,
    no live owner)."""
    run_dir = Path(cfg.run_dir)
    fix = "pass the run's hydra.run.dir, writable from every node"
    if problem := unwritable(run_dir):
        checks.add("run folder", Status.failed, f"{run_dir}: {problem}", fix)
        return
    if dist.is_main:
        overwrite = cfg.checkpoint.overwrite
        checks.attempt("run folder", lambda: check_one_run(run_dir, resume=cfg.resume, overwrite=overwrite),
                       f"{run_dir} is writable and holds no other run")  # fmt: skip
        if busy := RunLock(run_dir).busy():
            checks.add("run folder", Status.failed, busy, "wait for that run or pick another folder")
    else:
        checks.add("run folder", Status.passed, f"{run_dir} is writable")


def startup_checks(checks: RankChecks, cfg: PreflightRunConfig, dist: DistInfo) -> None:
    """The trainer's checks before any model loads, on this rank (every rank calls them: some are collectives)."""
    checks.attempt("mesh", lambda: check_mesh(cfg, dist.world_size),
                   f"{dist.world_size} rank(s), dist.replicate_degree={cfg.dist.replicate_degree}")  # fmt: skip

    checks.attempt("model folder", lambda: model_folder(cfg, dist), f"model.path={cfg.model.path} reads here")
    _run_folder(checks, cfg, dist)
    check_compile(checks, cfg, dist.device)
    # every rank's own checks agreed on before the collectives of the checkpoints and the disk: a rank that failed
    # would skip them, and the others wait in them for dist.timeout_s
    if failed := _failed_ranks(checks):
        checks.add("checkpoints", Status.skipped, f"not checked: rank {','.join(map(str, failed))} failed a check")
        return
    resumed = f"resume={cfg.resume}: its checkpoints read on this rank; " if cfg.resume else ""
    checks.attempt("checkpoints", lambda: _checkpoints(cfg, dist), f"{resumed}room for the run's checkpoint")


def _checkpoints(cfg: PreflightRunConfig, dist: DistInfo) -> None:
    """The trainer's checks of the checkpoints to resume from, else of the room for a new run's first one."""
    checkpoints = CheckpointManager(RunLayout(cfg.run_dir).root, cfg.checkpoint)
    digest = prompts_digest(read_prompts(cfg.data.train_prompts))
    if not check_resume(cfg, dist, checkpoints, max_step=cfg.num_steps, prompts=digest):
        check_room(cfg, checkpoints, model_folder(cfg, dist))


def _scratch(cfg: PreflightRunConfig, dist: DistInfo) -> Path:
    """The scratch folder with the reduced model, written by rank 0 (the run folder is shared by the nodes)."""
    scratch = RunLayout(cfg.run_dir).preflight_scratch
    if dist.is_main:
        shutil.rmtree(scratch, ignore_errors=True)  # a preflight that was killed
        reduced_folder(cfg, scratch / "model")
    barrier()
    return scratch


def _step(
    checks: RankChecks, cfg: PreflightRunConfig, dist: DistInfo, nodes: list[int]
) -> tuple[StepMeasure | None, list[LinkRate]]:
    """The reduced model's steps, its attention kernel and the collectives on its mesh; a failure (an out-of-memory
    error, a collective that failed, a bug) one line."""
    try:
        scratch = _scratch(cfg, dist)
        full = read_json(Path(cfg.model.path) / "transformer" / "config.json")
        with open_run(step_config(cfg, scratch / "model", scratch / "run"), dist) as run:  # claimed as the trainer's
            backbone = run.model.backbone
            grid = backbone.latent_grid(cfg.model.height, cfg.model.width)  # type: ignore[attr-defined]
            tokens = text_tokens(cfg) + math.prod(grid)
            check_attention(checks, cfg, backbone.configs["transformer"], tokens, run.device)  # type: ignore[attr-defined]
            links: list[LinkRate] = []
            if dist.world_size > 1:
                numel = block_numel(backbone.transformer, backbone.block_classes)
                mesh = world_mesh(replicate=cfg.dist.replicate_degree)
                links = measure_links(mesh, numel, dtype=cfg.model.dtype, nodes=nodes, device=run.device,
                                      repeats=cfg.preflight.collective_repeats)  # fmt: skip
            measured = replace(run_steps(run, full), scorers=time_scorers(run))
    except Exception as err:
        log.warning("the step at reduced depth failed on rank %d", dist.rank, exc_info=True)
        line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        fix = "its traceback is in preflight.log; an out-of-memory error at reduced depth: see the plan's advice"
        checks.add("step", Status.failed, f"the training step at reduced depth failed: {line}", fix)
        return None, []
    return measured, links


def on_every_rank(cfg: DictConfig, dist: DistInfo) -> Found:
    """The stages of the module docstring on this rank; everything gathered (rank 0 holds every rank's)."""
    checks = RankChecks(dist.rank)
    replicate = int(cfg.dist.replicate_degree)
    machine = describe(dist.device, rank=dist.rank, world_size=dist.world_size, replicate=replicate)
    nodes = [m["node"] for m in gather_objects(machine)]
    config = checks.attempt("settings and files", lambda: load_config(cfg), "the trainer's checks pass on this rank")
    measured: StepMeasure | None = None
    links: list[LinkRate] = []
    if not _failed_ranks(checks) and config is not None:
        startup_checks(checks, config, dist)  # type: ignore[arg-type]
        if not _failed_ranks(checks):
            measured, links = _step(checks, config, dist, nodes)  # type: ignore[arg-type]
    return Found(
        config=config,  # type: ignore[arg-type]
        checks=gather_objects(checks),
        machines=gather_objects(machine),
        steps=gather_objects(measured),
        links=gather_objects(links),
    )
