"""``scripts/gpu_check.sh --cpu --out DIR``: the GPU check's CPU mode writes every file of its results folder
(docs/gpu_check.md), SHA256SUMS verifies them, the metrics are finite and of their kind, and the JAGG gradient
under bf16 autocast is within a bound of bf16's epsilon of the float32 one; bad arguments stop in one line.

The bound, 32 x bf16's epsilon (2^-7): a parameter gradient of the tiny random transformer under bf16 autocast is
off its float32 value by 12 to 22 eps (scripts/gpu_check_jagg.py); JAGG against exact differs by far more (its
approximation on random weights), so a check that compared other gradients would fail the bound."""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
RUNS = ("flux_dance", "qwenimage_flow_fast")
BOUND = 32 * torch.finfo(torch.bfloat16).eps
PER_RUN = ("preflight.json", "preflight.log", "console.log", ".hydra/config.yaml")
PHASES = ("rollout", "reward", "update", "optimizer", "step")


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> Path:
    """The CPU mode's folder, as the documented command writes it (scripts/gpu_check.sh, this interpreter)."""
    out = tmp_path_factory.mktemp("gpu_check") / "out"
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONUNBUFFERED": "1"}
    command = [str(SCRIPT), "--cpu", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return out


def _sums(out: Path) -> dict[str, str]:
    lines = (out / "SHA256SUMS").read_text().splitlines()
    return {line.split("  ", 1)[1]: line.split("  ", 1)[0] for line in lines}


@pytest.mark.slow
def test_every_file_is_there_and_sha256sums_verifies_it(results):
    expected = {"metrics.json", "versions.json", *(f"configs/{run}.yaml" for run in RUNS)}
    expected |= {f"preflight/{run}/{name}" for run in RUNS for name in PER_RUN}
    files = {p.relative_to(results).as_posix() for p in results.rglob("*") if p.is_file()} - {"SHA256SUMS"}
    assert expected <= files, sorted(expected - files)
    sums = _sums(results)
    assert set(sums) == files  # every file, and nothing that is not there
    for name, digest in sums.items():
        assert hashlib.sha256((results / name).read_bytes()).hexdigest() == digest, name


@pytest.mark.slow
def test_the_jagg_gradient_in_bf16_is_within_its_dtypes_bound(results):
    metrics = json.loads((results / "metrics.json").read_text())
    assert metrics["version"] == 1 and metrics["mode"] == "cpu" and metrics["passed"] is True
    assert metrics["commit"] == "unknown" or len(metrics["commit"]) == 40
    assert "no pretrained weights" in metrics["stand_in"]
    jagg = metrics["jagg"]
    errors = jagg["relative_errors"]
    assert set(errors) == {"jagg_bf16_vs_float32", "exact_bf16_vs_float32", "jagg_vs_exact_float32",
                           "jagg_bf16_vs_exact_float32"}  # fmt: skip
    assert all(_finite(e) and e > 0 for e in errors.values()), errors  # > 0: bf16 rounded (autocast was on)
    assert errors["jagg_bf16_vs_float32"] < BOUND and errors["exact_bf16_vs_float32"] < BOUND, errors
    assert errors["jagg_vs_exact_float32"] > BOUND  # two different gradients: the bound tells them apart
    assert jagg["bound"] == pytest.approx(BOUND, rel=1e-12) and jagg["passed"] is True
    assert jagg["blocks"] == "1+1" and jagg["parameters"] > 0 and jagg["device"] == "cpu"


@pytest.mark.slow
def test_each_preflight_measured_its_step(results):
    metrics = json.loads((results / "metrics.json").read_text())
    assert set(metrics["preflight"]) == set(RUNS) and metrics["compile"] is None  # no compiled step on CPU
    for run in RUNS:
        found = metrics["preflight"][run]
        assert found["exit_status"] == 0 and found["verdict"] == 0 and found["model"] == "stand-in", run
        step = found["step"]
        assert all(_finite(step["seconds"][phase]) and step["seconds"][phase] >= 0 for phase in PHASES), step
        assert step["seconds"]["step"] > 0 and _finite(step["mfu"]) and step["mfu"] > 0, step
        assert step["peak_bytes"] is None  # no allocator statistics on CPU
        assert found["checks"]["attention"].startswith("skipped: CPU")
        assert any(
            name.startswith("collectives") and line.startswith("passed") for name, line in found["checks"].items()
        )
        assert found["plan"]["fits"] in (True, False) and _finite(found["plan"]["step_seconds"])
        config = yaml.safe_load((results / "configs" / f"{run}.yaml").read_text())
        assert config["experiment"] == run and "${" not in (results / "configs" / f"{run}.yaml").read_text()
        assert json.loads((results / "preflight" / run / "preflight.json").read_text())["exit_status"] == 0


@pytest.mark.slow
def test_versions_name_this_machine(results):
    versions = json.loads((results / "versions.json").read_text())
    assert versions["torch"] == torch.__version__ and versions["machine"]["device"] == "cpu"
    assert versions["python"] == ".".join(map(str, sys.version_info[:3]))


def test_bad_arguments_stop_in_one_line_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    from gpu_check import parse_args

    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "old.txt").write_text("x")
    cases = [
        (["--cpu", "--out", str(tmp_path / "full")], "gpu_check: --out ", "give a new folder"),
        (["--cpu", "--flux-path", str(tmp_path), "--out", str(tmp_path / "new")], "gpu_check: --flux-path ",
         "holds no model_index.json"),
    ]  # fmt: skip
    if not torch.cuda.is_available():
        cases.append((["--out", str(tmp_path / "gpu")], "gpu_check: no CUDA device here", "gpu_check.sh --cpu"))
    for argv, start, fix in cases:
        with pytest.raises(SystemExit) as stop:
            parse_args(argv)
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert stop.value.code == 2 and line.startswith(start) and fix in line, line
    assert not (tmp_path / "new").exists() and not (tmp_path / "gpu").exists()
