"""``python -m train.plan [overrides]``: per-rank memory and FLOPs of one full-size training step, on CPU.

Nothing is allocated and no weight is read. The transformer is built from its architecture config
(``configs/arch/<model>/transformer/config.json``, or ``model.path``'s) under torch's
``FakeTensorMode``, which gives every tensor its shape, dtype and device but no storage. It is then
set up by the trainer's own code (``train.trainer.setup_trainable``: LoRA or full fine-tuning, the
KL reference, activation checkpointing, FSDP2 through ``train.distributed.parallelize``) on a fake
process group of ``plan.world_size`` ranks, and rank 0 runs the phases of one training step under
``FSDPMemTracker`` (what lives in memory, and when) and ``FlopCounterMode``:

    rollout     one of the N denoising forwards, no grad, on every sample of the rank at once
    decode      the VAE decode of those samples (the reward models score the images next)
    reference   one forward of the KL reference on a micro-batch (when grpo.kl_beta > 0)
    update      one group of W steps of one micro-batch through ``train.jagg.backward_group``, once
                per update mode the run routes to (and exact), with and without activation
                checkpointing, while earlier micro-batches' gradients are held
    optimizer   the global-norm clip and one AdamW step (foreach, as on CUDA)

A phase's peak is what the tracker saw (transformer shards, gradients, optimizer state, the step's
trajectory, conditioning and images, and the phase's own activations, all-gathered blocks and
temporaries) plus the frozen models that every rank replicates, counted from their configs: text
encoders (none with ``model.embedding_cache``), VAE, reward models and, when the run evaluates,
the evaluation scorers it keeps after the first evaluation. The step's peak is the largest phase.
FLOPs per step scale the traced calls: N rollout forwards, the expected number of groups per mode
per micro-batch (over the random group pick and the Flow-GRPO-Fast window), W reference forwards
per group.

Limits, by construction:
* Fake tensors trace the CPU kernels' shapes: attention is the CPU flash kernel (output and
  log-sum-exp saved, no L x L matrix), as CUDA's flash and memory-efficient kernels do; any kernel
  whose CUDA version keeps other buffers is off by those.
* The tracker counts tensor storage, not the CUDA caching allocator: no fragmentation, no CUDA
  context, no NCCL buffers (``plan.reserved_gib`` keeps room for them), no cuBLAS workspaces.
* Not traced: the text encoders' and reward models' forward activations (their weights are
  counted), the rollout's SDE arithmetic, logging and checkpoints.
* The update's per-step loss is a stand-in with the real loss's shapes (an SDE mean and a squared
  error per sample, float32): the real one reads values (the SDE's sigma guard) that fake tensors
  do not have. Its memory is a few [micro_batch, tokens, channels] float32 tensors.
* The exact path runs its W steps one after another, each graph freed before the next: it is traced
  on two of them (``backward_group`` needs W >= 2) and its FLOPs are scaled to W.
"""

from __future__ import annotations

import copy
import json
import math
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from diffusers import ModelMixin
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import _TOTAL_KEY
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils.flop_counter import FlopCounterMode, _FlopCounterMode, flop_registry

import configs
from models.base import Backbone, Conditioning, decode_in_chunks, parse_dtype
from models.diffusers_backbone import DiffusersBackbone
from models.registry import backbone_names, get_backbone_class
from rewards.base import SCORER_NAMES
from train.config import AUTO, TrainConfig, register_schema, trainable_transitions, validate
from train.distributed import clip_grad_norm_, world_mesh
from train.jagg import UPDATE_MODES, backward_group, plan_groups
from train.trainer import predictor, setup_trainable

GIB = 2**30
ARCH_ROOT = Path(configs.__file__).resolve().parent / "arch"
SHIPPED_ARCH = {"flux": "flux1-dev", "qwenimage": "qwen-image"}  # model.name -> folder under configs/arch
NOT_READ = "<not read by the planner>"  # stands in for the required paths the planner never opens
# Model-based scorers: their architecture (a shipped CLIPModel config, or open_clip's own for HPSv2),
# used unless the scorer's model_path folder holds a config.json. The other scorers hold no weights.
SCORER_ARCH = {"clipscore": "clip-vit-large-patch14", "pickscore": "pickscore", "hpsv2": None}
WEIGHTLESS_SCORERS = ("jpeg_compressibility", "jpeg_incompressibility", "shape_alignment")
SCORER_DTYPE = "float32"  # the default dtype of every model-based scorer (rewards.base.FrozenModelScorer)


