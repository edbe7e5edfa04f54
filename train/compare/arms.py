"""Comparing training runs: arms over seeds, their rewards with confidence intervals, their speed.

A **run** is a run folder of ``python -m train`` (its ``metrics.jsonl``, the record of truth, and
the ``config.yaml`` the trainer writes beside it, or Hydra's ``.hydra/config.yaml``) or a wandb
run: an offline run folder (``wandb/offline-run-*``, read from its ``.wandb`` file), or an online
run, one by id or every run of a group (train/compare/wandb_runs.py). Inside a run folder, metrics.jsonl
is read and its own ``wandb/`` folder is not. Runs are grouped into **arms**: runs whose
configurations differ only in ``seed`` form one arm (exact, jagg, ablate of a sweep), labelled by
the settings that differ between arms (``update.mode`` is written as the mode alone), never by
folder names. A sweep folder stands for every run folder (and offline wandb run outside one) below
it; folders without a metrics file (``compare/``) or with an empty one (a
probe's) are skipped and named.

Per arm, over its seeds (train/observe/stats.py):
  * for each evaluation metric ``eval/<name>`` (the ODE evaluation with fixed noise, so step 0
    is the frozen control): the value at each evaluation step, the final value (the last
    evaluation step every run of the arm reached), its gain over step 0, and the area under the
    curve as the mean over training (trapezoids over the evaluation steps);
  * time per step and per phase: each run's median over its steps after ``warmup`` (a stalled
    step on a contended machine moves a median little), with the interquartile range, then the
    mean over seeds; speed-ups against the baseline arm as (T_base - T) / T_base (the paper's
    definition: 279 s -> 228 s is 18.2%).
Against the baseline (the arm whose ``update.mode`` is exact, unless named), each other arm's
final value, gain and area are compared pairwise on the seeds both ran: the mean difference, its
95% interval, and whether that interval excludes zero. Nothing is starred as "best".
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from train.algorithm.jagg import UPDATE_MODES
from train.compare.wandb_runs import WandbRun, read_offline, read_offline_file, read_online, run_file
from train.config.keys import moved_settings
from train.evaluation.summary import HELD_OUT, PHASES
from train.observe.stats import Estimate, estimate, median, paired, quantile, trapezoid_mean
from train.run.layout import METRICS, RunLayout

WANDB_PREFIX = "wandb:"
# The training curves plotted from metrics.jsonl (training_curves.png), with their axis labels.
TRAINING_CURVES = {
    "reward/total": "training reward (rollouts)",
    "adv/std": "advantage spread (std)",
    "train/approx_kl": "approximate KL to the rollout policy",
    "train/clip_frac": "clipped fraction",
    "train/grad_norm": "gradient norm (before clipping)",
    "time/step": "seconds per step",
}
# x axes of the reward plots: the step, the training time (the sum of step times: what a method's speed
# changes) and the wall-clock time (evaluations, checkpoints and stalls included)
PLOT_AXES = {
    "step": "training step",
    "training_time": "training time: sum of step times [min]",
    "wall": "wall-clock time, evaluations and stalls included [min]",
}
# Settings that never define an arm: where a run writes, how it logs, when it saves.
IGNORED_KEYS = ("seed", "run_dir", "resume", "logging.", "checkpoint.", "hydra.", "probe.output")


@dataclass
class RunMetrics:
    source: str  # the folder or wandb path it was read from
    steps: dict[int, dict[str, float]]  # logged step -> every metric logged at that step
    config: dict[str, Any] = field(default_factory=dict)  # flattened resolved configuration; {} if unknown
    name: str = ""  # the folder or wandb run name, a fallback label

    @property
    def seed(self) -> int | None:
        seed = self.config.get("seed")
        return int(seed) if seed is not None else None

    def series(self, key: str) -> dict[int, float]:
        return {step: values[key] for step, values in sorted(self.steps.items()) if key in values}


# Names a run logged before they were renamed, read as today's, so that runs of either age compare
# (README, changes): a metric's old prefix -> its new one (settings: train/config/keys.py).
RENAMED_METRICS = {"count/groups_": "count/segments_"}  # the JAGG unit of W transitions is a segment


def current_metric(name: str) -> str:
    """Today's name of a logged metric (``count/groups_jagg`` -> ``count/segments_jagg``)."""
    for old, new in RENAMED_METRICS.items():
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def _numbers(record: dict[str, Any]) -> dict[str, float]:
    return {
        current_metric(k): float(v) for k, v in record.items() if isinstance(v, int | float) and not isinstance(v, bool)
    }


