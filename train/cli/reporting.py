"""How every command ends: a user's mistake in one line, a bug with its traceback. The commands
(``python -m train`` and the command packages of train/, with their ``jagg-*`` console scripts)
share this:

* ``run_hydra(main, prog=...)`` runs a ``@hydra.main`` function. Hydra's own errors while it composes
  the settings (an unknown key, a value of the wrong type, an unknown option of a group, an override
  it cannot parse) and a run folder it cannot create become one line and exit status 2.
* ``reported(prog)`` wraps the body of the task: a ``Stop`` (train/ground/errors.py: a setting, a path, a
  file, a checkpoint, SIGTERM) prints ``<prog>: error: <message>`` and exits with its status (2 for a
  user error); a collective that timed out or lost a peer prints which one, from where, and exits 1;
  Ctrl+C prints what the command was doing and exits 130 (the training loop handles it itself:
  train/distributed/preemption.py).
* ``report_error(err, prog)`` prints the line and returns the status, for commands that return it.
  A sweep's job that fails is reported and the sweep goes on; it then ends with the status of its failed
  jobs, naming them.

Everything else propagates, so a bug shows its traceback. ``HYDRA_FULL_ERROR=1`` prints the
traceback of a reported error too. Under torchrun a message that every rank raises alike (a
setting, a decision the ranks took together) is printed by rank 0 only; any other by its own rank.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, is_dataclass
from pathlib import Path
from typing import Any

from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from hydra.types import RunMode
from omegaconf.errors import OmegaConfBaseException

from train.cli.launch import Launch
from train.ground.errors import ConfigError, Interrupted, Stop, UserError
from train.parts.config.keys import unknown_setting

DEBUG_ENV = "HYDRA_FULL_ERROR"  # Hydra's own switch for full tracebacks; it shows ours too
# What gloo raises when a peer does not answer within the timeout or has gone away.
_COLLECTIVE_FAILURES = (
    (re.compile(r"Timed out|timed out|Timeout"), "timed out after {timeout}"),
    (re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe"), "lost its peer"),
)
# OmegaConf's refusal of a value that is no member of an Enum field's class (a choice).
_ENUM_REFUSAL = re.compile(r"Invalid value '(.*)', expected one of \[(.*)\]")
# Frames of torch.distributed and of train/distributed/ whose function names say which collective ran.
_COLLECTIVE_NAMES = re.compile(r"all_gather|all_reduce|reduce_scatter|broadcast|barrier|gather|scatter|all_to_all")


@dataclass
class _Progress:
    task_started: bool = False  # Hydra has composed the settings, created the run folder and called the task
    debug: bool | None = None  # the user's HYDRA_FULL_ERROR while run_hydra sets its own; None = read it
    prog: str = ""  # the command being run (run_hydra's prog)
    launch: Launch | None = None  # the run folder before Hydra wrote into it (RunFolder)
    launches: dict[Path, Launch] = field(default_factory=dict)  # a sweep's: each job's folder before it began
    failed_jobs: list[tuple[str, int]] = field(default_factory=list)  # a sweep's failed jobs and their statuses
    jobs: int = 0  # a sweep's jobs started
    note: str | None = None  # a line for the console once the task has started (the run folder resume=auto chose)


progress = _Progress()


def _sweep_job() -> str | None:
    """``#<num> (<its folder>)`` of the running sweep job; None outside a sweep."""
    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    hydra = HydraConfig.get()
    return f"#{hydra.job.num} ({hydra.runtime.output_dir})"


def env_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def rank_tag(rank: int) -> str:
    """What a line of rank ``rank`` begins with on its output: ``[rank N] `` for a rank other than 0 (torchrun shows
    every worker's output as it is, untagged), nothing for rank 0."""
    return f"[rank {rank}] " if rank > 0 else ""


def _debug() -> bool:
    return os.environ.get(DEBUG_ENV) == "1" if progress.debug is None else progress.debug


def _quiet(*streams: Any) -> None:
    """Send what is left of ``streams`` nowhere: their reader is gone (a closed terminal, ``| head``), and
    Python's flush at exit must not fail again (Python's docs on SIGPIPE advise the same)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in streams:
        try:
            os.dup2(devnull, stream.fileno())
        except (OSError, ValueError, AttributeError):  # not a file (a test's capture)
            pass
    os.close(devnull)


def _print(prog: str, label: str, message: str, *, rank: int) -> None:
    """The line on stderr, and in the run folder's log file (a closed terminal shows it no more)."""
    one_line = " ".join(part.strip() for part in message.splitlines() if part.strip())
    line = f"{rank_tag(rank)}{prog}: {label}: {one_line}"
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(logging.LogRecord("train", logging.ERROR, __file__, 0, line, None, None))
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:  # the terminal closed (SIGHUP) or stderr's reader left
        _quiet(sys.stdout, sys.stderr)


