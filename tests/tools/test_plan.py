"""python -m train.plan without tracing: the real architectures and frozen models are counted from their configs,
the update's calls and the shared start as the update loop makes them, bad settings, communication and time by
hand, the SDE windows a run draws, the reward stage, and plan.depth=extended against the full trace."""

from __future__ import annotations

import inspect
import json
import shutil
from dataclasses import replace

import pytest
import torch
from diffusers import FluxTransformer2DModel, QwenImageTransformer2DModel
from plan_configs import config, num_params
from probe_toys import ToyVelocity, toy_trajectory

from rewards.base import SCORER_NAMES, FrozenModelScorer, scorer_class
from train.algorithm.jagg import Counts
from train.algorithm.routing import build_router
from train.algorithm.update import UpdateBatch, shared_start, update_micro_batch
from train.loop.passes import micro_batches, pass_order
from train.tools.plan.comm import Cluster, ModelBytes, Traffic, phase_seconds
from train.tools.plan.command import SHIPPED_ARCH, main, plan
from train.tools.plan.counts import (
    drawn_windows,
    expected_segments,
    expected_shared_calls,
    expected_shared_rows,
    update_variants,
)
from train.tools.plan.depth import extended, traced_depths
from train.tools.plan.frozen import (
    ARCH_ROOT,
    NOT_READ,
    SCORER_ARCH,
    build_component,
    frozen_models,
    read_json,
    scorer_module,
)
from train.tools.plan.report import Phase, PlanReport
from train.tools.plan.reward import RewardTiming, reward_timing, scorer_flops


def real_transformer(name: str) -> dict:
    return read_json(ARCH_ROOT / SHIPPED_ARCH[name] / "transformer" / "config.json")


def test_shipped_architectures_are_the_released_models():
    """The shipped configs are diffusers' defaults for both classes (which describe the released
    models) except Flux-dev's guidance embedding; the parameter counts are the published 11.9 B and 20.4 B."""
    for name, cls, changed in (
        ("flux", FluxTransformer2DModel, {"guidance_embeds": True}),
        ("qwenimage", QwenImageTransformer2DModel, {}),
    ):
        shipped = {k: v for k, v in real_transformer(name).items() if not k.startswith("_")}
        defaults = {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()}
        defaults = {k: list(v) if isinstance(v, tuple) else v for k, v in defaults.items()}
        assert {k: v for k, v in shipped.items() if defaults[k] != v} == changed, name
    with torch.device("meta"):
        flux = build_component(FluxTransformer2DModel, real_transformer("flux"))
        qwen = build_component(QwenImageTransformer2DModel, real_transformer("qwenimage"))
    assert (num_params(flux), num_params(qwen)) == (11_901_408_320, 20_430_401_088)


@pytest.mark.slow
def test_frozen_models_are_counted_from_their_configs():
    """Published sizes: CLIP-L text 123 M, T5-XXL encoder 4.76 B, Qwen2.5-VL-7B 8.29 B, HPSv2.1 and
    PickScore (CLIP ViT-H-14) 986 M, CLIP ViT-L/14 428 M. Text encoders and VAE in model.dtype
    (bfloat16: 2 bytes a parameter), scorers in float32 unless their dtype says otherwise."""
    flux = {(m.role, m.name): m for m in frozen_models(config(["experiment=flux_dance"])[0], ARCH_ROOT / "flux1-dev")}
    expected = {
        ("text encoder", "text_encoder"): (123_060_480, 2),
        ("text encoder", "text_encoder_2"): (4_762_310_656, 2),
        ("VAE", "vae"): (83_819_683, 2),
        ("reward", "hpsv2"): (986_109_441, 4),
        ("reward", "clipscore"): (427_616_513, 4),
        ("eval scorer", "hpsv2"): (986_109_441, 4),
        ("eval scorer", "clipscore"): (427_616_513, 4),
        ("eval scorer", "pickscore"): (986_109_441, 4),
    }
    assert set(flux) == set(expected)  # flux_dance evaluates every 25 steps: its scorers stay loaded
    for key, (count, size) in expected.items():
        assert flux[key].num_params == count, key
        assert flux[key].num_bytes / count == pytest.approx(size, rel=1e-3), key
    cached = ["experiment=qwenimage_dance", "model.embedding_cache=/nowhere", "+reward.components.hpsv2.dtype=bf16"]
    qwen = {(m.role, m.name): m for m in frozen_models(config(cached)[0], ARCH_ROOT / "qwen-image")}
    assert ("text encoder", "text_encoder") not in qwen  # replaced by the cache, which the planner never opens
    assert qwen[("reward", "hpsv2")].num_bytes / 986_109_441 == pytest.approx(2, rel=1e-3)
    qwen = {m.name: m for m in frozen_models(config(["experiment=qwenimage_dance"])[0], ARCH_ROOT / "qwen-image")}
    assert qwen["text_encoder"].num_params == 8_292_166_656


