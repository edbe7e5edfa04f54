"""Image-text cosine similarity with a transformers ``CLIPModel``: the body of CLIPScore and PickScore.

    score = <f_img / |f_img|, f_txt / |f_txt|>,   f_img = visual_projection(vision_model(x).pooler_output)
                                                   f_txt = text_projection(text_model(ids).pooler_output)

i.e. the cosine in [-1, 1], without ``logit_scale`` and without CLIPScore's 2.5 * max(cos, 0)
rescaling, so every CLIP-family reward shares one scale. The image transform is read from the
saved image processor (``preprocessor_config.json`` or ``processor_config.json``): size, crop,
resample, mean and std are the checkpoint's own, applied on tensors (``rewards.preprocess``).
Prompts are tokenized with the saved tokenizer, truncated to the text tower's length; padding is
harmless because CLIP's text tower is causal and pools at the end-of-text token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from transformers import AutoTokenizer, CLIPImageProcessor, CLIPModel

from rewards.base import FrozenModelScorer, require_any_file, require_path, unique_prompts
from rewards.preprocess import center_crop, interpolation_mode, normalize, resize, resize_shortest

PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
TOKENIZER_FILES = ("tokenizer.json", "vocab.json")


@dataclass(frozen=True)
class ImageTransform:
    """The tensor version of a saved CLIPImageProcessor: resize by ``shortest_edge`` (aspect kept) or
    to ``size`` = (h, w) (at most one is set; neither when the processor does not resize), then an
    optional center ``crop`` = (h, w), then normalization."""

    shortest_edge: int | None
    size: tuple[int, int] | None
    crop: tuple[int, int] | None
    mode: str
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __call__(self, images: Tensor) -> Tensor:
        if self.shortest_edge is not None:
            images = resize_shortest(images, self.shortest_edge, mode=self.mode)
        elif self.size is not None:
            images = resize(images, self.size, mode=self.mode).clamp(0.0, 1.0)
        if self.crop is not None:
            images = center_crop(images, self.crop)
        return normalize(images, self.mean, self.std)


def load_image_transform(directory: Path, *, field: str) -> ImageTransform:
    """Read the image processor saved in ``directory`` into an ``ImageTransform``."""
    require_any_file(directory, PROCESSOR_FILES, field=field, expected="a CLIP image processor config")
    processor = CLIPImageProcessor.from_pretrained(directory)
    shortest, size = None, None
    if processor.do_resize:
        shortest = _size_entry(processor.size, "shortest_edge")
        height, width = _size_entry(processor.size, "height"), _size_entry(processor.size, "width")
        size = (height, width) if shortest is None and height is not None and width is not None else None
        if shortest is None and size is None:
            raise ValueError(
                f"{field}: image processor size {processor.size} has neither shortest_edge nor height/width"
            )
    crop = None
    if processor.do_center_crop:
        crop_height, crop_width = _size_entry(processor.crop_size, "height"), _size_entry(processor.crop_size, "width")
        if crop_height is None or crop_width is None:
            raise ValueError(f"{field}: image processor crop_size {processor.crop_size} has no height/width")
        crop = (crop_height, crop_width)
    mean = tuple(processor.image_mean) if processor.do_normalize else (0.0, 0.0, 0.0)
    std = tuple(processor.image_std) if processor.do_normalize else (1.0, 1.0, 1.0)
    return ImageTransform(shortest, size, crop, interpolation_mode(processor.resample), mean, std)


class CLIPSimilarityScorer(FrozenModelScorer):
    """Cosine similarity of a CLIPModel at ``model_path``, with the processor at ``processor_path``."""

    def __init__(
        self,
        model_path: str | Path,
        processor_path: str | Path,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | str = torch.float32,
    ) -> None:
        model_dir = require_path(model_path, field="model_path", expected="a CLIPModel directory", is_dir=True)
        require_any_file(
            model_dir, ["config.json"], field="model_path", expected="a CLIPModel saved with save_pretrained"
        )
        processor_dir = require_path(
            processor_path, field="processor_path", expected="a CLIPProcessor directory", is_dir=True
        )
        self.transform = load_image_transform(processor_dir, field="processor_path")
        require_any_file(processor_dir, TOKENIZER_FILES, field="processor_path", expected="a CLIP tokenizer")
        self.tokenizer = AutoTokenizer.from_pretrained(processor_dir)
        super().__init__(CLIPModel.from_pretrained(model_dir), device=device, dtype=dtype)
        self.max_length = min(self.tokenizer.model_max_length, self.model.config.text_config.max_position_embeddings)

    def score(self, images: Tensor, prompts: Sequence[str]) -> Tensor:
        pixels = self.transform(images.to(self.device, torch.float32)).to(self.dtype)
        image_features = self.model.visual_projection(self.model.vision_model(pixel_values=pixels).pooler_output)
        unique, inverse = unique_prompts(prompts)
        tokens = self.tokenizer(
            unique, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
        ).to(self.device)
        text_out = self.model.text_model(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"])
        text_features = self.model.text_projection(text_out.pooler_output)[inverse.to(self.device)]
        image_features = torch.nn.functional.normalize(image_features.float(), dim=-1)
        text_features = torch.nn.functional.normalize(text_features.float(), dim=-1)
        return (image_features * text_features).sum(dim=-1)


def _size_entry(size: object, key: str) -> int | None:
    # transformers 5 stores sizes as SizeDict (attributes), 4.x as plain dicts.
    value = size.get(key) if isinstance(size, dict) else getattr(size, key, None)
    return None if value is None else int(value)
