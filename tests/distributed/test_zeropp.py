"""Hybrid sharding, hpZ, qwZ and qgZ on 4 ranks seen as 2 "nodes" of 2 (hybrid/hierarchy.py).

Exact options (hybrid sharding, hpZ) must train like one process on the global batch
(fp32, 1e-5) on every rank, ranks seeded differently, with AdamW and with SGD +
momentum (which sees a gradient's magnitude, so a replica group summed twice or not
at all shows). The ledger must show where the bytes went: hybrid sharding's gathers
and reduce-scatters stay in the node, hpZ's backward gathers never leave it, qwZ
halves the gather's bytes, qgZ cuts the reduce-scatter's cross-node bytes by the
factor its model gives. Quantized options are not exact: their loss after 20 bf16
steps must stay near plain stage 3's.
"""
from __future__ import annotations

import copy

import pytest
import torch

import zeromem
from harness import run_distributed
from models import GainLM, Reference, TinyLM, micro_batch, state_dict_diff, uses_sometimes
from zeromem.hybrid import quantize
from zeromem.comm import Comm
from zeromem.hybrid.hierarchy import HierarchicalQuantizedReduce
from zeromem.hybrid.mesh import Mesh, NodeLayout
from zeromem.planning.cluster import Cluster, option_cost
from zeromem.stage3.sharded_unit import all_gather_quantized

STEPS = 2  # the second step already applies SGD's momentum and Adam's moments


def config(stage: int, optimizer: str, gas: int = 1, clip: float = 0.0, ranks_per_node: int = 2,
           **zero) -> dict:
    opt = ({"type": "SGD", "params": {"lr": 1e-2, "momentum": 0.9}} if optimizer == "sgd"
           else {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}})
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": gas,
            "optimizer": opt, "gradient_clipping": clip,
            "zeromem": {"cluster": {"ranks_per_node": ranks_per_node}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 100,
                                  "allgather_bucket_size": 50,
                                  "stage3_param_persistence_threshold": 0, **zero}}


def held_diff(engine, model: torch.nn.Module) -> float:
    """Max abs difference between this rank's master and parameter shards (and whole
    parameters, stages 1-2) and `model`."""
    worst = 0.0
    for g in engine.groups:
        for slot in g.slots:
            ref = model.get_parameter(slot.name).detach().float().flatten()
            start, at, n = g.owned_slice(slot)
            for shard in (g.master, g.param_shard):
                got = shard.detach().float()[start:start + n]
                worst = max(worst, (got - ref[at:at + n]).abs().max().item() if n else 0.0)
            if g.flat_param is not None:
                whole = g.flat_param.detach().float()[slot.offset:slot.offset + slot.numel]
                worst = max(worst, (whole - ref).abs().max().item())
    return worst


def train_and_compare(rank: int, world_size: int, stage: int, optimizer: str, gas: int,
                      ranks_per_node: int = 2, **zero) -> dict:
    per_rank = stage < 3  # stage 3: every rank runs the same modules
    torch.manual_seed(0)
    clip = 0.05 if optimizer == "adamw" else 0.0  # AdamW cases clip: the norm must be global
    # GainLM: its backward reads the re-gathered parameters (a Linear's reads the forward's)
    ref = Reference(GainLM(), optimizer=optimizer, per_rank=per_rank, clip=clip)
    initial = copy.deepcopy(ref.model)
    torch.manual_seed(rank * 7 + 1 if rank else 0)  # ranks seeded differently: rank 0's wins
    engine = zeromem.initialize(GainLM(), config(stage, optimizer, gas, clip, ranks_per_node,
                                                 **zero))
    diffs = []
    for step in range(STEPS):
        for micro in range(gas):
            tokens, targets = micro_batch(step, rank, micro)
            engine.backward(engine(tokens, targets, uses_sometimes(step, rank, micro, per_rank)))
            engine.step()
        ref.step(step, world_size, gas)
        diffs.append(max(state_dict_diff(engine.full_state_dict(), ref.model),
                         held_diff(engine, ref.model)))
    assert held_diff(engine, initial) > 1e-3, f"rank {rank} did not train"
    report = engine.comm_report()
    engine.close()
    return {"diffs": diffs, "split": {k: report.split(k) for k in report.last_step},
            "shard_world": engine.groups[0].shard_world}


EXACT_CASES = [(1, "sgd", 2, {"mics_shard_size": 2}), (2, "adamw", 1, {"mics_shard_size": 2}),
               (3, "adamw", 1, {"mics_shard_size": 2}), (3, "sgd", 2, {"mics_shard_size": 2})]
