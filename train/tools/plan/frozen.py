"""The frozen models every rank replicates (text encoders, VAE, reward and evaluation scorers),
counted from their architecture configs: built on the meta device, never loaded."""

from __future__ import annotations

import inspect
import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from diffusers import ModelMixin
from torch import nn

from models.base import parse_dtype
from models.diffusers_backbone import DiffusersBackbone
from models.registry import get_backbone_class
from rewards.base import FrozenModelScorer, scorer_class
from train.ground.errors import ConfigError, config_key
from train.parts.config.schema import TrainConfig
from train.parts.config.shipped import shipped
from train.tools.plan.reward import scorer_flops

ARCH_ROOT = shipped("configs/arch")


NOT_READ = "<not read by the planner>"  # stands in for the required paths the planner never opens


# Model-based scorers: their architecture (a shipped CLIPModel config, ImageReward's med_config.json with its
# ViT-L/16, or open_clip's own for HPSv2), used unless the scorer's own config file is there (model_path's
# config.json, med_config). The other scorers hold no weights.
SCORER_ARCH = {
    "clipscore": "clip-vit-large-patch14", "pickscore": "pickscore", "imagereward": "imagereward", "hpsv2": None
}  # fmt: skip


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def diffusers_backbone_class(name: str) -> type[DiffusersBackbone]:
    """The adapter class of backbone ``name`` (both shipped adapters are diffusers pipelines)."""
    cls = get_backbone_class(name)
    if not issubclass(cls, DiffusersBackbone):
        raise ConfigError(f"model.name={name!r}: the planner knows diffusers backbones only, not {cls.__name__}")
    return cls


@dataclass(frozen=True)
class FrozenModel:
    """A model every rank holds whole, in the dtype it is placed in."""

    role: str  # text encoder | VAE | reward | eval scorer
    name: str
    num_params: int
    num_bytes: int  # parameters and buffers
    flops: float | None = None  # rewards: the forward on one image and prompt (reward.py), None: not counted


def module_bytes(module: nn.Module, dtype: torch.dtype) -> int:
    """Bytes of ``module``'s parameters and buffers once cast to ``dtype`` (integer buffers keep theirs)."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * (dtype.itemsize if t.is_floating_point() else t.dtype.itemsize) for t in tensors)


def build_component(loader: Any, config: dict[str, Any]) -> nn.Module:
    """A diffusers or transformers model of class ``loader`` from its config (call under a device
    or fake mode: the weights are random)."""
    if isinstance(loader, type) and issubclass(loader, ModelMixin):
        return loader.from_config(config)
    return loader(loader.config_class.from_dict(config))


def _frozen(role: str, name: str, module: nn.Module, dtype: torch.dtype) -> FrozenModel:
    return FrozenModel(role, name, sum(p.numel() for p in module.parameters()), module_bytes(module, dtype))


def backbone_frozen(cfg: TrainConfig, arch: Path) -> list[FrozenModel]:
    """The VAE and (without an embedding cache) the text encoders, in model.dtype as the trainer loads them."""
    backbone_cls = diffusers_backbone_class(cfg.model.name)
    dtype = parse_dtype(cfg.model.dtype)
    skipped = set(backbone_cls.text_components) if cfg.model.embedding_cache is not None else set()
    out = []
    for comp in backbone_cls.components:
        if not comp.is_module or comp.name == "transformer" or comp.name in skipped:
            continue
        role = "text encoder" if comp.name in backbone_cls.text_components else "VAE"
        with torch.device("meta"):
            module = build_component(comp.loader, read_json(arch / comp.name / comp.config_file))
        out.append(_frozen(role, comp.name, module, dtype))
    return out


def scorer_module(name: str, args: dict[str, Any]) -> nn.Module | None:
    """The architecture of scorer ``name`` on the meta device (None for a scorer without weights)."""
    if not issubclass(scorer_class(name), FrozenModelScorer):  # no weights (JPEG size, shape alignment)
        return None
    if name not in SCORER_ARCH:
        raise ConfigError(f"reward {name!r}: the planner does not know its architecture; known: {sorted(SCORER_ARCH)}")
    with torch.device("meta"):
        if name == "hpsv2":
            return _open_clip_module(args)
        if name == "imagereward":
            return _imagereward_module(args)
        from transformers import CLIPModel

        own = Path(str(args.get("model_path", NOT_READ))) / "config.json"
        return build_component(CLIPModel, read_json(_own_or_shipped(own, name, "config.json")))


def _own_or_shipped(own: Any, name: str, file_name: str) -> Path:
    """The scorer's own config file ``own`` if present, else the shipped ``file_name`` of scorer ``name``."""
    path = Path(str(own if own is not None else NOT_READ))
    return path if path.is_file() else ARCH_ROOT / str(SCORER_ARCH[name]) / file_name


def _open_clip_module(args: dict[str, Any]) -> nn.Module:
    import open_clip

    from rewards.hpsv2 import register_arch

    # open_clip logs "No pretrained weights loaded" as a warning: none are wanted here
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        return open_clip.create_model(register_arch(args.get("arch", _default("hpsv2", "arch"))), device="meta")
    finally:
        logging.disable(previous)


def _imagereward_module(args: dict[str, Any]) -> nn.Module:
    from rewards.imagereward import build_model

    vision = args.get("vision_config")
    med_config = _own_or_shipped(args.get("med_config"), "imagereward", "med_config.json")
    return build_model(med_config, None if vision is None else Path(str(vision)))


def _default(name: str, arg: str) -> Any:
    """The default of scorer ``name``'s constructor argument ``arg``."""
    return inspect.signature(scorer_class(name)).parameters[arg].default


def scorers_frozen(role: str, scorers: dict[str, dict]) -> list[FrozenModel]:
    out = []
    for name, args in scorers.items():
        module = scorer_module(name, args)
        if module is not None:
            with config_key(f"{role}.{name}", ["dtype"]):
                dtype = parse_dtype(args.get("dtype", _default(name, "dtype")))
            flops = scorer_flops(module) if role == "reward" else None
            out.append(replace(_frozen(role, name, module, dtype), flops=flops))
    return out


def frozen_models(cfg: TrainConfig, arch: Path) -> list[FrozenModel]:
    rewards = {name: {k: v for k, v in comp.items() if k != "weight"} for name, comp in cfg.reward.components.items()}
    out = backbone_frozen(cfg, arch) + scorers_frozen("reward", rewards)
    if cfg.eval.every:  # built on the first evaluation and kept for the rest of the run
        out += scorers_frozen("eval scorer", dict(cfg.eval.scorers))
    return out
