"""Tiny random reward models written in the real on-disk formats, for tests, benchmarks and CPU demos.

Nothing here downloads: the CLIP tokenizer is rebuilt from open_clip's bundled BPE file (the same
byte-level BPE as OpenAI CLIP, truncated to ``num_merges`` merges to stay small), models are
built from configs with a fixed seed and written with ``save_pretrained`` / ``torch.save`` so that
the scorers' real loading code reads them back.

* ``save_tiny_hps``: an open_clip config JSON (32 px ViT, 2 layers) and ``{"state_dict": ...}``,
  the format of ``HPS_v2.1_compressed.pt``.
* ``save_tiny_clip``: a transformers ``CLIPModel`` directory (config.json, model.safetensors),
  optionally with a ``CLIPProcessor`` (image processor and tokenizer) in the same directory.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import open_clip
import torch
from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

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


def tiny_clip_tokenizer(num_merges: int = 1000) -> CLIPTokenizer:
    """OpenAI CLIP's byte-level BPE from open_clip's bundled vocabulary, keeping ``num_merges`` merges."""
    with gzip.open(open_clip.tokenizer.default_bpe(), "rt", encoding="utf-8") as handle:
        lines = handle.read().split("\n")[1 : num_merges + 1]
    merges = [tuple(line.split()) for line in lines]
    base = list(open_clip.tokenizer.bytes_to_unicode().values())
    tokens = base + [token + "</w>" for token in base] + ["".join(merge) for merge in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    # the tokenizers backend takes merges as pairs, which transformers' annotation does not list
    vocab = {token: i for i, token in enumerate(tokens)}
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=77)  # type: ignore[arg-type]


def tiny_clip_processor(image_size: int = 32) -> CLIPProcessor:
    """A CLIPProcessor (shortest edge ``image_size``, square center crop, OpenAI mean/std, bicubic)."""
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    return CLIPProcessor(image_processor=image_processor, tokenizer=tiny_clip_tokenizer())


def save_tiny_clip(directory: str | Path, *, seed: int = 0, image_size: int = 32, with_processor: bool = True) -> Path:
    """Write a random 2-layer ``CLIPModel`` (and its processor) to ``directory``; returns it."""
    directory = Path(directory)
    tokenizer = tiny_clip_tokenizer()
    text = dict(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=37, num_attention_heads=4,
        num_hidden_layers=2, max_position_embeddings=77, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2,
                  image_size=image_size, patch_size=8)  # fmt: skip
    torch.manual_seed(seed)
    CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)).save_pretrained(directory)
    if with_processor:
        tiny_clip_processor(image_size).save_pretrained(directory)
    return directory
