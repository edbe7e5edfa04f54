"""ImageReward scorer: parity with the reference package (image-reward), loading, batching, gradients."""

from __future__ import annotations

import importlib.util
import json
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from scorer_checks import (
    assert_batched_equals_one_by_one,
    assert_gradient_reaches_images_and_weights_are_frozen,
    uint8_images,
)

from rewards.imagereward import SCORE_STD, ImageRewardScorer
from rewards.tiny import TINY_BLIP_VISION, save_tiny_imagereward
from train.ground.errors import PathError
from train.parts.scoring.scorers import check_scorer

PROMPTS = [
    "a photo of a cat",
    "An Oil Painting of a LIGHTHOUSE, at dusk!!",
    # Longer than 35 tokens, unknown words, and BLIP's added special tokens: both truncate alike.
    "a very detailed scene with zebras [ENC] " * 8,
]


@pytest.fixture(scope="session")
def tiny_ir(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return save_tiny_imagereward(tmp_path_factory.mktemp("imagereward"))


@pytest.fixture(scope="session")
def scorer(tiny_ir: dict[str, Path]) -> ImageRewardScorer:
    return ImageRewardScorer(**tiny_ir)


def _pil(pixels: torch.Tensor) -> list[Image.Image]:
    return [Image.fromarray(image.permute(1, 2, 0).numpy()) for image in pixels]


def _import_reference(patch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """The package's BLIP and ImageReward modules, imported under the few patches that let the 2023 package run
    with transformers 5 and no network."""
    # The package's __init__ files import its ReFL trainer and CLIP/aesthetic scorers (datasets, accelerate,
    # OpenAI's clip): empty packages in their place leave the ImageReward model's own modules as they are.
    root = Path(importlib.util.find_spec("ImageReward").submodule_search_locations[0])  # type: ignore[union-attr,index]
    for name, folder in (("ImageReward", root), ("ImageReward.models", root / "models")):
        package = types.ModuleType(name)
        package.__path__ = [str(folder)]
        patch.setitem(sys.modules, name, package)
    # med.py imports helpers that transformers 5 moved (apply_chunking_to_forward, prune_linear_layer) or
    # dropped (find_pruneable_heads_and_indices, used only to prune heads, which scoring never does).
    import transformers.modeling_utils as modeling_utils
    import transformers.pytorch_utils as pytorch_utils

    for helper in ("apply_chunking_to_forward", "prune_linear_layer"):
        patch.setattr(modeling_utils, helper, getattr(pytorch_utils, helper), raising=False)
    patch.setattr(modeling_utils, "find_pruneable_heads_and_indices", None, raising=False)
    import ImageReward.ImageReward as image_reward
    import ImageReward.models.BLIP.blip as blip
    import ImageReward.models.BLIP.blip_pretrain as blip_pretrain
    import ImageReward.models.BLIP.med as med
    import ImageReward.models.BLIP.vit as vit

    return types.SimpleNamespace(image_reward=image_reward, blip=blip, blip_pretrain=blip_pretrain, med=med, vit=vit)


def _patch_reference(patch: pytest.MonkeyPatch, ref: types.SimpleNamespace, tokenizer: Path) -> None:
    """The tiny ViT, the local tokenizer, and the three PreTrainedModel methods transformers 5 dropped."""

    class LocalTokenizer(ref.blip.BertTokenizer):  # type: ignore[name-defined,misc]
        """bert-base-uncased from the tiny folder; transformers 5 names additional_special_tokens extra ones."""

        @classmethod
        def from_pretrained(cls, name: str, *args: object, **kwargs: object) -> LocalTokenizer:
            assert name == "bert-base-uncased"
            return super().from_pretrained(tokenizer, *args, **kwargs)

        @property
        def additional_special_tokens_ids(self) -> list[int]:
            return self.convert_tokens_to_ids(self.extra_special_tokens)

    def tiny_vit(vit: str, image_size: int, *args: object) -> tuple[torch.nn.Module, int]:
        # the package's own VisionTransformer, as create_vit builds it, at the tiny width and depth
        v = TINY_BLIP_VISION
        model = ref.vit.VisionTransformer(
            img_size=image_size, patch_size=v["patch_size"], embed_dim=v["hidden_size"],
            depth=v["num_hidden_layers"], num_heads=v["num_attention_heads"],
            mlp_ratio=v["intermediate_size"] / v["hidden_size"],
        )  # fmt: skip
        return model, v["hidden_size"]

    def invert_attention_mask(self: torch.nn.Module, mask: torch.Tensor) -> torch.Tensor:
        # transformers 4's PreTrainedModel.invert_attention_mask for a [B, L] mask
        return (1.0 - mask[:, None, None, :].to(torch.float32)) * torch.finfo(torch.float32).min

    patch.setattr(ref.blip, "BertTokenizer", LocalTokenizer)
    patch.setattr(ref.blip_pretrain, "create_vit", tiny_vit)
    # every weight comes from the checkpoint (load_state_dict reports no missing key), so no init is needed
    patch.setattr(ref.med.BertModel, "init_weights", lambda self: None)
    patch.setattr(ref.med.BertModel, "get_head_mask", lambda self, mask, num_layers: [None] * num_layers, raising=False)
    patch.setattr(ref.med.BertModel, "invert_attention_mask", invert_attention_mask, raising=False)


@pytest.fixture(scope="session")
def reference(tiny_ir: dict[str, Path]) -> Iterator[torch.nn.Module]:
    """The package's ImageReward model built from the tiny med_config and loaded from the tiny checkpoint as
    ``ImageReward.load`` does (its torch.load, load_state_dict(strict=False), eval)."""
    if importlib.util.find_spec("ImageReward") is None:
        pytest.skip("image-reward is not installed (make test installs it: see the Makefile's .test-extras)")
    patch = pytest.MonkeyPatch()
    try:
        # Imported plainly, not with importorskip: an installed but broken image-reward must fail the test.
        ref = _import_reference(patch)
        _patch_reference(patch, ref, tiny_ir["tokenizer"])
        model = ref.image_reward.ImageReward(med_config=str(tiny_ir["med_config"]), device="cpu")
        loaded = model.load_state_dict(torch.load(tiny_ir["checkpoint"], map_location="cpu"), strict=False)
        assert not loaded.missing_keys and not loaded.unexpected_keys
        yield model.eval()
    finally:
        patch.undo()


def _reference_scores(model: torch.nn.Module, prompt: str, images: list[Image.Image]) -> torch.Tensor:
    with torch.no_grad():
        one_by_one = [model.score(prompt, image) for image in images]
        _, ranked = model.inference_rank(prompt, images)  # the list path MixGRPO's reward calls
    torch.testing.assert_close(torch.tensor(ranked), torch.tensor(one_by_one), atol=1e-5, rtol=0)
    return torch.tensor(np.array(one_by_one, dtype=np.float32))


# At 224 px on the shorter side the reference's 8-bit PIL resize is the identity: only the crop remains, with
# torchvision's rounded offset (263 - 224 = 39: round(19.5) = 20, where a truncating crop takes 19).
@pytest.mark.parametrize("height,width", [(224, 224), (224, 260), (263, 224)])
def test_matches_reference_imagereward(scorer: ImageRewardScorer, reference, height: int, width: int) -> None:
    pixels = uint8_images(3, height, width, seed=height * 1000 + width)
    for prompt in PROMPTS:
        expected = _reference_scores(reference, prompt, _pil(pixels))
        ours = scorer(pixels.float() / 255, [prompt] * len(pixels))
        torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)
    # Random weights still separate images: the comparison is not between constants.
    assert ours.std() > 1e-2


def test_resized_pixels_match_reference_to_8_bit_rounding(scorer: ImageRewardScorer, reference) -> None:
    # A smooth image: the reference resizes its 8-bit pixels (rounding each to 1/255), we resize floats.
    y, x = torch.meshgrid(torch.linspace(0, 1, 300), torch.linspace(0, 1, 410), indexing="ij")
    image = torch.stack([x, y, (x + y) / 2]).mul(255).round().to(torch.uint8)
    expected = reference.preprocess(_pil(image[None])[0])[None]
    # one 8-bit step after the CLIP normalisation (std down to 0.26) is 0.015
    torch.testing.assert_close(scorer.pixels(image[None].float() / 255), expected, atol=0.016, rtol=0)


def test_tokenizer_matches_reference(scorer: ImageRewardScorer, reference) -> None:
    for prompt in PROMPTS:
        ours = scorer.tokenizer(prompt, padding="max_length", truncation=True, max_length=35, return_tensors="pt")
        theirs = reference.blip.tokenizer(prompt, padding="max_length", truncation=True, max_length=35,
                                          return_tensors="pt")  # fmt: skip
        assert torch.equal(ours.input_ids, theirs.input_ids) and torch.equal(ours.attention_mask, theirs.attention_mask)


def test_batched_equals_one_by_one_and_mixed_prompts(scorer: ImageRewardScorer) -> None:
    images = uint8_images(4, 256, 320, seed=1).float() / 255
    assert_batched_equals_one_by_one(scorer, images, [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[2]], atol=1e-5)


def test_gradient_reaches_images_and_weights_are_frozen(scorer: ImageRewardScorer) -> None:
    images = uint8_images(2, 240, 240, seed=2).float() / 255
    assert_gradient_reaches_images_and_weights_are_frozen(scorer, images, PROMPTS[:2])


def test_score_is_normalised_by_imagereward_std(scorer: ImageRewardScorer) -> None:
    # The normalisation is (raw - mean) / std: two scores differ by their raw difference over 1.0333.
    images = uint8_images(2, 224, 224, seed=5).float() / 255
    tokens = scorer.tokenizer(PROMPTS[:2], padding="max_length", truncation=True, max_length=35, return_tensors="pt")
    raw = scorer.model(scorer.pixels(images), tokens.input_ids, tokens.attention_mask)
    scores = scorer(images, PROMPTS[:2])
    torch.testing.assert_close(scores[0] - scores[1], (raw[0] - raw[1]) / SCORE_STD, atol=1e-5, rtol=0)


@pytest.mark.parametrize("argument", ["checkpoint", "med_config", "tokenizer"])
def test_missing_file_names_its_argument(tiny_ir: dict[str, Path], tmp_path: Path, argument: str) -> None:
    missing = tmp_path / "absent"
    with pytest.raises(FileNotFoundError, match=rf"^{argument}: (file|directory) '.*absent' does not exist"):
        ImageRewardScorer(**{**tiny_ir, argument: missing})
    # the trainer checks the files at start-up, one line naming the config key
    with pytest.raises(PathError, match=rf"^reward\.components\.imagereward\.{argument}='.*absent' does not exist"):
        check_scorer("reward.components.imagereward", "imagereward", {**tiny_ir, argument: str(missing)})


def test_tokenizer_folder_without_vocabulary_is_refused(tiny_ir: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"^tokenizer: '.*' holds none of \['vocab.txt', 'tokenizer.json'\]"):
        ImageRewardScorer(**{**tiny_ir, "tokenizer": tmp_path})


def test_checkpoint_of_another_architecture_is_refused(tiny_ir: dict[str, Path], tmp_path: Path) -> None:
    state = torch.load(tiny_ir["checkpoint"], weights_only=True)
    del state["mlp.layers.7.weight"]
    torch.save(state, tmp_path / "ImageReward.pt")
    with pytest.raises(
        ValueError, match=r"^checkpoint: '.*ImageReward\.pt' does not fit .*missing \['head\.4\.weight'\]"
    ):
        ImageRewardScorer(**{**tiny_ir, "checkpoint": tmp_path / "ImageReward.pt"})
    # another med_config: the checkpoint's feed-forward weights no longer fit
    med = json.loads(tiny_ir["med_config"].read_text()) | {"intermediate_size": 32}
    (tmp_path / "med_config.json").write_text(json.dumps(med))
    with pytest.raises(ValueError, match=r"does not fit .*of another shape \['text_encoder\.encoder\.layer\.0\.inter"):
        ImageRewardScorer(**{**tiny_ir, "med_config": tmp_path / "med_config.json"})
    (tmp_path / "damaged.pt").write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match=r"^checkpoint: '.*damaged\.pt' is not a readable torch file"):
        ImageRewardScorer(**{**tiny_ir, "checkpoint": tmp_path / "damaged.pt"})


def test_bad_med_config_names_the_file(tiny_ir: dict[str, Path], tmp_path: Path) -> None:
    (tmp_path / "med_config.json").write_text('{"hidden_size": 768}')
    with pytest.raises(ValueError, match=r"^med_config: '.*med_config\.json' lacks \['vocab_size'"):
        ImageRewardScorer(**{**tiny_ir, "med_config": tmp_path / "med_config.json"})
