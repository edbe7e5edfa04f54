"""One training step of the run traced on fake tensors: the run's parts built by the trainer's own
code (train.model.builder.setup_trainable, FSDP2, AdamW, the EMA) and the trainer's own step
functions (train.step, train.algorithm.update) run phase by phase under ``measure``."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn

from models.base import Conditioning, parse_dtype
from models.diffusers_backbone import DiffusersBackbone
from samplers.rollout import Predict, Trajectory, stochastic_flags, trainable_flags
from samplers.schedule import shifted_sigmas
from train.algorithm.jagg import EXACT_BATCHED, UPDATE_MODES
from train.algorithm.segments import RoutedSegment, pick_segments, route_segments
from train.algorithm.update import UpdateBatch, update_micro_batch
from train.algorithm.update_config import MIDDLE_MODES, UpdateMode
from train.config.checks import trainable_transitions
from train.config.schema import TrainConfig
from train.distributed.parallelize import clip_grad_norm_, local_tensor
from train.model.builder import setup_trainable
from train.model.predict import kl_reference, predictor
from train.optim.ema import EMA
from train.optim.optimizer import adamw_settings, build_ema
from train.plan.fake import Measured, default_dtype, fake_deepcopy, known, measure
from train.plan.frozen import build_component, diffusers_backbone_class, read_json
from train.plan.plan_config import PlanRunConfig
from train.plan.report import Evaluation, Phase, to_phase
from train.step import decode_images, micro_batches, sample_trajectories, step_weights

CPU = torch.device("cpu")  # the one device of every fake tensor


EXACT_TRACED_STEPS = 2  # the exact path's steps are alike and run one after another: two show its peak


def expected_segments(cfg: TrainConfig, mode: str | None = None) -> dict[str, float]:
    """Expected segments per micro-batch of each update path, over the random segment pick
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
        every = route_segments(
            trainable,
            length=u.segment_length,
            mode=UpdateMode(mode or u.mode),
            jagg_frac=u.jagg_frac,
            num_transitions=s.num_steps - 1,
        )
        picked = len(pick_segments(trainable, length=u.segment_length, timestep_fraction=u.timestep_fraction))
        for segment in every:  # a uniform random subset: each segment is picked with probability picked / len
            counts[segment.mode] = counts.get(segment.mode, 0.0) + picked / len(every) / len(starts)
    return counts


