import pytest
import torch


@pytest.fixture
def float64():
    """Math tests run in float64; restore the default so other tests are unaffected."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


@pytest.fixture(scope="session")
def tiny_flux_dir(tmp_path_factory):
    """A tiny random FLUX pipeline folder, built once per test session (models/tiny.py)."""
    from models.tiny import build_tiny_flux

    return build_tiny_flux(tmp_path_factory.mktemp("backbones") / "flux")


@pytest.fixture(scope="session")
def tiny_qwenimage_dir(tmp_path_factory):
    """A tiny random Qwen-Image pipeline folder, built once per test session (models/tiny.py)."""
    from models.tiny import build_tiny_qwenimage

    return build_tiny_qwenimage(tmp_path_factory.mktemp("backbones") / "qwenimage")
