"""The environment is read once, at the edge (`distributed.Runtime`), and passed down."""
from __future__ import annotations

import torch

from zeromem.config.schema import Config
from zeromem.distributed import Runtime
from zeromem.hybrid.hierarchy import node_layout
from zeromem.hybrid.mesh import NodeLayout

CONFIG = {"train_batch_size": 4, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}


def test_node_layout_takes_the_first_ranks_per_node_given():
    assert NodeLayout.of(8, None, 4).ranks_per_node == 4
    assert NodeLayout.of(8, 2, 4).ranks_per_node == 2
    assert NodeLayout.of(8).ranks_per_node == 8  # nothing given: one node
    assert NodeLayout.of(4, None, 8).ranks_per_node == 4  # capped at the world


def test_runtime_reads_ranks_per_node_and_timeout_from_the_environment(monkeypatch):
    monkeypatch.delenv("ZEROMEM_RANKS_PER_NODE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("ZEROMEM_GATHER_TIMEOUT_S", raising=False)
    plain = Runtime.from_env(None, None)
    assert (plain.device, plain.global_rank, plain.ranks_per_node) == (torch.device("cpu"), 0, None)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert Runtime.from_env(None, None).ranks_per_node == 4
    monkeypatch.setenv("ZEROMEM_RANKS_PER_NODE", "2")  # the tests' "nodes" win over torchrun's
    monkeypatch.setenv("ZEROMEM_GATHER_TIMEOUT_S", "7")
    runtime = Runtime.from_env(None, 30.0)
    assert (runtime.ranks_per_node, runtime.gather_timeout_s) == (2, 7.0)


def test_node_layout_comes_from_the_config_then_the_runtime_not_the_environment(monkeypatch):
    monkeypatch.setenv("ZEROMEM_RANKS_PER_NODE", "1")  # read by Runtime only: ignored below
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    plain = Config.load(CONFIG)
    assert node_layout(plain, 4, 2).ranks_per_node == 2
    assert node_layout(plain, 4, None).ranks_per_node == 4
    pinned = Config.load({**CONFIG, "zeromem": {"cluster": {"ranks_per_node": 4}}})
    assert node_layout(pinned, 8, 2).ranks_per_node == 4
