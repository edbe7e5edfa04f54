"""Reward combiner, registry, input checks, JPEG rewards, evaluation summaries, import layering."""

from __future__ import annotations

import ast
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from torch import Tensor

import rewards
from rewards.base import SCORER_NAMES, Scorer, build_scorer
from rewards.combine import RewardCombiner, renormalised_weights
from rewards.compressibility import JPEGCompressibilityScorer, JPEGIncompressibilityScorer
from rewards.summary import summarize
from train.algorithm.grpo import group_advantages


class FixedScorer(Scorer):
    """Returns preset scores, whatever the images."""

    def __init__(self, name: str, values: Sequence[float]) -> None:
        self.name = name
        self.values = torch.tensor(values)

    def score(self, images: Tensor, prompts: Sequence[str]) -> Tensor:
        return self.values

    def to(self, device: torch.device | str) -> FixedScorer:
        return self


IMAGES = torch.full((4, 3, 8, 8), 0.5)
PROMPTS = ["a", "a", "b", "b"]
GROUPS = torch.tensor([0, 0, 1, 1])


def _combiner(mode: str, b_values: Sequence[float] = (0.0, 2.0, 5.0, 1.0)) -> RewardCombiner:
    components = {
        "hps": (FixedScorer("hpsv2", [1.0, 3.0, 2.0, 2.0]), 1.0),
        "clip": (FixedScorer("clipscore", b_values), 0.5),
    }
    return RewardCombiner(components, mode=mode)


def _hand_advantages(rewards_: Tensor, group_ids: Tensor) -> Tensor:
    """Plain (r - mean) / std per group, population std, 0 for a constant group."""
    out = torch.zeros_like(rewards_)
    for group in group_ids.unique():
        mask = group_ids == group
        std = rewards_[mask].std(unbiased=False)
        out[mask] = 0.0 if std == 0 else (rewards_[mask] - rewards_[mask].mean()) / std
    return out


def test_sum_mode_is_weighted_sum_of_raw_scores() -> None:
    combiner = _combiner("sum")
    scores = combiner.score(IMAGES, PROMPTS)
    total, parts = combiner.combine(scores)
    # hps + 0.5 clip = [1 + 0, 3 + 1, 2 + 2.5, 2 + 0.5]
    torch.testing.assert_close(total, torch.tensor([1.0, 4.0, 4.5, 2.5]))
    assert list(parts) == ["hps", "clip"]
    torch.testing.assert_close(parts["clip"], torch.tensor([0.0, 2.0, 5.0, 1.0]))


