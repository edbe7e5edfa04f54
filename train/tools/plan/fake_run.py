"""The parts of a run that one training step uses, on fake tensors, built by the trainer's own code where it
loads no weights: ``train.parts.policy.builder.setup_trainable`` (LoRA or full fine-tuning, the KL reference,
activation checkpointing, FSDP2), AdamW stepping each rank's local shards, the EMA."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from models.base import parse_dtype
from models.diffusers_backbone import DiffusersBackbone
from samplers.rollout import Predict
from train.distributed.parallelize import local_tensor
from train.loop.passes import step_weights
from train.parts.config.schema import TrainConfig
from train.parts.optim.ema import EMA
from train.parts.optim.optimizer import adamw_settings, build_ema
from train.parts.policy.builder import setup_trainable
from train.parts.policy.predict import kl_reference, predictor
from train.tools.plan.fake import default_dtype, fake_deepcopy
from train.tools.plan.frozen import build_component, diffusers_backbone_class, read_json
from train.tools.plan.plan_config import PlanRunConfig

CPU = torch.device("cpu")  # the one device of every fake tensor


class LocalShardAdamW(torch.optim.AdamW):
    """The trainer's AdamW (``train.parts.optim.optimizer.adamw_settings``) stepping each rank's local shards.

    DTensor runs an optimizer's foreach kernels on the local shards; the planner runs them there
    directly, because DTensor's sharding propagation of foreach ops over a thousand parameters costs
    minutes of CPU. Foreach, as PyTorch picks on CUDA: its temporaries span every parameter at once.
    ``step`` takes each parameter's gradient shard; ``zero_grad`` drops both.
    """

    def __init__(self, params: Sequence[nn.Parameter], **kwargs: Any) -> None:
        self.sharded = list(params)
        with torch.no_grad():
            shards = [local_tensor(p) for p in self.sharded]
        super().__init__(shards, foreach=True, **kwargs)

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        shards = [p for group in self.param_groups for p in group["params"]]
        with torch.no_grad():
            for p, shard in zip(self.sharded, shards, strict=True):
                shard.grad = None if p.grad is None else local_tensor(p.grad)
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for p in self.sharded:
            p.grad = None


def meta_backbone(cfg: TrainConfig, arch: Path) -> DiffusersBackbone:
    """The adapter around a float32 transformer (the trainer's master weights) and the VAE in model.dtype.

    The transformer is built on the meta device and materialized by ``traced_run`` after sharding,
    as FSDP2 expects for large models: under a fake mode a module cannot be moved or cast once built
    (peft casts its LoRA layers to the base layer's device and dtype, and skips meta ones).
    """
    backbone_cls = diffusers_backbone_class(cfg.model.name)
    loaders = {c.name: c for c in backbone_cls.components}
    configs_ = {name: read_json(arch / name / loaders[name].config_file) for name in ("transformer", "vae")}
    with torch.device("meta"):
        transformer = build_component(loaders["transformer"].loader, configs_["transformer"])
    with default_dtype(parse_dtype(cfg.model.dtype)):
        vae = build_component(loaders["vae"].loader, configs_["vae"])
    modules = {"transformer": transformer, "vae": vae.eval().requires_grad_(False)}
    return backbone_cls(modules, configs_, {}, dtype=parse_dtype(cfg.model.dtype), **cfg.model.options)  # type: ignore[abstract]


def hold_gradients(run: TracedRun) -> None:
    """A gradient on every trainable parameter, as the update of a later micro-batch finds them
    (FSDP2 adds its reduce-scattered gradient to them)."""
    for p in run.params:
        p.grad = torch.zeros_like(p)


@dataclass
class TracedRun:
    """The parts of a run that one training step uses, on fake tensors (the trainer's ``Run`` also
    holds rewards, prompts, checkpoints and a logger, which the planner neither builds nor traces)."""

    cfg: PlanRunConfig
    backbone: DiffusersBackbone
    params: list[nn.Parameter]
    optimizer: LocalShardAdamW
    ema: EMA | None
    reference: nn.Module | None  # the frozen KL reference of full fine-tuning

    def policy(self, transformer: nn.Module | None = None) -> Predict:
        """The trainer's predictor of the policy (or of ``transformer``) on the run's world size."""
        dtype = parse_dtype(self.cfg.model.dtype)
        world_size = self.cfg.plan.world_size
        return predictor(self.backbone, compute_dtype=dtype, world_size=world_size, device=CPU, transformer=transformer)

    def kl_reference(self) -> Predict | None:
        return None if self.cfg.grpo.kl_beta == 0 else kl_reference(self.backbone, self.reference, self.policy)


def traced_run(cfg: PlanRunConfig, arch: Path) -> TracedRun:
    """The run's parts on fake tensors, built by the trainer's own code where it loads no weights:
    ``train.parts.policy.builder.setup_trainable`` (LoRA or full fine-tuning, the KL reference, activation
    checkpointing, FSDP2 through ``parallelize``), AdamW with the run's settings and its state as after
    a first step, the EMA."""
    backbone = meta_backbone(cfg, arch)
    eager = replace(cfg, model=replace(cfg.model, compile=False))  # the planner traces the eager model
    with fake_deepcopy(), torch.device("meta"):  # LoRA layers too: peft skips moving meta adapters
        _, reference = setup_trainable(eager, backbone)
    for module in (backbone.transformer, reference):
        if module is not None:
            module.to_empty(device=CPU)
    params = [p for p in backbone.transformer.parameters() if p.requires_grad]  # to_empty replaced them
    optimizer = LocalShardAdamW(params, **adamw_settings(cfg.optimizer))
    run = TracedRun(cfg, backbone, params, optimizer, build_ema(params, cfg.ema), reference)
    hold_gradients(run)
    step_weights(run.optimizer, run.ema)  # the moments exist from the first step on
    run.optimizer.zero_grad(set_to_none=True)
    return run


def reference_shards(run: TracedRun) -> list[Tensor]:
    """The KL reference's local shards: a second FSDP root, which the policy's tracker counts as inputs."""
    return [] if run.reference is None else [local_tensor(p) for p in run.reference.parameters()]


def ema_shards(run: TracedRun) -> list[Tensor]:
    """The EMA's float32 local shards (held by no module or optimizer: counted as inputs)."""
    return [] if run.ema is None else [local_tensor(s) for s in run.ema.shadow]
