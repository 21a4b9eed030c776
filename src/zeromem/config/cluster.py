"""`zeromem.cluster`: where ranks sit and how the ZeRO++ / hybrid options are tuned.

The DeepSpeed keys that turn the options on live in `zero_optimization`
(`mics_shard_size`, `zero_hpz_partition_size`, `zero_quantized_weights`,
`zero_quantized_gradients`); this block holds zeromem's own knobs around them, and
`check_zeropp` the rules that tie those keys to the stage (hybrid/hierarchy.py builds them).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StrictInt

if TYPE_CHECKING:  # schema.py imports this module
    from zeromem.config.schema import ZeroConfig


class ClusterConfig(BaseModel):
    """`zeromem.cluster`: the node layout and the quantization of ZeRO++'s collectives."""

    model_config = ConfigDict(extra="forbid")
    _derived: set[str] = PrivateAttr(default_factory=set)

    # ranks on one node (consecutive global ranks); None: env ZEROMEM_RANKS_PER_NODE, then
    # torchrun's LOCAL_WORLD_SIZE. Lets tests run 4 ranks on one machine as 2 "nodes" of 2.
    ranks_per_node: StrictInt | None = Field(None, ge=1, le=2**20)
    # qgZ: bits per gradient element on the wire (ZeRO++ uses 4)
    quantized_gradient_bits: Literal[4, 8] = 4
    # qwZ / qgZ: elements sharing one fp32 scale (smaller: less error, more scale bytes)
    quantization_block_size: StrictInt = Field(256, ge=2, le=2**30, multiple_of=2)


def check_zeropp(zero: ZeroConfig) -> None:
    """Raise ValueError (naming the key) for a ZeRO++ / hybrid option the stage cannot run.

    `zero` is the `zero_optimization` block. hpZ, qwZ and qgZ change the stage-3
    parameter gathers and gradient reduce-scatter (ZeRO++, arXiv 2306.10209); hybrid
    sharding (`mics_shard_size`) shards within a group of ranks and replicates across
    them, which needs something sharded (stage >= 1).
    """
    zeropp = {"zero_hpz_partition_size": zero.zero_hpz_partition_size > 1,
              "zero_quantized_weights": zero.zero_quantized_weights,
              "zero_quantized_gradients": zero.zero_quantized_gradients}
    used = [key for key, on in zeropp.items() if on]
    for key in used:
        if zero.stage != 3:
            raise ValueError(f"{key} requires stage 3 (ZeRO++ changes the stage-3 parameter "
                             f"gathers and gradient reduce-scatter), got stage {zero.stage}")
    if zero.mics_shard_size > 0:
        if zero.stage == 0:
            raise ValueError("mics_shard_size (hybrid sharding) requires stage 1, 2 or 3, "
                             "got stage 0")
        clash = [key for key in ("zero_hpz_partition_size", "zero_quantized_gradients")
                 if key in used]
        if clash:
            raise ValueError(f"mics_shard_size with {clash[0]} is not supported: hybrid "
                             "sharding already keeps parameter gathers within the shard group "
                             "(hpZ), and its cross-group all-reduce is not quantized (qgZ)")
