"""The builders of a run, shared by the trainer and every command-line tool.

``build_run`` assembles the run state (``Run``) in a fixed order: seeds, the shared run folder, the
rewards (a wrong reward path fails in seconds, before the transformer loads), the backbone, the
trainable parameters and the KL reference (then sharding), the optimizer, the logger and the router.
``build_evaluator`` gives the trainer its evaluation (train/components/evaluator.py).
``predictor`` turns a backbone (or a reference transformer) into the ``predict(z, t, cond)`` that the
rollout, the update and the evaluation call.
"""

from __future__ import annotations

import copy
import inspect
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from diffusers.loaders.lora_base import LORA_WEIGHT_NAME_SAFE
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from models.base import Backbone, Conditioning, check_image_multiple, parse_dtype
from models.registry import backbone_names, get_backbone_class, load_backbone
from models.tiny import build_tiny
from rewards.base import SCORER_NAMES, Scorer, build_scorer, scorer_class
from rewards.combine import RewardCombiner
from samplers.rollout import Predict
from train.algorithm.routing import AutoRouter, PrefixRouter, Router
from train.algorithm.update_config import Routing
from train.components.checkpoint import CheckpointManager, Weights
from train.components.config import (
    LORA_MODULES,
    ModelConfig,
    TrainConfig,
    UpdateConfig,
    changed_refusal,
    changed_settings,
    resume_settings,
    validate,
)
from train.components.data import PromptRecord, PromptSampler, read_prompts
from train.components.ema import EMA
from train.components.errors import ConfigError, PathError, UserError
from train.components.evaluator import Evaluator, read_result, read_summary
from train.components.logger import RunLogger
from train.components.perf import CompileWatch, FlopMeter, Peak, device_peak
from train.components.run_folder import RunLock, check_one_run, clear_run, held_run
from train.components.summary import eval_tag, heldout_tag
from train.distributed.collectives import DistInfo, broadcast_object, gather_objects, init_distributed, shutdown
from train.distributed.parallelize import compile_blocks, compile_unavailable, mesh_shape, parallelize
from train.distributed.seeds import seed_everything, stream_seed

log = logging.getLogger(__name__)
FIRST_FILES_BYTES = 16 << 20  # free space a new run needs before its model loads (config, logs, metrics)


@dataclass
class Run:
    """Everything a training step needs, built once by ``build_run``."""

    cfg: TrainConfig
    dist: DistInfo
    device: torch.device  # where the transformer, the latents and the rewards live
    backbone: Backbone
    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    ema: EMA | None
    rewards: RewardCombiner
    prompts: PromptSampler
    checkpoints: CheckpointManager
    logger: RunLogger
    reference: nn.Module | None  # frozen copy for the KL term of full fine-tuning; None with LoRA or no KL
    compute_dtype: torch.dtype
    router: Router  # update.routing: which segments train and by which path (train/algorithm/routing.py)
    resume_from: list[Path]  # the checkpoints ``resume`` names that passed the file checks, newest first
    lora_modules: list[str]  # the full names of the modules LoRA wrapped (recorded with each checkpoint)
    flops: FlopMeter  # the FLOPs of the transformer's calls (train/components/perf.py)
    peak: Peak  # one device's peak rate, for perf/mfu/<phase>
    compiles: CompileWatch | None  # model.compile: what compiling costs, step by step


def _missing(tree: Any, name: str = "") -> list[str]:
    """Keys whose value is ``???`` (read without resolving interpolations, which would stop at the first)."""
    if isinstance(tree, dict):
        children = [(f"{name}.{key}" if name else str(key), value) for key, value in tree.items()]
    elif isinstance(tree, list):
        children = [(f"{name}[{i}]", value) for i, value in enumerate(tree)]
    else:
        return [name] if tree == "???" else []
    return [key for child, value in children for key in _missing(value, child)]


def typed_config(cfg: DictConfig) -> TrainConfig:
    """The composed tree as the typed schema; ConfigError naming a ``???`` or unresolvable setting."""
    missing = _missing(OmegaConf.to_container(cfg, resolve=False))
    if missing:  # the experiment leaves them ??? (local paths the user must give)
        raise ConfigError(f"required settings have no value: {', '.join(missing)}; pass each as <key>=<value>")
    try:
        return cast(TrainConfig, OmegaConf.to_object(cfg))
    except OmegaConfBaseException as err:  # e.g. an interpolation that does not resolve
        key = getattr(err, "full_key", None)
        raise ConfigError(f"{key}: {str(err).splitlines()[0]}" if key else str(err).splitlines()[0]) from None
    except ValueError as err:  # a group's own check (its __post_init__) names its field: add the group
        raise ConfigError(f"{_group_of(cfg)}{err}") from None


