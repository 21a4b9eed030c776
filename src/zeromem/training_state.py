"""The narrow boundary between the engine and its training checkpoints.

The engine hands `checkpoints/save_load.py` a `TrainingState`: the module, the flat groups,
the optimizer, the communicator, a few facts of the run, and the small pieces of
state as `Stateful` objects (torchtitan's protocol): the loss scaler, the lr
scheduler, the step counters and the random number generators. Checkpoint code
reads and restores through these objects only; it never reaches into the engine.
"""
from __future__ import annotations

import random
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from zeromem.comm import Comm

if TYPE_CHECKING:
    from zeromem.flat import FlatParamGroup


@runtime_checkable
class Stateful(Protocol):
    """An object whose state a checkpoint saves and restores (torchtitan's `Stateful`)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# what `initialize(lr_scheduler=...)` takes: a scheduler, a factory `optimizer -> scheduler`,
# or None (the config's `scheduler` block)
SchedulerArg = LRScheduler | Callable[[torch.optim.Optimizer], LRScheduler] | None


@dataclass(frozen=True)
class BatchSizes:
    """How many samples an optimizer step takes: DeepSpeed's three batch keys."""

    micro: int  # samples a rank runs in one forward (`train_micro_batch_size_per_gpu`)
    accumulation: int  # micro-steps per optimizer step (`gradient_accumulation_steps`)
    ranks: int  # data-parallel ranks

    @property
    def train(self) -> int:
        """`train_batch_size`: samples per optimizer step, all ranks together."""
        return self.micro * self.accumulation * self.ranks

    def with_train(self, train_batch_size: int) -> BatchSizes:
        """This micro-batch, with the accumulation steps `train_batch_size` takes."""
        per_micro_step = self.micro * self.ranks
        if train_batch_size <= 0 or train_batch_size % per_micro_step:
            raise ValueError(f"train_batch_size {train_batch_size} is not a positive multiple of "
                             f"micro-batch {self.micro} x {self.ranks} ranks = {per_micro_step}")
        return replace(self, accumulation=train_batch_size // per_micro_step)

    def with_micro(self, micro_batch_size: int) -> BatchSizes:
        if micro_batch_size <= 0:
            raise ValueError(f"train_micro_batch_size_per_gpu {micro_batch_size} is not positive")
        return replace(self, micro=micro_batch_size)


class StepCounters:
    """Global, micro and skipped step counts, and the batch sizes they count in; the engine
    advances and resizes them, checkpoints restore them.

    Owns the batch sizes because where the accumulation boundary falls is a question
    about the micro-steps run since the last one, unless the training loop announces it
    (`announce_boundary`). Counting from the last boundary, not from the start, keeps
    every accumulation whole when the batch changes during training (Megatron-DeepSpeed's
    batch ramp-up calls `set_train_batch_size` before every step).
    """

    def __init__(self, batch: BatchSizes) -> None:
        self.batch = batch
        self.global_steps = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self.global_samples = 0
        self.window_start = 0  # the micro-step count at the last boundary
        self.backwards = 0  # in this window; what an announced window counts its samples by
        # Accelerate (under HF's Trainer too) says before each backward whether it ends an
        # accumulation, and calls step() only when it does: the micro-step count then no
        # longer tells. Once announced, the announcement decides, as in DeepSpeed.
        self.announced: bool | None = None

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.batch.accumulation

    def resize(self, batch: BatchSizes) -> None:
        """Take `batch` from now on. A new accumulation count is refused in the middle of an
        accumulation: the micro-steps run were scaled by the old one."""
        if batch.accumulation != self.batch.accumulation and self.mid_accumulation():
            run = self.micro_steps - self.window_start
            raise ValueError(
                f"gradient_accumulation_steps cannot change from {self.batch.accumulation} to "
                f"{batch.accumulation} in the middle of an accumulation ({run} micro-steps run "
                "since the last optimizer step): change the batch size before a window's "
                "first forward")
        self.batch = batch

    def announce_boundary(self, is_boundary: bool) -> None:
        """The training loop's word on the micro-step about to run (DeepSpeed's
        `set_gradient_accumulation_boundary`); it holds until the next announcement."""
        self.announced = is_boundary

    def at_boundary(self) -> bool:
        """Whether the micro-step now running ends a gradient accumulation."""
        if self.announced is not None:
            return self.announced
        return self.micro_steps + 1 - self.window_start >= self.batch.accumulation

    def mid_accumulation(self) -> bool:
        """Whether some micro-steps of an unfinished accumulation have run."""
        if self.announced is not None:
            return not self.announced
        return self.micro_steps != self.window_start

    def advance_backward(self) -> None:
        self.backwards += 1

    def advance_micro(self, boundary: bool) -> None:
        """A `step()` call; `boundary`: it ended an accumulation."""
        self.micro_steps += 1
        if boundary:
            self.window_start = self.micro_steps

    def advance_global(self, skipped: bool) -> None:
        """One optimizer step ran (or was skipped on overflow). Its samples, as DeepSpeed
        counts them: the batch, or the backwards run when the loop announces boundaries."""
        self.global_steps += 1
        self.skipped_steps += int(skipped)
        self.global_samples += (self.batch.train if self.announced is None
                                else self.backwards * self.batch.micro * self.batch.ranks)
        self.backwards = 0

    def state_dict(self) -> dict[str, int]:
        return {"global_steps": self.global_steps, "micro_steps": self.micro_steps,
                "skipped_steps": self.skipped_steps, "global_samples": self.global_samples,
                "gradient_accumulation_steps": self.gradient_accumulation_steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        gas = self.gradient_accumulation_steps
        self.global_steps = state["global_steps"]
        self.skipped_steps = state["skipped_steps"]
        # With another accumulation count the saved micro-step count would misplace boundaries.
        same = state.get("gradient_accumulation_steps") == gas
        self.micro_steps = state["micro_steps"] if same else state["global_steps"] * gas
        self.window_start = self.micro_steps - self.micro_steps % gas
        # a checkpoint written before zeromem counted samples: DeepSpeed's estimate
        self.global_samples = state.get("global_samples", self.global_steps * self.batch.train)


class RngState:
    """This process's random number generators: torch CPU, each CUDA device, Python, numpy."""

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"cpu": torch.get_rng_state(), "cuda": [],
                                 "python": random.getstate()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = list(torch.cuda.get_rng_state_all())
        try:
            import numpy as np
        except ImportError:
            return state
        state["numpy"] = np.random.get_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.set_rng_state(state["cpu"])
        if state["cuda"] and torch.cuda.is_available():
            for i, cuda in enumerate(state["cuda"][:torch.cuda.device_count()]):
                torch.cuda.set_rng_state(cuda, i)
        random.setstate(state["python"])
        if "numpy" in state:
            import numpy as np
            np.random.set_state(state["numpy"])


@dataclass(frozen=True)
class TrainingState:
    """Everything a training checkpoint reads and writes, built by the engine on each call."""

    module: nn.Module
    groups: list[FlatParamGroup]  # in the engine's order (the order of pieces on disk)
    optimizer: torch.optim.Optimizer
    comm: Comm
    device: torch.device
    stateful: dict[str, Stateful]
    """"counters", "scaler", "rng", and "lr_scheduler" when the engine has one."""
    zero_stage: int
    compute_dtype: torch.dtype
    optimizer_type: str
    """The algorithm, lower case (config `optimizer.type`, else the optimizer's class)."""
    tag_validation: str
    """`checkpoint.tag_validation`: Warn, Fail or Ignore."""
    gather_16bit_weights: bool
    """`zero_optimization.stage3_gather_16bit_weights_on_model_save`."""
    all_in_memory: Callable[[], AbstractContextManager]
    """Brings offloaded masters and optimizer states into memory for the duration."""
    refresh_params: Callable[[], None]
    """Rebuilds the compute-dtype parameters from the masters and drops gradients."""
    frozen_groups: list[FlatParamGroup] = field(default_factory=list)
    """Stage 3: the flat groups of parameters frozen at `initialize`, sharded, not trained;
    checkpointed whole with the buffers (as module tensors)."""
    param_order: list[list[tuple[str, bool]]] = field(default_factory=list)
    """(name, requires grad) of the parameters of each param group `initialize` was given,
    in order: the positions of a DeepSpeed stage-0 checkpoint's optimizer states."""

    @property
    def counters(self) -> StepCounters:
        counters = self.stateful["counters"]
        assert isinstance(counters, StepCounters)
        return counters

    @property
    def lr_scheduler(self) -> Stateful | None:
        return self.stateful.get("lr_scheduler")
