"""The update stage (train/algorithm/update.py) on toy velocity models: the KL reference's batched call, and the
JAGG paths on the rollout's kept velocities."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from probe_toys import ToyVelocity, toy_batch, toy_settings, toy_trajectory
from torch import Tensor

from samplers.rollout import transition
from train.algorithm.grpo import kl_to_reference
from train.algorithm.segments import RoutedSegment
from train.algorithm.update import reference_velocities, step_loss, update_micro_batch
from train.algorithm.update_config import UpdateConfig

ROWS = torch.tensor([1, 3])


class Recording(ToyVelocity):
    """A toy velocity that records the rows of every call."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.calls: list[int] = []

    def forward(self, z: Tensor, t: Tensor, cond) -> Tensor:
        self.calls.append(z.shape[0])
        return super().forward(z, t, cond)


def test_kl_reference_is_one_batched_call_per_segment():
    """The reference's v of the segment's W steps come from one call over W x rows rows, and each step's
    KL term equals the one of a reference evaluated at that step alone."""
    model, reference = ToyVelocity(), Recording(seed=1)
    traj = toy_trajectory(model)
    batch = toy_batch(model, traj, toy_settings(kl_beta=0.1), reference=reference)
    loss = step_loss(batch, ROWS, (4, 8), scale=1.0, reference=reference_velocities(batch, ROWS, (4, 8)))
    assert reference.calls == [4 * len(ROWS)] and loss.reference_forwards == 4
    cond = traj.cond.index(ROWS)
    for j, k in enumerate(range(4, 8)):
        t = traj.timesteps[k].expand(len(ROWS))
        v = model(traj.latents[ROWS, k], t, cond)
        out, ref_out = (
            transition(traj, k, v, ROWS),
            transition(traj, k, reference(traj.latents[ROWS, k], t, cond), ROWS),
        )
        expected = kl_to_reference(out.mean, ref_out.mean, out.diffusion)
        assert expected > 0
        torch.testing.assert_close(loss(j, v)[1]["kl"].value, expected.detach())


def _micro_batch_grads(model, traj, settings, route, *, reuse: bool):
    model.zero_grad(set_to_none=True)
    stats = update_micro_batch(toy_batch(model, traj, settings), ROWS, route, reuse_velocities=reuse)
    return torch.cat([p.grad.flatten() for p in model.parameters()]), stats


def test_micro_batch_on_kept_velocities():
    """The jagg segments take their middle steps from the rollout (same gradient as recomputing, no
    middle forward); the exact segment runs as always."""
    model = Recording(gamma=10.0)
    traj = toy_trajectory(model, keep_velocities=True)
    route = [RoutedSegment(0, 4, "jagg"), RoutedSegment(4, 8, "jagg_sequential"), RoutedSegment(8, 12, "exact")]
    settings = toy_settings()
    model.calls.clear()
    recomputed, recomputing = _micro_batch_grads(model, traj, settings, route, reuse=False)
    recomputing_calls = list(model.calls)
    model.calls.clear()
    reused, stats = _micro_batch_grads(model, traj, settings, route, reuse=True)
    # float32: the rollout's v of 4 rows and the recomputed v of 2 rows agree to rounding
    assert float((reused - recomputed).norm() / recomputed.norm()) < 1e-6
    assert (stats.counts.reused_velocities, recomputing.counts.reused_velocities) == (4, 0)
    assert stats.counts.nograd_forwards == recomputing.counts.nograd_forwards - 4
    # recomputing: jagg = middle (4 rows) + endpoints (4); sequential = middle (4) + 2 + 2; exact = 4 x 2
    assert recomputing_calls == [4, 4, 4, 2, 2, 2, 2, 2, 2]
    assert model.calls == [4, 2, 2, 2, 2, 2, 2]


def test_reuse_needs_kept_velocities():
    model = ToyVelocity()
    with pytest.raises(ValueError, match="kept no velocities"):
        _micro_batch_grads(model, toy_trajectory(model), toy_settings(), [RoutedSegment(0, 4, "jagg")], reuse=True)


