"""The reward stage: the step (train/loop/step.py) rolls its rollout out in chunks of whole GRPO groups
(``reward.chunk_groups``, ``RewardStageConfig.chunks``) and hands each chunk's images to the step's scores as soon
as it is decoded, so that a served term scores a chunk while the next one rolls out; the stage scores and
collects, and the step's advantages wait for every score, so the result equals scoring after the whole rollout
(to float rounding: other batch shapes).

    chunk 1: rollout | decode | local scores, submit to the served scorers' workers
    chunk 2:          rollout  | decode | local scores, submit ...
    ...                                                          | collect: wait for the served scores
    agree with the other ranks (one all-reduce) -> advantages

A served scorer (``Scorer.runs_remotely``: the remote reward, a judge) scores in a background thread of its own,
one request at a time, so at most one request per served term is in flight while the rollout runs; a local
scorer runs on this thread between chunks, where it does not compete with the rollout for the device. Every
worker is shut down when the step's scoring ends, however it ends (pending chunks cancelled, a request in flight
stopped at once: rewards/served.py ``stopped_by``): a step that fails or is interrupted (Ctrl+C) leaves no thread
behind.

A served term's chunk that fails (its tries ran out: a NaN batch, or an error) fails the term for the rest of the
step at once, in its worker: its queued chunks return without a request and its later chunks are not handed to it,
so a step with a served term that does not answer waits one request's bound ((2 x retries + 1) x timeout_s at
most: ``request_bound_s``), not one per chunk. A stop of the caller's (``RewardStage.scores(stopped=)``: the
trainer's signal flag, SIGTERM, SIGHUP or Ctrl+C) stops the step's requests at once, and the step ends untrained on
every rank (``StepStopped``, agreed in the same all-reduce): the trainer checkpoints the steps before it and exits,
and a resume runs the step again, as an uninterrupted run does. A signal after the served scores came back changes
nothing: the step trains, and the run stops after it as for any signal.

Failures follow the rules of scoring after the whole rollout, per chunk. A required term's NaN or inf skips
the update on every rank; its protocol error (``RemoteRewardError``) stops the run with one line naming
``reward.components.<name>`` (``ScorerFailed``); any other exception (a decode's too) ends the step on every rank
at the same point (``RankFailed`` on the others). An optional term (``required: false``) that fails or scores NaN
is left out of the step's advantages on every rank, the other weights renormalised (rewards/combine.py), counted
by ``reward/<name>/missing`` and said on the console once per cause; a step with no weighted term left is skipped.
After a failure this rank still rolls out its remaining chunks without decoding or scoring them
(``StepScores.failed``): a sharded transformer's forwards are collectives the other ranks wait in.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import KW_ONLY, dataclass, field
from types import TracebackType
from typing import Any

import torch
from torch import Tensor

from rewards.combine import AdvantageFn, NonFiniteRewardError, RewardCombiner
from rewards.remote import RemoteRewardError
from rewards.reward_config import RewardConfig
from rewards.served import stopped_by
from settings.configurable import Configurable
from train.algorithm.grpo import group_advantages
from train.algorithm.grpo_config import AdvStd, GRPOConfig
from train.distributed.collectives import DistInfo, all_gather_tensor, all_reduce_max
from train.ground.errors import RankFailed, ScorerFailed, StepStopped, mark_agreed
from train.parts.scoring.left_out import missing_metric

log = logging.getLogger(__name__)

AUTO, AUTO_CHUNKS = "auto", 4  # reward.chunk_groups=auto: at most this many chunks, with a served term
# a rank's outcome of its own part of the reward stage, the ranks' agreed on as the largest
OK, NAN_REWARD, STOPPED, FAILED = 0, 1, 2, 3


def never() -> bool:
    return False


class ChunkSkipped(Exception):
    """A served term's chunk not requested: an earlier chunk of the term failed in this step."""


