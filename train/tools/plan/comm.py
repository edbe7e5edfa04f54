"""Per-rank communication of one training step, and the step's and the run's time estimate.

FSDP2 (train/distributed/parallelize.py) shards every parameter of the transformer, the frozen base
weights as well as the trained ones, and all-gathers each FSDP module's parameters in the compute
dtype (``model.dtype``) before its forward and again before its backward (``reshard_after_forward``);
after each backward it reduce-scatters the gradients of the trained parameters in float32
(``reduce_dtype``) and, under HSDP (``dist.replicate_degree`` R > 1), all-reduces the reduced shard
across the R replicas. Summed over the modules, a transformer call moves every parameter once: per
forward one all-gather of all of them, per backward one more, plus the reduce-scatter (and
all-reduce) of the trained ones. The KL reference of full fine-tuning is a second model of the same
size, sharded the same way; the LoRA reference is the policy with its adapters off.

Bytes each rank sends, ring algorithms (NCCL's for large messages) over a group of n ranks:

    all-gather of S bytes (the unsharded size)         (n - 1) / n * S
    reduce-scatter of S bytes                          (n - 1) / n * S
    all-reduce of S bytes (each rank's shard)          2 (n - 1) / n * S

A collective whose group holds ranks of more than one node counts as inter-node: its ring crosses
the nodes, and every step of a ring moves as many bytes on each link, so the slowest link (the
inter-node one) sets its time. Ranks are placed node after node (rank r on node r // gpus_per_node);
rank 0's shard group is ranks 0 .. world / R - 1, its replica group 0, world / R, ... (the mesh
(replicate, shard) of train/distributed/parallelize.py).

Calls: the transformer forwards of each traced call are counted as they run (with and without
gradients; every forward with gradients has one backward: each update path backpropagates each of
its graphs once, so JAGG's backward of a group of W is one, exact's W). The shared start
(``update.share_group_start``) adds, per optimizer step whose rows share, its forward and backward
(and the KL reference's forward), and takes a forward and a backward off each exact or
jagg_sequential micro-batch that leaves the step to it (``train.tools.plan.counts.expected_shared_calls``;
the batched paths run as many calls on fewer rows).

Time: a phase takes compute = FLOPs / (peak x MFU) and communication = intra bytes / intra-node rate
+ inter bytes / inter-node rate; FSDP2 prefetches the next module's all-gather while a module
computes and reduce-scatters while the backward goes on, so a phase takes the longer of the two
(``phase_seconds``), and a step the sum of its phases. Not in the estimate: text encoding, reward
scoring, the VAE decode (no FLOPs counted), logging and checkpoints, and collectives' latency.
"""

from __future__ import annotations

from dataclasses import dataclass

# Per GPU and direction, Gb/s. NVLink 4 (H100/H200 SXM): 18 links x 25 GB/s = 450 GB/s a direction
# (NVIDIA's "900 GB/s" counts both directions). InfiniBand NDR: 400 Gb/s, one adapter per GPU.
INTRA_NODE_GBPS = 3600.0
INTER_NODE_GBPS = 400.0


@dataclass(frozen=True)
class Cluster:
    """Where rank 0's collectives run: the world, HSDP's replicas, GPUs per node."""

    world_size: int
    replicate: int
    gpus_per_node: int

    @property
    def shard_size(self) -> int:
        return self.world_size // self.replicate

    def spans_nodes(self, ranks: range) -> bool:
        return len({r // self.gpus_per_node for r in ranks}) > 1

    @property
    def shard_group(self) -> range:
        return range(self.shard_size)

    @property
    def replica_group(self) -> range:
        return range(0, self.world_size, self.shard_size)


@dataclass(frozen=True)
class Traffic:
    """Bytes one rank sends, per collective kind and by the links they cross."""

    all_gather: float = 0.0
    reduce_scatter: float = 0.0
    all_reduce: float = 0.0
    intra: float = 0.0
    inter: float = 0.0

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(*(a + b for a, b in zip(self.astuple(), other.astuple(), strict=True)))

    def __mul__(self, factor: float) -> Traffic:
        return Traffic(*(a * factor for a in self.astuple()))

    def astuple(self) -> tuple[float, ...]:
        return (self.all_gather, self.reduce_scatter, self.all_reduce, self.intra, self.inter)

    @property
    def total(self) -> float:
        return self.intra + self.inter

    def seconds(self, intra_gbps: float, inter_gbps: float) -> float:
        return self.intra * 8 / (intra_gbps * 1e9) + self.inter * 8 / (inter_gbps * 1e9)


def ring_factor(n: int) -> float:
    """(n - 1) / n: the share of a collective's bytes each rank of a ring of n sends (twice, all-reduce)."""
    return (n - 1) / n


def _placed(cluster: Cluster, group: range, num_bytes: float, kind: str) -> Traffic:
    link = {"inter": num_bytes} if cluster.spans_nodes(group) else {"intra": num_bytes}
    return Traffic(**{kind: num_bytes}, **link)


@dataclass(frozen=True)
class ModelBytes:
    """The sizes the collectives move: every parameter in the compute dtype, the trained ones' float32 gradients."""

    gathered: float  # bytes of one all-gather of every parameter (model.dtype)
    gradients: float  # bytes of the trained parameters' gradients (float32)

    def forward(self, cluster: Cluster) -> Traffic:
        """One transformer forward: the all-gather of every parameter over the shard group."""
        group = cluster.shard_group
        return _placed(cluster, group, ring_factor(len(group)) * self.gathered, "all_gather")

    def backward(self, cluster: Cluster) -> Traffic:
        """One backward: the all-gather again, the reduce-scatter of the gradients, HSDP's all-reduce of the shard."""
        shards, replicas = cluster.shard_group, cluster.replica_group
        out = self.forward(cluster) + _placed(
            cluster, shards, ring_factor(len(shards)) * self.gradients, "reduce_scatter"
        )
        if len(replicas) > 1:
            shard = self.gradients / len(shards)
            out += _placed(cluster, replicas, 2 * ring_factor(len(replicas)) * shard, "all_reduce")
        return out

    def call(self, cluster: Cluster, forwards: float, backwards: float) -> Traffic:
        """``forwards`` forwards (with or without gradients) and ``backwards`` backwards."""
        return self.forward(cluster) * forwards + self.backward(cluster) * backwards


def phase_seconds(flops: float, traffic: Traffic, *, tflops: float, mfu: float, intra: float, inter: float) -> float:
    """A phase's time: the longer of its compute at ``mfu`` of ``tflops`` and its communication (overlapped)."""
    return max(flops / (tflops * 1e12 * mfu), traffic.seconds(intra, inter))
