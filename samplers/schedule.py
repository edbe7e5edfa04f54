"""Noise schedules of flow-matching samplers.

Convention (used everywhere in this project):
    sigma  the noise level of a latent, z_sigma = (1 - sigma) x0 + sigma x1, from 1 (noise) to 0 (data);
    t      the timestep value handed to the transformer. For the diffusers Flux and Qwen-Image
           transformers this *is* sigma (they multiply by 1000 inside), optionally quantized
           (DanceGRPO feeds int(1000 sigma) / 1000).

Two schedules:
    * fixed shift (DanceGRPO, Flow-GRPO): u_k = linspace(1, 0, N+1), sigma = s u / (1 + (s - 1) u);
    * resolution-dependent ("dynamic") shift, as diffusers' FlowMatchEulerDiscreteScheduler does for
      Flux and Qwen-Image: u_k = linspace(1, 1/N, N), mu = linear in the image token count,
      sigma = e^mu / (e^mu + (1/u - 1)), optionally stretched so the last sigma is
      ``shift_terminal``, then a final 0 is appended.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from settings import Choice, check_range, member, positive


def shifted_sigmas(num_steps: int, shift: float) -> Tensor:
    """sigmas [num_steps + 1] of the fixed-shift schedule, float64, from 1 down to exactly 0."""
    check_range(num_steps, "num_steps", low=1)
    positive(shift, "shift")
    u = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    return shift * u / (1.0 + (shift - 1.0) * u)


def dynamic_shift_mu(
    image_seq_len: int,
    *,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """mu of the resolution-dependent shift: linear from base_shift (at base_seq_len tokens) to
    max_shift (at max_seq_len tokens), as diffusers' ``calculate_shift``."""
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * slope + (base_shift - slope * base_seq_len)


def dynamic_sigmas(num_steps: int, mu: float, *, shift_terminal: float | None = None) -> Tensor:
    """sigmas [num_steps + 1] of the dynamic-shift schedule, float32 as diffusers stores them.

    The arithmetic follows diffusers step by step (numpy float64 for the u grid, float32 numpy
    for the shift, float32 torch for the terminal stretch) so rollouts reproduce its pipelines to
    the last bit.
    """
    check_range(num_steps, "num_steps", low=1)
    u = np.linspace(1.0, 1.0 / num_steps, num_steps).astype(np.float32)
    shifted = math.exp(mu) / (math.exp(mu) + (1.0 / u - 1.0) ** 1.0)
    sigmas = torch.from_numpy(np.asarray(shifted)).to(torch.float32)
    if shift_terminal:
        one_minus = 1.0 - sigmas
        scale = one_minus[-1] / (1.0 - shift_terminal)
        sigmas = 1.0 - one_minus / scale
    return torch.cat([sigmas, torch.zeros(1, dtype=sigmas.dtype)])


class QuantizeTimesteps(Choice):
    """The timestep fed to the transformer (``network_timesteps``)."""

    none = "none"
    float64 = "float64"
    dance = "dance"


def schedule_shift(sigmas: Tensor) -> float | None:
    """The shift s of a shifted schedule ``sigmas`` [N+1], sigma_k = s u_k / (1 + (s - 1) u_k) on the unshifted
    time u_k = 1 - k / N: the fixed-shift schedule, and the dynamic one without a terminal stretch (s = e^mu).
    Read back from sigmas[1] and checked on sigmas[N - 1]; None for any other schedule. Only those two values
    are read, as Python floats (so it also runs on tensors that carry shapes only)."""
    num_steps = sigmas.shape[0] - 1
    if num_steps < 2:
        return 1.0
    u1, u_last = 1.0 - 1.0 / num_steps, 1.0 / num_steps
    sigma1, sigma_last = float(sigmas[1]), float(sigmas[num_steps - 1])
    shift = sigma1 * (1.0 - u1) / (u1 * (1.0 - sigma1))
    tolerance = 1e-9 if sigmas.dtype == torch.float64 else 1e-5  # a float32 schedule rounds its u grid too
    return shift if abs(shift * u_last / (1.0 + (shift - 1.0) * u_last) - sigma_last) <= tolerance else None


