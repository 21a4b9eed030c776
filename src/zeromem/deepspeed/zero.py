"""DeepSpeed's `deepspeed.zero`: `Init` and `GatheredParameters` with DeepSpeed's arguments.

Both delegate to `zeromem.stage3.partitioned_init`; this module only maps DeepSpeed's keyword
names (`config_dict_or_path`, `data_parallel_group`, `fwd_module`) onto zeromem's.
`ZeroParamStatus` is the enum of the `ds_status` a stage-3 parameter carries (ds_attributes.py).
"""
from __future__ import annotations

import enum
import logging

from torch import nn

from ..ds_attributes import ZeroParamStatus
from ..stage3 import partitioned_init as partition

log = logging.getLogger("zeromem")


class Init(partition.Init):
    """`with deepspeed.zero.Init(config_dict_or_path=ds_config): model = Net()`.

    Builds modules with their parameters already partitioned over the data-parallel
    group. `remote_device`, `pin_memory` and `dtype` are accepted and not acted on:
    where partitions live is decided by the config's `offload_param` (with
    `device: nvme`, Init already writes them to its `nvme_path`, as DeepSpeed does
    when `remote_device` is left to the config). `module=` (partitioning an already built model)
    and `mpu=` are not supported.
    """

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear: bool = True,
                 remote_device=None, pin_memory: bool = False, config_dict_or_path=None,
                 config=None, enabled: bool = True, dtype=None, mpu=None, **unsupported):
        if module is not None or mpu is not None or unsupported:
            names = ["module"] * (module is not None) + ["mpu"] * (mpu is not None) + [*unsupported]
            raise NotImplementedError(f"zeromem.deepspeed.zero.Init: {', '.join(names)} "
                                      "not supported; build the model inside the context")
        if remote_device not in (None, "cpu") and enabled:
            log.info("zero.Init(remote_device=%r): placement follows the config's offload_param",
                     remote_device)
        super().__init__(config=config_dict_or_path if config is None else config,
                         dp_group=data_parallel_group, enabled=enabled)


class GatheredParameters(partition.GatheredParameters):
    """`with deepspeed.zero.GatheredParameters(params, modifier_rank=0):` whole parameters inside.

    `fwd_module` (DeepSpeed registers external parameters with it) is accepted
    and unused: zeromem's fetch units are found from the parameters themselves.
    """

    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None,
                 enabled: bool = True):
        super().__init__(params, modifier_rank=modifier_rank, enabled=enabled)


class OffloadDeviceEnum(str, enum.Enum):
    """DeepSpeed's `runtime.zero.offload_config.OffloadDeviceEnum` (`offload_states`' device)."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, enum.Enum):
    """DeepSpeed's state kinds for `offload_states(include=...)` (offload/states.py)."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


def offloads_to_host(device) -> bool:
    """`offload_states(device=...)`: True for the host; "none" moves nothing (logged, as
    DeepSpeed); anything else is refused, as DeepSpeed refuses NVMe there."""
    where = str(getattr(device, "value", device))
    if where == "none":
        log.warning("offload_states(device=none): nothing moved, as in DeepSpeed")
        return False
    if where != "cpu":
        raise ValueError(f"offload_states(device={where!r}): only the host (\"cpu\") holds "
                         "offloaded states, as in DeepSpeed")
    return True


def register_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """DeepSpeed's way to say that `module`'s forward uses `parameter`, which another module
    owns (HF's wav2vec2 / HuBERT positional convolution registers its weight-norm
    parameters so). Nothing to do: zeromem traces which parameters each forward uses
    (stage3/fetch.py) and gathers them with the unit that uses them."""


def unregister_external_parameter(module: nn.Module, parameter: nn.Parameter) -> None:
    """The undoing of `register_external_parameter`: nothing to undo."""


__all__ = ["Init", "GatheredParameters", "ZeroParamStatus", "register_external_parameter",
           "unregister_external_parameter", "OffloadDeviceEnum", "OffloadStateTypeEnum"]
