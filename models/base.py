"""The backbone interface (load, encode prompts, predict a velocity, decode latents) and the typed prompt conditioning.

Conventions shared by every adapter:
    * Latents are *packed*: a VAE latent [B, C, h, w] becomes a grid of 2x2 patches
      [B, h/2, w/2, 4C] (float32 outside the transformer). ``z.flatten(1, 2)`` is exactly the
      [B, L, 4C] token sequence diffusers' Flux and Qwen-Image pipelines use; keeping the grid makes
      every latent carry its own size, so ``predict`` needs no image size.
    * ``t`` is the timestep handed to the transformer (= sigma, or DanceGRPO's quantized sigma),
      one value per row; ``sigma`` is the noise level of the latent (see samplers/schedule.py).
    * ``predict`` runs the transformer in its own dtype and returns a float32 velocity shaped like z.
    * ``decode`` returns images [B, 3, H, W] in [0, 1], float32.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from settings import Choice

C = TypeVar("C", bound="Conditioning")


class DType(Choice):
    """The spellings of the dtypes a transformer or a scorer may run in (``DTYPES``)."""

    float32 = "float32"
    fp32 = "fp32"
    bfloat16 = "bfloat16"
    bf16 = "bf16"
    float16 = "float16"
    fp16 = "fp16"


# config spellings of the dtypes a transformer or a scorer may run in
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype from itself or from a config string (``"bfloat16"``, ``"bf16"``, ...)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {str(dtype)!r}")
    return DTYPES[dtype]


@dataclass
class Conditioning:
    """Prompt conditioning with one row per sample. Subclasses declare Tensor fields whose dim 0 is
    the batch. Zero is the padding value of every field (a backbone whose text tokens vary in
    number marks real tokens with a mask field, and zero there means "absent")."""

    def tensors(self) -> dict[str, Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def _map(self: C, fn: Callable[[Tensor], Tensor]) -> C:
        return replace(self, **{name: fn(value) for name, value in self.tensors().items()})

    @property
    def batch_size(self) -> int:
        return next(iter(self.tensors().values())).shape[0]

    def repeat(self: C, num_repeats: int) -> C:
        """Each row repeated ``num_repeats`` times in place (row i -> rows i*n .. i*n+n-1)."""
        return self._map(lambda x: x.repeat_interleave(num_repeats, dim=0))

    def index(self: C, rows: Tensor | Sequence[int]) -> C:
        rows = torch.as_tensor(rows, dtype=torch.long)
        return self._map(lambda x: x[rows.to(x.device)])

    def to(self: C, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> C:
        """Move every field; ``dtype`` applies to floating-point fields only (masks keep theirs)."""
        return self._map(lambda x: x.to(device=device, dtype=dtype if x.is_floating_point() else None))

    def trim(self: C) -> C:
        """Drop padding that no row needs (a no-op unless the backbone's text length varies)."""
        return self

    @classmethod
    def cat(cls: type[C], conds: Sequence[C]) -> C:
        """Rows of all ``conds`` in order; fields are zero-padded on non-batch dims to a common size."""
        if not conds:
            raise ValueError("Conditioning.cat needs at least one conditioning")
        out = {}
        for name in conds[0].tensors():
            parts = [c.tensors()[name] for c in conds]
            size = [max(p.shape[d] for p in parts) for d in range(1, parts[0].ndim)]
            out[name] = torch.cat([_pad_to(p, size) for p in parts])
        return cls(**out)


def _pad_to(x: Tensor, size: Sequence[int]) -> Tensor:
    """Zero-pad the non-batch dims of ``x`` at their end up to ``size``."""
    pad = []
    for dim in reversed(range(1, x.ndim)):
        pad += [0, size[dim - 1] - x.shape[dim]]
    return F.pad(x, pad) if any(pad) else x


def check_image_multiple(backbone: str, multiple: int, height: int, width: int) -> None:
    """ValueError unless height and width are positive multiples of ``multiple`` (``image_multiple``)."""
    if height % multiple or width % multiple or height <= 0 or width <= 0:
        raise ValueError(
            f"{backbone}: image height and width must be positive multiples of {multiple} (the VAE's "
            f"{multiple // 2} pixels per latent cell times the 2x2 patches), got {height}x{width}"
        )


class Backbone(abc.ABC):
    """One text-to-image flow-matching backbone: frozen text encoders and VAE, a trainable transformer."""

    name: ClassVar[str]
    conditioning_class: ClassVar[type[Conditioning]]
    block_classes: ClassVar[tuple[type[nn.Module], ...]]  # FSDP / activation-checkpointing units
    lora_target_modules: ClassVar[list[str]]  # module-name suffixes for peft's LoraConfig

    transformer: nn.Module

    @classmethod
    @abc.abstractmethod
    def load(
        cls, path: str | Path | None, *, dtype: torch.dtype | str, device: torch.device | str, **kwargs: Any
    ) -> Backbone:
        """Load every component from a diffusers folder (or per-component folders in ``kwargs``)."""

    @classmethod
    @abc.abstractmethod
    def image_multiple(cls, path: str | Path | None, **kwargs: Any) -> int:
        """What an image's height and width must be multiples of, read from the folder's configs (no weights
        load); ``kwargs`` as ``load`` takes them."""

    @classmethod
    @abc.abstractmethod
    def transformer_skeleton(cls, path: str | Path | None, **kwargs: Any) -> nn.Module:
        """The transformer built on the meta device from the folder's configs (no weights are read or allocated):
        its modules' names and its parameters' shapes."""

    @classmethod
    @abc.abstractmethod
    def tiny_pipeline(cls, size: str) -> Any:
        """A random diffusers pipeline of this architecture, drawn from torch's global RNG in a fixed
        order, for ``size`` in models/tiny.py's SIZES (tests, CPU demos, benchmarks); ``load`` reads
        the folder its ``save_pretrained`` writes."""

    @abc.abstractmethod
    def encode(self, prompts: list[str]) -> Conditioning:
        """Conditioning with one row per prompt, on the backbone's device, in its dtype."""

    @abc.abstractmethod
    def initial_noise(
        self, batch_size: int, *, height: int, width: int, generator: torch.Generator | None = None
    ) -> Tensor:
        """Packed float32 N(0, I) latents [B, h/2, w/2, 4C] for images of height x width pixels."""

    @abc.abstractmethod
    def predict(self, z: Tensor, t: Tensor, cond: Conditioning, *, transformer: nn.Module | None = None) -> Tensor:
        """Velocity v(z, t) [B, ...] float32 (float64 from a float64 transformer, as tests run it) for
        packed latents z [B, ...] and timesteps t [B], by the backbone's transformer or by
        ``transformer`` (e.g. a frozen reference copy of it)."""

    @abc.abstractmethod
    def decode(self, z: Tensor, *, height: int | None = None, width: int | None = None) -> Tensor:
        """Images [B, 3, H, W] in [0, 1] (float32) from packed latents."""

    @abc.abstractmethod
    def sigmas(self, num_steps: int, *, height: int, width: int, shift: float | None = None) -> Tensor:
        """Noise levels [num_steps + 1] from 1 to 0. ``shift=None``: the backbone's own diffusers
        schedule (with its resolution-dependent shift); a float: samplers.schedule.shifted_sigmas."""

    @abc.abstractmethod
    def to(self, device: torch.device | str) -> Backbone:
        """Move every loaded component to ``device``; returns self."""

    def decoder_units(self) -> list[nn.Module]:
        """The VAE decoder's modules to compile in place one by one, as the transformer's blocks are (their names
        unchanged); none unless the adapter names them."""
        return []


def decode_in_chunks(
    backbone: Backbone, z: Tensor, *, rows: int, height: int | None = None, width: int | None = None
) -> Tensor:
    """``backbone.decode(z)`` with at most ``rows`` latents per call (one call when ``rows`` <= 0).

    A VAE's full-resolution activations grow with the images decoded together (FLUX.1-dev's VAE: about 0.9 GiB
    per 720 x 720 image, docs/benchmarks/2026-12-planner-presets.md), while each image's pixels depend on its own
    latent only; chunks bound the memory of decoding a whole rollout batch.
    """
    if rows <= 0 or rows >= z.shape[0]:
        return backbone.decode(z, height=height, width=width)
    return torch.cat([backbone.decode(chunk, height=height, width=width) for chunk in z.split(rows)])