def test_imagereward_is_counted_from_its_med_config(tmp_path):
    """ImageReward v1.0: BLIP's ViT-L/16 and a BERT-base whose layers also cross-attend to the ViT's 1024-wide
    tokens, 446 M parameters; the scorer's own med_config.json, when present, replaces the shipped one."""
    shipped_count = num_params(scorer_module("imagereward", {"med_config": NOT_READ}))
    assert shipped_count == 446_206_689
    fewer = tmp_path / "med_config.json"
    fewer.write_text(json.dumps(read_json(ARCH_ROOT / "imagereward" / "med_config.json") | {"num_hidden_layers": 6}))
    self_attention = 4 * (768 * 768 + 768) + 2 * 768  # q, k, v, out and the LayerNorm
    cross_attention = 2 * (768 * 768 + 768) + 2 * (1024 * 768 + 768) + 2 * 768  # k and v read the ViT's tokens
    feed_forward = (768 * 3072 + 3072) + (3072 * 768 + 768) + 2 * 768
    per_layer = self_attention + cross_attention + feed_forward
    assert num_params(scorer_module("imagereward", {"med_config": str(fewer)})) == shipped_count - 6 * per_layer


def test_every_scorer_has_a_known_architecture():
    """Every scorer built around a frozen model has an architecture; the others weigh nothing."""
    with_weights = {name for name in SCORER_NAMES if issubclass(scorer_class(name), FrozenModelScorer)}
    assert with_weights == set(SCORER_ARCH)
    assert all(scorer_module(name, {}) is None for name in set(SCORER_NAMES) - with_weights)


@pytest.mark.parametrize(
    "experiment, segments",
    [
        ("flux_dance", {"jagg": 3, "exact": 2}),  # 5 segments, jagg_frac 0.6 of M = 20: those ending <= 12
        ("qwenimage_dance", {"jagg": 1.8, "exact": 1.2}),  # 3 of those 5, drawn at random (timestep_fraction 0.6)
        ("flux_flow_fast", {"jagg": 2, "exact": 1}),  # SDE window 0..11, jagg_frac 0.4: segments ending <= 8
        ("qwenimage_flow_fast", {"jagg": 1, "exact": 1}),  # SDE window 4..11
    ],
)
def test_presets_need_no_paths_and_route_as_the_paper(experiment, segments):
    cfg, model_path_given = config([f"experiment={experiment}"])
    assert not model_path_given
    assert expected_segments(cfg) == pytest.approx(segments)
    assert expected_segments(cfg, "exact") == pytest.approx({"exact": sum(segments.values())})


def test_update_calls_follow_velocity_reuse():
    """flux_dance: 96 micro-batches of 1 sample, 3 jagg and 2 exact segments each; fresh velocities serve
    the first 12 samples (one optimizer step), stale ones all; exact needs none, and exact_batched
    (traced for its memory) takes the exact calls when update.exact_batched is on."""
    cfg, _ = config(["experiment=flux_dance"])
    segments = expected_segments(cfg)
    assert update_variants(cfg, segments, kept_velocities=True) == [
        ("exact", False, 192),
        ("exact_batched", False, 0),
        ("jagg", True, 36),
        ("jagg", False, 252),
    ]
    stale = replace(cfg, update=replace(cfg.update, reuse_velocities="stale"))
    assert update_variants(stale, segments, kept_velocities=True)[2:] == [("jagg", True, 288)]
    assert update_variants(cfg, segments, kept_velocities=False)[2:] == [("jagg", False, 288)]
    batched = replace(cfg, update=replace(cfg.update, exact_batched=True))
    assert update_variants(batched, segments, kept_velocities=False)[:2] == [
        ("exact", False, 0),
        ("exact_batched", False, 192),
    ]
    # two passes (grpo.inner_epochs=2): every call twice; fresh velocities still serve the first optimizer step
    # only, stale ones the whole first pass
    twice = replace(cfg, grpo=replace(cfg.grpo, inner_epochs=2))
    assert update_variants(twice, segments, kept_velocities=True) == [
        ("exact", False, 384),
        ("exact_batched", False, 0),
        ("jagg", True, 36),
        ("jagg", False, 540),
    ]
    stale_twice = replace(stale, grpo=replace(cfg.grpo, inner_epochs=2))
    assert update_variants(stale_twice, segments, kept_velocities=True)[2:] == [
        ("jagg", True, 288),
        ("jagg", False, 288),
    ]


