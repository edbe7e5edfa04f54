"""What the diffusers-based adapters share: loading, packing, noise, schedule, the transformer call,
decoding, prompt encoding. An adapter adds its components, options, conditioning and VAE scaling.

Packing (both Flux and Qwen-Image): a VAE latent [B, C, h, w] is cut into 2x2 patches,
    [B, C, h/2, 2, w/2, 2] -> [B, h/2, w/2, C, 2, 2] -> [B, h/2, w/2, 4C],
the element order of diffusers' ``_pack_latents``, with the token grid kept (``flatten(1, 2)``
gives the pipelines' [B, L, 4C]).

Schedule: with ``shift=None`` the sigmas are those diffusers' FlowMatchEulerDiscreteScheduler
computes for the pipeline (linspace(1, 1/N, N), resolution-dependent exponential shift with mu
linear in the token count L = h/2 * w/2, optional terminal stretch, then a final 0).
"""

from __future__ import annotations

import abc
import copy
import inspect
import warnings
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from torch import Tensor, nn

from models.base import Backbone, Conditioning, check_image_multiple, parse_dtype
from models.cache import EmbeddingCache
from models.components import Component, component_folders, load_component, read_config
from samplers.schedule import dynamic_shift_mu, dynamic_sigmas, shifted_sigmas

# Attention projections of the dual-stream (image + text) blocks that Flux and Qwen-Image share;
# each adapter adds its own MLP names for LoRA.
JOINT_ATTENTION_LORA_TARGETS = [
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
]
# the scheduler both adapters read their sigmas from (its config only: the sampler is ours)
SCHEDULER_COMPONENT = Component("scheduler", FlowMatchEulerDiscreteScheduler, "scheduler_config.json", is_module=False)


def pack_latents(x: Tensor) -> Tensor:
    """[B, C, h, w] -> [B, h/2, w/2, 4C]."""
    b, c, h, w = x.shape
    return x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, h // 2, w // 2, 4 * c)


