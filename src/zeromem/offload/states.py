"""Model states out of device memory between steps and back: DeepSpeed's engine
`offload_states` / `reload_states`.

Colocated RLHF frees the GPU this way: OpenRLHF's `--deepspeed_enable_sleep` moves the
trainer's optimizer states, fp32 masters and gradient buffers to host memory while vLLM
generates on the same GPU, then reloads them for the next training step.

Each tensor keeps its identity, its views and its place in the optimizer: its storage is
copied to host memory (pinned if asked) and resized to nothing, and reloading regrows the
storage and copies the bytes back, FSDP's way of freeing a parameter. What was held comes
back bit for bit, an unfinished accumulation's gradients included. Only tensors on the
engine's device move: torch's per-parameter `step` counters live on the host already.

DeepSpeed's state kinds and what each names here:

    optim_states            the optimizer's state tensors (Adam's moments)
    hp_params               the fp32 master shards, where they are not the parameters
                            themselves (16-bit training)
    lp_grads,               the gradient buffers (zeromem keeps one buffer kind per group:
    contiguous_grad_buffer  whole at stages 0-1, the contiguous shards at 2-3); either
                            name moves them
    lp_params               the parameters: not moved (refused); the forward needs them
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import torch

if TYPE_CHECKING:
    from zeromem.flat import FlatParamGroup
    from zeromem.offload.placement import OffloadPolicy

KINDS = ("optim_states", "hp_params", "lp_grads", "contiguous_grad_buffer", "lp_params")
MOVED = KINDS[:4]


def chosen_kinds(include: Iterable[str] | None) -> set[str]:
    """The kinds `include` names (DeepSpeed's enum members or their strings); all that move
    when it is None. Unknown names and `lp_params` are refused, naming them."""
    if include is None:
        return set(MOVED)
    kinds = {str(getattr(kind, "value", kind)) for kind in include}
    unknown = kinds - set(KINDS)
    if unknown:
        raise ValueError(f"offload_states(include=...): unknown state kinds {sorted(unknown)}; "
                         f"DeepSpeed's are {list(KINDS)}")
    if "lp_params" in kinds:
        raise NotImplementedError(
            "offload_states(include=[lp_params]): zeromem does not move the parameters, which "
            "every forward reads; the other kinds hold 14 of the 16 bytes a parameter takes "
            "in mixed-precision Adam (gradient 2, master 4, moments 8)")
    return kinds


def state_tensors(kinds: set[str], groups: list[FlatParamGroup],
                  optimizer: torch.optim.Optimizer, policy: OffloadPolicy) -> list[torch.Tensor]:
    """The tensors of `kinds` (`chosen_kinds`) among the flat groups' and the optimizer's.
    Refused where `offload_optimizer` or `offload_param` already keep states off the device,
    as DeepSpeed refuses it."""
    if policy.optimizer != "device" or policy.params != "device":
        raise NotImplementedError(
            "offload_states: with offload_optimizer or offload_param set, those states live "
            "off the device already (DeepSpeed refuses this too)")
    tensors: list[torch.Tensor] = []
    if "optim_states" in kinds:
        tensors += [t for state in optimizer.state.values() for t in state.values()
                    if torch.is_tensor(t)]
    if "hp_params" in kinds:
        tensors += [g.master for g in groups if not g.master_aliases_params()]
    if kinds & {"lp_grads", "contiguous_grad_buffer"}:
        tensors += [t for g in groups for t in g.grad_held()]
    return tensors


class StatesOffload:
    """The host copies of the storages `offload` emptied, until `reload` puts them back."""

    def __init__(self, device: torch.device):
        self.device = device
        self._saved: list[tuple[torch.UntypedStorage, torch.Tensor]] = []

    def check_loaded(self, call: str) -> None:
        if self._saved:
            raise RuntimeError(f"{call}: the model states are offloaded (offload_states); "
                               "call reload_states() first")

    def offload(self, tensors: Iterable[torch.Tensor], pin_memory: bool,
                non_blocking: bool) -> None:
        """Copy each storage of `tensors` on the device to host memory, then free it. The
        caching allocator reuses freed device memory in stream order, after the copy. (The
        engine refuses a second offload before the reload: `check_loaded`.)"""
        pin = pin_memory and self.device.type == "cuda"
        seen: set[int] = set()
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if tensor.device.type != self.device.type or storage.nbytes() == 0 or \
                    storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
            host.copy_(_bytes_of(storage), non_blocking=non_blocking and pin)
            self._saved.append((storage, host))
        if self.device.type == "cuda" and not non_blocking:
            torch.cuda.current_stream(self.device).synchronize()
        for storage, _ in self._saved:
            storage.resize_(0)

    def reload(self, non_blocking: bool) -> None:
        """Regrow every emptied storage and copy its bytes back."""
        for storage, host in self._saved:
            storage.resize_(host.numel())
            _bytes_of(storage).copy_(host, non_blocking=non_blocking and host.is_pinned())
        self._saved = []


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
