"""The calibrated step-time model (planning/calibrate.py) on hand-made figures: each
measured figure moves the part of the step it measures, and only that part."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from gpt import GPT, GPTConfig
from zeromem.planning.step_model import (Calibration, Link, comm_seconds, offload_traffic,
                                          prefetched_gathers)
from zeromem.planning.shape_memory import rank_shards
from zeromem.planning.plan_json import plan_json
from zeromem.planning.planner import (Hardware, Setup, Workload, evaluate, model_flops, plan,
                                      planned_layout, shape_of)

WORK = Workload(2, 32, 2, "fp32")


def _shape():
    with torch.device("meta"):
        return shape_of(GPT(GPTConfig(n_layer=2, n_embd=128, block_size=32)))


def _cal(**changes) -> Calibration:
    links = {k: Link(0.0, 1e9) for k in ("all_reduce", "reduce_scatter", "all_gather")}
    base = Calibration("gloo", 2, 64, 0.01, 0.02, 1e10, links, 1e10, 1e9, 1e9, "/tmp",
                       {"device": 4e-9, "cpu": 1e-9})
    return dataclasses.replace(base, **changes)


def _time(cal: Calibration, setup: Setup):
    return evaluate(_shape(), setup, Hardware(2, 1e12, calibration=cal), WORK).time


@pytest.mark.parametrize("setup", [Setup(0), Setup(1), Setup(2), Setup(3)])
def test_collective_time_follows_the_measured_bandwidth_and_latency(setup):
    fast = _time(_cal(), setup)
    slow = _time(_cal(collectives={k: Link(0.0, 5e8) for k in _cal().collectives}), setup)
    assert fast.comm > 0 and slow.comm == pytest.approx(2 * fast.comm)
    late = _time(_cal(collectives={k: Link(1e-3, 1e9) for k in _cal().collectives}), setup)
    assert late.comm > fast.comm + 1e-3  # at least one call, each paying the latency
    assert (slow.compute, slow.optimizer) == (fast.compute, fast.optimizer)


def test_compute_follows_the_measured_flops_and_checkpointing_adds_a_forward():
    base = _time(_cal(), Setup(2))
    assert base.compute == pytest.approx(WORK.gas * model_flops(_shape(), WORK) / 1e10)
    assert _time(_cal(flops=5e9), Setup(2)).compute == pytest.approx(2 * base.compute)
    ckpt = _time(_cal(), Setup(2, "gpu"))
    assert ckpt.compute == pytest.approx(base.compute + WORK.gas * 0.01 * (2 * 32) / 64)


def test_optimizer_step_runs_the_kernel_of_its_placement():
    device, cpu = _time(_cal(), Setup(2)), _time(_cal(), Setup(2, "none", "cpu"))
    assert device.optimizer == pytest.approx(4 * cpu.optimizer)
    assert _time(_cal(), Setup(0)).optimizer == pytest.approx(2 * device.optimizer, rel=0.01)


@pytest.mark.parametrize("setup", [Setup(2, "none", "nvme"), Setup(3, "none", "nvme", "nvme")])
def test_swap_time_follows_the_measured_disk(setup):
    base = _time(_cal(), setup)
    slow = _time(_cal(disk_read=5e8, disk_write=5e8), setup)
    copies = _time(_cal(disk_read=1e30, disk_write=1e30), setup).offload
    assert base.offload > copies >= 0
    assert slow.offload - copies == pytest.approx(2 * (base.offload - copies))
    assert _time(_cal(disk_read=5e8, disk_write=5e8), Setup(2, "none", "cpu")).offload == \
        _time(_cal(), Setup(2, "none", "cpu")).offload


def test_engine_overhead_is_per_parameter_and_micro_step_at_the_setup_stage():
    params, psi = len(_shape().param_numels), _shape().psi
    cal = _cal(overhead={0: 1e-5, 1: 2e-5, 2: 3e-5, 3: 4e-5})
    for stage in range(4):
        t = _time(cal, Setup(stage))
        assert t.overhead == pytest.approx(WORK.gas * params * (stage + 1) * 1e-5)
        both = _time(dataclasses.replace(cal, overhead_per_element={stage: 1e-9}), Setup(stage))
        assert both.overhead == pytest.approx(t.overhead + WORK.gas * psi * 1e-9)
        assert t.serial == pytest.approx(t.compute + t.comm + t.offload + t.optimizer + t.overhead)
        assert t.overlapped == t.serial  # gloo: nothing overlaps
    assert _time(_cal(), Setup(3)).overhead == 0  # not calibrated: not modelled


def _links(bandwidth: float = 1e9, latency: float = 1e-4) -> dict:
    return {k: Link(latency, bandwidth) for k in ("all_reduce", "reduce_scatter", "all_gather")}


def test_prefetched_stage3_gathers_hide_behind_the_compute_of_their_pass():
    """Every fetched unit's gather but the first of each pass runs while the unit before
    it computes: with compute to spare they cost nothing; with none, all of them count;
    the gradient reductions of stages 0-2 count whole either way."""
    shape, n = _shape(), 2
    layout = planned_layout(shape, Setup(3))
    units = shape.with_unit_caps(layout.unit_caps(4, n))
    forward, backward = prefetched_gathers(units, layout, 4, n, WORK.gas)
    fetched = [u for u in units.unit_numels if u >= layout.persistence_threshold]
    assert len(fetched) >= 3 and forward[0] == backward[0] == WORK.gas * (len(fetched) - 1)
    gather = _links()["all_gather"]
    whole = comm_seconds(_links(), units, layout, 4, n, WORK.gas, (0.0, 0.0))
    hidden = gather.seconds(*forward) + gather.seconds(*backward)
    assert comm_seconds(_links(), units, layout, 4, n, WORK.gas, (1.0, 1.0)) == \
        pytest.approx(whole - hidden)
    # hidden up to the pass's compute, each pass on its own
    short = gather.seconds(*forward) / 2
    assert comm_seconds(_links(), units, layout, 4, n, WORK.gas, (short, 1.0)) == \
        pytest.approx(whole - short - gather.seconds(*backward))
    # no prefetch window: nothing is gathered ahead
    off = dataclasses.replace(layout, prefetch_numel=0)
    assert comm_seconds(_links(), units, off, 4, n, WORK.gas, (1.0, 1.0)) == pytest.approx(whole)
    for stage in (0, 1, 2):
        knobs = planned_layout(shape, Setup(stage))
        assert comm_seconds(_links(), shape, knobs, 4, n, WORK.gas, (1.0, 1.0)) == \
            comm_seconds(_links(), shape, knobs, 4, n, WORK.gas, (0.0, 0.0)) > 0


def test_stage3_step_waits_only_for_the_gathers_its_compute_cannot_cover():
    slow = _time(_cal(flops=1e6, collectives=_links()), Setup(3))  # compute covers all
    fast = _time(_cal(flops=1e30, forward_s=1e-30, collectives=_links()), Setup(3))
    assert 0 < slow.comm < fast.comm
    assert _time(_cal(flops=1e6, collectives=_links()), Setup(2)).comm == \
        _time(_cal(flops=1e30, forward_s=1e-30, collectives=_links()), Setup(2)).comm


def test_a_hidden_gather_still_costs_its_ranks_cpu_time():
    """gloo: a prefetched gather the rank does not wait for still takes the worker's CPU
    time (`Calibration.beside`) from the core the rank computes on; only its hidden part
    does (the rest is waited for whole); with no such figure (NCCL) it costs nothing."""
    shape, n = _shape(), 2
    layout = planned_layout(shape, Setup(3))
    units = shape.with_unit_caps(layout.unit_caps(4, n))
    forward, backward = prefetched_gathers(units, layout, 4, n, WORK.gas)
    beside = Link(2e-5, 4e9)
    free = comm_seconds(_links(), units, layout, 4, n, WORK.gas, (1.0, 1.0))
    paid = comm_seconds(_links(), units, layout, 4, n, WORK.gas, (1.0, 1.0), beside)
    assert paid == pytest.approx(free + beside.seconds(*forward) + beside.seconds(*backward))
    # half the forward's gathers hidden: half their CPU time, the other half waited for
    gather = _links()["all_gather"]
    short = gather.seconds(*forward) / 2
    half = comm_seconds(_links(), units, layout, 4, n, WORK.gas, (short, 1.0), beside)
    assert half == pytest.approx(comm_seconds(_links(), units, layout, 4, n, WORK.gas,
                                              (short, 1.0))
                                 + beside.seconds(*forward) / 2 + beside.seconds(*backward))
    # nothing hidden (no compute, or stages 0-2): nothing to add
    assert comm_seconds(_links(), units, layout, 4, n, WORK.gas, (0.0, 0.0), beside) == \
        comm_seconds(_links(), units, layout, 4, n, WORK.gas, (0.0, 0.0))
    knobs = planned_layout(shape, Setup(2))
    assert comm_seconds(_links(), shape, knobs, 4, n, WORK.gas, (1.0, 1.0), beside) == \
        comm_seconds(_links(), shape, knobs, 4, n, WORK.gas, (1.0, 1.0))
    # the planner's stage-3 step carries it (compute covers every gather here)
    slow = _cal(flops=1e6, collectives=_links())
    with_cpu = _time(dataclasses.replace(slow, beside=beside), Setup(3))
    assert with_cpu.comm == pytest.approx(_time(slow, Setup(3)).comm + beside.seconds(*forward)
                                          + beside.seconds(*backward))
    assert _time(dataclasses.replace(slow, beside=beside), Setup(2)) == _time(slow, Setup(2))


def _samples(worker_cpu: tuple[float, float]) -> list[dict]:
    """One made-up `Probe.sample()`: every figure 1 ms (links: 1 ms and 2 ms), and the CPU
    time gloo's threads spend on the small and large all-gather."""
    out = {k: 1e-3 for k in ("forward", "forward_backward", "copy", "optimizer_device",
                             "optimizer_cpu", "disk_write", "disk_read")}
    out.update({k: (1e-3, 2e-3) for k in ("all_reduce", "reduce_scatter", "all_gather")})
    out.update({f"{name}_{stage}": 1e-3 for name in ("params", "elements")
                for stage in ("none", 0, 1, 2, 3)})
    return [{**out, "all_gather_cpu": worker_cpu}]


