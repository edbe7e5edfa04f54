"""The GRPO training loop: rollout -> decode -> rewards -> advantages -> update -> optimizer.

One step on each rank:
  1. draw ``prompts_per_rank`` prompts (train/data.py); each is a group of G samples on this rank
     that starts from one initial noise drawn from the stream (seed, "initial_noise", group id);
  2. roll out the N-step trajectory without gradients (SDE or Flow-GRPO-Fast window);
  3. decode, score every reward component, combine, and take group advantages;
  4. update: micro-batches through train/update.py (exact or JAGG per group), one optimizer step
     per ``gradient_accumulation_steps`` samples, after clipping the global gradient norm.

Departures from the reference trainers, on purpose: every random draw comes from its own stream
of (seed, purpose, index) (train/seeds.py): a group's SDE noise from its group id, the training
plan from the step, LoRA's initialisation from the seed alone, so a resumed run replays exactly
and a step does not depend on how its groups are spread over ranks;
a NaN reward or a non-finite gradient skips the update (all ranks together) instead of
corrupting the weights.
"""

from __future__ import annotations

import copy
import logging
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn

from models.base import Backbone, parse_dtype
from models.registry import backbone_names, load_backbone
from rewards.base import SCORER_NAMES, build_scorer
from rewards.combine import RewardCombiner
from samplers.rollout import Trajectory, draw_sde_window, rollout
from samplers.sde import SDE
from train.checkpoint import CheckpointManager, export_model
from train.config import AUTO, TrainConfig, validate
from train.data import PromptSampler, read_prompts
from train.distributed import (
    DistInfo,
    all_gather_tensor,
    all_reduce_sum,
    broadcast_object,
    clip_grad_norm_,
    init_distributed,
    parallelize,
    shutdown,
)
from train.ema import EMA
from train.grpo import group_advantages
from train.logger import PhaseTimer, RunLogger, progress_bar
from train.routing import AutoRouter
from train.seeds import seed_everything, stream_generator, stream_seed
from train.update import UpdateSettings, UpdateStats, plan_for, update_micro_batch

log = logging.getLogger(__name__)


@dataclass
class Run:
    """Everything a training step needs, built once by ``build``."""

    cfg: TrainConfig
    dist: DistInfo
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
    eval_records: list | None = None  # built on the first evaluation
    eval_scorers: dict | None = None
    router: AutoRouter | None = None  # update.jagg_frac=auto: the per-group routing table (train/routing.py)


def run(cfg: DictConfig) -> None:
    """Entry point behind ``python -m train``: validate, build, train, export."""
    config: TrainConfig = OmegaConf.to_object(cfg)
    validate(config, known_scorers=SCORER_NAMES, known_backbones=tuple(backbone_names()))
    dist = init_distributed()
    try:
        state = build(config, dist)
        fit(state)
    finally:
        shutdown()


def _device(cfg: TrainConfig, dist: DistInfo) -> torch.device:
    if cfg.device == "cpu" or (cfg.device == "auto" and dist.device.type == "cpu"):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("device=cuda but CUDA is not available; use device=cpu or device=auto")
    return dist.device


def build_backbone(cfg: TrainConfig, dist: DistInfo, device: torch.device) -> Backbone:
    """Load every component from the local folder (building the tiny one first if asked).

    Placement policy for the frozen parts: text encoders and VAE are replicated on every rank in
    the model dtype (they run once per step, without gradients, and sharding them would add
    collectives for no memory that matters next to the transformer's optimizer state); with
    ``model.embedding_cache`` the text encoders are not loaded at all. The transformer keeps
    float32 master weights and computes in ``model.dtype`` (FSDP2 mixed precision or autocast).
    """
    if cfg.model.build_tiny is not None:
        if dist.is_main:
            from models.tiny import build_tiny

            build_tiny(cfg.model.name, cfg.model.path, size=cfg.model.build_tiny)
        broadcast_object(None)  # the other ranks wait for the folder
    dtype = parse_dtype(cfg.model.dtype)
    backbone = load_backbone(
        cfg.model.name,
        cfg.model.path,
        dtype=dtype,
        device=device,
        embedding_cache=cfg.model.embedding_cache,
        **cfg.model.options,
    )
    if next(backbone.transformer.parameters()).dtype != torch.float32:  # float32 master weights
        backbone.transformer.to(torch.float32)
    return backbone


