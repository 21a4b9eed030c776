"""`zeromem.deepspeed`: DeepSpeed's getters, keyword arguments and submodules (issue 13).

One spawned world of 2 gloo ranks runs every case; the example scripts themselves
are in test_deepspeed_examples.py.
"""
from __future__ import annotations

import argparse
import json
import os
import types
import warnings

import pytest
import torch
from torch import nn

from harness import run_distributed
from models import SparseExperts


def _cfg(stage: int, gas: int = 1, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0, "gradient_accumulation_steps": gas,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.5}},
            "zero_optimization": {"stage": stage}, **extra}


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


def _train(engine, steps: int, scale_wrt_gas: bool = True) -> None:
    gas = engine.gradient_accumulation_steps()
    for i in range(steps):
        torch.manual_seed(100 + i)
        x = torch.randn(2, 4)
        loss = engine(x).square().mean()
        engine.backward(loss if scale_wrt_gas else loss / gas, scale_wrt_gas=scale_wrt_gas)
        engine.step()


def _getters_and_module(deepspeed, rank, world_size, tmp) -> None:
    path = os.path.join(tmp, "ds.json")
    if rank == 0:
        with open(path, "w") as f:
            json.dump(_cfg(1, gas=2), f)
    deepspeed.comm.barrier()
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", path])
    data = torch.utils.data.TensorDataset(torch.arange(16.0).view(8, 2))
    net = _net()
    net.vocab_size = 11
    engine, opt, loader, sched = deepspeed.initialize(args=args, model=net, training_data=data)
    assert isinstance(engine, nn.Module) and opt is engine.optimizer and sched is None
    assert list(engine.state_dict()) == ["module.0.weight", "module.0.bias", "module.2.weight",
                                         "module.2.bias"]
    assert engine.vocab_size == 11  # attribute access reaches the model
    assert (engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps(),
            engine.train_batch_size()) == (2, 2, 4 * world_size)
    assert (engine.zero_optimization_stage(), engine.fp16_enabled(),
            engine.bfloat16_enabled()) == (1, False, False)
    assert (engine.global_rank, engine.world_size, engine.local_rank) == (rank, world_size, rank)
    assert engine.get_mom() == [0.5]
    assert (engine.optimizer_name(), engine.wall_clock_breakdown(), opt.cur_scale) == ("sgd", False, 1.0)
    seen = [int(v) for (batch,) in loader for v in batch[:, 0] // 2]
    assert len(seen) == 8 // world_size and len(set(seen)) == len(seen)
    everyone = [None] * world_size
    torch.distributed.all_gather_object(everyone, seen)
    assert sorted(sum(everyone, [])) == list(range(8))  # DistributedSampler: disjoint shares
    engine.eval()
    assert not engine.module.training and not engine.training
    engine.train()
    assert engine.to("cpu") is engine
    with pytest.raises(NotImplementedError):
        engine.to(torch.float16)
    with engine.no_sync():
        pass
    applied = []
    for _ in range(4):
        _train(engine, 1)
        applied.append(engine.was_step_applied())
    assert applied == [False, True, False, True]
    assert engine.global_steps == 2 and engine.global_samples == 2 * engine.train_batch_size()
    timer = engine.tput_timer  # DeepSpeed-Chat calls update_epoch_count() after each epoch
    assert (timer.global_step_count, timer.micro_step_count) == (2, 4)
    assert timer.avg_samples_per_sec() == float("-inf")  # the first 2 steps are warm-up
    timer.update_epoch_count()
    engine.eval()
    engine(torch.ones(2, 4))  # evaluation is not timed
    engine.train()
    _train(engine, 2)
    assert (timer.epoch_count, timer.global_step_count, timer.micro_step_count) == (1, 3, 2)
    assert 0 < timer.avg_samples_per_sec() < float("inf")
    with pytest.raises(ValueError, match="twice"):
        deepspeed.initialize(args=args, model=_net(), config=_cfg(1))
    engine.destroy()


def _keywords(deepspeed, rank, world_size, tmp) -> None:
    a, *_ = deepspeed.initialize(model=_net(), config=_cfg(2, gas=2))
    b, *_ = deepspeed.initialize(model=_net(), config_params=_cfg(2, gas=2))
    _train(a, 4)
    _train(b, 4, scale_wrt_gas=False)  # loss / gas by hand, not by the engine
    for pa, pb in zip(a.module.parameters(), b.module.parameters()):
        torch.testing.assert_close(pa, pb)
    with pytest.raises(AssertionError, match="no_sync"):
        with a.no_sync():
            pass
    loss = a(torch.ones(2, 4)).sum()
    a.backward(loss, retain_graph=True)
    a.backward(loss)  # the graph was kept
    a.step()

    seen = []

    class Recorder:
        def __init__(self, optimizer):
            self.optimizer = optimizer

        def step(self, **kwargs):
            seen.append(kwargs)

    c, _, _, sched = deepspeed.initialize(model=_net(), config=_cfg(0),
                                          lr_scheduler=lambda o: Recorder(o))
    assert isinstance(sched, Recorder)
    loss = c(torch.ones(2, 4)).sum()
    c.backward(loss)
    c.step(lr_kwargs={"increment": 3})
    assert seen == [{"increment": 3}]

    net = _net()
    d, opt, *_ = deepspeed.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.25),
                                      config={"train_batch_size": 2 * world_size,
                                              "zero_optimization": {"stage": 3,
                                                "stage3_gather_16bit_weights_on_model_save": True}})
    assert opt.param_groups[0]["lr"] == 0.25 and opt is d.optimizer
    _train(d, 2)
    ckpt = os.path.join(tmp, "ckpt")
    assert d.save_checkpoint(ckpt, client_state={"k": 1}, save_latest=True,
                             exclude_frozen_parameters=False)
    weights = [p.detach().clone() for p in d.module.parameters()]
    _train(d, 1)
    torch.manual_seed(rank)  # the generators this run draws from next, which the load keeps
    path, client = d.load_checkpoint(ckpt, load_module_strict=True, load_module_only=True)
    assert client == {"k": 1} and path
    # a warm start, as DeepSpeed's: the weights only; this run's step counts and generators
    assert d.global_steps == 3 and d.global_samples == 3 * 2 * world_size
    drawn = torch.rand(3)
    torch.manual_seed(rank)
    assert torch.equal(drawn, torch.rand(3))
    with deepspeed.zero.GatheredParameters(list(d.module.parameters())):
        for p, w in zip(d.module.parameters(), weights):
            torch.testing.assert_close(p, w) if p.numel() == w.numel() else None
    assert d.save_16bit_model(tmp, save_filename="m16.bin")
    if rank == 0:
        assert sorted(torch.load(os.path.join(tmp, "m16.bin"))) == sorted(net.state_dict())

    # no optimizer anywhere: an engine that evaluates only (ZeRO-3 inference), and no optimizer
    config = {"train_batch_size": 2 * world_size, "zero_optimization": {"stage": 3}}
    e, opt, *_ = deepspeed.initialize(model=_net(), config=config)
    assert opt is None
    with torch.no_grad():
        e(torch.ones(2, 4))