def test_the_cpu_time_of_a_gather_is_fitted_to_its_two_messages_on_gloo_only():
    from zeromem.planning.calibrate import from_samples, measurement
    what = measurement(GPT, _shape(), 2, 32, 2)
    small, large = what.link_sizes(2)
    cal = from_samples([_samples((1e-4, 5e-4))] * 2, what, _shape())
    bandwidth = 4 * (large - small) / 4e-4
    assert cal.beside == Link(pytest.approx(1e-4 - 4 * small / bandwidth), pytest.approx(bandwidth))
    assert cal.beside.seconds(1, 4 * large) == pytest.approx(5e-4)
    # the slower rank's, like every figure
    assert from_samples([_samples((1e-4, 5e-4)), _samples((1e-4, 9e-4))], what,
                        _shape()).beside.seconds(1, 4 * large) == pytest.approx(9e-4)
    assert from_samples([_samples((1e-4, 5e-4))] * 2, what, _shape(), "nccl").beside is None


def test_host_copies_on_a_cpu_device_are_only_those_the_engine_makes():
    """With the CPU as the device (a `calibrate` run) the engine gathers stage 3 from the
    host shard itself (offload/params.ParamsOnHost) and steps an fp32 gradient shard where
    it was reduced (offload/masters.HostGrads): only the updated parameters are copied back.
    For a GPU every copy counts; a bf16 gradient is copied into an fp32 host buffer anyway."""
    shape, n = _shape(), 2
    shard = shape.psi / n
    both = Setup(3, "none", "cpu", "cpu")
    states = evaluate(shape, both, Hardware(n, 1e12), WORK).states
    gas = WORK.gas
    assert offload_traffic(both, states, 4, shard, gas, device_is_host=True).copies == 4 * shard
    assert offload_traffic(both, states, 4, shard, gas).copies == (8 + 2 * gas * 4) * shard
    assert offload_traffic(both, states, 2, shard, gas, device_is_host=True).copies == 6 * shard
    assert offload_traffic(Setup(2, "none", "cpu"), states, 4, shard, gas,
                           device_is_host=True).copies == 4 * shard
    # a calibration measured the CPU as the device; one for a GPU would count them all
    assert _time(_cal(), both).offload == pytest.approx(4 * shard / 1e10)
    assert _time(_cal(device="cuda"), both).offload == pytest.approx((8 + 2 * gas * 4) * shard / 1e10)


