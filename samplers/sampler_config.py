"""The sampler's settings: which transition the rollout takes, on which schedule, and where.

``SamplerConfig`` checks its own ranges when it is built and names the field that is wrong in its
own words (``num_steps must be >= 2 ...``); whoever reads it from a larger configuration adds the
path of the group in front.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from samplers.schedule import QuantizeTimesteps
from samplers.sde import SDE, SDEKind
from settings import Choice, check_range, member


class PostWindowSolver(Choice):
    """post_window.solver: how the steps after the SDE window are taken."""

    euler = "euler"  # the ODE's Euler step on the sampling schedule
    dpmpp_2m = "dpmpp_2m"  # DPM-Solver++ 2M in data prediction (MixGRPO-Flash)


class WindowSchedule(Choice):
    """sde_window_schedule: where the SDE window of each training step starts."""

    fixed = "fixed"  # drawn in [lo, hi - size] per step (Flow-GRPO-Fast; one start when hi - lo = size)
    progressive = "progressive"  # MixGRPO: moves by stride every iters steps, back to lo past the last start
    random = "random"  # MixGRPO's random: uniform in [lo, hi - size] per step, the draw of fixed


@dataclass
class PostWindowConfig:
    """The deterministic steps after the SDE window (MixGRPO-Flash). They are never trained and keep no
    log-probability: only the map from the window's output to the final image changes."""

    solver: PostWindowSolver = PostWindowSolver.euler
    """euler (the ODE's Euler steps, as without a window setting) | dpmpp_2m (DPM-Solver++ 2M in data prediction,
    seeded with the window's last x0, first order on its last step)"""
    ratio: float = 1.0
    """rho in (0, 1]: the steps after the window run on P = max(int((N - L) rho), min_steps + 1) points from
    sigma_{L+1} to 0 (L the window's last step), uniform in the unshifted time; 1 = the sampling schedule's own
    (MixGRPO-Flash: 0.4)"""
    min_steps: int = 2
    """>= 1: the fewest steps after the window (one step straight to x0 is a quality risk)"""

    def __post_init__(self) -> None:
        self.solver = member(PostWindowSolver, self.solver, "solver")
        check_range(self.ratio, "ratio", low=0, high=1, low_open=True, why=" (1 = every step after the window)")
        check_range(self.min_steps, "min_steps", low=1)

    def points(self, num_steps: int, stop: int) -> int:
        """P, the points of the schedule after a window that stops before step ``stop`` of ``num_steps`` (L =
        stop - 1); more than the N - L the sampling schedule has there means its own (``post_window_sigmas``)."""
        return max(int((num_steps - stop + 1) * self.ratio), self.min_steps + 1)

    def steps(self, num_steps: int, stop: int) -> int:
        """The steps (transformer calls per row) after a window that stops before step ``stop``: P - 1 on a
        compressed schedule, N - stop on the sampling schedule's own."""
        return min(self.points(num_steps, stop), num_steps - stop + 1) - 1


