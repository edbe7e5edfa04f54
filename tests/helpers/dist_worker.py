"""Worker of tests/distributed/test_distributed_fsdp.py, run as ``torchrun --nproc_per_node 2 dist_worker.py OUT``.

One torchrun start-up (~6 s) checks, on a tiny diffusers Flux transformer (2 double + 2 single
blocks) sharded with FSDP2 on CPU/gloo:

1. the cross-rank helpers;
2. one training step (forward on rank-specific data, backward, global-norm clipping, AdamW) against
   a single-process reference on the concatenated global batch. Each rank's loss is the mean over
   its own rows and FSDP averages gradients over ranks, so with equal rows per rank the sharded
   gradient equals the gradient of the mean over the global batch, the reference loss;
3. the all-gathers of one batched forward + one backward with activation checkpointing, and the
   gradients of that pass against the reference;
4. the collectives of one group of W = 4 steps through each update path of train.algorithm.jagg, and through
   the JAGG paths given the steps' velocities;
5. EMA, checkpoint save/load and export of the sharded model.

Every rank writes ``OUT/results_rank{r}.json``; the test asserts on them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from collective_counter import count_collectives
from diffusers import FluxTransformer2DModel
from diffusers.models.transformers.transformer_flux import FluxSingleTransformerBlock, FluxTransformerBlock
from flux_toys import tiny_flux_transformer
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from train.algorithm.jagg import UPDATE_MODES, backward_segment
from train.algorithm.update_config import MIDDLE_MODES
from train.distributed.collectives import (
    all_gather_tensor,
    all_reduce_sum,
    barrier,
    broadcast_object,
    init_distributed,
    shutdown,
)
from train.distributed.parallelize import clip_grad_norm_, parallelize
from train.distributed.seeds import seed_everything
from train.parts.checkpoint.checkpoint_config import CheckpointConfig
from train.parts.checkpoint.export import export_model
from train.parts.checkpoint.manager import CheckpointManager
from train.parts.optim.ema import EMA

BLOCKS = (FluxTransformerBlock, FluxSingleTransformerBlock)
ROWS_PER_RANK = 2
MAX_NORM = 0.05


def build_model() -> FluxTransformer2DModel:
    return tiny_flux_transformer(in_channels=16, num_layers=2)


def global_batch(seed: int, rows: int) -> dict[str, torch.Tensor]:
    """The same rows on every rank (4x4 packed latent = 16 tokens, 8 text tokens)."""
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(rows, 16, 16, generator=g),
        "encoder_hidden_states": torch.randn(rows, 8, 32, generator=g),
        "pooled_projections": torch.randn(rows, 32, generator=g),
        "timestep": torch.rand(rows, generator=g),
    }


def rows_of(batch: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    return {k: v[rank * ROWS_PER_RANK : (rank + 1) * ROWS_PER_RANK] for k, v in batch.items()}


def forward(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    h = int(batch["hidden_states"].shape[1] ** 0.5)
    axes = (torch.zeros(1), torch.arange(h, dtype=torch.float32), torch.arange(h, dtype=torch.float32))
    img_ids = torch.stack(torch.meshgrid(*axes, indexing="ij"), -1)
    return model(**batch, img_ids=img_ids.reshape(-1, 3), txt_ids=torch.zeros(8, 3), return_dict=False)[0]


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((full(x) - full(y)).abs().max()) for x, y in zip(a, b, strict=True))


def check_helpers(rank: int) -> dict:
    x = torch.tensor([float(rank + 1)])
    gathered = all_gather_tensor(torch.full((2, 3), float(rank)))
    return {
        "sum": float(all_reduce_sum(x)),
        "input_unchanged": float(x),
        "gathered_rows": gathered[:, 0].tolist(),
        "broadcast": broadcast_object({"from": rank}, src=1)["from"],
    }


def train_step(
    rank: int, batch: dict[str, torch.Tensor], out: dict
) -> tuple[torch.nn.Module, torch.optim.Optimizer, list]:
    reference = build_model()
    forward(reference, batch).pow(2).mean().backward()
    ref_grads = [p.grad.clone() for p in reference.parameters()]
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.1)
    ref_opt.step()

    model = parallelize(build_model(), block_classes=BLOCKS, param_dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    forward(model, rows_of(batch, rank)).pow(2).mean().backward()
    # The bug this guards against: each rank clipping by the norm of its own shard.
    shard_norm = sum(float(p.grad.to_local().pow(2).sum()) for p in model.parameters()) ** 0.5
    norm = clip_grad_norm_(model.parameters(), MAX_NORM)
    opt.step()
    out.update(
        ref_norm=float(ref_norm),
        norm=float(norm),
        shard_norm=shard_norm,
        all_dtensor=all(isinstance(p, DTensor) for p in model.parameters()),
        param_diff=max_diff(list(model.parameters()), list(reference.parameters())),
        param_moved=max_diff(list(model.parameters()), list(build_model().parameters())),
    )
    return model, opt, ref_grads


def count_pass(rank: int, batch: dict[str, torch.Tensor], ref_grads: list[torch.Tensor], out: dict) -> None:
    model = parallelize(build_model(), block_classes=BLOCKS, param_dtype=torch.float32, activation_checkpointing=True)
    local = rows_of(batch, rank)
    forward(model, local).pow(2).mean().backward()  # warm-up: FSDP2's lazy init runs in the first forward
    model.zero_grad(set_to_none=True)
    with count_collectives() as fwd:
        loss = forward(model, local).pow(2).mean()
    with count_collectives() as bwd:
        loss.backward()
    out.update(
        num_fsdp_modules=sum(isinstance(m, FSDPModule) for m in model.modules()),
        forward_all_gathers=fwd.num_all_gathers,
        backward_all_gathers=bwd.num_all_gathers,
        backward_reduce_scatters=bwd.num_reduce_scatters,
        checkpointed_grad_diff=max_diff([p.grad for p in model.parameters()], ref_grads),
    )


def count_update_paths(rank: int, batch: dict[str, torch.Tensor], out: dict) -> None:
    """Collectives of one segment of W = 4 steps through train.algorithm.jagg.backward_segment per mode."""
    model = parallelize(build_model(), block_classes=BLOCKS, param_dtype=torch.float32)
    local = rows_of(batch, rank)
    cond = {k: v for k, v in local.items() if k not in ("hidden_states", "timestep")}

    def predict(z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        reps = z.shape[0] // ROWS_PER_RANK
        tiled = {k: v.repeat(reps, *([1] * (v.ndim - 1))) for k, v in cond.items()}
        return forward(model, {"hidden_states": z, "timestep": t, **tiled})

    z = [local["hidden_states"] + 0.1 * j for j in range(4)]
    t = torch.tensor([0.9, 0.8, 0.6, 0.5])
    forward(model, local).sum().backward()  # warm-up: FSDP2's lazy init runs in the first forward
    with torch.no_grad():  # what the rollout keeps: v of every step at the current weights
        velocities = [predict(z_j, t_j.expand(ROWS_PER_RANK)) for z_j, t_j in zip(z, t)]
    counts = {}
    runs = [(m, m, {}) for m in UPDATE_MODES] + [("exact_batched", "exact", {"exact_batched": True})]
    runs += [(f"{m}+velocities", m, {"velocities": velocities}) for m in MIDDLE_MODES]
    for name, mode, kwargs in runs:
        model.zero_grad(set_to_none=True)
        with count_collectives() as c:
            backward_segment(mode, predict, lambda j, v: (v.pow(2).mean(), {}), z, t, **kwargs)
        counts[name] = [c.num_all_gathers, c.num_reduce_scatters]
    out["update_path_collectives"] = counts


def check_checkpoint(rank: int, model, opt, batch, run_dir: Path, out: dict) -> None:
    seed_everything(1234, rank)  # build_model() reset the global RNG; make the ranks draw differently again
    ema = EMA(model.parameters(), decay=0.5)
    ema.update()
    manager = CheckpointManager(run_dir, CheckpointConfig(keep_last=2))
    manager.save(1, model=model, optimizer=opt, extra={"ema": ema.state_dict(), "data": {"index": 7 + rank}})
    rand_after_save = torch.rand(3)
    saved_params = [full(p).clone() for p in model.parameters()]
    saved_ema = [full(s).clone() for s in ema.shadow]
    saved_avg = [opt.state[p]["exp_avg"].to_local().clone() for p in model.parameters()]
    with ema.swapped():
        swapped_diff = max_diff(list(model.parameters()), saved_ema)
    out["restored_after_swap"] = max_diff(list(model.parameters()), saved_params)
    out["swapped_diff"] = swapped_diff

    opt.zero_grad()
    forward(model, rows_of(batch, rank)).pow(2).mean().backward()
    opt.step()
    ema.update()
    out["moved_before_load"] = max_diff(list(model.parameters()), saved_params)

    extra = manager.load(manager.latest(), model=model, optimizer=opt, extra_template={"ema": ema.state_dict()})
    out["param_diff_after_load"] = max_diff(list(model.parameters()), saved_params)
    out["ema_diff_after_load"] = max_diff(ema.shadow, saved_ema)
    out["exp_avg_diff_after_load"] = max(
        float((opt.state[p]["exp_avg"].to_local() - a).abs().max()) for p, a in zip(model.parameters(), saved_avg)
    )
    out["data_index"] = extra["data"]["index"]
    out["rand_equal_after_load"] = torch.equal(torch.rand(3), rand_after_save)
    out["rand_rows"] = all_gather_tensor(rand_after_save[None]).tolist()

    export_dir = run_dir / "export"
    export_model(model, export_dir)
    if rank == 0:
        reloaded = FluxTransformer2DModel.from_pretrained(export_dir)
        out["export_diff"] = max_diff(list(reloaded.parameters()), saved_params)
    barrier()


def main() -> None:
    out_dir = Path(sys.argv[1])
    info = init_distributed()
    seed_everything(1234, info.rank)
    out: dict = {"rank": info.rank, "world_size": info.world_size, "device": str(info.device)}
    out["helpers"] = check_helpers(info.rank)
    batch = global_batch(1, ROWS_PER_RANK * info.world_size)
    model, opt, ref_grads = train_step(info.rank, batch, out)
    count_pass(info.rank, batch, ref_grads, out)
    count_update_paths(info.rank, batch, out)
    check_checkpoint(info.rank, model, opt, batch, out_dir / "run", out)
    (out_dir / f"results_rank{info.rank}.json").write_text(json.dumps(out, indent=1))
    shutdown()


if __name__ == "__main__":
    main()