def read_metrics_file(path: Path) -> dict[int, dict[str, float]]:
    """Steps of one metrics.jsonl; a line that is not a JSON object with an integer "step" is an error.

    A step logged twice (a resumed run replays from its checkpoint) keeps the later values.
    """
    steps: dict[int, dict[str, float]] = {}
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{lineno} is not valid JSON ({err.msg}); the file is damaged") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError(f'{path}:{lineno} is not a metrics record (a JSON object with an integer "step")')
        steps.setdefault(record["step"], {}).update(_numbers(record))
    return steps


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """{"a.b": leaf} of a nested dict; lists stay leaves."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out |= flatten(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value}
    return out


def _read_config(folder: Path) -> dict[str, Any]:
    """The run's resolved configuration: the trainer's ``config.yaml``, else Hydra's; {} if neither. An older run's
    moved keys are read under their new names, so that it compares with a newer one."""
    layout = RunLayout(folder)
    for path in (layout.config, layout.hydra_config):
        if path.is_file():
            from omegaconf import OmegaConf

            return moved_settings(flatten(OmegaConf.to_container(OmegaConf.load(path), resolve=False)))
    return {}


def _from_wandb(run: WandbRun) -> RunMetrics:
    if not run.steps:
        raise ValueError(f"wandb run {run.source} has no logged step")
    steps = {step: _numbers(values) for step, values in run.steps.items()}
    return RunMetrics(run.source, steps, moved_settings(flatten(run.config)), run.name or run.run_id)


def _read_wandb(path: str) -> list[RunMetrics]:
    try:
        found = read_online(path)
    except ValueError:
        raise
    except Exception as err:  # wandb raises its own error types (network, auth, missing run)
        raise ValueError(f"wandb run {path!r} could not be read: {err}") from None
    return [_from_wandb(run) for run in found]


def load_run(folder: Path) -> RunMetrics:
    """One run folder: its metrics.jsonl (at least one step) and its Hydra configuration."""
    metrics = RunLayout(folder).metrics
    steps = read_metrics_file(metrics)
    if not steps:
        raise ValueError(f"{metrics} holds no logged step (the file is empty)")
    return RunMetrics(str(folder), steps, _read_config(folder), folder.resolve().name)


def discover(specs: list[str]) -> tuple[list[RunMetrics], list[str]]:
    """(runs, notes): each spec is a run folder, a sweep folder (run folders or offline wandb runs below
    it), an offline wandb run folder or its ``.wandb`` file, or wandb:<entity>/<project>/<run id or group:name>.
    """
    runs, notes = [], []
    for spec in specs:
        if spec.startswith(WANDB_PREFIX):
            runs += _read_wandb(spec[len(WANDB_PREFIX) :])
            continue
        path = Path(spec)
        if not path.exists():
            raise FileNotFoundError(f"run folder {spec!r} does not exist (for a wandb run write wandb:<entity>/...)")
        if path.is_file() and path.suffix == ".wandb":
            runs.append(_from_wandb(read_offline_file(path)))
        elif path.is_file():
            raise ValueError(f"run {spec!r} is a file; pass a run folder (with metrics.jsonl) or a sweep folder")
        elif RunLayout(path).metrics.is_file():
            runs.append(load_run(path))
        elif run_file(path) is not None:
            runs += [_from_wandb(run) for run in read_offline([path])]
        else:
            found, skipped = _below(path)
            runs += found
            notes += skipped
    if not runs:
        raise ValueError("no run to compare")
    return runs, notes


def _below(folder: Path) -> tuple[list[RunMetrics], list[str]]:
    """The runs of a sweep folder: run folders (metrics.jsonl), and offline wandb runs outside them."""
    runs, notes = [], []
    run_dirs = sorted(p.parent for p in folder.rglob(METRICS))
    for run_dir in run_dirs:
        if read_metrics_file(RunLayout(run_dir).metrics):
            runs.append(load_run(run_dir))
        else:
            notes.append(f"skipped {run_dir}: its metrics.jsonl is empty (not a training run)")
    offline = [p.parent for p in folder.rglob("run-*.wandb") if not any(d in p.parents for d in run_dirs)]
    runs += [_from_wandb(run) for run in read_offline(offline)]
    if not run_dirs and not offline:
        raise FileNotFoundError(
            f"{str(folder)!r} holds no metrics.jsonl and no wandb run: it is neither a run folder nor a sweep of runs"
        )
    return runs, notes


def _defines_arm(key: str) -> bool:
    return not any(key == k or key.startswith(k) for k in IGNORED_KEYS)


def _short(key: str, value: Any) -> str:
    return str(value) if key == "update.mode" else f"{key}={value}"


MAX_LABEL_SETTINGS = 3  # settings named in an arm's label; more are counted ("+5 more settings")


def _label(run: RunMetrics, differing: list[str], named_at_most: int) -> str:
    named = [_short(k, run.config.get(k)) for k in differing[:named_at_most]]
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
    keys = sorted({k for r in runs for k in r.config if _defines_arm(k)})
    differing = [k for k in keys if len({json.dumps(r.config.get(k), sort_keys=True) for r in runs}) > 1]
    differing.sort(key=lambda k: (k != "experiment", k != "update.mode", k))

    def labels(named: int) -> list[str]:
        return [
            run.name
            if not run.config
            else _label(run, differing, named)
            if differing
            else str(run.config.get("update.mode", run.name))
            for run in runs
        ]

    full, short = labels(len(differing)), labels(MAX_LABEL_SETTINGS)
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
    logged = list(
        dict.fromkeys(
            k.split("/", 1)[1]
            for arm in arms
            for r in arm.runs
            for v in r.steps.values()
            for k in v
            if k[:5] == "eval/"
        )
    )
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


def arm_rewards(arm: Arm, metric: str) -> ArmRewards | None:
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
    return ArmRewards(
        curve={step: estimate([c[step] for c in curves.values()]) for step in common},
        final={seed: c[last] for seed, c in curves.items()},
        gain={seed: c[last] - c[common[0]] for seed, c in curves.items()} if common[0] == 0 else {},
        auc={seed: trapezoid_mean(c) for seed, c in curves.items()},
        wall={step: sum(w) / len(w) for step, w in walls.items()},
        training_time={step: sum(t) / len(t) for step, t in trained.items()},
        last_step=last,
    )


@dataclass
class RunTiming:
    median: dict[str, float]  # phase -> median seconds per step
    iqr: dict[str, tuple[float, float]]  # phase -> (25%, 75%) quantiles
    num_steps: int


def run_timing(run: RunMetrics, warmup: int) -> RunTiming:
    timed = [v for _, v in sorted(run.steps.items()) if "time/step" in v]
    kept = timed[warmup:] if len(timed) > warmup else timed
    med, iqr = {}, {}
    for phase in PHASES:
        values = [v[f"time/{phase}"] for v in kept if f"time/{phase}" in v]
        med[phase] = median(values)
        iqr[phase] = (quantile(values, 0.25), quantile(values, 0.75))
    return RunTiming(med, iqr, len(kept))


def arm_timing(arm: Arm, warmup: int) -> dict[str, float]:
    """Phase -> mean over the arm's runs of their median seconds per step (NaN where not timed)."""
    timings = [run_timing(r, warmup) for r in arm.runs]
    out = {}
    for phase in PHASES:
        values = [t.median[phase] for t in timings if not math.isnan(t.median[phase])]
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


