"""The probe's report as the console shows it: the paper's Table 5 (train/algorithm/quality.py measures it), the
recommendation in the settings' words, and what the columns mean."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MIN_ROLLOUTS = 10  # fewer trajectories per segment: the report says its spread and recommendation are rough


def format_table(rep: Mapping[str, Any]) -> str:
    """Table 5 of the paper as text, the recommendation (and the staleness columns when measured), and
    what the columns mean."""
    mode = rep["mode"]
    stale = all("after_step" in g for g in rep["segments"]) and bool(rep["segments"])
    header = f"{'segment':>7}  {'steps':>7}  {'t':>11}  {f'cos(g_{mode}, g_exact)':>24}  {'rho':>15}  {'n':>3}  path"
    if stale:
        header += f"  {'fresh, 1 step':>22}  {'stale, 1 step':>22}"
    lines = [header, *(_table_row(g, stale) for g in rep["segments"])]
    lines.append(
        f"* mean cos >= {rep['threshold']}: recommended update.jagg_frac={rep['recommended_jagg_frac']} "
        f"(M = {rep['num_transitions']} trainable transitions)"
    )
    return "\n".join(lines + _legend(rep, stale))


def _table_row(g: Mapping[str, Any], stale: bool) -> str:
    mark = "*" if g["qualifies"] else " "
    line = (
        f"{g['segment']:>7}  {g['start']:>3}-{g['stop'] - 1:<3}  {g['t_first']:.3f}-{g['t_last']:.3f}  "
        f"{_pm(g['cos_mean'], g['cos_std'], 14)}{mark}  {_pm(g['rho_mean'], g['rho_std'], 7)}  "
        f"{g['num_samples']:>3}  {g['path']:<5}"
    )
    if stale:
        after = g["after_step"]
        line += "".join(f"  {_pm(after[k]['cos_mean'], after[k]['cos_std'], 14)}" for k in ("fresh", "stale"))
    return line.rstrip()


def _legend(rep: Mapping[str, Any], stale: bool) -> list[str]:
    """What the columns mean, and a note when too few trajectories were measured."""
    mode = rep["mode"]
    lines = [
        "steps: the segment's transitions; t: its first and last network-input timestep (1 = pure noise)",
        f"cos: cosine between the segment's gradient by the {mode} path and the exact one (1 = same direction);",
        f"rho: |g_{mode}| / |g_exact| (1 = same length); both mean ± standard deviation over n trajectories",
        "path: where the recommended jagg_frac routes the segment",
    ]
    if stale:
        lines.append(
            f"after one optimizer step on the rollout: cos(g_{mode}, g_exact) with the middle velocities "
            "recomputed (fresh) and taken from the rollout (stale, update.reuse_velocities=stale)"
        )
    fewest = min((g["num_samples"] for g in rep["segments"]), default=0)
    if fewest < MIN_ROLLOUTS:
        lines.append(
            f"note: n = {fewest} trajectories is too few for the ± and the recommendation to mean much "
            f"(a standard deviation from n values is itself uncertain by about 1 / sqrt(2 (n - 1))); "
            f"use probe.num_rollouts >= {MIN_ROLLOUTS} (the paper: >= 20)"
        )
    return lines


def _pm(mean: float | None, std: float | None, width: int) -> str:
    return f"{'-':>{width}}{'':8}" if mean is None else f"{mean:>{width}.3f} ± {std:.3f}"