@dataclass
class SamplerConfig:
    sde: SDEKind = SDEKind.dance
    """transition kind: dance (constant eta) | flow (noise_level) | cps (noise_level); ode (deterministic, for
    evaluation) leaves nothing to train"""
    num_steps: int = 21
    """denoising steps N per rollout; the last transition is never trained"""
    shift: float | None = 3.0
    """fixed timestep shift, > 0; null = the backbone's own (dynamic) schedule"""
    eta: float = 0.3
    """dance: diffusion coefficient g (constant), > 0"""
    noise_level: float = 0.7
    """flow: g = noise_level * sqrt(sigma / (1 - sigma)), > 0; cps: sigma_t = sigma' sin(noise_level pi / 2),
    in (0, 1]"""
    quantize_timesteps: QuantizeTimesteps = QuantizeTimesteps.none
    """t fed to the transformer: none = sigma; float64 = floor(1000 sigma) / 1000 of our float64 schedule;
    dance = int(1000 sigma) / 1000 of DanceGRPO's float32 schedule (needs a fixed shift; samplers/schedule.py)"""
    sde_window_size: int = 0
    """Flow-GRPO-Fast: >0 = SDE only on this many consecutive steps, ODE elsewhere"""
    sde_window_range: list[int] = field(default_factory=lambda: [0, 12])
    """[lo, hi): the window lies inside, its start in [lo, hi - size]"""
    sde_window_schedule: WindowSchedule = WindowSchedule.fixed
    """with sde_window_size > 0: fixed | random (the start drawn per step in [lo, hi - size] from the run's seed
    stream, the same on every rank and after a resume; fixed when the range holds one start) | progressive
    (MixGRPO: the start is lo + floor(step / sde_window_iters) * sde_window_stride, back to lo past hi - size)"""
    sde_window_iters: int = 25
    """progressive: training steps at each window position, >= 1 (MixGRPO 25, MixGRPO-Flash 20)"""
    sde_window_stride: int = 1
    """progressive: steps the window moves by, >= 0 (0 = it stays at lo)"""
    post_window: PostWindowConfig = field(default_factory=PostWindowConfig)
    """the steps after the SDE window (none without a window)"""

    def __post_init__(self) -> None:
        self.sde = member(SDEKind, self.sde, "sde")
        self.quantize_timesteps = member(QuantizeTimesteps, self.quantize_timesteps, "quantize_timesteps")
        check_range(self.num_steps, "num_steps", low=2, why=" (the last transition is never trained)")
        if self.shift is not None:
            check_range(self.shift, "shift", low=0, low_open=True)
        if self.quantize_timesteps is QuantizeTimesteps.dance and self.shift is None:
            raise ValueError("quantize_timesteps=dance needs DanceGRPO's fixed-shift schedule: set shift")
        self._check_transition()
        self._check_window()

    def _check_transition(self) -> None:
        # A diffusion coefficient of 0 makes every SDE step deterministic: no log-probability to train on.
        check_range(self.eta, "eta", low=0, low_open=self.sde is SDEKind.dance)
        if self.sde is SDEKind.cps:
            check_range(self.noise_level, "noise_level", low=0, high=1, low_open=True, why=" for sde=cps")
        else:
            check_range(self.noise_level, "noise_level", low=0, low_open=self.sde is SDEKind.flow)

    def _check_window(self) -> None:
        self.sde_window_schedule = member(WindowSchedule, self.sde_window_schedule, "sde_window_schedule")
        check_range(self.sde_window_iters, "sde_window_iters", low=1)
        check_range(self.sde_window_stride, "sde_window_stride", low=0, why=" (0 = the window stays at lo)")
        check_range(self.sde_window_size, "sde_window_size", low=0, why=" (0 = SDE on every step)")
        if len(self.sde_window_range) != 2:
            raise ValueError(f"sde_window_range must be [lo, hi], got {list(self.sde_window_range)}")
        if self.sde_window_size == 0 and self.sde_window_schedule is not WindowSchedule.fixed:
            # without a window every step is SDE: a schedule that moves the window would be read by nothing
            raise ValueError(
                f"sde_window_schedule={self.sde_window_schedule.value} moves the SDE window, and sde_window_size=0 "
                "has none (SDE on every step): set sde_window_size > 0 (and sde_window_range), or "
                "sde_window_schedule=fixed"
            )
        lo, hi = self.sde_window_range
        if self.sde_window_size > 0 and not (0 <= lo and lo + self.sde_window_size <= hi <= self.num_steps - 1):
            raise ValueError(
                f"sde_window_range={list(self.sde_window_range)} must satisfy 0 <= lo and "
                f"lo + sde_window_size ({self.sde_window_size}) <= hi <= num_steps - 1 ({self.num_steps - 1})"
            )

    @property
    def transition(self) -> SDE:
        """The transition of the SDE steps."""
        return SDE(self.sde, eta=self.eta, noise_level=self.noise_level)
