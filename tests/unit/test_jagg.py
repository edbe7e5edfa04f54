"""The four update paths (and exact with ``exact_batched``) against independently computed gradients, in float64.

Each test builds the real per-step GRPO loss of a segment (SDE log-prob of a stored transition, PPO
clip) and compares ``backward_segment``'s accumulated ``.grad`` with a formula evaluated with
``torch.func`` Jacobians, never with the code under test.
"""

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev

from samplers.schedule import check_timesteps, shifted_sigmas
from samplers.sde import SDE, step
from train.algorithm.grpo import ppo_step_loss
from train.algorithm.jagg import UPDATE_MODES, Counts, aggregate, backward_segment, interpolation_weights
from train.algorithm.segments import prefix_path, route_segments, split_segments

pytestmark = pytest.mark.usefixtures("float64")
B, D = 3, 6
SDE_ = SDE("dance", eta=0.7)
PATHS = (*UPDATE_MODES, "exact_batched")  # exact_batched: the exact mode with its flag


class LinearInZT(nn.Module):
    """v = A(theta) z + b(theta) t + c(theta): nonlinear in theta, linear in (z, t)."""

    def __init__(self):
        super().__init__()
        self.p1, self.p2 = nn.Parameter(torch.randn(D, D)), nn.Parameter(torch.randn(D, D))
        self.q, self.r = nn.Parameter(torch.randn(D)), nn.Parameter(torch.randn(D))

    def forward(self, z, t):
        a = 0.3 * torch.tanh(self.p1) @ self.p2
        return z @ a.T + t[:, None] * torch.sin(self.q) * self.q + self.r**3


class MLP(nn.Module):
    """Nonlinear in z, t and theta."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(D + 1, 16), nn.Tanh(), nn.Linear(16, 16), nn.SiLU(), nn.Linear(16, D))

    def forward(self, z, t):
        return self.net(torch.cat([z, t[:, None]], dim=1))


def make_segment(model, width, *, start=4, affine_path=False, seed=0, clip_range=10.0, advantages=None):
    """z [W] latents, t [W] timesteps and the GRPO step_loss(j, v) -> (loss, metrics) of a segment of transitions."""
    g = torch.Generator().manual_seed(seed)
    sigmas = shifted_sigmas(20, 3.0)[start : start + width + 1]  # non-uniform (shift 3)
    t = sigmas[:-1].clone()
    z = [torch.randn(B, D, generator=g) for _ in range(width)]
    if affine_path:
        alpha = interpolation_weights(t)
        z = [z[0] + a * (z[-1] - z[0]) for a in alpha]
    adv = torch.randn(B, generator=g) if advantages is None else advantages
    next_z, old = [], []
    with torch.no_grad():
        for j in range(width):
            out = step(SDE_, model(z[j], t[j].expand(B)), z[j], sigmas[j], sigmas[j + 1], generator=g)
            next_z.append(out.next_z)
            old.append(out.log_prob + 0.01 * torch.randn(B, generator=g))  # ratios != 1

    def step_loss(j, v):
        logp = step(SDE_, v, z[j], sigmas[j], sigmas[j + 1], next_z=next_z[j]).log_prob
        return ppo_step_loss(logp, old[j], adv, clip_range=clip_range)

    return z, t, step_loss


def mlp_segment(torch_seed, width, **kwargs):
    """An MLP with weights drawn after ``torch.manual_seed(torch_seed)``, and a segment of it (``make_segment``)."""
    torch.manual_seed(torch_seed)
    model = MLP()
    return (model, *make_segment(model, width, **kwargs))


def backward(model, path, z, t, step_loss, **kwargs):
    """``backward_segment`` by one of PATHS."""
    mode, batched = ("exact", True) if path == "exact_batched" else (path, False)
    return backward_segment(mode, lambda zz, tt: model(zz, tt), step_loss, z, t, exact_batched=batched, **kwargs)


def grads_of(model, path, z, t, step_loss):
    model.zero_grad(set_to_none=True)
    stats = backward(model, path, z, t, step_loss)
    return torch.cat([p.grad.flatten() for p in model.parameters()]), stats


def _velocities(model, z, t):
    with torch.no_grad():
        return [model(z_j, t_j.expand(B)) for z_j, t_j in zip(z, t)]


def vjp(model, z_j, t_j, cot):
    """J^T cot, J the Jacobian of v(z_j, t_j) in the parameters (torch.func), flattened over all parameters."""
    params = {k: p.detach() for k, p in model.named_parameters()}
    jac = jacrev(lambda p: functional_call(model, p, (z_j, t_j.expand(B))))(params)
    return torch.cat([torch.einsum("bd,bd...->...", cot, jac[k]).flatten() for k in params])


def score(step_loss, j, v):
    """s_j = d L_j / d v at v."""
    v = v.clone().requires_grad_(True)
    return torch.autograd.grad(step_loss(j, v)[0], v)[0]


def jacobian_terms(model, z, t, step_loss):
    """[J_j^T s_j for each j], flattened over all parameters."""
    return [vjp(model, z[j], t[j], score(step_loss, j, v)) for j, v in enumerate(_velocities(model, z, t))]


def jagg_formula(model, z, t, step_loss, velocities):
    """J_0^T s_base + J_{W-1}^T s_corr, the s_j taken at ``velocities``: they enter through the endpoints' Jacobians."""
    s = [score(step_loss, j, v) for j, v in enumerate(velocities)]
    alpha = interpolation_weights(t)
    s_base = sum((1 - a) * s_j for a, s_j in zip(alpha, s))
    s_corr = sum(a * s_j for a, s_j in zip(alpha, s))
    return vjp(model, z[0], t[0], s_base) + vjp(model, z[-1], t[-1], s_corr)