@dataclass
class RewardStageConfig(RewardConfig, Configurable["RewardStage"]):
    """The reward's settings (rewards/reward_config.py) and the stage's own: how the step hands it the rollout."""

    chunk_groups: Any = AUTO
    """GRPO groups per rollout chunk on a rank: an integer >= 0 (0 = all of the rank's groups in one chunk) or
    ``auto`` (the default): chunks of a quarter of the rank's groups (rounded up) when a served term (remote, judge)
    is in the reward, one chunk otherwise. Each chunk is decoded and handed to the reward as soon as it is rolled out,
    so a served reward scores it while the next chunk rolls out; the results equal one chunk's to float rounding
    (a resume may change it). The rule, from docs/benchmarks/2026-12-reward-overlap-cpu.md: on the default job
    (CPU, 8 groups) chunks only slow a local reward's step (1.23x in chunks of one group, 1.08x of two: smaller
    rollout batches) and hide nothing; with a served reward chunks of two gave the fastest step and left 0.30 of
    its time exposed (one group: 0.17, and a slower rollout)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        size = self.chunk_groups
        if size != AUTO and (isinstance(size, bool) or not isinstance(size, int) or size < 0):
            raise ValueError(f"chunk_groups must be auto or an integer >= 0 (0: one chunk), got {size!r}")

    @classmethod
    def owner(cls) -> type[RewardStage]:
        return RewardStage

    def chunks(self, num_groups: int) -> list[range]:
        """The groups of each chunk of a rank's ``num_groups`` groups, in order: ``chunk_groups`` at a time (the last
        chunk may hold fewer), all at once for 0, for ``auto`` as its docstring says. The step rolls out these
        chunks; the planner and the preflight count them."""
        size = self.chunk_groups
        if size == AUTO:
            size = math.ceil(num_groups / AUTO_CHUNKS) if self.served_terms() else 0
        size = size or num_groups
        return [range(first, min(first + size, num_groups)) for first in range(0, num_groups, size)]


@dataclass
class Scored:
    """The reward stage's result on this rank."""

    advantages: Tensor | None  # [B]; None when the step must be skipped (a non-finite reward on some rank)
    images: Tensor  # [B, 3, H, W] in [0, 1]
    rewards: Tensor | None  # [B] combined reward per sample (None when skipped)
    metrics: dict[str, float]


def advantage_fn(g: GRPOConfig) -> AdvantageFn:
    """Group advantages with ``grpo``'s settings (a global std all-gathers the step's rewards)."""

    def fn(rewards: Tensor, group_ids: Tensor) -> Tensor:
        unbiased = g.adv_std is AdvStd.unbiased
        global_std = all_gather_tensor(rewards).std(unbiased=unbiased) if g.global_std else None
        return group_advantages(
            rewards, group_ids, eps=g.adv_eps, adv_clip_max=g.adv_clip_max, global_std=global_std, unbiased=unbiased
        )

    return fn


def group_spread(scores: Tensor, group_ids: Tensor) -> float:
    """The largest range (max - min) of ``scores`` [B] within a group, over the groups of every rank: 0 when
    every group ties, so the reward adds no advantage (train/parts/observe/health.py warns)."""
    everyone, ids = all_gather_tensor(scores.float()), all_gather_tensor(group_ids)
    return max(float(everyone[ids == gid].max() - everyone[ids == gid].min()) for gid in ids.unique())


