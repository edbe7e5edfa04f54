"""``python -m train.preflight``: the verdict of each check, its exit status, ``preflight.json`` and a run folder left
ready for the run; the comparison of the planner with a measured step on a hand-made case.

The preflights here run on CPU over gloo: the collectives' rates and the step's times are printed, not asserted."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from small_run import FAST, command
from two_ranks import run_ranks, run_torchrun

import train.tools.preflight.command as preflight_command
from train.ground.layout import RunLayout
from train.run.folder import held_run
from train.tools.plan.comm import ModelBytes
from train.tools.plan.report import GIB, Phase, PlanReport
from train.tools.plan.reward import RewardTiming
from train.tools.preflight.compare import MemoryCompare, corrected_memory
from train.tools.preflight.links import LinkRate, link_checks
from train.tools.preflight.machine import sdpa_backend
from train.tools.preflight.scorers import ScorerTiming, measured_reward, reward_check
from train.tools.preflight.verdict import Check, RankChecks, Status, Verdict, merged

STATUSES = {"passed", "warned", "failed", "skipped"}


def _phase(name: str, peak_gib: float) -> Phase:
    return Phase(name, int(peak_gib * GIB), 0, 0, 0, flops=0, calls_per_step=1)


def _report(peaks: dict[str, float]) -> PlanReport:
    """A full-depth plan by hand: the phases' peaks, nothing else that the memory comparison reads."""
    return PlanReport(
        experiment="x", backbone="x", arch="x", world_size=8, gpu_memory_gib=80.0, reserved_gib=4.0,
        num_params=0, num_trainable=0, lora=False, checkpointing=True, image_tokens=0, text_tokens=0,
        samples_per_rank=1, decode_batch=1, micro_batch=1, segments={}, param_bytes=0, grad_bytes=0,
        optimizer_bytes=0, reference_bytes=0, ema_bytes=0, step_tensor_bytes=0, velocity_bytes=0, frozen=[],
        phases=[_phase(name, gib) for name, gib in peaks.items()], updates=[], model_bytes=ModelBytes(0.0, 0.0),
    )  # fmt: skip


def test_the_planners_error_corrects_the_full_depth_plan():
    # The planner traced 10 GiB for the reduced model, the step reserved 12.5 GiB: it under-counts by 20% of the
    # measured peak, and every full-depth peak is taken 1.25 times. 60 GiB traced -> 75 GiB, within the 80 GiB
    # device less the 1.5 GiB that the CUDA context and NCCL hold (78.5): fits; 64 GiB -> 80 GiB does not.
    memory = MemoryCompare(traced_bytes=10 * GIB, measured_bytes=12.5 * GIB)
    assert memory.ratio == pytest.approx(1.25, rel=1e-12)
    assert memory.error == pytest.approx(-0.2, rel=1e-12)
    assert "the planner's error -20%" in memory.line()
    device = {"total_bytes": 80 * GIB, "other_bytes": 1.5 * GIB}
    fits = corrected_memory(_report({"rollout": 20.0, "decode": 30.0, "optimizer": 60.0}), memory, **device)
    assert fits.peak.name == "optimizer" and fits.peak.peak_bytes == pytest.approx(75 * GIB, rel=1e-9)
    assert fits.budget_bytes == pytest.approx(78.5 * GIB, rel=1e-12) and fits.fits
    assert not corrected_memory(_report({"rollout": 20.0, "decode": 30.0, "optimizer": 64.0}), memory, **device).fits


def test_preflight_json_names_the_rank_that_failed():
    ranks = [RankChecks(0), RankChecks(1)]
    for rc in ranks:
        rc.add("mesh", Status.passed, "2 rank(s)")
    ranks[0].add("settings and files", Status.passed, "fine")
    ranks[1].add("settings and files", Status.failed, "data.train_prompts='p1.txt': no such file", "give the file")
    verdict = Verdict(merged(ranks), machine=[{"rank": 0}, {"rank": 1}])
    out = json.loads(json.dumps(verdict.to_json()))
    assert out["version"] == 1 and out["exit_status"] == 2
    assert set(out) == {"version", "exit_status", "checks", "machine", "step", "plan"}
    assert [(c["name"], c["status"], c["ranks"]) for c in out["checks"]] == [
        ("mesh", "passed", None),
        ("settings and files", "passed", [0]),
        ("settings and files", "failed", [1]),
    ]
    text = "\n".join(verdict.lines())
    assert "rank 1: data.train_prompts='p1.txt': no such file" in text and "fix: give the file" in text
    assert Verdict([Check("mesh", Status.warned, "slow")], []).exit_status == 0