@pytest.mark.parametrize("width", [3, 4, 5])
def test_theorem_1_jagg_exact_for_linear_velocity(width):
    torch.manual_seed(0)
    model = LinearInZT()
    z, t, step_loss = make_segment(model, width, affine_path=True)
    exact, _ = grads_of(model, "exact", z, t, step_loss)
    for mode in ("jagg", "jagg_sequential"):
        approx, _ = grads_of(model, mode, z, t, step_loss)
        torch.testing.assert_close(approx, exact, rtol=1e-10, atol=1e-12)
    # The premise matters: off the affine path JAGG is only an approximation.
    z_off, t_off, loss_off = make_segment(model, width, affine_path=False, seed=1)
    exact_off, _ = grads_of(model, "exact", z_off, t_off, loss_off)
    jagg_off, _ = grads_of(model, "jagg", z_off, t_off, loss_off)
    assert (jagg_off - exact_off).abs().max() > 1e-4


def test_each_mode_equals_its_formula_on_nonlinear_network():
    width = 4
    model, z, t, step_loss = mlp_segment(1, width)
    terms = jacobian_terms(model, z, t, step_loss)
    jagg = jagg_formula(model, z, t, step_loss, _velocities(model, z, t))
    exact = sum(terms)
    expected = {
        "exact": exact,
        "exact_batched": exact,
        "jagg": jagg,
        "jagg_sequential": jagg,
        "ablate": terms[0] + terms[-1],
    }
    for mode in PATHS:
        got, _ = grads_of(model, mode, z, t, step_loss)
        torch.testing.assert_close(got, expected[mode], rtol=1e-9, atol=1e-12, msg=mode)
    assert (expected["jagg"] - expected["exact"]).abs().max() > 1e-6  # the approximation is not trivial


def test_segment_length_two_all_modes_agree():
    model, z, t, step_loss = mlp_segment(2, 2)
    exact, _ = grads_of(model, "exact", z, t, step_loss)
    for mode in ("jagg", "jagg_sequential", "ablate"):
        got, _ = grads_of(model, mode, z, t, step_loss)
        torch.testing.assert_close(got, exact, rtol=1e-10, atol=1e-12)


