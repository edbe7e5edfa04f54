"""The trainer end to end on a tiny Flux-architecture pipeline, in this process (CPU).

Golden values: ``tests/e2e/golden/trainer.json`` holds the per-step reward (a tiny CLIPScore), gradient norm, loss and
approx_kl of a 3-step run for every update mode and sampler preset. Regenerate it after an intended change with
``UPDATE_GOLDEN=1 python -m pytest tests/e2e/test_trainer.py -k golden`` and say why in the commit.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from pathlib import Path

import pytest
import small_run
import torch
from hydra import compose, initialize_config_module
from run_folders import assert_same_export, exported
from run_folders import metrics as metric_rows
from safetensors.torch import load_file
from small_run import TWO_SEGMENTS
from two_ranks import HELPERS, run_torchrun

from models.registry import load_backbone
from train.algorithm import update
from train.distributed.seeds import seed_everything
from train.loop.trainer import run
from train.parts.config.schema import register_schema
from train.parts.policy.builder import setup_trainable
from train.run.start import load_config

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).with_name("golden") / "trainer.json"
# (rtol, atol) per key, from float32 rounding across CPUs. Measured on one Xeon between its AVX-512
# kernels and its AVX2 ones (ATEN_CPU_CAPABILITY=avx2), after three steps: 1.7e-5 relative in the
# gradient norm, 4e-7 absolute in the reward (a mean of CLIP similarities of order 0.1), 2e-7 in the
# loss, 3e-5 relative in approx_kl. The tolerances are 15-25x those; a real change moves each far more
# (the exact and JAGG paths' gradient norms differ by 0.8% on step 0). The loss and approx_kl come from
# the second optimizer step of each training step (GOLDEN_RUN), whose ratios differ from one, so they
# are 1e-5 to 1e-2 rather than rounding around zero.
GOLDEN_KEYS = {
    "reward/total": (1e-4, 5e-6),
    "train/grad_norm": (3e-4, 0.0),
    "train/loss": (0.0, 3e-6),
    "train/approx_kl": (1e-3, 1e-9),
}
register_schema()

# Two segments of W = 4, one optimizer step per step (the golden runs: two, GOLDEN_RUN).
SMALL = ["experiment=tiny", "num_steps=3", *TWO_SEGMENTS, "checkpoint.every=0", "update.jagg_frac=0.6"]
FAST = ["sampler.sde_window_size=4", "sampler.sde_window_range=[0,8]"]
# MixGRPO-Flash on the small run: a window that moves every step, DPM-Solver++ 2M on fewer points after it
SOLVER = ["sampler=flow_fast", *FAST, "update.jagg_frac=1.0", "sampler.post_window.solver=dpmpp_2m"]
LORA = ["model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=8"]
FLASH = [
    *SOLVER,
    "sampler.post_window.ratio=0.4",
    "sampler.sde_window_schedule=progressive",
    "sampler.sde_window_iters=1",
]


def smooth_reward(clip: Path) -> list[str]:
    """A tiny CLIPScore instead of the tiny experiment's JPEG size: a JPEG's size moves by whole bytes
    when one pixel crosses a rounding step, so two CPUs' rounding can draw a byte apart and every later
    metric follows; a CLIP similarity is continuous in the images and moves by rounding only."""
    return ["~reward.components.jpeg_compressibility", f"+reward.components.clipscore.model_path={clip}"]


# Two optimizer steps per training step (one per micro-batch of 2): the second micro-batch's ratios
# differ from one, so the PPO loss and approx_kl are values that can fail, not rounding around zero.
GOLDEN_RUN = ["batch.gradient_accumulation_steps=2"]
CASES = {
    "dance-exact": ["update=exact"],
    "dance-jagg": ["update=jagg"],
    "dance-jagg_sequential": ["update=jagg_sequential"],
    "dance-ablate": ["update=ablate"],
    "flow-jagg": ["sampler=flow", "grpo.kl_beta=0.01"],
    "flow_fast-jagg": ["sampler=flow_fast", *FAST, "update.jagg_frac=1.0"],
}


pytestmark = pytest.mark.usefixtures("repo_root")  # the demo's prompt file is relative to the repository root


def train(run_dir: Path, model: Path, overrides: list[str]) -> list[dict]:
    with initialize_config_module(config_module="configs", version_base=None):
        cfg = compose(config_name="train", overrides=[f"run_dir={run_dir}", f"model.path={model}", *SMALL, *overrides])
    run(cfg)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def replayed_keys(row: dict, *, per_rank: tuple[str, ...] = ()) -> set[str]:
    """The metrics a replay must reproduce: all but the clocks (time/*, wall_time), what is computed
    from them (perf/*: TFLOP/s and MFU), what counts the process's history (count/compilations:
    graphs compiled so far), and the ``per_rank`` prefixes."""
    process = ("wall_time", "count/compilations")
    return {k for k in row if not k.startswith(("time/", "perf/", *per_rank)) and k not in process}


@pytest.fixture(scope="module")
def golden_runs(tiny_flux_dir, tiny_clip_dir, tmp_path_factory) -> dict[str, list[dict]]:
    """The metrics of every golden case, trained once for the golden check and the counts check."""
    root = tmp_path_factory.mktemp("golden")
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(ROOT)
        reward = [*smooth_reward(tiny_clip_dir), *GOLDEN_RUN]
        return {case: train(root / case, tiny_flux_dir, [*reward, *overrides]) for case, overrides in CASES.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_tiny_run_matches_golden(case, golden_runs):
    metrics = golden_runs[case]
    assert [m["step"] for m in metrics] == [0, 1, 2]
    values = {key: [m[key] for m in metrics] for key in GOLDEN_KEYS}
    mode = case.split("-")[1]
    routed = metrics[0].get(f"count/segments_{mode}", 0)
    assert routed > 0, f"no segment took the {mode} path"
    golden = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
    if os.environ.get("UPDATE_GOLDEN"):
        golden[case] = values
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    assert case in golden, "no golden values: run with UPDATE_GOLDEN=1"
    for key, (rtol, atol) in GOLDEN_KEYS.items():
        torch.testing.assert_close(
            torch.tensor(values[key]), torch.tensor(golden[case][key]), rtol=rtol, atol=atol, msg=f"{case} {key}"
        )


COUNTED = ("count/grad_forwards", "count/nograd_forwards", "count/backward_calls", "count/reused_velocities")
SHARED = ("count/shared_start_forward_rows", "count/shared_start_grad_rows")
# 9 sampling steps' v of a 16 x 16 x 4 latent packed into 8 x 8 x 16, float32
VELOCITY_BYTES = 9 * 8 * 8 * 16 * 4


def test_counts_per_update_mode(golden_runs, tiny_flux_dir, tmp_path):
    """Per step of the golden runs: two micro-batches of 2 rows (one group), each its own optimizer step,
    and two segments of W = 4 per micro-batch, segment 0 routed to the mode (jagg_frac 0.6 of 8 transitions)
    and segment 1 exact (Flow-GRPO-Fast: one segment, in its window). The shared start runs each optimizer
    step's first trainable step once for the group's 2 rows (1 forward with grad, 1 backward call), so
    segment 0 runs no forward of its step 0. Exact runs W forwards and W backward passes per segment (W - 1
    in segment 0); jagg and ablate the endpoint W - 1 forward and 1 backward call in segment 0, 2 endpoint
    forwards and 1 call elsewhere; jagg_sequential one call per endpoint it runs. jagg takes its 2 middle
    steps from the rollout in the first micro-batch (the weights are the rollout's) and recomputes them
    without grad in the second (an optimizer step moved the weights: update.reuse_velocities=fresh). Two
    more runs, every segment on jagg, one optimizer step of both micro-batches: reuse off recomputes every
    middle step, stale reuses them after the optimizer step too."""
    counts = {case: tuple(metrics[0][key] for key in COUNTED) for case, metrics in golden_runs.items()}
    assert counts == {
        "dance-exact": (16, 0, 16, 0),
        "dance-jagg": (12, 2, 12, 2),
        "dance-jagg_sequential": (12, 2, 12, 2),
        "dance-ablate": (12, 0, 12, 0),
        "flow-jagg": (12, 18, 12, 2),  # and the KL reference: 4 no-grad steps per segment and micro-batch
        "flow_fast-jagg": (4, 2, 4, 2),  # one segment of 4 in the SDE window, on jagg (jagg_frac 1)
    }
    # rows saved: the rollout's step 0 for 3 of the group's 4 rows (the first SDE step), the KL reference's
    # and the update's step 0 for 1 of 2 rows per optimizer step
    shared = {case: tuple(metrics[0][key] for key in SHARED) for case, metrics in golden_runs.items()}
    assert {case: rows for case, rows in shared.items() if case != "flow_fast-jagg"} == {
        "dance-exact": (3, 2),
        "dance-jagg": (3, 2),
        "dance-jagg_sequential": (3, 2),
        "dance-ablate": (3, 2),
        "flow-jagg": (3 + 2, 2),
    }
    rollout_rows, update_rows = shared["flow_fast-jagg"]  # the rollout shares steps 0 .. its window's start
    assert update_rows == 2 and rollout_rows % 3 == 0 and 3 <= rollout_rows <= 3 * 5
    kept = {case: metrics[0].get("memory/velocity_bytes_per_sample") for case, metrics in golden_runs.items()}
    assert kept == {case: None if "exact" in case or "ablate" in case else VELOCITY_BYTES for case in CASES}
    extra = {
        "jagg-off": ["update.reuse_velocities=off"],
        "jagg-stale": ["update.reuse_velocities=stale", *GOLDEN_RUN],
    }
    for name, overrides in extra.items():
        m = train(tmp_path / name, tiny_flux_dir, ["update=jagg", "update.jagg_frac=1.0", "num_steps=1", *overrides])[0]
        counts[name] = tuple(m[key] for key in COUNTED)
        kept[name] = m.get("memory/velocity_bytes_per_sample")
    assert (counts["jagg-off"], kept["jagg-off"]) == ((7, 8, 5, 0), None)
    assert (counts["jagg-stale"], kept["jagg-stale"]) == ((8, 0, 6, 8), VELOCITY_BYTES)
    unshared = ["update=jagg", "num_steps=1", "update.share_group_start=false"]
    off = train(tmp_path / "unshared", tiny_flux_dir, unshared)[0]
    assert tuple(off[key] for key in SHARED) == (0, 0)
    assert tuple(off[key] for key in COUNTED) == (12, 0, 10, 4)  # endpoint 0 in jagg's batched forward again


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        [],  # jagg on the first segment, reusing the rollout's velocities (one optimizer step per step)
        ["update.reuse_velocities=fresh", *GOLDEN_RUN],  # reused, then recomputed after a step
        ["update.reuse_velocities=stale", *GOLDEN_RUN],
        FLASH,
        ["grpo.inner_epochs=2", *GOLDEN_RUN],  # two passes of two optimizer steps, the second reshuffled
    ],
    ids=["default", "fresh", "stale", "flash", "inner_epochs"],
)
def test_resume_replays_exactly(extra, tiny_flux_dir, tmp_path):
    """Kept velocities are not checkpointed: a resumed step rolls out again and keeps them anew, so it
    logs what the uninterrupted run logged, to every digit."""
    straight = train(tmp_path / "straight", tiny_flux_dir, ["num_steps=4", "checkpoint.every=2", *extra])
    train(tmp_path / "resumed", tiny_flux_dir, ["num_steps=2", "checkpoint.every=2", *extra])
    resumed = train(tmp_path / "resumed", tiny_flux_dir, ["num_steps=4", "checkpoint.every=2", "resume=auto", *extra])
    assert [m["step"] for m in resumed] == [0, 1, 2, 3]
    assert all(m["count/reused_velocities"] > 0 for m in resumed)
    if extra == FLASH:  # the window moves on from where the checkpoint left it; 9 forwards become 6 to 9
        assert [m["sampler/window_start"] for m in resumed] == [0, 1, 2, 3]
        assert [m["count/rollout_forwards"] for m in resumed] == [6, 7, 8, 9]
    clock = [m["wall_time"] for m in resumed]
    assert clock == sorted(clock) and clock[2] >= clock[1]  # wall_time goes on across the resume
    for a, b in zip(straight, resumed):
        keys = replayed_keys(a)
        assert keys == replayed_keys(b)
        for key in sorted(keys):
            assert a[key] == b[key], (a["step"], key)
    assert_same_export(tmp_path / "straight", tmp_path / "resumed")


def test_inner_epochs_through_the_command(capsys, tmp_path):
    """``python -m train`` on the tiny run with grpo.inner_epochs=2 beside one pass, 3 steps on the exact path (one
    optimizer step per pass): each step runs its update twice (twice the forwards, backward calls and optimizer
    steps; the rollout's the same), the first pass of step 0 is the one-pass run's, and the second runs at the
    weights the first moved: its ratio leaves 1."""
    runs = {}
    for passes in (1, 2):
        overrides = [*small_run.FAST, "num_steps=3", "update=exact", f"grpo.inner_epochs={passes}"]
        status, stderr = small_run.command(capsys, tmp_path / str(passes), [*overrides, "checkpoint.export=false"])
        assert status == 0, stderr
        runs[passes] = metric_rows(tmp_path / str(passes))
    one, two = runs[1], runs[2]
    assert [row["step"] for row in two] == [0, 1, 2]
    for a, b in zip(one, two):
        assert b["count/grad_forwards"] == 2 * a["count/grad_forwards"] > 0
        assert b["count/backward_calls"] == 2 * a["count/backward_calls"]
        assert b["count/rollout_forwards"] == a["count/rollout_forwards"]
        assert not any(name.startswith("train/pass") for name in a)
    assert two[0]["train/pass1/ratio_mean"] == one[0]["train/ratio_mean"]
    assert two[0]["train/pass1/clip_frac"] == one[0]["train/clip_frac"]
    assert all(abs(row["train/pass2/ratio_mean"] - 1) > abs(row["train/pass1/ratio_mean"] - 1) for row in two)


def test_console_lines_last_step_evaluation_and_run_folder(tiny_flux_dir, tmp_path, caplog):
    """What a researcher sees: a heartbeat without the bar, a line per evaluation against step 0, an
    evaluation after the last step although 3 is no multiple of eval_every, per-prompt scores, the
    before/after sheet and the summary with the paired difference and every folder written."""
    caplog.set_level(logging.INFO)
    evaluation = ["eval.every=2", "+eval.scorers.jpeg_compressibility={}", "eval.num_steps=4"]
    overrides = ["eval.num_prompts=3", "logging.heartbeat_s=0", "logging.sample_every=3", "checkpoint.every=2"]
    metrics = train(tmp_path, tiny_flux_dir, [*evaluation, *overrides])
    assert [m["step"] for m in metrics if "eval/jpeg_compressibility" in m] == [0, 2, 3]
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("train")]
    evals = [line for line in lines if line.startswith("eval step")]
    assert len(evals) == 3 and evals[0].startswith("eval step 0: jpeg_compressibility ")
    first = evals[0].split()[-1]
    assert re.fullmatch(rf"eval step 3: jpeg_compressibility -?\d+\.\d{{4}} \(step 0: {re.escape(first)}\)", evals[2])
    assert [line.split()[1] for line in lines if line.startswith("step ")] == ["1/3", "2/3", "3/3"]
    rows = [json.loads(line) for line in (tmp_path / "eval" / "step_00000003.scores.jsonl").read_text().splitlines()]
    assert [sorted(r) for r in rows] == [["category", "index", "jpeg_compressibility", "prompt", "seed"]] * 3
    assert (tmp_path / "eval" / "before_after_step_00000003.png").is_file()
    # the rollouts of the third step, as the checkpoint and the evaluation after it are numbered
    assert (tmp_path / "samples" / "samples_00000003.png").is_file()
    summary = lines[-1]
    assert summary.startswith("finished tiny (jagg, seed 42): steps 0-2 in ")
    assert "jpeg_compressibility: step 0 " in summary and "-> step 3 " in summary and "paired difference" in summary
    assert "time per step (median of 3): " in summary and "rollout " in summary and "update " in summary
    assert "transformer TFLOP/s (MFU of the peak " in summary and "measured float32 matmul): step " in summary
    for entry in ("metrics.jsonl", "samples/", "eval/", "checkpoints/    step_00000002", "export/"):
        assert entry in summary, entry


def test_nan_reward_skips_update(tiny_flux_dir, tmp_path, monkeypatch):
    from rewards.compressibility import JPEGCompressibilityScorer

    monkeypatch.setattr(
        JPEGCompressibilityScorer, "score", lambda self, images, prompts: torch.full((images.shape[0],), float("nan"))
    )
    before = load_file(tiny_flux_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    metrics = train(tmp_path / "nan", tiny_flux_dir, ["num_steps=2", "health.max_bad_steps=0"])  # exported all the same
    assert [m["train/skipped_nan_reward"] for m in metrics] == [1.0, 1.0]
    after = exported(tmp_path / "nan")
    for name, value in before.items():
        assert torch.equal(after[name], value.to(after[name].dtype)), name


def test_nan_loss_skips_optimizer_step(tiny_flux_dir, tmp_path, monkeypatch):

    original = update.ppo_step_loss

    def nan_loss(*args, **kwargs):
        loss, metrics = original(*args, **kwargs)
        return loss * float("nan"), metrics

    monkeypatch.setattr(update, "ppo_step_loss", nan_loss)
    before = load_file(tiny_flux_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    metrics = train(tmp_path / "nanloss", tiny_flux_dir, ["num_steps=1", "health.max_bad_steps=0"])
    assert metrics[0]["train/skipped_optimizer_steps"] == 1
    after = exported(tmp_path / "nanloss")
    for name, value in before.items():
        assert torch.equal(after[name], value.to(after[name].dtype)), name


def test_ratio_norm_trains_on_the_rollouts_velocities(tiny_flux_dir, tmp_path):
    """GRPO-Guard on Flow-GRPO's SDE, exact path (which keeps velocities for nothing else): the rollout
    keeps them, and the first micro-batch, on the sampling weights, has ratios of one as without it; the
    second, after an optimizer step, moves them."""
    overrides = ["num_steps=1", "sampler=flow", "update=exact", *GOLDEN_RUN]
    guarded = train(tmp_path / "guard", tiny_flux_dir, [*overrides, "grpo.ratio_norm=true"])[0]
    plain = train(tmp_path / "plain", tiny_flux_dir, overrides)[0]
    assert guarded["memory/velocity_bytes_per_sample"] > 0 and "memory/velocity_bytes_per_sample" not in plain
    assert guarded["train/grad_norm"] > 0 and guarded["train/skipped_optimizer_steps"] == 0
    assert guarded["train/loss"] != plain["train/loss"]
    assert math.isfinite(guarded["train/approx_kl"]) and guarded["train/approx_kl"] > 0


def test_lora_with_kl_trains_only_adapters(tiny_flux_dir, tmp_path):
    """LoRA fine-tuning: the reference of the KL term is the adapter-disabled policy; the export
    is a LoRA file and the base weights are untouched."""
    metrics = train(tmp_path / "lora", tiny_flux_dir, ["num_steps=2", *LORA, "grpo.kl_beta=0.1"])
    assert metrics[-1]["train/kl"] > 0  # the adapters moved the policy away from the reference
    files = {p.name for p in (tmp_path / "lora" / "export").iterdir()}
    assert "pytorch_lora_weights.safetensors" in files


def test_lora_initialisation_does_not_depend_on_the_rank(tiny_flux_dir, tmp_path):
    """Ranks seed their global RNGs differently (seed_everything(seed, rank)), but the adapters come
    from the rank-independent stream (seed, "model_init"): every rank, on any world size, starts from
    the same LoRA weights, so FSDP2's shards of them form one consistent matrix."""
    with initialize_config_module(config_module="configs", version_base=None):
        cfg = compose(
            config_name="train",
            overrides=[f"run_dir={tmp_path}", f"model.path={tiny_flux_dir}", *SMALL, "model.lora.enabled=true"],
        )
    config = load_config(cfg)
    adapters, draws = [], []
    for rank in (0, 1):
        seed_everything(config.seed, rank)
        backbone = load_backbone("flux", tiny_flux_dir, dtype="float32")
        params, _ = setup_trainable(config, backbone)
        names = [n for n, p in backbone.transformer.named_parameters() if p.requires_grad]
        adapters.append(dict(zip(names, (p.detach().clone() for p in params))))
        draws.append(torch.rand(4))  # what the rank's global RNG gives next
    assert not torch.equal(draws[0], draws[1])  # the ranks' global streams do differ
    assert adapters[0].keys() == adapters[1].keys() and any("lora_A" in n for n in adapters[0])
    for name, value in adapters[0].items():
        assert torch.equal(value, adapters[1][name]), name
    assert any(value.abs().max() > 0 for name, value in adapters[0].items() if "lora_A" in name)


# Every update mode, both SDEs and the Flow-GRPO-Fast window, LoRA and full fine-tuning, all with KL.
MULTI_RANK = {
    "full-exact-dance": ["update=exact"],
    "full-jagg-flow": ["update=jagg", "sampler=flow"],
    "lora-jagg_sequential-dance": [*LORA, "update=jagg_sequential"],
    "lora-ablate-flow_fast": [*LORA, "update=ablate", "sampler=flow_fast", *FAST, "update.jagg_frac=1.0"],
    "full-jagg-random_flash": [*SOLVER, "sampler.post_window.ratio=0.4", "sampler.sde_window_schedule=random"],
}
# Logged per step and independent of the rank layout: all but the clocks. The GRPO loss is a mean of
# advantage-weighted ratios whose advantages sum to zero, so its rounding is absolute (as in GOLDEN_KEYS).
ABS_TOL = {"train/loss": 1e-6, "adv/mean": 1e-6}


PER_RANK = ("flops/", "count/backward_calls", "count/grad_forwards", "count/nograd_forwards")


def assert_same_training(one: Path, many: Path, base: dict[str, torch.Tensor], name: str) -> None:
    """The run in ``many`` (several ranks) logged and exported what the one in ``one`` (one process) did."""
    single = [json.loads(line) for line in (one / "metrics.jsonl").read_text().splitlines()]
    multi = [json.loads(line) for line in (many / "metrics.jsonl").read_text().splitlines()]
    assert len(multi) == len(single) == 2
    for a, b in zip(single, multi):
        # per rank: FLOPs, and the transformer calls, as each rank runs its own shared-start call per optimizer step
        keys = replayed_keys(a, per_rank=PER_RANK)
        assert keys == replayed_keys(b, per_rank=PER_RANK), name
        assert a["train/kl"] > 0 or a["step"] == 0, name  # the KL term is live after the first step
        for key in sorted(keys):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=ABS_TOL.get(key, 1e-9)), (name, a["step"], key)
    a, b = exported(one), exported(many)
    assert a.keys() == b.keys(), name
    # how far training moved the weights: from the loaded transformer, or LoRA's B from its zero init
    moved = max((a[k] - base[k] if k in base else a[k] * ("lora_B" in k)).abs().max().item() for k in a)
    assert moved > 1e-5, name
    for key in a:
        # AdamW divides every element's gradient by that element's own RMS, so an element whose gradient
        # is at rounding level moves by a rounding-decided amount: measured 1% of `moved` at worst
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=moved * 5e-2, msg=f"{name} {key}")


@pytest.mark.slow
def test_two_ranks_log_and_train_as_one_process(tiny_flux_dir, tiny_clip_dir, tmp_path):
    """2 ranks x 1 prompt under FSDP2 (gloo) against 1 process x 2 prompts, two steps with KL: the same
    groups (ids and noise do not depend on the rank layout), gradients averaged over ranks, every
    training metric reduced over all ranks. So every logged value and the final weights agree."""
    reward = smooth_reward(tiny_clip_dir)  # both layouts must agree to rounding on every step
    common = [f"model.path={tiny_flux_dir}", *SMALL, "num_steps=2", "grpo.kl_beta=0.1", *reward]
    cases = {name: [*common, *extra, f"run_dir={tmp_path / 'two' / name}"] for name, extra in MULTI_RANK.items()}
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    result = run_torchrun(str(HELPERS / "trainer_worker.py"), str(tmp_path / "cases.json"), timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    # torch's alarming warnings of every multi-rank run: a view returned by a block (filtered: this test is
    # why that is harmless) and the deprecated all_gather_into_tensor (no longer called)
    for warning in ("returned a view tensor", "all_gather_into_tensor"):
        assert warning not in result.stderr + result.stdout, warning
    base = load_file(tiny_flux_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    for name, extra in MULTI_RANK.items():
        one = [*extra, "batch.prompts_per_rank=2", "batch.gradient_accumulation_steps=8"]
        train(tmp_path / "one" / name, tiny_flux_dir, ["num_steps=2", "grpo.kl_beta=0.1", *reward, *one])
        assert_same_training(tmp_path / "one" / name, tmp_path / "two" / name, base, name)


@pytest.mark.slow
@pytest.mark.long  # four ranks on 2 cores: make test-long
def test_hsdp_on_four_ranks_trains_as_one_process(tiny_flux_dir, tiny_clip_dir, tmp_path):
    """4 ranks x 1 prompt, HSDP (2 replicas of 2 shards: dist.replicate_degree=2) and FSDP over all 4,
    against 1 process x 4 prompts; then the HSDP run's checkpoint resumes in one process (DCP
    reshards it)."""
    reward = smooth_reward(tiny_clip_dir)
    common = [f"model.path={tiny_flux_dir}", *SMALL, "num_steps=2", "grpo.kl_beta=0.1", "checkpoint.every=1", *reward]
    layouts = {"hsdp": ["dist.replicate_degree=2"], "fsdp": []}
    cases = {name: [*common, *extra, f"run_dir={tmp_path / name}"] for name, extra in layouts.items()}
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    result = run_torchrun(str(HELPERS / "trainer_worker.py"), str(tmp_path / "cases.json"), timeout=900, nproc=4)
    assert result.returncode == 0, result.stderr[-4000:]
    one = [
        "num_steps=2",
        "grpo.kl_beta=0.1",
        *reward,
        "batch.prompts_per_rank=4",
        "batch.gradient_accumulation_steps=16",
    ]
    train(tmp_path / "one", tiny_flux_dir, one)
    base = load_file(tiny_flux_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    for name in layouts:
        assert_same_training(tmp_path / "one", tmp_path / name, base, name)
    resumed = train(tmp_path / "hsdp", tiny_flux_dir, [*one, "num_steps=3", "resume=auto"])
    assert [row["step"] for row in resumed] == [0, 1, 2]
