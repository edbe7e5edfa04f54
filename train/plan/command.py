"""``python -m train.plan [overrides]``: per-rank memory and FLOPs of one full-size training step, on CPU.

Nothing is allocated and no weight is read. The transformer is built from its architecture config
(``configs/arch/<model>/transformer/config.json``, or ``model.path``'s) under torch's
``FakeTensorMode``, which gives every tensor its shape, dtype and device but no storage, on a fake
process group of ``plan.world_size`` ranks. The trainer's own code then sets the run up and runs one
step on rank 0: ``train.components.build.setup_trainable`` (LoRA or full fine-tuning, the KL reference,
activation checkpointing, FSDP2 through ``train.distributed.parallelize``), AdamW with the run's
settings, the EMA; then, each call traced under ``FSDPMemTracker`` (what lives in memory, and when)
and ``FlopCounterMode``:

    rollout     ``train.step.sample_trajectories``: the sampler's N denoising steps on every sample of
                the rank, keeping the velocities when the update reuses them; the transformer is
                traced on the first step (the others run its shapes), its FLOPs counted N times
    decode      ``train.step.decode_images`` of those samples (the reward models score the images next)
    update      ``train.algorithm.update.update_micro_batch``: one group of W steps of one micro-batch (the GRPO loss,
                the KL reference's batched call, ``train.algorithm.jagg.backward_group``), once per update path
                the run routes to (and exact), on the rollout's velocities or recomputing them as the
                run does, with and without activation checkpointing, while earlier micro-batches'
                gradients are held; the exact path on 2 of its W steps (each step's graph is freed
                before the next), its FLOPs scaled to W
    optimizer   the global-norm clip, the AdamW step and the EMA (``train.step.step_weights``)

A phase's peak is what the tracker saw (transformer shards, gradients, optimizer state, the KL
reference and EMA shards, the step's trajectories, conditioning and images, and the phase's own
activations, all-gathered blocks and temporaries) plus the frozen models that every rank
replicates, counted from their configs: text encoders (none with ``model.embedding_cache``), VAE,
reward models and, when the run evaluates, the evaluation scorers it keeps after the first
evaluation. The step's peak is the largest phase. FLOPs per step scale the traced calls: one
rollout, one decode, the expected number of groups per path per micro-batch (over the random group
pick and the Flow-GRPO-Fast window), one optimizer step per ``gradient_accumulation_steps`` samples.

Limits, by construction:
* Fake tensors trace the CPU kernels' shapes: attention is the CPU flash kernel (output and
  log-sum-exp saved, no L x L matrix), as CUDA's flash and memory-efficient kernels do; any kernel
  whose CUDA version keeps other buffers is off by those.
* The tracker counts tensor storage, not the CUDA caching allocator: no fragmentation, no CUDA
  context, no NCCL buffers (``plan.reserved_gib`` keeps room for them), no cuBLAS workspaces.
* Every fake tensor lives on one device: the velocities kept in host memory
  (``update.offload_velocities``) are taken out of the GPU peak by their size.
* Not traced: prompt encoding and reward scoring (their models' weights are counted), logging,
  evaluation and checkpoints. The rollout runs without a prompt batch (conditioning shaped as
  ``backbone.encode`` returns it), from the first Flow-GRPO-Fast window, on a fixed-shift schedule;
  the values of the schedule and of the step's flags are real, every other tensor a shape.
* What reads a value is left out: the finiteness test of the gradient norm, the update's logged
  metrics (``train.algorithm.update.UpdateStats``).
* The exact path's trace runs the KL reference's batched call on its 2 traced steps, not W: the
  jagg paths' traces hold the full call (a few [W x micro_batch] rows without gradients).
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
import math
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from diffusers import ModelMixin
from hydra import compose, initialize_config_module
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from torch import Tensor, nn
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import _TOTAL_KEY
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils.flop_counter import FlopCounterMode, _FlopCounterMode, flop_registry

import configs
from models.base import Conditioning, parse_dtype
from models.diffusers_backbone import DiffusersBackbone
from models.registry import backbone_names, get_backbone_class
from rewards.base import SCORER_NAMES, FrozenModelScorer, scorer_class
from samplers.rollout import Predict, Trajectory, stochastic_flags, trainable_flags
from samplers.schedule import shifted_sigmas
from train.algorithm.groups import RoutedGroup, pick_groups, route_groups
from train.algorithm.jagg import MIDDLE_MODES, UPDATE_MODES
from train.algorithm.update import UpdateBatch, update_micro_batch
from train.cli import hydra_message, reported, setup
from train.cli import report as report_error
from train.components.build import (
    Run,
    adamw_settings,
    build_router,
    policy_predictor,
    reference_predictor,
    setup_trainable,
    typed_config,
    update_settings,
)
from train.components.config import TrainConfig, trainable_transitions, validate
from train.components.ema import EMA
from train.components.errors import ConfigError
from train.distributed.collectives import DistInfo
from train.distributed.parallelize import clip_grad_norm_, local_tensor, world_mesh
from train.step import decode_images, sample_trajectories, step_weights

GIB = 2**30
ARCH_ROOT = Path(configs.__file__).resolve().parent / "arch"
SHIPPED_ARCH = {"flux": "flux1-dev", "qwenimage": "qwen-image"}  # model.name -> folder under configs/arch
NOT_READ = "<not read by the planner>"  # stands in for the required paths the planner never opens
# Model-based scorers: their architecture (a shipped CLIPModel config, or open_clip's own for HPSv2),
# used unless the scorer's model_path folder holds a config.json. The other scorers hold no weights.
SCORER_ARCH = {"clipscore": "clip-vit-large-patch14", "pickscore": "pickscore", "hpsv2": None}
PROG = "python -m train.plan"
CPU = torch.device("cpu")  # the one device of every fake tensor
VIEW_WARNING = r"FSDP2-wrapped module .* returned a view tensor"
EXACT_TRACED_STEPS = 2  # the exact path's steps are alike and run one after another: two show its peak


# ---- configuration -------------------------------------------------------------------------------


def load_config(cfg: DictConfig) -> tuple[TrainConfig, bool]:
    """(the typed config, whether model.path was given). Required paths the planner does not read
    (model, prompts, reward checkpoints) may stay unset; everything else is validated as for training."""
    cfg = copy.deepcopy(cfg)
    model_path_given = not OmegaConf.is_missing(cfg.model, "path")
    cfg.run_dir = NOT_READ  # Hydra's output folder: compose() sets none, and the planner writes no run
    _fill_missing(cfg)
    config = typed_config(cfg)
    validate(config, known_scorers=SCORER_NAMES, known_backbones=tuple(backbone_names()), check_files=False)
    if config.update.routing != "prefix":
        raise ConfigError(
            f"update.routing={config.update.routing} routes each group by a cosine measured during the run, which "
            "a plan cannot know: plan with update.routing=prefix and a share, e.g. update.jagg_frac=0.6 (the paper's)"
        )
    return config, model_path_given


def _fill_missing(node: DictConfig) -> None:
    """Set every "???" value under ``node`` to NOT_READ (interpolations to them then resolve too)."""
    for key in map(str, node.keys()):
        if OmegaConf.is_missing(node, key):
            node[key] = NOT_READ
        elif not OmegaConf.is_interpolation(node, key) and isinstance(node[key], DictConfig):
            _fill_missing(node[key])


def arch_folder(cfg: TrainConfig, model_path_given: bool) -> Path:
    """Where the architecture configs are read: plan.arch, else model.path, else the shipped ones."""
    if cfg.plan.arch is not None:
        folder, field_name = Path(cfg.plan.arch), "plan.arch"
    elif model_path_given:
        folder, field_name = Path(cfg.model.path), "model.path"
    elif cfg.model.name in SHIPPED_ARCH:
        folder, field_name = ARCH_ROOT / SHIPPED_ARCH[cfg.model.name], "model.name"
    else:
        raise ConfigError(
            f"model.name={cfg.model.name!r} has no shipped architecture (shipped: {sorted(SHIPPED_ARCH)}); "
            "pass plan.arch=<folder with transformer/config.json, vae/config.json, ...> or model.path"
        )
    if not (folder / "transformer" / "config.json").is_file():
        raise ConfigError(
            f"{field_name}={str(folder)!r} holds no transformer/config.json; point it at a diffusers folder"
        )
    return folder


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def diffusers_backbone_class(name: str) -> type[DiffusersBackbone]:
    """The adapter class of backbone ``name`` (both shipped adapters are diffusers pipelines)."""
    cls = get_backbone_class(name)
    if not issubclass(cls, DiffusersBackbone):
        raise ConfigError(f"model.name={name!r}: the planner knows diffusers backbones only, not {cls.__name__}")
    return cls


# ---- frozen, replicated models -------------------------------------------------------------------


@dataclass(frozen=True)
class FrozenModel:
    """A model every rank holds whole, in the dtype it is placed in."""

    role: str  # text encoder | VAE | reward | eval scorer
    name: str
    num_params: int
    num_bytes: int  # parameters and buffers


def module_bytes(module: nn.Module, dtype: torch.dtype) -> int:
    """Bytes of ``module``'s parameters and buffers once cast to ``dtype`` (integer buffers keep theirs)."""
    total = 0
    for tensor in [*module.parameters(), *module.buffers()]:
        size = dtype.itemsize if tensor.is_floating_point() else tensor.dtype.itemsize
        total += tensor.numel() * size
    return total


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
            import open_clip

            from rewards.hpsv2 import register_arch

            # open_clip logs "No pretrained weights loaded" as a warning: none are wanted here
            previous = logging.root.manager.disable
            logging.disable(logging.WARNING)
            try:
                return open_clip.create_model(register_arch(args.get("arch", _default(name, "arch"))), device="meta")
            finally:
                logging.disable(previous)
        from transformers import CLIPModel

        folder = Path(str(args.get("model_path", NOT_READ)))
        config = folder / "config.json"
        if not config.is_file():
            config = ARCH_ROOT / str(SCORER_ARCH[name]) / "config.json"
        return build_component(CLIPModel, read_json(config))


