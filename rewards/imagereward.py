"""ImageReward v1.0 (THUDM), BLIP-based, from local files, batched, on tensors.

ImageReward is a BLIP ViT-L/16 image encoder, a BERT-base text encoder whose every layer cross-attends
to all the image tokens (``med_config.json``: BERT with ``add_cross_attention``), and a head of five
linear layers (768 -> 1024 -> 128 -> 64 -> 16 -> 1, no activations between them). The score of an
(image, prompt) pair is

    reward = (head(text_encoder(prompt tokens, cross-attending to vit(image))[CLS]) - mean) / std

with ImageReward v1.0's mean 0.16717362830052426 and std 1.0333394966054072 (constants of the
reference code, not stored in ``ImageReward.pt``). The prompt is BERT-uncased tokenized, padded and
truncated to 35 tokens; the tokenizer gets BLIP's two extra special tokens ([DEC], [ENC]) as BLIP's
``init_tokenizer`` adds them, so a prompt naming them tokenizes as in the reference.

The modules are transformers' BLIP ones, which are BLIP's own code renamed: ``BlipVisionModel`` is
BLIP's ViT (pre-norm blocks, fused qkv, final LayerNorm, eps 1e-6) and ``BlipTextModel`` is BLIP's
``med.py`` BERT in its multimodal mode (bidirectional self-attention, then cross-attention).
``ImageReward.pt`` (a plain state dict) is renamed onto them; its unused BLIP projections are dropped.

Preprocessing reproduces the reference's transform on tensors: the shorter side resized to 224
(bicubic, antialiased), a center crop to 224 x 224 (torchvision's rounded offset), OpenAI CLIP
mean/std. The reference resizes 8-bit PIL images, which rounds each pixel to 1/255: scoring an
image already at 224 px (or one only cropped) agrees to float32 rounding, a resized one to that
pixel rounding (tested against the ``image-reward`` package, which we do not depend on).
"""

from __future__ import annotations

import json
import pickle
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD
from torch import Tensor, nn
from transformers import BertTokenizer, BlipTextConfig, BlipTextModel, BlipVisionConfig, BlipVisionModel

from rewards.base import FrozenModelScorer, require_any_file, require_path
from rewards.preprocess import center_crop, normalize, resize_shortest

# ImageReward v1.0's score normalisation (ImageReward.py: self.mean, self.std)
SCORE_MEAN = 0.16717362830052426
SCORE_STD = 1.0333394966054072
MAX_PROMPT_TOKENS = 35  # the reference pads and truncates every prompt to 35 tokens
HEAD_WIDTHS = (1024, 128, 64, 16, 1)  # the reference's MLP after the 768-wide [CLS] feature

# BLIP's create_vit("large") at ImageReward's 224 px: 64-wide heads, mlp_ratio 4, LayerNorm eps 1e-6
VIT_LARGE_16: dict[str, Any] = {
    "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
    "image_size": 224, "patch_size": 16, "layer_norm_eps": 1e-6, "hidden_act": "gelu",
}  # fmt: skip

# ImageReward.pt's names (BLIP's ViT; the text encoder's names are transformers' already) -> ours; {} is a layer
_VISION_NAMES = (
    ("visual_encoder.cls_token", "visual_encoder.embeddings.class_embedding"),
    ("visual_encoder.pos_embed", "visual_encoder.embeddings.position_embedding"),
    ("visual_encoder.patch_embed.proj.", "visual_encoder.embeddings.patch_embedding."),
    ("visual_encoder.blocks.{}.norm1.", "visual_encoder.encoder.layers.{}.layer_norm1."),
    ("visual_encoder.blocks.{}.norm2.", "visual_encoder.encoder.layers.{}.layer_norm2."),
    ("visual_encoder.blocks.{}.attn.qkv.", "visual_encoder.encoder.layers.{}.self_attn.qkv."),
    ("visual_encoder.blocks.{}.attn.proj.", "visual_encoder.encoder.layers.{}.self_attn.projection."),
    ("visual_encoder.blocks.{}.mlp.", "visual_encoder.encoder.layers.{}.mlp."),
    ("visual_encoder.norm.", "visual_encoder.post_layernorm."),
)
# the reference's MLP is Sequential(Linear, Dropout, Linear, Dropout, Linear, Dropout, Linear, Linear)
_HEAD_NAMES = tuple((f"mlp.layers.{blip}.", f"head.{ours}.") for ours, blip in enumerate((0, 2, 4, 6, 7)))
# BLIP pretraining's contrastive projections and the text position ids: in the file, not in the score
_UNUSED = re.compile(r"^blip\.(vision_proj|text_proj)\.|^blip\.text_encoder\.embeddings\.position_ids$")


