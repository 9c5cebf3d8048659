"""A DLRM-style click model (Naumov et al. 2019): one embedding table per categorical feature, a
bottom MLP for the dense features, pairwise dot products of all of them, a top MLP to a logit."""

import torch
import torch.nn as nn
import torch.nn.functional as F


def _mlp(widths: list[int], last_activation: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (inputs, outputs) in enumerate(zip(widths, widths[1:])):
        layers.append(nn.Linear(inputs, outputs))
        if i < len(widths) - 2 or last_activation:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    sparse = True
    """Its embedding tables train sparse: a batch touches a few of their rows (row-wise optimizer)."""

    def __init__(self, rows: tuple[int, ...], dim: int, dense: int, hidden: int):
        super().__init__()
        self.tables = nn.ModuleList(nn.Embedding(count, dim) for count in rows)
        for table in self.tables:  # small initial vectors, as DLRM's uniform(±1/sqrt(rows)) keeps them
            nn.init.normal_(table.weight, std=0.05)
        self.bottom = _mlp([dense, hidden, dim], last_activation=True)
        features = len(rows) + 1
        self.pairs = torch.triu_indices(features, features, offset=1, device="cpu")
        self.top = _mlp([dim + self.pairs.shape[1], hidden, 1], last_activation=False)

    def lookups(self, dense: torch.Tensor, ids: torch.Tensor) -> list[torch.Tensor]:
        """The ids each table (in `self.tables` order) looks up in `forward(dense, ids)`: what a
        parameter server has to send before the forward runs."""
        return [ids[:, t] for t in range(len(self.tables))]

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Logits [batch] from dense [batch, dense] and ids [batch, tables]."""
        bottom = self.bottom(dense)
        vectors = torch.stack([bottom] + [table(ids[:, t]) for t, table in enumerate(self.tables)], dim=1)
        dots = vectors @ vectors.transpose(1, 2)
        left, right = self.pairs.to(dots.device)
        # sum over the single output, not squeeze: a new tensor rather than a view (FSDP2 warns on views)
        return self.top(torch.cat([bottom, dots[:, left, right]], dim=1)).sum(dim=-1)


def sample_losses(logits: torch.Tensor, clicks: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits, clicks, reduction="none")


def per_sample_loss(model: nn.Module, batch) -> torch.Tensor:
    dense, ids, clicks = batch
    return sample_losses(model(dense, ids), clicks)
