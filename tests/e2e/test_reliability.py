"""A user's mistake ends a command in one line; a cluster's faults do not lose or corrupt a run.

* The tables: every bad setting and every damaged checkpoint, run through the command's own entry
  (``train.cli.reporting.run_hydra``) in this process, exits with status 2 and one line on stderr naming the
  field or file, no traceback, and leaves the checkpoints of the run it resumes untouched.
* A bug keeps its traceback; a damaged latest checkpoint makes ``resume=auto`` resume from the
  previous one and reach the same weights; a checkpoint past num_steps is refused.
* SIGTERM writes a checkpoint after the step and the resumed run equals an uninterrupted one, bit
  for bit (1 process here; 2 gloo ranks, one signalled, in ``test_sigterm_on_one_of_two_ranks``).
* A stopped rank: the other fails after ``dist.timeout_s`` naming the collective it waited in.
* Nothing lost: a folder that holds a run is refused (unless resumed or overwritten) and a refused
  launch leaves no trace; a live owner of the folder is named; a resume that changes what the weights
  mean is refused; checkpoint files that were mixed up fail their checksums; a full disk is named
  before a save; the steps trained before a failure are saved.
* Nothing silent: a run that cannot learn (NaN rewards, rewards that cancel, NaN weights) stops after
  ``health.max_bad_steps`` with its checkpoint; a failing job of a sweep does not stop the others.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from run_folders import (
    ROOT,
    contents,
    copy_run,
    files_of,
    metrics,
    metrics_refused_after_one_row,
    nan_rewards,
    sigterm_at,
)
from safetensors.torch import load_file
from small_run import FAST, command, the_error
from two_ranks import HELPERS, free_port, run_ranks, run_torchrun

import train.__main__ as train_command
import train.cli.check as check_command
import train.eval.command as eval_command
import train.probe.command as probe_command
import train.trainer as trainer
from train.cli.reporting import run_hydra
from train.ground.errors import Preempted
from train.model import builder
from train.observe.observe_config import HealthConfig
from train.reward import scorers

pytestmark = pytest.mark.usefixtures("repo_root")  # the tiny experiment's prompt file is relative to the repository


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


def non_utf8(tmp_path: Path) -> str:
    path = tmp_path / "latin1.txt"
    path.write_bytes("a cat\nun caf\xe9 au lait\n".encode("latin-1"))
    return str(path)


def fifo(tmp_path: Path) -> str:
    """A named pipe, as a shell's <(...) hands one: it could be read once (nobody writes it here)."""
    path = tmp_path / "fifo.txt"
    os.mkfifo(path)
    return str(path)


