"""Each reward's scorer timed on this rank: its latency (one image) and its throughput (a chunk of the rank's images,
reward.chunk_groups groups), and whether the reward stage hides behind the rollout (train/tools/plan/reward.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from train.parts.config.schema import TrainConfig
from train.run.parts import Run
from train.tools.plan.report import PlanReport
from train.tools.preflight.verdict import Check, Status


@dataclass(frozen=True)
class ScorerTiming:
    """One reward's scorer on one rank."""

    name: str
    served: bool  # scored by a server (Scorer.runs_remotely)
    latency_s: float  # one image and prompt
    batch: int  # the images of one chunk
    batch_s: float  # scoring them in one call

    @property
    def images_per_s(self) -> float:
        return self.batch / self.batch_s


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


def time_scorers(run: Run) -> list[ScorerTiming]:
    """Every reward's scorer on images of the run's size (uniform noise) and the run's prompts after one warm-up
    call: one image, then a chunk's images in one call."""
    cfg, batch = run.cfg, chunk_images(run.cfg)
    images = torch.rand(batch, 3, cfg.model.height, cfg.model.width, device=run.device, generator=None)
    records = run.data.prompts.records  # the run's own prompts: a scorer may read them (the testbed's shapes do)
    prompts = [records[i % len(records)].prompt for i in range(batch)]
    out = []
    with torch.no_grad():
        for name, (scorer, _) in run.data.reward_stage.rewards.components.items():
            scorer(images[:1], prompts[:1])  # loads what it loads lazily, warms the kernels or the connection
            one = _timed(run, scorer, images[:1], prompts[:1])
            out.append(ScorerTiming(name, scorer.runs_remotely, one, batch, _timed(run, scorer, images, prompts)))
    return out


def measured_reward(report: PlanReport, timings: list[ScorerTiming]) -> PlanReport:
    """``report`` with its reward stage as measured: the local scorers' time for every image of a rank, the slowest
    served scorer's for a chunk."""
    stage = report.reward
    if stage is None or not timings:
        return report
    images = report.samples_per_rank
    local = sum(t.batch_s * images / t.batch for t in timings if not t.served)
    served = max((t.batch_s for t in timings if t.served), default=0.0)
    return replace(report, reward=replace(stage, local_seconds=local, served_seconds=served, source="measured"))


def reward_check(report: PlanReport, timings: list[ScorerTiming]) -> Check:
    """Whether the reward hides behind the rollout, with each scorer's latency and throughput."""
    stage = report.reward
    assert stage is not None
    each = "; ".join(
        f"{t.name} ({'served' if t.served else 'local'}) {t.latency_s:.3g} s for 1 image, {t.images_per_s:.3g} "
        f"images/s in a batch of {t.batch}"
        for t in timings
    )
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
