"""The typed configuration schema of the trainer: one dataclass per group, and TrainConfig, their tree.

Every field says its unit and whether it is per rank or global, in its attribute docstring (what ``--help``
prints). The YAML tree under ``configs/`` fills these dataclasses (Hydra's ConfigStore registers them as
option ``train`` of the ``schema`` group, the first entry of ``configs/train.yaml``'s defaults list), so a
misspelled key, a wrong type or an unknown choice (an Enum) fails at compose time. Each group checks its own
ranges in ``__post_init__`` with a plain ValueError that starts with the field's name in the group; the trainer
prefixes the group's path (train/config/keys.py: "optimizer.lr must be > 0, got 0"). The rules across groups
are train/run/checks.py's ``validate``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from models.model_config import ModelConfig
from rewards.reward_config import RewardConfig
from samplers.choices import Choice
from samplers.sampler_config import SamplerConfig, check_range
from train.algorithm.update_config import UpdateConfig
from train.config.keys import not_allowable
from train.config.shipped import shipped

# An override that adds an evaluation scorer to an empty eval.scorers, as typed on the command line
# (``eval.scorers={jpeg_compressibility: {}}`` needs quotes in a shell; ``+`` adds the key to the typed dict).
SCORERS_HINT = "+eval.scorers.jpeg_compressibility={}"


class AdvStd(Choice):
    """grpo.adv_std: the group standard deviation that divides the advantages."""

    population = "population"  # Flow-GRPO's, over n
    unbiased = "unbiased"  # DanceGRPO's torch.std, over n - 1


class WandbMode(Choice):
    """logging.wandb_mode."""

    disabled = "disabled"
    offline = "offline"
    online = "online"


class Device(Choice):
    """device: where the transformer, the latents and the rewards live."""

    auto = "auto"  # CUDA when the launch has a GPU, else CPU
    cpu = "cpu"
    cuda = "cuda"


def _positive(value: float, name: str, why: str = "") -> None:
    check_range(value, name, low=0, low_open=True, why=why)


def _non_negative(value: float, name: str, why: str = "") -> None:
    check_range(value, name, low=0, why=why)


@dataclass
class GRPOConfig:
    """The GRPO objective: groups, advantages, the clipped ratio and the KL term (train/algorithm/grpo.py)."""

    group_size: int = 12
    """G: samples per prompt, all on one rank, sharing one initial noise; >= 2."""
    clip_range: float = 1e-4
    """PPO clip epsilon of the ratio, > 0."""
    adv_clip_max: float = 5.0
    """Advantages are clamped to +-adv_clip_max, > 0."""
    adv_eps: float = 1e-8
    """Added to the group std, >= 0 (Flow-GRPO's stat tracker: 1e-4)."""
    adv_std: AdvStd = AdvStd.population
    """population (Flow-GRPO's, n) | unbiased (DanceGRPO's torch.std, n - 1)."""
    global_std: bool = False
    """Normalize by the std of all rewards of the step (all ranks) instead of per group."""
    ratio_norm: bool = False
    """GRPO-Guard's RatioNorm: the PPO log-ratio (logp - logp_old + mean (mu - mu_old)^2 / (2 s^2)) s, s the step's
    transition std (train/algorithm/grpo.py), so the ratio stays centred at every step; the rollout then keeps its
    velocities (the sampling weights' mu_old). For sampler.sde=dance or flow (CPS's log-prob has no 1 / (2 s^2)).
    """
    kl_beta: float = 0.0
    """Flow-GRPO's beta (the paper's Table 4 values as they are): beta * mean (mu - mu_ref)^2 / (2 g^2) over the
    trained steps' transition means, g the step's diffusion coefficient, >= 0 (0 = off, no reference forwards).
    """

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 (advantages are relative within a group), got {self.group_size}")
        _positive(self.clip_range, "clip_range")
        _positive(self.adv_clip_max, "adv_clip_max")
        _non_negative(self.adv_eps, "adv_eps")
        _non_negative(self.kl_beta, "kl_beta", " (0 = no KL term)")


@dataclass
class BatchConfig:
    """How a step's samples are split: prompts per rank, micro-batches, optimizer steps (all per rank)."""

    prompts_per_rank: int = 1
    """Prompts per rank per training step (per rank)."""
    micro_batch: int = 1
    """Samples per forward/backward in the update (per rank); divides gradient_accumulation_steps."""
    gradient_accumulation_steps: int = 12
    """Samples per rank per optimizer step; divides grpo.group_size * prompts_per_rank."""

    def __post_init__(self) -> None:
        for name in ("prompts_per_rank", "micro_batch", "gradient_accumulation_steps"):
            _positive(getattr(self, name), name)
        if self.gradient_accumulation_steps % self.micro_batch:
            raise ValueError(
                f"micro_batch={self.micro_batch} must divide "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps}"
            )


