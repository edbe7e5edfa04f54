"""What the command-line tools share: how they end, the schema and resolvers they compose with, the help text,
the console, and the weights ``train.eval`` is pointed at.

How every command ends: a user's mistake in one line, a bug with its traceback. The commands
(``python -m train`` and the command packages of train/, with their ``jagg-*`` console scripts)
share this:

* ``run_hydra(main, prog=...)`` runs a ``@hydra.main`` function. Hydra's own errors while it composes
  the settings (an unknown key, a value of the wrong type, an unknown option of a group, an override
  it cannot parse) and a run folder it cannot create become one line and exit status 2.
* ``reported(prog)`` wraps the body of the task: a ``Stop`` (train/run/errors.py: a setting, a path, a
  file, a checkpoint, SIGTERM) prints ``<prog>: error: <message>`` and exits with its status (2 for a
  user error); a collective that timed out or lost a peer prints which one, from where, and exits 1;
  Ctrl+C prints what the command was doing and exits 130 (the training loop handles it itself:
  train/distributed/preemption.py).
* ``report_error(err, prog)`` prints the line and returns the status, for commands that return it.
* ``RunFolder``, a Hydra callback (``hydra.callbacks.run_folder`` in configs/train.yaml), looks at the
  run folder before Hydra creates it or writes its ``.hydra/`` and log file there: a folder that holds a
  run (train/run/folder.py) is refused unless the launch resumes or overwrites it, as are a
  folder another live process owns and one that cannot be written. A launch refused later, before it
  did any work (a setting, a file, a checkpoint that does not fit), takes back what it wrote: the
  folder it created goes, and in a folder that existed ``.hydra/``, ``config*.yaml`` and the log file
  are as they were. A sweep (Hydra's basic sweeper) has every job's folder checked so before it writes
  anything, and is refused whole for one; a sweep's job that fails is reported, takes back its own folder,
  and the other jobs still run; the sweep then ends with the status of its failed jobs, naming them.

Everything else propagates, so a bug shows its traceback. ``HYDRA_FULL_ERROR=1`` prints the
traceback of a reported error too. Under torchrun a message that every rank raises alike (a
setting, a decision the ranks took together) is printed by rank 0 only; any other by its own rank.

What they compose with:

* ``setup()``, called at import by every Hydra entry point, registers the typed schema and the
  resolvers below.
* ``${jagg_fields:}`` (in ``hydra.help.template``, configs/train.yaml): every field of the schema with its
  current value and its attribute docstring, read from the module of its dataclass, so ``--help`` needs no
  second copy.
* ``${jagg_eval_dir:...}`` (configs/eval.yaml): Hydra's folder of ``python -m train.eval``, inside the
  evaluated run, so its config and log sit beside its results.
* ``ConsoleFormatter`` (configs/hydra/job_logging/console.yaml): INFO lines as they are, other levels
  prefixed; the run folder's ``<job name>.log`` gets the same lines with a time stamp.
"""

from __future__ import annotations