EXACT_CASES += [(3, optimizer, gas, {"zero_hpz_partition_size": 2})
                for optimizer, gas in (("adamw", 1), ("sgd", 2))]


def exact_options(rank: int, world_size: int, save_dir: str) -> list:
    return [train_and_compare(rank, world_size, stage, optimizer, gas, **zero)
            for stage, optimizer, gas, zero in EXACT_CASES] + [hybrid_checkpoint(rank, save_dir)]


def hybrid_checkpoint(rank: int, save_dir: str) -> dict:
    """Save under hybrid sharding (one block writes), resume it there and load it flat."""
    def build(**zero):
        torch.manual_seed(0)
        return zeromem.initialize(GainLM(), config(2, "adamw", 1, 0.05, **zero))

    def train(engine, steps) -> None:
        for step in steps:
            engine.backward(engine(*micro_batch(step, rank, 0)))
            engine.step()

    def masters(engine) -> list[torch.Tensor]:
        return [g.master.detach().clone() for g in engine.groups]

    first = build(mics_shard_size=2)
    train(first, range(2))
    path = first.save_checkpoint(save_dir)
    saved = first.full_state_dict()  # collective; {} off rank 0
    train(first, range(2, 4))
    resumed = build(mics_shard_size=2)
    resumed.load_checkpoint(save_dir)
    train(resumed, range(2, 4))
    same = max((a - b).abs().max().item() for a, b in zip(masters(first), masters(resumed)))
    flat = build()  # the checkpoint of the 2-rank block loads on 4 plain ranks
    flat.load_checkpoint(save_dir)
    loaded = flat.full_state_dict()
    flat_diff = max(((loaded[k] - saved[k]).abs().max().item() for k in saved), default=0.0)
    for engine in (first, resumed, flat):
        engine.close()
    return {"path": path, "resumed_diff": same, "flat_diff": flat_diff}


def test_hybrid_sharding_and_hpz_train_like_one_process(tmp_path):
    for rank, results in enumerate(run_distributed(exact_options, 4, str(tmp_path))):
        checkpoint = results.pop()
        assert checkpoint["path"] == str(tmp_path / "global_step2"), checkpoint
        assert checkpoint["resumed_diff"] <= 1e-6 and checkpoint["flat_diff"] <= 1e-6, checkpoint
        for (stage, optimizer, gas, zero), result in zip(EXACT_CASES, results):
            case = f"rank {rank} stage {stage} {optimizer} gas {gas} {zero}"
            assert max(result["diffs"]) <= 1e-5, f"{case}: diffs {result['diffs']}"
            split = result["split"]
            if "mics_shard_size" in zero:
                assert result["shard_world"] == 2, case  # sharded within the node only
                gathers = [k for k in split if k.startswith("all_gather")]
                assert gathers and all(split[k][1] == 0 for k in gathers), f"{case}: {split}"
                assert split["reduce_scatter"][1] == 0 and split["reduce_scatter"][0] > 0, case
                # the replica all-reduce is the only gradient traffic between nodes
                assert split["all_reduce"][0] == 0 and split["all_reduce"][1] > 0, case
            else:  # hpZ: the backward gathers stay in the node, the forward's cross it
                assert result["shard_world"] == 4, case
                intra, inter = split["all_gather_backward"]
                assert inter == 0 and intra > 0, f"{case}: {split}"
                assert split["all_gather_forward"][1] > 0, case


# World 8: the two-level arithmetic past 2 and 4 (2 nodes of 4, 4 nodes of 2).
WORLD_8_CASES = [(1, "adamw", 1, 4, {}), (2, "sgd", 1, 4, {}), (3, "adamw", 1, 4, {}),
                 (3, "sgd", 1, 4, {"mics_shard_size": 4}), (2, "adamw", 1, 2, {"mics_shard_size": 2}),
                 (3, "adamw", 1, 4, {"zero_hpz_partition_size": 4}),
                 (3, "sgd", 1, 2, {"zero_hpz_partition_size": 2})]


def world_8(rank: int, world_size: int) -> list:
    return [train_and_compare(rank, world_size, stage, optimizer, gas, nodes_of, **zero)
            for stage, optimizer, gas, nodes_of, zero in WORLD_8_CASES]


def test_world_8_stages_hybrid_and_hpz_train_like_one_process():
    for rank, results in enumerate(run_distributed(world_8, 8)):
        for (stage, optimizer, _, nodes_of, zero), result in zip(WORLD_8_CASES, results):
            case = f"rank {rank} stage {stage} {optimizer} nodes of {nodes_of} {zero}"
            assert max(result["diffs"]) <= 1e-5, f"{case}: diffs {result['diffs']}"
            assert result["shard_world"] == zero.get("mics_shard_size", 8), case
            if "zero_hpz_partition_size" in zero:
                intra, inter = result["split"]["all_gather_backward"]
                assert inter == 0 and intra > 0, case