@pytest.mark.parametrize("advantage_fn", [_hand_advantages, group_advantages], ids=["hand", "train.algorithm.grpo"])
def test_advantage_mode_sums_weighted_per_reward_advantages(advantage_fn) -> None:
    combiner = _combiner("advantage")
    total, parts = combiner.combine(combiner.score(IMAGES, PROMPTS), group_ids=GROUPS, advantage_fn=advantage_fn)
    # hps: group 0 [1, 3] -> [-1, 1]; group 1 [2, 2] -> [0, 0].
    # clip: group 0 [0, 2] -> [-1, 1]; group 1 [5, 1] -> mean 3, std 2 -> [1, -1].
    # total = hps + 0.5 clip = [-1.5, 1.5, 0.5, -0.5]
    torch.testing.assert_close(parts["hps"], torch.tensor([-1.0, 1.0, 0.0, 0.0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(parts["clip"], torch.tensor([-1.0, 1.0, 1.0, -1.0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(total, torch.tensor([-1.5, 1.5, 0.5, -0.5]), atol=1e-6, rtol=0)


def test_advantages_in_sum_mode_normalize_the_weighted_reward() -> None:
    combiner = _combiner("sum")
    advantages, parts = combiner.advantages(combiner.score(IMAGES, PROMPTS), GROUPS, _hand_advantages)
    # reward [1, 4, 4.5, 2.5]: group 0 -> [-1, 1], group 1 -> [1, -1]
    torch.testing.assert_close(advantages, torch.tensor([-1.0, 1.0, 1.0, -1.0]))
    torch.testing.assert_close(parts["hps"], torch.tensor([1.0, 3.0, 2.0, 2.0]))


def test_nan_score_is_an_error_naming_the_scorer() -> None:
    combiner = _combiner("sum", b_values=(0.0, float("nan"), 1.0, 1.0))
    with pytest.raises(ValueError, match=r"'clip' \(scorer 'clipscore'\).*\[1\]"):
        combiner.score(IMAGES, PROMPTS)
    scores = {"hps": torch.ones(4), "clip": torch.tensor([0.0, 1.0, float("inf"), 1.0])}
    with pytest.raises(ValueError, match=r"'clip' \(scorer 'clipscore'\).*\[2\]"):
        combiner.combine(scores)


def test_combiner_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="mode='mean' is not valid; accepted values: sum, advantage"):
        _combiner("mean")
    with pytest.raises(ValueError, match="group_ids and advantage_fn"):
        _combiner("advantage").combine({"hps": torch.ones(4), "clip": torch.ones(4)})
    with pytest.raises(ValueError, match="not used"):
        _combiner("sum").combine({"hps": torch.ones(4), "clip": torch.ones(4)}, advantage_fn=_hand_advantages)
    with pytest.raises(ValueError, match="expected"):
        _combiner("sum").combine({"hps": torch.ones(4)})
    with pytest.raises(ValueError, match=r"components\.x\.weight must be a finite number"):
        RewardCombiner({"x": (FixedScorer("x", [1.0]), float("nan"))})


def test_renormalised_weights_keep_the_sum_of_absolute_weights() -> None:
    """w'_k = w_k * sum_j |w_j| / sum_(j present) |w_j|: 1 : -2 : 3 with the -2 gone -> 1.5 : 4.5 (sum 6); all
    present: the weights as they are, bit for bit; nothing weighted left: an error."""
    weights = {"a": 1.0, "b": -2.0, "c": 3.0}
    assert renormalised_weights(weights, ["a", "c"]) == {"a": 1.5, "c": 4.5}
    assert renormalised_weights(weights, ["b"]) == {"b": -6.0}
    assert renormalised_weights(weights, ["a", "b", "c"]) == weights
    with pytest.raises(ValueError, match=r"every weight of the components left \(\['z'\]\) is 0"):
        renormalised_weights({"a": 1.0, "z": 0.0}, ["z"])


def _optional(mode: str) -> RewardCombiner:
    return RewardCombiner(
        {"hps": (FixedScorer("hpsv2", [0.0]), 1.0), "clip": (FixedScorer("clipscore", [0.0]), 0.5)},
        mode=mode,
        optional=["clip"],
    )


def test_a_missing_optional_component_renormalises_in_sum_mode(float64) -> None:
    """hps alone, its weight 1 -> 1.5 (the sum of |w| kept): the reward is 1.5 hps, in float64."""
    hps = torch.tensor([1.0, 3.0, 2.0, 2.0], dtype=torch.float64) / 3
    total, parts = _optional("sum").combine({"hps": hps})
    assert total.dtype == torch.float64 and list(parts) == ["hps"]
    torch.testing.assert_close(total, 1.5 * hps, rtol=1e-15, atol=0)
    advantages, _ = _optional("sum").advantages({"hps": hps}, GROUPS, _hand_advantages)
    torch.testing.assert_close(advantages, _hand_advantages(1.5 * hps, GROUPS), rtol=1e-15, atol=1e-15)


def test_a_missing_optional_component_renormalises_in_advantage_mode(float64) -> None:
    """clip alone, its weight 0.5 -> 1.5: the advantage is 1.5 A(clip) (per-term advantages scale with it)."""
    clip = torch.tensor([0.1, 0.7, 5.0, 1.0], dtype=torch.float64)
    total, _ = _optional("advantage").combine(
        {"clip": clip, "hps": torch.zeros(4, dtype=torch.float64)}, group_ids=GROUPS, advantage_fn=_hand_advantages
    )
    torch.testing.assert_close(total, 0.5 * _hand_advantages(clip, GROUPS), rtol=1e-15, atol=1e-15)
    optional = RewardCombiner(
        {"hps": (FixedScorer("hpsv2", [0.0]), 1.0), "clip": (FixedScorer("clipscore", [0.0]), 0.5)},
        mode="advantage",
        optional=["hps", "clip"],
    )
    alone, _ = optional.advantages({"clip": clip}, GROUPS, _hand_advantages)
    torch.testing.assert_close(alone, 1.5 * _hand_advantages(clip, GROUPS), rtol=1e-15, atol=1e-15)


def test_only_optional_components_may_be_missing() -> None:
    with pytest.raises(
        ValueError, match=r"scores have components \['clip'\].*optional ones may be missing: \['clip'\]"
    ):
        _optional("sum").combine({"clip": torch.ones(4)})
    with pytest.raises(ValueError, match=r"optional names \['pick'\], which are not components"):
        RewardCombiner({"hps": (FixedScorer("hpsv2", [0.0]), 1.0)}, optional=["pick"])


def test_registry_builds_by_name_and_lists_names_on_error() -> None:
    expected = {
        "hpsv2",
        "clipscore",
        "pickscore",
        "imagereward",
        "jpeg_compressibility",
        "jpeg_incompressibility",
        "shape_alignment",
        "remote",
        "judge",
    }
    assert set(SCORER_NAMES) == expected
    assert isinstance(build_scorer("jpeg_compressibility"), JPEGCompressibilityScorer)
    assert rewards.build_scorer is build_scorer
    with pytest.raises(ValueError, match="hpsv2, clipscore, pickscore, imagereward, jpeg_compressibility"):
        build_scorer("aesthetic")


def test_registry_passes_paths_through_to_file_checks(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"checkpoint: file .*HPS_v2\.1_compressed\.pt' does not exist"):
        build_scorer("hpsv2", checkpoint=tmp_path / "HPS_v2.1_compressed.pt")


@pytest.mark.parametrize(
    "images,prompts,match",
    [
        (torch.rand(2, 4, 8, 8), ["a", "b"], r"\[B, 3, H, W\]"),
        (torch.rand(2, 3, 8, 8), ["a"], "one prompt per image"),
        (torch.rand(1, 3, 8, 8), "a", "single string"),
        (torch.rand(2, 3, 8, 8) * 2 - 1, ["a", "b"], r"\(x / 2 \+ 0\.5\)"),
        (torch.randint(0, 255, (1, 3, 8, 8)), ["a"], "floating point"),
    ],
)
def test_scorer_input_checks(images: Tensor, prompts, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        JPEGCompressibilityScorer()(images, prompts)


@pytest.mark.parametrize("values", [[1.0, 2.0, 3.0], [[1.0], [2.0], [3.0], [4.0]]])
def test_scorer_output_shape_is_checked(values) -> None:
    """A scorer returning other than one score per image is an error naming it, not an assert."""
    with pytest.raises(ValueError, match=r"reward 'fixed': score\(\) must return one value per image, shape \[4\]"):
        FixedScorer("fixed", values)(IMAGES, PROMPTS)


def test_flat_image_is_more_compressible_than_noise() -> None:
    flat = torch.full((1, 3, 64, 64), 0.4)
    noise = torch.rand(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    images = torch.cat([flat, noise])
    compressibility = JPEGCompressibilityScorer()(images, ["", ""])
    incompressibility = JPEGIncompressibilityScorer()(images, ["", ""])
    assert compressibility.dtype == torch.float32
    assert compressibility[0] > compressibility[1]
    torch.testing.assert_close(incompressibility, -compressibility)
    # Noise at quality 95 barely compresses: several kB for 64 x 64 x 3 = 12.3 kB raw.
    assert incompressibility[1] > 5.0 > 1.0 > incompressibility[0]


def test_summarize_means_overall_and_per_category() -> None:
    scores = {"hpsv2": torch.tensor([0.1, 0.3, 0.2, 0.6]), "clipscore": torch.tensor([1.0, 2.0, 3.0, 4.0])}
    summary = summarize(scores, ["anime", "photo", "anime", "photo"])
    expected = {
        "hpsv2": 0.3, "hpsv2/anime": 0.15, "hpsv2/photo": 0.45,
        "clipscore": 2.5, "clipscore/anime": 2.0, "clipscore/photo": 3.0,
    }  # fmt: skip
    assert summary.keys() == expected.keys()
    for key, value in expected.items():
        assert summary[key] == pytest.approx(value)
    assert summarize(scores, None) == pytest.approx({"hpsv2": 0.3, "clipscore": 2.5})
    with pytest.raises(ValueError, match="categories"):
        summarize(scores, ["anime"])


def test_rewards_never_import_train_distributed_hydra_or_wandb() -> None:
    forbidden = ("train", "torch.distributed", "hydra", "wandb", "omegaconf")
    for path in Path(rewards.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert not any(name == bad or name.startswith(bad + ".") for bad in forbidden), f"{path}: {name}"