@pytest.mark.parametrize(
    "overrides, rows",
    [
        ([], 8 * 11),  # 8 optimizer steps of one whole group of 12, each micro-batch training step 0: 11 rows each
        (["update.share_group_start=false"], 0),
        (["batch.gradient_accumulation_steps=4"], 24 * 3),  # 24 optimizer steps of 4 rows of one group
        (["batch.micro_batch=4"], 8 * 11),  # micro-batches of 4: the same rows share
    ],
)
def test_expected_shared_rows(overrides, rows):
    """flux_dance trains every segment (timestep_fraction 1): per optimizer step, the rows of a group
    that train its first step run one row instead of theirs."""
    cfg, _ = config(["experiment=flux_dance", *overrides])
    assert expected_shared_rows(cfg) == pytest.approx(rows)


def test_expected_shared_rows_over_the_random_pick():
    """qwenimage_dance: 3 of 5 segments per micro-batch of 1 (p = 0.6), 4 micro-batches of one group per
    optimizer step: 4 p rows train step 0, and 1 - (1 - p)^4 of them is the shared row."""
    cfg, _ = config(["experiment=qwenimage_dance"])
    p = 0.6
    assert expected_shared_rows(cfg) == pytest.approx(24 * (4 * p - (1 - (1 - p) ** 4)))


def _update_loop_calls(cfg, traj, *, share: bool, seed: int) -> tuple[int, int]:
    """(transformer forwards, backwards) of one step's update as train/loop/step.py runs it: per pass and optimizer
    step, the micro-batches' routes drawn in order, the shared start, the micro-batches, its backward."""
    policy, reference, forwards = ToyVelocity(), ToyVelocity(seed=1), []
    for model in (policy, reference):
        model.register_forward_pre_hook(lambda *_: forwards.append(1))
    advantages = torch.linspace(-1, 1, traj.batch_size)
    config, g = replace(cfg.update, share_group_start=share), cfg.grpo
    batch = UpdateBatch(traj, advantages, policy, reference, config, g, cfg.batch.gradient_accumulation_steps)
    router, route_gen, counts = build_router(cfg.update), torch.Generator().manual_seed(seed), Counts()
    for number in range(g.inner_epochs):  # each pass in the order of step 0's
        order = pass_order(cfg.seed, 0, number, traj.batch_size)
        for chunk in range(0, traj.batch_size, cfg.batch.gradient_accumulation_steps):
            micro = micro_batches(cfg, order, chunk)
            routes = [router.route(traj, route_gen) for _ in micro]
            start = shared_start(batch, micro, routes)
            for rows, routed in zip(micro, routes):
                counts += update_micro_batch(batch, torch.tensor(rows), routed, start=start).counts
            if start is not None:
                counts += start.backward().counts
    return len(forwards), counts.backward_calls  # backward_calls counts calls (its forwards count steps)


