"""HPSv2.1 (Human Preference Score v2.1) with upstream ``open_clip_torch``, batched, on tensors.

HPSv2.1 is an open_clip ViT-H-14 fine-tuned on human preferences; its weights ship as
``HPS_v2.1_compressed.pt`` = ``{"state_dict": ...}``. The score of an (image, prompt) pair is

    hps = <f_img / |f_img|, f_txt / |f_txt|>      (no logit scale; about 0.2-0.35 for real images)

Preprocessing reproduces the reference scoring path (``hpsv2.img_score.score``, DanceGRPO's
reward), which builds its transform with ``light_augmentation=True``: the image tensor is resized
so its longer side is 224 (bicubic, antialiased), padded with black to 224 x 224 and normalized
with the OpenAI CLIP mean/std. Note this is *not* a center crop: a non-square image is scored
whole. The reference converts PIL images with ``ToTensor`` first, so given the same [0, 1] pixels
the two paths agree to float rounding (tested to 1e-5 against hpsv2x). Text uses open_clip's
bundled BPE tokenizer (77 tokens). We do not depend on the ``hpsv2`` package.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from pathlib import Path

import open_clip
import torch
from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD
from torch import Tensor

from rewards.base import FrozenModelScorer, require_path, unique_prompts
from rewards.preprocess import normalize, resize_longest_and_pad


class HPSv2Scorer(FrozenModelScorer):
    """HPSv2.1 from a local checkpoint. ``arch`` is an open_clip model name or a path to an open_clip
    model-config JSON (registered under the file's stem), which lets tests use a tiny config."""

    name = "hpsv2"

    def __init__(
        self,
        checkpoint: str | Path,
        *,
        arch: str = "ViT-H-14",
        device: torch.device | str = "cpu",
        dtype: torch.dtype | str = torch.float32,
    ) -> None:
        path = require_path(checkpoint, field="checkpoint", expected="HPS_v2.1_compressed.pt ({'state_dict': ...})")
        model_name = register_arch(arch)
        super().__init__(load_open_clip(model_name, path), device=device, dtype=dtype)
        self.image_size = _square_side(self.model.visual.image_size, model_name)
        self.tokenizer = open_clip.get_tokenizer(model_name)

    def score(self, images: Tensor, prompts: Sequence[str]) -> Tensor:
        pixels = resize_longest_and_pad(images.to(self.device, torch.float32), self.image_size)
        pixels = normalize(pixels, OPENAI_DATASET_MEAN, OPENAI_DATASET_STD).to(self.dtype)
        image_features = self.model.encode_image(pixels, normalize=True)
        unique, inverse = unique_prompts(prompts)
        tokens = self.tokenizer(unique).to(self.device)
        text_features = self.model.encode_text(tokens, normalize=True)[inverse.to(self.device)]
        return (image_features.float() * text_features.float()).sum(dim=-1)


def register_arch(arch: str) -> str:
    """The open_clip model name for ``arch``; a ``*.json`` path is registered with open_clip first."""
    if arch.endswith(".json"):
        config = require_path(arch, field="arch", expected="an open_clip model config JSON")
        open_clip.add_model_config(config)
        return config.stem
    if arch not in open_clip.list_models():
        raise ValueError(f"arch={arch!r} is not an open_clip model name or a *.json model config")
    return arch


def load_open_clip(model_name: str, checkpoint: Path) -> torch.nn.Module:
    """Build ``model_name`` and strictly load ``checkpoint`` (open_clip unwraps ``state_dict``, strips ``module.``)."""
    try:
        return open_clip.create_model(model_name, pretrained=str(checkpoint), weights_only=True)
    except pickle.UnpicklingError:
        # A checkpoint written by HPS's training code may pickle non-tensor entries next to the
        # state dict; this is a local file the user named, so full unpickling is acceptable.
        return open_clip.create_model(model_name, pretrained=str(checkpoint), weights_only=False)


def _square_side(image_size: int | Sequence[int], model_name: str) -> int:
    sides = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
    if sides[0] != sides[1]:
        raise ValueError(f"arch={model_name!r} has a non-square image size {sides}")
    return int(sides[0])
