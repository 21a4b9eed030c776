"""`Compose`, `ToTensor` (HWC uint8 -> CHW float in [0, 1]) and `Normalize`, as torchvision's."""
from __future__ import annotations

import torch


class Compose:
    def __init__(self, transforms):
        self.transforms = list(transforms)

    def __call__(self, x):
        for t in self.transforms:
            x = t(x)
        return x


class ToTensor:
    def __call__(self, image) -> torch.Tensor:
        return torch.from_numpy(image).permute(2, 0, 1).float().div(255)


class Normalize:
    def __init__(self, mean, std):
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std
