"""The CPU testbed: the procedural shape set, the shape-alignment reward, pretraining, the shipped model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models.diffusers_backbone import pack_latents
from rewards import build_scorer
from rewards.shapes import COLOURS, ShapeAlignmentScorer, inside_shape, parse_caption
from testbed.data import all_captions, make_dataset
from testbed.pretrain import (
    PretrainConfig,
    flow_matching_loss,
    latent_means,
    load_testbed,
    sample,
    save_untrained,
    set_latent_scaling,
    train_flow,
)

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "testbed" / "pipeline"


@pytest.fixture(scope="module")
def shapes() -> tuple[torch.Tensor, list[str]]:
    return make_dataset(48, seed=5)


def test_generator_is_deterministic_and_seeded(shapes):
    images, captions = shapes
    again, again_captions = make_dataset(48, seed=5)
    other, _ = make_dataset(48, seed=6)
    assert torch.equal(images, again) and captions == again_captions
    assert not torch.equal(images, other)
    assert images.shape == (48, 3, 32, 32) and 0 <= images.min() and images.max() <= 1
    # both kinds of scene occur and every caption is in the closed vocabulary
    assert {len(parse_caption(c)) for c in captions} == {1, 2}
    assert set(captions) <= set(all_captions())


def test_ground_truth_scores_one(shapes):
    images, captions = shapes
    scorer = build_scorer("shape_alignment")
    scores = scorer(images, captions)
    assert scores.shape == (48,) and scores.dtype == torch.float32
    assert scores.min() >= 0.99
    assert scorer.last_parts["count"].min() == 1


def _recoloured(caption: str, absent: set[str]) -> str:
    """The caption with every colour replaced by one the image does not show."""
    objects = parse_caption(caption)
    for obj, colour in zip(objects, sorted(absent)):
        caption = caption.replace(f"{obj.colour} {obj.shape}", f"{colour} {obj.shape}", 1)
    return caption


def test_mismatched_captions_score_near_zero(shapes):
    images, captions = shapes
    scorer = ShapeAlignmentScorer()
    wrong_colour = [_recoloured(c, set(COLOURS) - {o.colour for o in parse_caption(c)}) for c in captions]
    assert scorer(images, wrong_colour).max() == 0
    # right colour, wrong shape: the colour part stays, the shape part and the score drop
    swap = {"circle": "square", "square": "triangle", "triangle": "circle"}
    wrong_shape = [" ".join(swap.get(w, w) for w in c.split()) for c in captions]
    parts = scorer.score_parts(images, wrong_shape)
    assert parts["shape"].max() == 0 and parts["colour"].min() == 1
    # single objects keep their size and position parts (2 of 3 attributes), pairs name only shapes
    pairs = torch.tensor([" and " in c for c in captions])
    assert parts["score"][pairs].max() == 0 and parts["score"].max() <= 2 / 3 + 1e-6
    # a count mismatch halves the score
    single = [i for i, c in enumerate(captions) if " and " not in c][0]
    doubled = f"{captions[single].split(' at the ')[0]} and a {sorted(set(COLOURS))[0]} circle"
    assert scorer(images[single : single + 1], [doubled]).item() <= 0.5


def test_shape_part_is_graded_between_clean_shapes():
    """A square with rounded corners is partly a square, partly a circle: GRPO sees a difference
    between samples that a yes/no classification would score alike."""
    centre = torch.arange(32) + 0.5 - 16
    ys, xs = torch.meshgrid(centre, centre, indexing="ij")
    parts = {}
    for rounding in (1.0, 1.1, 1.5):  # circle, rounded square, square
        mask = inside_shape("square", xs, ys, 7.0) & inside_shape("circle", xs, ys, 7.0 * rounding)
        image = torch.zeros(1, 3, 32, 32)
        image[0, :, mask] = torch.tensor(COLOURS["red"])[:, None]
        score = ShapeAlignmentScorer().score_parts
        parts[rounding] = [score(image, [f"a red {shape}"])["shape"].item() for shape in ("square", "circle")]
    assert parts[1.0] == [0.0, 1.0] and parts[1.5] == [1.0, 0.0]
    square, circle = parts[1.1]
    assert 0.1 < square < 0.9 and square + circle == pytest.approx(1.0)


def test_unparseable_caption_is_a_clear_error(shapes):
    images, _ = shapes
    with pytest.raises(ValueError, match="cannot parse 'a photo of a cat'"):
        ShapeAlignmentScorer()(images[:1], ["a photo of a cat"])


@pytest.fixture(scope="module")
def untrained(tmp_path_factory):
    return load_testbed(save_untrained(tmp_path_factory.mktemp("testbed") / "pipeline", seed=0))


def test_short_pretraining_reduces_flow_loss(untrained, shapes):
    images, captions = shapes
    means = latent_means(untrained.vae, images)
    shift, scale = set_latent_scaling(untrained, means)
    latents = pack_latents((means - shift) * scale)
    cond = untrained.encode(captions)

    def held_loss() -> float:
        # the same t and noise before and after: the difference is the training alone
        with torch.no_grad():
            return flow_matching_loss(untrained, latents, cond, generator=torch.Generator().manual_seed(9)).item()

    before = held_loss()
    config = PretrainConfig(batch_size=16, flow_steps=12, flow_lr=2e-3, warmup_steps=1)
    losses = train_flow(untrained, latents, cond, config, generator=torch.Generator().manual_seed(0))
    assert len(losses) == 12
    assert held_loss() < 0.9 * before


@pytest.mark.skipif(not SHIPPED.is_dir(), reason="no shipped testbed pipeline")
def test_shipped_pipeline_loads_and_follows_captions():
    from models.registry import load_backbone

    backbone = load_backbone("flux", SHIPPED, dtype=torch.float32, max_sequence_length=16)
    _, prompts = make_dataset(16, seed=123)
    images = sample(backbone, prompts, seed=0)
    assert images.shape == (16, 3, 32, 32)
    # a random pipeline scores 0 here: the shipped one draws the named coloured shapes often
    assert ShapeAlignmentScorer()(images, prompts).mean() > 0.3