def unpack_latents(z: Tensor) -> Tensor:
    """[B, h/2, w/2, 4C] -> [B, C, h, w]."""
    b, h2, w2, c4 = z.shape
    return z.view(b, h2, w2, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c4 // 4, 2 * h2, 2 * w2)


def tokenize(tokenizer: Any, texts: list[str], *, max_length: int, padding: str, what: str) -> Any:
    """Tokenize with truncation at ``max_length``, warning (not failing) for each text cut short."""
    lengths = [len(ids) for ids in tokenizer(texts, truncation=False)["input_ids"]]
    for text, length in zip(texts, lengths):
        if length > max_length:
            warnings.warn(
                f"{what}: a prompt of {length} tokens is truncated to {max_length}: {text[:80]!r}...",
                stacklevel=3,
            )
    return tokenizer(texts, padding=padding, max_length=max_length, truncation=True, return_tensors="pt")


class DiffusersBackbone(Backbone):
    """A backbone made of diffusers / transformers components in one pipeline folder."""

    components: ClassVar[tuple[Component, ...]]
    text_components: ClassVar[tuple[str, ...]]  # needed only to encode prompts
    # conditioning field -> the transformer config's key holding its last-dim size
    conditioning_dims: ClassVar[dict[str, str]]
    guidance: float | None

    def __init__(
        self,
        modules: dict[str, Any],
        configs: dict[str, dict[str, Any]],
        folders: dict[str, Path],
        *,
        dtype: torch.dtype,
        cache: EmbeddingCache | None = None,
        **options: Any,
    ) -> None:
        self._parts = modules
        self.configs = configs
        self.folders = folders
        self.dtype = dtype
        self.device = torch.device("cpu")
        self.cache = cache
        self.guidance_embeds = bool(configs.get("transformer", {}).get("guidance_embeds", False))
        self.set_options(**options)

    @abc.abstractmethod
    def set_options(self) -> None:
        """Take the adapter's own keyword options (``load``'s keyword arguments that name no component), checked
        in its words; its signature lists the options ``load`` accepts."""

    # ---- loading -------------------------------------------------------------------------------

    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        *,
        dtype: torch.dtype | str = torch.bfloat16,
        device: torch.device | str = "cpu",
        embedding_cache: str | Path | None = None,
        skip: Collection[str] = (),
        **kwargs: Any,
    ) -> DiffusersBackbone:
        """Load from ``path`` (a diffusers folder); ``kwargs`` holds per-component folders and the
        adapter's options. Components in ``skip``, and the text encoders when an embedding cache is
        given, are neither required nor loaded."""
        names = [c.name for c in cls.components]
        overrides = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
        cls._check_options(kwargs, names)
        unknown_skip = sorted(set(skip) - set(names))
        if unknown_skip:
            raise ValueError(f"{cls.name}: cannot skip unknown component(s) {unknown_skip}; components are {names}")
        dtype = parse_dtype(dtype)
        cache = EmbeddingCache(embedding_cache) if embedding_cache is not None else None
        skipped = set(skip) | (set(cls.text_components) if cache is not None else set())
        if skipped & set(overrides):
            raise ValueError(
                f"{cls.name}: folders given for components that are not loaded {sorted(skipped & set(overrides))} "
                "(skipped, or text encoders replaced by the embedding cache); drop those settings"
            )
        wanted = [c for c in cls.components if c.name not in skipped]
        folders = component_folders(cls.name, wanted, path, overrides)
        configs = {c.name: read_config(cls.name, c, folders[c.name]) for c in wanted}
        cls.check_components(configs, folders)
        modules = {c.name: load_component(cls.name, c, folders[c.name], dtype=dtype) for c in wanted}
        backbone = cls(modules, configs, folders, dtype=dtype, cache=cache, **kwargs)
        if cache is not None:
            cache.check_signature(
                {"backbone": cls.name, **backbone.encoding_options(), "dims": backbone.expected_dims()}
            )
        return backbone.to(device)

    @classmethod
    def _check_options(cls, options: Mapping[str, Any], names: list[str]) -> None:
        accepted = [p for p in inspect.signature(cls.set_options).parameters if p != "self"]
        unknown = sorted(set(options) - set(accepted))
        if unknown:
            raise ValueError(
                f"{cls.name}: unknown model option(s) {unknown}; accepted: options {accepted}, "
                f"component folders {names}, embedding_cache, skip"
            )

    @classmethod
    @abc.abstractmethod
    def check_components(cls, configs: dict[str, dict[str, Any]], folders: dict[str, Path]) -> None:
        """Raise ValueError when loaded components do not fit together (sizes named with paths)."""

    def part(self, name: str) -> Any:
        """A loaded component; ValueError when it was skipped or freed."""
        if name not in self._parts:
            raise ValueError(
                f"{self.name}: component {name!r} is not loaded (skipped, or freed after encoding); "
                "load the backbone without skipping it"
            )
        return self._parts[name]

    def with_parts(self, **modules: Any) -> DiffusersBackbone:
        """A shallow copy of the backbone with ``modules`` in place of its components of those names (the
        other components shared with this one)."""
        copied = copy.copy(self)
        copied._parts = {**self._parts, **modules}
        return copied

    @property
    def transformer(self) -> nn.Module:
        return self.part("transformer")

    @transformer.setter
    def transformer(self, module: nn.Module) -> None:
        # a wrapped transformer (LoRA, FSDP) may replace the loaded one; predict must use the wrapper
        self._parts["transformer"] = module

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the transformer's parameters: predict feeds it inputs in this dtype (a
        mixed-precision wrapper such as FSDP2 casts them on to its compute dtype)."""
        return next(p.dtype for p in self.transformer.parameters() if p.is_floating_point())

    @property
    def vae(self) -> Any:  # a diffusers autoencoder: encode/decode and its config, beyond nn.Module
        return self.part("vae")

    def to(self, device: torch.device | str) -> DiffusersBackbone:
        self.device = torch.device(device)
        for part in self._parts.values():
            if isinstance(part, nn.Module):
                part.to(self.device)
        return self

    # ---- latents and schedule ------------------------------------------------------------------

    @classmethod
    @abc.abstractmethod
    def vae_scale(cls, vae_config: dict[str, Any]) -> int:
        """Pixels per latent cell along each side, for the VAE of ``vae_config``."""

    @property
    def vae_scale_factor(self) -> int:
        """Pixels per latent cell along each side."""
        return self.vae_scale(self.configs["vae"])

    @classmethod
    def _read_config(
        cls, name: str, path: str | Path | None, options: Mapping[str, Any]
    ) -> tuple[Component, dict[str, Any]]:
        """Component ``name`` and its checked config (no weights are read); ``options``: ``load``'s keyword
        arguments (a ``<name>=<folder>`` of its own)."""
        component = next(c for c in cls.components if c.name == name)
        folder = component_folders(cls.name, [component], path, options)[name]
        return component, read_config(cls.name, component, folder)

    @classmethod
    def transformer_skeleton(cls, path: str | Path | None, **options: Any) -> nn.Module:
        """The transformer built on the meta device from its config.json (no weights are read or allocated)."""
        component, config = cls._read_config("transformer", path, options)
        with torch.device("meta"):
            return component.loader.from_config(config)

    @classmethod
    def image_multiple(cls, path: str | Path | None, **options: Any) -> int:
        """What an image side must be a multiple of: the VAE's scale (from its config.json) times 2 (the
        transformer's 2x2 patches)."""
        return 2 * cls.vae_scale(cls._read_config("vae", path, options)[1])

    @property
    def latent_channels(self) -> int:
        return self.configs["transformer"]["in_channels"] // 4

    def latent_grid(self, height: int, width: int) -> tuple[int, int]:
        """(h/2, w/2): the packed token grid of a height x width image."""
        step = 2 * self.vae_scale_factor
        check_image_multiple(self.name, step, height, width)
        return height // step, width // step

    def initial_noise(
        self, batch_size: int, *, height: int, width: int, generator: torch.Generator | None = None
    ) -> Tensor:
        # drawn unpacked, as the pipelines do, so a seed gives the pipelines' noise
        h2, w2 = self.latent_grid(height, width)
        device = generator.device if generator is not None else self.device
        shape = (batch_size, self.latent_channels, 2 * h2, 2 * w2)
        noise = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
        return pack_latents(noise).to(self.device)

    def sigmas(self, num_steps: int, *, height: int, width: int, shift: float | None = None) -> Tensor:
        if shift is not None:
            return shifted_sigmas(num_steps, shift)
        config = self.configs["scheduler"]
        unsupported = [
            k
            for k in ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "invert_sigmas")
            if config.get(k)
        ]
        if (
            not config.get("use_dynamic_shifting")
            or config.get("time_shift_type", "exponential") != "exponential"
            or unsupported
        ):
            raise ValueError(
                f"{self.name}: the scheduler at {self.folders['scheduler']} is not a dynamic exponential-shift "
                f"FlowMatchEulerDiscreteScheduler ({unsupported or 'use_dynamic_shifting/time_shift_type'}); "
                "pass shift to use a fixed-shift schedule"
            )
        h2, w2 = self.latent_grid(height, width)
        mu = dynamic_shift_mu(
            h2 * w2,
            base_seq_len=config.get("base_image_seq_len", 256),
            max_seq_len=config.get("max_image_seq_len", 4096),
            base_shift=config.get("base_shift", 0.5),
            max_shift=config.get("max_shift", 1.15),
        )
        return dynamic_sigmas(num_steps, mu, shift_terminal=config.get("shift_terminal"))

    # ---- the transformer and the VAE -----------------------------------------------------------

    @abc.abstractmethod
    def transformer_inputs(self, z: Tensor, cond: Conditioning, dtype: torch.dtype) -> dict[str, Any]:
        """The transformer's keyword inputs besides the latents, the timestep and the guidance, for packed
        latents z: the conditioning in ``dtype`` and the token positions."""

    def predict(self, z: Tensor, t: Tensor, cond: Conditioning, *, transformer: nn.Module | None = None) -> Tensor:
        dtype = self.compute_dtype
        guidance = None
        if self.guidance_embeds:
            assert self.guidance is not None  # set_options requires it for a guidance-distilled transformer
            guidance = torch.full((z.shape[0],), self.guidance, device=z.device, dtype=torch.float32)
        model = self.transformer if transformer is None else transformer
        v = model(
            hidden_states=z.flatten(1, 2).to(dtype),
            timestep=t.to(dtype),
            guidance=guidance,
            **self.transformer_inputs(z, cond, dtype),
            return_dict=False,
        )[0]
        return v.to(torch.promote_types(v.dtype, torch.float32)).view_as(z)  # a float64 transformer's stays float64

    @abc.abstractmethod
    def vae_latents(self, x: Tensor) -> Tensor:
        """What the VAE decodes, from unpacked float32 latents x [B, C, h, w] (the adapter's scaling)."""

    def decode(self, z: Tensor, *, height: int | None = None, width: int | None = None) -> Tensor:
        size = (z.shape[1] * 2 * self.vae_scale_factor, z.shape[2] * 2 * self.vae_scale_factor)
        if (height is not None and height != size[0]) or (width is not None and width != size[1]):
            raise ValueError(f"{self.name}: these latents decode to {size[0]}x{size[1]} images, not {height}x{width}")
        image = self.vae.decode(self.vae_latents(unpack_latents(z.float())).to(self.dtype), return_dict=False)[0]
        if image.ndim == 5:  # a video VAE's images [B, 3, frames, H, W]: the one frame
            image = image[:, :, 0]
        return (image.float() / 2 + 0.5).clamp(0, 1)

    # ---- prompts -------------------------------------------------------------------------------

    @abc.abstractmethod
    def encode_text(self, prompts: list[str]) -> Conditioning:
        """Run the text encoders (no grad) on ``prompts``."""

    @abc.abstractmethod
    def encoding_options(self) -> dict[str, Any]:
        """Options that change the embeddings (None where unknown without the text encoders)."""

    def expected_dims(self) -> dict[str, int] | None:
        """Last-dim size of each floating conditioning field the transformer expects (None: unknown)."""
        if "transformer" not in self.configs:
            return None
        return {field: self.configs["transformer"][key] for field, key in self.conditioning_dims.items()}

    def cache_signature(self, cond: Conditioning) -> dict[str, Any]:
        """What a cache written from ``cond`` records about its encoding."""
        dims = {k: v.shape[-1] for k, v in cond.tensors().items() if v.is_floating_point()}
        return {"backbone": self.name, **self.encoding_options(), "dims": dims}

    def encode(self, prompts: list[str]) -> Conditioning:
        if isinstance(prompts, str):
            raise ValueError("encode takes a list of prompts, got a single string")
        if self.cache is not None:
            cond = self.cache.lookup(list(prompts), self.conditioning_class)
        else:
            missing = [n for n in self.text_components if n not in self._parts]
            if missing:
                raise ValueError(
                    f"{self.name}: text encoders {missing} are not loaded (skipped or freed); "
                    "pass embedding_cache or load them"
                )
            with torch.no_grad():
                cond = self.encode_text(list(prompts))
        return cond.to(self.device, self.dtype)