# ---- configuration -------------------------------------------------------------------------------


def load_config(cfg: DictConfig) -> tuple[TrainConfig, bool]:
    """(the typed config, whether model.path was given). Required paths the planner does not read
    (model, prompts, reward checkpoints) may stay unset; everything else is validated as for training."""
    cfg = copy.deepcopy(cfg)
    model_path_given = not OmegaConf.is_missing(cfg.model, "path")
    cfg.run_dir = NOT_READ  # Hydra's output folder: compose() sets none, and the planner writes no run
    _fill_missing(cfg)
    config: TrainConfig = OmegaConf.to_object(cfg)
    validate(config, known_scorers=SCORER_NAMES, known_backbones=tuple(backbone_names()), check_files=False)
    if config.update.jagg_frac == AUTO:
        raise ValueError(
            "update.jagg_frac=auto routes each group by a cosine measured during the run, which a plan cannot "
            "know: plan with a number, e.g. update.jagg_frac=0.6 (the paper's choice)"
        )
    return config, model_path_given


def _fill_missing(node: DictConfig) -> None:
    """Set every "???" value under ``node`` to NOT_READ (interpolations to them then resolve too)."""
    for key in node.keys():
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
        raise ValueError(
            f"model.name={cfg.model.name!r} has no shipped architecture (shipped: {sorted(SHIPPED_ARCH)}); "
            "pass plan.arch=<folder with transformer/config.json, vae/config.json, ...> or model.path"
        )
    if not (folder / "transformer" / "config.json").is_file():
        raise ValueError(
            f"{field_name}={str(folder)!r} holds no transformer/config.json; point it at a diffusers folder"
        )
    return folder


def read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


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
    backbone_cls = get_backbone_class(cfg.model.name)
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
    if name in WEIGHTLESS_SCORERS:
        return None
    if name not in SCORER_ARCH:
        raise ValueError(f"reward {name!r}: the planner does not know its architecture; known: {sorted(SCORER_ARCH)}")
    with torch.device("meta"):
        if name == "hpsv2":
            import open_clip

            from rewards.hpsv2 import register_arch

            with warnings.catch_warnings():  # "no pretrained weights loaded": none are wanted here
                warnings.simplefilter("ignore")
                return open_clip.create_model(register_arch(args.get("arch", "ViT-H-14")), device="meta")
        from transformers import CLIPModel

        folder = Path(str(args.get("model_path", NOT_READ)))
        config = folder / "config.json" if (folder / "config.json").is_file() else None
        config = config or ARCH_ROOT / SCORER_ARCH[name] / "config.json"
        return build_component(CLIPModel, read_json(config))


def scorers_frozen(role: str, scorers: dict[str, dict]) -> list[FrozenModel]:
    out = []
    for name, args in scorers.items():
        module = scorer_module(name, args)
        if module is not None:
            dtype = parse_dtype(args.get("dtype", SCORER_DTYPE), field=f"{role}.{name}.dtype")
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
    if s.sde_window_size > 0:
        lo, hi = s.sde_window_range
        starts = list(range(lo, hi - s.sde_window_size + 1))
    else:
        starts = [None]
    counts: dict[str, float] = {}
    for start in starts:
        trainable = trainable_transitions(s, start)
        kwargs = dict(window=u.window, mode=mode or u.mode, jagg_frac=u.jagg_frac, num_transitions=s.num_steps - 1)
        every = plan_groups(trainable, **kwargs)
        picked = len(plan_groups(trainable, timestep_fraction=u.timestep_fraction, **kwargs))
        for group in every:  # a uniform random subset: each group is picked with probability picked / len
            counts[group.mode] = counts.get(group.mode, 0.0) + picked / len(every) / len(starts)
    return counts


# ---- tracing -------------------------------------------------------------------------------------


