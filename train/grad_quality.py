"""Gradient quality of a JAGG path per group (the paper's Appendix E, Table 5), and the jagg_frac it gives.

For one trajectory and one group of W transitions [start, stop), with the update stage's own per-step
GRPO loss (``train.update.group_inputs``: PPO clip + KL, on the rollout's advantage):

    g_exact = sum_j J_j^T s_j                        backward_group("exact")
    g_mode                                           backward_group(mode), mode = jagg by default
    cos = <g_mode, g_exact> / (|g_mode| |g_exact|)   rho = |g_mode| / |g_exact|

over every trainable parameter. A group reports the mean and the sample standard deviation (n - 1)
of cos and rho over K trajectories. A trajectory whose exact gradient is zero (zero advantage) has no
cosine and is left out of that group (``num_samples`` counts the others); a zero g_mode against a
nonzero g_exact counts as cos = 0, rho = 0.

The rule (the paper's): a group qualifies when its mean cos >= threshold (0.5). The recommended
jagg_frac is the end of the run of qualifying groups that starts at the highest-noise group, over M
(the trajectory's trainable transitions), so ``train.jagg.route`` sends exactly that run to the path.
The paper then sets 0.6 for Flux where this rule gives 0.8, to stay clear of a high-variance group;
the report carries the standard deviations for such a judgement.

torchrun + FSDP2: trajectory m is row m // R of rank m % R and is measured in a turn of all ranks.
FSDP's collectives need every rank to run the same forwards and backwards, so each rank runs the
group on its own row m // R, but only the owner's loss has weight 1 (the others weight 0): the
reduce-scattered gradient is the owner's gradient / R, and cos and rho do not see the factor. Dot
products are over the full gradient: the local shards' products summed over ranks with
``all_reduce_sum`` (as ``clip_grad_norm_`` does), accumulated in float64.

The probe writes ``.grad``: it needs empty gradients (None) and leaves them None, so nothing it
computes reaches an optimizer step.

    python -m train.grad_quality probe.num_rollouts=8                  # tiny Flux on CPU
    torchrun --nproc_per_node 8 -m train.grad_quality experiment=flux_dance model.path=... \\
        data.train_prompts=... reward.components.hpsv2.checkpoint=... reward.components.clipscore.model_path=...
"""

from __future__ import annotations

import json
import logging
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from samplers.rollout import Trajectory
from train.config import register_schema
from train.distributed import _replication, all_reduce_sum, get_rank, get_world_size
from train.jagg import backward_group, route, split_groups
from train.update import GroupInputs, Predict, UpdateSettings, UpdateStats, group_inputs

if TYPE_CHECKING:
    from train.trainer import Run

log = logging.getLogger(__name__)
Group = tuple[int, int]  # transitions [start, stop)
Samples = dict[Group, list[tuple[float, float]]]  # group -> (cos, rho) per measured trajectory


def _local(grad: Tensor) -> Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


@torch.no_grad()
def global_dots(a: Sequence[Tensor | None], b: Sequence[Tensor | None]) -> tuple[float, float, float]:
    """(<a, a>, <b, b>, <a, b>) of two gradients given per parameter (None = zero), over all ranks.

    A DTensor contributes its local shard on every rank (divided by the number of ranks holding
    that same shard); a plain tensor is the same on every rank and counts once.
    """
    if len(a) != len(b):
        raise ValueError(f"the two gradients have {len(a)} and {len(b)} parameters")
    present = [x if x is not None else y for x, y in zip(a, b) if x is not None or y is not None]
    device = _local(present[0]).device if present else torch.device("cpu")
    sharded = torch.zeros(3, dtype=torch.float64, device=device)
    plain = torch.zeros(3, dtype=torch.float64, device=device)
    for x, y in zip(a, b):
        if x is None and y is None:
            continue
        ref = x if x is not None else y
        xl = _local(x).flatten().float() if x is not None else torch.zeros_like(_local(ref).flatten().float())
        yl = _local(y).flatten().float() if y is not None else torch.zeros_like(xl)
        terms = torch.stack([xl @ xl, yl @ yl, xl @ yl]).double()
        if isinstance(ref, DTensor):
            sharded += terms / _replication(ref)
        else:
            plain += terms
    aa, bb, ab = (all_reduce_sum(sharded) + plain).tolist()
    return aa, bb, ab


def _clear(params: Sequence[nn.Parameter]) -> None:
    for p in params:
        p.grad = None


def measure_group(inputs: GroupInputs, params: Sequence[nn.Parameter], mode: str) -> tuple[float, float] | None:
    """(cos, rho) of ``mode``'s gradient against the exact one, for one group; None when g_exact = 0."""
    backward_group("exact", inputs.policy, inputs.step_loss, inputs.z, inputs.t)
    exact = [None if p.grad is None else p.grad.detach().clone() for p in params]
    _clear(params)
    backward_group(mode, inputs.policy, inputs.step_loss, inputs.z, inputs.t)
    ee, mm, em = global_dots(exact, [p.grad for p in params])
    _clear(params)
    if ee == 0:
        return None
    if mm == 0:
        return 0.0, 0.0
    return em / math.sqrt(ee * mm), math.sqrt(mm / ee)