def _default(name: str, arg: str) -> Any:
    """The default of scorer ``name``'s constructor argument ``arg``."""
    return inspect.signature(scorer_class(name)).parameters[arg].default


def scorers_frozen(role: str, scorers: dict[str, dict]) -> list[FrozenModel]:
    out = []
    for name, args in scorers.items():
        module = scorer_module(name, args)
        if module is not None:
            dtype = parse_dtype(args.get("dtype", _default(name, "dtype")), field=f"{role}.{name}.dtype")
            out.append(_frozen(role, name, module, dtype))
    return out


def frozen_models(cfg: TrainConfig, arch: Path) -> list[FrozenModel]:
    rewards = {name: {k: v for k, v in comp.items() if k != "weight"} for name, comp in cfg.reward.components.items()}
    out = backbone_frozen(cfg, arch) + scorers_frozen("reward", rewards)
    if cfg.logging.eval_every:  # built on the first evaluation and kept for the rest of the run
        out += scorers_frozen("eval scorer", dict(cfg.eval.scorers))
    return out


# ---- routing -------------------------------------------------------------------------------------


def expected_groups(cfg: TrainConfig, mode: str | None = None) -> dict[str, float]:
    """Expected groups per micro-batch of each update path, over the random group pick
    (update.timestep_fraction) and the Flow-GRPO-Fast window start (uniform in its range).
    ``mode`` replaces update.mode (``"exact"``: the run without JAGG)."""
    s, u = cfg.sampler, cfg.update
    starts: list[int | None] = [None]
    if s.sde_window_size > 0:
        lo, hi = s.sde_window_range
        starts = list(range(lo, hi - s.sde_window_size + 1))
    counts: dict[str, float] = {}
    for start in starts:
        trainable = trainable_transitions(s, start)
        every = route_groups(
            trainable, window=u.window, mode=mode or u.mode, jagg_frac=u.jagg_frac, num_transitions=s.num_steps - 1
        )
        picked = len(pick_groups(trainable, window=u.window, timestep_fraction=u.timestep_fraction))
        for group in every:  # a uniform random subset: each group is picked with probability picked / len
            counts[group.mode] = counts.get(group.mode, 0.0) + picked / len(every) / len(starts)
    return counts


# ---- tracing -------------------------------------------------------------------------------------


