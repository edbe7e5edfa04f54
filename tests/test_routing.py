"""update.jagg_frac=auto (train/routing.py): the routing follows the measured cosines."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from grad_quality_toys import ADVANTAGES, ToyVelocity, toy_settings, toy_trajectory
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from models.registry import backbone_names
from rewards.base import SCORER_NAMES
from train.config import TrainConfig, register_schema, validate
from train.routing import AutoRouter
from train.update import plan_for

ROOT = Path(__file__).resolve().parents[1]
register_schema()


def refresh(router: AutoRouter, step: int, model: ToyVelocity) -> dict[str, float]:
    traj = toy_trajectory(model)  # rolled out by the current policy: the ratio is 1
    return router.refresh(step, model, traj, ADVANTAGES, list(model.parameters()), toy_settings())


def test_routing_changes_when_the_cosine_crosses_the_threshold():
    model = ToyVelocity(gamma=0.0)  # linear in t: every group measures cos = 1
    router = AutoRouter(mode="jagg", every=2, threshold=0.95, num_rollouts=4)
    metrics = refresh(router, 0, model)
    assert router.modes == {(0, 4): "jagg", (4, 8): "jagg", (8, 12): "jagg"}
    assert metrics["routing/cos_08_12"] == pytest.approx(1.0, abs=1e-5) and metrics["routing/jagg_08_12"] == 1.0
    assert metrics["routing/rule_jagg_frac"] == 1.0

    model.gamma = 10.0  # the low-noise group (t < 0.5) turns strongly nonlinear
    assert refresh(router, 1, model) == {}  # not due: the table holds
    assert set(router.modes.values()) == {"jagg"}
    metrics = refresh(router, 2, model)
    assert router.modes == {(0, 4): "jagg", (4, 8): "jagg", (8, 12): "exact"}
    assert metrics["routing/cos_08_12"] < 0.95 and metrics["routing/jagg_08_12"] == 0.0
    assert metrics["routing/rule_jagg_frac"] == pytest.approx(8 / 12, abs=1e-4)  # M = 12 trainable transitions

    plan = plan_for(toy_trajectory(model), router.apply(toy_settings()), generator=None)
    assert [(p.start, p.mode) for p in plan] == [(0, "jagg"), (4, "jagg"), (8, "exact")]


def test_groups_the_probe_did_not_see_take_the_exact_path():
    settings = replace(toy_settings(), group_modes={(0, 4): "jagg"})
    plan = plan_for(toy_trajectory(ToyVelocity()), settings, generator=None)
    assert [p.mode for p in plan] == ["jagg", "exact", "exact"]


def compose_cfg(overrides: list[str]) -> TrainConfig:
    with initialize_config_module(config_module="configs", version_base=None):
        cfg = compose(config_name="train", overrides=overrides)
    return OmegaConf.to_object(cfg)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["update.jagg_frac=fast"], "update.jagg_frac"),
        (["update.jagg_frac=auto", "update=exact"], "update.mode"),
        (["update.jagg_frac=auto", "update.auto_rollouts=100"], "update.auto_rollouts"),
        (["update.jagg_frac=auto", "update.auto_every=0"], "update.auto_every"),
    ],
)
def test_bad_auto_settings_fail_validation(overrides, match, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    cfg = compose_cfg([f"run_dir={tmp_path}", *overrides])
    with pytest.raises(ValueError, match=match):
        validate(cfg, known_scorers=SCORER_NAMES, known_backbones=tuple(backbone_names()))


def test_jagg_frac_takes_numbers_and_auto(tmp_path):
    for value, expected in (("1", 1), ("0.4", 0.4), ("auto", "auto")):
        assert compose_cfg([f"run_dir={tmp_path}", f"update.jagg_frac={value}"]).update.jagg_frac == expected


@pytest.mark.parametrize("threshold, path", [(-2.0, "jagg"), (1.5, "exact")])
def test_trainer_routes_by_the_probe(threshold, path, tiny_flux_dir, tmp_path, monkeypatch):
    """Any cosine passes a threshold of -2 and none passes 1.5: the update follows the table."""
    from train.trainer import run

    monkeypatch.chdir(ROOT)  # the demo's prompt file is relative to the repository root
    overrides = [
        f"run_dir={tmp_path}",
        "experiment=tiny",
        f"model.path={tiny_flux_dir}",
        "num_steps=1",
        "sampler.num_steps=9",
        "grpo.group_size=2",
        "grpo.prompts_per_rank=1",
        "grpo.micro_batch=2",
        "grpo.gradient_accumulation_steps=2",
        "logging.progress_bar=false",
        "checkpoint.export=false",
        "update.jagg_frac=auto",
        "update.auto_rollouts=2",
        f"update.auto_threshold={threshold}",
    ]
    with initialize_config_module(config_module="configs", version_base=None):
        run(compose(config_name="train", overrides=overrides))
    (m,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert m[f"count/groups_{path}"] == 2 and "count/groups_" + ("exact" if path == "jagg" else "jagg") not in m
    for key in ("00_04", "04_08"):
        assert -1.0 <= m[f"routing/cos_{key}"] <= 1.0 and m[f"routing/rho_{key}"] > 0
        assert m[f"routing/jagg_{key}"] == float(path == "jagg")
    assert m["time/probe"] > 0
