"""Activation checkpointing (ZeRO-R Pa+cpu, MD) in this process, no process group.

Partitioned activations over tensor-parallel groups: tests/distributed/test_activations_tp.py.
"""
from __future__ import annotations

import gc
import logging
from types import SimpleNamespace

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from models import StorageTracker, assert_all_close, grads_of
from zeromem.activations import recompute as act
from zeromem.activations.recompute import ActivationCheckpointing, ActivationPolicy, checkpoint

HIDDEN, BATCH, BLOCKS = 32, 48, 8
ACT_BYTES = HIDDEN * BATCH * 4  # one fp32 block input; distinct from every weight's size


@pytest.fixture(autouse=True)
def default_policy():
    act.configure()
    act.reset_peak_checkpoint_bytes()  # peaks of earlier tests in this process are not ours
    yield
    act.configure()


class Block(nn.Module):
    def __init__(self, hidden: int, p: float = 0.2):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
        self.drop = nn.Dropout(p)

    def forward(self, x, scale=1.0, bias=None):
        y = self.drop(self.fc2(self.drop(torch.relu(self.fc1(x))))) * scale
        return y if bias is None else y + bias


def make_blocks(n=BLOCKS, hidden=HIDDEN, seed=0) -> nn.ModuleList:
    torch.manual_seed(seed)
    return nn.ModuleList(Block(hidden) for _ in range(n))


def run_stack(blocks, x, mode: str):
    h = x
    for b in blocks:
        if mode == "plain":
            h = b(h)
        elif mode == "ours":
            h = checkpoint(b, h)
        else:
            h = torch_checkpoint.checkpoint(b, h, use_reentrant=False)
    return h


# -- gradients, arguments, RNG ------------------------------------------------

def test_grads_match_without_checkpointing_with_dropout_kwargs_and_rng():
    blocks = make_blocks()
    x = torch.randn(BATCH, HIDDEN, requires_grad=True)
    results = {}
    for mode in ("plain", "ours"):
        torch.manual_seed(123)
        run_stack(blocks, x, mode).pow(2).sum().backward()
        after = torch.rand(3)  # recompute must not disturb the caller's RNG stream
        results[mode] = grads_of(x, blocks) + [after]
    assert_all_close(results["plain"], results["ours"])


def test_kwargs_non_tensor_args_no_grad_tensors_and_tuple_outputs():
    torch.manual_seed(0)
    block = Block(HIDDEN)
    x = torch.randn(BATCH, HIDDEN, requires_grad=True)
    bias = torch.randn(HIDDEN)  # a tensor argument that needs no grad
    ids = torch.arange(BATCH)  # an integer tensor argument

    def fn(x, ids, tag, scale=1.0, bias=None):
        assert tag == "layer0"
        y = block(x, scale=scale, bias=bias)
        # a differentiable output, one that needs no grad, an integer one, a non-tensor
        return y, y.detach() * 2, ids * 2, "done"

    results = {}
    for mode in ("plain", "ours"):
        torch.manual_seed(7)
        call = fn if mode == "plain" else (lambda *a, **k: checkpoint(fn, *a, **k))
        y, frozen, doubled, tag = call(x, ids, "layer0", scale=0.5, bias=bias)
        assert tag == "done" and torch.equal(doubled, ids * 2) and not doubled.requires_grad
        (y.sum() + y.pow(2).mean()).backward()
        results[mode] = grads_of(x, block) + [frozen.detach()]
    assert_all_close(results["plain"], results["ours"])


def test_params_get_grads_when_no_input_needs_grad():
    blocks = make_blocks(n=2)
    x = torch.randn(BATCH, HIDDEN)  # raw data: autograd alone would skip the segment
    results = {}
    for mode in ("plain", "ours"):
        torch.manual_seed(3)
        run_stack(blocks, x, mode).sum().backward()
        results[mode] = grads_of(None, blocks)
    assert_all_close(results["plain"], results["ours"])


def test_no_grad_mode_keeps_nothing_and_errors_are_clear():
    block = make_blocks(n=1)[0]
    with torch.no_grad():
        checkpoint(block, torch.randn(4, HIDDEN, requires_grad=True))
    assert act.held_checkpoint_bytes() == 0

    x = torch.randn(4, HIDDEN, requires_grad=True)
    h = x * 1
    y = checkpoint(block, h)
    with torch.no_grad():
        h.add_(1)
    with pytest.raises(RuntimeError, match="modified in place"):
        y.sum().backward()

    y = checkpoint(block, x * 1)
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backpropagated once"):
        y.sum().backward()


def test_post_accumulate_grad_hook_fires_once_per_parameter_per_backward():
    blocks = make_blocks()
    counts = {id(p): 0 for p in blocks.parameters()}
    def count(p):
        counts[id(p)] += 1
    handles = [p.register_post_accumulate_grad_hook(count) for p in blocks.parameters()]
    x = torch.randn(BATCH, HIDDEN, requires_grad=True)
    for step in (1, 2):
        run_stack(blocks, x, "ours").sum().backward()
        assert set(counts.values()) == {step}
    for h in handles:
        h.remove()


# -- memory between forward and backward ------------------------------------


