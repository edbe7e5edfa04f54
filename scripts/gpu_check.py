"""A first run on one GPU, in one results folder: ``scripts/gpu_check.sh [--cpu] [--out DIR]`` (docs/gpu_check.md).

1. The JAGG gradient against the exact one at FLUX.1-dev's block width (one double and one single block, random
   weights), under bf16 autocast against float32 (scripts/gpu_check_jagg.py).
2. ``python -m train.preflight`` of flux_dance and qwenimage_flow_fast at reduced depth (1 block of each kind),
   scored by the JPEG reward: time per phase, peak memory against the planner's, MFU, the attention kernel.
3. flux_dance's step again with ``model.compile=true``, against the eager one of 2.

2 and 3 run first, as subprocesses: this process holds no GPU memory while they measure theirs.

Without ``--flux-path`` / ``--qwenimage-path`` no weights are needed: each experiment's model folder is a
stand-in, the tiny random pipeline (models/tiny.py: text encoders, VAE, tokenizers) whose transformer config is cut
to one block of each kind and, in the GPU mode, takes the real architecture's block width (heads, head dim, RoPE
axes; configs/arch/); the preflight builds its transformer from that config with random weights, and the planner
traces the same one-block model (the full-depth plan is ``python -m train.plan``'s, docs/planner.md). The images are
sized to the real runs' 2025 image tokens (720 px at the real VAE's scale) on the tiny VAE. ``--cpu``: the tiny
pipelines' widths, small batches, float32, the preflights on 2 ranks over gloo, no compiled step (inductor's first
compile takes minutes on CPU).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from gpu_check_jagg import jagg_check
from omegaconf import OmegaConf

from models.flux import tiny_transformer
from models.registry import get_backbone_class
from models.tiny import build_tiny
from train.cli.compose import setup
from train.tools.plan.depth import BLOCK_KEYS
from train.tools.preflight.machine import describe

ROOT = Path(__file__).resolve().parents[1]
ARCH = ROOT / "configs" / "arch"
EXPERIMENTS = {"flux_dance": ("flux", "flux1-dev"), "qwenimage_flow_fast": ("qwenimage", "qwen-image")}
WIDTH_KEYS = ("num_attention_heads", "attention_head_dim", "axes_dims_rope")  # the block width, taken in GPU mode
PACKAGES = ("diffusers", "transformers", "peft", "accelerate", "safetensors", "hydra-core", "numpy")
SUMS = "SHA256SUMS"
STAND_IN = (
    "no pretrained weights: random transformers at {width} block width and reduced depth, the tiny "
    "pipeline's text encoders and VAE, the JPEG reward; times and memory are the architecture's, not the models'"
)
SETTINGS = [  # every preflight's: no reward or evaluation weights, no logging service
    "reward=jpeg", "preflight.stand_in_rewards=true", "data.train_prompts=${shipped:testbed/prompts/demo.txt}",
    "eval.every=0", "~eval.scorers.pickscore", "~eval.scorers.hpsv2", "~eval.scorers.clipscore",
    "logging.wandb_mode=disabled",
]  # fmt: skip


@dataclass(frozen=True)
class Mode:
    """The sizes of one mode of the check."""

    name: str
    device: str
    ranks: int  # processes per preflight (torchrun when > 1)
    real_arch: bool  # the stand-in transformers take the real block width (else the tiny pipeline's)
    side_tokens: int  # image tokens per side of the preflights' images
    jagg_tokens: tuple[int, int]  # image and text tokens of the JAGG check's segment
    overrides: tuple[str, ...]  # the preflights' sizes
    compile: bool  # run the compiled step


GPU = Mode("gpu", "cuda", 1, True, 45, (1024, 512), (
    "device=cuda", "preflight.steps=2", "checkpoint.keep_last=1", "batch.prompts_per_rank=1",
    "batch.gradient_accumulation_steps=12",
), compile=True)  # fmt: skip
CPU = Mode("cpu", "cpu", 2, False, 8, (64, 32), (
    "device=cpu", "model.dtype=float32", "model.options.max_sequence_length=32", "preflight.steps=1",
    "grpo.group_size=2", "batch.prompts_per_rank=1", "batch.micro_batch=2", "batch.gradient_accumulation_steps=2",
), compile=False)  # fmt: skip


def stand_in(backbone: str, arch: str, dest: Path, *, real: bool) -> Path:
    """The tiny random pipeline of ``backbone`` at ``dest``, its transformer config cut to one block of each kind
    (the preflight's reduced depth, so that no check sizes a full-depth checkpoint) and with ``real`` given the block
    width of ``arch`` (configs/arch/); its transformer weights removed (the preflight reads none)."""
    build_tiny(backbone, dest, size="tiny")
    path = dest / "transformer" / "config.json"
    config = json.loads(path.read_text())
    config |= {key: 1 for key in BLOCK_KEYS if key in config}
    if real:
        arch_config = json.loads((ARCH / arch / "transformer" / "config.json").read_text())
        config |= {key: arch_config[key] for key in WIDTH_KEYS}
    path.write_text(json.dumps(config, indent=2))
    for weights in (dest / "transformer").glob("*.safetensors"):
        weights.unlink()
    return dest


def preflight(experiment: str, model: Path, mode: Mode, run_dir: Path, extra: list[str], *, sized: bool) -> dict:
    """``python -m train.preflight`` of ``experiment`` on ``model`` (under torchrun for several ranks; ``sized``: the
    images of ``mode.side_tokens`` tokens a side), its console output kept in ``run_dir``/console.log; the summary of
    its preflight.json."""
    side = mode.side_tokens * get_backbone_class(EXPERIMENTS[experiment][0]).image_multiple(str(model))
    args = [f"experiment={experiment}", f"model.path={model}", *SETTINGS, *mode.overrides, *extra]
    args += [f"model.height={side}", f"model.width={side}"] if sized else []
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={mode.ranks}"] if mode.ranks > 1 else []
    start = time.perf_counter()
    run = [sys.executable, *launch, "-m", "train.preflight", *args, f"hydra.run.dir={run_dir}"]
    done = subprocess.run(run, capture_output=True, text=True, cwd=ROOT)
    (run_dir / "console.log").write_text(done.stdout + done.stderr)
    verdict = run_dir / "preflight.json"
    found = json.loads(verdict.read_text()) if verdict.is_file() else {"exit_status": None, "checks": []}
    out = summary(found, done.returncode)  # without a verdict (the command broke): its console.log says why
    return out | {"wall_seconds": time.perf_counter() - start, "overrides": args}


def summary(found: dict[str, Any], returncode: int) -> dict[str, Any]:
    """What docs/benchmarks cite of one preflight.json: rank 0's step, the planner's memory, every check's line."""
    step = found["step"]["ranks"][0] if found.get("step") else {}
    checks = {c["name"] if c["ranks"] is None else f"{c['name']} {c['ranks']}": c for c in found["checks"]}
    keep = ("blocks", "full_blocks", "seconds", "tflops", "peak_tflops", "peak_source", "mfu", "peak_bytes",
            "allocated_bytes", "total_bytes")  # fmt: skip
    return {
        "exit_status": returncode,
        "verdict": found["exit_status"],
        "step": {key: step.get(key) for key in keep},
        "planner_memory": (found.get("plan") or {}).get("memory"),
        "plan": (found.get("plan") or {}).get("corrected"),
        "checks": {name: f"{c['status']}: {c['line']}" for name, c in checks.items()},
    }


def compiled(eager: dict[str, Any], compiled_step: dict[str, Any]) -> dict[str, Any]:
    """The compiled step against the eager one, phase by phase (seconds, eager / compiled)."""
    a, b = eager["step"]["seconds"] or {}, compiled_step["step"]["seconds"] or {}
    return {
        "seconds": {"eager": a, "compiled": b},
        "speedup": {phase: a[phase] / b[phase] for phase in a if b.get(phase)},
        "compile_check": compiled_step["checks"].get("compile"),
    }


def versions(device: str) -> dict[str, Any]:
    """Python, the packages, CUDA and cuDNN, and the machine as the preflight describes it (GPU, NCCL, driver)."""
    out: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform()}
    out |= {"torch": torch.__version__, "cuda": torch.version.cuda}  # the build, +cu130 included
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    out["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    out["machine"] = describe(torch.device(device), rank=0, world_size=1, replicate=1)
    try:
        out["cpu"] = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line)
    except (OSError, StopIteration):
        out["cpu"] = platform.processor()
    return out


