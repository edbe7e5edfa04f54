"""The reward stage (train/parts/scoring/stage.py) as the step's chunk loop (train/loop/step.py) hands it the rollout: a
chunked step equals one chunk; served scorers run in background workers that no step outlives, their time behind
the rollout counted as hidden; optional terms that fail or score NaN are left out, renormalised, counted and said
once; required ones skip or stop the step as before. The stage's settings build it and count the chunks."""

from __future__ import annotations

import json
import logging
import threading

import pytest
import torch
from hydra import compose, initialize_config_module
from stage_toys import ToyRollout, ToyScorer, brightness, nan_scores, redness, toy_stage

from rewards.combine import RewardCombiner
from rewards.remote import RemoteRewardError
from train.algorithm.grpo_config import GRPOConfig
from train.distributed.collectives import DistInfo
from train.ground.errors import ScorerFailed, ranks_agreed
from train.loop.step import roll_out_and_score
from train.parts.config.schema import register_schema
from train.parts.observe.perf import PhaseTimer
from train.parts.scoring.stage import RewardStage, RewardStageConfig, advantage_fn

FAILURE = RuntimeError("the judge went away")


def reward_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("reward-")]


def run_stage(stage: RewardStage, rollout: ToyRollout):
    """The step's rollout and scoring (train/loop/step.py's chunk loop) of the toy ``rollout``."""
    return roll_out_and_score(rollout, stage, PhaseTimer())  # type: ignore[arg-type]  # a toy rollout


def chunks(num_groups: int, chunk_groups: int) -> list[range]:
    return RewardStageConfig(chunk_groups=chunk_groups).chunks(num_groups)


def test_the_chunks_cover_every_group_once() -> None:
    assert chunks(5, 0) == [range(0, 5)]
    assert chunks(5, 2) == [range(0, 2), range(2, 4), range(4, 5)]
    assert chunks(2, 8) == [range(0, 2)]


SERVED_JUDGE = {"base_url": "http://127.0.0.1:8000/v1", "model": "a-judge"}


@pytest.mark.parametrize(
    ("components", "num_groups", "sizes"),
    [
        ({"shape_alignment": {}}, 8, [8]),  # local terms only: one chunk, the step of before
        ({"shape_alignment": {}, "judge": SERVED_JUDGE}, 8, [2, 2, 2, 2]),  # a served term: quarters
        ({"judge": {**SERVED_JUDGE, "weight": 0.0}, "shape_alignment": {}}, 5, [2, 2, 1]),  # scored, unweighted too
        ({"remote": {"url": "http://127.0.0.1:8100"}}, 3, [1, 1, 1]),
        ({"remote": {"url": "http://127.0.0.1:8100"}}, 1, [1]),
    ],
)
def test_auto_chunks_in_quarters_only_with_a_served_term(components, num_groups, sizes) -> None:
    config = RewardStageConfig(components=components)
    assert config.chunk_groups == "auto"
    assert [len(chunk) for chunk in config.chunks(num_groups)] == sizes
    assert [g for chunk in config.chunks(num_groups) for g in chunk] == list(range(num_groups))


def test_the_settings_build_the_stage_and_refuse_a_copy_of_their_own_field() -> None:
    """``build`` gives the stage its settings and the runtime parts; a runtime chunk_groups (a setting) is refused."""
    config = RewardStageConfig(chunk_groups=2)
    dist = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), is_main=True)
    runtime = {"rewards": RewardCombiner({"a": (ToyScorer(brightness), 1.0)}), "dist": dist, "device": dist.device}
    stage = config.build(**runtime, advantage=advantage_fn(GRPOConfig(group_size=2)))
    assert stage.config is config and stage.rewards is runtime["rewards"]
    with pytest.raises(TypeError, match=r"^RewardStageConfig\.build: chunk_groups are settings of the group"):
        config.build(**runtime, advantage=stage.advantage, chunk_groups=1)


@pytest.fixture(scope="module")
def tiny_run(tiny_flux_dir, tmp_path_factory):
    """The tiny experiment's run, 3 groups of 2 per step, its velocities kept, a Flow-GRPO-Fast window."""
    from train.run.build import open_run
    from train.run.start import load_config, process_group

    register_schema()
    overrides = [
        "experiment=tiny",
        f"model.path={tiny_flux_dir}",
        f"run_dir={tmp_path_factory.mktemp('stage')}",
        "grpo.group_size=2",
        "batch.prompts_per_rank=3",
        "batch.micro_batch=6",
        "batch.gradient_accumulation_steps=6",
        "sampler.sde_window_size=4",
        "sampler.sde_window_range=[0,6]",
    ]
    with initialize_config_module(config_module="configs", version_base=None):
        config = load_config(compose(config_name="train", overrides=overrides))
    with process_group() as dist, open_run(config, dist) as run:
        yield run


