"""Tiny random FLUX and Qwen-Image pipelines, built offline and saved with ``save_pretrained``.

Tests and the CPU demo load these folders through the real ``load_backbone`` path. Tokenizers
are built in memory (no hub): CLIP's real BPE from open_clip's bundled file, cut to its first
``CLIP_MERGES`` merges to keep the folder small; a Unigram T5 vocabulary of characters and a few
words; a byte-level Qwen2 vocabulary with the chat special tokens.

Sizes (image -> VAE latent -> packed tokens):
    tiny   32x32 px -> 16x16x4 -> 64 tokens; the diffusers test dummies (1+1 Flux blocks, 2 Qwen blocks)
    small  64x64 px -> 32x32x16 -> 256 tokens; 4+4 Flux blocks / 4 Qwen blocks, head dim 64, 4 heads,
           text width 256 (the CPU benchmark configuration)

A build is deterministic in its seed and is skipped when the folder already holds the same build
(a marker file written last, after an atomic rename of the finished folder).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import string
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTokenizer,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2Tokenizer,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
)

from models.components import quiet_progress_bars

SIZES = ("tiny", "small")
MARKER = "tiny_build.json"
CLIP_MERGES = 1000
IMAGE_SIZE = {"tiny": 32, "small": 64}  # pixels per side of the images each size is built for
QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# transformer blocks per size (the small ones are the CPU benchmark configuration of the stack probe)
FLUX_BLOCKS = {
    "tiny": dict(
        num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2, axes_dims_rope=[4, 4, 8]
    ),
    "small": dict(
        num_layers=4, num_single_layers=4, attention_head_dim=64, num_attention_heads=4, axes_dims_rope=[16, 24, 24]
    ),
}
QWEN_BLOCKS = {
    "tiny": dict(num_layers=2, attention_head_dim=16, num_attention_heads=3, axes_dims_rope=(8, 4, 4)),
    "small": dict(num_layers=4, attention_head_dim=64, num_attention_heads=4, axes_dims_rope=(16, 24, 24)),
}
T5_WORDS = ["a", "an", "the", "photo", "of", "cat", "dog", "red", "blue", "on", "in", "with", "and", "painting"]


# ---- tokenizers ------------------------------------------------------------------------------------


def clip_tokenizer(num_merges: int = CLIP_MERGES) -> CLIPTokenizer:
    """OpenAI CLIP's BPE (ids as open_clip's tokenizer) restricted to its first ``num_merges`` merges."""
    from open_clip.tokenizer import bytes_to_unicode, default_bpe  # heavy import, only for building

    lines = gzip.open(default_bpe()).read().decode("utf-8").split("\n")
    merges = [tuple(line.split()) for line in lines[1 : num_merges + 1]]
    chars = list(bytes_to_unicode().values())
    words = chars + [c + "</w>" for c in chars] + ["".join(m) for m in merges] + ["<|startoftext|>", "<|endoftext|>"]
    return CLIPTokenizer(vocab={w: i for i, w in enumerate(words)}, merges=merges, model_max_length=77)


def t5_tokenizer(max_length: int) -> T5Tokenizer:
    """A Unigram vocabulary: pad=0, eos=1, unk=2, then characters and a few whole words."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -5.0) for c in string.ascii_lowercase + string.digits + string.punctuation]
    pieces += [("\u2581" + c, -4.0) for c in string.ascii_lowercase]
    pieces += [("\u2581" + w, -1.0) for w in T5_WORDS]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=max_length)


def qwen2_tokenizer() -> Qwen2Tokenizer:
    """Byte-level BPE without merges (one token per byte) plus the Qwen chat special tokens."""
    from open_clip.tokenizer import bytes_to_unicode

    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": QWEN_SPECIAL_TOKENS})
    return tok


# ---- pipelines -----------------------------------------------------------------------------------


def flux_text_encoders(
    tok: CLIPTokenizer, tok2: T5Tokenizer, *, width: int, ff: int, t5_head_dim: int
) -> tuple[CLIPTextModel, T5EncoderModel]:
    """Random 2-layer CLIP and T5 text encoders of hidden size ``width`` (CLIP first: the order in
    which they draw from torch's global RNG is part of every seeded tiny pipeline)."""
    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tok),
            hidden_size=width,
            intermediate_size=ff,
            num_attention_heads=4,
            num_hidden_layers=2,
            projection_dim=width,
            max_position_embeddings=77,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    )
    t5 = T5EncoderModel(
        T5Config(
            vocab_size=len(tok2),
            d_model=width,
            d_kv=t5_head_dim,
            d_ff=ff,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            dropout_rate=0.0,
        )
    )
    return clip, t5


