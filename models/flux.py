"""FLUX.1 (dev) adapter: FluxTransformer2DModel, CLIP (pooled) + T5 (sequence) text encoders,
AutoencoderKL.

Conditioning follows diffusers' FluxPipeline: the CLIP text model's pooled output [B, P] (prompt
padded to CLIP's 77 tokens) and the T5 encoder's last hidden states [B, T, D] (prompt padded to
``max_sequence_length``; T5 runs without an attention mask, as in the pipeline). The distilled
guidance value (3.5 for Flux-dev) is fed through the guidance embedding on every call; no true CFG.
Decoding: z / scaling_factor + shift_factor, then the VAE.
"""

from __future__ import annotations

import gzip
import string
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock, FluxTransformerBlock
from torch import Tensor, nn
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel, T5Tokenizer

from models.base import Conditioning
from models.components import Component, check_equal, config_entry
from models.diffusers_backbone import JOINT_ATTENTION_LORA_TARGETS, SCHEDULER_COMPONENT, DiffusersBackbone, tokenize
from models.registry import register_backbone
from models.tiny import IMAGE_SIZE

FLUX_MAX_T5_LENGTH = 512  # FluxPipeline's upper bound for max_sequence_length
# FLUX.1-dev's scheduler (its resolution-dependent shift), which the random pipelines copy
SCHEDULER: dict[str, Any] = dict(
    shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096
)
CLIP_MERGES = 1000  # BPE merges kept by the tiny CLIP tokenizer (a small folder)
T5_WORDS = ["a", "an", "the", "photo", "of", "cat", "dog", "red", "blue", "on", "in", "with", "and", "painting"]
# per tiny size of models/tiny.py: text width, VAE latent channels and transformer blocks (the small
# ones are the CPU benchmark configuration of the stack probe)
TINY: dict[str, dict[str, Any]] = {
    "tiny": dict(text_width=32, latent_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
                 num_attention_heads=2, axes_dims_rope=[4, 4, 8]),
    "small": dict(text_width=256, latent_channels=16, num_layers=4, num_single_layers=4, attention_head_dim=64,
                  num_attention_heads=4, axes_dims_rope=[16, 24, 24]),
}  # fmt: skip


@dataclass
class FluxConditioning(Conditioning):
    prompt_embeds: Tensor  # [B, T, D] T5 last hidden states, T = max_sequence_length
    pooled: Tensor  # [B, P] CLIP pooled output