def setup_trainable(cfg: TrainConfig, backbone: Backbone) -> tuple[list[nn.Parameter], nn.Module | None]:
    """LoRA or full fine-tuning, the KL reference, then sharding (in that order)."""
    transformer = backbone.transformer
    transformer.requires_grad_(False)
    reference = None
    if cfg.model.lora.enabled:
        from peft import LoraConfig

        lora = cfg.model.lora
        # peft draws the adapters from the global RNG, which differs per rank; FSDP2 keeps each rank's
        # shard of its own draw. One stream for every rank gives the same weights on any world size.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(stream_seed(cfg.seed, "model_init"))
            transformer.add_adapter(
                LoraConfig(
                    r=lora.rank,
                    lora_alpha=lora.alpha,
                    init_lora_weights=lora.init,
                    target_modules=backbone.lora_target_modules,
                )
            )
    else:
        transformer.requires_grad_(True)
        if cfg.grpo.kl_beta > 0:  # full fine-tuning: the reference is a frozen copy of the start
            reference = copy.deepcopy(transformer).requires_grad_(False).eval()
    transformer.train()
    compute = parse_dtype(cfg.model.dtype)
    for module in (transformer, reference):
        if module is not None:
            parallelize(
                module,
                block_classes=backbone.block_classes,
                param_dtype=compute,
                activation_checkpointing=cfg.model.activation_checkpointing and module is transformer,
            )
    return [p for p in transformer.parameters() if p.requires_grad], reference


def build_rewards(cfg: TrainConfig, device: torch.device) -> RewardCombiner:
    """Every reward model is replicated on every rank: scoring is data-parallel and frozen."""
    components = {
        name: (
            build_scorer(name, **{k: v for k, v in comp.items() if k != "weight"}).to(device),
            float(comp.get("weight", 1.0)),
        )
        for name, comp in cfg.reward.components.items()
    }
    return RewardCombiner(components, mode=cfg.reward.combine)


def build(cfg: TrainConfig, dist: DistInfo) -> Run:
    seed_everything(cfg.seed, dist.rank)
    run_dir = Path(broadcast_object(cfg.run_dir))  # every rank writes where rank 0 does
    cfg.run_dir = str(run_dir)
    device = _device(cfg, dist)
    records = read_prompts(cfg.data.train_prompts)
    rewards = build_rewards(cfg, device)  # before the transformer: a wrong reward path fails in seconds
    backbone = build_backbone(cfg, dist, device)
    params, reference = setup_trainable(cfg, backbone)
    g = cfg.grpo
    optimizer = torch.optim.AdamW(params, lr=g.lr, weight_decay=g.weight_decay, betas=tuple(g.betas))
    logger = RunLogger(
        run_dir,
        is_main=dist.is_main,
        wandb_mode=cfg.logging.wandb_mode,
        project=cfg.logging.project,
        group=cfg.logging.group or cfg.experiment,
        name=f"{cfg.experiment}-{cfg.update.mode}-s{cfg.seed}",
        tags=[cfg.update.mode, f"seed{cfg.seed}", cfg.sampler.sde],
        config=OmegaConf.to_container(OmegaConf.structured(cfg)),
    )
    return Run(
        cfg=cfg,
        dist=dist,
        backbone=backbone,
        params=params,
        optimizer=optimizer,
        ema=EMA(params, g.ema_decay) if g.ema_decay > 0 else None,
        rewards=rewards,
        prompts=PromptSampler(
            records, seed=cfg.seed, rank=dist.rank, world_size=dist.world_size, prompts_per_rank=g.prompts_per_rank
        ),
        checkpoints=CheckpointManager(run_dir, keep_last=cfg.checkpoint.keep_last),
        logger=logger,
        reference=reference,
        compute_dtype=parse_dtype(cfg.model.dtype),
        router=AutoRouter.from_config(cfg.update) if cfg.update.jagg_frac == AUTO else None,
    )


