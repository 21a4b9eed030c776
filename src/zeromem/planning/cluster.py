"""Plan hybrid sharding and ZeRO++ for a cluster of nodes (`zeromem plan --gpus-per-node`).

For Ψ parameters trained in bf16 with Adam on K nodes of g GPUs (N = K g ranks), each
option's bytes per rank per step, split intra/inter-node with the model the engine's
ledger uses (comm.py: a rank sends an equal share to every peer of the group, so a
flat collective over N ranks sends (N - g)/N of its data off the node):

    stage 3     forward all-gather, backward all-gather, reduce-scatter: each
                (N - 1)/N of 2Ψ bytes, (N - g)/N of 2Ψ across nodes
    + hpZ       backward all-gather over the node only: (g - 1)/g of 2Ψ, none across
    + qwZ       all-gathers move int8 plus one fp32 scale per block: x (1 + 4/block)/2
                (not hpZ's backward gather: its secondary copies move unquantized)
    + qgZ       node all-to-all of int4 (or int8) values, then across nodes each rank
                sends its node's partial sums of K chunks of Ψ/N: (K - 1)/K of Ψ/g
                elements at bits/8 bytes (+ scales)
    hybrid      (mics_shard_size = g) gathers and reduce-scatter within the node;
                across nodes an all-reduce of the 2Ψ/g shard: 2(K - 1)/K of it

Memory per GPU (model states, bytes): stage 3 (2 + 2 + 12)Ψ/N; hpZ adds its secondary
copy of the parameters, 2Ψ/g, alive from the forward to the step; hybrid sharding
shards over the node only, 16Ψ/g. Step time: the communication at the given intra- and
inter-node bandwidths (per GPU), beside compute when given; overlap not modelled.

`paper_volume` is the ZeRO++ paper's own accounting (arXiv 2306.10209, section 3:
cross-node volume in units of the fp16 model size M): stage 3 sends M + M + M = 3M;
qwZ halves the forward gather (0.5M), hpZ removes the backward one (0), qgZ cuts the
reduce-scatter to int4 (0.25M): 0.75M, 4x less.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from zeromem.hybrid.quantize import packed_nbytes

OPTIONS: dict[str, dict] = {
    "stage 3": {},
    "+hpZ": {"zero_hpz_partition_size": True},
    "+qwZ": {"zero_quantized_weights": True},
    "+qgZ": {"zero_quantized_gradients": True},
    "ZeRO++ (all three)": {"zero_hpz_partition_size": True, "zero_quantized_weights": True,
                           "zero_quantized_gradients": True},
    "hybrid sharding": {"mics_shard_size": True},
}
STATE_BYTES = 16  # bf16 params and grads (2 + 2), Adam's fp32 master, momentum, variance (12)


@dataclass(frozen=True)
class Cluster:
    """K nodes of g GPUs; bandwidths in bytes/s per GPU."""

    nodes: int
    gpus_per_node: int
    intra_bw: float = 300e9
    inter_bw: float = 25e9
    gpu_mem_bytes: float | None = None

    @property
    def ranks(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class OptionCost:
    """One option's model-state memory and communication per GPU per step."""

    name: str
    memory_bytes: float
    intra_bytes: float
    inter_bytes: float
    comm_s: float
    exact: bool
    config: dict = field(default_factory=dict)


def _ag(psi: float, n: int, g: int) -> tuple[float, float]:
    """(intra, inter) bytes of one flat all-gather or reduce-scatter of 2Ψ over n ranks."""
    return 2 * psi * (g - 1) / n, 2 * psi * (n - g) / n


def option_cost(name: str, psi: float, cluster: Cluster, bits: int = 4,
                block: int = 256, frozen: float = 0.0) -> OptionCost:
    """The bytes and memory of option `name` (a key of OPTIONS) for Ψ = `psi` trained
    parameters and `frozen` ones (gathered as the others, never reduced)."""
    keys, n, g, k = OPTIONS[name], cluster.ranks, cluster.gpus_per_node, cluster.nodes
    gathered = psi + frozen
    if "mics_shard_size" in keys:
        intra = 3 * 2 * psi * (g - 1) / g
        inter = 2 * (k - 1) / k * 2 * psi / g
        return _cost(name, STATE_BYTES * psi / g, intra, inter, cluster, True,
                     {"mics_shard_size": g})
    weight = (1 + 4 / block) / 2 if "zero_quantized_weights" in keys else 1.0
    forward = tuple(b * weight for b in _ag(gathered, n, g))
    # hpZ's backward gathers the secondary copies unquantized: they stay in the node
    backward = ((2 * gathered * (g - 1) / g, 0.0) if "zero_hpz_partition_size" in keys
                else forward)
    if "zero_quantized_gradients" in keys:
        per_byte = packed_nbytes(block, bits, block) / block  # bytes per element on the wire
        reduce = (psi * (g - 1) / g * per_byte, psi / g * (k - 1) / k * per_byte)
    else:
        reduce = _ag(psi, n, g)
    memory = STATE_BYTES * psi / n + 2 * frozen / n \
        + (2 * gathered / g if "zero_hpz_partition_size" in keys else 0)
    config = {key: (g if key == "zero_hpz_partition_size" else True) for key in keys}
    return _cost(name, memory, forward[0] + backward[0] + reduce[0],
                 forward[1] + backward[1] + reduce[1], cluster, not keys.keys() - {
                     "zero_hpz_partition_size"}, config)