SHARED_CALL_CASES = {  # overrides of the tiny experiment (8 rows: 2 groups of G = 4; 2 segments of W = 4)
    "exact, micro-batch 1": ["update.mode=exact", "batch.micro_batch=1"],
    "jagg_sequential, KL, accumulation 2": [
        "update.mode=jagg_sequential", "batch.micro_batch=1", "batch.gradient_accumulation_steps=2", "grpo.kl_beta=0.1"
    ],
    "exact_batched": ["update.mode=exact", "update.exact_batched=true", "batch.micro_batch=1"],
    "jagg and exact, micro-batch 2, one optimizer step": [
        "update.mode=jagg", "update.jagg_frac=0.5", "batch.micro_batch=2", "batch.gradient_accumulation_steps=8"
    ],
    "exact, random pick": ["update.mode=exact", "batch.micro_batch=1", "update.timestep_fraction=0.5"],
    "exact, two passes, accumulation 4": [
        "update.mode=exact", "batch.micro_batch=1", "batch.gradient_accumulation_steps=4", "grpo.inner_epochs=2"
    ],
    "jagg_sequential, random pick, KL": [
        "update.mode=jagg_sequential", "batch.micro_batch=1", "update.timestep_fraction=0.5", "grpo.kl_beta=0.1",
    ],
}  # fmt: skip


@pytest.mark.parametrize("case", list(SHARED_CALL_CASES))
def test_expected_shared_calls_equal_the_update_loop(case):
    """The planner's count of what the shared start adds to the update's transformer calls (its own forward,
    backward and KL reference call per optimizer step that shares, less the step each exact and
    jagg_sequential micro-batch leaves to it) against the calls the trainer's update loop makes with
    update.share_group_start on and off on the same draws: equal where every segment trains
    (timestep_fraction 1); where segments are picked at random, the mean over 150 draws within 4 of its
    standard errors of the expectation (a path counted wrongly is off by about 1 call per micro-batch)."""
    cfg, _ = config(["experiment=tiny", *SHARED_CALL_CASES[case]])
    traj = toy_trajectory(ToyVelocity(), batch=cfg.grpo.group_size * cfg.batch.prompts_per_rank,
                          num_steps=cfg.sampler.num_steps)  # fmt: skip
    draws = 1 if cfg.update.timestep_fraction == 1 else 150
    diffs = torch.zeros(draws, 2, dtype=torch.float64)
    for seed in range(draws):
        on = _update_loop_calls(cfg, traj, share=True, seed=seed)
        off = _update_loop_calls(cfg, traj, share=False, seed=seed)
        diffs[seed] = torch.tensor(on) - torch.tensor(off)
    expected = torch.tensor(expected_shared_calls(cfg), dtype=torch.float64)
    if draws == 1:
        assert diffs[0].tolist() == expected.tolist()
    else:
        error = diffs.std(dim=0) / draws**0.5
        assert bool((error > 0).all()) and bool(((diffs.mean(dim=0) - expected).abs() < 4 * error).all())


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["update.routing=auto"], "update.routing=auto"),
        (["plan.world_size=1"], "plan.world_size"),
        (["plan.reserved_gib=90"], "plan.reserved_gib"),
        (["model.decode_batch=-1"], "model.decode_batch"),
        (["plan.arch=/nowhere"], "plan.arch"),
        (["plan.world_size=8", "dist.replicate_degree=3"], "dist.replicate_degree=3 must divide the world size 8"),
        (["plan.gpus_per_node=0"], "plan.gpus_per_node"),
        (["plan.world_size=12"], "plan.world_size=12 fills no whole nodes of plan.gpus_per_node=8"),
        (["plan.inter_node_gbps=0"], "plan.inter_node_gbps"),
        (["plan.intra_node_gbps=-1"], "plan.intra_node_gbps"),
        (["plan.gpu=X100"], "plan.gpu='X100'"),
        (["plan.mfu=1.5"], "plan.mfu"),
    ],
)
def test_bad_settings_fail_before_tracing(overrides, message):
    with pytest.raises(ValueError, match=message):
        cfg, given = config(["experiment=flux_dance", *overrides])
        plan(cfg, model_path_given=given)


# ---- communication and time (train/tools/plan/comm.py), by hand -----------------------------------------

GATHERED, GRADIENTS = 6e9, 1e8  # bytes of one all-gather of every parameter; of the trained gradients


