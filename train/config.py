"""The typed configuration schema of the trainer, and its validation.

Every field says its unit and whether it is per rank or global. The YAML tree under ``configs/``
fills these dataclasses (Hydra's ConfigStore registers them as ``train_schema``, the first entry
of ``configs/train.yaml``'s defaults list), so a misspelled key or a wrong type fails at compose
time. ``validate`` then rejects impossible combinations before any model is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from rewards.combine import COMBINE_MODES
from samplers.sde import SDE_KINDS
from train.jagg import UPDATE_MODES, split_groups

DTYPES = ("float32", "bfloat16", "float16")
ROUTINGS = ("prefix", "auto")  # update.routing (train/routing.py)
WANDB_MODES = ("disabled", "offline", "online")


@dataclass
class LoraConfig:
    enabled: bool = False  # train LoRA adapters instead of every transformer weight
    rank: int = 64  # r: rank of each adapter's B A
    alpha: int = 128  # scaling: the adapter adds alpha / r * B A
    init: str = "gaussian"  # peft init_lora_weights


@dataclass
class ModelConfig:
    name: str = "flux"  # backbone registry key: flux | qwenimage (models/registry.py)
    path: str = MISSING  # local diffusers pipeline folder (no hub downloads)
    build_tiny: str | None = None  # "tiny" | "small": build a random offline pipeline at `path` if absent (CPU demos)
    dtype: str = "float32"  # transformer parameter/compute dtype: float32 | bfloat16 | float16
    height: int = 32  # image height in pixels
    width: int = 32  # image width in pixels
    # adapter options for models.registry.load_backbone: Flux guidance / max_sequence_length (text tokens
    # per prompt; longer prompts are truncated with a warning), per-component folders (e.g. vae: /path)
    options: dict = field(default_factory=dict)
    embedding_cache: str | None = None  # cache folder written by scripts/precompute_embeddings.py
    activation_checkpointing: bool = False  # recompute each transformer block in backward
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class SamplerConfig:
    sde: str = "dance"  # transition kind: dance (constant eta) | flow (noise_level) | ode
    num_steps: int = 21  # denoising steps N per rollout; the last transition is never trained
    shift: float | None = 3.0  # fixed timestep shift; null = the backbone's own (dynamic) schedule
    eta: float = 0.3  # dance: diffusion coefficient g (constant)
    noise_level: float = 0.7  # flow: g = noise_level * sqrt(sigma / (1 - sigma))
    quantize_timesteps: bool = False  # feed int(1000 sigma) / 1000 to the transformer (DanceGRPO)
    sde_window_size: int = 0  # Flow-GRPO-Fast: >0 = SDE only on this many consecutive steps, ODE elsewhere
    sde_window_range: list[int] = field(default_factory=lambda: [0, 12])  # [lo, hi): window start in [lo, hi - size]


@dataclass
class UpdateConfig:
    mode: str = "jagg"  # exact | jagg | jagg_sequential | ablate
    window: int = 4  # W: consecutive transitions per group
    # Which groups take the `mode` path (train/routing.py). prefix: those ending at or before
    # round(jagg_frac * M), M the trainable transitions; the rest are exact. auto: every auto_every steps
    # a probe measures cos(g_mode, g_exact) per group on the current policy and a group takes the
    # `mode` path when its mean cosine >= auto_threshold.
    routing: str = "prefix"  # prefix | auto
    jagg_frac: float = 0.6  # routing=prefix: share of the trajectory, in [0, 1], routed to the `mode` path
    timestep_fraction: float = 1.0  # share of groups trained per sample (DanceGRPO draws them at random)
    auto_every: int = 10  # routing=auto: training steps between probes (the first step always probes)
    auto_threshold: float = 0.5  # routing=auto: minimum mean cosine for the `mode` path (the paper's 0.5)
    auto_rollouts: int = 4  # routing=auto: trajectories per probe, all ranks together (<= G * prompts_per_rank)


@dataclass
class GRPOConfig:
    group_size: int = 12  # G: samples per prompt, all on one rank, sharing one initial noise
    prompts_per_rank: int = 1  # prompts per rank per training step (per rank)
    micro_batch: int = 1  # samples per forward/backward in the update (per rank)
    gradient_accumulation_steps: int = 12  # samples per rank per optimizer step
    clip_range: float = 1e-4  # PPO clip epsilon of the ratio
    adv_clip_max: float = 5.0  # advantages are clamped to +-adv_clip_max
    adv_eps: float = 1e-8  # added to the group std
    global_std: bool = False  # normalize by the std of all rewards of the step (all ranks) instead of per group
    kl_beta: float = 0.0  # weight of the KL to the reference policy (0 = off, no reference forwards)
    lr: float = 1e-5  # AdamW learning rate
    weight_decay: float = 1e-4  # AdamW decoupled weight decay
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW (beta1, beta2)
    max_grad_norm: float = 1.0  # global gradient-norm clip, across all shards
    ema_decay: float = 0.0  # EMA of trainable weights for evaluation (0 = off)


@dataclass
class RewardConfig:
    combine: str = "sum"  # sum: weighted sum of raw scores; advantage: weighted sum of per-reward advantages
    # scorer registry key (hpsv2 | clipscore | pickscore | jpeg_compressibility | ...) ->
    # {weight: float (default 1), <the scorer's arguments, e.g. checkpoint: /path>} (docs/rewards.md).
    # Untyped so that `+reward.components.pickscore.weight=0.5` can add a component from the command line.
    components: dict = field(default_factory=dict)


@dataclass
class DataConfig:
    train_prompts: str = MISSING  # text file, one prompt per line
    eval_prompts: str | None = None  # text or jsonl ({"prompt", "category"}) file for evaluation
    num_eval_prompts: int = 0  # 0 = all of eval_prompts


@dataclass
class LoggingConfig:
    wandb_mode: str = "disabled"  # disabled | offline | online
    project: str = "jagg-grpo"  # wandb project
    entity: str | None = None  # wandb entity (user or team); null = wandb's default entity
    group: str | None = None  # wandb group; null = the experiment name (scripts/launch/compare_modes.sh sets one)
    name: str | None = None  # wandb run name; null = <experiment>-<update.mode>-s<seed>
    tags: list[str] = field(default_factory=list)  # wandb tags, added to the automatic ones (mode, seed<N>, sde)
    notes: str | None = None  # wandb notes: a sentence on what this run tests
    sample_every: int = 0  # save (and send to wandb) a captioned grid of rollout images every N steps (0 = never)
    # evaluate before training, every N steps and after the last step (0 = never); eval/* at step k = after k steps
    eval_every: int = 0
    progress_bar: bool = True  # a tqdm bar on rank 0; when false, a heartbeat line instead
    heartbeat_s: float = 60.0  # progress_bar=false: seconds between progress lines (0 = one line per step)


@dataclass
class CheckpointConfig:
    every: int = 0  # save every N steps (0 = only at the end)
    keep_last: int = 3  # complete checkpoints kept; older ones are deleted after each save
    export: bool = True  # write the trained transformer (or LoRA) in diffusers format at the end


@dataclass
class EvalConfig:
    num_steps: int = 28  # ODE steps of evaluation sampling
    batch_size: int = 4  # prompts per rank per sampling call
    seed: int = 0  # prompt i starts from the noise of the stream (seed, "eval_noise", i) (train/seeds.py)
    grid_size: int = 16  # images in the PNG grid (the first prompts), and pairs in the before/after sheet
    # python -m train.eval: the weights to evaluate: an export (<run>/export), a training checkpoint
    # (<run>/checkpoints/step_XXXXXXXX) or a run folder (its export, else its latest checkpoint); null = pretrained
    transformer: str | None = None
    # python -m train.eval: also evaluate the pretrained model (same prompts and noise) and report the paired difference
    compare_pretrained: bool = False
    # metric name (hpsv2 | pickscore | clipscore | jpeg_compressibility | ...) -> scorer arguments (local paths)
    scorers: dict[str, dict] = field(default_factory=dict)


@dataclass
class ProbeConfig:
    """``python -m train.grad_quality``: gradient quality of a JAGG path per group (train/grad_quality.py)."""

    num_rollouts: int = 20  # K: trajectories measured, all ranks together (the paper: >= 20)
    mode: str = "jagg"  # the path compared with exact: jagg | jagg_sequential | ablate
    threshold: float = 0.5  # a group qualifies for the path when its mean cos(g_mode, g_exact) >= threshold
    output: str | None = None  # JSON report; null = <run_dir>/grad_quality.json


@dataclass
class TrainConfig:
    experiment: str = "demo"  # name used for the wandb group and the run folder
    run_dir: str = ""  # shared run folder of all ranks; "" = Hydra's output folder (hydra.run.dir)
    seed: int = 42  # every random stream derives from (seed, purpose, index) (train/seeds.py)
    num_steps: int = 10  # training steps (rollout + update)
    resume: str | None = None  # null | auto (latest checkpoint in run_dir) | path to a checkpoint folder
    device: str = "auto"  # auto | cpu | cuda
    model: ModelConfig = field(default_factory=ModelConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    update: UpdateConfig = field(default_factory=UpdateConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    probe: ProbeConfig = field(default_factory=ProbeConfig)


def register_schema() -> None:
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def _choice(value, accepted, name: str) -> None:
    if value not in accepted:
        raise ValueError(f"{name}={value!r} is not valid; accepted values: {', '.join(map(str, accepted))}")


def _positive(value, name: str) -> None:
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")


def trainable_transitions(sampler: SamplerConfig, window_start: int | None = None) -> list[int]:
    """Trainable transitions of a rollout: the SDE steps, without the last (ignored) transition."""
    last = sampler.num_steps - 1
    if sampler.sde == "ode":
        return []
    if sampler.sde_window_size <= 0:
        return list(range(last))
    start = sampler.sde_window_range[0] if window_start is None else window_start
    return [k for k in range(start, start + sampler.sde_window_size) if k < last]


def _validate_sampler(s: SamplerConfig) -> None:
    _choice(s.sde, SDE_KINDS[:2], "sampler.sde")
    if s.num_steps < 2:
        raise ValueError(f"sampler.num_steps must be >= 2 (the last transition is never trained), got {s.num_steps}")
    if s.shift is not None:
        _positive(s.shift, "sampler.shift")
    if s.sde_window_size > 0:
        lo, hi = s.sde_window_range
        if not (0 <= lo and lo + s.sde_window_size <= hi <= s.num_steps - 1):
            raise ValueError(
                f"sampler.sde_window_range={list(s.sde_window_range)} must satisfy 0 <= lo and "
                f"lo + sde_window_size ({s.sde_window_size}) <= hi <= num_steps - 1 ({s.num_steps - 1})"
            )


def _validate_grpo(g: GRPOConfig) -> None:
    for name in ("group_size", "prompts_per_rank", "micro_batch", "gradient_accumulation_steps", "lr"):
        _positive(getattr(g, name), f"grpo.{name}")
    if g.group_size < 2:
        raise ValueError(f"grpo.group_size must be >= 2 (advantages are relative within a group), got {g.group_size}")
    samples = g.group_size * g.prompts_per_rank
    if samples % g.gradient_accumulation_steps:
        raise ValueError(
            f"grpo.gradient_accumulation_steps={g.gradient_accumulation_steps} must divide the samples per rank "
            f"per step (group_size * prompts_per_rank = {samples})"
        )
    if g.gradient_accumulation_steps % g.micro_batch:
        raise ValueError(
            f"grpo.micro_batch={g.micro_batch} must divide "
            f"grpo.gradient_accumulation_steps={g.gradient_accumulation_steps}"
        )
    for name in ("clip_range", "max_grad_norm"):
        _positive(getattr(g, name), f"grpo.{name}")
    if not 0.0 <= g.ema_decay < 1.0:
        raise ValueError(f"grpo.ema_decay must be in [0, 1), got {g.ema_decay}")
    if g.kl_beta < 0:
        raise ValueError(f"grpo.kl_beta must be >= 0, got {g.kl_beta}")


def _validate_update(u: UpdateConfig, g: GRPOConfig) -> None:
    if not 0.0 < u.timestep_fraction <= 1.0:
        raise ValueError(f"update.timestep_fraction must be in (0, 1], got {u.timestep_fraction}")
    _choice(u.routing, ROUTINGS, "update.routing")
    if not 0.0 <= u.jagg_frac <= 1.0:
        raise ValueError(f"update.jagg_frac must be in [0, 1], got {u.jagg_frac}")
    if u.routing == "auto":
        if u.mode == "exact":
            raise ValueError("update.routing=auto routes between update.mode and exact: pick update.mode=jagg")
        _positive(u.auto_every, "update.auto_every")
        _positive(u.auto_rollouts, "update.auto_rollouts")
        rows = g.group_size * g.prompts_per_rank
        if u.auto_rollouts > rows:
            raise ValueError(
                f"update.auto_rollouts={u.auto_rollouts} exceeds the samples per rank per step "
                f"(group_size * prompts_per_rank = {rows})"
            )


def _validate_probe(p: ProbeConfig) -> None:
    _positive(p.num_rollouts, "probe.num_rollouts")
    _choice(p.mode, tuple(m for m in UPDATE_MODES if m != "exact"), "probe.mode")


def _validate_reward(r: RewardConfig, known_scorers: tuple[str, ...]) -> None:
    _choice(r.combine, COMBINE_MODES, "reward.combine")
    if not r.components:
        raise ValueError("reward.components is empty: name at least one scorer, e.g. reward=jpeg")
    for name, comp in r.components.items():
        _choice(name, known_scorers, "reward.components (scorer name)")
        if not isinstance(comp, dict) or not isinstance(comp.get("weight", 1.0), int | float):
            raise ValueError(f"reward.components.{name} must be {{weight: <number>, <scorer arguments>}}, got {comp}")


def _validate_files(cfg: TrainConfig) -> None:
    model_path = Path(cfg.model.path)
    if cfg.model.build_tiny is None and not model_path.is_dir():
        raise FileNotFoundError(
            f"model.path={cfg.model.path!r} is not a folder; point it at a local diffusers pipeline folder"
        )
    for field_name, value in (
        ("data.train_prompts", cfg.data.train_prompts),
        ("data.eval_prompts", cfg.data.eval_prompts),
    ):
        if value is None:
            continue
        path = Path(value)
        if not path.is_file():
            raise FileNotFoundError(f"{field_name}={value!r} does not exist")
        if not any(line.strip() for line in path.read_text().splitlines()):
            raise ValueError(f"{field_name}={value!r} has no prompts (the file is empty)")


def validate(cfg: TrainConfig, *, known_scorers: tuple[str, ...], known_backbones: tuple[str, ...]) -> None:
    """Reject impossible settings, naming the field and the accepted values. Loads no model."""
    _choice(cfg.model.name, known_backbones, "model.name")
    _choice(cfg.model.dtype, DTYPES, "model.dtype")
    if cfg.model.build_tiny is not None:
        _choice(cfg.model.build_tiny, ("tiny", "small"), "model.build_tiny")
    _choice(cfg.update.mode, UPDATE_MODES, "update.mode")
    _choice(cfg.logging.wandb_mode, WANDB_MODES, "logging.wandb_mode")
    if cfg.logging.heartbeat_s < 0:
        raise ValueError(f"logging.heartbeat_s must be >= 0 (0 = a line per step), got {cfg.logging.heartbeat_s}")
    _choice(cfg.device, ("auto", "cpu", "cuda"), "device")
    if cfg.resume not in (None, "auto") and not Path(cfg.resume).is_dir():
        raise FileNotFoundError(f"resume={cfg.resume!r}: no such checkpoint folder (use resume=auto or a path)")
    _positive(cfg.num_steps, "num_steps")
    _validate_sampler(cfg.sampler)
    _validate_grpo(cfg.grpo)
    _validate_reward(cfg.reward, known_scorers)
    for name in cfg.eval.scorers:
        _choice(name, known_scorers, "eval.scorers (scorer name)")
    if cfg.logging.eval_every and not cfg.eval.scorers:
        raise ValueError("logging.eval_every > 0 needs eval.scorers (e.g. eval.scorers={jpeg_compressibility: {}})")
    _validate_update(cfg.update, cfg.grpo)
    _validate_probe(cfg.probe)
    split_groups(trainable_transitions(cfg.sampler), cfg.update.window)
    _validate_files(cfg)