import ast
import functools
import inspect
import json
import logging
import os
import re
import shutil
import signal
import sys
import threading
import traceback
import typing
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from train.config.keys import unknown_setting
from train.config.schema import TrainConfig, register_schema
from train.run.errors import ConfigError, Interrupted, Stop, UserError
from train.run.folder import RunLock, check_one_run
from train.run.layout import LOCK_FILE, RunLayout

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
class _Launch:
    """The run folder as it was before Hydra wrote into it, so that a refused launch can take back what it wrote.

    What a launch writes before its first step (bookkeeping): Hydra's ``.hydra/`` and log file, the
    trainer's ``config*.yaml`` and lock. Anything else that changed means the launch did work: it stays.
    """

    folder: Path
    created: Path | None  # the outermost folder that did not exist (None: the run folder existed)
    saved: dict[Path, bytes]  # the bookkeeping files' contents (log files: their lengths in ``lengths``)
    lengths: dict[Path, int]
    others: dict[Path, tuple[int, int]]  # every other file: (size, mtime in ns)
    folders: set[Path]  # the folders under it

    @staticmethod
    def bookkeeping(relative: Path) -> bool:
        parts = relative.parts
        top = len(parts) == 1 and (
            parts[0].endswith(".log") or parts[0] == LOCK_FILE or re.fullmatch(r"config.*\.yaml", parts[0]) is not None
        )
        return top or parts[0] == ".hydra"

    @classmethod
    def before(cls, folder: Path, *, within: Path | None = None) -> _Launch:
        """``folder`` now; ``within``: a folder never to take back (a sweep's, which holds its other jobs)."""
        created = None
        for candidate in (folder, *folder.parents):
            if candidate.exists() or candidate == within:
                break
            created = candidate
        folders = {p for p in folder.rglob("*") if p.is_dir()} if folder.is_dir() else set()
        launch = cls(folder, created, {}, {}, {}, folders)
        for path in launch._files():
            if not cls.bookkeeping(path.relative_to(folder)):
                launch.others[path] = (path.stat().st_size, path.stat().st_mtime_ns)
            elif path.suffix == ".log":
                launch.lengths[path] = path.stat().st_size
            else:
                launch.saved[path] = path.read_bytes()
        return launch

    def _files(self) -> list[Path]:
        return [p for p in self.folder.rglob("*") if p.is_file()] if self.folder.is_dir() else []

    def did_work(self) -> bool:
        now = {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in self._files()}
        return {p: v for p, v in now.items() if not self.bookkeeping(p.relative_to(self.folder))} != self.others

    def undo(self) -> None:
        """Take back the bookkeeping of a launch refused before it did any work (else leave everything)."""
        if not self.folder.is_dir() or self.did_work():
            return
        for handler in logging.getLogger().handlers[:]:  # Hydra's log file in the folder
            if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).is_relative_to(self.folder):
                handler.close()
                logging.getLogger().removeHandler(handler)
        if self.created is not None:
            shutil.rmtree(self.created, ignore_errors=True)
            return
        for path in self._files():
            if not self.bookkeeping(path.relative_to(self.folder)):
                continue
            if path in self.saved:
                path.write_bytes(self.saved[path])
            elif path in self.lengths:
                os.truncate(path, self.lengths[path])
            else:
                path.unlink()
        for folder in sorted(self.folder.rglob("*"), reverse=True):  # folders the launch created, now empty
            if folder.is_dir() and folder not in self.folders and not any(folder.iterdir()):
                folder.rmdir()


@dataclass
class _Progress:
    task_started: bool = False  # Hydra has composed the settings, created the run folder and called the task
    debug: bool | None = None  # the user's HYDRA_FULL_ERROR while run_hydra sets its own; None = read it
    prog: str = ""  # the command being run (run_hydra's prog)
    launch: _Launch | None = None  # the run folder before Hydra wrote into it (RunFolder)
    launches: dict[Path, _Launch] = field(default_factory=dict)  # a sweep's: each job's folder before it began
    failed_jobs: list[tuple[str, int]] = field(default_factory=list)  # a sweep's failed jobs and their statuses
    jobs: int = 0  # a sweep's jobs started


_progress = _Progress()


class RunFolder(Callback):
    """Hydra's callback before the run folder is created (``hydra.callbacks.run_folder``, configs/train.yaml).

    ``one_run``: refuse a folder that holds a run unless ``resume`` or ``checkpoint.overwrite`` is set, and
    one whose lock a live process holds (the trainer's; train.eval and train.probe write beside runs).
    """

    def __init__(self, one_run: bool = True) -> None:
        self.one_run = one_run

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            folder = Path(str(OmegaConf.select(config, "hydra.run.dir"))).absolute()
        except OmegaConfBaseException:
            return  # Hydra resolves it again in a moment and reports the error its own way
        problem = self._refusal(folder, config)
        if problem is not None:
            raise SystemExit(report_error(problem, _progress.prog))  # Hydra's callbacks swallow Exceptions
        _progress.launch = _Launch.before(folder)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Every job's folder, before the sweep writes anything: one refused folder refuses the sweep."""
        jobs = _sweep_jobs(config)
        if jobs is None:
            return  # a sweeper plugin of its own: each job's folder is checked when it starts (preflight.claim_folder)
        problems = [f"job #{num} ({folder}): {p}" for num, folder, job in jobs if (p := self._refusal(folder, job))]
        if problems:
            message = f"the sweep starts none of its {len(jobs)} jobs: {'; '.join(problems)}"
            raise SystemExit(report_error(ConfigError(message), _progress.prog))
        sweep_dir = Path(str(config.hydra.sweep.dir)).absolute()
        _progress.launches = {folder: _Launch.before(folder, within=sweep_dir) for _, folder, _ in jobs}

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        if HydraConfig.get().mode == RunMode.MULTIRUN:  # the job's folder as it was before the sweep began
            _progress.launch = _progress.launches.get(Path(config.hydra.runtime.output_dir))

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        if HydraConfig.get().mode == RunMode.MULTIRUN:
            _progress.launch = None

    def _refusal(self, folder: Path, config: DictConfig) -> Stop | None:
        """Why a launch of ``config`` may not write into ``folder`` (unwritable; with ``one_run``, a run held
        there that the launch neither resumes nor overwrites, or a live owner), or None."""
        if folder.is_dir() and not os.access(folder, os.W_OK | os.X_OK):
            return ConfigError(
                f"cannot write the run folder (Permission denied: {folder}); pass a writable hydra.run.dir=<folder>"
            )
        if not self.one_run:
            return None
        try:
            overwrite = bool(OmegaConf.select(config, "checkpoint.overwrite", default=False))
            check_one_run(folder, resume=config.get("resume"), overwrite=overwrite)
        except Stop as err:
            return err
        busy = RunLock(folder).busy() if _rank() == 0 else None  # rank 0 owns the folder
        return UserError(busy) if busy else None


