"""EMA math on hand-made numbers, float32 shadows, swapping and state dicts (sharded EMA: see
test_distributed_fsdp.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from train.parts.optim.ema import EMA


def param(*values: float, dtype: torch.dtype = torch.float32) -> nn.Parameter:
    return nn.Parameter(torch.tensor(values, dtype=dtype))


def test_update_hand_computed() -> None:
    p = param(1.0, 2.0)
    ema = EMA([p], decay=0.9)
    torch.testing.assert_close(ema.shadow[0], torch.tensor([1.0, 2.0]))  # starts at the parameter
    with torch.no_grad():
        p.copy_(torch.tensor([2.0, 4.0]))
    ema.update()  # 0.9 * [1, 2] + 0.1 * [2, 4] = [1.1, 2.2]
    torch.testing.assert_close(ema.shadow[0], torch.tensor([1.1, 2.2]))
    with torch.no_grad():
        p.zero_()
    ema.update()  # 0.9 * [1.1, 2.2] + 0.1 * 0 = [0.99, 1.98]
    torch.testing.assert_close(ema.shadow[0], torch.tensor([0.99, 1.98]))
    assert ema.num_updates == 2


def test_shadow_is_float32_for_bf16_params() -> None:
    p = param(1.0, dtype=torch.bfloat16)
    ema = EMA([p], decay=0.999)
    with torch.no_grad():
        p.fill_(2.0)
    ema.update()  # 1 + 0.001 * (2 - 1) = 1.001: not representable in bf16 (spacing 2^-7 near 1)
    assert ema.shadow[0].dtype == torch.float32
    assert float(ema.shadow[0]) == pytest.approx(1.001, abs=1e-6)


def test_frozen_parameters_are_not_tracked() -> None:
    frozen = param(5.0)
    frozen.requires_grad_(False)
    trained = param(1.0)
    ema = EMA([frozen, trained], decay=0.5)
    assert ema.params == [trained] and len(ema.shadow) == 1


def test_swapped_uses_average_then_restores_even_on_error() -> None:
    p = param(1.0, 3.0)
    ema = EMA([p], decay=0.5)
    with torch.no_grad():
        p.copy_(torch.tensor([3.0, 5.0]))
    ema.update()  # shadow = [2, 4]
    with ema.swapped([p]):
        torch.testing.assert_close(p.detach(), torch.tensor([2.0, 4.0]))
    torch.testing.assert_close(p.detach(), torch.tensor([3.0, 5.0]))
    with pytest.raises(RuntimeError, match="eval failed"), ema.swapped():
        raise RuntimeError("eval failed")
    torch.testing.assert_close(p.detach(), torch.tensor([3.0, 5.0]))


def test_swapped_rejects_other_parameters() -> None:
    ema = EMA([param(1.0, 2.0)], decay=0.5)
    with pytest.raises(ValueError, match="differ"), ema.swapped([param(1.0)]):
        pass


def test_state_dict_round_trip() -> None:
    p = param(1.0, 2.0)
    ema = EMA([p], decay=0.9)
    with torch.no_grad():
        p.add_(1.0)
    ema.update()
    other = EMA([param(0.0, 0.0)], decay=0.1)
    other.load_state_dict(ema.state_dict())
    torch.testing.assert_close(other.shadow[0], ema.shadow[0])
    assert (other.decay, other.num_updates) == (0.9, 1)
    with pytest.raises(ValueError, match="shape"):
        EMA([param(0.0)], decay=0.9).load_state_dict(ema.state_dict())


def test_rejects_bad_decay_and_no_trainable_params() -> None:
    with pytest.raises(ValueError, match="decay"):
        EMA([param(1.0)], decay=1.5)
    frozen = param(1.0)
    frozen.requires_grad_(False)
    with pytest.raises(ValueError, match="trainable"):
        EMA([frozen], decay=0.9)
