"""``python -m train.plan [overrides]``: per-rank memory and FLOPs of one full-size training step, on CPU.

Nothing is allocated and no weight is read. The transformer is built from its architecture config
(``configs/arch/<model>/transformer/config.json``, or ``model.path``'s) under torch's
``FakeTensorMode``, which gives every tensor its shape, dtype and device but no storage, on a fake
process group of ``plan.world_size`` ranks. The trainer's own code then sets the run up and runs one
step on rank 0: ``train.parts.policy.builder.setup_trainable`` (LoRA or full fine-tuning, the KL reference,
activation checkpointing, FSDP2 through ``train.distributed.parallelize``), AdamW with the run's
settings, the EMA; then, each call traced under ``FSDPMemTracker`` (what lives in memory, and when)
and ``FlopCounterMode``:

    rollout     ``train.loop.step.sample_trajectories``: the sampler's N denoising steps on every sample of
                the rank, keeping the velocities when the update reuses them; the transformer is
                traced on the first step of each shape (the shared start's steps run one row per
                group), its FLOPs scaled by the rows of every step
    decode      ``train.loop.step.decode_images`` of those samples (the reward models score the images next)
    update      ``train.algorithm.update.update_micro_batch``: one segment of W steps of one micro-batch (the GRPO loss,
                the KL reference's batched call, ``train.algorithm.jagg.backward_segment``), once per update path
                the run routes to (and exact), on the rollout's velocities or recomputing them as the
                run does, with and without activation checkpointing, while earlier micro-batches'
                gradients are held; the exact path on 2 of its W steps (each step's graph is freed
                before the next), its FLOPs scaled to W; exact_batched (its W steps in one forward
                and one backward, update.exact_batched) for its memory
    optimizer   the global-norm clip, the AdamW step and the EMA (``train.loop.passes.step_weights``)

A phase's peak is what the tracker saw (transformer shards, gradients, optimizer state, the KL
reference and EMA shards, the step's trajectories, conditioning and images, and the phase's own
activations, all-gathered blocks and temporaries) plus the frozen models that every rank
replicates, counted from their configs: text encoders (none with ``model.embedding_cache``), VAE,
reward models and, when the run evaluates, the evaluation scorers it keeps after the first
evaluation. The step's peak is the largest phase. FLOPs per step scale the traced calls: one
rollout (its forwards expected over the SDE windows the run draws, ``counts.drawn_windows``: each window's
rollout is run), one decode, the expected number of segments per path per micro-batch (over the random segment
pick and those windows), one optimizer step per ``gradient_accumulation_steps`` samples.
The update's shared start (``update.share_group_start``) takes off the expected rows whose first
trainable step it runs once per group, at the exact path's FLOPs per step and row; the report gives
the step with it and without it.

Communication and time (train/tools/plan/comm.py): the transformer forwards of each traced call are counted
(with gradients: each has one backward), and each forward and backward turned into the bytes rank 0
sends in FSDP2's all-gathers, reduce-scatters and HSDP's all-reduces, inside its node and across
nodes (``plan.gpus_per_node``); with the FLOPs at ``plan.mfu`` of the GPU's peak (``perf.peak_tflops``,
else ``plan.gpu``'s in train/parts/observe/perf.py's table) and the links' rates (``plan.intra_node_gbps``,
``plan.inter_node_gbps``) they give the step's time, and with the run's evaluations (``evaluation``:
their images sampled at the rollout's FLOPs per row) the run's.

Limits, by construction:
* Fake tensors trace the CPU kernels' shapes: attention is the CPU flash kernel (output and
  log-sum-exp saved, no L x L matrix), as CUDA's flash and memory-efficient kernels do; any kernel
  whose CUDA version keeps other buffers is off by those.
* The tracker counts tensor storage, not the CUDA caching allocator: no fragmentation, no CUDA
  context, no NCCL buffers (``plan.reserved_gib`` keeps room for them), no cuBLAS workspaces.
* Every fake tensor lives on one device: the velocities kept in host memory
  (``update.offload_velocities``) are taken out of the GPU peak by their size.
* Not traced: prompt encoding and reward scoring (their models' weights are counted), logging,
  evaluation (its cost is estimated from the rollout's) and checkpoints. The rollout runs without a
  prompt batch (conditioning shaped as ``backbone.encode`` returns it), its memory measured with the first
  window the run draws (the trajectory keeps every step's latents wherever the window is), on a fixed-shift
  schedule; the values of the schedule and of the step's flags are real,
  every other tensor a shape.
* ``plan.depth=extended`` (the default) traces the transformer with 4 and 6 blocks of each kind and extends
  every figure linearly to its full depth (train/tools/plan/depth.py): parameters, FLOPs and the bytes sent are the full
  trace's; a peak moves by a block's saved input per block from depth to depth (and from run to run), so the
  peaks are within a fraction of a percent of the full trace's (``plan.depth=full``, every block traced).
* What reads a value is left out: the finiteness test of the gradient norm, the update's logged
  metrics (``train.algorithm.update.UpdateStats``).
* The exact path's trace runs the KL reference's batched call on its 2 traced steps, not W: the
  jagg paths' traces hold the full call (a few [W x micro_batch] rows without gradients).

The planner's files: this one (the settings as read, the plan, the command), plan_config.py (``plan.*``,
composed by configs/plan.yaml), fake.py (the fake process group and tensors, the tracker and FLOP
counter: every private torch name), frozen.py (the replicated models), fake_run.py (the run's parts),
step_calls.py (the step's phases as calls), tracing.py (the traced step), depth.py (a few blocks traced,
extended to full depth), counts.py (what the settings alone give: segments, update calls, the shared start,
evaluations), comm.py (communication and time), report.py (what was found, the verdict), advice.py (the changes
that lower the peak), report_text.py (the printed report).
"""

