"""A tiny random FluxTransformer2DModel (head_dim 16, 2 heads, text width 32), seeded, for the
distribution and checkpoint tests; tests/dist_worker.py imports it too."""

import torch
from diffusers import FluxTransformer2DModel


def tiny_flux_transformer(*, in_channels: int = 4, num_layers: int = 1, seed: int = 0) -> FluxTransformer2DModel:
    """``num_layers`` double and as many single blocks; weights from ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=in_channels,
        num_layers=num_layers,
        num_single_layers=num_layers,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=[4, 4, 8],
    )