def test_gradients_accumulate_across_segments():
    model, z, t, step_loss = mlp_segment(3, 4)
    once, _ = grads_of(model, "jagg", z, t, step_loss)
    backward(model, "jagg", z, t, step_loss)
    torch.testing.assert_close(torch.cat([p.grad.flatten() for p in model.parameters()]), 2 * once)


@pytest.mark.filterwarnings("ignore:Full backward hook")
@pytest.mark.parametrize(
    "mode, grad_fwd, nograd_fwd, calls, backward_steps",
    [
        ("exact", 5, 0, 5, 5),
        ("exact_batched", 5, 0, 1, 5),  # the W steps' graph in one backward call
        ("jagg", 2, 3, 1, 2),
        ("jagg_sequential", 2, 3, 2, 2),
        ("ablate", 2, 0, 1, 2),
    ],
)
def test_counters_and_backward_hook(mode, grad_fwd, nograd_fwd, calls, backward_steps):
    model, z, t, step_loss = mlp_segment(4, 5)
    rows = []
    model.register_full_backward_hook(lambda m, gin, gout: rows.append(gout[0].shape[0]))
    _, stats = grads_of(model, mode, z, t, step_loss)
    assert stats.counts == Counts(grad_fwd, nograd_fwd, calls, 0)
    assert sum(rows) // B == backward_steps  # transformer backward passes, in steps of B rows
    assert len(rows) == calls
    expected_steps = [0, 4] if mode == "ablate" else [0, 1, 2, 3, 4]
    assert list(stats.losses) == expected_steps


@pytest.mark.parametrize("mode", PATHS)
def test_a_given_start_leaves_step_0_to_the_caller(mode):
    """With v_0 given (the shared start), a path runs no forward of step 0: its .grad plus the caller's
    J_0^T start_upstream is the path's gradient, and the step losses are the same."""
    model, z, t, step_loss = mlp_segment(6, 4)
    full, full_stats = grads_of(model, mode, z, t, step_loss)
    model.zero_grad(set_to_none=True)
    v0 = model(z[0], t[0].expand(B))
    stats = backward(model, mode, z, t, step_loss, start=v0.detach())
    assert stats.start_upstream is not None and stats.start_upstream.shape == v0.shape
    v0.backward(stats.start_upstream)
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    torch.testing.assert_close(got, full, rtol=1e-12, atol=1e-14)
    assert stats.counts.grad_forwards == full_stats.counts.grad_forwards - 1
    torch.testing.assert_close(torch.stack(list(stats.losses.values())), torch.stack(list(full_stats.losses.values())))
    with pytest.raises(ValueError, match="start"):
        backward(model, mode, z, t, step_loss, start=v0.detach()[:1])


def test_losses_and_metrics_are_the_step_losses():
    model, z, t, step_loss = mlp_segment(5, 4)
    _, exact = grads_of(model, "exact", z, t, step_loss)
    _, jagg = grads_of(model, "jagg", z, t, step_loss)
    for j in range(4):
        loss, metrics = step_loss(j, model(z[j], t[j].expand(B)))
        torch.testing.assert_close(jagg.losses[j], exact.losses[j])
        torch.testing.assert_close(exact.losses[j], loss.detach())
        assert exact.metrics[j].keys() == jagg.metrics[j].keys() == metrics.keys()  # handed back as values
        for name, value in metrics.items():
            assert jagg.metrics[j][name].reduce is value.reduce
            torch.testing.assert_close(jagg.metrics[j][name].value, value.value)


