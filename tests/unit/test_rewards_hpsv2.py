"""HPSv2.1 scorer: parity with the reference package (hpsv2x), loading, batching, gradients."""

from __future__ import annotations

import argparse
import importlib.util
import warnings

import numpy as np
import pytest
import torch
from PIL import Image
from scorer_checks import (
    assert_batched_equals_one_by_one,
    assert_gradient_reaches_images_and_weights_are_frozen,
    uint8_images,
)

from rewards.hpsv2 import HPSv2Scorer
from rewards.tiny import TINY_HPS_ARCH, save_tiny_hps

PROMPTS = [
    "a photo of a cat",
    "An Oil Painting of a LIGHTHOUSE, at dusk!!",
    # Longer than 77 tokens: both tokenizers truncate and end with <|endoftext|>.
    "a very detailed scene " * 30,
]


@pytest.fixture(scope="session")
def tiny_hps(tmp_path_factory: pytest.TempPathFactory) -> tuple:
    return save_tiny_hps(tmp_path_factory.mktemp("hps"))


@pytest.fixture(scope="session")
def scorer(tiny_hps: tuple) -> HPSv2Scorer:
    checkpoint, config = tiny_hps
    return HPSv2Scorer(checkpoint, arch=str(config))


@pytest.fixture(scope="session")
def reference_score(tiny_hps: tuple, tmp_path_factory: pytest.TempPathFactory):
    """hpsv2x's own scoring function on the tiny model: its vendored open_clip, its
    ``preprocess_val`` (light_augmentation=True, as in ``initialize_model``) and its score formula."""
    if importlib.util.find_spec("hpsv2") is None:
        pytest.skip("hpsv2x is not installed (CI installs it: see .ci/run)")
    # Imported plainly, not with importorskip: an installed but broken hpsv2x must fail the test.
    import hpsv2.img_score as img_score
    import hpsv2.src.open_clip as hps_open_clip

    checkpoint, config = tiny_hps
    hps_open_clip.add_model_config(config)
    model, _, preprocess_val = hps_open_clip.create_model_and_transforms(
        TINY_HPS_ARCH, None, precision="amp", device="cpu", jit=False, force_quick_gelu=False,
        force_custom_text=False, force_patch_dropout=False, force_image_size=None, pretrained_image=False,
        image_mean=None, image_std=None, light_augmentation=True, aug_cfg={}, output_dict=True,
        with_score_predictor=False, with_region_predictor=False,
    )  # fmt: skip
    root = tmp_path_factory.mktemp("hps_root")

    def score(images: list[Image.Image], prompt: str) -> torch.Tensor:
        # Pre-populating model_dict skips the hub download of the ViT-H-14 base weights; root_path
        # would otherwise be created under the home directory.
        with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            patch.setattr(img_score, "model_dict", {"model": model, "preprocess_val": preprocess_val})
            patch.setattr(img_score, "root_path", str(root))
            values = img_score.score(images, prompt, cp=str(checkpoint), hps_version="v2.1")
        return torch.tensor(np.array(values, dtype=np.float32))

    return score


# Tiny model input is 32 px: down- and up-sampling, portrait and landscape, odd padding.
@pytest.mark.parametrize("height,width", [(32, 32), (64, 64), (40, 72), (96, 50), (24, 24), (33, 17)])
def test_matches_reference_hpsv2(scorer: HPSv2Scorer, reference_score, height: int, width: int) -> None:
    pixels = uint8_images(3, height, width, seed=height * 1000 + width)
    # ToTensor divides uint8 by 255: the same [0, 1] values we hand to our scorer.
    images = pixels.float() / 255
    pil_images = [Image.fromarray(image.permute(1, 2, 0).numpy()) for image in pixels]
    for prompt in PROMPTS:
        expected = reference_score(pil_images, prompt)
        ours = scorer(images, [prompt] * len(pil_images))
        torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)
    # Random weights still separate images: the comparison is not between constants.
    assert ours.std() > 1e-3


def test_tokenizer_matches_reference(scorer: HPSv2Scorer, reference_score) -> None:
    from hpsv2.src.open_clip import get_tokenizer

    torch.testing.assert_close(scorer.tokenizer(PROMPTS), get_tokenizer(TINY_HPS_ARCH)(PROMPTS))


def test_batched_equals_one_by_one_and_mixed_prompts(scorer: HPSv2Scorer) -> None:
    images = uint8_images(4, 40, 56, seed=1).float() / 255
    assert_batched_equals_one_by_one(scorer, images, [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[2]], atol=1e-6)


def test_gradient_reaches_images_and_weights_are_frozen(scorer: HPSv2Scorer) -> None:
    images = uint8_images(2, 48, 48, seed=2).float() / 255
    assert_gradient_reaches_images_and_weights_are_frozen(scorer, images, PROMPTS[:2])


def test_non_square_image_at_model_size_is_padded(scorer: HPSv2Scorer) -> None:
    # The reference skips resize and padding when the longer side already equals the model size,
    # which crashes its ViT on non-square input; we still pad, i.e. score it like a resize by 1.
    images = uint8_images(1, 32, 20, seed=3).float() / 255
    padded = torch.zeros(1, 3, 32, 32)
    padded[..., 6:26] = images
    torch.testing.assert_close(scorer(images, PROMPTS[:1]), scorer(padded, PROMPTS[:1]), atol=1e-6, rtol=0)


def test_checkpoint_with_pickled_extras_loads(tiny_hps: tuple, scorer: HPSv2Scorer, tmp_path) -> None:
    # Training checkpoints may carry non-tensor objects that weights_only loading refuses.
    checkpoint, config = tiny_hps
    state = torch.load(checkpoint, weights_only=True)
    state["args"] = argparse.Namespace(lr=1e-5)
    torch.save(state, tmp_path / "with_args.pt")
    other = HPSv2Scorer(tmp_path / "with_args.pt", arch=str(config))
    images = uint8_images(2, 32, 32, seed=4).float() / 255
    torch.testing.assert_close(other(images, PROMPTS[:2]), scorer(images, PROMPTS[:2]))


def test_missing_checkpoint_names_file_and_field(tiny_hps: tuple, tmp_path) -> None:
    missing = tmp_path / "HPS_v2.1_compressed.pt"
    with pytest.raises(FileNotFoundError, match=r"checkpoint: file .*HPS_v2\.1_compressed\.pt' does not exist"):
        HPSv2Scorer(missing, arch=str(tiny_hps[1]))


def test_unknown_arch_is_a_value_error(tiny_hps: tuple) -> None:
    with pytest.raises(ValueError, match=r"arch='ViT-Nonexistent-99' is not an open_clip model name"):
        HPSv2Scorer(tiny_hps[0], arch="ViT-Nonexistent-99")
