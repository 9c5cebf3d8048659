"""Optimizers: the config's choice as a torch optimizer (`optimizer_spec`), the state one keeps per
parameter (`probe_state`, asked of the optimizer itself), and row-wise Adagrad for embedding
tables beside torch's own optimizer for every other parameter. Kept apart from the training loop
so a launch's checks need not import it (and DCP with it).

Row-wise Adagrad.

Recommendation models train their tables with a row-wise optimizer: one accumulator per row
(FBGEMM's and TorchRec's default), so a table's optimizer state is a column, not a second table,
and a row no batch touched is left exactly as it was (its gradient is zero: it adds nothing to
the accumulator and moves nothing), which lets a parameter server update only the rows pushed
to it and still match single-process training. torch's Adagrad keeps one accumulator per element
and has no row-wise form, so the few lines of it are here.

`with_rowwise_tables(base)` is a subclass of torch's optimizer class `base` (AdamW, SGD): the
weights of `tables`, the embedding modules the model declares sparse (`model.sparse_tables()`,
read by `gradmesh.parallel.ps.sparse_tables`), are updated row-wise at `table_lr` (times the
run's learning-rate schedule) with no weight decay, the others by `base` as usual, in the same
param groups. The modules are given, not their weights, and each module's weight is read when
the optimizer is made: wrappers such as FSDP2 replace a module's parameter objects before then,
and a dense layer that happens to share a table's shape must not train row-wise.
"""

import torch
import torch.nn as nn

from gradmesh.config import TrainConfig

EPS = 1e-8
OptimizerSpec = tuple[type[torch.optim.Optimizer], dict]


def optimizer_spec(train: TrainConfig) -> OptimizerSpec:
    """(optimizer class, keyword arguments) from the config's adamw|sgd choice."""
    if train.optimizer == "sgd":
        return torch.optim.SGD, {"lr": train.lr, "momentum": train.momentum, "weight_decay": train.weight_decay}
    return torch.optim.AdamW, {"lr": train.lr, "weight_decay": train.weight_decay}


def probe_state(optimizer_class: type, kwargs: dict) -> tuple[list[str], dict[str, torch.Tensor]]:
    """The optimizer's state for one parameter, found by stepping it once on a probe: the names of
    its element-wise slots (Adam's two moments, SGD's momentum buffer, Adagrad's sum) and its
    scalars (Adam's step count). Asked of the optimizer itself, so any torch optimizer (amsgrad's
    third moment included) is counted right without a table of classes."""
    probe = nn.Parameter(torch.zeros(2))
    optimizer = optimizer_class([probe], **dict(kwargs, lr=0.0))
    probe.grad = torch.zeros(2)
    optimizer.step()  # torch optimizers make their state on the first step
    tensors = {k: v for k, v in optimizer.state[probe].items() if isinstance(v, torch.Tensor)}
    elementwise = [k for k, v in tensors.items() if v.shape == probe.shape]
    return elementwise, {k: v for k, v in tensors.items() if k not in elementwise}


def optimizer_slots(optimizer_class: type, kwargs: dict) -> int:
    """State tensors the size of its parameter the optimizer keeps per parameter (`probe_state`)."""
    return len(probe_state(optimizer_class, kwargs)[0])


def trained_bytes(weight_bytes: int, slots: int) -> int:
    """Bytes that weights of `weight_bytes` hold in training: themselves, their gradients and the
    optimizer's `slots` state tensors of the same size each (`optimizer_slots`)."""
    return weight_bytes * (2 + slots)


def rowwise_adagrad(param: torch.Tensor, grad: torch.Tensor, accumulator: torch.Tensor, lr: float) -> None:
    """accumulator[r] += mean_j grad[r, j]^2; param[r] -= lr grad[r] / (sqrt(accumulator[r]) + EPS)."""
    accumulator.add_(grad.pow(2).mean(dim=1))
    param.addcdiv_(grad, accumulator.sqrt().add_(EPS).unsqueeze(1), value=-lr)


def with_rowwise_tables(base: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    # A base class chosen at run time: mypy cannot type a class over a variable base.
    class RowwiseTables(base):  # type: ignore[valid-type,misc]
        def __init__(self, params, *, tables, table_lr: float, **kwargs):
            super().__init__(params, **kwargs)
            self.table_weights = [table.weight for table in tables]  # held: their ids stay theirs
            self.table_ids = {id(weight) for weight in self.table_weights}
            for group in self.param_groups:  # groups stay as given (ZeRO matches them one to one)
                group.setdefault("table_lr", table_lr)
                group.setdefault("first_lr", group["lr"])

        def _is_table(self, param: torch.Tensor) -> bool:
            return id(param) in self.table_ids

        @torch.no_grad()
        def step(self, closure=None):
            everything = []
            for group in self.param_groups:
                # the run's warm-up and decay apply to tables too
                schedule = group["lr"] / group["first_lr"] if group["first_lr"] else 0.0
                for param in group["params"]:
                    if param.grad is None or not self._is_table(param):
                        continue
                    state = self.state[param]
                    if "sum" not in state:
                        # one per row; from a column of the parameter, so a row-sharded DTensor gets a sharded one
                        state["sum"] = torch.zeros_like(param[:, 0], memory_format=torch.contiguous_format)
                        state["step"] = torch.tensor(0.0)  # torch's Adam expects one in every state it loads
                    rowwise_adagrad(param, param.grad, state["sum"], group["table_lr"] * schedule)
                    state["step"] += 1
                everything.append(group["params"])
                group["params"] = [p for p in group["params"] if not self._is_table(p)]
            try:
                return super().step(closure)
            finally:
                for group, params in zip(self.param_groups, everything):
                    group["params"] = params

    RowwiseTables.__name__ = RowwiseTables.__qualname__ = f"RowwiseTables{base.__name__}"
    return RowwiseTables