def build_comparison(
    specs: list[str],
    *,
    labels: list[str] | None = None,
    baseline: str | None = None,
    metrics: list[str] | None = None,
    warmup: int = 1,
) -> Comparison:
    runs, notes = discover(specs)
    notes += experiments_note(runs)
    arms = group_arms(runs, labels)
    base, why = pick_baseline(arms, baseline)
    arms = [base] + [a for a in arms if a is not base]
    names = eval_metrics(arms, metrics)
    rewards = {m: {a.label: arm_rewards(a, m) for a in arms} for m in names}
    return Comparison(arms, base, why, names, rewards, {a.label: arm_timing(a, warmup) for a in arms}, notes)


def _fmt(value: float, digits: int = 4) -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def curve_rows(c: Comparison, metric: str) -> list[list[str]]:
    rewards = c.rewards[metric]
    steps = sorted({s for r in rewards.values() if r is not None for s in r.curve})
    rows = [["step", *[a.label for a in c.arms]]]
    for step in steps:
        cells = []
        for arm in c.arms:
            r = rewards[arm.label]
            cells.append(r.curve[step].format() if r is not None and step in r.curve else "-")
        rows.append([str(step), *cells])
    return rows


def summary_rows(c: Comparison, metric: str) -> list[list[str]]:
    header = ["arm", "seeds", "final", "gain over step 0", "mean over training", "step [s]", "update [s]"]
    rows = [header + ["speed-up step", "speed-up update"]]
    base_t = c.timing[c.baseline.label]
    for arm in c.arms:
        r, t = c.rewards[metric][arm.label], c.timing[arm.label]
        rewards = (
            ["-"] * 3
            if r is None
            else [
                f"{estimate(list(r.final.values())).format()} (step {r.last_step})",
                estimate(list(r.gain.values())).format(signed=True) if r.gain else "-",
                estimate(list(r.auc.values())).format(),
            ]
        )
        speed = ["(baseline)"] * 2
        if arm is not c.baseline:
            speed = [f"{speedup_pct(base_t[p], t[p]):.1f}%" for p in ("step", "update")]
        rows.append([arm.label, str(len(arm.runs)), *rewards, _fmt(t["step"], 3), _fmt(t["update"], 3), *speed])
    return rows


