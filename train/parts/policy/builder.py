"""The builders of the model side of a run: the backbone from its local folder (checked first), LoRA or
full fine-tuning, the KL reference and sharding; and for ``python -m train.eval`` the pretrained backbone
with trained weights loaded into it."""

from __future__ import annotations

import copy
import warnings
from dataclasses import fields
from functools import partial
from pathlib import Path
from typing import Any

import torch
from diffusers.loaders.lora_base import LORA_WEIGHT_NAME_SAFE
from torch import Tensor, nn

from models.base import Backbone, check_image_multiple, parse_dtype
from models.model_config import ModelConfig, TinySize
from models.registry import get_backbone_class, load_backbone
from models.tiny import build_tiny
from samplers.rollout import Predict
from train.distributed.collectives import DistInfo, gather_objects, main_decides
from train.distributed.parallelize import compile_blocks, local_tensor, parallelize
from train.distributed.seeds import stream_seed
from train.ground.errors import ConfigError, config_key
from train.parts.checkpoint.export import Weights
from train.parts.checkpoint.manager import CheckpointManager
from train.parts.checkpoint.settings import LORA_MODULES, change, changed_refusal, covered
from train.parts.config.schema import Device, TrainConfig
from train.parts.observe.perf import FlopMeter
from train.parts.policy.parts import ModelParts
from train.parts.policy.predict import kl_reference, predictor

MODEL_FIELDS = [f.name for f in fields(ModelConfig)]  # the words of the model's own messages (config_key)


def model_folder(cfg: TrainConfig, dist: DistInfo) -> nn.Module:
    """The model's folder, before any model loads: the tiny pipeline built at model.path first if asked
    (model.build_tiny, rank 0), then model.height and model.width checked against what the backbone
    samples (a multiple of its VAE's scale times its 2x2 patches), and with LoRA each of its targets against
    the transformer's module names (peft wraps the modules whose name ends with one), read from the
    folder's config files. Returns the transformer's skeleton (on the meta device)."""
    if cfg.model.build_tiny is not None:  # the other ranks wait for the folder, and stop with rank 0 if it fails
        size = cfg.model.build_tiny
        main_decides(dist, lambda: _build_tiny(cfg.model, size))
    m = cfg.model
    backbone = get_backbone_class(m.name)
    with config_key("model", MODEL_FIELDS):  # a component missing from the folder
        multiple = backbone.image_multiple(m.path, **m.options)
        skeleton = backbone.transformer_skeleton(m.path, **m.options)
    with config_key("model.height / model.width"):
        check_image_multiple(m.name, multiple, m.height, m.width)
    modules = [name for name, _ in skeleton.named_modules()]
    unmatched = [t for t in lora_targets(m) if not any(_wraps(t, n) for n in modules)] if m.lora.enabled else []
    if unmatched:
        raise ConfigError(
            f"model.lora.target_modules: {', '.join(unmatched)} name no module of the transformer in "
            f"{m.path} (a target is a module name or its end, e.g. {modules[-1] if modules else 'attn.to_q'})"
        )
    return skeleton


def _build_tiny(model: ModelConfig, size: TinySize) -> None:
    with config_key("model.build_tiny"):
        build_tiny(model.name, model.path, size=size)


def _wraps(target: str, name: str) -> bool:
    """peft wraps the module ``name`` for the target ``target``: the name or its end."""
    return name == target or name.endswith(f".{target}")


