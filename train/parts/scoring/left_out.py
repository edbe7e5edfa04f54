"""The optional reward terms a run left out, read back from its metrics rows.

The reward stage (train/parts/scoring/stage.py) logs ``reward/<name>/missing`` on every training step for each
optional term (``required: false``): 1 when the step scored without it (it failed or scored NaN), the other weights
renormalised, else 0. ``reward/total`` of such a step is then over the other terms, so a run's totals, or two runs'
totals, are not of the same terms; the end-of-run summary (train/loop/epilogue.py) and ``python -m train.compare``
say so in the one line of ``left_out_line``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

PREFIX, SUFFIX = "reward/", "/missing"


def missing_metric(name: str) -> str:
    """The metric that marks the steps that left the optional term ``name`` out."""
    return f"{PREFIX}{name}{SUFFIX}"


def left_out(rows: Iterable[tuple[int, Mapping[str, object]]]) -> dict[str, tuple[int, int]]:
    """Optional term -> (the steps that left it out, the steps that logged it), from (step, row) pairs of a metrics
    file (a step's last row wins); only the terms left out on some step."""
    marked: dict[str, dict[int, bool]] = {}
    for step, row in rows:
        for key, value in row.items():
            if key.startswith(PREFIX) and key.endswith(SUFFIX) and isinstance(value, int | float):
                marked.setdefault(key[len(PREFIX) : -len(SUFFIX)], {})[step] = value > 0
    counts = {name: (sum(steps.values()), len(steps)) for name, steps in sorted(marked.items())}
    return {name: (out, of) for name, (out, of) in counts.items() if out}


def left_out_line(rows: Iterable[tuple[int, Mapping[str, object]]]) -> str | None:
    """``optional reward terms left out: judge on 3 of 10 steps; reward/total on those steps ...``, or None when
    no step left a term out."""
    found = left_out(rows)
    if not found:
        return None
    terms = ", ".join(f"{name} on {out} of {of} step{'s' if of > 1 else ''}" for name, (out, of) in found.items())
    return (
        f"optional reward terms left out: {terms}; reward/total on those steps is over the other terms, "
        f"renormalised ({missing_metric('<name>')} in metrics.jsonl marks them)"
    )
