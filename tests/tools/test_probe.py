"""The gradient-quality probe (train/algorithm/quality.py, train/tools/probe/session.py and table.py): exactness where
Theorem 1 holds, the jagg_frac rule on hand-made numbers, the Hydra entry point on the tiny Flux backbone, and
torchrun + FSDP2."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from hydra import compose, initialize_config_module
from probe_toys import ADVANTAGES, ToyVelocity, toy_batch, toy_settings, toy_trajectory
from two_ranks import run_torchrun

from train.algorithm.quality import (
    SegmentQuality,
    measure_staleness,
    measure_trajectories,
    probe_report,
    recommend_jagg_frac,
    summarize_segments,
)
from train.algorithm.segments import prefix_path
from train.distributed.parallelize import ProcessRanks, global_dots
from train.parts.config.schema import register_schema
from train.tools.probe.probe_config import register
from train.tools.probe.table import format_table

register_schema()
register()
RANKS = ProcessRanks()  # one process: the measurement's reductions are local


def probe(model, traj, settings, *, advantages=ADVANTAGES, reference=None) -> list[SegmentQuality]:
    params = list(model.parameters())
    batch = toy_batch(model, traj, settings, advantages=advantages, reference=reference)
    samples = measure_trajectories(batch, params, num_rollouts=traj.batch_size, mode=settings.mode, ranks=RANKS)
    assert all(p.grad is None for p in params), "the probe left gradients behind"
    return summarize_segments(samples, traj.timesteps)


@pytest.mark.parametrize("sde, kl_beta", [("dance", 0.0), ("flow", 0.0), ("dance", 0.1)])
def test_affine_in_t_model_gives_cosine_and_ratio_one(sde, kl_beta):
    """v = A z + b t + c: J_j = [t_j I, I] is the t-interpolation of the endpoint Jacobians, so the
    JAGG gradient equals the exact one on every segment, whatever the trajectory and the loss."""
    model = ToyVelocity()
    traj = toy_trajectory(model, sde=sde)
    reference = ToyVelocity(seed=1) if kl_beta else None  # a different policy: the KL term has a gradient
    segments = probe(model, traj, toy_settings(kl_beta=kl_beta), reference=reference)
    assert [(g.start, g.stop) for g in segments] == [(0, 4), (4, 8), (8, 12)]
    for g in segments:
        assert g.num_samples == 4
        assert g.cos_mean == pytest.approx(1.0, abs=1e-5) and g.cos_std < 1e-5
        assert g.rho_mean == pytest.approx(1.0, abs=1e-5) and g.rho_std < 1e-5


def test_ablate_is_not_exact_on_the_same_model():
    """The probe can tell: ablate drops the middle steps' signal, so it misses the exact gradient."""
    model = ToyVelocity()
    segments = probe(model, toy_trajectory(model), toy_settings(mode="ablate"))
    for g in segments:
        assert g.cos_mean < 0.999 or abs(g.rho_mean - 1.0) > 1e-2, (g.start, g.cos_mean, g.rho_mean)


def test_nonlinear_model_lowers_cosine_of_low_noise_segment_only():
    model = ToyVelocity(gamma=10.0)  # oscillates in t below t = 0.5: only the last segment sees it
    segments = probe(model, toy_trajectory(model), toy_settings())
    assert segments[0].cos_mean == pytest.approx(1.0, abs=1e-5)
    assert segments[1].cos_mean == pytest.approx(1.0, abs=1e-5)
    assert segments[2].cos_mean < 0.95


def test_zero_advantage_trajectory_has_no_cosine():
    model = ToyVelocity()
    advantages = ADVANTAGES.clone()
    advantages[1] = 0.0  # its loss, hence both gradients, are zero at ratio 1
    segments = probe(model, toy_trajectory(model), toy_settings(), advantages=advantages)
    assert [g.num_samples for g in segments] == [3, 3, 3]


def staleness(model, traj) -> tuple[list[SegmentQuality], list[SegmentQuality]]:
    params = list(model.parameters())
    batch = toy_batch(model, traj, toy_settings())
    fresh, stale = measure_staleness(batch, params, num_rollouts=traj.batch_size, ranks=RANKS)
    assert all(p.grad is None for p in params), "the probe left gradients behind"
    return summarize_segments(fresh, traj.timesteps), summarize_segments(stale, traj.timesteps)