def _sweep_jobs(config: DictConfig) -> list[tuple[int, Path, DictConfig]] | None:
    """Each job of a sweep of Hydra's basic sweeper: (its number, its folder, its configuration), composed as
    the launcher composes them; None for another sweeper (its jobs are not known ahead)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if OmegaConf.select(config, "hydra.sweeper._target_") != f"{BasicSweeper.__module__}.{BasicSweeper.__name__}":
        return None
    params = [f"{key}={value}" for key, value in (config.hydra.sweeper.params or {}).items()]
    overrides = OverridesParser.create().parse_overrides([*params, *config.hydra.overrides.task])
    OmegaConf.select(config, "hydra.sweep.dir")  # resolved once here: the jobs copy its ${now:} from this cache
    loader, hydra_config = GlobalHydra.instance().config_loader(), HydraConfig.instance().cfg
    jobs = []
    try:
        for num, job_overrides in enumerate(BasicSweeper.split_arguments(overrides, None)[0]):
            job = loader.load_sweep_config(config, list(job_overrides))
            with open_dict(job):
                job.hydra.job.id = job.hydra.job.num = num
            HydraConfig.instance().set_config(job)  # for ${hydra:...} in the folder's name, as the launcher does
            folder = Path(str(job.hydra.sweep.dir), str(job.hydra.sweep.subdir)).absolute()
            jobs.append((num, folder, job))
    finally:
        HydraConfig.instance().cfg = hydra_config
    return jobs


def _sweep_job() -> str | None:
    """``#<num> (<its folder>)`` of the running sweep job; None outside a sweep."""
    if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.MULTIRUN:
        return None
    hydra = HydraConfig.get()
    return f"#{hydra.job.num} ({hydra.runtime.output_dir})"


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _debug() -> bool:
    return os.environ.get(DEBUG_ENV) == "1" if _progress.debug is None else _progress.debug


def _print(prog: str, label: str, message: str, *, rank: int) -> None:
    prefix = f"[rank {rank}] " if rank > 0 else ""
    one_line = " ".join(part.strip() for part in message.splitlines() if part.strip())
    print(f"{prefix}{prog}: {label}: {one_line}", file=sys.stderr, flush=True)


def report_error(err: Stop, prog: str, *, where: str = "") -> int:
    """Print ``err`` as one line (rank 0 alone when every rank raised it), after ``where`` (a sweep's job),
    and return its exit status."""
    rank = _rank()
    if _debug():
        traceback.print_exception(err)
    if rank == 0 or not err.same_on_every_rank:
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
    _progress.task_started = True
    job = _sweep_job()
    _progress.jobs += job is not None
    try:
        with _ctrl_c_stops():
            yield
    except Stop as err:
        if isinstance(err, UserError) and _progress.launch is not None:
            _progress.launch.undo()
        status = report_error(err, prog, where=f"sweep job {job}: " if job else "")
        if job is None:
            raise SystemExit(status) from None
        _progress.failed_jobs.append((job, status))  # the sweep goes on with its next job
    except RuntimeError as err:
        line = collective_failure(err)
        if line is None:
            raise
        if _debug():
            traceback.print_exception(err)
        _print(prog, "error", line, rank=_rank())
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
    _progress.task_started, _progress.debug, _progress.prog = False, saved_debug == "1", prog
    _progress.launch, _progress.launches, _progress.failed_jobs, _progress.jobs = None, {}, [], 0
    os.environ[DEBUG_ENV] = "1"  # Hydra re-raises instead of printing its own multi-line report
    try:
        main()
        if failed := _progress.failed_jobs:
            message = (
                f"{len(failed)} of the sweep's {_progress.jobs} jobs failed ({', '.join(job for job, _ in failed)}; "
                "each error is above); the others ran to their end"
            )
            _print(prog, "error", message, rank=_rank())
            raise SystemExit(max(status for _, status in failed))
    except (HydraException, OmegaConfBaseException) as err:
        if _progress.task_started:
            raise
        raise SystemExit(report_error(ConfigError(hydra_message(err)), prog)) from None
    except OSError as err:
        if _progress.task_started:
            raise
        # Before the task runs, Hydra creates the run folder and writes .hydra/ and its log into it.
        message = (
            f"cannot write the run folder ({err.strerror}: {err.filename}); pass a writable hydra.run.dir=<folder>"
        )
        raise SystemExit(report_error(ConfigError(message), prog)) from None
    finally:
        sys.argv, _progress.debug, _progress.launch, _progress.launches = saved_argv, None, None, {}
        if saved_debug is None:
            os.environ.pop(DEBUG_ENV, None)
        else:
            os.environ[DEBUG_ENV] = saved_debug
        GlobalHydra.instance().clear()


