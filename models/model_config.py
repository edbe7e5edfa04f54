"""The backbone's settings: which adapter, from which folder, in which dtype and size, and LoRA.

``ModelConfig`` and ``LoraConfig`` check their own ranges when they are built and name the field that is
wrong in their own words (``height must be > 0, got 0``); whoever reads them from a larger configuration
adds the path of the group in front. Which names ``name`` accepts is the registry's to say
(``models.registry.get_backbone_class``), and whether ``path`` holds a pipeline the loader's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from models.base import DType
from settings import Choice, check_range, member

# peft's init_lora_weights that need no extra config; pissa_niter_<n> too
LORA_INITS = ("gaussian", "olora", "pissa", "orthogonal")


class TinySize(Choice):
    """The random offline pipelines ``models.tiny.build_tiny`` builds (its module docstring)."""

    tiny = "tiny"
    small = "small"


@dataclass
class LoraConfig:
    enabled: bool = False
    """train LoRA adapters instead of every transformer weight"""
    rank: int = 64
    """r: rank of each adapter's B A, >= 1"""
    alpha: int = 128
    """scaling: the adapter adds alpha / r * B A, >= 1"""
    init: str = "gaussian"
    """peft init_lora_weights: gaussian | olora | pissa | pissa_niter_<n> | orthogonal"""
    target_modules: list[str] = field(default_factory=list)
    """module-name suffixes of the transformer to wrap (peft target_modules); empty: the backbone's own
    (lora_target_modules in models/<name>.py). A checkpoint records the modules this wrapped, by full name"""

    def __post_init__(self) -> None:
        check_range(self.rank, "rank", low=0, low_open=True)
        check_range(self.alpha, "alpha", low=0, low_open=True)
        if self.init not in LORA_INITS and not re.fullmatch(r"pissa_niter_\d+", self.init):
            raise ValueError(
                f"init={self.init!r} is not valid; accepted values: {', '.join(LORA_INITS)}, pissa_niter_<n>"
            )
        if any(not isinstance(name, str) or not name.strip() for name in self.target_modules):
            raise ValueError(
                f"target_modules must be module-name suffixes (e.g. attn.to_q), got {list(self.target_modules)}"
            )


@dataclass
class ModelConfig:
    name: str = "flux"
    """backbone registry key: flux | qwenimage (models/registry.py)"""
    path: str = "???"  # omegaconf's MISSING: a value the user must give
    """local diffusers pipeline folder (no hub downloads)"""
    build_tiny: TinySize | None = None
    """"tiny" | "small": build a random offline pipeline at `path` if absent (CPU demos)"""
    dtype: DType = DType.float32
    """transformer parameter/compute dtype: float32 | bfloat16 | float16 (or fp32 | bf16 | fp16)"""
    height: int = 32
    """image height in pixels"""
    width: int = 32
    """image width in pixels"""
    options: dict = field(default_factory=dict)
    """adapter options for models.registry.load_backbone: Flux guidance / max_sequence_length (text tokens
    per prompt; longer prompts are truncated with a warning), per-component folders (e.g. vae: /path)"""
    embedding_cache: str | None = None
    """cache folder written by scripts/precompute_embeddings.py"""
    decode_batch: int = 0
    """images per VAE decode call when the rollout is scored (per rank); 0 = every sample of the step in one
    call. Decoding many large images at once dominates the step's memory (measured per image for the shipped
    presets in docs/benchmarks/2026-12-planner-presets.md)."""
    activation_checkpointing: bool = False
    """recompute each transformer block in backward"""
    compile: bool = False
    """torch.compile (inductor) each transformer block on its own, for the rollout, the update, the KL
    reference and evaluation alike, and the VAE decoder (Flux's: the decode of rollouts and evaluations);
    needs a C++ compiler on CPU, Triton on CUDA (checked at start-up). The first step pays the compilation
    (logged as time/compile; inductor's on-disk cache makes a second run start faster)"""
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        self.dtype = member(DType, self.dtype, "dtype")
        if self.build_tiny is not None:
            self.build_tiny = member(TinySize, self.build_tiny, "build_tiny")
        check_range(self.height, "height", low=0, low_open=True)
        check_range(self.width, "width", low=0, low_open=True)
        check_range(self.decode_batch, "decode_batch", low=0, why=" (0 = every sample of the step in one call)")