def _submodules(deepspeed, rank, world_size, tmp) -> None:
    from zeromem.deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    assert acc.device_name() == "cpu" and acc.device_name(1) == "cpu"
    assert acc.device_count() >= 1 and acc.is_bf16_supported() and acc.is_available()
    acc.synchronize()
    acc.set_device(rank)
    assert acc.communication_backend_name() == "gloo"
    comm = deepspeed.comm
    assert (comm.get_rank(), comm.get_world_size(), comm.get_local_rank()) == (rank, world_size, rank)
    t = torch.ones(1)
    comm.all_reduce(t)
    assert t.item() == world_size
    assert comm.broadcast_object(f"r{rank}") == "r0"
    comm.barrier()
    cfg = _cfg(3)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        net = _net()
    assert net[0].weight.numel() == 0  # partitioned at construction
    status = deepspeed.zero.ZeroParamStatus
    w = net[0].weight  # DeepSpeed's names from Init on (PEFT sizes its adapters by ds_shape)
    assert (w.ds_shape, w.ds_numel, w.ds_status) == ((8, 4), 32, status.NOT_AVAILABLE)
    with deepspeed.zero.GatheredParameters(net[0].weight):
        assert net[0].weight.shape == (8, 4) and w.ds_status == status.AVAILABLE
    assert w.ds_status == status.NOT_AVAILABLE and w.numel() == 0
    engine, *_ = deepspeed.initialize(model=net, config=cfg)
    with deepspeed.zero.GatheredParameters(engine.module[2].weight, modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                engine.module[2].weight.fill_(0.5)
    with deepspeed.zero.GatheredParameters(engine.module[2].weight):
        assert bool((engine.module[2].weight == 0.5).all())
    # DeepSpeed-Chat's and OpenRLHF's savers gather the parameters that carry `ds_id` and
    # copy the rest as they are: every stage-3 parameter must say it is partitioned
    engine, *_ = deepspeed.initialize(model=_net(), config=_cfg(3, zero_optimization={
        "stage": 3, "stage3_param_persistence_threshold": 0}))  # every parameter sharded
    saved, full = {}, engine.engine.full_state_dict()
    for name, p in engine.module.named_parameters():
        assert hasattr(p, "ds_id") and p.ds_status == status.NOT_AVAILABLE and p.numel() == 0
        with deepspeed.zero.GatheredParameters([p]):
            assert p.ds_status == status.AVAILABLE and p.shape == p.ds_shape
            # DeepSpeed-Chat's save_zero_three_model: `.cpu()` on a CPU is `p.data` itself,
            # and it must keep its values once the block has ended, as DeepSpeed's do
            saved[name] = p.data.cpu()
    assert len(saved) == 4 and all(v.numel() == p.ds_numel for v, p in
                                   zip(saved.values(), engine.module.parameters()))
    for name, value in full.items():  # rank 0's full state dict, from the masters
        torch.testing.assert_close(saved[name], value, rtol=0, atol=0)
    assert deepspeed.checkpointing.checkpoint is not None
    groups = deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer(
        {"params": list(net.parameters())})
    assert len(groups) == 1


def _client_optimizers(deepspeed, rank, world_size, tmp) -> None:
    """Optimizers built before `initialize`, as DeepSpeed-Chat and HF's Trainer build them:
    two param groups (decay and none), a scheduler made over the optimizer first. At stage 3
    (every parameter sharded) the engine steps them over its masters, the scheduler still
    sets their lr, and every rank ends as one process does with the same objects; also
    with the optimizer and parameters on NVMe (its optimizer reads the groups' lr there)."""
    from zeromem.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    nvme = {"device": "nvme", "nvme_path": os.path.join(tmp, "nvme")}
    os.makedirs(nvme["nvme_path"], exist_ok=True)
    offloaded = json.loads(json.dumps(config))
    offloaded["zero_optimization"].update(offload_optimizer=nvme, offload_param=nvme)
    for make, config in (
            (lambda g: torch.optim.AdamW(g, lr=0.1), config),
            (lambda g: FusedAdam(g, lr=0.1), config),
            (lambda g: DeepSpeedCPUAdam(g, lr=0.1, adamw_mode=False), config),
            (lambda g: DeepSpeedCPUAdam(g, lr=0.1), offloaded)):
        trained = []
        for engine_steps in (False, True):
            net = _net()
            groups = [{"params": [p for p in net.parameters() if p.dim() > 1], "weight_decay": 0.1},
                      {"params": [p for p in net.parameters() if p.dim() == 1], "weight_decay": 0.0}]
            opt = make(groups)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
            if engine_steps:
                engine, returned, _, _ = deepspeed.initialize(model=net, optimizer=opt,
                                                              lr_scheduler=sched, config=config)
                with warnings.catch_warnings():  # torch's "scheduler before optimizer" check
                    warnings.simplefilter("error")
                    _train(engine, 3)  # the engine steps the scheduler after each update
                assert engine.get_lr() == [0.1 * 0.5 ** 3] * 2
                if config is not offloaded:  # there, an optimizer whose states live on disk
                    assert type(engine.engine.optimizer) is type(opt)  # the client's kind steps
                    masters = [p for g in returned.param_groups for p in g["params"]]
                    assert masters and all(returned.state[p] for p in masters)  # checkpointed
                with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
                    trained.append([p.detach().clone() for p in engine.module.parameters()])
            else:
                for i in range(3):  # `_train`'s batches: the same on every rank
                    torch.manual_seed(100 + i)
                    net(torch.randn(2, 4)).square().mean().backward()
                    opt.step()
                    opt.zero_grad()
                    sched.step()
                trained.append([p.detach().clone() for p in net.parameters()])
        for got, want in zip(trained[1], trained[0]):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def _auto_sizes(deepspeed, rank, world_size, tmp) -> None:
    """HF's configs leave the hidden-size sizes "auto"; a model passed to `initialize` before
    HF's Trainer fills them (TRL's reference models) has them read from its
    `config.hidden_size` (the largest of `hidden_sizes`), as HF fills them; a model without
    one gets zeromem's sizes, as DeepSpeed gives its own."""
    auto = {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto"}
    for config, want in ((types.SimpleNamespace(hidden_size=8), 8),
                         (types.SimpleNamespace(hidden_sizes=[4, 12, 8]), 12)):
        net = _net()
        net.config = config
        engine, *_ = deepspeed.initialize(model=net, config=_cfg(3, zero_optimization=auto))
        zero = engine.engine.config.zero_optimization
        assert (zero.reduce_bucket_size, zero.stage3_prefetch_bucket_size,
                zero.stage3_param_persistence_threshold) == (want * want, int(0.9 * want * want),
                                                             10 * want)
    # a model that names no hidden size: zeromem's own sizes, as DeepSpeed takes its own
    engine, *_ = deepspeed.initialize(model=_net(), config=_cfg(3, zero_optimization=auto))
    assert not engine.engine.config.zero_optimization.model_fields_set & set(auto) - {"stage"}


def _beside_one_process(engine, plain: nn.Module, rank: int, batches, steps: int = 2) -> None:
    """Train `engine` on rank r's batch r of `batches()` and `plain` (SGD as `_cfg`'s) on
    their mean, `steps` times; then the engine's full weights are `plain`'s (rank 0)."""
    opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.5)
    for step in range(steps):
        torch.manual_seed(50 + step)
        xs = batches()
        engine.backward(engine(xs[rank]).square().mean())
        engine.step()
        sum(plain(x).square().mean() for x in xs).div(len(xs)).backward()
        opt.step()
        opt.zero_grad()
    full = engine.engine.full_state_dict()
    if rank == 0:
        for key, value in plain.state_dict().items():
            torch.testing.assert_close(full[key], value, rtol=0, atol=1e-6, msg=key)


class _WeightNormed(nn.Module):
    """HF's wav2vec2 / HuBERT positional convolution under ZeRO-3: its constructor, run
    inside `zero.Init`, gathers the convolution's weight to re-parametrize it
    (`weight_norm`: two new parameters replace the weight) and registers them as external."""

    def __init__(self, deepspeed=None):
        super().__init__()
        self.conv = nn.Conv1d(4, 4, kernel_size=3, padding=1, groups=2)
        weight_norm = nn.utils.parametrizations.weight_norm
        if deepspeed is None:
            self.conv = weight_norm(self.conv, name="weight", dim=2)
            return
        with deepspeed.zero.GatheredParameters(self.conv.weight, modifier_rank=0):
            self.conv = weight_norm(self.conv, name="weight", dim=2)
        for p in self.conv.parametrizations.weight.parameters():
            deepspeed.zero.register_external_parameter(self, p)

    def forward(self, x):
        return self.conv(x)


def _built_under_init(deepspeed, rank, world_size, tmp) -> None:
    """The module above built under Init trains at stage 3 as one process trains it plainly
    (until stop 34 the gathered weight read empty inside Init, and weight_norm failed)."""
    cfg = _cfg(3, zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0})
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=cfg):
        built = _WeightNormed(deepspeed)
    torch.manual_seed(0)
    plain = _WeightNormed()
    engine, *_ = deepspeed.initialize(model=built, config=cfg)
    _beside_one_process(engine, plain, rank, lambda: torch.randn(world_size, 2, 4, 5))


