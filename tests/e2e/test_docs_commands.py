"""Every command in the code blocks of README.md, docs/*.md and docs/benchmarks/*.md runs as printed.

Each command is checked in this process as far as it can be without training: its settings compose
and validate as the command itself would validate them (files included, when the command names no
placeholder and no absolute path), ``python -m train.compare``'s arguments parse, and a launcher of
scripts/launch/ prints its commands with ``DRY_RUN=1``, each of which is checked the same way. A
command whose arguments are elided (``...``, ``[paths]``) or that passes ``--cfg``/``--help`` is
composed only, as Hydra would print it. Anything else must be in ``NOT_RUN``, with the reason.
"""

from __future__ import annotations

import itertools
import os
import re
import shlex
import subprocess
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from models.registry import backbone_names
from rewards.base import SCORER_NAMES
from train.cli.compose import setup
from train.run.checks import validate
from train.run.start import typed_config
from train.tools.compare.command import parse_args
from train.tools.eval.command import check_scorers, target
from train.tools.plan.command import plan_config
from train.tools.plan.plan_config import register as register_plan
from train.tools.preflight.preflight_config import register as register_preflight
from train.tools.probe.probe_config import probe_settings
from train.tools.probe.probe_config import register as register_probe

setup()
register_probe()
register_plan()
register_preflight()
ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "benchmarks").glob("*.md"))]
BLOCK = re.compile(r"^( *)```(\w*)\n(.*?)^\1```", re.S | re.M)
# a command in the prose: python -m train[.<command>] or torchrun with arguments (not a bare name, not its output)
INLINE = re.compile(r"`((?:python -m train(?:\.\w+)?|torchrun) [^`:]*)`")
PLACEHOLDER = re.compile(r"<([A-Za-z_ ]+)>")  # <run>, <FLUX_PATH>: what the reader fills in
CONSOLE_SCRIPTS = {
    "jagg-train": "train",
    "jagg-eval": "train.eval",
    "jagg-probe": "train.probe",
    "jagg-plan": "train.plan",
    "jagg-preflight": "train.preflight",
}
CONFIGS = {
    "train": "train",
    "train.eval": "eval",
    "train.probe": "probe",
    "train.plan": "plan",
    "train.preflight": "preflight",
}
ELIDED = ("...", "[paths]", "[overrides]")
# Commands the test does not run, by their first words, and why.
NOT_RUN = {
    "make test": "the test suite itself",
    "python -m venv": "creates an environment",
    "python -c": "prints torch's version",
    "pip install": "installs packages",
    "hf download": "downloads weights (network)",
    "export": "sets a variable",
    'eval "$(jagg-train -sc install=bash)"': "Hydra's shell completion, no settings",
    "python scripts/": "a benchmark or tool with its own flags (argparse), not settings",
    "scripts/gpu_check.sh": "its own flags (argparse); tests/tools/test_gpu_check.py runs its CPU mode",
    "vllm serve": "starts a model server (a GPU and the judge's weights; docs/rewards.md)",
    "sbatch": (
        "submits a Slurm job (its commands: the DRY_RUN=1 line beside it, tests/e2e/test_slurm.py; on a one-node "
        "cluster: make test-slurm)"
    ),
}


@dataclass(frozen=True)
class Command:
    doc: str  # where it is printed
    line: str

    def __str__(self) -> str:
        return f"{self.doc}: {self.line}"


def doc_commands(path: Path) -> list[Command]:
    """The commands of a document: every line of a ``bash`` block (continuations joined, comments
    dropped), the ``$ `` lines of an untagged block (a console transcript), and the inline code spans of
    the prose that start with ``python -m train`` or ``torchrun``."""
    text = path.read_text(encoding="utf-8")
    prose = BLOCK.sub("", text)
    found = [Command(path.name, " ".join(m.group(1).split())) for m in INLINE.finditer(prose)]
    for match in BLOCK.finditer(text):
        language, body = match.group(2), textwrap.dedent(match.group(3)).replace("\\\n", " ")
        for line in body.splitlines():
            if language == "bash":
                line = line.strip()
                if line and not line.startswith("#"):
                    found.append(Command(path.name, line))
            elif language == "" and line.startswith("$ "):
                found.append(Command(path.name, line[2:].strip()))
    return found


def _filled(override: str) -> str:
    """A placeholder filled in as the reader would: a whole value (seed=<s>) with 1, a part of a path by its name."""
    key, _, value = override.partition("=")
    if PLACEHOLDER.fullmatch(value):
        return f"{key}=1"
    return PLACEHOLDER.sub(lambda m: m.group(1).replace(" ", "_"), override)


def _sweep(overrides: list[str]) -> list[list[str]]:
    """Every job of ``-m``'s comma lists (``update=exact,jagg seed=0,1``: 4 jobs)."""
    options = [
        [f"{o.split('=', 1)[0]}={v}" for v in o.split("=", 1)[1].split(",")] if "," in o and "{" not in o else [o]
        for o in overrides
    ]
    return [list(job) for job in itertools.product(*options)]


