"""Evaluation summaries: mean scores overall and per prompt category.

``summarize`` returns a flat dict, ready for a logger: ``{name: mean}`` for every metric and
``{f"{name}/{category}": mean}`` for every category (e.g. the HPSv2 benchmark's anime,
concept-art, paintings and photo), where a category's mean is over the images of that category.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor


def overall(summary: Mapping[str, float]) -> dict[str, float]:
    """The means over all prompts of a ``summarize`` result (not the per-category ``<name>/<category>``)."""
    return {name: value for name, value in summary.items() if "/" not in name}


def summarize(scores: Mapping[str, Tensor], categories: Sequence[str] | None = None) -> dict[str, float]:
    """Means of each score [N] overall and, when ``categories`` (N labels) is given, per category."""
    summary: dict[str, float] = {}
    for name, values in scores.items():
        values = values.detach().float().flatten().cpu()
        if values.numel() == 0 or not torch.isfinite(values).all():
            raise ValueError(f"metric {name!r} is empty or holds NaN/inf; cannot summarize it")
        summary[name] = values.mean().item()
        if categories is None:
            continue
        if len(categories) != values.numel():
            raise ValueError(f"got {len(categories)} categories for {values.numel()} {name!r} scores")
        for category in sorted(set(categories)):
            mask = torch.tensor([label == category for label in categories])
            summary[f"{name}/{category}"] = values[mask].mean().item()
    return summary