class StepMemTracker(FSDPMemTracker):
    """FSDPMemTracker keeping only the peak of the whole traced region.

    Per-module peaks are not kept (nothing here reads them, and updating them walks every FSDP
    module at every op: 60% of a trace's time, measured), and module statistics are reset before
    each forward of the root, which FSDPMemTracker otherwise refuses as "multiple iterative calls":
    a rollout or an update runs the transformer several times.
    """

    def __enter__(self) -> StepMemTracker:
        super().__enter__()
        self._reset = self._root_mod.register_forward_pre_hook(lambda *_: self.reset_mod_stats(), prepend=True)
        return self

    def __exit__(self, *args: Any) -> None:
        self._reset.remove()
        super().__exit__(*args)

    def _update_peak_stats(self, peak_state: Any) -> None:
        for device, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snapshot[_TOTAL_KEY]:
                self._peak_mem[device] = snapshot[_TOTAL_KEY]
                self._peak_mem_snap[device] = copy.deepcopy(snapshot)


class StepFlopCounter(FlopCounterMode):
    """FlopCounterMode with two changes. No per-module breakdown: its module tracker keeps the
    tensors that activation checkpointing recomputes alive after the backward (measured: a 12-block
    full-width Flux, 5.9 GiB traced peak alone, 12.2 GiB under FlopCounterMode). And attention
    counts: the CPU flash kernel that fake tensors dispatch to has no formula of its own, so it
    takes that of the CUDA flash kernel (the same q, k, v arguments first)."""

    def __init__(self) -> None:
        super().__init__(display=False)
        aten = torch.ops.aten
        self.flop_registry[aten._scaled_dot_product_flash_attention_for_cpu] = flop_registry[
            aten._scaled_dot_product_flash_attention
        ]
        self.flop_registry[aten._scaled_dot_product_flash_attention_for_cpu_backward] = flop_registry[
            aten._scaled_dot_product_flash_attention_backward
        ]

    def __enter__(self) -> StepFlopCounter:
        self.flop_counts.clear()
        self.mode = _FlopCounterMode(self)
        self.mode.__enter__()
        return self

    def __exit__(self, *args: Any) -> None:
        assert self.mode is not None
        self.mode.__exit__(*args)
        self.mode = None


@dataclass
class Measured:
    """What one traced call did on rank 0."""

    peak_bytes: int  # everything the tracker saw at its peak
    flops: int
    at_start: dict[str, int]  # tracker categories when the call started (shards, gradients, optimizer, inputs)
    at_peak: dict[str, int]


def _categories(snapshot: dict[Any, dict[Any, int]]) -> dict[str, int]:
    (per_device,) = snapshot.values()  # every fake tensor lives on one device
    return {str(getattr(k, "value", k)): v for k, v in per_device.items()}


def measure(root: nn.Module, optimizer: torch.optim.Optimizer, resident: Sequence[Tensor], fn: Callable) -> Measured:
    """Trace ``fn()`` with ``resident`` tensors (the step's trajectory and images, the KL reference's
    shards, the EMA) counted as live from the start."""
    tracker = StepMemTracker(root, optimizer)
    tracker.track_inputs(tuple(resident))
    counter = StepFlopCounter()
    with tracker:
        start = _categories(tracker.get_tracker_snapshot("current"))
        with counter:
            fn()
    peak = _categories(tracker.get_tracker_snapshot("peak"))
    return Measured(peak[_TOTAL_KEY], counter.get_total_flops(), start, peak)


@contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """A fake ``world_size``-rank process group (this process is rank 0) and its cpu mesh."""
    if dist.is_initialized():
        raise ConfigError("python -m train.plan creates its own fake process group: run it without torchrun")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        world_mesh("cpu")  # outside any fake mode: building a mesh runs collectives on real tensors
        yield
    finally:
        dist.destroy_process_group()


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build modules in ``dtype``: a module of fake tensors cannot be cast after it is built."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@contextmanager
def fake_deepcopy() -> Iterator[None]:
    """``copy.deepcopy`` of a fake tensor that stays in its fake mode. The trainer's KL reference is a
    deep copy of the policy, and torch's ``Tensor.__deepcopy__`` puts the copy of a fake tensor in a
    fresh fake mode, whose tensors then cannot meet the policy's ("Mixing fake modes")."""

    def clone(tensor: FakeTensor, memo: dict[int, Any]) -> Tensor:
        if id(tensor) not in memo:
            with torch.no_grad():
                copied = tensor.clone()
            if isinstance(tensor, nn.Parameter):
                copied = nn.Parameter(copied, requires_grad=tensor.requires_grad)
            memo[id(tensor)] = copied
        return memo[id(tensor)]

    FakeTensor.__deepcopy__ = clone  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        del FakeTensor.__deepcopy__


def known(make: Callable[[], Tensor]) -> Tensor:
    """A small tensor built for real by ``make`` and handed to the active fake mode as a constant: its
    values stay readable (``float(sigmas[1])``, ``bool(traj.stochastic[k])``) where every other fake
    tensor has a shape only."""
    mode = detect_fake_mode()
    if mode is None:
        return make()
    with unset_fake_temporarily():
        real = make()
    return mode.fake_tensor_converter.from_real_tensor(mode, real, make_constant=True)


# ---- the run on fake tensors ---------------------------------------------------------------------


class LocalShardAdamW(torch.optim.AdamW):
    """The trainer's AdamW (``train.components.build.adamw_settings``) stepping each rank's local shards.

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


class NotBuilt:
    """Stands in for a part of the run the planner does not build (it has no weights or files)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __getattr__(self, attr: str) -> Any:
        raise RuntimeError(f"python -m train.plan builds no {self.name}: nothing it traces may use it")


