"""Several named rewards with weights, combined in one of two ways.

With components k = 1..K, weights w_k, raw scores s_k [B] and a group advantage function A
(``advantage_fn``, the caller's: GRPO's group-normalised advantages, for instance):

    mode="sum"        r = sum_k w_k s_k              (the paper's HPSv2.1 : CLIPScore = 1 : 1;
                                                      advantages are then A(r))
    mode="advantage"  A = sum_k w_k A(s_k)           (per-reward group advantages, as DanceGRPO's
                                                      video trainers and GDPO do; no component
                                                      dominates through its raw scale)

Every component is always returned separately, so each can be logged. A NaN or inf score is a
``NonFiniteRewardError`` naming the component and its scorer, never a value that flows into the
advantages: a caller can tell it (a batch to skip) from any other error of a scorer (a bug or a setting).

A component is required (the default) or optional. Scores may leave out optional components (one that
failed or scored NaN in this batch); the weights of the present ones P are then
renormalised so that their absolute values keep the sum of all of them:

    w'_k = w_k * sum_j |w_j| / sum_{j in P} |w_j|      (k in P)

so a step with a term missing keeps the reward's scale (weights 1 : 1 with one term gone -> 2 for the
other, as the advantage of a sum does not change with its scale and a per-term advantage's does).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

import torch
from torch import Tensor

from rewards.base import Scorer
from rewards.reward_config import CombineMode, check_weight
from settings import member

AdvantageFn = Callable[[Tensor, Tensor], Tensor]  # (rewards [B], group_ids [B]) -> advantages [B]


class NonFiniteRewardError(ValueError):
    """A reward component scored NaN or inf: the step's advantages cannot be computed."""


class RewardCombiner:
    """``components`` maps a component name to (scorer, weight); the names in ``optional`` may be left out of
    the scores (module docstring), the others are required."""

    def __init__(
        self,
        components: Mapping[str, tuple[Scorer, float]],
        *,
        mode: CombineMode | str = CombineMode.sum,
        optional: Collection[str] = (),
    ) -> None:
        self.mode = member(CombineMode, mode, "mode")
        if not components:
            raise ValueError("components is empty; name at least one reward with a weight")
        for name, (_, weight) in components.items():
            check_weight(name, weight)
        if unknown := sorted(set(optional) - set(components)):
            raise ValueError(f"optional names {unknown}, which are not components ({sorted(components)})")
        self.components = dict(components)
        self.optional = frozenset(optional)

    @property
    def weights(self) -> dict[str, float]:
        return {name: float(weight) for name, (_, weight) in self.components.items()}

    def score(self, images: Tensor, prompts: Sequence[str]) -> dict[str, Tensor]:
        """Raw scores [B] of every component, in order; NaN or inf raises NonFiniteRewardError naming it."""
        return {name: self.score_term(name, images, prompts) for name in self.components}

    def score_term(self, name: str, images: Tensor, prompts: Sequence[str]) -> Tensor:
        """Raw scores [B] of component ``name``; NaN or inf raises NonFiniteRewardError naming it."""
        scorer = self.components[name][0]
        scores = scorer(images, prompts)
        check_finite(scores, component=name, scorer=scorer.name)
        return scores

    def combine(
        self,
        scores: Mapping[str, Tensor],
        *,
        group_ids: Tensor | None = None,
        advantage_fn: AdvantageFn | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """-> (total [B], parts) with total = sum_k w_k parts[k].

        mode="sum": parts are the raw scores and total is the reward (pass no group_ids or
        advantage_fn: advantages of the total are the caller's business).
        mode="advantage": parts are the per-component advantages ``advantage_fn(s_k, group_ids)``
        and total is the advantage."""
        parts = self._checked(scores)
        if self.mode is CombineMode.sum:
            if group_ids is not None or advantage_fn is not None:
                raise ValueError("mode=sum returns rewards; group_ids and advantage_fn are not used")
        else:
            if group_ids is None or advantage_fn is None:
                raise ValueError("mode=advantage needs group_ids and advantage_fn")
            parts = {name: advantage_fn(score, group_ids) for name, score in parts.items()}
        return self._weighted_sum(parts), parts

    def total(self, scores: Mapping[str, Tensor]) -> Tensor:
        """The reward [B] = sum_k w_k s_k of raw scores, in either mode (what ``reward/total`` logs)."""
        return self._weighted_sum(self._checked(scores))

    def _weighted_sum(self, parts: Mapping[str, Tensor]) -> Tensor:
        weights = renormalised_weights(self.weights, parts)
        terms = [weights[name] * part for name, part in parts.items()]
        return sum(terms[1:], terms[0])

    def advantages(
        self, scores: Mapping[str, Tensor], group_ids: Tensor, advantage_fn: AdvantageFn
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Advantages [B] in either mode (A(sum_k w_k s_k) or sum_k w_k A(s_k)), and the parts of ``combine``."""
        if self.mode is CombineMode.advantage:
            return self.combine(scores, group_ids=group_ids, advantage_fn=advantage_fn)
        reward, parts = self.combine(scores)
        return advantage_fn(reward, group_ids), parts

    def to(self, device: torch.device | str) -> RewardCombiner:
        for scorer, _ in self.components.values():
            scorer.to(device)
        return self

    def _checked(self, scores: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``scores`` in the components' order: every required component, and no name that is not one."""
        required = set(self.components) - self.optional
        if not required <= set(scores) <= set(self.components) or not scores:
            raise ValueError(
                f"scores have components {sorted(scores)}, expected {sorted(self.components)} "
                f"(optional ones may be missing: {sorted(self.optional)}, not all of them)"
            )
        for name, score in scores.items():
            check_finite(score, component=name, scorer=self.components[name][0].name)
        return {name: scores[name] for name in self.components if name in scores}


def renormalised_weights(weights: Mapping[str, float], present: Collection[str]) -> dict[str, float]:
    """The weights of the ``present`` components, scaled so that the sum of their absolute values is that of all
    ``weights`` (module docstring); ValueError when every present weight is 0 (nothing to learn from)."""
    kept = sum(abs(weights[name]) for name in present)
    if kept == 0:
        raise ValueError(f"every weight of the components left ({sorted(present)}) is 0")
    scale = sum(abs(weight) for weight in weights.values()) / kept
    return {name: weight * scale for name, weight in weights.items() if name in present}


def check_finite(score: Tensor, *, component: str, scorer: str) -> None:
    """NonFiniteRewardError naming the component, its scorer and the offending rows if ``score`` has NaN or inf."""
    bad = ~torch.isfinite(score.detach())
    if bad.any():
        rows = bad.nonzero().flatten().tolist()
        raise NonFiniteRewardError(
            f"reward component {component!r} (scorer {scorer!r}) returned NaN or inf for images {rows}"
        )
