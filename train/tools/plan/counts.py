"""The counts of one step that follow from the settings alone, without a tensor: the segments each update path
trains per micro-batch (expected over the random segment pick and the windows the run draws), the
update calls a rank makes, what the shared start adds or saves, the SDE window and the text tokens the
trace uses, and the run's evaluations."""

from __future__ import annotations

import math
from collections import Counter

from samplers.sampler_config import WindowSchedule
from samplers.window import progressive_start
from train.algorithm.segments import RoutedSegment, pick_segments, route_segments
from train.algorithm.update_config import MIDDLE_MODES, ReuseVelocities, UpdateMode
from train.loop.passes import micro_batches, pass_order
from train.parts.config.schema import TrainConfig
from train.run.checks import trainable_transitions
from train.tools.plan.plan_config import PlanRunConfig
from train.tools.plan.report import Evaluation

EXACT_BATCHED = "exact_batched"  # the planner's path of an exact segment with update.exact_batched


def drawn_windows(cfg: TrainConfig) -> dict[tuple[int, int] | None, float]:
    """The SDE windows the run's steps sample with, each with the share of the steps that draw it: every start in
    [lo, hi - size] alike for the fixed and random schedules, the starts the num_steps steps reach for the
    progressive one; {None: 1} without a window. The window's position changes the rollout's forwards (the steps
    after it) and which update path trains it, not the memory of a step (every step's latents are kept)."""
    s = cfg.sampler
    if s.sde_window_size <= 0:
        return {None: 1.0}
    lo, hi = s.sde_window_range
    if s.sde_window_schedule is WindowSchedule.progressive:
        size, iters, stride = s.sde_window_size, s.sde_window_iters, s.sde_window_stride
        starts = [
            progressive_start(step, window_range=(lo, hi), size=size, iters=iters, stride=stride)
            for step in range(cfg.num_steps)
        ]
    else:
        starts = list(range(lo, hi - s.sde_window_size + 1))
    counts = Counter(starts)
    return {(start, start + s.sde_window_size): counts[start] / len(starts) for start in sorted(counts)}


def expected_segments(cfg: TrainConfig, mode: UpdateMode | None = None) -> dict[UpdateMode, float]:
    """Expected segments per micro-batch of each update path, over the random segment pick
    (update.timestep_fraction) and the windows the run draws (``drawn_windows``).
    ``mode`` replaces update.mode (``exact``: the run without JAGG)."""
    counts: dict[UpdateMode, float] = {}
    for window, share in drawn_windows(cfg).items():
        every, p = _routed(cfg, window, mode)
        for segment in every:
            counts[segment.mode] = counts.get(segment.mode, 0.0) + p * share
    return counts


def _routed(
    cfg: TrainConfig, window: tuple[int, int] | None, mode: UpdateMode | None
) -> tuple[list[RoutedSegment], float]:
    """(every segment of a trajectory with SDE ``window``, routed; the probability that the random pick trains
    one: it picks a uniform random subset). ``mode`` as in ``expected_segments``."""
    u = cfg.update
    trainable = trainable_transitions(cfg.sampler, None if window is None else window[0])
    every = route_segments(
        trainable,
        length=u.segment_length,
        mode=UpdateMode(mode or u.mode),
        jagg_frac=u.jagg_frac,
        num_transitions=cfg.sampler.num_steps - 1,
    )
    picked = len(pick_segments(trainable, length=u.segment_length, timestep_fraction=u.timestep_fraction))
    return every, picked / len(every)


def text_tokens(cfg: TrainConfig) -> int:
    """Text tokens per prompt: the adapter's max_sequence_length (Qwen-Image pads to the longest
    prompt of a batch, so this is its worst case)."""
    return int(cfg.model.options.get("max_sequence_length") or 512)


def first_window(cfg: TrainConfig) -> tuple[int, int] | None:
    """The first of the windows the run draws: the one the trace measures memory with."""
    return next(iter(drawn_windows(cfg)))


def update_variants(
    cfg: TrainConfig, segments: dict[UpdateMode, float], *, kept_velocities: bool
) -> list[tuple[str, bool, float]]:
    """(path, on the rollout's velocities, calls per rank per step) for each update call the run makes,
    and exact (the baseline of the speed-up) and exact_batched (its memory) in any case.
    ``update.reuse_velocities=fresh`` reuses them until the first optimizer step of the step moves the
    weights: the first of B / accumulation chunks; ``stale`` for the whole first of grpo.inner_epochs passes."""
    b, passes = cfg.batch, cfg.grpo.inner_epochs
    samples = cfg.grpo.group_size * b.prompts_per_rank
    num_micro_batches = passes * samples // b.micro_batch
    stale = cfg.update.reuse_velocities is ReuseVelocities.stale
    reused = (1.0 if stale else b.gradient_accumulation_steps / samples) / passes
    out: list[tuple[str, bool, float]] = []
    for mode in UpdateMode:
        calls = num_micro_batches * segments.get(mode, 0.0)
        if calls == 0 and mode is not UpdateMode.exact:
            continue
        if kept_velocities and mode in MIDDLE_MODES:
            out.append((mode, True, calls * reused))
            if reused < 1:
                out.append((mode, False, calls * (1 - reused)))
        elif mode is UpdateMode.exact:
            batched = cfg.update.exact_batched
            out += [(mode, False, 0.0 if batched else calls), (EXACT_BATCHED, False, calls if batched else 0.0)]
        else:
            out.append((mode, False, calls))
    return out


def _optimizer_steps(cfg: TrainConfig) -> list[list[dict[int, int]]]:
    """Per optimizer step of a rank's step, over its grpo.inner_epochs passes, its micro-batches: each the rows it
    holds of each sample group (G rows that share a start); a later pass in the order the first step draws."""
    g, b = cfg.grpo, cfg.batch
    samples = g.group_size * b.prompts_per_rank
    orders = [pass_order(cfg.seed, 0, number, samples) for number in range(g.inner_epochs)]
    return [
        [dict(Counter(row // g.group_size for row in rows)) for rows in micro_batches(cfg, order, chunk)]
        for order in orders
        for chunk in range(0, samples, b.gradient_accumulation_steps)
    ]


def _per_group(micro: list[dict[int, int]]) -> dict[int, list[int]]:
    """Each sample group's rows in each micro-batch that holds any."""
    out: dict[int, list[int]] = {}
    for rows in micro:
        for group, num in rows.items():
            out.setdefault(group, []).append(num)
    return out


def _start_step(cfg: TrainConfig, mode: UpdateMode | None = None) -> tuple[float, UpdateMode] | None:
    """(probability that a micro-batch trains the shared step, the path of the segment that starts there),
    None where nothing is shared (update.share_group_start off, G = 1). ``mode`` as in ``expected_segments``."""
    if not cfg.update.share_group_start or cfg.grpo.group_size < 2:
        return None
    segments, p = _routed(cfg, first_window(cfg), mode)
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


def expected_shared_calls(cfg: TrainConfig, mode: UpdateMode | None = None) -> tuple[float, float]:
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
    sequential = path is UpdateMode.jagg_sequential or (path is UpdateMode.exact and not cfg.update.exact_batched)
    per_micro = 1.0 if sequential else 0.0
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


def evaluation(cfg: PlanRunConfig, forward_flops_per_row: float) -> Evaluation | None:
    """The run's evaluations (train/loop/trainer.py: before training, every eval.every steps, after the
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
