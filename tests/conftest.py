import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

# the tests' shared modules (tiny models, the two-rank launcher) and the scripts torchrun starts
sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))


@pytest.fixture
def repo_root(monkeypatch) -> Path:
    """The repository as the current folder: the tiny experiment's prompt file is relative to it."""
    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    return root


@pytest.fixture
def float64():
    """Math tests run in float64; restore the default so other tests are unaffected."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Callable[[str], Path]:
    """``tiny_dir(name)``: the tiny random pipeline folder of registered backbone ``name`` (the
    adapter's own ``tiny_pipeline``, models/tiny.py), built once per test session on first use."""
    from models.tiny import build_tiny

    root = tmp_path_factory.mktemp("backbones")
    return lambda name: build_tiny(name, root / name)


@pytest.fixture(scope="module")
def backbones(tiny_dir) -> dict:
    """Every registered backbone loaded in float32 from its tiny pipeline, once per test module."""
    from models import backbone_names, load_backbone

    return {name: load_backbone(name, tiny_dir(name), dtype="float32") for name in backbone_names()}


@pytest.fixture(scope="session")
def tiny_flux_dir(tiny_dir) -> Path:
    """The tiny Flux pipeline: the backbone of experiment=tiny, which the trainer tests run."""
    return tiny_dir("flux")


@pytest.fixture(scope="session")
def tiny_clip_dir(tmp_path_factory) -> Path:
    """A tiny random CLIPModel with its processor (rewards/tiny.py), for a reward that is smooth in the images."""
    from rewards.tiny import save_tiny_clip

    return save_tiny_clip(tmp_path_factory.mktemp("clip"), seed=0)
