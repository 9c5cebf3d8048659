"""Non-finite steps: before the optimizer, every rank learns whether any rank's loss or gradient
is NaN or infinite, so that all of them apply the step's update or none of them does.

Under ddp the verdict rides on the gradient all-reduce itself (`gradmesh.comm.hooks`: each
rank adds loss × 0 to its first bucket, so a non-finite loss anywhere makes every rank's reduced
gradients non-finite, and a non-finite gradient anywhere does so by the sum): every rank reads
the same answer from its own gradients, with no collective of its own. Elsewhere (sharded
gradients, model-parallel axes, compressors that need not keep a NaN), one small all-reduce per
step carries it. Either way, once something was found the ranks name it together: each fills
its own row of a [world, 3] tensor (loss non-finite, gradient non-finite, 1 + the index of its
first non-finite gradient among its parameters) and the sum gives every rank the same table;
then the lowest rank with a bad gradient broadcasts that gradient's name as UTF-8 bytes (never
pickled), so the one-line report names it on every rank.

Which rank to blame: a NaN loss is found on the rank that computed it; its gradient reaches every
replica through the average, so a gradient alone (a finite loss) names every rank that holds it.
"""

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

NAME_BYTES = 256


@dataclass
class Finding:
    """What was non-finite at one step, the same on every rank."""

    step: int
    loss_ranks: list[int] = field(default_factory=list)
    gradient_ranks: list[int] = field(default_factory=list)
    gradient: str = ""
    """The first non-finite gradient's parameter name (on the lowest such rank)."""
    push: str = ""
    """Parameter servers: the rejected push (sender and what it carried)."""

    @property
    def ranks(self) -> list[int]:
        return sorted(set(self.loss_ranks) | set(self.gradient_ranks))

    def what(self) -> str:
        parts = []
        if self.loss_ranks:
            parts.append(f"loss on rank(s) {_ranks(self.loss_ranks)}")
        if self.gradient_ranks:
            parts.append(f"gradient of {self.gradient!r} on rank(s) {_ranks(self.gradient_ranks)}")
        if self.push:
            parts.append(self.push)
        return " and ".join(parts) or "value"

    def alert(self, policy: str, action: str) -> dict:
        return {
            "step": self.step,
            "kind": "nonfinite",
            "rank": (self.ranks or [0])[0],
            "ranks": self.ranks,
            "loss_ranks": self.loss_ranks,
            "gradient_ranks": self.gradient_ranks,
            "gradient": self.gradient,
            "push": self.push,
            "policy": policy,
            "message": f"NaN or infinite {self.what()}; {action}",
        }


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))


def _local_flags(model: torch.nn.Module, loss_sum: torch.Tensor) -> tuple[bool, int, list[str]]:
    """(loss non-finite, 1 + index of the first non-finite gradient or 0, parameter names)."""
    names, grads = [], []
    for name, param in model.named_parameters():
        if param.grad is not None:
            grad = param.grad
            names.append(name)
            grads.append(grad.to_local() if hasattr(grad, "to_local") else grad)  # a DTensor's own shard
    bad = 0
    if grads:
        # One fused pass: a norm is non-finite exactly when its tensor holds a NaN or an infinity.
        norms = torch.stack([n.float() for n in torch._foreach_norm(grads)])
        where = (~torch.isfinite(norms)).nonzero()
        bad = int(where[0].item()) + 1 if len(where) else 0
    return not bool(torch.isfinite(loss_sum).all()), bad, names


def locally_finite(model: torch.nn.Module, loss_sum: torch.Tensor) -> bool:
    """This rank's loss and gradients hold no NaN or infinity (no collective)."""
    loss_bad, grad_bad, _ = _local_flags(model, loss_sum)
    return not loss_bad and not grad_bad


def check(
    model: torch.nn.Module, loss_sum: torch.Tensor, group, rank: int, world_size: int, step: int
) -> Finding | None:
    """Collective over `group` (every rank of the job): the step's non-finite values, or None."""
    loss_bad, grad_bad, names = _local_flags(model, loss_sum)
    device = loss_sum.device if loss_sum.device.type == "cuda" else torch.device("cpu")
    table = torch.zeros(world_size, 3, dtype=torch.float64, device=device)
    table[rank] = torch.tensor([float(loss_bad), float(grad_bad > 0), float(grad_bad)], dtype=torch.float64)
    if world_size > 1:
        dist.all_reduce(table, group=group)
    table = table.cpu()
    if not table[:, :2].any():
        return None
    loss_ranks = [r for r in range(world_size) if table[r, 0] > 0]
    gradient_ranks = [r for r in range(world_size) if table[r, 1] > 0]
    name = ""
    if gradient_ranks:
        source = gradient_ranks[0]
        mine = names[grad_bad - 1] if rank == source else ""
        name = _share_name(mine, source, group, world_size, device)
    return Finding(step, loss_ranks, gradient_ranks, _plain_name(name))


def _share_name(name: str, source: int, group, world_size: int, device) -> str:
    encoded = name.encode()[:NAME_BYTES]
    buffer = torch.zeros(NAME_BYTES, dtype=torch.uint8, device=device)
    buffer[: len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
    if world_size > 1:
        dist.broadcast(buffer, group=group, group_src=source)
    return bytes(buffer.cpu().tolist()).rstrip(b"\0").decode(errors="replace")


def _plain_name(name: str) -> str:
    """The name as in the plain model (wrappers add prefixes)."""
    for prefix in ("module.", "_orig_mod."):
        name = name.replace(prefix, "")
    return name


def finite_number(value: float) -> float | None:
    """A figure for JSON: None where it is not finite (JSON has no NaN)."""
    return value if math.isfinite(value) else None