def commit() -> dict[str, Any]:
    """The checkout's commit and whether it had changes (``unknown`` outside a git checkout)."""
    git = ["git", "-C", str(ROOT)]
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode:
        return {"commit": "unknown", "dirty": None}
    status = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip())}


def resolved_configs(out: Path, names: list[str]) -> None:
    """Each preflight's settings as Hydra composed them, interpolations resolved, in ``out``/configs/<name>.yaml."""
    setup()  # the project's resolvers (${shipped:...})
    (out / "configs").mkdir()
    for name in (n for n in names if (out / "preflight" / n / ".hydra" / "config.yaml").is_file()):
        composed = OmegaConf.load(out / "preflight" / name / ".hydra" / "config.yaml")
        (out / "configs" / f"{name}.yaml").write_text(OmegaConf.to_yaml(composed, resolve=True))


def write_sums(out: Path) -> None:
    """``out``/SHA256SUMS over every other file in ``out``, as ``sha256sum -c SHA256SUMS`` reads it there."""
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name != SUMS)
    lines = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.relative_to(out).as_posix()}" for p in files]
    (out / SUMS).write_text("\n".join(lines) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="the results folder, new or empty (default runs/gpu_check/<time>)")
    parser.add_argument("--cpu", action="store_true", help="the CPU mode: tiny sizes, gloo (the test suite's)")
    for experiment, (backbone, arch) in EXPERIMENTS.items():
        parser.add_argument(
            f"--{backbone}-path", type=Path, help=f"{arch} weights for {experiment} (a diffusers folder)"
        )
    args = parser.parse_args(argv)
    args.out = args.out or ROOT / "runs" / "gpu_check" / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    problem = checked(args)
    if problem:
        parser.exit(2, f"gpu_check: {problem}\n")
    return args