def test_fsdp_on_one_node_sends_everything_inside_it():
    """2 ranks: a forward all-gathers half the parameters' bytes from each rank, a backward that again and
    half the gradients' reduce-scatter; nothing crosses nodes."""
    cluster, model = Cluster(2, 1, 8), ModelBytes(GATHERED, GRADIENTS)
    assert model.forward(cluster) == Traffic(all_gather=GATHERED / 2, intra=GATHERED / 2)
    backward = Traffic(all_gather=GATHERED / 2, reduce_scatter=GRADIENTS / 2, intra=(GATHERED + GRADIENTS) / 2)
    assert model.backward(cluster) == backward
    assert model.call(cluster, forwards=3, backwards=1) == model.forward(cluster) * 3 + backward


def test_hsdp_crosses_nodes_only_with_the_gradients_all_reduce():
    """4 ranks on 2 nodes of 2, R = 2: the shard groups are the nodes; the replica group {0, 2} all-reduces
    rank 0's shard (a half of the gradients): 2 (2 - 1) / 2 of it across nodes."""
    cluster, model = Cluster(4, 2, 2), ModelBytes(GATHERED, GRADIENTS)
    assert model.forward(cluster).inter == 0
    backward = model.backward(cluster)
    assert backward.all_reduce == backward.inter == GRADIENTS / 2
    assert backward.intra == (GATHERED + GRADIENTS) / 2


def test_fsdp_across_nodes_gathers_across_them():
    """4 ranks on 2 nodes of 2, R = 1: every ring spans both nodes: 3 / 4 of each size, all of it across."""
    cluster, model = Cluster(4, 1, 2), ModelBytes(GATHERED, GRADIENTS)
    assert model.forward(cluster) == Traffic(all_gather=0.75 * GATHERED, inter=0.75 * GATHERED)
    backward = model.backward(cluster)
    assert backward.intra == 0 and backward.all_reduce == 0
    assert backward.inter == pytest.approx(0.75 * (GATHERED + GRADIENTS), rel=1e-12)


def test_a_phase_takes_the_longer_of_compute_and_communication():
    """10 PFLOP at 0.5 of 1000 TFLOP/s: 20 s; 1000 GB in a node at 800 Gb/s (10 s) and 10 GB across at
    8 Gb/s (10 s): 20 s of communication; the phase takes the longer."""
    traffic = Traffic(intra=1000e9, inter=10e9)
    assert traffic.seconds(800, 8) == pytest.approx(20)
    assert phase_seconds(10e15, traffic, tflops=1000, mfu=0.5, intra=800, inter=8) == pytest.approx(20)
    assert phase_seconds(20e15, traffic, tflops=1000, mfu=0.5, intra=800, inter=8) == pytest.approx(40)
    assert phase_seconds(1e15, traffic, tflops=1000, mfu=0.5, intra=800, inter=8) == pytest.approx(20)


@pytest.mark.parametrize(
    "overrides, starts",
    [
        (["experiment=flux_mix"], {start: 25 for start in range(12)}),  # 300 steps, 25 per start: 0..11
        (["experiment=flux_mix_flash"], {start: 20 for start in range(15)}),  # 20 per start
        (["experiment=flux_mix", "num_steps=600"], {start: 25 + 25 * (start <= 2) for start in range(21)}),  # wraps
        (["experiment=flux_flow_fast"], {0: 1}),  # the fixed window [0, 12)
        (["experiment=flux_mix", "sampler.sde_window_schedule=random"], {start: 1 for start in range(21)}),
    ],
)
def test_the_planned_windows_are_those_the_run_draws(overrides, starts):
    cfg, _ = config(overrides)
    total = sum(starts.values())
    size = cfg.sampler.sde_window_size
    expected = {(start, start + size): pytest.approx(n / total) for start, n in starts.items()}
    assert drawn_windows(cfg) == expected


# ---- the reward stage --------------------------------------------------------------------------------


