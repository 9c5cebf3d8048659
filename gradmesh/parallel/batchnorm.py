"""Batch normalisation synchronised over the data-parallel ranks, on the CPU (gloo) as on CUDA.

Why gradmesh has its own: `torch.nn.SyncBatchNorm` refuses CPU tensors (its forward raises
"SyncBatchNorm expected input tensor to be on GPU ..." in torch 2.13, and its statistics kernels,
`batch_norm_gather_stats_with_counts` and friends, exist for CUDA only), while gradmesh trains on
CPU workers over gloo as well as on GPUs.

Why it is needed: a BatchNorm layer normalises by its batch's statistics, so N ranks that each
normalise by their own share train a different model from one process that normalises by the
whole batch (contract 2, docs/contracts.md), and with DDP's per-forward buffer broadcast off
(`gradmesh.parallel.data`) each rank's running statistics would drift apart too. Synchronised,
every rank normalises by the per-channel mean and variance of the global micro-batch, the
backward uses the global per-channel sums it needs, and the running statistics are the same
numbers on every rank.

How: forward, one all-reduce of each rank's count, Σx and Σx² per channel; backward, one of
the per-channel Σdy and Σdy·x̂. The sums are taken in float64: the fp32 statistics that come
out are then the same numbers however the batch is split over ranks (a float64 sum of fp32
values rounds far below fp32's precision), where fp32 sums would differ in their last bits
with the split; and E[x²] − E[x]² in float64 keeps fp32's precision unless a channel's mean lies
some 10^4 standard deviations from zero. The count is each rank's
real count, so uneven shares weigh right; a micro-batch that only pads (weight 0: a rank with
no samples left still joins its peers' collectives, `gradmesh.engine.collective`) counts zero
and takes no part (`counting`). Two collectives per layer and micro-batch are its cost (40 a
step for ResNet-18's 20 layers; what that costs: docs/getting-started.md#resnet-shapes).

A model is converted by `convert_sync_batchnorm` (its BatchNorm layers become `SyncBatchNorm`
with the same parameters and buffers, so weights keep their names); the composition binds them
to the data-parallel group (`bind`). Unbound (one process, the planner's calibration) a layer
normalises by its own batch through the same code.
"""

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

from gradmesh.mesh import DP_AXIS, FSDP_AXIS
from gradmesh.topology import Topology


