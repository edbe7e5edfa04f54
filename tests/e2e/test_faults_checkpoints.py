"""Checkpoints and what a resume may change (docs/reliability.md, Settings on resume, A branch and another
run's checkpoint): a damaged checkpoint, export or metrics file is named in one line (``resume=auto`` falls back
past a damaged latest checkpoint); a resume that changes what the weights mean is refused, on two ranks by the
rank that sees the change, each rank with its line, and one that moves a rank's judge goes on, that rank noting it;
a branch from an older checkpoint retires the later ones, and a resume from a retired one brings its timeline
back."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from run_folders import assert_same_export, contents, copy_run, files_of, metrics, refused_line

import train.tools.eval.command as eval_command

pytestmark = pytest.mark.usefixtures("repo_root")  # the tiny experiment's prompt file is relative to the repository


def truncate(name: str):
    def damage(path: Path) -> None:
        data = (path / name).read_bytes()
        (path / name).write_bytes(data[: len(data) // 2])

    return damage


def zero(name: str):
    def damage(path: Path) -> None:
        (path / name).write_bytes(bytes((path / name).stat().st_size))

    return damage


def swap(name: str):
    """The file of the same name from the previous checkpoint (step 1): same length, other bytes."""
    return lambda path: shutil.copyfile(path.parent / "step_00000001" / name, path / name)


def remove(name: str):
    return lambda path: (path / name).unlink()


def write(name: str, text: str):
    return lambda path: (path / name).write_text(text)


def of_another_run(path: Path) -> None:
    """The marker of the same step of another run: its run id is another (the files are this run's)."""
    marker = json.loads((path / "COMPLETE").read_text())
    (path / "COMPLETE").write_text(json.dumps({**marker, "run_id": "0123456789abcdef"}))


# (damage to the latest checkpoint, what the one line must say, found before the model loads?)
DAMAGED = {
    "truncated-distcp": (truncate("__0_0.distcp"), r"__0_0\.distcp is truncated \(\d+ of \d+ bytes\)"),
    "missing-distcp": (remove("__0_0.distcp"), r"__0_0\.distcp is missing"),
    "zeroed-distcp": (zero("__0_0.distcp"), r"__0_0\.distcp does not match the checksum recorded when it was saved"),
    "swapped-distcp": (swap("__0_0.distcp"), r"__0_0\.distcp does not match the checksum recorded when it was saved"),
    "swapped-rank0": (swap("rank0.pt"), r"rank0\.pt is not the rank file of step 2"),
    "truncated-rank0": (truncate("rank0.pt"), r"rank0\.pt cannot be read"),
    "zeroed-rank0": (zero("rank0.pt"), r"rank0\.pt cannot be read"),
    "missing-rank0": (remove("rank0.pt"), r"rank0\.pt is missing"),
    "missing-metadata": (remove(".metadata"), r"it has no \.metadata file"),
    "zeroed-metadata": (zero(".metadata"), r"\.metadata cannot be read"),
    "garbage-marker": (write("COMPLETE", "garbage{"), r"its COMPLETE marker is not the JSON the trainer writes"),
    "wrong-step-marker": (write("COMPLETE", '{"step": 7, "world_size": 1}'), r"says step 7, its folder name step 2"),
    "of-another-run": (
        of_another_run,
        r"was written by run 0123456789abcdef, but .*/run holds run [0-9a-f]{16} \(its run_id file\).*"
        r"continue the other run in a new folder: resume=.*step_00000002 hydra\.run\.dir=<new folder>",
    ),
}


@pytest.mark.parametrize("case", list(DAMAGED))
def test_a_damaged_checkpoint_is_named_in_one_line(case, trained, launch, tmp_path):
    damage, expected = DAMAGED[case]
    run_dir = copy_run(trained, tmp_path)
    latest = run_dir / "checkpoints" / "step_00000002"
    damage(latest)
    before = files_of(run_dir / "checkpoints")
    line = refused_line(launch, run_dir, "num_steps=3", f"resume={latest}")
    assert str(latest) in line and re.search(expected, line), line
    assert "weights_only" not in line  # torch's advice for a damaged file would not help
    assert files_of(run_dir / "checkpoints") == before


@pytest.mark.parametrize("case", ["truncated-distcp", "zeroed-distcp", "garbage-marker"])
def test_resume_auto_falls_back_past_a_damaged_latest_checkpoint(case, trained, launch, tmp_path):
    """Checkpoint 2 is damaged: the run resumes from checkpoint 1, replays step 1 and writes the weights
    of the uninterrupted run; the damage is reported (caught early or while loading the tensors)."""
    run_dir = copy_run(trained, tmp_path)
    DAMAGED[case][0](run_dir / "checkpoints" / "step_00000002")
    status, stderr = launch(run_dir, "num_steps=2", "resume=auto")
    assert status == 0, stderr
    assert [m["step"] for m in metrics(run_dir)] == [0, 1]
    assert_same_export(run_dir, trained)


def test_resume_auto_with_every_checkpoint_damaged_is_an_error(trained, launch, tmp_path):
    run_dir = copy_run(trained, tmp_path)
    for path in (run_dir / "checkpoints").iterdir():
        (path / ".metadata").unlink()
    line = refused_line(launch, run_dir, "num_steps=3", "resume=auto", kept=run_dir)
    assert re.search(r"resume=auto: no checkpoint under .* can be resumed from", line), line


def other_model(tiny_flux_dir: Path, tmp_path: Path) -> Path:
    """The tiny pipeline with a transformer of another width (same keys, other shapes)."""
    from diffusers import FluxTransformer2DModel

    folder = Path(shutil.copytree(tiny_flux_dir, tmp_path / "wider"))
    config = FluxTransformer2DModel.load_config(folder / "transformer")
    config["attention_head_dim"] *= 2
    config["axes_dims_rope"] = [2 * d for d in config["axes_dims_rope"]]
    shutil.rmtree(folder / "transformer")
    FluxTransformer2DModel.from_config(config).save_pretrained(folder / "transformer")
    return folder


@pytest.mark.parametrize("resume", ["auto", "path"])
def test_a_checkpoint_of_another_model_is_one_line(resume, trained, tiny_flux_dir, launch, tmp_path):
    """Not damage: resume=auto does not fall back to an older checkpoint of the same other model."""
    run_dir = copy_run(trained, tmp_path)
    before = files_of(run_dir / "checkpoints")
    latest = run_dir / "checkpoints" / "step_00000002"
    overrides = [f"model.path={other_model(tiny_flux_dir, tmp_path)}", "model.build_tiny=null", "num_steps=3"]
    overrides.append(f"resume={'auto' if resume == 'auto' else latest}")
    line = refused_line(launch, run_dir, *overrides)
    assert re.search(r"other settings .*\(model\.path '.*' -> '.*wider'\)", line), line
    # another copy of the model: its weights tell
    line = refused_line(launch, run_dir, *overrides, "checkpoint.allow_changed=[model.path]")
    assert re.search(r"was saved from a model of another size \(Size mismatch", line), line
    assert files_of(run_dir / "checkpoints") == before


def test_a_full_checkpoint_into_a_lora_run_is_one_line(trained, launch, tmp_path):
    run_dir = copy_run(trained, tmp_path)
    overrides = ["num_steps=3", "resume=auto", "model.lora.enabled=true", "checkpoint.allow_changed=[model.lora]"]
    line = refused_line(launch, run_dir, *overrides, kept=run_dir)
    assert re.search(r"does not hold this model's weights.*model\.lora", line), line


def test_a_checkpoint_at_num_steps_trains_nothing(trained, launch, tmp_path):
    run_dir = copy_run(trained, tmp_path)
    status, stderr, stdout = launch(run_dir, "num_steps=2", "resume=auto", stdout=True)
    assert status == 0, stderr
    assert "nothing to train" in stdout + stderr
    assert [m["step"] for m in metrics(run_dir)] == [0, 1]


def test_a_resume_keeps_each_session_configuration(trained, launch, tmp_path):
    run_dir = copy_run(trained, tmp_path)
    first = (run_dir / "config.yaml").read_text()
    status, _ = launch(run_dir, "num_steps=3", "resume=auto", "seed=7", "checkpoint.allow_changed=[seed]")
    assert status == 0
    assert (run_dir / "config.yaml").read_text() == first
    assert "seed: 7" in (run_dir / "config.2.yaml").read_text()
    assert [m["step"] for m in metrics(run_dir)] == [0, 1, 2]


def test_a_resume_with_other_inner_epochs_is_refused_unless_allowed(trained, launch, tmp_path):
    """grpo.inner_epochs changes what the next steps compute (their passes over each rollout), as the other grpo
    settings do: a resume with 2 passes is refused in one line naming it and the fix, the run folder untouched; named
    in checkpoint.allow_changed, the run goes on from the checkpoint's step, each later step in two passes."""
    run_dir = copy_run(trained, tmp_path)
    two = ["num_steps=3", "resume=auto", "grpo.inner_epochs=2"]
    line = refused_line(launch, run_dir, *two, kept=run_dir)
    assert re.search(r"\(grpo\.inner_epochs 1 -> 2\).*checkpoint\.allow_changed=\[grpo\.inner_epochs\]", line), line
    status, stderr = launch(run_dir, *two, "checkpoint.allow_changed=[grpo.inner_epochs]")
    assert status == 0, stderr
    rows = metrics(run_dir)
    assert [m["step"] for m in rows] == [0, 1, 2]
    assert not any(key.startswith("train/pass") for key in rows[1]) and 0 <= rows[2]["train/pass2/clip_frac"] <= 1


def test_a_resume_on_fewer_ranks_that_changes_the_global_batch_is_one_line(trained, launch, tmp_path):
    """The latest checkpoint as 2 ranks would have saved it (its marker says world size 2), resumed by 1 process:
    refused in one line naming the batch before and after and the per-rank setting that keeps it."""
    run_dir = copy_run(trained, tmp_path)
    marker_path = run_dir / "checkpoints" / "step_00000002" / "COMPLETE"
    marker_path.write_text(json.dumps({**json.loads(marker_path.read_text()), "world_size": 2}))
    line = refused_line(launch, run_dir, "num_steps=3", "resume=auto", kept=run_dir)
    assert re.search(
        r"the global batch changes: 2 prompts per step \(2 ranks x batch\.prompts_per_rank=1\), now 1 \(1 rank x "
        r"batch\.prompts_per_rank=1\).*keep it with batch\.prompts_per_rank=2",
        line,
    ), line


def test_a_resume_that_wraps_other_lora_modules_is_one_line(launch, tmp_path, monkeypatch):
    """The same settings, but the backbone's own LoRA targets changed (another version of its adapter): the
    checkpoint's adapters were saved under other module names, which the recorded list shows."""
    from models.flux import FluxBackbone

    run_dir = tmp_path / "run"
    lora = ["model.lora.enabled=true", "model.lora.rank=2", "num_steps=1"]
    assert launch(run_dir, *lora, "checkpoint.export=false")[0] == 0
    wrapped = len(
        json.loads((run_dir / "checkpoints" / "step_00000001" / "COMPLETE").read_text())["settings"][
            "model.lora.modules"
        ]
    )
    monkeypatch.setattr(FluxBackbone, "lora_target_modules", ["attn.to_q"])
    line = refused_line(launch, run_dir, *lora, "num_steps=2", "resume=auto", kept=run_dir)
    assert re.search(
        rf"\(model\.lora\.modules {wrapped} -> \d+ modules wrapped \(no longer: .*attn\.to_k.*; new: none\)\).*"
        r"allow_changed=\[model\.lora\.modules\]",
        line,
    ), line


def damage_metrics(case: str, path: Path) -> None:
    lines = path.read_bytes().splitlines(keepends=True)
    if case == "not-utf8":  # a byte of another encoding in the row of step 1
        lines[1] = lines[1].replace(b'"step"', b'"st\xe9p"')
    else:  # the row of step 1 cut short by a crash while it was written
        lines[1] = lines[1][: len(lines[1]) // 2]
    path.write_bytes(b"".join(lines))


@pytest.mark.parametrize("case", ["not-utf8", "cut-short"])
def test_a_damaged_metrics_file_is_named_on_resume(case, trained, launch, tmp_path):
    """Non-UTF-8 bytes: one line naming the line and column, before the model loads, nothing changed. A row cut
    short: the run goes on, the line says which row was dropped."""
    run_dir = copy_run(trained, tmp_path)
    damage_metrics(case, run_dir / "metrics.jsonl")
    if case == "not-utf8":
        line = refused_line(launch, run_dir, "num_steps=3", "resume=auto", kept=run_dir)
        assert re.search(r"metrics\.jsonl:2 is not UTF-8 \(byte 0xe9 at column \d+\)", line), line
        return
    status, stderr, stdout = launch(run_dir, "num_steps=3", "resume=auto", stdout=True)
    assert status == 0, stderr
    assert re.search(r"metrics\.jsonl: line 2 was cut short by the crash that ended a session: dropped", stdout)
    assert [m["step"] for m in metrics(run_dir)] == [0, 2]


def test_a_branch_from_an_older_checkpoint_retires_the_later_ones(trained, launch, tmp_path):
    """resume=<step 1> (another lr): step 2's checkpoint and the export of step 2 move to checkpoints/retired/,
    named in one line; metrics.jsonl holds one timeline, which resume=auto then continues."""
    run_dir = copy_run(trained, tmp_path)
    old = contents(run_dir / "checkpoints" / "step_00000002")
    common = ["optimizer.lr=0.01"]
    first = run_dir / "checkpoints" / "step_00000001"
    status, stderr, stdout = launch(run_dir, *common, "num_steps=2", f"resume={first}", stdout=True)
    assert status == 0, stderr
    retired = list((run_dir / "checkpoints" / "retired").iterdir())
    assert len(retired) == 1
    assert sorted(p.name for p in retired[0].iterdir()) == ["export", "metrics.jsonl", "step_00000002"]
    assert contents(retired[0] / "step_00000002") == old
    assert re.search(
        rf"resume=.*step_00000001 starts a new timeline after step 1: the later step_00000002, export moved to "
        rf"{re.escape(str(retired[0]))} with their rows of metrics.jsonl \(resume=auto does not look there",
        stdout,
    ), stdout
    assert contents(run_dir / "checkpoints" / "step_00000002") != old  # the branch's own, with its lr
    assert [m["step"] for m in metrics(run_dir)] == [0, 1]
    assert metrics(retired[0]) == metrics(trained)[1:]  # the retired timeline's row of step 1, as it was
    status, stderr, stdout = launch(run_dir, *common, "num_steps=3", "resume=auto", stdout=True)
    assert status == 0 and re.search(r"resumed from .*/run/checkpoints/step_00000002 at step 2", stdout), stderr
    assert [m["step"] for m in metrics(run_dir)] == [0, 1, 2]


def test_a_resume_from_a_retired_checkpoint_goes_back_to_its_timeline(trained, launch, tmp_path):
    """A branch at step 1 (another lr) trains to step 3; resume=<the retired step 2> then retires the branch and
    brings the first timeline back: its checkpoint of step 2 and its metrics row of step 1, as they were."""
    run_dir = copy_run(trained, tmp_path)
    first_timeline = contents(run_dir / "checkpoints" / "step_00000002")
    common = ["num_steps=3", "checkpoint.every=1"]
    assert launch(run_dir, *common, "optimizer.lr=0.01", f"resume={run_dir / 'checkpoints' / 'step_00000001'}")[0] == 0
    [first] = list((run_dir / "checkpoints" / "retired").iterdir())
    branched = metrics(run_dir)
    status, stderr, stdout = launch(run_dir, *common, f"resume={first / 'step_00000002'}", stdout=True)
    assert status == 0, stderr
    [second] = [p for p in (run_dir / "checkpoints" / "retired").iterdir() if p != first]
    assert sorted(p.name for p in second.iterdir()) == ["export", "metrics.jsonl", "step_00000002", "step_00000003"]
    assert metrics(second) == branched[1:]  # the branch's rows of steps 1 and 2
    assert sorted(p.name for p in first.iterdir()) == ["export"]  # the first timeline's export of step 2 stays
    assert re.search(
        rf"resume=.*step_00000002 goes back to the timeline retired after step 1: the later step_00000002, "
        rf"step_00000003, export moved to {re.escape(str(second))} with their rows of metrics.jsonl; step_00000002 "
        rf"came back into {re.escape(str(run_dir / 'checkpoints'))} with their rows",
        stdout,
    ), stdout
    assert contents(run_dir / "checkpoints" / "step_00000002") == first_timeline
    rows = metrics(run_dir)
    assert [m["step"] for m in rows] == [0, 1, 2] and rows[:2] == metrics(trained)


def test_a_checkpoint_of_another_run_is_refused_and_continued_in_a_new_folder(trained, launch, tmp_path):
    """The latest checkpoint replaced by the same step of another run: resume=auto is refused in one line and
    nothing changes; the way the line names (resume=<it> into a new folder) trains on, as a run of its own."""
    run_dir = copy_run(trained, tmp_path)
    latest = run_dir / "checkpoints" / "step_00000002"
    of_another_run(latest)
    line = refused_line(launch, run_dir, "num_steps=3", "resume=auto", kept=run_dir)
    assert re.search(DAMAGED["of-another-run"][1], line), line
    status, stderr, stdout = launch(tmp_path / "copy", "num_steps=3", f"resume={latest}", stdout=True)
    assert status == 0, stderr
    assert [m["step"] for m in metrics(tmp_path / "copy")] == [2]
    new_id = (tmp_path / "copy" / "run_id").read_text().strip()
    assert new_id not in ("0123456789abcdef", (run_dir / "run_id").read_text().strip())
    copied = (
        rf"resume=.*step_00000002: continuing checkpoint .*step_00000002 of run 0123456789abcdef as a new run {new_id}"
    )
    assert len([line for line in stdout.splitlines() if re.search(copied, line)]) == 1, stdout
    marker = json.loads((tmp_path / "copy" / "checkpoints" / "step_00000003" / "COMPLETE").read_text())
    assert marker["run_id"] == new_id


def test_eval_names_a_damaged_checkpoint(trained, launch, tmp_path):
    """python -m train.eval checks a checkpoint's files as resuming does, before the model loads."""
    run_dir = copy_run(trained, tmp_path)
    latest = run_dir / "checkpoints" / "step_00000002"
    truncate("__0_0.distcp")(latest)
    line = refused_line(launch, tmp_path / "eval", f"eval.transformer={latest}", module=eval_command)
    assert str(latest) in line and re.search(DAMAGED["truncated-distcp"][1], line), line


def flip_last_weight_byte(path: Path) -> None:
    """One byte of the last tensor changed: the file keeps its size and its header reads."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["truncated", "one-weight-changed"])
def test_eval_names_a_damaged_export(damage, trained, launch, tmp_path):
    run_dir = copy_run(trained, tmp_path)
    weights = run_dir / "export" / "diffusion_pytorch_model.safetensors"
    if damage == "truncated":
        truncate(weights.name)(weights.parent)
    else:
        flip_last_weight_byte(weights)
    eval_export = f"eval.transformer={run_dir / 'export'}"
    line = refused_line(launch, tmp_path / "eval", eval_export, module=eval_command, kept=run_dir)
    expected = "does not match the checksum" if damage == "one-weight-changed" else r"(cannot|has \d+ bytes)"
    assert re.search(rf"eval\.transformer=.*export'.*diffusion_pytorch_model\.safetensors {expected}", line), line
    # the run folder itself: its checkpoint stands in for the damaged export
    from train.parts.checkpoint.export import find_weights

    assert find_weights(str(run_dir), "eval.transformer").path == run_dir / "checkpoints" / "step_00000002"


def test_eval_names_a_checkpoint_the_run_pruned(trained, launch, tmp_path):
    """eval.transformer=<an older checkpoint> that the live run pruned meanwhile: one line naming the latest."""
    run_dir = copy_run(trained, tmp_path)
    shutil.rmtree(run_dir / "checkpoints" / "step_00000001")
    pruned = f"eval.transformer={run_dir / 'checkpoints' / 'step_00000001'}"
    line = refused_line(launch, tmp_path / "eval", pruned, module=eval_command)
    assert re.search(
        r"step_00000001' does not exist: the run keeps only .* and pruned it; pick its "
        r"latest, .*step_00000002, or pass the run folder",
        line,
    ), line


def test_a_resume_may_move_a_judge_and_allow_one_of_its_arguments(launch, tmp_path):
    """A judge's address, deadline and concurrency change nothing a step computes: a resume takes them, named in
    one line. Its score_range changes the rewards: refused, the line naming the argument, which allow_changed
    then allows alone (a misspelt key names its nearest)."""
    pytest.importorskip("fastapi")
    from reward_servers import chat, judge_server, serve

    judge = "+reward.components.judge={{base_url: '{}/v1', model: judge, retries: 0{}}}"
    run_dir, kept = tmp_path / "run", ["checkpoint.export=false", "resume=auto"]
    first, _ = judge_server(lambda body, number: chat("Final Score: 3"))
    second, _ = judge_server(lambda body, number: chat("Final Score: 4"))
    with serve(first) as url, serve(second) as moved:
        assert launch(run_dir, "num_steps=1", "checkpoint.export=false", judge.format(url, ""))[0] == 0
        moving = judge.format(moved, ", timeout_s: 30, max_in_flight: 2")
        status, stderr, stdout = launch(run_dir, "num_steps=2", *kept, moving, stdout=True)
        assert status == 0, stderr
        assert re.search(
            rf"changed since checkpoint .*step_00000001, used as given: reward\.components\.judge\.base_url "
            rf"'{url}/v1' -> '{moved}/v1'; reward\.components\.judge\.max_in_flight \(not set\) -> 2; "
            r"reward\.components\.judge\.timeout_s \(not set\) -> 30",
            stdout + stderr,
        ), stdout + stderr
        ranged = [*kept, "num_steps=3", judge.format(moved, ", score_range: [0, 5]")]
        line = refused_line(launch, run_dir, *ranged, kept=run_dir)
        assert re.search(
            r"\(reward\.components\.judge\.score_range \(not set\) -> \[0, 5\]\).*"
            r"checkpoint\.allow_changed=\[reward\.components\.judge\.score_range\]$",
            line,
        ), line
        line = refused_line(launch, run_dir, *ranged, "checkpoint.allow_changed=[reward.components.judge.scor_range]")
        assert re.search(
            r"'reward\.components\.judge\.scor_range' names no .*reward\.components\.judge\.score_range", line
        )
        status, stderr = launch(run_dir, *ranged, "checkpoint.allow_changed=[reward.components.judge.score_range]")
        assert status == 0, stderr
    assert [m["step"] for m in metrics(run_dir)] == [0, 1, 2]


@pytest.mark.slow
def test_a_two_rank_resume_with_a_judge_per_rank_goes_on_and_notes_the_address(launch, tiny_flux_dir, tmp_path):
    """A run trained on one rank with its judge at 127.0.0.1 resumes on two ranks (gloo, the same global batch), each
    with its own judge (base_url http://127.0.${oc.env:RANK}.1:PORT/v1): a judge's address changes nothing a step
    computes, so each rank compares it with the checkpoint's inside the ranks' agreement and goes on; rank 1, whose
    judge moved, names the change in one line on its own output, rank 0, whose judge did not, says nothing. Before
    (an address among the compared settings) rank 1 refused alone and rank 0 lost its peer."""
    pytest.importorskip("fastapi")
    from reward_servers import chat, judge_server, serve
    from small_run import FAST
    from two_ranks import run_ranks

    judge = "+reward.components.judge={{base_url: 'http://{host}:{port}/v1', model: judge, retries: 0}}"
    run_dir, kept = tmp_path / "run", ["checkpoint.export=false", "dist.timeout_s=120"]
    first, first_seen = judge_server(lambda body, number: chat("Final Score: 3"))
    second, second_seen = judge_server(lambda body, number: chat("Final Score: 4"))
    with serve(first) as url, serve(second, host="127.0.1.1", port=int(url.rsplit(":", 1)[1])) as moved:
        port = url.rsplit(":", 1)[1]
        doubled = ["batch.prompts_per_rank=2", "batch.gradient_accumulation_steps=4"]  # two ranks of SMALL_RUN's
        assert launch(run_dir, *kept, *doubled, "num_steps=1", judge.format(host="127.0.0.1", port=port))[0] == 0
        per_rank = judge.format(host="127.0.${oc.env:RANK}.1", port=port)
        args = [*FAST, f"model.path={tiny_flux_dir}", *kept, "num_steps=2", "resume=auto", per_rank]
        ranks = run_ranks("-m", "train", *args, f"hydra.run.dir={run_dir}", timeout=300)
    assert [rank.returncode for rank in ranks] == [0, 0], [rank.stderr[-2000:] for rank in ranks]
    noted = (
        f"resume=auto: changed since checkpoint {run_dir / 'checkpoints' / 'step_00000001'}, used as given: "
        f"reward.components.judge.base_url '{url}/v1' -> '{moved}/v1'"
    )
    assert [line for line in ranks[1].stdout.splitlines() if "changed since checkpoint" in line] == [
        f"[rank 1] WARNING: {noted}"
    ], ranks[1].stdout
    assert "changed since checkpoint" not in ranks[0].stdout + (run_dir / "__main__.log").read_text()
    assert [m["step"] for m in metrics(run_dir)] == [0, 1] and second_seen.bodies  # rank 1 asked its own judge


@pytest.mark.slow
def test_a_resume_whose_settings_changed_on_one_rank_stops_both_ranks_each_with_its_line(trained, tiny_flux_dir,
                                                                                         tmp_path):  # fmt: skip
    """Two ranks (gloo) resume a checkpoint of 2 ranks, each reading the training prompts from its own copy, and rank
    1's copy holds other prompts (a node with a stale file): each rank compares the checkpoint's settings with its
    own inside the ranks' agreement (``agreed``), so rank 1 prints its own refusal naming data.train_prompts, rank
    0 the line naming rank 1's, both exit 2 in seconds, and the run folder is as it was, byte for byte: its Hydra
    record (which rank 1 wrote as well, racing rank 0's record of the folder: config.yaml was once left empty) and its
    log (where rank 1 appended its lines, kept or cut by rank 0's take-back as they came before or after it). Compared
    outside the agreement, rank 1 stopped alone without a line (a refusal every rank raises is printed by rank 0)
    and rank 0 lost its peer in the next collective ("see its own output")."""
    from run_folders import ROOT
    from small_run import FAST, the_error
    from two_ranks import run_ranks

    run_dir = copy_run(trained, tmp_path)
    latest = run_dir / "checkpoints" / "step_00000002"  # as 2 ranks would have saved it: a marker, two rank files
    (latest / "COMPLETE").write_text(json.dumps({**json.loads((latest / "COMPLETE").read_text()), "world_size": 2}))
    shutil.copyfile(latest / "rank0.pt", latest / "rank1.pt")
    prompts = (ROOT / "testbed" / "prompts" / "demo.txt").read_text()
    (tmp_path / "prompts_0.txt").write_text(prompts)
    (tmp_path / "prompts_1.txt").write_text("a prompt the run never trained on\n" + prompts)
    saved = contents(run_dir)
    args = [*FAST, f"model.path={tiny_flux_dir}", f"data.train_prompts={tmp_path}/prompts_${{oc.env:RANK}}.txt"]
    args += ["num_steps=3", "resume=auto", "dist.timeout_s=600", f"hydra.run.dir={run_dir}"]
    ranks = run_ranks("-m", "train", *args, timeout=300)
    assert [rank.returncode for rank in ranks] == [2, 2], [rank.stderr[-2000:] for rank in ranks]
    (own,) = [line for line in ranks[1].stderr.splitlines() if "error:" in line]
    refusal = (
        f"resume=auto: checkpoint {latest} was saved with other settings that change what it means (data.train_prompts"
    )
    assert own.startswith(f"[rank 1] python -m train: error: {refusal} '8 prompts, sha256 "), own
    assert the_error(ranks[0].stderr).startswith(f"python -m train: error: rank 1: {refusal}"), ranks[0].stderr
    assert contents(run_dir) == saved
