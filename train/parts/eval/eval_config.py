"""The evaluation's settings (the ``eval`` group), read by the trainer's evaluator and ``python -m train.eval``
(train/parts/eval/protocol.py); each range checked when it is built, the trainer adding the group's path in front."""

from __future__ import annotations

from dataclasses import dataclass, field

from settings import Choice, member, non_negative, positive

# An override that adds an evaluation scorer to an empty eval.scorers, as typed on the command line
# (``eval.scorers={jpeg_compressibility: {}}`` needs quotes in a shell; ``+`` adds the key to the typed dict).
SCORERS_HINT = "+eval.scorers.jpeg_compressibility={}"


class GuardAction(Choice):
    """What the guard does when the watched metric fell while the training reward rose (train/parts/eval/watch.py)."""

    off = "off"
    warn = "warn"
    stop = "stop"


@dataclass
class GuardConfig:
    """The guard against a gamed reward (``eval.guard``; train/parts/eval/watch.py)."""

    action: GuardAction = GuardAction.off
    """off | warn (one line) | stop (end the run after the evaluation: its checkpoint, the exports and the summary
    written, then one line and exit status 2), when eval.metric fell for ``patience`` evaluations in a row while the
    mean training reward/total between evaluations rose.
    """
    patience: int = 3
    """Evaluations in a row, >= 1, that fell while the reward rose before the guard acts."""

    def __post_init__(self) -> None:
        self.action = member(GuardAction, self.action, "action")
        positive(self.patience, "patience")


@dataclass
class EvalConfig:
    """Evaluation: during training (``every``) and by python -m train.eval (train/parts/eval/protocol.py)."""

    every: int = 0
    """Evaluate before training, every N steps and after the last step (0 = never); eval/* at step k = after k steps."""
    prompts: str | None = None
    """Text or jsonl ({"prompt", "category"}) file of the evaluation prompts; null = data.train_prompts."""
    num_prompts: int = 0
    """The first this many of the evaluation prompts; 0 = all of them."""
    heldout_prompts: str | None = None
    """Prompts kept out of training, evaluated with the eval prompts (as many samples each) and logged as
    eval/<metric>/held-out: whether training on a prompt subset generalises (null = none).
    """
    num_steps: int = 28
    """ODE steps of evaluation sampling."""
    batch_size: int = 4
    """Prompts per rank per sampling call."""
    seed: int = 0
    """Prompt i starts from the noise of the stream (seed, "eval_noise", i) (train/distributed/seeds.py)."""
    samples_per_prompt: int = 1
    """Images per prompt, each from its own noise: sample j of prompt i (of n) is evaluation item j * n + i, so
    sample 0 keeps the noise of samples_per_prompt=1; more samples shrink the spread of a small prompt set.
    """
    grid_size: int = 16
    """Images in the PNG grid (the first prompts), and pairs in the before/after sheet."""
    transformer: str | None = None
    """python -m train.eval: the weights to evaluate: an export (<run>/export), a training checkpoint
    (<run>/checkpoints/step_XXXXXXXX) or a run folder (its export, else its latest checkpoint); null = pretrained.
    """
    compare_pretrained: bool = False
    """python -m train.eval: also evaluate the pretrained model (same prompts and noise) and report the paired
    difference.
    """
    max_images: int = 3200
    """The most images one evaluation may sample (prompts x samples_per_prompt, held-out ones included), >= 1: a
    larger set (eval.prompts unset falls back to every training prompt) is refused; cut it with num_prompts.
    """
    scorers: dict[str, dict] = field(default_factory=dict)
    """Metric name (hpsv2 | pickscore | clipscore | jpeg_compressibility | ...) -> scorer arguments (local paths)."""
    metric: str | None = None
    """The scorer of eval.scorers whose mean ranks the evaluations, higher is better (checkpoint.keep_best, the guard,
    python -m train.compare): its held-out mean, eval/<metric>/held-out, with eval.heldout_prompts, else
    eval/<metric>; null = the first of eval.scorers.
    """
    guard: GuardConfig = field(default_factory=GuardConfig)
    """Warn, or stop, when eval.metric falls while the training reward rises (train/parts/eval/watch.py)."""

    def __post_init__(self) -> None:
        non_negative(self.every, "every", " (0 = never)")
        non_negative(self.num_prompts, "num_prompts", " (0 = all of them)")
        for name in ("num_steps", "batch_size", "samples_per_prompt", "grid_size", "max_images"):
            positive(getattr(self, name), name)
        if self.every and not self.scorers:
            raise ValueError(f"every > 0 needs eval.scorers: add one, e.g. {SCORERS_HINT} (docs/rewards.md)")
        if self.metric is not None and self.metric not in self.scorers:
            known = ", ".join(self.scorers) or "none"
            raise ValueError(f"metric={self.metric!r} is not one of eval.scorers ({known}): name one, or null")
        if self.guard.action is not GuardAction.off and not self.every:
            raise ValueError(
                f"guard.action={self.guard.action} watches the evaluations, and eval.every=0 runs none: set "
                "eval.every > 0, or eval.guard.action=off"
            )