# ---------------------------------------------------------------- the quantized collectives

def quantized_collectives(rank: int, world_size: int) -> dict:
    """qgZ's reduce-scatter and qwZ's gather against the exact ones, on real groups."""
    layout = NodeLayout(world_size, 2)
    comm = Comm(None, None, layout)  # 2 nodes of 2
    nodes = Mesh(layout, 2, rank)
    g = torch.Generator().manual_seed(rank)
    chunk, out = 300, {}
    bucket = torch.randn(world_size * chunk, generator=g) * (1 + rank)
    exact = torch.empty(chunk)
    comm.reduce_scatter(exact, bucket.clone())
    bound = sum(1 + r for r in range(world_size)) * bucket.abs().max().item() / (1 + rank)
    for bits in (4, 8):
        reduce = HierarchicalQuantizedReduce(comm.sub(nodes.block_group),
                                             comm.sub(nodes.across_group), bits, 64)
        got = torch.empty(chunk)
        reduce.reduce_scatter(got, bucket.clone())
        # two hops, each within half a quantization step of every summand's block maximum
        out[f"qgZ int{bits}"] = ((got - exact).abs().max().item(),
                                 2 * 4 * bound / (2 * quantize.qmax(bits)))
    shard = torch.randn(chunk, generator=g)
    whole_exact = torch.empty(world_size * chunk)
    comm.all_gather(whole_exact, shard)

    whole = torch.empty(world_size * chunk)
    pending, dequantize = all_gather_quantized(comm, shard, whole, "all_gather_forward", 8, 64)
    pending.wait()
    dequantize()
    limit = max(quantize.max_error(whole_exact[r * chunk:(r + 1) * chunk], 8, 64).max().item()
                for r in range(world_size))
    out["qwZ"] = ((whole - whole_exact).abs().max().item(), limit * (1 + 1e-5))
    comm.close()
    return out


def test_quantized_collectives_are_exact_ones_within_their_bound(measured):
    for rank, runs in enumerate(measured):  # the same spawned world as the bytes below
        for name, (error, bound) in runs["collectives"].items():
            assert 0 < error <= bound, (rank, name, error, bound)


# ---------------------------------------------------------------- bytes and convergence

OPTIONS = {"stage 3": {}, "+hpZ": {"zero_hpz_partition_size": 2},
           "+qwZ": {"zero_quantized_weights": True},
           "+qgZ": {"zero_quantized_gradients": True},
           "all three": {"zero_hpz_partition_size": 2, "zero_quantized_weights": True,
                         "zero_quantized_gradients": True}}
CONVERGE_STEPS = 20
BLOCK = 64


def wide_lm() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(vocab=13, dim=96)  # shards of hundreds of elements: several blocks each


def bf16_config(**zero) -> dict:
    data = config(3, "adamw", 1, 0.0, reduce_bucket_size=10**6, **zero)
    data["bf16"] = {"enabled": True}
    data["optimizer"]["params"]["lr"] = 3e-3
    data["zeromem"]["cluster"]["quantization_block_size"] = BLOCK
    return data


def bytes_and_losses(rank: int, world_size: int) -> dict:
    out: dict = {"collectives": quantized_collectives(rank, world_size)}
    for name, zero in OPTIONS.items():
        engine = zeromem.initialize(wide_lm(), bf16_config(**zero))
        losses = []
        for step in range(CONVERGE_STEPS):
            tokens, targets = micro_batch(step % 4, rank, 0)  # 4 batches seen 5 times
            loss = engine(tokens, targets)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        report = engine.comm_report()
        shards = [g.shard_numel for g in engine.groups]
        frozen = [g.shard_numel for g in engine.frozen_groups]  # gathered, never reduced
        engine.backward(engine(*micro_batch(0, rank, 0)))  # hpZ's copies live until the step
        params_bytes = engine.memory_report().held["params"]["device"]
        engine.step()  # ... and no longer: the step changed the weights they copy
        after_step = engine.memory_report().held["params"]["device"]
        engine.close()
        out[name] = {"split": {k: report.split(k) for k in report.last_step},
                     "losses": losses, "shards": shards, "frozen": frozen,
                     "params_bytes": params_bytes,
                     "params_bytes_after_step": after_step}
    return out


@pytest.fixture(scope="module")
def measured() -> list[dict]:
    return run_distributed(bytes_and_losses, 4)


