"""CLIPScore and PickScore on tiny random CLIP models saved and reloaded with save_pretrained/from_pretrained."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from scorer_checks import assert_batched_equals_one_by_one, assert_gradient_reaches_images_and_weights_are_frozen
from transformers import CLIPImageProcessor, CLIPModel, CLIPProcessor

from rewards.clipscore import CLIPScoreScorer
from rewards.pickscore import PickScoreScorer
from rewards.tiny import save_tiny_clip, tiny_clip_processor

PROMPTS = ["a photo of a cat", "a red car on a bridge", "a photo of a cat", "a very long caption " * 30]


@pytest.fixture(scope="session")
def pickscore_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """PickScore's layout: the weights in one directory, the CLIP-H processor in another."""
    model_dir = save_tiny_clip(tmp_path_factory.mktemp("pickscore"), seed=1, with_processor=False)
    processor_dir = tmp_path_factory.mktemp("clip_h_processor")
    tiny_clip_processor().save_pretrained(processor_dir)
    return model_dir, processor_dir


@pytest.fixture(scope="session")
def scorers(tiny_clip_dir: Path, pickscore_dirs: tuple[Path, Path]) -> dict:
    return {"clipscore": CLIPScoreScorer(tiny_clip_dir), "pickscore": PickScoreScorer(*pickscore_dirs)}


def _smooth_images(num: int, height: int, width: int, seed: int) -> torch.Tensor:
    """Upsampled coarse noise, quantized to uint8 steps: closer to photos than pixel noise."""
    generator = torch.Generator().manual_seed(seed)
    coarse = torch.rand(num, 3, max(height // 6, 2), max(width // 6, 2), generator=generator)
    images = F.interpolate(coarse, size=(height, width), mode="bilinear", align_corners=False)
    return (images * 255).round() / 255


@pytest.mark.parametrize("name", ["clipscore", "pickscore"])
def test_batched_equals_one_by_one(scorers: dict, name: str) -> None:
    batched = assert_batched_equals_one_by_one(scorers[name], _smooth_images(4, 48, 40, seed=0), PROMPTS, atol=1e-5)
    assert batched.std() > 1e-3  # random weights still separate the pairs


@pytest.mark.parametrize("name", ["clipscore", "pickscore"])
def test_gradient_reaches_images_and_weights_are_frozen(scorers: dict, name: str) -> None:
    assert_gradient_reaches_images_and_weights_are_frozen(scorers[name], _smooth_images(2, 40, 64, seed=1), PROMPTS[:2])


def test_score_is_transformers_cosine(tiny_clip_dir: Path, scorers: dict) -> None:
    # At the model's input size no resize happens, so the processor and our transform agree exactly
    # and the score must be CLIPModel's logits_per_image divided by the logit scale.
    images = _smooth_images(3, 32, 32, seed=2)
    pil_images = [Image.fromarray((image * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()) for image in images]
    model = CLIPModel.from_pretrained(tiny_clip_dir).eval()
    inputs = CLIPProcessor.from_pretrained(tiny_clip_dir)(
        text=PROMPTS[:3], images=pil_images, padding=True, truncation=True, return_tensors="pt"
    )
    with torch.no_grad():
        output = model(**inputs)
    expected = output.logits_per_image.diagonal() / model.logit_scale.exp()
    torch.testing.assert_close(scorers["clipscore"](images, PROMPTS[:3]), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("height,width", [(64, 64), (40, 72), (96, 50), (24, 24), (33, 17), (200, 120)])
def test_tensor_preprocessing_close_to_processor(tiny_clip_dir: Path, scorers: dict, height: int, width: int) -> None:
    # Tolerance: the CPU processor resizes uint8 pixels (rounded to 1/255, i.e. 0.015 after dividing
    # by CLIP's std of about 0.27); on smooth images we measured at most 0.015.
    images = _smooth_images(1, height, width, seed=height + width)
    pil = Image.fromarray((images[0] * 255).round().to(torch.uint8).permute(1, 2, 0).numpy())
    expected = CLIPImageProcessor.from_pretrained(tiny_clip_dir)(images=pil, return_tensors="pt")["pixel_values"]
    ours = scorers["clipscore"].transform(images)
    assert ours.shape == expected.shape == (1, 3, 32, 32)
    torch.testing.assert_close(ours, expected, atol=0.03, rtol=0)


def test_pickscore_without_processor_names_field(pickscore_dirs: tuple[Path, Path]) -> None:
    model_dir, _ = pickscore_dirs
    # The weights directory alone holds no processor: pointing both paths at it names the field.
    pattern = r"processor_path: .* holds none of \[.preprocessor_config\.json"
    with pytest.raises(FileNotFoundError, match=pattern):
        PickScoreScorer(model_dir, model_dir)


def test_missing_model_directory_names_field(tmp_path: Path, tiny_clip_dir: Path) -> None:
    missing = tmp_path / "clip-vit-large-patch14"
    with pytest.raises(FileNotFoundError, match=r"model_path: directory .*clip-vit-large-patch14"):
        CLIPScoreScorer(missing)
    missing.mkdir()
    with pytest.raises(FileNotFoundError, match=r"model_path: .*config\.json"):
        CLIPScoreScorer(missing, processor_path=tiny_clip_dir)


def test_bfloat16_scorer_returns_float32_close_to_float32(tiny_clip_dir: Path, scorers: dict) -> None:
    images = _smooth_images(2, 48, 48, seed=3)
    low = CLIPScoreScorer(tiny_clip_dir, dtype="bf16")(images, PROMPTS[:2])
    assert low.dtype == torch.float32
    torch.testing.assert_close(low, scorers["clipscore"](images, PROMPTS[:2]), atol=3e-2, rtol=0)


def test_pickscore_flow_grpo_scale_is_logit_over_26(pickscore_dirs: tuple[Path, Path], scorers: dict) -> None:
    # flow_grpo's PickScore reward: logit_scale.exp() * cosine / 26, the same ranking as the cosine
    images = _smooth_images(4, 40, 48, seed=3)
    scaled = PickScoreScorer(*pickscore_dirs, scale="flow_grpo")
    cosine = scorers["pickscore"](images, PROMPTS)
    factor = scorers["pickscore"].model.logit_scale.exp().item() / 26
    torch.testing.assert_close(scaled(images, PROMPTS), cosine * factor, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="scale='logit' is not valid; accepted values: cosine, flow_grpo"):
        PickScoreScorer(*pickscore_dirs, scale="logit")
