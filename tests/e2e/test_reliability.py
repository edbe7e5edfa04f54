"""A user's mistake ends a command in one line; a cluster's faults do not lose or corrupt a run.

* The tables: every bad setting and every damaged checkpoint, run through the command's own entry
  (``train.cli.run_hydra``) in this process, exits with status 2 and one line on stderr naming the
  field or file, no traceback, and leaves the checkpoints of the run it resumes untouched.
* A bug keeps its traceback; a damaged latest checkpoint makes ``resume=auto`` resume from the
  previous one and reach the same weights; a checkpoint past num_steps is refused.
* SIGTERM writes a checkpoint after the step and the resumed run equals an uninterrupted one, bit
  for bit (1 process here; 2 gloo ranks, one signalled, in ``test_sigterm_on_one_of_two_ranks``).
* A stopped rank: the other fails after ``dist.timeout_s`` naming the collective it waited in.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from two_ranks import HELPERS, free_port, run_torchrun

import train.__main__ as train_command
import train.eval.command as eval_command
import train.probe.command as probe_command
import train.trainer as trainer
from train.cli import run_hydra
from train.components.errors import Preempted

ROOT = Path(__file__).resolve().parents[2]
# 5 sampling steps -> 4 trainable transitions = one group of W = 4; one prompt of G = 2 per step.
FAST = [
    "experiment=tiny",
    "sampler.num_steps=5",
    "grpo.group_size=2",
    "grpo.prompts_per_rank=1",
    "grpo.micro_batch=2",
    "grpo.gradient_accumulation_steps=2",
    "logging.sample_every=0",
    "logging.progress_bar=false",
]


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the tiny experiment's prompt file is relative to the repository root


def merged(*lists: list[str]) -> list[str]:
    """Overrides in order, a later one replacing an earlier one of the same key (Hydra refuses two)."""
    by_key = {}
    for override in (o for overrides in lists for o in overrides):
        by_key[override.split("=")[0].lstrip("+")] = override
    return list(by_key.values())


def command(capsys, run_dir: Path, overrides: list[str], module=train_command, *, stdout: bool = False):
    """Run ``python -m <module> overrides`` in this process as its entry point does: (exit status, stderr),
    with ``stdout`` (exit status, stderr, stdout)."""
    try:
        run_hydra(module.main, prog=module.PROG, argv=[*merged(overrides), f"hydra.run.dir={run_dir}"])
        status = 0
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else 1
    captured = capsys.readouterr()
    return (status, captured.err, captured.out) if stdout else (status, captured.err)


def the_error(stderr: str, prog: str = "python -m train") -> str:
    """The one error line of a command (other lines on stderr are library warnings); no traceback."""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.startswith(f"{prog}: error: ")]
    assert len(lines) == 1, stderr
    return lines[0]


def files_of(folder: Path) -> dict[str, tuple[int, int, str]]:
    """Every file under ``folder``: (size, mtime in ns, sha1), to show that nothing was written."""
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns, hashlib.sha1(p.read_bytes()).hexdigest())
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def exported(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(run_dir / "export" / "diffusion_pytorch_model.safetensors")


def assert_same_run(straight: Path, resumed: Path, steps: int) -> None:
    """The resumed run logged each of ``steps`` steps once, with the uninterrupted run's loss, reward
    and gradient norm, and exported the same weights, bit for bit."""
    rows_a, rows_b = metrics(straight), metrics(resumed)
    assert [m["step"] for m in rows_b] == list(range(steps))
    for a, b in zip(rows_a, rows_b):
        for key in ("train/loss", "reward/total", "train/grad_norm"):
            assert a[key] == b[key], (a["step"], key)
    final_a, final_b = exported(straight), exported(resumed)
    for name in final_a:
        assert torch.equal(final_a[name], final_b[name]), name


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_flux_dir) -> Path:
    """A finished 2-step run with checkpoints after steps 1 and 2 (do not modify: copy it)."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    overrides = [*FAST, f"model.path={tiny_flux_dir}", "num_steps=2", "checkpoint.every=1"]
    run_hydra(train_command.main, prog=train_command.PROG, argv=[*overrides, f"hydra.run.dir={run_dir}"])
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000001", "step_00000002"]
    return run_dir


