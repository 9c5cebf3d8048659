"""A plain MLP classifier (for scikit-learn's 8x8 digits)."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, inputs: int = 64, hidden: int = 128, classes: int = 10, dropout: float = 0.0):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(inputs, hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def sample_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels, reduction="none")


def per_sample_loss(model: nn.Module, batch) -> torch.Tensor:
    features, labels = batch
    return sample_losses(model(features), labels)