def _channel_dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _per_channel(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A [C] tensor shaped to broadcast over `like` ([N, C, ...])."""
    return t.view(1, -1, *([1] * (like.dim() - 2)))


def _sums(x: torch.Tensor, counted: bool) -> torch.Tensor:
    """[count, Σx (C), Σx² (C)] of this rank's batch per channel, in float64."""
    channels = x.shape[1]
    if not counted or x.numel() == 0:
        return torch.zeros(1 + 2 * channels, dtype=torch.float64, device=x.device)
    wide, dims = x.double(), _channel_dims(x)
    count = torch.tensor([float(x.numel() // channels)], dtype=torch.float64, device=x.device)
    return torch.cat([count, wide.sum(dim=dims), wide.square().sum(dim=dims)])


def _statistics(sums: torch.Tensor, group: dist.ProcessGroup | None) -> tuple[float, torch.Tensor, torch.Tensor]:
    """(global count, mean, biased variance), float64, from every rank's `_sums` added up."""
    if group is not None:
        dist.all_reduce(sums, group=group)
    channels = (sums.numel() - 1) // 2
    count = float(sums[0])
    mean = sums[1 : 1 + channels] / max(count, 1.0)
    return count, mean, (sums[1 + channels :] / max(count, 1.0) - mean.square()).clamp_(min=0)


class _SyncNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, factor, group, counted):
        count, mean, var = _statistics(_sums(x, counted), group)
        if count == 0:  # every rank pads (no samples anywhere): normalise by its own, update nothing
            count, mean, var = _statistics(_sums(x, True), None)
        elif running_mean is not None and running_var is not None:
            with torch.no_grad():
                running_mean.mul_(1 - factor).add_(mean.to(running_mean.dtype), alpha=factor)
                unbiased = var * (count / max(count - 1, 1.0))
                running_var.mul_(1 - factor).add_(unbiased.to(running_var.dtype), alpha=factor)
        invstd = (var + eps).rsqrt().to(x.dtype)
        xhat = (x - _per_channel(mean.to(x.dtype), x)) * _per_channel(invstd, x)
        ctx.save_for_backward(xhat, weight, invstd)
        ctx.group, ctx.count, ctx.counted = group, count, counted
        out = xhat if weight is None else xhat * _per_channel(weight, x)
        return out if bias is None else out + _per_channel(bias, x)

    @staticmethod
    def backward(ctx, dy):
        xhat, weight, invstd = ctx.saved_tensors
        dims = _channel_dims(dy)
        wide = dy.double()
        local = torch.stack([wide.sum(dim=dims), (wide * xhat.double()).sum(dim=dims)])
        if not ctx.counted:
            local.zero_()
        sums = local.clone()
        if ctx.group is not None:
            dist.all_reduce(sums, group=ctx.group)
        scale = invstd if weight is None else invstd * weight
        if ctx.counted:  # d mean and d var reach every counted sample; a padding one has no part in them
            mean_dy, mean_dy_xhat = (sums / ctx.count).to(dy.dtype)
            dy = dy - _per_channel(mean_dy, dy) - xhat * _per_channel(mean_dy_xhat, dy)
        dx = dy * _per_channel(scale, dy)
        local = local.to(dy.dtype)
        grad_weight = local[1] if weight is not None and ctx.needs_input_grad[1] else None
        grad_bias = local[0] if ctx.needs_input_grad[2] else None
        return dx, grad_weight, grad_bias, None, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over any input [N, C, ...] whose batch statistics in training are those of every
    rank of `group` together (`bind`); in eval mode, as BatchNorm, the running statistics."""

    group: dist.ProcessGroup | None = None
    counted: bool = True
    """Whether this rank's input of the coming forward counts in the statistics (`counting`)."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected an input of at least 2 dimensions [N, C, ...], got {input.dim()}")

    def _average_factor(self) -> float:
        """The running statistics' update weight, as torch's BatchNorm takes it."""
        if not self.track_running_stats or self.num_batches_tracked is None:
            return 0.0
        self.num_batches_tracked.add_(1)
        if self.momentum is None:  # a cumulative average
            return 1.0 / float(self.num_batches_tracked.item())
        return self.momentum

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training:
            return super().forward(input)
        factor = self._average_factor()
        keeps = self.track_running_stats
        return _SyncNorm.apply(
            input,
            self.weight,
            self.bias,
            self.running_mean if keeps else None,
            self.running_var if keeps else None,
            self.eps,
            factor,
            self.group,
            self.counted,
        )


def convert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """`module` with every BatchNorm layer (1d, 2d, 3d) replaced by a `SyncBatchNorm` holding the
    same parameters and buffers, as `torch.nn.SyncBatchNorm.convert_sync_batchnorm` does."""
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        options = (module.eps, module.momentum, module.affine, module.track_running_stats)
        synced = SyncBatchNorm(module.num_features, *options)
        if module.affine:
            synced.weight, synced.bias = module.weight, module.bias
        synced.running_mean, synced.running_var = module.running_mean, module.running_var
        synced.num_batches_tracked = module.num_batches_tracked
        synced.train(module.training)
        return synced
    for name, child in module.named_children():
        module.add_module(name, convert_sync_batchnorm(child))
    return module


def layers(model: nn.Module) -> list[SyncBatchNorm]:
    return [m for m in model.modules() if isinstance(m, SyncBatchNorm)]


def bind(model: nn.Module, topology: Topology) -> list[SyncBatchNorm]:
    """Synchronise `model`'s `SyncBatchNorm` layers over the data-parallel ranks (the axis whose
    ranks hold different samples); returns them."""
    found = layers(model)
    if found:
        group = topology.group(FSDP_AXIS if FSDP_AXIS in topology.mesh_shape else DP_AXIS)
        for layer in found:
            layer.group = group
    return found


@contextlib.contextmanager
def counting(found: list[SyncBatchNorm], counted: bool) -> Iterator[None]:
    """Around one micro-batch's forward: whether this rank's samples count in the statistics (not
    when they only pad, at weight 0)."""
    for layer in found:
        layer.counted = counted
    try:
        yield
    finally:
        for layer in found:
            layer.counted = True