def report_error(err: Stop, prog: str, *, where: str = "") -> int:
    """Print ``err`` as one line (rank 0 alone when every rank raised it), after ``where`` (a sweep's job),
    and return its exit status."""
    rank = env_rank()
    if _debug():
        traceback.print_exception(err)
    if err.printed_by(rank):
        _print(prog, err.label, f"{where}{err}", rank=rank)
    return err.exit_code


def collective_failure(err: BaseException) -> str | None:
    """One line for a collective that timed out or lost its peer (gloo raises a bare RuntimeError), else None.

    The collective is read from the traceback: the innermost frame of torch.distributed or
    train/distributed/ named after one, and the innermost frame of this project that called it.
    """
    frames = traceback.extract_tb(err.__traceback__)
    if not any("torch/distributed" in frame.filename for frame in frames):
        return None  # raised outside a collective: not for this message
    text = str(err)
    what = next((w for pattern, w in _COLLECTIVE_FAILURES if pattern.search(text)), None)
    if what is None:
        return None
    collective, caller = "a collective", None
    for frame in reversed(frames):
        in_dist = "torch/distributed" in frame.filename or frame.filename.endswith("train/distributed/")
        if collective == "a collective" and in_dist and _COLLECTIVE_NAMES.search(frame.name):
            collective = f"the collective {frame.name}"
        project = any(f"/{p}/" in frame.filename for p in ("train", "models", "samplers", "rewards"))
        if caller is None and project and not frame.filename.endswith("train/distributed/"):
            caller = f"{'/'.join(frame.filename.split('/')[-2:])}:{frame.lineno} in {frame.name}"
    from train.distributed.collectives import (
        collective_context,  # torch: not for commands that never start a process group
    )

    activity, timeout_s = collective_context()
    timeout = f"{timeout_s:g} s (dist.timeout_s)" if timeout_s else "its timeout"
    where = f" called from {caller}" if caller else ""
    return (
        f"{collective}{where}, during {activity}, {what.format(timeout=timeout)}: another rank is hung, "
        "stopped or dead (see its own output); raise dist.timeout_s only if a step really waits that long"
    )


def _interrupted(signum: int, frame: Any) -> None:
    from train.distributed.collectives import collective_context  # torch: imported once Ctrl+C comes

    raise Interrupted(f"Ctrl+C during {collective_context()[0]}: the command ended there, nothing more was written")


@contextmanager
def _ctrl_c_stops() -> Iterator[None]:
    """Ctrl+C raises ``Interrupted`` (one line) instead of KeyboardInterrupt (a traceback), in the block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, _interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextmanager
def reported(prog: str) -> Iterator[None]:
    """Around a command's body: a ``Stop``, Ctrl+C or a failed collective ends the process with one line."""
    progress.task_started = True
    if progress.note is not None and env_rank() == 0:
        logging.getLogger("train").warning(progress.note)
    job = _sweep_job()
    progress.jobs += job is not None
    try:
        with _ctrl_c_stops():
            yield
    except Stop as err:
        if isinstance(err, UserError) and progress.launch is not None:
            progress.launch.undo()
        status = report_error(err, prog, where=f"sweep job {job}: " if job else "")
        if job is None:
            raise SystemExit(status) from None
        progress.failed_jobs.append((job, status))  # the sweep goes on with its next job
    except RuntimeError as err:
        line = collective_failure(err)
        if line is None:
            raise
        if _debug():
            traceback.print_exception(err)
        _print(prog, "error", line, rank=env_rank())
        raise SystemExit(1) from None


def hydra_message(err: Exception) -> str:
    """Hydra's and OmegaConf's multi-line composition errors as one sentence naming the setting."""
    cause = err.__cause__ if isinstance(err.__cause__, OmegaConfBaseException) else err
    if isinstance(err, MissingConfigException) and err.missing_cfg_file:
        group, _, option = err.missing_cfg_file.rpartition("/")
        accepted = f"; accepted values: {', '.join(err.options)}" if err.options else ""
        return f"{group}={option} is not an option of {group}{accepted}"
    if isinstance(err, OverrideParseException):
        return f"cannot parse the override {err.override!r}: {str(err).splitlines()[0]} (Hydra's override grammar)"
    full_key = getattr(cause, "full_key", None)
    first = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
    if full_key and (choice := _ENUM_REFUSAL.fullmatch(first)):  # an Enum field: as the other choices read
        return f"{full_key}={choice[1]!r} is not valid; accepted values: {choice[2]}"
    schema = getattr(cause, "object_type", None)
    if "not in" in first and full_key and isinstance(schema, type) and is_dataclass(schema):
        parent, _, key = full_key.rpartition(".")
        return unknown_setting(f"{parent}." if parent else "", key, schema)
    return f"{full_key}: {first}" if full_key else first