class ImageRewardModel(nn.Module):
    """BLIP ViT + cross-attending BERT + linear head: (pixels, tokens) -> the unnormalised reward [B]."""

    def __init__(self, vision: BlipVisionConfig, text: BlipTextConfig) -> None:
        super().__init__()
        self.visual_encoder = BlipVisionModel(vision)
        self.text_encoder = BlipTextModel(text, add_pooling_layer=False)
        widths = (text.hidden_size, *HEAD_WIDTHS)
        self.head = nn.Sequential(*(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:])))

    def forward(self, pixels: Tensor, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        image_tokens = self.visual_encoder(pixel_values=pixels).last_hidden_state
        # is_decoder=False: BLIP's multimodal encoder mode, bidirectional self-attention over the prompt
        text = self.text_encoder(
            input_ids=input_ids, attention_mask=attention_mask, encoder_hidden_states=image_tokens, is_decoder=False
        ).last_hidden_state
        return self.head(text[:, 0, :]).squeeze(-1).float()


def read_json(path: Path, *, field: str) -> dict[str, Any]:
    """A JSON object from ``path``, or ValueError naming ``field``."""
    try:
        content = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{field}: {str(path)!r} is not valid JSON ({err})") from None
    if not isinstance(content, dict):
        raise ValueError(f"{field}: {str(path)!r} must hold a JSON object, got {type(content).__name__}")
    return content


def build_model(med_config: Path, vision_config: Path | None = None) -> ImageRewardModel:
    """The architecture (random weights) from BLIP's ``med_config.json`` and a BLIP ViT (default ViT-L/16)."""
    vision_fields = VIT_LARGE_16 if vision_config is None else read_json(vision_config, field="vision_config")
    vision = BlipVisionConfig(**vision_fields)
    med = read_json(med_config, field="med_config")
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "max_position_embeddings", "hidden_act", "layer_norm_eps", "pad_token_id")  # fmt: skip
    missing = [key for key in keys if key not in med]
    if missing:
        raise ValueError(f"med_config: {str(med_config)!r} lacks {missing}; expected BLIP's med_config.json")
    # BLIP sets the cross-attention's key/value width to the ViT's (blip_pretrain.py: encoder_width); the
    # generation token ids stay unset: scoring never generates, and BLIP's defaults may lie outside a vocabulary
    text = BlipTextConfig(**{key: med[key] for key in keys}, encoder_hidden_size=vision.hidden_size,
                          bos_token_id=None, eos_token_id=None, sep_token_id=None)  # fmt: skip
    return ImageRewardModel(vision, text)


def _rename(key: str, names: Sequence[tuple[str, str]]) -> str:
    """``key`` with the first matching prefix of ``names`` (source, target) replaced, its layer kept."""
    for source, target in names:
        match = re.match(re.escape(source).replace(r"\{\}", r"(\d+)"), key)
        if match:
            return target.format(*match.groups()) + key[match.end() :]
    return key


def from_blip_names(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``ImageReward.pt``'s state dict (BLIP's ViT, ``med.py``, the reference MLP) -> ``ImageRewardModel``'s."""
    return {
        _rename(_rename(key, _HEAD_NAMES).removeprefix("blip."), _VISION_NAMES): value
        for key, value in state.items()
        if not _UNUSED.search(key)
    }


