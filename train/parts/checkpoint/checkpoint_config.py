"""The checkpoints' and the export's settings (the ``checkpoint`` group), each checking its own range when it is
built; the trainer adds the group's path in front (train/parts/config/keys.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from settings import non_negative, positive


@dataclass
class CheckpointConfig:
    """Checkpoints and the export (train/parts/checkpoint/manager.py)."""

    every: int = 0
    """Save every N steps (0 = only at the end); the last step is always saved."""
    keep_last: int = 3
    """Complete checkpoints kept, >= 1; older ones are deleted after each save."""
    export: bool = True
    """Write the trained transformer (or LoRA) in diffusers format at the end."""
    keep_best: bool = False
    """Keep the checkpoint of the best evaluation by eval.metric (checkpoints/best/, never pruned) and export it
    beside the last (export_best/); a checkpoint is then saved after every evaluation too (eval.every > 0).
    """
    overwrite: bool = False
    """Start a new run in a run folder that holds one, deleting its checkpoints, metrics, export and samples;
    without it (and without resume=) such a folder is refused.
    """
    allow_changed: list[str] = field(default_factory=list)
    """Settings a resumed run may change although they change what the weights mean or what the next steps compute
    (RESUME_SETTINGS of train/parts/checkpoint/settings.py: model.name/path/dtype/height/width/options, model.lora.*,
    seed, data.train_prompts (its prompts), sampler.*, update.*, grpo.*, batch.* (per rank: compared as the global batch
    with the world size), reward.*, ema.*), e.g. [seed]; any other change of these is refused.
    """

    def __post_init__(self) -> None:
        non_negative(self.every, "every", " (0 = only at the end)")
        positive(self.keep_last, "keep_last")
        # allow_changed names other groups' keys: train/run/checks.py checks it with the rules across groups
