"""What the engine reports besides training: DeepSpeed's monitors (csv, TensorBoard, wandb),
comms_logger, flops_profiler and per-phase timers.
"""
