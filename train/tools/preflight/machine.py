"""The machine a rank runs on: versions, its GPU, bf16, the attention kernel the transformer's shapes get, whether
inductor compiles; and the world and its mesh."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from models.base import parse_dtype
from train.distributed.parallelize import compile_unavailable, mesh_shape
from train.parts.config.schema import TrainConfig
from train.tools.preflight.verdict import RankChecks, Status

GIB = 2**30
SDPA_NAMES = {
    SDPBackend.FLASH_ATTENTION: "flash",
    SDPBackend.EFFICIENT_ATTENTION: "memory-efficient",
    SDPBackend.CUDNN_ATTENTION: "cuDNN",
    SDPBackend.MATH: "math",
}


def _driver() -> str | None:
    """The NVIDIA driver's version (nvidia-smi's answer), or None without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.splitlines()[0].strip() if out.stdout.strip() else None


def describe(device: torch.device, *, rank: int, world_size: int, replicate: int) -> dict[str, Any]:
    """What this rank runs on (JSON-ready)."""
    info: dict[str, Any] = {
        "rank": rank,
        "host": socket.gethostname(),
        "node": int(os.environ.get("GROUP_RANK", "0")),  # torchrun's rank of this node's agent
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        "world_size": world_size,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": str(device),
        "cpu_threads": torch.get_num_threads(),
    }
    try:
        info["mesh"] = list(mesh_shape(world_size, replicate))
    except ValueError:
        info["mesh"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {
            "gpu": props.name,
            "gpu_memory_gib": round(props.total_memory / GIB, 1),
            "bf16": torch.cuda.is_bf16_supported(),
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "driver": _driver(),
        }
    return info


def machine_line(info: dict[str, Any]) -> str:
    if "gpu" not in info:
        return f"{info['host']}: CPU; torch {info['torch']}"
    gpu = f"{info['gpu']} {info['gpu_memory_gib']} GiB, bf16 {'yes' if info['bf16'] else 'no'}"
    versions = f"torch {info['torch']}, CUDA {info['cuda']}, NCCL {info['nccl']}, driver {info['driver']}"
    return f"{info['host']}: {gpu}; {versions}"


def sdpa_backend(shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device) -> str | None:
    """The kernel scaled-dot-product attention picks for one sample of ``shape`` (torch's order of preference,
    the first that runs), or None when none does."""
    heads, tokens, dim = shape
    q = torch.randn(1, heads, tokens, dim, device=device, dtype=dtype)
    for code in torch._C._get_sdp_priority_order():
        backend = SDPBackend(code)
        if backend not in SDPA_NAMES:
            continue
        try:
            with sdpa_kernel([backend]):
                torch.nn.functional.scaled_dot_product_attention(q, q, q)
        except RuntimeError:
            continue
        return SDPA_NAMES[backend]
    return None


def check_attention(
    checks: RankChecks, cfg: TrainConfig, config: dict[str, Any], tokens: int, device: torch.device
) -> None:
    shape = int(config["num_attention_heads"]), tokens, int(config["attention_head_dim"])  # (heads, tokens, head dim)
    what = f"{shape[0]} heads x {shape[1]} tokens x {shape[2]} dims in {cfg.model.dtype}"
    if device.type != "cuda":
        checks.add("attention", Status.skipped, f"CPU: no GPU kernel to check ({what})")
        return
    kernel = sdpa_backend(shape, parse_dtype(cfg.model.dtype), device)
    if kernel is None:
        checks.add("attention", Status.failed, f"no attention kernel runs {what}", "check the torch and CUDA install")
    elif kernel == "math":
        fix = "use model.dtype=bfloat16 and a GPU and torch build with flash or memory-efficient attention"
        checks.add("attention", Status.warned, f"the math kernel (slow, L x L memory) for {what}", fix)
    else:
        checks.add("attention", Status.passed, f"the {kernel} kernel for {what}")


def check_compile(checks: RankChecks, cfg: TrainConfig, device: torch.device) -> None:
    """With model.compile, inductor compiles a tiny function on this rank's device."""
    if not cfg.model.compile:
        checks.add("compile", Status.skipped, "model.compile=false")
        return
    fix = "install what it names, or set model.compile=false"
    if why := compile_unavailable(device.type):
        checks.add("compile", Status.failed, f"model.compile=true: {why}", fix)
        return
    try:
        out = torch.compile(lambda x: torch.sin(x) * 2 + 1)(torch.ones(8, device=device))
        torch.testing.assert_close(out, torch.sin(torch.ones(8, device=device)) * 2 + 1)
    except Exception as err:  # inductor's own failure (a compiler that does not work, Triton's), in one line
        line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        checks.add(
            "compile", Status.failed, f"model.compile=true: inductor could not compile a tiny function: {line}", fix
        )
        return
    checks.add("compile", Status.passed, f"inductor compiles on {device.type}")
