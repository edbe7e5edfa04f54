"""The command lines themselves: the console and its copy in the run folder, --cfg job --resolve, --help
with every field's documentation, the console scripts, the launchers' DRY_RUN output."""

from __future__ import annotations

import logging
import os
import runpy
import string
import subprocess
import sys
from importlib import import_module
from pathlib import Path
from unittest import mock

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from train.cli.compose import setup
from train.cli.help_text import field_docs
from train.tools.plan.command import main as plan_main
from train.tools.plan.plan_config import PlanRunConfig
from train.tools.probe.probe_config import ProbeRunConfig
from train.tools.probe.probe_config import register as register_probe

setup()
register_probe()
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def python(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_console_lines_are_also_in_the_run_log(tiny_flux_dir, tmp_path):
    """Hydra's job logging writes the console's lines to <run>/__main__.log (it stayed empty when the
    trainer printed)."""
    run_dir = tmp_path / "run"
    args = ["experiment=tiny", f"model.path={tiny_flux_dir}", "num_steps=1", "sampler.num_steps=5",
            "update.segment_length=2", "grpo.group_size=2", "batch.prompts_per_rank=1", "batch.micro_batch=2",
            "batch.gradient_accumulation_steps=2", "eval.every=1", "+eval.scorers.jpeg_compressibility={}",
            "eval.num_steps=2", "eval.num_prompts=2", "logging.progress_bar=false", "checkpoint.export=false",
            f"hydra.run.dir={run_dir}"]  # fmt: skip
    done = python("-m", "train", *args)
    log = (run_dir / "__main__.log").read_text()
    for line in ("eval step 0: jpeg_compressibility", "eval step 1: jpeg_compressibility", "step 1/1  reward",
                 "finished tiny (jagg, seed 42)", "__main__.log    these lines"):  # fmt: skip
        assert line in done.stdout and line in log, line
    assert not (run_dir / "export").exists() and "export/" not in log


@pytest.mark.slow
def test_cfg_job_resolve_prints_the_configuration():
    resolved = python("-m", "train", "--cfg", "job", "--resolve").stdout  # it crashed on ${hydra:runtime.output_dir}
    assert "run_dir: ''" in resolved and "experiment: demo" in resolved


@pytest.mark.parametrize("config, app", [("train", "jagg-train"), ("eval", "jagg-eval"), ("probe", "jagg-probe")])
def test_help_lists_every_field_with_its_value_and_meaning(config, app):
    """--help is Hydra's hydra.help.template, filled as Hydra fills it (string.Template)."""
    with initialize_config_module(config_module="configs", version_base=None):
        cfg = compose(config_name=config, overrides=["update=exact"], return_hydra_config=True)
    template = string.Template(OmegaConf.select(cfg, "hydra.help.template"))
    shown = template.substitute(APP_CONFIG_GROUPS="<groups>", FLAGS_HELP="", HYDRA_CONFIG_GROUPS="", CONFIG="")
    assert shown.startswith(f"{app} (python -m train")
    assert "model.path = ${shipped:testbed/pipeline}" in shown  # values as composed, interpolations unresolved
    assert "local diffusers pipeline folder (no hub downloads)" in shown
    assert "update.mode = exact" in shown  # values as composed
    assert len([line for line in shown.splitlines() if " = " in line]) >= len(field_docs())
    assert ("probe.num_rollouts = 20" in shown) is (config == "probe")  # a command's own settings in its help only
    if config == "train":
        assert 'eval "$(jagg-train -sc install=bash)"' in shown


def test_every_schema_field_is_documented():
    docs = field_docs()
    assert {"model.lora.rank", "logging.entity", "eval.compare_pretrained"} <= set(docs)
    assert not any(key.startswith(("probe.", "plan.")) for key in docs)  # the trainer's settings only
    assert [key for key, doc in docs.items() if not doc] == []
    for schema, own in ((ProbeRunConfig, "probe.num_rollouts"), (PlanRunConfig, "plan.world_size")):
        theirs = field_docs(schema)
        assert own in theirs and set(docs) < set(theirs) and all(theirs.values())
    # a docstring of several lines reads as one
    assert docs["model.options"].startswith("adapter options for models.registry.load_backbone")


def console_scripts() -> dict[str, str]:
    """setup.py's console scripts: program name -> ``module:function``."""
    with mock.patch("setuptools.setup") as setup:
        runpy.run_path(str(ROOT / "setup.py"))
    return dict(item.split("=") for item in setup.call_args.kwargs["entry_points"]["console_scripts"])


def test_console_scripts_point_at_functions():
    scripts = console_scripts()
    assert set(scripts) == {"jagg-train", "jagg-eval", "jagg-compare", "jagg-probe", "jagg-plan", "jagg-preflight"}
    for target in scripts.values():
        module, function = target.split(":")
        assert callable(getattr(import_module(module), function)), target


@pytest.fixture
def root_logger():
    """Hydra's --help configures the root logger (a handler on this test's captured stdout): put it back after."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.mark.parametrize("script", sorted(console_scripts()))
def test_every_console_script_answers_help(script, capsys, monkeypatch, root_logger):
    """The function an installed program calls (its setup.py entry point, with the program's argv) prints the
    command's help and ends with status 0, as its wrapper script would run it."""
    module, function = console_scripts()[script].split(":")
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    try:
        status = getattr(import_module(module), function)()
    except SystemExit as end:
        status = end.code
    shown = capsys.readouterr()
    assert status in (0, None), shown.err
    assert "error" not in shown.err
    assert "python -m train" in shown.out.splitlines()[0]  # "jagg-eval (python -m train.eval): ...", argparse's usage


def test_plan_answers_help_through_its_entry(capsys, root_logger):
    """jagg-plan composes with Hydra's compose API, which read --help as an override (a parse error); its help
    is Hydra's, filled with the planner's settings and the overrides given beside it."""
    plan_main(["experiment=flux_dance", "-h", "plan.world_size=16"])  # --help: the test above
    shown = capsys.readouterr().out
    assert shown.startswith("jagg-plan (python -m train.plan): per-rank memory")
    assert "plan.world_size = 16" in shown and "experiment = flux_dance" in shown
    assert "update: ablate, exact, jagg" in shown  # the groups, as Hydra lists them
    plan_main(["--hydra-help"])
    assert "== Flags ==" in capsys.readouterr().out
    for argv, line in (
        (["--help", "update=nope"], "update=nope is not an option of update"),
        (["--cfg", "job"], "--cfg: of Hydra's flags the planner takes --help, -h, --hydra-help only"),
    ):
        with pytest.raises(SystemExit) as end:
            plan_main(argv)
        assert end.value.code == 2
        (printed,) = capsys.readouterr().err.splitlines()
        assert printed.startswith(f"python -m train.plan: error: {line}")


@pytest.mark.slow
def test_sweep_subfolders_are_short():
    with initialize_config_module(config_module="configs", version_base=None):
        cfg = compose(config_name="train", overrides=["update=exact", "seed=3"], return_hydra_config=True)
    assert OmegaConf.to_container(cfg.hydra.sweep)["subdir"] == "${update.mode}_s${seed}_job${hydra.job.num}"
    with initialize_config_module(config_module="configs", version_base=None):
        probe = compose(config_name="probe", return_hydra_config=True)
    assert OmegaConf.to_container(probe.hydra.run)["dir"].startswith("runs/${experiment}/probe/")


def launch(script: str, *args: str, **env: str) -> list[str]:
    """The commands a launcher prints with DRY_RUN=1, without any of the model and data paths set."""
    clean = {k: v for k, v in ENV.items() if not k.endswith(("_PATH", "_CKPT", "_PROMPTS", "NODE_RANK"))}
    done = subprocess.run(
        ["bash", f"scripts/launch/{script}", *args],
        cwd=ROOT,
        env={**clean, "DRY_RUN": "1", **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_compare_modes_dry_run_loops_over_seeds_and_passes_the_run_folders():
    lines = launch("compare_modes.sh", "testbed_compare", "num_steps=4", SEEDS="0 1", OUT_DIR="runs/x", GROUP="g")
    assert len(lines) == 7  # 3 modes x 2 seeds, then the comparison
    first = lines[0].split()
    # elastic: 3 restarts, each resuming the run's latest checkpoint; a CPU experiment: one process
    assert first[:6] == ["torchrun", "--standalone", "--max-restarts", "3", "--nproc_per_node", "1"]
    assert "resume=auto" in first
    assert {"experiment=testbed_compare", "update=exact", "seed=0", "logging.group=g", "num_steps=4"} <= set(first)
    assert "hydra.run.dir=runs/x/exact_s0" in first
    assert "hydra.run.dir=runs/x/ablate_s1" in lines[5].split()
    assert lines[6].split() == ["python", "-m", "train.compare", *(f"runs/x/{m}_s{s}" for s in (0, 1)
                                for m in ("exact", "jagg", "ablate")), "--out", "runs/x/compare"]  # fmt: skip


def test_paper_launchers_dry_run_without_paths_and_multinode_uses_c10d():
    (line,) = launch("flux_dance.sh", "update=exact")
    assert "'model.path=<FLUX_PATH>'" in line.split() and "update=exact" in line.split()  # a placeholder, quoted
    (line,) = launch("multinode.sh", "flux_dance", NNODES="2", MASTER_ADDR="10.0.0.1", RUN_DIR="/shared/r")
    words = line.split()
    assert words[words.index("--rdzv_backend") + 1] == "c10d"
    assert words[words.index("--rdzv_endpoint") + 1] == "10.0.0.1:29500"
    assert words[words.index("--nnodes") + 1] == "2" and words[words.index("--node_rank") + 1] == "'<NODE_RANK>'"
    assert "hydra.run.dir=/shared/r" in words and "resume=auto" in words
    (line,) = launch("train.sh", "demo", "resume=runs/demo/a/checkpoints/step_00000002", MAX_RESTARTS="0")
    words = line.split()  # the user's resume= replaces the default; MAX_RESTARTS=0 turns restarts off
    assert [w for w in words if "resume=" in w] == ["resume=runs/demo/a/checkpoints/step_00000002"]
    assert words[words.index("--max-restarts") + 1] == "0"
    (line,) = launch("flux_dance.sh", "update=exact", PREFLIGHT="1", RUN_DIR="/shared/r")
    words = line.split()  # the run's own launch as a preflight: its overrides and folder, no restarts
    assert words[words.index("-m") + 1] == "train.preflight" and words[words.index("--max-restarts") + 1] == "0"
    assert {"experiment=flux_dance", "hydra.run.dir=/shared/r", "resume=auto", "update=exact"} <= set(words)
    (line,) = launch("probe.sh", "demo")
    assert "resume=auto" not in line.split()  # the probe measures; it resumes nothing
    (line,) = launch("train.sh", "demo", "update=exact,jagg", "logging.notes=it's new")
    assert " update=exact,jagg " in line  # quoted only where a shell needs it: commas stay as they are
    echoed = subprocess.run(["bash", "-c", "printf '%s\\n' " + line], capture_output=True, text=True, check=True)
    assert echoed.stdout.splitlines()[-2:] == ["update=exact,jagg", "logging.notes=it's new"]  # copy-pasteable
