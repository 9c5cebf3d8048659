"""Gradient compression: reducers that put fewer bytes on the wire than fp32.

fp16 and bf16 cast each bucket to half width, average it by all-reduce in that width and cast
the mean back (torch's fp16 compression hook does the same arithmetic). torch's bf16 hook
refuses to register without CUDA and NCCL, but gloo all-reduces bf16 tensors, so this one works
on CPU too. The bucket is divided by the group size before the cast, so a sum over many ranks
does not overflow fp16's range.
"""

import torch
import torch.distributed as dist

from gradmesh.comm.reducer import Reducer
from gradmesh.config import compression as compressors
from gradmesh.config.compression import Compressor, parse_compression


def cast_dtype(compression: str) -> torch.dtype | None:
    """The dtype a plain cast (`Compressor.wire_dtype`) narrows gradients to; None for any other method."""
    row = compressors.COMPRESSORS.get(compression)
    return getattr(torch, row.wire_dtype) if row and row.wire_dtype else None


class CastAllReduce(Reducer):
    def __init__(self, compression: str):
        dtype = cast_dtype(compression)
        if dtype is None:
            raise ValueError(f"--compression {compression} is not a plain cast (its row has no wire_dtype)")
        self.dtype, self.name = dtype, f"all_reduce_{compression}"

    def wire_bytes(self, tensor: torch.Tensor, parts=None) -> int:
        return tensor.numel() * torch.finfo(self.dtype).bits // 8

    def reduce(self, tensor, group, parts=None):
        if tensor.numel() == 0:  # gloo crashed on zero-element all-reduces (pytorch#58467)
            future = torch.futures.Future()
            future.set_result(tensor)
            return future
        narrow = tensor.div(group.size()).to(self.dtype)
        work = dist.all_reduce(narrow, group=group, async_op=True)
        return work.get_future().then(lambda done: tensor.copy_(done.value()[0]))


class PushCodec:
    """Point-to-point gradient pushes (parameter servers) in the run's wire width: fp32, or half
    width under fp16 and bf16, widened back to fp32 by the receiver.

    fp16 spans 6e-5 to 65504 (subnormals, losing digits, down to 6e-8), far less than gradients
    do: sparse tables' row gradients of a 256-sample mean sit near 1e-6, where fp16 keeps one or
    two digits, and plain casts leave the tables further from fp32's than scaled pushes do
    (docs/benchmarks.md#fp16-pushes). So an fp16 push is multiplied by the power of two that
    brings its largest magnitude just under 2^14, and the exponent travels as its last value
    (small integers are exact in fp16); scaling by a power of two adds no rounding of its own.
    bf16 has fp32's range and goes as it is."""

    def __init__(self, compression: str):
        self.dtype = cast_dtype(compression) or torch.float32
        self.scaled = self.dtype == torch.float16

    def numel(self, values: int) -> int:
        """Elements on the wire for a push of `values` values."""
        return values + self.scaled

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        flat = values.reshape(-1)
        if not self.scaled:
            return flat.to(self.dtype)
        top = flat.abs().max() if flat.numel() else torch.zeros(())
        exponent = 14 - int(torch.frexp(top).exponent) if 0 < top < float("inf") else 0
        head = torch.tensor([float(exponent)], dtype=self.dtype, device=flat.device)
        return torch.cat([flat.mul(2.0**exponent).to(self.dtype), head])

    def buffer(self, into: torch.Tensor) -> torch.Tensor:
        """Where a push meant for `into` (fp32) is received: `into` itself when pushes travel in
        fp32, else a buffer of the wire's width for `decode`."""
        if self.dtype == into.dtype:
            return into
        return torch.empty(self.numel(into.numel()), dtype=self.dtype, device=into.device)

    def decode(self, payload: torch.Tensor, into: torch.Tensor) -> None:
        """Widen `payload` (from `buffer(into)`) into `into`; nothing to do if it was `into`."""
        if payload is into:
            return
        into.copy_(payload[: into.numel()].view_as(into))
        if self.scaled:
            into.mul_(2.0 ** -int(payload[-1]))


def cast_all_reduce(row: Compressor, parameters: dict) -> Reducer:
    return CastAllReduce(row.name)


def reducer_for(compression: str) -> Reducer | None:
    """The base reducer of `--compression` (None: the plain fp32 mean), as its compressor row builds it."""
    method, parameters = parse_compression(compression)
    return compressors.COMPRESSORS[method].build(parameters)
