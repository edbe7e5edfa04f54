"""The typed configuration schema of the trainer, and its validation.

Every field says its unit and whether it is per rank or global. The YAML tree under ``configs/``
fills these dataclasses (Hydra's ConfigStore registers them as option ``train`` of the ``schema``
group, the first entry of ``configs/train.yaml``'s defaults list), so a misspelled key or a wrong type fails at compose
time. ``validate`` then rejects impossible combinations before any model is loaded: every float
must be finite and in its range, every count >= 0 (>= 1 where 0 would mean nothing), every file
must exist and read as UTF-8. It raises ConfigError or PathError (train/components/errors.py), which the
commands print as one line.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from models.base import DTYPES
from rewards.combine import COMBINE_MODES
from samplers.schedule import QUANTIZE_MODES
from samplers.sde import SDE_KINDS
from train.algorithm.segments import split_segments
from train.algorithm.update_config import Routing, UpdateConfig
from train.components.data import read_prompts
from train.components.errors import ConfigError, PathError
from train.components.logger import WANDB_MODES

ADV_STDS = ("population", "unbiased")  # grpo.adv_std
# Settings that change what a checkpoint's weights or the run's history mean: a resumed run keeps them unless
# checkpoint.allow_changed names them (a key or a group of keys). The world size and the replicate degree
# are not among them: a checkpoint reshards.
RESUME_SETTINGS = ("model.name", "model.path", "model.lora", "seed", "update.mode", "sampler")
# Recorded with a checkpoint beside the settings: the full names of the modules LoRA wrapped (known once
# the adapters are added; [] for full fine-tuning), so that other targets are refused as a changed setting.
LORA_MODULES = "model.lora.modules"
LORA_INITS = ("gaussian", "olora", "pissa", "orthogonal")  # peft's init_lora_weights that need no extra config
# An override that adds an evaluation scorer to an empty eval.scorers, as typed on the command line
# (``eval.scorers={jpeg_compressibility: {}}`` needs quotes in a shell; ``+`` adds the key to the typed dict).
SCORERS_HINT = "+eval.scorers.jpeg_compressibility={}"


@dataclass
class LoraConfig:
    enabled: bool = False  # train LoRA adapters instead of every transformer weight
    rank: int = 64  # r: rank of each adapter's B A, >= 1
    alpha: int = 128  # scaling: the adapter adds alpha / r * B A, >= 1
    init: str = "gaussian"  # peft init_lora_weights: gaussian | olora | pissa | pissa_niter_<n> | orthogonal
    # module-name suffixes of the transformer to wrap (peft target_modules); empty: the backbone's own
    # (lora_target_modules in models/<name>.py). A checkpoint records the modules this wrapped, by full name
    target_modules: list[str] = field(default_factory=list)


@dataclass
class ModelConfig:
    name: str = "flux"  # backbone registry key: flux | qwenimage (models/registry.py)
    path: str = MISSING  # local diffusers pipeline folder (no hub downloads)
    build_tiny: str | None = None  # "tiny" | "small": build a random offline pipeline at `path` if absent (CPU demos)
    dtype: str = "float32"  # transformer parameter/compute dtype: float32 | bfloat16 | float16 (or fp32 | bf16 | fp16)
    height: int = 32  # image height in pixels
    width: int = 32  # image width in pixels
    # adapter options for models.registry.load_backbone: Flux guidance / max_sequence_length (text tokens
    # per prompt; longer prompts are truncated with a warning), per-component folders (e.g. vae: /path)
    options: dict = field(default_factory=dict)
    embedding_cache: str | None = None  # cache folder written by scripts/precompute_embeddings.py
    # images per VAE decode call when the rollout is scored (per rank); 0 = every sample of the step in one call.
    # Decoding many 720x720 images at once dominates the step's memory (0.9 GiB per image for FLUX.1-dev's VAE).
    decode_batch: int = 0
    activation_checkpointing: bool = False  # recompute each transformer block in backward
    # torch.compile (inductor) each transformer block on its own, for the rollout, the update, the KL reference and
    # evaluation alike, and the VAE decoder (Flux's: the decode of rollouts and evaluations); needs a C++ compiler
    # on CPU, Triton on CUDA (checked at start-up). The first step pays the compilation (logged as time/compile;
    # inductor's on-disk cache makes a second run start faster)
    compile: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class SamplerConfig:
    sde: str = "dance"  # transition kind: dance (constant eta) | flow (noise_level) | cps (noise_level) | ode
    num_steps: int = 21  # denoising steps N per rollout; the last transition is never trained
    shift: float | None = 3.0  # fixed timestep shift, > 0; null = the backbone's own (dynamic) schedule
    eta: float = 0.3  # dance: diffusion coefficient g (constant), > 0
    # flow: g = noise_level * sqrt(sigma / (1 - sigma)), > 0; cps: sigma_t = sigma' sin(noise_level pi / 2), in (0, 1]
    noise_level: float = 0.7
    # t fed to the transformer: none = sigma; float64 = floor(1000 sigma) / 1000 of our float64 schedule;
    # dance = int(1000 sigma) / 1000 of DanceGRPO's float32 schedule (needs a fixed shift; samplers/schedule.py)
    quantize_timesteps: str = "none"  # none | float64 | dance
    sde_window_size: int = 0  # Flow-GRPO-Fast: >0 = SDE only on this many consecutive steps, ODE elsewhere
    sde_window_range: list[int] = field(default_factory=lambda: [0, 12])  # [lo, hi): window start in [lo, hi - size]


@dataclass
class GRPOConfig:
    group_size: int = 12  # G: samples per prompt, all on one rank, sharing one initial noise
    prompts_per_rank: int = 1  # prompts per rank per training step (per rank)
    micro_batch: int = 1  # samples per forward/backward in the update (per rank)
    gradient_accumulation_steps: int = 12  # samples per rank per optimizer step
    clip_range: float = 1e-4  # PPO clip epsilon of the ratio, > 0
    adv_clip_max: float = 5.0  # advantages are clamped to +-adv_clip_max, > 0
    adv_eps: float = 1e-8  # added to the group std, >= 0 (Flow-GRPO's stat tracker: 1e-4)
    adv_std: str = "population"  # population (Flow-GRPO's, n) | unbiased (DanceGRPO's torch.std, n - 1)
    global_std: bool = False  # normalize by the std of all rewards of the step (all ranks) instead of per group
    # GRPO-Guard's RatioNorm: the PPO log-ratio (logp - logp_old + mean (mu - mu_old)^2 / (2 s^2)) s, s the step's
    # transition std (train/algorithm/grpo.py), so the ratio stays centred at every step; the rollout then keeps its
    # velocities (the sampling weights' mu_old). For sampler.sde=dance or flow (CPS's log-prob has no 1 / (2 s^2))
    ratio_norm: bool = False
    # Flow-GRPO's beta (the paper's Table 4 values as they are): beta * mean (mu - mu_ref)^2 / (2 g^2) over the
    # trained steps' transition means, g the step's diffusion coefficient, >= 0 (0 = off, no reference forwards)
    kl_beta: float = 0.0
    lr: float = 1e-5  # AdamW learning rate, > 0 (on resume the configured value replaces the checkpoint's)
    weight_decay: float = 1e-4  # AdamW decoupled weight decay, >= 0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW (beta1, beta2), each in [0, 1)
    max_grad_norm: float = 1.0  # global gradient-norm clip, across all shards, > 0
    ema_decay: float = 0.0  # EMA of trainable weights for evaluation, in [0, 1) (0 = off)
    # stop (after a checkpoint) once this many consecutive steps skipped their update (a NaN reward, a non-finite
    # gradient) or had a zero gradient (every advantage 0): such a run cannot learn (0 = never stop)
    max_bad_steps: int = 10


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
    # prompts kept out of training, evaluated with the eval prompts (as many samples each) and logged as
    # eval/<metric>/held-out: whether training on a prompt subset generalises (null = none)
    heldout_prompts: str | None = None


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
    every: int = 0  # save every N steps (0 = only at the end); the last step is always saved
    keep_last: int = 3  # complete checkpoints kept, >= 1; older ones are deleted after each save
    export: bool = True  # write the trained transformer (or LoRA) in diffusers format at the end
    # start a new run in a run folder that holds one, deleting its checkpoints, metrics, export and samples;
    # without it (and without resume=) such a folder is refused
    overwrite: bool = False
    # settings a resumed run may change although they change what the weights or the run mean (RESUME_SETTINGS:
    # the model, LoRA, seed, update.mode, sampler.*), e.g. [seed]; any other change of these is refused
    allow_changed: list[str] = field(default_factory=list)


@dataclass
class EvalConfig:
    num_steps: int = 28  # ODE steps of evaluation sampling
    batch_size: int = 4  # prompts per rank per sampling call
    seed: int = 0  # prompt i starts from the noise of the stream (seed, "eval_noise", i) (train/distributed/seeds.py)
    # images per prompt, each from its own noise: sample j of prompt i (of n) is evaluation item j * n + i,
    # so sample 0 keeps the noise of samples_per_prompt=1; more samples shrink the spread of a small prompt set
    samples_per_prompt: int = 1
    grid_size: int = 16  # images in the PNG grid (the first prompts), and pairs in the before/after sheet
    # python -m train.eval: the weights to evaluate: an export (<run>/export), a training checkpoint
    # (<run>/checkpoints/step_XXXXXXXX) or a run folder (its export, else its latest checkpoint); null = pretrained
    transformer: str | None = None
    # python -m train.eval: also evaluate the pretrained model (same prompts and noise) and report the paired difference
    compare_pretrained: bool = False
    # the most images one evaluation may sample (prompts x samples_per_prompt, held-out ones included), >= 1: a
    # larger set (data.eval_prompts unset falls back to every training prompt) is refused; cut it with num_eval_prompts
    max_images: int = 3200
    # metric name (hpsv2 | pickscore | clipscore | jpeg_compressibility | ...) -> scorer arguments (local paths)
    scorers: dict[str, dict] = field(default_factory=dict)


@dataclass
class PerfConfig:
    # peak TFLOP/s of one device, the denominator of perf/mfu/<phase>; null = the device's: the table of
    # train/components/perf.py on a GPU (A100, H100, H200, B200 bf16 dense), on CPU this machine's float32
    # matmul rate measured once at start-up; > 0
    peak_tflops: float | None = None


@dataclass
class DistConfig:
    # Seconds a collective may wait for the other ranks before this rank fails with a message naming it
    # (a hung, stopped or dead rank). Longer than any legitimate wait: a slow checkpoint save or evaluation.
    timeout_s: float = 1800.0
    # HSDP: R > 1 replicates the model over R groups of world / R ranks, each group sharding it (one group per
    # node: all-gathers stay inside a node, gradients are all-reduced across nodes); R must divide the world
    # size. 1 = FSDP over every rank. Checkpoints load across a change of R or of the world size.
    replicate_degree: int = 1


@dataclass
class TrainConfig:
    experiment: str = "demo"  # name used for the wandb group and the run folder
    run_dir: str = ""  # shared run folder of all ranks; "" = Hydra's output folder (hydra.run.dir)
    seed: int = 42  # every random stream derives from (seed, purpose, index) (train/distributed/seeds.py)
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
    dist: DistConfig = field(default_factory=DistConfig)
    perf: PerfConfig = field(default_factory=PerfConfig)


def _covered(key: str, prefixes: Sequence[str]) -> bool:
    return any(key == prefix or key.startswith(prefix + ".") for prefix in prefixes)


def resume_settings(cfg: TrainConfig) -> dict[str, Any]:
    """The ``RESUME_SETTINGS`` of ``cfg``, dotted key -> value (what a checkpoint records)."""
    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            elif _covered(f"{prefix}{key}", RESUME_SETTINGS):
                flat[f"{prefix}{key}"] = value.value if isinstance(value, Enum) else value  # as recorded (JSON)

    walk(asdict(cfg), "")
    return flat


def _change(key: str, saved: Any, now: Any) -> str:
    """``key saved -> now``; lists of module names by what differs (hundreds of names on a real model)."""
    if key != LORA_MODULES or not isinstance(saved, list) or not isinstance(now, list):
        return f"{key} {saved!r} -> {now!r}"
    gone, new = [n for n in saved if n not in now], [n for n in now if n not in saved]

    def some(names: list[str]) -> str:
        return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "") if names else "none"

    return f"{key} {len(saved)} -> {len(now)} modules wrapped (no longer: {some(gone)}; new: {some(new)})"


def changed_settings(saved: dict[str, Any], now: dict[str, Any], allowed: Sequence[str]) -> list[str]:
    """``key saved -> now`` for each key whose recorded value differs, unless ``allowed`` (checkpoint.allow_changed)
    names it or a group of keys it belongs to."""
    return [
        _change(key, saved.get(key), now.get(key))
        for key in sorted(saved.keys() | now.keys())
        if saved.get(key) != now.get(key) and not _covered(key, allowed)
    ]


def changed_refusal(resume: str | None, path: Any, changed: list[str]) -> ConfigError:
    """The one line that refuses to resume checkpoint ``path`` with the ``changed`` settings."""
    keys = ",".join(change.split(" ")[0] for change in changed)
    return ConfigError(
        f"resume={resume}: checkpoint {path} was saved with other settings that change what it means "
        f"({'; '.join(changed)}): resume with its settings, start a new run folder, or allow them with "
        f"checkpoint.allow_changed=[{keys}]"
    )


def register_schema(name: str = "train", schema: type = TrainConfig) -> None:
    """Store ``schema`` as option ``name`` of the ``schema`` group: configs/train.yaml composes the
    trainer's; a command with settings of its own (configs/probe.yaml) overrides it with a subclass."""
    ConfigStore.instance().store(group="schema", name=name, node=schema)