def _group_of(cfg: DictConfig) -> str:
    """``<group>.`` of the first top-level group of ``cfg`` that does not build ("" if none is found)."""
    for key, node in cfg.items():
        if isinstance(node, DictConfig) and OmegaConf.get_type(node) is not dict:
            try:
                OmegaConf.to_object(node)
            except ValueError:
                return f"{key!s}."
    return ""


def load_config(cfg: DictConfig) -> TrainConfig:
    """The typed config of a composed Hydra tree, validated (no model is loaded).

    An empty ``run_dir`` becomes Hydra's output folder of the job (``hydra.run.dir``, or the sweep job's folder).
    """
    config = typed_config(cfg)
    if not config.run_dir:
        if not HydraConfig.initialized():
            raise ConfigError("run_dir is not set and no Hydra command is running: pass run_dir=<folder>")
        config.run_dir = HydraConfig.get().runtime.output_dir
    validate(config, known_scorers=SCORER_NAMES, known_backbones=tuple(backbone_names()))
    return config


@contextmanager
def process_group(timeout_s: float | None = None) -> Iterator[DistInfo]:
    """torchrun's process group (none for one process) for the duration of a command.

    timeout_s: ``dist.timeout_s``, how long a collective waits for the other ranks.
    """
    dist = init_distributed(timeout_s=timeout_s)
    try:
        yield dist
    finally:
        shutdown()


@contextmanager
def _settings(field_name: str) -> Iterator[None]:
    """A ValueError or FileNotFoundError raised while building from ``field_name``'s values is about them.

    The adapters and scorers check their arguments and name the file or option that is wrong;
    here that becomes the user error it is (its traceback stays on the exception's cause).
    """
    try:
        yield
    except FileNotFoundError as err:
        raise PathError(f"{field_name}: {err}") from err
    except ValueError as err:
        raise ConfigError(f"{field_name}: {err}") from err


def _unwritable(run_dir: Path) -> str | None:
    """Why the run folder or its checkpoints/ cannot be written, or None (tried by creating a file)."""
    for folder in (run_dir, run_dir / "checkpoints"):
        probe = folder / f".write_test_{os.getpid()}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as err:
            return f"cannot write in {folder} ({err.strerror})"
    return None


def _claim(cfg: TrainConfig, *, training: bool) -> RunLock:
    """Rank 0's part of ``claim_folder``; raises the UserError that refuses the folder."""
    run_dir = Path(cfg.run_dir)
    problem = _unwritable(run_dir)
    if problem:
        raise ConfigError(f"run_dir={cfg.run_dir!r}: {problem}; pass a writable hydra.run.dir=<folder>")
    lock = RunLock(run_dir)
    if training:
        check_one_run(run_dir, resume=cfg.resume, overwrite=cfg.checkpoint.overwrite)
    lock.acquire()
    if training and cfg.checkpoint.overwrite and (held := held_run(run_dir)):
        log.warning("checkpoint.overwrite=true: deleting the run in %s (%s)", run_dir, held)
        clear_run(run_dir)
    return lock


def claim_folder(cfg: TrainConfig, dist: DistInfo, *, training: bool) -> RunLock | None:
    """Make the run folder this run's before anything is written there; rank 0's lock (None elsewhere).

    Rank 0 writes the run folder: it must be writable, a training run may not start in a folder that
    holds a run unless it resumes or overwrites it, and no other live process may hold its lock
    (train/components/run_folder.py). Rank 0 tries; every rank gets the verdict.
    """
    lock, refusal = None, None
    if dist.is_main:
        try:
            lock = _claim(cfg, training=training)
        except UserError as err:
            refusal = err
    message = broadcast_object(None if refusal is None else str(refusal))
    if refusal is not None:
        raise refusal
    if message is not None:  # rank 0 prints it (a ConfigError is printed by rank 0 alone)
        raise ConfigError(message)
    if lock is not None:
        lock.start_renewing()
    return lock


