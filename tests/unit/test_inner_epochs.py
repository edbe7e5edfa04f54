"""Inner epochs (``grpo.inner_epochs``, train/loop/passes.py ``update``): K update passes over a rollout's samples,
each later pass reshuffled, against a hand-written loop of K passes in float64, and every update path's gradient
at the weights a pass moved against exact autograd there."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from probe_toys import DIM, ToyCond, ToyVelocity

from samplers.rollout import KeptVelocities, Trajectory, rollout, transition
from samplers.sampler_config import SamplerConfig
from samplers.schedule import shifted_sigmas
from train.algorithm.grpo_config import BatchConfig, GRPOConfig
from train.algorithm.routing import PrefixRouter
from train.algorithm.update_config import UpdateConfig
from train.distributed.seeds import stream_seed
from train.loop.passes import pass_order, update
from train.parts.config.schema import TrainConfig
from train.parts.observe.health import Health, HealthConfig, bad_step
from train.parts.observe.perf import PhaseTimer
from train.parts.optim.optim_config import OptimizerConfig
from train.run.build import optimizer_steps_per_step
from train.run.parts import OptimParts

G, GROUPS, STEP, LR, CLIP = 2, 2, 3, 0.05, 0.003
ADVANTAGES = torch.tensor([1.0, -0.6, 0.8, -1.3], dtype=torch.float64)


def in_float64(net):
    return lambda z, t, cond: net(z.double(), t.double(), cond)


def _trajectory(net: ToyVelocity) -> Trajectory:
    """Two groups of G rows, each from one initial noise (the shared start's premise), 8 trainable transitions."""
    noise = torch.randn(GROUPS, DIM, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        return rollout(
            in_float64(net),
            ToyCond(torch.zeros(G * GROUPS, 1)),
            noise.repeat_interleave(G, 0),
            SamplerConfig(sde="dance", num_steps=9, eta=0.3),
            sigmas=shifted_sigmas(9, 3.0).double(),
            generator=torch.Generator().manual_seed(2),
            velocities=KeptVelocities(torch.float64),
        )


def _config(mode: str = "exact", reuse: str = "fresh", *, inner_epochs: int = 2, share: bool = True) -> TrainConfig:
    return TrainConfig(
        seed=7,
        grpo=GRPOConfig(group_size=G, clip_range=CLIP, inner_epochs=inner_epochs),
        batch=BatchConfig(prompts_per_rank=GROUPS, micro_batch=1, gradient_accumulation_steps=2),
        update=UpdateConfig(mode=mode, jagg_frac=1.0, reuse_velocities=reuse, share_group_start=share),
        optimizer=OptimizerConfig(max_grad_norm=1e6),
    )


class RecordingSGD(torch.optim.SGD):
    """SGD that records, at each step, the weights it starts from and the gradient it takes."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__(params, lr=LR)
        self.seen: list[tuple[list[torch.Tensor], torch.Tensor]] = []

    def step(self, closure=None):  # type: ignore[override]
        params = self.param_groups[0]["params"]
        self.seen.append(([p.detach().clone() for p in params], torch.cat([p.grad.flatten() for p in params])))
        return super().step(closure)


def _train(cfg: TrainConfig, net: ToyVelocity, traj: Trajectory) -> tuple[RecordingSGD, dict[str, float]]:
    """The step's update (train/loop/step.py) of ``net`` on ``traj``."""
    params = list(net.parameters())
    optimizer = RecordingSGD(params)
    model = SimpleNamespace(policy=in_float64(net), kl_reference=None, params=params)
    optim = OptimParts(optimizer=optimizer, ema=None, router=PrefixRouter(cfg.update))
    timer, cpu = PhaseTimer(), torch.device("cpu")
    return optimizer, update(model, optim, cfg, step=STEP, traj=traj, advantages=ADVANTAGES, timer=timer, device=cpu)


def _exact(
    net: ToyVelocity, traj: Trajectory, rows: list[int], clip: float, steps: list[int] | None = None
) -> tuple[torch.Tensor, list[float]]:
    """By hand: the gradient of the mean PPO-clip loss over ``rows`` and the transitions ``steps`` (default: every
    trainable one), autograd through each transition on its own; and the ratios."""
    loss, ratios = torch.zeros((), dtype=torch.float64), []
    steps = traj.trainable_steps() if steps is None else steps
    adv = ADVANTAGES[rows]
    for k in steps:
        v = in_float64(net)(traj.latents[rows, k], traj.timesteps[k].expand(len(rows)), None)
        ratio = torch.exp(transition(traj, k, v, rows).log_prob - traj.log_probs[rows, k])
        loss = loss + torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - clip, 1 + clip)).sum()
        ratios += ratio.tolist()
    grads = torch.autograd.grad(loss / (len(rows) * len(steps)), list(net.parameters()))
    return torch.cat([g.flatten() for g in grads]), ratios


