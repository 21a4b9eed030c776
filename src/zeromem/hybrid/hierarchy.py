"""Two-level data parallelism: which group each collective runs over (ZeRO++, MiCS, HSDP).

Flat ZeRO runs every collective over all N_d ranks, so on a cluster most of its bytes
cross the slow links between nodes. The options here keep them inside a node:

- hybrid sharding (`mics_shard_size` = s; MiCS, FSDP2's HSDP): model states are sharded
  over blocks of s consecutive ranks (usually a node) and replicated across blocks.
  Gradients are reduce-scattered within the block, then each shard is all-reduced
  across the replica group (the ranks at the same position of every block); parameter
  all-gathers stay within the block. Every replica then steps the same shard alike.
- hpZ (`zero_hpz_partition_size` = h; ZeRO++ section 3.2): stage-3 parameters keep,
  after each forward gather, a secondary copy sharded over blocks of h ranks, so the
  backward gather runs within the block (stage3/sharded_unit.py).
- qwZ (`zero_quantized_weights`; section 3.1): the stage-3 all-gather moves block-wise
  int8 weights plus one fp32 scale per block (hybrid/quantize.py), about half of bf16's bytes.
- qgZ (`zero_quantized_gradients`; section 3.3): the gradient reduce-scatter runs in two
  hops: an all-to-all within the node of int4 (or int8) chunks, summed there, then an
  all-to-all across nodes of the node's partial sums, again quantized. Each node
  reduces before anything crosses, so the cross-node bytes shrink by the ranks per
  node times the compression (`HierarchicalQuantizedReduce`).

`build_comm_plan` reads the config once and hands the engine a `CommPlan`: the `Comm`
the flat groups shard over, the object the reducer reduces gradients with, and the
stage-3 gather. The node layout (hybrid/mesh.py) comes from `zeromem.cluster.ranks_per_node`,
else from the environment as `distributed.Runtime` read it once (ZEROMEM_RANKS_PER_NODE
or torchrun's LOCAL_WORLD_SIZE); nothing here reads the environment.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from zeromem.hybrid import quantize
from zeromem.comm import Comm, Pending, done
from zeromem.config.schema import Config, ConfigError
from zeromem.hybrid.mesh import Mesh, NodeLayout
from zeromem.stage3.sharded_unit import GatherPolicy


def node_layout(config: Config, world_size: int, env_ranks_per_node: int | None) -> NodeLayout:
    """The node layout of `world_size` ranks: `zeromem.cluster.ranks_per_node`, else the
    environment's (`Runtime.ranks_per_node`), else one node."""
    try:
        return NodeLayout.of(world_size, config.zeromem.cluster.ranks_per_node, env_ranks_per_node)
    except ValueError as error:
        raise ConfigError(f"zeromem.cluster.ranks_per_node: {error}") from None


class ReplicatedReduce:
    """Hybrid sharding's gradient reduction: reduce-scatter in the shard group, then
    all-reduce the shard across the replicas. The sum is over every rank."""

    def __init__(self, shard: Comm, replicas: Comm):
        self.shard = shard
        self.replicas = replicas

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor,
                       async_op: bool = False) -> Pending:
        pending = self.shard.reduce_scatter(output, input, async_op=async_op)

        def across() -> None:  # issued when waited on: every rank waits in bucket order
            pending.wait()
            self.replicas.all_reduce(output)

        return _run_now_or_later(across, async_op)

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False, **kwargs) -> Pending:
        self.shard.all_reduce(tensor, **kwargs)
        self.replicas.all_reduce(tensor, **kwargs)
        return done()

    def note_buffer(self, tensor: torch.Tensor) -> None:
        self.shard.note_buffer(tensor)

    def release_buffer(self, tensor: torch.Tensor) -> None:
        self.shard.release_buffer(tensor)


class HierarchicalQuantizedReduce:
    """qgZ: a reduce-scatter over all ranks as two quantized all-to-alls, node first.

    Rank r = node * b + local (b ranks per node, K nodes) owns chunk r of the bucket.
    Hop 1, within the node: local rank l receives, from each node peer, the K chunks
    owned by the ranks at position l of every node (k * b + l), quantized; it sums
    them (fp32) into the node's partial sums of those K chunks. Hop 2, across nodes:
    it sends partial sum k, quantized again, to rank k * b + l and sums the K it
    receives: its own chunk, reduced over every rank. Blocking (no overlap).
    """

    def __init__(self, node: Comm, across: Comm, bits: int, block: int):
        self.node = node
        self.across = across
        self.bits = bits
        self.block = block

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor,
                       async_op: bool = False) -> Pending:
        b, k = self.node.world_size, self.across.world_size
        chunk = output.numel()
        # (K, b, chunk) -> rows by destination local rank: (b, K * chunk)
        by_local = input.view(k, b, chunk).transpose(0, 1).reshape(b, k * chunk)
        node_sum = self._exchange(self.node, by_local).sum(dim=0)        # (K * chunk,)
        total = self._exchange(self.across, node_sum.view(k, chunk)).sum(dim=0)
        output.copy_(total.to(output.dtype))
        return done()

    def _exchange(self, comm: Comm, rows: torch.Tensor) -> torch.Tensor:
        """Row i of `rows` goes to rank i of `comm`, quantized; returns the rows received."""
        numel = rows.shape[1]
        packed = quantize.pack(rows, self.bits, self.block)
        received = torch.empty_like(packed)
        comm.all_to_all(received.view(-1), packed.view(-1), kind="reduce_scatter")
        return quantize.unpack(received, numel, self.bits, self.block)

    def note_buffer(self, tensor: torch.Tensor) -> None:
        self.node.note_buffer(tensor)

    def release_buffer(self, tensor: torch.Tensor) -> None:
        self.node.release_buffer(tensor)


