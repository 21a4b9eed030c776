"""`zeromem plan --calibrate` (planning/calibrate.py): what holds however noisy the machine.

Timing values are never asserted. What is: the collectives the step-time model
counts carry the bytes the engine's Comm really sends (stages 0-3, accumulation
included); a calibration on spawned gloo ranks yields positive figures that agree
with each other; the predictions built from it order setups as the work they
do orders them; and a call that synchronises the ranks is timed net of the
loaded rank's run-queue delay on both (load made on purpose: tests/contention.py).
How close the predictions come to measured steps is benchmarks/bench_plan.py's
question (README, "A plan beside the measured run"), since timings on a shared machine cannot be asserted.
"""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import zeromem
from gpt import GPT, GPTConfig
from contention import CAN_SHARE_A_CORE, burn, sharing_one_core
from harness import run_distributed
from zeromem.comm import Comm
from zeromem.config.schema import Config
from zeromem.planning.calibrate import Clock, calibrate, run_queue_delay
from zeromem.planning.step_model import collectives, offload_traffic
from zeromem.planning.planner import (Hardware, Setup, Workload, deepspeed_config, evaluate,
                                      layout_for, model_flops, planned_layout, predict_memory,
                                      shape_of)

SMALL = GPTConfig(n_layer=2, n_embd=128, block_size=32)
GAS = 2


def _config(stage: int) -> dict:
    # small buckets: several flat groups at stages 0-2, chunked all-gathers
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": GAS,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 60_000,
                                  "allgather_bucket_size": 30_000,
                                  "stage3_param_persistence_threshold": 20_000},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def _loaded_ranks(rank, world_size):
    """Rank r computes on a core shared with r + 1 busy processes, then the ranks meet:
    (wall, delay) of that call as `Clock` times it synchronised, and the run-queue
    delay this rank saw around it."""
    clock = Clock(Comm())

    def work() -> None:
        with sharing_one_core(rank + 1, index=rank):
            burn()
    before = run_queue_delay()
    synchronised = clock.timed(lambda: (work(), clock.comm.barrier()))
    return synchronised, run_queue_delay() - before


def _comm_bytes(rank, world_size):
    out = {}
    for stage in range(4):
        torch.manual_seed(0)
        engine = zeromem.initialize(GPT(SMALL), _config(stage))
        for _ in range(2):  # the second step's report: no first-step effects
            for _ in range(GAS):
                tokens = torch.randint(0, 256, (2, 16))
                engine.backward(engine(tokens, tokens))
                engine.step()
        out[stage] = (engine.comm_report().to_dict()["last_step"], engine.comm.buffer_bytes_peak)
        engine.close()
    return out


SWAPPED = (Setup(2, "none", "nvme"), Setup(3, "none", "nvme"), Setup(3, "none", "nvme", "nvme"))
SWAP_GAS = 3  # reads of the gradient file: 2 per step at 1 micro-step, one more for each more


def _planned(setup: Setup, nvme_path: str):
    """The planner's candidate for `setup` (SMALL, 2 ranks, accumulation SWAP_GAS) and the
    config it writes."""
    with torch.device("meta"):
        shape = shape_of(GPT(SMALL))
    work = Workload(2, 16, SWAP_GAS, "fp32")
    candidate = evaluate(shape, setup, Hardware(2, 1e12), work)
    return shape, candidate, deepspeed_config(candidate, shape, work, 2, nvme_path)


def _swap_bytes(rank, world_size, nvme_path):
    """Each NVMe setup's swap I/O in one optimizer step, as the engine counts it."""
    out = {}
    for setup in SWAPPED:
        torch.manual_seed(0)
        engine = zeromem.initialize(GPT(SMALL), _planned(setup, nvme_path)[2])
        for _ in range(2 * SWAP_GAS):  # the second step's: the first starts fresh states
            tokens = torch.randint(0, 256, (2, 16))
            engine.backward(engine(tokens, tokens))
            engine.step()
        out[setup.label()] = engine.offload.io_report()["last_step"]
        engine.close()
    return out