def dance_float32_sigmas(sigmas: Tensor) -> Tensor:
    """DanceGRPO's float32 schedule [N+1] for our float64 fixed-shift ``sigmas`` [N+1].

    DanceGRPO evaluates s u / (1 + (s - 1) u) in float32 on a float32 linspace; a float32 sigma can
    sit a rounding step below a multiple of 1/1000 that the float64 one reaches (21 steps, shift 3:
    step 14 is 0.59999996, not 0.6). u_k = 1 - k / N is the same grid in both; the shift is read back
    (``schedule_shift``, exact up to float64 rounding, which float32 discards): a schedule that is not a
    float64 fixed-shift one (``shifted_sigmas``) raises, DanceGRPO has no other.
    """
    shift = schedule_shift(sigmas)
    if shift is None or sigmas.dtype != torch.float64:
        raise ValueError("quantize=dance needs a fixed-shift schedule (DanceGRPO has no other)")
    u = torch.linspace(1.0, 0.0, sigmas.shape[0], dtype=torch.float32)
    s = torch.tensor(shift, dtype=torch.float32)
    return (s * u) / (1.0 + (s - 1.0) * u)


def post_window_sigmas(sigmas: Tensor, stop: int, points: int) -> list[float]:
    """The schedule (``points`` floats) of the steps after an SDE window that ends before step ``stop`` (its last
    transition L = stop - 1): noise levels uniform in the unshifted time from u_stop down to 0, both included,
    shifted by the schedule's own shift (``schedule_shift``), so the first is sigma_stop (set exactly) and the
    last 0. ``points`` >= N - stop + 1, the points the schedule has there, gives those back unchanged. Reads
    ``sigmas`` one value at a time, as Python floats (so it also runs on constants that carry shapes only)."""
    num_steps = sigmas.shape[0] - 1
    check_range(stop, "stop", low=0, high=num_steps, low_open=True, high_open=True)
    check_range(points, "points", low=2)
    if points >= num_steps - stop + 1:
        return [float(sigmas[k]) for k in range(stop, num_steps + 1)]
    shift = schedule_shift(sigmas)
    if shift is None:
        raise ValueError(
            "compressing the steps after the window needs a shifted schedule (a fixed shift, or a dynamic one "
            "without a terminal stretch): set the sampler's shift"
        )
    u = [(1.0 - stop / num_steps) * (points - 1 - i) / (points - 1) for i in range(points)]
    return [float(sigmas[stop]), *(shift * x / (1.0 + (shift - 1.0) * x) for x in u[1:-1]), 0.0]


def network_timesteps(sigmas: Tensor, *, quantize: QuantizeTimesteps | str = QuantizeTimesteps.none) -> Tensor:
    """The timestep fed to the transformer at each of the N steps (sigmas[:-1]).

    ``none``: sigma itself. ``float64``: floor(1000 sigma) / 1000 of our float64 schedule.
    ``dance``: DanceGRPO's int(1000 sigma) / 1000 of its float32 schedule (``dance_float32_sigmas``);
    the two differ only where sigma is an exact multiple of 1/1000. The SDE itself always uses our
    exact sigmas, so rollout and training see the same inputs and the ratio is unaffected.
    """
    quantize = member(QuantizeTimesteps, quantize, "quantize")
    if quantize is QuantizeTimesteps.dance:
        return torch.floor(dance_float32_sigmas(sigmas)[:-1] * 1000.0).to(sigmas.dtype) / 1000.0
    t = sigmas[:-1].clone()
    if quantize is QuantizeTimesteps.float64:
        t = torch.floor(t * 1000.0) / 1000.0
    return t


def check_timesteps(sigmas: Tensor, *, quantize: QuantizeTimesteps | str = QuantizeTimesteps.none) -> None:
    """Refuse a schedule whose network timesteps do not strictly decrease: JAGG's interpolation
    weights divide by the timestep span of a group, which two equal timesteps could make 0."""
    t = network_timesteps(sigmas, quantize=quantize)
    if not bool((t[1:] < t[:-1]).all()):
        raise ValueError(
            f"the network timesteps must strictly decrease, but quantize={quantize} maps two of the "
            f"{t.shape[0]} steps to one timestep: use fewer steps"
        )
