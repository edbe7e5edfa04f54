"""The scorer interface shared by every reward, and the registry that builds scorers by name.

A scorer maps a batch of images and their prompts to one float32 score per image:

    scorer(images [B, 3, H, W] in [0, 1], prompts: B strings) -> Tensor [B] float32

on the images' device. Images may be any size and live on any device; a scorer moves them to its
own device and dtype, preprocesses them as tensors (no PIL round trip, no files) and returns the
scores on the images' device. Model-based scorers are frozen (eval mode, ``requires_grad`` False
on their weights) but never wrap scoring in ``torch.no_grad``: when the images require grad, the
score is differentiable with respect to them. A caller that needs no gradient scores under ``no_grad``.
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from models.base import parse_dtype

# name -> "module:Class"; imported lazily so that e.g. the JPEG reward never imports open_clip.
_REGISTRY: dict[str, str] = {
    "hpsv2": "rewards.hpsv2:HPSv2Scorer",
    "clipscore": "rewards.clipscore:CLIPScoreScorer",
    "pickscore": "rewards.pickscore:PickScoreScorer",
    "imagereward": "rewards.imagereward:ImageRewardScorer",
    "jpeg_compressibility": "rewards.compressibility:JPEGCompressibilityScorer",
    "jpeg_incompressibility": "rewards.compressibility:JPEGIncompressibilityScorer",
    "shape_alignment": "rewards.shapes:ShapeAlignmentScorer",
    "remote": "rewards.remote:RemoteScorer",
    "judge": "rewards.judge:JudgeScorer",
}
SCORER_NAMES: tuple[str, ...] = tuple(_REGISTRY)


class Scorer(abc.ABC):
    """A reward: ``scorer(images, prompts) -> Tensor[B] float32`` (see the module docstring)."""

    name: ClassVar[str]
    runs_remotely: ClassVar[bool] = False
    """True for a scorer served by another process (HTTP): its calls wait on the network, not on this device, so
    they can run in a background thread while the device works, where a local scorer would compete for it."""

    def __call__(self, images: Tensor, prompts: Sequence[str]) -> Tensor:
        check_inputs(images, prompts, scorer=self.name)
        scores = self.score(images, prompts)
        if not isinstance(scores, Tensor) or scores.shape != (images.shape[0],):
            # a scorer is user code (docs/rewards.md): one score per image is its contract, not an invariant
            got = tuple(scores.shape) if isinstance(scores, Tensor) else type(scores).__name__
            raise ValueError(
                f"reward {self.name!r}: score() must return one value per image, shape [{images.shape[0]}], got {got}"
            )
        return scores.to(device=images.device, dtype=torch.float32)

    @classmethod
    def check_arguments(cls, arguments: Mapping[str, Any]) -> None:
        """The constructor's ``arguments`` (every one by name, defaults filled in) checked without loading or
        contacting anything: ValueError in the scorer's own words. A scorer whose constructor reaches a server
        overrides it, so that its settings are refused before any work starts; nothing by default."""
        return None

    @abc.abstractmethod
    def score(self, images: Tensor, prompts: Sequence[str]) -> Tensor:
        """Validated images [B, 3, H, W] in [0, 1] and B prompts -> scores [B] (any device/dtype)."""

    @abc.abstractmethod
    def to(self, device: torch.device | str) -> Scorer:
        """Move the scorer's weights to ``device``; returns self."""


class FrozenModelScorer(Scorer):
    """A scorer built around one frozen ``nn.Module`` held in ``self.model``."""

    def __init__(self, model: nn.Module, *, device: torch.device | str, dtype: torch.dtype | str) -> None:
        self.dtype = parse_dtype(dtype)
        self.device = torch.device(device)
        # frozen, but inputs can still carry gradients through it; a third-party model (open_clip, transformers):
        # its own attributes, which nn.Module's typing hides
        self.model: Any = model.eval().requires_grad_(False).to(device=self.device, dtype=self.dtype)

    def to(self, device: torch.device | str) -> FrozenModelScorer:
        self.device = torch.device(device)
        self.model.to(self.device)
        return self


def check_inputs(images: Tensor, prompts: Sequence[str], *, scorer: str) -> None:
    """Raise ValueError unless images is a float [B, 3, H, W] batch in [0, 1] with B prompts."""
    if not isinstance(images, Tensor) or images.ndim != 4 or images.shape[1] != 3:
        shape = tuple(images.shape) if isinstance(images, Tensor) else type(images).__name__
        raise ValueError(f"reward {scorer!r}: images must be a [B, 3, H, W] tensor, got {shape}")
    if not images.is_floating_point():
        raise ValueError(f"reward {scorer!r}: images must be floating point in [0, 1], got {images.dtype}")
    if isinstance(prompts, str) or len(prompts) != images.shape[0]:
        got = "a single string" if isinstance(prompts, str) else f"{len(prompts)} prompts"
        raise ValueError(f"reward {scorer!r}: need one prompt per image ({images.shape[0]}), got {got}")
    low, high = torch.aminmax(images.detach())
    if low.item() < 0.0 or high.item() > 1.0:
        raise ValueError(
            f"reward {scorer!r}: images must be in [0, 1], got values in [{low.item():.3g}, {high.item():.3g}]; "
            "map VAE output in [-1, 1] with (x / 2 + 0.5).clamp(0, 1)"
        )


def require_path(path: str | Path, *, field: str, expected: str, is_dir: bool = False) -> Path:
    """``path`` as a Path, or FileNotFoundError naming the argument ``field``, the file and what belongs there."""
    resolved = Path(path).expanduser()
    present = resolved.is_dir() if is_dir else resolved.is_file()
    if not present:
        kind = "directory" if is_dir else "file"
        raise FileNotFoundError(
            f"{field}: {kind} {str(resolved)!r} does not exist; expected {expected} (see docs/rewards.md)"
        )
    return resolved


def require_any_file(directory: Path, names: Sequence[str], *, field: str, expected: str) -> Path:
    """The first of ``names`` present in ``directory``, or FileNotFoundError naming them all."""
    for name in names:
        if (directory / name).is_file():
            return directory / name
    raise FileNotFoundError(
        f"{field}: {str(directory)!r} holds none of {list(names)}; expected {expected} (see docs/rewards.md)"
    )


def unique_prompts(prompts: Sequence[str]) -> tuple[list[str], Tensor]:
    """Distinct prompts in first-seen order and, per input, its index among them: a GRPO group
    repeats one prompt G times, so the text tower runs once per group."""
    index: dict[str, int] = {}
    inverse = [index.setdefault(prompt, len(index)) for prompt in prompts]
    return list(index), torch.tensor(inverse, dtype=torch.long)


def scorer_class(name: str) -> type[Scorer]:
    """The class registered under ``name`` (its module is imported on first use)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown reward {name!r}; accepted names: {', '.join(SCORER_NAMES)}")
    module_name, class_name = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def build_scorer(name: str, **kwargs: object) -> Scorer:
    """Build the scorer registered under ``name`` with its constructor's keyword arguments."""
    return scorer_class(name)(**kwargs)