def held_between_forward_and_backward(blocks, x, mode: str) -> tuple[int, int]:
    """(bytes of tensors created in forward and still alive, ledger bytes) before backward."""
    tracker = StorageTracker()
    with tracker:
        loss = run_stack(blocks, x, mode).sum()
    gc.collect()
    held = tracker.held_bytes(exclude=[x, *blocks.parameters()])
    ledger = act.held_checkpoint_bytes()
    loss.backward()
    blocks.zero_grad(set_to_none=True)
    return held, ledger


def test_checkpointed_stack_holds_one_activation_per_block():
    blocks = make_blocks()
    x = torch.randn(BATCH, HIDDEN, requires_grad=True)
    held = {m: held_between_forward_and_backward(blocks, x, m) for m in ("plain", "ours", "torch")}
    per_block = {m: h / (BLOCKS * ACT_BYTES) for m, (h, _) in held.items()}
    print("held activations per block:", per_block)
    # Block inputs 1..7 (x is the caller's) plus a few small scalars; the ledger counts all 8.
    assert (BLOCKS - 1) * ACT_BYTES <= held["ours"][0] <= BLOCKS * ACT_BYTES
    assert held["ours"][1] == BLOCKS * ACT_BYTES
    assert held["ours"][0] <= held["torch"][0]
    assert held["plain"][0] > 4 * held["ours"][0]
    assert act.held_checkpoint_bytes() == 0  # backward gave everything back


def test_cpu_checkpointing_files_bytes_under_host():
    act.configure(cpu_checkpointing=True)
    blocks = make_blocks(n=3)
    x = torch.randn(BATCH, HIDDEN, requires_grad=True)
    _, ledger = held_between_forward_and_backward(blocks, x, "ours")
    stats = act.checkpoint_stats()
    assert ledger == 3 * ACT_BYTES and stats.peak_bytes["host"] == 3 * ACT_BYTES
    assert stats.held_bytes == {"device": 0, "host": 0}


# -- MD pool ------------------------------------------------------------------

def test_contiguous_pool_is_reused_across_steps_and_matches_grads():
    blocks = make_blocks()
    x = torch.randn(BATCH, HIDDEN, requires_grad=True)
    torch.manual_seed(11)
    run_stack(blocks, x, "ours").sum().backward()
    reference = grads_of(x, blocks)

    act.configure(contiguous_memory_optimization=True, number_checkpoints=BLOCKS)
    pool = act._DEFAULT.store.pool
    for _ in range(3):
        torch.manual_seed(11)
        run_stack(blocks, x, "ours").sum().backward()
        assert_all_close(reference, grads_of(x, blocks))
        assert pool.pool_bytes == BLOCKS * ACT_BYTES and pool.used_bytes == 0
        assert act.checkpoint_stats().pool_bytes["device"] == BLOCKS * ACT_BYTES
        if _ == 0:
            first_ptr = pool.buffer.data_ptr()
        assert pool.buffer.data_ptr() == first_ptr


def test_contiguous_pool_overflow_and_missing_size_are_clear_errors():
    with pytest.raises(ValueError, match="number_checkpoints"):
        act.configure(contiguous_memory_optimization=True)
    act.configure(contiguous_memory_optimization=True, number_checkpoints=BLOCKS // 2)
    with pytest.raises(RuntimeError, match=f"pool is full.*number_checkpoints={BLOCKS // 2}"):
        run_stack(make_blocks(), torch.randn(BATCH, HIDDEN, requires_grad=True), "ours")
    gc.collect()
    assert act.held_checkpoint_bytes() == 0 and act._DEFAULT.store.pool.used_bytes == 0


# -- configuration and estimator -----------------------------------------------

def test_configure_from_config_block_and_pa_without_group_logs_once(caplog):
    block = SimpleNamespace(partition_activations=True, cpu_checkpointing=False,
                            contiguous_memory_optimization=True, number_checkpoints=3,
                            synchronize_checkpoint_boundary=False, profile=True)
    config = act.configure_from_config(block)
    assert config == act.get_config() and config.number_checkpoints == 3 and config.mp_size == 1

    caplog.clear()
    fresh = ActivationCheckpointing()  # a new object has not said it yet
    with caplog.at_level(logging.INFO, logger="zeromem"):
        fresh.configure(ActivationPolicy(partition_activations=True))
        fresh.configure(ActivationPolicy(partition_activations=True))
        blocks = make_blocks(n=2)
        x = torch.randn(BATCH, HIDDEN, requires_grad=True)
        fresh.checkpoint(blocks[0], x).sum().backward()
    noop = [r for r in caplog.records if "model-parallel group" in r.getMessage()]
    assert len(noop) == 1

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="zeromem"):  # the default object, profile on
        checkpoint(blocks[1], x).sum().backward()
    timings = [r.getMessage() for r in caplog.records]
    assert any("forward" in m for m in timings) and any("recompute+backward" in m for m in timings)
    assert fresh.stats().peak_bytes["device"] == ACT_BYTES  # Pa did nothing: whole input kept


def test_estimator_reproduces_the_seed_example():
    assert act.estimate_checkpoint_bytes(2048, 4096) == 16 * 2**20 == 16_777_216
    assert act.estimate_checkpoint_bytes(2048, 4096, mp_size=8) == 2 * 2**20
    assert act.estimate_checkpoint_bytes(3, 5, batch=1, bytes_per_element=4, mp_size=2) == 8 * 4