def _choice(value, accepted, name: str) -> None:
    if value not in accepted:
        raise ConfigError(f"{name}={value!r} is not valid; accepted values: {', '.join(map(str, accepted))}")


def _bounds(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if high is None:
        return f"{'>' if low_open else '>='} {low:g}"
    if low is None:
        return f"{'<' if high_open else '<='} {high:g}"
    return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"


def _in_range(
    value: float,
    name: str,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    why: str = "",
) -> None:
    """``value`` finite and within its bounds (an open end excludes the bound itself); ``why`` ends the message."""
    ok = math.isfinite(value)
    ok = ok and (low is None or (value > low if low_open else value >= low))
    ok = ok and (high is None or (value < high if high_open else value <= high))
    if not ok:
        finite = "" if math.isfinite(value) else "a finite number "
        raise ConfigError(f"{name} must be {finite}{_bounds(low, high, low_open, high_open)}, got {value}{why}")


def _positive(value, name: str, why: str = "") -> None:
    _in_range(value, name, low=0, low_open=True, why=why)


def _non_negative(value, name: str, why: str = "") -> None:
    _in_range(value, name, low=0, why=why)


def _check_finite(node: object, prefix: str) -> None:
    """Every float anywhere in the settings (dataclass fields, lists, dicts such as model.options) is finite.

    The field-specific checks below add the ranges; this walk keeps a new float field from slipping
    through with a NaN, which no comparison rejects.
    """
    if is_dataclass(node):
        items = [(f.name, getattr(node, f.name)) for f in fields(node)]
    elif isinstance(node, dict):
        items = [(str(key), value) for key, value in node.items()]
    elif isinstance(node, list | tuple):
        items = [(f"[{i}]", value) for i, value in enumerate(node)]
    else:
        return
    for key, value in items:
        name = f"{prefix}{key}" if key.startswith("[") or not prefix else f"{prefix}.{key}"
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{name} must be a finite number, got {value}")
        _check_finite(value, name)


def unknown_setting(prefix: str, key: str, schema: type) -> str:
    """The error for ``<prefix><key>``, which the dataclass ``schema`` does not declare, with the closest name."""
    close = difflib.get_close_matches(key, sorted(f.name for f in fields(schema)), n=1)
    hint = f"; did you mean {prefix}{close[0]}?" if close else ""
    where = schema.__module__.replace(".", "/") + ".py"  # the module that declares the schema
    return f"{prefix}{key} is not a setting of {schema.__name__}{hint} ({where})"


def _check_known_keys(node: object, prefix: str) -> None:
    """A key added with ``+group.key=value`` that no dataclass declares would be silently ignored: reject it."""
    if not is_dataclass(node):
        return
    declared = {f.name for f in fields(node)}
    for key in vars(node):
        if key not in declared:
            raise ConfigError(unknown_setting(prefix, key, type(node)))
    for name in declared:
        _check_known_keys(getattr(node, name), f"{prefix}{name}.")


def trainable_transitions(sampler: SamplerConfig, window_start: int | None = None) -> list[int]:
    """Trainable transitions of a rollout: the SDE steps, without the last (ignored) transition."""
    last = sampler.num_steps - 1
    if sampler.sde == "ode":
        return []
    if sampler.sde_window_size <= 0:
        return list(range(last))
    start = sampler.sde_window_range[0] if window_start is None else window_start
    return [k for k in range(start, start + sampler.sde_window_size) if k < last]


def _validate_model(m: ModelConfig, known_backbones: tuple[str, ...]) -> None:
    _choice(m.name, known_backbones, "model.name")
    _choice(m.dtype, DTYPES, "model.dtype")
    if m.build_tiny is not None:
        _choice(m.build_tiny, ("tiny", "small"), "model.build_tiny")
    _positive(m.height, "model.height")
    _positive(m.width, "model.width")
    _non_negative(m.decode_batch, "model.decode_batch", " (0 = every sample of the step in one call)")
    _positive(m.lora.rank, "model.lora.rank")
    _positive(m.lora.alpha, "model.lora.alpha")
    if m.lora.init not in LORA_INITS and not re.fullmatch(r"pissa_niter_\d+", m.lora.init):
        raise ConfigError(
            f"model.lora.init={m.lora.init!r} is not valid; accepted values: {', '.join(LORA_INITS)}, pissa_niter_<n>"
        )
    if any(not isinstance(name, str) or not name.strip() for name in m.lora.target_modules):
        raise ConfigError(
            f"model.lora.target_modules must be module-name suffixes (e.g. attn.to_q), got {m.lora.target_modules}"
        )


def _validate_sampler(s: SamplerConfig) -> None:
    _choice(s.sde, tuple(kind for kind in SDE_KINDS if kind != "ode"), "sampler.sde")
    if s.num_steps < 2:
        raise ConfigError(f"sampler.num_steps must be >= 2 (the last transition is never trained), got {s.num_steps}")
    if s.shift is not None:
        _positive(s.shift, "sampler.shift")
    _choice(s.quantize_timesteps, QUANTIZE_MODES, "sampler.quantize_timesteps")
    if s.quantize_timesteps == "dance" and s.shift is None:
        raise ConfigError("sampler.quantize_timesteps=dance needs DanceGRPO's fixed-shift schedule: set sampler.shift")
    # A diffusion coefficient of 0 makes every SDE step deterministic: no log-probability to train on.
    (_positive if s.sde == "dance" else _non_negative)(s.eta, "sampler.eta")
    if s.sde == "cps":
        _in_range(s.noise_level, "sampler.noise_level", low=0, high=1, low_open=True, why=" for sampler.sde=cps")
    else:
        (_positive if s.sde == "flow" else _non_negative)(s.noise_level, "sampler.noise_level")
    _non_negative(s.sde_window_size, "sampler.sde_window_size", " (0 = SDE on every step)")
    if len(s.sde_window_range) != 2:
        raise ConfigError(f"sampler.sde_window_range must be [lo, hi], got {list(s.sde_window_range)}")
    if s.sde_window_size > 0:
        lo, hi = s.sde_window_range
        if not (0 <= lo and lo + s.sde_window_size <= hi <= s.num_steps - 1):
            raise ConfigError(
                f"sampler.sde_window_range={list(s.sde_window_range)} must satisfy 0 <= lo and "
                f"lo + sde_window_size ({s.sde_window_size}) <= hi <= num_steps - 1 ({s.num_steps - 1})"
            )


def _validate_grpo(g: GRPOConfig) -> None:
    for name in ("group_size", "prompts_per_rank", "micro_batch", "gradient_accumulation_steps"):
        _positive(getattr(g, name), f"grpo.{name}")
    if g.group_size < 2:
        raise ConfigError(f"grpo.group_size must be >= 2 (advantages are relative within a group), got {g.group_size}")
    samples = g.group_size * g.prompts_per_rank
    if samples % g.gradient_accumulation_steps:
        raise ConfigError(
            f"grpo.gradient_accumulation_steps={g.gradient_accumulation_steps} must divide the samples per rank "
            f"per step (group_size * prompts_per_rank = {samples})"
        )
    if g.gradient_accumulation_steps % g.micro_batch:
        raise ConfigError(
            f"grpo.micro_batch={g.micro_batch} must divide "
            f"grpo.gradient_accumulation_steps={g.gradient_accumulation_steps}"
        )
    _positive(g.clip_range, "grpo.clip_range")
    _positive(g.adv_clip_max, "grpo.adv_clip_max")
    _non_negative(g.adv_eps, "grpo.adv_eps")
    _choice(g.adv_std, ADV_STDS, "grpo.adv_std")
    _non_negative(g.kl_beta, "grpo.kl_beta", " (0 = no KL term)")
    _positive(g.max_grad_norm, "grpo.max_grad_norm")
    _non_negative(g.max_bad_steps, "grpo.max_bad_steps", " (0 = never stop)")
    _in_range(g.ema_decay, "grpo.ema_decay", low=0, high=1, high_open=True, why=" (0 = no EMA)")
    # AdamW's own checks run only once the model is loaded: the same ranges, up front.
    _positive(g.lr, "grpo.lr")
    _non_negative(g.weight_decay, "grpo.weight_decay")
    if len(g.betas) != 2:
        raise ConfigError(f"grpo.betas must be two numbers [beta1, beta2], got {list(g.betas)}")
    for i, beta in enumerate(g.betas):
        _in_range(beta, f"grpo.betas[{i}]", low=0, high=1, high_open=True)


def _validate_update(u: UpdateConfig, g: GRPOConfig) -> None:
    """The update's rule across groups, and its own checks again (for a field set after construction)."""
    try:
        u.__post_init__()
    except ValueError as err:
        raise ConfigError(f"update.{err}") from None
    rows = g.group_size * g.prompts_per_rank
    if u.routing is Routing.auto and u.auto_rollouts > rows:
        raise ConfigError(
            f"update.auto_rollouts={u.auto_rollouts} exceeds the samples per rank per step "
            f"(group_size * prompts_per_rank = {rows})"
        )


def _validate_reward(r: RewardConfig, known_scorers: tuple[str, ...]) -> None:
    _choice(r.combine, COMBINE_MODES, "reward.combine")
    if not r.components:
        raise ConfigError("reward.components is empty: name at least one scorer, e.g. reward=jpeg")
    weights = []
    for name, comp in r.components.items():
        _choice(name, known_scorers, "reward.components (scorer name)")
        weight = comp.get("weight", 1.0) if isinstance(comp, dict) else None
        if not isinstance(weight, int | float) or isinstance(weight, bool):
            raise ConfigError(f"reward.components.{name} must be {{weight: <number>, <scorer arguments>}}, got {comp}")
        _in_range(weight, f"reward.components.{name}.weight")
        if name == "remote" and not comp.get("url"):
            raise ConfigError(
                "reward.components.remote.url is not set: give the reward server's address, e.g. "
                "http://127.0.0.1:8100 (scripts/reward_server.py)"
            )
        weights.append(weight)
    if not any(weights):
        raise ConfigError("reward.components: every weight is 0, so every advantage would be 0; give one a weight")


def _validate_run(cfg: TrainConfig, known_scorers: tuple[str, ...]) -> None:
    if not cfg.experiment.strip():
        raise ConfigError("experiment must name the run (it is the wandb group and part of the run folder)")
    _choice(cfg.device, ("auto", "cpu", "cuda"), "device")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but CUDA is not available on this machine; use device=cpu or device=auto")
    _positive(cfg.num_steps, "num_steps")
    _positive(cfg.dist.timeout_s, "dist.timeout_s")
    if cfg.perf.peak_tflops is not None:
        _positive(cfg.perf.peak_tflops, "perf.peak_tflops", " (null = the device's own)")
    _choice(cfg.logging.wandb_mode, WANDB_MODES, "logging.wandb_mode")
    if cfg.logging.wandb_mode != "disabled" and not cfg.logging.project.strip():
        raise ConfigError("logging.project is empty: name the wandb project")
    _non_negative(cfg.logging.sample_every, "logging.sample_every", " (0 = never)")
    _non_negative(cfg.logging.eval_every, "logging.eval_every", " (0 = never)")
    _non_negative(cfg.logging.heartbeat_s, "logging.heartbeat_s", " (0 = a line per step)")
    _non_negative(cfg.checkpoint.every, "checkpoint.every", " (0 = only at the end)")
    if cfg.checkpoint.overwrite and cfg.resume:
        raise ConfigError(
            f"checkpoint.overwrite=true starts the run in run_dir again, resume={cfg.resume} continues one: pick one"
        )
    for key in cfg.checkpoint.allow_changed:
        if not any(_covered(key, (prefix,)) or _covered(prefix, (key,)) for prefix in RESUME_SETTINGS):
            raise ConfigError(
                f"checkpoint.allow_changed: {key!r} is not a setting a resumed run keeps; those are "
                f"{', '.join(RESUME_SETTINGS)} (and the keys under them)"
            )
    _positive(cfg.checkpoint.keep_last, "checkpoint.keep_last")
    _non_negative(cfg.data.num_eval_prompts, "data.num_eval_prompts", " (0 = all of them)")
    e = cfg.eval
    for name in ("num_steps", "batch_size", "samples_per_prompt", "grid_size", "max_images"):
        _positive(getattr(e, name), f"eval.{name}")
    for name in e.scorers:
        _choice(name, known_scorers, "eval.scorers (scorer name)")
    if cfg.logging.eval_every and not e.scorers:
        raise ConfigError(f"logging.eval_every > 0 needs eval.scorers: add one, e.g. {SCORERS_HINT} (docs/rewards.md)")


def _validate_files(cfg: TrainConfig) -> None:
    model_path = Path(cfg.model.path)
    if cfg.model.build_tiny is None and not model_path.is_dir():
        raise PathError(f"model.path={cfg.model.path!r} is not a folder; point it at a local diffusers pipeline folder")
    # eval.transformer: python -m train.eval checks it (train.cli.find_weights), naming what it accepts
    if cfg.model.embedding_cache is not None and not Path(cfg.model.embedding_cache).is_dir():
        raise PathError(f"model.embedding_cache={cfg.model.embedding_cache!r} is not a folder")
    if cfg.resume not in (None, "auto") and not Path(cfg.resume).is_dir():
        raise PathError(f"resume={cfg.resume!r}: no such checkpoint folder (use resume=auto or a path)")
    read_prompts(cfg.data.train_prompts, field_name="data.train_prompts")
    for field_name in ("eval_prompts", "heldout_prompts"):
        path = getattr(cfg.data, field_name)
        if path is not None:
            read_prompts(path, field_name=f"data.{field_name}")


def _check_eval_size(cfg: TrainConfig) -> None:
    """One evaluation samples at most eval.max_images images (the trainer's run before training and every
    eval_every steps; python -m train.eval's once or twice)."""
    d, e = cfg.data, cfg.eval
    if not e.scorers:
        return  # no evaluation is configured
    prompts = len(read_prompts(d.eval_prompts or d.train_prompts))
    if d.num_eval_prompts:
        prompts = min(prompts, d.num_eval_prompts)
    heldout = len(read_prompts(d.heldout_prompts)) if d.heldout_prompts else 0
    images = (prompts + heldout) * e.samples_per_prompt
    if images > e.max_images:
        source = f"data.eval_prompts={d.eval_prompts}" if d.eval_prompts else f"data.train_prompts={d.train_prompts}"
        raise ConfigError(
            f"an evaluation would sample {images} images ({prompts} prompts of {source}"
            + (f" and {heldout} held-out" if heldout else "")
            + f", x eval.samples_per_prompt={e.samples_per_prompt}), more than eval.max_images={e.max_images}: "
            "set data.num_eval_prompts=<n> (or data.eval_prompts=<a smaller file>), or raise eval.max_images"
        )


def validate(
    cfg: TrainConfig, *, known_scorers: tuple[str, ...], known_backbones: tuple[str, ...], check_files: bool = True
) -> None:
    """Reject impossible settings, naming the field and the accepted values. Loads no model.

    Raises ConfigError (a ValueError) for a setting, PathError (a FileNotFoundError) for a missing file.
    ``check_files=False`` skips the checks of model, prompt and checkpoint paths, for a command that
    reads none of them.
    """
    _check_known_keys(cfg, "")
    _check_finite(cfg, "")
    _validate_model(cfg.model, known_backbones)
    _validate_sampler(cfg.sampler)
    _validate_grpo(cfg.grpo)
    _validate_update(cfg.update, cfg.grpo)
    _positive(cfg.dist.replicate_degree, "dist.replicate_degree", " (1 = shard over every rank)")
    if cfg.grpo.ratio_norm and cfg.sampler.sde == "cps":
        raise ConfigError(
            "grpo.ratio_norm=true normalises a Gaussian log-prob, which sampler.sde=cps does not have: "
            "use sampler.sde=flow or dance, or grpo.ratio_norm=false"
        )
    _validate_reward(cfg.reward, known_scorers)
    _validate_run(cfg, known_scorers)
    try:
        split_segments(trainable_transitions(cfg.sampler), cfg.update.segment_length)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if check_files:
        _validate_files(cfg)
        _check_eval_size(cfg)
