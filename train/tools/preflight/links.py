"""The collectives FSDP2 issues, timed on the run's own mesh: the all-gather of one transformer block's parameters
in ``model.dtype`` and the reduce-scatter of its float32 gradients over the shard group, and under HSDP the
all-reduce of the gradient shard over the replicas (train/tools/plan/comm.py counts the same calls per step).

Achieved rate: the bytes one rank sends (ring algorithms, ``train.tools.plan.comm.ring_factor``) over the median time,
in Gb/s, the unit of ``plan.intra_node_gbps`` / ``plan.inter_node_gbps`` it is compared with. A group whose ranks
sit on more than one node runs at the inter-node rate; when the shard group spans nodes, the all-gather and the
reduce-scatter are also timed inside each node (torchrun's node groups), so both links are measured.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from models.base import parse_dtype
from train.tools.plan.comm import ring_factor
from train.tools.preflight.verdict import Check, Status


@dataclass(frozen=True)
class LinkRate:
    """One collective as one rank timed it."""

    name: str  # all-gather | reduce-scatter | all-reduce
    ranks: tuple[int, ...]  # its group
    across_nodes: bool
    sent_bytes: float  # per rank
    seconds: float  # the median of the timed repeats

    @property
    def gbps(self) -> float:
        return self.sent_bytes * 8 / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def block_numel(transformer: nn.Module, block_classes: tuple[type, ...]) -> int:
    """Parameters of the transformer's largest block (what one FSDP2 unit all-gathers), counted unsharded."""
    sizes = [sum(p.numel() for p in m.parameters()) for m in transformer.modules() if isinstance(m, block_classes)]
    return max(sizes)


def _timed(fn: Callable[[], object], device: torch.device, group: dist.ProcessGroup, repeats: int) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()  # the first call sets the communicator up
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


Rate = Callable[[str, dist.ProcessGroup, float, Callable[[], object]], LinkRate]


def _sharded(
    rate: Rate, group: dist.ProcessGroup, numel: int, dtype: torch.dtype, device: torch.device
) -> list[LinkRate]:
    """The all-gather of ``numel`` parameters in ``dtype`` and the reduce-scatter of their float32 gradients over
    ``group`` (nothing over a group of one rank: HSDP of whole replicas)."""
    n = dist.get_world_size(group)
    if n == 1:
        return []
    per_rank = -(-numel // n)  # FSDP2 pads a parameter to a multiple of the group
    params = torch.ones(per_rank, dtype=dtype, device=device)
    gathered = torch.empty(per_rank * n, dtype=dtype, device=device)
    grads = torch.ones(per_rank * n, dtype=torch.float32, device=device)
    reduced = torch.empty(per_rank, dtype=torch.float32, device=device)
    return [
        rate("all-gather", group, ring_factor(n) * gathered.nbytes,
             lambda: dist.all_gather_into_tensor(gathered, params, group=group)),
        rate("reduce-scatter", group, ring_factor(n) * grads.nbytes,
             lambda: dist.reduce_scatter_tensor(reduced, grads, group=group)),
    ]  # fmt: skip


def measure_links(
    mesh: DeviceMesh, numel: int, *, dtype: str, nodes: list[int], device: torch.device, repeats: int
) -> list[LinkRate]:
    """This rank's timing of each collective of the mesh (a collective: every rank calls it)."""

    def rate(name: str, group: dist.ProcessGroup, sent: float, fn: Callable[[], object]) -> LinkRate:
        ranks = tuple(dist.get_process_group_ranks(group))
        seconds = _timed(fn, device, group, repeats)
        return LinkRate(name, ranks, len({nodes[r] for r in ranks}) > 1, sent, seconds)

    shard = mesh.get_group("shard") if mesh.ndim == 2 else mesh.get_group()
    shard_ranks = dist.get_process_group_ranks(shard)
    with warnings.catch_warnings():  # reduce_scatter_tensor's deprecation notice, from FSDP2's own call too
        warnings.simplefilter("ignore", FutureWarning)
        out = _sharded(rate, shard, numel, parse_dtype(dtype), device)
        per_node = nodes.count(nodes[dist.get_rank()])
        if len({nodes[r] for r in shard_ranks}) > 1 and per_node > 1:  # the in-node link too
            node_group, _ = dist.new_subgroups(group_size=per_node)
            out += _sharded(rate, node_group, numel, parse_dtype(dtype), device)
        if mesh.ndim == 2:
            replicas = mesh.get_group("replicate")
            r = dist.get_world_size(replicas)
            shard_grads = torch.ones(-(-numel // len(shard_ranks)), dtype=torch.float32, device=device)
            out.append(rate("all-reduce", replicas, 2 * ring_factor(r) * shard_grads.nbytes,
                            lambda: dist.all_reduce(shard_grads, group=replicas)))  # fmt: skip
    return out


def link_checks(
    per_rank: list[list[LinkRate]], *, intra_gbps: float, inter_gbps: float, slow_link: float, compared: bool
) -> list[Check]:
    """One check per collective: the slowest rank's rate against the plan's link rate. ``compared``: NCCL on GPUs
    (gloo over CPU has no NVLink or InfiniBand rate to be held to)."""
    checks = []
    for i, first in enumerate(per_rank[0]):
        slowest = min((rates[i] for rates in per_rank), key=lambda x: x.gbps)
        link, planned = ("across nodes", inter_gbps) if first.across_nodes else ("in a node", intra_gbps)
        key = "plan.inter_node_gbps" if first.across_nodes else "plan.intra_node_gbps"
        line = (
            f"{first.name}, {first.sent_bytes / 1e6:.3g} MB sent per rank over {len(first.ranks)} ranks {link}: "
            f"{slowest.gbps:.3g} Gb/s at the slowest rank, {planned:g} planned ({key})"
        )
        if not compared:
            checks.append(Check("collectives", Status.passed, f"{line}; gloo on CPU: not held to the plan"))
        elif slowest.gbps < slow_link * planned:
            fix = (
                "check NCCL's transport (NCCL_DEBUG=INFO: NVLink/P2P in a node, InfiniBand across, not sockets), "
                f"or set {key} to the measured rate so the plan's time is right"
            )
            checks.append(Check("collectives", Status.warned, f"{line}: far below", fix))
        else:
            checks.append(Check("collectives", Status.passed, line))
    return checks