def paired_rows(c: Comparison, metric: str) -> list[list[str]]:
    rows = [[f"arm - {c.baseline.label}", "seeds", "final", "mean over training", "distinguishable from 0"]]
    base = c.rewards[metric][c.baseline.label]
    for arm in c.arms:
        r = c.rewards[metric][arm.label]
        if arm is c.baseline or r is None or base is None or not set(r.final) & set(base.final):
            continue
        final, auc = paired(r.final, base.final), paired(r.auc, base.auc)
        verdict = "n=1: no interval" if final.n < 2 else _verdict(final, auc)
        rows.append([arm.label, str(final.n), final.format(signed=True), auc.format(signed=True), verdict])
    return rows


def _verdict(final: Estimate, auc: Estimate) -> str:
    parts = [
        f"{name}: {'yes, ' + ('higher' if e.mean > 0 else 'lower') if e.distinguishable_from_zero else 'no'}"
        for name, e in (("final", final), ("mean", auc))
    ]
    return "; ".join(parts)


def phase_rows(c: Comparison) -> list[list[str]]:
    phases = [p for p in PHASES if any(not math.isnan(t[p]) for t in c.timing.values())]
    rows = [["arm", *[f"{p} [s]" for p in phases]]]
    rows += [[a.label, *[_fmt(c.timing[a.label][p], 3) for p in phases]] for a in c.arms]
    return rows


def render(rows: list[list[str]], *, markdown: bool = False) -> str:
    if markdown:
        lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows[1:]])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in rows)


def comparison_tables(c: Comparison, *, markdown: bool = False) -> str:
    """Every table of the comparison as text (or markdown)."""
    h = "## " if markdown else ""
    seeds = {a.label: sorted(s for s in a.seeds() if s >= 0) for a in c.arms}
    out = [f"{h}arms (runs grouped by the settings that differ, over seeds)"]
    out += [f"- {label}: seeds {s or 'unknown'}" for label, s in seeds.items()]
    out += [f"baseline: {c.baseline.label}; {c.why_baseline}", *c.notes, ""]
    for metric in c.metrics:
        out += [f"{h}eval/{metric}: mean ± 95% interval over seeds", render(curve_rows(c, metric), markdown=markdown)]
        out += ["", f"{h}summary (final = the last evaluation step every seed reached; time = median per step)"]
        out += [render(summary_rows(c, metric), markdown=markdown), ""]
        paired_table = paired_rows(c, metric)
        if len(paired_table) > 1:
            out += [f"{h}paired difference to {c.baseline.label} on the same seeds (95% interval)"]
            out += [render(paired_table, markdown=markdown), ""]
    if not c.metrics:
        out += ["no eval/<metric> was logged: enable eval.every to compare rewards", ""]
    out += [f"{h}median seconds per step of each phase", render(phase_rows(c), markdown=markdown)]
    return "\n".join(out) + "\n"