def _run_now_or_later(finish, async_op: bool) -> Pending:
    pending = Pending(None, finish)
    if not async_op:
        pending.wait()
    return pending


@dataclass
class CommPlan:
    """Which group each of the engine's collectives runs over."""

    shard: Comm  # the flat groups' shards, their all-gathers and the gradient norm
    grads: Comm | ReplicatedReduce | HierarchicalQuantizedReduce  # the reducer's
    gather: GatherPolicy  # how stage-3 units are gathered
    replicas: Comm | None = None  # hybrid sharding: the ranks holding the same shard as this one

    def write_once(self, write: Callable[[], str], fallback: str, world: Comm,
                   device: torch.device) -> str:
        """Run a checkpoint writer `write` (collective over `shard`) on one copy of the shards.

        Under hybrid sharding every block of ranks holds the same shards, and files are
        named by shard rank, so only the first block writes (a checkpoint of
        `mics_shard_size` ranks, which loads under any world size); the others return
        `fallback`, the same path. Every rank learns whether the write failed. Each
        rank's RNG state is saved by its first-block counterpart only.
        """
        if self.replicas is None:
            return write()
        result, error = fallback, None
        if self.replicas.rank == 0:
            try:
                result = write()
            except Exception as caught:  # noqa: BLE001 - re-raised below, after the others hear
                error = caught
        failed = torch.tensor([int(error is not None)], device=device)
        world.all_reduce(failed, op=dist.ReduceOp.MAX, kind="checkpoint")
        if error is not None:
            raise error
        if failed.item():
            raise RuntimeError("writing the checkpoint failed on the first block of ranks "
                               "(hybrid sharding); see its error")
        return result


def build_comm_plan(config: Config, comm: Comm, env_ranks_per_node: int | None) -> CommPlan:
    """The groups the config's options need (created here, on every rank, in one order).

    The node layout is `comm`'s, else the config's or `env_ranks_per_node` (`Runtime`'s).
    """
    zero, cluster = config.zero_optimization, config.zeromem.cluster
    hpz, shard_size = zero.zero_hpz_partition_size, zero.mics_shard_size
    quantized = zero.zero_quantized_weights or zero.zero_quantized_gradients
    if not (hpz > 1 or shard_size > 0 or quantized):
        return CommPlan(comm, comm, GatherPolicy(comm))
    if not comm.spans_world:
        raise ConfigError("zero_optimization: hybrid sharding and ZeRO++ need the data-parallel "
                          "group to be every rank (dp_group=None)")
    layout = comm.layout or node_layout(config, comm.world_size, env_ranks_per_node)
    meshes: dict[int, Mesh] = {}

    def mesh(block: int, key: str) -> Mesh:
        if block < 1 or comm.world_size % block:
            raise ConfigError(f"{key} = {block} does not divide the {comm.world_size} "
                              "data-parallel ranks")
        if block not in meshes:
            meshes[block] = Mesh(layout, block, comm.global_rank)
        return meshes[block]

    block = cluster.quantization_block_size
    weight_bits = 8 if zero.zero_quantized_weights else None
    if shard_size > comm.world_size:
        raise ConfigError(f"zero_optimization.mics_shard_size = {shard_size} is more than the "
                          f"{comm.world_size} data-parallel ranks")
    if 0 < shard_size < comm.world_size:
        hybrid = mesh(shard_size, "zero_optimization.mics_shard_size")
        shard = comm.sub(hybrid.block_group)
        replicas = comm.sub(hybrid.across_group)
        return CommPlan(shard, ReplicatedReduce(shard, replicas),
                        GatherPolicy(shard, None, weight_bits, block), replicas)
    secondary = None
    if hpz > 1:
        secondary = comm.sub(mesh(hpz, "zero_optimization.zero_hpz_partition_size").block_group)
    gather = GatherPolicy(comm, secondary, weight_bits, block)
    grads: Comm | HierarchicalQuantizedReduce = comm
    if zero.zero_quantized_gradients:
        nodes = mesh(layout.ranks_per_node, "zeromem.cluster.ranks_per_node")
        grads = HierarchicalQuantizedReduce(comm.sub(nodes.block_group),
                                            comm.sub(nodes.across_group),
                                            cluster.quantized_gradient_bits, block)
    return CommPlan(comm, grads, gather)