@dataclass
class OptimizerConfig:
    """AdamW and the gradient clip (AdamW's own checks run only once the model is loaded: the same, up front)."""

    lr: float = 1e-5
    """AdamW learning rate, in (0, 1) (on resume the configured value replaces the checkpoint's): AdamW moves every
    weight by about lr per step, so 1 or more can only be a typo (usual values: 1e-5 to 1e-3)."""
    weight_decay: float = 1e-4
    """AdamW decoupled weight decay, >= 0."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW (beta1, beta2), each in [0, 1)."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip, across all shards, > 0."""

    def __post_init__(self) -> None:
        _positive(self.lr, "lr")
        typo = " (AdamW moves every weight by about lr per step: usual values are 1e-5 to 1e-3)"
        check_range(self.lr, "lr", high=1, high_open=True, why=typo)
        _non_negative(self.weight_decay, "weight_decay")
        if len(self.betas) != 2:
            raise ValueError(f"betas must be two numbers [beta1, beta2], got {list(self.betas)}")
        for i, beta in enumerate(self.betas):
            check_range(beta, f"betas[{i}]", low=0, high=1, high_open=True)
        _positive(self.max_grad_norm, "max_grad_norm")


@dataclass
class EMAConfig:
    """An exponential moving average of the trainable weights, for evaluation and the export."""

    decay: float = 0.0
    """EMA of trainable weights for evaluation, in [0, 1) (0 = off)."""

    def __post_init__(self) -> None:
        check_range(self.decay, "decay", low=0, high=1, high_open=True, why=" (0 = no EMA)")


@dataclass
class HealthConfig:
    """When a run that cannot learn, or that diverged, stops (train/observe/health.py)."""

    max_bad_steps: int = 10
    """Stop (after a checkpoint) once this many consecutive steps skipped their update (a NaN reward, a non-finite
    gradient) or had a zero gradient (every advantage 0): such a run cannot learn; a run none of whose steps
    changed the weights stops so at its end, without an export (0 = never stop).
    """
    max_weight_growth: float = 10.0
    """Stop, without saving the weights, once the L2 norm of the trainable weights (over all ranks) is more than
    this many times its value at the start of the run (the model as loaded, or LoRA's initial adapters), or less
    than 1 / this: the run diverged (logged as health/weight_growth; a sane run stays within a few percent of 1
    when it trains every weight, within a few times 1 with LoRA); > 1 (0 = never stop).
    """
    flat_image_range: float = 1 / 255
    """An image whose pixel values (in [0, 1]) span less than this (1/255: one level of an 8-bit image) is one flat
    colour; a step whose every image is flat stops the run without saving the weights that sampled them: the policy
    collapsed (logged as health/flat_images, the fraction of flat images); in [0, 1) (0 = never stop).
    """

    def __post_init__(self) -> None:
        _non_negative(self.max_bad_steps, "max_bad_steps", " (0 = never stop)")
        if self.max_weight_growth != 0:
            check_range(self.max_weight_growth, "max_weight_growth", low=1, low_open=True, why=" (0 = never stop)")
        check_range(self.flat_image_range, "flat_image_range", low=0, high=1, high_open=True, why=" (0 = never stop)")


@dataclass
class DataConfig:
    """The training prompts."""

    train_prompts: str = MISSING
    """Text file, one prompt per line."""


