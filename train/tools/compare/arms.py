"""Runs grouped into arms, and what each arm measured over its seeds.

Runs (read by train/tools/compare/runs.py) are grouped into **arms**: runs whose configurations differ only in
``seed`` form one arm (exact, jagg, ablate of a sweep), labelled by the settings that differ between arms
(``update.mode`` is written as the mode alone), never by folder names.

Per arm, over its seeds (train/parts/observe/stats.py):
  * for each evaluation metric ``eval/<name>`` (the ODE evaluation with fixed noise, so step 0
    is the frozen control): the value at each evaluation step, the final value (the last
    evaluation step every run of the arm reached), its gain over step 0, the area under the
    curve as the mean over training (trapezoids over the evaluation steps), and with a reward threshold
    (``--reward-threshold``) the training time (the sum of its step times before the evaluation) at
    which each seed's run first evaluates at least that much over its step 0, and the step of each seed's best
    evaluation (after a training step, as checkpoint.keep_best picks it: train/parts/eval/watch.py) with how much
    it beat that seed's last one;
  * time per step and per phase: each run's median over its steps after ``warmup`` (a stalled
    step on a contended machine moves a median little), then the mean over seeds; speed-ups
    against the baseline arm as (T_base - T) / T_base (the paper's definition: 279 s -> 228 s
    is 18.2%).
Against the baseline (the arm whose ``update.mode`` is exact, unless named), each other arm's
final value, gain and area are compared pairwise on the seeds both ran: the mean difference, its
95% interval, and whether that interval excludes zero. Nothing is starred as "best". A run whose steps left an
optional reward term out (``reward/<name>/missing``) is named under the tables with the term and on how many steps:
its ``reward/total`` there is over the other terms (train/parts/scoring/left_out.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from train.algorithm.jagg import UPDATE_MODES
from train.parts.eval.tags import HELD_OUT, PHASES
from train.parts.eval.watch import best_of
from train.parts.observe.stats import Estimate, estimate, median, trapezoid_mean
from train.parts.scoring.left_out import left_out_line
from train.tools.compare.runs import NOT_READ, RunMetrics, discover

# Settings that never define an arm: where a run writes, how it logs, when it saves.
IGNORED_KEYS = ("seed", "run_dir", "resume", "logging.", "checkpoint.", "hydra.", "probe.output")


MAX_LABEL_SETTINGS = 3  # settings named in an arm's label; more are counted ("+5 more settings")


def _label(run: RunMetrics, differing: list[str], named_at_most: int) -> str:
    """The run's arm: its folder's name without a configuration, its update.mode when no setting differs."""
    if not run.config or not differing:
        return str(run.config.get("update.mode", run.name))
    named = [
        str(run.config.get(k)) if k == "update.mode" else f"{k}={run.config.get(k)}" for k in differing[:named_at_most]
    ]
    more = len(differing) - named_at_most
    return ", ".join(named) + (f" (+{more} more settings)" if more > 0 else "")


def experiments_note(runs: list[RunMetrics]) -> list[str]:
    """A note when the runs belong to more than one experiment: arms are meant to differ in a few settings."""
    names = sorted({str(r.config["experiment"]) for r in runs if "experiment" in r.config})
    if len(names) < 2:
        return []
    return [
        f"warning: these runs belong to {len(names)} experiments ({', '.join(names)}): they are compared as arms of "
        "one experiment; compare the runs of one experiment, or name the arms with --labels"
    ]


def arm_labels(runs: list[RunMetrics]) -> list[str]:
    """The arm of each run: the settings (other than the seed) in which it differs from the others, the
    experiment first, at most ``MAX_LABEL_SETTINGS`` of them named."""
    keys = sorted({k for r in runs for k in r.config if not k.startswith(IGNORED_KEYS)})
    differing = [k for k in keys if len({json.dumps(r.config.get(k), sort_keys=True) for r in runs}) > 1]
    differing.sort(key=lambda k: (k != "experiment", k != "update.mode", k))
    full, short = ([_label(run, differing, n) for run in runs] for n in (len(differing), MAX_LABEL_SETTINGS))
    return short if len(set(short)) == len(set(full)) else full  # short labels must keep the arms apart


@dataclass
class Arm:
    label: str
    runs: list[RunMetrics]

    def seeds(self) -> list[int]:
        """The runs' seeds; a run without a known seed counts as its own (by position)."""
        return [r.seed if r.seed is not None else -i - 1 for i, r in enumerate(self.runs)]

    @property
    def mode(self) -> str | None:
        modes = {r.config.get("update.mode") for r in self.runs}
        return modes.pop() if len(modes) == 1 else None


