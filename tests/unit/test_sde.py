"""SDE transitions and schedules against slow references and the formulas of the reference recipes."""

import math

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from models import flux, qwenimage
from samplers.sampler_config import SamplerConfig
from samplers.schedule import QuantizeTimesteps, dynamic_shift_mu, dynamic_sigmas, network_timesteps, shifted_sigmas
from samplers.sde import SDE, SDEKind, gaussian_log_prob, step

pytestmark = pytest.mark.usefixtures("float64")
DANCE, FLOW, ODE = SDE("dance", eta=0.3), SDE("flow", noise_level=0.7), SDE("ode")
CPS = SDE("cps", noise_level=0.8)


def _latents(seed: int = 0, shape=(3, 16, 4)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


@pytest.mark.parametrize("sde", [DANCE, FLOW])
def test_log_prob_equals_torch_normal(sde):
    z, v = _latents()
    out = step(sde, v, z, 0.7, 0.55, generator=torch.Generator().manual_seed(1))
    std = out.std.reshape(-1, 1, 1).expand_as(out.mean)
    ref = torch.distributions.Normal(out.mean, std).log_prob(out.next_z).flatten(1).mean(1)
    torch.testing.assert_close(out.log_prob, ref, rtol=0, atol=1e-12)


def test_dance_mean_matches_score_form():
    # DanceGRPO writes mu = x + v dsigma - 0.5 eta^2 s dsigma with s = -(x - (1 - sigma) x0_hat) / sigma^2.
    z, v = _latents()
    sigma, sigma_next, eta = 0.8, 0.6, 0.3
    x0_hat = z - sigma * v
    score = -(z - (1 - sigma) * x0_hat) / sigma**2
    d = sigma_next - sigma
    expected = z + v * d - 0.5 * eta**2 * score * d
    out = step(DANCE, v, z, sigma, sigma_next, noise=torch.zeros_like(z))
    torch.testing.assert_close(out.mean, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(out.std, torch.full((3,), eta * math.sqrt(sigma - sigma_next)))


def test_flow_mean_matches_expanded_form():
    # Flow-GRPO: mu = x (1 + a^2 dt / (2 sigma)) + v (1 + a^2 (1 - sigma) / (2 sigma)) dt,
    # a = noise_level sqrt(sigma / (1 - sigma)), per-element std a sqrt(-dt).
    z, v = _latents()
    sigma, sigma_next, level = 0.6, 0.45, 0.7
    a = level * math.sqrt(sigma / (1 - sigma))
    dt = sigma_next - sigma
    expected = z * (1 + a**2 * dt / (2 * sigma)) + v * (1 + a**2 * (1 - sigma) / (2 * sigma)) * dt
    out = step(FLOW, v, z, sigma, sigma_next, noise=torch.zeros_like(z))
    torch.testing.assert_close(out.mean, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(out.std, torch.full((3,), a * math.sqrt(-dt)))


def test_flow_first_step_needs_and_uses_guard():
    z, v = _latents()
    with pytest.raises(ValueError, match="sigma_guard"):
        step(FLOW, v, z, 1.0, 0.9)
    out = step(FLOW, v, z, 1.0, 0.9, sigma_guard=0.9, noise=torch.zeros_like(z))
    a = 0.7 * math.sqrt(1.0 / (1 - 0.9))  # numerator keeps sigma = 1, denominator uses the guard
    torch.testing.assert_close(out.std, torch.full((3,), a * math.sqrt(0.1)))


@pytest.mark.parametrize("sde", [SDE("dance", eta=0.0), SDE("flow", noise_level=0.0)])
def test_zero_noise_sde_is_euler(sde):
    z, v = _latents()
    out = step(sde, v, z, 0.5, 0.3, sigma_guard=0.9)
    euler = step(ODE, v, z, 0.5, 0.3)
    torch.testing.assert_close(out.next_z, z + v * (0.3 - 0.5), rtol=0, atol=1e-15)
    torch.testing.assert_close(euler.next_z, out.next_z, rtol=0, atol=1e-15)
    assert euler.log_prob is None and bool((euler.std == 0).all())


@pytest.mark.parametrize("sde", [DANCE, FLOW])
def test_sampled_std_matches_stated_std(sde):
    z, v = _latents(shape=(2, 200, 100))
    out = step(sde, v, z, 0.7, 0.6, generator=torch.Generator().manual_seed(3))
    emp = (out.next_z - out.mean).flatten(1).std(1)
    # 20,000 samples per row: the relative standard error of the sample std is ~0.5%.
    torch.testing.assert_close(emp, out.std, rtol=0.02, atol=0)


def test_recomputed_step_scores_stored_latent():
    z, v = _latents()
    sampled = step(DANCE, v, z, 0.7, 0.6, generator=torch.Generator().manual_seed(5))
    again = step(DANCE, v, z, 0.7, 0.6, next_z=sampled.next_z)
    assert torch.equal(again.log_prob, sampled.log_prob)


def test_log_prob_is_float32_for_half_inputs():
    z, v = _latents()
    out = step(DANCE, v.bfloat16(), z.float(), 0.7, 0.6, generator=torch.Generator().manual_seed(0))
    assert out.log_prob.dtype == torch.float32 and out.mean.dtype == torch.float32


def test_gaussian_log_prob_per_row_std():
    x = torch.tensor([[0.0, 1.0], [2.0, 2.0]])
    mean = torch.zeros(2, 2)
    std = torch.tensor([[1.0], [2.0]])
    expected = torch.tensor([(-0.0 - 0.5) / 2, -0.5 - math.log(2)]) - 0.5 * math.log(2 * math.pi)
    torch.testing.assert_close(gaussian_log_prob(x, mean, std), expected)


def test_invalid_sde_kind():
    with pytest.raises(ValueError, match="kind='euler' is not valid; accepted values: dance, flow, cps, ode"):
        SDE("euler")


def test_shifted_sigmas():
    sig = shifted_sigmas(4, 3.0)
    u = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])
    torch.testing.assert_close(sig, 3 * u / (1 + 2 * u))
    assert sig[0] == 1.0 and sig[-1] == 0.0
    torch.testing.assert_close(shifted_sigmas(5, 1.0), torch.linspace(1, 0, 6))


@pytest.mark.parametrize("kwargs, seq_len, steps", [(flux.SCHEDULER, 1024, 28), (qwenimage.SCHEDULER, 64, 7)])
def test_dynamic_sigmas_equal_diffusers(kwargs, seq_len, steps):
    """The adapters' scheduler configurations (FLUX.1-dev's, Qwen-Image's with a terminal stretch)."""
    sched = FlowMatchEulerDiscreteScheduler(**kwargs)
    mu = dynamic_shift_mu(
        seq_len,
        base_seq_len=kwargs["base_image_seq_len"],
        max_seq_len=kwargs["max_image_seq_len"],
        base_shift=kwargs["base_shift"],
        max_shift=kwargs["max_shift"],
    )
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    ours = dynamic_sigmas(steps, mu, shift_terminal=kwargs.get("shift_terminal"))
    assert torch.equal(ours, sched.sigmas.to(ours.dtype))


def test_network_timesteps_quantized():
    sig = torch.tensor([1.0, 0.8765, 0.1234, 0.0])
    torch.testing.assert_close(network_timesteps(sig), sig[:-1])
    torch.testing.assert_close(network_timesteps(sig, quantize="float64"), torch.tensor([1.0, 0.876, 0.123]))
    with pytest.raises(ValueError, match="quantize='true' is not valid; accepted values: none, float64, dance"):
        network_timesteps(sig, quantize="true")


def _dance_reference(num_steps: int, shift: float) -> list[float]:
    """DanceGRPO's own arithmetic, written out: a float32 linspace (its default dtype), the shift in
    float32, int(1000 sigma)."""
    u = torch.linspace(1, 0, num_steps + 1, dtype=torch.float32)
    sigmas = (shift * u) / (1 + (shift - 1) * u)
    return [int(sigma * 1000) / 1000 for sigma in sigmas][:num_steps]


@pytest.mark.parametrize("num_steps, shift", [(21, 3.0), (9, 3.0), (16, 3.0), (20, 3.0), (12, 1.0), (10, 2.5)])
def test_dance_timesteps_equal_dancegrpo(num_steps, shift):
    t = network_timesteps(shifted_sigmas(num_steps, shift), quantize="dance")
    assert t.tolist() == pytest.approx(_dance_reference(num_steps, shift), abs=1e-12)


def test_dance_and_float64_part_at_exact_thousandths():
    # 21 steps, shift 3: sigma_14 = 0.6 exactly in float64, 0.59999996 in float32 -> 0.600 vs 0.599
    sigmas = shifted_sigmas(21, 3.0)
    ours, dance = network_timesteps(sigmas, quantize="float64"), network_timesteps(sigmas, quantize="dance")
    assert (ours != dance).nonzero().flatten().tolist() == [14]
    assert (float(ours[14]), float(dance[14])) == pytest.approx((0.600, 0.599), abs=1e-12)


def test_dance_timesteps_need_a_fixed_shift():
    with pytest.raises(ValueError, match="quantize=dance needs a fixed-shift schedule"):
        network_timesteps(dynamic_sigmas(8, 0.8), quantize="dance")


def _cps_formula(v, z, sigma, sigma_next, noise_level, eps):
    """Coefficients-Preserving Sampling written from the paper's symbols, one line each."""
    sigma_t = sigma_next * math.sin(noise_level * math.pi / 2)
    x0_hat, x1_hat = z - sigma * v, z + (1 - sigma) * v
    mean = x0_hat * (1 - sigma_next) + x1_hat * math.sqrt(sigma_next**2 - sigma_t**2)
    return mean, sigma_t, mean + sigma_t * eps


@pytest.mark.parametrize("noise_level", [0.3, 0.8, 1.0])
@pytest.mark.parametrize("sigma, sigma_next", [(1.0, 0.9), (0.6, 0.45), (0.2, 0.05)])
def test_cps_step_equals_the_formula(noise_level, sigma, sigma_next):
    z, v = _latents(1)
    eps = torch.randn(z.shape, generator=torch.Generator().manual_seed(5))
    out = step(SDE("cps", noise_level=noise_level), v, z, sigma, sigma_next, noise=eps)
    mean, sigma_t, next_z = _cps_formula(v, z, sigma, sigma_next, noise_level, eps)
    assert out.next_z.dtype == torch.float64
    torch.testing.assert_close(out.mean, mean, rtol=0, atol=1e-14)
    torch.testing.assert_close(out.next_z, next_z, rtol=0, atol=1e-14)
    torch.testing.assert_close(out.std, torch.full((3,), sigma_t), rtol=0, atol=1e-15)
    torch.testing.assert_close(out.diffusion, out.std, rtol=0, atol=0)  # the KL divides by 2 sigma_t^2
    # flow_grpo's log-prob: -(z' - mean)^2 averaged, no constants, no 1 / (2 sigma_t^2)
    torch.testing.assert_close(out.log_prob, -((sigma_t * eps) ** 2).flatten(1).mean(1), rtol=0, atol=1e-14)


def test_cps_preserves_the_marginal_coefficients():
    # With the true v = x1 - x0 (z = (1 - sigma) x0 + sigma x1), z' = (1 - sigma') x0 + sigma' (a x1 + b eps)
    # with a^2 + b^2 = 1: the noise keeps unit variance, the name of the method.
    x0, x1 = _latents(2)
    sigma, sigma_next, noise_level = 0.7, 0.5, 0.6
    z, v = (1 - sigma) * x0 + sigma * x1, x1 - x0
    eps = torch.randn(x0.shape, generator=torch.Generator().manual_seed(1))
    out = step(SDE("cps", noise_level=noise_level), v, z, sigma, sigma_next, noise=eps)
    b = math.sin(noise_level * math.pi / 2)
    torch.testing.assert_close(out.next_z, (1 - sigma_next) * x0 + sigma_next * (math.sqrt(1 - b**2) * x1 + b * eps))


def test_cps_last_step_is_x0_hat_with_zero_log_prob():
    z, v = _latents(3)
    out = step(CPS, v, z, 0.1, 0.0)
    torch.testing.assert_close(out.next_z, z - 0.1 * v, rtol=0, atol=1e-15)
    assert torch.equal(out.log_prob, torch.zeros(3))


def test_cps_rescored_step_and_ratio():
    z, v = _latents(4)
    sampled = step(CPS, v, z, 0.5, 0.4, generator=torch.Generator().manual_seed(0))
    rescored = step(CPS, v, z, 0.5, 0.4, next_z=sampled.next_z)
    assert torch.equal(rescored.log_prob, sampled.log_prob)
    moved = step(CPS, v + 0.01, z, 0.5, 0.4, next_z=sampled.next_z)
    assert (moved.log_prob - sampled.log_prob).abs().min() > 0


@pytest.mark.parametrize("noise_level", [0.0, 1.5, -0.1])
def test_cps_noise_level_outside_zero_one_is_rejected(noise_level):
    with pytest.raises(ValueError, match=r"noise_level must be in \(0, 1\], got .* for cps"):
        SDE("cps", noise_level=noise_level)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"num_steps": 1}, r"^num_steps must be >= 2, got 1 \(the last transition is never trained\)$"),
        ({"sde": "euler"}, r"^sde='euler' is not valid; accepted values: dance, flow, cps, ode$"),
        ({"eta": 0.0}, r"^eta must be > 0, got 0.0$"),
        ({"sde": "flow", "noise_level": 0.0}, r"^noise_level must be > 0, got 0.0$"),
        ({"sde": "cps", "noise_level": 1.5}, r"^noise_level must be in \(0, 1\], got 1.5 for sde=cps$"),
        ({"shift": float("nan")}, r"^shift must be a finite number > 0, got nan$"),
        ({"quantize_timesteps": "dance", "shift": None}, r"^quantize_timesteps=dance needs .*: set shift$"),
        ({"sde_window_size": 4, "sde_window_range": [0, 21]}, r"^sde_window_range=\[0, 21\] must satisfy"),
    ],
)
def test_sampler_config_names_its_own_fields(settings, message):
    """The sampler's settings check themselves in their own words (no trainer key: the trainer adds it)."""
    with pytest.raises(ValueError, match=message):
        SamplerConfig(**settings)


def test_sampler_config_reads_the_strings_users_type():
    sampler = SamplerConfig(sde="cps", noise_level=0.8, quantize_timesteps="float64")
    assert sampler.sde is SDEKind.cps and sampler.quantize_timesteps is QuantizeTimesteps.float64
    assert f"{sampler.sde}" == "cps" and str(sampler.quantize_timesteps) == "float64"  # formats as typed
    assert sampler.transition == SDE("cps", eta=0.3, noise_level=0.8)