def copy_run(trained: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(trained, tmp_path / "run"))


def non_utf8(tmp_path: Path) -> str:
    path = tmp_path / "latin1.txt"
    path.write_bytes("a cat\nun caf\xe9 au lait\n".encode("latin-1"))
    return str(path)


def utf16(tmp_path: Path) -> str:
    path = tmp_path / "utf16.txt"
    path.write_text("a cat\n", encoding="utf-16")
    return str(path)


# (overrides, what the one line must match). Each runs with resume=auto against the trained run: the
# error must come before anything touches its checkpoints. {tmp} is a folder of the test.
BAD_SETTINGS = {
    # numbers that trained silently into a wrong result before
    "max_grad_norm-nan": (["grpo.max_grad_norm=nan"], r"grpo\.max_grad_norm must be a finite number"),
    "lr-inf": (["grpo.lr=inf"], r"grpo\.lr must be a finite number"),
    "lr-nan": (["grpo.lr=nan"], r"grpo\.lr must be a finite number"),
    "lr-zero": (["grpo.lr=0"], r"grpo\.lr must be > 0, got 0"),
    "adv_eps-negative": (["grpo.adv_eps=-1"], r"grpo\.adv_eps must be >= 0, got -1"),
    "adv_clip_max-negative": (["grpo.adv_clip_max=-1"], r"grpo\.adv_clip_max must be > 0"),
    "clip_range-nan": (["grpo.clip_range=nan"], r"grpo\.clip_range must be a finite number"),
    "kl_beta-nan": (["grpo.kl_beta=nan"], r"grpo\.kl_beta must be a finite number"),
    "kl_beta-negative": (["grpo.kl_beta=-0.1"], r"grpo\.kl_beta must be >= 0"),
    "eta-nan": (["sampler.eta=nan"], r"sampler\.eta must be a finite number"),
    "eta-zero": (["sampler.eta=0"], r"sampler\.eta must be > 0"),
    "shift-nan": (["sampler.shift=nan"], r"sampler\.shift must be a finite number"),
    "noise_level-inf": (["sampler.noise_level=inf"], r"sampler\.noise_level must be a finite number"),
    "checkpoint.every-negative": (["checkpoint.every=-1"], r"checkpoint\.every must be >= 0.*only at the end"),
    "sample_every-negative": (["logging.sample_every=-1"], r"logging\.sample_every must be >= 0"),
    "eval_every-negative": (["logging.eval_every=-1"], r"logging\.eval_every must be >= 0"),
    # the optimizer's settings, which torch checked only after the model loaded
    "betas-above-one": (["grpo.betas=[1.5,0.999]"], r"grpo\.betas\[0\] must be in \[0, 1\), got 1\.5"),
    "betas-one-value": (["grpo.betas=[0.9]"], r"grpo\.betas must be two numbers"),
    "betas-nan": (["grpo.betas=[0.9,nan]"], r"grpo\.betas\[1\] must be a finite number"),
    "weight_decay-negative": (["grpo.weight_decay=-1"], r"grpo\.weight_decay must be >= 0"),
    "ema_decay-one": (["grpo.ema_decay=1.0"], r"grpo\.ema_decay must be in \[0, 1\)"),
    # the rest of the schema, field by field
    "jagg_frac-above-one": (["update.jagg_frac=1.5"], r"update\.jagg_frac must be in \[0, 1\], got 1\.5"),
    "jagg_frac-nan": (["update.jagg_frac=nan"], r"update\.jagg_frac must be a finite number"),
    "timestep_fraction-zero": (["update.timestep_fraction=0"], r"update\.timestep_fraction must be in \(0, 1\]"),
    "auto_threshold": (["update.auto_threshold=2"], r"update\.auto_threshold must be in \[-1, 1\]"),
    "window": (["update.window=3"], r"update\.window=3 does not split"),
    "reuse_velocities": (["update.reuse_velocities=always"], r"update\.reuse_velocities='always' is not valid"),
    "offload-without-reuse": (
        ["update.offload_velocities=true", "update.reuse_velocities=off"],
        r"update\.offload_velocities=true keeps no velocities",
    ),
    "group_size": (["grpo.group_size=1"], r"grpo\.group_size must be >= 2"),
    "micro_batch-zero": (["grpo.micro_batch=0"], r"grpo\.micro_batch must be > 0"),
    "sde_window_size-negative": (["sampler.sde_window_size=-1"], r"sampler\.sde_window_size must be >= 0"),
    "sampler.num_steps": (["sampler.num_steps=1"], r"sampler\.num_steps must be >= 2"),
    "keep_last-zero": (["checkpoint.keep_last=0"], r"checkpoint\.keep_last must be > 0"),
    "num_eval_prompts-negative": (["data.num_eval_prompts=-1"], r"data\.num_eval_prompts must be >= 0"),
    "eval.num_steps-zero": (["eval.num_steps=0"], r"eval\.num_steps must be > 0"),
    "samples_per_prompt-zero": (["eval.samples_per_prompt=0"], r"eval\.samples_per_prompt must be > 0"),
    "plan-setting": (["plan.world_size=8"], r"plan is not a setting of TrainConfig"),  # python -m train.plan's
    "timeout-zero": (["dist.timeout_s=0"], r"dist\.timeout_s must be > 0"),
    "num_steps-zero": (["num_steps=0"], r"num_steps must be > 0"),
    "height-zero": (["model.height=0"], r"model\.height must be > 0"),
    "lora-rank-zero": (["model.lora.rank=0"], r"model\.lora\.rank must be > 0"),
    "lora-init": (["model.lora.init=kaiming"], r"model\.lora\.init='kaiming' is not valid.*gaussian"),
    "model-option-nan": (["model.options.guidance=nan"], r"model\.options\.guidance must be a finite number"),
    "reward-weight-nan": (["reward.components.jpeg_compressibility.weight=nan"], r"jpeg_compressibility\.weight"),
    "reward-weights-zero": (["reward.components.jpeg_compressibility.weight=0"], r"every weight is 0"),
    "reward-argument": (["+reward.components.jpeg_compressibility.qualty=5"], r"reward\.components\.jpeg.*qualty"),
    "device": (["device=tpu"], r"device='tpu' is not valid; accepted values: auto, cpu, cuda"),
    "wandb_mode": (["logging.wandb_mode=off"], r"logging\.wandb_mode='off' is not valid"),
    # Hydra's own errors while composing
    "unknown-key": (["sampler.sde_windw=3"], r"sampler\.sde_windw is not a setting.*sde_window_size"),
    "added-key": (["+grpo.clip_rnage=0.1"], r"grpo\.clip_rnage is not a setting.*grpo\.clip_range"),
    "wrong-type": (["grpo.lr=abc"], r"grpo\.lr: Value 'abc' of type 'str' could not be converted to Float"),
    "unknown-option": (["update=fast"], r"update=fast is not an option of update; accepted values: ablate"),
    "unparsable": (["grpo.lr=1=2"], r"cannot parse the override 'grpo\.lr=1=2'"),
    "required-path": (["experiment=flux_dance"], r"required settings have no value: .*hpsv2\.checkpoint"),
    # files and paths
    "model-path": (["model.build_tiny=null", "model.path=/nonexistent/flux"], r"model\.path='/nonexistent/flux'"),
    "prompts-missing": (["data.train_prompts=/nonexistent.txt"], r"data\.train_prompts='/nonexistent\.txt' does not"),
    "prompts-folder": (["data.train_prompts={tmp}"], r"data\.train_prompts=.* is a folder"),
    "prompts-latin1": (["data.train_prompts={latin1}"], r"latin1\.txt': line 2 is not UTF-8 \(byte 0xe9 at column 7\)"),
    "prompts-utf16": (["data.eval_prompts={utf16}"], r"data\.eval_prompts=.*utf16\.txt' is UTF-16"),
    "resume-missing": (["resume=/nonexistent/step_00000001"], r"resume='/nonexistent/step_00000001': no such"),
    "embedding-cache": (["model.embedding_cache=/nonexistent"], r"model\.embedding_cache='/nonexistent' is not a"),
    "past-num_steps": (["num_steps=1"], r"holds step 2, past num_steps=1"),
}