from __future__ import annotations

import copy
import json
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from models.base import parse_dtype
from models.registry import backbone_names
from rewards.base import SCORER_NAMES
from train.algorithm.update_config import Routing, UpdateMode
from train.cli.compose import setup
from train.cli.reporting import hydra_message, report_error, reported
from train.ground.errors import ConfigError
from train.parts.config.schema import TrainConfig
from train.parts.observe.perf import GPU_PEAK_TFLOPS
from train.run.checks import validate
from train.run.start import typed_config
from train.run.startup_checks import check_mesh
from train.tools.plan.comm import ModelBytes
from train.tools.plan.counts import (
    evaluation,
    expected_segments,
    expected_shared_calls,
    expected_shared_rows,
    text_tokens,
)
from train.tools.plan.depth import cut_arch, extended, full_depths, traced_depths
from train.tools.plan.fake import fake_process_group, fake_tensors
from train.tools.plan.fake_run import traced_run
from train.tools.plan.frozen import ARCH_ROOT, NOT_READ, FrozenModel, frozen_models
from train.tools.plan.plan_config import Depth, PlanRunConfig, register, validate_plan
from train.tools.plan.report import Phase, PlanReport
from train.tools.plan.report_text import format_report
from train.tools.plan.reward import reward_timing
from train.tools.plan.step_calls import StepTensors
from train.tools.plan.tracing import Traced, progress, trace_other_checkpointing, trace_step

SHIPPED_ARCH = {"flux": "flux1-dev", "qwenimage": "qwen-image"}  # model.name -> folder under configs/arch


PROG = "python -m train.plan"
HELP_FLAGS = ("--help", "-h", "--hydra-help")  # Hydra's flags the planner answers (it takes no other)


def plan_config(cfg: DictConfig) -> tuple[PlanRunConfig, bool]:
    """(the typed config, whether model.path was given). Required paths the planner does not read
    (model, prompts, reward checkpoints) may stay unset; everything else is validated as for training."""
    cfg = copy.deepcopy(cfg)
    model_path_given = not OmegaConf.is_missing(cfg.model, "path")
    cfg.run_dir = NOT_READ  # Hydra's output folder: compose() sets none, and the planner writes no run
    _fill_missing(cfg)
    config = typed_config(cfg)
    if not isinstance(config, PlanRunConfig):
        raise TypeError(f"the planner's settings come from configs/plan.yaml, got a {type(config).__name__}")
    validate(config, known_scorers=SCORER_NAMES, known_backbones=tuple(backbone_names()), check_files=False)
    validate_plan(config.plan)
    plannable(config)
    return config, model_path_given


def plannable(config: TrainConfig) -> None:
    """ConfigError for a run whose routing a plan cannot know (update.routing=auto)."""
    if config.update.routing is not Routing.prefix:
        raise ConfigError(
            f"update.routing={config.update.routing} routes each segment by a cosine measured during the run, which "
            "a plan cannot know: plan with update.routing=prefix and a share, e.g. update.jagg_frac=0.6 (the paper's)"
        )


def _fill_missing(node: DictConfig) -> None:
    """Set every "???" value under ``node`` to NOT_READ (interpolations to them then resolve too)."""
    for key in map(str, node.keys()):
        if OmegaConf.is_missing(node, key):
            node[key] = NOT_READ
        elif not OmegaConf.is_interpolation(node, key) and isinstance(node[key], DictConfig):
            _fill_missing(node[key])


