"""The update stage's settings (the ``update`` group of the config): the object the update code reads.

The GRPO loss's own settings (clip range, KL weight, RatioNorm, the group size G) belong to the
algorithm's ``grpo`` group; the update stage takes that object beside this one
(``train.algorithm.update.UpdateBatch``) instead of copies of its fields.
"""

from __future__ import annotations

from dataclasses import dataclass

from settings import Choice, check_range


class UpdateMode(Choice):
    """The path a routed segment takes (train/algorithm/jagg.py)."""

    exact = "exact"
    jagg = "jagg"
    jagg_sequential = "jagg_sequential"
    ablate = "ablate"


class Routing(Choice):
    """Which segments take ``update.mode`` (train/algorithm/routing.py)."""

    prefix = "prefix"
    auto = "auto"


class ReuseVelocities(Choice):
    """Whether the middle steps of a jagg segment take the rollout's velocities."""

    fresh = "fresh"
    stale = "stale"
    off = "off"


MIDDLE_MODES = (UpdateMode.jagg, UpdateMode.jagg_sequential)  # the paths that need the middle steps' v


@dataclass
class UpdateConfig:
    mode: UpdateMode = UpdateMode.jagg
    """The path of the segments routed to JAGG: exact | jagg | jagg_sequential | ablate."""
    segment_length: int = 4
    """W: consecutive transitions per segment, >= 2 (JAGG needs two endpoints)."""
    routing: Routing = Routing.prefix
    """Which segments take the `mode` path. prefix: those ending at or before round(jagg_frac * M), M the
    trainable transitions; the rest are exact. auto: every auto_every steps a probe measures cos(g_mode,
    g_exact) per segment on the current policy and a segment takes the `mode` path when its mean cosine >=
    auto_threshold."""
    jagg_frac: float = 0.6
    """routing=prefix: share of the trajectory, in [0, 1], routed to the `mode` path."""
    timestep_fraction: float = 1.0
    """Share of segments trained per sample, in (0, 1] (DanceGRPO draws them at random)."""
    auto_every: int = 10
    """routing=auto: training steps between probes, >= 1 (the first step always probes)."""
    auto_threshold: float = 0.5
    """routing=auto: minimum mean cosine for the `mode` path, in [-1, 1] (the paper's 0.5)."""
    auto_rollouts: int = 4
    """routing=auto: trajectories per probe, all ranks together, >= 1 (<= G * prompts_per_rank)."""
    reuse_velocities: ReuseVelocities = ReuseVelocities.fresh
    """The middle steps of a jagg / jagg_sequential segment need v_j only for s_j = dL_j/dv_j, and the rollout
    computed them. fresh: the rollout keeps its velocities and the update uses them while the weights are
    those that sampled (until the first optimizer step of the training step), then recomputes them; stale:
    uses them after optimizer steps too (an approximation: python -m train.probe reports its cosine); off:
    keeps none and always recomputes. Kept velocities cost N * (latent elements) * (model.dtype bytes) per
    sample (per rank; logged as memory/velocity_bytes_per_sample); exact and ablate, or W = 2, keep none."""
    offload_velocities: bool = False
    """Keep the rollout's velocities in host memory (pinned) instead of on the GPU."""
    share_group_start: bool = True
    """The shared start: a group's G samples start from one noise with one prompt, so every prediction until
    the group's first SDE noise has the same input in its G rows. true: those run one row per group and are
    broadcast (the rollout's prefix and first SDE step; in the update the first trainable step, with grad,
    and its KL reference, over the rows of one optimizer step), the same numbers up to float rounding;
    false: G rows."""
    exact_batched: bool = False
    """The segments routed to exact (in JAGG runs too): true = their W steps in one forward with grad and one
    backward (fewer FSDP2 all-gathers, about W times the activation memory); false = one step at a time."""

    def __post_init__(self) -> None:
        # the members, also when constructed from strings (tests, scripts): code compares with ``is``
        self.mode, self.routing = UpdateMode(self.mode), Routing(self.routing)
        self.reuse_velocities = ReuseVelocities(self.reuse_velocities)
        check_range(self.segment_length, "segment_length", low=2, why=" (JAGG needs two endpoints)")
        check_range(self.jagg_frac, "jagg_frac", low=0, high=1)
        check_range(self.timestep_fraction, "timestep_fraction", low=0, high=1, low_open=True)
        check_range(self.auto_threshold, "auto_threshold", low=-1, high=1, why=" (a cosine)")
        check_range(self.auto_every, "auto_every", low=1)
        check_range(self.auto_rollouts, "auto_rollouts", low=1)
        if self.offload_velocities and self.reuse_velocities is ReuseVelocities.off:
            raise ValueError(
                "offload_velocities=true keeps no velocities with reuse_velocities=off: "
                "pick reuse_velocities=fresh or stale, or offload_velocities=false"
            )
        if self.routing is Routing.auto and self.mode is UpdateMode.exact:
            raise ValueError("routing=auto routes between mode and exact: pick mode=jagg")

    @property
    def reuses_velocities(self) -> bool:
        """Whether the middle steps take the rollout's velocities: only a path with them (W > 2)."""
        return (
            self.reuse_velocities is not ReuseVelocities.off and self.mode in MIDDLE_MODES and self.segment_length > 2
        )

    def keeps_velocities(self, *, ratio_norm: bool) -> bool:
        """Whether the rollout keeps its velocities: to reuse them, or (``ratio_norm``, GRPO-Guard's
        normalisation) as the sampling weights' v that the current transition mean is compared with."""
        return self.reuses_velocities or ratio_norm

    def shared_rows(self, group_size: int) -> int:
        """The rows that share a start (rollout and update): G with ``share_group_start``, else 1."""
        return group_size if self.share_group_start else 1