def test_served_scoring_hides_behind_the_next_chunks_rollout():
    # 4 chunks; a rollout of 8 s is 2 s a chunk. A served answer of 3 s: the first 3 chunks' answers each hide 2 s
    # behind the next chunk's rollout (6 s), the rest is exposed: 2 s of local scoring + 4 x 3 - 6 = 8 s.
    stage = RewardTiming(chunks=4, local=("jpeg_compressibility",), served=("remote",), local_flops=0.0,
                        served_seconds=3.0, source="plan.served_reward_seconds")  # fmt: skip
    assert stage.split(2.0, 8.0) == pytest.approx((8.0, 6.0), rel=1e-12)
    # an answer faster than a chunk's rollout: only the last chunk's is exposed, 2 + 1
    assert replace(stage, served_seconds=1.0).split(2.0, 8.0) == pytest.approx((3.0, 3.0), rel=1e-12)
    # one chunk (reward.chunk_groups=0): everything is exposed
    assert replace(stage, chunks=1).split(2.0, 8.0) == pytest.approx((5.0, 0.0), rel=1e-12)
    # the preflight's measurement of the local scorers replaces the planner's estimate
    assert replace(stage, chunks=1, local_seconds=0.5).split(2.0, 8.0) == pytest.approx((3.5, 0.0), rel=1e-12)


def test_the_reward_stage_of_a_run_with_a_served_scorer(monkeypatch):
    monkeypatch.setattr(scorer_class("remote"), "runs_remotely", True, raising=False)
    cfg, _ = config(
        ["experiment=flux_dance", "+reward.components.remote.url=http://127.0.0.1:1", "plan.served_reward_seconds=5"]
    )
    cfg.reward.chunk_groups = 3  # type: ignore[attr-defined]  # the chunked rollout's setting, 8 prompts a rank
    stage = reward_timing(cfg, {"hpsv2": 10.0, "clipscore": 1.0}, cfg.plan.served_reward_seconds)
    assert stage.chunks == 3 and stage.served == ("remote",) and set(stage.local) == {"hpsv2", "clipscore"}
    assert stage.local_flops == pytest.approx(11.0 * cfg.grpo.group_size * cfg.batch.prompts_per_rank, rel=1e-12)
    assert stage.served_seconds == 5.0


def test_a_reward_models_flops_are_its_towers_on_one_image_and_prompt():
    # CLIP ViT-L/14 at 224 px: its vision tower's 257 tokens and its text tower's 77 through their parameters,
    # 2 FLOPs per multiply-add (attention adds a few percent)
    module = scorer_module("clipscore", {})
    vision = sum(p.numel() for p in module.vision_model.parameters())
    text = sum(p.numel() for p in module.text_model.parameters())
    assert scorer_flops(module) == pytest.approx(2 * (257 * vision + 77 * text), rel=0.05)


def test_imagereward_flops_are_those_of_its_scores_forward(tmp_path):
    # the count on the meta device (the planner's) against the FLOPs of the scorer's own call on a tiny checkpoint:
    # the same image side and prompt length (35 tokens) as the score runs
    from torch.utils.flop_counter import FlopCounterMode

    from rewards.imagereward import ImageRewardScorer, build_model
    from rewards.tiny import save_tiny_imagereward

    paths = save_tiny_imagereward(tmp_path)
    scorer = ImageRewardScorer(**paths)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        scorer(torch.rand(1, 3, 40, 40), ["a red cube"])
    with torch.device("meta"):
        module = build_model(paths["med_config"], paths["vision_config"])
    assert scorer_flops(module) == counter.get_total_flops() > 0


def test_the_step_time_adds_the_exposed_reward():
    report = PlanReport(
        experiment="x", backbone="x", arch="x", world_size=8, gpu_memory_gib=80.0, reserved_gib=4.0,
        num_params=0, num_trainable=0, lora=False, checkpointing=True, image_tokens=0, text_tokens=0,
        samples_per_rank=1, decode_batch=1, micro_batch=1, segments={}, param_bytes=0, grad_bytes=0,
        optimizer_bytes=0, reference_bytes=0, ema_bytes=0, step_tensor_bytes=0, velocity_bytes=0, frozen=[],
        phases=[Phase(name, 0, 0, 0, 0, flops=int(f), calls_per_step=1) for name, f in
                (("rollout", 8e15), ("decode", 0), ("optimizer", 0))],
        updates=[], model_bytes=ModelBytes(0.0, 0.0), peak_tflops=1000.0, mfu=0.5, intra_gbps=1.0, inter_gbps=1.0,
        reward=RewardTiming(chunks=4, local=("hpsv2",), served=("remote",), local_flops=1e15, served_seconds=3.0,
                           source="plan.served_reward_seconds"),
    )  # fmt: skip
    # the rollout: 8e15 FLOPs at 500 TFLOP/s, 16 s (4 a chunk); hpsv2 2 s on the rank; 3 x 3 s hidden
    assert report.reward_seconds() == pytest.approx((2.0 + 4 * 3.0 - 9.0, 9.0), rel=1e-12)
    assert report.step_seconds() == pytest.approx(16.0 + 5.0, rel=1e-12)


