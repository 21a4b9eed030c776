"""ZeRO-3: fetch units gathered on demand and their schedule (`fetch`), and building models
already partitioned (`partitioned_init`: `Init`, `GatheredParameters`).
"""