class StepMemTracker(FSDPMemTracker):
    """FSDPMemTracker keeping only the peak of the whole traced region.

    Per-module peaks are not kept (nothing here reads them, and updating them walks every FSDP
    module at every op: 60% of a trace's time, measured), and module statistics are reset before
    each forward of the root, which FSDPMemTracker otherwise refuses as "multiple iterative calls":
    an update runs the transformer several times.
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
    """Trace ``fn()`` with ``resident`` tensors (the step's trajectory, images, the KL reference's
    shards) counted as live from the start."""
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
        raise ValueError("python -m train.plan creates its own fake process group: run it without torchrun")
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

    FakeTensor.__deepcopy__ = clone
    try:
        yield
    finally:
        del FakeTensor.__deepcopy__


@dataclass
class TrainingState:
    """The rank-0 training state of the run, every tensor fake."""

    backbone: Backbone
    params: list[nn.Parameter]  # the trainable DTensor parameters
    shards: list[Tensor]  # their local shards, which the optimizer steps
    optimizer: torch.optim.Optimizer
    reference: nn.Module | None
    predict: Callable[[Tensor, Tensor, Conditioning], Tensor] | None

    def optimizer_step(self) -> None:
        """AdamW on the local shards with the parameters' gradients, then zero_grad(set_to_none)."""
        with torch.no_grad():
            for p, shard in zip(self.params, self.shards):
                shard.grad = p.grad.to_local()
        self.optimizer.step()
        for p, shard in zip(self.params, self.shards):
            p.grad = shard.grad = None


def build_backbone(cfg: TrainConfig, arch: Path) -> DiffusersBackbone:
    """The adapter around a float32 transformer (the trainer's master weights) and the VAE in model.dtype.

    The transformer is built on the meta device and materialized by ``build_state`` after sharding,
    as FSDP2 expects for large models: under a fake mode a module cannot be moved or cast once built
    (peft casts its LoRA layers to the base layer's device and dtype, and skips meta ones).
    """
    backbone_cls = get_backbone_class(cfg.model.name)
    loaders = {c.name: c for c in backbone_cls.components}
    configs_ = {name: read_json(arch / name / loaders[name].config_file) for name in ("transformer", "vae")}
    with torch.device("meta"):
        transformer = build_component(loaders["transformer"].loader, configs_["transformer"])
    with default_dtype(parse_dtype(cfg.model.dtype)):
        vae = build_component(loaders["vae"].loader, configs_["vae"])
    modules = {"transformer": transformer, "vae": vae.eval().requires_grad_(False)}
    return backbone_cls(modules, configs_, {}, dtype=parse_dtype(cfg.model.dtype), **cfg.model.options)


def build_state(cfg: TrainConfig, arch: Path) -> TrainingState:
    """The trainer's setup on fake tensors: LoRA or full fine-tuning, the KL reference, checkpointing,
    FSDP2; AdamW with its state and a gradient on every trainable parameter, as after a first step."""
    backbone = build_backbone(cfg, arch)
    with fake_deepcopy(), torch.device("meta"):  # LoRA layers too: peft skips moving meta adapters
        params, reference = setup_trainable(cfg, backbone)
    for module in (backbone.transformer, reference):
        if module is not None:
            module.to_empty(device="cpu")
    params = [p for p in backbone.transformer.parameters() if p.requires_grad]  # to_empty replaced them
    g = cfg.grpo
    # The trainer's AdamW over the sharded parameters takes the foreach path on CUDA (the CPU default
    # is a per-parameter loop): its temporaries span every parameter at once. DTensor runs those
    # foreach kernels on each rank's local shards; the plan runs them there directly, because DTensor's
    # sharding propagation of a foreach op over thousands of parameters costs minutes of CPU.
    with torch.no_grad():
        shards = [p.to_local() for p in params]
    optimizer = torch.optim.AdamW(shards, lr=g.lr, weight_decay=g.weight_decay, betas=tuple(g.betas), foreach=True)
    state = TrainingState(backbone, params, shards, optimizer, reference, None)
    hold_gradients(state)
    state.optimizer_step()  # the moments exist from the first step on
    state.predict = predictor(backbone, parse_dtype(cfg.model.dtype), cfg.plan.world_size)
    return state


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
    config = backbone.configs["transformer"]
    values = {}
    for f in fields(backbone.conditioning_class):
        if f.name not in _FIELD_SHAPES:
            raise ValueError(f"plan: no shape known for conditioning field {f.name!r} of backbone {backbone.name!r}")
        shape = (rows, *_FIELD_SHAPES[f.name](tokens, config))
        is_mask = f.name == "mask"
        values[f.name] = torch.ones(shape, dtype=torch.long) if is_mask else torch.randn(shape, dtype=backbone.dtype)
    return backbone.conditioning_class(**values)


