"""Activation checkpointing (ZeRO-R Pa, Pa+cpu, MD): `recompute` holds `zeromem.checkpoint` and
the per-engine policy and store. Not to be confused with training checkpoints
(`zeromem.checkpoints.save_load`).
"""