def _verdict(run_dir: Path) -> dict:
    out = json.loads(RunLayout(run_dir).preflight.read_text())
    assert set(out) == {"version", "exit_status", "checks", "machine", "step", "plan"}
    for check in out["checks"]:
        assert set(check) == {"name", "status", "line", "fix", "ranks"} and check["status"] in STATUSES
        assert check["fix"] or check["status"] not in ("warned", "failed"), check
    return out


def _failed(out: dict) -> list[str]:
    return [f"{c['name']}: {c['line']}" for c in out["checks"] if c["status"] == "failed"]


def _ready_for_the_run(run_dir: Path) -> None:
    layout = RunLayout(run_dir)
    assert held_run(run_dir) is None and not layout.lock.exists() and not layout.preflight_scratch.exists()
    assert not layout.metrics.exists() and not layout.checkpoints.exists()


def test_a_world_size_the_replicate_degree_does_not_divide(tmp_path, capsys):
    status, _ = command(capsys, tmp_path, ["dist.replicate_degree=2"], preflight_command)
    out = _verdict(tmp_path)
    assert status == 2 and out["exit_status"] == 2
    assert _failed(out) == ["mesh: dist.replicate_degree=2 must divide the world size 1: pick a divisor of it, or "
                            "dist.replicate_degree=1"]  # fmt: skip
    _ready_for_the_run(tmp_path)


def test_settings_that_fail_still_give_a_verdict_naming_every_missing_file(tmp_path, capsys):
    """The settings check fails (two prompt files that do not exist): both named in its one line, the verdict written
    to the run folder, and the folder left as the run will find it."""
    missing = ["data.train_prompts=/nonexistent/train.txt", "eval.prompts=/nonexistent/eval.txt"]
    status, _ = command(capsys, tmp_path, missing, preflight_command)
    out = _verdict(tmp_path)
    assert status == 2 and out["exit_status"] == 2
    (line,) = _failed(out)
    assert line.startswith("settings and files: data.train_prompts='/nonexistent/train.txt' does not exist; ")
    assert "eval.prompts='/nonexistent/eval.txt' does not exist" in line
    _ready_for_the_run(tmp_path)


@pytest.mark.slow
def test_the_model_folder_missing_on_one_rank_stops_both_ranks_in_seconds(tmp_path):
    """Two ranks of the tiny preset whose model folder rank 0 builds (model.build_tiny) and rank 1 reads at another
    path, where none is: the ranks agree on the failure before the checks that are collectives (the checkpoints,
    the disk), so both exit 2 long before dist.timeout_s, and rank 0 writes the verdict naming rank 1's folder."""
    model = f"model.path={tmp_path}/model_${{oc.env:RANK}}"
    args = ["-m", "train.preflight", *FAST, model, "dist.timeout_s=600", f"hydra.run.dir={tmp_path / 'run'}"]
    ranks = run_ranks(*args, timeout=300)  # a rank waiting in a collective would wait 600 s
    assert [rank.returncode for rank in ranks] == [2, 2], [rank.stderr[-2000:] for rank in ranks]
    out = _verdict(tmp_path / "run")
    (failed,) = [c for c in out["checks"] if c["status"] == "failed"]
    assert failed["ranks"] == [1] and f"{tmp_path}/model_1" in failed["line"]
    _ready_for_the_run(tmp_path / "run")


