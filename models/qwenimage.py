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
from functools import partial
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from diffusers.models.transformers.transformer_qwenimage import QwenImageTransformerBlock
from torch import Tensor
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

from models.base import Conditioning
from models.components import Component, check_equal, config_entry
from models.diffusers_backbone import JOINT_ATTENTION_LORA_TARGETS, SCHEDULER_COMPONENT, DiffusersBackbone, tokenize
from models.registry import register_backbone

PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n"
    "<|im_start|>assistant\n"
)
QWEN_MAX_TEXT_LENGTH = 1024  # QwenImagePipeline's upper bound for max_sequence_length
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
# Qwen-Image's scheduler (exponential dynamic shift with a terminal stretch), which the tiny pipelines copy
SCHEDULER: dict[str, Any] = dict(
    shift=1.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=0.9,
    base_image_seq_len=256,
    max_image_seq_len=8192,
    shift_terminal=0.02,
    time_shift_type="exponential",
)
# per tiny size of models/tiny.py: text width, VAE latent channels and transformer blocks
TINY: dict[str, dict[str, Any]] = {
    "tiny": dict(text_width=16, z_dim=4, num_layers=2, attention_head_dim=16, num_attention_heads=3,
                 axes_dims_rope=(8, 4, 4)),
    "small": dict(text_width=256, z_dim=16, num_layers=4, attention_head_dim=64, num_attention_heads=4,
                  axes_dims_rope=(16, 24, 24)),
}  # fmt: skip


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
        Component("transformer", QwenImageTransformer2DModel),
        Component("vae", AutoencoderKLQwenImage),
        Component("text_encoder", Qwen2_5_VLForConditionalGeneration),
        Component("tokenizer", Qwen2Tokenizer, "tokenizer_config.json", is_module=False),
        SCHEDULER_COMPONENT,
    )
    text_components = ("text_encoder", "tokenizer")
    conditioning_dims = {"prompt_embeds": "joint_attention_dim"}

    @classmethod
    def tiny_pipeline(cls, size: str) -> QwenImagePipeline:
        """A random pipeline: VAE, transformer, then the text encoder, drawn in that order from torch's
        global RNG; the VAE's per-channel statistics come from their own generator."""
        options = dict(TINY[size])
        width, z_dim = options.pop("text_width"), options.pop("z_dim")
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
            **options,
        )
        return QwenImagePipeline(
            transformer=transformer,
            vae=vae,
            scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER),
            text_encoder=random_text_encoder(tok, width),
            tokenizer=tok,
        )

    def set_options(self, *, max_sequence_length: int = 512, guidance: float | None = None) -> None:
        """``max_sequence_length``: text tokens kept per prompt after the template prefix (the
        pipeline's default, 512). ``guidance``: only for a guidance-distilled transformer."""
        if not 0 < max_sequence_length <= QWEN_MAX_TEXT_LENGTH:
            raise ValueError(
                f"qwenimage: max_sequence_length must be in 1..{QWEN_MAX_TEXT_LENGTH}, got {max_sequence_length}"
            )
        self.max_sequence_length = max_sequence_length
        if self.guidance_embeds and guidance is None:
            raise ValueError("qwenimage: this transformer is guidance-distilled; set the model option guidance")
        self.guidance = guidance
        self.template_drop: int | None = None  # measured with the tokenizer; None when it is not loaded
        if "tokenizer" in self._parts:
            prefix = PROMPT_TEMPLATE.split("{}")[0]
            self.template_drop = len(self._parts["tokenizer"](prefix).input_ids)

    @classmethod
    def check_components(cls, configs: dict[str, dict[str, Any]], folders: dict[str, Path]) -> None:
        entry = partial(config_entry, configs, folders)
        text = None
        if "text_encoder" in configs:
            text = ("text_encoder", folders["text_encoder"], _text_width(configs["text_encoder"]))
        check_equal(cls.name, "text width", entry("transformer", "joint_attention_dim"), text)
        # 2x2 packing: a token carries 4 latent cells; the output is unpatchified to z_dim channels
        check_equal(cls.name, "latent channels", entry("transformer", "in_channels"), entry("vae", "z_dim", factor=4))
        check_equal(cls.name, "output channels", entry("transformer", "out_channels"), entry("vae", "z_dim"))

    @classmethod
    def vae_scale(cls, vae_config: dict[str, Any]) -> int:
        return 2 ** len(vae_config["temperal_downsample"])  # one 2x spatial downsampling per level

    def encoding_options(self) -> dict[str, Any]:
        return {"max_sequence_length": self.max_sequence_length, "template_drop": self.template_drop}

    def encode_text(self, prompts: list[str]) -> QwenImageConditioning:
        assert self.template_drop is not None  # encode_text runs with the tokenizer loaded
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

    def transformer_inputs(  # type: ignore[override]  # the adapter's own Conditioning subclass
        self, z: Tensor, cond: QwenImageConditioning, dtype: torch.dtype
    ) -> dict[str, Any]:
        batch, h2, w2, _ = z.shape
        return {
            "encoder_hidden_states": cond.prompt_embeds.to(dtype),
            "encoder_hidden_states_mask": cond.mask,
            "img_shapes": [[(1, h2, w2)]] * batch,
        }

    def vae_latents(self, x: Tensor) -> Tensor:
        config = self.configs["vae"]
        x = x[:, :, None]  # one video frame: [B, C, 1, h, w]
        mean = torch.tensor(config["latents_mean"], device=x.device).view(1, -1, 1, 1, 1)
        std = torch.tensor(config["latents_std"], device=x.device).view(1, -1, 1, 1, 1)
        return x / (1.0 / std) + mean  # the pipeline's exact arithmetic


# ---- random pipelines (tests, CPU demos, benchmarks) ----------------------------------------------


def qwen2_tokenizer() -> Qwen2Tokenizer:
    """Byte-level BPE without merges (one token per byte) plus the Qwen chat special tokens."""
    from open_clip.tokenizer import bytes_to_unicode

    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    # byte-level: every byte is a token, so no unknown token (transformers' annotation wants a string)
    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token=None,  # type: ignore[arg-type]
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    tok.add_special_tokens({"additional_special_tokens": QWEN_SPECIAL_TOKENS})
    return tok


def random_text_encoder(tok: Qwen2Tokenizer, width: int) -> Qwen2_5_VLForConditionalGeneration:
    """A random 2-layer Qwen2.5-VL text model of hidden size ``width`` (with a 2-block vision tower)."""
    vocab = tok.get_vocab()
    ids = {t: vocab[t] for t in QWEN_SPECIAL_TOKENS}
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
    # the top-level sizes and token ids are the composite config's legacy keywords, passed on to its
    # sub-configs; transformers' annotations list only the new ones
    options: dict[str, Any] = dict(
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
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**options)).eval()
