"""The training recipe tests' tiny model and its run options: tests/unit/training/test_recipe.py's
in-process runs, tests/integration/test_recipe_runs.py's and their worker, tests/scripts/recipe_job.py."""

from __future__ import annotations

import torch
from torch import nn

TINY = [
    "MODEL.ARCH",
    "recipe_cnn",
    "TRAIN.IM_SIZE",
    "16",
    "TEST.IM_SIZE",
    "16",
    "OPTIM.BASE_LR",
    "0.1",
    "LOG.PLOT",
    "False",
]


class RecipeCNN(nn.Module):
    """Two 3x3 convolutions and a linear head, no BatchNorm, so that a batch's update does not
    depend on how it is split; its two largest tensors (2,304 and 2,560) let ZeRO-1 split it evenly."""

    def __init__(self, num_classes: int):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveMaxPool2d(4),
        )  # fmt: skip
        self.fc = nn.Linear(16 * 4 * 4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x).flatten(1))