def test_clipped_step_contributes_exactly_zero():
    width = 4
    model, z, t, base_loss = mlp_segment(6, width, clip_range=0.2, advantages=torch.ones(B))

    def clipped_loss(j, v):  # step 1 with a ratio far above 1 + eps and A > 0: clipped in every row
        if j != 1:
            return base_loss(j, v)
        return ppo_step_loss(v.sum(1) * 0 + 5.0, torch.zeros(B), torch.ones(B), clip_range=0.2)

    def dropped_loss(j, v):
        return base_loss(j, v) if j != 1 else ((v * 0).sum(), {})

    for mode in UPDATE_MODES:
        with_clip, _ = grads_of(model, mode, z, t, clipped_loss)
        dropped, _ = grads_of(model, mode, z, t, dropped_loss)
        assert torch.equal(with_clip, dropped), mode


def test_zero_advantage_gives_zero_gradient():
    model, z, t, step_loss = mlp_segment(7, 4, advantages=torch.zeros(B))
    for mode in UPDATE_MODES:
        got, _ = grads_of(model, mode, z, t, step_loss)
        assert torch.equal(got, torch.zeros_like(got)), mode


def test_interpolation_weights_and_aggregate():
    t = torch.tensor([1.0, 0.9, 0.6, 0.5])
    torch.testing.assert_close(interpolation_weights(t), torch.tensor([0.0, 0.2, 0.8, 1.0]))
    s = [torch.full((2,), float(j + 1)) for j in range(4)]  # s_j = j + 1
    base, corr = aggregate(s, t)
    # base = 1*1 + 0.8*2 + 0.2*3 + 0*4 = 3.2; corr = 0*1 + 0.2*2 + 0.8*3 + 1*4 = 6.8
    torch.testing.assert_close(base, torch.full((2,), 3.2))
    torch.testing.assert_close(corr, torch.full((2,), 6.8))


def test_timesteps_that_repeat_are_refused():
    """A segment's alpha divides by t_0 - t_{W-1}: the rollout refuses a schedule with a repeated timestep."""
    check_timesteps(shifted_sigmas(20, 3.0), quantize="float64")
    with pytest.raises(ValueError, match="strictly decrease, but quantize=float64 maps two"):
        check_timesteps(torch.tensor([1.0, 0.5004, 0.5001, 0.0]), quantize="float64")


@pytest.mark.filterwarnings("ignore:Full backward hook")
@pytest.mark.parametrize("mode", ["jagg", "jagg_sequential"])
def test_given_velocities_replace_the_middle_forwards(mode):
    """The W steps' v at the current weights, as a list or one [W, B, D] tensor: the same gradient as
    recomputing them, and the transformer runs only the endpoints (forward and backward)."""
    width = 5
    model, z, t, step_loss = mlp_segment(8, width)
    recomputed, _ = grads_of(model, mode, z, t, step_loss)
    velocities = _velocities(model, z, t)
    rows = []
    model.register_forward_hook(lambda m, args, out: rows.append(out.shape[0]))
    for given in (velocities, torch.stack(velocities)):
        rows.clear()
        model.zero_grad(set_to_none=True)
        stats = backward(model, mode, z, t, step_loss, velocities=given)
        got = torch.cat([p.grad.flatten() for p in model.parameters()])
        torch.testing.assert_close(got, recomputed, rtol=1e-12, atol=1e-14)
        counts = stats.counts
        assert (counts.grad_forwards, counts.nograd_forwards, counts.reused_velocities) == (2, 0, width - 2)
        assert sum(rows) == 2 * B  # the two endpoints' rows, nothing else
        assert list(stats.losses) == list(range(width))