def group_arms(runs: list[RunMetrics], labels: list[str] | None = None) -> list[Arm]:
    """Runs grouped by arm label (given, or from their configurations): the update modes in the order of
    UPDATE_MODES (exact, jagg, jagg_sequential, ablate), as every table of the project shows them, then
    the other arms in order of appearance."""
    labels = labels if labels is not None else arm_labels(runs)
    if len(labels) != len(runs):
        raise ValueError(f"--labels names {len(labels)} runs but {len(runs)} runs are given")
    arms: dict[str, Arm] = {}
    for run, label in zip(runs, labels):
        arms.setdefault(label, Arm(label, [])).runs.append(run)
    for arm in arms.values():
        seeds = arm.seeds()
        if len(set(seeds)) != len(seeds):
            sources = ", ".join(r.source for r in arm.runs)
            raise ValueError(f"arm {arm.label!r} holds two runs of one seed ({sources}); label them apart")
    order = {mode: i for i, mode in enumerate(UPDATE_MODES)}
    return sorted(arms.values(), key=lambda arm: order.get(arm.mode or "", len(order)))


def pick_baseline(arms: list[Arm], wanted: str | None) -> tuple[Arm, str]:
    """(baseline arm, why it is the baseline)."""
    if wanted is not None:
        for arm in arms:
            if arm.label == wanted:
                return arm, "named by --baseline"
        raise ValueError(f"--baseline {wanted!r} is not an arm; arms: {', '.join(a.label for a in arms)}")
    exact = [a for a in arms if a.mode == "exact"]
    if len(exact) == 1:
        return exact[0], "its update.mode is exact, the per-step gradient every other path approximates"
    return arms[0], "the first arm given (no single arm with update.mode=exact; name one with --baseline)"


def eval_metrics(arms: list[Arm], wanted: list[str] | None) -> list[str]:
    """Names of the ``eval/<name>`` metrics that runs logged: the overall means by default, the held-out
    prompts' (``shape_alignment/held-out``) among them, or the ``wanted`` ones, which may name a category."""
    keys = (k for arm in arms for r in arm.runs for values in r.steps.values() for k in values)
    logged = list(dict.fromkeys(k.split("/", 1)[1] for k in keys if k.startswith("eval/")))
    if wanted:
        missing = [m for m in wanted if m not in logged]
        if missing:
            raise ValueError(f"--metrics {', '.join(missing)} not logged as eval/<name>; logged: {logged or 'none'}")
        return wanted
    return [name for name in logged if "/" not in name or name.endswith(f"/{HELD_OUT}")]


@dataclass
class ArmRewards:
    """One evaluation metric of one arm over its seeds."""

    curve: dict[int, Estimate]  # evaluation step -> value over seeds (steps every seed reached)
    final: dict[int, float]  # seed -> value at the last common evaluation step
    gain: dict[int, float]  # seed -> final - value at step 0 (the frozen control)
    auc: dict[int, float]  # seed -> mean over training (trapezoids over the evaluation steps)
    wall: dict[int, float]  # evaluation step -> mean wall_time (s) over seeds when it was logged
    training_time: dict[int, float]  # evaluation step -> mean over seeds of the time/step (s) of the steps before it
    last_step: int
    # seed -> (the step of its best evaluation, how much it beat the seed's last evaluation): train/parts/eval/watch.py
    best: dict[int, tuple[int, float]] = field(default_factory=dict)
    # seed -> training time (s) of the first evaluation at least the threshold over step 0 (inf: never)
    reached: dict[int, float] = field(default_factory=dict)


def time_to_threshold(curve: dict[int, float], trained: dict[int, float], threshold: float) -> float:
    """The training time (``trained``: evaluation step -> s) of the first evaluation of ``curve`` (step ->
    value, from step 0) at least ``threshold`` over step 0; inf when none is."""
    return next((trained[s] for s, v in sorted(curve.items()) if v >= curve[0] + threshold), math.inf)


