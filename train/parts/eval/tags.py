"""The names of the trainer's evaluations (their tags, the held-out prompts' suffix), the timed phases of a step,
and the console's line per evaluation:

    eval step 20: shape_alignment 0.5735 (step 0: 0.5862); held-out: shape_alignment 0.5401 (step 0: 0.5362)
"""

from __future__ import annotations

from collections.abc import Mapping

from rewards.summary import overall

HELD_OUT = "held-out"  # the held-out prompts' evaluation: eval/<metric>/held-out, eval/<tag>_held-out.*
PHASES = ("step", "rollout", "reward", "update", "optimizer", "probe")  # the timed phases of a step (time/<phase>)


def eval_tag(step: int) -> str:
    """The trainer's evaluation of the policy after ``step`` training steps: ``eval/<tag>.*``."""
    return f"step_{step:08d}"


def heldout_tag(step: int) -> str:
    """The trainer's evaluation of the held-out prompts (eval.heldout_prompts) after ``step`` steps."""
    return f"{eval_tag(step)}_{HELD_OUT}"


def _means(step: int, summary: Mapping[str, float], first: Mapping[str, float] | None) -> str:
    parts = []
    for name, value in overall(summary).items():
        before = "" if step == 0 or not first or name not in first else f" (step 0: {first[name]:.4f})"
        parts.append(f"{name} {value:.4f}{before}")
    return ", ".join(parts)


def eval_line(
    step: int,
    summary: Mapping[str, float],
    first: Mapping[str, float] | None,
    *,
    heldout: Mapping[str, float] | None = None,
    heldout_first: Mapping[str, float] | None = None,
) -> str:
    """``eval step 20: shape_alignment 0.5735 (step 0: 0.5862)``, one entry per scorer, then the held-out
    prompts' (``; held-out: ...``) when they were evaluated."""
    line = f"eval step {step}: {_means(step, summary, first)}"
    return line + (f"; {HELD_OUT}: {_means(step, heldout, heldout_first)}" if heldout is not None else "")