@dataclass
class StepTensors:
    """What the step keeps on the GPU from the rollout to the optimizer step (trainer.train_step)."""

    latents: Tensor  # [B, N+1, h/2, w/2, 4C] float32
    log_probs: Tensor  # [B, N] float32
    timesteps: Tensor  # [N]
    cond: Conditioning  # B rows (the prompts' rows repeated G times)
    advantages: Tensor  # [B]
    images: Tensor | None = None  # [B, 3, H, W] float32, from the decode phase on

    def tensors(self) -> list[Tensor]:
        out = [self.latents, self.log_probs, self.timesteps, self.advantages, *self.cond.tensors().values()]
        return out + ([self.images] if self.images is not None else [])


def step_tensors(cfg: TrainConfig, backbone: DiffusersBackbone) -> StepTensors:
    rows = cfg.grpo.group_size * cfg.grpo.prompts_per_rank
    noise = backbone.initial_noise(rows, height=cfg.model.height, width=cfg.model.width)
    num_steps = cfg.sampler.num_steps
    prompts = conditioning(backbone, cfg.grpo.prompts_per_rank, text_tokens(cfg))
    return StepTensors(
        latents=noise.new_zeros((rows, num_steps + 1, *noise.shape[1:])),
        log_probs=torch.zeros(rows, num_steps),
        timesteps=torch.linspace(1, 0, num_steps + 1)[:-1],
        cond=prompts.repeat(cfg.grpo.group_size),
        advantages=torch.zeros(rows),
    )


def rollout_call(state: TrainingState, tensors: StepTensors) -> Callable[[], None]:
    """One of the rollout's N steps: every sample of the rank in one forward, without grad."""

    def call() -> None:
        with torch.no_grad():
            rows = tensors.latents.shape[0]
            v = state.predict(tensors.latents[:, 0], tensors.timesteps[0].expand(rows), tensors.cond)
            tensors.latents[:, 1] = tensors.latents[:, 0] + v * -0.05

    return call


def decode_call(cfg: TrainConfig, state: TrainingState, tensors: StepTensors) -> Callable[[], None]:
    def call() -> None:
        with torch.no_grad():
            z, model = tensors.latents[:, -1], cfg.model
            tensors.images = decode_in_chunks(
                state.backbone, z, rows=model.decode_batch, height=model.height, width=model.width
            )

    return call


def reference_call(cfg: TrainConfig, state: TrainingState, tensors: StepTensors) -> Callable[[], None]:
    """One of the W no-grad forwards of the KL reference per group: the frozen copy of full
    fine-tuning, or the policy with its LoRA adapters disabled."""
    rows = torch.arange(cfg.grpo.micro_batch)
    if state.reference is not None:
        reference = predictor(state.backbone, parse_dtype(cfg.model.dtype), cfg.plan.world_size, state.reference)
        adapters = nullcontext()
    else:
        reference, adapters = state.predict, lora_disabled(state.backbone.transformer)

    def call() -> None:
        with torch.no_grad(), adapters:
            reference(tensors.latents[rows, 0], tensors.timesteps[0].expand(len(rows)), tensors.cond.index(rows))

    return call


@contextmanager
def lora_disabled(transformer: nn.Module) -> Iterator[None]:
    transformer.disable_adapters()
    try:
        yield
    finally:
        transformer.enable_adapters()


def update_call(cfg: TrainConfig, state: TrainingState, tensors: StepTensors, mode: str) -> Callable[[], None]:
    """One group of one micro-batch through ``backward_group`` (the exact path on two of its steps)."""
    width = 2 if mode == "exact" else cfg.update.window
    rows = torch.arange(cfg.grpo.micro_batch)

    def call() -> None:
        cond = tensors.cond.index(rows)
        adv = tensors.advantages[rows]
        z = [tensors.latents[rows, k] for k in range(width)]
        z_next = [tensors.latents[rows, k + 1] for k in range(width)]

        def policy(z_b: Tensor, t_b: Tensor) -> Tensor:
            reps = z_b.shape[0] // len(rows)
            return state.predict(z_b, t_b, cond if reps == 1 else type(cond).cat([cond] * reps))

        def step_loss(j: int, v: Tensor) -> Tensor:
            mean = z[j] + v * -0.05
            return ((z_next[j] - mean).pow(2).mean(dim=(1, 2, 3)) * adv).mean()

        backward_group(mode, policy, step_loss, z, tensors.timesteps[:width])

    return call


