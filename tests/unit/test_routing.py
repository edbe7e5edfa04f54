"""Routing (train/algorithm/routing.py): the prefix rule, and update.routing=auto following the measured cosines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from probe_toys import ToyVelocity, toy_batch, toy_settings, toy_trajectory

from models.registry import backbone_names
from rewards.base import SCORER_NAMES
from train.algorithm.routing import AutoRouter, PrefixRouter, build_router
from train.algorithm.update_config import UpdateConfig
from train.distributed.parallelize import ProcessRanks
from train.parts.config.schema import TrainConfig, register_schema
from train.run.checks import validate

ROOT = Path(__file__).resolve().parents[2]
register_schema()


def auto_router(*, every: int = 2, threshold: float = 0.95) -> AutoRouter:
    return AutoRouter(UpdateConfig(routing="auto", auto_every=every, auto_threshold=threshold, auto_rollouts=4))


def refresh(router: AutoRouter, step: int, model: ToyVelocity) -> dict[str, float]:
    traj = toy_trajectory(model)  # rolled out by the current policy: the ratio is 1
    batch = toy_batch(model, traj, toy_settings())
    return router.refresh(step, batch, list(model.parameters()), ranks=ProcessRanks())


def test_routing_changes_when_the_cosine_crosses_the_threshold():
    model = ToyVelocity(gamma=0.0)  # linear in t: every segment measures cos = 1
    router = auto_router()
    assert router.due(0)
    metrics = refresh(router, 0, model)
    assert router.modes == {(0, 4): "jagg", (4, 8): "jagg", (8, 12): "jagg"}
    assert metrics["routing/cos_08_12"] == pytest.approx(1.0, abs=1e-5) and metrics["routing/jagg_08_12"] == 1.0
    assert metrics["routing/rule_jagg_frac"] == 1.0

    model.gamma = 10.0  # the low-noise segment (t < 0.5) turns strongly nonlinear
    assert not router.due(1)
    assert refresh(router, 1, model) == {}  # not due: the table holds
    assert set(router.modes.values()) == {"jagg"}
    metrics = refresh(router, 2, model)
    assert router.modes == {(0, 4): "jagg", (4, 8): "jagg", (8, 12): "exact"}
    assert metrics["routing/cos_08_12"] < 0.95 and metrics["routing/jagg_08_12"] == 0.0
    assert metrics["routing/rule_jagg_frac"] == pytest.approx(8 / 12, abs=1e-4)  # M = 12 trainable transitions

    route = router.route(toy_trajectory(model), generator=None)
    assert [(p.start, p.mode) for p in route] == [(0, "jagg"), (4, "jagg"), (8, "exact")]


def test_segments_the_probe_did_not_see_take_the_exact_path():
    router = auto_router()
    router.modes = {(0, 4): "jagg"}
    route = router.route(toy_trajectory(ToyVelocity()), generator=None)
    assert [p.mode for p in route] == ["jagg", "exact", "exact"]


def test_prefix_router_is_the_jagg_frac_rule():
    """M = 12 trainable transitions, W = 4, jagg_frac 0.7 -> round(8.4) = 8: segments 0 and 4 take jagg."""
    router = PrefixRouter(UpdateConfig(jagg_frac=0.7))
    assert not router.due(0) and router.refresh(0, None, [], ranks=ProcessRanks()) == {}  # measures nothing
    route = router.route(toy_trajectory(ToyVelocity()), generator=None)
    assert [(p.start, p.stop, p.mode) for p in route] == [(0, 4, "jagg"), (4, 8, "jagg"), (8, 12, "exact")]


def compose_cfg(overrides: list[str]) -> TrainConfig:
    with initialize_config_module(config_module="configs", version_base=None):
        cfg = compose(config_name="train", overrides=overrides)
    return OmegaConf.to_object(cfg)


@pytest.mark.parametrize(
    "overrides, error, match",
    [
        (["update.routing=fast"], ConfigCompositionException, "update.routing=fast"),  # not a Routing
        (["update.jagg_frac=1.5"], ValueError, "jagg_frac must be in"),
        (["update.routing=auto", "update=exact"], ValueError, "routing=auto routes between mode and exact"),
        (["update.routing=auto", "update.auto_rollouts=100"], ValueError, "update.auto_rollouts"),
        (["update.routing=auto", "update.auto_every=0"], ValueError, "auto_every must be >= 1"),
    ],
)
def test_bad_auto_settings_fail_validation(overrides, error, match, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(error, match=match):
        cfg = compose_cfg([f"run_dir={tmp_path}", *overrides])
        validate(cfg, known_scorers=SCORER_NAMES, known_backbones=tuple(backbone_names()))


def test_jagg_frac_is_a_number_and_routing_its_own_field(tmp_path):
    for value, expected in (("1", 1.0), ("0.4", 0.4)):
        cfg = compose_cfg([f"run_dir={tmp_path}", f"update.jagg_frac={value}"])
        assert cfg.update.jagg_frac == expected and isinstance(cfg.update.jagg_frac, float)
        assert isinstance(build_router(cfg.update), PrefixRouter)
    assert isinstance(build_router(compose_cfg([f"run_dir={tmp_path}", "update.routing=auto"]).update), AutoRouter)
    with pytest.raises(ConfigCompositionException, match="update.jagg_frac"):
        compose_cfg([f"run_dir={tmp_path}", "update.jagg_frac=auto"])


@pytest.mark.parametrize("threshold, path", [(-1.0, "jagg"), (1.0, "exact")])
def test_trainer_routes_by_the_probe(threshold, path, tiny_flux_dir, tmp_path, monkeypatch):
    """Any cosine passes a threshold of -1 (the ends of update.auto_threshold's range) and none short of
    parallel gradients passes 1: the update follows the table."""
    from train.loop.trainer import run

    monkeypatch.chdir(ROOT)  # the demo's prompt file is relative to the repository root
    overrides = [
        f"run_dir={tmp_path}",
        "experiment=tiny",
        f"model.path={tiny_flux_dir}",
        "num_steps=1",
        "sampler.num_steps=9",
        "grpo.group_size=2",
        "batch.prompts_per_rank=1",
        "batch.micro_batch=2",
        "batch.gradient_accumulation_steps=2",
        "logging.progress_bar=false",
        "checkpoint.export=false",
        "update.routing=auto",
        "update.auto_rollouts=2",
        f"update.auto_threshold={threshold}",
    ]
    with initialize_config_module(config_module="configs", version_base=None):
        run(compose(config_name="train", overrides=overrides))
    (m,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert m[f"count/segments_{path}"] == 2 and "count/segments_" + ("exact" if path == "jagg" else "jagg") not in m
    for key in ("00_04", "04_08"):
        assert -1.0 <= m[f"routing/cos_{key}"] <= 1.0 and m[f"routing/rho_{key}"] > 0
        assert m[f"routing/jagg_{key}"] == float(path == "jagg")
    assert m["time/probe"] > 0
