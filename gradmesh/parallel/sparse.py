"""What the parameter-server strategies ask of a model with sparse tables (`SparseModel`).

Models do not import gradmesh: they meet these protocols by shape alone (`gradmesh.models.dlrm.DLRM`
does; the check below lets mypy say so). A model declares its sparse tables with `sparse_tables()`
(`DeclaresSparseTables`, the one member that decides whether a model has any: `gradmesh.parallel.ps.
sparse_tables`); a model that does also says which ids each table looks up before its forward runs
(`lookups`, one tensor per table in the declared order) and makes any range of a table's initial
rows on its own (`init_rows`), so a server holding a shard never builds the whole table.
"""

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
import torch.nn as nn


@runtime_checkable
class DeclaresSparseTables(Protocol):
    def sparse_tables(self) -> list[nn.Embedding]:
        """The model's own embedding modules that train row-wise, in the order `lookups` gives their ids."""
        ...


class SparseModel(DeclaresSparseTables, Protocol):
    @property
    def lookups(self) -> Callable[..., list[torch.Tensor]]:
        """lookups(*forward inputs): the ids each sparse table looks up in that forward."""
        ...

    def init_rows(self, table: int, low: int, high: int) -> torch.Tensor:
        """Initial rows [low, high) of sparse table `table`, on the CPU."""
        ...


if TYPE_CHECKING:
    from gradmesh.models.dlrm import DLRM

    def _dlrm_is_sparse(model: DLRM) -> SparseModel:
        return model


__all__ = ["DeclaresSparseTables", "SparseModel"]