def preflight(cfg: TrainConfig, dist: DistInfo, checkpoints: CheckpointManager, *, max_step: int | None) -> list[Path]:
    """The checks of the checkpoints to resume from, before any model loads; returns them, newest first.

    The checkpoints ``resume`` names are checked file by file (``CheckpointManager.usable``); a training
    run must not start from a checkpoint past its last step (``max_step``, num_steps), nor with settings
    that change what the checkpoint's weights mean (``RESUME_SETTINGS``, unless checkpoint.allow_changed).
    """
    found = checkpoints.usable(cfg.resume)
    if max_step is not None:  # before the logger writes: room for a checkpoint like it, else for the first files
        needed = checkpoints.size_of(found[0]) if found else FIRST_FILES_BYTES
        checkpoints.check_space(needed, "a checkpoint of this run")
    if not found and cfg.resume == "auto":
        _starting_again(checkpoints)
    if found and max_step is not None and (step := checkpoints.step_of(found[0])) > max_step:
        raise ConfigError(
            f"resume={cfg.resume}: checkpoint {found[0]} holds step {step}, past "
            f"num_steps={max_step}: set num_steps to at least that to train on, or use a new run folder"
        )
    saved = checkpoints.settings_of(found[0]) if found and max_step is not None else None
    recorded = {key: value for key, value in (saved or {}).items() if key != LORA_MODULES}  # known once LoRA is on
    changed = changed_settings(recorded, resume_settings(cfg), cfg.checkpoint.allow_changed) if saved else []
    if changed:
        raise changed_refusal(cfg.resume, found[0], changed)
    return found


def check_mesh(cfg: TrainConfig, world_size: int) -> None:
    """HSDP's replicate degree divides the world size, before any model loads."""
    try:
        mesh_shape(world_size, cfg.dist.replicate_degree)
    except ValueError as err:
        raise ConfigError(f"{err}: pick a divisor of it, or dist.replicate_degree=1") from None


def _starting_again(checkpoints: CheckpointManager) -> None:
    """resume=auto without a complete checkpoint starts from step 0: say so when that drops work."""
    unfinished = sorted(p.name for p in checkpoints.root.glob("step_*.tmp")) if checkpoints.root.is_dir() else []
    held = held_run(checkpoints.root.parent)
    if unfinished or held:
        log.warning(
            "resume=auto: no complete checkpoint under %s (%s): training starts again from step 0 and the rows "
            "of metrics.jsonl go",
            checkpoints.root,
            ", ".join(unfinished) + " unfinished" if unfinished else held,
        )


def resolve_device(cfg: TrainConfig, dist: DistInfo) -> torch.device:
    if cfg.device == "cpu" or (cfg.device == "auto" and dist.device.type == "cpu"):
        return torch.device("cpu")
    if not torch.cuda.is_available():  # validate() refuses device=cuda without CUDA: device=auto found a GPU rank
        raise ConfigError("device=auto: this rank has no CUDA device; use device=cpu")
    return dist.device


def model_folder(cfg: TrainConfig, dist: DistInfo) -> None:
    """The model's folder, before any model loads: the tiny pipeline built at model.path first if asked
    (model.build_tiny, rank 0), then model.height and model.width checked against what the backbone
    samples (a multiple of its VAE's scale times its 2x2 patches), and with LoRA each of its targets against
    the transformer's module names (peft wraps the modules whose name ends with one), read from the
    folder's config files."""
    if cfg.model.build_tiny is not None:
        if dist.is_main:
            with _settings("model.build_tiny"):
                build_tiny(cfg.model.name, cfg.model.path, size=cfg.model.build_tiny)
        broadcast_object(None)  # the other ranks wait for the folder
    m = cfg.model
    backbone = get_backbone_class(m.name)
    with _settings("model"):  # a component missing from the folder
        multiple = backbone.image_multiple(m.path, **m.options)
        modules = backbone.transformer_modules(m.path, **m.options) if m.lora.enabled else []
    with _settings("model.height / model.width"):
        check_image_multiple(m.name, multiple, m.height, m.width)
    if not m.lora.enabled:
        return
    unmatched = [t for t in lora_targets(m) if not any(n == t or n.endswith(f".{t}") for n in modules)]
    if unmatched:
        raise ConfigError(
            f"model.lora.target_modules: {', '.join(unmatched)} name no module of the transformer in "
            f"{m.path} (a target is a module name or its end, e.g. {modules[-1] if modules else 'attn.to_q'})"
        )


