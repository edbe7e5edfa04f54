"""Every shipped config composes into the typed schema and validates; bad values fail fast."""

import copy
import math
import re
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from models.base import DTYPES, parse_dtype
from models.registry import backbone_names
from rewards.base import SCORER_NAMES
from train.cli.reporting import hydra_message
from train.ground.errors import ConfigError
from train.parts.config.keys import checked, typed
from train.parts.config.schema import TrainConfig, register_schema
from train.parts.config.shipped import shipped
from train.parts.observe.health import Health, HealthConfig
from train.parts.optim.optimizer import adamw_settings
from train.run.checks import trainable_transitions, validate
from train.run.start import typed_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
EXPERIMENTS = sorted(p.stem for p in (CONFIGS / "experiment").glob("*.yaml"))
# need no path; MixGRPO's two recipes; the rest are the paper's four runs
CPU_EXPERIMENTS = ("demo", "testbed_compare", "testbed_probe", "tiny")
MIX_EXPERIMENTS = ("flux_mix", "flux_mix_flash")
PAPER_EXPERIMENTS = [e for e in EXPERIMENTS if e not in CPU_EXPERIMENTS + MIX_EXPERIMENTS]
register_schema()
# a judge whose request to a server that never answers takes (2 x 2 + 1) x 100 s = 500 s
SLOW_JUDGE = "base_url: 'http://127.0.0.1:9/v1', model: m, timeout_s: 100, retries: 2"


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    monkeypatch.chdir(CONFIGS.parent)  # the tiny models are built under .cache/ of the repository root


@pytest.fixture
def paths(tmp_path):
    """Stand-ins for the local files a real experiment names."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\na dog\n")
    model = tmp_path / "model"
    model.mkdir()
    weights = tmp_path / "weights.pt"  # a scorer's file: validate checks that it exists
    weights.write_bytes(b"")
    return {"prompts": prompts, "model": model, "file": weights}


def load(overrides: list[str], tmp_path: Path) -> TrainConfig:
    """The typed config as the commands build it: Hydra's refusals as the one line they print."""
    try:
        with initialize_config_module(config_module="configs", version_base=None):
            cfg = compose(config_name="train", overrides=[f"run_dir={tmp_path}/run", *overrides])
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError(hydra_message(err)) from None
    return typed_config(cfg)


def check(cfg: TrainConfig) -> None:
    validate(cfg, known_scorers=SCORER_NAMES, known_backbones=tuple(backbone_names()))


def required_paths(paths) -> list[str]:
    return [
        f"model.path={paths['model']}",
        f"data.train_prompts={paths['prompts']}",
        f"eval.prompts={paths['prompts']}",
        f"reward.components.hpsv2.checkpoint={paths['file']}",
        f"reward.components.clipscore.model_path={paths['model']}",
        f"eval.scorers.pickscore.model_path={paths['model']}",
        f"eval.scorers.pickscore.processor_path={paths['model']}",
    ]


def test_default_job_is_the_testbed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the shipped model and prompt files are found from any folder
    cfg = load([], tmp_path)
    check(cfg)
    assert (cfg.experiment, cfg.update.mode, cfg.model.path, cfg.model.build_tiny) == (
        "demo",
        "jagg",
        str(shipped("testbed/pipeline")),
        None,
    )
    assert Path(cfg.data.train_prompts) == CONFIGS.parent / "testbed/prompts/train.txt"
    assert list(cfg.reward.components) == ["shape_alignment"] and list(cfg.eval.scorers) == ["shape_alignment"]
    assert cfg.eval.every > 0


@pytest.mark.parametrize("experiment", ["tiny", "testbed_compare", "testbed_probe"])
def test_cpu_experiments_compose_and_validate(experiment, tmp_path):
    check(load([f"experiment={experiment}"], tmp_path))


@pytest.mark.parametrize("experiment", PAPER_EXPERIMENTS)
def test_paper_experiments_compose_and_validate(experiment, paths, tmp_path):
    cfg = load([f"experiment={experiment}", *required_paths(paths)], tmp_path)
    check(cfg)
    assert set(cfg.reward.components) == {"hpsv2", "clipscore"}
    assert cfg.eval.scorers["hpsv2"]["checkpoint"] == str(paths["file"])  # interpolated from the reward
    assert cfg.grpo.group_size == 12 and cfg.sampler.num_steps == 21 and cfg.update.segment_length == 4
    # each recipe's own conventions (docs/recipes.md)
    dance = experiment.endswith("_dance")
    assert cfg.grpo.adv_std == ("unbiased" if dance else "population")
    assert cfg.sampler.quantize_timesteps == ("dance" if dance else "none")
    assert cfg.grpo.adv_eps == (1e-8 if dance else 1e-4)