@pytest.mark.parametrize("case", list(BAD_SETTINGS))
def test_a_bad_setting_is_one_line_before_anything_loads(case, trained, tiny_flux_dir, tmp_path, capsys):
    overrides, expected = BAD_SETTINGS[case]
    paths = {"tmp": str(tmp_path), "latin1": non_utf8(tmp_path), "utf16": utf16(tmp_path)}
    before = files_of(trained / "checkpoints")
    status, stderr = command(
        capsys,
        trained,
        [*FAST, f"model.path={tiny_flux_dir}", "num_steps=2", "resume=auto", *(o.format(**paths) for o in overrides)],
    )
    assert status == 2, stderr
    assert re.search(expected, the_error(stderr)), the_error(stderr)
    assert files_of(trained / "checkpoints") == before


def truncate(name: str):
    def damage(path: Path) -> None:
        data = (path / name).read_bytes()
        (path / name).write_bytes(data[: len(data) // 2])

    return damage


def zero(name: str):
    def damage(path: Path) -> None:
        (path / name).write_bytes(bytes((path / name).stat().st_size))

    return damage


def remove(name: str):
    return lambda path: (path / name).unlink()


def write(name: str, text: str):
    return lambda path: (path / name).write_text(text)


# (damage to the latest checkpoint, what the one line must say, found before the model loads?)
DAMAGED = {
    "truncated-distcp": (truncate("__0_0.distcp"), r"__0_0\.distcp is truncated \(\d+ of \d+ bytes\)"),
    "missing-distcp": (remove("__0_0.distcp"), r"__0_0\.distcp is missing"),
    "zeroed-distcp": (zero("__0_0.distcp"), r"is damaged: its \.distcp shards do not read back"),
    "truncated-rank0": (truncate("rank0.pt"), r"rank0\.pt cannot be read"),
    "zeroed-rank0": (zero("rank0.pt"), r"rank0\.pt cannot be read"),
    "missing-rank0": (remove("rank0.pt"), r"rank0\.pt is missing"),
    "missing-metadata": (remove(".metadata"), r"it has no \.metadata file"),
    "zeroed-metadata": (zero(".metadata"), r"\.metadata cannot be read"),
    "garbage-marker": (write("COMPLETE", "garbage{"), r"its COMPLETE marker is not the JSON the trainer writes"),
    "wrong-step-marker": (write("COMPLETE", '{"step": 7, "world_size": 1}'), r"says step 7, its folder name step 2"),
}


@pytest.mark.parametrize("case", list(DAMAGED))
def test_a_damaged_checkpoint_is_named_in_one_line(case, trained, tiny_flux_dir, tmp_path, capsys):
    damage, expected = DAMAGED[case]
    run_dir = copy_run(trained, tmp_path)
    latest = run_dir / "checkpoints" / "step_00000002"
    damage(latest)
    before = files_of(run_dir / "checkpoints")
    status, stderr = command(capsys, run_dir, [*FAST, f"model.path={tiny_flux_dir}", "num_steps=3", f"resume={latest}"])
    line = the_error(stderr)
    assert status == 2 and str(latest) in line and re.search(expected, line), line
    assert "weights_only" not in line  # torch's advice for a damaged file would not help
    assert files_of(run_dir / "checkpoints") == before


@pytest.mark.parametrize("case", ["truncated-distcp", "zeroed-distcp", "garbage-marker"])
def test_resume_auto_falls_back_past_a_damaged_latest_checkpoint(case, trained, tiny_flux_dir, tmp_path, capsys):
    """Checkpoint 2 is damaged: the run resumes from checkpoint 1, replays step 1 and writes the weights
    of the uninterrupted run; the damage is reported (caught early or while loading the tensors)."""
    run_dir = copy_run(trained, tmp_path)
    DAMAGED[case][0](run_dir / "checkpoints" / "step_00000002")
    status, stderr = command(capsys, run_dir, [*FAST, f"model.path={tiny_flux_dir}", "num_steps=2", "resume=auto"])
    assert status == 0, stderr
    assert [m["step"] for m in metrics(run_dir)] == [0, 1]
    final, original = exported(run_dir), exported(trained)
    assert final.keys() == original.keys()
    for name in final:
        assert torch.equal(final[name], original[name]), name


def test_resume_auto_with_every_checkpoint_damaged_is_an_error(trained, tiny_flux_dir, tmp_path, capsys):
    run_dir = copy_run(trained, tmp_path)
    for path in (run_dir / "checkpoints").iterdir():
        (path / ".metadata").unlink()
    status, stderr = command(capsys, run_dir, [*FAST, f"model.path={tiny_flux_dir}", "num_steps=3", "resume=auto"])
    assert status == 2 and re.search(r"resume=auto: no checkpoint under .* can be resumed from", the_error(stderr))


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
def test_a_checkpoint_of_another_model_is_one_line(resume, trained, tiny_flux_dir, tmp_path, capsys):
    """Not damage: resume=auto does not fall back to an older checkpoint of the same other model."""
    run_dir = copy_run(trained, tmp_path)
    before = files_of(run_dir / "checkpoints")
    latest = run_dir / "checkpoints" / "step_00000002"
    overrides = [*FAST, f"model.path={other_model(tiny_flux_dir, tmp_path)}", "model.build_tiny=null", "num_steps=3"]
    status, stderr = command(capsys, run_dir, [*overrides, f"resume={'auto' if resume == 'auto' else latest}"])
    line = the_error(stderr)
    assert status == 2 and re.search(r"was saved from a model of another size \(Size mismatch", line), line
    assert files_of(run_dir / "checkpoints") == before


def test_a_full_checkpoint_into_a_lora_run_is_one_line(trained, tiny_flux_dir, tmp_path, capsys):
    run_dir = copy_run(trained, tmp_path)
    overrides = [*FAST, f"model.path={tiny_flux_dir}", "num_steps=3", "resume=auto", "model.lora.enabled=true"]
    status, stderr = command(capsys, run_dir, overrides)
    assert status == 2 and re.search(r"does not hold this model's weights.*model\.lora", the_error(stderr))


def test_a_checkpoint_at_num_steps_trains_nothing(trained, tiny_flux_dir, tmp_path, capsys):
    run_dir = copy_run(trained, tmp_path)
    overrides = [*FAST, f"model.path={tiny_flux_dir}", "num_steps=2", "resume=auto"]
    status, stderr, stdout = command(capsys, run_dir, overrides, stdout=True)
    assert status == 0, stderr
    assert "nothing to train" in stdout + stderr
    assert [m["step"] for m in metrics(run_dir)] == [0, 1]


@pytest.mark.parametrize("where", ["under-a-file", "checkpoints-is-a-file", "read-only"])
def test_an_unwritable_run_folder_is_one_line_before_training(where, tiny_flux_dir, tmp_path, capsys):
    if where == "read-only" and os.geteuid() == 0:
        pytest.skip("root writes into read-only folders")
    run_dir = tmp_path / "run"
    if where == "under-a-file":
        (tmp_path / "file").write_text("")
        run_dir = tmp_path / "file" / "run"
    elif where == "checkpoints-is-a-file":
        run_dir.mkdir()
        (run_dir / "checkpoints").write_text("")
    else:
        run_dir.mkdir()
        run_dir.chmod(0o555)
    status, stderr = command(capsys, run_dir, [*FAST, f"model.path={tiny_flux_dir}", "num_steps=1"])
    assert status == 2
    assert re.search(r"(run folder|run_dir).*(Not a directory|File exists|Permission denied)", the_error(stderr))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_bug_keeps_its_traceback(tiny_flux_dir, tmp_path, capsys, monkeypatch):
    def broken(cfg):
        raise RuntimeError("an internal bug")

    monkeypatch.setattr(trainer, "run", broken)
    with pytest.raises(RuntimeError, match="an internal bug"):
        command(capsys, tmp_path / "run", [*FAST, f"model.path={tiny_flux_dir}"])


@pytest.mark.parametrize(
    "module, overrides",
    [
        (eval_command, ["eval.batch_size=0"]),
        (probe_command, ["probe.threshold=nan"]),
    ],
)
def test_the_other_commands_report_the_same_way(module, overrides, tiny_flux_dir, tmp_path, capsys):
    status, stderr = command(capsys, tmp_path / "run", [*FAST, f"model.path={tiny_flux_dir}", *overrides], module)
    field = overrides[0].split("=")[0]
    assert status == 2 and field in the_error(stderr, module.PROG)


def test_eval_names_a_damaged_checkpoint(trained, tiny_flux_dir, tmp_path, capsys):
    """python -m train.eval checks a checkpoint's files as resuming does, before the model loads."""
    run_dir = copy_run(trained, tmp_path)
    latest = run_dir / "checkpoints" / "step_00000002"
    truncate("__0_0.distcp")(latest)
    overrides = [*FAST, f"model.path={tiny_flux_dir}", f"eval.transformer={latest}"]
    status, stderr = command(capsys, tmp_path / "eval", overrides, eval_command)
    line = the_error(stderr, eval_command.PROG)
    assert status == 2 and str(latest) in line and re.search(DAMAGED["truncated-distcp"][1], line), line


def sigterm_at(step: int, monkeypatch) -> None:
    """SIGTERM to this process during training step ``step``, as a scheduler would send it."""
    real = trainer.train_step

    def step_then_signal(run, k):
        out = real(run, k)
        if k == step:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(trainer, "train_step", step_then_signal)


@pytest.mark.slow
def test_sigterm_checkpoints_and_resume_is_bit_identical(tiny_flux_dir, tmp_path, capsys, monkeypatch):
    common = [*FAST, f"model.path={tiny_flux_dir}", "num_steps=4", "checkpoint.every=0"]
    assert command(capsys, tmp_path / "straight", common)[0] == 0
    sigterm_at(1, monkeypatch)
    status, stderr = command(capsys, tmp_path / "stopped", common)
    assert status == Preempted.exit_code == 143
    line = [line for line in stderr.splitlines() if line.startswith("python -m train: stopped: ")]
    assert len(line) == 1 and "step_00000002 after step 2" in line[0] and "resume=auto" in line[0], stderr
    assert [p.name for p in (tmp_path / "stopped" / "checkpoints").iterdir()] == ["step_00000002"]
    assert not (tmp_path / "stopped" / "export").exists()
    monkeypatch.undo()
    monkeypatch.chdir(ROOT)
    assert command(capsys, tmp_path / "stopped", [*common, "resume=auto"])[0] == 0
    assert_same_run(tmp_path / "straight", tmp_path / "stopped", steps=4)


def test_a_resumed_run_logs_each_step_once(tiny_flux_dir, tmp_path, capsys, monkeypatch):
    """A crash in step 3 after the checkpoint of step 2 left rows 0..2 (and the evaluation after step 2):
    the resumed run drops row 2 before replaying it, and keeps that evaluation (it does not rerun it)."""
    common = [
        *FAST,
        f"model.path={tiny_flux_dir}",
        "num_steps=4",
        "checkpoint.every=2",
        "logging.eval_every=2",
        "+eval.scorers.jpeg_compressibility={}",
        "eval.num_steps=2",
        "data.num_eval_prompts=2",
    ]
    real = trainer.train_step

    def crash_in_step_3(run, k):
        if k == 3:
            raise KeyboardInterrupt  # the process dies; nothing after the checkpoint of step 2 survives
        return real(run, k)

    monkeypatch.setattr(trainer, "train_step", crash_in_step_3)
    with pytest.raises(KeyboardInterrupt):
        command(capsys, tmp_path / "run", common)
    monkeypatch.setattr(trainer, "train_step", real)
    assert command(capsys, tmp_path / "run", [*common, "resume=auto"])[0] == 0
    rows = [(m["step"], "eval" if "eval/jpeg_compressibility" in m else "train") for m in metrics(tmp_path / "run")]
    assert rows == [
        (0, "eval"),
        (0, "train"),
        (1, "train"),
        (2, "eval"),
        (2, "train"),
        (3, "train"),
        (4, "eval"),
    ]


@pytest.mark.slow
def test_sigterm_on_one_of_two_ranks(tiny_flux_dir, tmp_path):
    """2 gloo ranks; SIGTERM reaches rank 1 only. Both stop after the same step, write one checkpoint
    and exit; resume=auto then ends where the uninterrupted 2-rank run ends, bit for bit."""
    common = [*FAST, f"model.path={tiny_flux_dir}", "num_steps=3", "checkpoint.every=0"]
    cases = {
        "straight": {"overrides": [*common, f"run_dir={tmp_path / 'straight'}"]},
        "stopped": {"overrides": [*common, f"run_dir={tmp_path / 'stopped'}"], "sigterm": {"rank": 1, "step": 0}},
        "resumed": {"overrides": [*common, f"run_dir={tmp_path / 'stopped'}", "resume=auto"]},
    }
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    result = run_torchrun(str(HELPERS / "reliability_worker.py"), str(tmp_path / "cases.json"), timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    outcome = json.loads((tmp_path / "outcome.json").read_text())
    assert outcome["stopped"] == {"0": "Preempted", "1": "Preempted"}, outcome
    assert_same_run(tmp_path / "straight", tmp_path / "stopped", steps=3)


@pytest.mark.slow
def test_a_stopped_rank_makes_the_other_fail_naming_the_collective(tiny_flux_dir, tmp_path):
    """Two ``python -m train`` processes (gloo); once step 0 is logged, rank 1 is stopped (SIGSTOP). Rank 0
    fails after dist.timeout_s with one line naming the collective and what it was doing."""
    run_dir, port = tmp_path / "run", free_port()
    args = [*FAST, f"model.path={tiny_flux_dir}", "num_steps=50", "dist.timeout_s=10", f"hydra.run.dir={run_dir}"]
    procs = []
    for rank in (0, 1):
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "train", *args], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True
            )
        )
    try:
        deadline = time.monotonic() + 300
        while not ((run_dir / "metrics.jsonl").is_file() and (run_dir / "metrics.jsonl").read_text()):
            assert time.monotonic() < deadline and procs[0].poll() is None, "step 0 never finished"
            time.sleep(0.2)
        procs[1].send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        _, stderr = procs[0].communicate(timeout=120)
        waited = time.monotonic() - stopped_at
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert procs[0].returncode == 1, stderr
    line = the_error(stderr)
    assert re.search(r"the collective \w*(all_reduce|all_gather|broadcast|barrier|reduce_scatter)\w*", line), line
    assert re.search(r"during training step \d+, timed out after 10 s \(dist\.timeout_s\)", line), line
    assert 9 < waited < 60, waited