def checkpoint_size(cfg: TrainConfig, skeleton: nn.Module) -> tuple[int, str]:
    """About the bytes of a checkpoint of this run, before the model loads, and what they hold: the transformer's
    float32 weights (the master copy), and AdamW's two moments and the EMA (ema.decay > 0) of the trained ones (LoRA:
    its adapters, rank x (in + out) per wrapped Linear), from the shapes of the transformer's ``skeleton``."""
    weights = sum(p.numel() for p in skeleton.parameters())
    trained, adapters = weights, 0
    if cfg.model.lora.enabled:
        wrapped = [
            module
            for name, module in skeleton.named_modules()
            if isinstance(module, nn.Linear) and any(_wraps(t, name) for t in lora_targets(cfg.model))
        ]
        trained = adapters = sum(cfg.model.lora.rank * (m.in_features + m.out_features) for m in wrapped)
    copies = 2 + (cfg.ema.decay > 0)
    what = f"{weights / 1e6:.1f} M float32 weights, AdamW's 2 moments{' and the EMA' if cfg.ema.decay > 0 else ''}"
    return 4 * (weights + adapters + copies * trained), f"{what} of {trained / 1e6:.1f} M trained"


def check_room(cfg: TrainConfig, checkpoints: CheckpointManager, skeleton: nn.Module) -> None:
    """A new run: DiskFull unless the disk has room for its first checkpoint (``checkpoint_size``), before the
    model loads (a collective)."""
    size, held = checkpoint_size(cfg, skeleton)
    checkpoints.check_space(size, f"a checkpoint of this run ({held})")


def build_backbone(cfg: TrainConfig, dist: DistInfo, device: torch.device) -> Backbone:
    """Load every component from the local folder (``model_folder`` prepared it).

    Placement policy for the frozen parts: text encoders and VAE are replicated on every rank in
    the model dtype (they run once per step, without gradients, and sharding them would add
    collectives for no memory that matters next to the transformer's optimizer state); with
    ``model.embedding_cache`` the text encoders are not loaded at all. The transformer keeps
    float32 master weights and computes in ``model.dtype`` (FSDP2 mixed precision or autocast).
    """
    with config_key("model", MODEL_FIELDS):
        backbone = load_backbone(
            cfg.model.name,
            cfg.model.path,
            dtype=parse_dtype(cfg.model.dtype),
            device=device,
            embedding_cache=cfg.model.embedding_cache,
            **cfg.model.options,
        )
    if next(backbone.transformer.parameters()).dtype != torch.float32:  # float32 master weights
        backbone.transformer.to(torch.float32)
    if problem := non_finite(backbone.transformer):  # they would give a NaN loss and skip every update
        raise ConfigError(
            f"model.path={cfg.model.path!r}: the transformer's weights hold {problem}: they are damaged; "
            "point model.path at an intact copy"
        )
    return backbone


def non_finite(module: nn.Module) -> str | None:
    """ "<n> NaN or inf values (the first in <parameter>)" among ``module``'s weights on some rank, or None.

    A collective: the ranks' shards (or replicas) are checked, every rank gets the same verdict.
    """
    count, first = 0, None
    for name, tensor in module.state_dict().items():
        local = local_tensor(tensor)
        if isinstance(local, Tensor) and local.is_floating_point():
            bad = int((~torch.isfinite(local)).sum())
            count, first = count + bad, first or (name if bad else None)
    for rank_count, rank_first in gather_objects((count, first)):
        if rank_count:
            return f"{rank_count} NaN or inf values (the first in {rank_first})"
    return None


def lora_targets(m: ModelConfig) -> list[str]:
    """The module-name suffixes LoRA wraps: ``model.lora.target_modules``, else the backbone's own."""
    return list(m.lora.target_modules) or get_backbone_class(m.name).lora_target_modules


def add_lora(cfg: TrainConfig, backbone: Backbone) -> None:
    """LoRA adapters of ``model.lora`` on the transformer (the only trainable parameters afterwards): on the
    modules ``model.lora.target_modules`` names, else on the backbone's own ``lora_target_modules``."""
    from peft import LoraConfig  # only LoRA runs pay for importing peft

    transformer: Any = backbone.transformer  # a diffusers model: its PEFT mixin adds the adapters
    lora = cfg.model.lora
    # peft draws the adapters from the global RNG, which differs per rank; FSDP2 keeps each rank's
    # shard of its own draw. One stream for every rank gives the same weights on any world size.
    with torch.random.fork_rng(devices=[]), config_key("model.lora.target_modules"):
        torch.manual_seed(stream_seed(cfg.seed, "model_init"))
        transformer.add_adapter(
            LoraConfig(
                r=lora.rank,
                lora_alpha=lora.alpha,
                init_lora_weights=lora.init,  # type: ignore[arg-type]  # a config string; peft checks it
                target_modules=lora_targets(cfg.model),
            )
        )