def summary(c: Comparison) -> dict[str, Any]:
    """The comparison as JSON-ready data (every per-seed value included)."""
    arms = {}
    for arm in c.arms:
        entry: dict[str, Any] = {"runs": {str(s): r.source for s, r in zip(arm.seeds(), arm.runs)}}
        entry["time_median_s"] = c.timing[arm.label]
        for metric in c.metrics:
            r = c.rewards[metric][arm.label]
            if r is not None:
                entry[f"eval/{metric}"] = {
                    "curve": {s: e.__dict__ for s, e in r.curve.items()},
                    "final": r.final,
                    "gain": r.gain,
                    "auc": r.auc,
                    "last_step": r.last_step,
                }
        arms[arm.label] = entry
    return {"baseline": c.baseline.label, "why_baseline": c.why_baseline, "arms": arms}


def plot(c: Comparison, out: Path) -> list[Path]:
    """Per metric: reward against step, training time and wall-clock time (mean line, min-max band over
    seeds); the training curves of metrics.jsonl; and the median time per phase as bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for metric in c.metrics:
        for axis, xlabel in PLOT_AXES.items():
            fig, ax = plt.subplots(figsize=(6.5, 4))
            for arm in c.arms:
                r = c.rewards[metric][arm.label]
                if r is None:
                    continue
                steps = sorted(r.curve)
                x = steps if axis == "step" else [getattr(r, axis)[s] / 60 for s in steps]
                key = f"eval/{metric}"
                per_seed = [[run.steps[s][key] for s in steps] for run in arm.runs]
                ax.plot(x, [r.curve[s].mean for s in steps], marker="o", label=f"{arm.label} (n={len(arm.runs)})")
                ax.fill_between(x, [min(v) for v in zip(*per_seed)], [max(v) for v in zip(*per_seed)], alpha=0.2)
            ax.set(xlabel=xlabel, ylabel=f"eval/{metric}", title=f"eval/{metric}: mean, band = min..max over seeds")
            ax.grid(alpha=0.3)
            ax.legend()
            path = out / f"eval_{metric.replace('/', '_')}_vs_{axis}.png"
            fig.savefig(path, dpi=110, bbox_inches="tight")
            plt.close(fig)
            written.append(path)
    written.append(_plot_training_curves(c, out, plt))
    written.append(_plot_phases(c, out, plt))
    return written


def _plot_training_curves(c: Comparison, out: Path, plt: Any) -> Path:
    """``training_curves.png``: each logged one of TRAINING_CURVES against the step, per arm the mean over
    seeds with a min-max band."""
    logged = [k for k in TRAINING_CURVES if any(r.series(k) for arm in c.arms for r in arm.runs)]
    columns = 3
    rows = max(1, math.ceil(len(logged) / columns))
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 3.4 * rows), squeeze=False)
    for ax, key in zip(axes.flat, logged):
        for arm in c.arms:
            series = [r.series(key) for r in arm.runs]
            steps = sorted(set.intersection(*(set(s) for s in series)))
            values = [[s[k] for s in series] for k in steps]
            ax.plot(steps, [sum(v) / len(v) for v in values], label=f"{arm.label} (n={len(arm.runs)})", lw=1)
            ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values], alpha=0.2)
        ax.set(xlabel="training step", ylabel=key, title=TRAINING_CURVES[key])
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(logged) :]:
        ax.set_visible(False)
    if logged:
        axes.flat[0].legend()
    path = out / "training_curves.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _plot_phases(c: Comparison, out: Path, plt: Any) -> Path:
    phases = [p for p in PHASES[1:] if any(not math.isnan(t[p]) for t in c.timing.values())]
    width = 0.8 / max(len(c.arms), 1)
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, arm in enumerate(c.arms):
        heights = [0.0 if math.isnan(c.timing[arm.label][p]) else c.timing[arm.label][p] for p in phases]
        ax.bar([k + i * width for k in range(len(phases))], heights, width=width, label=arm.label)
    ax.set_xticks([k + width * (len(c.arms) - 1) / 2 for k in range(len(phases))], phases)
    ax.set(ylabel="seconds per step (median)", title="time per phase")
    ax.legend()
    path = out / "time_per_phase.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