def predictor(backbone: Backbone, compute_dtype: torch.dtype, world_size: int, module: nn.Module | None = None):
    """predict(z, t, cond) with the backbone's transformer, or ``module`` swapped in (the reference).

    Single-process runs compute in ``compute_dtype`` by autocast over float32 master weights;
    under FSDP2 the mixed-precision policy does it.
    """
    device = next(backbone.transformer.parameters()).device
    wanted = compute_dtype != torch.float32 and world_size == 1

    def predict(z: Tensor, t: Tensor, cond) -> Tensor:
        with torch.autocast(device.type, dtype=compute_dtype) if wanted else nullcontext():
            if module is None:
                return backbone.predict(z, t, cond)
            policy, backbone.transformer = backbone.transformer, module
            try:
                return backbone.predict(z, t, cond)
            finally:
                backbone.transformer = policy

    return predict


def policy_predictor(run: Run, module: nn.Module | None = None):
    return predictor(run.backbone, run.compute_dtype, run.dist.world_size, module)


def reference_predictor(run: Run):
    """The KL reference: the LoRA-disabled policy, or the frozen copy of full fine-tuning."""
    if run.cfg.grpo.kl_beta == 0:
        return None
    if run.reference is not None:
        return policy_predictor(run, run.reference)
    policy = policy_predictor(run)

    def predict(z: Tensor, t: Tensor, cond) -> Tensor:
        run.backbone.transformer.disable_adapters()
        try:
            return policy(z, t, cond)
        finally:
            run.backbone.transformer.enable_adapters()

    return predict


def rollout_phase(run: Run, step: int) -> tuple[Trajectory, list[str]]:
    cfg, backbone = run.cfg, run.backbone
    batch = run.prompts.batch(step)
    size = cfg.grpo.group_size
    device = next(backbone.transformer.parameters()).device
    noise = torch.cat(
        [
            backbone.initial_noise(
                1,
                height=cfg.model.height,
                width=cfg.model.width,
                generator=stream_generator(cfg.seed, "initial_noise", gid, device),
            ).expand(size, *([-1] * 3))
            for gid in batch.group_ids
        ]
    )
    s = cfg.sampler
    window = None
    if s.sde_window_size > 0:  # the window decides how many transitions train: same on every rank
        window = draw_sde_window(
            s.num_steps,
            size=s.sde_window_size,
            window_range=tuple(s.sde_window_range),
            generator=stream_generator(cfg.seed, "sde_window", step),  # same on every rank
        )
    sigmas = backbone.sigmas(s.num_steps, height=cfg.model.height, width=cfg.model.width, shift=s.shift)
    # SDE noise per group, from (seed, group id): the same samples however groups spread over ranks.
    sde_noise = [stream_generator(cfg.seed, "sde_noise", gid, device) for gid in batch.group_ids]
    with torch.no_grad():
        cond = backbone.encode(batch.prompts).repeat(size)
        traj = rollout(
            policy_predictor(run),
            cond,
            noise,
            sigmas=sigmas,
            sde=SDE(s.sde, eta=s.eta, noise_level=s.noise_level),
            sde_window=window,
            quantize_timesteps=s.quantize_timesteps,
            generator=sde_noise,
            group_ids=torch.tensor(batch.group_ids, device=device).repeat_interleave(size),
        )
    prompts = [p for p in batch.prompts for _ in range(size)]
    return traj, prompts


def advantage_fn(run: Run):
    g = run.cfg.grpo

    def fn(rewards: Tensor, group_ids: Tensor) -> Tensor:
        global_std = all_gather_tensor(rewards).std(unbiased=False) if g.global_std else None
        return group_advantages(rewards, group_ids, eps=g.adv_eps, adv_clip_max=g.adv_clip_max, global_std=global_std)

    return fn


