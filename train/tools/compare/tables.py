"""A comparison as the command prints it (text or markdown tables) and writes it (JSON-ready data)."""

from __future__ import annotations

import math
from typing import Any

from train.parts.eval.tags import PHASES
from train.parts.observe.stats import Estimate, estimate, paired
from train.tools.compare.arms import Comparison, speedup_pct


def _fmt(value: float, digits: int = 4) -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def curve_rows(c: Comparison, metric: str) -> list[list[str]]:
    rewards = c.rewards[metric]
    steps = sorted({s for r in rewards.values() if r is not None for s in r.curve})
    rows = [["step", *[a.label for a in c.arms]]]
    for step in steps:
        cells = [r.curve[step].format() if (r := rewards[a.label]) and step in r.curve else "-" for a in c.arms]
        rows.append([str(step), *cells])
    return rows


def reach_cell(reached: dict[int, float]) -> str:
    """The training time to a threshold over seeds: mean ± 95% interval of the seeds that reached it, and how
    many did not ("never" when none did)."""
    times = [t for t in reached.values() if math.isfinite(t)]
    if not times:
        return f"never (0 of {len(reached)} seeds)"
    cell = estimate(times).format(1)
    return cell if len(times) == len(reached) else f"{cell} ({len(times)} of {len(reached)} seeds; the others never)"


def summary_rows(c: Comparison, metric: str) -> list[list[str]]:
    header = ["arm", "seeds", "final", "gain over step 0", "mean over training", "best - last (best step)"]
    if c.threshold is not None:
        header.append(f"training time to {c.threshold:+g} [s]")
    rows = [header + ["step [s]", "update [s]", "speed-up step", "speed-up update"]]
    base_t = c.timing[c.baseline.label]
    for arm in c.arms:
        r, t = c.rewards[metric][arm.label], c.timing[arm.label]
        rewards = (
            ["-"] * 4
            if r is None
            else [
                f"{estimate(list(r.final.values())).format()} (step {r.last_step})",
                estimate(list(r.gain.values())).format(signed=True) if r.gain else "-",
                estimate(list(r.auc.values())).format(),
                best_cell(r.best),
            ]
        )
        if c.threshold is not None:
            rewards.append("-" if r is None or not r.reached else reach_cell(r.reached))
        speed = ["(baseline)"] * 2
        if arm is not c.baseline:
            speed = [f"{speedup_pct(base_t[p], t[p]):.1f}%" for p in ("step", "update")]
        rows.append([arm.label, str(len(arm.runs)), *rewards, _fmt(t["step"], 3), _fmt(t["update"], 3), *speed])
    return rows


def best_cell(best: dict[int, tuple[int, float]]) -> str:
    """How much each seed's best evaluation beat its last, over seeds, and the best steps (``ArmRewards.best``)."""
    if not best:
        return "-"
    steps = ", ".join(str(step) for step, _ in best.values())
    word = "step" if len(best) == 1 else "steps"
    return f"{estimate([margin for _, margin in best.values()]).format(signed=True)} ({word} {steps})"


def paired_rows(c: Comparison, metric: str) -> list[list[str]]:
    rows = [[f"arm - {c.baseline.label}", "seeds", "final", "mean over training", "distinguishable from 0"]]
    if c.threshold is not None:
        rows[0].append(f"time to {c.threshold:+g} / {c.baseline.label}'s")
    base = c.rewards[metric][c.baseline.label]
    for arm in c.arms:
        r = c.rewards[metric][arm.label]
        if arm is c.baseline or r is None or base is None or not set(r.final) & set(base.final):
            continue
        final, auc = paired(r.final, base.final), paired(r.auc, base.auc)
        verdict = "n=1: no interval" if final.n < 2 else _verdict(final, auc)
        rows.append([arm.label, str(final.n), final.format(signed=True), auc.format(signed=True), verdict])
        if c.threshold is not None:
            rows[-1].append(ratio_cell(r.reached, base.reached))
    return rows


def ratio_cell(reached: dict[int, float], base: dict[int, float]) -> str:
    """The per-seed ratio of two arms' training times to the threshold, mean ± 95% interval over the seeds
    where both reached it, and how many seeds that is."""
    both = [s for s in sorted(set(reached) & set(base)) if math.isfinite(reached[s]) and math.isfinite(base[s])]
    if not both:
        return "-"
    cell = estimate([reached[s] / base[s] for s in both]).format(3)
    n = len(set(reached) & set(base))
    return cell if len(both) == n else f"{cell} ({len(both)} of {n} seeds reached it in both)"


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
    out += [f"baseline: {c.baseline.label}; {c.why_baseline}", *c.notes]
    if c.threshold is not None:
        out.append(
            f"training time to {c.threshold:+g}: the sum of the step times before the first evaluation at least "
            f"{c.threshold:g} over step 0, per seed (evaluations every few steps: a time is that of the first one)"
        )
    out.append("")
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
    if c.left_out:  # training_curves.png's reward/total of these runs is not over the same terms at every step
        out += ["", *(f"note: {line}" for line in c.left_out)]
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
                    "best": {seed: {"step": step, "over_last": margin} for seed, (step, margin) in r.best.items()},
                }
                if c.threshold is not None:  # seed -> seconds, null: never
                    entry[f"eval/{metric}"]["time_to_threshold"] = {
                        s: t if math.isfinite(t) else None for s, t in r.reached.items()
                    }
        arms[arm.label] = entry
    return {"baseline": c.baseline.label, "why_baseline": c.why_baseline, "threshold": c.threshold, "arms": arms}