class LocalShardAdamW(torch.optim.AdamW):
    """The trainer's AdamW (``train.optim.optimizer.adamw_settings``) stepping each rank's local shards.

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
    ``train.model.builder.setup_trainable`` (LoRA or full fine-tuning, the KL reference, activation
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
    optimizer = LocalShardAdamW(params, **adamw_settings(cfg))
    run = TracedRun(cfg, backbone, params, optimizer, build_ema(params, cfg.ema.decay), reference)
    hold_gradients(run)
    step_weights(run.optimizer, run.ema)  # the moments exist from the first step on
    run.optimizer.zero_grad(set_to_none=True)
    return run


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
    """A predictor that runs its first call of each input shape and answers each later one with an
    uninitialized tensor of that call's output shape and dtype.

    The rollout's N steps call the transformer with the same shapes (and, with the shared start, its
    first steps with one row per group): the first forward of each shape traced gives a step's memory,
    and the rows of all calls (``called_rows``) against the traced ones (``traced_rows``) scale its
    FLOPs, which are per row. The sampler's own loop (trajectory buffers, SDE steps, log-probabilities,
    kept velocities) still runs every step, at a fraction of the CPU.
    """

    def __init__(self, predict: Predict) -> None:
        self.predict = predict
        self.first: dict[torch.Size, tuple[torch.Size, torch.dtype]] = {}  # input shape -> (output shape, dtype)
        self.traced_rows = self.called_rows = self.calls = 0

    def __call__(self, z: Tensor, t: Tensor, cond: Any) -> Tensor:
        self.called_rows += z.shape[0]
        self.calls += 1
        if z.shape not in self.first:
            v = self.predict(z, t, cond)
            self.first[z.shape] = (v.shape, v.dtype)
            self.traced_rows += z.shape[0]
            return v
        shape, dtype = self.first[z.shape]
        return torch.empty(shape, dtype=dtype, device=z.device)


def rollout_call(run: TracedRun, tensors: StepTensors, predict: TracedOnce) -> Callable[[], None]:
    """The rollout of every sample of the rank (``train.step.sample_trajectories``: the sampler's N
    steps, the transformer traced on the first, ``TracedOnce``) from conditioning and noise shaped as
    ``rollout_phase`` makes them."""
    cfg, backbone = run.cfg, cast(DiffusersBackbone, run.backbone)
    g, b, s, window = cfg.grpo, cfg.batch, cfg.sampler, first_window(cfg)

    def call() -> None:
        cond = conditioning(backbone, b.prompts_per_rank, text_tokens(cfg)).repeat(g.group_size)
        noise = backbone.initial_noise(b.prompts_per_rank, height=cfg.model.height, width=cfg.model.width)
        # The schedule's values change no shape: a fixed shift stands in for a dynamic one.
        sigmas = known(lambda: shifted_sigmas(s.num_steps, s.shift if s.shift is not None else 1.0))
        traj = sample_trajectories(
            predict,
            cfg,
            cond,
            noise.repeat_interleave(g.group_size, dim=0),
            sigmas=sigmas,
            group_ids=torch.arange(b.prompts_per_rank).repeat_interleave(g.group_size),
            sde_window=window,
            sde_noise=[torch.Generator().manual_seed(i) for i in range(b.prompts_per_rank)],
            keep_velocities=cfg.update.keeps_velocities(ratio_norm=cfg.grpo.ratio_norm),
            velocity_dtype=parse_dtype(cfg.model.dtype),
        )
        flags = stochastic_flags(s.num_steps, traj.sde, window)  # readable, for transition() and the plan
        stochastic = known(lambda: torch.tensor(flags, dtype=torch.bool))
        trainable = known(lambda: torch.tensor(trainable_flags(flags), dtype=torch.bool))
        tensors.traj = replace(traj, stochastic=stochastic, trainable=trainable)

    return call


def decode_call(run: TracedRun, tensors: StepTensors) -> Callable[[], None]:
    """The decode of the rollout's final latents before scoring (``train.step.decode_images``)."""
    cfg = run.cfg

    def call() -> None:
        assert tensors.traj is not None
        tensors.images = decode_images(run.backbone, tensors.traj.latents[:, -1], cfg.model)

    return call


def update_call(run: TracedRun, tensors: StepTensors, mode: str, *, reuse: bool) -> Callable[[], None]:
    """One segment of W steps of one micro-batch through ``train.algorithm.update.update_micro_batch`` (the GRPO loss,
    the KL reference's batched call, ``backward_segment``), on the rollout's velocities when ``reuse``;
    ``mode`` exact_batched: an exact segment with update.exact_batched. Without the shared start."""
    cfg, traj = run.cfg, tensors.traj
    assert traj is not None and tensors.advantages is not None
    batch = UpdateBatch(
        traj=traj,
        advantages=tensors.advantages,
        predict=run.policy(),
        reference=run.kl_reference(),
        config=replace(cfg.update, exact_batched=mode == EXACT_BATCHED),
        grpo=cfg.grpo,
        gradient_accumulation_steps=cfg.batch.gradient_accumulation_steps,
    )
    start = traj.trainable_steps()[0]
    width = EXACT_TRACED_STEPS if mode == "exact" else cfg.update.segment_length
    segment = RoutedSegment(start, start + width, UpdateMode("exact" if mode == EXACT_BATCHED else mode))
    rows = torch.arange(cfg.batch.micro_batch)

    def call() -> None:
        update_micro_batch(batch, rows, [segment], reuse_velocities=reuse)  # its scale changes nothing traced

    return call


def optimizer_call(run: TracedRun) -> Callable[[], None]:
    """``train.step.optimizer_step`` but for its finiteness test (a value): the global-norm clip, the
    AdamW step and the EMA, then zero_grad."""

    def call() -> None:
        clip_grad_norm_(run.params, run.cfg.optimizer.max_grad_norm)
        step_weights(run.optimizer, run.ema)
        run.optimizer.zero_grad(set_to_none=True)

    return call


