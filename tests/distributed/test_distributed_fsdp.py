"""Two processes under torchrun on CPU/gloo with FSDP2: the worker (tests/helpers/dist_worker.py) does the
work, this test reads its per-rank results. One torchrun start-up for every check (~20 s)."""

from __future__ import annotations

import json

import pytest
from two_ranks import HELPERS, run_torchrun

WORKER = HELPERS / "dist_worker.py"

pytestmark = pytest.mark.slow  # one torchrun start-up of two gloo ranks


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("fsdp")
    proc = run_torchrun(str(WORKER), str(out), timeout=180)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return [json.loads((out / f"results_rank{r}.json").read_text()) for r in range(2)]


def test_cross_rank_helpers(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        helpers = res["helpers"]
        assert res["world_size"] == 2 and res["device"] == "cpu"
        assert helpers["sum"] == 3.0  # ranks contribute 1 and 2
        assert helpers["input_unchanged"] == rank + 1
        assert helpers["gathered_rows"] == [0.0, 0.0, 1.0, 1.0]  # rank order, 2 rows each
        assert helpers["broadcast"] == 1  # src=1's object reached rank 0 too


def test_sharded_step_equals_single_process_step(results: list[dict]) -> None:
    for res in results:
        assert res["all_dtensor"]
        # clipping was active (norm above max_norm 0.05), so the clipped update depends on the norm
        assert res["ref_norm"] > 0.05
        assert res["norm"] == pytest.approx(res["ref_norm"], rel=1e-5)
        assert res["param_moved"] > 1e-4  # the step changed the parameters ...
        assert res["param_diff"] < 1e-5  # ... exactly as the unsharded step on the global batch


def test_clip_uses_global_norm_not_shard_norm(results: list[dict]) -> None:
    # The per-shard norm (a reference trainer's bug) is smaller and differs across ranks.
    shard_norms = [res["shard_norm"] for res in results]
    assert shard_norms[0] != pytest.approx(shard_norms[1], rel=1e-3)
    for res in results:
        assert res["shard_norm"] < res["norm"] * 0.9
    assert sum(n**2 for n in shard_norms) ** 0.5 == pytest.approx(results[0]["norm"], rel=1e-5)


def test_batched_pass_gathers_each_module_once_per_direction(results: list[dict]) -> None:
    for res in results:
        assert res["num_fsdp_modules"] == 5  # 2 double + 2 single blocks + the root
        assert res["forward_all_gathers"] == 5
        assert res["backward_all_gathers"] == 5
        assert res["backward_reduce_scatters"] == 5
        # with activation checkpointing, gradients still match the unsharded reference
        assert res["checkpointed_grad_diff"] < 1e-6


def test_update_paths_gather_as_designed(results: list[dict]) -> None:
    """With n = 5 sharded modules and W = 4: JAGG gathers every module once for the batched no-grad
    middle, once for the batched endpoints' forward and once in their backward (3n), and
    reduce-scatters once (n); the exact path pays a forward and a backward gather and a
    reduce-scatter per step (2Wn, Wn), exact_batched one forward and one backward gather and one
    reduce-scatter for its W steps (2n, n); the sequential variant two forwards and backwards. Given the
    rollout's velocities, the JAGG paths skip the middle's gather: jagg costs what ablate does."""
    n = 5
    for res in results:
        assert res["update_path_collectives"] == {
            "exact": [8 * n, 4 * n],
            "exact_batched": [2 * n, n],
            "jagg": [3 * n, n],
            "jagg_sequential": [5 * n, 2 * n],
            "ablate": [2 * n, n],
            "jagg+velocities": [2 * n, n],
            "jagg_sequential+velocities": [4 * n, 2 * n],
        }


def test_ema_swap_on_shards(results: list[dict]) -> None:
    for res in results:
        assert res["swapped_diff"] == 0.0
        assert res["restored_after_swap"] == 0.0


def test_sharded_checkpoint_round_trip(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        assert res["moved_before_load"] > 1e-4  # an extra step changed the model before loading
        assert res["param_diff_after_load"] == 0.0
        assert res["exp_avg_diff_after_load"] == 0.0
        assert res["ema_diff_after_load"] == 0.0
        assert res["data_index"] == 7 + rank  # per-rank extra
        assert res["rand_equal_after_load"]  # this rank's RNG state came back
    rows = results[0]["rand_rows"]
    assert rows[0] != rows[1]  # and the ranks' streams differ


def test_sharded_export_reloads(results: list[dict]) -> None:
    assert results[0]["export_diff"] == 0.0


def test_no_gloo_thread_outlives_the_command() -> None:
    """Two ranks shard a tensor over the world mesh inside ``process_group`` (tests/helpers/exit_worker.py): by the
    last exit handler the destroyed process group is freed and its gloo threads joined. Before, torch's DTensor
    caches and the world mesh's own kept it, its threads alive until the interpreter was torn down (where
    test_sigterm_on_one_of_two_ranks once aborted: "terminate called without an active exception")."""
    proc = run_torchrun(str(HELPERS / "exit_worker.py"), timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("gloo threads at exit: ")]
    assert lines == ["gloo threads at exit: []"] * 2, proc.stderr[-4000:]