def test_compile_without_a_cpp_compiler(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("train.distributed.parallelize.shutil.which", lambda name: None)  # as CXX=<missing> does
    status, _ = command(capsys, tmp_path / "run", ["model.compile=true"], preflight_command)
    (line,) = _failed(_verdict(tmp_path / "run"))
    assert status == 2 and line.startswith("compile: model.compile=true: inductor compiles CPU code with a C++")


def test_tiny_preset_on_a_disk_too_small(tmp_path, capsys, monkeypatch, tiny_flux_dir):
    """The whole preflight of one process, the step and the plan included. The disk has 20 MB free: room for a
    run's first files (16 MB), not for 41 checkpoints of about 1 MB."""
    monkeypatch.setattr("train.parts.checkpoint.manager.free_bytes", lambda path: 20 * 10**6)
    overrides = [*FAST, f"model.path={tiny_flux_dir}", "preflight.steps=1", "checkpoint.keep_last=40"]
    status, _, stdout = command(capsys, tmp_path, overrides, preflight_command, stdout=True)
    out = _verdict(tmp_path)
    assert status == 2 and out["exit_status"] == 2
    (line,) = _failed(out)
    assert line.startswith("disk: the disk of ") and "41 checkpoints (checkpoint.keep_last=40" in line
    by_name = {c["name"]: c["status"] for c in out["checks"]}
    assert by_name["step"] == "passed" and by_name["plan"] == "passed" and by_name["collectives"] == "skipped"
    (step,) = out["step"]["ranks"]
    assert step["blocks"] == "1+1" and step["seconds"]["step"] > 0 and step["peak_bytes"] is None
    assert out["plan"]["corrected"]["step_seconds"] > 0 and out["machine"][0]["torch"] == torch.__version__
    # the reward's scorer timed on one image and on a chunk (the rank's 2 images), and the stage against the rollout
    assert by_name["reward"] == "passed"
    (scorer,) = out["plan"]["reward"]["scorers"]
    assert scorer["name"] == "jpeg_compressibility" and not scorer["served"] and scorer["batch"] == 2
    assert scorer["latency_s"] > 0 and scorer["batch_s"] > 0 and out["plan"]["reward"]["hidden_s"] == 0
    _ready_for_the_run(tmp_path)


def test_the_step_and_the_plan_count_every_update_pass(tmp_path, capsys, tiny_flux_dir):
    """grpo.inner_epochs=2 on the small tiny run (per pass one micro-batch of one jagg segment and one optimizer
    step): the measured step runs 2 passes of 1 update call each, its line says so, and the full-depth plan,
    traced and corrected, counts those 2 calls and 2 optimizer steps per step."""
    overrides = [*FAST, f"model.path={tiny_flux_dir}", "preflight.steps=1", "grpo.inner_epochs=2"]
    status, stderr = command(capsys, tmp_path, overrides, preflight_command)
    out = _verdict(tmp_path)
    assert status == 0 and not _failed(out), stderr
    (step,) = out["step"]["ranks"]
    assert (step["passes"], step["update_calls"]) == (2, 2)
    (line,) = [c["line"] for c in out["checks"] if c["name"] == "step"]
    assert "; the update's 2 passes: 2 calls;" in line, line
    for plan in (out["plan"]["traced"], out["plan"]["corrected"]):
        assert (plan["update_calls"], plan["optimizer_steps"]) == (2, 2)


@pytest.mark.slow
def test_default_job(tmp_path, capsys):
    """The default job (the testbed, 2+2 blocks cut to 1+1) in one process: every check passes or is skipped; then
    the run itself starts in the folder and trains a step."""
    status, _ = command(capsys, tmp_path, ["preflight.steps=1"], preflight_command)
    out = _verdict(tmp_path)
    assert status == 0 and not _failed(out)
    assert {c["name"] for c in out["checks"] if c["status"] == "passed"} >= {"settings and files", "step", "plan"}
    _ready_for_the_run(tmp_path)
    status, stderr = command(capsys, tmp_path, ["num_steps=1", "eval.every=0", "checkpoint.export=false"])
    assert status == 0 and held_run(tmp_path) == "1 checkpoint (the latest step_00000001), 1 row of metrics.jsonl"


@pytest.mark.slow
def test_tiny_preset_on_two_ranks_and_a_file_one_rank_cannot_read(tmp_path, tiny_flux_dir):
    """Launched by torchrun: the collectives are measured on the mesh; then prompts that only rank 0 can read
    stop both ranks with rank 1's line."""
    base = ["-m", "train.preflight", *FAST, f"model.path={tiny_flux_dir}", "preflight.steps=1"]
    done = run_torchrun(*base, f"hydra.run.dir={tmp_path / 'ok'}", timeout=300)
    out = _verdict(tmp_path / "ok")
    assert done.returncode == 0 and not _failed(out), done.stderr[-3000:]
    collectives = [c["line"] for c in out["checks"] if c["name"] == "collectives"]
    assert [line.split(",")[0] for line in collectives] == ["all-gather", "reduce-scatter"]
    (tmp_path / "prompts_0.txt").write_text("a red circle\n")
    prompts = f"data.train_prompts={tmp_path}/prompts_${{oc.env:LOCAL_RANK}}.txt"
    done = run_torchrun(*base, prompts, f"hydra.run.dir={tmp_path / 'one'}", timeout=300)
    out = _verdict(tmp_path / "one")
    (failed,) = [c for c in out["checks"] if c["status"] == "failed"]
    assert done.returncode != 0 and failed["ranks"] == [1] and "prompts_1.txt" in failed["line"]
    _ready_for_the_run(tmp_path / "one")


def test_served_scoring_hides_when_a_chunk_scores_faster_than_the_next_rolls_out():
    report = replace(_report({"rollout": 1.0, "decode": 1.0, "optimizer": 1.0}), samples_per_rank=8,
                     peak_tflops=1000.0, mfu=0.5, intra_gbps=1.0, inter_gbps=1.0)  # fmt: skip
    report.phases[0].flops = int(8e15)  # 16 s of rollout at 500 TFLOP/s: 4 s a chunk
    stage = RewardTiming(chunks=4, local=(), served=("remote",), local_flops=0.0, served_seconds=2.0,
                        source="plan.served_reward_seconds")  # fmt: skip
    report = replace(report, reward=stage)
    fast = [ScorerTiming("remote", served=True, latency_s=0.5, batch=2, batch_s=3.0)]
    check = reward_check(measured_reward(report, fast), fast)
    assert check.status is Status.passed and "served scoring hides behind the rollout" in check.line
    assert "remote (served) 0.5 s for 1 image, 0.667 images/s in a batch of 2" in check.line
    # 6 s a chunk: 3 x 4 s hide behind the next chunks' rollout, 4 x 6 - 12 s are exposed
    slow = [ScorerTiming("remote", served=True, latency_s=0.5, batch=2, batch_s=6.0)]
    check = reward_check(measured_reward(report, slow), slow)
    assert check.status is Status.warned and "12 s exposed per step, 12 s hidden" in check.line
    assert "reward.chunk_groups" in check.fix


def test_a_link_far_below_the_plan_warns_with_its_fix():
    # 1 GB sent in 0.1 s is 80 Gb/s: far below NVLink's planned 3600 (under 25% of it), above 25% of 200
    slow = LinkRate("all-gather", (0, 1), False, sent_bytes=1e9, seconds=0.1)
    fast = LinkRate("all-gather", (0, 1), False, sent_bytes=1e9, seconds=0.001)
    assert slow.gbps == pytest.approx(80.0, rel=1e-12)
    (check,) = link_checks([[fast], [slow]], intra_gbps=3600, inter_gbps=400, slow_link=0.25, compared=True)
    assert check.status is Status.warned and "80 Gb/s at the slowest rank" in check.line
    assert "NCCL_DEBUG=INFO" in check.fix and "plan.intra_node_gbps" in check.fix
    (check,) = link_checks([[slow]], intra_gbps=200, inter_gbps=400, slow_link=0.25, compared=True)
    assert check.status is Status.passed
    (check,) = link_checks([[slow]], intra_gbps=3600, inter_gbps=400, slow_link=0.25, compared=False)
    assert check.status is Status.passed and "gloo on CPU: not held to the plan" in check.line


def test_the_attention_kernel_of_a_shape_is_named():
    assert sdpa_backend((2, 16, 8), torch.float32, torch.device("cpu")) in ("flash", "memory-efficient", "math")


def test_a_judge_that_never_answers_fails_the_reward_check_and_the_step(tmp_path, capsys, tiny_flux_dir):
    """A judge whose /v1/models answers and whose chat completions never come within timeout_s=1: the reward check
    failed naming the term and the fix, no latency reported for it, and the step whose update was skipped (its
    reward NaN) failed too: the run cannot start (it reported the deadline as the latency and said it could)."""
    pytest.importorskip("fastapi")
    from reward_servers import chat, judge_server, serve

    app, _ = judge_server(lambda body, number: chat("Final Score: 3"), delay_s=600)
    with serve(app) as url:
        judge = f"+reward.components.judge={{base_url: '{url}/v1', model: judge, timeout_s: 1, retries: 0}}"
        overrides = [*FAST, f"model.path={tiny_flux_dir}", "preflight.steps=1", judge]
        status, _ = command(capsys, tmp_path, overrides, preflight_command)
    out = _verdict(tmp_path)
    assert status == 2 and out["exit_status"] == 2
    checks = {c["name"]: c for c in out["checks"]}
    reward, step = checks["reward"], checks["step"]
    assert reward["status"] == "failed" and reward["line"].startswith(
        f"reward.components.judge: judge 'judge' at {url}/v1 gave no score: it did not answer within timeout_s=1 on "
        "1 try"
    ), reward
    assert f"check that the server at {url}/v1 answers" in reward["fix"] and "timeout_s" in reward["fix"]
    assert step["status"] == "failed" and "the update of step 0 was skipped: a reward was NaN or inf" in step["line"]
    judged = {t["name"]: t for t in out["plan"]["reward"]["scorers"]}["judge"]
    assert judged["latency_s"] is None and judged["batch_s"] is None
    _ready_for_the_run(tmp_path)
