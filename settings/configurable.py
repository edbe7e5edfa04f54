"""A settings group that builds the part that reads it, as torchtitan's ``Configurable.Config.build`` does.

``group.build(**runtime)`` is ``owner()(group, **runtime)``: the part gets its own settings whole and, as keyword
arguments, the runtime objects only the assembly holds (built parts, the process group, the device). A runtime
argument that repeats one of the group's fields is refused: a setting reaches its part through its group, never as
a copy beside it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Configurable(Generic[T]):
    """The base of a settings dataclass that builds a part of type ``T`` (``owner``)."""

    # OmegaConf reads the arguments of a structured config's first generic base as a Dict's (key, value) types
    # (omegaconf/_utils.py, get_dict_key_value_types); these are what it takes for a plain dataclass
    __args__ = (Any, Any)

    @classmethod
    def owner(cls) -> Callable[..., T]:
        """The part this group builds: called with the group, then the runtime arguments by name."""
        raise NotImplementedError(f"{cls.__name__} names no part to build")

    def build(self, **runtime: Any) -> T:
        """The part, built from these settings and ``runtime``; TypeError for a runtime argument that is a field."""
        repeated = sorted({f.name for f in fields(self)} & runtime.keys())  # type: ignore[arg-type]
        if repeated:
            raise TypeError(
                f"{type(self).__name__}.build: {', '.join(repeated)} are settings of the group; set them in it "
                "rather than pass them at build time"
            )
        return self.owner()(self, **runtime)
