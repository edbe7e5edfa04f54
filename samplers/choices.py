"""``Choice``: the base of the settings that pick one of a few named options (``SDEKind``, ``DType``, ...).

A member's name is the string a user types and its value that same string, so a YAML file or an override
reads as before, omegaconf refuses any other string when it composes, and the member formats as that
string (``f"{SDEKind.cps}"`` is ``cps``, as ``enum.StrEnum`` does from Python 3.11 on; this project
supports 3.10). Code compares members (``kind is SDEKind.cps``).
"""

from __future__ import annotations

from enum import Enum
from typing import TypeVar

C = TypeVar("C", bound="Choice")


class Choice(str, Enum):
    """A named option whose value is its name."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


def member(choice: type[C], value: object, name: str) -> C:
    """``value`` as a member of ``choice`` (a member, or the string that names one); ValueError naming ``name``
    and the accepted values otherwise."""
    try:
        return choice(value)
    except ValueError:
        accepted = ", ".join(m.value for m in choice)
        raise ValueError(f"{name}={value!r} is not valid; accepted values: {accepted}") from None
