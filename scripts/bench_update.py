"""Time one segment's update for every mode on the small Flux transformer of models/flux.py (CPU).

    python scripts/bench_update.py [--reps 7] [--segment-length 4] [--batch 1] [--rollout-batch 4]

Modes run alternately (exact, jagg, jagg_sequential, ablate, jagg + rollout v, ..., exact, ...) so
drift in the machine hits all of them alike; each is reported as the median over repetitions of its
wall time and of the process's CPU time (which other processes on a busy machine do not stretch;
run with OMP_NUM_THREADS=1 for it to be the work done), relative to exact, next to the floor
(W F + 2 B) / (W F + W B) from this run's own forward F and backward B of one step. The loss is
the real GRPO step loss (DanceGRPO SDE log-prob of a stored transition, PPO clip).

"+ rollout v" hands the JAGG paths the velocities a rollout computed: one call per step over
``--rollout-batch`` rows, of which the segment's ``--batch`` rows are the first, as the trainer's
rollout runs the whole batch and the update a micro-batch of it; the gradient on them is compared
with the recomputing path's (relative difference of the flattened gradients).

A KL penalty adds the reference's no-grad forwards of the W steps to every mode alike (the update
stage runs them as one batched call per segment); they are timed in the same rounds, one batched call
and W calls, and the ratios are shown again with the batched call added to each mode.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from models.flux import TINY, tiny_transformer
from samplers.schedule import shifted_sigmas
from samplers.sde import SDE, step
from train.algorithm.grpo import ppo_step_loss
from train.algorithm.jagg import UPDATE_MODES, backward_segment
from train.algorithm.metrics import Metric
from train.algorithm.update_config import MIDDLE_MODES

IMAGE_TOKENS, TEXT_TOKENS = 256, 32
TEXT_WIDTH, LATENT_WIDTH = int(TINY["small"]["text_width"]), 4 * int(TINY["small"]["latent_channels"])  # packed 2x2


def build(batch: int):
    torch.manual_seed(0)
    model = tiny_transformer("small").train()
    side = int(IMAGE_TOKENS**0.5)
    rows_cols = torch.cartesian_prod(torch.arange(side), torch.arange(side)).float()
    img_ids = torch.cat([torch.zeros(IMAGE_TOKENS, 1), rows_cols], 1)
    cond = dict(
        encoder_hidden_states=torch.randn(batch, TEXT_TOKENS, TEXT_WIDTH),
        pooled_projections=torch.randn(batch, TEXT_WIDTH),
        img_ids=img_ids,
        txt_ids=torch.zeros(TEXT_TOKENS, 3),
    )

    def predict(z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        reps = z.shape[0] // batch
        return model(
            hidden_states=z,
            timestep=t,
            guidance=torch.full_like(t, 3.5),
            encoder_hidden_states=cond["encoder_hidden_states"].repeat(reps, 1, 1),
            pooled_projections=cond["pooled_projections"].repeat(reps, 1),
            img_ids=cond["img_ids"],
            txt_ids=cond["txt_ids"],
            return_dict=False,
        )[0]

    return model, predict


def make_segment(predict, batch: int, width: int, rollout_batch: int):
    """z, t, step_loss of one segment of ``batch`` rows, and the velocities a rollout of ``rollout_batch``
    rows (the segment's first) computed for them."""
    sde = SDE("dance", eta=0.3)
    sigmas = shifted_sigmas(20, 3.0)[: width + 1].float()
    t = sigmas[:-1].clone()
    z_rollout = [torch.randn(rollout_batch, IMAGE_TOKENS, LATENT_WIDTH) for _ in range(width)]
    z = [z_j[:batch] for z_j in z_rollout]
    adv = torch.randn(batch)
    with torch.no_grad():
        velocities = [predict(z_j, t_j.expand(rollout_batch))[:batch] for z_j, t_j in zip(z_rollout, t)]
        outs = [step(sde, velocities[j], z[j], sigmas[j], sigmas[j + 1]) for j in range(width)]

    def step_loss(j: int, v: torch.Tensor) -> tuple[torch.Tensor, dict[str, Metric]]:
        logp = step(sde, v, z[j], sigmas[j], sigmas[j + 1], next_z=outs[j].next_z).log_prob
        return ppo_step_loss(logp, outs[j].log_prob, adv, clip_range=0.1)

    return z, t, step_loss, velocities


class Clocks:
    """Wall time and this process's CPU time of a block: on a busy machine other processes stretch the
    first, not the second (with one thread, the CPU time is the work done)."""

    def __enter__(self) -> Clocks:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


def time_forward_backward(model, predict, z, t, reps: int) -> tuple[float, float]:
    """Median forward-with-grad and backward CPU time of one step (B rows)."""
    fwd, bwd = [], []
    for _ in range(reps):
        with Clocks() as forward:
            v = predict(z[0], t[0].expand(z[0].shape[0]))
        with Clocks() as backward:
            v.backward(torch.randn_like(v))
        fwd.append(forward.cpu)
        bwd.append(backward.cpu)
        model.zero_grad(set_to_none=True)
    return statistics.median(fwd), statistics.median(bwd)


def gradient(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--segment-length", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rollout-batch", type=int, default=4, help="rows of the rollout that computed the v")
    return parser.parse_args()


Timings = dict[str, list[float]]  # name -> seconds per repetition


def time_rounds(model, predict, runs, references, step_loss, z, t, reps: int) -> tuple[Timings, Timings, dict]:
    """(wall, CPU) seconds of every run and reference call per round, alternating, and each run's gradient;
    the first round warms up and is discarded."""
    wall: Timings = {name: [] for name in [*runs, *references]}
    cpu: Timings = {name: [] for name in [*runs, *references]}
    grads = {}
    for rep in range(reps + 1):
        for name, (mode, given) in runs.items():
            model.zero_grad(set_to_none=True)
            with Clocks() as clocks:
                backward_segment(mode, predict, step_loss, z, t, velocities=given)
            grads[name] = gradient(model)
            if rep:
                wall[name].append(clocks.wall)
                cpu[name].append(clocks.cpu)
        for name, forwards in references.items():
            with Clocks() as clocks, torch.no_grad():
                forwards()
            if rep:
                wall[name].append(clocks.wall)
                cpu[name].append(clocks.cpu)
    return wall, cpu, grads


def print_results(args, f: float, b: float, wall: Timings, cpu: Timings, runs, references, grads) -> None:
    """The table: each run's and reference call's median times, relative to exact, with and without the KL
    reference's batched call; the floor from F and B; how far the rollout velocities move the gradient."""
    w = args.segment_length
    print(
        f"small Flux, {IMAGE_TOKENS} image + {TEXT_TOKENS} text tokens, W={w}, batch={args.batch} "
        f"(rollout {args.rollout_batch}), float32, {torch.get_num_threads()} threads, median of {args.reps}"
    )
    print(f"one step (CPU time): forward F = {f * 1e3:.1f} ms, backward B = {b * 1e3:.1f} ms (B/F = {b / f:.2f})")
    print(f"per-step floor (W F + 2 B) / (W F + W B) = {(w * f + 2 * b) / (w * f + w * b):.3f}")
    med = {name: (statistics.median(wall[name]), statistics.median(cpu[name])) for name in wall}
    exact, reference = med["exact"], med["one batched call"][1]
    print(f"{'mode':<28}{'wall ms':>9}{'/ exact':>9}{'CPU ms':>9}{'/ exact':>9}{'CPU, with KL ref':>18}")
    for name in runs:
        (w_s, c_s), with_kl = med[name], (med[name][1] + reference) / (exact[1] + reference)
        ratios = f"{w_s / exact[0]:>9.3f}{c_s * 1e3:>9.1f}{c_s / exact[1]:>9.3f}{with_kl:>18.3f}"
        print(f"{name:<28}{w_s * 1e3:>9.1f}{ratios}")
    for name in references:
        print(f"{'KL reference, ' + name:<28}{med[name][0] * 1e3:>9.1f}{'':>9}{med[name][1] * 1e3:>9.1f}")
    for mode in MIDDLE_MODES:
        recomputed, reused = grads[mode], grads[f"{mode} + rollout v"]
        difference = float((reused - recomputed).norm() / recomputed.norm())
        print(f"{mode}: |g(rollout v) - g(recomputed)| / |g(recomputed)| = {difference:.1e}")


def main() -> None:
    args = parse_args()
    model, predict = build(args.batch)
    z, t, step_loss, velocities = make_segment(
        predict, args.batch, args.segment_length, max(args.rollout_batch, args.batch)
    )
    runs = {mode: (mode, None) for mode in UPDATE_MODES}
    runs |= {f"{mode} + rollout v": (mode, velocities) for mode in MIDDLE_MODES}
    references = {
        "one batched call": lambda: predict(torch.cat(z), torch.cat([t_j.expand(args.batch) for t_j in t])),
        f"{args.segment_length} calls": lambda: [predict(z_j, t_j.expand(args.batch)) for z_j, t_j in zip(z, t)],
    }
    wall, cpu, grads = time_rounds(model, predict, runs, references, step_loss, z, t, args.reps)
    f, b = time_forward_backward(model, predict, z, t, args.reps)
    print_results(args, f, b, wall, cpu, runs, references, grads)


if __name__ == "__main__":
    main()
