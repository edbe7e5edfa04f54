"""Tiny random reward models written in the real on-disk formats, for tests, benchmarks and CPU demos.

Nothing here downloads: the CLIP tokenizer is the tiny Flux pipelines' (``models.flux.clip_tokenizer``:
open_clip's bundled BPE, truncated to its first merges to stay small), models are
built from configs with a fixed seed and written with ``save_pretrained`` / ``torch.save`` so that
the scorers' real loading code reads them back.

* ``save_tiny_hps``: an open_clip config JSON (32 px ViT, 2 layers) and ``{"state_dict": ...}``,
  the format of ``HPS_v2.1_compressed.pt``.
* ``save_tiny_clip``: a transformers ``CLIPModel`` directory (config.json, model.safetensors),
  optionally with a ``CLIPProcessor`` (image processor and tokenizer) in the same directory.
* ``save_tiny_imagereward``: ``ImageReward.pt`` with BLIP's names, ``med_config.json``, a BERT
  tokenizer folder, and the tiny ViT's ``vision_config.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import open_clip
import torch
from torch import nn
from transformers import BertTokenizer, CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

from models.flux import clip_text_config, clip_tokenizer
from rewards.imagereward import build_model, to_blip_names

TINY_OPEN_CLIP_CONFIG = {
    "embed_dim": 32,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "head_width": 32, "patch_size": 8},
    # vocab_size must stay 49408: open_clip's tokenizer is the full bundled BPE.
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2},
}
TINY_HPS_ARCH = "tiny-hps"


def save_tiny_hps(directory: str | Path, *, seed: int = 0) -> tuple[Path, Path]:
    """Write ``<arch>.json`` and ``hps_tiny.pt``; returns (checkpoint, config JSON) for ``HPSv2Scorer``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / f"{TINY_HPS_ARCH}.json"
    config.write_text(json.dumps(TINY_OPEN_CLIP_CONFIG))
    open_clip.add_model_config(config)
    torch.manual_seed(seed)
    model = open_clip.create_model(TINY_HPS_ARCH, pretrained=None)
    checkpoint = directory / "hps_tiny.pt"
    torch.save({"state_dict": model.state_dict()}, checkpoint)
    return checkpoint, config


def tiny_clip_processor(image_size: int = 32) -> CLIPProcessor:
    """A CLIPProcessor (shortest edge ``image_size``, square center crop, OpenAI mean/std, bicubic)."""
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    return CLIPProcessor(image_processor=image_processor, tokenizer=clip_tokenizer())


def save_tiny_clip(directory: str | Path, *, seed: int = 0, image_size: int = 32, with_processor: bool = True) -> Path:
    """Write a random 2-layer ``CLIPModel`` (and its processor) to ``directory``; returns it."""
    directory = Path(directory)
    text = clip_text_config(clip_tokenizer(), width=32, ff=37)
    vision = dict(hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2,
                  image_size=image_size, patch_size=8)  # fmt: skip
    torch.manual_seed(seed)
    CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)).save_pretrained(directory)
    if with_processor:
        tiny_clip_processor(image_size).save_pretrained(directory)
    return directory


# A random ImageReward: a 2-layer BLIP ViT at ImageReward's 224 px and a 1-layer cross-attending BERT. The
# text stays 768 wide because the reference's head starts at 768 (ImageReward.py: MLP(768)).
TINY_BLIP_VISION: dict[str, Any] = {
    "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
    "image_size": 224, "patch_size": 16, "layer_norm_eps": 1e-6, "hidden_act": "gelu",
}  # fmt: skip
TINY_BERT_WORDS = ("a photo of the cat dog painting lighthouse at dusk an oil very detailed scene red blue "
                   "green on in with and sky sea").split()  # fmt: skip


def tiny_bert_tokenizer(directory: Path) -> int:
    """Write a bert-uncased WordPiece tokenizer of a few words and every lowercase character to
    ``directory``; returns its vocabulary size."""
    characters = [chr(code) for code in range(ord("a"), ord("z") + 1)] + list("0123456789.,!?'-")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *characters, *(f"##{c}" for c in characters)]
    vocab += [word for word in TINY_BERT_WORDS if word not in vocab]
    BertTokenizer(vocab={token: i for i, token in enumerate(vocab)}).save_pretrained(directory)
    return len(vocab)


def save_tiny_imagereward(directory: str | Path, *, seed: int = 0) -> dict[str, Path]:
    """Write a random ImageReward in its real formats: ``ImageReward.pt`` (BLIP's names), ``med_config.json``,
    a tokenizer folder and the ViT's ``vision_config.json``; returns ``ImageRewardScorer``'s arguments."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = {"tokenizer": directory / "tokenizer", "med_config": directory / "med_config.json",
             "vision_config": directory / "vision_config.json", "checkpoint": directory / "ImageReward.pt"}  # fmt: skip
    vocab_size = tiny_bert_tokenizer(paths["tokenizer"])
    med = {"architectures": ["BertModel"], "attention_probs_dropout_prob": 0.1, "hidden_act": "gelu",
           "hidden_dropout_prob": 0.1, "hidden_size": 768, "initializer_range": 0.02, "intermediate_size": 96,
           "layer_norm_eps": 1e-12, "max_position_embeddings": 40, "model_type": "bert", "num_attention_heads": 12,
           "num_hidden_layers": 1, "pad_token_id": 0, "type_vocab_size": 2, "encoder_width": 768,
           "add_cross_attention": True, "vocab_size": vocab_size + 2}  # + BLIP's [DEC] and [ENC]  # fmt: skip
    paths["med_config"].write_text(json.dumps(med, indent=2))
    paths["vision_config"].write_text(json.dumps(TINY_BLIP_VISION, indent=2))
    torch.manual_seed(seed)
    model = build_model(paths["med_config"], paths["vision_config"])
    # random LayerNorms and biases too, and weights large enough for the image to move the score (std 0.02 barely does)
    for parameter in model.parameters():
        nn.init.normal_(parameter, std=0.5 if parameter.ndim == 1 else 0.1)
    state = to_blip_names(model.state_dict())
    # the real file also holds BLIP's contrastive projections (256 wide) and the text position ids, unused
    state |= {"blip.vision_proj.weight": torch.randn(256, TINY_BLIP_VISION["hidden_size"]), "blip.vision_proj.bias":
              torch.zeros(256), "blip.text_proj.weight": torch.randn(256, 768), "blip.text_proj.bias": torch.zeros(256),
              "blip.text_encoder.embeddings.position_ids": torch.arange(40).unsqueeze(0)}  # fmt: skip
    torch.save(state, paths["checkpoint"])
    return paths