def arch_folder(cfg: PlanRunConfig, model_path_given: bool) -> Path:
    """Where the architecture configs are read: plan.arch, else model.path, else the shipped ones."""
    if cfg.plan.arch is not None:
        folder, field_name = Path(cfg.plan.arch), "plan.arch"
    elif model_path_given:
        folder, field_name = Path(cfg.model.path), "model.path"
    elif cfg.model.name in SHIPPED_ARCH:
        folder, field_name = ARCH_ROOT / SHIPPED_ARCH[cfg.model.name], "model.name"
    else:
        raise ConfigError(
            f"model.name={cfg.model.name!r} has no shipped architecture (shipped: {sorted(SHIPPED_ARCH)}); "
            "pass plan.arch=<folder with transformer/config.json, vae/config.json, ...> or model.path"
        )
    if not (folder / "transformer" / "config.json").is_file():
        raise ConfigError(
            f"{field_name}={str(folder)!r} holds no transformer/config.json; point it at a diffusers folder"
        )
    return folder


def plan(cfg: PlanRunConfig, *, model_path_given: bool = False) -> PlanReport:
    """Trace one training step of ``cfg`` on rank 0 of plan.world_size fake ranks (module docstring)."""
    started = time.perf_counter()
    check_mesh(cfg, cfg.plan.world_size)
    arch = arch_folder(cfg, model_path_given)
    progress(f"tracing one training step of experiment={cfg.experiment} on fake tensors (the frozen models first)")
    frozen = frozen_models(cfg, arch)
    segments = expected_segments(cfg)
    traced, updates = trace(cfg, arch, segments)
    frozen_bytes = sum(m.num_bytes for m in frozen)
    for phase in [*traced.phases, *updates]:
        phase.peak_bytes += frozen_bytes
    report = plan_report(cfg, arch, frozen, segments, traced, updates)
    return replace(with_estimates(report, cfg, traced, updates), seconds=time.perf_counter() - started)


def trace(cfg: PlanRunConfig, arch: Path, segments: dict[UpdateMode, float]) -> tuple[Traced, list[Phase]]:
    """The step traced on fake ranks and fake tensors, and its update calls with activation checkpointing as
    configured and flipped: at full depth, or at a few blocks of each kind extended to it (plan.depth)."""
    full = full_depths(arch)
    if cfg.plan.depth is Depth.full or not traced_depths(full):
        return trace_full(cfg, arch, segments)

    def trace_at(depths: dict[str, int]) -> tuple[Traced, list[Phase]]:
        progress(f"tracing the transformer with {depths} blocks, to extend to {full} (plan.depth=extended)")
        with cut_arch(arch, depths) as folder:
            traced, updates = trace_full(cfg, folder, segments)
        return replace(traced, tensors=StepTensors()), updates  # the tensors are the cut model's, not extended

    return extended(full, trace_at)


def trace_full(cfg: PlanRunConfig, arch: Path, segments: dict[UpdateMode, float]) -> tuple[Traced, list[Phase]]:
    """The step traced with every block of ``arch``'s transformer."""
    # setup_trainable filters FSDP2's warning about blocks that return views (train/parts/policy/builder.py),
    # for the duration of the trace
    with fake_process_group(cfg.plan.world_size, cfg.dist.replicate_degree), fake_tensors(), warnings.catch_warnings():
        traced = trace_step(traced_run(cfg, arch), segments)
        updates = traced.updates + trace_other_checkpointing(cfg, arch, traced.tensors, segments)
    return traced, updates


def shared_update_flops(cfg: PlanRunConfig, updates: list[Phase]) -> float:
    """FLOPs per rank and step the shared start saves in the update: the rows whose first trainable step it runs
    once per group, at the exact path's FLOPs per step and row."""
    exact = next(
        u for u in updates if u.mode == UpdateMode.exact and u.checkpointing == cfg.model.activation_checkpointing
    )
    per_row = exact.flops / (cfg.update.segment_length * cfg.batch.micro_batch)  # one step of one row, with backward
    return expected_shared_rows(cfg) * per_row


def plan_report(
    cfg: PlanRunConfig,
    arch: Path,
    frozen: list[FrozenModel],
    segments: dict[UpdateMode, float],
    traced: Traced,
    updates: list[Phase],
) -> PlanReport:
    """What the trace found: the run, its memory per rank, its phases (their peaks with the frozen models added)."""
    at = traced.at_step
    # FLOPs of each reward model's forward on one image and prompt, where the planner counted them
    scorer_flops = {m.name: m.flops for m in frozen if m.role == "reward" and m.flops is not None}
    return PlanReport(
        experiment=cfg.experiment,
        backbone=cfg.model.name,
        arch=str(arch),
        world_size=cfg.plan.world_size,
        gpu_memory_gib=cfg.plan.gpu_memory_gib,
        reserved_gib=cfg.plan.reserved_gib,
        num_params=traced.num_params,
        num_trainable=traced.num_trainable,
        lora=cfg.model.lora.enabled,
        checkpointing=cfg.model.activation_checkpointing,
        image_tokens=traced.image_tokens,
        text_tokens=text_tokens(cfg),
        samples_per_rank=cfg.grpo.group_size * cfg.batch.prompts_per_rank,
        decode_batch=cfg.model.decode_batch,
        micro_batch=cfg.batch.micro_batch,
        segments=segments,
        param_bytes=at.get("Sharded Param", 0),
        grad_bytes=at.get("Sharded Grad", 0),
        optimizer_bytes=at.get("OptState", 0),
        reference_bytes=traced.reference_bytes,
        ema_bytes=traced.ema_bytes,
        step_tensor_bytes=traced.step_tensor_bytes,
        velocity_bytes=traced.velocity_bytes,
        frozen=frozen,
        phases=traced.phases,
        updates=updates,
        reward=reward_timing(cfg, scorer_flops, cfg.plan.served_reward_seconds),
    )


