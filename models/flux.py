"""FLUX.1 (dev) adapter: FluxTransformer2DModel, CLIP (pooled) + T5 (sequence) text encoders,
AutoencoderKL.

Conditioning follows diffusers' FluxPipeline: the CLIP text model's pooled output [B, P] (prompt
padded to CLIP's 77 tokens) and the T5 encoder's last hidden states [B, T, D] (prompt padded to
``max_sequence_length``; T5 runs without an attention mask, as in the pipeline). The distilled
guidance value (3.5 for Flux-dev) is fed through the guidance embedding on every call; no true CFG.
Decoding: z / scaling_factor + shift_factor, then the VAE.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock, FluxTransformerBlock
from torch import Tensor
from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5Tokenizer

from models.base import Conditioning
from models.cache import EmbeddingCache
from models.components import Component, Entry, check_equal, config_entry
from models.diffusers_backbone import JOINT_ATTENTION_LORA_TARGETS, DiffusersBackbone, tokenize, unpack_latents
from models.registry import register_backbone

FLUX_MAX_T5_LENGTH = 512  # FluxPipeline's upper bound for max_sequence_length


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
        Component("transformer", FluxTransformer2DModel, "config.json", ("FluxTransformer2DModel",)),
        Component("vae", AutoencoderKL, "config.json", ("AutoencoderKL",)),
        Component("text_encoder", CLIPTextModel, "config.json", ("CLIPTextModel",)),
        Component("tokenizer", CLIPTokenizer, "tokenizer_config.json", ("CLIPTokenizer", "CLIPTokenizerFast"), False),
        Component("text_encoder_2", T5EncoderModel, "config.json", ("T5EncoderModel",)),
        Component("tokenizer_2", T5Tokenizer, "tokenizer_config.json", ("T5Tokenizer", "T5TokenizerFast"), False),
        Component(
            "scheduler",
            FlowMatchEulerDiscreteScheduler,
            "scheduler_config.json",
            ("FlowMatchEulerDiscreteScheduler",),
            False,
        ),
    )
    text_components = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")

    def __init__(
        self,
        modules: dict[str, Any],
        configs: dict[str, dict[str, Any]],
        folders: dict[str, Path],
        *,
        dtype: torch.dtype,
        cache: EmbeddingCache | None = None,
        guidance: float = 3.5,
        max_sequence_length: int | None = None,
    ) -> None:
        """``guidance``: Flux-dev's distilled guidance value. ``max_sequence_length``: T5 tokens per
        prompt (default: the T5 tokenizer's limit, at most 512)."""
        super().__init__(modules, configs, folders, dtype=dtype, cache=cache)
        self.guidance = float(guidance)
        if max_sequence_length is None and "tokenizer_2" in modules:
            max_sequence_length = min(modules["tokenizer_2"].model_max_length, FLUX_MAX_T5_LENGTH)
        if max_sequence_length is not None and not 0 < max_sequence_length <= FLUX_MAX_T5_LENGTH:
            raise ValueError(f"flux: max_sequence_length must be in 1..{FLUX_MAX_T5_LENGTH}, got {max_sequence_length}")
        self.max_sequence_length = max_sequence_length
        self.guidance_embeds = bool(configs.get("transformer", {}).get("guidance_embeds", False))

    @classmethod
    def check_components(cls, configs: dict[str, dict[str, Any]], folders: dict[str, Path]) -> None:
        def entry(name: str, key: str, factor: int = 1) -> Entry | None:
            return config_entry(configs, folders, name, key, factor=factor)

        check_equal(
            cls.name, "T5 width", entry("transformer", "joint_attention_dim"), entry("text_encoder_2", "d_model")
        )
        check_equal(
            cls.name, "CLIP width", entry("transformer", "pooled_projection_dim"), entry("text_encoder", "hidden_size")
        )
        # 2x2 packing: a token carries 4 latent cells
        check_equal(
            cls.name, "latent channels", entry("transformer", "in_channels"), entry("vae", "latent_channels", 4)
        )

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** (len(self.configs["vae"]["block_out_channels"]) - 1)

    def encoding_options(self) -> dict[str, Any]:
        return {"max_sequence_length": self.max_sequence_length}

    def expected_dims(self) -> dict[str, int] | None:
        if "transformer" not in self.configs:
            return None
        config = self.configs["transformer"]
        return {"prompt_embeds": config["joint_attention_dim"], "pooled": config["pooled_projection_dim"]}

    def encode_text(self, prompts: list[str]) -> FluxConditioning:
        clip_tok, t5_tok = self.part("tokenizer"), self.part("tokenizer_2")
        clip_ids = tokenize(
            clip_tok, prompts, max_length=clip_tok.model_max_length, padding="max_length", what="flux CLIP tokenizer"
        ).input_ids
        pooled = self.part("text_encoder")(clip_ids.to(self.device), output_hidden_states=False).pooler_output
        t5_ids = tokenize(
            t5_tok, prompts, max_length=self.max_sequence_length, padding="max_length", what="flux T5 tokenizer"
        ).input_ids
        embeds = self.part("text_encoder_2")(t5_ids.to(self.device), output_hidden_states=False)[0]
        return FluxConditioning(prompt_embeds=embeds.to(self.dtype), pooled=pooled.to(self.dtype))

    def predict(self, z: Tensor, t: Tensor, cond: FluxConditioning) -> Tensor:
        batch, h2, w2, _ = z.shape
        dtype = self.compute_dtype
        img_ids = torch.zeros(h2, w2, 3, device=z.device, dtype=dtype)
        img_ids[..., 1] = torch.arange(h2, device=z.device)[:, None]
        img_ids[..., 2] = torch.arange(w2, device=z.device)[None, :]
        txt_ids = torch.zeros(cond.prompt_embeds.shape[1], 3, device=z.device, dtype=dtype)
        guidance = None
        if self.guidance_embeds:
            guidance = torch.full((batch,), self.guidance, device=z.device, dtype=torch.float32)
        v = self.transformer(
            hidden_states=z.flatten(1, 2).to(dtype),
            timestep=t.to(dtype),
            guidance=guidance,
            pooled_projections=cond.pooled.to(dtype),
            encoder_hidden_states=cond.prompt_embeds.to(dtype),
            txt_ids=txt_ids,
            img_ids=img_ids.flatten(0, 1),
            return_dict=False,
        )[0]
        return v.float().view_as(z)

    def decode(self, z: Tensor, *, height: int | None = None, width: int | None = None) -> Tensor:
        self.check_image_size(z, height, width)
        config = self.configs["vae"]
        x = unpack_latents(z.float()) / config["scaling_factor"] + (config.get("shift_factor") or 0.0)
        image = self.vae.decode(x.to(self.dtype), return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)