def prompt_file(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def utf16(tmp_path: Path) -> str:
    path = tmp_path / "utf16.txt"
    path.write_text("a cat\n", encoding="utf-16")
    return str(path)


# (overrides, what the one line must match). Each runs with resume=auto against the trained run: the
# error must come before anything touches its checkpoints. {tmp} is a folder of the test.
BAD_SETTINGS = {
    # numbers that trained silently into a wrong result before
    "max_grad_norm-nan": (["optimizer.max_grad_norm=nan"], r"optimizer\.max_grad_norm must be a finite number"),
    "lr-inf": (["optimizer.lr=inf"], r"optimizer\.lr must be a finite number"),
    "lr-nan": (["optimizer.lr=nan"], r"optimizer\.lr must be a finite number"),
    "lr-zero": (["optimizer.lr=0"], r"optimizer\.lr must be > 0, got 0"),
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
    "eval_every-negative": (["eval.every=-1"], r"eval\.every must be >= 0"),
    # the optimizer's settings, which torch checked only after the model loaded
    "betas-above-one": (["optimizer.betas=[1.5,0.999]"], r"optimizer\.betas\[0\] must be in \[0, 1\), got 1\.5"),
    "betas-one-value": (["optimizer.betas=[0.9]"], r"optimizer\.betas must be two numbers"),
    "betas-nan": (["optimizer.betas=[0.9,nan]"], r"optimizer\.betas\[1\] must be a finite number"),
    "weight_decay-negative": (["optimizer.weight_decay=-1"], r"optimizer\.weight_decay must be >= 0"),
    "ema_decay-one": (["ema.decay=1.0"], r"ema\.decay must be in \[0, 1\)"),
    # the rest of the schema, field by field
    "jagg_frac-above-one": (["update.jagg_frac=1.5"], r"update\.jagg_frac must be in \[0, 1\], got 1\.5"),
    "jagg_frac-nan": (["update.jagg_frac=nan"], r"update\.jagg_frac must be a finite number"),
    "timestep_fraction-zero": (["update.timestep_fraction=0"], r"update\.timestep_fraction must be in \(0, 1\]"),
    "auto_threshold": (["update.auto_threshold=2"], r"update\.auto_threshold must be in \[-1, 1\]"),
    "segment_length": (["update.segment_length=3"], r"update\.segment_length=3 does not split"),
    "reuse_velocities": (["update.reuse_velocities=always"], r"update\.reuse_velocities='always' is not valid"),
    "offload-without-reuse": (
        ["update.offload_velocities=true", "update.reuse_velocities=off"],
        r"update\.offload_velocities=true keeps no velocities",
    ),
    "group_size": (["grpo.group_size=1"], r"grpo\.group_size must be >= 2"),
    "micro_batch-zero": (["batch.micro_batch=0"], r"batch\.micro_batch must be > 0"),
    "sde_window_size-negative": (["sampler.sde_window_size=-1"], r"sampler\.sde_window_size must be >= 0"),
    "sampler.num_steps": (["sampler.num_steps=1"], r"sampler\.num_steps must be >= 2"),
    "keep_last-zero": (["checkpoint.keep_last=0"], r"checkpoint\.keep_last must be > 0"),
    "num_eval_prompts-negative": (["eval.num_prompts=-1"], r"eval\.num_prompts must be >= 0"),
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
    "reward-argument": (
        ["+reward.components.jpeg_compressibility.qualty=5", "checkpoint.allow_changed=[reward]"],
        r"reward\.components\.jpeg.*qualty",
    ),
    "device": (["device=tpu"], r"device='tpu' is not valid; accepted values: auto, cpu, cuda"),
    "wandb_mode": (["logging.wandb_mode=off"], r"logging\.wandb_mode='off' is not valid"),
    # Hydra's own errors while composing
    "unknown-key": (["sampler.sde_windw=3"], r"sampler\.sde_windw is not a setting.*sde_window_size"),
    "moved-key": (["grpo.lr=1e-4"], r"error: grpo\.lr is now optimizer\.lr$"),
    "moved-key-added": (["+logging.eval_every=1"], r"error: logging\.eval_every is now eval\.every$"),
    "added-key": (["+grpo.clip_rnage=0.1"], r"grpo\.clip_rnage is not a setting.*grpo\.clip_range"),
    "wrong-type": (["optimizer.lr=abc"], r"optimizer\.lr: Value 'abc' of type 'str' could not be converted to Float"),
    "unknown-option": (["update=fast"], r"update=fast is not an option of update; accepted values: ablate"),
    "unparsable": (["optimizer.lr=1=2"], r"cannot parse the override 'optimizer\.lr=1=2'"),
    "required-path": (["experiment=flux_dance"], r"required settings have no value: .*hpsv2\.checkpoint"),
    # files and paths
    "model-path": (["model.build_tiny=null", "model.path=/nonexistent/flux"], r"model\.path='/nonexistent/flux'"),
    "prompts-missing": (["data.train_prompts=/nonexistent.txt"], r"data\.train_prompts='/nonexistent\.txt' does not"),
    "prompts-folder": (["data.train_prompts={tmp}"], r"data\.train_prompts=.* is a folder"),
    "prompts-fifo": (["data.train_prompts={fifo}"], r"data\.train_prompts=.*fifo\.txt' is a pipe or another file"),
    "prompts-latin1": (["data.train_prompts={latin1}"], r"latin1\.txt': line 2 is not UTF-8 \(byte 0xe9 at column 7\)"),
    "prompts-utf16": (["eval.prompts={utf16}"], r"eval\.prompts=.*utf16\.txt' is UTF-16"),
    "resume-missing": (["resume=/nonexistent/step_00000001"], r"resume='/nonexistent/step_00000001': no such"),
    "embedding-cache": (["model.embedding_cache=/nonexistent"], r"model\.embedding_cache='/nonexistent' is not a"),
    "past-num_steps": (["num_steps=1"], r"holds step 2, past num_steps=1"),
    "prompt-null": (
        ["eval.prompts={null_prompt}"],
        r"null\.jsonl:2: 'prompt' must be a non-empty string, got null",
    ),
    "prompt-empty": (["eval.prompts={empty_prompt}"], r"empty\.jsonl:1: 'prompt' must be a non-empty string"),
    "prompt-nul": (["data.train_prompts={nul_prompt}"], r"data\.train_prompts: .*nul\.txt:2 holds a NUL byte"),
    "category-list": (["eval.prompts={list_category}"], r"category\.jsonl:1: 'category' must be a string or null"),
    "reward-twice": (
        [
            "reward.components={{jpeg_compressibility: {{weight: 1}}, jpeg_compressibility: {{weight: 2}}}}"
        ],  # str.format
        r"reward\.components: the value names 'jpeg_compressibility' twice",
    ),
    # sizes and files that were read only when the model or a scorer loaded
    "height-not-a-multiple": (
        ["model.height=33", "checkpoint.allow_changed=[model.height]"],
        r"model\.height / model\.width: .*multiples of 4 \(the VAE's 2 .*33x32",
    ),
    "width-not-a-multiple": (
        ["model.width=30", "checkpoint.allow_changed=[model.width]"],
        r"model\.height / model\.width: .*multiples of 4 .*got 32x30",
    ),
    "vae-folder": (
        ["+model.options.vae={tmp}", "checkpoint.allow_changed=[model.options]"],
        r"model: flux: component 'vae' is missing: .*config\.json does not",
    ),
    "reward-file": (
        ["+reward.components.clipscore.model_path=/nonexistent/clip", "checkpoint.allow_changed=[reward]"],
        r"reward\.components\.clipscore\.model_path='/nonexistent/clip' does not exist",
    ),
    "eval-scorer-file": (
        ["eval.every=1", "+eval.scorers.clipscore.model_path=/nonexistent/clip"],
        r"eval\.scorers\.clipscore\.model_path='/nonexistent/clip' does not exist",
    ),
    "eval-scorer-argument": (
        ["eval.every=1", "+eval.scorers.jpeg_compressibility.qualty=5"],
        r"eval\.scorers\.jpeg_compressibility: .*qualty",
    ),
    "overwrite-and-resume": (["checkpoint.overwrite=true"], r"checkpoint\.overwrite=true .* resume=auto .*pick one"),
    "allow_changed-unknown": (
        ["checkpoint.allow_changed=[optimizer.lr]"],
        r"checkpoint\.allow_changed: 'optimizer\.lr' may change on resume without it",
    ),
    # settings that would do nothing on the tiny experiment, which has no SDE window
    "post_window-without-window": (
        ["sampler.post_window.solver=dpmpp_2m"],
        r"sampler\.post_window\.solver=dpmpp_2m sets the steps after the SDE window, and sampler\.sde_window_size=0",
    ),
    "moving-window-without-window": (
        ["sampler.sde_window_schedule=progressive"],
        r"sampler\.sde_window_schedule=progressive moves the SDE window, and sde_window_size=0 has none",
    ),
    "max_bad_steps-negative": (["health.max_bad_steps=-1"], r"health\.max_bad_steps must be >= 0"),
    "max_weight_growth-below-one": (["health.max_weight_growth=0.5"], r"health\.max_weight_growth must be > 1"),
    "flat_image_range-one": (["health.flat_image_range=1"], r"health\.flat_image_range must be in \[0, 1\)"),
    "lr-typo": (["optimizer.lr=1e9"], r"optimizer\.lr must be < 1, got 1000000000\.0 \(AdamW moves every weight"),
    "lora-target-typo": (
        [
            "model.lora.enabled=true",
            "model.lora.target_modules=[attn.to_q,attn.to_qq]",
            "checkpoint.allow_changed=[model.lora]",
        ],
        r"model\.lora\.target_modules: attn\.to_qq name no module of the transformer in ",
    ),
    "lora-target-empty": (["model.lora.target_modules=['']"], r"model\.lora\.target_modules must be module-name"),
    "changed-lora-targets": (
        ["model.lora.target_modules=[attn.to_q]"],
        r"\(model\.lora\.target_modules \[\] -> \['attn\.to_q'\]\).*allow_changed=\[model\.lora\.target_modules\]",
    ),
    "changed-seed": (["seed=7"], r"saved with other settings .*\(seed 42 -> 7\).*checkpoint\.allow_changed=\[seed\]"),
    "changed-prompts": (
        ["data.train_prompts={other_prompts}"],
        r"\(data\.train_prompts .* -> .*\).*checkpoint\.allow_changed=\[data\.train_prompts\]",
    ),
    "changed-grpo": (
        ["grpo.group_size=4", "grpo.kl_beta=0.5", "grpo.clip_range=0.5"],
        r"\(grpo\.clip_range .* -> 0\.5; grpo\.group_size 2 -> 4; grpo\.kl_beta .* -> 0\.5\)",
    ),
    "changed-meaning": (
        ["update.mode=exact", "sampler.eta=0.5", "model.lora.enabled=true"],
        r"\(model\.lora\.enabled False -> True; sampler\.eta 0\.3 -> 0\.5; update\.mode 'jagg' -> 'exact'\)",
    ),
}
if not torch.cuda.is_available():
    BAD_SETTINGS["cuda-missing"] = (["device=cuda"], r"device=cuda but CUDA is not available on this machine")


@pytest.mark.parametrize("case", list(BAD_SETTINGS))
def test_a_bad_setting_is_one_line_before_anything_loads(case, trained, tiny_flux_dir, tmp_path, capsys, monkeypatch):
    overrides, expected = BAD_SETTINGS[case]
    for module, name in ((builder, "load_backbone"), (scorers, "build_scorer")):  # neither loads before the error
        monkeypatch.setattr(module, name, lambda *args, what=name, **kwargs: pytest.fail(f"{what} ran"))
    paths = {
        "tmp": str(tmp_path),
        "fifo": fifo(tmp_path),
        "latin1": non_utf8(tmp_path),
        "utf16": utf16(tmp_path),
        "null_prompt": prompt_file(tmp_path, "null.jsonl", '{"prompt": "a cat"}\n{"prompt": null}\n'),
        "empty_prompt": prompt_file(tmp_path, "empty.jsonl", '{"prompt": " "}\n'),
        "nul_prompt": prompt_file(tmp_path, "nul.txt", "a cat\na d\x00og\n"),
        "list_category": prompt_file(tmp_path, "category.jsonl", '{"prompt": "a cat", "category": ["animal"]}\n'),
        "other_prompts": prompt_file(tmp_path, "other.txt", "a red cube\na blue ball\n"),
    }
    before, saved = files_of(trained / "checkpoints"), contents(trained)
    status, stderr = command(
        capsys,
        trained,
        [*FAST, f"model.path={tiny_flux_dir}", "num_steps=2", "resume=auto", *(o.format(**paths) for o in overrides)],
    )
    assert status == 2, stderr
    assert re.search(expected, the_error(stderr)), the_error(stderr)
    assert files_of(trained / "checkpoints") == before
    assert contents(trained) == saved  # Hydra's .hydra/ and log file too: the refused launch took them back


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
    assert status == 2 and re.search(r"other settings .*\(model\.path '.*' -> '.*wider'\)", the_error(stderr))
    overrides.append("checkpoint.allow_changed=[model.path]")  # another copy of the model: its weights tell
    status, stderr = command(capsys, run_dir, [*overrides, f"resume={'auto' if resume == 'auto' else latest}"])
    line = the_error(stderr)
    assert status == 2 and re.search(r"was saved from a model of another size \(Size mismatch", line), line
    assert files_of(run_dir / "checkpoints") == before


def test_a_full_checkpoint_into_a_lora_run_is_one_line(trained, tiny_flux_dir, tmp_path, capsys):
    run_dir = copy_run(trained, tmp_path)
    overrides = [*FAST, f"model.path={tiny_flux_dir}", "num_steps=3", "resume=auto", "model.lora.enabled=true"]
    status, stderr = command(capsys, run_dir, [*overrides, "checkpoint.allow_changed=[model.lora]"])
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


def test_sighup_checkpoints_like_sigterm(tiny_flux_dir, tmp_path, capsys, monkeypatch):
    """A closed terminal (SIGHUP) during step 0: the step ends, its checkpoint is written, the one line says so
    (on stderr and in the run's log file), status 129, the lock is released."""
    sigterm_at(0, monkeypatch, signal.SIGHUP)
    run_dir = tmp_path / "run"
    ignored = signal.signal(signal.SIGHUP, signal.SIG_DFL)  # a suite started under nohup: the trainer would keep that
    try:
        status, stderr = command(capsys, run_dir, [*FAST, f"model.path={tiny_flux_dir}", "num_steps=3"])
    finally:
        signal.signal(signal.SIGHUP, ignored)
    assert status == 128 + signal.SIGHUP
    line = [line for line in stderr.splitlines() if line.startswith("python -m train: stopped: ")]
    assert len(line) == 1 and "Traceback" not in stderr, stderr
    assert re.search(
        r"SIGHUP \(the terminal or ssh session closed\): wrote checkpoint .*step_00000001 after step 1; "
        r"rerun with resume=auto",
        line[0],
    ), line
    assert line[0] in (run_dir / "__main__.log").read_text()
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_00000001"]
    assert not (run_dir / "LOCK").exists()


def test_help_into_a_reader_that_stops_early_ends_quietly(capsys, monkeypatch):
    """``python -m train --help | head``: the reader closed stdout; no line about the run folder, status 141
    (128 + SIGPIPE), as a process that SIGPIPE ended."""

    class Closed:
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", Closed())
    with pytest.raises(SystemExit) as stop:
        run_hydra(train_command.main, prog=train_command.PROG, argv=["--help"])
    assert stop.value.code == 128 + signal.SIGPIPE
    assert capsys.readouterr().err == ""


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
        "eval.every=2",
        "+eval.scorers.jpeg_compressibility={}",
        "eval.num_steps=2",
        "eval.num_prompts=2",
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
    assert outcome["stopped"] == {"0": "Preempted", "1": "Preempted"}, (outcome, result.stderr[-4000:])
    assert_same_run(tmp_path / "straight", tmp_path / "stopped", steps=3)


@pytest.mark.slow
@pytest.mark.long  # two torchrun ranks over several steps: make test-long
def test_a_failure_on_one_of_two_ranks_saves_the_steps_before_it(tiny_flux_dir, tmp_path):
    """Rank 1's reward raises in step 2 (0-based) after two unsaved steps: both ranks stop at the reward phase's
    check and write step 2's checkpoint together, then fail: rank 1 with its own error, rank 0 naming rank 1."""
    common = [*FAST, f"model.path={tiny_flux_dir}", "num_steps=3", "checkpoint.every=0", "checkpoint.export=false"]
    common += [f"run_dir={tmp_path / 'run'}"]
    cases = {"failed": {"overrides": common, "fail": {"rank": 1, "step": 2}}}
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    result = run_torchrun(str(HELPERS / "reliability_worker.py"), str(tmp_path / "cases.json"), timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    outcome = json.loads((tmp_path / "outcome.json").read_text())
    assert outcome == {"failed": {"0": "RankFailed", "1": "RuntimeError"}}, outcome
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step_00000002"]
    assert [m["step"] for m in metrics(tmp_path / "run")] == [0, 1]


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


def test_every_missing_path_is_named_in_one_line(tmp_path, capsys, monkeypatch):
    """The model folder, a prompt file and a reward's file, all missing: one line names the three, before anything
    loads."""
    monkeypatch.setattr(builder, "load_backbone", lambda *args, **kwargs: pytest.fail("load_backbone ran"))
    missing = [
        "model.path=/nonexistent/model",
        "model.build_tiny=null",
        "data.train_prompts=/nonexistent/train.txt",
        "+reward.components.clipscore.model_path=/nonexistent/clip",
    ]
    status, stderr = command(capsys, tmp_path, [*FAST, *missing])
    line = the_error(stderr)
    assert status == 2
    for name in (
        "data.train_prompts='/nonexistent/train.txt' does not exist",
        "reward.components.clipscore.model_path='/nonexistent/clip' does not exist",
        "model.path='/nonexistent/model' is not a folder",
    ):
        assert name in line, line


# Where rank 1 finds no model folder: its settings check (a folder rank 0 has), or the model's check once rank 0
# built its tiny folder (model.build_tiny; rank 1 reads another path): (overrides, rank 1's line)
MISSING_ON_RANK_1 = {
    "settings": (["model.build_tiny=null"], "model.path='{tmp}/model_1' is not a folder"),
    "model-folder": ([], "model: flux: component 'vae' is missing: {tmp}/model_1/vae/config.json does not exist"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(MISSING_ON_RANK_1))
def test_a_model_folder_missing_on_one_rank_stops_both_ranks_in_seconds(case, tiny_flux_dir, tmp_path):
    """Two ranks (gloo), the model folder at rank 0's path only: both exit 2 in seconds, not after dist.timeout_s,
    and rank 0's one line names rank 1's folder."""
    overrides, expected = MISSING_ON_RANK_1[case]
    if overrides:
        (tmp_path / "model_0").symlink_to(tiny_flux_dir)
    model = f"model.path={tmp_path}/model_${{oc.env:RANK}}"
    args = ["-m", "train", *FAST, model, *overrides, "dist.timeout_s=600", f"hydra.run.dir={tmp_path / 'run'}"]
    ranks = run_ranks(*args, timeout=300)  # a rank waiting in a collective would wait 600 s
    assert [rank.returncode for rank in ranks] == [2, 2], [rank.stderr[-2000:] for rank in ranks]
    line = the_error(ranks[0].stderr)
    assert "rank 1: " + expected.format(tmp=tmp_path) in line, line
    assert not [x for x in ranks[1].stderr.splitlines() if "error:" in x], ranks[1].stderr  # rank 0 says it


def test_a_folder_that_holds_a_run_is_refused_before_anything_is_written(trained, tiny_flux_dir, tmp_path, capsys):
    """A second launch into a finished run's folder (another seed, no resume=) changes nothing in it."""
    run_dir = copy_run(trained, tmp_path)
    saved = contents(run_dir)
    status, stderr = command(capsys, run_dir, [*FAST, f"model.path={tiny_flux_dir}", "num_steps=2", "seed=7"])
    line = the_error(stderr)
    assert status == 2 and re.search(r"run_dir=.* already holds a run \(2 checkpoints .*resume=auto.*overwrite", line)
    assert contents(run_dir) == saved


def test_overwrite_replaces_the_run(trained, tiny_flux_dir, tmp_path, capsys):
    """Nothing of the old run stays for train.eval to score into the new one: its export_raw/ (of a run that
    kept an EMA) and its probe.json go with its checkpoints and metrics."""
    run_dir = copy_run(trained, tmp_path)
    shutil.copytree(run_dir / "export", run_dir / "export_raw")
    (run_dir / "probe.json").write_text("{}")
    overrides = [*FAST, f"model.path={tiny_flux_dir}", "num_steps=1", "checkpoint.overwrite=true"]
    assert command(capsys, run_dir, overrides)[0] == 0
    assert [m["step"] for m in metrics(run_dir)] == [0]
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_00000001"]
    assert not (run_dir / "export_raw").exists() and not (run_dir / "probe.json").exists()
    assert json.loads((run_dir / "export" / "weights.json").read_text())["step"] == 1


def test_a_refused_launch_leaves_no_folder(tiny_flux_dir, tmp_path, capsys):
    run_dir = tmp_path / "runs" / "new"
    status, stderr = command(capsys, run_dir, [*FAST, f"model.path={tiny_flux_dir}", "optimizer.lr=nan"])
    assert status == 2 and "optimizer.lr" in the_error(stderr)
    assert not (tmp_path / "runs").exists()  # nor the parent Hydra created for it


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["sampler.post_window.solver=dpmpp_2m"], r"sampler\.post_window\.solver=dpmpp_2m sets the steps after"),
        (["optimizer.lrr=1"], r"optimizer\.lrr"),  # Hydra's refusal, as python -m train words it
        (["data.train_prompts=/nonexistent.txt"], r"data\.train_prompts"),
    ],
)
def test_the_launchers_check_refuses_in_one_line_and_writes_nothing(overrides, expected, tmp_path, capsys):
    """python -m train.cli.check: the launch's settings validated as python -m train validates them."""
    run_dir = tmp_path / "run"
    try:
        status = check_command.main(["experiment=tiny", f"hydra.run.dir={run_dir}", *overrides])
    except SystemExit as end:  # a refusal after the settings composed ends the process, as the trainer's does
        status = end.code
    err = capsys.readouterr().err
    assert status == 2 and len(err.strip().splitlines()) == 1, err
    assert re.search(expected, the_error(err)) and err.startswith("python -m train: error: ")
    assert check_command.main(["experiment=tiny", f"hydra.run.dir={run_dir}"]) == 0
    assert not run_dir.exists()  # the check writes nothing


