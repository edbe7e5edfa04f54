"""Exponential moving average of the trainable parameters.

After each optimizer step: shadow <- decay * shadow + (1 - decay) * param, with the shadow kept
in float32 whatever the parameter dtype (a bf16 shadow would round away updates of size
(1 - decay) * delta). Under FSDP2 the parameters are DTensors: the shadow of each one is a DTensor
with the same mesh and placements, and every operation runs on the local shards (no
communication), so ``state_dict()`` can go through ``torch.distributed.checkpoint`` sharded.
Shadows are keyed by the position of the parameter in the list given at construction.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from settings import check_range


def _local(tensor: Tensor) -> Tensor:
    """The tensor whose storage this rank owns (the local shard of a DTensor)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _float32_copy(param: Tensor) -> Tensor:
    local = _local(param).detach().to(torch.float32, copy=True)
    if isinstance(param, DTensor):
        return DTensor.from_local(
            local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    return local


class EMA:
    """Float32 moving average of ``parameters`` (only those with requires_grad are tracked)."""

    def __init__(self, parameters: Iterable[nn.Parameter], decay: float) -> None:
        check_range(decay, "EMA decay", low=0, high=1)
        self.decay = decay
        self.num_updates = 0
        self.params = [p for p in parameters if p.requires_grad]
        if not self.params:
            raise ValueError("EMA: no trainable parameter (requires_grad=True) was given")
        with torch.no_grad():
            self.shadow = [_float32_copy(p) for p in self.params]

    @torch.no_grad()
    def update(self) -> None:
        """shadow <- decay * shadow + (1 - decay) * param, on local shards."""
        weight = 1.0 - self.decay
        for shadow, param in zip(self.shadow, self.params, strict=True):
            _local(shadow).lerp_(_local(param).float(), weight)
        self.num_updates += 1

    @torch.no_grad()
    def copy_to(self, parameters: Iterable[nn.Parameter] | None = None) -> None:
        """Write the averaged weights into ``parameters`` (default: the tracked ones)."""
        params = self._check(parameters)
        for shadow, param in zip(self.shadow, params, strict=True):
            _local(param).copy_(_local(shadow))

    @contextmanager
    def swapped(self, parameters: Iterable[nn.Parameter] | None = None) -> Iterator[None]:
        """Evaluate with the averaged weights inside the block; the trained ones come back after."""
        params = self._check(parameters)
        with torch.no_grad():
            backup = [_local(p).detach().clone() for p in params]
        self.copy_to(params)
        try:
            yield
        finally:
            with torch.no_grad():
                for saved, param in zip(backup, params, strict=True):
                    _local(param).copy_(saved)

    def state_dict(self) -> dict[str, Any]:
        """{"decay", "num_updates", "shadow": {"<index>": float32 tensor or DTensor}} (no copies)."""
        return {
            "decay": self.decay,
            "num_updates": self.num_updates,
            "shadow": {str(i): s for i, s in enumerate(self.shadow)},
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        shadow = state["shadow"]
        if len(shadow) != len(self.shadow):
            raise ValueError(f"EMA state has {len(shadow)} tensors, this EMA tracks {len(self.shadow)} parameters")
        for i, target in enumerate(self.shadow):
            source = shadow[str(i)]
            if source.shape != target.shape:
                raise ValueError(
                    f"EMA state tensor {i} has shape {tuple(source.shape)}, expected {tuple(target.shape)}"
                )
            if source is not target:
                _local(target).copy_(_local(source))
        self.decay = float(state["decay"])
        self.num_updates = int(state["num_updates"])

    def _check(self, parameters: Iterable[nn.Parameter] | None) -> list[nn.Parameter]:
        if parameters is None:
            return self.params
        params = [p for p in parameters if p.requires_grad]
        if len(params) != len(self.params) or any(p.shape != q.shape for p, q in zip(params, self.params)):
            raise ValueError("EMA.swapped/copy_to: parameters differ from the ones the EMA was built with")
        return params