@register_backbone("flux")
class FluxBackbone(DiffusersBackbone):
    conditioning_class = FluxConditioning
    block_classes = (FluxTransformerBlock, FluxSingleTransformerBlock)
    lora_target_modules = [
        *JOINT_ATTENTION_LORA_TARGETS,
        "ff.net.0.proj",
        "ff.net.2",
        "ff_context.net.0.proj",
        "ff_context.net.2",
    ]
    components = (
        Component("transformer", FluxTransformer2DModel),
        Component("vae", AutoencoderKL),
        Component("text_encoder", CLIPTextModel),
        Component("tokenizer", CLIPTokenizer, "tokenizer_config.json", is_module=False),
        Component("text_encoder_2", T5EncoderModel),
        Component("tokenizer_2", T5Tokenizer, "tokenizer_config.json", is_module=False),
        SCHEDULER_COMPONENT,
    )
    text_components = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
    conditioning_dims = {"prompt_embeds": "joint_attention_dim", "pooled": "pooled_projection_dim"}

    @classmethod
    def tiny_pipeline(cls, size: str) -> FluxPipeline:
        size_options = dict(TINY[size])
        width, channels = size_options.pop("text_width"), size_options.pop("latent_channels")
        vae = dict(sample_size=IMAGE_SIZE[size], latent_channels=channels, shift_factor=0.0609, scaling_factor=1.5035)
        return random_pipeline(
            tokenizer_2=t5_tokenizer(T5_WORDS, max_length=32),
            text_width=width,
            ff=37,
            t5_head_dim=8,
            vae=vae,
            transformer=dict(latent_channels=channels, **size_options),
        )

    def set_options(self, *, guidance: float = 3.5, max_sequence_length: int | None = None) -> None:
        """``guidance``: Flux-dev's distilled guidance value. ``max_sequence_length``: T5 tokens per
        prompt (default: the T5 tokenizer's limit, at most 512)."""
        self.guidance = float(guidance)
        if max_sequence_length is None and "tokenizer_2" in self._parts:
            max_sequence_length = min(self._parts["tokenizer_2"].model_max_length, FLUX_MAX_T5_LENGTH)
        if max_sequence_length is not None and not 0 < max_sequence_length <= FLUX_MAX_T5_LENGTH:
            raise ValueError(f"flux: max_sequence_length must be in 1..{FLUX_MAX_T5_LENGTH}, got {max_sequence_length}")
        self.max_sequence_length = max_sequence_length

    @classmethod
    def check_components(cls, configs: dict[str, dict[str, Any]], folders: dict[str, Path]) -> None:
        entry = partial(config_entry, configs, folders)
        check_equal(
            cls.name, "T5 width", entry("transformer", "joint_attention_dim"), entry("text_encoder_2", "d_model")
        )
        check_equal(
            cls.name, "CLIP width", entry("transformer", "pooled_projection_dim"), entry("text_encoder", "hidden_size")
        )
        # 2x2 packing: a token carries 4 latent cells
        check_equal(
            cls.name, "latent channels", entry("transformer", "in_channels"), entry("vae", "latent_channels", factor=4)
        )

    @classmethod
    def vae_scale(cls, vae_config: dict[str, Any]) -> int:
        return 2 ** (len(vae_config["block_out_channels"]) - 1)  # one 2x downsampling between levels

    def encoding_options(self) -> dict[str, Any]:
        return {"max_sequence_length": self.max_sequence_length}

    def encode_text(self, prompts: list[str]) -> FluxConditioning:
        clip_tok, t5_tok = self.part("tokenizer"), self.part("tokenizer_2")
        clip_ids = tokenize(
            clip_tok, prompts, max_length=clip_tok.model_max_length, padding="max_length", what="flux CLIP tokenizer"
        ).input_ids
        pooled = self.part("text_encoder")(clip_ids.to(self.device), output_hidden_states=False).pooler_output
        assert self.max_sequence_length is not None  # set whenever the T5 tokenizer is loaded
        t5_ids = tokenize(
            t5_tok, prompts, max_length=self.max_sequence_length, padding="max_length", what="flux T5 tokenizer"
        ).input_ids
        embeds = self.part("text_encoder_2")(t5_ids.to(self.device), output_hidden_states=False)[0]
        return FluxConditioning(prompt_embeds=embeds.to(self.dtype), pooled=pooled.to(self.dtype))

    def transformer_inputs(  # type: ignore[override]  # the adapter's own Conditioning subclass
        self, z: Tensor, cond: FluxConditioning, dtype: torch.dtype
    ) -> dict[str, Any]:
        _, h2, w2, _ = z.shape
        img_ids = torch.zeros(h2, w2, 3, device=z.device, dtype=dtype)
        img_ids[..., 1] = torch.arange(h2, device=z.device)[:, None]
        img_ids[..., 2] = torch.arange(w2, device=z.device)[None, :]
        return {
            "pooled_projections": cond.pooled.to(dtype),
            "encoder_hidden_states": cond.prompt_embeds.to(dtype),
            "txt_ids": torch.zeros(cond.prompt_embeds.shape[1], 3, device=z.device, dtype=dtype),
            "img_ids": img_ids.flatten(0, 1),
        }

    def vae_latents(self, x: Tensor) -> Tensor:
        config = self.configs["vae"]
        return x / config["scaling_factor"] + (config.get("shift_factor") or 0.0)

    def decoder_units(self) -> list[nn.Module]:
        return [self.vae.decoder]  # AutoencoderKL.decode: post_quant_conv, then this one module


# ---- random pipelines (tests, CPU demos, benchmarks, the testbed) ------------------------------------