@pytest.mark.slow
def test_a_refused_launch_is_not_restarted_by_the_launcher(tmp_path):
    """torchrun restarts a failed launch whatever its exit status (a bad setting printed its line four times under
    MAX_RESTARTS=3): the launcher checks the settings once first, and torchrun never starts."""
    torchrun = tmp_path / "torchrun"  # a stand-in that records how it was started
    torchrun.write_text('#!/usr/bin/env bash\necho "$@" > "$(dirname "$0")/started"\n')
    torchrun.chmod(0o755)
    env = {**os.environ, "TORCHRUN": str(torchrun), "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    env |= {"RUN_DIR": str(tmp_path / "run"), "OMP_NUM_THREADS": "1"}
    script = [str(ROOT / "scripts" / "launch" / "train.sh"), "tiny"]
    bad = subprocess.run([*script, "sampler.sde_window_schedule=progressive"], env=env, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.count("python -m train: error: sampler.sde_window_schedule") == 1
    assert not (tmp_path / "started").exists() and not (tmp_path / "run").exists()
    good = subprocess.run(script, env=env, capture_output=True, text=True, timeout=300)
    assert good.returncode == 0, good.stderr
    started = (tmp_path / "started").read_text().split()
    assert started[:4] == ["--standalone", "--max-restarts", "3", "--nproc_per_node"] and "resume=auto" in started


def test_rank_1_of_a_refused_launch_leaves_the_take_back_to_rank_0(
    trained, tiny_flux_dir, tmp_path, capsys, monkeypatch
):
    """Rank 1 of a launch refused for a setting, while rank 0 takes the launch back (its LOCK and config.yaml go):
    status 2, no line (rank 0 prints it), no traceback, and rank 1 puts nothing back nor removes anything."""
    run_dir = copy_run(trained, tmp_path)
    (run_dir / "LOCK").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getppid(), "renewed": 0.0}))
    real = trainer.load_config

    def rank_0_takes_back(cfg):
        (run_dir / "LOCK").unlink()
        (run_dir / "config.yaml").unlink()
        return real(cfg)

    monkeypatch.setattr(trainer, "load_config", rank_0_takes_back)
    monkeypatch.setenv("RANK", "1")
    saved = kept(run_dir)
    overrides = [*FAST, f"model.path={tiny_flux_dir}", "num_steps=3", "resume=auto", "optimizer.lr=nan"]
    status, stderr = command(capsys, run_dir, overrides)
    assert status == 2 and stderr.strip() == "", stderr
    del saved["LOCK"], saved["config.yaml"]
    assert {k: v for k, v in kept(run_dir).items() if not k.startswith(".hydra")} == {
        k: v
        for k, v in saved.items()
        if not k.startswith(".hydra")  # rank 1's Hydra writes what rank 0's did
    }