def _cost(name: str, memory: float, intra: float, inter: float, cluster: Cluster, exact: bool,
          config: dict) -> OptionCost:
    comm_s = intra / cluster.intra_bw + inter / cluster.inter_bw
    return OptionCost(name, memory, intra, inter, comm_s, exact, config)


def paper_volume() -> dict[str, float]:
    """Cross-node volume per step in units of the fp16 model size (ZeRO++ paper, section 3)."""
    stage3 = {"forward all-gather": 1.0, "backward all-gather": 1.0, "reduce-scatter": 1.0}
    zeropp = {"forward all-gather": 0.5,   # qwZ: int8 instead of fp16
              "backward all-gather": 0.0,  # hpZ: within the node
              "reduce-scatter": 0.25}      # qgZ: int4 instead of fp16
    return {"stage 3": sum(stage3.values()), "ZeRO++": sum(zeropp.values())}


@dataclass(frozen=True)
class ClusterPlan:
    psi: float
    cluster: Cluster
    costs: tuple[OptionCost, ...]
    recommended: tuple[str, ...]
    reasons: tuple[str, ...]

    def zero_keys(self, stage: int) -> tuple[dict, str | None]:
        """The `zero_optimization` keys of the recommended options for a config at `stage`,
        and a note when some do not apply (ZeRO++ is stage 3 only; hybrid needs stage >= 1)."""
        costs = {o.name: o for o in self.costs}
        names = {"hybrid sharding": "hybrid sharding", "hpZ": "+hpZ", "qwZ": "+qwZ", "qgZ": "+qgZ"}
        keys: dict = {}
        skipped = []
        for option in self.recommended:
            usable = stage >= 1 if option == "hybrid sharding" else stage == 3
            if usable:
                keys.update(costs[names[option]].config)
            else:
                skipped.append(option)
        note = (f"not applied at stage {stage}: {', '.join(skipped)} (ZeRO++ needs stage 3, "
                "hybrid sharding stage 1-3)" if skipped else None)
        return keys, note

    def __str__(self) -> str:
        c = self.cluster
        rows = [f"cluster: {c.nodes} node(s) x {c.gpus_per_node} GPUs, intra {c.intra_bw / 1e9:g} "
                f"GB/s, inter {c.inter_bw / 1e9:g} GB/s per GPU; Ψ = {self.psi:.3g}",
                f"{'option':<20}{'memory GB':>11}{'intra GB':>10}{'inter GB':>10}"
                f"{'comm s':>9}  exact"]
        for o in self.costs:
            rows.append(f"{o.name:<20}{o.memory_bytes / 1e9:>11.2f}{o.intra_bytes / 1e9:>10.2f}"
                        f"{o.inter_bytes / 1e9:>10.2f}{o.comm_s:>9.3f}  {'yes' if o.exact else 'no'}")
        paper = paper_volume()
        rows.append(f"paper's accounting (ZeRO++ section 3): stage 3 sends {paper['stage 3']:g}M "
                    f"across nodes per step, ZeRO++ {paper['ZeRO++']:g}M "
                    f"({paper['stage 3'] / paper['ZeRO++']:g}x less)")
        rows.append("recommended: " + (", ".join(self.recommended) or "plain stage 3"))
        rows += [f"  - {r}" for r in self.reasons]
        return "\n".join(rows)


def plan_cluster(psi: float, cluster: Cluster, compute_s: float | None = None,
                 bits: int = 4, block: int = 256, frozen: float = 0.0) -> ClusterPlan:
    """Each option's cost, and which to turn on, with reasons."""
    costs = tuple(option_cost(name, psi, cluster, bits, block, frozen) for name in OPTIONS)
    by_name = {o.name: o for o in costs}
    plain, reasons, chosen = by_name["stage 3"], [], []
    if cluster.nodes == 1:
        reasons.append("one node: nothing crosses a node, so hpZ/qwZ/qgZ/hybrid sharding "
                       "save no slow-link bytes (qwZ/qgZ would only add quantization error)")
        return ClusterPlan(psi, cluster, costs, (), tuple(reasons))
    budget = cluster.gpu_mem_bytes
    hybrid = by_name["hybrid sharding"]
    if budget is None or hybrid.memory_bytes <= budget:
        chosen.append("hybrid sharding")
        reasons.append(f"model states sharded over one node fit ({hybrid.memory_bytes / 1e9:.1f} "
                       f"GB per GPU): exact, and cross-node bytes fall from "
                       f"{plain.inter_bytes / 1e9:.2f} to {hybrid.inter_bytes / 1e9:.2f} GB per step")
        return ClusterPlan(psi, cluster, costs, tuple(chosen), tuple(reasons))
    reasons.append(f"hybrid sharding needs {hybrid.memory_bytes / 1e9:.1f} GB per GPU: too much")
    hpz = by_name["+hpZ"]
    if hpz.memory_bytes <= budget:
        chosen.append("hpZ")
        reasons.append(f"hpZ's secondary copy fits ({hpz.memory_bytes / 1e9:.1f} GB per GPU) and "
                       "keeps the backward gather in the node, exactly")
    slow = compute_s is None or plain.comm_s > compute_s
    if slow:
        chosen += ["qwZ", "qgZ"]
        reasons.append(f"communication ({plain.comm_s:.3f} s per step"
                       + (f" against {compute_s:.3f} s of compute" if compute_s else "")
                       + ") bounds the step: qwZ halves the gathers and qgZ sends int4 node "
                         "sums across nodes (not exact: check convergence)")
    else:
        reasons.append("compute hides the communication: qwZ/qgZ would cost accuracy for nothing")
    return ClusterPlan(psi, cluster, costs, tuple(chosen), tuple(reasons))