@pytest.mark.parametrize("chunk_groups", [1, 2])
def test_a_chunked_step_equals_one_chunk(tiny_run, chunk_groups) -> None:
    """The tiny model's rollout in chunks of 1 or 2 of its 3 groups (the last chunk smaller), scored by its JPEG
    reward on this thread and a served term in a worker: the trajectories, velocities, rewards and advantages of
    one chunk, to float rounding (other batch shapes in the transformer's matmuls)."""
    from train.loop.step import step_rollout

    run, served = tiny_run, ToyScorer(brightness, served=True)
    rewards = RewardCombiner({**run.data.reward_stage.rewards.components, "served": (served, 0.5)})
    results = []
    advantage = advantage_fn(run.cfg.grpo)
    for size in (0, chunk_groups):
        config = RewardStageConfig(chunk_groups=size)
        stage = config.build(rewards=rewards, advantage=advantage, dist=run.dist, device=run.device)
        rollout = step_rollout(run.model, run.data.prompts, run.cfg, 3, device=run.device)
        results.append(roll_out_and_score(rollout, stage, PhaseTimer()))
    (one, _, whole), (chunked, prompts, parts) = results
    assert served.calls[0].startswith("reward-served") and len(served.calls) == 1 + len(chunks(3, chunk_groups))
    assert one.velocities is not None and chunked.velocities is not None and one.trainable.any()
    for name in ("latents", "log_probs", "velocities"):
        torch.testing.assert_close(getattr(chunked, name), getattr(one, name), rtol=1e-4, atol=1e-5, msg=name)
    assert torch.equal(chunked.group_ids, one.group_ids)
    for name, tensor in one.cond.tensors().items():
        assert torch.equal(chunked.cond.tensors()[name], tensor), name
    assert len(prompts) == 6 and whole.advantages is not None and parts.advantages is not None
    torch.testing.assert_close(parts.rewards, whole.rewards, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(parts.advantages, whole.advantages, rtol=1e-3, atol=1e-4)
    assert reward_threads() == []


def test_served_terms_score_in_workers_while_the_rollout_goes_on() -> None:
    """A served scorer's chunks run in its own worker, one at a time, and the step equals scoring after the
    whole rollout; the workers are gone when the step ends."""
    served, local = ToyScorer(brightness, served=True), ToyScorer(redness)
    components = {"judge": (served, 1.0), "local": (local, 1.0)}
    _, _, chunked = run_stage(toy_stage(components, chunk_groups=1), ToyRollout(num_groups=4))
    _, _, whole = run_stage(toy_stage(components), ToyRollout(num_groups=4))
    assert set(served.calls) == {"reward-judge_0"} and set(local.calls) == {threading.current_thread().name}
    torch.testing.assert_close(chunked.advantages, whole.advantages)
    assert reward_threads() == []


class FakeClock:
    """The stage's clock: seconds pass only when a scorer says (``advance``); ``read_by_step`` is set once the
    step's thread reads it, which it does only as it starts to wait for the served scores (``collect``)."""

    def __init__(self) -> None:
        self.now = 0.0
        self.read_by_step = threading.Event()

    def __call__(self) -> float:
        if threading.current_thread() is threading.main_thread():
            self.read_by_step.set()
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def answering(
    clock: FakeClock, seconds: list[float], *, after: threading.Event | None = None, then: threading.Event | None = None
) -> ToyScorer:
    """A served scorer whose i-th answer takes ``seconds[i]`` on ``clock``, each once ``after`` is set; ``then`` is
    set as each answer ends."""

    def score(images: torch.Tensor) -> torch.Tensor:
        if after is not None:
            assert after.wait(timeout=60)
        clock.advance(seconds[len(judge.calls) - 1])
        if then is not None:
            then.set()
        return brightness(images)

    judge = ToyScorer(score, served=True)
    return judge


def test_served_time_behind_the_rollout_is_hidden_and_the_time_waited_for_is_not() -> None:
    """time/reward_hidden on a fake clock. Two chunks: the first chunk's answer (3 s) comes while the second rolls
    out (its rollout waits for it), the second's is instant: 3 s hidden. One chunk: its answer (3 s) comes while
    the step waits for it: nothing hidden."""
    clock, answered = FakeClock(), threading.Event()

    def after_the_first_answer(chunk: int) -> None:
        assert chunk == 0 or answered.wait(timeout=60)

    judge = answering(clock, [3.0, 0.0], then=answered)
    rollout = ToyRollout(num_groups=2, before_chunk=after_the_first_answer)
    _, _, chunked = run_stage(toy_stage({"judge": (judge, 1.0)}, chunk_groups=1, clock=clock), rollout)
    assert chunked.metrics["time/reward_hidden"] == 3.0  # sums of whole seconds: exact in floats
    clock = FakeClock()
    waited = answering(clock, [3.0], after=clock.read_by_step)
    _, _, whole = run_stage(toy_stage({"judge": (waited, 1.0)}, clock=clock), ToyRollout(num_groups=2))
    assert whole.metrics["time/reward_hidden"] == 0.0 and clock.now == 3.0
    torch.testing.assert_close(chunked.advantages, whole.advantages)
    assert reward_threads() == []


def test_an_interrupted_step_leaves_no_worker_behind() -> None:
    """Ctrl+C (KeyboardInterrupt) in the rollout of the third chunk while the served scorer is mid-request:
    the interrupt goes on, the pending chunks are cancelled, the request in flight ends, no thread is left."""
    served = ToyScorer(brightness, served=True, delay_s=0.3)
    stage = toy_stage({"judge": (served, 1.0)}, chunk_groups=1)
    with pytest.raises(KeyboardInterrupt):
        run_stage(stage, ToyRollout(num_groups=4, interrupt_at=2))
    assert len(served.calls) <= 2 and reward_threads() == []


@pytest.mark.parametrize("mode", ["sum", "advantage"])
@pytest.mark.parametrize("served", [False, True])
@pytest.mark.parametrize("cause", ["failure", "nan"])
def test_an_optional_term_that_fails_is_left_out_and_counted(mode, served, cause, caplog) -> None:
    """An optional term that raises (in the second chunk) or scores NaN: the step's advantages are those of the
    other terms with their weights renormalised (1 : 3 with the 2 of the missing term -> 1.5 : 4.5), its
    reward/<name>/missing is 1, and the console says it once over two steps."""
    fn, fail = (brightness, FAILURE) if cause == "failure" else (nan_scores, None)
    judge = ToyScorer(fn, served=served, fail=fail, fail_from=1)
    a, b = ToyScorer(brightness), ToyScorer(redness)
    stage = toy_stage(
        {"a": (a, 1.0), "judge": (judge, 2.0), "b": (b, 3.0)}, chunk_groups=1, mode=mode, optional=["judge"]
    )
    expected = toy_stage({"a": (a, 1.5), "b": (b, 4.5)}, mode=mode)
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            _, _, scored = run_stage(stage, ToyRollout(num_groups=3))
    _, _, want = run_stage(expected, ToyRollout(num_groups=3))
    torch.testing.assert_close(scored.advantages, want.advantages)
    torch.testing.assert_close(scored.rewards, want.rewards)
    assert scored.metrics["reward/judge/missing"] == 1.0 and "reward/judge" not in scored.metrics
    lines = [
        r.getMessage() for r in caplog.records if "reward.components.judge (optional) is left out" in r.getMessage()
    ]
    why = "the judge went away" if cause == "failure" else "NaN or inf"
    assert len(lines) == 1 and why in lines[0], lines
    assert reward_threads() == []


def test_an_optional_term_that_scores_is_counted_as_present() -> None:
    stage = toy_stage({"a": (ToyScorer(brightness), 1.0), "judge": (ToyScorer(redness), 1.0)}, optional=["judge"])
    _, _, scored = run_stage(stage, ToyRollout(num_groups=2))
    assert scored.metrics["reward/judge/missing"] == 0.0 and "reward/judge" in scored.metrics


def test_a_required_nan_still_skips_the_step(caplog) -> None:
    """A required term's NaN in the first chunk skips the step; the later chunks are decoded (their images are
    logged) but no longer scored."""
    nan = ToyScorer(nan_scores)
    stage = toy_stage({"a": (nan, 1.0), "judge": (ToyScorer(redness), 1.0)}, chunk_groups=1, optional=["judge"])
    with caplog.at_level(logging.WARNING):
        _, _, scored = run_stage(stage, ToyRollout(num_groups=2))
    assert scored.advantages is None and scored.metrics["train/skipped_nan_reward"] == 1.0
    assert "skipping the update of this step: reward component 'a'" in caplog.text
    assert scored.images.shape[0] == 4 and len(nan.calls) == 1


@pytest.mark.parametrize("served", [False, True])
def test_a_required_failure_still_stops_the_step(served) -> None:
    """A required term's exception ends the step (marked as known to every rank); a served term's protocol
    error is one line naming reward.components.<name>; the rollout's remaining chunks still run (a sharded
    transformer's forwards are collectives) but are not scored."""
    judge = ToyScorer(brightness, served=served, fail=FAILURE, fail_from=1)
    rollout = ToyRollout(num_groups=4)
    with pytest.raises(RuntimeError, match="the judge went away") as raised:
        run_stage(toy_stage({"judge": (judge, 1.0)}, chunk_groups=1), rollout)
    assert ranks_agreed(raised.value) and rollout.chunks == 4 and (served or len(judge.calls) == 2)
    protocol = ToyScorer(brightness, served=served, fail=RemoteRewardError("reward server http://x answered 42"))
    with pytest.raises(ScorerFailed, match=r"^reward\.components\.judge: reward server http://x answered 42$"):
        run_stage(toy_stage({"judge": (protocol, 1.0)}, chunk_groups=1), ToyRollout(num_groups=2))
    assert reward_threads() == []


def test_a_step_with_no_weighted_term_left_is_skipped(caplog) -> None:
    """Every term optional and every one failing, or only terms of weight 0 left: skipped, as a NaN reward is."""
    failing = ToyScorer(brightness, fail=FAILURE)
    stage = toy_stage({"judge": (failing, 1.0), "other": (ToyScorer(nan_scores), 1.0)}, optional=["judge", "other"])
    with caplog.at_level(logging.WARNING):
        _, _, scored = run_stage(stage, ToyRollout(num_groups=2))
    assert scored.advantages is None and scored.metrics["train/skipped_nan_reward"] == 1.0
    assert scored.metrics["reward/judge/missing"] == scored.metrics["reward/other/missing"] == 1.0
    assert "every weighted reward term was left out" in caplog.text
    weightless = toy_stage({"zero": (ToyScorer(redness), 0.0), "judge": (failing, 1.0)}, optional=["judge"])
    assert run_stage(weightless, ToyRollout(num_groups=2))[2].advantages is None


def test_advantages_of_a_chunked_step_use_the_whole_steps_groups() -> None:
    """The advantages wait for every chunk: each group's are those of its own rewards, whichever chunk held it."""
    stage = toy_stage({"a": (ToyScorer(brightness), 1.0)}, chunk_groups=2)
    traj, _, scored = run_stage(stage, ToyRollout(num_groups=3))
    rewards = brightness(torch.sigmoid(traj.latents[:, -1]).reshape(-1, 3, 4, 4))
    torch.testing.assert_close(scored.advantages, advantage_fn(GRPOConfig(group_size=2))(rewards, traj.group_ids))


@pytest.mark.slow
def test_an_optional_term_failing_on_one_rank_is_left_out_on_both(tmp_path) -> None:
    """2 ranks over gloo; the judge fails on rank 1 only: both ranks leave it out (the same advantages as a
    stage without it, from the one all-reduce of outcomes), count it, and say why once: rank 1 its error,
    rank 0 that another rank could not score it."""
    from two_ranks import HELPERS, run_torchrun

    done = run_torchrun(str(HELPERS / "stage_worker.py"), str(tmp_path), timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, result in enumerate(results):
        assert result["metrics"]["reward/judge/missing"] == 1.0 and "reward/judge" not in result["metrics"]
        alone = toy_stage({"a": (ToyScorer(brightness), 2.0)})
        want = run_stage(alone, ToyRollout(num_groups=2, first_group=2 * rank))[2].advantages
        torch.testing.assert_close(torch.tensor(result["advantages"]), want)
        said = [line for line in result["lines"] if "reward.components.judge (optional) is left out" in line]
        why = "the judge went away" if rank == 1 else "another rank could not score it"
        assert len(said) == 1 and why in said[0], result["lines"]


def test_the_console_says_each_cause_once(caplog) -> None:
    """An optional judge that fails, scores NaN, fails, scores NaN in four steps: two lines, one per cause."""
    causes = iter([FAILURE, None, FAILURE, None])

    class Flaky(ToyScorer):
        def score(self, images, prompts):
            cause = next(causes)
            if cause is None:
                return nan_scores(images)
            raise cause

    stage = toy_stage({"a": (ToyScorer(brightness), 1.0), "judge": (Flaky(brightness), 1.0)}, optional=["judge"])
    with caplog.at_level(logging.WARNING):
        missing = [run_stage(stage, ToyRollout(num_groups=1))[2].metrics["reward/judge/missing"] for _ in range(4)]
    lines = [r.getMessage() for r in caplog.records if "reward.components.judge (optional)" in r.getMessage()]
    assert missing == [1.0] * 4 and len(lines) == 2, lines
    assert "it failed (RuntimeError): the judge went away" in lines[0] and "it scored NaN or inf" in lines[1]


def test_a_failed_served_term_requests_no_more_chunks() -> None:
    """A served optional term whose first chunk fails: its three other chunks are never requested (one call, not
    four), and the step goes on with the other term."""
    judge = ToyScorer(brightness, served=True, fail=FAILURE)
    stage = toy_stage({"judge": (judge, 1.0), "red": (ToyScorer(redness), 1.0)}, chunk_groups=1, optional=["judge"])
    _, _, scored = run_stage(stage, ToyRollout(num_groups=4))
    assert len(judge.calls) == 1 and scored.metrics["reward/judge/missing"] == 1.0 and reward_threads() == []


@pytest.mark.parametrize("optional", [[], ["judge"]])
def test_a_signal_that_stops_a_served_request_ends_the_step_untrained(optional) -> None:
    """A served term whose request a signal stopped (it scores NaN while the stop is true) ends the step on every
    rank (``StepStopped``), required or optional: the step is run again on a resume, not skipped or trained on
    fewer terms; a NaN without a signal still only skips the update."""
    from train.ground.errors import StepStopped

    nan = ToyScorer(nan_scores, served=True)
    components = {"judge": (nan, 1.0), "red": (ToyScorer(redness), 1.0)}
    stage = toy_stage(components, chunk_groups=1, optional=optional)
    with pytest.raises(StepStopped) as stopped:
        roll_out_and_score(ToyRollout(num_groups=2), stage, PhaseTimer(), lambda: True)  # type: ignore[arg-type]
    assert ranks_agreed(stopped.value) and len(nan.calls) == 1 and reward_threads() == []
    _, _, scored = run_stage(toy_stage(components, chunk_groups=1, optional=optional), ToyRollout(num_groups=2))
    assert (scored.advantages is None) == (optional == [])


def test_a_signal_after_the_served_scores_came_back_trains_the_step() -> None:
    """A stop asked while nothing of a served term failed changes nothing: the step's scores are all in."""
    judge = ToyScorer(brightness, served=True)
    stage = toy_stage({"judge": (judge, 1.0), "red": (ToyScorer(redness), 1.0)}, chunk_groups=1)
    _, _, scored = roll_out_and_score(ToyRollout(num_groups=2), stage, PhaseTimer(), lambda: True)  # type: ignore[arg-type]
    assert scored.advantages is not None and len(judge.calls) == 2


def test_a_stop_ends_a_request_to_a_server_that_never_answers() -> None:
    """A request whose tries would take an hour ends as soon as its thread's stop turns true."""
    from reward_servers import silent_server

    from rewards.served import RequestStopped, Server, request, stopped_by

    stop, outcome = threading.Event(), []

    def ask(url: str) -> None:
        with stopped_by(stop.is_set):
            try:
                request(Server(url, "a silent server", timeout_s=600.0, retries=5), "GET", "/health")
            except RequestStopped as err:
                outcome.append(err)

    with silent_server() as url:
        worker = threading.Thread(target=ask, args=(url,))
        worker.start()
        stop.set()
        worker.join(timeout=120)
    assert not worker.is_alive() and len(outcome) == 1


def test_a_served_scorer_whose_bound_reaches_dist_timeout_is_refused() -> None:
    """(2 x retries + 1) x timeout_s = 500 s against dist.timeout_s=300, for a reward term and for an evaluation
    scorer alike: one line naming the scorer's field and dist.timeout_s (a local scorer among them has no request to
    bound)."""
    from rewards.reward_config import RewardConfig
    from train.ground.errors import ConfigError
    from train.parts.scoring.scorers import check_served_bounds

    slow = {"timeout_s": 100.0, "retries": 2}
    reward = RewardConfig(components={"remote": {"url": "http://127.0.0.1:9", **slow}})
    local = RewardConfig(components={"jpeg_compressibility": {}})
    judge = {"judge": {"base_url": "http://127.0.0.1:9/v1", "model": "m", **slow}, "jpeg_compressibility": {}}
    check_served_bounds(reward, judge, 600.0)
    fix = r"lower {0}\.timeout_s or {0}\.retries, or raise dist\.timeout_s$"
    with pytest.raises(ConfigError, match=r"^reward\.components\.remote: .*500 s.*dist\.timeout_s=300.*raise dist"):
        check_served_bounds(reward, None, 300.0)
    with pytest.raises(
        ConfigError,
        match=r"^eval\.scorers\.judge: .*500 s.*dist\.timeout_s=300, .*" + fix.format(r"eval\.scorers\.judge"),
    ):
        check_served_bounds(local, judge, 300.0)
