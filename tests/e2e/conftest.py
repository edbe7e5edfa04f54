"""Fixtures the end-to-end tests of the trainer's faults share (tests/e2e/test_faults_*.py,
tests/e2e/test_run_record.py); their helpers are tests/helpers/run_folders.py."""

from collections.abc import Callable
from pathlib import Path

import pytest
from run_folders import train_small
from small_run import FAST, command


@pytest.fixture(scope="session")
def trained(tmp_path_factory, tiny_flux_dir) -> Path:
    """A finished 2-step run with checkpoints after steps 1 and 2, one per test session (do not modify: copy it)."""
    return train_small(tmp_path_factory.mktemp("trained") / "run", tiny_flux_dir)


@pytest.fixture
def launch(capsys, tiny_flux_dir) -> Callable[..., tuple]:
    """``launch(run_dir, *overrides)``: ``small_run.command`` on the small run of the tiny pipeline (``FAST``,
    ``model.path``), a later override replacing one of the same key; ``module=`` and ``stdout=`` as there."""
    return lambda run_dir, *overrides, **options: command(
        capsys, run_dir, [*FAST, f"model.path={tiny_flux_dir}", *overrides], **options
    )