def test_a_plan_for_a_cpu_device_holds_an_fp32_gradient_once():
    """A calibration on this machine's CPU plans for it: the fp32 reduced gradient shard is
    the host gradient (offload/masters.HostGrads), held once, where a GPU holds a device
    and a host copy; a bf16 one is copied on either. The plan says which device it is for."""
    shape, n = _shape(), 2
    setup = Setup(2, "none", "cpu")
    for dtype, shared in (("fp32", True), ("bf16", False)):
        work = dataclasses.replace(WORK, dtype=dtype)
        on_cpu = evaluate(shape, setup, Hardware(n, 1e12, calibration=_cal()), work)
        on_gpu = evaluate(shape, setup, Hardware(n, 1e12), work)
        grads = on_gpu.states.device["grads"]
        assert on_cpu.host_bytes == on_gpu.host_bytes  # the host gradient, on either
        assert on_cpu.states.model_state_bytes == on_gpu.states.model_state_bytes - grads * shared
        if shared:
            assert on_cpu.states.host["host_grads"] == grads == 4 * sum(rank_shards(
                shape, n, on_cpu.layout))
    cuda = evaluate(shape, setup, Hardware(n, 1e12, calibration=_cal(device="cuda")), WORK)
    assert cuda.states.device["grads"] > 0  # a calibration on a GPU plans for the GPU
    for hw, device in ((Hardware(n, 1e12), "cuda"), (Hardware(n, 1e12, calibration=_cal()), "cpu")):
        p = plan(shape, hw, WORK)
        assert plan_json(p)["memory_for"] == device
        assert ("memory    planned for this machine's CPU" in str(p)) == (device == "cpu")