def reward_phase(run: Run, traj: Trajectory, prompts: list[str]) -> tuple[Tensor | None, Tensor, dict[str, float]]:
    """(advantages or None when the step must be skipped, images, metrics)."""
    with torch.no_grad():
        images = run.backbone.decode(traj.latents[:, -1], height=run.cfg.model.height, width=run.cfg.model.width)
        try:
            scores = run.rewards.score(images, prompts)
            error = 0.0
        except ValueError as err:  # a NaN/inf score names its scorer; skip the update on every rank
            log.warning("skipping the update of this step: %s", err)
            scores, error = {}, 1.0
    if float(all_reduce_sum(torch.tensor(error, device=images.device))) > 0:
        return None, images, {"train/skipped_nan_reward": 1.0}
    advantages, _ = run.rewards.advantages(scores, traj.group_ids, advantage_fn(run))
    metrics = {f"reward/{name}": float(all_gather_tensor(s).mean()) for name, s in scores.items()}
    total = sum(run.rewards.weights[n] * s for n, s in scores.items())
    metrics |= {
        "reward/total": float(all_gather_tensor(total).mean()),
        "adv/mean": float(advantages.mean()),
        "adv/std": float(advantages.std(unbiased=False)),
        "adv/abs_max": float(advantages.abs().max()),
        "train/skipped_nan_reward": 0.0,
    }
    return advantages, images, metrics


def update_settings(cfg: TrainConfig) -> UpdateSettings:
    return UpdateSettings(
        mode=cfg.update.mode,
        window=cfg.update.window,
        jagg_frac=0.0 if cfg.update.jagg_frac == AUTO else cfg.update.jagg_frac,  # auto: Run.router routes
        timestep_fraction=cfg.update.timestep_fraction,
        clip_range=cfg.grpo.clip_range,
        kl_beta=cfg.grpo.kl_beta,
        gradient_accumulation_steps=cfg.grpo.gradient_accumulation_steps,
    )


def optimizer_step(run: Run) -> tuple[float, bool]:
    """Clip the global norm and step; a non-finite norm skips the step. Returns (norm, stepped)."""
    norm = clip_grad_norm_(run.params, run.cfg.grpo.max_grad_norm)
    finite = bool(torch.isfinite(norm))
    if finite:
        run.optimizer.step()
        if run.ema is not None:
            run.ema.update()
    run.optimizer.zero_grad(set_to_none=True)
    return float(norm), finite


def update_phase(run: Run, traj: Trajectory, advantages: Tensor, step: int, timer: PhaseTimer) -> dict[str, float]:
    g, settings = run.cfg.grpo, update_settings(run.cfg)
    stats = UpdateStats()
    plan_gen = stream_generator(run.cfg.seed, "update_plan", step)  # same on every rank
    predict, reference = policy_predictor(run), reference_predictor(run)
    routing = {}
    if run.router is not None:  # update.jagg_frac=auto: re-measure the groups, then route by cosine
        with timer.phase("probe"):
            routing = run.router.refresh(step, predict, traj, advantages, run.params, settings, reference=reference)
        settings = run.router.apply(settings)
    device = advantages.device
    norms, skipped = [], 0
    for chunk in range(0, advantages.shape[0], g.gradient_accumulation_steps):
        with timer.phase("update"):
            for first in range(chunk, chunk + g.gradient_accumulation_steps, g.micro_batch):
                rows = torch.arange(first, first + g.micro_batch, device=device)
                plan = plan_for(traj, settings, plan_gen)
                update_micro_batch(predict, traj, advantages, rows, plan, settings, stats, reference=reference)
        with timer.phase("optimizer"):
            norm, stepped = optimizer_step(run)
            norms.append(norm)
            skipped += not stepped
    out = stats.summary() | routing
    out |= {
        "train/grad_norm": sum(norms) / len(norms),
        "train/skipped_optimizer_steps": skipped,
        "train/lr": run.optimizer.param_groups[0]["lr"],
    }
    return out


def train_step(run: Run, step: int) -> dict[str, float]:
    timer = PhaseTimer(next(run.backbone.transformer.parameters()).device)
    with timer.phase("step"):
        with timer.phase("rollout"):
            traj, prompts = rollout_phase(run, step)
        with timer.phase("reward"):
            advantages, images, metrics = reward_phase(run, traj, prompts)
        if advantages is not None:
            metrics |= update_phase(run, traj, advantages, step, timer)
    metrics |= timer.pop()
    metrics["count/rollout_forwards"] = run.cfg.sampler.num_steps
    every = run.cfg.logging.sample_every
    if every and (step + 1) % every == 0:
        run.logger.log_images("samples", images, prompts, step)
    return metrics


