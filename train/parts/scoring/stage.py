"""The reward stage: a rank's rollout runs in chunks of whole GRPO groups (``reward.chunk_groups``); as each
chunk finishes it is decoded and scored while the next one rolls out, and the step's advantages wait for
every score, so the result equals scoring after the whole rollout (to float rounding: other batch shapes).

    chunk 1: rollout | decode, local scores | submit to the served scorers' workers
    chunk 2:          rollout               | decode, local scores | submit ...
    ...                                                             | wait for the served scores
    agree with the other ranks (one all-reduce) -> advantages

A served scorer (``Scorer.runs_remotely``: the remote reward, a judge) scores in a background thread of its own,
one request at a time, so at most one request per served term is in flight while the rollout runs; a local
scorer runs on this thread between chunks, where it does not compete with the rollout for the device. Every
worker is shut down when the step's scoring ends, however it ends (pending chunks cancelled, a request in flight
waited for within its own deadline): a step that fails or is interrupted (Ctrl+C) leaves no thread behind.

Failures follow the rules of scoring after the whole rollout, per chunk. A required term's NaN or inf skips
the update on every rank; its protocol error (``RemoteRewardError``) stops the run with one line naming
``reward.components.<name>`` (``ScorerFailed``); any other exception ends the step on every rank at the same
point (``RankFailed`` on the others). An optional term (``required: false``) that fails or scores NaN is left
out of the step's advantages on every rank, the other weights renormalised (rewards/combine.py), counted by
``reward/<name>/missing`` and said on the console once per cause; a step with no weighted term left is skipped.
After a failure this rank still rolls out its remaining chunks without scoring them: a sharded transformer's
forwards are collectives the other ranks wait in.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import KW_ONLY, dataclass, field
from types import TracebackType
from typing import Protocol

import torch
from torch import Tensor

from models.base import Backbone, decode_in_chunks
from models.model_config import ModelConfig
from rewards.combine import AdvantageFn, NonFiniteRewardError, RewardCombiner
from rewards.remote import RemoteRewardError
from samplers.rollout import Trajectory, cat_trajectories
from train.algorithm.grpo import group_advantages
from train.algorithm.grpo_config import AdvStd, GRPOConfig
from train.distributed.collectives import DistInfo, all_gather_tensor, all_reduce_max
from train.ground.errors import RankFailed, ScorerFailed, mark_agreed
from train.parts.observe.perf import PhaseTimer

log = logging.getLogger(__name__)

OK, NAN_REWARD, FAILED = 0, 1, 2  # a rank's outcome of its own part of the reward stage


class ChunkedRollout(Protocol):
    """A step's rollout, drawn once (noise, SDE window) and run a few groups at a time."""

    @property
    def num_groups(self) -> int: ...

    def chunk(self, groups: range) -> tuple[Trajectory, list[str]]:
        """The trajectories of ``groups`` (indices among the step's groups on this rank) and their prompts."""
        ...


@dataclass
class Scored:
    """The reward stage's result on this rank."""

    advantages: Tensor | None  # [B]; None when the step must be skipped (a non-finite reward on some rank)
    images: Tensor  # [B, 3, H, W] in [0, 1]
    rewards: Tensor | None  # [B] combined reward per sample (None when skipped)
    metrics: dict[str, float]


def group_chunks(num_groups: int, chunk_groups: int) -> list[range]:
    """The groups of each chunk: ``chunk_groups`` at a time (the last chunk may hold fewer), all at once for 0."""
    size = chunk_groups or num_groups
    return [range(first, min(first + size, num_groups)) for first in range(0, num_groups, size)]


