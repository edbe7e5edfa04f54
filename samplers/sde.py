"""One denoising transition z(sigma) -> z(sigma') with its Gaussian log-probability.

Notation: dt = sigma' - sigma < 0, v = model velocity, x1_hat = z + (1 - sigma) v (predicted noise).
Both reference recipes are Euler-Maruyama steps of the same reverse SDE with diffusion g:

    mean = z + [v + g^2 / (2 sigma) * x1_hat] dt,     std = g sqrt(-dt),     z' = mean + std * eps

    * ``dance`` (DanceGRPO): g = eta, a constant (0.3 for images);
    * ``flow``  (Flow-GRPO):  g = noise_level * sqrt(sigma / (1 - sigma)); at sigma = 1 the
      denominator uses ``sigma_guard`` (the schedule's second sigma) instead of sigma;
    * ``ode``: z' = z + v dt, std = 0 and no log-probability.

The log-probability of z' under N(mean, std^2) is the elementwise Gaussian log density averaged
over every non-batch dimension, computed in float32 (float64 inputs stay float64, for tests).

``cps`` (Flow-GRPO's Coefficients-Preserving Sampling, arXiv 2509.05952) is not an Euler-Maruyama
step: with x0_hat = z - sigma v, sigma_t = sigma' sin(noise_level pi / 2) (noise_level in (0, 1]),

    mean = x0_hat (1 - sigma') + x1_hat sqrt(sigma'^2 - sigma_t^2),     std = sigma_t,

so z' keeps the marginal's coefficients (1 - sigma') on x0 and sigma' on the noise. Its log-prob
is flow_grpo's, -(z' - mean)^2 averaged over non-batch dims: every constant and the 1 / (2 sigma_t^2)
factor are dropped, so exp(logp - logp_old) is not a density ratio (the references pair it with
clip_range 1e-5). A true Gaussian log-prob is not offered: it would only rescale each step's
log-ratio by 1 / (2 sigma_t^2), which clip ranges tuned on flow_grpo's form do not expect. The
``diffusion`` of a CPS step is sigma_t, so (mean_a - mean_b)^2 / (2 diffusion^2) per element is the exact
Gaussian KL of two such transitions, as flow_grpo computes it. At sigma' = 0 (the last step, never trained)
sigma_t = 0, z' = x0_hat and the log-prob is 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from settings import Choice, check_range, member, non_negative


class SDEKind(Choice):
    """The transition a step takes (module docstring)."""

    dance = "dance"
    flow = "flow"
    cps = "cps"
    ode = "ode"


@dataclass(frozen=True)
class SDE:
    """Which transition to take. ``eta`` is read by ``dance``, ``noise_level`` by ``flow`` and ``cps``."""

    kind: SDEKind = SDEKind.dance
    eta: float = 0.3
    noise_level: float = 0.7

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", member(SDEKind, self.kind, "kind"))
        non_negative(self.eta, "eta")
        if self.kind is SDEKind.cps:
            # sigma_t = sigma' sin(noise_level pi / 2) must stay in (0, sigma'] for sqrt(sigma'^2 - sigma_t^2)
            check_range(self.noise_level, "noise_level", low=0, high=1, low_open=True, why=" for cps")
        else:
            non_negative(self.noise_level, "noise_level")

    @property
    def stochastic(self) -> bool:
        return self.kind is not SDEKind.ode


ODE = SDE(kind=SDEKind.ode)  # the deterministic step: outside an SDE window, and for evaluation


@dataclass(frozen=True)
class StepOutput:
    next_z: Tensor  # [B, ...] sampled z', or the stored z' that was passed in
    mean: Tensor  # [B, ...] mean of the transition
    std: Tensor  # [B] per-row std of the transition, g sqrt(-dt) (0 for ode)
    diffusion: Tensor  # [B] per-row diffusion coefficient g (0 for ode); Flow-GRPO's KL divides by 2 g^2
    log_prob: Tensor | None  # [B] mean log density of next_z over non-batch dims; None for ode


def _rows(x: Tensor | float, like: Tensor) -> Tensor:
    """A scalar or per-row [B] value as a [B, 1, ..., 1] tensor broadcastable against ``like``."""
    x = torch.as_tensor(x, dtype=like.dtype, device=like.device)
    if x.ndim == 0:
        x = x.expand(like.shape[0])
    return x.reshape(-1, *([1] * (like.ndim - 1)))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half precision inputs, else the input dtype (float64 stays float64)."""
    return torch.promote_types(dtype, torch.float32)