def build_backbone(cfg: TrainConfig, arch: Path) -> DiffusersBackbone:
    """The adapter around a float32 transformer (the trainer's master weights) and the VAE in model.dtype.

    The transformer is built on the meta device and materialized by ``build_run`` after sharding,
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


def hold_gradients(run: Run) -> None:
    """A gradient on every trainable parameter, as the update of a later micro-batch finds them
    (FSDP2 adds its reduce-scattered gradient to them)."""
    for p in run.params:
        p.grad = torch.zeros_like(p)


def build_run(cfg: TrainConfig, arch: Path) -> Run:
    """The trainer's ``Run`` on fake tensors, built by its own code where it loads no weights:
    ``train.components.build.setup_trainable`` (LoRA or full fine-tuning, the KL reference, activation
    checkpointing, FSDP2 through ``parallelize``), AdamW with the run's settings and its state as after
    a first step, the EMA, the router. Rewards, prompts, checkpoints and the logger are not built."""
    backbone = build_backbone(cfg, arch)
    with fake_deepcopy(), torch.device("meta"):  # LoRA layers too: peft skips moving meta adapters
        _, reference = setup_trainable(cfg, backbone)
    for module in (backbone.transformer, reference):
        if module is not None:
            module.to_empty(device=CPU)
    params = [p for p in backbone.transformer.parameters() if p.requires_grad]  # to_empty replaced them
    g = cfg.grpo
    run = Run(
        cfg=cfg,
        dist=DistInfo(rank=0, world_size=cfg.plan.world_size, local_rank=0, device=CPU, is_main=True),
        device=CPU,
        backbone=backbone,
        params=params,
        optimizer=LocalShardAdamW(params, **adamw_settings(cfg)),
        ema=EMA(params, g.ema_decay) if g.ema_decay > 0 else None,
        rewards=cast(Any, NotBuilt("reward models")),
        prompts=cast(Any, NotBuilt("prompt sampler")),
        checkpoints=cast(Any, NotBuilt("checkpoint manager")),
        logger=cast(Any, NotBuilt("logger")),
        reference=reference,
        compute_dtype=parse_dtype(cfg.model.dtype),
        router=build_router(cfg.update),
        resume_from=[],
    )
    hold_gradients(run)
    step_weights(run.optimizer, run.ema)  # the moments exist from the first step on
    run.optimizer.zero_grad(set_to_none=True)
    return run


# ---- one training step ---------------------------------------------------------------------------

# Shapes of the conditioning fields of one prompt, from (text tokens, the transformer's config).
_FIELD_SHAPES: dict[str, Callable[[int, dict[str, Any]], tuple[int, ...]]] = {
    "prompt_embeds": lambda tokens, config: (tokens, config["joint_attention_dim"]),
    "pooled": lambda tokens, config: (config["pooled_projection_dim"],),
    "mask": lambda tokens, config: (tokens,),
}


def text_tokens(cfg: TrainConfig) -> int:
    """Text tokens per prompt: the adapter's max_sequence_length (Qwen-Image pads to the longest
    prompt of a batch, so this is its worst case)."""
    return int(cfg.model.options.get("max_sequence_length") or 512)


def conditioning(backbone: DiffusersBackbone, rows: int, tokens: int) -> Conditioning:
    """What ``backbone.encode`` returns for ``rows`` prompts of ``tokens`` text tokens (its shapes)."""
    config = backbone.configs["transformer"]
    values = {}
    for f in fields(backbone.conditioning_class):
        if f.name not in _FIELD_SHAPES:
            raise ValueError(f"plan: no shape known for conditioning field {f.name!r} of backbone {backbone.name!r}")
        shape = (rows, *_FIELD_SHAPES[f.name](tokens, config))
        is_mask = f.name == "mask"
        values[f.name] = torch.ones(shape, dtype=torch.long) if is_mask else torch.randn(shape, dtype=backbone.dtype)
    return backbone.conditioning_class(**values)


def first_window(cfg: TrainConfig) -> tuple[int, int] | None:
    """The Flow-GRPO-Fast SDE window the trace samples with: the first one the run can draw (every
    window trains as many transitions: validation keeps the last one out of its range)."""
    s = cfg.sampler
    if s.sde_window_size <= 0:
        return None
    lo = s.sde_window_range[0]
    return lo, lo + s.sde_window_size


@dataclass
class StepTensors:
    """What a step keeps from its rollout to its optimizer step (train.step.train_step)."""

    traj: Trajectory | None = None
    images: Tensor | None = None  # [B, 3, H, W] float32, from the decode on (logged after the update)
    advantages: Tensor | None = None  # [B]

    def resident(self, *, offloaded_velocities: bool) -> list[Tensor]:
        """The tensors on the GPU: the velocities stay out when they are kept in host memory."""
        out: list[Tensor] = []
        if self.traj is not None:
            t = self.traj
            out += [t.latents, t.timesteps, t.sigmas, t.log_probs, t.group_ids, *t.cond.tensors().values()]
            if t.velocities is not None and not offloaded_velocities:
                out.append(t.velocities)
        return out + [x for x in (self.images, self.advantages) if x is not None]


class TracedOnce:
    """A predictor that runs its first call and answers each later one with an uninitialized tensor
    of that call's output shape and dtype (each later call must have the first one's input shape).

    The rollout's N steps call the transformer with the same shapes: its first forward traced gives
    a step's memory and 1/N of the rollout's FLOPs, and the sampler's own loop (trajectory buffers,
    SDE steps, log-probabilities, kept velocities) still runs every step, at a fraction of the CPU.
    """

    def __init__(self, predict: Predict) -> None:
        self.predict = predict
        self.first: tuple[torch.Size, torch.Size, torch.dtype] | None = None  # (input shape, output shape, dtype)

    def __call__(self, z: Tensor, t: Tensor, cond: Any) -> Tensor:
        if self.first is None:
            v = self.predict(z, t, cond)
            self.first = (z.shape, v.shape, v.dtype)
            return v
        if z.shape != self.first[0]:
            raise ValueError(f"TracedOnce: a call on {tuple(z.shape)} after one on {tuple(self.first[0])}")
        return torch.empty(self.first[1], dtype=self.first[2], device=z.device)


def rollout_call(run: Run, tensors: StepTensors) -> Callable[[], None]:
    """The rollout of every sample of the rank (``train.step.sample_trajectories``: the sampler's N
    steps, the transformer traced on the first, ``TracedOnce``) from conditioning and noise shaped as
    ``rollout_phase`` makes them."""
    cfg, backbone = run.cfg, cast(DiffusersBackbone, run.backbone)
    g, s, window = cfg.grpo, cfg.sampler, first_window(cfg)

    def call() -> None:
        cond = conditioning(backbone, g.prompts_per_rank, text_tokens(cfg)).repeat(g.group_size)
        noise = backbone.initial_noise(g.prompts_per_rank, height=cfg.model.height, width=cfg.model.width)
        # The schedule's values change no shape: a fixed shift stands in for a dynamic one.
        sigmas = known(lambda: shifted_sigmas(s.num_steps, s.shift if s.shift is not None else 1.0))
        traj = sample_trajectories(
            TracedOnce(policy_predictor(run)),
            cfg,
            cond,
            noise.repeat_interleave(g.group_size, dim=0),
            sigmas=sigmas,
            group_ids=torch.arange(g.prompts_per_rank).repeat_interleave(g.group_size),
            sde_window=window,
            sde_noise=[torch.Generator().manual_seed(i) for i in range(g.prompts_per_rank)],
            keep_velocities=update_settings(cfg).keeps_velocities,
            velocity_dtype=run.compute_dtype,
        )
        flags = stochastic_flags(s.num_steps, traj.sde, window)  # readable, for transition() and the plan
        stochastic = known(lambda: torch.tensor(flags, dtype=torch.bool))
        trainable = known(lambda: torch.tensor(trainable_flags(flags), dtype=torch.bool))
        tensors.traj = replace(traj, stochastic=stochastic, trainable=trainable)

    return call


def decode_call(run: Run, tensors: StepTensors) -> Callable[[], None]:
    """The decode of the rollout's final latents before scoring (``train.step.decode_images``)."""
    cfg = run.cfg

    def call() -> None:
        assert tensors.traj is not None
        tensors.images = decode_images(run.backbone, tensors.traj.latents[:, -1], cfg.model)

    return call


