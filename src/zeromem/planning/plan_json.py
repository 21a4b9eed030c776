"""`zeromem plan --json`: every setup the planner considered, machine-readable.

    {"setups": [{"name", "stage", "checkpointing", "offload_optimizer", "offload_param",
                 "states_bytes", "activation_bytes", "buffer_bytes", "device_bytes",
                 "host_bytes_per_node", "nvme_bytes_per_node", "step_seconds": [best, worst],
                 "fits", ...}, ...],
     "recommended": NAME, "memory_for": "cuda" | "cpu", ...}

Bytes are per GPU unless the key says per node; `step_seconds` runs from full
overlap of compute, communication and offload traffic to none (plus the optimizer
step), from the speeds measured by `--calibrate` when given ("step_seconds_from"
holds them), else from the assumed GPU cluster's. Each setup also
carries its host, NVMe and buffer breakdowns by name and the call its checkpointing
needs. "memory_for" names the device the bytes are planned for: "cuda" (GPUs), or
"cpu" when `--calibrate` measured ranks computing on this machine's CPU, where host
memory is the device's and the engine holds an fp32 gradient once (`predict_memory`).
"""
from __future__ import annotations

from zeromem.planning.planner import Candidate, Plan, checkpointing_call


def setup_json(c: Candidate, gpus_per_node: int) -> dict:
    """One setup's figures (see the module docstring)."""
    s, node = c.setup, gpus_per_node
    host_parts = dict(c.states.host)
    if c.activations.host:
        host_parts["activation_checkpoints"] = c.activations.host
    return {
        "name": s.label(), "stage": s.stage, "checkpointing": s.checkpointing,
        "offload_optimizer": s.offload_optimizer, "offload_param": s.offload_param,
        "states_bytes": c.states.model_state_bytes, "activation_bytes": c.activations.device,
        "buffer_bytes": c.states.gathered_params + c.states.comm_buffers,
        "device_bytes": c.device_bytes, "host_bytes_per_node": c.host_bytes * node,
        "nvme_bytes_per_node": c.nvme_bytes * node,
        "step_seconds": [c.time.overlapped, c.time.serial], "fits": c.fits,
        "host_bytes_per_rank_by_part": host_parts,
        "nvme_bytes_per_rank_by_part": dict(c.states.nvme),
        # buffer_bytes by part: gathered stage-3 units, and the communication buffers
        # (grad_buckets, reduce_scatter_receive on gloo, gather_chunks) at their peak
        "buffer_bytes_by_part": {"gathered_params": c.states.gathered_params, **c.states.comm},
        "needs": checkpointing_call(s),
    }


def plan_json(p: Plan) -> dict:
    """{"setups": [...], "recommended": NAME} for `p`."""
    node = p.hardware.gpus_per_node
    cal = p.hardware.calibration
    return {"setups": [setup_json(c, node) for c in p.candidates],
            "recommended": p.chosen.setup.label(), "reasons": list(p.reasons),
            "config": p.config, "memory_for": p.hardware.device,
            # where step_seconds come from: this machine (`--calibrate`) or the assumed speeds
            "step_seconds_from": cal.to_dict() if cal is not None else "assumed"}


def needs_nvme_path(p: Plan) -> bool:
    """The recommended setup swaps to NVMe and its config names no directory."""
    s = p.chosen.setup
    zero = p.config.get("zero_optimization", {})
    named = all(zero.get(k, {}).get("nvme_path") for k in ("offload_optimizer", "offload_param")
                if zero.get(k, {}).get("device") == "nvme")
    return "nvme" in (s.offload_optimizer, s.offload_param) and not named
