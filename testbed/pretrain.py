"""Pretraining of the testbed's tiny Flux-architecture pipeline from scratch on the shape set.

Components: CLIP and T5 text encoders, random and frozen (the CLIP BPE of models/tiny.py; a T5
Unigram vocabulary holding every testbed word whole, so a caption is a few word tokens); an
AutoencoderKL (32x32 px -> 16x16x4) trained first; a FluxTransformer2DModel trained second.

1. VAE: reconstruction MSE on the images in [-1, 1] plus ``kl_weight`` x KL(q(z|x) || N(0, I)),
   decoding a posterior sample (so the decoder tolerates the flow model's small latent errors).
   Then shift_factor = mean and scaling_factor = 1 / std of the posterior means over the set are
   written into the VAE config, as diffusers' Flux VAE carries them.
2. Flow: packed normalized latents x0 = pack((mode(q(z|x)) - shift) x scale), captions encoded
   once by the backbone adapter, and the rectified-flow objective through the adapter's predict:
       t ~ U(0, 1), eps ~ N(0, I), x_t = (1 - t) x0 + t eps,  loss = || v(x_t, t) - (eps - x0) ||^2
   (the trainer's convention: sigma = 1 is noise, v points from data to noise).

Everything is drawn from generators seeded by the config's seed: a run is deterministic on a given
machine and thread count.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import FluxPipeline
from torch import Tensor

from models.components import quiet_progress_bars
from models.diffusers_backbone import pack_latents
from models.flux import FluxBackbone, FluxConditioning, random_pipeline, t5_tokenizer
from models.registry import load_backbone
from rewards.shapes import COLOURS, POSITIONS, SHAPES, SIZES
from samplers.rollout import rollout
from samplers.sampler_config import SamplerConfig
from samplers.sde import SDEKind

MARKER = "testbed_build.json"
TEXT_WIDTH = 64  # CLIP and T5 hidden size (= the transformer's joint and pooled projection dims)
MAX_SEQUENCE_LENGTH = 16  # T5 tokens per caption: the longest caption is 11 words + </s>
TRANSFORMER = dict(
    num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=4, axes_dims_rope=[4, 6, 6]
)
Log = Callable[[str], None]


@dataclass
class PretrainConfig:
    """Sizes and lengths of a pretraining run (steps are optimizer steps)."""

    seed: int = 0
    num_images: int = 8192  # images drawn from the set (seed = seed)
    batch_size: int = 64  # flow-model batch
    vae_batch_size: int = 32
    vae_steps: int = 500
    vae_lr: float = 2e-3
    kl_weight: float = 1e-4
    flow_steps: int = 2000
    flow_lr: float = 1e-3
    warmup_steps: int = 100  # linear learning-rate warmup of the flow model


def testbed_words() -> list[str]:
    """Every word a testbed caption uses."""
    words = {"a", "an", "and", "at", "in", "the", *COLOURS, *SHAPES, *SIZES}
    for position in POSITIONS:
        words.update(position.split())
    return sorted(words)


def untrained_pipeline() -> FluxPipeline:
    """The random pipeline (torch's global RNG initializes the weights): the Flux adapter's random
    pipeline with wider text encoders, a T5 vocabulary holding every testbed word whole (single
    letters are already pieces), a wider VAE without mid-block attention and 2+2 blocks."""
    return random_pipeline(
        tokenizer_2=t5_tokenizer([w for w in testbed_words() if len(w) > 1], max_length=MAX_SEQUENCE_LENGTH),
        text_width=TEXT_WIDTH,
        ff=128,
        t5_head_dim=16,
        vae=dict(sample_size=32, block_out_channels=(16, 32), latent_channels=4, mid_block_add_attention=False),
        transformer=dict(latent_channels=4, **TRANSFORMER),
    )


def save_untrained(path: str | Path, *, seed: int) -> Path:
    """Write the random pipeline to ``path`` (weights from ``seed``)."""
    with torch.random.fork_rng(devices=[]), quiet_progress_bars():
        torch.manual_seed(seed)
        pipeline: Any = untrained_pipeline()  # DiffusionPipeline's methods are not visible to mypy
        pipeline.save_pretrained(path)
    return Path(path)


def load_testbed(path: str | Path, *, dtype: torch.dtype = torch.float32) -> FluxBackbone:
    """The pipeline folder through the Flux backbone adapter (guidance and T5 length as trained)."""
    backbone = load_backbone("flux", path, dtype=dtype, guidance=3.5, max_sequence_length=MAX_SEQUENCE_LENGTH)
    assert isinstance(backbone, FluxBackbone)
    return backbone


def _fit(module: Any, loss: Callable[[], Tensor], steps: int, lr: float, log: Log | None, what: str,
         warmup_steps: int = 0, max_norm: float | None = None) -> list[float]:  # fmt: skip
    """Train ``module`` in place: AdamW on ``loss()`` for ``steps`` steps, the learning rate warmed up linearly over
    ``warmup_steps``, the gradient norm clipped to ``max_norm``; returns every step's loss (``what``: the log line)."""
    module.train().requires_grad_(True)
    optimizer = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(warmup_steps, 1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    losses = []
    for step in range(steps):
        value = loss()
        optimizer.zero_grad(set_to_none=True)
        value.backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm)
        optimizer.step()
        schedule.step()
        losses.append(value.item())
        if log is not None and (step + 1) % 100 == 0:
            log(what.format(step=step + 1, steps=steps, loss=sum(losses[-100:]) / 100))
    module.eval().requires_grad_(False)
    return losses


def train_vae(
    vae: Any, images: Tensor, config: PretrainConfig, *, generator: torch.Generator, log: Log | None = None
) -> list[float]:
    """Train ``vae`` in place on images [N, 3, H, W] in [0, 1]; returns the loss of every step."""

    def loss() -> Tensor:
        x = images[torch.randint(len(images), (config.vae_batch_size,), generator=generator)] * 2 - 1
        posterior = vae.encode(x).latent_dist
        z = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=generator)
        recon = vae.decode(z).sample
        return (recon - x).pow(2).mean() + config.kl_weight * posterior.kl().mean() / x[0].numel()

    return _fit(vae, loss, config.vae_steps, config.vae_lr, log, "vae step {step}/{steps} loss {loss:.5f}")


