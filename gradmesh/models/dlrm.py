"""A DLRM-style click model (Naumov et al. 2019): one embedding table per categorical feature, a
bottom MLP for the dense features, pairwise dot products of all of them, a top MLP to a logit.

It is a sparse model as the parameter-server strategies ask (`gradmesh.parallel.sparse.SparseModel`:
`sparse_tables`, `lookups`, `init_rows`), by shape alone: models import nothing of gradmesh."""

from collections.abc import Sequence
from typing import cast

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


CHUNK = 1 << 16
"""Rows per independently seeded block of a table's initial values."""


class DLRM(nn.Module):
    def __init__(self, rows: tuple[int, ...], dim: int, dense: int, hidden: int, materialize: bool = True):
        """`materialize` False: the tables stay on the meta device (no memory) until
        `materialize_tables`; whoever holds rows of them gets their initial values from `init_rows`."""
        super().__init__()
        self.table_seed = int(torch.randint(0, 2**62, (1,), device="cpu").item())
        # Given its weight, nn.Embedding skips its initialiser: the first one run on the meta
        # device imports torch._dynamo (slow: docs/benchmarks.md#launch), and these values come from
        # init_rows.
        # ModuleList is not generic in torch's stubs; typed as the sequence of tables it is read as.
        self.tables: Sequence[nn.Embedding] = nn.ModuleList(  # type: ignore[assignment]
            nn.Embedding(count, dim, _weight=torch.empty(count, dim, device="meta")) for count in rows
        )
        if materialize:
            self.materialize_tables()
        self.bottom = _mlp([dense, hidden, dim], last_activation=True)
        features = len(rows) + 1
        self.pairs = torch.triu_indices(features, features, offset=1, device="cpu")
        self.top = _mlp([dim + self.pairs.shape[1], hidden, 1], last_activation=False)

    def init_rows(self, table: int, low: int, high: int) -> torch.Tensor:
        """Initial rows [low, high) of a table, on the CPU: small vectors (std 0.05, as DLRM's
        uniform(±1/sqrt(rows)) keeps them), drawn per block of CHUNK rows from a generator seeded
        by the model's seed, the table and the block, so any range is made without the rest."""
        embedding = self.sparse_tables()[table]
        dim = embedding.embedding_dim
        parts = []
        for block in range(low // CHUNK, (high + CHUNK - 1) // CHUNK):
            start, end = block * CHUNK, min((block + 1) * CHUNK, embedding.num_embeddings)
            seed = (self.table_seed + 1_000_003 * table + block) % 2**63
            generator = torch.Generator(device="cpu").manual_seed(seed)
            values = torch.randn(end - start, dim, generator=generator, device="cpu") * 0.05
            parts.append(values[max(low - start, 0) : high - start])
        return torch.cat(parts) if parts else torch.zeros(0, dim)

    def materialize_tables(self) -> None:
        """Every table whole, with its initial values."""
        for t, table in enumerate(self.sparse_tables()):
            if table.weight.is_meta:
                table.weight = nn.Parameter(self.init_rows(t, 0, table.num_embeddings))

    def sparse_tables(self) -> list[nn.Embedding]:
        """The tables that train sparse: a batch touches a few of their rows, so they train
        row-wise (one optimizer accumulator per row) and a parameter server moves only the rows a
        batch looks up. Every other parameter is dense. In the order `lookups` gives their ids."""
        return [cast(nn.Embedding, table) for table in self.tables]

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
