"""Activation checkpointing (ZeRO-R Pa, Pa+cpu, MD): `recompute` holds `zeromem.checkpoint` and
the per-engine policy; `store` keeps the checkpointed inputs (partitioned, on host, pooled).
Not to be confused with training checkpoints (`zeromem.checkpoints.save_load`).
"""