@dataclass
class StepScores:
    """One step's scores, chunk by chunk as the step hands them over (``add``), and what went wrong (module
    docstring); ``collect`` waits for the served ones. A context manager: its exit shuts every worker down."""

    rewards: RewardCombiner
    clock: Callable[[], float] = time.perf_counter  # what the served scores' seconds are read from
    stopped: Callable[[], bool] = never  # the caller's stop of the served requests (a signal)
    images: list[Tensor] = field(default_factory=list)  # per chunk handed over, scored or not
    parts: dict[str, list[Tensor | Future]] = field(default_factory=dict)  # per term, per chunk
    workers: dict[str, ThreadPoolExecutor] = field(default_factory=dict)  # one per served term
    failing: dict[str, threading.Event] = field(default_factory=dict)  # per served term: a chunk of it failed
    ended: threading.Event = field(default_factory=threading.Event)  # the scoring ended: stop every request
    dropped: dict[str, str] = field(default_factory=dict)  # optional term -> why it is left out
    outcome: int = OK
    signalled: bool = False  # the caller's stop ended a served request of this step
    failure: Exception | None = None  # this rank's own error, raised once the ranks agreed
    served_s: float = 0.0  # seconds the served scorers took, in their workers
    waited_s: float = 0.0  # seconds this thread waited for them

    def __enter__(self) -> StepScores:
        for name, (scorer, _) in self.rewards.components.items():
            self.parts[name] = []
            if scorer.runs_remotely:
                self.workers[name] = ThreadPoolExecutor(1, thread_name_prefix=f"reward-{name}")
                self.failing[name] = threading.Event()
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        self.ended.set()  # a request in flight stops at once
        for worker in self.workers.values():
            worker.shutdown(wait=True, cancel_futures=True)

    def stopping(self) -> bool:
        """The served requests stop: the scoring ended, or the caller's stop."""
        return self.ended.is_set() or self.stopped()

    @property
    def failed(self) -> bool:
        """This rank's step ends (the rest of its rollout is neither decoded nor scored)."""
        return self.outcome == FAILED

    def scoring(self, name: str) -> bool:
        return self.outcome == OK and name not in self.dropped

    def add(self, images: Tensor, prompts: list[str]) -> None:
        """Keep a chunk's ``images`` and score them: the served terms in their workers, the others here (nothing
        once a NaN skips the step; its images are still logged)."""
        self.images.append(images)
        for name in self.rewards.components:
            if not self.scoring(name):
                continue
            if name in self.workers:
                if not self.failing[name].is_set():  # a failed term gets no more chunks
                    self.parts[name].append(self.workers[name].submit(self._served, name, images, prompts))
                continue
            try:
                with torch.no_grad():
                    self.parts[name].append(self.rewards.score_term(name, images, prompts))
            except Exception as err:
                self.fail(name, err)

    def _served(self, name: str, images: Tensor, prompts: list[str]) -> tuple[Tensor, float]:
        """A chunk's scores of served term ``name`` and the seconds they took, in the term's worker; none after a
        failed chunk of the term (``ChunkSkipped``), and a failure marks the term failed at once."""
        if self.failing[name].is_set():
            raise ChunkSkipped(name)
        began = self.clock()
        try:
            with torch.no_grad(), stopped_by(self.stopping):  # grad mode is per thread
                scores = self.rewards.score_term(name, images, prompts)
        except Exception:
            self.failing[name].set()
            self.signalled = self.signalled or self.stopped()
            raise
        return scores, self.clock() - began

    def fail(self, name: str | None, err: Exception) -> None:
        """Term ``name`` (None: the decode) raised ``err``: drop an optional term, else skip or stop the step."""
        if name in self.rewards.optional:
            nan = isinstance(err, NonFiniteRewardError)  # the cause is the text before the first colon
            self.dropped[name] = "it scored NaN or inf" if nan else f"it failed ({type(err).__name__}): {err}"
        elif isinstance(err, NonFiniteRewardError):  # it names its scorer; skip the update on every rank
            log.warning("skipping the update of this step: %s", err)
            self.outcome = max(self.outcome, NAN_REWARD)
        else:  # the server's answer or refusal: a setting or the server to fix, in one line
            remote = isinstance(err, RemoteRewardError)
            self.outcome, self.failure = FAILED, ScorerFailed(f"reward.components.{name}: {err}") if remote else err

    def collect(self) -> dict[str, Tensor]:
        """Every score of the step, once each served chunk came back: per term still scored, [B] in chunk order."""
        for name, parts in self.parts.items():
            for i, part in enumerate(parts):
                if not isinstance(part, Future) or (not self.scoring(name) and part.cancel()):
                    continue
                began = self.clock()
                try:
                    parts[i], took = part.result()
                    self.served_s += took
                except Exception as err:
                    if self.scoring(name):
                        self.fail(name, err)
                self.waited_s += self.clock() - began
        return {name: torch.cat(parts) for name, parts in self.parts.items() if self.scoring(name)}  # type: ignore[arg-type]