@pytest.mark.parametrize(
    "mode, length, reuse, keeps",
    [
        ("jagg", 4, "fresh", True),
        ("jagg_sequential", 4, "stale", True),
        ("jagg", 4, "off", False),
        ("jagg", 2, "fresh", False),  # no middle step
        ("exact", 4, "fresh", False),
        ("ablate", 4, "stale", False),
    ],
)
def test_which_runs_keep_velocities(mode, length, reuse, keeps):
    config = UpdateConfig(mode=mode, segment_length=length, reuse_velocities=reuse)
    assert config.keeps_velocities(ratio_norm=False) is config.reuses_velocities is keeps
    # GRPO-Guard reads the sampling weights' v from the rollout on every path, and reuses none for it
    assert config.keeps_velocities(ratio_norm=True) and config.reuses_velocities is keeps


def in_float64(net):
    return lambda z, t, cond: net(z.double(), t.double(), cond)


def test_ratio_norm_on_policy_scales_each_steps_gradient_by_its_std():
    """On the sampling weights (v = the rollout's v, so mu = mu_old) the normalised log-ratio is
    (logp - logp_old) s: each step's gradient in v is its plain one times the step's std s, and the
    mean-shift term contributes nothing. Float64 steps on the float32 rollout: rounding only."""
    model = ToyVelocity(gamma=10.0)
    traj = toy_trajectory(model, sde="flow", keep_velocities=True)
    plain_settings = toy_settings()
    guarded = toy_batch(model, traj, replace(plain_settings, ratio_norm=True))
    plain = toy_batch(model, traj, plain_settings)
    segment = (4, 8)
    guarded_loss = step_loss(guarded, ROWS, segment, scale=1.0, reference=None)
    plain_loss = step_loss(plain, ROWS, segment, scale=1.0, reference=None)
    for j, k in enumerate(range(*segment)):
        grads = []
        for loss in (guarded_loss, plain_loss):
            v = traj.velocities[ROWS, k].double().requires_grad_()
            (grad,) = torch.autograd.grad(loss(j, v)[0], v)
            grads.append(grad)
        std = transition(traj, k, traj.velocities[ROWS, k], ROWS).std
        assert torch.equal(std, std[:1].expand_as(std))  # one schedule: every row of a step shares s
        assert grads[1].abs().max() > 0
        torch.testing.assert_close(grads[0], float(std[0]) * grads[1], rtol=1e-5, atol=0)