@pytest.mark.parametrize("experiment", MIX_EXPERIMENTS)
def test_mixgrpo_experiments_compose_and_validate(experiment, paths, tmp_path):
    """MixGRPO's recipes (docs/recipes.md): 25 steps, a window of 4 that moves every 25 (Flash: 20) steps, and
    in the Flash one DPM-Solver++ 2M on 0.4 of the steps after it; HPSv2.1 + ImageReward + PickScore advantages,
    1/3 each, evaluated with HPSv2.1 + PickScore."""
    pick = [f"reward.components.pickscore.{key}={paths['model']}" for key in ("model_path", "processor_path")]
    pick += [f"reward.components.imagereward.{key}={paths['file']}" for key in ("checkpoint", "med_config")]
    pick += [f"reward.components.imagereward.tokenizer={paths['model']}"]
    common = [f"model.path={paths['model']}", f"data.train_prompts={paths['prompts']}"]
    common += [f"eval.prompts={paths['prompts']}", f"reward.components.hpsv2.checkpoint={paths['file']}"]
    cfg = load([f"experiment={experiment}", *common, *pick], tmp_path)
    check(cfg)
    s, flash = cfg.sampler, experiment == "flux_mix_flash"
    assert (s.num_steps, s.sde_window_size, s.sde_window_schedule, s.sde_window_stride) == (25, 4, "progressive", 1)
    assert s.sde_window_iters == (20 if flash else 25) and cfg.reward.combine == "advantage"
    assert (s.post_window.solver, s.post_window.ratio) == (("dpmpp_2m", 0.4) if flash else ("euler", 1.0))
    assert set(cfg.reward.components) == {"hpsv2", "imagereward", "pickscore"}
    assert [comp["weight"] for comp in cfg.reward.components.values()] == pytest.approx([1 / 3] * 3)
    assert set(cfg.eval.scorers) == {"hpsv2", "pickscore"}