def clip_tokenizer(num_merges: int = CLIP_MERGES) -> CLIPTokenizer:
    """OpenAI CLIP's BPE (ids as open_clip's tokenizer) restricted to its first ``num_merges`` merges."""
    from open_clip.tokenizer import bytes_to_unicode, default_bpe  # heavy import, only for building

    lines = gzip.open(default_bpe()).read().decode("utf-8").split("\n")
    merges = [tuple(line.split()) for line in lines[1 : num_merges + 1]]
    chars = list(bytes_to_unicode().values())
    words = chars + [c + "</w>" for c in chars] + ["".join(m) for m in merges] + ["<|startoftext|>", "<|endoftext|>"]
    # the tokenizers backend takes merges as pairs, which transformers' annotation does not list
    return CLIPTokenizer(
        vocab={w: i for i, w in enumerate(words)},
        merges=merges,  # type: ignore[arg-type]
        model_max_length=77,
    )


def t5_tokenizer(words: Sequence[str], *, max_length: int) -> T5Tokenizer:
    """A Unigram vocabulary: pad=0, eos=1, unk=2, then characters and ``words`` whole."""
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -5.0) for c in string.ascii_lowercase + string.digits + string.punctuation]
    pieces += [("\u2581" + c, -4.0) for c in string.ascii_lowercase]
    pieces += [("\u2581" + w, -1.0) for w in words]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=max_length)


def clip_text_config(tok: CLIPTokenizer, *, width: int, ff: int) -> dict[str, Any]:
    """The CLIPTextConfig fields of a 2-layer, 4-head CLIP text tower of hidden size ``width`` over ``tok``."""
    return dict(vocab_size=len(tok), hidden_size=width, intermediate_size=ff, num_attention_heads=4,
                num_hidden_layers=2, max_position_embeddings=77, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip


def random_transformer(*, latent_channels: int, text_width: int, **options: Any) -> FluxTransformer2DModel:
    """A random Flux transformer for 2x2-packed latents of ``latent_channels`` and text of ``text_width``;
    ``options`` are FluxTransformer2DModel's (blocks, heads, RoPE axes, guidance_embeds=True by default)."""
    return FluxTransformer2DModel(
        **{
            "patch_size": 1,
            "in_channels": 4 * latent_channels,
            "joint_attention_dim": text_width,
            "pooled_projection_dim": text_width,
            "guidance_embeds": True,
            **options,
        }
    )


def tiny_transformer(size: str = "tiny", **options: Any) -> FluxTransformer2DModel:
    """The transformer of the ``size`` tiny pipeline, with ``options`` overriding its configuration."""
    return random_transformer(**{**TINY[size], **options})


def random_pipeline(
    *, tokenizer_2: T5Tokenizer, text_width: int, ff: int, t5_head_dim: int, vae: dict, transformer: dict
) -> FluxPipeline:
    """A random Flux pipeline: 2-layer CLIP and T5 text encoders of hidden size ``text_width``, then the VAE
    (``vae``: AutoencoderKL options over a 2-level, 1-layer default) and the transformer (``random_transformer``
    options), drawn in that order from torch's global RNG; FLUX.1-dev's dynamic-shift scheduler."""
    tok = clip_tokenizer()
    clip = CLIPTextConfig(**clip_text_config(tok, width=text_width, ff=ff), projection_dim=text_width)
    text_encoder = CLIPTextModel(clip)
    t5 = T5Config(vocab_size=len(tokenizer_2), d_model=text_width, d_kv=t5_head_dim, d_ff=ff, num_layers=2,
                  num_heads=4, relative_attention_num_buckets=8, dropout_rate=0.0)  # fmt: skip
    text_encoder_2 = T5EncoderModel(t5)
    autoencoder = AutoencoderKL(
        **{
            "block_out_channels": (8, 16),
            "layers_per_block": 1,
            "down_block_types": ("DownEncoderBlock2D",) * 2,
            "up_block_types": ("UpDecoderBlock2D",) * 2,
            "norm_num_groups": 4,
            "use_quant_conv": False,
            "use_post_quant_conv": False,
            **vae,
        }
    )
    return FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
        text_encoder=text_encoder,
        tokenizer=tok,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=random_transformer(text_width=text_width, **transformer),
        vae=autoencoder,
    )