def build_backbone(cfg: TrainConfig, dist: DistInfo, device: torch.device) -> Backbone:
    """Load every component from the local folder (``model_folder`` prepared it).

    Placement policy for the frozen parts: text encoders and VAE are replicated on every rank in
    the model dtype (they run once per step, without gradients, and sharding them would add
    collectives for no memory that matters next to the transformer's optimizer state); with
    ``model.embedding_cache`` the text encoders are not loaded at all. The transformer keeps
    float32 master weights and computes in ``model.dtype`` (FSDP2 mixed precision or autocast).
    """
    with _settings("model"):
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
    problem = non_finite(backbone.transformer)  # they would give a NaN loss and skip every update
    if problem:
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
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
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
    with torch.random.fork_rng(devices=[]), _settings("model.lora.target_modules"):
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
    changed = changed_settings({LORA_MODULES: saved[LORA_MODULES]}, {LORA_MODULES: now}, cfg.checkpoint.allow_changed)
    if changed:
        raise changed_refusal(cfg.resume, resume_from[0], changed)


# FSDP2 warns on every forward with gradients that a sharded block returned a view (diffusers'
# FluxSingleTransformerBlock slices its output into text and image tokens): an in-place op on that view
# would skip the block's pre-backward all-gather. No code of ours writes into a block's output in place,
# (tests/tools/test_plan.py::test_no_path_writes_into_the_views_single_blocks_return checks every update
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


def check_scorer(field_name: str, name: str, kwargs: dict[str, Any]) -> None:
    """The settings under ``field_name`` are arguments scorer ``name`` takes, and the files and folders among
    them (the constructor's parameters typed ``Path``) exist; nothing is built."""
    signature = inspect.signature(scorer_class(name))
    try:
        signature.bind(**kwargs)
    except TypeError as err:
        raise ConfigError(f"{field_name}: {err} (the scorer's arguments are in docs/rewards.md)") from None
    for key, value in kwargs.items():
        parameter = signature.parameters.get(key)
        typed_path = parameter is not None and "Path" in str(parameter.annotation)
        if typed_path and value is not None and not Path(str(value)).expanduser().exists():
            raise PathError(
                f"{field_name}.{key}={str(value)!r} does not exist: point it at the scorer's file or folder "
                "(docs/rewards.md lists them)"
            )


def _reward_arguments(component: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in component.items() if key != "weight"}


def check_scorer_inputs(cfg: TrainConfig) -> None:
    """What the scorers read, checked at start-up before any of them (or the model) loads, rather than when
    each one builds: the rewards' arguments and files, and with an evaluation (logging.eval_every) those of
    eval.scorers (validate() has read the prompt files)."""
    for name, component in cfg.reward.components.items():
        check_scorer(f"reward.components.{name}", name, _reward_arguments(dict(component)))
    if cfg.logging.eval_every:
        check_eval_scorers(cfg)


def check_eval_scorers(cfg: TrainConfig) -> None:
    """``check_scorer`` on each of eval.scorers."""
    for name, kwargs in cfg.eval.scorers.items():
        check_scorer(f"eval.scorers.{name}", name, dict(kwargs))


def _scorer(field_name: str, name: str, kwargs: dict[str, Any], device: torch.device) -> Scorer:
    """Scorer ``name`` built from the settings under ``field_name`` (``check_scorer_inputs`` checked them)."""
    with _settings(field_name):
        return build_scorer(name, **kwargs).to(device)


def adamw_settings(cfg: TrainConfig) -> dict[str, Any]:
    """The optimizer's hyperparameters (grpo.lr, grpo.weight_decay, grpo.betas) as AdamW's keywords."""
    g = cfg.grpo
    return {"lr": g.lr, "weight_decay": g.weight_decay, "betas": (g.betas[0], g.betas[1])}


def build_rewards(cfg: TrainConfig, device: torch.device) -> RewardCombiner:
    """Every reward model is replicated on every rank: scoring is data-parallel and frozen."""
    components = {
        name: (
            _scorer(f"reward.components.{name}", name, _reward_arguments(comp), device),
            float(comp.get("weight", 1.0)),
        )
        for name, comp in cfg.reward.components.items()
    }
    return RewardCombiner(components, mode=cfg.reward.combine)


def build_eval_scorers(cfg: TrainConfig, device: torch.device) -> dict[str, Scorer]:
    """The evaluation metrics of ``eval.scorers`` (name -> constructor arguments)."""
    return {
        name: _scorer(f"eval.scorers.{name}", name, dict(kwargs), device) for name, kwargs in cfg.eval.scorers.items()
    }


