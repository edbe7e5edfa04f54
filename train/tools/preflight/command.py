"""``python -m train.preflight [the run's overrides]`` (``jagg-preflight``): launched as the run will be
(``torchrun ... -m train.preflight experiment=... hydra.run.dir=<run>``, or ``PREFLIGHT=1 scripts/launch/...``), it
says in minutes whether the run will work there, how fast it will go and what to change. On every rank
(train/tools/preflight/session.py):

1. the trainer's own start-up checks (``train.run.start.load_config``: the settings and every file read as this
   rank reads it; ``train.run.startup_checks``: the mesh, the run folder; the model folder and the reward files);
2. the machine: versions, GPU and bf16, the attention kernel of the transformer's shapes, inductor when
   ``model.compile`` is on, the world, nodes and mesh (train/tools/preflight/machine.py);
3. the collectives FSDP2 will issue, timed on the run's mesh at the sizes of one block (train/tools/preflight/links.py);
4. ``preflight.steps`` training steps of the configured model cut to ``preflight.blocks`` blocks of each kind
   (random weights, full width), built by ``train.run.build.open_run`` and run by ``train.loop.step.train_step``: time
   per phase, peak memory, MFU (train/tools/preflight/reduced.py).

Then on rank 0 (conclude.py): the planner (train/tools/plan/) traces the same reduced model, its peak
against the measured one is the planner's error here; the full-depth plan corrected by it and re-timed with the
measured MFU and link rates says fits or not, s/step and h/run, with the planner's advice; and the disk of the run
folder is checked for ``checkpoint.keep_last`` checkpoints of the run's size (train/tools/preflight/compare.py).

The verdict: each check passed, warned, failed or skipped with one line and its fix, on the console and in
``<run>/preflight.json`` (train/tools/preflight/verdict.py); exit status 2 when the run would fail. The reduced model
and its one-step run live in ``<run>/.preflight/``, removed at the end: the folder stays ready for the run (no
lock, checkpoint or metrics left).
"""

from __future__ import annotations

import logging
import shutil
from contextlib import suppress
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from train.cli.compose import setup
from train.cli.reporting import reported, run_hydra
from train.distributed.collectives import DistInfo, barrier
from train.ground.layout import RunLayout
from train.run.start import process_group
from train.tools.preflight.conclude import conclude
from train.tools.preflight.machine import machine_line
from train.tools.preflight.preflight_config import register
from train.tools.preflight.session import Found, on_every_rank
from train.tools.preflight.verdict import FAILED_STATUS, Verdict

PROG = "python -m train.preflight"
log = logging.getLogger(__name__)
setup()
register()


def report_lines(found: Found, verdict: Verdict, dist: DistInfo) -> list[str]:
    cfg = found.config
    nodes = {m["node"] for m in found.machines}
    what = f"experiment={cfg.experiment}, run folder {cfg.run_dir}" if cfg is not None else "settings not read"
    lines = [f"preflight of {what}: {dist.world_size} rank(s) on {len(nodes)} node(s)", "machine"]
    seen: dict[str, list[int]] = {}
    for m in found.machines:
        seen.setdefault(machine_line(m), []).append(m["rank"])
    lines += [f"  ranks {','.join(map(str, ranks))}: {line}" for line, ranks in seen.items()]
    mesh = found.machines[0].get("mesh")
    lines += [f"  mesh {mesh} ({'HSDP (replicate, shard)' if mesh and len(mesh) == 2 else 'FSDP'})", "checks"]
    return lines + verdict.lines()


def tidy(run_dir: Path) -> None:
    """The run folder as the run will find it: no reduced model, and no checkpoints/ folder while it is empty (the
    run-folder check created it to test that it can be written)."""
    layout = RunLayout(run_dir)
    shutil.rmtree(layout.preflight_scratch, ignore_errors=True)
    with suppress(OSError):  # a folder that holds checkpoints stays
        layout.checkpoints.rmdir()


def conclude_on_main(found: Found, dist: DistInfo) -> int:
    """Rank 0's verdict, printed and written; its exit status."""
    # the run folder, or where Hydra writes this command's log when the settings did not read (run_dir unknown)
    run_dir = Path(found.config.run_dir if found.config is not None else HydraConfig.get().runtime.output_dir)
    try:
        out = conclude(found)
    finally:
        tidy(run_dir)
    for line in report_lines(found, out, dist):
        log.info(line)
    out.write(path := RunLayout(run_dir).preflight)
    log.info("written to %s", path)
    return out.exit_status


def run_preflight(cfg: DictConfig) -> int:
    """Every rank's part, then rank 0's verdict (printed and written); the exit status of this rank."""
    with process_group(cfg.dist.timeout_s) as dist:
        found = on_every_rank(cfg, dist)
        if not found.passed():  # every rank exits 2, once rank 0 wrote the verdict: torchrun stops the other ranks
            status = conclude_on_main(found, dist) if dist.is_main else FAILED_STATUS  # when one exits with an error
            barrier()
            return status
    return conclude_on_main(found, dist) if dist.is_main else 0


@hydra.main(config_path="pkg://configs", config_name="preflight", version_base=None)
def main(cfg: DictConfig) -> None:
    with reported(PROG):
        logging.captureWarnings(True)
        status = run_preflight(cfg)
    if status:
        raise SystemExit(status)


def command() -> None:
    """``python -m train.preflight`` and the console script ``jagg-preflight``."""
    run_hydra(main, prog=PROG)
