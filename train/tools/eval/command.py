"""``python -m train.eval`` (``jagg-eval``): the evaluation protocol of train/parts/eval/protocol.py on a model,
optionally against the pretrained one with the paired difference.

    python -m train.eval                                                  # the pretrained testbed model
    python -m train.eval eval.transformer=runs/demo/<run>                 # its export, else latest checkpoint
    python -m train.eval eval.transformer=runs/demo/<run>/checkpoints/step_00000030 eval.compare_pretrained=true
    python -m train.eval resume=runs/demo/<run>/checkpoints/step_00000030  # the same as eval.transformer=
    python -m train.eval experiment=flux_dance model.path=... eval.prompts=... <the run's other paths> \\
        eval.transformer=runs/flux_dance/<run>/export

The weights (``eval.transformer`` or ``resume``) are an export (``<run>/export``: the full transformer
or a LoRA file, the EMA the trainer scored when the run kept one; ``<run>/export_raw``: then the trained
weights without it), a training checkpoint (``<run>/checkpoints/step_XXXXXXXX``), or a run folder; the path
is checked before any model loads. Pass the same model settings as the training run (a checkpoint of
a LoRA run needs ``model.lora.*``; the run's ``.hydra/config.yaml`` is checked when present).
Output, in the evaluated run's ``eval/`` folder (configs/eval.yaml; without a run,
``runs/<experiment>/eval_<time>``): ``eval_<what>.json``, ``.scores.jsonl`` and ``.png`` per model
(``what`` = ``pretrained``, ``step_XXXXXXXX``, ``export`` or ``export_raw``), and with ``eval.compare_pretrained=true``
``eval_<what>_vs_pretrained.json`` (the paired difference per scorer) and ``.png`` (before/after sheet).

The scorers are built before any model loads: a served one whose server does not answer is one line, status 2,
in seconds. One that fails during an evaluation is left out of it in one line (train/parts/eval/protocol.py) and
the others are written; when none is left, one line and status 2, nothing written.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rewards.summary import overall
from train.cli.command import hydra_command
from train.cli.compose import setup
from train.cli.help_text import show_value
from train.distributed.collectives import agree_on_write
from train.ground.disk import write_failure
from train.ground.errors import CheckpointError, ConfigError, ScorerFailed
from train.ground.layout import EXPORT, RunLayout
from train.parts.checkpoint.export import Weights, export_description, find_weights
from train.parts.checkpoint.manager import CheckpointManager, deleted
from train.parts.config.schema import TrainConfig
from train.parts.eval.eval_config import SCORERS_HINT
from train.parts.eval.evaluator import read_eval_prompts
from train.parts.eval.protocol import EvalParts, EvalResult, before_after, evaluate, paired_difference
from train.parts.policy.builder import build_for_eval, load_weights, resolve_device
from train.parts.scoring.scorers import build_eval_scorers, check_eval_scorers, check_served_bounds
from train.run.start import load_config, process_group

setup()
PROG = "python -m train.eval"
log = logging.getLogger(__name__)
STRUCTURE = ("model.name", "model.lora.enabled", "model.lora.rank", "model.lora.alpha")
NOTHING_CHANGED = "the weights it evaluates are untouched: run it again once there is room"


def check_scorers(cfg: TrainConfig) -> None:
    """An evaluation scores with ``eval.scorers``: without one there is nothing to write (before any model loads)."""
    if not cfg.eval.scorers:
        raise ConfigError(
            f"eval.scorers is empty, so there is nothing to score the images with: add one, e.g. {SCORERS_HINT} "
            "(docs/rewards.md lists the scorers)"
        )


def target(cfg: TrainConfig) -> Weights | None:
    """The weights named by ``eval.transformer`` or ``resume`` (None: the pretrained model), checked."""
    if cfg.resume == "auto":
        raise ConfigError("resume=auto names no run to evaluate; pass eval.transformer=<run folder>")
    if cfg.resume and cfg.eval.transformer and Path(cfg.resume) != Path(cfg.eval.transformer):
        raise ConfigError(
            f"eval.transformer={cfg.eval.transformer!r} and resume={cfg.resume!r} name different weights; pass one"
        )
    field, value = ("eval.transformer", cfg.eval.transformer) if cfg.eval.transformer else ("resume", cfg.resume)
    if not value:
        if cfg.eval.compare_pretrained:
            raise ConfigError("eval.compare_pretrained=true needs the trained weights: pass eval.transformer=<path>")
        return None
    return find_weights(value, field)


def check_training_config(cfg: TrainConfig, weights: Weights) -> None:
    """A checkpoint loads into the model structure it was trained with: compare with the run's saved config."""
    layout = RunLayout(weights.run_dir) if weights.run_dir is not None else None
    if weights.kind != "checkpoint" or layout is None or not (saved := layout.hydra_config).is_file():
        return
    trained = _recorded(saved, weights)
    here = OmegaConf.structured(cfg)
    for key in STRUCTURE:
        was, now = OmegaConf.select(trained, key), OmegaConf.select(here, key)
        if was is not None and was != now:
            raise ConfigError(
                f"{weights.path} was trained with {key}={show_value(was)} ({saved}), this command has "
                f"{key}={show_value(now)}: pass {key}={show_value(was)}"
            )
    if OmegaConf.select(trained, "ema.decay", default=0.0):
        log.info(
            "the run kept an EMA of its weights: a checkpoint's model is the trained weights, not the EMA its "
            "evaluations scored (%s holds that)",
            layout.export if layout.export.is_dir() else f"a finished run's {EXPORT}/",
        )


