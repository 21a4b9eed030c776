"""The cluster planner (planning/cluster.py): the paper's volumes, the byte model, the advice."""
from __future__ import annotations

from pathlib import Path

import pytest

from zeromem.planning.cluster import Cluster, option_cost, paper_volume, plan_cluster


def test_paper_setting_sends_four_times_less_across_nodes():
    volume = paper_volume()
    assert volume == {"stage 3": 3.0, "ZeRO++": 0.75}
    # our byte model on many nodes (nearly every peer off-node) approaches the paper's
    psi, cluster = 1e9, Cluster(nodes=384, gpus_per_node=16)
    stage3 = option_cost("stage 3", psi, cluster).inter_bytes
    assert stage3 == pytest.approx(3 * 2 * psi, rel=0.01)  # 3M, M = 2Ψ bytes
    zeropp = option_cost("ZeRO++ (all three)", psi, cluster)
    # qwZ's forward gather alone is ~0.5M; hpZ moves no backward byte across; qgZ's
    # hierarchical reduce-scatter sends int4 node sums: far below the paper's 0.25M
    assert 0.5 * 2 * psi < zeropp.inter_bytes < 0.75 * 2 * psi
    assert stage3 / zeropp.inter_bytes >= 4


def test_bytes_and_memory_of_each_option_on_two_nodes_of_eight():
    psi, cluster = 7.5e9, Cluster(2, 8, 300e9, 25e9)
    plain = option_cost("stage 3", psi, cluster)
    assert plain.memory_bytes == 16 * psi / 16
    assert plain.inter_bytes == pytest.approx(3 * 2 * psi * 8 / 16)
    hpz = option_cost("+hpZ", psi, cluster)
    assert hpz.memory_bytes == plain.memory_bytes + 2 * psi / 8  # the secondary copy
    assert hpz.inter_bytes == pytest.approx(2 / 3 * plain.inter_bytes) and hpz.exact
    qwz = option_cost("+qwZ", psi, cluster, block=256)
    assert qwz.inter_bytes == pytest.approx(plain.inter_bytes * (2 + 4 / 256) / 3,
                                            rel=0.01)  # gathers halved, reduce-scatter not
    assert not qwz.exact
    hybrid = option_cost("hybrid sharding", psi, cluster)
    assert hybrid.memory_bytes == 16 * psi / 8 and hybrid.exact
    assert hybrid.inter_bytes == pytest.approx(2 * 0.5 * 2 * psi / 8)


def test_advice_follows_memory_and_links():
    one_node = plan_cluster(1e9, Cluster(1, 8))
    assert one_node.recommended == () and "one node" in one_node.reasons[0]
    roomy = plan_cluster(1e9, Cluster(2, 8, gpu_mem_bytes=80e9))
    assert roomy.recommended == ("hybrid sharding",)
    tight = plan_cluster(7.5e9, Cluster(16, 8, gpu_mem_bytes=10e9), compute_s=0.1)
    assert tight.recommended == ("hpZ", "qwZ", "qgZ")
    assert any("too much" in r for r in tight.reasons)
    fast = plan_cluster(7.5e9, Cluster(16, 8, gpu_mem_bytes=10e9), compute_s=100.0)
    assert fast.recommended == ("hpZ",)
    assert "4x less" in str(tight)
    assert tight.zero_keys(3) == ({"zero_hpz_partition_size": 8, "zero_quantized_weights": True,
                                   "zero_quantized_gradients": True}, None)
    keys, note = tight.zero_keys(2)
    assert keys == {} and "hpZ, qwZ, qgZ" in note
    assert roomy.zero_keys(1) == ({"mics_shard_size": 8}, None)


def test_plan_command_prints_the_cluster_options(capsys):
    from zeromem.cli import main
    model = str(Path(__file__).parents[2] / "examples" / "configs" / "gpt2-small.json")
    assert main(["plan", model, "--nodes", "2", "--gpus-per-node",
                 "8", "--gpu-mem", "16GB", "--intra", "300GB/s", "--inter", "25GB/s"]) == 0
    out = capsys.readouterr().out
    assert "cluster: 2 node(s) x 8 GPUs, intra 300 GB/s, inter 25 GB/s" in out
    assert "ZeRO++ (all three)" in out and "recommended: hybrid sharding" in out
    assert '"mics_shard_size": 8' in out  # the written config carries the recommendation
    assert main(["plan", model, "--gpus", "12", "--nodes", "2",
                 "--gpus-per-node", "8", "--gpu-mem", "16GB"]) != 0  # 12 is not 2 x 8
