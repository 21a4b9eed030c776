"""Resuming DeepSpeed's own ZeRO checkpoints: the run continues DeepSpeed's loss curve.

The checkpoints under tests/data/deepspeed_checkpoints were saved by real DeepSpeed
(stages 1-3, 1 and 2 ranks, fp32, bf16 and fp16, two with exclude_frozen_parameters=True;
tools/make_deepspeed_checkpoints.py), with the losses DeepSpeed's run had on every
micro-batch after the save. Each is loaded by `engine.load_checkpoint` at 1 and 2 ranks
and stages 1, 2 and 3, trained on the same micro-batches, and its losses compared with
DeepSpeed's on every rank. Two cases trained HF Trainer's two param groups (weights
decayed, biases not; split by stage 3 into three sub-groups), and one saved
Megatron-DeepSpeed's client state, which must come back. Each case is resumed twice:
from the checkpoint, and from the universal checkpoint DeepSpeed's `ds_to_universal` made
of it, beside it (`checkpoint.load_universal`, as Megatron-DeepSpeed's
`--universal-checkpoint` sets).

fp16 cases also check the dynamic loss scaler: right after the load it is DeepSpeed's
saved state, and each following step runs with DeepSpeed's loss scale and lr and is
skipped on overflow exactly when DeepSpeed's was. Cases saved without frozen parameters
are loaded into a model whose frozen layer holds DeepSpeed's (untrained) values and
whose trained parameters do not: the load must set those and keep the frozen ones.

Tolerances: fp32 1e-5 (measured: at most 5e-7, the order of summation across ranks);
bf16 2e-2 (measured: up to 8e-3 on losses near 2.6; zeromem and DeepSpeed round the
bf16 gradients' reductions differently across ranks and stages); fp16 2e-3 (measured:
at most 4.6e-4; the fp16 model and loss-scaled gradients round likewise).
"""
from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import pytest
import torch

import zeromem
from harness import run_distributed
from models import TinyLM, client_optimizer
from zeromem.checkpoints.tensor_files import CheckpointError
from setups import (DEEPSPEED_CHECKPOINTS, deepspeed_case, deepspeed_curve, deepspeed_engine,
                    deepspeed_param_groups, deepspeed_resume_config, deepspeed_scaler)

CASES = sorted(p.name for p in DEEPSPEED_CHECKPOINTS.iterdir() if (p / "expected.json").is_file())
TOLERANCE = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 2e-3}


