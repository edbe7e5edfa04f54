"""Time one group's update for every mode on the small Flux transformer of models/flux.py (CPU).

    python scripts/bench_update.py [--reps 7] [--window 4] [--batch 1]

Modes run alternately (exact, jagg, jagg_sequential, ablate, exact, ...) so drift in the machine
hits all of them alike; each is reported as the median over repetitions, relative to exact, next
to the floor (W F + 2 B) / (W F + W B) from this run's own forward F and backward B of one step.
The loss is the real GRPO step loss (DanceGRPO SDE log-prob of a stored transition, PPO clip).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from models.flux import TINY, tiny_transformer
from samplers.schedule import shifted_sigmas
from samplers.sde import SDE, step
from train.grpo import ppo_step_loss
from train.jagg import UPDATE_MODES, backward_group

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


def make_group(predict, batch: int, width: int):
    sde = SDE("dance", eta=0.3)
    sigmas = shifted_sigmas(20, 3.0)[: width + 1].float()
    t = sigmas[:-1].clone()
    z = [torch.randn(batch, IMAGE_TOKENS, LATENT_WIDTH) for _ in range(width)]
    adv = torch.randn(batch)
    with torch.no_grad():
        outs = [step(sde, predict(z[j], t[j].expand(batch)), z[j], sigmas[j], sigmas[j + 1]) for j in range(width)]

    def step_loss(j: int, v: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logp = step(sde, v, z[j], sigmas[j], sigmas[j + 1], next_z=outs[j].next_z).log_prob
        return ppo_step_loss(logp, outs[j].log_prob, adv, clip_range=0.1)

    return z, t, step_loss


def time_forward_backward(model, predict, z, t, reps: int) -> tuple[float, float]:
    """Median forward-with-grad and backward time of one step (B rows)."""
    fwd, bwd = [], []
    for _ in range(reps):
        start = time.perf_counter()
        v = predict(z[0], t[0].expand(z[0].shape[0]))
        mid = time.perf_counter()
        v.backward(torch.randn_like(v))
        fwd.append(mid - start)
        bwd.append(time.perf_counter() - mid)
        model.zero_grad(set_to_none=True)
    return statistics.median(fwd), statistics.median(bwd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--window", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()
    model, predict = build(args.batch)
    z, t, step_loss = make_group(predict, args.batch, args.window)
    times = {mode: [] for mode in UPDATE_MODES}
    for rep in range(args.reps + 1):  # the first round warms up and is discarded
        for mode in UPDATE_MODES:
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            backward_group(mode, predict, step_loss, z, t)
            if rep:
                times[mode].append(time.perf_counter() - start)
    f, b = time_forward_backward(model, predict, z, t, args.reps)
    w = args.window
    exact = statistics.median(times["exact"])
    print(
        f"small Flux, {IMAGE_TOKENS} image + {TEXT_TOKENS} text tokens, W={w}, batch={args.batch}, "
        f"float32, {torch.get_num_threads()} threads, median of {args.reps}"
    )
    print(f"one step: forward F = {f * 1e3:.1f} ms, backward B = {b * 1e3:.1f} ms (B/F = {b / f:.2f})")
    print(f"per-step floor (W F + 2 B) / (W F + W B) = {(w * f + 2 * b) / (w * f + w * b):.3f}")
    print(f"{'mode':<16}{'median ms':>10}{'/ exact':>9}")
    for mode in UPDATE_MODES:
        med = statistics.median(times[mode])
        print(f"{mode:<16}{med * 1e3:>10.1f}{med / exact:>9.3f}")


if __name__ == "__main__":
    main()