@dataclass
class Forwards:
    """Transformer forwards a traced call ran (the policy's and the KL reference's), by whether with gradients."""

    with_grad: int = 0
    without_grad: int = 0

    def count(self, *_: Any) -> None:
        if torch.is_grad_enabled():
            self.with_grad += 1
        else:
            self.without_grad += 1


def measure_counting(run: TracedRun, resident: Sequence[Tensor], call: Callable[[], None]) -> tuple[Measured, Forwards]:
    """``measure`` of ``call``, with the forwards of the transformer and of the KL reference copy counted."""
    forwards = Forwards()
    roots = [m for m in (run.backbone.transformer, run.reference) if m is not None]
    hooks = [m.register_forward_pre_hook(forwards.count) for m in roots]
    try:
        return measure(run.backbone.transformer, run.optimizer, resident, call), forwards
    finally:
        for hook in hooks:
            hook.remove()


def _storage_bytes(tensors: Sequence[Tensor]) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


def reference_shards(run: TracedRun) -> list[Tensor]:
    """The KL reference's local shards: a second FSDP root, which the policy's tracker counts as inputs."""
    return [] if run.reference is None else [local_tensor(p) for p in run.reference.parameters()]


def ema_shards(run: TracedRun) -> list[Tensor]:
    """The EMA's float32 local shards (held by no module or optimizer: counted as inputs)."""
    return [] if run.ema is None else [local_tensor(s) for s in run.ema.shadow]


def update_variants(
    cfg: TrainConfig, segments: dict[str, float], *, kept_velocities: bool
) -> list[tuple[str, bool, float]]:
    """(path, on the rollout's velocities, calls per rank per step) for each update call the run makes,
    and exact (the baseline of the speed-up) and exact_batched (its memory) in any case.
    ``update.reuse_velocities=fresh`` reuses them until the first optimizer step of the step moves the
    weights: the first of B / accumulation chunks."""
    b = cfg.batch
    samples = cfg.grpo.group_size * b.prompts_per_rank
    num_micro_batches = samples // b.micro_batch
    reused = 1.0 if cfg.update.reuse_velocities == "stale" else b.gradient_accumulation_steps / samples
    out = []
    for mode in UPDATE_MODES:
        calls = num_micro_batches * segments.get(mode, 0.0)
        if calls == 0 and mode != "exact":
            continue
        if kept_velocities and mode in MIDDLE_MODES:
            out.append((mode, True, calls * reused))
            if reused < 1:
                out.append((mode, False, calls * (1 - reused)))
        elif mode == "exact":
            batched = cfg.update.exact_batched
            out += [(mode, False, 0.0 if batched else calls), (EXACT_BATCHED, False, calls if batched else 0.0)]
        else:
            out.append((mode, False, calls))
    return out


