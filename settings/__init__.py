"""What every typed settings group uses, from the sampler's to the trainer's: ``Choice``, the base of the settings
that pick one of a few named options (``SDEKind``, ``DType``, ...), and the range checks of ``__post_init__``.
It imports nothing of the project, so that samplers/, models/, rewards/ and train/ can all use it.

A member's name is the string a user types and its value that same string, so a YAML file or an override
reads as before, omegaconf refuses any other string when it composes, and the member formats as that
string (``f"{SDEKind.cps}"`` is ``cps``, as ``enum.StrEnum`` does from Python 3.11 on; this project
supports 3.10). Code compares members (``kind is SDEKind.cps``).
"""

from __future__ import annotations

import math
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


def _bounds(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if high is None:
        return f"{'>' if low_open else '>='} {low:g}"
    if low is None:
        return f"{'<' if high_open else '<='} {high:g}"
    return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


def check_range(
    value: float,
    name: str,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    why: str = "",
) -> None:
    """ValueError unless ``value`` is finite and within its bounds (an open end excludes the bound itself);
    the message starts with ``name`` and ends with ``why``."""
    ok = math.isfinite(value)
    ok = ok and (low is None or (value > low if low_open else value >= low))
    ok = ok and (high is None or (value < high if high_open else value <= high))
    if not ok:
        finite = "" if math.isfinite(value) else "a finite number "
        raise ValueError(f"{name} must be {finite}{_bounds(low, high, low_open, high_open)}, got {value}{why}")


def positive(value: float, name: str, why: str = "") -> None:
    check_range(value, name, low=0, low_open=True, why=why)


def non_negative(value: float, name: str, why: str = "") -> None:
    check_range(value, name, low=0, why=why)