# ---- plan.depth=extended: a few blocks traced, every figure extended to full depth ------------------------------


def test_only_deep_kinds_are_extended():
    """FLUX's two kinds each add 2 blocks to the base of 4; a kind of at most 6 blocks is traced whole, and a model
    with no deeper kind is traced at full depth."""
    assert traced_depths({"num_layers": 19, "num_single_layers": 38}) == [
        {"num_layers": 4, "num_single_layers": 4},
        {"num_layers": 6, "num_single_layers": 4},
        {"num_layers": 4, "num_single_layers": 6},
    ]
    assert traced_depths({"num_layers": 60, "num_single_layers": 3}) == [
        {"num_layers": 4, "num_single_layers": 3},
        {"num_layers": 6, "num_single_layers": 3},
    ]
    assert traced_depths({"num_layers": 6, "num_single_layers": 1}) == []


def test_every_figure_is_extended_by_what_its_blocks_add():
    """A trace whose figures grow linearly in each kind's blocks is extended to their values at full depth: integers
    rounded, dictionaries per key, names and flags as traced."""
    full = {"num_layers": 19, "num_single_layers": 38}

    def trace_at(depths: dict[str, int]) -> tuple[Phase, dict[str, int]]:
        double, single = depths["num_layers"], depths["num_single_layers"]
        flops = 1000 + 30 * double + 7 * single
        phase = Phase("update exact", 5 * flops, flops, 0, 0, flops, 2.5, forwards=2.0, checkpointing=True)
        return phase, {"Sharded Param": 3 * double + single, "Temp": 11}

    phase, at = extended(full, trace_at)
    assert phase == trace_at(full)[0]
    assert at == trace_at(full)[1]


def test_an_unknown_depth_stops_with_the_choices(capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["experiment=flux_dance", "plan.depth=half"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "plan.depth" in err and "extended" in err and "full" in err and "Traceback" not in err


@pytest.mark.slow
def test_extended_plan_agrees_with_the_full_trace(tmp_path):
    """Qwen-Image cut to 8 blocks, extended from its traces at 4 and 6 blocks against all 8 traced. Per block the
    update's peak moves by one block's saved input between depths and between runs (about 16 MB here,
    docs/benchmarks/2026-12-planner-speed.md), a fraction of a percent of its peak, so every peak is within 1%;
    parameters, FLOPs and the bytes the collectives send grow exactly by block and agree within float rounding."""
    shutil.copytree(ARCH_ROOT / SHIPPED_ARCH["qwenimage"], tmp_path / "arch")
    path = tmp_path / "arch" / "transformer" / "config.json"
    path.write_text(json.dumps(read_json(path) | {"num_layers": 8}))
    reports = {}
    for depth in ("extended", "full"):
        cfg, given = config(["experiment=qwenimage_flow_fast", f"plan.arch={tmp_path / 'arch'}", f"plan.depth={depth}"])
        reports[depth] = plan(cfg, model_path_given=given)
    ext, full = reports["extended"], reports["full"]
    assert (ext.num_params, ext.param_bytes, ext.optimizer_bytes) == (
        full.num_params,
        full.param_bytes,
        full.optimizer_bytes,
    )
    assert ext.model_bytes == full.model_bytes
    assert [p.name for p in ext.phases + ext.updates] == [p.name for p in full.phases + full.updates]
    for e, f in zip(ext.phases + ext.updates, full.phases + full.updates, strict=True):
        assert e.peak_bytes == pytest.approx(f.peak_bytes, rel=0.01), e.name
        assert e.flops == pytest.approx(f.flops, rel=1e-3), e.name
        assert (e.forwards, e.backwards, e.calls_per_step) == (f.forwards, f.backwards, f.calls_per_step), e.name
    assert ext.flops_per_step() == pytest.approx(full.flops_per_step(), rel=1e-3)
    assert ext.step_seconds() == pytest.approx(full.step_seconds(), rel=1e-3)