def update_call(run: Run, tensors: StepTensors, mode: str, *, reuse: bool) -> Callable[[], None]:
    """One group of W steps of one micro-batch through ``train.algorithm.update.update_micro_batch`` (the GRPO loss,
    the KL reference's batched call, ``backward_group``), on the rollout's velocities when ``reuse``."""
    cfg, traj = run.cfg, tensors.traj
    assert traj is not None and tensors.advantages is not None
    batch = UpdateBatch(
        traj=traj,
        advantages=tensors.advantages,
        predict=policy_predictor(run),
        reference=reference_predictor(run),
        settings=update_settings(cfg),
    )
    start = traj.trainable_steps()[0]
    group = RoutedGroup(start, start + (EXACT_TRACED_STEPS if mode == "exact" else cfg.update.window), mode)
    rows = torch.arange(cfg.grpo.micro_batch)

    def call() -> None:
        update_micro_batch(batch, rows, [group], reuse_velocities=reuse)  # its scale changes nothing traced

    return call


def optimizer_call(run: Run) -> Callable[[], None]:
    """``train.step.optimizer_step`` but for its finiteness test (a value): the global-norm clip, the
    AdamW step and the EMA, then zero_grad."""

    def call() -> None:
        clip_grad_norm_(run.params, run.cfg.grpo.max_grad_norm)
        step_weights(run.optimizer, run.ema)
        run.optimizer.zero_grad(set_to_none=True)

    return call


# ---- the plan ------------------------------------------------------------------------------------


@dataclass
class Phase:
    """One traced call on rank 0. Its peak includes the frozen models once ``plan`` adds them."""

    name: str  # rollout | decode | update <mode>[, rollout velocities] | optimizer
    peak_bytes: int
    working_bytes: int  # the call's own memory: its peak minus what was live when it started
    activation_bytes: int  # of which activations and backward temporaries, at the peak
    gathered_bytes: int  # of which all-gathered (unsharded) parameters, at the peak
    flops: int  # of one call; an update's call is one group of W steps of one micro-batch
    calls_per_step: float  # calls per rank per training step
    checkpointing: bool | None = None  # updates: traced with activation checkpointing
    mode: str | None = None  # updates: the path


def _phase(name: str, m: Measured, calls_per_step: float, **kwargs: Any) -> Phase:
    at_peak = m.at_peak
    return Phase(
        name=name,
        peak_bytes=m.peak_bytes,
        working_bytes=m.peak_bytes - m.at_start[_TOTAL_KEY],
        activation_bytes=at_peak.get("Activation", 0) + at_peak.get("Temp", 0),
        gathered_bytes=at_peak.get("All Gather", 0) + at_peak.get("Unsharded Param", 0),
        flops=m.flops,
        calls_per_step=calls_per_step,
        **kwargs,
    )


@dataclass
class PlanReport:
    """Everything ``python -m train.plan`` prints (and writes as JSON to plan.output)."""

    experiment: str
    backbone: str
    arch: str
    world_size: int
    gpu_memory_gib: float
    reserved_gib: float
    num_params: int
    num_trainable: int
    lora: bool
    checkpointing: bool
    image_tokens: int
    text_tokens: int
    samples_per_rank: int
    decode_batch: int
    micro_batch: int
    groups: dict[str, float]  # expected groups per micro-batch, per update path
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    reference_bytes: int
    ema_bytes: int
    step_tensor_bytes: int  # trajectories (with the velocities kept on the GPU), conditioning, images
    velocity_bytes: int  # of which the rollout's velocities kept on the GPU for the update
    frozen: list[FrozenModel]
    phases: list[Phase]  # rollout, decode, optimizer
    updates: list[Phase]  # per traced path, with and without activation checkpointing
    seconds: float = 0.0

    @property
    def frozen_bytes(self) -> int:
        return sum(m.num_bytes for m in self.frozen)

    @property
    def budget_bytes(self) -> float:
        return (self.gpu_memory_gib - self.reserved_gib) * GIB

    def configured_updates(self) -> list[Phase]:
        return [u for u in self.updates if u.checkpointing == self.checkpointing]

    def step_phases(self) -> list[Phase]:
        """The phases of a step as configured: the updates the run routes to, its checkpointing."""
        return self.phases + [u for u in self.configured_updates() if u.calls_per_step > 0]

    @property
    def peak(self) -> Phase:
        return max(self.step_phases(), key=lambda p: p.peak_bytes)

    @property
    def fits(self) -> bool:
        return self.peak.peak_bytes <= self.budget_bytes

    def flops_per_step(self, *, exact: bool = False) -> tuple[float, float]:
        """(update, whole step) FLOPs per rank: as routed, or with every group on the exact path."""
        updates = self.configured_updates()
        if exact:
            calls = sum(u.calls_per_step for u in updates)
            update = calls * next(u.flops for u in updates if u.mode == "exact")
        else:
            update = sum(u.calls_per_step * u.flops for u in updates)
        return update, update + sum(p.calls_per_step * p.flops for p in self.phases)