def _world(rank, world_size, nvme_path):
    """One spawned world for the tests below (spawning costs seconds)."""
    return {"comm": _comm_bytes(rank, world_size),
            "swap": _swap_bytes(rank, world_size, nvme_path),
            "clock": _loaded_ranks(rank, world_size) if CAN_SHARE_A_CORE else None}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return run_distributed(_world, 2, str(tmp_path_factory.mktemp("nvme")))


def test_counted_collectives_carry_the_bytes_the_engine_sends(world):
    """... and the planner's communication buffers are the engine's (chunked all-gathers:
    at stage 1 the gather's chunk buffers outweigh the reduce-scatter's receive buffer)."""
    measured = [rank["comm"] for rank in world]
    with torch.device("meta"):
        shape = shape_of(GPT(SMALL))
    n = 2
    # Comm counts what one rank sends: all-reduce 2(n-1)/n of the tensor, the others (n-1)/n
    sent = {"all_reduce": 2 * (n - 1) / n, "all_reduce_norm": 2 * (n - 1) / n,
            "reduce_scatter": (n - 1) / n, "all_gather": (n - 1) / n,
            "all_gather_forward": (n - 1) / n, "all_gather_backward": (n - 1) / n}
    for stage in range(4):
        layout = layout_for(Config.load(_config(stage), world_size=n))
        predicted = collectives(shape, layout, 4, 4, n, GAS)
        planned = predict_memory(shape, _config(stage), n, backend="gloo")
        for rank_report, buffers in (r[stage] for r in measured):
            assert buffers == planned.comm_buffers, (stage, buffers, planned.comm)
            report = {k: v for k, v in rank_report.items() if v}
            assert set(report) == set(predicted), (stage, report, predicted)
            for kind, (calls, nbytes) in predicted.items():
                assert calls >= 1
                assert report[kind] == pytest.approx(sent[kind] * nbytes, abs=1), (stage, kind)


def test_calibration_is_positive_and_self_consistent(tmp_path):
    with torch.device("meta"):
        shape = shape_of(GPT(SMALL))
    cal = calibrate(functools.partial(GPT, SMALL), shape, 2, 32, 2, str(tmp_path), reps=1)
    assert cal.world_size == 2 and cal.backend == "gloo" and cal.tokens == 64
    work = Workload(2, 32, 1, "fp32")
    assert cal.forward_s > 0 and cal.backward_s > 0
    assert cal.flops == pytest.approx(model_flops(shape, work) / (cal.forward_s + cal.backward_s))
    for link in cal.collectives.values():
        assert link.latency > 0 and link.bandwidth > 0
    assert min(cal.copy_bandwidth, cal.disk_read, cal.disk_write) > 0
    assert set(cal.optimizer) == {"device", "cpu"} and min(cal.optimizer.values()) > 0
    for overhead in (cal.overhead, cal.overhead_per_element):
        assert set(overhead) == {0, 1, 2, 3} and min(overhead.values()) >= 0
    # gloo's threads spend CPU time on a gather: some per call, more for more bytes
    assert cal.beside is not None and cal.beside.latency >= 0 and cal.beside.bandwidth > 0
    hw = Hardware(2, 1e12, calibration=cal)
    assert hw.device == "cpu"  # measured here: its memory is planned for this machine's CPU
    t = {s: evaluate(shape, s, hw, work).time
         for s in (Setup(0), Setup(2), Setup(3), Setup(2, "gpu"), Setup(2, "none", "nvme"))}
    for setup, time in t.items():
        assert time.compute > 0 and time.comm > 0 and time.optimizer > 0
        assert time.overhead == pytest.approx(len(shape.param_numels) * cal.overhead[setup.stage]
                                              + shape.psi * cal.overhead_per_element[setup.stage])
        assert time.overlapped == time.serial  # gloo: nothing overlaps
    # the compute of the measured workload is what was measured
    assert t[Setup(0)].compute == pytest.approx(cal.forward_s + cal.backward_s)
    # directions that follow from the work done, whatever the figures
    # stage 3: the same reduce-scatter plus two gathers per fetched unit, so more bytes; its
    # time need not exceed stage 2's, whose small buckets may make more (latency-bound) calls
    # than stage 3's merged fetch units (stage3/units.py)
    moved = {s: sum(b for _, b in collectives(shape, planned_layout(shape, Setup(s)), 4, 4, 2,
                                              1).values()) for s in (2, 3)}
    assert moved[3] > moved[2] and t[Setup(3)].comm > 0
    # stage 3's prefetched gathers hide behind compute, but their CPU time is counted
    free = Hardware(2, 1e12, calibration=dataclasses.replace(cal, beside=None))
    assert t[Setup(3)].comm > evaluate(shape, Setup(3), free, work).time.comm
    assert t[Setup(2)] == evaluate(shape, Setup(2), free, work).time
    assert t[Setup(2, "gpu")].compute == pytest.approx(t[Setup(2)].compute + cal.forward_s)
    assert t[Setup(0)].optimizer == pytest.approx(2 * t[Setup(2)].optimizer, rel=0.01)
    assert t[Setup(2, "none", "nvme")].offload > 0 and t[Setup(2)].offload == 0


