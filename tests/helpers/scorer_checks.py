"""What every image reward's scorer must do (tests/unit/test_rewards_*.py): score a batch as it scores each image
alone, and pass a gradient to the images while its own weights stay frozen."""

from __future__ import annotations

import torch


def uint8_images(num: int, height: int, width: int, seed: int) -> torch.Tensor:
    """Random pixels, (num, 3, height, width) uint8."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (num, 3, height, width), generator=generator, dtype=torch.uint8)


def assert_batched_equals_one_by_one(scorer, images: torch.Tensor, prompts: list[str], atol: float) -> torch.Tensor:
    """The batch's scores (returned): float32, one per image, each as the image scored alone."""
    batched = scorer(images, prompts)
    single = torch.cat([scorer(images[i : i + 1], [prompts[i]]) for i in range(len(prompts))])
    assert batched.dtype == torch.float32 and batched.shape == (len(prompts),)
    torch.testing.assert_close(batched, single, atol=atol, rtol=0)
    return batched


def assert_gradient_reaches_images_and_weights_are_frozen(scorer, images: torch.Tensor, prompts: list[str]) -> None:
    images = images.requires_grad_(True)
    scorer(images, prompts).sum().backward()
    assert images.grad is not None and torch.isfinite(images.grad).all() and images.grad.abs().sum() > 0
    assert not scorer.model.training
    assert not any(p.requires_grad for p in scorer.model.parameters())
