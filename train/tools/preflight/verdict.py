"""What the preflight found: each check passed, warned, failed or skipped with one line (and, when not passed, the
fix), per rank or for every rank alike; the verdict on the console and in ``<run>/preflight.json``.

``preflight.json`` (``SCHEMA_VERSION``): ``{"version", "exit_status", "checks": [{"name", "status", "line", "fix",
"ranks"}], "machine": [one per rank], "step": {...}, "plan": {...}}``; ``ranks`` is null for a check every rank
answered alike, else the ranks of that answer.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from settings import Choice
from train.ground.errors import UserError

SCHEMA_VERSION = 1
FAILED_STATUS = 2  # the exit status when the run would fail, as for a user's mistake
T = TypeVar("T")


class Status(Choice):
    passed = "passed"
    warned = "warned"
    failed = "failed"
    skipped = "skipped"  # not applicable here (one process, CPU, a setting that is off), or after a failure


@dataclass(frozen=True)
class Check:
    """One check's answer: ``line`` says what was found, ``fix`` (warned or failed) what to change."""

    name: str
    status: Status
    line: str
    fix: str = ""
    ranks: tuple[int, ...] | None = None  # None: every rank answered alike


@dataclass
class RankChecks:
    """The checks of one rank, in the order they ran."""

    rank: int
    checks: list[Check] = field(default_factory=list)

    def add(self, name: str, status: Status, line: str, fix: str = "") -> None:
        self.checks.append(Check(name, status, line, fix))

    def attempt(self, name: str, fn: Callable[[], T], passed: str | Callable[[T], str]) -> T | None:
        """``fn()``: passed with ``passed`` (or ``passed(result)``), or failed with a user error's own line."""
        try:
            result = fn()
        except (UserError, ValueError, FileNotFoundError, PermissionError) as err:
            self.add(name, Status.failed, str(err).splitlines()[0], "the message names the setting or path to change")
            return None
        self.add(name, Status.passed, passed(result) if callable(passed) else passed)
        return result

    def failed(self) -> bool:
        return any(c.status is Status.failed for c in self.checks)


def merged(per_rank: Iterable[RankChecks]) -> list[Check]:
    """One entry per check and answer: the ranks named where the ranks answered differently."""
    ranks = list(per_rank)
    answers: dict[tuple[str, Status, str, str], list[int]] = {}
    for rc in ranks:
        for c in rc.checks:
            answers.setdefault((c.name, c.status, c.line, c.fix), []).append(rc.rank)
    everyone = sorted(rc.rank for rc in ranks)
    names = list(dict.fromkeys(key[0] for key in answers))  # each check's answers together, in the order they ran
    return [
        Check(name, status, line, fix, None if sorted(who) == everyone else tuple(who))
        for (name, status, line, fix), who in sorted(answers.items(), key=lambda item: names.index(item[0][0]))
    ]


@dataclass
class Verdict:
    checks: list[Check]
    machine: list[dict[str, Any]]  # one description per rank
    step: dict[str, Any] = field(default_factory=dict)  # the measured step at reduced depth
    plan: dict[str, Any] = field(default_factory=dict)  # the planner's, traced and corrected

    @property
    def exit_status(self) -> int:
        return FAILED_STATUS if any(c.status is Status.failed for c in self.checks) else 0

    def to_json(self) -> dict[str, Any]:
        checks = [{**asdict(c), "status": str(c.status), "ranks": None if c.ranks is None else list(c.ranks)}
                  for c in self.checks]  # fmt: skip
        return {
            "version": SCHEMA_VERSION,
            "exit_status": self.exit_status,
            "checks": checks,
            "machine": self.machine,
            "step": self.step,
            "plan": self.plan,
        }

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")

    def lines(self) -> list[str]:
        width = max((len(c.name) for c in self.checks), default=0)
        out = []
        for c in self.checks:
            who = "" if c.ranks is None else f"rank {','.join(map(str, c.ranks))}: "
            out.append(f"  {c.status.value:<7} {c.name:<{width}}  {who}{c.line}")
            if c.fix and c.status in (Status.warned, Status.failed):
                out.append(f"  {'':<7} {'':<{width}}  fix: {c.fix}")
        failed = sum(c.status is Status.failed for c in self.checks)
        warned = sum(c.status is Status.warned for c in self.checks)
        if failed:
            out.append(f"verdict: the run would fail ({failed} failed, {warned} warned); exit status {FAILED_STATUS}")
        else:
            out.append(f"verdict: the run can start ({warned} warned)")
        return out