@pytest.mark.parametrize("sde", ["dance", "flow"])
def test_ratio_norm_through_jagg_is_exact_where_theorem_1_holds(sde):
    """GRPO-Guard's loss is a loss like any other: on a velocity whose parameter Jacobian is affine in t
    and free of z (gamma = 0), jagg (through its s_j) gives exact's gradient of it, off the sampling
    weights too (the model moved, so mu != mu_old and the shift term counts). Float64."""
    model = ToyVelocity().double()
    traj = toy_trajectory(in_float64(model), sde=sde, keep_velocities=True)
    with torch.no_grad():  # off-policy: the shift term and ratios away from one count
        for param in model.parameters():
            param.mul_(1.05)
    settings = replace(toy_settings(), ratio_norm=True)
    grads = {}
    for mode in ("exact", "jagg"):
        model.zero_grad(set_to_none=True)
        update_micro_batch(toy_batch(in_float64(model), traj, settings), ROWS, [RoutedSegment(4, 8, mode)])
        grads[mode] = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert grads["exact"].abs().max() > 0
    torch.testing.assert_close(grads["jagg"], grads["exact"], rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("kl_beta, ratio_norm", [(0.0, False), (0.1, False), (0.0, True)])
def test_micro_batches_of_1_2_and_g_give_one_gradient(kl_beta, ratio_norm):
    """With every segment trained (timestep_fraction 1), the accumulated gradient of the G rows does not
    depend on how they are split into micro-batches: each micro-batch's loss is scaled by
    (rows / gradient_accumulation_steps) / trained transitions. GRPO-Guard's mean std is over a
    micro-batch's rows of one step, which share their std: no split changes it. Float64, so only
    rounding differs."""
    model, reference = ToyVelocity(gamma=10.0).double(), ToyVelocity(seed=1).double()
    traj = toy_trajectory(in_float64(model), keep_velocities=ratio_norm)
    rows = traj.batch_size
    settings = replace(toy_settings(kl_beta=kl_beta), gradient_accumulation_steps=rows, ratio_norm=ratio_norm)
    batch = toy_batch(in_float64(model), traj, settings, reference=in_float64(reference))
    route = [RoutedSegment(0, 4, "jagg"), RoutedSegment(4, 8, "jagg_sequential"), RoutedSegment(8, 12, "exact")]
    grads = []
    for micro in (1, 2, rows):
        model.zero_grad(set_to_none=True)
        for first in range(0, rows, micro):
            update_micro_batch(batch, torch.arange(first, first + micro), route)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert grads[0].abs().max() > 0
    for other in grads[1:]:
        torch.testing.assert_close(other, grads[0], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    "mode, exact_batched, calls",
    [("jagg", False, 1), ("ablate", False, 1), ("jagg_sequential", False, 2), ("exact", False, 4), ("exact", True, 1)],
)
def test_a_segments_gradient_comes_from_its_paths_backward_calls(mode, exact_batched, calls, monkeypatch):
    """A segment of W = 4 runs as many autograd backward calls as its path says (jagg: one, for both
    endpoints together; exact: one per step), and the update's count is the calls it made. Where the
    paper's Theorem 1 holds (gamma = 0: a Jacobian affine in t and free of z), jagg's one call gives
    exact's gradient (jagg_sequential's middle weights are float32: to its rounding)."""
    model = ToyVelocity().double()
    traj = toy_trajectory(in_float64(model))
    made = []
    backward = torch.autograd.backward
    monkeypatch.setattr(torch.autograd, "backward", lambda *a, **k: (made.append(1), backward(*a, **k))[1])
    grads = {}
    for path in dict.fromkeys((mode, "exact")):
        made.clear()
        model.zero_grad(set_to_none=True)
        settings = replace(toy_settings(mode=path), exact_batched=exact_batched and path == mode)
        stats = update_micro_batch(toy_batch(in_float64(model), traj, settings), ROWS, [RoutedSegment(4, 8, path)])
        grads[path] = torch.cat([p.grad.flatten() for p in model.parameters()])
        if path == mode:
            assert len(made) == stats.counts.backward_calls == calls
    assert grads["exact"].abs().max() > 0
    if mode != "ablate":  # ablate drops the middle steps: another gradient
        torch.testing.assert_close(grads[mode], grads["exact"], rtol=1e-6, atol=1e-12)


def test_each_metric_is_reduced_by_its_own_reduction():
    """A mean weighs each step by its rows, a max and a min keep the extremes whatever their names, and
    the counters add up to integers; the step reduces them over ranks (one process here)."""
    from train.algorithm.jagg import Counts, SegmentStats
    from train.algorithm.metrics import Metric, Reduce
    from train.algorithm.update import UpdateStats
    from train.loop.passes import reduce_over_ranks

    def segment(loss: float, peak: float, low: float) -> SegmentStats:
        metrics = {"loss": Metric(torch.tensor(loss)), "peak": Metric(peak, Reduce.max), "low": Metric(low, Reduce.min)}
        return SegmentStats(metrics={0: metrics}, counts=Counts(grad_forwards=2, backward_calls=1))

    stats = UpdateStats()
    stats.add_segment("jagg", segment(1.0, 3.0, -1.0), rows=1)
    other = UpdateStats()
    other.add_segment("exact", segment(4.0, 2.0, -5.0), rows=3)
    metrics = (stats + other).metrics()
    assert [name for name in metrics if name.startswith("train/")] == ["train/loss", "train/peak", "train/low"]
    reduced = reduce_over_ranks(metrics, torch.device("cpu"))
    assert reduced["train/loss"] == (1 * 1.0 + 3 * 4.0) / 4  # over every row
    assert (reduced["train/peak"], reduced["train/low"]) == (3.0, -5.0)
    assert reduced["count/grad_forwards"] == 4 and isinstance(reduced["count/grad_forwards"], int)
    assert (reduced["count/segments_jagg"], reduced["count/segments_exact"]) == (1, 1)