@dataclass(eq=False)  # compared by identity, as a part of a run
class RewardStage:
    """Score a step's rollout as the step hands it over chunk by chunk, then the step's advantages (module
    docstring). Built by its settings: ``RewardStageConfig.build(rewards=, advantage=, dist=, device=)``."""

    config: RewardStageConfig
    _: KW_ONLY
    rewards: RewardCombiner  # the scorers, built
    advantage: AdvantageFn  # a step's group advantages (``advantage_fn`` of the run's GRPO settings)
    dist: DistInfo
    device: torch.device
    clock: Callable[[], float] = time.perf_counter  # what the served scores' seconds are read from
    _said: set[tuple[str, str]] = field(default_factory=set, init=False)  # (term, cause) already said on the console

    def scores(self, stopped: Callable[[], bool] = never) -> StepScores:
        """A step's scores, empty: ``with stage.scores() as scores``, ``scores.add`` each chunk, ``scores.collect()``
        in the block, then ``stage.agree``; ``stopped``: asked while a served request waits, true stops the step's
        requests (module docstring)."""
        return StepScores(self.rewards, self.clock, stopped)

    def agree(self, scores: StepScores, collected: dict[str, Tensor], group_ids: Tensor) -> Scored:
        """Agree with the other ranks, in one all-reduce, on each rank's outcome and on the terms left out, then
        the advantages (every rank computes them with the same terms) of the ``collected`` scores (the whole
        step's rows, ``group_ids``)."""
        terms, world = list(self.rewards.components), self.dist.world_size
        flags = torch.zeros(world + len(terms), device=self.device)
        flags[self.dist.rank] = max(scores.outcome, STOPPED) if scores.signalled else scores.outcome
        flags[world:] = torch.tensor([float(name in scores.dropped) for name in terms])
        flags = all_reduce_max(flags)
        outcomes, dropped = flags[:world].tolist(), [name for name, f in zip(terms, flags[world:].tolist()) if f]
        raise_failures(scores.failure, [rank for rank, value in enumerate(outcomes) if value == FAILED])
        if max(outcomes) == STOPPED:
            raise mark_agreed(StepStopped("a signal stopped this step's served requests"))
        images = torch.cat(scores.images)
        self._say_dropped(dropped, scores.dropped)
        metrics = {missing_metric(name): float(name in dropped) for name in sorted(self.rewards.optional)}
        metrics["time/reward_hidden"] = max(scores.served_s - scores.waited_s, 0.0)
        left = {name: s for name, s in collected.items() if name not in dropped}
        if max(outcomes) == NAN_REWARD or not any(self.rewards.weights[name] for name in left):
            if max(outcomes) != NAN_REWARD:
                log.warning("skipping the update of this step: every weighted reward term was left out")
            return Scored(None, images, None, metrics | {"train/skipped_nan_reward": 1.0})
        return self._advantages(left, group_ids, images, metrics)

    def _say_dropped(self, dropped: list[str], why: dict[str, str]) -> None:
        """One console line per (term, cause): a term left out, and why (its error here, or another rank's)."""
        for name in dropped:
            reason = why.get(name, "another rank could not score it (its output says why)")
            cause = reason.split(":")[0]
            if (name, cause) not in self._said:
                self._said.add((name, cause))
                log.warning(
                    "reward.components.%s (optional) is left out of this step's advantages and the other weights "
                    "renormalised: %s; reward/%s/missing counts the steps, this line is said once per cause",
                    name,
                    reason,
                    name,
                )

    def _advantages(
        self, scores: dict[str, Tensor], group_ids: Tensor, images: Tensor, metrics: dict[str, float]
    ) -> Scored:
        """The step's advantages and reward metrics from every term left (every rank holds as many samples: the
        gathered tensors are the whole step's)."""
        advantages, _ = self.rewards.advantages(scores, group_ids, self.advantage)
        total = self.rewards.total(scores)
        metrics |= {f"reward/{name}": float(all_gather_tensor(s).mean()) for name, s in scores.items()}
        metrics |= {f"spread/{name}": group_spread(s, group_ids) for name, s in scores.items()}
        everyone = all_gather_tensor(advantages)
        metrics |= {
            "reward/total": float(all_gather_tensor(total).mean()),
            "adv/mean": float(everyone.mean()),
            "adv/std": float(everyone.std(unbiased=False)),
            "adv/abs_max": float(everyone.abs().max()),
            "train/skipped_nan_reward": 0.0,
        }
        return Scored(advantages, images, total, metrics)


def raise_failures(own: Exception | None, failed: list[int]) -> None:
    """This rank's own error (``own``), marked as known to every rank, or ``RankFailed`` when ranks ``failed``: an
    exception on some rank ends the step on every rank at this point, so that they can still checkpoint the
    steps trained before it together (train/loop/faults.py)."""
    if own is not None:
        raise mark_agreed(own)
    if failed:
        raise RankFailed(
            f"rank {', '.join(map(str, failed))} failed in the reward phase of this step (its error is in its "
            "own output); this rank stopped with it"
        )