def arm_rewards(arm: Arm, metric: str, threshold: float | None = None) -> ArmRewards | None:
    key = f"eval/{metric}"
    per_seed = {seed: run.series(key) for seed, run in zip(arm.seeds(), arm.runs)}
    if any(not s for s in per_seed.values()):
        return None
    common = sorted(set.intersection(*(set(s) for s in per_seed.values())))
    if not common:
        return None
    last = common[-1]
    curves = {seed: {step: s[step] for step in common} for seed, s in per_seed.items()}
    walls = {step: [r.steps[step].get("wall_time", math.nan) for r in arm.runs] for step in common}
    step_times = [run.series("time/step") for run in arm.runs]
    trained = {step: [sum(t for k, t in times.items() if k < step) for times in step_times] for step in common}
    reached = {}
    if threshold is not None and common[0] == 0:
        for i, (seed, curve) in enumerate(curves.items()):
            reached[seed] = time_to_threshold(curve, {step: t[i] for step, t in trained.items()}, threshold)
    return ArmRewards(
        curve={step: estimate([c[step] for c in curves.values()]) for step in common},
        final={seed: c[last] for seed, c in curves.items()},
        gain={seed: c[last] - c[common[0]] for seed, c in curves.items()} if common[0] == 0 else {},
        auc={seed: trapezoid_mean(c) for seed, c in curves.items()},
        wall={step: sum(w) / len(w) for step, w in walls.items()},
        training_time={step: sum(t) / len(t) for step, t in trained.items()},
        last_step=last,
        best=best_over_last(per_seed),
        reached=reached,
    )


def best_over_last(per_seed: dict[int, dict[int, float]]) -> dict[int, tuple[int, float]]:
    """Seed -> (the step of the best evaluation of its whole series, its value minus the last evaluation's)."""
    out = {}
    for seed, series in per_seed.items():
        if (best := best_of(series)) is not None:
            out[seed] = (best.step, best.value - series[max(series)])
    return out


def _run_medians(run: RunMetrics, warmup: int) -> dict[str, float]:
    """Phase -> the run's median seconds per step over its timed steps after ``warmup`` (all when it has fewer)."""
    timed = [v for _, v in sorted(run.steps.items()) if "time/step" in v]
    kept = timed[warmup:] if len(timed) > warmup else timed
    return {phase: median([v[f"time/{phase}"] for v in kept if f"time/{phase}" in v]) for phase in PHASES}


def arm_timing(arm: Arm, warmup: int) -> dict[str, float]:
    """Phase -> mean over the arm's runs of their median seconds per step (NaN where not timed)."""
    medians = [_run_medians(r, warmup) for r in arm.runs]
    out = {}
    for phase in PHASES:
        values = [m[phase] for m in medians if not math.isnan(m[phase])]
        out[phase] = sum(values) / len(values) if values else math.nan
    return out


def speedup_pct(base: float, value: float) -> float:
    return (base - value) / base * 100 if base > 0 and not math.isnan(value) else math.nan


@dataclass
class Comparison:
    arms: list[Arm]
    baseline: Arm
    why_baseline: str
    metrics: list[str]
    rewards: dict[str, dict[str, ArmRewards | None]]  # metric -> arm label -> its rewards
    timing: dict[str, dict[str, float]]  # arm label -> phase -> seconds per step
    notes: list[str]
    threshold: float | None = None  # --reward-threshold: the gain over step 0 whose first time is reported
    left_out: list[str] = field(default_factory=list)  # per run that left an optional reward term out: its line


def build_comparison(
    specs: list[str],
    *,
    labels: list[str] | None = None,
    baseline: str | None = None,
    metrics: list[str] | None = None,
    warmup: int = 1,
    threshold: float | None = None,
) -> Comparison:
    runs, notes = discover(specs)
    notes += experiments_note(runs)
    try:
        arms = group_arms(runs, labels)
    except ValueError as err:  # a run left out shifts --labels: the refusal says which
        raise ValueError("; ".join([str(err), *(n for n in notes if n.startswith(NOT_READ))])) from None
    base, why = pick_baseline(arms, baseline)
    arms = [base] + [a for a in arms if a is not base]
    names = eval_metrics(arms, metrics)
    rewards = {m: {a.label: arm_rewards(a, m, threshold) for a in arms} for m in names}
    timing = {a.label: arm_timing(a, warmup) for a in arms}
    left = [f"{r.source}: {line}" for a in arms for r in a.runs if (line := left_out_line(r.steps.items()))]
    return Comparison(arms, base, why, names, rewards, timing, notes, threshold, left)