def repeated_keys(text: str) -> list[str]:
    """Keys that the dict literals of an override name twice at one level (Hydra keeps the last, silently)."""
    levels: list[tuple[set[str] | None, list[bool]]] = []  # per open bracket: its keys (None: a list), expecting one
    repeated, token, quote = [], "", ""
    for char in text:
        if quote:
            quote = "" if char == quote else quote
            token += char
        elif char in "'\"":
            quote, token = char, token + char
        elif char in "{[":
            levels.append((set() if char == "{" else None, [True]))
            token = ""
        elif char in "}]":
            levels = levels[:-1]
            token = ""
        elif char == "," and levels:
            levels[-1][1][0], token = True, ""
        elif char == ":" and levels and (keys := levels[-1][0]) is not None and levels[-1][1][0]:
            key = token.strip().strip("'\"")
            if key in keys:
                repeated.append(key)
            keys.add(key)
            levels[-1][1][0], token = False, ""
        else:
            token += char
    return repeated


def _repeated_override_keys(argv: Sequence[str]) -> str | None:
    for override in argv:
        key, _, value = override.partition("=")
        if repeated := repeated_keys(value):
            return (
                f"{key.lstrip('+~')}: the value names {', '.join(repr(k) for k in repeated)} twice, and only the last "
                "would count: name each once"
            )
    return None


def _before_task(err: HydraException | OmegaConfBaseException | OSError, prog: str) -> int:
    """The exit status of an error while Hydra composes the settings and prepares the run folder, with its line."""
    if isinstance(err, HydraException | OmegaConfBaseException):  # first: a missing config file is an OSError too
        return report_error(ConfigError(hydra_message(err)), prog)
    if isinstance(err, BrokenPipeError):
        # --help or --cfg piped into a reader that stopped early (``| head``): end quietly, as a process that
        # SIGPIPE ended (128 + 13)
        _quiet(sys.stdout)
        return 128 + signal.SIGPIPE
    # Hydra creates the run folder and writes .hydra/ and its log into it
    message = f"cannot write the run folder ({err.strerror}: {err.filename}); pass a writable hydra.run.dir=<folder>"
    return report_error(ConfigError(message), prog)


def run_hydra(main: Callable[[], Any], *, prog: str, argv: Sequence[str] | None = None) -> None:
    """Run ``main`` (a ``@hydra.main`` function whose body is inside ``reported``); a reported error exits.

    ``argv`` replaces the command-line arguments (tests call commands in-process with it).
    """
    saved_argv, saved_debug = sys.argv, os.environ.get(DEBUG_ENV)
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    if problem := _repeated_override_keys(sys.argv[1:]):
        sys.argv = saved_argv
        raise SystemExit(report_error(ConfigError(problem), prog))
    vars(progress).update(vars(_Progress(debug=saved_debug == "1", prog=prog)))  # in place: run_folder.py holds it
    os.environ[DEBUG_ENV] = "1"  # Hydra re-raises instead of printing its own multi-line report
    try:
        main()
        if failed := progress.failed_jobs:
            message = (
                f"{len(failed)} of the sweep's {progress.jobs} jobs failed ({', '.join(job for job, _ in failed)}; "
                "each error is above); the others ran to their end"
            )
            _print(prog, "error", message, rank=env_rank())
            raise SystemExit(max(status for _, status in failed))
    except (HydraException, OmegaConfBaseException, OSError) as err:
        if progress.task_started:
            raise
        raise SystemExit(_before_task(err, prog)) from None
    finally:
        if progress.launch is not None and progress.launch.lock is not None:
            progress.launch.lock.release()  # the lock RunFolder took, if the task has not released it
        sys.argv, progress.debug, progress.launch, progress.launches = saved_argv, None, None, {}
        if saved_debug is None:
            os.environ.pop(DEBUG_ENV, None)
        else:
            os.environ[DEBUG_ENV] = saved_debug
        GlobalHydra.instance().clear()
