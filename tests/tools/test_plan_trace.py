"""python -m train.plan's traces: the real architectures take LoRA and shard on fake tensors; on a tiny Flux the
planner's byte counts are exact and its traced peaks and collectives match the same step on real tensors over
gloo; no update path writes into the views Flux's single blocks return; the rollout's FLOPs follow its schedule."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import warnings
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import torch
from diffusers import FluxTransformer2DModel, QwenImageTransformer2DModel
from plan_configs import config, num_params
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor, Shard
from two_ranks import HELPERS, env, torchrun

from models.base import decode_in_chunks
from models.flux import FluxBackbone
from models.registry import get_backbone_class
from samplers.rollout import rollout
from samplers.schedule import shifted_sigmas
from samplers.window import rollout_forwards
from train.algorithm.jagg import UPDATE_MODES, backward_segment
from train.distributed.parallelize import parallelize
from train.parts.policy.builder import FSDP_VIEW_WARNING
from train.run.build import optimizer_steps_per_step
from train.tools.plan.command import SHIPPED_ARCH, plan
from train.tools.plan.counts import drawn_windows
from train.tools.plan.fake import fake_process_group
from train.tools.plan.fake_run import traced_run
from train.tools.plan.frozen import ARCH_ROOT, build_component, read_json
from train.tools.plan.report import GIB
from train.tools.plan.report_text import format_report
from train.tools.plan.step_calls import EXACT_TRACED_STEPS

REPO = Path(__file__).resolve().parents[2]
TEXT_PARTS = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
TRANSFORMERS = {"flux": FluxTransformer2DModel, "qwenimage": QwenImageTransformer2DModel}
# The real architectures with fewer blocks (full width): the same module names, shapes and sharding.
PARTIAL = {"flux": {"num_layers": 1, "num_single_layers": 1}, "qwenimage": {"num_layers": 1}}


def partial_arch(name: str, folder: Path) -> Path:
    """configs/arch/<name> in ``folder``, the transformer cut to PARTIAL's block counts."""
    shutil.copytree(ARCH_ROOT / SHIPPED_ARCH[name], folder)
    path = folder / "transformer" / "config.json"
    path.write_text(json.dumps(read_json(path) | PARTIAL[name]))
    return folder


@pytest.mark.parametrize("experiment", ["flux_dance", "qwenimage_dance"])
def test_real_architecture_takes_lora_and_shards_on_8_fake_ranks(experiment, tmp_path):
    """The trainer's own setup (train.parts.policy.builder.setup_trainable: peft LoRA on the adapter's target modules,
    activation checkpointing, FSDP2 per block and root) on the real architecture, cut to one block
    of each kind: every LoRA target names modules of it, every parameter is sharded over 8 ranks."""
    cfg, _ = config([f"experiment={experiment}", "model.lora.enabled=true"])
    arch = partial_arch(cfg.model.name, tmp_path / "arch")
    targets = get_backbone_class(cfg.model.name).lora_target_modules
    with torch.device("meta"):
        base = num_params(
            build_component(TRANSFORMERS[cfg.model.name], read_json(arch / "transformer" / "config.json"))
        )
    with fake_process_group(8), FakeTensorMode(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=FSDP_VIEW_WARNING)
        run = traced_run(cfg, arch)
        model = run.backbone.transformer
        names = [n for n, _ in model.named_modules()]
        for target in targets:  # peft matches a target by module-name suffix; each must name real modules
            assert any(n.endswith("." + target) for n in names), target
        params = dict(model.named_parameters())
        for p in params.values():
            assert isinstance(p, DTensor) and p.placements == (Shard(0),) and p.device_mesh.size() == 8
        trained = {n for n, p in params.items() if p.requires_grad}
        assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
        assert {id(p) for p in run.params} == {id(params[n]) for n in trained}
        assert sum(p.numel() for p in params.values() if not p.requires_grad) == base  # global sizes


# ---- the planner on a tiny Flux ------------------------------------------------------------------

