"""The files shipped inside the packages: the testbed's pipeline and prompt lists (``testbed/pipeline``,
``testbed/prompts``) and the architecture configs the planner reads (``configs/arch``).

A shipped default names one as ``${shipped:<package>/<path in it>}`` (configs/model/testbed.yaml); the resolver
(train/cli/compose.py) finds it through importlib.resources wherever the package is installed (a wheel, an
editable install, the repository), so the default job runs from any folder. A path the user passes stays as
written: relative to the folder they launched from.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def shipped(reference: str) -> Path:
    """The installed location of ``<package>/<path in it>``, e.g. ``testbed/pipeline``.

    Raises FileNotFoundError when the package is not installed or does not hold the path (a wheel built
    without its package data).
    """
    package, _, inside = reference.strip("/").partition("/")
    try:
        root = resources.files(package)
    except ModuleNotFoundError:
        raise FileNotFoundError(f"shipped:{reference}: no package {package!r} is installed") from None
    location = root.joinpath(inside) if inside else root
    if not isinstance(location, Path) or not location.exists():
        raise FileNotFoundError(f"shipped:{reference}: {package!r} ({root}) holds no {inside!r}; reinstall jagg-grpo")
    return location
