"""The optimizer side DeepSpeed's config names: its own optimizers (Lamb, Lion, Adam without bias
correction), building the optimizer a config asks for, and its learning-rate schedules.
"""
