"""The JAGG gradient of one segment against the exact one, in bf16 autocast against float32 (scripts/gpu_check.py).

A Flux transformer of ``blocks`` double and as many single blocks at the width of ``config`` (FLUX.1-dev's, or
the tiny pipeline's in the CPU mode), random weights, one segment of W steps on the DanceGRPO SDE with the real
GRPO step loss (PPO clip). ``backward_segment`` gives four gradients of the same weights and inputs: exact and
jagg, each in float32 (TF32 off: the reference) and under bf16 autocast with float32 weights (as the trainer
computes, train/parts/policy/predict.py). The relative errors |a - b| / |b| of the flattened gradients:

    jagg_bf16_vs_float32       bf16 JAGG against float32 JAGG: the rounding of bf16, held to ``bound``
    exact_bf16_vs_float32      the same for the exact path
    jagg_vs_exact_float32      JAGG's approximation itself at this width (random weights; reported, not bounded)
    jagg_bf16_vs_exact_float32 what a bf16 JAGG step gets against the float32 exact gradient
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from diffusers import FluxTransformer2DModel
from torch import Tensor

from samplers.schedule import shifted_sigmas
from samplers.sde import SDE, step
from train.algorithm.grpo import ppo_step_loss
from train.algorithm.jagg import backward_segment
from train.algorithm.metrics import Metric

# bf16's machine epsilon (2^-7) times this. The velocity of a random Flux transformer under bf16 autocast is off
# its float32 value by about 4 eps (norm-wise; modulation and attention amplify each op's rounding), and a
# parameter gradient, a sum over tokens of terms that largely cancel, by 12 to 22 eps (0.11 .. 0.17, measured on
# the tiny transformer on CPU, 5 seeds, for JAGG and exact alike): 32 eps = 0.25 leaves that margin, and a path
# that computed another gradient (JAGG against exact differs by 0.7 .. 0.9 here) fails it
BOUND_EPS = 32.0
SEGMENT = 4  # W, flux_dance's update.segment_length


def transformer(config: dict[str, Any], blocks: int, device: torch.device) -> FluxTransformer2DModel:
    """``config`` (a diffusers config) cut to ``blocks`` blocks of each kind, random float32 weights."""
    options = {key: value for key, value in config.items() if not key.startswith("_")}
    options |= {"num_layers": blocks, "num_single_layers": blocks}
    return FluxTransformer2DModel(**options).to(device)


def predictor(model: FluxTransformer2DModel, image_tokens: int, text_tokens: int, device: torch.device) -> Callable:
    """v = model(z, t) with one random prompt's conditioning and the image's position ids (a square of tokens)."""
    side = math.isqrt(image_tokens)
    grid = torch.cartesian_prod(torch.arange(side), torch.arange(side)).float()
    img_ids = torch.cat([torch.zeros(side * side, 1), grid], 1).to(device)
    text = torch.randn(1, text_tokens, model.config.joint_attention_dim, device=device)
    pooled = torch.randn(1, model.config.pooled_projection_dim, device=device)

    def predict(z: Tensor, t: Tensor) -> Tensor:
        rows, ids = z.shape[0], torch.zeros(text_tokens, 3, device=device)
        return model(
            hidden_states=z, timestep=t, guidance=torch.full_like(t, 3.5), img_ids=img_ids, txt_ids=ids,
            encoder_hidden_states=text.expand(rows, -1, -1), pooled_projections=pooled.expand(rows, -1),
            return_dict=False,
        )[0]  # fmt: skip

    return predict


def segment(predict: Callable, channels: int, image_tokens: int, device: torch.device) -> tuple:
    """z [W] latents, t [W] timesteps and the GRPO step loss of one segment sampled by ``predict`` in float32."""
    sde = SDE("dance", eta=0.3)
    sigmas = shifted_sigmas(20, 3.0)[: SEGMENT + 1].float().to(device)
    t = sigmas[:-1].clone()
    z = [torch.randn(1, image_tokens, channels, device=device) for _ in range(SEGMENT)]
    advantage = torch.ones(1, device=device)
    with torch.no_grad():
        outs = [step(sde, predict(z[j], t[j].expand(1)), z[j], sigmas[j], sigmas[j + 1]) for j in range(SEGMENT)]

    def step_loss(j: int, v: Tensor) -> tuple[Tensor, dict[str, Metric]]:
        logp = step(sde, v, z[j], sigmas[j], sigmas[j + 1], next_z=outs[j].next_z).log_prob
        return ppo_step_loss(logp, outs[j].log_prob, advantage, clip_range=10.0)  # no step clipped

    return z, t, step_loss


def gradient(model: FluxTransformer2DModel, mode: str, predict: Callable, seg: tuple, bf16: bool) -> Tensor:
    """The flattened float32 gradient of the segment's loss by ``mode``, under bf16 autocast or in float32."""
    model.zero_grad(set_to_none=True)
    device_type = next(model.parameters()).device.type

    def run(z: Tensor, t: Tensor) -> Tensor:
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16):
            return predict(z, t)

    backward_segment(mode, run, seg[2], seg[0], seg[1])
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).double()


def relative(a: Tensor, b: Tensor) -> float:
    return float((a - b).norm() / b.norm())


def jagg_check(config: dict[str, Any], *, blocks: int, image_tokens: int, text_tokens: int, device: str) -> dict:
    """The four gradients' relative errors (module docstring), with the sizes, the bound and whether it held."""
    where = torch.device(device)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the float32 reference is float32
    try:
        torch.manual_seed(0)
        model = transformer(config, blocks, where)
        predict = predictor(model, image_tokens, text_tokens, where)
        seg = segment(predict, model.config.in_channels, image_tokens, where)
        grads = {
            (mode, bf16): gradient(model, mode, predict, seg, bf16)
            for mode in ("exact", "jagg")
            for bf16 in (False, True)
        }
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    errors = {
        "jagg_bf16_vs_float32": relative(grads["jagg", True], grads["jagg", False]),
        "exact_bf16_vs_float32": relative(grads["exact", True], grads["exact", False]),
        "jagg_vs_exact_float32": relative(grads["jagg", False], grads["exact", False]),
        "jagg_bf16_vs_exact_float32": relative(grads["jagg", True], grads["exact", False]),
    }
    bound = BOUND_EPS * torch.finfo(torch.bfloat16).eps
    width = int(config["num_attention_heads"]) * int(config["attention_head_dim"])
    return {
        "device": str(where), "width": width, "blocks": f"{blocks}+{blocks}", "segment_length": SEGMENT,
        "image_tokens": image_tokens, "text_tokens": text_tokens, "weights": "random", "dtype": "bfloat16 autocast",
        "reference": "float32, TF32 off", "parameters": sum(p.numel() for p in model.parameters()),
        "relative_errors": errors, "bound": bound, "bound_of": "jagg_bf16_vs_float32, exact_bf16_vs_float32",
        "passed": errors["jagg_bf16_vs_float32"] < bound and errors["exact_bf16_vs_float32"] < bound,
    }  # fmt: skip