def bad_directories(tmp: Path) -> dict[str, str]:
    """{directory: the error it must give}: a damaged DeepSpeed checkpoint, a foreign directory."""
    src, _ = deepspeed_case("stage2_ws2_fp32")
    damaged = tmp / "damaged"
    shutil.copytree(src, damaged)
    (damaged / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    (damaged / "global_step3_universal" / "zero" / "fc2.weight" / "exp_avg.pt").unlink()
    (damaged / "latest_universal").unlink()  # the directory names the damaged ZeRO checkpoint
    src, _ = deepspeed_case("stage3_ws2_fp32_nvme")  # ZeRO-Infinity's swap files, truncated
    truncated = tmp / "truncated"
    shutil.copytree(src, truncated)
    swap = truncated / "global_step3" / "offloaded_tensors" / "rank00" / "exp_avg-0_5.tensor.swp"
    swap.write_bytes(swap.read_bytes()[:1000])
    foreign = tmp / "foreign"
    foreign.mkdir()
    (foreign / "pytorch_model.bin").write_bytes(b"")
    return {str(damaged): r"lacks the optimizer states of rank\(s\) \[1\]",
            str(damaged / "global_step3_universal"): r"fc2.weight holds the states "
                                                     r"\['exp_avg_sq', 'master'\]",
            str(truncated): r"rank00/exp_avg-0_5.tensor.swp holds 1000 bytes",
            str(foreign): "neither a zeromem checkpoint .* nor a DeepSpeed one.*pytorch_model.bin "
                          "looks like a weights file"}


def refuse(engine, bad: dict[str, str]) -> None:
    """Each bad directory raises its error on every rank and leaves the engine as it was."""
    before = [p.detach().clone() for p in engine.module.parameters()]
    steps = engine.global_steps
    for path, message in bad.items():
        with pytest.raises(CheckpointError, match=message):
            engine.load_checkpoint(path)
    assert all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
    assert engine.global_steps == steps


def resume_all(rank: int, world_size: int, bad: dict[str, str]) -> list[tuple[str, int, float]]:
    """(case, stage, worst loss difference) of every case resumed at every stage, from the
    checkpoint and from its universal form; then the bad directories are refused."""
    results = []
    for name, universal, stage in itertools.product(CASES, (False, True), (0, 1, 2, 3)):
        path, expected = deepspeed_case(name)
        # ds_to_universal converts ZeRO checkpoints (stages 1-3) of Adam only; zeromem's
        # stage 0 resumes DeepSpeed's stage 0 only, to keep this short
        if universal and not (path / "latest_universal").is_file() \
                or stage == 0 and expected["stage"] > 0:
            continue
        gas = expected["micro_batches_per_step"] // world_size
        config = deepspeed_resume_config(expected, stage, world_size)
        config["checkpoint"] = {"load_universal": universal}
        built = model(expected, rank)
        groups = deepspeed_param_groups(built, expected)
        if expected.get("client_optimizer"):  # the script's own SGD and LambdaLR, as DeepSpeed's run
            optimizer, schedule = client_optimizer(groups)
            engine = zeromem.initialize(built, config, optimizer=optimizer, lr_scheduler=schedule)
        else:
            engine = zeromem.initialize(built, config, model_parameters=groups)
        loaded, client_state = engine.load_checkpoint(path)
        tag = "global_step3_universal" if universal else "global_step3"
        assert loaded == str(path / tag)
        # DeepSpeed's client state, the caller's (Megatron-DeepSpeed's here) among it
        assert client_state["ds_version"] == expected["deepspeed_version"]
        for key, want in expected.get("client_state", {}).items():
            owner, _, attribute = key.partition(".")
            got = client_state[owner]
            assert (getattr(got, attribute) if attribute else got) == want, key
        assert engine.global_steps == expected["save_at"]
        first_lr = expected["lrs"][0] if "lrs" in expected else 1e-3 + 0.4 * 9e-3
        # DeepSpeed's WarmupLR at last_batch_iteration 2 gives its next step min + 2/5 (max - min)
        assert engine.get_lr() == pytest.approx([first_lr] * len(engine.optimizer.param_groups))
        if "scaler" in expected:
            assert engine.scaler.state_dict() == deepspeed_scaler(expected)
        trace: list = []
        curve = deepspeed_curve(engine, rank, world_size, expected, trace)
        if "loss_scales" in expected:
            assert trace == [(scale, pytest.approx(lr), skipped) for scale, lr, skipped in zip(
                expected["loss_scales"], expected["lrs"], expected["skipped"])], (name, stage)
        mine = [want[rank * gas:(rank + 1) * gas] for want in expected["losses"]]
        if expected.get("unscaled_fp16"):  # DeepSpeed's steps after the first are unscaled
            curve, mine = curve[:1], mine[:1]  # (tools/make_deepspeed_checkpoints.py)
        worst = max(abs(a - b) for got, want in zip(curve, mine) for a, b in zip(got, want))
        results.append((f"{name}{' (universal)' if universal else ''}", stage, worst))
        assert worst <= TOLERANCE[expected["precision"]], (name, stage, rank, curve, mine)
        assert engine.global_steps == expected["save_at"] + len(expected["losses"])
    refuse(engine, bad)
    resume_through_deepspeeds_api(Path(next(iter(bad))).parent, rank, world_size)
    return results


def resume_through_deepspeeds_api(tmp: Path, rank: int, world_size: int) -> None:
    """DeepSpeed's `load_checkpoint` answers (None, None) for a directory with nothing to
    resume; one whose only pointer is `latest_universal` has a checkpoint to resume."""
    import zeromem.deepspeed as deepspeed

    path, expected = deepspeed_case("stage2_ws2_fp32")
    only_universal = tmp / "only_universal"
    if rank == 0 and not only_universal.exists():
        shutil.copytree(path, only_universal, ignore=shutil.ignore_patterns("latest"))
    deepspeed.comm.barrier()
    config = deepspeed_resume_config(expected, 2, world_size)
    engine, *_ = deepspeed.initialize(model=model(expected, rank), config=config)
    loaded, client_state = engine.load_checkpoint(str(only_universal))
    assert loaded == str(only_universal / "global_step3_universal")
    assert client_state["ds_version"] == expected["deepspeed_version"]
    assert engine.global_steps == expected["save_at"]


def model(expected: dict, rank: int) -> TinyLM:
    """TinyLM with weights unlike DeepSpeed's (the checkpoint must set them), except the frozen
    layer when the checkpoint left it out: then DeepSpeed's initial values, which it kept.
    Its tied embedding frozen too where DeepSpeed's run froze it (a LoRA run's base)."""
    torch.manual_seed(1 + rank)
    hidden = expected.get("hidden", 7)  # the NVMe case's is wider (swapped sub-groups)
    built = TinyLM(hidden=hidden)
    if expected.get("frozen_tied"):
        built.embed.requires_grad_(False)
    if expected.get("exclude_frozen_parameters"):
        torch.manual_seed(0)  # as tools/make_deepspeed_checkpoints.py built DeepSpeed's model
        initial = TinyLM(hidden=hidden)
        built.frozen.load_state_dict(initial.frozen.state_dict())
        if expected.get("frozen_tied"):  # left out too, and its tied head's key with it
            built.embed.load_state_dict(initial.embed.state_dict())
    return built


def test_deepspeed_checkpoints_cover_stages_and_precisions():
    cases = [deepspeed_case(name)[1] for name in CASES]
    assert {c["stage"] for c in cases} == {0, 1, 2, 3}
    # stage 0 (DeepSpeed's default) in fp32 (torch's optimizer) and in 16 bits (DeepSpeed's
    # FP16_Optimizer, its masters one tensor per parameter or, with its fused Adam, flat)
    stage0 = [c for c in cases if c["stage"] == 0]
    assert {c["precision"] for c in stage0} == {"fp32", "bf16", "fp16"}
    assert any("torch_adam" not in c["config"]["optimizer"]["params"] for c in stage0)
    assert {c["world_size"] for c in cases} == {1, 2}
    assert {c["precision"] for c in cases} == {"fp32", "bf16", "fp16"}
    assert {c["stage"] for c in cases if c.get("exclude_frozen_parameters")} == {1, 3}
    # a LoRA run's frozen base, its embedding tied to the head: refused as damaged until stop 51;
    # saved without its frozen parameters (HF's Trainer does so for PEFT): until stop 52
    assert {c["stage"] for c in cases if c.get("frozen_tied")} == {2, 3}
    assert any(c.get("frozen_tied") and c["exclude_frozen_parameters"] for c in cases)
    # DeepSpeed's own FusedAdam (a config without torch_adam), whose param groups keep a
    # step and bias_correction: its checkpoints failed to load until stop 42
    assert any("torch_adam" not in c["config"]["optimizer"]["params"] for c in cases)
    assert any("client_state" in c for c in cases)  # Megatron-DeepSpeed's
    # the script's own optimizer and schedule (no optimizer block, as HF's Trainer runs
    # without one): taken for Adam, and its schedule dropped, until stop 52
    assert {c["stage"] for c in cases if c.get("client_optimizer")} == {0, 2, 3}
    # ZeRO-Infinity (NVMe offload): a sub-group's partition and states only in DeepSpeed's
    # swap files (offloaded_tensors/), refused as damaged until stop 53
    nvme = [name for name in CASES if "nvme" in
            deepspeed_case(name)[1]["config"]["zero_optimization"].get("offload_optimizer", {})
            .get("device", "")]
    swapped = {name: len(list((deepspeed_case(name)[0] / "global_step3" / "offloaded_tensors"
                               / "rank01").glob("[0-9]*.tensor.swp"))) for name in nvme}
    # DeepSpeed's own threshold (1 MiB a rank: one sub-group), and two sub-groups swapped
    # past a lowered one (their order matters), in fp32 and in bf16
    assert sorted(swapped.values()) == [1, 2], swapped
    assert {deepspeed_case(name)[1]["precision"] for name in nvme} == {"fp32", "bf16"}
    fp16 = [c for c in cases if c["precision"] == "fp16" and c["stage"] > 0]
    # the saved scaler is mid-hysteresis, and the steps after the save skip, halve and keep
    assert all(c["scaler"]["cur_hysteresis"] == 1 and any(c["skipped"]) for c in fp16)
    assert all(len(set(c["loss_scales"])) > 1 for c in fp16)


def test_frozen_parameters_left_out_by_deepspeed():
    """DeepSpeed's exclude_frozen_parameters checkpoints lack the frozen layer."""
    from zeromem.checkpoints.deepspeed_import import read_deepspeed
    for name in CASES:
        path, expected = deepspeed_case(name)
        keys = read_deepspeed(path, engine=deepspeed_engine(expected)).state_dict_keys
        excluded = bool(expected.get("exclude_frozen_parameters"))
        assert ("frozen.weight" in keys) != excluded, name
        if expected.get("frozen_tied"):  # the tied head goes with the embedding it names
            assert ("head.weight" in keys) == ("embed.weight" in keys) != excluded, name


def test_resume_deepspeed_checkpoint_one_rank(tmp_path):
    for name, stage, worst in resume_all(0, 1, bad_directories(tmp_path)):
        print(f"1 rank, {name} -> stage {stage}: max |loss - DeepSpeed's| = {worst:.1e}")


def test_resume_deepspeed_checkpoint_two_ranks(tmp_path):
    for rank_results in run_distributed(resume_all, 2, bad_directories(tmp_path)):
        for name, stage, worst in rank_results:
            print(f"2 ranks, {name} -> stage {stage}: max |loss - DeepSpeed's| = {worst:.1e}")


def test_stage_0_states_follow_the_order_the_engine_was_given():
    """A stage-0 checkpoint numbers its optimizer states by the order the run gave them:
    an engine given them in another order refuses it, naming the parameter, and is left
    as it was, unless it reads no optimizer state (a warm start: the module's weights);
    given `model.parameters()`, frozen ones too, it loads a 16-bit checkpoint
    (DeepSpeed's FP16_Optimizer keeps the trained ones) but not an fp32 one (torch's
    optimizer numbered the frozen ones too)."""
    def engine(name: str, params) -> tuple:
        path, expected = deepspeed_case(name)
        built = model(expected, 0)
        return zeromem.initialize(built, deepspeed_resume_config(expected, 0, 1),
                                  model_parameters=params(built)), path

    reversed_order, path = engine("stage0_ws2_bf16", lambda m: list(m.parameters())[::-1])
    before = [p.detach().clone() for p in reversed_order.module.parameters()]
    with pytest.raises(CheckpointError, match=r"the master at 'sometimes.bias''s position has "
                                              r"shape \[13, 10\], where .*another order"):
        reversed_order.load_checkpoint(path)
    assert all(torch.equal(a, b) for a, b in zip(before, reversed_order.module.parameters()))
    assert reversed_order.global_steps == 0
    # a warm start reads no optimizer state: the weights load whatever the order
    reversed_order.load_checkpoint(path, load_optimizer_states=False,
                                   load_lr_scheduler_states=False)
    saved = torch.load(path / "global_step3" / "mp_rank_00_model_states.pt",
                       weights_only=True)["module"]
    loaded = reversed_order.module.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in saved.items()), "weights"
    everything, path = engine("stage0_ws2_bf16", lambda m: m.parameters())
    everything.load_checkpoint(path)
    assert everything.global_steps == 3
    everything, path = engine("stage0_ws2_fp32", lambda m: m.parameters())
    with pytest.raises(CheckpointError, match=r"param groups hold \[7\] parameters, but the "
                                              r"param groups this engine was given hold \[9\]"):
        everything.load_checkpoint(path)
