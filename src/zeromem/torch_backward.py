"""`loss.backward()` through an engine's outputs, as with a plain module (DeepSpeed 0.18+).

`engine.backward(loss)` opens the engine's backward, scales the loss and closes the
backward when autograd returns. A loop written for DDP or FSDP2 calls `loss.backward()`
itself, and DeepSpeed 0.18+ accepts that too. `OutputHooks` sees such a backward reach
the tensors the engine's forward returned: the first of them in a graph task opens
the engine's backward (the same bookkeeping as `engine.backward`), and its close is
queued for the end of that graph task. The gradients are scaled where the engine takes
them in, not on the outputs: an output computed from another (a Hugging Face model's
loss from its logits) would be scaled twice there.

Two backwards reach the outputs and are not the engine's, left as they were before:
- one that an `engine.backward` started: another engine's loss through this module (a
  GAN's generator step through the discriminator) keeps PyTorch's meaning, gradients
  left in `param.grad`. Autograd's graph tasks belong to the process, so the record of
  which of them an engine started (`ENGINE_TASKS`) does too;
- `torch.autograd.grad` (a gradient penalty), which accumulates no parameter gradient.
"""
from __future__ import annotations

from collections.abc import Mapping
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import torch
from torch.autograd import Variable
from torch.autograd.graph import _get_grad_fn_or_grad_acc

# the graph tasks an engine.backward started and has not seen end, any engine's
ENGINE_TASKS: set[int] = set()


@contextmanager
def engine_task() -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
    """Around `engine.backward`'s autograd call: gives a function that marks the scaled
    loss, whose graph task is then known as an engine's until the block ends."""
    started: list[int] = []

    def record(_grad: torch.Tensor) -> None:
        started.append(torch._C._current_graph_task_id())
        ENGINE_TASKS.add(started[-1])

    def mark(loss: torch.Tensor) -> torch.Tensor:
        if loss.requires_grad:
            loss.register_hook(record)  # the root: its hook runs first in the graph task
        return loss

    try:
        yield mark
    finally:
        ENGINE_TASKS.difference_update(started)


def output_tensors(out: object) -> Iterator[torch.Tensor]:
    """The tensors that carry a gradient in a forward's result: a tensor, or one inside
    tuples, lists and mappings (a Hugging Face `ModelOutput` is one)."""
    if isinstance(out, torch.Tensor):
        if out.grad_fn is not None:
            yield out
    elif isinstance(out, (tuple, list)):
        for item in out:
            yield from output_tensors(item)
    elif isinstance(out, Mapping):
        for item in out.values():
            yield from output_tensors(item)


class OutputHooks:
    """Opens the engine's backward when a backward of the user's own reaches its outputs.

    `opens()` is the engine's bookkeeping before a backward; it returns what closes it."""

    def __init__(self, params: Sequence[torch.nn.Parameter], opens: Callable[[], Callable[[], None]]):
        self.params = [p for p in params if p.requires_grad]
        self.opens = opens
        self.task: int | None = None  # the graph task of the backward opened, until it ends

    def watch(self, out: object) -> None:
        for tensor in output_tensors(out):
            tensor.register_hook(self._reached)

    def _reached(self, _grad: torch.Tensor) -> None:
        task = torch._C._current_graph_task_id()
        if task == self.task or task in ENGINE_TASKS or not self._accumulates():
            return
        close = self.opens()
        self.task = task

        def closed() -> None:
            self.task = None
            close()
        Variable._execution_engine.queue_callback(closed)

    def _accumulates(self) -> bool:
        """Whether this graph task accumulates into the parameters' `.grad` (a backward),
        rather than returning gradients (`torch.autograd.grad`)."""
        try:
            return any(torch._C._will_engine_execute_node(_get_grad_fn_or_grad_acc(p))
                       for p in self.params)
        except RuntimeError:  # "... currently running autograd.grad()": not a backward
            return False
