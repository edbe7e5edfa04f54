"""Qwen-Image adapter: QwenImageTransformer2DModel, Qwen2.5-VL text encoder, AutoencoderKLQwenImage.

Conditioning follows diffusers' QwenImagePipeline: each prompt is wrapped in the chat template
below, run through the text encoder, and the last hidden states of its real (unpadded) tokens are
kept after dropping the template's system-prompt prefix; the batch is right-padded with zeros to
its longest prompt and a mask [B, T] (1 = real token) marks the rest. The prefix length is
measured with the loaded tokenizer (34 tokens for the released Qwen tokenizer, the pipeline's
hard-coded value). No true CFG: the model is guidance-free unless its config has
``guidance_embeds``. Decoding: z * latents_std + latents_mean per channel, then the VAE (one frame).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock
from torch import Tensor
from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

from models.base import Conditioning
from models.cache import EmbeddingCache
from models.components import Component, Entry, check_equal, config_entry
from models.diffusers_backbone import JOINT_ATTENTION_LORA_TARGETS, DiffusersBackbone, tokenize, unpack_latents
from models.registry import register_backbone

PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
QWEN_MAX_TEXT_LENGTH = 1024  # QwenImagePipeline's upper bound for max_sequence_length


@dataclass
class QwenImageConditioning(Conditioning):
    prompt_embeds: Tensor  # [B, T, D] text-encoder last hidden states, zero past each prompt's end
    mask: Tensor  # [B, T] int64, 1 for real tokens

    def trim(self) -> QwenImageConditioning:
        used = self.mask.any(0).nonzero()  # token columns some row needs
        keep = int(used.max()) + 1 if len(used) else 1
        return QwenImageConditioning(self.prompt_embeds[:, :keep], self.mask[:, :keep])


def _text_width(config: dict[str, Any]) -> int | None:
    return (config.get("text_config") or {}).get("hidden_size", config.get("hidden_size"))


@register_backbone("qwenimage")
class QwenImageBackbone(DiffusersBackbone):
    conditioning_class = QwenImageConditioning
    block_classes = (QwenImageTransformerBlock,)
    lora_target_modules = [
        *JOINT_ATTENTION_LORA_TARGETS,
        "img_mlp.net.0.proj",
        "img_mlp.net.2",
        "txt_mlp.net.0.proj",
        "txt_mlp.net.2",
    ]
    components = (
        Component("transformer", QwenImageTransformer2DModel, "config.json", ("QwenImageTransformer2DModel",)),
        Component("vae", AutoencoderKLQwenImage, "config.json", ("AutoencoderKLQwenImage",)),
        Component(
            "text_encoder", Qwen2_5_VLForConditionalGeneration, "config.json", ("Qwen2_5_VLForConditionalGeneration",)
        ),
        Component(
            "tokenizer", Qwen2Tokenizer, "tokenizer_config.json", ("Qwen2Tokenizer", "Qwen2TokenizerFast"), False
        ),
        Component(
            "scheduler",
            FlowMatchEulerDiscreteScheduler,
            "scheduler_config.json",
            ("FlowMatchEulerDiscreteScheduler",),
            False,
        ),
    )
    text_components = ("text_encoder", "tokenizer")

    def __init__(
        self,
        modules: dict[str, Any],
        configs: dict[str, dict[str, Any]],
        folders: dict[str, Path],
        *,
        dtype: torch.dtype,
        cache: EmbeddingCache | None = None,
        max_sequence_length: int = 512,
        guidance: float | None = None,
    ) -> None:
        """``max_sequence_length``: text tokens kept per prompt after the template prefix (the
        pipeline's default, 512). ``guidance``: only for a guidance-distilled transformer."""
        super().__init__(modules, configs, folders, dtype=dtype, cache=cache)
        if not 0 < max_sequence_length <= QWEN_MAX_TEXT_LENGTH:
            raise ValueError(
                f"qwenimage: max_sequence_length must be in 1..{QWEN_MAX_TEXT_LENGTH}, got {max_sequence_length}"
            )
        self.max_sequence_length = max_sequence_length
        self.guidance_embeds = bool(configs.get("transformer", {}).get("guidance_embeds", False))
        if self.guidance_embeds and guidance is None:
            raise ValueError("qwenimage: this transformer is guidance-distilled; set the model option guidance")
        self.guidance = guidance
        self.template_drop = None
        if "tokenizer" in modules:
            prefix = PROMPT_TEMPLATE.split("{}")[0]
            self.template_drop = len(modules["tokenizer"](prefix).input_ids)

    @classmethod
    def check_components(cls, configs: dict[str, dict[str, Any]], folders: dict[str, Path]) -> None:
        def entry(name: str, key: str, factor: int = 1) -> Entry | None:
            return config_entry(configs, folders, name, key, factor=factor)

        text = None
        if "text_encoder" in configs:
            text = ("text_encoder", folders["text_encoder"], _text_width(configs["text_encoder"]))
        check_equal(cls.name, "text width", entry("transformer", "joint_attention_dim"), text)
        # 2x2 packing: a token carries 4 latent cells; the output is unpatchified to z_dim channels
        check_equal(cls.name, "latent channels", entry("transformer", "in_channels"), entry("vae", "z_dim", 4))
        check_equal(cls.name, "output channels", entry("transformer", "out_channels"), entry("vae", "z_dim"))

    @property
    def vae_scale_factor(self) -> int:
        return 2 ** len(self.configs["vae"]["temperal_downsample"])

    def encoding_options(self) -> dict[str, Any]:
        return {"max_sequence_length": self.max_sequence_length, "template_drop": self.template_drop}

    def expected_dims(self) -> dict[str, int] | None:
        if "transformer" not in self.configs:
            return None
        return {"prompt_embeds": self.configs["transformer"]["joint_attention_dim"]}

    def encode_text(self, prompts: list[str]) -> QwenImageConditioning:
        texts = [PROMPT_TEMPLATE.format(p) for p in prompts]
        batch = tokenize(
            self.part("tokenizer"),
            texts,
            max_length=self.max_sequence_length + self.template_drop,
            padding="longest",
            what="qwenimage tokenizer",
        )
        out = self.part("text_encoder")(
            input_ids=batch.input_ids.to(self.device),
            attention_mask=batch.attention_mask.to(self.device),
            output_hidden_states=True,
        )
        real = batch.attention_mask.bool()
        rows = out.hidden_states[-1][real.to(self.device)].split(real.sum(1).tolist())
        rows = [r[self.template_drop :] for r in rows]
        width = max(len(r) for r in rows)
        embeds = torch.stack([torch.cat([r, r.new_zeros(width - len(r), r.shape[1])]) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], dtype=torch.long, device=self.device)
        return QwenImageConditioning(prompt_embeds=embeds.to(self.dtype), mask=mask)

    def predict(self, z: Tensor, t: Tensor, cond: QwenImageConditioning) -> Tensor:
        batch, h2, w2, _ = z.shape
        dtype = self.compute_dtype
        guidance = None
        if self.guidance_embeds:
            guidance = torch.full((batch,), self.guidance, device=z.device, dtype=torch.float32)
        v = self.transformer(
            hidden_states=z.flatten(1, 2).to(dtype),
            timestep=t.to(dtype),
            guidance=guidance,
            encoder_hidden_states=cond.prompt_embeds.to(dtype),
            encoder_hidden_states_mask=cond.mask,
            img_shapes=[[(1, h2, w2)]] * batch,
            return_dict=False,
        )[0]
        return v.float().view_as(z)

    def decode(self, z: Tensor, *, height: int | None = None, width: int | None = None) -> Tensor:
        self.check_image_size(z, height, width)
        config = self.configs["vae"]
        x = unpack_latents(z.float())[:, :, None]  # one video frame: [B, C, 1, h, w]
        mean = torch.tensor(config["latents_mean"], device=x.device).view(1, -1, 1, 1, 1)
        std = torch.tensor(config["latents_std"], device=x.device).view(1, -1, 1, 1, 1)
        x = x / (1.0 / std) + mean  # the pipeline's exact arithmetic
        image = self.vae.decode(x.to(self.dtype), return_dict=False)[0][:, :, 0]
        return (image.float() / 2 + 0.5).clamp(0, 1)