def optimizer_call(cfg: TrainConfig, state: TrainingState) -> Callable[[], None]:
    def call() -> None:
        clip_grad_norm_(state.params, cfg.grpo.max_grad_norm)
        state.optimizer_step()

    return call


# ---- the plan ------------------------------------------------------------------------------------


@dataclass
class Phase:
    """One traced call on rank 0. Its peak includes the frozen models once ``plan`` adds them."""

    name: str  # rollout | decode | reference | optimizer | update <mode>
    peak_bytes: int
    working_bytes: int  # the call's own memory: its peak minus what was live when it started
    activation_bytes: int  # of which activations and backward temporaries, at the peak
    gathered_bytes: int  # of which all-gathered (unsharded) parameters, at the peak
    flops: int  # of one call; an update's call is one group of one micro-batch (exact scaled to W)
    calls_per_step: float  # calls per rank per training step
    checkpointing: bool | None = None  # updates: traced with activation checkpointing


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
    step_tensor_bytes: int
    frozen: list[FrozenModel]
    phases: list[Phase]  # rollout, decode, reference, optimizer
    updates: list[Phase]  # per traced mode, with and without activation checkpointing
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
            update = calls * next(u.flops for u in updates if u.name == "update exact")
        else:
            update = sum(u.calls_per_step * u.flops for u in updates)
        return update, update + sum(p.calls_per_step * p.flops for p in self.phases)


def reference_shards(state: TrainingState) -> list[Tensor]:
    """The KL reference's local shards: a second FSDP root, which the policy's tracker counts as inputs."""
    if state.reference is None:
        return []
    return [p.to_local() for p in state.reference.parameters()]


def _storage_bytes(tensors: Sequence[Tensor]) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def hold_gradients(state: TrainingState) -> None:
    """Gradients on every trainable shard, as the update of a later micro-batch finds them (FSDP2
    adds its reduce-scattered gradient to them)."""
    for p in state.params:
        p.grad = torch.zeros_like(p)


def traced_modes(groups: dict[str, float]) -> list[str]:
    """The update paths the run routes to, and exact (the baseline of the speed-up) in any case."""
    return [m for m in UPDATE_MODES if groups.get(m, 0) > 0 or m == "exact"]


def trace_updates(
    cfg: TrainConfig, state: TrainingState, tensors: StepTensors, groups: dict[str, float]
) -> list[Phase]:
    """One group of one micro-batch per traced mode, with ``cfg``'s activation checkpointing."""
    resident = tensors.tensors() + reference_shards(state)
    micro_batches = cfg.grpo.group_size * cfg.grpo.prompts_per_rank // cfg.grpo.micro_batch
    out = []
    for mode in traced_modes(groups):
        m = measure(state.backbone.transformer, state.optimizer, resident, update_call(cfg, state, tensors, mode))
        if mode == "exact":  # traced on two of its W identical steps
            m.flops = int(m.flops * cfg.update.window / 2)
        calls = micro_batches * groups.get(mode, 0)
        out.append(_phase(f"update {mode}", m, calls, checkpointing=cfg.model.activation_checkpointing))
    return out


@dataclass
class Traced:
    """Everything measured on rank 0 of the run as configured."""

    phases: list[Phase]
    updates: list[Phase]
    at_step: dict[str, int]  # tracker categories when the optimizer step starts: shards, gradients, state, inputs
    num_params: int
    num_trainable: int
    step_tensor_bytes: int
    reference_bytes: int
    image_tokens: int