TINY = [
    "experiment=tiny",
    "model.build_tiny=null",
    "grpo.group_size=2",
    "batch.prompts_per_rank=1",
    "batch.micro_batch=1",
    "batch.gradient_accumulation_steps=1",  # 2 optimizer steps: the second micro-batch's jagg segment recomputes
    "update.jagg_frac=0.5",  # 2 segments: one jagg, one exact
    "grpo.kl_beta=0.1",  # full fine-tuning with a KL reference copy
    "ema.decay=0.9",
    "plan.world_size=2",
]
PHASES = {"rollout", "decode", "update exact", "update jagg, rollout velocities", "update jagg", "optimizer"}


@pytest.fixture(scope="module")
def tiny(tiny_flux_dir, tmp_path_factory):
    """(config, the planner's report of TINY, rank 0's traced peaks and collectives of the same step on
    real tensors over 2 gloo processes): tests/helpers/plan_worker.py runs while this process routes."""
    overrides = [*TINY, f"model.path={tiny_flux_dir}"]
    out = tmp_path_factory.mktemp("real_run")
    worker = subprocess.Popen(
        torchrun(str(HELPERS / "plan_worker.py"), str(out), *overrides),
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        cfg, given = config(overrides)
        report = plan(cfg, model_path_given=given)
    finally:
        stdout, stderr = worker.communicate(timeout=600)
    assert worker.returncode == 0, f"torchrun failed:\n{stdout[-3000:]}\n{stderr[-5000:]}"
    real = {name: json.loads((out / f"real_{name}.json").read_text()) for name in ("peaks", "collectives")}
    return cfg, report, real


@pytest.mark.slow
def test_planner_bytes_equal_the_analytic_count(tiny):
    """FSDP2 pads dim 0 of every parameter to a multiple of the world size: rank 0 holds
    ceil(dim0 / ws) rows. Gradients and AdamW's two moments are float32 like the shards; AdamW adds
    one float32 step counter per parameter. The KL reference copy and the EMA are sharded the same way."""
    cfg, report, _ = tiny
    ws = cfg.plan.world_size
    model = build_component(FluxTransformer2DModel, read_json(Path(cfg.model.path) / "transformer" / "config.json"))
    shards = [math.ceil(p.shape[0] / ws) * math.prod(p.shape[1:]) * 4 for p in model.parameters()]
    assert report.param_bytes == sum(shards)
    assert report.grad_bytes == sum(shards)
    assert report.optimizer_bytes == 2 * sum(shards) + 4 * len(shards)
    assert report.reference_bytes == report.ema_bytes == sum(shards)
    assert report.num_params == report.num_trainable == num_params(model)


@pytest.mark.slow
def test_hsdp_shards_over_one_replica(tiny_flux_dir):
    """dist.replicate_degree=2 on 4 ranks: each parameter is sharded over the 2 ranks of a replica, so
    rank 0 holds ceil(dim0 / 2) rows of it, twice what FSDP over all 4 leaves it."""
    overrides = [*TINY, f"model.path={tiny_flux_dir}", "plan.world_size=4", "grpo.kl_beta=0", "ema.decay=0"]
    model = build_component(FluxTransformer2DModel, read_json(tiny_flux_dir / "transformer" / "config.json"))
    for replicate, shard in ((2, 2), (1, 4)):
        cfg, given = config([*overrides, f"dist.replicate_degree={replicate}"])
        report = plan(cfg, model_path_given=given)
        assert report.param_bytes == sum(
            math.ceil(p.shape[0] / shard) * math.prod(p.shape[1:]) * 4 for p in model.parameters()
        )


@pytest.mark.slow
def test_traced_peaks_match_a_real_gloo_run(tiny):
    """The same phases on real tensors over 2 gloo processes (tests/helpers/plan_worker.py) give rank 0 the
    same peaks within 1%; measured here: equal to the byte, as fake tensors carry the storage sizes
    of the real kernels' outputs."""
    _, report, real_run = tiny
    real = real_run["peaks"]
    # exact_batched is traced for its memory in any case, though this run makes no call of it; the real run
    # traces the configured checkpointing only (the report also holds the other one's updates, of the same names)
    planned = {p.name: p.peak_bytes - report.frozen_bytes for p in [*report.phases, *report.configured_updates()]}
    assert set(planned) == set(real) == PHASES | {"update exact_batched"}
    for name, value in real.items():
        assert planned[name] == pytest.approx(value, rel=0.01), name


@pytest.mark.slow
def test_every_update_call_is_traced_with_its_flops(tiny):
    """The KL reference's batched call over W steps and W policy forwards (exact) > the middle
    forward and both endpoints (jagg) > the endpoints alone on the rollout's velocities; each once per
    step here (one exact and one jagg segment per micro-batch, the first of 2 micro-batches on the
    rollout's velocities); the rollout runs every one of its 9 steps."""
    cfg, report, _ = tiny
    assert {u.name for u in report.updates} == PHASES - {"rollout", "decode", "optimizer"} | {"update exact_batched"}
    assert {u.checkpointing for u in report.updates} == {False, True}
    flops = {u.name: u.flops for u in report.configured_updates()}
    assert flops["update exact"] > flops["update jagg"] > flops["update jagg, rollout velocities"] > 0
    assert {u.name: u.calls_per_step for u in report.configured_updates()} == {
        "update exact": 2,
        "update exact_batched": 0,  # traced for its memory: update.exact_batched is off
        "update jagg, rollout velocities": 1,
        "update jagg": 1,
    }
    rollout = next(p for p in report.phases if p.name == "rollout")
    middle = flops["update jagg"] - flops["update jagg, rollout velocities"]  # one forward of 2 rows (2 steps of 1)
    # 9 forwards of 2 rows, the first (the shared start) of one row: 17 rows, and the row it saves
    assert rollout.flops == pytest.approx(8.5 * middle, rel=0.01)
    assert report.shared_rollout_flops == pytest.approx(0.5 * middle, rel=0.01)
    assert report.shared_update_flops == 0  # micro-batches of 1, each its own optimizer step: nothing shared


@pytest.mark.slow
def test_two_update_passes_count_every_call_and_optimizer_step_twice(tiny_flux_dir):
    """TINY with grpo.inner_epochs=2: the planned step holds both passes' update calls (per pass 2 micro-batches of
    one exact and one jagg segment, each micro-batch its own optimizer step) and optimizer steps, the rollout and
    the decode once. One pass plans 2 exact calls, 1 jagg call on the rollout's velocities, 1 jagg call and 2
    optimizer steps (test_every_update_call_is_traced_with_its_flops); two plan 4, the same 1 (fresh velocities
    serve until the first optimizer step moves the weights), 3 and 4, the update's FLOPs per step those calls'."""
    cfg, given = config([*TINY, f"model.path={tiny_flux_dir}", "grpo.inner_epochs=2"])
    report = plan(cfg, model_path_given=given)
    calls = {p.name: p.calls_per_step for p in report.step_phases()}
    assert calls == {
        "rollout": 1,
        "decode": 1,
        "optimizer": 4,
        "update exact": 4,
        "update jagg, rollout velocities": 1,
        "update jagg": 3,
    }
    assert calls["optimizer"] == optimizer_steps_per_step(cfg)
    update, _ = report.flops_per_step(shared=False)
    assert update == sum(calls[u.name] * u.flops for u in report.configured_updates() if u.name in calls)


@pytest.mark.slow
def test_forwards_and_backwards_follow_the_paths(tiny):
    """Per call: exact runs W forwards with gradients (each with its backward) and the KL reference's one
    batched call; jagg one batched endpoint forward and one backward, the middle steps' no-grad forward
    unless the rollout's velocities serve, and the reference call; so jagg's update sends fewer bytes."""
    cfg, report, _ = tiny
    w = cfg.update.segment_length
    calls = {u.name: (u.forwards, u.backwards) for u in report.configured_updates()}
    assert calls["update exact"] == (w + 1, w)
    assert calls["update jagg, rollout velocities"] == (2, 1)
    assert calls["update jagg"] == (3, 1)
    rollout = next(p for p in report.phases if p.name == "rollout")
    assert (rollout.forwards, rollout.backwards) == (cfg.sampler.num_steps, 0)
    routed, exact = report.update_traffic(), report.update_traffic(exact=True)
    assert 0 < routed.total < exact.total
    model = report.model_bytes
    assert model.gathered == report.num_params * 4  # the tiny run computes in float32
    assert model.gradients == report.num_trainable * 4


@pytest.mark.slow
def test_planned_collectives_match_a_real_gloo_run(tiny):
    """The planner's rule (every forward all-gathers every FSDP module's parameters once, every backward
    again and reduce-scatters their gradients) against the collectives each traced call issued over 2
    gloo ranks: as many all-gathers and reduce-scatters, and as many unsharded bytes (FSDP2 pads each
    parameter's dim 0 to a multiple of the world size: 0.2% more here, measured). The exact path is
    traced on its first EXACT_TRACED_STEPS steps, the rollout on the first forward of each shape; the
    optimizer step's gradient norm is an all-reduce."""
    cfg, report, real_run = tiny
    real, n = real_run["collectives"]["phases"], real_run["collectives"]["fsdp_modules"]
    assert n == 3  # the tiny Flux's one double and one single block, and the root
    model = report.model_bytes
    rollout = next(p for p in report.phases if p.name == "rollout")
    assert (rollout.forwards, rollout.backwards) == (cfg.sampler.num_steps, 0)
    for p in [*report.phases, *report.configured_updates()]:
        backwards = p.backwards * (EXACT_TRACED_STEPS / cfg.update.segment_length if p.mode == "exact" else 1)
        forwards = p.forwards - p.backwards + backwards
        if p is rollout:  # TracedOnce runs the first forward of each shape: the shared start's row, then 2 rows
            forwards = 2
        r = real[p.name]
        assert (r["all_gathers"], r["reduce_scatters"]) == (n * (forwards + backwards), n * backwards), p.name
        assert r["all_gather_bytes"] == pytest.approx((forwards + backwards) * model.gathered, rel=0.005), p.name
        assert r["reduce_scatter_bytes"] == pytest.approx(backwards * model.gradients, rel=0.005), p.name
    assert real["update jagg"]["all_gathers"] < real["update exact"]["all_gathers"]


@pytest.mark.slow
def test_step_time_is_the_sum_of_its_parts_each_the_longer_term(tiny):
    _, report, _ = tiny
    expected = 0.0
    for _, flops, traffic in report.time_terms():
        compute = flops / (report.peak_tflops * 1e12 * report.mfu)
        comm = traffic.intra * 8 / (report.intra_gbps * 1e9) + traffic.inter * 8 / (report.inter_gbps * 1e9)
        expected += max(compute, comm)
    assert report.step_seconds() == pytest.approx(expected, rel=1e-12)
    assert report.run_seconds() == pytest.approx(report.num_steps * expected + report.evaluation_seconds())


@pytest.mark.slow
def test_report_ends_with_the_summary_line(tiny):
    cfg, report, _ = tiny
    text = format_report(report)
    assert text.splitlines()[-1] == f"peak per rank {report.peak.peak_bytes / GIB:.1f} GiB of 80 GiB: fits"
    report = replace(report, gpu_memory_gib=1e-4, reserved_gib=0.0)
    lines = format_report(report).splitlines()
    assert lines[-1].endswith(": does not fit")
    assert any(line.startswith("does not fit: ") for line in lines)
    assert any("model.lora.enabled=true" in line for line in lines)  # full fine-tuning: LoRA is advised


# ---- FluxSingleTransformerBlock returns views ---------------------------------------------------


def tiny_backbone(path: Path) -> FluxBackbone:
    return FluxBackbone.load(path, dtype=torch.float32, skip=TEXT_PARTS, max_sequence_length=8)


def record_versions(outputs: list, module, inputs, out) -> None:
    outputs.extend((t, t._version) for t in out)


def test_no_path_writes_into_the_views_single_blocks_return(tiny_flux_dir):
    """FSDP2 warns that FluxSingleTransformerBlock returns views: an in-place op on one would skip
    its pre-backward all-gather. Every update path, with and without activation checkpointing,
    through the adapter's predict on a 2-rank FSDP2 model: the outputs' version counters (bumped by
    any in-place op on a tensor or a view of it) never move."""
    backbone = tiny_backbone(tiny_flux_dir)
    config_ = backbone.configs["transformer"]
    cond = backbone.conditioning_class(
        prompt_embeds=torch.randn(1, 8, config_["joint_attention_dim"]),
        pooled=torch.randn(1, config_["pooled_projection_dim"]),
    )
    z = [torch.randn(1, 2, 2, config_["in_channels"]) for _ in range(4)]

    def policy(z_b, t_b):
        return backbone.predict(z_b, t_b, type(cond).cat([cond] * z_b.shape[0]))

    for checkpointing in (False, True):
        outputs = []
        with fake_process_group(2), pytest.warns(UserWarning, match=FSDP_VIEW_WARNING):
            backbone.transformer = build_component(FluxTransformer2DModel, config_)
            parallelize(
                backbone.transformer,
                block_classes=backbone.block_classes,
                param_dtype=torch.float32,
                activation_checkpointing=checkpointing,
            )
            for block in backbone.transformer.single_transformer_blocks:
                block.register_forward_hook(partial(record_versions, outputs))
            for mode in UPDATE_MODES:
                backward_segment(mode, policy, lambda j, v: (v.pow(2).mean(), {}), z, torch.linspace(1.0, 0.4, 4))
        assert outputs and all(t._version == version for t, version in outputs)


def test_decode_in_chunks_equals_one_call(tiny_flux_dir):
    backbone = tiny_backbone(tiny_flux_dir)
    z = backbone.initial_noise(5, height=32, width=32, generator=torch.Generator().manual_seed(0))
    whole = decode_in_chunks(backbone, z, rows=0)
    torch.testing.assert_close(decode_in_chunks(backbone, z, rows=2), whole, atol=1e-5, rtol=1e-5)


def test_rollout_flops_follow_the_schedule_after_the_window(tiny_flux_dir):
    """With DPM-Solver++ 2M on 0.4 of the steps after a window of 4 drawn in [0, 8) of 9, the planner counts the
    rows the rollout itself runs, expected over the 5 windows the run draws alike: at [0, 4) 6 forwards per
    sample instead of 9, the shared start's first step once per group; what the compression saves is the
    forwards after each window that the rebuilt schedule leaves out, at the same FLOPs per row."""
    flash = ["sampler=flow_fast", "sampler.sde_window_size=4", "sampler.sde_window_range=[0,8]"]
    flash += ["sampler.post_window.solver=dpmpp_2m", "sampler.post_window.ratio=0.4", "update.segment_length=4"]
    cfg, given = config([*TINY, f"model.path={tiny_flux_dir}", *flash])
    report = plan(cfg, model_path_given=given)
    backbone = FluxBackbone.load(tiny_flux_dir, dtype="float32")
    cond = backbone.encode(["a cat"]).repeat(2)
    noise = backbone.initial_noise(1, height=cfg.model.height, width=cfg.model.width).repeat_interleave(2, dim=0)
    sampler, sigmas = cfg.sampler, shifted_sigmas(cfg.sampler.num_steps, cfg.sampler.shift)
    windows = drawn_windows(cfg)
    assert windows == {(start, start + 4): pytest.approx(1 / 5) for start in range(5)}
    rows: dict[tuple[int, int], list[int]] = {}
    for window in windows:

        def counted(z, t, c, window=window):
            rows.setdefault(window, []).append(z.shape[0])
            return backbone.predict(z, t, c)

        rollout(counted, cond, noise, sampler, sigmas=sigmas, sde_window=window, group_size=2)
        assert len(rows[window]) == rollout_forwards(sampler, window)
    assert rows[(0, 4)] == [1] + [2] * 5  # the shared start's step on one row, then 3 window steps and 2 after it
    phase = next(p for p in report.phases if p.name == "rollout")
    mean_rows = sum(sum(r) for r in rows.values()) / 5
    mean_forwards = sum(len(r) for r in rows.values()) / 5
    assert phase.forwards == pytest.approx(mean_forwards, rel=1e-9)
    per_row = phase.flops / mean_rows
    assert report.post_window_flops == pytest.approx(per_row * 2 * (9 - mean_forwards), rel=1e-6)
    assert report.shared_rollout_flops == pytest.approx(per_row * (2 * mean_forwards - mean_rows), rel=1e-6)
    assert "after the SDE window (sampler.post_window) the rollout is" in format_report(report)
    # the reference trainers' step: every segment exact, no shared start, every row on all 9 steps
    exact_update, _ = report.flops_per_step(exact=True, shared=False)
    others = sum(p.calls_per_step * p.flops for p in report.phases if p is not phase)
    rollout_all = per_row * 2 * 9 * phase.calls_per_step
    assert report.reference_step_flops() == pytest.approx(exact_update + others + rollout_all, rel=1e-6)
    assert "the step as the reference trainers run it" in format_report(report)
