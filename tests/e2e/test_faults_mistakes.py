"""A user's mistake is one line naming the setting or file and the fix, status 2, before anything loads
(docs/reliability.md, Mistakes): every bad setting through ``python -m train`` (run against a trained run with
resume=auto, whose files stay untouched), the other commands, the launchers' check, every missing path (on one
of two ranks too). A bug keeps its traceback."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from run_folders import ROOT, files_of, refused_line
from small_run import FAST, the_error
from two_ranks import run_ranks

import train.cli.check as check_command
import train.loop.trainer as trainer
import train.tools.eval.command as eval_command
import train.tools.probe.command as probe_command
from train.parts.policy import builder
from train.parts.scoring import scorers

pytestmark = pytest.mark.usefixtures("repo_root")  # the tiny experiment's prompt file is relative to the repository


def fifo(tmp_path: Path) -> str:
    """A named pipe, as a shell's <(...) hands one: it could be read once (nobody writes it here)."""
    path = tmp_path / "fifo.txt"
    os.mkfifo(path)
    return str(path)


def prompt_file(tmp_path: Path, name: str, text: str, encoding: str = "utf-8") -> str:
    path = tmp_path / name
    path.write_text(text, encoding=encoding)
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
    "eval_metric-unknown": (
        ["eval.every=1", "+eval.scorers.jpeg_compressibility={{}}", "eval.metric=hpsv2"],  # {{}}: str.format
        r"eval\.metric='hpsv2' is not one of eval\.scorers \(jpeg_compressibility\)",
    ),
    "guard_patience-zero": (["eval.guard.patience=0"], r"eval\.guard\.patience must be > 0, got 0"),
    "guard_action": (["eval.guard.action=halt"], r"eval\.guard\.action='halt' is not valid"),
    "guard-without-eval": (["eval.guard.action=warn"], r"eval\.guard\.action=warn watches .* eval\.every=0"),
    "keep_best-without-eval": (["checkpoint.keep_best=true"], r"checkpoint\.keep_best=true .* eval\.every=0"),
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
    "prompt-null": (["eval.prompts={null_prompt}"], r"null\.jsonl:2: 'prompt' must be a non-empty string, got null"),
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
def test_a_bad_setting_is_one_line_before_anything_loads(case, trained, launch, tmp_path, monkeypatch):
    overrides, expected = BAD_SETTINGS[case]
    for module, name in ((builder, "load_backbone"), (scorers, "build_scorer")):  # neither loads before the error
        monkeypatch.setattr(module, name, lambda *args, what=name, **kwargs: pytest.fail(f"{what} ran"))
    paths = {
        "tmp": str(tmp_path),
        "fifo": fifo(tmp_path),
        "latin1": prompt_file(tmp_path, "latin1.txt", "a cat\nun caf\xe9 au lait\n", "latin-1"),
        "utf16": prompt_file(tmp_path, "utf16.txt", "a cat\n", "utf-16"),
        "null_prompt": prompt_file(tmp_path, "null.jsonl", '{"prompt": "a cat"}\n{"prompt": null}\n'),
        "empty_prompt": prompt_file(tmp_path, "empty.jsonl", '{"prompt": " "}\n'),
        "nul_prompt": prompt_file(tmp_path, "nul.txt", "a cat\na d\x00og\n"),
        "list_category": prompt_file(tmp_path, "category.jsonl", '{"prompt": "a cat", "category": ["animal"]}\n'),
        "other_prompts": prompt_file(tmp_path, "other.txt", "a red cube\na blue ball\n"),
    }
    before, overrides = files_of(trained / "checkpoints"), [o.format(**paths) for o in overrides]
    # kept: Hydra's .hydra/ and log file too, which the refused launch took back
    line = refused_line(launch, trained, "num_steps=2", "resume=auto", *overrides, kept=trained)
    assert re.search(expected, line), line
    assert files_of(trained / "checkpoints") == before


def test_a_bug_keeps_its_traceback(launch, tmp_path, monkeypatch):
    def broken(cfg):
        raise RuntimeError("an internal bug")

    monkeypatch.setattr(trainer, "run", broken)
    with pytest.raises(RuntimeError, match="an internal bug"):
        launch(tmp_path / "run")


@pytest.mark.parametrize(
    "module, overrides", [(eval_command, ["eval.batch_size=0"]), (probe_command, ["probe.threshold=nan"])]
)
def test_the_other_commands_report_the_same_way(module, overrides, launch, tmp_path):
    assert overrides[0].split("=")[0] in refused_line(launch, tmp_path / "run", *overrides, module=module)


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


def test_every_missing_path_is_named_in_one_line(launch, tmp_path, monkeypatch):
    """The model folder, a prompt file and a reward's file, all missing: one line names the three, before anything
    loads."""
    monkeypatch.setattr(builder, "load_backbone", lambda *args, **kwargs: pytest.fail("load_backbone ran"))
    missing = [
        "model.path=/nonexistent/model",
        "model.build_tiny=null",
        "data.train_prompts=/nonexistent/train.txt",
        "+reward.components.clipscore.model_path=/nonexistent/clip",
    ]
    line = refused_line(launch, tmp_path, *missing)
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
    rank 0's one line names rank 1's folder, and rank 1 prints its own line."""
    overrides, expected = MISSING_ON_RANK_1[case]
    if overrides:
        (tmp_path / "model_0").symlink_to(tiny_flux_dir)
    model = f"model.path={tmp_path}/model_${{oc.env:RANK}}"
    args = ["-m", "train", *FAST, model, *overrides, "dist.timeout_s=600", f"hydra.run.dir={tmp_path / 'run'}"]
    ranks = run_ranks(*args, timeout=300)  # a rank waiting in a collective would wait 600 s
    assert [rank.returncode for rank in ranks] == [2, 2], [rank.stderr[-2000:] for rank in ranks]
    line = the_error(ranks[0].stderr)
    assert "rank 1: " + expected.format(tmp=tmp_path) in line, line
    (own,) = [x for x in ranks[1].stderr.splitlines() if "error:" in x]  # rank 1's own line, in its own output
    assert own.startswith("[rank 1] python -m train: error: " + expected.format(tmp=tmp_path)), own


def test_eval_names_a_missing_scorer_file_before_the_model_loads(launch, tmp_path, monkeypatch):
    monkeypatch.setattr(builder, "load_backbone", lambda *args, **kwargs: pytest.fail("the model loaded"))
    missing = "+eval.scorers.clipscore.model_path=/nonexistent/clip"
    line = refused_line(launch, tmp_path / "eval", missing, module=eval_command)
    assert re.search(r"eval\.scorers\.clipscore\.model_path='/nonexistent/clip' does not exist", line), line


@pytest.mark.parametrize("output", ["folder", "missing-folder"])
def test_plan_output_is_checked_before_the_trace(output, tmp_path, capsys):
    import train.tools.plan.command as plan_command

    path = tmp_path if output == "folder" else tmp_path / "nowhere" / "plan.json"
    with pytest.raises(SystemExit) as stop:
        plan_command.main(["experiment=flux_dance", f"plan.output={path}"])
    line = the_error(capsys.readouterr().err, plan_command.PROG)
    assert stop.value.code == 2 and re.search(r"plan\.output=.* (is a folder|which is not a folder)", line)