def trace_step(cfg: TrainConfig, state: TrainingState, groups: dict[str, float]) -> Traced:
    """The phases in the order a step runs them, with gradients held where the trainer holds them."""
    tensors = step_tensors(cfg, state.backbone)
    root, opt, g = state.backbone.transformer, state.optimizer, cfg.grpo
    # the rollout and the decode run after the last optimizer step's zero_grad(set_to_none)
    phases = [
        _phase("rollout", measure(root, opt, tensors.tensors(), rollout_call(state, tensors)), cfg.sampler.num_steps),
        _phase("decode", measure(root, opt, tensors.tensors(), decode_call(cfg, state, tensors)), 1),
    ]
    hold_gradients(state)
    resident = tensors.tensors() + reference_shards(state)
    if g.kl_beta > 0:  # W forwards per group of each micro-batch
        calls = g.group_size * g.prompts_per_rank // g.micro_batch * sum(groups.values()) * cfg.update.window
        phases.append(_phase("reference", measure(root, opt, resident, reference_call(cfg, state, tensors)), calls))
    updates = trace_updates(cfg, state, tensors, groups)
    optimizer = measure(root, opt, resident, optimizer_call(cfg, state))
    phases.append(_phase("optimizer", optimizer, g.group_size * g.prompts_per_rank / g.gradient_accumulation_steps))
    return Traced(
        phases=phases,
        updates=updates,
        at_step=optimizer.at_start,
        num_params=sum(p.numel() for p in root.parameters()),
        num_trainable=sum(p.numel() for p in state.params),
        step_tensor_bytes=_storage_bytes(tensors.tensors()),
        reference_bytes=_storage_bytes(reference_shards(state)),
        image_tokens=math.prod(state.backbone.latent_grid(cfg.model.height, cfg.model.width)),
    )


def trace_other_checkpointing(cfg: TrainConfig, arch: Path, groups: dict[str, float]) -> list[Phase]:
    """The update traces with activation checkpointing flipped (a second model: checkpointing wraps
    the blocks before FSDP2 shards them)."""
    other = replace(cfg, model=replace(cfg.model, activation_checkpointing=not cfg.model.activation_checkpointing))
    state = build_state(other, arch)
    tensors = step_tensors(other, state.backbone)
    tensors.images = torch.empty(tensors.latents.shape[0], 3, cfg.model.height, cfg.model.width)
    hold_gradients(state)
    return trace_updates(other, state, tensors, groups)


def plan(cfg: TrainConfig, *, model_path_given: bool = False) -> PlanReport:
    """Trace one training step of ``cfg`` on rank 0 of plan.world_size fake ranks (module docstring)."""
    started = time.perf_counter()
    arch = arch_folder(cfg, model_path_given)
    frozen = frozen_models(cfg, arch)
    groups = expected_groups(cfg)
    with fake_process_group(cfg.plan.world_size), FakeTensorMode(), warnings.catch_warnings():
        # FSDP2 warns on every forward that FluxSingleTransformerBlock returns views; no path of ours
        # writes into them in place (tests/test_plan.py checks it), so the warning is noise here.
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
        traced = trace_step(cfg, build_state(cfg, arch), groups)
        updates = traced.updates + trace_other_checkpointing(cfg, arch, groups)
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
        step_tensor_bytes=traced.step_tensor_bytes,
        frozen=frozen,
        phases=traced.phases,
        updates=updates,
        seconds=time.perf_counter() - started,
    )


# ---- advice and the printed report ---------------------------------------------------------------


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.1f}"


Saving = tuple[str, dict[str, float], str]  # (the change, bytes it frees per phase name, how that is known)


def _static_savings(report: PlanReport, names: list[str]) -> list[Saving]:
    out = []
    text = sum(m.num_bytes for m in report.frozen if m.role == "text encoder")
    if text:
        change = "model.embedding_cache=<folder> (scripts/precompute_embeddings.py): no text encoders"
        out.append((change, dict.fromkeys(names, text), "exact"))
    if not report.lora:  # the rollout and the decode hold no gradients in any case
        held = report.optimizer_bytes + report.reference_bytes
        saved = {n: held + (report.grad_bytes if n not in ("rollout", "decode") else 0) for n in names}
        change = "model.lora.enabled=true: no full-size gradients, optimizer state or KL reference copy"
        out.append((change, saved, "estimate; trace it with model.lora.enabled=true"))
    evaluation = sum(m.num_bytes for m in report.frozen if m.role == "eval scorer")
    if evaluation:
        change = "logging.eval_every=0 (evaluate with python -m train.eval): no evaluation scorers kept"
        out.append((change, dict.fromkeys(names, evaluation), "exact"))
    return out


