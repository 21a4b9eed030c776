"""DeepSpeed's memory estimators, where its users call them.

`deepspeed.runtime.zero.stage3.estimate_zero3_model_states_mem_needs_all_live(model,
num_gpus_per_node, num_nodes)` and its `_all_cold(total_params, largest_layer_params, ...)`
form, and the stage-2 pair in `deepspeed.runtime.zero.stage_1_and_2`, print the memory
that model states need per GPU and per node's CPU for each offload option (HF's DeepSpeed
guide opens its memory section with them). The figures are DeepSpeed's own formulas
(planning/estimate.py `deepspeed_estimate`), so a script prints what it printed under
DeepSpeed; `zeromem plan` gives zeromem's, from the model's real shapes. Registered
under DeepSpeed's module names by `install_as_deepspeed`.
"""
from __future__ import annotations

from torch import nn

from ..planning.estimate import deepspeed_estimate, format_bytes

GIB = "GiB"


def model_to_params(model: nn.Module) -> tuple[int, int]:
    """(parameters, each shared one counted once; the most any one module holds directly),
    whole sizes also for parameters partitioned under zero.Init (`ds_numel`)."""
    def numel(p: nn.Parameter) -> int:
        return int(getattr(p, "ds_numel", p.numel()))
    total = sum({id(p): numel(p) for p in model.parameters()}.values())
    largest = max((sum(numel(p) for p in m.parameters(recurse=False)) for m in model.modules()),
                  default=0)
    return total, largest


def estimate_zero3_model_states_mem_needs_all_live(model: nn.Module, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:
    total, largest = model_to_params(model)
    estimate_zero3_model_states_mem_needs_all_cold(total, largest, num_gpus_per_node, num_nodes,
                                                   additional_buffer_factor)


def estimate_zero3_model_states_mem_needs_all_cold(total_params: int, largest_layer_params: int,
                                                   num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:
    rows = [(f"offload_param={param}, offload_optimizer={opt}, zero_init={init}",
             deepspeed_estimate(total_params, largest_layer_params, 3, num_gpus_per_node,
                                num_nodes, opt == "cpu", param == "cpu", init == 1,
                                additional_buffer_factor))
            for param, opt in (("cpu", "cpu"), ("none", "cpu"), ("none", "none"))
            for init in (1, 0)]
    _print(3, total_params, largest_layer_params, num_gpus_per_node, num_nodes, rows)


def estimate_zero2_model_states_mem_needs_all_live(model: nn.Module, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:
    total, _ = model_to_params(model)
    estimate_zero2_model_states_mem_needs_all_cold(total, num_gpus_per_node, num_nodes,
                                                   additional_buffer_factor)


def estimate_zero2_model_states_mem_needs_all_cold(total_params: int, num_gpus_per_node: int = 1,
                                                   num_nodes: int = 1,
                                                   additional_buffer_factor: float = 1.5) -> None:
    rows = [(f"offload_optimizer={opt}",
             deepspeed_estimate(total_params, 0, 2, num_gpus_per_node, num_nodes, opt == "cpu",
                                buffer_factor=additional_buffer_factor))
            for opt in ("cpu", "none")]
    _print(2, total_params, None, num_gpus_per_node, num_nodes, rows)


def _print(stage: int, total: int, largest: int | None, gpus: int, nodes: int,
           rows: list) -> None:
    layer = "" if largest is None else f", largest layer {largest / 1e6:.0f}M"
    print(f"ZeRO-{stage} model states by DeepSpeed's estimator, {nodes} node(s) x {gpus} GPU(s), "
          f"{total / 1e6:.0f}M parameters{layer}:")
    print(f"{'CPU per node':>14} | {'per GPU':>10} | options")
    for options, figure in rows:
        print(f"{format_bytes(figure.cpu_bytes, GIB) + ' GiB':>14} | "
              f"{format_bytes(figure.gpu_bytes, GIB) + ' GiB':>10} | {options}")
    print("(zeromem's own figures, from the model's real shapes: `zeromem plan`)")
