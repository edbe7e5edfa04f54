"""The reward stage of a step in the plan: the scorers' time on a rank, and how much of it the rollout hides.

A rank's rollout runs in chunks of whole groups (``reward.chunk_groups``; 0: one chunk; auto: quarters with a served
term), each chunk decoded and scored while the next one rolls out. Served scorers (``Scorer.runs_remotely``: the remote
scorer, the judge) answer while the rank goes on rolling out; local scorers score on the rank between chunks, so their
time is exposed. With one chunk everything is exposed; with n chunks the served scoring of the first n - 1 chunks hides
behind the next chunk's rollout, up to that rollout's time:

    hidden = (n - 1) min(served, rollout / n)        exposed = local + n served - hidden

``local``: the local scorers' time per step (their forwards' FLOPs on every image of the rank at the plan's MFU, or
as the preflight measured it); ``served``: the slowest served scorer's answer for one chunk
(``plan.served_reward_seconds``, an assumption, or as the preflight measured it); ``rollout``: the step's rollout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from rewards.imagereward import MAX_PROMPT_TOKENS
from train.parts.config.schema import TrainConfig


@dataclass(frozen=True)
class RewardTiming:
    """The timing of the reward stage of one rank's step: its chunks, its scorers and their seconds."""

    chunks: int  # the rollout's chunks (reward.chunk_groups)
    local: tuple[str, ...]  # the rewards scored on the rank
    served: tuple[str, ...]  # the rewards a server scores (Scorer.runs_remotely)
    local_flops: float  # per step: the local scorers' forwards on each image of the rank (0 for those without weights)
    served_seconds: float  # per chunk: the slowest served scorer's answer
    source: str  # where the seconds come from: "plan.served_reward_seconds" (assumed) or "measured"
    local_seconds: float | None = None  # per step, as measured (the preflight); None: from local_flops

    def split(self, local_seconds: float, rollout_seconds: float) -> tuple[float, float]:
        """(exposed, hidden) seconds per step (the module docstring), the local scorers taking ``local_seconds``
        (``local_seconds`` when measured replaces it) and the rollout ``rollout_seconds``."""
        local = self.local_seconds if self.local_seconds is not None else local_seconds
        served = self.served_seconds if self.served else 0.0
        hidden = (self.chunks - 1) * min(served, rollout_seconds / self.chunks)
        return local + self.chunks * served - hidden, hidden


def scorer_flops(scorer: nn.Module) -> float | None:
    """FLOPs of a frozen scorer's forward on one image and one prompt at its own input sizes, counted on the meta
    device: open_clip's ``model(image, text)``, ImageReward's ``model(pixels, input_ids, attention_mask)`` or
    transformers' CLIP ``model(input_ids=, pixel_values=)``; None for another architecture (not counted)."""
    module: Any = scorer  # a third-party model (open_clip, transformers): its own attributes
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        if hasattr(module, "encode_image"):  # open_clip
            size = module.visual.image_size
            side = size[0] if isinstance(size, (tuple, list)) else size
            image = torch.empty(1, 3, side, side, device="meta")
            module(image, torch.zeros(1, module.context_length, dtype=torch.long, device="meta"))
        elif hasattr(module, "visual_encoder") and hasattr(module, "text_encoder"):  # ImageReward (BLIP)
            side = module.visual_encoder.config.image_size
            tokens = torch.zeros(1, MAX_PROMPT_TOKENS, dtype=torch.long, device="meta")
            module(torch.empty(1, 3, side, side, device="meta"), tokens, None)  # no mask: its check reads values
        elif hasattr(module, "vision_model") and hasattr(module, "text_model"):  # transformers' CLIPModel
            config = module.config
            side = config.vision_config.image_size
            tokens = torch.zeros(1, config.text_config.max_position_embeddings, dtype=torch.long, device="meta")
            module(input_ids=tokens, pixel_values=torch.empty(1, 3, side, side, device="meta"))
        else:
            return None
    return float(counter.get_total_flops())


def reward_timing(cfg: TrainConfig, flops_per_image: dict[str, float], served_seconds: float) -> RewardTiming:
    """The reward stage of ``cfg``'s step on a rank: ``flops_per_image`` of its local scorers with weights (one
    image and prompt), ``served_seconds`` the answer of a served scorer for one chunk."""
    names = list(cfg.reward.components)
    served = tuple(cfg.reward.served_terms())
    images = cfg.grpo.group_size * cfg.batch.prompts_per_rank
    return RewardTiming(
        chunks=len(cfg.reward.chunks(cfg.batch.prompts_per_rank)),  # those the step rolls out
        local=tuple(name for name in names if name not in served),
        served=served,
        local_flops=images * sum(flops_per_image.get(name, 0.0) for name in names if name not in served),
        served_seconds=served_seconds,
        source="plan.served_reward_seconds",
    )