@dataclass
class LoggingConfig:
    """Metrics, wandb, sample grids and the progress line (train/observe/logger.py)."""

    wandb_mode: WandbMode = WandbMode.disabled
    """disabled | offline | online."""
    project: str = "jagg-grpo"
    """wandb project."""
    entity: str | None = None
    """wandb entity (user or team); null = wandb's default entity."""
    group: str | None = None
    """wandb group; null = the experiment name (scripts/launch/compare_modes.sh sets one)."""
    name: str | None = None
    """wandb run name; null = <experiment>-<update.mode>-s<seed>."""
    tags: list[str] = field(default_factory=list)
    """wandb tags, added to the automatic ones (mode, seed<N>, sde)."""
    notes: str | None = None
    """wandb notes: a sentence on what this run tests."""
    sample_every: int = 0
    """Save (and send to wandb) a captioned grid of rollout images every N steps (0 = never)."""
    progress_bar: bool = True
    """A tqdm bar on rank 0; when false, a heartbeat line instead."""
    heartbeat_s: float = 60.0
    """progress_bar=false: seconds between progress lines (0 = one line per step)."""

    def __post_init__(self) -> None:
        if self.wandb_mode is not WandbMode.disabled and not self.project.strip():
            raise ValueError("project is empty: name the wandb project")
        _non_negative(self.sample_every, "sample_every", " (0 = never)")
        _non_negative(self.heartbeat_s, "heartbeat_s", " (0 = a line per step)")


@dataclass
class CheckpointConfig:
    """Checkpoints and the export (train/checkpoint/manager.py)."""

    every: int = 0
    """Save every N steps (0 = only at the end); the last step is always saved."""
    keep_last: int = 3
    """Complete checkpoints kept, >= 1; older ones are deleted after each save."""
    export: bool = True
    """Write the trained transformer (or LoRA) in diffusers format at the end."""
    overwrite: bool = False
    """Start a new run in a run folder that holds one, deleting its checkpoints, metrics, export and samples;
    without it (and without resume=) such a folder is refused.
    """
    allow_changed: list[str] = field(default_factory=list)
    """Settings a resumed run may change although they change what the weights mean or what the next steps compute
    (RESUME_SETTINGS of train/config/keys.py: model.name/path/dtype/height/width/options, model.lora.*, seed,
    data.train_prompts (its prompts), sampler.*, update.*, grpo.*, batch.* (per rank: compared as the global batch
    with the world size), reward.*, ema.*), e.g. [seed]; any other change of these is refused.
    """

    def __post_init__(self) -> None:
        _non_negative(self.every, "every", " (0 = only at the end)")
        _positive(self.keep_last, "keep_last")
        for key in self.allow_changed:
            if problem := not_allowable(key):
                raise ValueError(f"allow_changed: {problem}")


@dataclass
class EvalConfig:
    """Evaluation: during training (``every``) and by python -m train.eval (train/evaluation/protocol.py)."""

    every: int = 0
    """Evaluate before training, every N steps and after the last step (0 = never); eval/* at step k = after k steps."""
    prompts: str | None = None
    """Text or jsonl ({"prompt", "category"}) file of the evaluation prompts; null = data.train_prompts."""
    num_prompts: int = 0
    """The first this many of the evaluation prompts; 0 = all of them."""
    heldout_prompts: str | None = None
    """Prompts kept out of training, evaluated with the eval prompts (as many samples each) and logged as
    eval/<metric>/held-out: whether training on a prompt subset generalises (null = none).
    """
    num_steps: int = 28
    """ODE steps of evaluation sampling."""
    batch_size: int = 4
    """Prompts per rank per sampling call."""
    seed: int = 0
    """Prompt i starts from the noise of the stream (seed, "eval_noise", i) (train/distributed/seeds.py)."""
    samples_per_prompt: int = 1
    """Images per prompt, each from its own noise: sample j of prompt i (of n) is evaluation item j * n + i, so
    sample 0 keeps the noise of samples_per_prompt=1; more samples shrink the spread of a small prompt set.
    """
    grid_size: int = 16
    """Images in the PNG grid (the first prompts), and pairs in the before/after sheet."""
    transformer: str | None = None
    """python -m train.eval: the weights to evaluate: an export (<run>/export), a training checkpoint
    (<run>/checkpoints/step_XXXXXXXX) or a run folder (its export, else its latest checkpoint); null = pretrained.
    """
    compare_pretrained: bool = False
    """python -m train.eval: also evaluate the pretrained model (same prompts and noise) and report the paired
    difference.
    """
    max_images: int = 3200
    """The most images one evaluation may sample (prompts x samples_per_prompt, held-out ones included), >= 1: a
    larger set (eval.prompts unset falls back to every training prompt) is refused; cut it with num_prompts.
    """
    scorers: dict[str, dict] = field(default_factory=dict)
    """Metric name (hpsv2 | pickscore | clipscore | jpeg_compressibility | ...) -> scorer arguments (local paths)."""

    def __post_init__(self) -> None:
        _non_negative(self.every, "every", " (0 = never)")
        _non_negative(self.num_prompts, "num_prompts", " (0 = all of them)")
        for name in ("num_steps", "batch_size", "samples_per_prompt", "grid_size", "max_images"):
            _positive(getattr(self, name), name)
        if self.every and not self.scorers:
            raise ValueError(f"every > 0 needs eval.scorers: add one, e.g. {SCORERS_HINT} (docs/rewards.md)")