class ConsoleFormatter(logging.Formatter):
    """``message`` for INFO, ``LEVEL: message`` otherwise (a warning must not read like progress)."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        return text if record.levelno == logging.INFO else f"{record.levelname}: {text}"


@functools.cache  # a module's source is read and parsed once per process
def _class_docs(module_name: str) -> dict[str, dict[str, str]]:
    """Class name -> field name -> its attribute docstring (the string literal right below the field), on one line,
    for the classes of a module's source."""
    per_class: dict[str, dict[str, str]] = {}
    for node in ast.parse(inspect.getsource(sys.modules[module_name])).body:
        if not isinstance(node, ast.ClassDef):
            continue
        docs = per_class.setdefault(node.name, {})
        for item, after in zip(node.body, [*node.body[1:], None]):
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                continue
            literal = after.value if isinstance(after, ast.Expr) else None
            text = literal.value if isinstance(literal, ast.Constant) and isinstance(literal.value, str) else ""
            docs[item.target.id] = " ".join(inspect.cleandoc(text).split())
    return per_class


def field_docs(schema: type = TrainConfig) -> dict[str, str]:
    """Dotted key of every field of ``schema`` (the trainer's, or a command's that extends it) -> its attribute
    docstring, read from the module that declares its dataclass (train/config/schema.py, samplers/, ...)."""
    out: dict[str, str] = {}

    def doc(cls: type, name: str) -> str:
        for owner in cls.__mro__:  # the class that declares the field, for an inherited one
            docs = _class_docs(owner.__module__).get(owner.__name__, {}) if is_dataclass(owner) else {}
            if name in docs:
                return docs[name]
        return ""

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            kind = hints[f.name]
            if is_dataclass(kind):
                walk(typing.cast(type, kind), f"{prefix}{f.name}.")
            else:
                out[f"{prefix}{f.name}"] = doc(cls, f.name)

    walk(schema, "")
    return out


def show_value(value: Any) -> str:
    """A value as it is written on the command line (null, true, JSON for lists and dicts)."""
    if value is None:
        return "null"
    if isinstance(value, dict | list):
        return json.dumps(value)
    return str(value).lower() if isinstance(value, bool) else str(value)


def fields_help(root: DictConfig) -> str:
    """``key = value   meaning`` for every schema field, values as composed (interpolations unresolved)."""
    values = OmegaConf.to_container(root, resolve=False, throw_on_missing=False)
    assert isinstance(values, dict)
    schema = OmegaConf.get_type(root)
    rows = []
    for key, doc in field_docs(schema if isinstance(schema, type) and is_dataclass(schema) else TrainConfig).items():
        node: Any = values
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        rows.append((f"{key} = {show_value(node)}", doc))
    width = min(48, max(len(left) for left, _ in rows))
    text = "\n".join(f"{left:<{width}}  {doc}".rstrip() for left, doc in rows)
    return text.replace("$", "$$")  # Hydra fills the template with string.Template: a literal $ is $$


def eval_output_dir(transformer: str | None, resume: str | None, default: str) -> str:
    """Hydra's folder for ``python -m train.eval``: ``<evaluated run>/eval``, else ``default``.

    A path that names no weights also gives ``default``: train/eval/command.py then says what is wrong with it.
    """
    value = transformer or (resume if resume != "auto" else None)
    if not value:
        return default
    from train.checkpoint.export import find_weights  # torch and diffusers: only when a path is given

    try:
        run = find_weights(value, "eval.transformer").run_dir
    except FileNotFoundError:
        return default
    return str(RunLayout(run).eval) if run is not None else default


def setup() -> None:
    """The schema and the resolvers of configs/*.yaml (idempotent: every entry point calls it at import)."""
    register_schema()
    OmegaConf.register_new_resolver("jagg_fields", lambda *, _root_: fields_help(_root_), replace=True)
    OmegaConf.register_new_resolver("jagg_eval_dir", eval_output_dir, replace=True)
