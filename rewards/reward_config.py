"""The reward's settings: which scorers, with which weights and arguments, combined how.

``RewardConfig`` checks itself when it is built and names the field that is wrong in its own words
(``components.remote.url is not set ...``); whoever reads it from a larger configuration adds the path
of the group in front. An empty ``components`` is the default a preset fills: whoever needs a reward
refuses it (``RewardCombiner`` does). Whether a scorer's arguments fit it, and its files exist, is the
scorer's to say.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from rewards.base import SCORER_NAMES, scorer_class
from settings import Choice, member

# what a served reward cannot start without, and the hint when it is missing
SERVED_REQUIRED: dict[str, dict[str, str]] = {
    "remote": {"url": "give the reward server's address, e.g. http://127.0.0.1:8100 (scripts/reward_server.py)"},
    "judge": {
        "base_url": "give the judge's OpenAI-compatible address, e.g. http://127.0.0.1:8000/v1 (docs/rewards.md)",
        "model": "give the served model's name, e.g. CodeGoat24/UnifiedReward-2.0-qwen3vl-2b (docs/rewards.md)",
    },
}

# what a served reward's arguments change in how its scores are fetched, not in what they are: its address, the
# variable that holds its key, each try's deadline, its tries, its requests at once (a resumed run may change them)
SERVED_TRANSPORT: dict[str, tuple[str, ...]] = {
    "remote": ("url", "timeout_s", "retries"),
    "judge": ("base_url", "api_key_env", "timeout_s", "retries", "max_in_flight"),
}


class CombineMode(Choice):
    """How the components make one reward (rewards/combine.py)."""

    sum = "sum"
    advantage = "advantage"


@dataclass
class RewardConfig:
    combine: CombineMode = CombineMode.sum
    """sum: weighted sum of raw scores; advantage: weighted sum of per-reward advantages"""
    components: dict = field(default_factory=dict)
    """scorer registry key (hpsv2 | clipscore | pickscore | jpeg_compressibility | ...) -> {weight: float
    (default 1), required: bool (default true; false: a failure or NaN of this term leaves it out of the step's
    advantages, the other weights renormalised), <the scorer's arguments, e.g. checkpoint: /path>}
    (docs/rewards.md). Untyped: any registered scorer may be added as a component, with its own arguments."""

    def __post_init__(self) -> None:
        self.combine = member(CombineMode, self.combine, "combine")
        for name, component in self.components.items():
            if name not in SCORER_NAMES:
                raise ValueError(f"components.{name} is not a scorer; accepted names: {', '.join(SCORER_NAMES)}")
            weight = component.get("weight", 1.0) if isinstance(component, Mapping) else None
            if not isinstance(weight, int | float) or isinstance(weight, bool):
                raise ValueError(f"components.{name} must be {{weight: <number>, <scorer arguments>}}, got {component}")
            if not isinstance(component.get("required", True), bool):
                raise ValueError(f"components.{name}.required must be true or false, got {component['required']!r}")
            for key in SERVED_REQUIRED.get(name, ()):
                if not component.get(key):
                    raise ValueError(f"components.{name}.{key} is not set: {SERVED_REQUIRED[name][key]}")
        weights = {name: component.get("weight", 1.0) for name, component in self.components.items()}
        for name, weight in weights.items():
            check_weight(name, weight)
        if weights and not any(weights.values()):
            raise ValueError("components: every weight is 0, so every advantage would be 0; give one a weight")
        weighted = [name for name, weight in weights.items() if weight]
        if weighted and set(weighted) <= set(optional_terms(self.components)):
            raise ValueError(
                f"components.{weighted[0]}.required is false and no required term has a weight: when it fails, a "
                "step has no reward to train on; set it to true, or add a required term with a weight"
            )

    def served_terms(self) -> list[str]:
        """The terms a server scores (``Scorer.runs_remotely``: the remote reward, the judge)."""
        return [name for name in self.components if scorer_class(name).runs_remotely]


def optional_terms(components: Mapping[str, Mapping]) -> list[str]:
    """The names of the ``components`` (``RewardConfig.components``) marked ``required: false``."""
    return [name for name, component in components.items() if not component.get("required", True)]


def check_weight(name: str, weight: float) -> None:
    """The weight of component ``name`` is a finite number."""
    if not math.isfinite(weight):
        raise ValueError(f"components.{name}.weight must be a finite number, got {weight}")