@dataclass
class PerfConfig:
    """Performance accounting (train/observe/perf.py)."""

    peak_tflops: float | None = None
    """Peak TFLOP/s of one device, the denominator of perf/mfu/<phase>; null = the device's: the table of
    train/observe/perf.py on a GPU (A100, H100, H200, B200 bf16 dense), on CPU this machine's float32 matmul
    rate measured once at start-up; > 0.
    """

    def __post_init__(self) -> None:
        if self.peak_tflops is not None:
            _positive(self.peak_tflops, "peak_tflops", " (null = the device's own)")


@dataclass
class DistConfig:
    """The process group and the device mesh (train/distributed/)."""

    timeout_s: float = 1800.0
    """Seconds a collective may wait for the other ranks before this rank fails with a message naming it (a hung,
    stopped or dead rank). Longer than any legitimate wait: a slow checkpoint save or evaluation.
    """
    replicate_degree: int = 1
    """HSDP: R > 1 replicates the model over R groups of world / R ranks, each group sharding it (one group per
    node: all-gathers stay inside a node, gradients are all-reduced across nodes); R must divide the world size.
    1 = FSDP over every rank. Checkpoints load across a change of R or of the world size.
    """

    def __post_init__(self) -> None:
        _positive(self.timeout_s, "timeout_s")
        _positive(self.replicate_degree, "replicate_degree", " (1 = shard over every rank)")


@dataclass
class TrainConfig:
    """The trainer's settings: the run itself, then one group per component."""

    experiment: str = "demo"
    """Name used for the wandb group and the run folder."""
    run_dir: str = ""
    """Shared run folder of all ranks; "" = Hydra's output folder (hydra.run.dir)."""
    seed: int = 42
    """Every random stream derives from (seed, purpose, index) (train/distributed/seeds.py)."""
    num_steps: int = 10
    """Training steps (rollout + update)."""
    resume: str | None = None
    """null | auto (latest checkpoint in run_dir) | path to a checkpoint folder."""
    device: Device = Device.auto
    """auto | cpu | cuda."""
    model: ModelConfig = field(default_factory=ModelConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    update: UpdateConfig = field(default_factory=UpdateConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    ema: EMAConfig = field(default_factory=EMAConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    perf: PerfConfig = field(default_factory=PerfConfig)

    def __post_init__(self) -> None:
        if not self.experiment.strip():
            raise ValueError("experiment must name the run (it is the wandb group and part of the run folder)")
        _positive(self.num_steps, "num_steps")
        if self.device is Device.cuda and not torch.cuda.is_available():
            raise ValueError("device=cuda but CUDA is not available on this machine; use device=cpu or device=auto")


def register_schema(name: str = "train", schema: type = TrainConfig) -> None:
    """Store ``schema`` as option ``name`` of the ``schema`` group: configs/train.yaml composes the
    trainer's; a command with settings of its own (configs/probe.yaml) overrides it with a subclass. The shipped
    defaults' resolver (``${shipped:<package>/<path>}``) comes with it: every composition of configs/ needs it."""
    ConfigStore.instance().store(group="schema", name=name, node=schema)
    OmegaConf.register_new_resolver("shipped", lambda reference: str(shipped(reference)), replace=True)