def _save(run: Run, step: int) -> None:
    extra = {"step": step}
    if run.ema is not None:
        extra["ema"] = run.ema.state_dict()
    run.checkpoints.save(step, model=run.backbone.transformer, optimizer=run.optimizer, extra=extra)


def resume(run: Run) -> int:
    """The step to start from: 0, or the step stored in the checkpoint named by ``resume``."""
    path = run.checkpoints.resolve(run.cfg.resume)
    if path is None:
        return 0
    # The EMA copies may be sharded DTensors: they load in place into the live EMA's state.
    template = {"ema": run.ema.state_dict()} if run.ema is not None else None
    extra = run.checkpoints.load(path, model=run.backbone.transformer, optimizer=run.optimizer, extra_template=template)
    if run.ema is not None:
        run.ema.load_state_dict(extra["ema"])
    log.info("resumed from %s at step %d", path, extra["step"])
    return int(extra["step"])


def run_eval(run: Run, step: int) -> dict[str, float]:
    """The evaluation protocol of train/eval.py on all ranks, with the EMA weights when kept."""
    from train.eval import build_eval_scorers, evaluate

    cfg = run.cfg
    if run.eval_records is None:
        run.eval_records = read_prompts(cfg.data.eval_prompts or cfg.data.train_prompts, field_name="data.eval_prompts")
        run.eval_records = run.eval_records[: cfg.data.num_eval_prompts or None]
        run.eval_scorers = build_eval_scorers(cfg, next(run.backbone.transformer.parameters()).device)
    swap = run.ema.swapped() if run.ema is not None else nullcontext()
    with swap:
        summary = evaluate(
            run.backbone,
            policy_predictor(run),
            run.eval_scorers,
            run.eval_records,
            cfg,
            run.dist,
            tag=f"step_{step:08d}",
        )
    return {f"eval/{name}": value for name, value in summary.items()}


def build_for_eval(cfg: TrainConfig) -> tuple[Backbone, object, DistInfo]:
    """Backbone (with ``eval.transformer`` loaded, when given) and predictor for python -m train.eval."""
    dist = init_distributed()
    backbone = build_backbone(cfg, dist, _device(cfg, dist))
    if cfg.eval.transformer is not None:
        trained = type(backbone.transformer).from_pretrained(cfg.eval.transformer, torch_dtype=torch.float32)
        backbone.transformer = trained.to(next(backbone.transformer.parameters()).device)
    backbone.transformer.eval()
    return backbone, predictor(backbone, parse_dtype(cfg.model.dtype), dist.world_size), dist


def fit(run: Run) -> None:
    cfg = run.cfg
    start = resume(run)
    # eval/<metric> at step k is the policy after k training steps: k = 0 is the model as loaded.
    if cfg.logging.eval_every and start == 0:
        run.logger.log(run_eval(run, 0), 0)
    bar = progress_bar(cfg.num_steps, is_main=run.dist.is_main and cfg.logging.progress_bar, initial=start)
    for step in range(start, cfg.num_steps):
        metrics = train_step(run, step)
        run.logger.log(metrics, step)
        bar.update(1)
        bar.set_postfix(reward=f"{metrics.get('reward/total', float('nan')):.4f}")
        if cfg.logging.eval_every and (step + 1) % cfg.logging.eval_every == 0:
            run.logger.log(run_eval(run, step + 1), step + 1)
        if cfg.checkpoint.every and (step + 1) % cfg.checkpoint.every == 0:
            _save(run, step + 1)
    bar.close()
    if cfg.checkpoint.export:
        export_model(run.backbone.transformer, Path(cfg.run_dir) / "export")
    run.logger.finish()
    if run.dist.is_main:
        print(
            f"run folder: {cfg.run_dir}\n  metrics: {Path(cfg.run_dir) / 'metrics.jsonl'}\n"
            f"  samples: {Path(cfg.run_dir) / 'samples'}\n  export:  {Path(cfg.run_dir) / 'export'}"
        )
