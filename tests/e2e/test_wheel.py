"""The package as a user installs it: a wheel, built from a copy of the sources, installed without dependencies
into a fresh environment that sees the pinned ones (a .pth file naming this environment's site-packages, whose
own .pth files, the editable install's among them, are not run), then every console script's ``--help`` and one
step of the default job from an empty folder: the shipped defaults must come from the wheel (setup.py's
package_data), and ``runs/`` must be written under the folder the command started from."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ("jagg-train", "jagg-eval", "jagg-compare", "jagg-probe", "jagg-plan")
NOT_SOURCES = (
    ".git",
    ".venv",
    "runs",
    "outputs",
    "wandb",
    ".cache",
    "build",
    "dist",
    "*.egg-info",
    "*_cache",
    "__pycache__",
)


def build_wheel(out: Path) -> Path:
    """The wheel of a copy of the sources (a build writes build/ and egg-info beside setup.py)."""
    sources = out / "src"
    shutil.copytree(ROOT, sources, ignore=shutil.ignore_patterns(*NOT_SOURCES))
    # setuptools >= 70.1 builds wheels itself: then no build environment is fetched
    flags = ["--no-build-isolation"] if importlib.util.find_spec("setuptools.command.bdist_wheel") else []
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", *flags, "-w", str(out), str(sources)], check=True, timeout=300)
    (wheel,) = out.glob("jagg_grpo-*.whl")
    return wheel


def fresh_environment(folder: Path, wheel: Path) -> Path:
    """A venv holding only the wheel, with this environment's packages on its path; its bin folder."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True, timeout=120)
    python = folder / "bin" / "python"
    site = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True
    ).stdout.strip()
    Path(site, "pinned.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "--python", str(python)]
    subprocess.run([*pip, "install", "--no-deps", str(wheel)], check=True, timeout=300)
    return folder / "bin"


@pytest.mark.slow
def test_the_wheel_runs_from_any_folder(tmp_path):
    bin_dir = fresh_environment(tmp_path / "venv", build_wheel(tmp_path / "wheel"))
    user = tmp_path / "user"
    user.mkdir()
    where = subprocess.run(
        [bin_dir / "python", "-c", "import train, testbed; print(train.__file__); print(testbed.__file__)"],
        cwd=user,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert all(Path(p).is_relative_to(tmp_path / "venv") for p in where), where  # the wheel's, not the sources'
    for script in SCRIPTS:
        shown = subprocess.run([bin_dir / script, "--help"], cwd=user, capture_output=True, text=True, timeout=300)
        assert shown.returncode == 0 and "python -m train" in shown.stdout, (script, shown.stderr[-2000:])
    args = ["num_steps=1", "eval.every=0", "checkpoint.export=false", "logging.progress_bar=false"]
    done = subprocess.run([bin_dir / "jagg-train", *args], cwd=user, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = (user / "runs" / "demo").iterdir()
    assert (run / "metrics.jsonl").read_text().count("\n") == 1
    assert (run / "checkpoints" / "step_00000001" / "COMPLETE").is_file()