def _storage_bytes(tensors: Sequence[Tensor]) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def reference_shards(run: Run) -> list[Tensor]:
    """The KL reference's local shards: a second FSDP root, which the policy's tracker counts as inputs."""
    return [] if run.reference is None else [local_tensor(p) for p in run.reference.parameters()]


def ema_shards(run: Run) -> list[Tensor]:
    """The EMA's float32 local shards (held by no module or optimizer: counted as inputs)."""
    return [] if run.ema is None else [local_tensor(s) for s in run.ema.shadow]


def update_variants(
    cfg: TrainConfig, groups: dict[str, float], *, kept_velocities: bool
) -> list[tuple[str, bool, float]]:
    """(path, on the rollout's velocities, calls per rank per step) for each update call the run makes,
    and exact (the baseline of the speed-up) in any case. ``update.reuse_velocities=fresh`` reuses them
    until the first optimizer step of the step moves the weights: the first of B / accumulation chunks."""
    g = cfg.grpo
    samples = g.group_size * g.prompts_per_rank
    micro_batches = samples // g.micro_batch
    reused = 1.0 if cfg.update.reuse_velocities == "stale" else g.gradient_accumulation_steps / samples
    out = []
    for mode in UPDATE_MODES:
        calls = micro_batches * groups.get(mode, 0.0)
        if calls == 0 and mode != "exact":
            continue
        if kept_velocities and mode in MIDDLE_MODES:
            out.append((mode, True, calls * reused))
            if reused < 1:
                out.append((mode, False, calls * (1 - reused)))
        else:
            out.append((mode, False, calls))
    return out


def trace_updates(run: Run, tensors: StepTensors, groups: dict[str, float]) -> list[Phase]:
    """Every update call of the run (``update_variants``) on one group of one micro-batch, with the
    run's activation checkpointing and gradients held."""
    cfg = run.cfg
    assert tensors.traj is not None
    offloaded = cfg.update.offload_velocities
    resident = tensors.resident(offloaded_velocities=offloaded) + reference_shards(run) + ema_shards(run)
    out = []
    for mode, reuse, calls in update_variants(cfg, groups, kept_velocities=tensors.traj.velocities is not None):
        m = measure(run.backbone.transformer, run.optimizer, resident, update_call(run, tensors, mode, reuse=reuse))
        if mode == "exact":  # its W steps, each freed before the next, traced on EXACT_TRACED_STEPS
            m.flops = round(m.flops * cfg.update.window / EXACT_TRACED_STEPS)
        name = f"update {mode}" + (", rollout velocities" if reuse else "")
        out.append(_phase(name, m, calls, checkpointing=cfg.model.activation_checkpointing, mode=mode))
    return out


@dataclass
class Traced:
    """Everything measured on rank 0 of the run as configured."""

    phases: list[Phase]
    updates: list[Phase]
    tensors: StepTensors
    at_step: dict[str, int]  # tracker categories when the optimizer step starts: shards, gradients, state, inputs
    num_params: int
    num_trainable: int
    step_tensor_bytes: int
    reference_bytes: int
    ema_bytes: int
    velocity_bytes: int
    image_tokens: int


def trace_step(run: Run, groups: dict[str, float]) -> Traced:
    """The phases in the order a step runs them, with gradients held where the trainer holds them."""
    cfg, g = run.cfg, run.cfg.grpo
    root, opt = run.backbone.transformer, run.optimizer
    offloaded = cfg.update.offload_velocities
    always = reference_shards(run) + ema_shards(run)
    tensors = StepTensors()
    # the rollout and the decode run after the last optimizer step's zero_grad(set_to_none)
    rollout = measure(root, opt, always, rollout_call(run, tensors))
    assert tensors.traj is not None
    if offloaded and tensors.traj.velocities is not None:  # allocated during the rollout, in host memory
        rollout.peak_bytes -= _storage_bytes([tensors.traj.velocities])
    rollout.flops *= cfg.sampler.num_steps  # counted: the transformer's first forward (TracedOnce)
    phases = [_phase("rollout", rollout, 1)]
    decode = measure(root, opt, always + tensors.resident(offloaded_velocities=offloaded), decode_call(run, tensors))
    phases.append(_phase("decode", decode, 1))
    tensors.advantages = torch.zeros(tensors.traj.batch_size)
    hold_gradients(run)
    updates = trace_updates(run, tensors, groups)
    resident = always + tensors.resident(offloaded_velocities=offloaded)
    optimizer = measure(root, opt, resident, optimizer_call(run))
    phases.append(_phase("optimizer", optimizer, g.group_size * g.prompts_per_rank / g.gradient_accumulation_steps))
    velocities = tensors.traj.velocities
    return Traced(
        phases=phases,
        updates=updates,
        tensors=tensors,
        at_step=optimizer.at_start,
        num_params=sum(p.numel() for p in root.parameters()),
        num_trainable=sum(p.numel() for p in run.params),
        step_tensor_bytes=_storage_bytes(tensors.resident(offloaded_velocities=offloaded)),
        reference_bytes=_storage_bytes(reference_shards(run)),
        ema_bytes=_storage_bytes(ema_shards(run)),
        velocity_bytes=0 if offloaded or velocities is None else _storage_bytes([velocities]),
        image_tokens=math.prod(cast(DiffusersBackbone, run.backbone).latent_grid(cfg.model.height, cfg.model.width)),
    )


def trace_other_checkpointing(
    cfg: TrainConfig, arch: Path, tensors: StepTensors, groups: dict[str, float]
) -> list[Phase]:
    """The update traces with activation checkpointing flipped, on the same step's tensors (a second
    model: checkpointing wraps the blocks before FSDP2 shards them)."""
    other = replace(cfg, model=replace(cfg.model, activation_checkpointing=not cfg.model.activation_checkpointing))
    run = build_run(other, arch)
    hold_gradients(run)
    return trace_updates(run, tensors, groups)