def lora_modules(transformer: nn.Module) -> list[str]:
    """The full names of the modules LoRA wrapped (none for full fine-tuning), before sharding wraps them."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [name for name, module in transformer.named_modules() if isinstance(module, BaseTunerLayer)]


def check_lora_modules(
    cfg: TrainConfig, checkpoints: CheckpointManager, resume_from: list[Path], now: list[str]
) -> None:
    """The checkpoint to resume from wrapped the modules LoRA wraps now (unless checkpoint.allow_changed names
    model.lora.modules): its adapters' weights load by these names."""
    saved = checkpoints.settings_of(resume_from[0]) if resume_from else None
    if not saved or LORA_MODULES not in saved:  # nothing to resume, or saved before the modules were recorded
        return
    if saved[LORA_MODULES] != now and not covered(LORA_MODULES, cfg.checkpoint.allow_changed):
        raise changed_refusal(cfg.resume, resume_from[0], [change(LORA_MODULES, saved[LORA_MODULES], now)])


# FSDP2 warns on every forward with gradients that a sharded block returned a view (diffusers'
# FluxSingleTransformerBlock slices its output into text and image tokens): an in-place op on that view
# would skip the block's pre-backward all-gather. No code of ours writes into a block's output in place,
# (tests/tools/test_plan_trace.py::test_no_path_writes_into_the_views_single_blocks_return checks every update
# path), and tests/e2e/test_trainer.py::test_two_ranks_log_and_train_as_one_process shows that 2 FSDP2 ranks
# log every metric and export the weights of 1 process (no shard, no hook). So exactly that warning goes.
FSDP_VIEW_WARNING = r"FSDP2-wrapped module \(.*\) returned a view tensor"


def setup_trainable(cfg: TrainConfig, backbone: Backbone) -> tuple[list[nn.Parameter], nn.Module | None]:
    """LoRA or full fine-tuning, the KL reference, then sharding (in that order): the trainable
    parameters and the reference."""
    reference = add_trainable(cfg, backbone)
    return shard_trainable(cfg, backbone, reference)


def add_trainable(cfg: TrainConfig, backbone: Backbone) -> nn.Module | None:
    """LoRA adapters or every weight made trainable; returns the KL reference of full fine-tuning."""
    transformer = backbone.transformer
    transformer.requires_grad_(False)
    reference = None
    if cfg.model.lora.enabled:
        add_lora(cfg, backbone)
    else:
        transformer.requires_grad_(True)
        if cfg.grpo.kl_beta > 0:  # full fine-tuning: the reference is a frozen copy of the start
            reference = copy.deepcopy(transformer).requires_grad_(False).eval()
    transformer.train()
    return reference


def shard_trainable(
    cfg: TrainConfig, backbone: Backbone, reference: nn.Module | None
) -> tuple[list[nn.Parameter], nn.Module | None]:
    """``parallelize`` the transformer and the reference (checkpointing the transformer's blocks,
    compiling both with ``model.compile``); the trainable parameters and the reference."""
    transformer = backbone.transformer
    compute = parse_dtype(cfg.model.dtype)
    warnings.filterwarnings("ignore", message=FSDP_VIEW_WARNING, category=UserWarning)
    for module in (transformer, reference):
        if module is not None:
            parallelize(
                module,
                block_classes=backbone.block_classes,
                param_dtype=compute,
                activation_checkpointing=cfg.model.activation_checkpointing and module is transformer,
                replicate=cfg.dist.replicate_degree,
                compile=cfg.model.compile,
            )
    return [p for p in transformer.parameters() if p.requires_grad], reference