def read_eval_prompts(cfg: TrainConfig) -> list[PromptRecord]:
    """``data.eval_prompts`` (or the training prompts), cut to ``data.num_eval_prompts`` when set, each
    ``eval.samples_per_prompt`` times (item j * n + i is sample j of prompt i: its own noise)."""
    records = read_prompts(cfg.data.eval_prompts or cfg.data.train_prompts, field_name="data.eval_prompts")
    return records[: cfg.data.num_eval_prompts or None] * cfg.eval.samples_per_prompt


def read_heldout_prompts(cfg: TrainConfig) -> list[PromptRecord]:
    """``data.heldout_prompts`` (none when unset), each ``eval.samples_per_prompt`` times."""
    if cfg.data.heldout_prompts is None:
        return []
    return read_prompts(cfg.data.heldout_prompts, field_name="data.heldout_prompts") * cfg.eval.samples_per_prompt


def build_evaluator(run: Run, *, start: int) -> Evaluator | None:
    """The trainer's evaluation for a session that starts at step ``start``, or None when it would
    evaluate nothing (logging.eval_every=0, or no step left). A resumed session's rank 0 reads the
    step-0 result back from the run folder, for its comparisons."""
    cfg = run.cfg
    if not cfg.logging.eval_every or start == cfg.num_steps:
        return None
    records, heldout = read_eval_prompts(cfg), read_heldout_prompts(cfg)
    resumed = start > 0 and run.dist.is_main
    folder = Path(cfg.run_dir) / "eval"
    return Evaluator(
        cfg=cfg,
        dist=run.dist,
        device=run.device,
        backbone=run.backbone,
        predict=policy_predictor(run),
        ema=run.ema,
        logger=run.logger,
        scorers=build_eval_scorers(cfg, run.device),
        records=records,
        heldout=heldout,
        before=read_result(folder, eval_tag(0)) if resumed else None,
        heldout_before=read_summary(folder, heldout_tag(0)) if resumed and heldout else None,
    )


def predictor(
    backbone: Backbone,
    *,
    compute_dtype: torch.dtype,
    world_size: int,
    device: torch.device,
    transformer: nn.Module | None = None,
    flops: FlopMeter | None = None,
) -> Predict:
    """predict(z, t, cond) with the backbone's transformer, or with ``transformer`` (the reference);
    each call counted by ``flops`` when given.

    Single-process runs compute in ``compute_dtype`` by autocast over float32 master weights;
    under FSDP2 the mixed-precision policy does it.
    """
    wanted = compute_dtype != torch.float32 and world_size == 1

    def predict(z: Tensor, t: Tensor, cond: Conditioning) -> Tensor:
        if flops is not None:
            flops.count(z, t, cond)
        with torch.autocast(device.type, dtype=compute_dtype) if wanted else nullcontext():
            return backbone.predict(z, t, cond, transformer=transformer)

    return predict


def policy_predictor(run: Run, transformer: nn.Module | None = None) -> Predict:
    return predictor(
        run.backbone,
        compute_dtype=run.compute_dtype,
        world_size=run.dist.world_size,
        device=run.device,
        transformer=transformer,
        flops=run.flops,
    )


def reference_predictor(run: Run) -> Predict | None:
    """The KL reference of the run (``kl_reference``); None without a KL term."""
    if run.cfg.grpo.kl_beta == 0:
        return None
    return kl_reference(run.backbone, run.reference, lambda transformer=None: policy_predictor(run, transformer))


def kl_reference(backbone: Backbone, reference: nn.Module | None, policy: Callable[..., Predict]) -> Predict:
    """The KL reference: the frozen copy ``reference`` of full fine-tuning, else the LoRA-disabled
    policy. ``policy(transformer=None)``: the predictor of the backbone's transformer, or of another."""
    if reference is not None:
        return policy(reference)
    lora = policy()
    transformer: Any = backbone.transformer  # diffusers' PEFT mixin: enable/disable_adapters

    def predict(z: Tensor, t: Tensor, cond: Conditioning) -> Tensor:
        transformer.disable_adapters()
        try:
            return lora(z, t, cond)
        finally:
            transformer.enable_adapters()

    return predict


def build_ema(params: list[nn.Parameter], decay: float) -> EMA | None:
    """The EMA of ``params`` (grpo.ema_decay); None when the decay is 0."""
    return EMA(params, decay) if decay > 0 else None