def _empty_partition_cache(deepspeed, rank, world_size, tmp) -> None:
    """DeepSpeed-Chat and OpenRLHF call `empty_partition_cache()` after generation: every
    unit, the persistent (small) ones too, goes back to its shard, and training goes on
    as one process's (the next forward gathers what it uses)."""
    engine, *_ = deepspeed.initialize(model=_net(), config=_cfg(3))  # small: all persistent
    plain = _net()
    opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.5)
    units = engine.engine.stage3.units
    for step in range(2):
        torch.manual_seed(100 + step)
        x = torch.randn(2, 4)  # the same batch on every rank: the mean is one process's
        engine.backward(engine(x).square().mean())
        engine.step()
        plain(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        assert units and all(u.persistent and u.full is not None for u in units)
        engine.empty_partition_cache()
        assert all(u.full is None for u in units)
    full = engine.engine.full_state_dict()
    if rank == 0:
        for key, value in plain.state_dict().items():
            torch.testing.assert_close(full[key], value, rtol=0, atol=1e-6, msg=key)


def _leaf_modules(deepspeed, rank, world_size, tmp) -> None:
    """`deepspeed.utils.set_z3_leaf_modules(model, [MoEBlock])`, as MoE recipes (and
    Accelerate's transformer_moe_cls_names) call it, or the config's
    `zero_optimization.leaf_module` (DeepSpeed 0.18 on; refused before stop 47): each block
    is gathered whole, so ranks whose samples pick different experts still gather the same
    units, and train as one process on both ranks' batches."""
    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), SparseExperts(), nn.Linear(4, 2))
    # units merged up to 16 elements only: without the leaf each expert is a unit of its
    # own, and ranks picking different experts pair their gathers up wrongly
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 16}
    for leaf_module in (None, {"classes": "SparseExperts"}, {"names": ["1"]}):
        model, plain = net(), net()
        if leaf_module is None:
            leaves = deepspeed.utils.set_z3_leaf_modules(model, [SparseExperts])
            assert leaves == [model[1]] and deepspeed.utils.get_z3_leaf_modules(model) == leaves
        engine, *_ = deepspeed.initialize(model=model, config=_cfg(3, zero_optimization={
            **zero, **({} if leaf_module is None else {"leaf_module": leaf_module})}))
        assert [line.split()[-1] for line in engine.engine.fetch_unit_report.splitlines()
                if " leaf " in line] == ["1"]  # the block, whole
        spread = 1 + torch.arange(world_size).view(-1, 1, 1)  # the ranks' gates pick apart
        _beside_one_process(engine, plain, rank, lambda: torch.randn(world_size, 2, 4) * spread)
    with pytest.raises(ValueError, match="no module of class"):
        deepspeed.utils.set_z3_leaf_modules(net(), ["NoSuchBlock"])


