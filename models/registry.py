"""Backbone registry: ``@register_backbone(name)`` on an adapter class, ``load_backbone(name, ...)``.

Adapters are found by module discovery: the first lookup imports every module of the ``models``
package, so adding a backbone means one new adapter file here (plus its config file), nothing else.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from models.base import Backbone

_BACKBONES: dict[str, type[Backbone]] = {}


def register_backbone(name: str) -> Callable[[type[Backbone]], type[Backbone]]:
    """Class decorator: make the adapter loadable as ``name``."""

    def decorate(cls: type[Backbone]) -> type[Backbone]:
        if name in _BACKBONES and _BACKBONES[name] is not cls:
            raise ValueError(
                f"backbone {name!r} is registered twice: {_BACKBONES[name].__qualname__} and {cls.__qualname__}"
            )
        cls.name = name
        _BACKBONES[name] = cls
        return cls

    return decorate


@functools.cache
def _discover() -> None:
    for module in pkgutil.iter_modules([str(Path(__file__).parent)]):
        importlib.import_module(f"{__package__}.{module.name}")


def backbone_names() -> list[str]:
    _discover()
    return sorted(_BACKBONES)


def get_backbone_class(name: str) -> type[Backbone]:
    _discover()
    if name not in _BACKBONES:
        raise ValueError(f"name must be one of {sorted(_BACKBONES)}, got {name!r}")
    return _BACKBONES[name]


def load_backbone(
    name: str,
    path: str | Path | None = None,
    *,
    dtype: torch.dtype | str = torch.bfloat16,
    device: torch.device | str = "cpu",
    **kwargs: Any,
) -> Backbone:
    """Load backbone ``name`` from a diffusers folder ``path``.

    ``kwargs`` are the adapter's own: per-component folders (``transformer=...``, ``vae=...``),
    ``embedding_cache=<folder>``, ``skip=(component names not to load)`` and encoding options (e.g.
    Flux's ``guidance``); an unknown keyword raises ValueError listing the accepted ones.
    """
    return get_backbone_class(name).load(path, dtype=dtype, device=device, **kwargs)
