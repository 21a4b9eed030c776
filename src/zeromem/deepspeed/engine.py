"""`DeepSpeedEngine`: DeepSpeed's engine interface around zeromem's native `Engine`.

DeepSpeed's engine is an `nn.Module` holding the model as the submodule `module`
(so `state_dict()` keys start with `module.`), forwarding unknown attributes to
the model, and offering getters (`train_batch_size()`, `zero_optimization_stage()`,
...) and keyword arguments that zeromem's `Engine` does not have. This class adds
exactly that and delegates all training work to one native `Engine` it owns.

`ZEROMEM_LOSS_LOG=path` (a test hook): each `backward()` appends
"rank micro_step loss" to `path`, so scripts that print losses only now and then
can be compared with a single-process run.
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoints.consolidate import available_tags
from ..checkpoints.formats import holds_pointer
from ..checkpoints.model_weights import weights_16bit
from ..engine import Engine
from ..training_state import RngState
from . import utils
from .optimizer import DeepSpeedZeroOptimizer
from .parameter_offload import ParameterOffload
from .comm import broadcast_object
from .timer import ThroughputTimer
from .zero import offloads_to_host

log = logging.getLogger("zeromem")


class DeepSpeedEngine(nn.Module):
    """What `zeromem.deepspeed.initialize` returns first; use it as DeepSpeed's engine."""

    def __init__(self, engine: Engine, ds_config: dict | None = None):
        super().__init__()
        self.engine = engine  # the native engine does the work; not a module, so not registered
        self._ds_config = ds_config  # the JSON config as given (DeepSpeed's `engine.config`)
        self.module = engine.module  # registered: state_dict keys are "module.<name>"
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        # DeepSpeed's: the rank and size of the whole world; ZeRO's data-parallel share of it
        # (smaller with a model-parallel mpu=)
        whole = torch.distributed.is_initialized()
        self.global_rank = torch.distributed.get_rank() if whole else 0
        self.world_size = torch.distributed.get_world_size() if whole else 1
        self.dp_world_size = engine.dp_world_size
        self.mp_world_size = self.world_size // self.dp_world_size
        self.device = engine.device
        self._step_applied = False
        self._loss_log = os.environ.get("ZEROMEM_LOSS_LOG") or None
        throughput = engine.config.timers.throughput
        self.tput_timer = ThroughputTimer(self.train_batch_size(), throughput.enabled,
                                          throughput.synchronized, engine.device)
        utils.attach(engine.param_states, engine.module)  # safe_get_full_grad(p) finds it
        # what DeepSpeed returns as its optimizer: stepping it is the engine's update
        self._optimizer = DeepSpeedZeroOptimizer(engine) if engine.trains else None
        if engine.stage3 is not None and self._optimizer is not None:  # TRL's generation reaches for it
            self._optimizer.parameter_offload = ParameterOffload(engine.module)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> Any:
        """Registered parameters, buffers and modules first; then the wrapped model's attributes."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules", {})
            if "module" not in modules:
                raise
            return getattr(modules["module"], name)

    # -- training loop ---------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self.module.training:
            self.tput_timer.start()
        return self.engine.forward(*args, **kwargs)

    def backward(self, loss: torch.Tensor, allreduce_gradients: bool = True, release_loss=False,
                 retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backpropagate `loss`; `scale_wrt_gas=False` skips the 1/accumulation-steps factor.
        Returns the loss as DeepSpeed does: divided by the accumulation steps unless that
        factor was skipped."""
        if not allreduce_gradients:
            raise NotImplementedError("backward(allreduce_gradients=False) is not supported")
        self._log_loss(loss)
        gas = self.gradient_accumulation_steps()
        self.engine.backward(loss if scale_wrt_gas else loss * gas, retain_graph=retain_graph)
        return loss / gas if scale_wrt_gas else loss

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """DeepSpeed's: `engine.scale(loss).backward()`, the fp16 loss scale applied, for a
        loop that calls backward itself (any precision: the factor is 1 without fp16)."""
        return self.engine.scale(loss)

    def step(self, lr_kwargs: dict | None = None) -> None:
        """A micro-step; at the accumulation boundary the optimizer (and scheduler) step."""
        boundary = self.engine.is_gradient_accumulation_boundary()
        skipped = self.engine.skipped_steps
        self.engine.step(lr_kwargs=lr_kwargs)
        self._step_applied = boundary and self.engine.skipped_steps == skipped
        self.tput_timer.stop(global_step=boundary)

    def was_step_applied(self) -> bool:
        """True when the last `step()` updated the weights (a boundary, no fp16 overflow)."""
        return self._step_applied

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.engine.is_gradient_accumulation_boundary()

    @contextlib.contextmanager
    def no_sync(self):
        """DeepSpeed's `no_sync`: gradients of the backwards inside are accumulated locally.

        zeromem reduces gradients when `gradient_accumulation_steps` says so; like
        DeepSpeed, `no_sync` is refused where gradients are partitioned (stage 2, 3),
        and at stages 0-1 the accumulation boundary already defers the reduction.
        """
        if self.zero_optimization_stage() >= 2:
            raise AssertionError(f"no_sync is incompatible with ZeRO stage "
                                 f"{self.zero_optimization_stage()} (gradient partitioning)")
        yield

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        """Accelerate announces each micro-step's boundary before its backward and calls
        `step()` at boundaries only; as in DeepSpeed, the announcement then decides where
        accumulations end (a short last window of an epoch included: HF's Trainer scales
        its loss by the window's length itself)."""
        self.engine.set_gradient_accumulation_boundary(is_boundary)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients are freed after each step anyway; `set_to_none` is accepted as torch's."""
        self.engine.zero_grad()

    def _log_loss(self, loss: torch.Tensor) -> None:
        if self._loss_log is not None:
            with open(self._loss_log, "a") as f:
                f.write(f"{self.global_rank} {self.engine.micro_steps} {loss.item()!r}\n")

    # -- getters ---------------------------------------------------------------
    def train_micro_batch_size_per_gpu(self) -> int:
        return self.engine.counters.batch.micro

    def gradient_accumulation_steps(self) -> int:
        return self.engine.counters.batch.accumulation

    def train_batch_size(self) -> int:
        return self.engine.counters.batch.train

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """The global batch changes by the accumulation steps (Megatron-DeepSpeed's batch
        ramp-up calls this before every step); see `Engine.set_train_batch_size`."""
        self.engine.set_train_batch_size(train_batch_size)
        self.tput_timer.batch_size = self.train_batch_size()

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        self.engine.set_train_micro_batch_size(micro_batch_size)
        self.tput_timer.batch_size = self.train_batch_size()

    def zero_optimization_stage(self) -> int:
        return self.engine.zero_stage

    def zero_optimization(self) -> bool:
        return self.engine.zero_stage > 0

    def fp16_enabled(self) -> bool:
        return self.engine.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.engine.config.bf16.enabled

    bf16_enabled = bfloat16_enabled

    def bf16_master_weights_and_gradients(self) -> bool:
        return self.engine.config.bf16.bf16_master_weights_and_grads

    def bf16_optimizer_states(self) -> bool:
        return self.engine.config.bf16.bf16_optimizer_states

    def gradient_clipping(self) -> float:
        return self.engine.config.gradient_clipping

    def steps_per_print(self) -> int | float:  # Infinity: never
        return self.engine.config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return bool(self.engine.config.wall_clock_breakdown)

    def collect_python_gc(self) -> int:
        """DeepSpeed's: one collection of Python's cyclic garbage, where the loop allows it
        (`disable_python_gc` itself is warned about: zeromem leaves the collector on)."""
        return gc.collect()

    def optimizer_name(self) -> str | None:
        """The config's optimizer type in lower case, as DeepSpeed names it ("adamw",
        "lamb"); None when the client built the optimizer."""
        block = self.engine.config.optimizer
        return block.type.lower() if block is not None else None

    @property
    def config(self) -> Any:
        """The config as given to `initialize` (a dict, as DeepSpeed's `engine.config`; HF
        reads `config.get("zero_optimization")`); the validated `zeromem.Config` otherwise."""
        return self._ds_config if self._ds_config is not None else self.engine.config

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """DeepSpeed's ZeRO optimizer (optimizer.py); an engine that evaluates only keeps
        the placeholder it was built with."""
        return self._optimizer if self._optimizer is not None else self.engine.optimizer

    @property
    def lr_scheduler(self) -> Any:
        return self.engine.lr_scheduler

    @lr_scheduler.setter
    def lr_scheduler(self, scheduler: Any) -> None:
        """Lightning sets None to step the scheduler itself: the engine then neither steps
        it nor saves it in checkpoints, as DeepSpeed's."""
        self.engine.lr_scheduler = scheduler

    @property
    def global_steps(self) -> int:
        return self.engine.global_steps

    @property
    def micro_steps(self) -> int:
        return self.engine.micro_steps

    @property
    def global_samples(self) -> int:
        return self.engine.counters.global_samples

    @property
    def skipped_steps(self) -> int:
        return self.engine.skipped_steps

    @property
    def loss_scale(self) -> float:
        return self.engine.loss_scale

    def get_lr(self) -> list[float]:
        return self.engine.get_lr()

    def get_mom(self) -> list:
        """Per param group: Adam's `betas`, or SGD's `momentum` (DeepSpeed's get_mom)."""
        return [pg["betas"] if "betas" in pg else pg.get("momentum")
                for pg in self.engine.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        return self.engine.get_global_grad_norm()

    # -- moving ----------------------------------------------------------------
    def to(self, *args, **kwargs) -> DeepSpeedEngine:
        """Accepted when it moves nothing: the engine's buffers stay where they were built."""
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        same_device = device is None or torch.device(device).type == self.device.type
        if not same_device or (dtype is not None and dtype != self.engine.compute_dtype):
            raise NotImplementedError(f"engine.to({device}, {dtype}): the engine lives on "
                                      f"{self.device} in {self.engine.compute_dtype}")
        return self

    # -- checkpoints -------------------------------------------------------------
    def save_checkpoint(self, save_dir, tag: str | None = None, client_state: Any = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """Collective. `latest` is always written (zeromem publishes tags atomically);
        `exclude_frozen_parameters` leaves out parameters with requires_grad False, which a
        load then keeps as the loading model has them.

        A zeromem checkpoint is one directory, written by all ranks; DeepSpeed lets
        each rank write under the `save_dir` it passed. Scripts that name the
        directory after a clock read on each rank (HelloDeepSpeed does) can pass
        different ones, so rank 0's is used by all."""
        _refuse_unsupported(save_latest=(save_latest, True))
        with self.engine.collective("save_checkpoint"):  # before its first collective
            chosen = broadcast_object(str(save_dir), 0, self.engine.comm.group)
            if chosen != str(save_dir):
                log.warning("rank %d: save_checkpoint(%s) writes to rank 0's directory %s",
                            self.global_rank, save_dir, chosen)
            self.engine.save_checkpoint(chosen, tag, client_state if client_state else None,
                                        exclude_frozen_parameters)
        return True

    def load_checkpoint(self, load_dir, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False) -> tuple[str | None, Any]:
        """(path, client_state); (None, None) where `load_dir` holds no checkpoint (no
        `latest`, no tag), as DeepSpeed answers. `load_module_only` (DeepSpeed's warm
        start) loads the weights only: the optimizer, the scheduler, the step counts and
        the random generators stay as they are.

        Loading is strict either way: every trained parameter and buffer must be in the
        checkpoint. The one leniency DeepSpeed users pass `load_module_strict=False` for,
        frozen parameters left out by `save_checkpoint(exclude_frozen_parameters=True)`,
        zeromem grants always (they keep the model's values); anything else missing or
        unexpected is still an error naming the key."""
        if load_module_only:
            load_optimizer_states = load_lr_scheduler_states = False
        run = (self.engine.counters.state_dict(), RngState().state_dict())  # this run's, kept
        with self.engine.collective("load_checkpoint"):
            if tag is None and not broadcast_object(_holds_checkpoints(load_dir), 0,
                                                    self.engine.comm.group):
                # DeepSpeed's answer, which "resume if there is one" scripts test for
                # (OpenRLHF, Lightning); a directory with tags but no `latest` is an error
                log.warning("load_checkpoint: no checkpoint in %s (no 'latest' or "
                            "'latest_universal' file, no tags); nothing loaded", load_dir)
                return None, None
            path, client_state = self.engine.load_checkpoint(load_dir, tag, load_optimizer_states,
                                                             load_lr_scheduler_states)
        if load_module_only:  # the saved run's counts and generators are not this run's
            self.engine.counters.load_state_dict(run[0])
            RngState().load_state_dict(run[1])
        return path, client_state if client_state is not None else {}

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return self.engine.config.zero_optimization.stage3_gather_16bit_weights_on_model_save

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False
                                             ) -> dict[str, torch.Tensor]:
        """The whole model's state dict on global rank 0 ({} elsewhere), keys as the model's
        own, trained parameters in the compute dtype; collective. HF's `save_model` calls it
        at stage 3."""
        with self.engine.collective("_zero3_consolidated_16bit_state_dict"):
            return weights_16bit(self.engine.training_state(), exclude_frozen_parameters,
                                 keep=self.engine.comm.rank == 0)

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False
                                       ) -> dict[str, torch.Tensor]:
        """DeepSpeed 0.17's name for the above, which OpenRLHF's `save_model` calls at stage 3.
        As DeepSpeed's, it answers only where the weights are partitioned."""
        if self.zero_optimization_stage() != 3:
            raise ValueError(f"_consolidated_16bit_state_dict: at ZeRO stage "
                             f"{self.zero_optimization_stage()} the weights are not partitioned; "
                             "module.state_dict() holds them whole (as in DeepSpeed)")
        return self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)

    def save_16bit_model(self, save_dir, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        self.engine.save_16bit_model(save_dir, save_filename, exclude_frozen_parameters)
        return True

    # -- reports and teardown ----------------------------------------------------
    def memory_report(self):
        return self.engine.memory_report()

    def offload_states(self, include=None, device: str = "cpu", pin_memory: bool = True,
                       non_blocking: bool = False) -> None:
        """Model states to host memory until `reload_states` (`Engine.offload_states`);
        OpenRLHF's colocated RLHF calls it through `engine.optimizer` between steps."""
        if offloads_to_host(device):
            self.engine.offload_states(include, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        self.engine.reload_states(non_blocking)

    def empty_partition_cache(self) -> None:
        """Give back the memory of gathered stage-3 parameters (DeepSpeed-Chat and OpenRLHF
        call it after generation); persistent ones are gathered again by the next forward."""
        self.engine.empty_partition_cache()

    def destroy(self) -> None:
        """Release offload storage; the engine must not be used afterwards."""
        self.engine.close()

    def compile(self, backend: str = "inductor", compile_kwargs: dict | None = None,
                schedule: Any = None) -> None:
        """DeepSpeed's `engine.compile(backend=, compile_kwargs=)`, which Accelerate calls for
        a dynamo backend (HF's `TrainingArguments(torch_compile=True)`): the model is
        compiled in place (`nn.Module.compile`); stage 3's hooks stay outside the compiled
        regions (stage3/fetch.py). DeepCompile's `schedule` is not supported."""
        if schedule is not None:
            raise NotImplementedError("engine.compile(schedule=...): DeepCompile schedules are "
                                      "not supported; compile without one")
        self.module.compile(backend=backend, **(compile_kwargs or {}))
        self._compiled = True

    @property
    def is_compiled(self) -> bool:
        return self.__dict__.get("_compiled", False)


def _holds_checkpoints(load_dir) -> bool:
    root = Path(load_dir)
    return holds_pointer(root) or bool(available_tags(root))


def _refuse_unsupported(**given: tuple[Any, Any]) -> None:
    """DeepSpeed keyword arguments zeromem does not honour: an error when set away from the
    default, never a silent no-op (a checkpoint without `latest`, or with frozen weights the
    caller meant to leave out, would surprise a later load)."""
    for name, (value, default) in given.items():
        if value != default:
            raise NotImplementedError(f"{name}={value!r} is not supported by zeromem "
                                      f"(only {default!r}): leave it at its default")