def test_stale_velocities_cost_cosine_only_once_the_weights_moved():
    """On the affine-in-t model fresh JAGG is exact. At the rollout's weights the kept velocities are
    the policy's own: stale = fresh. Once the weights move, the kept velocities lag behind and the
    gradient on them leaves the exact one."""
    model = ToyVelocity()
    traj = toy_trajectory(model, keep_velocities=True)
    fresh, stale = staleness(model, traj)
    for f, s in zip(fresh, stale):
        assert f.cos_mean == pytest.approx(1.0, abs=1e-5) and s.cos == pytest.approx(f.cos, abs=1e-6)
    with torch.no_grad():
        model.c.add_(0.5 * torch.randn(model.c.shape, generator=torch.Generator().manual_seed(3)))
    fresh, stale = staleness(model, traj)
    for f, s in zip(fresh, stale):
        assert f.cos_mean == pytest.approx(1.0, abs=1e-5)
        assert s.cos_mean < 0.999


def test_staleness_columns_in_the_report():
    segments = [quality(0.9, 0), quality(0.8, 4)]
    rep = probe_report(
        segments,
        mode="jagg",
        threshold=0.5,
        num_transitions=8,
        staleness=(segments, [quality(0.7, 0), quality(0.6, 4)]),
    )
    assert rep["segments"][1]["after_step"]["stale"]["cos_mean"] == 0.6
    assert rep["segments"][1]["after_step"]["fresh"]["cos_mean"] == 0.8
    table = format_table(rep)
    assert "stale, 1 step" in table and "0.600 ± 0.000" in table.splitlines()[2]
    assert "stale" not in format_table(probe_report(segments, mode="jagg", threshold=0.5, num_transitions=8))


def test_global_dots_in_one_process():
    a = [torch.tensor([1.0, 2.0]), None, torch.tensor([[3.0]])]
    b = [torch.tensor([0.5, -1.0]), torch.tensor([2.0]), None]
    # <a, a> = 1 + 4 + 9; <b, b> = 0.25 + 1 + 4; <a, b> = 0.5 - 2 (the None pieces are zeros)
    assert global_dots(a, b) == pytest.approx((14.0, 5.25, -1.5))


def quality(cos: float, start: int, length: int = 4) -> SegmentQuality:
    return SegmentQuality(start, start + length, 1.0, 0.9, cos=(cos,), rho=(1.0,))


def test_recommendation_follows_the_threshold_rule():
    # The paper's Table 5 (20 transitions, W = 4): Flux's segments 0-3 pass 0.5 -> 16 / 20; QwenImage's 0-2 -> 0.6.
    flux = [quality(c, 4 * i) for i, c in enumerate([0.85, 0.77, 0.74, 0.63, 0.41])]
    qwen = [quality(c, 4 * i) for i, c in enumerate([0.79, 0.64, 0.58, 0.45, 0.22])]
    assert recommend_jagg_frac(flux, threshold=0.5, num_transitions=20) == 0.8
    assert recommend_jagg_frac(qwen, threshold=0.5, num_transitions=20) == 0.6
    assert recommend_jagg_frac(flux, threshold=0.75, num_transitions=20) == 0.4  # the threshold is a parameter
    assert recommend_jagg_frac(flux, threshold=0.9, num_transitions=20) == 0.0
    # Only the run from the highest noise counts: a passing segment after a failing one stays exact.
    gap = [quality(c, 4 * i) for i, c in enumerate([0.9, 0.3, 0.9])]
    assert recommend_jagg_frac(gap, threshold=0.5, num_transitions=12) == pytest.approx(4 / 12, abs=1e-4)
    # A segment without samples (NaN mean) does not qualify.
    assert recommend_jagg_frac([quality(math.nan, 0), quality(0.9, 4)], threshold=0.5, num_transitions=8) == 0.0


def test_recommendation_routes_exactly_the_qualifying_segments():
    # A Flow-GRPO-Fast window of transitions 4..11 (M = 20): the segment 4..7 passes, 8..11 does not.
    segments = [quality(0.7, 4), quality(0.4, 8)]
    rep = probe_report(segments, mode="jagg", threshold=0.5, num_transitions=20)
    assert rep["recommended_jagg_frac"] == 0.4
    assert [g["path"] for g in rep["segments"]] == ["jagg", "exact"]
    for g in rep["segments"]:
        assert g["path"] == prefix_path(g["start"], g["stop"], mode="jagg", jagg_frac=0.4, num_transitions=20)


# 9 sampling steps -> 8 trainable transitions -> 2 segments of W = 4; G = 2 samples per prompt.
PROBE = [
    "experiment=tiny",
    "sampler.num_steps=9",
    "grpo.group_size=2",
    "batch.gradient_accumulation_steps=2",
    "batch.micro_batch=1",
]


