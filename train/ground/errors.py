"""The errors a command reports in one line instead of a traceback (train/cli/reporting.py prints them).

* ``UserError``: something the user gave is wrong (a setting, a path, a file, a checkpoint). The
  command prints its message, which names the field or file and the fix, and exits with status 2.
  ``ConfigError`` is a ValueError and ``PathError`` a FileNotFoundError, so callers that catch
  those (and the tests) keep working; ``CheckpointError`` says whether the checkpoint is damaged
  (``resume=auto`` then falls back to the previous one) or merely does not fit the run.
  ``SaveFailed``: a checkpoint or a metrics row could not be written (``DiskFull``: the run folder's disk is
  full); ``NotLearning``: a run whose steps cannot change the weights stopped (after a checkpoint); ``Diverged``:
  a run whose weights or images left any sane range stopped (the diverged weights unsaved); ``ScorerFailed``: a
  reward's scorer (its server) answered in a way a setting or the server must fix; all exit with status 2.
* ``Preempted``: SIGTERM or the first Ctrl+C stopped training after writing a checkpoint; exit status
  143 (128 + 15, what a process killed by SIGTERM reports) or 130 (128 + 2, SIGINT), so a scheduler or a
  script does not take the job for finished.
* ``RankFailed``: another rank raised in a part of a training step that is its own (the reward phase), and
  the ranks learned of it together (``mark_agreed`` on the failing rank's exception): every rank took part
  in the checkpoint of the steps trained before it; exit status 1. The failing rank reports its own error.
* ``Interrupted``: Ctrl+C stopped a command at once (a second one during training, or one before it);
  exit status 130. Its message says what was not saved.

Any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager


class Stop(Exception):
    """Ends a command with one line on stderr and ``exit_code``."""

    exit_code = 1
    label = "error"  # the word after the program name: "python -m train: error: ..."
    # Raised on every rank alike (a setting, or a decision the ranks took together): rank 0 alone prints it.
    same_on_every_rank = False

    def printed_by(self, rank: int) -> bool:
        """Whether rank ``rank`` prints the line: rank 0 alone when every rank raised it alike, else every rank."""
        return rank == 0 or not self.same_on_every_rank


class UserError(Stop):
    exit_code = 2


class ConfigError(UserError, ValueError):
    """A setting is impossible; every rank composes the same settings."""

    same_on_every_rank = True


class PathError(UserError, FileNotFoundError):
    """A file or folder named by a setting is missing (it may be missing on some nodes only)."""


class CheckpointError(UserError, ValueError):
    """A checkpoint cannot be resumed from. ``damaged``: its files are broken, so an earlier one may serve."""

    same_on_every_rank = True  # raised after the ranks agreed (train/parts/checkpoint/manager.py)

    def __init__(self, message: str, *, damaged: bool) -> None:
        super().__init__(message)
        self.damaged = damaged


class Preempted(Stop):
    """SIGTERM or Ctrl+C: a checkpoint was written and training stopped; ``resume=auto`` continues."""

    exit_code = 143
    label = "stopped"
    same_on_every_rank = True

    def __init__(self, message: str, *, signum: int = 15) -> None:
        super().__init__(message)
        self.exit_code = 128 + signum


class Interrupted(Stop):
    """Ctrl+C stopped the command at once."""

    exit_code = 130
    label = "stopped"
    same_on_every_rank = True  # Ctrl+C reaches every process of the terminal


class SaveFailed(UserError):
    """A file of the run (a checkpoint, a row of metrics.jsonl) could not be written: its disk is full or cannot be
    written (read-only, gone); the checkpoints already written are intact."""

    same_on_every_rank = True  # the ranks agree on the verdict (train/parts/checkpoint/manager.py)


class DiskFull(SaveFailed):
    """The disk of the run folder cannot take the next checkpoint or row; the checkpoints already written are intact."""


class NotLearning(UserError):
    """Training stopped after ``health.max_bad_steps`` steps in a row that could not change the weights."""

    same_on_every_rank = True  # decided from metrics every rank shares


class GuardStopped(UserError):
    """``eval.guard.action=stop``: the watched evaluation metric fell while the training reward rose, for
    ``eval.guard.patience`` evaluations in a row; the step was checkpointed and the run exported first."""

    same_on_every_rank = True  # decided from metrics every rank shares


class Diverged(UserError):
    """Training stopped because the weights or the images left any sane range; those weights were not saved."""

    same_on_every_rank = True  # decided from metrics every rank shares


class ScorerFailed(UserError):
    """A reward's scorer cannot score in a way a setting or its server must fix (an answer outside the remote
    protocol, a refused token, another scorer behind the URL); raised by the rank whose scorer failed."""


class StartRefused(UserError):
    """A start-up check failed on some ranks: every rank raises it once the ranks have agreed
    (train/distributed/collectives.py ``agreed``), so that no rank waits in a collective the others skip. ``printed``:
    this rank prints it (a failing rank its own line, a rank that passed the line naming the failing ranks); None:
    rank 0 alone."""

    same_on_every_rank = True

    def __init__(self, message: str, *, printed: bool | None = None) -> None:
        super().__init__(message)
        self.printed = printed

    def printed_by(self, rank: int) -> bool:
        return super().printed_by(rank) if self.printed is None else self.printed


class StepStopped(Exception):
    """A signal stopped a step's served requests on some rank (train/parts/scoring/stage.py): the step is not
    trained, so that a resume runs it again as an uninterrupted run does; the loop checkpoints the steps before it
    and exits as for the signal (train/loop/faults.py)."""


class RankFailed(Stop):
    """Another rank failed where the ranks check together (train/loop/step.py's reward phase)."""


def every_missing(checks: Iterable[Callable[[], object]]) -> None:
    """Run every check; the files and folders they find missing (each PathError's line) raised together in one
    PathError, so that a user fixes them all in one attempt. Another error stops at once."""
    missing = []
    for check in checks:
        try:
            check()
        except PathError as err:
            missing.append(str(err))
    if missing:
        raise PathError("; ".join(missing))


def prefixed(key: str, message: str, names: Iterable[str] = ()) -> str:
    """``message`` about the settings under ``key``, naming it: ``key.message`` when the message starts with one
    of ``names`` (the fields or arguments those settings fill: ``num_steps must be >= 2`` ->
    ``sampler.num_steps must be >= 2``), else ``key: message``; ``message`` alone for the root (``key`` "")."""
    if not key:
        return message
    first = re.match(r"[A-Za-z_]\w*", message)
    return f"{key}.{message}" if first and first.group() in set(names) else f"{key}: {message}"


@contextmanager
def config_key(key: str, names: Iterable[str] = ()) -> Iterator[None]:
    """A ValueError or FileNotFoundError raised inside is about the settings under ``key`` (a config group, or
    the arguments a library class was built from): it becomes the ConfigError or PathError it is, its message
    ``prefixed`` by the key (the original stays the cause). A UserError already names its key and passes."""
    try:
        yield
    except UserError:
        raise
    except FileNotFoundError as err:
        raise PathError(prefixed(key, str(err), names)) from err
    except ValueError as err:
        raise ConfigError(prefixed(key, str(err), names)) from err


_AGREED = "ranks_agreed"  # set on the failing rank's own exception once every rank knows of it


def mark_agreed(err: Exception) -> Exception:
    """``err``, marked as known to every rank at the same point of the step (``ranks_agreed``)."""
    setattr(err, _AGREED, True)
    return err


def ranks_agreed(err: BaseException) -> bool:
    """Every rank raised at the same point: ``err`` was raised alike everywhere, or the ranks agreed on it
    (``RankFailed`` on the others, ``mark_agreed`` on the failing rank), so they can still save together."""
    same = isinstance(err, Stop) and err.same_on_every_rank
    return same or isinstance(err, RankFailed) or bool(getattr(err, _AGREED, False))
