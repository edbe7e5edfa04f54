"""Loading the components of a diffusers pipeline folder, one by one, with errors that name them.

A backbone is a set of named components (``transformer``, ``vae``, ``text_encoder``, ...). Each is
read from ``<root>/<name>`` (the layout ``save_pretrained`` writes) unless an explicit folder is
given for it. Before any weights are read, every component's config file must exist and name the
expected class; a missing component raises FileNotFoundError and a mismatched one ValueError, both
naming the component and the path.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers.utils import logging as diffusers_logging
from transformers.utils import logging as transformers_logging


@contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """No per-file progress bars from diffusers / transformers while loading or saving (one line
    per component per rank otherwise)."""
    libraries = [lib for lib in (diffusers_logging, transformers_logging) if lib.is_progress_bar_enabled()]
    for lib in libraries:
        lib.disable_progress_bar()
    try:
        yield
    finally:
        for lib in libraries:
            lib.enable_progress_bar()


@dataclass(frozen=True)
class Component:
    """How to find, check and load one component."""

    name: str  # folder name inside a pipeline folder, and the keyword that overrides its path
    loader: Any  # a class with from_pretrained(folder, ...)
    config_file: str = "config.json"  # the file that marks a folder as this component
    is_module: bool = True  # nn.Module: loaded in the backbone's dtype, in eval mode, frozen

    @property
    def class_names(self) -> tuple[str, ...]:
        """The class names that file may record: the loader's (a tokenizer's fast twin too)."""
        name = self.loader.__name__
        return (name, f"{name}Fast") if self.config_file == "tokenizer_config.json" else (name,)


def component_folders(
    backbone: str, components: Collection[Component], root: str | Path | None, overrides: Mapping[str, str | Path]
) -> dict[str, Path]:
    """The folder of each component: ``overrides[name]`` or ``<root>/<name>``."""
    folders = {}
    for comp in components:
        if comp.name in overrides and overrides[comp.name] is not None:
            folders[comp.name] = Path(overrides[comp.name])
        elif root is not None:
            folders[comp.name] = Path(root) / comp.name
        else:
            raise ValueError(
                f"{backbone}: no folder for component {comp.name!r}: pass the pipeline folder (path) or "
                f"{comp.name}=<folder>"
            )
    return folders


def read_config(backbone: str, comp: Component, folder: Path) -> dict[str, Any]:
    """The component's config, after checking that the folder holds the expected class."""
    path = folder / comp.config_file
    if not path.is_file():
        raise FileNotFoundError(
            f"{backbone}: component {comp.name!r} is missing: {path} does not exist. Point the pipeline folder "
            f"(path) at a complete diffusers folder or pass {comp.name}=<folder holding {comp.config_file}>"
        )
    config = json.loads(path.read_text())
    # the class names it records: diffusers' _class_name, a tokenizer's tokenizer_class, transformers' architectures
    recorded = [config.get("_class_name"), config.get("tokenizer_class"), *(config.get("architectures") or [])]
    found = [name for name in recorded if name]
    if found and not set(found) & set(comp.class_names):
        raise ValueError(
            f"{backbone}: component {comp.name!r} at {folder} is a {found[0]}, expected one of "
            f"{list(comp.class_names)}; check the pipeline folder (path) or the {comp.name}= override"
        )
    return config


def load_component(backbone: str, comp: Component, folder: Path, *, dtype: torch.dtype) -> Any:
    """Load one checked component; weights that do not fit the config raise ValueError naming it."""
    try:
        with quiet_progress_bars():
            if not comp.is_module:
                return comp.loader.from_pretrained(folder)
            module = comp.loader.from_pretrained(folder, dtype=dtype)
        return module.eval().requires_grad_(False)
    except (OSError, RuntimeError, ValueError) as err:
        raise ValueError(f"{backbone}: could not load component {comp.name!r} from {folder}: {err}") from err


Entry = tuple[str, Path, Any]  # (component, folder, value)


def config_entry(
    configs: Mapping[str, Mapping[str, Any]], folders: Mapping[str, Path], name: str, key: str, *, factor: int = 1
) -> Entry | None:
    """``factor * configs[name][key]`` with where it came from; None when ``name`` is not loaded."""
    if name not in configs:
        return None
    return name, folders[name], factor * configs[name][key]


def check_equal(backbone: str, what: str, a: Entry | None, b: Entry | None) -> None:
    """Raise when two loaded components disagree on a size (skipped when either is not loaded)."""
    if a is not None and b is not None and a[2] != b[2]:
        raise ValueError(
            f"{backbone}: components do not fit together ({what}): {a[0]!r} at {a[1]} has {a[2]}, "
            f"{b[0]!r} at {b[1]} has {b[2]}"
        )
