"""Synthetic `CIFAR10`: same shapes and types as the real one, a few samples, no download.

`ZEROMEM_CIFAR_SAMPLES` sets the training-set size (default 64); the test set is
a quarter of it. Samples depend only on (train, index), never on the rank.
"""
from __future__ import annotations

import os

import numpy as np


class CIFAR10:
    def __init__(self, root: str, train: bool = True, download: bool = False, transform=None,
                 target_transform=None):
        size = int(os.environ.get("ZEROMEM_CIFAR_SAMPLES", 64)) // (1 if train else 4)
        rng = np.random.default_rng(0 if train else 1)
        self.data = rng.integers(0, 256, size=(size, 32, 32, 3), dtype=np.uint8)  # HWC, as CIFAR
        # every class in the test set: the script divides by each class's count
        self.targets = ([int(t) for t in rng.integers(0, 10, size=size)] if train
                        else [i % 10 for i in range(size)])
        self.transform = transform
        self.target_transform = target_transform

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        image, target = self.data[index], self.targets[index]
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target