def test_an_evaluation_larger_than_eval_max_images_is_refused(paths, tmp_path):
    """The presets evaluated on the whole training prompt file (HPDv2's) when eval.prompts was unset."""
    many = tmp_path / "many.txt"
    many.write_text("".join(f"prompt {i}\n" for i in range(40)))
    overrides = ["experiment=flux_dance", *required_paths(paths), f"eval.prompts={many}", "eval.max_images=32"]
    with pytest.raises(
        ConfigError, match=r"would sample 40 images \(40 prompts .* eval.max_images=32: set eval.num_prompts"
    ):
        check(load(overrides, tmp_path))
    check(load([*overrides, "eval.num_prompts=32"], tmp_path))
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
        overrides += ["update.segment_length=3", "sampler.sde_window_range=[0,3]", "sampler.sde_window_size=3"]
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
        (["update.segment_length=3"], ValueError, "update.segment_length=3"),
        (["sampler.sde=euler"], ValueError, "sampler.sde='euler'.*dance, flow, cps"),
        (["update.jagg_frac=1.5"], ValueError, "update.jagg_frac"),
        (["update.reuse_velocities=off", "update.offload_velocities=true"], ValueError, "update.offload_velocities"),
        (["sampler.sde=ode"], ValueError, "sampler.sde=ode samples no transition to train: pick dance, flow or cps"),
        (["sampler.sde=cps", "sampler.noise_level=1.2"], ValueError, r"sampler.noise_level must be in \(0, 1\]"),
        (["sampler.sde=cps", "sampler.noise_level=0"], ValueError, r"sampler.noise_level must be in \(0, 1\]"),
        (
            ["sampler.quantize_timesteps=dance", "sampler.shift=null"],
            ValueError,
            "sampler.quantize_timesteps=dance.*shift",
        ),
        (["grpo.adv_std=sample"], ValueError, "grpo.adv_std.*population, unbiased"),
        (["grpo.ratio_norm=true", "sampler.sde=cps"], ValueError, "grpo.ratio_norm=true.*sampler.sde=cps"),
        (["+reward.components.aesthetic.weight=1"], ValueError, "reward.components.*aesthetic.*hpsv2"),
        (["+reward.components.remote.weight=1"], ValueError, "reward.components.remote.url is not set"),
        (
            ["reward.chunk_groups=-1"],
            ValueError,
            r"^reward\.chunk_groups must be auto or an integer >= 0 \(0: one chunk\), got -1$",
        ),
        (
            ["reward.chunk_groups=two"],
            ValueError,
            r"^reward\.chunk_groups must be auto or an integer >= 0 \(0: one chunk\), got 'two'$",
        ),
        (
            ["+reward.components.jpeg_compressibility.required=false", "reward.components.shape_alignment.weight=0"],
            ValueError,
            r"^reward\.components\.jpeg_compressibility\.required is false and no required term has a weight",
        ),
        (
            ["+reward.components.shape_alignment.required=maybe"],
            ValueError,
            r"^reward\.components\.shape_alignment\.required must be true or false, got 'maybe'$",
        ),
        (
            ["batch.gradient_accumulation_steps=3", "batch.micro_batch=1"],
            ValueError,
            "batch.gradient_accumulation_steps=3 must",
        ),
        (["grpo.group_size=1"], ValueError, "grpo.group_size"),
        (["sampler.sde_window_range=[0,12]"], ValueError, "sampler.sde_window_range"),
        (["perf.peak_tflops=0"], ValueError, "perf.peak_tflops must be > 0"),
        (["model.lora.rank=0"], ValueError, r"^model\.lora\.rank must be > 0, got 0$"),  # a nested group's own key
        (["model.decode_batch=-1"], ValueError, r"^model\.decode_batch must be >= 0, got -1 \(0 = every sample"),
        (
            ["model.build_tiny=null", "model.path=/nonexistent/flux"],
            FileNotFoundError,
            "model.path='/nonexistent/flux'",
        ),
        (["resume=/nonexistent/ckpt"], FileNotFoundError, "resume"),
        (
            ["experiment=tiny", "checkpoint.allow_changed=[reward.components.jpeg_compressibility.wieght]"],
            ValueError,
            r"^checkpoint\.allow_changed: 'reward\.components\.jpeg_compressibility\.wieght' names no setting a "
            r"checkpoint records \(the nearest are reward\.components\.jpeg_compressibility\.weight",
        ),
        (["checkpoint.allow_changed=[model.heigth]"], ValueError, r"names no setting .*nearest are model\.height"),
        (["checkpoint.allow_changed=[update.nope]"], ValueError, r"'update\.nope' names no setting a checkpoint"),
        (
            [
                "+reward.components.judge={base_url: 'http://127.0.0.1:9/v1', model: m}",
                "checkpoint.allow_changed=[reward.components.judge.timeout_s]",
            ],
            ValueError,
            r"'reward\.components\.judge\.timeout_s' may change on resume without it",
        ),
        (
            ["experiment=tiny", "eval.every=1", f"+eval.scorers.judge={{{SLOW_JUDGE}}}", "dist.timeout_s=300"],
            ValueError,
            r"^eval\.scorers\.judge: a request its server does not answer takes up to 500 s .*dist\.timeout_s=300",
        ),
    ],
)
def test_bad_values_fail_fast(overrides, error, message, tmp_path):
    with pytest.raises(error, match=message):
        check(load(overrides, tmp_path))


def test_a_served_eval_scorer_is_bound_checked_only_with_an_evaluation(tmp_path):
    """eval.scorers are built only with an evaluation (eval.every > 0): without one, a judge among them whose
    request would outlast dist.timeout_s refuses nothing."""
    check(load(["experiment=tiny", "eval.every=0", f"+eval.scorers.judge={{{SLOW_JUDGE}}}", "dist.timeout_s=300"],
               tmp_path))  # fmt: skip