def test_a_resume_keeps_each_session_configuration(trained, tiny_flux_dir, tmp_path, capsys):
    run_dir = copy_run(trained, tmp_path)
    first = (run_dir / "config.yaml").read_text()
    overrides = [*FAST, f"model.path={tiny_flux_dir}", "num_steps=3", "resume=auto", "seed=7"]
    status, _ = command(capsys, run_dir, [*overrides, "checkpoint.allow_changed=[seed]"])
    assert status == 0
    assert (run_dir / "config.yaml").read_text() == first
    assert "seed: 7" in (run_dir / "config.2.yaml").read_text()
    assert [m["step"] for m in metrics(run_dir)] == [0, 1, 2]


def test_a_branch_from_an_older_checkpoint_retires_the_later_ones(trained, tiny_flux_dir, tmp_path, capsys):
    """resume=<step 1> (another lr): step 2's checkpoint and the export of step 2 move to checkpoints/retired/,
    named in one line; metrics.jsonl holds one timeline, which resume=auto then continues."""
    run_dir = copy_run(trained, tmp_path)
    old = contents(run_dir / "checkpoints" / "step_00000002")
    common = [*FAST, f"model.path={tiny_flux_dir}", "optimizer.lr=0.01"]
    first = run_dir / "checkpoints" / "step_00000001"
    status, stderr, stdout = command(capsys, run_dir, [*common, "num_steps=2", f"resume={first}"], stdout=True)
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
    status, stderr, stdout = command(capsys, run_dir, [*common, "num_steps=3", "resume=auto"], stdout=True)
    assert status == 0 and re.search(r"resumed from .*/run/checkpoints/step_00000002 at step 2", stdout), stderr
    assert [m["step"] for m in metrics(run_dir)] == [0, 1, 2]


def test_a_resume_from_a_retired_checkpoint_goes_back_to_its_timeline(trained, tiny_flux_dir, tmp_path, capsys):
    """A branch at step 1 (another lr) trains to step 3; resume=<the retired step 2> then retires the branch and
    brings the first timeline back: its checkpoint of step 2 and its metrics row of step 1, as they were."""
    run_dir = copy_run(trained, tmp_path)
    first_timeline = contents(run_dir / "checkpoints" / "step_00000002")
    common = [*FAST, f"model.path={tiny_flux_dir}", "num_steps=3", "checkpoint.every=1"]
    branch = [*common, "optimizer.lr=0.01", f"resume={run_dir / 'checkpoints' / 'step_00000001'}"]
    assert command(capsys, run_dir, branch)[0] == 0
    [first] = list((run_dir / "checkpoints" / "retired").iterdir())
    branched = metrics(run_dir)
    status, stderr, stdout = command(capsys, run_dir, [*common, f"resume={first / 'step_00000002'}"], stdout=True)
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


def test_a_checkpoint_of_another_run_is_refused_and_continued_in_a_new_folder(trained, tiny_flux_dir, tmp_path, capsys):
    """The latest checkpoint replaced by the same step of another run: resume=auto is refused in one line and
    nothing changes; the way the line names (resume=<it> into a new folder) trains on, as a run of its own."""
    run_dir = copy_run(trained, tmp_path)
    latest = run_dir / "checkpoints" / "step_00000002"
    of_another_run(latest)
    saved = contents(run_dir)
    common = [*FAST, f"model.path={tiny_flux_dir}", "num_steps=3"]
    status, stderr = command(capsys, run_dir, [*common, "resume=auto"])
    assert status == 2 and re.search(DAMAGED["of-another-run"][1], the_error(stderr)), stderr
    assert contents(run_dir) == saved
    status, stderr, stdout = command(capsys, tmp_path / "copy", [*common, f"resume={latest}"], stdout=True)
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


