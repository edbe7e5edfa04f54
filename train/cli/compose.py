"""What the commands compose with:

* ``setup()``, called at import by every Hydra entry point, registers the typed schema and the
  resolvers below.
* ``${jagg_fields:}`` (in ``hydra.help.template``, configs/train.yaml): the ``--help`` text
  (train/cli/help_text.py).
* ``${shipped:<package>/<path>}`` (configs/model/testbed.yaml, configs/data/, configs/experiment/demo.yaml): a
  file shipped inside a package, found wherever it is installed (train/parts/config/shipped.py); registered with
  the schema (``register_schema``), which every composition of configs/ calls.
* ``${jagg_eval_dir:...}`` (configs/eval.yaml): Hydra's folder of ``python -m train.eval``, inside the
  evaluated run, so its config and log sit beside its results.
* ``ConsoleFormatter`` (configs/hydra/job_logging/console.yaml): INFO lines as they are, other levels
  prefixed, a rank other than 0's tagged ``[rank N]``; the run folder's ``<job name>.log`` gets rank 0's lines with
  a time stamp (the other ranks write none there: train/cli/run_folder.py).
"""

from __future__ import annotations

import logging

from omegaconf import OmegaConf

from train.cli.help_text import fields_help
from train.cli.reporting import env_rank, rank_tag
from train.ground.layout import RunLayout
from train.parts.config.schema import register_schema


class ConsoleFormatter(logging.Formatter):
    """``message`` for INFO, ``LEVEL: message`` otherwise (a warning must not read like progress); under torchrun a
    rank other than 0 tags its lines ``[rank N] `` (``rank_tag``), as it does its error line."""

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        line = text if record.levelno == logging.INFO else f"{record.levelname}: {text}"
        return rank_tag(env_rank()) + line


def eval_output_dir(transformer: str | None, resume: str | None, default: str) -> str:
    """Hydra's folder for ``python -m train.eval``: ``<evaluated run>/eval``, else ``default``.

    A path that names no weights also gives ``default``: train/tools/eval/command.py then says what is wrong with it.
    """
    value = transformer or (resume if resume != "auto" else None)
    if not value:
        return default
    from train.parts.checkpoint.export import find_weights  # torch and diffusers: only when a path is given

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