@pytest.mark.parametrize(
    "keys",
    [
        "reward.components.jpeg_compressibility.weight",
        "reward.components",
        "reward.components.clipscore",
        "model.lora.modules",
    ],
)
def test_allow_changed_takes_what_a_resume_compares(keys, tmp_path):
    """A key at any depth, a group, a scorer this run left out (the checkpoint's, checked on resume), the LoRA
    modules recorded beside the settings."""
    check(load(["experiment=tiny", f"checkpoint.allow_changed=[{keys}]"], tmp_path))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["optimizer.lr=0"], "optimizer.lr must be > 0, got 0.0"),  # a group's own check, its path prefixed
        (["optimizer.betas=[0.9,1.0]"], "optimizer.betas[1] must be in [0, 1), got 1.0"),
        (["optimizer.eps=0"], "optimizer.eps must be > 0, got 0.0"),
        (["ema.decay=1"], "ema.decay must be in [0, 1), got 1.0 (0 = no EMA)"),
        (["batch.micro_batch=3"], "batch.micro_batch=3 must divide gradient_accumulation_steps=64"),
        (["experiment=tiny", "eval.every=2"], "eval.every > 0 needs eval.scorers"),
        (["grpo.adv_std=sample"], "grpo.adv_std='sample' is not valid; accepted values: population, unbiased"),
        (
            ["logging.wandb_mode=off"],
            "logging.wandb_mode='off' is not valid; accepted values: disabled, offline, online",
        ),
    ],
)
def test_a_group_names_the_full_key_of_its_refused_field(overrides, message, tmp_path):
    with pytest.raises(ConfigError) as refused:
        check(load(overrides, tmp_path))
    assert str(refused.value).startswith(message)


def test_adamw_takes_the_configured_epsilon(tmp_path):
    """optimizer.eps reaches AdamW; its default is torch's own, so a run that does not set it computes as before."""
    param = [torch.nn.Parameter(torch.zeros(1))]
    adamw = torch.optim.AdamW(param, **adamw_settings(load(["optimizer.eps=1e-6"], tmp_path).optimizer))
    assert adamw.param_groups[0]["eps"] == 1e-6
    assert adamw_settings(load([], tmp_path).optimizer)["eps"] == torch.optim.AdamW(param).defaults["eps"]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["sampler.post_window.solver=dpmpp_2m"],
            "sampler.post_window.solver=dpmpp_2m sets the steps after the SDE window, and sampler.sde_window_size=0 "
            "has none (SDE on every step): leave sampler.post_window at its defaults, or set",
        ),
        (["sampler.post_window.ratio=0.4", "sampler.post_window.min_steps=1"], "sampler.post_window.ratio=0.4, "),
        (
            ["sampler.sde_window_schedule=progressive"],
            "sampler.sde_window_schedule=progressive moves the SDE window, and sde_window_size=0 has none",
        ),
        (["sampler.sde_window_schedule=random"], "sampler.sde_window_schedule=random moves the SDE window"),
    ],
)
def test_a_window_setting_on_a_sampler_without_a_window_is_refused(overrides, message, tmp_path):
    """python -m train experiment=tiny (no SDE window) sampler.post_window.solver=dpmpp_2m would do nothing."""
    with pytest.raises(ConfigError) as refused:
        check(load(["experiment=tiny", *overrides], tmp_path))
    assert str(refused.value).startswith(message)
    window = ["sampler.sde_window_size=4", "sampler.sde_window_range=[0,4]", "update.segment_length=4"]
    check(load(["experiment=tiny", *window, *overrides], tmp_path))  # with a window they act: accepted


@dataclass
class _Inner:
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"size must be >= 1, got {self.size}")


@dataclass
class _Outer:
    inner: _Inner = field(default_factory=_Inner)
    lr: float = 1.0


@dataclass
class _Root:
    outer: _Outer = field(default_factory=_Outer)


def test_a_nested_group_is_named_by_its_whole_path():
    """OmegaConf.to_object runs __post_init__ but says nothing of where; the typed tree names the whole key."""
    tree = OmegaConf.merge(OmegaConf.structured(_Root), {"outer": {"inner": {"size": 0}}})
    with pytest.raises(ValueError, match="^size must be >= 1, got 0$"):
        OmegaConf.to_object(tree)
    with pytest.raises(ConfigError, match=r"^outer\.inner\.size must be >= 1, got 0$"):
        typed(tree)
    built = typed(OmegaConf.merge(OmegaConf.structured(_Root), {"outer": {"lr": 2.0}}))
    assert built == _Root(_Outer(_Inner(1), 2.0))
    built.outer.inner.size = 0  # changed after it was built: the checks run again
    with pytest.raises(ConfigError, match=r"^outer\.inner\.size must be >= 1"):
        checked(built)