def plan(cfg: TrainConfig, *, model_path_given: bool = False) -> PlanReport:
    """Trace one training step of ``cfg`` on rank 0 of plan.world_size fake ranks (module docstring)."""
    started = time.perf_counter()
    arch = arch_folder(cfg, model_path_given)
    frozen = frozen_models(cfg, arch)
    groups = expected_groups(cfg)
    with fake_process_group(cfg.plan.world_size), FakeTensorMode(), warnings.catch_warnings():
        # FSDP2 warns on every forward that FluxSingleTransformerBlock returns views; no path of ours
        # writes into them in place (tests/test_plan.py checks it), so the warning is noise here.
        warnings.filterwarnings("ignore", message=VIEW_WARNING)
        traced = trace_step(build_run(cfg, arch), groups)
        updates = traced.updates + trace_other_checkpointing(cfg, arch, traced.tensors, groups)
    frozen_bytes = sum(m.num_bytes for m in frozen)
    for phase in [*traced.phases, *updates]:
        phase.peak_bytes += frozen_bytes
    at = traced.at_step
    return PlanReport(
        experiment=cfg.experiment,
        backbone=cfg.model.name,
        arch=str(arch),
        world_size=cfg.plan.world_size,
        gpu_memory_gib=cfg.plan.gpu_memory_gib,
        reserved_gib=cfg.plan.reserved_gib,
        num_params=traced.num_params,
        num_trainable=traced.num_trainable,
        lora=cfg.model.lora.enabled,
        checkpointing=cfg.model.activation_checkpointing,
        image_tokens=traced.image_tokens,
        text_tokens=text_tokens(cfg),
        samples_per_rank=cfg.grpo.group_size * cfg.grpo.prompts_per_rank,
        decode_batch=cfg.model.decode_batch,
        micro_batch=cfg.grpo.micro_batch,
        groups=groups,
        param_bytes=at.get("Sharded Param", 0),
        grad_bytes=at.get("Sharded Grad", 0),
        optimizer_bytes=at.get("OptState", 0),
        reference_bytes=traced.reference_bytes,
        ema_bytes=traced.ema_bytes,
        step_tensor_bytes=traced.step_tensor_bytes,
        velocity_bytes=traced.velocity_bytes,
        frozen=frozen,
        phases=traced.phases,
        updates=updates,
        seconds=time.perf_counter() - started,
    )


# ---- advice and the printed report ---------------------------------------------------------------


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.1f}"


Saving = tuple[str, dict[str, float], str]  # (the change, bytes it frees per phase name, how that is known)


def _everywhere(names: list[str], num_bytes: float) -> dict[str, float]:
    return dict.fromkeys(names, float(num_bytes))


def _static_savings(report: PlanReport, names: list[str]) -> list[Saving]:
    out: list[Saving] = []
    text = sum(m.num_bytes for m in report.frozen if m.role == "text encoder")
    if text:
        change = "model.embedding_cache=<folder> (scripts/precompute_embeddings.py): no text encoders"
        out.append((change, _everywhere(names, text), "exact"))
    if not report.lora:  # the rollout and the decode hold no gradients in any case
        held = report.optimizer_bytes + report.reference_bytes + report.ema_bytes
        saved = {n: float(held + (report.grad_bytes if n not in ("rollout", "decode") else 0)) for n in names}
        change = "model.lora.enabled=true: no full-size gradients, optimizer state, KL reference copy or EMA"
        out.append((change, saved, "estimate; trace it with model.lora.enabled=true"))
    evaluation = sum(m.num_bytes for m in report.frozen if m.role == "eval scorer")
    if evaluation:
        change = "logging.eval_every=0 (evaluate with python -m train.eval): no evaluation scorers kept"
        out.append((change, _everywhere(names, evaluation), "exact"))
    if report.velocity_bytes:
        change = "update.offload_velocities=true: the rollout's velocities in host memory"
        out.append((change, _everywhere(names, report.velocity_bytes), "exact"))
    return out


def _working_savings(report: PlanReport) -> list[Saving]:
    out: list[Saving] = []
    current = {u.name: u for u in report.configured_updates()}
    if not report.checkpointing:
        other = {u.name: u for u in report.updates if u.checkpointing}
        saved = {name: float(u.peak_bytes - other[name].peak_bytes) for name, u in current.items()}
        out.append(("model.activation_checkpointing=true", saved, "traced"))
    if report.groups.get("jagg", 0) > 0:
        saved = {name: u.activation_bytes / 2 for name, u in current.items() if u.mode == "jagg"}
        change = "update.mode=jagg_sequential: one endpoint graph alive instead of two"
        out.append((change, saved, "estimate; trace it with update.mode=jagg_sequential"))
    if report.micro_batch > 1:
        share = 1 - 1 / report.micro_batch
        saved = {p.name: p.working_bytes * share for p in report.step_phases() if p.name != "decode"}
        out.append(("grpo.micro_batch=1", saved, "estimate; trace it with grpo.micro_batch=1"))
    decode = next(p for p in report.phases if p.name == "decode")
    per_call = report.decode_batch if 0 < report.decode_batch < report.samples_per_rank else report.samples_per_rank
    for rows in (16, 8, 4, 2, 1):  # the largest chunk that fits, if one does: working memory ~ images per call
        saved = {"decode": decode.working_bytes * (1 - rows / per_call)}
        if rows < per_call and (decode.peak_bytes - saved["decode"] <= report.budget_bytes or rows == 1):
            out.append((f"model.decode_batch={rows}", saved, f"estimate; trace it with model.decode_batch={rows}"))
            break
    return out


def advice(report: PlanReport) -> list[str]:
    """One line per change that lowers the peak: the step's peak it would leave, and whether that fits."""
    names = [p.name for p in report.step_phases()]
    lines = []
    for change, saved, how in _static_savings(report, names) + _working_savings(report):
        peak = max(p.peak_bytes - saved.get(p.name, 0) for p in report.step_phases())
        if peak < report.peak.peak_bytes:
            verdict = "fits" if peak <= report.budget_bytes else "does not fit"
            lines.append(f"  {change}: peak {_gib(peak)} GiB, {verdict} ({how})")
    return lines