def diffusion_coeff(sde: SDE, sigma: Tensor, sigma_guard: Tensor | float | None) -> Tensor:
    """g(sigma) of the chosen SDE, same shape as ``sigma``."""
    if sde.kind is SDEKind.dance:
        return torch.full_like(sigma, sde.eta)
    if sde.kind is SDEKind.flow:
        if sigma_guard is None:
            # Checked only where it costs no device sync; the rollout always passes the guard.
            if sigma.device.type == "cpu" and bool((sigma >= 1.0).any()):
                raise ValueError("the flow SDE at sigma = 1 needs sigma_guard (the schedule's second sigma)")
            return sde.noise_level * torch.sqrt(sigma / (1.0 - sigma))
        denom_sigma = torch.where(sigma >= 1.0, torch.as_tensor(sigma_guard, dtype=sigma.dtype), sigma)
        return sde.noise_level * torch.sqrt(sigma / (1.0 - denom_sigma))
    return torch.zeros_like(sigma)


def gaussian_log_prob(x: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """Mean over non-batch dims of log N(x; mean, std^2); std broadcastable to x. Returns [B]."""
    logp = -((x - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    return logp.flatten(1).mean(1)


def _next_z(
    mean: Tensor, std: Tensor, next_z: Tensor | None, noise: Tensor | None, generator: torch.Generator | None
) -> Tensor:
    """The given z' in the step's dtype, or one drawn: mean + std * eps (eps = ``noise``, or float32 N(0, I))."""
    if next_z is not None:
        return next_z.to(mean.dtype)
    if noise is None:
        noise = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=torch.float32)
    return (mean + std * noise.to(mean.dtype)).to(mean.dtype)


def step(
    sde: SDE,
    v: Tensor,
    z: Tensor,
    sigma: Tensor | float,
    sigma_next: Tensor | float,
    *,
    next_z: Tensor | None = None,
    noise: Tensor | None = None,
    generator: torch.Generator | None = None,
    sigma_guard: Tensor | float | None = None,
) -> StepOutput:
    """Take one transition from ``z`` at ``sigma`` to ``sigma_next`` with velocity ``v``.

    ``sigma``/``sigma_next`` are scalars or per-row [B]. Pass ``next_z`` to score a stored
    transition (training), or neither ``next_z`` nor ``noise`` to sample one (``noise`` lets a
    caller supply eps). All arithmetic is in ``compute_dtype(v.dtype)``.
    """
    dtype = compute_dtype(torch.promote_types(v.dtype, z.dtype))
    v, z = v.to(dtype), z.to(dtype)
    sig, sig_next = _rows(sigma, z), _rows(sigma_next, z)
    dt = sig_next - sig
    if sde.kind is SDEKind.ode:
        mean = z + v * dt
        out = mean if next_z is None else next_z.to(dtype)
        zero = torch.zeros(z.shape[0], dtype=dtype, device=z.device)
        return StepOutput(out, mean, zero, zero, None)

    if sde.kind is SDEKind.cps:
        return _cps_step(sde, v, z, sig, sig_next, next_z=next_z, noise=noise, generator=generator)
    g = diffusion_coeff(sde, sig, sigma_guard)
    x1_hat = z + (1.0 - sig) * v
    mean = z + (v + g**2 / (2.0 * sig) * x1_hat) * dt
    std = g * torch.sqrt(-dt)
    next_z = _next_z(mean, std, next_z, noise, generator)
    return StepOutput(next_z, mean, std.flatten(), g.flatten(), gaussian_log_prob(next_z, mean, std))


def _cps_step(
    sde: SDE,
    v: Tensor,
    z: Tensor,
    sig: Tensor,
    sig_next: Tensor,
    *,
    next_z: Tensor | None,
    noise: Tensor | None,
    generator: torch.Generator | None,
) -> StepOutput:
    """The ``cps`` transition (module docstring); ``sig``/``sig_next`` already [B, 1, ..., 1]."""
    sigma_t = sig_next * math.sin(sde.noise_level * math.pi / 2)
    x0_hat = z - sig * v
    x1_hat = z + (1.0 - sig) * v
    # clamp: sin(pi / 2) rounds so that sigma'^2 - sigma_t^2 can be -1 ulp at noise_level = 1
    mean = x0_hat * (1.0 - sig_next) + x1_hat * torch.sqrt((sig_next**2 - sigma_t**2).clamp_min(0.0))
    next_z = _next_z(mean, sigma_t, next_z, noise, generator)
    log_prob = -((next_z - mean) ** 2).flatten(1).mean(1)
    return StepOutput(next_z, mean, sigma_t.flatten(), sigma_t.flatten(), log_prob)
