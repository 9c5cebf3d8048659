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

COMPRESSIONS = {"fp16": torch.float16, "bf16": torch.bfloat16}


class CastAllReduce(Reducer):
    def __init__(self, compression: str):
        self.dtype, self.name = COMPRESSIONS[compression], f"all_reduce_{compression}"

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


def reducer_for(compression: str) -> Reducer | None:
    """The base reducer of `--compression` (None: the plain fp32 mean)."""
    from gradmesh.comm.auto import AutoCompression
    from gradmesh.comm.feedback import PowerSGD, TopK
    from gradmesh.config.compression import parse_compression

    method, options = parse_compression(compression)
    if method == "auto":
        return AutoCompression()
    if method in COMPRESSIONS:
        return CastAllReduce(method)
    if method == "powersgd":
        return PowerSGD(options["rank"], options["start"])
    return TopK(options["ratio"], options.get("start", 0)) if method == "topk" else None
