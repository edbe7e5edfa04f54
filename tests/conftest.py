import pytest
import torch


@pytest.fixture
def float64():
    """Math tests run in float64; restore the default so other tests are unaffected."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)