@pytest.mark.parametrize(
    "override, message",
    [
        ("sampler.sde=euler", "sampler.sde='euler' is not valid; accepted values: dance, flow, cps, ode"),
        (  # YAML reads true as a boolean
            "sampler.quantize_timesteps=true",
            "sampler.quantize_timesteps='True' is not valid; accepted values: none, float64, dance",
        ),
        ("reward.combine=max", "reward.combine='max' is not valid; accepted values: sum, advantage"),
        ("model.build_tiny=huge", "model.build_tiny='huge' is not valid; accepted values: tiny, small"),
    ],
)
def test_bad_choices_fail_at_compose(override, message, tmp_path):
    """A choice is an Enum: composing refuses a value that names no member, naming the key and the members."""
    with pytest.raises(ConfigError) as refused:
        load([override], tmp_path)
    assert str(refused.value) == message


@pytest.mark.parametrize(
    "overrides, error, message",
    [
        (["update.segment_length=1"], ValueError, "segment_length must be >= 2"),
        (["update.jagg_frac=1.5"], ValueError, r"jagg_frac must be in \[0, 1\], got 1.5"),
        (["update.timestep_fraction=0"], ValueError, r"timestep_fraction must be in \(0, 1\]"),
        (["update.reuse_velocities=off", "update.offload_velocities=true"], ValueError, "offload_velocities=true"),
        (["update.mode=fast"], ConfigError, "^update.mode='fast' is not valid; accepted values: exact, jagg,"),
        (["update.reuse_velocities=always"], ConfigError, "^update.reuse_velocities='always' is not valid; accepted"),
    ],
)
def test_bad_update_settings_fail_when_the_config_is_built(overrides, error, message, tmp_path):
    """The update stage's config checks its own fields (its choices are Enums, checked at compose time)."""
    with pytest.raises(error, match=message):
        load(overrides, tmp_path)


def test_model_dtype_accepts_what_the_backbone_parses(tmp_path):
    """model.dtype is validated against models.base.DTYPES, the names parse_dtype reads."""
    for name in DTYPES:
        check(load([f"model.dtype={name}"], tmp_path))
    with pytest.raises(
        ConfigError, match=r"^model\.dtype='bf32' is not valid; accepted values: float32, fp32, bfloat16, bf16"
    ):
        load(["model.dtype=bf32"], tmp_path)
    with pytest.raises(ValueError, match="dtype must be one of"):
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
    assert {
        "optimizer.max_grad_norm",
        "sampler.eta",
        "checkpoint.every",
        "logging.sample_every",
        "dist.timeout_s",
    } <= set(names)


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


def test_an_optional_reward_term_reaches_the_combiner_and_not_its_scorer(tmp_path):
    """reward.components.<name>.required=false: the combiner may leave the term out; the scorer is built without
    the key (it is the combiner's, as weight is) and the arguments check passes it."""
    import torch

    from train.parts.scoring.scorers import build_rewards, check_scorer_inputs

    overrides = [
        "+reward.components.jpeg_compressibility.required=false",
        "+reward.components.jpeg_compressibility.quality=80",
    ]
    cfg = load(overrides, tmp_path)
    check_scorer_inputs(cfg.reward, None)
    rewards = build_rewards(cfg.reward, torch.device("cpu"))
    assert rewards.optional == {"jpeg_compressibility"} and set(rewards.components) == {
        "shape_alignment",
        "jpeg_compressibility",
    }
    assert cfg.reward.chunk_groups == "auto"  # no served term: one chunk, the step of before the reward stage
    assert cfg.reward.chunks(8) == [range(8)]


def test_a_group_that_builds_its_part_composes_and_refuses_a_copy_of_its_settings():
    """HealthConfig's first base is Configurable: it composes into the structured config and merges overrides, and
    ``build`` makes the part from the group, refusing a runtime argument that repeats one of its settings."""
    merged = OmegaConf.merge(OmegaConf.structured(TrainConfig), OmegaConf.from_dotlist(["health.max_bad_steps=3"]))
    group = OmegaConf.to_object(merged.health)
    assert isinstance(group, HealthConfig) and group.max_bad_steps == 3
    health = group.build(optimizer_steps=2, first=0, last=9, start_norm=1.0)
    assert isinstance(health, Health) and health.config is group and health.optimizer_steps == 2
    with pytest.raises(TypeError, match="max_bad_steps are settings of the group"):
        group.build(optimizer_steps=2, first=0, last=9, start_norm=1.0, max_bad_steps=1)