def _stepping_the_returned_optimizer(deepspeed, rank, world_size, tmp) -> None:
    """Lightning Fabric's loop: the optimizer `initialize` returned is stepped, not the
    engine, and the loop steps the scheduler, as with DeepSpeed's ZeRO optimizer. The
    weights follow one process on the mean of every rank's batch, on every rank."""
    decay = lambda step: 0.5 ** step  # noqa: E731
    for stage in (2, 3):
        net, plain = _net(), _net()
        client = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.5)
        engine, optimizer, _, scheduler = deepspeed.initialize(
            model=net, optimizer=client, lr_scheduler=torch.optim.lr_scheduler.LambdaLR(client, decay),
            config={"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
                    "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}})
        reference = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.5)
        reference_scheduler = torch.optim.lr_scheduler.LambdaLR(reference, decay)
        for step in range(3):
            torch.manual_seed(50 + step)
            xs = [torch.randn(2, 4) for _ in range(world_size)]
            engine.backward(engine(xs[rank]).square().mean())
            optimizer.step()
            optimizer.zero_grad()
            assert engine.get_lr() == [0.1 * 0.5 ** step]  # the loop's to step, not the optimizer's
            scheduler.step()
            sum(plain(x).square().mean() for x in xs).div(len(xs)).backward()
            reference.step()
            reference.zero_grad()
            reference_scheduler.step()
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            for mine, theirs in zip(engine.module.parameters(), plain.parameters()):
                torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)