def test_ledger_shows_each_option_saving_what_it_claims(measured):
    for rank, runs in enumerate(measured):
        plain, shards = runs["stage 3"]["split"], runs["stage 3"]["shards"]
        gathered = shards + runs["stage 3"]["frozen"]  # TinyLM's frozen layer: gathered too
        # hpZ: no backward gather byte crosses a node; the forward's are unchanged
        hpz = runs["+hpZ"]["split"]
        assert hpz["all_gather_backward"][1] == 0 and hpz["all_gather_backward"][0] > 0
        assert hpz["all_gather_forward"] == plain["all_gather_forward"]
        # qwZ: int8 plus one fp32 scale per block of BLOCK, against bf16's 2 bytes
        qwz = runs["+qwZ"]["split"]
        packed = sum(quantize.packed_nbytes(s, 8, BLOCK) for s in gathered)
        for kind in ("all_gather_forward", "all_gather_backward"):
            assert sum(qwz[kind]) == pytest.approx(sum(plain[kind]) * packed / (2 * sum(gathered)),
                                                   abs=2), kind
            assert sum(qwz[kind]) <= 0.55 * sum(plain[kind]), kind  # about half
        # qgZ: flat reduce-scatter sends 2 of its 3 peers' chunks across (2 bytes each);
        # hierarchical sends one int4 node-sum chunk per rank across
        qgz = runs["+qgZ"]["split"]
        flat_inter = sum(2 * 2 * s for s in shards)  # 4 chunks of s, 2 of them off-node
        qgz_inter = sum(quantize.packed_nbytes(s, 4, BLOCK) for s in shards)
        assert plain["reduce_scatter"][1] == pytest.approx(flat_inter, abs=2)
        assert qgz["reduce_scatter"][1] == pytest.approx(qgz_inter, abs=2)
        assert plain["reduce_scatter"][1] / qgz["reduce_scatter"][1] > 6, rank  # ~8x less
        # hpZ's secondary copy: half of each unit (2 ranks per node), bf16, until the step
        extra = runs["+hpZ"]["params_bytes"] - runs["stage 3"]["params_bytes"]
        assert extra == sum(4 * s // 2 * 2 for s in gathered), (extra, gathered)
        assert runs["+hpZ"]["params_bytes_after_step"] == runs["stage 3"]["params_bytes_after_step"]
        both = runs["all three"]["split"]
        assert both["all_gather_backward"][1] == 0
        assert both["reduce_scatter"] == qgz["reduce_scatter"]
        # the planner's model (planning/cluster.py) predicts what the ledger measured
        psi, cluster = 4 * sum(shards), Cluster(2, 2)
        frozen = 4 * sum(runs["stage 3"]["frozen"])
        for name, planned in (("stage 3", "stage 3"), ("+hpZ", "+hpZ"), ("+qwZ", "+qwZ"),
                              ("+qgZ", "+qgZ"), ("all three", "ZeRO++ (all three)")):
            cost = option_cost(planned, psi, cluster, bits=4, block=BLOCK, frozen=frozen)
            split = runs[name]["split"]
            kinds = ("all_gather_forward", "all_gather_backward", "reduce_scatter")
            intra, inter = (sum(split[k][i] for k in kinds) for i in (0, 1))
            assert inter == pytest.approx(cost.inter_bytes, rel=0.03), name
            assert intra == pytest.approx(cost.intra_bytes, rel=0.03), name


def test_quantized_options_converge_like_plain_stage3(measured):
    for runs in measured:
        plain = runs["stage 3"]["losses"]
        assert plain[-1] < plain[0] - 0.3  # it did learn
        assert runs["+hpZ"]["losses"] == plain  # hpZ is exact: the same weights and sums
        for name in ("+qwZ", "+qgZ", "all three"):
            final = runs[name]["losses"][-1]
            assert abs(final - plain[-1]) <= 0.05 * plain[-1], (name, final, plain[-1])


def hybrid_on_a_sub_group(rank: int, world_size: int) -> str:
    """hpZ asked for over a data-parallel group of one rank (each rank its own group)."""
    import torch.distributed as dist
    groups = [dist.new_group([r]) for r in range(world_size)]
    try:
        zeromem.initialize(TinyLM(), config(3, "adamw", zero_hpz_partition_size=2),
                           dp_group=groups[rank])
    except zeromem.ConfigError as error:
        return str(error)
    return "no error"


def test_hybrid_sharding_on_a_data_parallel_sub_group_is_refused_by_name():
    for rank, message in enumerate(run_distributed(hybrid_on_a_sub_group, 2)):
        assert "need the data-parallel group to be every rank" in message, (rank, message)
