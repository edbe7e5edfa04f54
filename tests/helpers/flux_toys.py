"""The tiny Flux transformer of models/flux.py without guidance embedding, seeded, for the
distribution and checkpoint tests; tests/helpers/dist_worker.py imports it too."""

import torch
from diffusers import FluxTransformer2DModel

from models.flux import tiny_transformer


def tiny_flux_transformer(*, in_channels: int = 4, num_layers: int = 1, seed: int = 0) -> FluxTransformer2DModel:
    """``num_layers`` double and as many single blocks; weights from ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return tiny_transformer(
        latent_channels=in_channels // 4, num_layers=num_layers, num_single_layers=num_layers, guidance_embeds=False
    )