@torch.no_grad()
def latent_means(vae: Any, images: Tensor, *, batch_size: int = 512) -> Tensor:
    """Posterior means [N, C, h, w] of images [N, 3, H, W] in [0, 1]."""
    return torch.cat([vae.encode(x * 2 - 1).latent_dist.mean for x in images.split(batch_size)])


def set_latent_scaling(backbone: FluxBackbone, means: Tensor) -> tuple[float, float]:
    """Write shift_factor = mean and scaling_factor = 1 / std of ``means`` into the VAE config (the
    module's and the adapter's copy); returns (shift, scale)."""
    shift, scale = means.mean().item(), 1.0 / means.std().item()
    backbone.vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    backbone.configs["vae"].update(shift_factor=shift, scaling_factor=scale)
    return shift, scale


def flow_matching_loss(
    backbone: FluxBackbone, x0: Tensor, cond: FluxConditioning, *, generator: torch.Generator
) -> Tensor:
    """Rectified-flow loss of packed latents x0 [B, h/2, w/2, 4C] under conditioning ``cond`` (B rows)."""
    t = torch.rand(x0.shape[0], generator=generator)
    eps = torch.randn(x0.shape, generator=generator)
    tb = t.view(-1, *([1] * (x0.ndim - 1)))
    x_t = (1 - tb) * x0 + tb * eps
    return (backbone.predict(x_t, t, cond) - (eps - x0)).pow(2).mean()


def train_flow(
    backbone: FluxBackbone,
    latents: Tensor,
    cond: FluxConditioning,
    config: PretrainConfig,
    *,
    generator: torch.Generator,
    log: Log | None = None,
) -> list[float]:
    """Train the backbone's transformer in place on packed latents [N, ...] with ``cond`` (N rows)."""

    def loss() -> Tensor:
        rows = torch.randint(len(latents), (config.batch_size,), generator=generator)
        return flow_matching_loss(backbone, latents[rows], cond.index(rows), generator=generator)

    what = "flow step {step}/{steps} loss {loss:.4f}"
    return _fit(backbone.transformer, loss, config.flow_steps, config.flow_lr, log, what, config.warmup_steps, 1.0)


def pretrain(
    path: str | Path, images: Tensor, captions: list[str], config: PretrainConfig, *, log: Log | None = None
) -> dict:
    """Build, train and save the testbed pipeline at ``path``; returns a summary (losses, scaling)."""
    path = Path(path)
    if path.exists() and any(path.iterdir()):
        raise ValueError(f"{path} exists and is not empty; remove it or pick another output folder")
    save_untrained(path, seed=config.seed)
    backbone = load_testbed(path)
    generator = torch.Generator().manual_seed(config.seed)
    vae_losses = train_vae(backbone.vae, images, config, generator=generator, log=log)
    means = latent_means(backbone.vae, images)
    shift, scale = set_latent_scaling(backbone, means)
    latents = pack_latents((means - shift) * scale)
    unique = sorted(set(captions))
    index = {c: i for i, c in enumerate(unique)}
    encoded = backbone.encode(unique)
    assert isinstance(encoded, FluxConditioning)
    cond = encoded.index([index[c] for c in captions])
    flow_losses = train_flow(backbone, latents, cond, config, generator=generator, log=log)
    with quiet_progress_bars():
        backbone.vae.save_pretrained(path / "vae")
        transformer: Any = backbone.transformer  # a diffusers model
        transformer.save_pretrained(path / "transformer")
    summary = {
        "config": asdict(config),
        "latent_shift": shift,
        "latent_scale": scale,
        "vae_loss_last100": sum(vae_losses[-100:]) / len(vae_losses[-100:]),
        "flow_loss_first100": sum(flow_losses[:100]) / len(flow_losses[:100]),
        "flow_loss_last100": sum(flow_losses[-100:]) / len(flow_losses[-100:]),
    }
    (path / MARKER).write_text(json.dumps(summary, indent=1) + "\n")
    return summary


@torch.no_grad()
def sample(
    backbone: FluxBackbone, prompts: list[str], *, num_steps: int = 9, shift: float = 3.0, seed: int = 0
) -> Tensor:
    """ODE samples [B, 3, 32, 32] in [0, 1] of ``prompts`` from noise seeded by ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    noise = backbone.initial_noise(len(prompts), height=32, width=32, generator=generator)
    sigmas = backbone.sigmas(num_steps, height=32, width=32, shift=shift)
    traj = rollout(backbone.predict, backbone.encode(prompts), noise, SamplerConfig(sde=SDEKind.ode), sigmas=sigmas)
    return backbone.decode(traj.latents[:, -1])
