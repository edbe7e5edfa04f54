"""Every shipped config composes into the typed schema and validates; bad values fail fast."""

import copy
import math
import re
from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf
from omegaconf.errors import MissingMandatoryValue

from models.base import DTYPES, parse_dtype
from models.registry import backbone_names
from rewards.base import SCORER_NAMES
from train.components.config import TrainConfig, register_schema, trainable_transitions, validate
from train.run.errors import ConfigError

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
EXPERIMENTS = sorted(p.stem for p in (CONFIGS / "experiment").glob("*.yaml"))
# need no path; the rest are the paper's four runs
CPU_EXPERIMENTS = ("demo", "testbed_compare", "testbed_probe", "tiny")
PAPER_EXPERIMENTS = [e for e in EXPERIMENTS if e not in CPU_EXPERIMENTS]
register_schema()


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    monkeypatch.chdir(CONFIGS.parent)  # the demo's prompt file is relative to the repository root


@pytest.fixture
def paths(tmp_path):
    """Stand-ins for the local files a real experiment names."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\na dog\n")
    model = tmp_path / "model"
    model.mkdir()
    return {"prompts": prompts, "model": model, "file": tmp_path / "weights.pt"}


def load(overrides: list[str], tmp_path: Path) -> TrainConfig:
    with initialize_config_module(config_module="configs", version_base=None):
        cfg = compose(config_name="train", overrides=[f"run_dir={tmp_path}/run", *overrides])
    return OmegaConf.to_object(cfg)


def check(cfg: TrainConfig) -> None:
    validate(cfg, known_scorers=SCORER_NAMES, known_backbones=tuple(backbone_names()))


def required_paths(paths) -> list[str]:
    return [
        f"model.path={paths['model']}",
        f"data.train_prompts={paths['prompts']}",
        f"data.eval_prompts={paths['prompts']}",
        f"reward.components.hpsv2.checkpoint={paths['file']}",
        f"reward.components.clipscore.model_path={paths['model']}",
        f"eval.scorers.pickscore.model_path={paths['model']}",
        f"eval.scorers.pickscore.processor_path={paths['model']}",
    ]


def test_default_job_is_the_testbed(tmp_path):
    cfg = load([], tmp_path)
    check(cfg)
    assert (cfg.experiment, cfg.update.mode, cfg.model.path, cfg.model.build_tiny) == (
        "demo",
        "jagg",
        "testbed/pipeline",
        None,
    )
    assert list(cfg.reward.components) == ["shape_alignment"] and list(cfg.eval.scorers) == ["shape_alignment"]
    assert cfg.logging.eval_every > 0


@pytest.mark.parametrize("experiment", ["tiny", "testbed_compare", "testbed_probe"])
def test_cpu_experiments_compose_and_validate(experiment, tmp_path):
    check(load([f"experiment={experiment}"], tmp_path))


@pytest.mark.parametrize("experiment", PAPER_EXPERIMENTS)
def test_paper_experiments_compose_and_validate(experiment, paths, tmp_path):
    cfg = load([f"experiment={experiment}", *required_paths(paths)], tmp_path)
    check(cfg)
    assert set(cfg.reward.components) == {"hpsv2", "clipscore"}
    assert cfg.eval.scorers["hpsv2"]["checkpoint"] == str(paths["file"])  # interpolated from the reward
    assert cfg.grpo.group_size == 12 and cfg.sampler.num_steps == 21 and cfg.update.window == 4
    # each recipe's own conventions (docs/recipes.md)
    dance = experiment.endswith("_dance")
    assert cfg.grpo.adv_std == ("unbiased" if dance else "population")
    assert cfg.sampler.quantize_timesteps == ("dance" if dance else "none")
    assert cfg.grpo.adv_eps == (1e-8 if dance else 1e-4)


def test_an_evaluation_larger_than_eval_max_images_is_refused(paths, tmp_path):
    """The presets evaluated on the whole training prompt file (HPDv2's) when data.eval_prompts was unset."""
    many = tmp_path / "many.txt"
    many.write_text("".join(f"prompt {i}\n" for i in range(40)))
    overrides = ["experiment=flux_dance", *required_paths(paths), f"data.eval_prompts={many}", "eval.max_images=32"]
    with pytest.raises(ConfigError, match=r"would sample 40 images \(40 prompts .* eval.max_images=32: set data"):
        check(load(overrides, tmp_path))
    check(load([*overrides, "data.num_eval_prompts=32"], tmp_path))
    # the demo: 8 captions x 16 noises and 16 held-out x 16
    with pytest.raises(ConfigError, match=r"384 images \(8 prompts .* and 16 held-out, x eval.samples_per_prompt=16"):
        check(load(["eval.max_images=383"], tmp_path))


@pytest.mark.parametrize("experiment", PAPER_EXPERIMENTS)
def test_paper_experiments_require_paths(experiment, tmp_path):
    with initialize_config_module(config_module="configs", version_base=None):
        cfg = compose(config_name="train", overrides=[f"run_dir={tmp_path}", f"experiment={experiment}"])
    assert OmegaConf.is_missing(cfg.model, "path") and OmegaConf.is_missing(cfg.data, "train_prompts")
    with pytest.raises(MissingMandatoryValue):
        OmegaConf.to_object(cfg)


# Every option of every config group, found by globbing configs/ (experiments have their own tests;
# hydra/ is Hydra's own and arch/ holds architecture files, not options).
GROUP_OPTIONS = sorted(
    (folder.name, option.stem)
    for folder in CONFIGS.iterdir()
    if folder.is_dir() and folder.name not in ("experiment", "hydra", "arch", "__pycache__")
    for option in folder.glob("*.yaml")
)


def test_group_options_are_found():
    groups = {group for group, _ in GROUP_OPTIONS}
    assert {"model", "sampler", "update", "reward", "data", "logging"} <= groups
    assert len(GROUP_OPTIONS) >= 19


def stand_ins(missing: list[str], paths) -> list[str]:
    """A value for every required path an option leaves ``???``: a folder for models, a file for the rest."""
    folder_keys = ("model.path", "model_path", "processor_path")
    return [f"{key}={paths['model'] if key.endswith(folder_keys) else paths['prompts']}" for key in missing]


@pytest.mark.parametrize("group, option", GROUP_OPTIONS)
def test_group_options_compose(group, option, paths, tmp_path):
    overrides = [f"{group}={option}"]
    if option == "cps_fast":  # flow_grpo's 6 steps as shipped; its 3-step window needs a JAGG window of 3
        overrides += ["update.window=3", "sampler.sde_window_range=[0,3]", "sampler.sde_window_size=3"]
    elif group == "sampler":  # the demo's 9 steps; Fast needs a window inside the 8 trainable transitions
        overrides += ["sampler.num_steps=9"] + (
            ["sampler.sde_window_range=[0,8]", "sampler.sde_window_size=4"] if option == "flow_fast" else []
        )
    with initialize_config_module(config_module="configs", version_base=None):
        cfg = compose(config_name="train", overrides=[f"run_dir={tmp_path}/run", *overrides])
    missing = sorted(OmegaConf.missing_keys(cfg))
    cfg = load([*overrides, *stand_ins(missing, paths)], tmp_path)
    check(cfg)


def test_hydra_overrides_reach_the_schema(tmp_path):
    # experiment=tiny: the demo's own SDE window (an experiment is applied after the groups) would hide flow_fast's
    cfg = load(
        ["experiment=tiny", "update=exact", "update.jagg_frac=0.4", "sampler=flow_fast", "sampler.num_steps=21"],
        tmp_path,
    )
    assert (cfg.update.mode, cfg.update.jagg_frac, cfg.sampler.sde, cfg.sampler.sde_window_size) == (
        "exact",
        0.4,
        "flow",
        8,
    )


@pytest.mark.parametrize(
    "overrides, error, message",
    [
        (["update.window=3"], ValueError, "update.window=3"),
        (["update.window=1"], ValueError, "update.window"),
        (["update.jagg_frac=1.5"], ValueError, "update.jagg_frac"),
        (["update.mode=fast"], ValueError, "update.mode='fast'.*exact, jagg, jagg_sequential, ablate"),
        (["update.reuse_velocities=always"], ValueError, "update.reuse_velocities='always'.*fresh, stale, off"),
        (["update.reuse_velocities=off", "update.offload_velocities=true"], ValueError, "update.offload_velocities"),
        (["sampler.sde=euler"], ValueError, "sampler.sde='euler'.*dance, flow, cps"),
        (["sampler.sde=cps", "sampler.noise_level=1.2"], ValueError, r"sampler.noise_level must be in \(0, 1\]"),
        (["sampler.sde=cps", "sampler.noise_level=0"], ValueError, r"sampler.noise_level must be in \(0, 1\]"),
        (["sampler.quantize_timesteps=true"], ValueError, "sampler.quantize_timesteps.*none, float64, dance"),
        (["sampler.quantize_timesteps=dance", "sampler.shift=null"], ValueError, "sampler.shift"),
        (["grpo.adv_std=sample"], ValueError, "grpo.adv_std.*population, unbiased"),
        (["grpo.ratio_norm=true", "sampler.sde=cps"], ValueError, "grpo.ratio_norm=true.*sampler.sde=cps"),
        (["+reward.components.aesthetic.weight=1"], ValueError, "reward.components.*aesthetic.*hpsv2"),
        (["+reward.components.remote.weight=1"], ValueError, "reward.components.remote.url is not set"),
        (["grpo.gradient_accumulation_steps=3"], ValueError, "grpo.gradient_accumulation_steps"),
        (["grpo.group_size=1"], ValueError, "grpo.group_size"),
        (["sampler.sde_window_range=[0,12]"], ValueError, "sampler.sde_window_range"),
        (["perf.peak_tflops=0"], ValueError, "perf.peak_tflops must be > 0"),
        (
            ["model.build_tiny=null", "model.path=/nonexistent/flux"],
            FileNotFoundError,
            "model.path='/nonexistent/flux'",
        ),
        (["resume=/nonexistent/ckpt"], FileNotFoundError, "resume"),
    ],
)
def test_bad_values_fail_fast(overrides, error, message, tmp_path):
    cfg = load(overrides, tmp_path)
    with pytest.raises(error, match=message):
        check(cfg)


def test_model_dtype_accepts_what_the_backbone_parses(tmp_path):
    """model.dtype is validated against models.base.DTYPES, the names parse_dtype reads."""
    for name in DTYPES:
        check(load([f"model.dtype={name}"], tmp_path))
    with pytest.raises(ValueError, match=r"model\.dtype='bf32'.*float32, fp32, bfloat16, bf16"):
        check(load(["model.dtype=bf32"], tmp_path))
    with pytest.raises(ValueError, match="model.dtype must be one of"):
        parse_dtype("bf32")


def test_empty_or_missing_prompt_file(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    with pytest.raises(ValueError, match="data.train_prompts.*empty"):
        check(load([f"data.train_prompts={empty}"], tmp_path))
    with pytest.raises(FileNotFoundError, match="data.train_prompts"):
        check(load([f"data.train_prompts={tmp_path}/nope.txt"], tmp_path))


def test_typos_fail_at_compose(tmp_path):
    with pytest.raises(Exception, match="sde_windw"):
        load(["sampler.sde_windw=3"], tmp_path)


def test_trainable_transitions():
    cfg = load([], Path("/tmp"))
    cfg.sampler.num_steps, cfg.sampler.sde_window_size = 21, 0
    assert trainable_transitions(cfg.sampler) == list(range(20))
    cfg.sampler.sde_window_size, cfg.sampler.sde_window_range = 8, [4, 12]
    assert trainable_transitions(cfg.sampler, window_start=4) == list(range(4, 12))


def schema_fields(node, prefix: str = ""):
    """(dotted name, annotation, value) of every leaf field of the schema."""
    for f in fields(node):
        value = getattr(node, f.name)
        if is_dataclass(value):
            yield from schema_fields(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f.type, value


SEEDS = ("seed", "eval.seed")  # any integer seeds a stream; every other int of the schema is a count


def test_every_number_of_the_schema_is_checked(tmp_path):
    """Field by field: NaN and inf in any float, and -1 in any count, are rejected naming the field. A new
    field of the schema is covered without editing this test."""
    names, base = [], load([], tmp_path)
    for name, annotation, _ in schema_fields(base):
        if annotation in ("float", "float | None"):
            bad = [math.nan, math.inf, -math.inf]
        elif annotation == "int" and name not in SEEDS:
            bad = [-1]
        else:
            continue
        names.append(name)
        for value in bad:
            cfg = copy.deepcopy(base)
            parent, _, leaf = name.rpartition(".")
            setattr(_node(cfg, parent), leaf, value)
            with pytest.raises(ConfigError, match=re.escape(name)):
                check(cfg)
    assert {"grpo.max_grad_norm", "sampler.eta", "checkpoint.every", "logging.sample_every", "dist.timeout_s"} <= set(
        names
    )


def _node(cfg: TrainConfig, dotted: str):
    node = cfg
    for part in filter(None, dotted.split(".")):
        node = getattr(node, part)
    return node


def test_pickscore_reward_option_is_flow_grpo_scaled(paths, tmp_path):
    cfg = load(
        [
            "reward=pickscore",
            f"reward.components.pickscore.model_path={paths['model']}",
            f"reward.components.pickscore.processor_path={paths['model']}",
        ],
        tmp_path,
    )
    check(cfg)
    assert cfg.reward.components["pickscore"]["scale"] == "flow_grpo"