def build_model(
    cfg: TrainConfig,
    dist: DistInfo,
    device: torch.device,
    *,
    lora_checkpoint: tuple[CheckpointManager, list[Path]] | None = None,
) -> tuple[ModelParts, FlopMeter]:
    """The model parts of a run (``model_folder`` prepared the folder): the backbone, LoRA or full
    fine-tuning and the KL reference, sharding, the compiled decode, and the predictors, each call counted
    by the returned FLOP meter. ``lora_checkpoint``: the checkpoints and the ones to resume from, whose
    LoRA modules must be those wrapped now (``check_lora_modules``), checked before anything loads them."""
    backbone = build_backbone(cfg, dist, device)
    reference = add_trainable(cfg, backbone)
    wrapped = lora_modules(backbone.transformer)
    if lora_checkpoint is not None:  # before the checkpoint loads by those names
        check_lora_modules(cfg, *lora_checkpoint, wrapped)
    flops = FlopMeter(backbone)  # of the eager model: before checkpointing, compilation and sharding wrap it
    params, reference = shard_trainable(cfg, backbone, reference)
    if cfg.model.compile:
        compile_blocks(backbone.decoder_units())  # the rollout's and the evaluation's decode
    compute_dtype = parse_dtype(cfg.model.dtype)
    # the policy's predictor of the backbone's transformer, or of another (the KL reference's), calls counted
    policy = partial(
        predictor, backbone, compute_dtype=compute_dtype, world_size=dist.world_size, device=device, flops=flops
    )
    kl = kl_reference(backbone, reference, policy) if cfg.grpo.kl_beta != 0 else None
    model = ModelParts(backbone, params, reference, compute_dtype, wrapped, policy=policy(), kl_reference=kl)
    return model, flops


def build_for_eval(cfg: TrainConfig, dist: DistInfo) -> tuple[Backbone, Predict, torch.device]:
    """The pretrained backbone in evaluation mode, its predictor and its device (``load_weights`` then
    puts trained weights in; the predictor follows ``backbone.transformer``)."""
    device = resolve_device(cfg, dist)
    model_folder(cfg, dist)
    backbone = build_backbone(cfg, dist, device)
    backbone.transformer.eval()
    predict = predictor(backbone, compute_dtype=parse_dtype(cfg.model.dtype), world_size=dist.world_size, device=device)
    return backbone, predict, device


def load_weights(cfg: TrainConfig, backbone: Backbone, weights: Weights, device: torch.device) -> None:
    """Trained weights into ``backbone.transformer``: a full export replaces it, a LoRA export adds its
    adapter, a training checkpoint loads its model state (into LoRA adapters of ``model.lora`` first
    when the run trained LoRA)."""
    transformer: Any = backbone.transformer  # a diffusers model (from_pretrained, PEFT mixin)
    if weights.kind == "export":
        backbone.transformer = type(transformer).from_pretrained(weights.path, torch_dtype=torch.float32).to(device)
    elif weights.kind == "lora_export":
        transformer.load_lora_adapter(str(weights.path), prefix="transformer", weight_name=LORA_WEIGHT_NAME_SAFE)
    else:
        if cfg.model.lora.enabled:
            add_lora(cfg, backbone)
        CheckpointManager(weights.path.parent.parent).load(weights.path, model=backbone.transformer, optimizer=None)
    backbone.transformer.eval()


def resolve_device(cfg: TrainConfig, dist: DistInfo) -> torch.device:
    if cfg.device is Device.cpu or (cfg.device is Device.auto and dist.device.type == "cpu"):
        return torch.device("cpu")
    if not torch.cuda.is_available():  # validate() refuses device=cuda without CUDA: device=auto found a GPU rank
        raise ConfigError("device=auto: this rank has no CUDA device; use device=cpu")
    return dist.device