def to_blip_names(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The inverse of ``from_blip_names`` (for writing ImageReward.pt files, e.g. tiny test ones)."""
    vision = tuple((ours, blip) for blip, ours in _VISION_NAMES)
    head = tuple((ours, blip) for blip, ours in _HEAD_NAMES)
    out = {}
    for key, value in state.items():
        renamed = _rename(key, head)
        out[renamed if renamed != key else "blip." + _rename(key, vision)] = value
    return out


def load_model(checkpoint: Path, med_config: Path, vision_config: Path | None) -> ImageRewardModel:
    """``build_model`` with ``checkpoint``'s weights, every one of them required at its shape."""
    try:
        state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"checkpoint: {str(checkpoint)!r} is not a readable torch file ({reason})") from None
    weights = from_blip_names(state) if isinstance(state, dict) else {}
    model = build_model(med_config, vision_config)
    expected = model.state_dict()
    missing, unexpected = sorted(expected.keys() - weights.keys()), sorted(weights.keys() - expected.keys())
    reshaped = sorted(key for key in expected.keys() & weights.keys() if weights[key].shape != expected[key].shape)
    if missing or unexpected or reshaped:
        found = {"missing": missing, "unexpected": unexpected, "of another shape": reshaped}
        listed = "; ".join(
            f"{what} {names[:3]}{' ...' if len(names) > 3 else ''}" for what, names in found.items() if names
        )
        raise ValueError(
            f"checkpoint: {str(checkpoint)!r} does not fit the architecture of med_config and the ViT "
            f"(weights {listed}); expected ImageReward.pt with its own med_config.json"
        )
    model.load_state_dict(weights)
    return model


def load_tokenizer(folder: Path) -> BertTokenizer:
    """The BERT-uncased tokenizer with BLIP's special tokens added (blip.py: init_tokenizer)."""
    tokenizer = BertTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"bos_token": "[DEC]"})
    tokenizer.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    return tokenizer


class ImageRewardScorer(FrozenModelScorer):
    """ImageReward v1.0 from local files: ``checkpoint`` (ImageReward.pt), ``med_config`` (its
    med_config.json) and ``tokenizer`` (a bert-base-uncased tokenizer folder). ``vision_config``, a JSON
    of transformers ``BlipVisionConfig`` fields, replaces the ViT-L/16 (tests use a tiny one)."""

    name = "imagereward"

    def __init__(
        self,
        checkpoint: str | Path,
        med_config: str | Path,
        tokenizer: str | Path,
        *,
        vision_config: str | Path | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | str = torch.float32,
    ) -> None:
        weights = require_path(checkpoint, field="checkpoint", expected="ImageReward.pt (THUDM/ImageReward)")
        med = require_path(med_config, field="med_config", expected="med_config.json (THUDM/ImageReward)")
        folder = require_path(tokenizer, field="tokenizer", expected="a bert-base-uncased tokenizer", is_dir=True)
        require_any_file(folder, ["vocab.txt", "tokenizer.json"], field="tokenizer", expected="a BERT tokenizer")
        vision = None if vision_config is None else require_path(vision_config, field="vision_config",
                                                                  expected="a BlipVisionConfig JSON")  # fmt: skip
        super().__init__(load_model(weights, med, vision), device=device, dtype=dtype)
        self.tokenizer = load_tokenizer(folder)
        self.image_size = int(self.model.visual_encoder.config.image_size)

    def pixels(self, images: Tensor) -> Tensor:
        """The reference's transform on [0, 1] images: shorter side to the ViT's size, center crop, CLIP mean/std."""
        side = self.image_size
        pixels = resize_shortest(images.to(self.device, torch.float32), side)
        pixels = center_crop(pixels, (side, side), round_offset=True)
        return normalize(pixels, OPENAI_DATASET_MEAN, OPENAI_DATASET_STD).to(self.dtype)

    def score(self, images: Tensor, prompts: Sequence[str]) -> Tensor:
        pixels = self.pixels(images)
        tokens = self.tokenizer(
            list(prompts), padding="max_length", truncation=True, max_length=MAX_PROMPT_TOKENS, return_tensors="pt"
        ).to(self.device)
        reward = self.model(pixels, tokens.input_ids, tokens.attention_mask)
        return (reward - SCORE_MEAN) / SCORE_STD
