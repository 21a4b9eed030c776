"""The training engine: builds the parts from the config and runs forward, backward and step.

The engine chooses the parts once, at construction, and passes each what it uses:
flat groups (flat.py), where masters and shards live (offload/placement.py), the
ZeRO optimizer that reduces gradients during backward and runs the step's phases
(zero_optimizer.py, whose docstring is the communication schedule), and at stage 3
the fetch schedule (stage3/fetch.py). `step()` at an accumulation boundary calls
`ZeroOptimizer.step()` once, then the learning-rate scheduler and the counters.
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from zeromem import torch_backward
from zeromem.activations import recompute as activations
from zeromem.checkpoints import model_weights
from zeromem.checkpoints import save_load as checkpoints
from zeromem.comm import Comm
from zeromem.config.schema import Config
from zeromem.distributed import Runtime
from zeromem.flat import FlatParamGroup
from zeromem.hybrid.hierarchy import build_comm_plan
from zeromem.layout import Sharding, ShardLayout, derived_bucket_numel, pack_buckets
from zeromem.lockstep import Lockstep
from zeromem.memory import Ledger, MemoryReport, model_state_formula
from zeromem.monitoring.monitors import Observers, StepFacts, due
from zeromem.module_dtypes import cast_module
from zeromem.module_state import LoadIntoMasters, broadcast_from_rank0, gathered_state_dict, \
    materialize_meta, warn_sharded_state_dict
from zeromem.offload.params import ParamPlacement
from zeromem.param_states import ParamStates
from zeromem.offload.staged_masters import StagedMasters
from zeromem.offload.states import StatesOffload, chosen_kinds, state_tensors
from zeromem.offload.placement import (OffloadPolicy, SwapSpaces, build_grads, build_offload,
                                       build_params, stage_masters)
from zeromem.optim.factory import (client_groups, evaluated_groups, optimizer_param_groups,
                                   optimizer_state_bytes_per_param, param_order)
from zeromem.stage3.partitioned_init import Partitions
from zeromem.precision import make_scaler
from zeromem.optim.schedulers import build_scheduler
from zeromem.stage3.fetch import FetchSchedule, build_stage3
from zeromem.stage3.units import UnitCaps, UnitChoice, choose_units
from zeromem.tensor_parallel import model_parallel_norm
from zeromem.monitoring.timers import PhaseTimers
from zeromem.training_state import BatchSizes, RngState, SchedulerArg, Stateful, StepCounters, \
    TrainingState
from zeromem.zero_optimizer import StepSettings, ZeroOptimizer

log = logging.getLogger("zeromem")


class Engine:
    """Wraps a module and trains it with ZeRO stage 0, 1, 2 or 3. Built by `zeromem.initialize`.

    At construction rank 0's parameters and buffers are broadcast to every
    data-parallel rank (as DDP and DeepSpeed do); buffers are not broadcast again,
    so BatchNorm statistics then follow each rank's own batches (rank 0's are
    checkpointed). The fp32 masters start from the module's own (fp32) values, and
    `engine.module.load_state_dict(...)` reaches them at full precision, at every
    stage (module_state.py).
    """

    def __init__(self, module: nn.Module, config: Config, comm: Comm,
                 model_parameters: Iterable | None = None,
                 optimizer: Callable[[list[dict]], torch.optim.Optimizer] | None = None,
                 lr_scheduler: SchedulerArg = None, fetch_units: tuple[type, ...] = (),
                 mp_group: dist.ProcessGroup | None = None, partitions: Partitions | None = None,
                 runtime: Runtime | None = None):
        self.config = config
        self.comm = comm
        # device, global rank, gather timeout: read from the environment by `initialize`
        self.runtime = runtime or Runtime.from_env(comm.group, config.zeromem.gather_timeout_s)
        # parameters built under zeromem.Init, and where this engine files its fetch units
        self.partitions = Partitions() if partitions is None else partitions
        self.dp_world_size = comm.world_size
        self.zero_stage = config.zero_optimization.stage
        self.device = self.runtime.device  # LOCAL_RANK's GPU, not the global rank's
        self.compute_dtype = config.compute_dtype
        self.partitions.refuse_taken(module)
        materialize_meta(module, self.device)  # a model built on the meta device
        # The user's dtype is kept until the flat groups read the fp32 masters from it.
        self.module = module.to(self.device)
        broadcast_from_rank0(self.module, comm)  # ranks need not be seeded alike
        self.counters = StepCounters(BatchSizes(*config.batch()[1:], ranks=comm.world_size))
        # every rank must run the same backwards and collective calls: checked as they start
        self.lockstep = Lockstep.agree(comm)
        self.scaler = make_scaler(config.fp16)
        self.states = StatesOffload(self.device)  # offload_states: host copies until reloaded
        self.timers = PhaseTimers(config.wall_clock_breakdown, self.device)
        # this engine's policy and byte ledger, active while its forward/backward run
        self.activation_checkpointing = activations.for_engine(config.activation_checkpointing)

        # which group each collective runs over: hybrid sharding, hpZ, qwZ, qgZ (hybrid/hierarchy.py)
        self.plan = build_comm_plan(config, comm, self.runtime.ranks_per_node)
        # Given no optimizer, the engine evaluates only, as DeepSpeed's does (ZeRO-3 inference:
        # HF's Trainer.evaluate() before any training, DeepSpeed-Chat's reference models), and
        # shards the whole module: `model_parameters` (Lightning passes []) names nothing to train
        self.trains = optimizer is not None or config.optimizer is not None
        given = client_groups(module, model_parameters)  # read once: it may be a generator
        param_groups = optimizer_param_groups(config.optimizer, module, given) if self.trains \
            else evaluated_groups(module, config.zero_optimization.stage)
        self.param_order = param_order(module, given)  # DeepSpeed stage-0 states' positions
        self.names = {id(p): n for n, p in module.named_parameters()}
        sharding = Sharding.for_stage(self.zero_stage)
        self.fetch_unit_report = ""  # stage 3: the fetch units chosen (stage3/units.py)
        self.unit_choice: UnitChoice | None = None  # stage 3: set by `_partition`
        self.bucket_sizes = self._bucket_sizes(param_groups)  # explicit, or from the model
        # Stage 3 shards the parameters frozen at initialize too (a LoRA model's base weights),
        # in units of their own with nothing to train, as DeepSpeed and FSDP2 do
        frozen = self._frozen_by_dtype(module) if sharding.params and self.trains else []
        parts = self._partition(param_groups, sharding, fetch_units, frozen)
        trained_parts = [part for part in parts if part[0] < len(param_groups)]
        # Laid out before the groups exist, so that under Init each unit's shard (and, 16-bit
        # with the optimizer on NVMe, its fp32 master) leaves memory for its swap file before
        # the next unit is gathered whole: no rank holds all its shards at once.
        # Swap files are named by the global rank: unique across nodes sharing a filesystem
        # and across data-parallel groups (a dp_group rank repeats in each group).
        spaces = SwapSpaces(config, self.runtime.global_rank)
        shards = self._shards(parts, len(param_groups)) if sharding.params else []
        params_placement = build_params(config, shards, self.device, spaces)
        staged = stage_masters(config, [n for n, _ in self._shards(trained_parts, len(param_groups))]
                               if sharding.params else [], self.compute_dtype, spaces)
        built = self._build_groups(parts, sharding, len(param_groups), staged, params_placement,
                                   spaces)
        self.groups = [g for g in built if g.trains]
        self.frozen_groups = [g for g in built if not g.trains]  # stage 3: sharded, not trained
        self.partitions.materialize(self.module.parameters(), self.comm)  # frozen, built under Init
        cast_module(self.module, config)  # frozen parameters, buffers (module_dtypes.py)
        self.psi = sum(g.numel for g in self.groups)
        # parameters outside the flat groups, which `zero_grad` clears too: listed once, as a
        # walk of the module tree at every step costs about a millisecond on a deep model
        grouped = {id(p) for g in self.groups for p in g.params}
        self.loose_params = [p for p in module.parameters() if id(p) not in grouped]
        self.frozen_at_initialize = [(n, p) for n, p in module.named_parameters()
                                     if id(p) not in grouped and not p.requires_grad]
        # each group's gradient buffer, built knowing where its reduced gradient goes (kept,
        # copied to host at the boundary, or written to grads.swp: offload/placement.py)
        grads = build_grads(config, self.groups, sharding, spaces, self.device)
        # where masters and optimizer states live (offload/placement.py), beside the parameter
        # placement the shards went to; before the stage-3 units, which receive the latter
        self.offload = build_offload(config, self.groups, params_placement, spaces,
                                     self.runtime.global_rank, staged, grads)
        self.optimizer = self.offload.build_optimizer(config.optimizer, param_groups, optimizer,
                                                      self.device)
        # tensor parallelism: the clipping norm spans the model-parallel group too
        if mp_group is None:  # DeepSpeed's way: the group given to checkpointing.configure
            mp_group = self.activation_checkpointing.config.mp_group
        self.mp_norm = model_parallel_norm(module, mp_group)  # None without tensor parallelism
        # the buckets' reductions, in bucket order on every rank, with at most `buckets_alive`
        # full-size buckets alive: scheduled by the shard group's Comm, which whoever fills
        # the buckets holds (comm.py)
        self.plan.shard.schedule_reductions(self.plan.grads, len(self.groups),
                                            self.offload.buckets_alive,
                                            config.zero_optimization.overlap_comm is not False)
        # one gradient's life: reduced in backward, stepped, all-gathered (zero_optimizer.py)
        self.zero = ZeroOptimizer(self.groups, self.plan, self.offload.masters, self.offload.params,
                                  self.optimizer, self.scaler, self.mp_norm, StepSettings(
                                      float(config.gradient_clipping or 0.0),
                                      self.bucket_sizes["allgather_bucket_size"]))
        # gradient readiness: one hook per parameter (stages 0-2), or each unit's own (stage 3)
        self.stage3: FetchSchedule | None = None
        if self.unit_choice is None:
            self.zero.hook_parameters()
            self.partitions.add_groups(self.groups, self.lockstep)  # GatheredParameters edits reach masters
        else:
            self.stage3 = self._build_stage3(self.unit_choice)
            warn_sharded_state_dict(self.module)  # state_dict() of empty shards: said once
            self.zero.after_gather(self.stage3.refresh)  # persistent units re-gather the new weights
        self.load_hooks = LoadIntoMasters(self.module, self.groups + self.frozen_groups,
                                          self.offload)
        # one parameter's master, optimizer states and gradient, whole or this rank's part
        self.param_states = ParamStates(self.groups, self.optimizer, self.offload.masters,
                                        self.scaler, self.device,
                                        lambda: self.zero.gradient_complete,
                                        self.zero.masters_changed)
        self.lr_scheduler = self._make_scheduler(lr_scheduler)
        # monitors, comms_logger, flops_profiler, throughput, dump_state (monitoring/monitors.py)
        self.observers = Observers(config, comm, self.device, self.psi, self.counters)
        # `loss.backward()` through the forward's outputs opens this engine's backward
        self.output_hooks = torch_backward.OutputHooks(
            [p for g in self.groups for p in g.params], self._opens_torch_backward)
        self._loss_scaled = False  # engine.scale(loss) came before that backward (fp16)

    def _make_scheduler(self, lr_scheduler: SchedulerArg) -> LRScheduler | None:
        """A factory `optimizer -> scheduler`, a ready scheduler, or the config's `scheduler`."""
        if lr_scheduler is None:
            return build_scheduler(self.config.scheduler, self.optimizer)
        if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
            return lr_scheduler(self.optimizer)
        return cast(LRScheduler, lr_scheduler)  # or any object with its step / state_dict

    # -- construction ------------------------------------------------------
    def _bucket_sizes(self, param_groups: list[dict]) -> dict[str, int]:
        """reduce / all-gather bucket elements: the config's where given, else derived from
        the model size and N_d (layout.py); stage 3's prefetch depth follows in
        `_build_stage3`, once the fetch units are known."""
        zero = self.config.zero_optimization
        psi = sum(self.partitions.full_numel(p) for pg in param_groups for p in pg["params"])
        derived = derived_bucket_numel(psi, self.dp_world_size)
        sizes = {key: int(getattr(zero, key)) if key in zero.model_fields_set else derived
                 for key in ("reduce_bucket_size", "allgather_bucket_size")}
        log.info("bucket sizes (elements): %s (derived from %s elements on %d ranks: %d)",
                 sizes, f"{psi:,}", self.dp_world_size, derived)
        return sizes

    def _shards(self, parts: list[tuple[int, list[nn.Parameter]]],
                trained: int) -> list[tuple[int, torch.dtype]]:
        """Stage 3: this rank's shard of each flat group to build, before it exists: its
        elements and dtype (parts of param group `trained` and above are frozen)."""
        shard = self.plan.shard
        return [(ShardLayout(sum(self.partitions.full_numel(p) for p in params),
                             shard.world_size, shard.rank).shard_numel,
                 self._group_dtype(params, gi < trained)) for gi, params in parts]

    def _build_groups(self, parts: list[tuple[int, list[nn.Parameter]]], sharding: Sharding,
                      trained: int, staged: StagedMasters | None, params: ParamPlacement,
                      spaces: SwapSpaces) -> list[FlatParamGroup]:
        """One flat group per part (a bucket, at stage 3 a fetch unit), in expected backward
        order; each is handed (`admit`) to where its master is `staged` and to the parameter
        placement as soon as it is built. Parts of param group `trained` and above hold
        frozen parameters: no master, nothing to train."""
        order = {id(p): i for i, p in enumerate(self.module.parameters())}
        groups = []
        try:
            for gi, part in parts:
                self.partitions.materialize(part, self.comm)  # built under Init: one at a time
                names = [self.names[id(p)] for p in part]
                group = FlatParamGroup(part, names, self.plan.shard, sharding, gi,
                                       self._group_dtype(part, gi < trained), trains=gi < trained,
                                       master_dtype=self.config.master_dtype)
                groups.append(group)
                if staged is not None and group.trains:
                    staged.admit(group)
                params.admit(group)
        except BaseException:
            spaces.close()  # no half-written swap files left behind
            raise
        groups.sort(key=lambda g: -min(order[id(p)] for p in g.params))
        return groups

    def _partition(self, param_groups: list[dict], sharding: Sharding,
                   fetch_units: tuple[type, ...],
                   frozen: list[list[nn.Parameter]]) -> list[tuple[int, list[nn.Parameter]]]:
        """(param group index, parameters) of each flat group to build; at stage 3 `frozen`
        parameters' units too, each list of them as param group `len(param_groups)` on."""
        if sharding.params:  # one group per fetch unit and param group (stage3/units.py)
            leaves = self.config.zero_optimization.leaf_module.modules(self.module)
            self.unit_choice = choose_units(self.module, param_groups, fetch_units,
                                            self._unit_caps(), self.partitions.full_numel, frozen,
                                            leaves)
            self.fetch_unit_report = self.unit_choice.report
            return self.unit_choice.parts
        order = {id(p): i for i, p in enumerate(self.module.parameters())}
        bucket_numel = self.bucket_sizes["reduce_bucket_size"]
        parts = []
        for gi, pg in enumerate(param_groups):
            params = sorted(pg["params"], key=lambda p: -order[id(p)])  # backward runs last-first
            buckets = pack_buckets((p.numel() for p in params), bucket_numel)
            parts += [(gi, [params[i] for i in bucket]) for bucket in buckets]
        return parts

    def _frozen_by_dtype(self, module: nn.Module) -> list[list[nn.Parameter]]:
        """Stage 3: the parameters frozen at initialize, one list per flat group dtype: the
        compute dtype's, or in fp32 each their own (PEFT's bf16 base under fp32 adapters
        stays bf16, as in one process and DeepSpeed)."""
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in module.parameters():
            if not p.requires_grad:
                by_dtype.setdefault(self._group_dtype([p], trains=False), []).append(p)
        return list(by_dtype.values())

    def _group_dtype(self, params: list[nn.Parameter], trains: bool) -> torch.dtype:
        """A flat group's dtype: the compute dtype, but frozen parameters keep their own
        where the config casts no module (`Config.casts_module`)."""
        if trains or self.config.casts_module:
            return self.compute_dtype
        return params[0].dtype

    def _unit_caps(self) -> UnitCaps:
        """What bounds a merged fetch unit: the reduce bucket, and with parameters on NVMe
        the parameter pool's share of the host budget (offload/budget.py); and which units
        merge as persistent (stage3_param_persistence_threshold)."""
        bucket_numel = self.bucket_sizes["reduce_bucket_size"]
        pool = OffloadPolicy.from_config(self.config).pool_unit_numel(
            self.compute_dtype.itemsize, self.plan.shard.world_size)
        return UnitCaps(bucket_numel, pool,
                        int(self.config.zero_optimization.stage3_param_persistence_threshold))

    def _build_stage3(self, choice: UnitChoice) -> FetchSchedule:
        """The fetch units and their schedule (stage3/fetch.py); records the prefetch window."""
        schedule = build_stage3(self.module, self.groups + self.frozen_groups, choice,
                                self.config, self.plan,
                                self.offload.params, self.runtime.gather_timeout_s, self.comm,
                                self.partitions, self.lockstep, self.zero.warn_outside_backward)
        self.bucket_sizes["stage3_prefetch_bucket_size"] = schedule.limits.prefetch_numel
        return schedule

    # -- training loop -------------------------------------------------------
    def forward(self, *args, **kwargs):
        """Run the wrapped module (inputs cast to fp16 when `fp16.auto_cast` is on; under
        `torch.autocast` when `torch_autocast` is: activation checkpoints recompute under
        the same state)."""
        if self.config.fp16.enabled and self.config.fp16.auto_cast:
            cast = lambda x: x.half() if torch.is_tensor(x) and x.is_floating_point() else x  # noqa: E731
            args = tuple(cast(a) for a in args)
            kwargs = {k: cast(v) for k, v in kwargs.items()}
        # not `enabled=False`: that would switch off an autocast the caller entered itself
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16) \
            if self.config.torch_autocast.enabled else contextlib.nullcontext()
        with self.timers("forward"), self.activation_checkpointing.active(), \
                self.observers.forward(), autocast:
            out = self.module(*args, **kwargs)
        if self.trains and torch.is_grad_enabled():
            self.output_hooks.watch(out)  # a `loss.backward()` of the caller's opens a backward
        return out

    __call__ = forward

    # A loop written for DeepSpeed's engine, an nn.Module, switches modes on the engine.
    def train(self, mode: bool = True) -> Engine:
        """The wrapped module's train(mode) (dropout, batch statistics); returns the engine."""
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    @property
    def training(self) -> bool:
        return self.module.training

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Backpropagate `loss` with 1/(accumulation steps x N_d) and the loss scale applied.

        Scaling the loss divides every gradient by N_d before the reduction sums them:
        DeepSpeed's `"prescale_gradients": true`, always (its default, false, divides after).
        `loss.backward()` on what the engine's forward returned does the same
        (torch_backward.py), the gradients scaled as they are taken in."""
        scale = self.scaler.scale / (self.counters.gradient_accumulation_steps * self.dp_world_size)
        with self._backward_pass(loss, grad_factor=1.0), self.activation_checkpointing.active(), \
                torch_backward.engine_task() as mark:
            mark(loss.float() * scale).backward(retain_graph=retain_graph)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` times the fp16 loss scale, for `engine.scale(loss).backward()` (DeepSpeed's):
        with fp16, `loss.backward()` without it is refused, its gradients would underflow."""
        self._loss_scaled = True
        return loss * self.scaler.scale

    @contextlib.contextmanager
    def _backward_pass(self, loss: torch.Tensor | None, grad_factor: float) -> Iterator[None]:
        """One backward's bookkeeping: counted, the reductions started, and at the end the
        buckets no gradient completed handed in; gradients are taken in times `grad_factor`."""
        self._check_trains("backward")
        self.lockstep.pass_starts(f"backward (micro-step {self.micro_steps + 1}, optimizer "
                                  f"step {self.global_steps + 1})")
        self.counters.advance_backward()
        with self.timers("backward"), self.observers.backward(loss):
            self.zero.start_backward(self.is_gradient_accumulation_boundary(), grad_factor)
            if self.stage3 is not None:
                self.stage3.start_pass("backward", grad_factor)
            yield
            if self.stage3 is not None:
                self.stage3.finish_backward()  # units with unused parameters hand over
            self.zero.finish_backward()
            if self.stage3 is not None:
                self.stage3.finish_pass()

    def _opens_torch_backward(self) -> Callable[[], None]:
        """A `loss.backward()` of the caller's reached the outputs (torch_backward.py): the
        backward opens, gradients taken in times 1/(accumulation steps x N_d); returns its
        close, which autograd calls when that backward ends."""
        if self.scaler.scale != 1.0 and not self._loss_scaled:
            raise RuntimeError(
                "loss.backward() on this engine's output with fp16: the gradients need the "
                f"loss scale ({self.scaler.scale:g}) to stay representable; call "
                "engine.scale(loss).backward() or engine.backward(loss)")
        self._loss_scaled = False
        stack = contextlib.ExitStack()
        stack.enter_context(self._backward_pass(
            None, 1.0 / (self.counters.gradient_accumulation_steps * self.dp_world_size)))
        return stack.close

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.counters.at_boundary()

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Whether the next backward ends an accumulation, said by the training loop
        (Accelerate, before every backward); it decides from then on, not the count."""
        self.counters.announce_boundary(is_boundary)

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """DeepSpeed's: the global batch changes by the micro-steps per optimizer step, the
        micro-batch staying (a batch-size ramp-up); between accumulations only."""
        self.counters.resize(self.counters.batch.with_train(train_batch_size))

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """DeepSpeed's: the micro-batch changes, the accumulation steps staying."""
        self.counters.resize(self.counters.batch.with_micro(micro_batch_size))

    def step(self, lr_kwargs: dict | None = None) -> None:
        """Called every micro-step; updates the model at the accumulation boundary, then
        steps the scheduler (unless fp16 overflow skipped the update).

        `lr_kwargs` go to the scheduler's `step()` (DeepSpeed's `step(lr_kwargs=)`)."""
        self._step(self.lr_scheduler, lr_kwargs or {})

    def step_without_scheduler(self) -> None:
        """`step()` leaving the scheduler alone, for loops that step it themselves: what
        DeepSpeed's ZeRO optimizer's own `step()` does (Lightning Fabric calls that in place
        of the engine's)."""
        self._step(None, {})

    def _step(self, scheduler: LRScheduler | None, lr_kwargs: dict) -> None:
        self._check_trains("step")
        boundary = self.is_gradient_accumulation_boundary()
        self.counters.advance_micro(boundary)
        if not boundary:
            return
        self._refuse_unfrozen()
        with self.timers("step"):
            overflow = self.zero.step()  # norm, skip, unscale, update, gather (zero_optimizer.py)
            if not overflow and scheduler is not None:
                scheduler.step(**lr_kwargs)
            self.zero_grad()
            self.counters.advance_global(skipped=overflow)
            self.comm.end_step()
            self.offload.end_step()  # swap bytes and I/O wait of this step (offload.io_report())
        printing = due(self.global_steps, self.config.steps_per_print)
        facts = StepFacts(self.get_lr(), self.loss_scale, self.grad_norm,
                          self.memory_report() if self.observers.wants_memory_report(printing)
                          else None)
        self.observers.after_step(facts)
        if printing:
            log.info("step %d: lr %s, grad norm %.4g, loss scale %g, skipped %d%s%s",
                     self.global_steps, facts.lr, self.grad_norm, self.loss_scale,
                     self.skipped_steps, self.timers.summary(), self.observers.log_line_extras(facts))

    def _refuse_unfrozen(self) -> None:
        """A parameter frozen at initialize has no master and no optimizer state: unfrozen
        later (training a head first, then the body), its gradient would be dropped at
        every step, where PyTorch's optimizer would step it. Refused, naming it."""
        for name, p in self.frozen_at_initialize:
            if p.grad is not None:
                raise RuntimeError(
                    f"step(): parameter {name!r} was frozen (requires_grad=False) when the "
                    "engine was built and has a gradient now; the engine steps only the "
                    "parameters trainable at initialize, so it would never change. Make it "
                    "trainable before initialize (frozen later, it gets a zero gradient: "
                    "weight decay and momentum still move it, as in DeepSpeed)")

    def _check_trains(self, call: str) -> None:
        if not self.trains:
            raise RuntimeError(f"{call}(): this engine was given no optimizer (no 'optimizer' "
                               "block in the config, none passed to initialize), so it evaluates "
                               "only, as DeepSpeed's does; give it one to train")
        self.states.check_loaded(f"{call}()")

    def offload_states(self, include: Iterable[str] | None = None, pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """DeepSpeed's: the states `include` names leave device memory until `reload_states`
        (offload/states.py); backward, step and checkpoints wait for the reload."""
        self._check_trains("offload_states")
        self.states.offload(state_tensors(chosen_kinds(include), self.groups, self.optimizer,
                                          self.offload.policy), pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        self.states.reload(non_blocking)

    def zero_grad(self) -> None:
        self.zero.zero_grad()
        for p in self.loose_params:
            p.grad = None  # parameters outside the flat groups too

    def set_optimizer_mode(self, mode: str) -> None:
        """A schedule-free optimizer's `train()` or `eval()` (zero_optimizer.py)."""
        self.zero.set_optimizer_mode(mode)

    # -- attributes ---------------------------------------------------------
    @property
    def grad_norm(self) -> float | None:
        """The pre-clip global gradient norm of the last step (None before the first)."""
        return self.zero.grad_norm

    @property
    def global_steps(self) -> int:
        return self.counters.global_steps

    @property
    def micro_steps(self) -> int:
        return self.counters.micro_steps

    @property
    def skipped_steps(self) -> int:
        return self.counters.skipped_steps

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def get_lr(self) -> list[float]:
        return [pg["lr"] for pg in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The pre-clip global gradient norm of the last step."""
        return self.grad_norm

    # -- checkpoints (checkpoints/save_load.py) -------------------------------------------
    def save_checkpoint(self, save_dir, tag: str | None = None, client_state: object = None,
                        exclude_frozen_parameters: bool = False) -> str:
        """Atomic sharded checkpoint, loadable under any world size and stage; collective.

        `exclude_frozen_parameters` leaves out parameters with requires_grad False (a
        load keeps the loading model's values for them). Refused under tensor parallelism,
        on every rank and before anything is written: the files are named by data-parallel
        rank, so the model-parallel ranks' different slices would overwrite each other."""
        if self.mp_norm is not None:
            raise NotImplementedError(
                "save_checkpoint with tensor parallelism (a model-parallel group of "
                f"{self.mp_norm.comm.world_size} ranks) is not supported: each model-parallel "
                "rank holds other slices, which one checkpoint directory would mix; "
                "full_state_dict() gives each model-parallel rank its own")
        path = str(Path(save_dir) / (f"global_step{self.global_steps}" if tag is None else str(tag)))
        with self.collective("save_checkpoint"):
            return self.plan.write_once(lambda: checkpoints.save_checkpoint(
                self.training_state(), save_dir, tag, client_state, exclude_frozen_parameters),
                path, self.comm, self.device)

    def collective(self, call: str) -> contextlib.AbstractContextManager[None]:
        """Around a collective call every rank must make at the same point of the loop:
        made on some ranks only, it is refused at once, naming what the others did."""
        return self.lockstep.collective(call, f"(after optimizer step {self.global_steps}, "
                                              f"micro-step {self.micro_steps})")

    # The states loaded are the ones training then updates in place: inference tensors
    # (made under a caller's torch.inference_mode) would refuse that.
    @torch.inference_mode(False)
    def load_checkpoint(self, load_dir, tag: str | None = None, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True,
                        trust_client_state: bool = False) -> tuple[str, Any]:
        """Load a checkpoint saved under any world size / stage; returns (path, client_state).

        `trust_client_state=True` unpickles arbitrary objects in client_state.pt
        (only for checkpoints you trust; see `checkpoints.load_checkpoint`). An engine
        given no optimizer loads the weights only: it has nothing to put the rest in."""
        if not self.trains:
            load_optimizer_states = load_lr_scheduler_states = False
        with self.collective("load_checkpoint"):
            return checkpoints.load_checkpoint(self.training_state(), load_dir, tag,
                                               load_optimizer_states,
                                               load_lr_scheduler_states, trust_client_state,
                                               self.config.checkpoint.load_universal)

    def save_16bit_model(self, save_dir, filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> str:
        """Compute-dtype weights to save_dir/filename on rank 0; collective."""
        with self.collective("save_16bit_model"):
            return self.plan.write_once(lambda: model_weights.save_16bit_model(
                self.training_state(), save_dir, filename, exclude_frozen_parameters),
                str(Path(save_dir) / filename), self.comm, self.device)

    def training_state(self) -> TrainingState:
        """What checkpoints read and restore (checkpoints/save_load.py never sees the engine)."""
        self.states.check_loaded("a checkpoint")
        stateful: dict[str, Stateful] = {"counters": self.counters, "scaler": self.scaler, "rng": RngState()}
        if self.lr_scheduler is not None:
            stateful["lr_scheduler"] = self.lr_scheduler
        block = self.config.optimizer
        return TrainingState(
            # the shards' group: under hybrid sharding, one block of the replicated ranks
            self.module, self.groups, self.optimizer, self.plan.shard, self.device, stateful,
            self.zero_stage, self.compute_dtype,
            (block.type if block is not None else type(self.optimizer).__name__).lower(),
            self.config.checkpoint.tag_validation,
            self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save,
            self.offload.all_in_memory, self.zero.refresh_params, self.frozen_groups,
            self.param_order)

    # -- reports ----------------------------------------------------------------
    def memory_report(self) -> MemoryReport:
        """Bytes actually held by this rank, beside the paper's formula."""
        ledger = Ledger()
        self.offload.file_into(ledger)  # offloaded tensors first: host / nvme, counted once
        for g in self.groups + self.frozen_groups:
            ledger.add("params", "device", g.flat_param)
            ledger.add("params", "device", g.param_shard)
        for unit in self.stage3.units if self.stage3 is not None else []:
            ledger.add("params", "device", unit.full)  # persistent (small) units stay whole
            for shard in unit.held():
                ledger.add("params", "device", shard)  # hpZ's secondary copy (forward to step)
        for p in self.module.parameters():
            ledger.add("params", "device", p)  # frozen parameters (flat ones already counted)
        for g in self.groups:
            for t in g.grad_held():
                ledger.add("grads", "device", t)
            ledger.add("master_params", "device", g.master)
        for state in self.optimizer.state.values():
            for t in state.values():
                if torch.is_tensor(t):
                    ledger.add("optimizer_states", "device", t)
        ledger.add_bytes("comm_buffers", "device", self.comm.buffer_bytes_peak)
        peaks = self.activation_checkpointing.stats().peak_bytes  # peak since the last reset
        for place, nbytes in peaks.items():
            ledger.add_bytes("activation_checkpoints", place, nbytes)
        g0 = self.groups[0] if self.groups else None
        # bf16.bf16_master_weights_and_grads: masters and states in bf16, half the bytes
        width = self.config.master_dtype.itemsize
        master_bytes = 0 if g0 is None or g0.master_aliases_params() else width
        k = optimizer_state_bytes_per_param(self.optimizer) * width / 4 + master_bytes
        formula = model_state_formula(self.psi, self.plan.shard.world_size, self.zero_stage,
                                      self.compute_dtype.itemsize, self.config.grad_dtype.itemsize,
                                      k, master_bytes)
        return MemoryReport(ledger.as_dict(), formula, self.psi, self.dp_world_size,
                            self.zero_stage, self.comm.buffer_bytes_peak)

    def empty_partition_cache(self) -> None:
        """Stage 3: release every gathered parameter not held by GatheredParameters."""
        if self.stage3 is not None:
            self.stage3.release_all()

    def close(self, barrier_timeout_s: float = 10.0) -> None:
        """Finish and drop collectives in flight, meet the other ranks (bounded wait),
        and release offload storage (swap files). Also run at exit and on SIGTERM."""
        self.observers.close()
        self.comm.close(barrier_timeout_s)
        self.offload.close()

    def comm_report(self):
        """Bytes each collective kind moved from this rank, last step and in total."""
        return self.comm.report()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The full fp32 state dict (keys as `module.state_dict()`) on rank 0; {} elsewhere."""
        with self.collective("full_state_dict"), self.offload.all_in_memory():
            # masters in NVMe files come back for the read
            whole = gathered_state_dict(self.module, self.groups + self.frozen_groups,
                                        self.plan.shard,
                                        torch.float32, keep=self.comm.rank == 0)
        return {k: v.float() if v.is_floating_point() else v for k, v in whole.items()}