def test_given_velocities_enter_through_s_j():
    """jagg on given v_j: J_0^T s_base + J_{W-1}^T s_corr with the middle s_j taken at those v_j (the
    endpoints' s_j at the model's own v, which carry the Jacobians), from torch.func Jacobians."""
    width = 4
    model, z, t, step_loss = mlp_segment(9, width)
    own = _velocities(model, z, t)
    given = [v + 0.3 * torch.randn_like(v) for v in own]  # e.g. from weights before an optimizer step
    expected = jagg_formula(model, z, t, step_loss, [own[0], *given[1:-1], own[-1]])
    for mode in ("jagg", "jagg_sequential"):
        model.zero_grad(set_to_none=True)
        backward(model, mode, z, t, step_loss, velocities=given)
        got = torch.cat([p.grad.flatten() for p in model.parameters()])
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12, msg=mode)
    recomputed, _ = grads_of(model, "jagg", z, t, step_loss)
    assert (recomputed - expected).abs().max() > 1e-6  # the given velocities were used


def test_exact_and_ablate_ignore_velocities():
    model, z, t, step_loss = mlp_segment(10, 4)
    junk = [torch.full_like(z_j, 1e3) for z_j in z]
    for mode in ("exact", "ablate"):
        plain, _ = grads_of(model, mode, z, t, step_loss)
        model.zero_grad(set_to_none=True)
        stats = backward(model, mode, z, t, step_loss, velocities=junk)
        assert torch.equal(torch.cat([p.grad.flatten() for p in model.parameters()]), plain), mode
        assert stats.counts.reused_velocities == 0


@pytest.mark.parametrize(
    "velocities, message",
    [
        (lambda z: z[:3], "one v per step"),
        (lambda z: [z_j[:, :2] for z_j in z], r"velocities\[0\] has shape"),
        (lambda z: torch.stack(z)[:, :1], r"velocities\[0\] has shape"),
    ],
)
def test_velocities_of_the_wrong_shape(velocities, message):
    model = MLP()
    z, t, step_loss = make_segment(model, 4)
    with pytest.raises(ValueError, match=message):
        backward(model, "jagg", z, t, step_loss, velocities=velocities(z))


def test_routing_worked_examples():
    # 21 sampling steps, last ignored: M = 20, W = 4, jagg_frac = 0.6 -> round(12) = 12.
    route = route_segments(range(20), length=4, mode="jagg", jagg_frac=0.6, num_transitions=20)
    assert [(p.start, p.mode) for p in route] == [(0, "jagg"), (4, "jagg"), (8, "jagg"), (12, "exact"), (16, "exact")]
    # Flow-GRPO-Fast window of transitions 4..11 and jagg_frac = 0.4 -> round(8) = 8.
    route = route_segments(range(4, 12), length=4, mode="jagg", jagg_frac=0.4, num_transitions=20)
    assert [(p.start, p.stop, p.mode) for p in route] == [(4, 8, "jagg"), (8, 12, "exact")]
    # The exact mode never routes to JAGG; jagg_frac = 1 routes everything.
    for mode, length in (("exact", 4), ("ablate", 5)):
        route = route_segments(range(20), length=length, mode=mode, jagg_frac=1.0, num_transitions=20)
        assert {p.mode for p in route} == {mode}


def test_timestep_fraction_picks_segments_reproducibly():
    kw = dict(length=4, mode="jagg", jagg_frac=0.6, num_transitions=20, timestep_fraction=0.6)
    a = route_segments(range(20), generator=torch.Generator().manual_seed(0), **kw)
    b = route_segments(range(20), generator=torch.Generator().manual_seed(0), **kw)
    assert a == b and len(a) == 3  # int(5 * 0.6) segments
    assert [p.start for p in a] == sorted(p.start for p in a)  # high noise first
    for p in a:
        assert p.mode == prefix_path(p.start, p.stop, mode="jagg", jagg_frac=0.6, num_transitions=20)


def test_split_segments_over_runs():
    assert split_segments([0, 1, 4, 5, 6, 7], 2) == [(0, 2), (4, 6), (6, 8)]
    with pytest.raises(ValueError, match="trainable"):
        split_segments([], 4)
    with pytest.raises(ValueError, match=r"^segment_length=3 does not split"):  # 20 steps, segments of 3
        split_segments(range(20), 3)