def checked(args: argparse.Namespace) -> str | None:
    """The first thing wrong with the arguments or the machine, in one line with its fix; None when all is well."""
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        return f"--out {args.out} exists and is not an empty folder: give a new folder"
    for backbone, arch in EXPERIMENTS.values():
        path = getattr(args, f"{backbone}_path")
        if path is not None and not (path / "model_index.json").is_file():
            return f"--{backbone}-path {path} holds no model_index.json: give a diffusers folder of {arch}"
    if not args.cpu and not torch.cuda.is_available():
        return "no CUDA device here: run it on a GPU machine, or scripts/gpu_check.sh --cpu for the CPU mode"
    return None


def run_preflights(args: argparse.Namespace, mode: Mode, out: Path) -> dict[str, dict]:
    """The two experiments' preflights, and flux_dance's compiled one with ``mode.compile``."""
    found = {}
    for experiment, (backbone, arch) in EXPERIMENTS.items():
        given = getattr(args, f"{backbone}_path")
        model = given or stand_in(backbone, arch, out / ".models" / backbone, real=mode.real_arch)
        runs = [(experiment, ["model.compile=false"])]
        if mode.compile and experiment == "flux_dance":
            runs.append((f"{experiment}_compiled", ["model.compile=true"]))
        for name, extra in runs:
            found[name] = preflight(
                experiment, Path(model).absolute(), mode, out / "preflight" / name, extra, sized=given is None
            )
            found[name]["model"] = "given" if given else "stand-in"
            print(f"{name}: verdict {found[name]['verdict']}, step {found[name]['step']['seconds']}", flush=True)
    return found


def passed(metrics: dict[str, Any]) -> bool:
    return metrics["jagg"]["passed"] and all(p["exit_status"] == 0 for p in metrics["preflight"].values())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    mode, out, start = CPU if args.cpu else GPU, args.out, time.perf_counter()
    (out / "preflight").mkdir(parents=True, exist_ok=True)
    found = run_preflights(args, mode, out)  # first: this process holds no GPU memory while they measure theirs
    real = json.loads((ARCH / "flux1-dev" / "transformer" / "config.json").read_text())
    config = real if mode.real_arch else dict(tiny_transformer("tiny").config)
    image, text = mode.jagg_tokens
    jagg = jagg_check(config, blocks=1, image_tokens=image, text_tokens=text, device=mode.device)
    print(f"jagg: {jagg['relative_errors']} (bound {jagg['bound']:.3g})", flush=True)
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    width = f"the real {jagg['width']}-wide" if mode.real_arch else "the tiny pipeline's"
    metrics = {
        "version": 1, "mode": mode.name, "date": date,
        **commit(), "stand_in": STAND_IN.format(width=width), "jagg": jagg, "preflight": found,
        "compile": compiled(found["flux_dance"], found["flux_dance_compiled"]) if mode.compile else None,
    }  # fmt: skip
    metrics["passed"], metrics["wall_seconds"] = passed(metrics), time.perf_counter() - start
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1, allow_nan=True))
    (out / "versions.json").write_text(json.dumps(versions(mode.device), indent=1))
    resolved_configs(out, list(found))
    shutil.rmtree(out / ".models", ignore_errors=True)  # the stand-in folders: scratch, rebuilt by any rerun
    write_sums(out)
    print(f"{'passed' if metrics['passed'] else 'FAILED'} in {metrics['wall_seconds']:.0f} s: {out}", flush=True)
    return 0 if metrics["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
