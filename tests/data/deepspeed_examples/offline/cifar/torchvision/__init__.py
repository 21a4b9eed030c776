"""Test stand-in for `torchvision` (CIFAR-10 cannot be downloaded here; torchvision is not installed).

Only what `cifar10_deepspeed.py` uses: `datasets.CIFAR10` (deterministic synthetic
32x32 RGB images with labels 0-9) and `transforms.Compose/ToTensor/Normalize`.
Put this folder first on PYTHONPATH to run the example offline.
"""
from . import datasets, transforms

__all__ = ["datasets", "transforms"]
