"""The reward stage's overlap (reward.chunk_groups) on the default job, with a served reward and with its local one.

    OMP_NUM_THREADS=1 python scripts/bench_reward.py [--rounds 3] [--steps 3] [--chunks 0 1 2 4]
        [--ms-per-image 8]

A stand-in reward server (scripts/reward_server.py, the remote protocol) serves ``SleepyScorer``: it takes
``--ms-per-image`` per image without using the CPU, under the server's one lock, so it scores one image at a time
for all requests together, as one judge on one GPU does. The default job (``--job demo`` of
scripts/bench_train.py, without evaluations or checkpoints) trains with its local reward (shape_alignment) plus
``remote`` at weight 1 against that server, and against the same server at 0 ms per image (instant), for each
``--chunks`` value; and with its local reward alone. Runs alternate within a round, one process per (round, run),
``--steps`` steps each, the first dropped; a run reports the median over its other steps of all rounds.

Exposed reward time of a chunking = step(slow server) - step(instant server); its ratio to the unchunked one
(``--chunks`` 0) is how much of the served reward's time the overlap did not hide. The same difference of the
reward phase alone (``time/reward``: what the step waited for) is printed beside it: it leaves out the rollout's
noise, and also any slowdown of the rollout by the background requests, which the step's difference holds. The
local runs' step time is given as a ratio to the unchunked one, by the wall clock and by the process's CPU time,
which other processes on a busy machine do not stretch.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch
from bench_train import JOBS, run_once
from torch import Tensor

from rewards.base import Scorer

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("step", "rollout", "reward", "reward_hidden")
CLOCKS = [f"time/{phase}" for phase in PHASES] + ["cpu/step"]  # cpu: the process's CPU time (bench_train.py)


class SleepyScorer(Scorer):
    """A served judge's stand-in: ``ms_per_image`` of waiting per image (no CPU), the images' mean as the score."""

    name = "sleepy"

    def __init__(self, ms_per_image: float = 8.0) -> None:
        self.ms_per_image = float(ms_per_image)

    def score(self, images: Tensor, prompts: Sequence[str]) -> Tensor:
        time.sleep(self.ms_per_image * images.shape[0] / 1000)
        return images.mean(dim=(1, 2, 3))

    def to(self, device: torch.device | str) -> SleepyScorer:
        return self


@contextmanager
def reward_server(ms_per_image: float, port: int) -> Iterator[str]:
    """scripts/reward_server.py serving ``SleepyScorer`` on 127.0.0.1:``port``; yields its URL."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "scripts")])}
    cmd = [sys.executable, str(ROOT / "scripts" / "reward_server.py"), "--scorer-class", "bench_reward:SleepyScorer"]
    cmd += ["--arg", f"ms_per_image={ms_per_image}", "--port", str(port)]
    server = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"{url}/health", timeout=1.0)
                break
            except httpx.HTTPError:
                assert server.poll() is None and time.monotonic() < deadline, server.communicate()[1][-2000:]
                time.sleep(0.2)
        yield url
    finally:
        server.terminate()
        server.wait(30)


def arms(chunks: list[str], slow: str, instant: str) -> dict[str, list[str]]:
    """Every run of a round: (local | instant | slow) x chunk_groups."""
    runs = {}
    for c in chunks:
        runs[f"local chunks {c}"] = [f"reward.chunk_groups={c}"]
        for name, url in (("instant", instant), ("slow", slow)):
            runs[f"{name} chunks {c}"] = [f"reward.chunk_groups={c}", f"+reward.components.remote={{url: '{url}'}}"]
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="steps per process, the first one dropped")
    parser.add_argument(
        "--chunks", nargs="+", default=["0", "1", "2", "4"], help="reward.chunk_groups per run (auto too)"
    )
    parser.add_argument("--ms-per-image", type=float, default=8.0, help="the slow server's time per image")
    parser.add_argument("--port", type=int, default=8731, help="the slow server's port; the instant one's is +1")
    args = parser.parse_args()
    results: dict[str, dict[str, list[float]]] = {}
    with reward_server(args.ms_per_image, args.port) as slow, reward_server(0.0, args.port + 1) as instant:
        runs = arms(args.chunks, slow, instant)
        results = {name: {clock: [] for clock in CLOCKS} for name in runs}
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.rounds):
                for i, (name, overrides) in enumerate(runs.items()):
                    metrics, _ = run_once([*JOBS["demo"], *overrides], args.steps, Path(tmp) / f"{i}_{r}")
                    for clock in CLOCKS:
                        results[name][clock] += [m.get(clock, 0.0) for m in metrics[1:]]
                    print(f"round {r} {name}: step {statistics.median(results[name]['time/step']):.2f}s", flush=True)
    report(args, {name: {p: statistics.median(v) for p, v in res.items()} for name, res in results.items()})


def report(args: argparse.Namespace, med: dict[str, dict[str, float]]) -> None:
    """The median phases per run; the exposed reward time per chunking and its ratio to one chunk's."""
    timed = args.rounds * (args.steps - 1)
    print(f"default job; median of {timed} steps per run ({args.rounds} processes); slow server "
          f"{args.ms_per_image:g} ms per image")  # fmt: skip
    print(f"{'run':<18}{'step s':>8}{'rollout s':>11}{'reward s':>10}{'hidden s':>10}{'CPU step s':>12}")
    for name, m in med.items():
        times = "".join(f"{m[f'time/{p}']:>{w}.2f}" for p, w in zip(PHASES, (8, 11, 10, 10)))
        print(f"{name:<18}{times}{m['cpu/step']:>12.2f}")
    first = args.chunks[0]
    exposed = {
        c: {p: med[f"slow chunks {c}"][f"time/{p}"] - med[f"instant chunks {c}"][f"time/{p}"] for p in PHASES}
        for c in args.chunks
    }
    print("exposed = slow - instant: of the step, and of the reward phase alone (less noise from the rollout)")
    header = f"{'exposed s':>10}{'/ unchunked':>12}{'reward phase s':>16}{'/ unchunked':>12}"
    print(f"{'chunk_groups':<14}{header}{'local step / unchunked: wall':>30}{'CPU':>6}")
    for c in args.chunks:
        local = "".join(
            f"{med[f'local chunks {c}'][clock] / med[f'local chunks {first}'][clock]:>{w}.3f}"
            for clock, w in (("time/step", 30), ("cpu/step", 6))
        )
        step, phase = exposed[c]["step"], exposed[c]["reward"]
        to_first = step / exposed[first]["step"], phase / exposed[first]["reward"]
        print(f"{c:<14}{step:>10.2f}{to_first[0]:>12.3f}{phase:>16.2f}{to_first[1]:>12.3f}{local}")


if __name__ == "__main__":
    main()
