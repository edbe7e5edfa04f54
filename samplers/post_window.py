"""The steps after an SDE window (MixGRPO-Flash): never trained, they only map the window's output to the image.

``euler``: the ODE's step z' = z + v (sigma' - sigma). ``dpmpp_2m``: DPM-Solver++ 2M in data prediction, with
x0 = z - sigma v, alpha = 1 - sigma and lambda = log(alpha / sigma) (``log_snr``); a step from sigma to sigma'
(h = lambda' - lambda) is

    z' = (sigma' / sigma) z - alpha' (e^{-h} - 1) (D0 + D1 / 2),   D0 = x0,   D1 = (x0 - x0_prev) / r,

r = (lambda - lambda_prev) / h, x0_prev the previous step's x0 (the window's last, for the first step after it);
first order (D1 = 0) while there is no earlier x0, and at sigma' = 0 the step lands on x0. Their schedule is the
sampling schedule's tail or a rebuilt one with fewer points (samplers/schedule.py: ``post_window_sigmas``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from samplers.sampler_config import PostWindowConfig, PostWindowSolver
from samplers.schedule import QuantizeTimesteps, network_timesteps, post_window_sigmas
from samplers.sde import ODE, compute_dtype, step

History = tuple[Tensor, float]  # (x0, the sigma it was predicted at) of the previous step


def after_window_grid(sigmas: Tensor, stop: int, post: PostWindowConfig) -> list[float]:
    """[sigma_L, then the points after a window that stops before step ``stop`` (L = stop - 1)]: the schedule of
    the steps after it (``post_window_sigmas`` with ``post``'s P), read as Python floats."""
    points = post_window_sigmas(sigmas, stop, post.points(sigmas.shape[0] - 1, stop))
    return [float(sigmas[stop - 1]), *points]


def tail_timesteps(points: list[float], quantize: QuantizeTimesteps) -> Tensor:
    """The network timesteps [P - 1] of the steps on a compressed schedule after a window (its ``points``): as
    ``network_timesteps``, with DanceGRPO's quantization as float64's (its float32 schedule has no such points)."""
    if quantize is QuantizeTimesteps.dance:
        quantize = QuantizeTimesteps.float64
    return network_timesteps(torch.tensor(points, dtype=torch.float64), quantize=quantize)


def post_window_step(
    solver: PostWindowSolver, v: Tensor, z: Tensor, sigma: float, sigma_next: float, history: History | None
) -> tuple[Tensor, History | None]:
    """One step after the window with ``solver``: (z', the solver's history for the next step)."""
    if solver is PostWindowSolver.euler:
        return step(ODE, v, z, sigma, sigma_next).next_z, None
    next_z, x0 = dpmpp_2m_step(v, z, sigma, sigma_next, history)
    return next_z, (x0, sigma)


def log_snr(sigma: float) -> float:
    """lambda = log(alpha / sigma) with alpha = 1 - sigma: the half log-SNR of z_sigma = alpha x0 + sigma x1."""
    return math.log((1.0 - sigma) / sigma)


def dpmpp_2m_step(
    v: Tensor, z: Tensor, sigma: float, sigma_next: float, history: History | None
) -> tuple[Tensor, Tensor]:
    """One DPM-Solver++ 2M step in data prediction from ``z`` at ``sigma`` to ``sigma_next`` with velocity ``v``:
    (z', x0) with x0 = z - sigma v. ``history`` = (x0_prev, sigma_prev), the previous step's x0 and the sigma it
    was predicted at, or None for a first-order step. With h = lambda' - lambda, r = (lambda - lambda_prev) / h,

        z' = (sigma' / sigma) z - alpha' (e^{-h} - 1) (x0 + (x0 - x0_prev) / (2 r)),

    first order (x0 alone) without ``history``; at sigma' = 0 the step lands on x0."""
    dtype = compute_dtype(torch.promote_types(v.dtype, z.dtype))
    x0 = z.to(dtype) - sigma * v.to(dtype)
    if sigma_next == 0.0:
        return x0, x0
    h = log_snr(sigma_next) - log_snr(sigma)
    data = x0
    if history is not None:
        x0_prev, sigma_prev = history
        r = (log_snr(sigma) - log_snr(sigma_prev)) / h
        data = x0 + (x0 - x0_prev.to(dtype)) / (2.0 * r)
    return (sigma_next / sigma) * z.to(dtype) - (1.0 - sigma_next) * math.expm1(-h) * data, x0
