"""ZeRO-3: fetch units (`gather`) gathered on demand by their schedule (`fetch`), and building
models already partitioned (`partitioned_init`: `Init`, `GatheredParameters`).
"""