def _flux_pipeline(size: str) -> FluxPipeline:
    width, latent_ch = (256, 16) if size == "small" else (32, 4)
    tok, tok2 = clip_tokenizer(), t5_tokenizer(32)
    text_encoder, text_encoder_2 = flux_text_encoders(tok, tok2, width=width, ff=37, t5_head_dim=8)
    vae = AutoencoderKL(
        sample_size=IMAGE_SIZE[size],
        block_out_channels=(8, 16),
        layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=latent_ch,
        norm_num_groups=4,
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,
        scaling_factor=1.5035,
    )
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=4 * latent_ch,
        joint_attention_dim=width,
        pooled_projection_dim=width,
        guidance_embeds=True,
        **FLUX_BLOCKS[size],
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    return FluxPipeline(
        scheduler=scheduler,
        text_encoder=text_encoder,
        tokenizer=tok,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tok2,
        transformer=transformer,
        vae=vae,
    )


def _qwen_text_encoder(tok: Qwen2Tokenizer, width: int) -> Qwen2_5_VLForConditionalGeneration:
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIAL_TOKENS}
    half_head = width // 2 // 2  # head dim / 2, split over the three M-RoPE sections
    text_config = {
        "hidden_size": width,
        "intermediate_size": width,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "vocab_size": len(tok),
        "bos_token_id": None,
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "rope_theta": 1e6,
        "rope_scaling": {
            "mrope_section": [half_head // 4, half_head // 4, half_head // 2],
            "rope_type": "default",
            "type": "default",
        },
    }
    config = Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config={
            "depth": 2,
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_heads": 2,
            "out_hidden_size": width,
        },
        hidden_size=width,
        vocab_size=len(tok),
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_token_id=ids["<|vision_pad|>"],
    )
    return Qwen2_5_VLForConditionalGeneration(config).eval()


def _qwen_pipeline(size: str) -> QwenImagePipeline:
    width, z_dim = (256, 16) if size == "small" else (16, 4)
    tok = qwen2_tokenizer()
    generator = torch.Generator().manual_seed(1)
    # non-trivial per-channel statistics, so decoding tests see the VAE's own scaling
    vae = AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=z_dim,
        dim_mult=[1, 2],
        num_res_blocks=1,
        temperal_downsample=[True],
        latents_mean=(0.1 * torch.randn(z_dim, generator=generator)).tolist(),
        latents_std=(0.5 + torch.rand(z_dim, generator=generator)).tolist(),
    )
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=4 * z_dim,
        out_channels=z_dim,
        joint_attention_dim=width,
        guidance_embeds=False,
        **QWEN_BLOCKS[size],
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=0.9,
        base_image_seq_len=256,
        max_image_seq_len=8192,
        shift_terminal=0.02,
        time_shift_type="exponential",
    )
    return QwenImagePipeline(
        transformer=transformer,
        vae=vae,
        scheduler=scheduler,
        text_encoder=_qwen_text_encoder(tok, width),
        tokenizer=tok,
    )


def _build(path: str | Path, kind: str, size: str, seed: int, make: Callable[[str], Any]) -> Path:
    if size not in SIZES:
        raise ValueError(f"tiny {kind} size must be one of {SIZES}, got {size!r}")
    path = Path(path)
    spec = {"kind": kind, "size": size, "seed": seed}
    marker = path / MARKER
    if marker.is_file():
        if json.loads(marker.read_text()) != spec:
            raise ValueError(f"{path} holds another tiny build ({marker.read_text()}), not {spec}; pick another folder")
        return path
    if path.exists() and any(path.iterdir()):
        raise ValueError(f"{path} exists and is not a complete tiny build; remove it or pick another folder")
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    with torch.random.fork_rng(devices=[]), quiet_progress_bars():
        torch.manual_seed(seed)
        make(size).save_pretrained(tmp)
    (tmp / MARKER).write_text(json.dumps(spec))
    try:
        os.replace(tmp, path)  # atomic; replaces an empty folder, fails on a full one
    except OSError:  # another process finished the same build first
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def build_tiny_flux(path: str | Path, *, size: str = "tiny", seed: int = 0) -> Path:
    """Write (or reuse) a random FLUX pipeline folder; returns its path."""
    return _build(path, "flux", size, seed, _flux_pipeline)


def build_tiny_qwenimage(path: str | Path, *, size: str = "tiny", seed: int = 0) -> Path:
    """Write (or reuse) a random Qwen-Image pipeline folder; returns its path."""
    return _build(path, "qwenimage", size, seed, _qwen_pipeline)


def build_tiny(name: str, path: str | Path, *, size: str = "tiny", seed: int = 0) -> Path:
    """``build_tiny_flux`` or ``build_tiny_qwenimage`` by backbone name."""
    builders = {"flux": build_tiny_flux, "qwenimage": build_tiny_qwenimage}
    if name not in builders:
        raise ValueError(f"model.build_tiny exists for backbones {sorted(builders)}, not {name!r}")
    return builders[name](path, size=size, seed=seed)