def build_run(cfg: TrainConfig, dist: DistInfo, *, training: bool = True) -> Run:
    """The run state in the claimed run folder; ``training``: refuse a checkpoint past num_steps or of
    other settings (the probe only measures one)."""
    seed_everything(cfg.seed, dist.rank)
    run_dir = Path(cfg.run_dir)
    checkpoints = CheckpointManager(run_dir, keep_last=cfg.checkpoint.keep_last)
    resume_from = preflight(cfg, dist, checkpoints, max_step=cfg.num_steps if training else None)
    check_mesh(cfg, dist.world_size)
    device = resolve_device(cfg, dist)
    records = read_prompts(cfg.data.train_prompts)
    if cfg.model.compile and (why := compile_unavailable(device.type)):
        raise ConfigError(f"model.compile=true: {why}; or set model.compile=false")
    check_scorer_inputs(cfg)
    model_folder(cfg, dist)
    rewards = build_rewards(cfg, device)  # before the transformer: a wrong reward path fails in seconds
    backbone = build_backbone(cfg, dist, device)
    reference = add_trainable(cfg, backbone)
    wrapped = lora_modules(backbone.transformer)
    if training:  # before the checkpoint loads by those names
        check_lora_modules(cfg, checkpoints, resume_from, wrapped)
    flops = FlopMeter(backbone)  # of the eager model: before checkpointing, compilation and sharding wrap it
    params, reference = shard_trainable(cfg, backbone, reference)
    if cfg.model.compile:
        compile_blocks(backbone.decoder_units())  # the rollout's and the evaluation's decode
    g = cfg.grpo
    optimizer = torch.optim.AdamW(params, **adamw_settings(cfg))
    lg = cfg.logging
    logger = RunLogger(
        run_dir,
        is_main=dist.is_main,
        wandb_mode=lg.wandb_mode,
        project=lg.project,
        entity=lg.entity,
        group=lg.group or cfg.experiment,
        name=lg.name or f"{cfg.experiment}-{cfg.update.mode}-s{cfg.seed}",
        tags=list(dict.fromkeys([cfg.update.mode, f"seed{cfg.seed}", cfg.sampler.sde, *lg.tags])),
        notes=lg.notes,
        config=cast(dict[str, Any], OmegaConf.to_container(OmegaConf.structured(cfg), enum_to_str=True)),
        resumed=bool(resume_from),
    )
    return Run(
        cfg=cfg,
        dist=dist,
        device=device,
        backbone=backbone,
        params=params,
        optimizer=optimizer,
        ema=build_ema(params, g.ema_decay),
        rewards=rewards,
        prompts=PromptSampler(
            records, seed=cfg.seed, rank=dist.rank, world_size=dist.world_size, prompts_per_rank=g.prompts_per_rank
        ),
        checkpoints=checkpoints,
        logger=logger,
        reference=reference,
        compute_dtype=parse_dtype(cfg.model.dtype),
        router=build_router(cfg.update),
        resume_from=resume_from,
        lora_modules=wrapped,
        flops=flops,
        peak=device_peak(cfg.perf.peak_tflops, device),
        compiles=CompileWatch() if cfg.model.compile else None,
    )


@contextmanager
def open_run(cfg: TrainConfig, dist: DistInfo, *, training: bool = True) -> Iterator[Run]:
    """``build_run`` in the run folder claimed for it; the logger finished and the lock released however
    the block ends."""
    cfg.run_dir = str(broadcast_object(cfg.run_dir))  # every rank writes where rank 0 does
    lock = claim_folder(cfg, dist, training=training)
    try:
        run = build_run(cfg, dist, training=training)
        try:
            yield run
        finally:
            run.logger.finish()
    finally:
        if lock is not None:
            lock.release()


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


def build_router(update: UpdateConfig) -> Router:
    """The router ``update.routing`` names."""
    u = update
    if u.routing is Routing.auto:
        return AutoRouter(
            mode=u.mode,
            segment_length=u.segment_length,
            timestep_fraction=u.timestep_fraction,
            every=u.auto_every,
            threshold=u.auto_threshold,
            num_rollouts=u.auto_rollouts,
        )
    return PrefixRouter(
        mode=u.mode, segment_length=u.segment_length, timestep_fraction=u.timestep_fraction, jagg_frac=u.jagg_frac
    )