def with_estimates(report: PlanReport, cfg: PlanRunConfig, traced: Traced, updates: list[Phase]) -> PlanReport:
    """``report`` with what the shared start saves and adds, and the inputs of the communication and time
    estimate."""
    peak, source = assumed_peak(cfg)
    return replace(
        report,
        shared_rollout_flops=traced.shared_rollout_flops,
        post_window_flops=traced.post_window_flops,
        shared_update_flops=shared_update_flops(cfg, updates),
        shared_calls=expected_shared_calls(cfg),
        shared_calls_exact=expected_shared_calls(cfg, UpdateMode.exact),
        replicate=cfg.dist.replicate_degree,
        gpus_per_node=cfg.plan.gpus_per_node,
        model_bytes=ModelBytes(
            gathered=traced.num_params * parse_dtype(cfg.model.dtype).itemsize, gradients=traced.num_trainable * 4
        ),
        peak_tflops=peak,
        peak_source=source,
        mfu=cfg.plan.mfu,
        intra_gbps=cfg.plan.intra_node_gbps,
        inter_gbps=cfg.plan.inter_node_gbps,
        num_steps=cfg.num_steps,
        evaluation=evaluation(cfg, traced.forward_flops_per_row),
    )


def assumed_peak(cfg: PlanRunConfig) -> tuple[float, str]:
    """(TFLOP/s, where it comes from): perf.peak_tflops when set, else plan.gpu's dense bf16 rate."""
    if cfg.perf.peak_tflops is not None:
        return cfg.perf.peak_tflops, "perf.peak_tflops"
    return GPU_PEAK_TFLOPS[cfg.plan.gpu], f"{cfg.plan.gpu} bf16 dense"


def print_help(flag: str, overrides: list[str]) -> None:
    """What ``@hydra.main`` prints for ``--help`` (``-h``) or ``--hydra-help``. The planner composes with Hydra's
    compose API, whose overrides take no flags (it read ``--help`` as an override it could not parse), so it
    asks Hydra for the text itself: hydra.help of configs/plan.yaml, filled with the planner's settings."""
    from hydra._internal.utils import get_args_parser

    with initialize_config_module(config_module="configs", version_base=None):
        hydra = GlobalHydra.instance().hydra
        assert hydra is not None
        parser = get_args_parser()
        show = hydra.hydra_help if flag == "--hydra-help" else hydra.app_help
        show(config_name="plan", args_parser=parser, args=parser.parse_args(overrides))


def main(argv: Sequence[str] | None = None) -> PlanReport | None:
    """``python -m train.plan [overrides]``: print the plan (and write it to plan.output as JSON); with
    ``--help``, the settings instead. A wrong setting ends the command with one line (train/cli/reporting.py), as
    every command of the trainer does."""
    setup()
    register()
    overrides = list(sys.argv[1:] if argv is None else argv)
    help_flag = next((arg for arg in overrides if arg in HELP_FLAGS), None)
    if flag := next((arg for arg in overrides if arg.startswith("-") and arg not in HELP_FLAGS), None):
        message = f"{flag}: of Hydra's flags the planner takes {', '.join(HELP_FLAGS)} only; the rest are overrides"
        raise SystemExit(report_error(ConfigError(message), PROG))
    try:
        if help_flag is not None:
            print_help(help_flag, [arg for arg in overrides if arg not in HELP_FLAGS])
            return None
        with initialize_config_module(config_module="configs", version_base=None):
            composed = compose(config_name="plan", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as err:
        raise SystemExit(report_error(ConfigError(hydra_message(err)), PROG)) from None
    with reported(PROG):
        cfg, model_path_given = plan_config(composed)
        report = plan(cfg, model_path_given=model_path_given)
        print(format_report(report))
        if cfg.plan.output is not None:
            Path(cfg.plan.output).write_text(json.dumps(asdict(report), indent=2) + "\n")
    return report


def command() -> None:
    """The console script ``jagg-plan``."""
    main()