def _checkpointing_group_from_mpu(deepspeed, rank, world_size, tmp) -> None:
    """Megatron's `deepspeed.checkpointing.configure(mpu, ...)`: the model-parallel group
    Pa splits checkpoints over comes from `mpu.get_model_parallel_group()`."""
    group = torch.distributed.new_group(list(range(world_size)))
    mpu = types.SimpleNamespace(get_model_parallel_group=lambda: group)
    try:
        policy = deepspeed.checkpointing.configure(mpu, partition_activations=True)
        assert policy.mp_group is group and policy.mp_size == world_size
    finally:
        deepspeed.checkpointing.configure(None)


def _pytorch_style_backward(deepspeed, rank, world_size, tmp) -> None:
    """DeepSpeed 0.18+: `loss.backward()` (or `engine.scale(loss).backward()`) on the
    engine's output, then `engine.step()`, trains as `engine.backward(loss)`; which returns
    the loss divided by the accumulation steps, as DeepSpeed's does."""
    for stage in (2, 3):
        weights = []
        for style in ("engine", "torch", "scaled"):
            engine, *_ = deepspeed.initialize(model=_net(), config=_cfg(stage, gas=2))
            for i in range(4):
                torch.manual_seed(100 + 10 * i + rank)  # ranks see different batches
                loss = engine(torch.randn(2, 4)).square().mean()
                if style == "engine":
                    returned = engine.backward(loss)
                    torch.testing.assert_close(returned, loss / 2)
                else:
                    (loss if style == "torch" else engine.scale(loss)).backward()
                engine.step()
            assert engine.global_steps == 2, (stage, style)
            params = list(engine.module.parameters())
            with deepspeed.zero.GatheredParameters(params):  # compared on every rank
                weights.append([p.detach().clone() for p in params])
        for other in weights[1:]:
            for got, want in zip(other, weights[0]):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-7, msg=f"stage {stage}")


def _cases(rank: int, world_size: int, tmp: str) -> None:
    import zeromem.deepspeed as deepspeed
    _client_optimizers(deepspeed, rank, world_size, tmp)
    _getters_and_module(deepspeed, rank, world_size, tmp)
    _keywords(deepspeed, rank, world_size, tmp)
    _submodules(deepspeed, rank, world_size, tmp)
    _auto_sizes(deepspeed, rank, world_size, tmp)
    _built_under_init(deepspeed, rank, world_size, tmp)
    _empty_partition_cache(deepspeed, rank, world_size, tmp)
    _leaf_modules(deepspeed, rank, world_size, tmp)
    _stepping_the_returned_optimizer(deepspeed, rank, world_size, tmp)
    _checkpointing_group_from_mpu(deepspeed, rank, world_size, tmp)
    _pytorch_style_backward(deepspeed, rank, world_size, tmp)


def test_deepspeed_api_surface(tmp_path):
    run_distributed(_cases, 2, str(tmp_path))