def decode_images(backbone: Backbone, latents: Tensor, model: ModelConfig) -> Tensor:
    """Images [B, 3, H, W] of the final ``latents`` [B, ...], ``model.decode_batch`` per VAE call."""
    with torch.no_grad():
        return decode_in_chunks(backbone, latents, rows=model.decode_batch, height=model.height, width=model.width)


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
    every group ties, so the reward adds no advantage (train/observe/health.py warns)."""
    everyone, ids = all_gather_tensor(scores.float()), all_gather_tensor(group_ids)
    return max(float(everyone[ids == gid].max() - everyone[ids == gid].min()) for gid in ids.unique())


@dataclass
class StepScores:
    """One step's scores, chunk by chunk, and what went wrong (module docstring). A context manager: its exit
    shuts every worker down."""

    rewards: RewardCombiner
    parts: dict[str, list[Tensor | Future]] = field(default_factory=dict)  # per term, per chunk
    workers: dict[str, ThreadPoolExecutor] = field(default_factory=dict)  # one per served term
    dropped: dict[str, str] = field(default_factory=dict)  # optional term -> why it is left out
    outcome: int = OK
    failure: Exception | None = None  # this rank's own error, raised once the ranks agreed
    served_s: float = 0.0  # seconds the served scorers took, in their workers
    waited_s: float = 0.0  # seconds this thread waited for them

    def __enter__(self) -> StepScores:
        for name, (scorer, _) in self.rewards.components.items():
            self.parts[name] = []
            if scorer.runs_remotely:
                self.workers[name] = ThreadPoolExecutor(1, thread_name_prefix=f"reward-{name}")
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        for worker in self.workers.values():  # a request in flight ends within its own deadline
            worker.shutdown(wait=True, cancel_futures=True)

    def scoring(self, name: str) -> bool:
        return self.outcome == OK and name not in self.dropped

    def add(self, images: Tensor, prompts: list[str]) -> None:
        """Score a chunk's ``images``: the served terms in their workers, the others here."""
        for name in self.rewards.components:
            if not self.scoring(name):
                continue
            if name in self.workers:
                self.parts[name].append(self.workers[name].submit(self._served, name, images, prompts))
                continue
            try:
                with torch.no_grad():
                    self.parts[name].append(self.rewards.score_term(name, images, prompts))
            except Exception as err:
                self.fail(name, err)

    def _served(self, name: str, images: Tensor, prompts: list[str]) -> tuple[Tensor, float]:
        began = time.perf_counter()
        with torch.no_grad():  # grad mode is per thread
            scores = self.rewards.score_term(name, images, prompts)
        return scores, time.perf_counter() - began

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
                began = time.perf_counter()
                try:
                    parts[i], took = part.result()
                    self.served_s += took
                except Exception as err:
                    if self.scoring(name):
                        self.fail(name, err)
                self.waited_s += time.perf_counter() - began
        return {name: torch.cat(parts) for name, parts in self.parts.items() if self.scoring(name)}  # type: ignore[arg-type]


@dataclass(eq=False)  # compared by identity, as a part of a run
class RewardStage:
    """Decode and score a step's rollout chunk by chunk, then the step's advantages (module docstring)."""

    rewards: RewardCombiner
    backbone: Backbone
    model: ModelConfig
    grpo: GRPOConfig
    _: KW_ONLY
    chunk_groups: int
    dist: DistInfo
    device: torch.device
    _said: set[tuple[str, str]] = field(default_factory=set, init=False)  # (term, cause) already said on the console

    def run(self, rollout: ChunkedRollout, timer: PhaseTimer) -> tuple[Trajectory, list[str], Scored]:
        """Roll out and score the step chunk by chunk (timed as ``rollout`` and ``reward``: the reward time this
        thread spent, decoding, scoring locally and waiting for the served scores); the whole step's
        trajectories, prompts and scores."""
        parts: list[Trajectory] = []
        prompts: list[str] = []
        images: list[Tensor] = []
        with StepScores(self.rewards) as scores:
            for groups in group_chunks(rollout.num_groups, self.chunk_groups):
                with timer.phase("rollout"):
                    traj, chunk_prompts = rollout.chunk(groups)
                parts.append(traj)
                prompts += chunk_prompts
                with timer.phase("reward"):
                    self._score_chunk(scores, traj, chunk_prompts, images)
            with timer.phase("reward"):
                collected = scores.collect()
        traj = cat_trajectories(parts)
        with timer.phase("reward"):
            scored = self._agree(scores, collected, traj.group_ids, torch.cat(images) if images else None)
        return traj, prompts, scored

    def _score_chunk(self, scores: StepScores, traj: Trajectory, prompts: list[str], images: list[Tensor]) -> None:
        if scores.outcome == FAILED:  # the step ends: roll out the rest (collectives), decode and score nothing
            return
        try:
            images.append(decode_images(self.backbone, traj.latents[:, -1], self.model))
        except Exception as err:
            scores.fail(None, err)
            return
        scores.add(images[-1], prompts)  # nothing once a NaN skips the step; its images are still logged

    def _agree(
        self, scores: StepScores, collected: dict[str, Tensor], group_ids: Tensor, images: Tensor | None
    ) -> Scored:
        """Agree with the other ranks, in one all-reduce, on each rank's outcome and on the terms left out, then
        the advantages (every rank computes them with the same terms)."""
        terms, world = list(self.rewards.components), self.dist.world_size
        flags = torch.zeros(world + len(terms), device=self.device)
        flags[self.dist.rank] = scores.outcome
        flags[world:] = torch.tensor([float(name in scores.dropped) for name in terms])
        flags = all_reduce_max(flags)
        outcomes, dropped = flags[:world].tolist(), [name for name, f in zip(terms, flags[world:].tolist()) if f]
        raise_failures(scores.failure, [rank for rank, value in enumerate(outcomes) if value == FAILED])
        assert images is not None
        self._say_dropped(dropped, scores.dropped)
        metrics = {f"reward/{name}/missing": float(name in dropped) for name in sorted(self.rewards.optional)}
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
        advantages, _ = self.rewards.advantages(scores, group_ids, advantage_fn(self.grpo))
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
    steps trained before it together (train/faults.py)."""
    if own is not None:
        raise mark_agreed(own)
    if failed:
        raise RankFailed(
            f"rank {', '.join(map(str, failed))} failed in the reward phase of this step (its error is in its "
            "own output); this rank stopped with it"
        )