def check_settings(module: str, args: list[str], run_dir: Path) -> None:
    """Compose ``python -m <module> args`` and validate the settings as the command does."""
    compose_only = any(a in ("--cfg", "--help", "-sc", "--hydra-help") or a in ELIDED for a in args)
    multirun = "-m" in args or "--multirun" in args
    skip = {"--cfg", "-sc"}
    overrides, drop_next = [], False
    for arg in args:
        if drop_next or arg in ELIDED or arg in ("--help", "--resolve", "-m", "--multirun", "--hydra-help"):
            drop_next = False
            continue
        drop_next = arg in skip
        if not drop_next:
            overrides.append(arg)
    placeholder = any(PLACEHOLDER.search(a) or "..." in a for a in overrides)
    check_files = not placeholder and not any(re.search(r"=/|^/", a) for a in overrides)
    overrides = [_filled(a) for a in overrides]
    # weights under runs/ are what an earlier command of the document trains
    written_before = any(re.search(r"(transformer|resume)=runs/", a) for a in overrides)
    for job in _sweep(overrides) if multirun else [overrides]:
        extra = [] if module == "train.plan" else [f"run_dir={run_dir}"]
        cfg = compose(config_name=CONFIGS[module], overrides=[*job, *extra])
        if compose_only:
            continue
        if module == "train.plan":
            plan_config(cfg)
            continue
        config = typed_config(cfg)
        validate(config, known_scorers=SCORER_NAMES, known_backbones=tuple(backbone_names()), check_files=check_files)
        if module == "train.probe":
            probe_settings(config)
        if module == "train.eval":
            check_scorers(config)
            if not placeholder and not written_before:
                target(config)


def executable(script: str) -> None:
    """A script a document runs directly (``scripts/launch/train.sh ...``) is executable, and committed so: a
    fresh clone gets git's mode, not this checkout's."""
    path = ROOT / script
    assert path.is_file(), f"{script} is printed as a command but is no file"
    assert os.access(path, os.X_OK), f"{script} is printed to run directly but is not executable"
    listed = subprocess.run(["git", "ls-files", "-s", "--", script], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode == 0 and listed.stdout:  # a git checkout (a wheel or an archive has none)
        mode = listed.stdout.split()[0]
        assert mode == "100755", f"{script} is committed with mode {mode}: git update-index --chmod=+x {script}"


def dry_run(words: list[str]) -> list[str]:
    """The commands a launcher prints with DRY_RUN=1, run as printed: its leading VAR=value words set its
    environment, and the script itself is executed (not handed to bash), as the reader's shell does."""
    env = {**os.environ, "DRY_RUN": "1"}
    while re.fullmatch(r"[A-Z_]+=.*", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    executable(words[0])
    done = subprocess.run(words, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def check(line: str, run_dir: Path) -> str:
    """Check one command line; what was checked (or why it was not run)."""
    words = shlex.split(line, comments=True)
    env_words = list(itertools.takewhile(lambda w: re.fullmatch(r"[A-Z_]+=.*", w), words))
    program = words[len(env_words) :]
    if program[0].startswith("scripts/launch/"):
        for printed in dry_run(words):
            check(printed, run_dir)
        return "DRY_RUN"
    for prefix, why in NOT_RUN.items():
        if line.startswith(prefix) or " ".join(program).startswith(prefix):  # or after its VAR=value words
            return f"not run: {why}"
    if "/" in program[0]:
        raise AssertionError(f"a script run directly has no DRY_RUN mode to check it (add one): {line}")
    if program[0] == "make" and program[1:] == ["demo"]:
        module, args = "train", []  # the Makefile's demo target is python -m train
    elif program[0] in CONSOLE_SCRIPTS:
        module, args = CONSOLE_SCRIPTS[program[0]], program[1:]
    elif program[0] in ("python", "torchrun") and "-m" in program:
        at = program.index("-m")
        module, args = program[at + 1], program[at + 2 :]
    else:
        raise AssertionError(f"no check for this command (add one, or a reason to NOT_RUN): {line}")
    if module == "train.compare":
        parse_args(args)
        return "parsed"
    check_settings(module, args, run_dir)
    return "validated"


ALL = [command for doc in DOCS for command in doc_commands(doc)]


@pytest.fixture(scope="module")
def _hydra():
    with initialize_config_module(config_module="configs", version_base=None):  # once: it scans configs/
        yield


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch, _hydra):
    monkeypatch.chdir(ROOT)  # the documents' relative paths start at the repository root


@pytest.mark.parametrize("command", ALL, ids=[f"{c.doc}:{i}" for i, c in enumerate(ALL)])
def test_documented_command_runs_as_printed(command, tmp_path):
    check(command.line, tmp_path / "run")


def test_every_script_the_documents_run_directly_is_executable():
    """Each ``path/to/script`` a document runs as a command (the launchers, slurm.sbatch's DRY_RUN line) runs
    as printed: a script committed without its executable bit failed there with "Permission denied"."""
    direct = {program[0] for program in map(_program, ALL) if program and "/" in program[0]}
    assert {"scripts/launch/slurm.sbatch", "scripts/launch/train.sh"} <= direct
    for script in sorted(direct):
        executable(script)


def _program(command: Command) -> list[str]:
    """The words of a command after its leading VAR=value words."""
    words = shlex.split(command.line, comments=True)
    return list(itertools.dropwhile(lambda w: re.fullmatch(r"[A-Z_]+=.*", w), words))


def test_the_readme_stays_a_map():
    """Each feature one line and a link; the detail lives in docs/ (the README had grown to 262 lines)."""
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) < 250


def test_the_documents_have_commands_to_check():
    assert {c.doc for c in ALL} >= {"README.md", "research_tools.md", "testbed.md", "rewards.md"}
    assert sum(1 for c in ALL if "train.probe" in c.line) >= 4  # the Table 5 commands among them