def _optimizer_steps(cfg: TrainConfig) -> list[list[dict[int, int]]]:
    """Per optimizer step of a rank's step, its micro-batches: each the rows it holds of each sample
    group (G rows that share a start)."""
    g, b = cfg.grpo, cfg.batch
    return [
        [dict(Counter(row // g.group_size for row in rows)) for rows in micro_batches(cfg, chunk)]
        for chunk in range(0, g.group_size * b.prompts_per_rank, b.gradient_accumulation_steps)
    ]


def _per_group(micro: list[dict[int, int]]) -> dict[int, list[int]]:
    """Each sample group's rows in each micro-batch that holds any."""
    out: dict[int, list[int]] = {}
    for rows in micro:
        for group, num in rows.items():
            out.setdefault(group, []).append(num)
    return out


def _start_step(cfg: TrainConfig, mode: str | None = None) -> tuple[float, str] | None:
    """(probability that a micro-batch trains the shared step, the path of the segment that starts there),
    None where nothing is shared (update.share_group_start off, G = 1). ``mode`` as in ``expected_segments``."""
    g, u = cfg.grpo, cfg.update
    if not u.share_group_start or g.group_size < 2:
        return None
    window = first_window(cfg)
    trainable = trainable_transitions(cfg.sampler, None if window is None else window[0])
    transitions = cfg.sampler.num_steps - 1
    segments = route_segments(
        trainable,
        length=u.segment_length,
        mode=UpdateMode(mode or u.mode),
        jagg_frac=u.jagg_frac,
        num_transitions=transitions,
    )
    p = len(pick_segments(trainable, length=u.segment_length, timestep_fraction=u.timestep_fraction)) / len(segments)
    return p, segments[0].mode


def expected_shared_rows(cfg: TrainConfig) -> float:
    """Rows per rank and step whose first trainable step the shared start runs once per group instead of
    once per row (``train.algorithm.update.shared_start``): per optimizer step, the rows that train it less
    the groups among them, expected over the random segment pick of each micro-batch."""
    start = _start_step(cfg)
    if start is None:
        return 0.0
    p, _ = start
    saved = 0.0
    for step in _optimizer_steps(cfg):
        for rows in _per_group(step).values():  # each micro-batch trains the step with probability p
            saved += p * sum(rows) - (1 - (1 - p) ** len(rows))
    return saved


def _shares(rows: list[int], p: float) -> float:
    """Probability that two or more of a group's rows train the shared step (micro-batches of ``rows``)."""
    m = len(rows)
    return 1 - (1 - p) ** m - sum(p * (1 - p) ** (m - 1) for r in rows if r == 1)


def expected_shared_calls(cfg: TrainConfig, mode: str | None = None) -> tuple[float, float]:
    """(transformer forwards, backwards) per rank and step that the shared start adds; negative: saves.

    An optimizer step whose rows share (two rows of one group train the step) runs the shared forward
    with gradients, its backward and, with a KL term, the reference's no-grad forward of it; each of
    its micro-batches that trains the step then leaves that step to it: on exact (not batched) and
    jagg_sequential one forward and one backward fewer, while exact_batched, jagg and ablate run the
    same batched calls on fewer rows. Expected over the random segment pick of each micro-batch (train
    with probability p each), taking the groups as independent (exact when no micro-batch spans two).
    ``mode`` as in ``expected_segments``."""
    start = _start_step(cfg, mode)
    if start is None:
        return 0.0, 0.0
    p, path = start
    per_micro = 1.0 if path == "jagg_sequential" or (path == "exact" and not cfg.update.exact_batched) else 0.0
    shared_forwards = 1.0 + (cfg.grpo.kl_beta > 0)
    forwards = backwards = 0.0
    for step in _optimizer_steps(cfg):
        groups = _per_group(step)
        alone = {g: 1 - _shares(rows, p) for g, rows in groups.items()}  # fewer than two of its rows train it
        none = math.prod(alone.values())
        forwards += (1 - none) * shared_forwards
        backwards += 1 - none
        for rows in step:  # this micro-batch trains the step (p), and the start is formed
            unshared = math.prod(
                0.0 if num >= 2 else (1 - p) ** (len(groups[g]) - 1) for g, num in rows.items()
            ) * math.prod(a for g, a in alone.items() if g not in rows)
            taken = p * (1 - unshared) * per_micro
            forwards -= taken
            backwards -= taken
    return forwards, backwards


def trace_updates(run: TracedRun, tensors: StepTensors, segments: dict[str, float]) -> list[Phase]:
    """Every update call of the run (``update_variants``) on one segment of one micro-batch, with the
    run's activation checkpointing and gradients held."""
    cfg = run.cfg
    assert tensors.traj is not None
    offloaded = cfg.update.offload_velocities
    resident = tensors.resident(offloaded_velocities=offloaded) + reference_shards(run) + ema_shards(run)
    out = []
    for mode, reuse, calls in update_variants(cfg, segments, kept_velocities=cfg.update.reuses_velocities):
        m, forwards = measure_counting(run, resident, update_call(run, tensors, mode, reuse=reuse))
        backwards = float(forwards.with_grad)  # each graph is backpropagated once
        if mode == "exact":  # its W steps, each freed before the next, traced on EXACT_TRACED_STEPS
            m.flops = round(m.flops * cfg.update.segment_length / EXACT_TRACED_STEPS)
            backwards *= cfg.update.segment_length / EXACT_TRACED_STEPS
        name = f"update {mode}" + (", rollout velocities" if reuse else "")
        calls_of = {"forwards": forwards.without_grad + backwards, "backwards": backwards}
        checkpointing = cfg.model.activation_checkpointing
        out.append(to_phase(name, m, calls, checkpointing=checkpointing, mode=mode, **calls_of))
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
    shared_rollout_flops: float  # what the rollout's shared start saves (rows of the steps before the first SDE noise)
    forward_flops_per_row: float  # of one transformer forward of one row without gradients (the rollout's)
    image_tokens: int


def trace_step(run: TracedRun, segments: dict[str, float]) -> Traced:
    """The phases in the order a step runs them, with gradients held where the trainer holds them."""
    cfg, b = run.cfg, run.cfg.batch
    root, opt = run.backbone.transformer, run.optimizer
    offloaded = cfg.update.offload_velocities
    always = reference_shards(run) + ema_shards(run)
    tensors = StepTensors()
    # the rollout and the decode run after the last optimizer step's zero_grad(set_to_none)
    predict = TracedOnce(run.policy())
    rollout = measure(root, opt, always, rollout_call(run, tensors, predict))
    assert tensors.traj is not None
    if offloaded and tensors.traj.velocities is not None:  # allocated during the rollout, in host memory
        rollout.peak_bytes -= _storage_bytes([tensors.traj.velocities])
    per_row = rollout.flops / predict.traced_rows  # counted: the first forward of each shape (TracedOnce)
    rollout.flops = round(per_row * predict.called_rows)
    shared_rollout_flops = per_row * (cfg.sampler.num_steps * tensors.traj.batch_size - predict.called_rows)
    phases = [to_phase("rollout", rollout, 1, forwards=predict.calls)]
    decode = measure(root, opt, always + tensors.resident(offloaded_velocities=offloaded), decode_call(run, tensors))
    phases.append(to_phase("decode", decode, 1))
    tensors.advantages = torch.zeros(tensors.traj.batch_size)
    hold_gradients(run)
    updates = trace_updates(run, tensors, segments)
    resident = always + tensors.resident(offloaded_velocities=offloaded)
    optimizer = measure(root, opt, resident, optimizer_call(run))
    phases.append(
        to_phase("optimizer", optimizer, cfg.grpo.group_size * b.prompts_per_rank / b.gradient_accumulation_steps)
    )
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
        shared_rollout_flops=shared_rollout_flops,
        forward_flops_per_row=per_row,
        image_tokens=math.prod(cast(DiffusersBackbone, run.backbone).latent_grid(cfg.model.height, cfg.model.width)),
    )


def trace_other_checkpointing(
    cfg: PlanRunConfig, arch: Path, tensors: StepTensors, segments: dict[str, float]
) -> list[Phase]:
    """The update traces with activation checkpointing flipped, on the same step's tensors (a second
    model: checkpointing wraps the blocks before FSDP2 shards them)."""
    other = replace(cfg, model=replace(cfg.model, activation_checkpointing=not cfg.model.activation_checkpointing))
    run = traced_run(other, arch)
    hold_gradients(run)
    return trace_updates(run, tensors, segments)


def evaluation(cfg: PlanRunConfig, forward_flops_per_row: float) -> Evaluation | None:
    """The run's evaluations (train/trainer.py: before training, every eval.every steps, after the
    last step) on rank 0: eval.num_prompts x eval.samples_per_prompt images, or eval.max_images (the
    most one may sample) when it takes every prompt of a file the planner does not read."""
    every, e = cfg.eval.every, cfg.eval
    if every <= 0:
        return None
    count = 1 + cfg.num_steps // every + (cfg.num_steps % every != 0)
    prompts = cfg.eval.num_prompts
    images = prompts * e.samples_per_prompt if prompts > 0 else e.max_images
    per_rank = math.ceil(images / cfg.plan.world_size)
    calls = math.ceil(per_rank / e.batch_size) * e.num_steps
    return Evaluation(count, images, per_rank, float(calls), per_rank * e.num_steps * forward_flops_per_row)
