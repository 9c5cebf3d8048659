"""FSDP2's gradient reduce-scatter, counted like every other gradient collective.

FSDP2 issues its collectives itself, so the reducer chain never sees them. Its
`FSDPModule.set_custom_reduce_scatter` lets a unit's reduce-scatter go through an object of
ours instead (the interface lives in a private torch module, which torch==2.13.0 pins); this one
makes the same call FSDP2's default does and adds the bytes handed to it, the unit's whole
gradient at the reduce dtype (fp32; fp16 or bf16 under --compression), to the step's count.
"""

import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

from gradmesh.comm.reducer import CommCounter


class CountedReduceScatter(DefaultReduceScatter):
    def __init__(self, counter: CommCounter):
        super().__init__()
        self.counter = counter

    def __call__(self, output_tensor, input_tensor, group: dist.ProcessGroup, op, async_op: bool = False):
        self.counter.add(input_tensor.numel() * input_tensor.element_size())
        return super().__call__(output_tensor, input_tensor, group, op, async_op)