def _working_savings(report: PlanReport) -> list[Saving]:
    out = []
    current = {u.name: u for u in report.configured_updates()}
    if not report.checkpointing:
        other = {u.name: u for u in report.updates if u.checkpointing}
        saved = {name: u.peak_bytes - other[name].peak_bytes for name, u in current.items()}
        out.append(("model.activation_checkpointing=true", saved, "traced"))
    if report.groups.get("jagg", 0) > 0:
        saved = {"update jagg": current["update jagg"].activation_bytes / 2}
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
        "step tensors": report.step_tensor_bytes,
        **{f"{m.role} {m.name}": m.num_bytes for m in report.frozen},
    }
    if phase.name not in ("rollout", "decode"):
        terms["gradients"] = report.grad_bytes
    name = max(terms, key=terms.get)
    return f"{name} ({_gib(terms[name])} GiB)"


def _memory_lines(r: PlanReport) -> list[str]:
    lines = [
        "memory per rank, GiB",
        f"  transformer shards (float32)               {_gib(r.param_bytes):>7}",
        f"  gradients (float32 shards)                 {_gib(r.grad_bytes):>7}",
        f"  optimizer state (AdamW)                    {_gib(r.optimizer_bytes):>7}",
        f"  KL reference (shards)                      {_gib(r.reference_bytes):>7}",
        f"  step tensors (trajectory, images)          {_gib(r.step_tensor_bytes):>7}",
    ]
    for m in r.frozen:
        label = f"{m.role} {m.name} (replicated)"
        lines.append(f"  {label:<42} {_gib(m.num_bytes):>7}   {m.num_params / 1e9:.2f} B parameters")
    lines += ["", "phase peaks per rank, GiB (working: the phase's own activations, all-gathered blocks, temporaries)"]
    for p in [*r.phases, *r.updates]:
        label = p.name if p.checkpointing is None else f"{p.name}, {'AC' if p.checkpointing else 'no AC'}"
        note = "" if p.checkpointing in (None, r.checkpointing) else "  (other checkpointing setting)"
        lines.append(
            f"  {label:<22} peak {_gib(p.peak_bytes):>6}   working {_gib(p.working_bytes):>6}"
            f" (activations {_gib(p.activation_bytes)}, all-gathered {_gib(p.gathered_bytes)}){note}"
        )
    return lines


def _flop_lines(r: PlanReport) -> list[str]:
    lines = ["FLOPs per rank per training step, TFLOP (calls per step x TFLOP per call)"]
    for p in r.phases + r.configured_updates():
        lines.append(
            f"  {p.name:<22} {p.flops * p.calls_per_step / 1e12:>10.1f}   ({p.calls_per_step:g} x {p.flops / 1e12:.2f})"
        )
    update, step = r.flops_per_step()
    update_exact, step_exact = r.flops_per_step(exact=True)
    lines += [
        f"  update as routed       {update / 1e12:>10.1f}   every group exact: {update_exact / 1e12:.1f}"
        f" -> {update_exact / update:.2f}x faster at equal throughput",
        f"  training step          {step / 1e12:>10.1f}   every group exact: {step_exact / 1e12:.1f}"
        f" -> {step_exact / step:.2f}x faster at equal throughput",
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
        lines.append(f"fits: the largest phase is {peak.name} at {_gib(peak.peak_bytes)} GiB, within {budget}")
    else:
        over = _gib(peak.peak_bytes - r.budget_bytes)
        lines.append(f"does not fit: {peak.name} needs {_gib(peak.peak_bytes)} GiB, {over} GiB over {budget};")
        lines.append(f"  its largest term is {largest_term(r, peak)}. Each change alone:")
        lines += advice(r)
    lines.append(f"traced in {r.seconds:.0f} s")
    verdict = "fits" if r.fits else "does not fit"
    lines.append(f"peak per rank {_gib(peak.peak_bytes)} GiB of {r.gpu_memory_gib:g} GiB: {verdict}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> PlanReport:
    """``python -m train.plan [overrides]``: print the plan (and write it to plan.output as JSON)."""
    from hydra import compose, initialize_config_module

    register_schema()
    with initialize_config_module(config_module="configs", version_base=None):
        composed = compose(config_name="train", overrides=list(sys.argv[1:] if argv is None else argv))
    cfg, model_path_given = load_config(composed)
    report = plan(cfg, model_path_given=model_path_given)
    print(format_report(report))
    if cfg.plan.output is not None:
        Path(cfg.plan.output).write_text(json.dumps(asdict(report), indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