def _by_hand(cfg: TrainConfig, net: ToyVelocity, traj: Trajectory) -> tuple[ToyVelocity, list[torch.Tensor], list]:
    """K passes written out: pass 1 in row order, pass k > 1 in torch.randperm of the stream (seed, "pass_order",
    (step, k - 1)); one SGD step per gradient_accumulation_steps rows. (weights, gradients, ratios per pass)."""
    net, grads, ratios = copy.deepcopy(net), [], []
    rows, accumulation = traj.batch_size, cfg.batch.gradient_accumulation_steps
    for number in range(cfg.grpo.inner_epochs):
        seed = stream_seed(cfg.seed, "pass_order", (STEP, number))
        order = torch.randperm(rows, generator=torch.Generator().manual_seed(seed)).tolist() if number else [0, 1, 2, 3]
        ratios.append([])
        for first in range(0, rows, accumulation):
            grad, ratio = _exact(net, traj, order[first : first + accumulation], cfg.grpo.clip_range)
            ratios[-1] += ratio
            grads.append(grad)
            with torch.no_grad():
                flat = torch.nn.utils.parameters_to_vector(net.parameters())
                torch.nn.utils.vector_to_parameters(flat - LR * grad, net.parameters())
    return net, grads, ratios


@pytest.mark.parametrize("share", [True, False])
def test_two_passes_equal_a_hand_written_loop_of_reshuffled_passes(share):
    """Float64: the weights after K = 2 passes, every optimizer step's gradient and each pass's mean ratio and clip
    fraction are those of the loop written out; the second pass runs off policy (its ratios leave 1, the clip
    acts on some rows but not all)."""
    net = ToyVelocity(gamma=10.0).double()
    traj = _trajectory(net)
    cfg = _config(share=share)
    expected, grads, ratios = _by_hand(cfg, net, traj)
    optimizer, metrics = _train(cfg, net, traj)
    assert len(optimizer.seen) == len(grads) == 4
    for (_, got), want in zip(optimizer.seen, grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-13)
    for got_p, want_p in zip(net.parameters(), expected.parameters()):
        torch.testing.assert_close(got_p, want_p, rtol=1e-12, atol=1e-13)
    for number, ratio in enumerate(ratios, start=1):
        r = torch.tensor(ratio, dtype=torch.float64)
        clipped = float(((r - 1).abs() > cfg.grpo.clip_range).double().mean())
        assert metrics[f"train/pass{number}/ratio_mean"] == pytest.approx(float(r.mean()), rel=1e-12)
        assert metrics[f"train/pass{number}/clip_frac"] == pytest.approx(clipped, abs=1e-12)
    assert 0 < metrics["train/pass2/clip_frac"] < 1 and metrics["train/pass2/ratio_mean"] != pytest.approx(1.0)


def test_one_pass_logs_no_pass_metrics():
    net = ToyVelocity().double()
    optimizer, metrics = _train(_config(inner_epochs=1), net, _trajectory(net))
    assert len(optimizer.seen) == 2 and not any(name.startswith("train/pass") for name in metrics)


