"""Training checkpoints: sharded atomic save and load under any world size (`save_load`,
`state`, `manifest`), tensor files and consolidation (`tensor_files`, `consolidate`). Not to
be confused with activation checkpointing (`zeromem.activations.recompute`).
"""
