"""DeepSpeed's `deepspeed.accelerator.get_accelerator()`: the device a script trains on.

DeepSpeed scripts ask this object, not `torch.cuda`, for device names, counts and
synchronisation, so that the same script runs on CUDA and on CPUs. zeromem trains
on CUDA when it is available (NCCL) and on CPUs otherwise (gloo); the accelerator
answers for whichever of the two this process uses.
"""
from __future__ import annotations

import os

import torch


class Accelerator:
    """The subset of DeepSpeed's accelerator interface that training scripts call."""

    def __init__(self, kind: str):
        self._name = kind  # "cuda" or "cpu"
        self._backend = "nccl" if kind == "cuda" else "gloo"

    # -- devices ---------------------------------------------------------------
    def device_name(self, device_index: int | None = None) -> str:
        """'cuda' or 'cuda:<i>'; always 'cpu' on CPUs (as DeepSpeed's CPU accelerator)."""
        if self._name == "cpu" or device_index is None:
            return self._name
        return f"{self._name}:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._name == "cuda" else 0

    def current_device_name(self) -> str:
        return self.device_name(self.current_device()) if self._name == "cuda" else "cpu"

    def set_device(self, device_index: int) -> None:
        if self._name == "cuda":
            torch.cuda.set_device(device_index)

    def device_count(self) -> int:
        """CUDA devices; on CPUs the ranks on this node (torchrun's LOCAL_WORLD_SIZE) or 1."""
        if self._name == "cuda":
            return torch.cuda.device_count()
        return int(os.environ.get("LOCAL_WORLD_SIZE", 1))

    def is_available(self) -> bool:
        return torch.cuda.is_available() if self._name == "cuda" else True

    def synchronize(self, device_index: int | None = None) -> None:
        if self._name == "cuda":
            torch.cuda.synchronize(device_index)

    def is_synchronized_device(self) -> bool:
        """True where kernels finish before the call returns (no streams to wait on)."""
        return self._name == "cpu"

    def communication_backend_name(self) -> str:
        return self._backend

    # -- dtypes ----------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._name == "cuda" else True

    def is_fp16_supported(self) -> bool:
        return self._name == "cuda"

    def supported_dtypes(self) -> list[torch.dtype]:
        dtypes = [torch.float32]
        dtypes += [torch.float16] if self.is_fp16_supported() else []
        dtypes += [torch.bfloat16] if self.is_bf16_supported() else []
        return dtypes

    # -- random numbers --------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)  # seeds CUDA generators too

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        if self._name == "cuda":
            return torch.cuda.get_rng_state(device_index if device_index is not None else "cuda")
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if self._name == "cuda":
            torch.cuda.set_rng_state(new_state, device_index if device_index is not None else "cuda")
        else:
            torch.set_rng_state(new_state)

    # -- memory ----------------------------------------------------------------
    def empty_cache(self) -> None:
        if self._name == "cuda":
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._name == "cuda" else 0

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self._name == "cuda" else 0

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._name == "cuda":
            torch.cuda.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        if self._name == "cuda":
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._name == "cuda" else tensor

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name


def get_accelerator() -> Accelerator:
    """The accelerator this process trains on: CUDA when available, else the CPU.

    A new, stateless object each call (DeepSpeed keeps a process-wide one; the
    answers are the same)."""
    return Accelerator("cuda" if torch.cuda.is_available() else "cpu")