def test_probe_on_tiny_backbone(tiny_flux_dir, tmp_path, caplog, repo_root):
    from train.tools.probe.session import run_probe

    caplog.set_level(logging.INFO)
    out = tmp_path / "report.json"
    overrides = [f"run_dir={tmp_path}", f"model.path={tiny_flux_dir}", *PROBE, "probe.num_rollouts=3"]
    with initialize_config_module(config_module="configs", version_base=None):
        cfg = compose(config_name="probe", overrides=[*overrides, f"probe.output={out}"])
    rep = run_probe(cfg)
    assert json.loads(out.read_text()) == json.loads(json.dumps(rep))
    assert [(g["start"], g["stop"]) for g in rep["segments"]] == [(0, 4), (4, 8)]
    for g in rep["segments"]:
        assert g["num_samples"] == 3 and len(g["cos"]) == 3
        assert -1.0 <= g["cos_mean"] <= 1.0 and g["rho_mean"] > 0
    assert rep["recommended_jagg_frac"] in (0.0, 0.5, 1.0)  # a whole number of the 2 segments of M = 8
    printed = caplog.text
    assert printed.count("\n") >= 4 and "recommended update.jagg_frac=" in printed
    assert format_table(rep) in printed
    assert "cos: cosine between" in printed  # the columns are explained
    assert "n = 3 trajectories is too few" in printed  # K = 3 < MIN_ROLLOUTS
    assert not (tmp_path / "metrics.jsonl").exists()  # the probe logs no training metric


def test_probe_measures_stale_velocities_and_restores_the_weights(tiny_flux_dir, tmp_path, repo_root):
    """update.reuse_velocities=stale: the report carries fresh and stale cosines after one optimizer
    step; the probe's step is undone (the run's weights and optimizer are as built)."""
    from train.run.build import open_run
    from train.run.start import load_config, process_group
    from train.tools.probe.session import probe as run_probe_on

    overrides = [f"run_dir={tmp_path}", f"model.path={tiny_flux_dir}", *PROBE, "probe.num_rollouts=2"]
    with initialize_config_module(config_module="configs", version_base=None):
        cfg = compose(config_name="probe", overrides=[*overrides, "update.reuse_velocities=stale"])
    config = load_config(cfg)
    with process_group() as dist, open_run(config, dist) as run:
        before = [p.detach().clone() for p in run.model.params]
        rep = run_probe_on(run, config.probe)
        assert all(torch.equal(p, b) for p, b in zip(run.model.params, before))
        assert all(p.grad is None for p in run.model.params) and not run.optim.optimizer.state
    for g in rep["segments"]:
        after = g["after_step"]
        assert after["fresh"]["num_samples"] == after["stale"]["num_samples"] == 2
        # the tiny model at lr 3e-3: fresh JAGG stays close to exact, the lagging velocities cost more
        assert after["stale"]["cos_mean"] < after["fresh"]["cos_mean"] <= 1.0


@pytest.mark.slow
def test_probe_under_torchrun_fsdp_matches_one_process(tiny_flux_dir, tmp_path, repo_root):
    """2 ranks x 1 prompt under FSDP2 (gloo) measure the same 4 trajectories as 1 process x 2 prompts
    (group noise does not depend on the rank layout): the cosines and ratios over the sharded,
    global gradient equal the single-process ones."""
    from train.tools.probe.session import run_probe

    common = [f"model.path={tiny_flux_dir}", *PROBE, "probe.num_rollouts=4"]
    sharded = tmp_path / "fsdp"
    args = ["-m", "train.probe", *common, f"run_dir={sharded}", f"hydra.run.dir={sharded}"]
    result = run_torchrun(*args, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    two = json.loads((sharded / "probe.json").read_text())
    assert (sharded / "probe.log").is_file()  # the console's lines, named after the command
    with initialize_config_module(config_module="configs", version_base=None):
        cfg = compose(
            config_name="probe", overrides=[*common, f"run_dir={tmp_path / 'one'}", "batch.prompts_per_rank=2"]
        )
    one = run_probe(cfg)
    assert two["world_size"] == 2 and one["world_size"] == 1
    for a, b in zip(two["segments"], one["segments"], strict=True):
        assert (a["start"], a["num_samples"]) == (b["start"], b["num_samples"]) and a["num_samples"] == 4
        assert sorted(a["cos"]) == pytest.approx(sorted(b["cos"]), abs=1e-4)
        assert sorted(a["rho"]) == pytest.approx(sorted(b["rho"]), abs=1e-4)