def as_host(host: str, lease_s: float, overrides: list[str]) -> subprocess.Popen:
    """``python -m train overrides`` as a process of ``host`` with a lock lease of ``lease_s`` (its output piped)."""
    argv = [sys.executable, str(HELPERS / "other_host.py"), host, str(lease_s), *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def kept(folder: Path) -> dict[str, str]:
    """``contents`` without the log files (a process that stops says why there)."""
    return {name: sha for name, sha in contents(folder).items() if not name.endswith(".log")}


@pytest.mark.slow
def test_a_suspended_holder_whose_folder_was_taken_over_stops_before_writing(tiny_flux_dir, tmp_path):
    """Host a's run is stopped (SIGSTOP) past its 2 s lease; a launch from host b takes the folder over with
    resume=auto and finishes. Host a's run, continued, stops at its step's end in one line, before its metrics
    row: nothing in the folder changes."""
    run_dir = tmp_path / "run"
    common = [*FAST, f"model.path={tiny_flux_dir}", "checkpoint.every=0", f"hydra.run.dir={run_dir}"]
    holder = as_host("host-a", 2.0, [*common, "num_steps=500"])
    try:
        deadline = time.monotonic() + 300
        while not ((run_dir / "metrics.jsonl").is_file() and (run_dir / "metrics.jsonl").read_text()):
            assert time.monotonic() < deadline and holder.poll() is None, "step 0 never finished"
            time.sleep(0.2)
        holder.send_signal(signal.SIGSTOP)
        time.sleep(3)  # past the lease: host b takes host a for dead
        taker = as_host("host-b", 2.0, [*common, "num_steps=2", "resume=auto"])
        taker_stdout, taker_stderr = taker.communicate(timeout=300)
        assert taker.returncode == 0, taker_stderr
        assert "taking over the lock" in taker_stdout
        saved = kept(run_dir)
        holder.send_signal(signal.SIGCONT)
        _, stderr = holder.communicate(timeout=120)
    finally:
        holder.kill()
        holder.wait()
    assert holder.returncode == 1, stderr
    line = the_error(stderr)
    assert re.search(r"is no longer this run's: its lock .*LOCK was taken over .*pid \d+ on host host-a", line), line
    assert "stopped before writing anything more" in line
    assert kept(run_dir) == saved
    assert [m["step"] for m in metrics(run_dir)] == [0, 1] and not (run_dir / "LOCK").exists()


def test_a_holder_that_loses_its_folder_while_it_evaluates_writes_nothing(tiny_flux_dir, tmp_path, capsys, monkeypatch):
    """The lock taken over while the evaluation after step 1 samples (rewritten here as another host's, as a
    launch that took a suspended holder for dead leaves it): the run stops with status 1 in one line, and that
    evaluation writes no file and no metrics row."""
    from train.evaluation import protocol

    run_dir, real, saved = tmp_path / "run", protocol._sample_and_score, {}

    def taken_over_in_step_1(*args, **kwargs):
        sampled = real(*args, **kwargs)
        if kwargs["tag"] != "step_00000000":
            lock = {"host": "host-b", "pid": 1, "renewed": time.time(), "lease_s": 60.0}
            (run_dir / "LOCK").write_text(json.dumps(lock))
            saved.update(kept(run_dir))
        return sampled

    monkeypatch.setattr(protocol, "_sample_and_score", taken_over_in_step_1)
    overrides = [*FAST, f"model.path={tiny_flux_dir}", "num_steps=2", "checkpoint.every=0", "eval.every=1"]
    overrides += ["+eval.scorers.jpeg_compressibility={}", "eval.num_prompts=2"]
    status, stderr = command(capsys, run_dir, overrides)
    line = the_error(stderr)
    assert status == 1 and re.search(r"is no longer this run's: .*pid 1 on host host-b holds it now", line), line
    assert saved and kept(run_dir) == saved
    assert not list((run_dir / "eval").glob("step_00000001*"))


@pytest.mark.slow
def test_two_launches_into_one_new_folder_one_trains_the_other_takes_back_nothing(tiny_flux_dir, tmp_path):
    """Two launches at once into one new folder: exactly one owns it and trains; the other is refused in one line
    and leaves the winner's files alone (its LOCK while it runs, .hydra/, log, config.yaml)."""
    run_dir = tmp_path / "runs" / "new"
    overrides = [*FAST, f"model.path={tiny_flux_dir}", "num_steps=1", f"hydra.run.dir={run_dir}"]
    launches = [as_host(socket.gethostname(), 60.0, overrides) for _ in range(2)]
    deadline = time.monotonic() + 300
    while all(launch.poll() is None for launch in launches):
        assert time.monotonic() < deadline, "neither launch ended"
        time.sleep(0.1)
    still = [launch for launch in launches if launch.poll() is None]
    holder = json.loads((run_dir / "LOCK").read_text()) if (run_dir / "LOCK").is_file() else None
    if still and still[0].poll() is None:  # the winner still runs: its lock is in place
        assert holder is not None and holder["pid"] == still[0].pid, holder
    stderrs = [launch.communicate(timeout=300)[1] for launch in launches]
    statuses = [launch.returncode for launch in launches]
    assert sorted(statuses) == [0, 2], stderrs
    winner = launches[statuses.index(0)]
    line = the_error(stderrs[statuses.index(2)])
    assert re.search(rf"is in use by pid {winner.pid} |already holds a run", line), line
    assert [m["step"] for m in metrics(run_dir)] == [0]
    for name in (".hydra/config.yaml", "__main__.log", "config.yaml", "run_id", "checkpoints/step_00000001", "export"):
        assert (run_dir / name).exists(), name
    assert not (run_dir / "LOCK").exists()


@pytest.mark.parametrize("holder", ["live", "dead"])
def test_a_live_owner_of_the_folder_is_named_and_a_dead_one_taken_over(holder, tiny_flux_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    pid = os.getppid()  # alive, and not this process
    if holder == "dead":
        proc = subprocess.Popen([sys.executable, "-c", "pass"])
        proc.wait()
        pid = proc.pid
    (run_dir / "LOCK").write_text(json.dumps({"host": socket.gethostname(), "pid": pid, "renewed": time.time()}))
    status, stderr, stdout = command(
        capsys, run_dir, [*FAST, f"model.path={tiny_flux_dir}", "num_steps=1"], stdout=True
    )
    if holder == "live":
        assert status == 2 and re.search(rf"is in use by pid {pid} on host {socket.gethostname()}", the_error(stderr))
        assert sorted(p.name for p in run_dir.iterdir()) == ["LOCK"]
    else:
        assert status == 0 and "taking over the lock" in stderr + stdout
        assert not (run_dir / "LOCK").exists()  # released at the end


@pytest.mark.parametrize("why", ["nan-reward", "cancelling-rewards"])
def test_a_run_that_cannot_learn_stops_after_max_bad_steps(why, tiny_flux_dir, tmp_path, capsys, monkeypatch):
    """Every step skipped (NaN rewards) or with a zero gradient (weights that cancel): after 2 such steps the
    run writes its checkpoint and stops in one line, status 2."""
    overrides = [*FAST, f"model.path={tiny_flux_dir}", "num_steps=4", "checkpoint.every=0", "health.max_bad_steps=2"]
    if why == "nan-reward":
        nan_rewards(monkeypatch)
    else:
        overrides.append("+reward.components.jpeg_incompressibility.weight=1")  # minus the other: the sum is 0
    status, stderr = command(capsys, tmp_path / "run", overrides)
    line = the_error(stderr)
    expected = "a reward was NaN" if why == "nan-reward" else "the gradient was 0"
    assert status == 2 and re.search(rf"health\.max_bad_steps=2: steps 0 to 1 .*{expected}.*step_00000002", line), line
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step_00000002"]


def test_a_reward_without_spread_is_named(tiny_flux_dir, tmp_path, capsys, monkeypatch):
    from train.observe import health

    warnings = []
    monkeypatch.setattr(health.log, "warning", lambda message, *args: warnings.append(message % args))
    metrics_of = {"spread/jpeg_compressibility": 0.0, "spread/clipscore": 0.5, "train/grad_norm": 1.0}
    watch = health.Health(HealthConfig(), optimizer_steps=1, first=0, last=100, start_norm=1.0)
    for step in range(health.SPREAD_STEPS + 2):
        assert watch.observe(metrics_of, step) is None
    assert len(warnings) == 1 and warnings[0].startswith("reward.components.jpeg_compressibility: its scores tied")


# (health settings, metrics of step 5, the first step count whose weights diverged or None): the bounds' edges
HEALTH_BOUNDS = {
    "grown": ({}, {"health/weight_growth": 10.5}, 6),
    "shrunk": ({}, {"health/weight_growth": 0.09}, 6),
    "within": ({}, {"health/weight_growth": 9.5, "health/flat_images": 0.5}, None),
    "growth-off": ({"max_weight_growth": 0}, {"health/weight_growth": 1e9}, None),
    "all-flat": ({}, {"health/weight_growth": 1.0, "health/flat_images": 1.0}, 5),
    "flat-off": ({"flat_image_range": 0}, {"health/flat_images": 1.0}, None),
}


@pytest.mark.parametrize("case", list(HEALTH_BOUNDS))
def test_the_health_bounds(case):
    from train.observe.health import Health

    settings, measured, bad_from = HEALTH_BOUNDS[case]
    watch = Health(HealthConfig(**settings), optimizer_steps=1, first=0, last=100, start_norm=1.0)
    verdict = watch.observe({"train/grad_norm": 1.0, **measured}, 5)
    assert (verdict and verdict.bad_from) == bad_from, verdict


def test_a_run_none_of_whose_steps_learned_is_not_exported(tiny_flux_dir, tmp_path, capsys, monkeypatch):
    """Shorter than health.max_bad_steps, every reward NaN: a checkpoint, one line, status 2, and no export or summary
    that would call the loaded weights trained."""
    nan_rewards(monkeypatch)
    run_dir = tmp_path / "run"
    status, stderr, stdout = command(
        capsys, run_dir, [*FAST, f"model.path={tiny_flux_dir}", "num_steps=2"], stdout=True
    )
    line = the_error(stderr)
    assert status == 2 and re.search(r"none of steps 0 to 1 could change the weights .*NaN.* nothing is exported", line)
    assert line.endswith("wrote checkpoint " + str(run_dir / "checkpoints" / "step_00000002")), line
    assert not (run_dir / "export").exists() and "finished" not in stdout + stderr


def black_images(monkeypatch) -> None:
    """Every rollout decodes to black images, as a policy that collapsed samples them."""
    from train.reward import stage

    monkeypatch.setattr(stage, "decode_images", lambda backbone, latents, model: torch.zeros(len(latents), 3, 8, 8))


# How a resumed run diverges (steps 2 and 3 after the trained run's 2): the line's cause, and the checkpoint it
# names as the last before the weights that diverged (step_00000002 sampled the black images of step 2).
DIVERGED = {
    "weights": (
        ["optimizer.lr=0.9", "health.max_weight_growth=2"],
        r"health\.max_weight_growth=2: after step 2 the trainable weights' norm is [\d.]+ times its value at the start",
        r"is \S+/step_00000002: lower optimizer\.lr \(now 0\.9\), then resume=auto continues from it$",
    ),
    "flat-images": (
        [],
        r"health\.flat_image_range=0\.00392: every image sampled in step 2 is one flat colour: the weights after 2",
        r"is \S+/step_00000001 \(step_00000002 after it\): lower optimizer\.lr \(now 0\.003\), then resume=\S+01 ",
    ),
}


@pytest.mark.parametrize("case", list(DIVERGED))
def test_a_diverged_run_stops_before_saving_the_diverged_weights(
    case, trained, tiny_flux_dir, tmp_path, capsys, monkeypatch
):
    """Weights that grew past health.max_weight_growth, or images that are all one colour, in a run of finite
    numbers: one line naming the bound and the last checkpoint before, status 2; no checkpoint or export changed."""
    overrides, cause, left = DIVERGED[case]
    if case == "flat-images":
        black_images(monkeypatch)
    run_dir = copy_run(trained, tmp_path)
    saved = {name: files_of(run_dir / name) for name in ("checkpoints", "export")}
    common = [*FAST, f"model.path={tiny_flux_dir}", "num_steps=4", "checkpoint.every=1", "resume=auto"]
    status, stderr = command(capsys, run_dir, [*common, *overrides])
    line = the_error(stderr)
    assert status == 2 and re.search(cause, line) and re.search(left, line), line
    assert {name: files_of(run_dir / name) for name in saved} == saved


# A reward server that answers step 0 and then outside the protocol: what the one line says after the URL.
SERVER_FAULTS = {
    "non-json": ("text", r"answered non-JSON: 'Bad Gateway'"),
    "another-scorer": ("other", r"now scores with pickscore\(\), not fake\(\) as when the run started"),
    "refused-token": ("401", r"refused the request: 401 .*JAGG_REWARD_TOKEN"),
    "too-large": ("huge", r"returned a score beyond float32's range \(\+-3\.4e\+38\): an integer of 401 digits"),
}


@pytest.mark.parametrize("case", list(SERVER_FAULTS))
def test_a_reward_server_answer_outside_the_protocol_is_one_line(case, tiny_flux_dir, tmp_path, capsys):
    """Step 1's answer breaks the protocol: the step trained before it is checkpointed, then one line naming
    reward.components.remote and the server, status 2."""
    pytest.importorskip("fastapi")
    from fastapi.responses import JSONResponse, PlainTextResponse
    from reward_servers import FAKE, fake_server, serve

    def good(count):
        return {"scores": [0.5 * i for i in range(count)], **FAKE}

    fault = {
        "text": PlainTextResponse("Bad Gateway"),
        "other": lambda count: {**good(count), "scorer": "pickscore"},
        "401": JSONResponse({"detail": "missing or wrong bearer token"}, status_code=401),
        "huge": lambda count: {**good(count), "scores": [10**400] * count},
    }[SERVER_FAULTS[case][0]]
    with serve(fake_server(good, fault)) as url:
        remote = f"+reward.components.remote={{url: '{url}', timeout_s: 10, retries: 0}}"
        status, stderr = command(
            capsys, tmp_path / "run", [*FAST, f"model.path={tiny_flux_dir}", "num_steps=3", remote]
        )
    line = the_error(stderr)
    assert status == 2 and re.search(rf"reward\.components\.remote: reward server {url} {SERVER_FAULTS[case][1]}", line)
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step_00000001"]


def test_a_reward_server_that_answers_a_byte_at_a_time_ends_each_step_at_its_deadline(tiny_flux_dir, tmp_path, capsys):
    """Every byte of /score's answer comes within timeout_s, the whole answer would take a minute: each step ends
    at the request's deadline (its rewards NaN, skipped), and the run, none of whose steps learned, ends in one
    line within seconds."""
    pytest.importorskip("fastapi")
    from reward_servers import dripping_server

    with dripping_server() as url:
        remote = f"+reward.components.remote={{url: '{url}', timeout_s: 1, retries: 0}}"
        start = time.monotonic()
        status, stderr = command(
            capsys, tmp_path / "run", [*FAST, f"model.path={tiny_flux_dir}", "num_steps=2", remote]
        )
        elapsed = time.monotonic() - start
    line = the_error(stderr)
    assert status == 2 and "health.max_bad_steps: none of steps 0 to 1 could change the weights" in line, line
    log = (tmp_path / "run" / "__main__.log").read_text()
    assert elapsed < 60 and log.count(f"reward server {url} did not answer POST /score within timeout_s=1") == 2


def test_a_reward_server_that_never_answers_its_health_check_is_named_as_such(tiny_flux_dir, tmp_path, capsys):
    """A server that accepts the connection and never answers is stuck, not unreachable: one line, status 2."""
    pytest.importorskip("fastapi")
    from reward_servers import silent_server

    with silent_server() as url:
        remote = f"+reward.components.remote={{url: '{url}', timeout_s: 1, retries: 0}}"
        status, stderr = command(capsys, tmp_path / "run", [*FAST, f"model.path={tiny_flux_dir}", remote])
    line = the_error(stderr)
    assert status == 2 and line.startswith(
        f"python -m train: error: reward.components.remote: reward server {url} did not answer GET /health within "
        "timeout_s=1 at start-up"
    ), line


def test_a_judge_answer_without_a_score_is_one_line_after_the_steps_before_it(tiny_flux_dir, tmp_path, capsys):
    """A judge (reward=judge's component against a stand-in OpenAI-compatible server) scores step 0, then answers
    step 1 without a score: step 0 is checkpointed and one line quotes the answer, status 2."""
    pytest.importorskip("fastapi")
    from reward_servers import chat, judge_server, serve

    def answer(body: dict, number: int) -> dict:
        return chat(f"Final Score: {1 + number % 5}") if number < 2 else chat("I cannot rate this image.")

    app, seen = judge_server(answer)
    with serve(app) as url:
        judge = f"+reward.components.judge={{base_url: '{url}/v1', model: judge, score_range: [1, 5], retries: 0}}"
        overrides = [*FAST, f"model.path={tiny_flux_dir}", "num_steps=3", "checkpoint.every=5", judge]
        status, stderr = command(capsys, tmp_path / "run", overrides)
    line = the_error(stderr)
    assert (
        status == 2 and f"judge 'judge' at {url}/v1 answered without a score matching score_pattern: 'I cannot" in line
    )
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step_00000001"]
    assert metrics(tmp_path / "run")[0]["reward/judge"] == pytest.approx((0.0 + 0.25) / 2)  # scores 1 and 2 -> 0, 1/4


def nan_weights(tiny_flux_dir: Path, tmp_path: Path) -> Path:
    from safetensors.torch import save_file

    folder = Path(shutil.copytree(tiny_flux_dir, tmp_path / "nan"))
    file = next((folder / "transformer").glob("*.safetensors"))
    tensors = load_file(file)
    name = sorted(tensors)[0]
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, file)
    return folder


def test_nan_weights_in_the_model_are_one_line(tiny_flux_dir, tmp_path, capsys):
    model = nan_weights(tiny_flux_dir, tmp_path)
    status, stderr = command(capsys, tmp_path / "run", [*FAST, f"model.path={model}", "model.build_tiny=null"])
    line = the_error(stderr)
    assert status == 2 and re.search(r"model\.path=.*nan'.* weights hold 1 NaN or inf values \(the first in ", line)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("when", ["at-start", "at-a-save", "while-writing"])
def test_a_full_disk_is_one_line_and_keeps_the_checkpoints(when, trained, tiny_flux_dir, tmp_path, capsys, monkeypatch):
    import torch.distributed.checkpoint as dcp

    from train.checkpoint import manager as checkpoint

    run_dir = copy_run(trained, tmp_path)
    before = files_of(run_dir / "checkpoints")
    saves = []
    if when == "at-start":
        monkeypatch.setattr(checkpoint, "free_bytes", lambda path: 1000)
    elif when == "at-a-save":  # room at start-up (one check), then full at the save after step 3
        monkeypatch.setattr(checkpoint, "free_bytes", lambda path: 10**12 if len(saves) < 2 else 1000)
        real = checkpoint.CheckpointManager.check_space
        monkeypatch.setattr(checkpoint.CheckpointManager, "check_space", lambda *a: saves.append(1) or real(*a))
    else:

        def full(*args, **kwargs):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(dcp, "save", full)
    overrides = [*FAST, f"model.path={tiny_flux_dir}", "num_steps=4", "checkpoint.every=1", "resume=auto"]
    status, stderr = command(capsys, run_dir, overrides)
    line = the_error(stderr)
    assert status == 2 and re.search(r"the disk of .*checkpoints \(the file system mounted at /.*\) ", line), line
    if when == "at-start":
        assert "has 0.0 MB free, a checkpoint of this run needs about" in line
        assert files_of(run_dir / "checkpoints") == before
    else:
        names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
        assert names[:2] == ["step_00000001", "step_00000002"] and not [n for n in names if n.endswith(".tmp")]
        assert {k: v for k, v in files_of(run_dir / "checkpoints").items() if k in before} == before


def test_a_resume_on_fewer_ranks_that_changes_the_global_batch_is_one_line(trained, tiny_flux_dir, tmp_path, capsys):
    """The latest checkpoint as 2 ranks would have saved it (its marker says world size 2), resumed by 1 process:
    refused in one line naming the batch before and after and the per-rank setting that keeps it."""
    run_dir = copy_run(trained, tmp_path)
    marker_path = run_dir / "checkpoints" / "step_00000002" / "COMPLETE"
    marker_path.write_text(json.dumps({**json.loads(marker_path.read_text()), "world_size": 2}))
    saved = contents(run_dir)
    overrides = [*FAST, f"model.path={tiny_flux_dir}", "num_steps=3", "resume=auto"]
    status, stderr = command(capsys, run_dir, overrides)
    line = the_error(stderr)
    assert status == 2 and re.search(
        r"the global batch changes: 2 prompts per step \(2 ranks x batch\.prompts_per_rank=1\), now 1 \(1 rank x "
        r"batch\.prompts_per_rank=1\).*keep it with batch\.prompts_per_rank=2",
        line,
    ), line
    assert contents(run_dir) == saved


def damage_metrics(case: str, path: Path) -> None:
    lines = path.read_bytes().splitlines(keepends=True)
    if case == "not-utf8":  # a byte of another encoding in the row of step 1
        lines[1] = lines[1].replace(b'"step"', b'"st\xe9p"')
    else:  # the row of step 1 cut short by a crash while it was written
        lines[1] = lines[1][: len(lines[1]) // 2]
    path.write_bytes(b"".join(lines))


@pytest.mark.parametrize("case", ["not-utf8", "cut-short"])
def test_a_damaged_metrics_file_is_named_on_resume(case, trained, tiny_flux_dir, tmp_path, capsys):
    """Non-UTF-8 bytes: one line naming the line and column, before the model loads, nothing changed. A row cut
    short: the run goes on, the line says which row was dropped."""
    run_dir = copy_run(trained, tmp_path)
    damage_metrics(case, run_dir / "metrics.jsonl")
    saved = contents(run_dir)
    overrides = [*FAST, f"model.path={tiny_flux_dir}", "num_steps=3", "resume=auto"]
    status, stderr, stdout = command(capsys, run_dir, overrides, stdout=True)
    if case == "not-utf8":
        line = the_error(stderr)
        assert status == 2 and re.search(r"metrics\.jsonl:2 is not UTF-8 \(byte 0xe9 at column \d+\)", line), line
        assert contents(run_dir) == saved
    else:
        assert status == 0, stderr
        assert re.search(r"metrics\.jsonl: line 2 was cut short by the crash that ended a session: dropped", stdout)
        assert [m["step"] for m in metrics(run_dir)] == [0, 2]


def test_a_checkpoint_save_the_file_system_refuses_is_one_line(trained, tiny_flux_dir, tmp_path, capsys, monkeypatch):
    """A read-only mount under the save (DCP's CheckpointException, not an Exception): one line naming the
    checkpoints' disk and the OS's words, status 2; the checkpoints written before stay as they were."""
    import traceback

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import CheckpointException

    def read_only(*args, **kwargs):
        cause = OSError(30, "Read-only file system")
        raise CheckpointException("save failed", {0: (cause, traceback.StackSummary())})

    run_dir = copy_run(trained, tmp_path)
    before = files_of(run_dir / "checkpoints")
    monkeypatch.setattr(dcp, "save", read_only)
    overrides = [*FAST, f"model.path={tiny_flux_dir}", "num_steps=3", "resume=auto"]
    status, stderr = command(capsys, run_dir, overrides)
    line = the_error(stderr)
    assert status == 2 and re.search(r"checkpoints .*Read-only file system", line), line
    assert {k: v for k, v in files_of(run_dir / "checkpoints").items() if k in before} == before
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.endswith(".tmp")]


def test_a_disk_that_fills_while_a_metrics_row_is_written_is_one_line(tiny_flux_dir, tmp_path, capsys, monkeypatch):
    """ENOSPC from the metrics file's write after step 1: one line naming the file's disk, no chained tracebacks;
    the steps before it are checkpointed."""
    metrics_refused_after_one_row(monkeypatch, 28, "No space left on device")
    overrides = [*FAST, f"model.path={tiny_flux_dir}", "num_steps=3", "checkpoint.every=0"]
    status, stderr = command(capsys, tmp_path / "run", overrides)
    line = the_error(stderr)
    assert status == 2 and re.search(r"the disk of .*metrics\.jsonl .*filled up", line), line
    assert [m["step"] for m in metrics(tmp_path / "run")] == [0]


def test_a_new_run_is_refused_naming_the_size_of_its_checkpoint(trained, tiny_flux_dir, tmp_path, capsys, monkeypatch):
    """A new run on a disk with little room: the line names what a checkpoint of this run needs, estimated from
    the model and optimizer before any is written (within a factor of 2 of the size a checkpoint has)."""
    from train.checkpoint import manager as checkpoint

    monkeypatch.setattr(checkpoint, "free_bytes", lambda path: 1000)
    status, stderr = command(capsys, tmp_path / "run", [*FAST, f"model.path={tiny_flux_dir}", "num_steps=2"])
    line = the_error(stderr)
    match = re.search(r"a checkpoint of this run \(.*\) needs about ([0-9.]+) MB", line)
    assert status == 2 and match, line
    written = sum(p.stat().st_size for p in (trained / "checkpoints" / "step_00000002").iterdir()) / 1e6
    assert written / 2 <= float(match.group(1)) <= written * 2, (match.group(1), written)


def test_the_steps_trained_before_a_failure_are_saved(tiny_flux_dir, tmp_path, capsys, monkeypatch):
    """A failure in step 2 (here: a bug) after two unsaved steps: step 2's checkpoint is written first."""
    real = trainer.train_step

    def fail_in_step_2(run, k):
        if k == 2:
            raise RuntimeError("the reward server went away")
        return real(run, k)

    monkeypatch.setattr(trainer, "train_step", fail_in_step_2)
    overrides = [*FAST, f"model.path={tiny_flux_dir}", "num_steps=4", "checkpoint.every=0"]
    with pytest.raises(RuntimeError, match="the reward server went away"):
        command(capsys, tmp_path / "run", overrides)
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step_00000002"]


def test_a_sweep_runs_its_valid_jobs_and_names_the_failed_one(tiny_flux_dir, tmp_path, capsys):
    argv = [
        "-m",
        *FAST,
        f"model.path={tiny_flux_dir}",
        "num_steps=1",
        "checkpoint.export=false",
        "optimizer.lr=nan,0.001",
    ]
    argv += [f"hydra.sweep.dir={tmp_path / 'sweep'}", "hydra.sweep.subdir=${hydra.job.num}"]
    with pytest.raises(SystemExit) as stop:
        run_hydra(train_command.main, prog=train_command.PROG, argv=argv)
    stderr = capsys.readouterr().err
    assert stop.value.code == 2 and "Traceback" not in stderr
    lines = [line for line in stderr.splitlines() if line.startswith("python -m train: error: ")]
    assert re.search(r"sweep job #0 \(.*sweep/0\): optimizer\.lr must be a finite number", lines[0]), lines
    assert re.search(r"1 of the sweep's 2 jobs failed \(#0 \(.*sweep/0\); .*the others ran", lines[1]), lines
    assert [m["step"] for m in metrics(tmp_path / "sweep" / "1")] == [0]
    assert not (tmp_path / "sweep" / "0").exists()  # the failed job took back the folder it created


def flip_last_weight_byte(path: Path) -> None:
    """One byte of the last tensor changed: the file keeps its size and its header reads."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["truncated", "one-weight-changed"])
def test_eval_names_a_damaged_export(damage, trained, tiny_flux_dir, tmp_path, capsys):
    run_dir = copy_run(trained, tmp_path)
    weights = run_dir / "export" / "diffusion_pytorch_model.safetensors"
    if damage == "truncated":
        truncate(weights.name)(weights.parent)
    else:
        flip_last_weight_byte(weights)
    saved = contents(run_dir)
    overrides = [*FAST, f"model.path={tiny_flux_dir}", f"eval.transformer={run_dir / 'export'}"]
    status, stderr = command(capsys, tmp_path / "eval", overrides, eval_command)
    line = the_error(stderr, eval_command.PROG)
    expected = "does not match the checksum" if damage == "one-weight-changed" else r"(cannot|has \d+ bytes)"
    assert status == 2 and re.search(
        rf"eval\.transformer=.*export'.*diffusion_pytorch_model\.safetensors {expected}", line
    )
    assert contents(run_dir) == saved
    # the run folder itself: its checkpoint stands in for the damaged export
    from train.checkpoint.export import find_weights

    assert find_weights(str(run_dir), "eval.transformer").path == run_dir / "checkpoints" / "step_00000002"


def test_eval_names_a_checkpoint_the_run_pruned(trained, tiny_flux_dir, tmp_path, capsys):
    """eval.transformer=<an older checkpoint> that the live run pruned meanwhile: one line naming the latest."""
    run_dir = copy_run(trained, tmp_path)
    shutil.rmtree(run_dir / "checkpoints" / "step_00000001")
    overrides = [*FAST, f"model.path={tiny_flux_dir}", f"eval.transformer={run_dir / 'checkpoints' / 'step_00000001'}"]
    status, stderr = command(capsys, tmp_path / "eval", overrides, eval_command)
    line = the_error(stderr, eval_command.PROG)
    assert status == 2 and re.search(
        r"step_00000001' does not exist: the run keeps only .* and pruned it; pick its "
        r"latest, .*step_00000002, or pass the run folder",
        line,
    ), line


def test_eval_names_a_missing_scorer_file_before_the_model_loads(tiny_flux_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(builder, "load_backbone", lambda *args, **kwargs: pytest.fail("the model loaded"))
    overrides = [*FAST, f"model.path={tiny_flux_dir}", "+eval.scorers.clipscore.model_path=/nonexistent/clip"]
    status, stderr = command(capsys, tmp_path / "eval", overrides, eval_command)
    line = the_error(stderr, eval_command.PROG)
    assert status == 2 and re.search(r"eval\.scorers\.clipscore\.model_path='/nonexistent/clip' does not exist", line)


@pytest.mark.parametrize("output", ["folder", "missing-folder"])
def test_plan_output_is_checked_before_the_trace(output, tmp_path, capsys):
    import train.plan.command as plan_command

    path = tmp_path if output == "folder" else tmp_path / "nowhere" / "plan.json"
    with pytest.raises(SystemExit) as stop:
        plan_command.main(["experiment=flux_dance", f"plan.output={path}"])
    line = the_error(capsys.readouterr().err, plan_command.PROG)
    assert stop.value.code == 2 and re.search(r"plan\.output=.* (is a folder|which is not a folder)", line)


def test_a_read_only_run_folder_is_one_line_before_hydra_writes(trained, tiny_flux_dir, tmp_path, capsys, monkeypatch):
    """resume=auto in an existing folder this user cannot write (os.access says so: the tests may run as root)."""
    import train.cli.run_folder as run_folder

    run_dir = copy_run(trained, tmp_path)
    saved = contents(run_dir)
    real = os.access
    monkeypatch.setattr(run_folder.os, "access", lambda path, mode: Path(path) != run_dir and real(path, mode))
    status, stderr = command(capsys, run_dir, [*FAST, f"model.path={tiny_flux_dir}", "num_steps=3", "resume=auto"])
    assert status == 2 and re.search(r"cannot write the run folder \(Permission denied: .*run\)", the_error(stderr))
    assert contents(run_dir) == saved


def test_a_resume_that_wraps_other_lora_modules_is_one_line(tiny_flux_dir, tmp_path, capsys, monkeypatch):
    """The same settings, but the backbone's own LoRA targets changed (another version of its adapter): the
    checkpoint's adapters were saved under other module names, which the recorded list shows."""
    from models.flux import FluxBackbone

    run_dir = tmp_path / "run"
    lora = [*FAST, f"model.path={tiny_flux_dir}", "model.lora.enabled=true", "model.lora.rank=2", "num_steps=1"]
    assert command(capsys, run_dir, [*lora, "checkpoint.export=false"])[0] == 0
    saved = contents(run_dir)
    wrapped = len(
        json.loads((run_dir / "checkpoints" / "step_00000001" / "COMPLETE").read_text())["settings"][
            "model.lora.modules"
        ]
    )
    monkeypatch.setattr(FluxBackbone, "lora_target_modules", ["attn.to_q"])
    status, stderr = command(capsys, run_dir, [*lora, "num_steps=2", "resume=auto"])
    line = the_error(stderr)
    assert status == 2 and re.search(
        rf"\(model\.lora\.modules {wrapped} -> \d+ modules wrapped \(no longer: .*attn\.to_k.*; new: none\)\).*"
        r"allow_changed=\[model\.lora\.modules\]",
        line,
    ), line
    assert contents(run_dir) == saved


def test_a_sweep_with_a_folder_that_holds_a_run_starts_none_of_its_jobs(trained, tiny_flux_dir, tmp_path, capsys):
    """Job #1's folder holds a finished run: the sweep is refused before it writes anything, job #0's
    folder included, and the run in job #1's folder is unchanged."""
    sweep = tmp_path / "sweep"
    held = copy_run(trained, sweep).rename(sweep / "1")
    saved = contents(held)
    argv = ["-m", *FAST, f"model.path={tiny_flux_dir}", "num_steps=1", "seed=0,1"]
    argv += [f"hydra.sweep.dir={sweep}", "hydra.sweep.subdir=${hydra.job.num}"]
    with pytest.raises(SystemExit) as stop:
        run_hydra(train_command.main, prog=train_command.PROG, argv=argv)
    line = the_error(capsys.readouterr().err)
    assert stop.value.code == 2, line
    assert re.search(r"the sweep starts none of its 2 jobs: job #1 \(.*sweep/1\): run_dir=.* already holds a run", line)
    assert sorted(p.name for p in sweep.iterdir()) == ["1"]  # no multirun.yaml, no folder of job #0
    assert contents(sweep / "1") == saved