def _recorded(saved: Path, weights: Weights) -> DictConfig:
    """The configuration the run recorded; ConfigError when it does not read as one."""
    try:
        recorded = OmegaConf.to_container(OmegaConf.load(saved), resolve=False)
    except (OSError, UnicodeDecodeError, yaml.YAMLError, OmegaConfBaseException) as err:
        why = str(err).splitlines()[0] if str(err) else type(err).__name__
        recorded = f"unreadable ({why[:80]})"
    if not isinstance(recorded, dict):
        shown = recorded if isinstance(recorded, str) else f"a {type(recorded).__name__}, not a mapping"
        raise ConfigError(
            f"{weights.path}: its run's recorded configuration {saved} is damaged ({shown}), so the model settings "
            "it was trained with cannot be checked: put back a copy of it, or move it away and pass the run's "
            "model settings (model.*) yourself"
        )
    return OmegaConf.create(recorded)


def check_checkpoint(weights: Weights) -> None:
    """A checkpoint's files are whole before any model loads, as for resuming (a collective)."""
    problem = CheckpointManager(weights.path.parent.parent).problem(weights.path)
    if problem and not weights.path.exists():  # found by target(), pruned since by the run that wrote it
        raise CheckpointError(deleted(weights.path), damaged=True)
    if problem:
        raise CheckpointError(f"{problem}; evaluate another checkpoint", damaged=True)


def _line(result: EvalResult) -> str:
    means = [f"{name} {value:.4f} ± {se:.4f}" for name, (value, se) in result.means().items()]
    return (
        f"eval {result.tag.removeprefix('eval_')}: {', '.join(means)} (standard error over {len(result.rows)} images)"
    )


def _compare(before: EvalResult, after: EvalResult, prompts: list[str], out: Path) -> list[str]:
    """The paired difference per scorer (JSON) and the before/after sheet; the console lines."""
    shared = [name for name in overall(after.summary) if name in before.summary]  # a scorer may be left out of one
    if not shared:
        return ["no scorer scored both evaluations: nothing to compare"]
    paired = [paired_difference(before.rows, after.rows, name) for name in shared]
    stem = f"{after.tag}_vs_pretrained"
    (out / f"{stem}.json").write_text(json.dumps([asdict(p) for p in paired], indent=2) + "\n")
    metric = paired[0].metric
    names = ("pretrained", after.tag.removeprefix("eval_"))
    before_after(before, after, [prompts[i] for i in after.indices], metric, names).save(out / f"{stem}.png")
    return [p.line(*names) for p in paired]


def eval_command(cfg: DictConfig) -> dict[str, EvalResult]:
    """Everything ``main`` does: check, load, evaluate, compare; the results by tag (rows on rank 0)."""
    config = load_config(cfg, rewards=False)  # it scores with eval.scorers, checked below
    weights = target(config)
    if weights is not None:
        check_training_config(config, weights)
        if held := export_description(weights.path):
            log.info("%s holds %s", weights.path, held)
    out = Path(config.run_dir)
    records = read_eval_prompts(config.eval, config.data.train_prompts)
    results: dict[str, EvalResult] = {}
    with process_group(config.dist.timeout_s) as dist:
        if weights is not None and weights.kind == "checkpoint":
            check_checkpoint(weights)
        check_scorers(config)  # after the weights' checks, before any model loads
        check_eval_scorers(config.eval.scorers)
        check_served_bounds(None, config.eval.scorers, config.dist.timeout_s)
        # built before the model: a served scorer whose server does not answer is one line in seconds
        scorers = build_eval_scorers(config.eval.scorers, resolve_device(config, dist))
        backbone, predict, device = build_for_eval(config, dist)
        parts = EvalParts(backbone, predict, scorers, config.eval, config.sampler, config.model, dist, device)

        def run(tag: str) -> EvalResult:
            def evaluated() -> None:
                results[tag] = evaluate(parts, records, tag=tag, out=out)

            agree_on_write(evaluated, out, f"the evaluation {tag}", kept=NOTHING_CHANGED)  # one line on every rank
            if not results[tag].summary:  # the ranks agree: every one gathered the same scores
                raise ScorerFailed(
                    f"eval.scorers: none of {', '.join(config.eval.scorers)} could score the evaluation {tag} (the "
                    "lines above say why), so nothing was written: run it again once its server answers"
                )
            if dist.is_main:
                log.info(_line(results[tag]))
            return results[tag]

        if weights is None or config.eval.compare_pretrained:
            run("eval_pretrained")
        if weights is not None:
            load_weights(config, backbone, weights, device)
            after = run(f"eval_{weights.tag}")
            if config.eval.compare_pretrained and dist.is_main:
                try:
                    lines = _compare(results["eval_pretrained"], after, [r.prompt for r in records], out)
                except OSError as err:
                    raise write_failure(err, out, "the comparison", NOTHING_CHANGED) or err from None
                log.info("\n".join(lines))
    if dist.is_main:
        log.info("wrote %s: %s (.json means, .scores.jsonl per prompt, .png grids)", out, ", ".join(results))
    return results


main, command = hydra_command("eval", PROG, eval_command)  # python -m train.eval, the console script jagg-eval


if __name__ == "__main__":
    command()