@pytest.mark.parametrize("reuse", ["fresh", "stale"])
@pytest.mark.parametrize("mode", ["exact", "jagg", "jagg_sequential", "ablate"])
def test_each_path_is_exact_at_the_weights_a_pass_moved(mode, reuse):
    """Where the paper's Theorem 1 holds (gamma = 0), every optimizer step's gradient of every path equals exact
    autograd at the weights that step starts from, the shared start on: the second pass's at weights two optimizer
    steps moved, so no path may take the rollout's velocities there (``stale`` takes them in the first pass only,
    whose second step is then off by the move). ablate drops the middle steps: it equals its own endpoints.
    jagg_sequential's middle weights are float32: to their rounding (1e-8 relative)."""
    net = ToyVelocity().double()
    traj = _trajectory(net)
    optimizer, _ = _train(_config(mode, reuse), net, traj)
    probe = copy.deepcopy(net)
    for number, (weights, got) in enumerate(optimizer.seen):
        torch.nn.utils.vector_to_parameters(torch.cat([w.flatten() for w in weights]), probe.parameters())
        order = pass_order(7, STEP, number // 2, traj.batch_size)
        rows = order[2 * (number % 2) : 2 * (number % 2) + 2]
        if mode == "ablate":  # the segments' ends, each as 1/8 of the loss over the 8 trained transitions
            want = _exact(probe, traj, rows, CLIP, steps=[0, 3, 4, 7])[0] / 2
        else:
            want = _exact(probe, traj, rows, CLIP)[0]
        error = float((got - want).norm() / want.norm())
        if reuse == "stale" and mode.startswith("jagg") and number == 1:
            assert error > 1e-4
            continue
        assert error < (1e-7 if mode == "jagg_sequential" else 1e-12), f"optimizer step {number}: {error:.1e}"


def test_pass_order_from_the_seed_stream():
    """Pass 1 in the rollout's order; each later pass a permutation of the stream (seed, step, pass): the same when
    drawn again (a resumed step), whatever the global RNG, another for another pass, step or seed."""
    assert pass_order(7, STEP, 0, 12) == list(range(12))
    torch.manual_seed(0)
    second = pass_order(7, STEP, 1, 12)
    torch.manual_seed(1)
    assert pass_order(7, STEP, 1, 12) == second and sorted(second) == list(range(12))
    others = [pass_order(7, STEP, 2, 12), pass_order(7, STEP + 1, 1, 12), pass_order(8, STEP, 1, 12)]
    assert all(other != second for other in others) and second != list(range(12))


def test_health_counts_the_optimizer_steps_of_every_pass():
    """A step is bad when every optimizer step of its K passes was skipped: two passes of two optimizer steps at
    NaN weights skip all four (the count the trainer gives ``Health``), a bad step; a step that skipped one pass's
    worth of them (2 of 4) still moved the weights."""
    cfg = _config()
    net = ToyVelocity().double()
    traj = _trajectory(net)
    with torch.no_grad():
        net.c.fill_(float("nan"))
    optimizer, metrics = _train(cfg, net, traj)
    steps = optimizer_steps_per_step(cfg)
    assert not optimizer.seen and metrics["train/skipped_optimizer_steps"] == steps == 2 * 2
    assert bad_step(metrics, steps) == "the gradient was not finite (every optimizer step was skipped)"
    watch = Health(HealthConfig(max_bad_steps=1), optimizer_steps=steps, first=0, last=9, start_norm=1.0)
    one_pass = {"train/skipped_optimizer_steps": steps // 2, "train/grad_norm": 1.0}
    assert watch.observe(one_pass, 0) is None and watch.bad_in_a_row == 0
    verdict = watch.observe(metrics, 1)
    assert verdict is not None and "steps 1 to 1 could not change the weights" in verdict.line


def test_inner_epochs_must_be_at_least_one():
    with pytest.raises(ValueError, match="inner_epochs"):
        GRPOConfig(inner_epochs=0)