def measure_trajectories(
    predict: Predict,
    traj: Trajectory,
    advantages: Tensor,
    params: Sequence[nn.Parameter],
    settings: UpdateSettings,
    *,
    num_rollouts: int,
    mode: str = "jagg",
    reference: Predict | None = None,
) -> Samples:
    """(cos, rho) per group of ``settings.window`` for trajectories 0 .. num_rollouts - 1 of the batch.

    Trajectory m is row m // R of rank m % R (R ranks; every rank passes its own ``traj``).
    """
    world, rank = get_world_size(), get_rank()
    if num_rollouts > world * traj.batch_size:
        raise ValueError(f"asked for {num_rollouts} trajectories; the batch holds {traj.batch_size} per rank x {world}")
    assert all(p.grad is None for p in params), "the probe needs empty gradients (zero_grad(set_to_none=True))"
    groups = split_groups(traj.trainable_steps(), settings.window)
    stats = UpdateStats()  # the probe's losses are not training metrics
    samples: Samples = {group: [] for group in groups}
    for m in range(num_rollouts):
        rows = torch.tensor([m // world], device=advantages.device)
        weight = 1.0 if rank == m % world else 0.0
        for group in groups:
            inputs = group_inputs(
                predict, traj, advantages, rows, group, settings, stats, reference=reference, scale=weight
            )
            result = measure_group(inputs, params, mode)
            if result is not None:
                samples[group].append(result)
    return samples


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    mean = sum(values) / len(values)
    if len(values) == 1:
        return mean, 0.0
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


@dataclass(frozen=True)
class GroupQuality:
    """Measured quality of one group of transitions [start, stop), over its trajectories."""

    start: int
    stop: int
    t_first: float  # network-input timestep of the group's first step (high noise = near 1)
    t_last: float  # of its last step
    cos: tuple[float, ...]  # cos(g_mode, g_exact), one per measured trajectory
    rho: tuple[float, ...]  # |g_mode| / |g_exact|, one per measured trajectory

    @property
    def num_samples(self) -> int:
        return len(self.cos)

    @property
    def cos_mean(self) -> float:
        return _mean_std(self.cos)[0]

    @property
    def cos_std(self) -> float:
        return _mean_std(self.cos)[1]

    @property
    def rho_mean(self) -> float:
        return _mean_std(self.rho)[0]

    @property
    def rho_std(self) -> float:
        return _mean_std(self.rho)[1]


def summarize_groups(samples: Mapping[Group, Sequence[tuple[float, float]]], timesteps: Tensor) -> list[GroupQuality]:
    """One ``GroupQuality`` per group, high noise first; ``timesteps`` [N] are the trajectory's t."""
    t = timesteps.detach().float().cpu().tolist()
    return [
        GroupQuality(
            start=a,
            stop=b,
            t_first=t[a],
            t_last=t[b - 1],
            cos=tuple(c for c, _ in samples[(a, b)]),
            rho=tuple(r for _, r in samples[(a, b)]),
        )
        for a, b in sorted(samples)
    ]


def recommend_jagg_frac(groups: Sequence[GroupQuality], *, threshold: float, num_transitions: int) -> float:
    """The paper's rule: stop of the last group of the qualifying run from the highest noise, over M.

    A group qualifies when its mean cosine is >= ``threshold`` (a group without samples does not).
    """
    if num_transitions < 1:
        raise ValueError(f"num_transitions must be >= 1, got {num_transitions}")
    stop = 0
    for group in sorted(groups, key=lambda g: g.start):
        if not group.cos_mean >= threshold:  # also stops at NaN (no sample)
            break
        stop = max(stop, group.stop)
    return round(stop / num_transitions, 4)


def _finite(value: float) -> float | None:
    return None if math.isnan(value) else value  # JSON null: a group without samples


def _pm(mean: float | None, std: float | None, width: int) -> str:
    return f"{'-':>{width}}{'':8}" if mean is None else f"{mean:>{width}.3f} ± {std:.3f}"


def report(
    groups: Sequence[GroupQuality], *, mode: str, threshold: float, num_transitions: int, **extra: Any
) -> dict[str, Any]:
    """The JSON report: the recommendation, and per group its statistics, samples and path under it."""
    frac = recommend_jagg_frac(groups, threshold=threshold, num_transitions=num_transitions)
    rows = []
    for index, g in enumerate(groups):
        rows.append(
            {
                "group": index,
                "start": g.start,
                "stop": g.stop,
                "t_first": g.t_first,
                "t_last": g.t_last,
                "cos_mean": _finite(g.cos_mean),
                "cos_std": _finite(g.cos_std),
                "rho_mean": _finite(g.rho_mean),
                "rho_std": _finite(g.rho_std),
                "num_samples": g.num_samples,
                "qualifies": bool(g.cos_mean >= threshold),
                "path": route(g.start, g.stop, mode=mode, jagg_frac=frac, num_transitions=num_transitions),
                "cos": list(g.cos),
                "rho": list(g.rho),
            }
        )
    return {
        "mode": mode,
        "threshold": threshold,
        "num_transitions": num_transitions,
        "recommended_jagg_frac": frac,
        **extra,
        "groups": rows,
    }


def format_table(rep: Mapping[str, Any]) -> str:
    """Table 5 of the paper as text, and the recommendation."""
    mode = rep["mode"]
    header = f"{'group':>5}  {'steps':>7}  {'t':>11}  {f'cos(g_{mode}, g_exact)':>24}  {'rho':>15}  {'n':>3}  path"
    lines = [header]
    for g in rep["groups"]:
        mark = "*" if g["qualifies"] else " "
        lines.append(
            f"{g['group']:>5}  {g['start']:>3}-{g['stop'] - 1:<3}  {g['t_first']:.3f}-{g['t_last']:.3f}  "
            f"{_pm(g['cos_mean'], g['cos_std'], 14)}{mark}  {_pm(g['rho_mean'], g['rho_std'], 7)}  "
            f"{g['num_samples']:>3}  {g['path']}"
        )
    lines.append(
        f"* mean cos >= {rep['threshold']}: recommended update.jagg_frac={rep['recommended_jagg_frac']} "
        f"(M = {rep['num_transitions']} trainable transitions)"
    )
    return "\n".join(lines)


MAX_BATCHES_PER_K = 10


def probe_run(run: Run) -> dict[str, Any]:
    """Roll out batches with the trainer's pieces until ``probe.num_rollouts`` trajectories are measured.

    A trajectory whose advantage is 0 (its group's rewards all equal) has no gradient and is not
    measured; batches are drawn until K trajectories were, at most ``MAX_BATCHES_PER_K`` times as
    many batches as K needs.
    """
    from train.trainer import policy_predictor, reference_predictor, reward_phase, rollout_phase, update_settings

    cfg, p = run.cfg, run.cfg.probe
    settings = update_settings(cfg)
    predict, reference = policy_predictor(run), reference_predictor(run)
    per_batch = cfg.grpo.group_size * cfg.grpo.prompts_per_rank * run.dist.world_size
    samples: Samples = defaultdict(list)
    traj, done = None, 0
    max_batches = MAX_BATCHES_PER_K * math.ceil(p.num_rollouts / per_batch)
    for batch in range(max_batches):
        traj, prompts = rollout_phase(run, batch)
        advantages, _, _ = reward_phase(run, traj, prompts)
        if advantages is None:  # a NaN reward (reward_phase warned); this batch is not measured
            continue
        count = min(per_batch, p.num_rollouts - done)
        measured = measure_trajectories(
            predict, traj, advantages, run.params, settings, num_rollouts=count, mode=p.mode, reference=reference
        )
        for group, values in measured.items():
            samples[group] += values
        done = min((len(v) for v in samples.values()), default=0)
        if done >= p.num_rollouts:
            break
    else:
        log.warning("probe: %d of K = %d trajectories had a gradient after %d batches", done, p.num_rollouts, batch + 1)
    groups = summarize_groups(samples, traj.timesteps)
    return report(
        groups,
        mode=p.mode,
        threshold=p.threshold,
        num_transitions=traj.num_transitions,
        experiment=cfg.experiment,
        model=cfg.model.name,
        window=cfg.update.window,
        sampler=cfg.sampler.sde,
        num_rollouts=p.num_rollouts,
        world_size=run.dist.world_size,
    )


def run_probe(cfg: DictConfig) -> dict[str, Any]:
    """Entry point behind ``python -m train.grad_quality``: build as the trainer does, probe, report.

    wandb stays off. Rollouts use only as many prompts per rank as K trajectories need; with
    ``resume=<checkpoint folder>`` the probe measures those weights.
    """
    from models.registry import backbone_names
    from rewards.base import SCORER_NAMES
    from train.config import TrainConfig, validate
    from train.distributed import init_distributed, shutdown
    from train.trainer import build, resume

    config: TrainConfig = OmegaConf.to_object(cfg)
    validate(config, known_scorers=SCORER_NAMES, known_backbones=tuple(backbone_names()))
    config.logging.wandb_mode = "disabled"
    dist = init_distributed()
    try:
        needed = math.ceil(config.probe.num_rollouts / (config.grpo.group_size * dist.world_size))
        if needed < config.grpo.prompts_per_rank:  # samples no trajectory would use are not rolled out
            log.info("probe: %d prompt(s) per rank per rollout batch cover K = %d", needed, config.probe.num_rollouts)
            config.grpo.prompts_per_rank = needed
        run = build(config, dist)
        if config.resume is not None:
            resume(run)
        rep = probe_run(run)
        if dist.is_main:
            out = Path(config.probe.output or Path(config.run_dir) / "grad_quality.json")
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(rep, indent=2) + "\n")
            print(f"{format_table(rep)}\nreport: {out}")
        run.logger.finish()
        return rep
    finally:
        shutdown()


@hydra.main(config_path="pkg://configs", config_name="train", version_base=None)
def main(cfg: DictConfig) -> None:
    run_probe(cfg)


if __name__ == "__main__":
    register_schema()
    main()
