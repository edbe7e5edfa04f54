"""Each reward's scorer timed on this rank: its latency (one image) and its throughput (a chunk of the rank's images,
reward.chunk_groups groups), and whether the reward stage hides behind the rollout (train/tools/plan/reward.py). A
scorer that gives no finite score (a served one whose server does not answer within its deadline) is not timed,
and fails the reward check with one line naming the term and the fix."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from rewards.base import Scorer
from rewards.served import ServedScorer
from train.parts.config.schema import TrainConfig
from train.run.parts import Run
from train.tools.plan.report import PlanReport
from train.tools.preflight.verdict import Check, Status


@dataclass(frozen=True)
class ScorerTiming:
    """One reward's scorer on one rank; a scorer that gave no finite score is not timed (``no_score`` says why)."""

    name: str
    served: bool  # scored by a server (Scorer.runs_remotely)
    latency_s: float | None  # one image and prompt; None: not measured
    batch: int  # the images of one chunk
    batch_s: float | None  # scoring them in one call; None: not measured
    no_score: str = ""  # why the warm-up call gave no finite score, naming the term; "" when it did
    fix: str = ""  # then what to change

    def text(self) -> str:
        """``judge (served) 0.5 s for 1 image, 4 images/s in a batch of 2``, or why it was not timed."""
        if self.latency_s is None or self.batch_s is None:
            return self.no_score
        return (
            f"{self.name} ({'served' if self.served else 'local'}) {self.latency_s:.3g} s for 1 image, "
            f"{self.batch / self.batch_s:.3g} images/s in a batch of {self.batch}"
        )


def chunk_images(cfg: TrainConfig) -> int:
    """The images of the first (the largest) chunk of a rank's rollout, as the step rolls it out."""
    return cfg.grpo.group_size * len(cfg.reward.chunks(cfg.batch.prompts_per_rank)[0])


def _timed(run: Run, score: object, images: torch.Tensor, prompts: list[str]) -> float:
    sync = torch.cuda.synchronize if run.device.type == "cuda" else (lambda: None)
    sync()
    started = time.perf_counter()
    score(images, prompts)  # type: ignore[operator]
    sync()
    return time.perf_counter() - started


def no_score(name: str, scorer: Scorer) -> tuple[str, str]:
    """Why term ``name``'s scorer gave no finite score, and what to change: a served one's server did not answer
    within its deadline on any try (or refused with 429 or 5xx: its warning says which), a local one scored NaN
    or inf."""
    if not isinstance(scorer, ServedScorer):
        line = f"reward.components.{name} scored NaN or inf on images of the run's size, so it was not timed"
        return line, f"reward.components.{name}'s scorer must give a finite score per image (docs/rewards.md)"
    server, tries = scorer.server, scorer.server.retries + 1
    line = (
        f"reward.components.{name}: {server.name} gave no score: it did not answer within "
        f"timeout_s={server.timeout_s:g} on {tries} tr{'ies' if tries > 1 else 'y'} (or answered 429 or 5xx, as its "
        "warning says), so no latency was measured"
    )
    fix = (
        f"check that the server at {server.url} answers (reward.components.{name}'s address, the server's own "
        f"log), or raise reward.components.{name}.timeout_s"
    )
    return line, fix


def time_scorers(run: Run) -> list[ScorerTiming]:
    """Every reward's scorer on images of the run's size (uniform noise) and the run's prompts after one warm-up
    call: one image, then a chunk's images in one call; a scorer whose warm-up gives no finite score, not timed."""
    cfg, batch = run.cfg, chunk_images(run.cfg)
    images = torch.rand(batch, 3, cfg.model.height, cfg.model.width, device=run.device, generator=None)
    records = run.data.prompts.records  # the run's own prompts: a scorer may read them (the testbed's shapes do)
    prompts = [records[i % len(records)].prompt for i in range(batch)]
    out = []
    with torch.no_grad():
        for name, (scorer, _) in run.data.reward_stage.rewards.components.items():
            served = scorer.runs_remotely
            # loads what it loads lazily, warms the kernels or the connection
            if not bool(torch.isfinite(scorer(images[:1], prompts[:1])).all()):
                out.append(ScorerTiming(name, served, None, batch, None, *no_score(name, scorer)))
                continue
            one = _timed(run, scorer, images[:1], prompts[:1])
            out.append(ScorerTiming(name, served, one, batch, _timed(run, scorer, images, prompts)))
    return out


def measured_reward(report: PlanReport, timings: list[ScorerTiming]) -> PlanReport:
    """``report`` with its reward stage as measured: the local scorers' time for every image of a rank, the slowest
    served scorer's for a chunk."""
    stage = report.reward
    if stage is None or not timings:
        return report
    images = report.samples_per_rank
    local = sum(t.batch_s * images / t.batch for t in timings if not t.served and t.batch_s is not None)
    served = max((t.batch_s for t in timings if t.served and t.batch_s is not None), default=0.0)
    return replace(report, reward=replace(stage, local_seconds=local, served_seconds=served, source="measured"))


def reward_check(report: PlanReport, timings: list[ScorerTiming]) -> Check:
    """Whether the reward hides behind the rollout, with each scorer's latency and throughput; failed, naming the
    term, when a scorer gave no score."""
    stage = report.reward
    assert stage is not None
    if none := [t for t in timings if t.no_score]:
        return Check("reward", Status.failed, "; ".join(t.no_score for t in none), "; ".join(t.fix for t in none))
    each = "; ".join(t.text() for t in timings)
    exposed, hidden = report.reward_seconds()
    (_, flops, traffic), *_ = report.time_terms()
    chunk_rollout = report.seconds_of(flops, traffic) / stage.chunks
    line = f"{each}; {stage.chunks} chunk(s), the rollout of one {chunk_rollout:.3g} s at full depth"
    if stage.served and stage.served_seconds > chunk_rollout or stage.served and stage.chunks == 1:
        fix = "score in chunks (reward.chunk_groups) while the rollout goes on, or serve the scorer faster"
        return Check("reward", Status.warned, f"{line}: {exposed:.3g} s exposed per step, {hidden:.3g} s hidden", fix)
    local = f", the local scorers' {stage.local_seconds or 0.0:.3g} s between chunks exposed" if stage.local else ""
    served = "served scoring hides behind the rollout" if stage.served else "no served scorer"
    return Check("reward", Status.passed, f"{line}: {served}{local}")