def largest_term(report: PlanReport, phase: Phase) -> str:
    terms = {
        f"{phase.name} working memory": phase.working_bytes,
        "transformer shards": report.param_bytes,
        "optimizer state": report.optimizer_bytes,
        "KL reference shards": report.reference_bytes,
        "EMA shards": report.ema_bytes,
        "step tensors": report.step_tensor_bytes,
        **{f"{m.role} {m.name}": m.num_bytes for m in report.frozen},
    }
    if phase.name not in ("rollout", "decode"):
        terms["gradients"] = report.grad_bytes
    name = max(terms, key=lambda term: terms[term])
    return f"{name} ({_gib(terms[name])} GiB)"


def _memory_lines(r: PlanReport) -> list[str]:
    lines = [
        "memory per rank, GiB",
        f"  transformer shards (float32)               {_gib(r.param_bytes):>7}",
        f"  gradients (float32 shards)                 {_gib(r.grad_bytes):>7}",
        f"  optimizer state (AdamW)                    {_gib(r.optimizer_bytes):>7}",
        f"  KL reference (shards)                      {_gib(r.reference_bytes):>7}",
        f"  EMA (float32 shards)                       {_gib(r.ema_bytes):>7}",
        f"  step tensors (trajectories, images)        {_gib(r.step_tensor_bytes):>7}"
        f"   of which kept velocities {_gib(r.velocity_bytes)}",
    ]
    for m in r.frozen:
        label = f"{m.role} {m.name} (replicated)"
        lines.append(f"  {label:<42} {_gib(m.num_bytes):>7}   {m.num_params / 1e9:.2f} B parameters")
    lines += ["", "phase peaks per rank, GiB (working: the phase's own activations, all-gathered blocks, temporaries)"]
    labels = [
        p.name if p.checkpointing is None else f"{p.name}, {'AC' if p.checkpointing else 'no AC'}"
        for p in r.phases + r.updates
    ]
    width = max(map(len, labels))
    for p, label in zip([*r.phases, *r.updates], labels):
        note = "" if p.checkpointing in (None, r.checkpointing) else "  (other checkpointing setting)"
        lines.append(
            f"  {label:<{width}} peak {_gib(p.peak_bytes):>6}   working {_gib(p.working_bytes):>6}"
            f" (activations {_gib(p.activation_bytes)}, all-gathered {_gib(p.gathered_bytes)}){note}"
        )
    return lines


def _flop_lines(r: PlanReport) -> list[str]:
    lines = ["FLOPs per rank per training step, TFLOP (calls per step x TFLOP per call)"]
    width = max(len(p.name) for p in r.phases + r.configured_updates())
    for p in r.phases + r.configured_updates():
        total = p.flops * p.calls_per_step / 1e12
        lines.append(f"  {p.name:<{width}} {total:>10.1f}   ({p.calls_per_step:g} x {p.flops / 1e12:.2f})")
    update, step = r.flops_per_step()
    update_exact, step_exact = r.flops_per_step(exact=True)
    lines += [
        f"  {'update as routed':<{width}} {update / 1e12:>10.1f}   every group exact: {update_exact / 1e12:.1f}"
        f" -> {update_exact / update:.2f}x fewer FLOPs: that speed-up at equal throughput",
        f"  {'training step':<{width}} {step / 1e12:>10.1f}   every group exact: {step_exact / 1e12:.1f}"
        f" -> {step_exact / step:.2f}x",
    ]
    return lines


def format_report(report: PlanReport) -> str:
    r = report
    groups = ", ".join(f"{mode} {n:g}" for mode, n in sorted(r.groups.items()))
    what = "LoRA" if r.lora else "full fine-tuning"
    checkpointing = "on" if r.checkpointing else "off"
    lines = [
        f"plan of experiment={r.experiment} ({r.backbone}, architecture from {r.arch})",
        f"  {r.world_size} ranks x {r.gpu_memory_gib:g} GiB; transformer {r.num_params / 1e9:.2f} B parameters, "
        f"{what} ({r.num_trainable / 1e9:.3f} B trained), activation checkpointing {checkpointing}",
        f"  {r.samples_per_rank} samples per rank per step, {r.image_tokens} image + {r.text_tokens} text tokens each; "
        f"micro-batch {r.micro_batch}, groups per micro-batch: {groups}",
        "",
        *_memory_lines(r),
        "",
        *_flop_lines(r),
        "",
    ]
    peak = r.peak
    budget = f"{r.gpu_memory_gib:g} GiB less {r.reserved_gib:g} GiB reserved (CUDA context, NCCL, fragmentation)"
    if r.fits:
        lines.append(f"fits: the largest phase is {peak.name} at {_gib(peak.peak_bytes)} GiB, within {budget};")
        lines.append(f"  its largest term is {largest_term(r, peak)}")
    else:
        over = _gib(peak.peak_bytes - r.budget_bytes)
        lines.append(f"does not fit: {peak.name} needs {_gib(peak.peak_bytes)} GiB, {over} GiB over {budget};")
        lines.append(f"  its largest term is {largest_term(r, peak)}. Each change alone:")
        lines += advice(r)
    need = _gib(peak.peak_bytes + r.reserved_gib * GIB)
    lines.append(
        f"needs GPUs of at least {need} GiB each ({r.reserved_gib:g} GiB reserved); traced in {r.seconds:.0f} s"
    )
    verdict = "fits" if r.fits else "does not fit"
    lines.append(f"peak per rank {_gib(peak.peak_bytes)} GiB of {r.gpu_memory_gib:g} GiB: {verdict}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> PlanReport:
    """``python -m train.plan [overrides]``: print the plan (and write it to plan.output as JSON). A wrong
    setting ends the command with one line (train/cli.py), as every command of the trainer does."""
    setup()
    overrides = list(sys.argv[1:] if argv is None else argv)
    try:
        with initialize_config_module(config_module="configs", version_base=None):
            composed = compose(config_name="train", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as err:
        raise SystemExit(report_error(ConfigError(hydra_message(err)), PROG)) from None
    with reported(PROG):
        cfg, model_path_given = load_config(composed)
        report = plan(cfg, model_path_given=model_path_given)
        print(format_report(report))
        if cfg.plan.output is not None:
            Path(cfg.plan.output).write_text(json.dumps(asdict(report), indent=2) + "\n")
    return report


def command() -> None:
    """The console script ``jagg-plan``."""
    main()


if __name__ == "__main__":
    command()