def test_swap_traffic_the_step_time_counts_is_what_the_engine_moves(world, tmp_path):
    """The disk bytes a step of each NVMe setup is predicted from (`offload_traffic`) are
    the bytes the engine's swap I/O moves (ALIGN padding apart), accumulation included:
    optimizer states in and out, each micro-step's reduced gradient written, read back
    by the next, by the gradient norm and by the step; updated parameter shards written.
    Parameter reads at stage 3 are an upper bound: the engine's pool keeps what fits."""
    for setup in SWAPPED:
        shape, candidate, _ = _planned(setup, str(tmp_path))
        planned = offload_traffic(setup, candidate.states, 4, shape.psi / 2, SWAP_GAS)
        for rank in world:
            moved = rank["swap"][setup.label()]
            assert moved["written_bytes"] == pytest.approx(planned.written, rel=0.01), setup
            if setup.offload_param == "nvme":
                assert moved["read_bytes"] <= planned.read, setup
            else:
                assert moved["read_bytes"] == pytest.approx(planned.read, rel=0.01), setup


@pytest.mark.skipif(not CAN_SHARE_A_CORE, reason="needs per-thread schedstat and CPU affinity")
def test_a_synchronising_call_is_net_of_the_slower_ranks_delay(world):
    """The ranks wait for each other at the barrier: the call is net of the slower rank's
    run-queue delay (the largest over the ranks: about twice the other's here), on both."""
    (synced_0, own_0), (synced_1, own_1) = (rank["clock"] for rank in world)
    assert synced_0[1] == synced_1[1] > 0
    assert synced_0[1] == pytest.approx(max(own_0, own_1), rel=0.2)
    for wall, delay in (synced_0, synced_1):
        assert 0 < wall - delay < wall


def _tiny_swin() -> torch.nn.Module:
    import transformers
    config = transformers.SwinConfig(image_size=16, patch_size=4, embed_dim=8, depths=[1, 1],
                                     num_heads=[2, 2], window_size=2, num_labels=3)
    return transformers.SwinForImageClassification(config)


def test_a_vision_model_is_measured_on_images(tmp_path):
    """The calibration's forward and backward get the batch the bench and the activation trace
    give the model (`example_inputs`): images and class labels to a vision model. It fed every
    Hugging Face model `input_ids`, so a Swin's rank failed ('NoneType' has no 'shape')."""
    pytest.importorskip("transformers")
    with torch.device("meta"):
        shape = shape_of(_tiny_swin())
    cal = calibrate(_tiny_swin, shape, 2, 16, 1, str(tmp_path), reps=1)
    assert cal.forward_s > 0 and cal.backward_s > 0
